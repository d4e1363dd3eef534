"""transformers' Qwen2-VL ``generate`` (an image in the prompt) with ``model.forward`` compiled.

What each decode step costs, steady (``examples/qwen2_vl_generate.py``: 4 and 8 new tokens on the
same request, the difference per token), with eager, stock Dynamo (``backend="eager"``) and nosync
(``codegen="eager"``), and the generated tokens and every step's logits bitwise equal to eager.

Measured (transformers 5.24.0, torch 2.13.0): one sync per decode step under all three, and it is
``generate``'s stop check (``bool(unfinished_sequences.max() == 0)``, ``generation/utils.py``),
outside the compiled forward and new at every step; the decode forward itself syncs nowhere, and
compiles to one graph under stock Dynamo already. The multimodal questions (token types, vision
grid) are asked once per request, before the decode loop. What nosync changes is the prefill
forward: 1 graph instead of 5 and 1 sync instead of 2 (the image-token count check is hoisted; its
guard re-reads it once per new prompt), and 3 compiles instead of 7.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("transformers")
import qwen2_vl_generate as qv  # noqa: E402  (examples/ is on sys.path: tests/conftest.py)

import torchsync_pass  # noqa: E402
from torchsync_pass import Action  # noqa: E402

pytestmark = [
    pytest.mark.real,
    pytest.mark.skipif(os.environ.get("TORCHSYNC_PASS_REAL") != "1",
                       reason="real-library test: run `make test-real` (or set TORCHSYNC_PASS_REAL=1)"),
]
STOP_CHECK = os.path.join("transformers", "generation", "utils.py")


def only_the_stop_check(res):
    """The sites that sync once more per decode step: generate's stop check alone, once."""
    return {(k.file.endswith(STOP_CHECK), n) for k, n in res["step_sites"].items()} == {(True, 1.0)}


def test_qwen2_vl_generate_decode_steps_under_nosync():
    qv.quiet()
    ref = qv.run("eager")
    stock = qv.run("stock")
    nos = qv.run("nosync")
    hoisted = [d for d in torchsync_pass.decisions() if d.action is Action.HOISTED]

    for a, b in zip(nos["outs"], ref["outs"], strict=True):
        assert qv.same_bits(a, b)  # tokens and logits of every step
    for res in (ref, stock, nos):
        assert res["syncs_per_step"] == 1 and only_the_stop_check(res), res["step_sites"]
        assert res["forward_syncs"][1:] == [0, 0, 0], res["forward_syncs"]  # decode forwards: no sync
    # the decode forward is one graph already under stock Dynamo; nosync keeps it so
    assert stock["graphs_per_step"] == nos["graphs_per_step"] == 1
    # the prefill forward: stock splits it at the image-token count check, nosync hoists the check
    assert (stock["prefill_graphs"], nos["prefill_graphs"]) == (5, 1)
    assert (stock["forward_syncs"][0], nos["forward_syncs"][0]) == (2, 1)
    assert (stock["compiles"], nos["compiles"]) == (7, 3)
    assert any(d.site.file.endswith("import_utils.py") and "_check_tensor_all" in d.source for d in hoisted)


@pytest.mark.parametrize("case", ["mistral-sliding-window", "llama-static-cache"])
def test_generate_where_transformers_masks_differently_under_compile(case):
    # README ("Guarantees and limits"): with one unpadded prompt, transformers builds another
    # attention mask under compile for a sliding window or a static cache, so stock Dynamo's logits
    # may differ from eager by an ULP; nosync (codegen="eager") must give stock's bits
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    kw = dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if case == "mistral-sliding-window":
        model_cls, config, gen = MistralForCausalLM, MistralConfig(**kw, sliding_window=4), {}
    else:
        model_cls, config, gen = LlamaForCausalLM, LlamaConfig(**kw), {"cache_implementation": "static"}
    torch.manual_seed(0)
    model = model_cls(config).eval()
    torch._dynamo.reset()
    torchsync_pass.reset()
    forward = model.forward
    x = torch.randint(3, 100, (1, 5), generator=torch.Generator().manual_seed(1))
    logits = {}
    for name, f in [("stock", torch.compile(forward, backend="eager")),
                    ("nosync", torch.compile(forward, backend="nosync", options={"codegen": "eager"}))]:
        model.forward = f
        try:
            with torch.no_grad():
                out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=5,
                                     do_sample=False, output_logits=True, return_dict_in_generate=True, **gen)
        finally:
            model.forward = forward
        logits[name] = out.logits
    assert len(logits["nosync"]) == len(logits["stock"]) == 5
    for a, b in zip(logits["nosync"], logits["stock"]):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_a_transformers_models_inputs_are_declared_by_the_config_defaults_wrappers_names():
    """transformers 5 wraps every model's ``forward`` in ``@merge_with_config_defaults`` (a
    ``functools.wraps`` wrapper that rebinds ``args``): its own names count. ``kwargs.attention_mask``
    declares the mask (the work computed from it is cached), and ``attention_mask`` is refused under
    strict with the wrapper's paths in the message."""
    import copy

    import torch
    from torch._dynamo.utils import counters
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=32, type_vocab_size=3)
    model = BertModel(cfg).eval()
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, 7:] = 0
    try:
        for invariant in (["kwargs.attention_mask"], ["attention_mask"]):
            torch._dynamo.reset()
            torchsync_pass.reset()
            counters.clear()
            step = torch.compile(copy.deepcopy(model), backend="nosync",
                                 options={"codegen": "eager", "invariant": invariant, "strict": True})
            with torch.no_grad():
                ids = torch.randint(0, 50, (2, 10))
                if invariant == ["attention_mask"]:
                    with pytest.raises(torchsync_pass.NosyncOptionsError, match="'kwargs.attention_mask'"):
                        step(input_ids=ids, attention_mask=mask)
                    continue
                for _ in range(3):
                    ids = torch.randint(0, 50, (2, 10))
                    out = step(input_ids=ids, attention_mask=mask)
                    ref = model(input_ids=ids, attention_mask=mask)
                    assert torch.equal(out.last_hidden_state, ref.last_hidden_state)
            leaves = {leaf for d in torchsync_pass.decisions() if d.kind == "tensor" for leaf in d.leaves}
            assert "kwargs.attention_mask" in leaves, leaves
            assert counters["nosync"]["invariant_hits"] >= 2
    finally:
        torch._dynamo.reset()
        torchsync_pass.reset()


def _vl_request(seed, grid, inference):
    """A prefill request of the example's Qwen2-VL with an image of ``grid`` (t, h, w patches),
    its tensors made under inference mode when ``inference``."""
    import torch

    with torch.inference_mode(inference):
        g = torch.Generator().manual_seed(seed)
        t, h, w = grid
        ids = torch.cat([torch.randint(3, 60, (3,), generator=g), torch.tensor([qv.VISION_START]),
                         torch.full((t * h * w // 4,), qv.IMAGE), torch.tensor([qv.VISION_END]),
                         torch.randint(3, 60, (4,), generator=g)])[None]
        return {"input_ids": ids, "mm_token_type_ids": (ids == qv.IMAGE).int(),
                "pixel_values": torch.randn(t * h * w, 24, generator=g), "image_grid_thw": torch.tensor([grid])}


def test_an_entry_with_a_demoted_site_fails_before_its_live_sites_read():
    """Requests alternating torch.no_grad() and inference mode (inputs made in it) with six image
    grids: Dynamo checks older cache entries of the vision frame, one of whose sites (the grid's
    height, ``grid_thw[1].item()``) is demoted. The entry's live site (the grid's ``t``) re-ran its
    cone, one read, before the demoted one failed the entry: 17 reads a call against stock's 16 on
    calls that compile nothing (review 20). Once every grid was seen in both modes, no call reads
    more than stock's but the one that demotes a site (README: once per demotion)."""
    import torch
    from torch._dynamo.utils import counters
    from transformers import DynamicCache

    qv.quiet()
    grids = [(1, 2, 4), (1, 4, 2), (1, 4, 4), (1, 2, 2), (1, 6, 2), (1, 2, 6)]
    plan = [(i % 3, grids[i % 6], i % 2 == 1) for i in range(12)]
    rows, outs = {}, {}
    try:
        for kind in ("eager", "stock", "nosync"):
            torch._dynamo.reset()
            torchsync_pass.reset()
            model = qv.build()
            step = model if kind == "eager" else torch.compile(
                model, backend="eager" if kind == "stock" else torchsync_pass.NosyncBackend({"codegen": "eager"}))
            rows[kind], outs[kind] = [], []
            for seed, grid, inference in plan:
                req = _vl_request(seed, grid, inference)
                model.model.rope_deltas = None
                frames, known = sum(counters["frames"].values()), len(torchsync_pass.decisions())
                with (torch.inference_mode() if inference else torch.no_grad()), torchsync_pass.count_syncs() as c:
                    outs[kind].append(step(**req, cache=DynamicCache(config=model.config), use_cache=True).logits)
                # a call that compiles, or demotes a site (one read more than stock, documented)
                special = sum(counters["frames"].values()) != frames or any(
                    d.action is Action.DEMOTED for d in torchsync_pass.decisions()[known:])
                rows[kind].append((c.total + c.compile_time, special))
    finally:
        torch._dynamo.reset()
        torchsync_pass.reset()
    for a, b in zip(outs["nosync"], outs["eager"], strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride() and torch.equal(a, b)
    steady = [i for i in range(6, len(plan)) if not rows["stock"][i][1] and not rows["nosync"][i][1]]
    assert len(steady) >= 4, rows
    assert [i for i in steady if rows["nosync"][i][0] > rows["stock"][i][0]] == [], (str(rows["stock"]), str(rows["nosync"]))


def test_a_whisper_decoders_encoder_output_is_declared_through_its_model_output():
    """``generate`` passes ``encoder_outputs`` as a ``BaseModelOutput`` (a dict subclass read as
    ``encoder_outputs[0]``): declaring ``kwargs.encoder_outputs.last_hidden_state`` cached nothing
    and warned nothing, even under strict (review 21, helper 156). Now the cross-attention keys and
    values over it are cached, bitwise equal to eager, recomputed for a new encoder output.
    The eval model's ``F.dropout(..., training=False)`` no longer stops the caching either."""
    import torch
    from transformers import WhisperConfig, WhisperForConditionalGeneration
    from transformers.modeling_outputs import BaseModelOutput

    torch.manual_seed(0)
    model = WhisperForConditionalGeneration(WhisperConfig(
        vocab_size=64, num_mel_bins=8, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, d_model=16, encoder_ffn_dim=32, decoder_ffn_dim=32, max_source_positions=16,
        max_target_positions=32, pad_token_id=1, bos_token_id=2, eos_token_id=3, decoder_start_token_id=2)).eval()
    attn = "self.model.decoder.layers.0.encoder_attn."
    declared = ["kwargs.encoder_outputs.last_hidden_state", attn + "k_proj.weight", attn + "v_proj.weight",
                attn + "v_proj.bias"]
    ids = torch.tensor([[2, 5, 7]])
    try:
        torch._dynamo.reset()
        torchsync_pass.reset()
        step = torch.compile(model, backend="nosync", options={"codegen": "eager", "strict": True, "invariant": declared})
        with torch.no_grad():
            for h in (torch.randn(1, 8, 16), torch.randn(1, 8, 16)):  # two requests
                for _ in range(2):
                    out = step(encoder_outputs=BaseModelOutput(last_hidden_state=h), decoder_input_ids=ids, use_cache=False)
                    ref = model(encoder_outputs=BaseModelOutput(last_hidden_state=h), decoder_input_ids=ids, use_cache=False)
                    assert torch.equal(out.logits, ref.logits)
        over_encoder = [d for d in torchsync_pass.decisions()
                        if d.action is Action.CACHED and any("encoder_outputs" in leaf for leaf in d.leaves)]
        assert len(over_encoder) >= 2, torchsync_pass.decisions()
    finally:
        torch._dynamo.reset()
        torchsync_pass.reset()

"""transformers' Qwen2-VL ``generate`` (greedy, an image in the prompt) with the forward compiled.

A tiny random-weight ``Qwen2VLForConditionalGeneration`` built from a config (no hub download: a
2-layer text model, a 1-block vision tower, vocabulary 64), one 4x4-patch image (its
``pixel_values``, ``image_grid_thw`` and ``mm_token_type_ids``), and ``model.generate`` with
``model.forward`` compiled: the way transformers itself serves the model. It measures what runs
per decode step, steady: ``generate`` is run for ``tokens`` and for ``2 * tokens`` new tokens on the
same request, and the difference, divided by ``tokens``, is what each further decode step costs
(syncs, compiled graphs run, and the sites that sync). Per forward call it also counts the syncs
inside the compiled forward (prefill, then each decode step).

    python examples/qwen2_vl_generate.py [--tokens 4] [--requests 2] [--loop generate|forward]

``--loop forward`` runs the same requests through a hand-written prefill + decode loop that calls
the compiled model itself, the vision tower inside the prefill (:func:`run_forward_loop`).

NOTE: in transformers 5.24 the multimodal questions (which token types are present:
``mm_token_type_ids.tolist()``; the vision grid: ``grid_thw[i].item()``, ``grid_thw.tolist()``) are
asked once per request, outside the decode step: ``generate`` runs the vision tower before its loop
and ``_prepare_position_ids_for_generation`` computes the 3D rope positions and caches
``model.model.rope_deltas``; a decode step's forward reads only that cached tensor.
"""

from __future__ import annotations

import argparse
import functools
import logging
import warnings
from typing import Any

import torch

import torchsync_pass
from diffusers_pipeline import Counting

IMAGE, VIDEO, VISION_START, VISION_END = 60, 61, 62, 63
GRID = (1, 4, 4)  # temporal, height, width patches: 16 patches, 4 image tokens after the 2x2 merge


def build(seed: int = 0) -> torch.nn.Module:
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    torch.manual_seed(seed)
    text = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    vision = dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2, patch_size=2, spatial_merge_size=2,
                  temporal_patch_size=2, in_channels=3)
    cfg = Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE, video_token_id=VIDEO,
                        vision_start_token_id=VISION_START, vision_end_token_id=VISION_END)
    return Qwen2VLForConditionalGeneration(cfg).eval()


def request(seed: int) -> dict[str, torch.Tensor]:
    """A prompt of 3 text tokens, the image (vision start, 4 image tokens, vision end), 4 text tokens."""
    g = torch.Generator().manual_seed(seed)
    t, h, w = GRID
    image = torch.full((t * h * w // 4,), IMAGE)
    ids = torch.cat([torch.randint(3, 60, (3,), generator=g), torch.tensor([VISION_START]), image,
                     torch.tensor([VISION_END]), torch.randint(3, 60, (4,), generator=g)])[None]
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": (ids == IMAGE).int(),
            "pixel_values": torch.randn(t * h * w, 3 * 2 * 2 * 2, generator=g), "image_grid_thw": torch.tensor([GRID])}


def generate(model: torch.nn.Module, req: dict, tokens: int) -> Any:
    with torch.no_grad():
        return model.generate(**req, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                              output_logits=True, return_dict_in_generate=True)


def run(kind: str, tokens: int = 4, requests: int = 2) -> dict[str, Any]:
    """``kind``: "eager", "stock" (Dynamo, ``backend="eager"``) or "nosync" (``codegen="eager"``)."""
    torch._dynamo.reset()
    torchsync_pass.reset()
    model = build()
    counter = None
    if kind != "eager":
        counter = Counting(torchsync_pass.NosyncBackend({"codegen": "eager"}) if kind == "nosync" else "eager")
        model.forward = torch.compile(model.forward, backend=counter)
    runs = lambda: counter.runs if counter else 0  # noqa: E731
    outs, per_call = [], []
    compiled = model.forward

    @functools.wraps(compiled)
    def forward(*args: Any, **kwargs: Any) -> Any:  # the syncs inside each forward call
        with torchsync_pass.count_syncs() as c:
            out = compiled(*args, **kwargs)
        per_call.append(c.total)
        return out

    model.forward = forward
    for r in range(requests):
        per_call.clear()
        outs.append(generate(model, request(r), tokens))
    forward_syncs = list(per_call)  # of the last request: prefill, then each decode step
    model.forward = compiled
    spans = []
    for n in (tokens, 2 * tokens):  # the last request again: what `tokens` more decode steps cost
        before = runs()
        with torchsync_pass.count_syncs() as c:
            generate(model, request(requests - 1), n)
        spans.append((c.total, runs() - before, c.by_site))
    (s1, g1, sites1), (s2, g2, sites2) = spans
    step_sites = {k: (n - sites1.get(k, 0)) / tokens for k, n in sites2.items() if n != sites1.get(k, 0)}
    return {"outs": outs, "forward_syncs": forward_syncs, "syncs_per_step": (s2 - s1) / tokens,
            "graphs_per_step": (g2 - g1) / tokens, "step_sites": step_sites, "prefill_graphs": g1 - (g2 - g1) * (tokens - 1) / tokens,
            "compiles": counter.compiled if counter else 0}


def run_forward_loop(kind: str, tokens: int = 4, requests: int = 2) -> dict[str, Any]:
    """The same requests through a hand-written loop that calls the compiled model itself: a prefill
    with ``pixel_values`` (the vision tower and the 3D rope positions inside the compiled forward),
    then greedy decode steps with the cache and no ``position_ids`` (the model derives them from its
    cached ``rope_deltas``). Per call of the last request: (syncs, compiled graphs run)."""
    from transformers import DynamicCache

    torch._dynamo.reset()
    torchsync_pass.reset()
    model = build()
    step, counter = model, None
    if kind != "eager":
        counter = Counting(torchsync_pass.NosyncBackend({"codegen": "eager"}) if kind == "nosync" else "eager")
        step = torch.compile(model, backend=counter)
    tokens_out, per_call = [], []
    for r in range(requests):
        req, cache, per_call = request(r), DynamicCache(config=model.config), []
        model.model.rope_deltas = None  # a new request
        kwargs: dict[str, Any] = dict(req, cache=cache, use_cache=True)
        out_ids = []
        with torch.no_grad():
            for _ in range(tokens):
                before = counter.runs if counter else 0
                with torchsync_pass.count_syncs() as c:
                    logits = step(**kwargs).logits
                per_call.append((c.total, (counter.runs - before) if counter else 0))
                out_ids.append(logits[:, -1].argmax(-1, keepdim=True))
                kwargs = dict(input_ids=out_ids[-1], cache=cache, use_cache=True)
        tokens_out.append(torch.cat(out_ids, 1))
    return {"tokens": tokens_out, "per_call": per_call, "compiles": counter.compiled if counter else 0}


def same_bits(a: Any, b: Any) -> bool:
    """The generated tokens and every step's logits: torch.equal with equal dtype, shape, stride."""
    pairs = [(a.sequences, b.sequences), *zip(a.logits, b.logits)]
    return len(a.logits) == len(b.logits) and all(
        x.dtype == y.dtype and x.shape == y.shape and x.stride() == y.stride() and torch.equal(x, y) for x, y in pairs)


def quiet() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", module="transformers")
    logging.getLogger("torch._dynamo").setLevel(logging.ERROR)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4)
    p.add_argument("--requests", type=int, default=2)
    p.add_argument("--loop", choices=("generate", "forward"), default="generate",
                   help="model.generate, or a hand-written prefill + decode loop calling the model")
    args = p.parse_args(argv)
    quiet()
    if args.loop == "forward":
        ref = run_forward_loop("eager", args.tokens, args.requests)
        for kind in ("eager", "stock", "nosync"):
            res = ref if kind == "eager" else run_forward_loop(kind, args.tokens, args.requests)
            same = all(torch.equal(a, b) for a, b in zip(res["tokens"], ref["tokens"]))
            print(f"{kind:6}  (syncs, graphs) per call of the last request {res['per_call']}  "
                  f"compiles {res['compiles']}  tokens equal to eager: {same}")
        return 0
    ref = run("eager", args.tokens, args.requests)
    for kind in ("eager", "stock", "nosync"):
        res = ref if kind == "eager" else run(kind, args.tokens, args.requests)
        bitwise = all(same_bits(a, b) for a, b in zip(res["outs"], ref["outs"]))
        sites = {f"{k.file.rsplit('site-packages/', 1)[-1]}:{k.line}": n for k, n in res["step_sites"].items()}
        print(f"{kind:6}  syncs/decode step {res['syncs_per_step']:g} {sites}  graphs/decode step "
              f"{res['graphs_per_step']:g}  prefill graphs {res['prefill_graphs']:g}  compiles {res['compiles']}  "
              f"syncs per forward call {res['forward_syncs']}  bitwise with eager: {bitwise}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

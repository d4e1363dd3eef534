"""The bundled examples: each runs, the hand-hoisted references equal the originals, and the nosync
backend (eager codegen) reproduces eager bit for bit while removing the request-invariant syncs.

The nosync checks run only with the real backend (not the Inductor placeholder it replaced)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch._dynamo.utils import counters

import decode_loop
import diffusion_loop
import prefill_tokens
import torchsync_pass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def nosync_eager(model):
    return torch.compile(model, backend="nosync", options={"codegen": "eager"})


def assert_bitwise(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    """torch.equal plus dtype, shape and stride: what 'bitwise identical' means here."""
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} != {b.dtype}"
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    assert a.stride() == b.stride(), f"{what}: stride {a.stride()} != {b.stride()}"
    assert torch.equal(a, b), f"{what}: values differ (max abs {(a.double() - b.double()).abs().max()})"


class Recorder:
    """Wraps a step and keeps every output, so loops can be compared step by step."""

    def __init__(self, step):
        self.step, self.outputs = step, []

    def __call__(self, *args):
        out = self.step(*args)
        self.outputs.append(out[0] if isinstance(out, tuple) else out)
        return out


def syncs_during(fn) -> int:
    from torchsync_pass import count_syncs

    with count_syncs(stacks=False) as c:
        fn()
    return c.total


def graphs_and_breaks() -> tuple[int, int]:
    return int(counters["stats"]["unique_graphs"]), int(sum(counters["graph_break"].values()))


# --------------------------------------------------------------------------------------------
# each example runs as documented


@pytest.mark.parametrize(
    "module, argv, expect",
    [
        (diffusion_loop, ["--backend", "eager", "--steps", "3", "--requests", "1"], "request 0: 3 steps"),
        (diffusion_loop, ["--size", "large", "--backend", "eager", "--steps", "1", "--requests", "1"], "request 0: 1 steps"),
        (decode_loop, ["--backend", "eager", "--max-new", "5", "--requests", "2"], "request 1:"),
        (prefill_tokens, ["--backend", "eager", "--steps", "2", "--requests", "1"], "request 0: 16 positions"),
    ],
)
def test_example_main_runs(module, argv, expect, capsys):
    module.main(argv)
    assert expect in capsys.readouterr().out


def test_example_runs_as_a_script():
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "decode_loop.py"), "--backend", "eager", "--max-new", "3",
         "--requests", "1"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("request 0: ")


# --------------------------------------------------------------------------------------------
# eager semantics of the examples themselves


@pytest.mark.parametrize("make", ["make_hoisted_model", "make_split_model"])
@pytest.mark.parametrize("size", ["tiny", "large"])
def test_diffusion_hoisted_reference_is_bitwise_equal(size, make):
    model, hoisted = diffusion_loop.make_model(size), getattr(diffusion_loop, make)(size)
    with torch.no_grad():
        request = diffusion_loop.make_request(size)
        want = diffusion_loop.denoise(model, request, 3)
        got = diffusion_loop.denoise_hoisted(hoisted, hoisted, request, 3)
    assert_bitwise(got, want, f"diffusion {size}")


@pytest.mark.parametrize("temperature", [0.8, 0.0])
def test_decode_hoisted_reference_is_bitwise_equal(temperature):
    model, hoisted = decode_loop.make_model(), decode_loop.make_hoisted_model()
    with torch.no_grad():
        request = decode_loop.make_request(seed=3, temperature=temperature, stop_ids=[])
        want = decode_loop.generate(model, request, 12)
        got = decode_loop.generate_hoisted(hoisted, hoisted, request, 12)
    assert_bitwise(got, want, "decode")
    assert want.numel() == 12


def test_decode_is_reproducible_and_settings_matter():
    model = decode_loop.make_model()
    with torch.no_grad():
        a = decode_loop.generate(model, decode_loop.make_request(seed=1, stop_ids=[]), 16)
        b = decode_loop.generate(model, decode_loop.make_request(seed=1, stop_ids=[]), 16)
        greedy = decode_loop.generate(model, decode_loop.make_request(seed=1, temperature=0.0, stop_ids=[]), 16)
    assert_bitwise(a, b, "same request twice")
    assert not torch.equal(a, greedy), "temperature had no effect"


def stop_request(model, seed: int = 0, max_new: int = 24):
    """A request whose stop token is the one eager generates at step max_new // 2 (so it stops)."""
    with torch.no_grad():
        free = decode_loop.generate(model, decode_loop.make_request(seed=seed, stop_ids=[]), max_new)
    stop_token = int(free[max_new // 2])
    return decode_loop.make_request(seed=seed, stop_ids=[stop_token]), max_new


def test_decode_stop_check_stops_early_in_eager():
    model = decode_loop.make_model()
    request, max_new = stop_request(model)
    with torch.no_grad():
        out = decode_loop.generate(model, request, max_new)
    assert out.numel() <= max_new // 2 + 1 < max_new
    assert int(out[-1]) in request["stop_ids"].tolist()


@pytest.mark.parametrize("size", ["tiny", "long", "long-tensor", "tiny-pad"])
def test_prefill_vectorized_step_equals_the_original(size):
    model, vec = prefill_tokens.make_model(size), prefill_tokens.make_vectorized_model(size)
    request = prefill_tokens.make_request(size, seed=3)
    with torch.no_grad():
        assert_bitwise(prefill_tokens.prefill(vec, request, 2), prefill_tokens.prefill(model, request, 2))


def test_prefill_reads_every_token_back():
    model = prefill_tokens.make_model()
    request = prefill_tokens.make_request()
    chunk = request["chunk"]
    with torch.no_grad():
        n = syncs_during(lambda: prefill_tokens.prefill(model, request, 3))
    assert n == 3 * chunk


# --------------------------------------------------------------------------------------------
# nosync (codegen="eager") on the examples


def test_diffusion_nosync_eager_bitwise_every_step_one_graph_no_syncs():
    model = diffusion_loop.make_model()
    eager_steps, compiled_steps = Recorder(model), Recorder(nosync_eager(diffusion_loop.make_model()))
    with torch.no_grad():
        for seed in range(2):  # two requests: the second one reuses the compiled graph
            request = diffusion_loop.make_request(seed=seed)
            want = diffusion_loop.denoise(eager_steps, request, 6)
            got = diffusion_loop.denoise(compiled_steps, diffusion_loop.make_request(seed=seed), 6)
            assert_bitwise(got, want, f"request {seed}")
        for i, (a, b) in enumerate(zip(compiled_steps.outputs, eager_steps.outputs)):
            assert_bitwise(a, b, f"step {i}")
        assert graphs_and_breaks() == (1, 0)
        request = diffusion_loop.make_request(seed=0)
        diffusion_loop.denoise(compiled_steps, request, 2)
        assert syncs_during(lambda: diffusion_loop.denoise(compiled_steps, request, 4)) == 0


@pytest.mark.parametrize("temperature", [0.8, 0.0])
def test_decode_nosync_eager_bitwise_and_only_the_stop_check_syncs(temperature):
    model = decode_loop.make_model()
    compiled = Recorder(nosync_eager(decode_loop.make_model()))
    eager = Recorder(model)
    steps = 10
    with torch.no_grad():
        request = decode_loop.make_request(seed=2, temperature=temperature, stop_ids=[])
        want = decode_loop.generate(eager, request, steps)
        got = decode_loop.generate(compiled, request, steps)
        assert_bitwise(got, want, "tokens")
        for i, (a, b) in enumerate(zip(compiled.outputs, eager.outputs)):
            assert_bitwise(a, b, f"step {i}")
        n = syncs_during(lambda: decode_loop.generate(compiled, request, steps))
    assert n == steps, f"expected only the step-varying stop check to sync (one per step), got {n}"


def test_decode_nosync_stop_check_still_stops_at_the_same_step():
    model = decode_loop.make_model()
    compiled = nosync_eager(decode_loop.make_model())
    request, max_new = stop_request(model, seed=4)
    with torch.no_grad():
        # warm the compiled step on a request that never stops, then run the one that does
        decode_loop.generate(compiled, decode_loop.make_request(seed=4, stop_ids=[]), max_new)
        want = decode_loop.generate(model, request, max_new)
        got = decode_loop.generate(compiled, request, max_new)
    assert want.numel() < max_new
    assert_bitwise(got, want, "tokens up to the stop")


def test_decode_nosync_does_not_guard_the_step_varying_stop_check():
    compiled = nosync_eager(decode_loop.make_model())
    steps = 12
    with torch.no_grad():
        decode_loop.generate(compiled, decode_loop.make_request(seed=6, stop_ids=[]), steps)
        before = counters["nosync"]["guard_syncs"]
        decode_loop.generate(compiled, decode_loop.make_request(seed=6, stop_ids=[]), steps)
        per_request = counters["nosync"]["guard_syncs"] - before
    # a new request re-reads each of the four request-invariant cones once; the stop check,
    # whose leaves change at every step, must not be re-evaluated by a guard at every step
    assert per_request <= 4, f"{per_request} guard syncs in one {steps}-step request"


def test_prefill_nosync_rewrites_every_read():
    # step-varying reads used only as a list index: traced as device gathers, 8 -> 0 syncs per step
    model = prefill_tokens.make_model()
    compiled = nosync_eager(prefill_tokens.make_model())
    with torch.no_grad():
        for seed in (5, 6):  # two requests, every step compared
            request = prefill_tokens.make_request(seed=seed)
            tokens, chunk = request["tokens"], request["chunk"]
            s_eager = s_nosync = request["state"]
            for i in range(4):
                t = tokens[i * chunk : (i + 1) * chunk]
                n_eager = syncs_during(lambda: model(t, s_eager))
                n_nosync = syncs_during(lambda: compiled(t, s_nosync))
                (h1, s_eager), (h2, s_nosync) = model(t, s_eager), compiled(t, s_nosync)
                assert_bitwise(h2, h1, f"request {seed} step {i}")
                assert_bitwise(s_nosync, s_eager, f"request {seed} step {i} state")
                assert (n_eager, n_nosync) == (chunk, 0)
    assert graphs_and_breaks() == (1, 0)
    (d,) = [d for d in torchsync_pass.decisions() if d.action is torchsync_pass.Action.REWRITTEN]
    assert d.reason is torchsync_pass.Reason.INDEX_LIST and "self.table, 64 entries" in d.detail


def test_prefill_with_pad_positions_selects_on_the_device():
    # the per-position branch (pad row, or a list row read at t.item()): once nosync has seen the
    # test change (speculated, then demoted), both arms are traced and torch.where selects
    size = "tiny-pad"
    model = prefill_tokens.make_model(size)
    compiled = nosync_eager(prefill_tokens.make_model(size))
    with torch.no_grad():
        request = prefill_tokens.make_request(size, seed=5)
        tokens, chunk = request["tokens"], request["chunk"]
        assert 0 < int((tokens == prefill_tokens.PAD).sum()) < tokens.numel()
        s_eager = s_nosync = request["state"]
        counts = []
        for i in range(8):
            t = tokens[i * chunk : (i + 1) * chunk]
            n_eager = syncs_during(lambda: model(t, s_eager))
            counts.append(syncs_during(lambda: compiled(t, s_nosync)))
            (h1, s_eager), (h2, s_nosync) = model(t, s_eager), compiled(t, s_nosync)
            assert_bitwise(h2, h1, f"step {i}")
            assert_bitwise(s_nosync, s_eager, f"step {i} state")
            assert n_eager == chunk + int((t != prefill_tokens.PAD).sum())
    assert counts[-3:] == [0, 0, 0], counts
    reasons = {d.reason for d in torchsync_pass.decisions() if d.action is torchsync_pass.Action.REWRITTEN}
    assert reasons == {torchsync_pass.Reason.INDEX_LIST, torchsync_pass.Reason.BRANCH_WHERE}


# --------------------------------------------------------------------------------------------
# CUDA (skipped without a device; run by benchmarks/gpu_check.sh)


@pytest.mark.cuda
def test_examples_nosync_eager_bitwise_on_cuda():
    dev = torch.device("cuda")

    def on_device(request):  # requests are drawn on the CPU (CPU generators), then moved
        return {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in request.items()}

    req = on_device(diffusion_loop.make_request())
    dreq = on_device(decode_loop.make_request(stop_ids=[]))
    with torch.no_grad(), dev:  # the loops' own factory calls land on the GPU too
        model = diffusion_loop.make_model().to(dev)
        compiled = nosync_eager(diffusion_loop.make_model().to(dev))
        assert_bitwise(diffusion_loop.denoise(compiled, req, 4), diffusion_loop.denoise(model, req, 4), "diffusion")
        dmodel = decode_loop.make_model().to(dev)
        dcompiled = nosync_eager(decode_loop.make_model().to(dev))
        assert_bitwise(decode_loop.generate(dcompiled, dreq, 8), decode_loop.generate(dmodel, dreq, 8), "decode")

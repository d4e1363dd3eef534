"""Review 18 (2026-12-07): each test failing on the commit before its fix."""

from __future__ import annotations


import pytest
import torch

import torchsync_pass

from test_core import assert_bitwise

EAGER = {"codegen": "eager"}

SCALE = {"v": 1.0}


@torch.compiler.allow_in_graph
def scaled_by_table(t):
    return t * SCALE["v"]


def _scaled_step(x, buf):
    v = scaled_by_table(buf).sum().item()
    return x * v + scaled_by_table(buf).exp()


@pytest.mark.parametrize("cache_bytes", [0, 1 << 20])
def test_function_kept_whole_reading_python_state_is_not_hoisted(cache_bytes):
    # a function of the user's kept whole (allow_in_graph) reads a dict entry that changes between
    # requests; the leaf never changes, so the hoisted sum (and the cached exp) were served from
    # the first request
    torch._dynamo.reset()
    torchsync_pass.reset()
    f = torch.compile(_scaled_step, backend="nosync",
                      options={**EAGER, "invariant_cache_bytes": cache_bytes})
    buf = torch.tensor([1.0, 2.0, 3.0])
    try:
        for scale in (1.0, 2.0, 1.0):
            SCALE["v"] = scale
            for _ in range(2):
                x = torch.ones(3)
                assert_bitwise(f(x, buf), _scaled_step(x, buf))
    finally:
        SCALE["v"] = 1.0
    reasons = {(d.action.value, d.reason.name) for d in torchsync_pass.decisions()}
    assert ("rejected", "IMPURE_OP") in reasons, reasons
    assert not any(d.action.value in ("hoisted", "cached") for d in torchsync_pass.decisions())


@torch.compiler.nested_compile_region
def doubled_in_region(t):
    return t * 2.0


def test_cone_through_a_higher_order_op_names_it():
    # the cone's get_attr of the subgraph was reported as "a tensor created inside the step"
    # (CONSTANT_LEAF); it is the higher-order op that stops hoisting
    def step(x, buf):
        return x * doubled_in_region(buf).sum().item()

    torch._dynamo.reset()
    torchsync_pass.reset()
    f = torch.compile(step, backend="nosync", options=EAGER)
    buf = torch.tensor([1.0, 2.0, 3.0])
    for _ in range(2):
        assert_bitwise(f(torch.ones(3), buf), step(torch.ones(3), buf))
    ds = [d for d in torchsync_pass.decisions() if d.action.value == "rejected"]
    assert ds and all(d.reason.name == "SUBGRAPH" for d in ds), [(d.reason.name, d.detail) for d in ds]
    assert "invoke_subgraph" in ds[0].detail or "higher-order op" in ds[0].detail, ds[0].detail


@pytest.mark.skipif(not hasattr(torch, "uint64"), reason="no uint64 dtype")
@pytest.mark.parametrize("conv", [int, bool], ids=["int", "bool"])
def test_lifted_uint64_entry_past_int64_raises_as_eager(conv):
    # table lifting converted the mirror's .tolist() value with Python's int()/bool(): a uint64
    # entry >= 2**63 gave 9223372036854775808 (or True) where eager's Tensor.__int__ raises
    class Sched:
        def __init__(self):
            self.tab, self.i = torch.tensor([1, 2, 2 ** 63, 3], dtype=torch.uint64), 0

        def step(self, x):
            v = conv(self.tab[self.i])
            self.i += 1
            return x + 1, v

    def run(step_of):
        s = Sched()
        step, out = step_of(s), []
        for k in range(4):
            try:
                out.append(step(torch.zeros(1))[1])
            except RuntimeError as e:
                out.append(("raised", "overflow" in str(e)))
                s.i = k + 1
        return out

    torch._dynamo.reset()
    torchsync_pass.reset()
    want = run(lambda s: s.step)
    got = run(lambda s: torch.compile(s.step, backend="nosync", options=EAGER))
    assert want[2] == ("raised", True), want
    assert got == want, (got, want)

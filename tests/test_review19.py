"""Review 19 (2026-12-07): each test failing on the commit before its fix."""

from __future__ import annotations

import types

import pytest
import torch

import torchsync_pass

EAGER = {"codegen": "eager"}


def _gated(x, mask):
    if mask.any():  # request-invariant: hoisted
        return x * 2
    return x - 1


def _copy(fn: types.FunctionType) -> types.FunctionType:
    """``fn`` with a code object of its own, equal to the original (``code.replace()``)."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__)


def test_equal_code_copies_each_have_their_own_recompile_budget():
    """benchmarks/ab.py and step_overhead.py compile each variant from a ``code.replace()`` copy of
    the step: equal code objects, each a frame of its own to Dynamo. The budget counted them as one
    frame (a dict keyed by the code's equality): from the fifth copy's compile on (half of
    recompile_limit 8) every site was demoted (here the branch became a device-side where running
    both sides; in step_overhead.py's diffusion step the syncs stayed: 2x the hoisted step)."""
    torch._dynamo.reset()
    torchsync_pass.reset()
    x, mask = torch.ones(3), torch.tensor([False, True])
    try:
        for k in range(7):
            fn = _copy(_gated)
            assert fn.__code__ == _gated.__code__ and fn.__code__ is not _gated.__code__
            step = torch.compile(fn, backend="nosync", options=EAGER)
            step(x, mask)
            with torchsync_pass.count_syncs() as c:
                out = step(x, mask)
            assert torch.equal(out, _gated(x, mask))
            assert c.total == 0, f"copy {k}: {c.total} syncs"
        assert not any(d.reason.name == "RECOMPILE_BUDGET" for d in torchsync_pass.decisions())
        assert {d.action.name for d in torchsync_pass.decisions()} == {"HOISTED"}
    finally:
        torch._dynamo.reset()
        torchsync_pass.reset()


def test_checks_of_a_code_copy_are_its_own():
    """serving's per-code check lists were keyed by the code's equality: a copy's checks were
    listed for the original (and the reverse)."""
    from torchsync_pass import guards

    torch._dynamo.reset()
    torchsync_pass.reset()
    x, mask = torch.ones(3), torch.tensor([True])
    try:
        a, b = _copy(_gated), _copy(_gated)
        torch.compile(a, backend="nosync", options=EAGER)(x, mask)
        assert len(guards.checks_for(a.__code__)) == 1
        assert guards.checks_for(b.__code__) == []
        torch.compile(b, backend="nosync", options=EAGER)(x, mask)
        ca, cb = guards.checks_for(a.__code__), guards.checks_for(b.__code__)
        assert len(ca) == len(cb) == 1 and ca[0] is not cb[0]
    finally:
        torch._dynamo.reset()
        torchsync_pass.reset()


_E8M0 = getattr(torch, "float8_e8m0fnu", None)


def _e8m0_branch(a, b, s):
    t = (s + 0 * torch.rand(())).to(_E8M0)  # a random op in the test's cone: not hoisted, selected
    y = a if t else b
    return y * 1


@pytest.mark.skipif(_E8M0 is None, reason="no float8_e8m0fnu in this torch")
def test_branch_on_an_e8m0_test_is_not_a_select():
    """float8_e8m0fnu has no zero: bool(t) is True for its smallest value 2**-127, but the select's
    nonzero test torch.ne(t, 0) compares with 0 converted to 2**-127: the other arm (helper 141)."""
    torch._dynamo.reset()
    torchsync_pass.reset()
    a, b = torch.ones(3), torch.full((3,), 2.0)
    f = torch.compile(_e8m0_branch, backend="nosync", options=EAGER)
    try:
        for v in (2.0 ** -127, 1.0, 2.0 ** -127):
            s = torch.tensor(v)
            torch.manual_seed(0)
            want = _e8m0_branch(a, b, s)
            torch.manual_seed(0)
            assert torch.equal(f(a, b, s), want), v
        assert not any(d.action.name == "REWRITTEN" for d in torchsync_pass.decisions())
    finally:
        torch._dynamo.reset()
        torchsync_pass.reset()

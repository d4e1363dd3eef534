"""Review 23 (2026-12-07): each test failing on the commit before its fix."""

from __future__ import annotations

import warnings
from typing import NamedTuple

import pytest
import torch

import torchsync_pass
from test_review21 import _clean  # noqa: F401 - the fixture: Dynamo, nosync and counters reset


class _Req(NamedTuple):
    ids: torch.Tensor
    mask: torch.Tensor


def _nt_step(x, req):
    return x * req[1].sum().item()


@pytest.mark.parametrize("declared", ["req.1", "req.mask"])
def test_a_named_tuple_field_is_declared_by_its_position_as_by_its_name(_clean, declared):
    """Dynamo names the leaf ``req.mask`` where the step reads ``req[1]``; ``req.1`` (a tuple's
    item by position, as for a plain tuple or a dict) resolved, so nothing warned, yet declared
    nothing: inference tensors stayed rejected and every warm call read (5 of 5), silently even
    under strict (helper 175)."""
    x = torch.ones(3)
    with torch.inference_mode():  # no version counter: hoisted only when declared
        a = _Req(torch.zeros(2), torch.ones(4))
        b = _Req(torch.zeros(2), torch.full((4,), 2.0))
    f = torch.compile(_nt_step, backend="nosync",
                      options={"codegen": "eager", "invariant": [declared], "strict": True})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(f(x, a), _nt_step(x, a))
        with torchsync_pass.count_syncs() as c:
            got = [f(x, a) for _ in range(5)]
    assert c.total == 0
    assert all(torch.equal(g, _nt_step(x, a)) for g in got)
    (d,) = torchsync_pass.decisions()
    assert d.action.value == "hoisted" and d.leaves == ("req.mask",)
    # another request (another tuple): its own value, never the first one's
    want_b = _nt_step(x, b)
    assert torch.equal(f(x, b), want_b) and torch.equal(f(x, b), want_b)
    assert torch.equal(f(x, a), _nt_step(x, a))

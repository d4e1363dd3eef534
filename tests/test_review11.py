"""Hostile review 11 (2026-12-03): defects found by the review helpers, each test failing on the
commit before its fix."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import torchsync_pass
from test_core import assert_bitwise

EAGER = {"codegen": "eager"}


class DunderWrite(nn.Module):
    """A buffer written by an in-place operator called by its dunder name, then read: Dynamo
    traces ``t.__iadd__(v)`` as a call of that method (not ``operator.iadd``)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.register_buffer("table", torch.arange(64.0).reshape(8, 8) / 7.0)

    def forward(self, x):
        if self.how == "method":
            self.table.__iadd__(1.0)
        elif self.how == "function":
            torch.Tensor.__imul__(self.table, 1.5)
        else:
            torch.Tensor.__setitem__(self.table, 0, 2.0)
        y = x + self.table.cumsum(0)  # invariant work but for the write: must not be cached
        if self.table.sum() > 0:  # reads the written buffer: must not be hoisted
            y = y + 1
        return y * self.table[1, 1].item()


@pytest.mark.parametrize("how", ["method", "function", "setitem"])
def test_dunder_inplace_write_is_a_write(how):
    m = DunderWrite(how)
    ref = copy.deepcopy(m)
    c = torch.compile(m, backend="nosync", options={**EAGER, "invariant_cache_bytes": 64 << 20})
    x = torch.randn(8, 8)
    with torch.no_grad():
        for _ in range(3):
            assert_bitwise(c(x), ref(x))
    assert torch.equal(m.table, ref.table)
    assert not [d for d in torchsync_pass.decisions() if d.action.name == "CACHED"]

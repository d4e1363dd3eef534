"""Review 22 (2026-12-07): each test failing on the commit before its fix."""

from __future__ import annotations

import pytest
import torch

import torchsync_pass
from test_review21 import _clean  # noqa: F401 - the fixture: Dynamo, nosync and counters reset


class _Cached(torch.nn.Module):
    """No sync at all: ``w.exp()`` is request-invariant work the invariant runner caches."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(n), requires_grad=False)

    def forward(self, x):
        return x * self.w.exp()


class _Hoisted(torch.nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(n), requires_grad=False)

    def forward(self, x):
        if (self.w > 0).all():
            return x + self.w.sum().item()
        return x - 1


@pytest.mark.parametrize("module", [_Cached, _Hoisted])
def test_a_weight_swapped_by_data_assignment_is_never_served_an_older_weights_value(_clean, module):
    """``m.w.data = new`` keeps the Parameter object and its version; the allocator hands the new
    data the address of a weight freed two swaps earlier, so (identity, version, data pointer,
    metadata) equalled an older memo entry and its value was served (wrong results on 9 to 29 of 40
    calls). The storage's own address, pinned by the memo entry, tells them apart."""
    n = 1024
    m = module(n)
    f = torch.compile(m, backend="nosync", options={"codegen": "eager"})
    x = torch.ones(n)
    wrong = []
    with torch.no_grad():
        for k in range(40):
            m.w.data = torch.full((n,), float((-1) ** k * (k % 5 + 1)) / 4)
            got, want = f(x), m(x)
            if not torch.equal(got, want):
                wrong.append(k)
    assert wrong == []

"""Review 14 (2026-12-03): each test failing on the commit before its fix."""

from __future__ import annotations

import torch

import torchsync_pass
from torchsync_pass.guards import counters

from test_core import assert_bitwise

EAGER = {"codegen": "eager"}


def test_cached_view_counts_its_base_storage():
    # (table * 2)[:4] keeps the whole 4 MB temporary alive: counted by its 16 bytes, a 1 MiB limit
    # held 4 MB per request (8 requests: 32 MB)
    def step(x, table):
        return x + (table * 2)[:4]

    torch._dynamo.reset()
    torchsync_pass.reset()
    f = torch.compile(step, backend="nosync",
                      options={**EAGER, "invariant_cache_bytes": 1 << 20, "invariant": ["table"]})
    x = torch.ones(4)
    table = torch.arange(1 << 20, dtype=torch.float32)
    with torch.no_grad():
        for _ in range(2):
            assert_bitwise(f(x, table), step(x, table))
    c = counters()
    assert c["cached"] == 0 and c["not cached"] == 1, dict(c)
    (d,) = [d for d in torchsync_pass.decisions() if d.action.value == "not cached"]
    assert d.nbytes == 4 << 20, d


def test_views_of_one_storage_counted_once():
    def step(x, table):
        t = table * 2
        return x + t[:4] + t[4:8]

    torch._dynamo.reset()
    torchsync_pass.reset()
    f = torch.compile(step, backend="nosync",
                      options={**EAGER, "invariant_cache_bytes": 1 << 20, "invariant": ["table"]})
    x = torch.ones(4)
    table = torch.arange(1 << 16, dtype=torch.float32)
    with torch.no_grad():
        for _ in range(2):
            assert_bitwise(f(x, table), step(x, table))
    cached = [d for d in torchsync_pass.decisions() if d.action.value == "cached"]
    assert sum(d.nbytes for d in cached) == 1 << 18, [(d.detail, d.nbytes) for d in cached]

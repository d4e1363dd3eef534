"""Invariant caching with the default codegen (Inductor): torchsync_pass/invariant.py, issue 14.

The graph is split into an invariant part (eager FX, once per request) and a step part compiled by
Inductor. Inductor fuses differently across the split, so the exact reference is the *hand-split*
step: the invariant tensors computed by the same eager ops, fed to stock Inductor compiling the
rest (the hoisted sync's answer passed as a Python constant). Bitwise equality is expected.

One scenario per compiled function (an Inductor compile costs 20+ s on a small CPU): a cached
tensor from a buffer and one from a speculated input (the leaf of a hoisted sync), one over the
byte limit (not cached), one the step writes in place (not cached); then new requests, a leaf
written in place mid request, interleaved requests (A, B, A), and grad mode on (a recompile for
both nosync and the reference) with its backward.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import torchsync_pass
from torchsync_pass import Action, NosyncBackend, Reason
from test_core import assert_bitwise

pytestmark = pytest.mark.inductor

# emb (8 floats, 32 bytes) and mask (256 bytes) fit, three requests of them; big (a view of a
# 4,096-byte tensor) does not.
LIMIT = 1000


def invariant_part(table, tokens):
    emb = (tokens.float().cumsum(0) * 0.25).exp()
    mask = (table.cumsum(0) > 3.0).float() * 0.5
    return emb, mask


def step_part(x, wide, emb, mask, big_tokens: bool):
    if big_tokens:
        x = x * 2.0
    big = wide.cumsum(1).sin()[:8, :8]  # over the byte limit: stays in the step
    scratch = mask * 3.0
    scratch.add_(x)  # written in place by the step: never cached
    return x * mask + emb + big + scratch


class Step(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.arange(64.0).reshape(8, 8) / 7.0)
        self.register_buffer("wide", torch.linspace(-1.0, 1.0, 1024).reshape(32, 32))

    def forward(self, x, tokens):
        big_tokens = bool((tokens > 2).any())  # hoisted: tokens becomes a guarded (speculated) leaf
        return step_part(x, self.wide, *invariant_part(self.table, tokens), big_tokens)


class HandSplit(nn.Module):
    """The reference: the invariant part in eager, the step part compiled by stock Inductor."""

    def __init__(self, m: Step) -> None:
        super().__init__()
        self.m = m
        self.step = torch.compile(step_part, backend="inductor")

    def forward(self, x, tokens):
        big_tokens = bool((tokens > 2).any())
        return self.step(x, self.m.wide, *invariant_part(self.m.table, tokens), big_tokens)


def exps(fn, *args):
    """(result, aten::exp calls): only the invariant part runs exp as an aten op (Inductor's step
    computes no exp), so this counts the invariant part's runs."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = fn(*args)
    return out, sum(e.count for e in prof.key_averages() if e.key == "aten::exp")


def disable_layers(fn, *args) -> int:
    """How many ``torch._dynamo.disable`` wrappers one call of ``fn`` goes through (each switches
    the eval-frame callback off and on again)."""
    import sys

    seen = []

    def prof(frame, event, arg):
        code = frame.f_code
        if event == "call" and code.co_name == "_fn" and code.co_filename.endswith("eval_frame.py"):
            seen.append(code)

    sys.setprofile(prof)
    try:
        fn(*args)
    finally:
        sys.setprofile(None)
    return len(seen)


def test_inductor_step_part_bitwise_equal_to_stock_inductor_on_the_hand_split_step():
    m = Step()
    f = torch.compile(m, backend=NosyncBackend({"invariant_cache_bytes": LIMIT}))
    ref = HandSplit(m)
    a, b = torch.arange(8), torch.arange(8).flip(0).contiguous()
    x = torch.randn(8, 8)

    def call(tokens, x=x):
        out, n = exps(f, x, tokens)
        assert_bitwise(out, ref(x, tokens))
        return n

    with torch.no_grad():
        call(a)  # compiles (tracing runs ops too: not counted)
        by_source = {d.source: d for d in torchsync_pass.decisions() if d.kind == "tensor"}
        cached = sorted(s for s, d in by_source.items() if d.action is Action.CACHED)
        assert cached == ["emb = (tokens.float().cumsum(0) * 0.25).exp()",
                          "mask = (table.cumsum(0) > 3.0).float() * 0.5"]
        (over,) = [d for d in by_source.values() if d.action is Action.NOT_CACHED]
        assert over.reason is Reason.CACHE_BYTES and "sin" in over.source and over.nbytes == 4096
        assert by_source[cached[0]].leaves == ("tokens",)  # speculated: the leaf of the hoisted sync
        counters["nosync"].clear()
        # the first request (computed by the compiling call), then a leaf written in place mid
        # request (the buffer, then the speculated input), then interleaved requests B, A, B, A
        seen = [call(a), call(a)]
        m.table.mul_(1.0)
        seen += [call(a), call(a)]
        a[0] = 1  # same hoisted answer, new cached values
        seen += [call(a), call(a)]
        seen += [call(t) for t in (b, a, b, a)]
        assert seen == [0, 0, 1, 0, 1, 0, 1, 0, 0, 0]
        assert counters["nosync"]["invariant_computes"] == 3
        assert counters["nosync"]["invariant_hits"] == 7
        assert counters["nosync"]["hoisted"] == 0  # no recompile on any of these
        # per call as many disable wrappers as stock Inductor's (Dynamo's, around what the backend
        # returns, and its bytecode hooks): the step part Inductor compiled is not wrapped again
        assert disable_layers(f, x, a) == disable_layers(ref.step, x, m.wide, *invariant_part(m.table, a), True)

    # Grad mode on: Dynamo recompiles both; nothing that requires grad is cached, and the
    # gradient through the step part matches the reference's bitwise.
    xg = torch.randn(8, 8, requires_grad=True)
    outs, grads = [], []
    for fn in (f, ref):
        out = fn(xg, a)
        out.sum().backward()
        outs.append(out.detach())
        grads.append(xg.grad)
        xg.grad = None
    assert_bitwise(outs[0], outs[1])
    assert_bitwise(grads[0], grads[1])

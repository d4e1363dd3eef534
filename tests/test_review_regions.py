"""Work moved out of the step must run as the step would have run it (hostile review, 2026-12-01).

Invariant caching and in-op tabulation compute values once per request, outside the step's graph.
They must not take ops that run inside a grad-mode, inference-mode or autocast region of the step
(the values would be computed under the caller's state), must not trust batch-norm running
statistics (updated without a version bump), and an invariant op that raises must raise after the
in-place writes the step makes before it, as eager does. Each test fails on the commit before.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchsync_pass
from torchsync_pass import Action, Reason
from test_core import assert_bitwise

EAGER = {"codegen": "eager"}


class NoGradRegion(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(4, 3)
        self.register_buffer("tt", torch.tensor([0, 2, 1]))

    def forward(self, x):
        with torch.no_grad():
            e = self.emb(self.tt) * 2.0  # request-invariant, and no autograd history in eager
        return (x * e).sum()


def test_invariant_work_inside_a_no_grad_region_keeps_no_autograd_history():
    torch.manual_seed(0)
    m = NoGradRegion()
    f = torch.compile(m, backend="nosync", options={**EAGER, "invariant": ["self.emb.weight"]})
    for fn in (m, f, f):
        x = torch.ones(3, 3, requires_grad=True)
        m.emb.weight.grad = None
        out = fn(x)
        assert_bitwise(out, m(x))
        out.backward()
        assert m.emb.weight.grad is None  # was filled on every nosync call: a weight eager never trains


class InferenceRegion(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("w", torch.arange(9.0).reshape(3, 3))

    def forward(self, x):
        with torch.inference_mode():
            e = self.w * 2.0
        return (x * e).sum()


def test_invariant_work_inside_inference_mode_still_refuses_backward():
    m = InferenceRegion()
    f = torch.compile(m, backend="nosync", options=EAGER)
    for fn in (m, f, f):
        with pytest.raises(RuntimeError, match="Inference tensors cannot be saved for backward"):
            fn(torch.ones(3, 3, requires_grad=True)).backward()


class AutocastSolve(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.register_buffer("A", torch.randn(3, 3, generator=g) + 3 * torch.eye(3))
        self.register_buffer("B", torch.ones(3, 1))

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            a2 = self.A @ self.A  # bf16 in eager
        return x + torch.linalg.solve(a2.float(), self.B)


def test_in_op_sync_inside_an_autocast_region_is_kept():
    m = AutocastSolve()
    f = torch.compile(m, backend="nosync", options={**EAGER, "invariant_cache_bytes": 0})
    x = torch.zeros(3, 1)
    with torch.no_grad():
        for _ in range(3):
            assert_bitwise(f(x), m(x))  # the table was computed in fp32: off by 5.8e-4
    (d,) = [d for d in torchsync_pass.decisions() if "solve" in d.source]
    assert d.action is Action.KEPT and d.reason is Reason.IN_OP_STATE_REGION and "autocast" in d.detail


class EnableGradSolve(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.A = nn.Parameter(torch.eye(3) * 2 + 0.1)
        self.register_buffer("B", torch.ones(3, 1))

    def forward(self, x):
        with torch.enable_grad():
            return x * torch.linalg.solve(self.A, self.B)


def test_in_op_sync_inside_an_enable_grad_region_keeps_its_autograd_history():
    m = EnableGradSolve()
    f = torch.compile(m, backend="nosync", options={**EAGER, "invariant": ["self.A"]})
    x = torch.ones(3, 1)
    for _ in range(3):
        with torch.no_grad():
            want, got = m(x), f(x)
        assert_bitwise(got, want)
        assert got.requires_grad and want.requires_grad  # nosync's did not: backward raised
        grads = []
        for out in (want, got):
            m.A.grad = None
            out.sum().backward()
            grads.append(m.A.grad.clone())
        assert_bitwise(grads[1], grads[0])


class HandNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x):  # a hand-written eval-mode normalisation
        return (x - self.bn.running_mean) / torch.sqrt(self.bn.running_var + self.bn.eps)


def test_batch_norm_running_statistics_are_not_cached():
    torch.manual_seed(0)
    net = HandNorm()
    f = torch.compile(net, backend="nosync", options=EAGER)
    x = torch.randn(8, 4)
    with torch.no_grad():
        assert_bitwise(f(x), net(x))
        assert_bitwise(f(x), net(x))
        v = net.bn.running_var._version
        net.bn.train()
        net.bn(torch.randn(16, 4) * 5)  # updates the running statistics in place
        net.bn.eval()
        assert net.bn.running_var._version == v  # behind the version counter
        assert_bitwise(f(x), net(x))  # was the stale cached sqrt(running_var + eps): off by 1.09
    assert not [d for d in torchsync_pass.decisions() if d.action is Action.CACHED and "running" in " ".join(d.leaves)]


class WriteThenIndex(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.arange(12.0).reshape(4, 3))
        self.register_buffer("idx", torch.tensor([0, 2]))

    def forward(self, x, acc):
        acc.add_(1.0)  # an in-place write to an input, first
        return x + self.table[self.idx].sum(0)  # request-invariant: cached


def test_invariant_op_that_raises_raises_after_the_steps_earlier_writes():
    m = WriteThenIndex()
    f = torch.compile(m, backend="nosync", options=EAGER)
    with torch.no_grad():
        acc = torch.zeros(1)
        assert_bitwise(f(torch.zeros(3), acc), m(torch.zeros(3), torch.zeros(1)))
        assert [d.action for d in torchsync_pass.decisions() if d.kind == "tensor"] == [Action.CACHED]
        m.idx.fill_(7)  # out of range for the 4-row table
        for fn in (m, f):
            acc = torch.zeros(1)
            with pytest.raises(IndexError):
                fn(torch.zeros(3), acc)
            assert acc.item() == 1.0  # nosync raised before the write

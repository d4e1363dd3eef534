"""Ops classified pure that are not (hostile review 8, 2026-12-02).

Dynamo keeps some Python functions whole in its graph (``torch.svd_lowrank``, ``torch.pca_lowrank``,
``F.multi_head_attention_forward``): their names say nothing of the ``torch.randn`` or dropout
inside, so their draws were cached, or a branch on them hoisted. A global setter kept in the graph
before a hoisted sync (``torch.set_default_dtype``, ``torch._C._set_mkldnn_enabled``) was ignored:
the guard re-ran the cone under the caller's setting, and the invariant runner did not know the
kernel-switch setters. Each test fails on the commit before.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchsync_pass
from torchsync_pass import Action, Reason
from test_core import assert_bitwise
from test_invariant import same_draws_as_eager

EAGER = {"codegen": "eager"}


def decisions(action: Action) -> list:
    return [d for d in torchsync_pass.decisions() if d.action is action]


class LowRank(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("a", torch.randn(12, 10, generator=torch.Generator().manual_seed(0)))

    def forward(self, x):
        u, s, v = torch.svd_lowrank(self.a, q=4, niter=1)  # a random projection inside
        return x + u[:, 0].abs().sum() * s[0]


class Attention(nn.Module):
    """``nn.MultiheadAttention`` with dropout in training mode (MC dropout), over a fixed context."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.mha = nn.MultiheadAttention(8, 2, dropout=0.5).requires_grad_(False)  # frozen: invariant
        self.register_buffer("q", torch.randn(5, 1, 8, generator=g))

    def forward(self, x):
        out, _ = self.mha(self.q, self.q, self.q, need_weights=False)
        return x + out


@pytest.mark.parametrize("cls", [LowRank, Attention])
def test_python_function_kept_whole_with_a_draw_inside_is_not_cached(cls):
    torch.manual_seed(0)
    m, x = cls(), torch.zeros(1)
    f = torch.compile(m, backend="nosync", options=EAGER)
    outs = same_draws_as_eager(f, m, x)
    assert not torch.equal(outs[0], outs[1])  # the scenario: each call draws anew


def pca_branch(x, a):
    u, s, v = torch.pca_lowrank(a, q=3, niter=1)
    if u[0, 0] > 0:  # on a random projection: not a request-invariant answer
        return x + 1
    return x - 1


def test_branch_on_a_random_python_function_is_not_hoisted():
    a, x = torch.randn(10, 6, generator=torch.Generator().manual_seed(0)), torch.zeros(2)
    f = torch.compile(pca_branch, backend="nosync", options=EAGER)
    seen = set()
    for seed in range(8):
        torch.manual_seed(seed)
        got = f(x, a)
        torch.manual_seed(seed)
        want = pca_branch(x, a)
        assert_bitwise(got, want)
        seen.add(float(want[0]))
    assert seen == {1.0, -1.0}  # the scenario: the branch varies with the seed
    assert not decisions(Action.HOISTED)


def python_function_writing(x, b):
    torch.nn.init.constant_(b, 2.0)  # a Python function Dynamo may keep whole that writes b
    return x * b.sum().item()


def test_dispatched_ops_of_a_python_function_are_seen():
    """The probe itself: the ops a Python function dispatches, and the arguments it writes."""
    from torch import fx

    from torchsync_pass import cone

    g = fx.Graph()
    a = g.placeholder("a")
    n = g.call_function(torch.svd_lowrank, (a,), {"q": 2})
    w = g.call_function(torch.nn.init.constant_, (a, 2.0))
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        a.meta["example_value"] = mode.from_tensor(torch.randn(6, 4))
    assert cone.is_random(n)
    assert cone.written_nodes(w) == [a]
    assert cone._impure_reason(w) is not None


def dtype_region(t, x):
    torch.set_default_dtype(torch.float64)
    p = (t / 7 * 7 != t).any()  # true division in the default dtype
    torch.set_default_dtype(torch.float32)
    if p:
        return x + 1
    return x - 1


def test_setter_before_a_sync_in_the_graph_is_not_hoisted():
    """29 / 7 * 7 != 29 in float64, == 29 in float32: the guard re-ran the cone under the
    caller's float32 and served the wrong branch to the second request."""
    x = torch.zeros(2)
    f = torch.compile(dtype_region, backend="nosync", options=EAGER)
    try:
        for t in (torch.tensor([7]), torch.tensor([29]), torch.tensor([7])):
            assert_bitwise(f(t, x), dtype_region(t, x))
    finally:
        torch.set_default_dtype(torch.float32)
    rejected = decisions(Action.REJECTED)
    assert rejected and rejected[0].reason is Reason.STATE_REGION
    assert "set_default_dtype" in rejected[0].detail


class ConvMkldnnOff(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.register_buffer("img", torch.randn(4, 64, 28, 28, generator=g))
        self.register_buffer("w", torch.randn(64, 64, 3, 3, generator=g))

    def forward(self, y):
        torch._C._set_mkldnn_enabled(False)  # what torch.backends.mkldnn.flags calls
        c = torch.nn.functional.conv2d(self.img, self.w)
        torch._C._set_mkldnn_enabled(True)
        return y + c


def test_kernel_switch_setter_in_the_step_keeps_the_work_in_the_step():
    m, y = ConvMkldnnOff(), torch.zeros(4, 64, 26, 26)
    with torch.no_grad():
        with torch.backends.mkldnn.flags(enabled=True):
            on = torch.nn.functional.conv2d(m.img, m.w)
        if torch.equal(on, m(y)):
            pytest.skip("this build computes the convolution to the same bits with mkldnn on and off")
        f = torch.compile(m, backend="nosync", options=EAGER)
        for _ in range(2):
            assert_bitwise(f(y), m(y))
    assert not decisions(Action.CACHED)


# --- What the fixes above must not refuse (hostile review of them, the same day) ----------------


class NormOfBuffers(nn.Module):
    """``F.layer_norm`` and ``F.softmax`` are Python functions Dynamo keeps whole."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("b", torch.randn(4, 8, generator=torch.Generator().manual_seed(0)))

    def forward(self, x):
        return x * torch.nn.functional.softmax(torch.nn.functional.layer_norm(self.b, (8,)), -1)


def test_pure_python_functions_kept_whole_are_still_cached():
    """The probe ran under the backend's fresh fake mode, not the examples' ("Mixing fake modes"),
    failed, and every such function counted as impure: nothing through them was cached."""
    m, x = NormOfBuffers(), torch.randn(4, 8)
    f = torch.compile(m, backend="nosync", options=EAGER)
    for _ in range(2):
        assert_bitwise(f(x), m(x))
    assert decisions(Action.CACHED)


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.rnn = nn.LSTM(8, 8, num_layers=2, dropout=0.5)  # dropout, but eval: none drawn
        self.register_buffer("ctx", torch.randn(5, 1, 8, generator=g))

    def forward(self, x):
        out, _ = self.rnn(self.ctx)
        if out.abs().sum() > 1.0:
            x = x + 1
        return x + out[-1]


def test_rnn_in_eval_is_not_random():
    """``aten.lstm`` is tagged seeded for its dropout between layers: an eval LSTM over a fixed
    context counted as random and was neither hoisted nor cached."""
    m, x = Encoder().eval().requires_grad_(False), torch.zeros(1, 8)
    with torch._dynamo.config.patch(allow_rnn=True):
        f = torch.compile(m, backend="nosync", options=EAGER)
        for _ in range(2):
            assert_bitwise(f(x), m(x))
    assert decisions(Action.HOISTED) and decisions(Action.CACHED)


class AutocastThenSync(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("lens", torch.tensor([3, 5, 2]))

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.lin(x)
        n = int(self.lens.max())  # its cone runs after the region closed
        return h.float()[:n] * 2


def test_sync_after_a_closed_autocast_region_is_hoisted():
    m, x = AutocastThenSync().eval(), torch.randn(6, 8)
    f = torch.compile(m, backend="nosync", options=EAGER)
    with torch.no_grad():
        for _ in range(2):
            assert_bitwise(f(x), m(x))
    assert decisions(Action.HOISTED) and not decisions(Action.REJECTED)

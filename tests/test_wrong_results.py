"""Issue 9, "Wrong results": paths on which a hoisted value was served stale or wrong.

Each test reproduces the case of the issue exactly and compares with eager bitwise (codegen="eager").
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchsync_pass
from torchsync_pass import Action, NosyncError, Reason
from test_core import Compiled, assert_bitwise


def decisions(action=None):
    return [d for d in torchsync_pass.decisions() if action is None or d.action is action]


def batches(n=4, shape=(3, 4)):
    return [torch.randn(*shape, generator=torch.Generator().manual_seed(i)) for i in range(n)]


# --------------------------------------------------------------------------------------------
# 1. BatchNorm running statistics: written in place without bumping _version
# --------------------------------------------------------------------------------------------
class BNAfter(nn.Module):
    """The issue's case: the sync reads the running mean the BN just updated (first call wrong)."""

    def __init__(self, bn=nn.BatchNorm1d):
        super().__init__()
        self.bn = bn(4)

    def forward(self, x):
        y = self.bn(x)
        return y * self.bn.running_mean.sum().item()


class BNBefore(BNAfter):
    """The sync reads the running stats before the BN updates them (stale on later calls)."""

    def forward(self, x):
        v = self.bn.running_var.sum().item()
        return self.bn(x) * v


class FunctionalBN(nn.Module):
    """F.batch_norm / torch.batch_norm / native_batch_norm on buffers not named running_*."""

    def __init__(self, op, after):
        super().__init__()
        self.op, self.after = op, after
        self.register_buffer("stat", torch.zeros(4))
        self.register_buffer("var", torch.ones(4))

    def bn(self, x):
        if self.op == "F.batch_norm":
            return F.batch_norm(x, self.stat, self.var, training=True)
        if self.op == "torch.batch_norm":
            return torch.batch_norm(x, None, None, self.stat, self.var, True, 0.1, 1e-5, False)
        return torch.native_batch_norm(x, None, None, self.stat, self.var, True, 0.1, 1e-5)[0]

    def forward(self, x):
        if self.after:
            v = self.stat.sum().item()
            return self.bn(x) * v
        y = self.bn(x)
        return y * self.stat.sum().item()


def run_pair(make, xs, **options):
    model, ref = make(), make()
    step = Compiled(model, **options)
    for x in xs:
        assert_bitwise(step(x), ref(x))
    for (name, a), b in zip(model.named_buffers(), ref.buffers()):
        assert torch.equal(a, b), name
    return step


@pytest.mark.parametrize("make, reason", [
    pytest.param(BNAfter, Reason.HIDDEN_WRITER, id="BatchNorm1d-sync-after"),
    pytest.param(BNBefore, Reason.HIDDEN_WRITER, id="BatchNorm1d-sync-before"),
    pytest.param(lambda: BNAfter(nn.BatchNorm2d), Reason.HIDDEN_WRITER, id="BatchNorm2d-sync-after"),
])
def test_batchnorm_running_stats_are_never_hoisted_stale(make, reason):
    xs = batches(4, (3, 4, 2, 2)) if "2d" in repr(make().bn) else batches()
    run_pair(make, xs)
    assert not decisions(Action.HOISTED)
    assert {d.reason for d in decisions(Action.REJECTED)} == {reason}


@pytest.mark.parametrize("op", ["F.batch_norm", "torch.batch_norm", "native_batch_norm"])
def test_batch_norm_before_the_sync_is_a_writer_of_its_running_stats(op):
    """The cone's write analysis sees the BN op as a writer of the buffers (first call right)."""
    run_pair(lambda: FunctionalBN(op, after=False), batches())
    assert not decisions(Action.HOISTED)
    rejected = decisions(Action.REJECTED)
    assert rejected[0].reason is Reason.MUTATION and "writes to input" in rejected[0].detail


@pytest.mark.parametrize("op", ["F.batch_norm", "torch.batch_norm", "native_batch_norm"])
def test_batch_norm_after_the_sync_demotes_the_site(op):
    """A BN later in the same graph writes the leaf behind the version counter: the hoisted value is
    right for the call it was traced on, and the site is demoted before the next call."""
    from torch._dynamo.testing import CompileCounterWithBackend

    stock = CompileCounterWithBackend("eager")
    f = torch.compile(FunctionalBN(op, after=True), backend=stock)
    for x in batches():
        f(x)
    torch._dynamo.reset()
    step = run_pair(lambda: FunctionalBN(op, after=True), batches())
    demoted = decisions(Action.DEMOTED)
    assert [d.reason for d in demoted] == [Reason.HIDDEN_WRITER]
    assert step.graphs == stock.frame_count + 1  # the hoisted graph, then as stock


def _positive_step(x, t):
    if (t > 0).any():
        x = x + 1.0
    return x


def test_a_site_demoted_after_its_fast_path_took_hold_fails_that_guard_at_once():
    """The fused guard answers a repeated call (same leaves, same versions) without its checks;
    a demotion of one of its sites since (by another compile of the frame: a hidden writer, the
    recompile budget) must still fail it, or the demoted hoisted value keeps being served."""
    from torch._dynamo.utils import counters

    from torchsync_pass import guards

    f = torch.compile(_positive_step, backend=torchsync_pass.NosyncBackend({"codegen": "eager"}))
    x, t = torch.zeros(3), torch.ones(3)
    for _ in range(3):  # the third call takes the fast path
        assert_bitwise(f(x, t), _positive_step(x, t))
    states = [s for s in guards._sites.values() if s.code is _positive_step.__code__]
    assert len(states) == 1 and states[0].demoted is None
    graphs = counters["stats"]["unique_graphs"]
    guards._demote(states[0], Reason.HIDDEN_WRITER, "demoted by the test")
    assert_bitwise(f(x, t), _positive_step(x, t))
    assert counters["stats"]["unique_graphs"] > graphs  # the guard failed: the frame compiled again, as stock


def _leafless_step(x):
    if (torch.arange(4) > 2).any():  # no tensor input at all: a cone with no leaf
        return x + 1.0
    return x - 1.0


def test_a_hoisted_site_with_no_leaf_is_guarded_without_error():
    """The fused guard's generated code for zero leaves was a syntax error (``= leaves``): the
    guard raised, Dynamo asserted on its own fresh entry and compiled the frame again and again."""
    from torch._dynamo.utils import counters

    f = torch.compile(_leafless_step, backend=torchsync_pass.NosyncBackend({"codegen": "eager"}))
    x = torch.zeros(3)
    for _ in range(4):
        assert_bitwise(f(x), _leafless_step(x))
    assert counters["stats"]["unique_graphs"] == 1
    assert [d.reason for d in torchsync_pass.decisions() if d.action is Action.HOISTED]


def _mask_step(x, mask):
    if mask.any():
        return x + 1.0
    return x - 1.0


def test_leaf_written_while_its_guard_reruns_the_cone_is_not_served_stale(monkeypatch):
    """A write to a leaf that lands while the guard re-runs its cone (another thread's, simulated
    right after the cone's value is read): the memo entry and the fast path's key were taken after
    the value, so every later call with that leaf took the old branch without checking again."""
    from torchsync_pass import guards

    f = torch.compile(_mask_step, backend=torchsync_pass.NosyncBackend({"codegen": "eager"}))
    x = torch.zeros(3)
    for _ in range(2):
        assert_bitwise(f(x, torch.ones(3, dtype=torch.bool)), _mask_step(x, torch.ones(3, dtype=torch.bool)))
    mask = torch.ones(3, dtype=torch.bool)  # a new request: the guard re-runs the cone
    convert = guards._CONVERT["bool"]

    def racing(t):
        value = convert(t)
        mask.zero_()  # lands between the value and the bookkeeping
        return value

    monkeypatch.setitem(guards._CONVERT, "bool", racing)
    f(x, mask)  # the racing call: eager would have read either value
    monkeypatch.setitem(guards._CONVERT, "bool", convert)
    for _ in range(3):
        assert_bitwise(f(x, mask), _mask_step(x, mask))  # the zeroed mask: x - 1


def test_batchnorm_in_eval_mode_is_not_a_writer():
    """Eval mode: the running stats are read only; a sync on the BN output is still hoisted."""

    class EvalBN(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm1d(4).eval()
            self.register_buffer("scale", torch.tensor(2.0))

        def forward(self, x):
            y = self.bn(x)
            return y * self.scale.item()

    run_pair(EvalBN, batches())
    assert [d.reason for d in decisions(Action.HOISTED)] == [Reason.INVARIANT_CONE]


# --------------------------------------------------------------------------------------------
# 2. Cone state keyed by what it computes
# --------------------------------------------------------------------------------------------
class Pool(nn.Module):
    def __init__(self, fn, conv=float):
        super().__init__()
        self.fn, self.conv = fn, conv

    def forward(self, x, t):
        return x * self.conv(self.fn(t, 2).sum())


class Convert(nn.Module):
    def __init__(self, conv):
        super().__init__()
        self.conv = conv

    def forward(self, x, t):
        return x * self.conv(t)


@pytest.mark.parametrize("first, second, t", [
    pytest.param(Pool(F.max_pool1d), Pool(F.adaptive_max_pool1d), torch.tensor([[1.0, 2.0, 3.0]]),
                 id="max_pool1d-vs-adaptive_max_pool1d"),
    pytest.param(Convert(int), Convert(float), torch.tensor(2.5), id="int-vs-float"),
    pytest.param(Convert(float), Convert(int), torch.tensor(2.5), id="float-vs-int"),
])
def test_two_instances_of_one_class_do_not_share_a_cone(first, second, t):
    """Both pool functions are ``boolean_dispatch.<locals>.fn``; both conversions sit on one line."""
    x = torch.ones(2)
    a, b = Compiled(first), Compiled(second)
    for _ in range(2):
        assert_bitwise(a(x, t), first(x, t))
        assert_bitwise(b(x, t), second(x, t))
    assert len(decisions(Action.HOISTED)) == 2


# --------------------------------------------------------------------------------------------
# 3. Identity-only memo belongs to an inference-tensor leaf, never to a cone
# --------------------------------------------------------------------------------------------
def scaled(x, tt):
    return x * tt.sum().item()


def test_inference_then_ordinary_tensor_at_one_declared_argument():
    step = Compiled(scaled, invariant=["tt"])
    x = torch.ones(2)
    with torch.inference_mode():
        ti = torch.tensor([1, 2])
    assert_bitwise(step(x, ti), scaled(x, ti))
    t = torch.tensor([1, 2])
    assert_bitwise(step(x, t), scaled(x, t))
    t.add_(1)
    assert_bitwise(step(x, t), scaled(x, t))  # 5, not 3
    t.mul_(10)
    assert_bitwise(step(x, t), scaled(x, t))  # 50
    assert_bitwise(step(x, ti), scaled(x, ti))  # the inference tensor, by identity, again


# --------------------------------------------------------------------------------------------
# 4. Thread count: a reduction's bits depend on it
# --------------------------------------------------------------------------------------------
def big_sum(x, w):
    return x * w.sum().item()


@pytest.fixture
def threads():
    saved = torch.get_num_threads()
    yield
    torch.set_num_threads(saved)


def test_value_memoized_under_two_threads_is_not_served_under_one(threads):
    w = torch.randn(2_000_000, generator=torch.Generator().manual_seed(1))
    sums = {}
    for n in (2, 1):
        torch.set_num_threads(n)
        sums[n] = w.sum().item()
    if sums[1] == sums[2]:
        pytest.skip("this build sums 2M floats to the same bits with 1 and 2 threads")
    step = Compiled(big_sum)
    x = torch.ones(2)
    for n in (2, 1, 2, 1):
        torch.set_num_threads(n)
        assert_bitwise(step(x, w), big_sum(x, w))


# --------------------------------------------------------------------------------------------
# 5. Guards dropped by the caller
# --------------------------------------------------------------------------------------------
def branch(x, flag):
    if flag.any():
        return x + 1
    return x - 1


def drop_all(entries):
    return [False] * len(entries)


FILTERS = [
    pytest.param(drop_all, id="drop-all"),  # vLLM's way to drop every Dynamo guard
    pytest.param(torch.compiler.skip_all_guards_unsafe, id="skip_all_guards_unsafe"),
    pytest.param(torch.compiler.keep_tensor_guards_unsafe, id="keep_tensor_guards_unsafe"),
    pytest.param(torch.compiler.skip_guard_on_globals_unsafe, id="skip_guard_on_globals_unsafe"),
]


def filtered(guard_filter_fn):
    return torch.compile(branch, backend="nosync",
                         options={"codegen": "eager", "guard_filter_fn": guard_filter_fn})


@pytest.mark.parametrize("guard_filter_fn", FILTERS)
def test_guard_filter_that_drops_the_nosync_guard_is_refused(guard_filter_fn):
    """Without the guard the branch hoisted for the first request is taken for the next one."""
    step = filtered(guard_filter_fn)
    x = torch.zeros(2)
    assert_bitwise(step(x, torch.tensor([True])), branch(x, torch.tensor([True])))
    with pytest.raises(NosyncError, match="guard_filter_fn"):
        step(x, torch.tensor([False]))


@pytest.mark.parametrize("guard_filter_fn", FILTERS)
def test_keep_nosync_guards_keeps_the_check_under_a_dropping_filter(guard_filter_fn):
    step = filtered(getattr(torchsync_pass, "keep_nosync_guards")(guard_filter_fn))
    x = torch.zeros(2)
    for v in (True, False, True, False):
        flag = torch.tensor([v])
        assert_bitwise(step(x, flag), branch(x, flag))


def test_guard_dropped_and_released_by_reset_is_still_refused():
    """torchsync_pass.reset() without torch._dynamo.reset() releases the checks of a frame whose
    compiled graph Dynamo still holds; with the guard dropped by a filter, that graph must not
    start serving its hoisted branch unchecked (it did: no checks left looked like nothing
    hoisted)."""
    step = filtered(drop_all)
    x = torch.zeros(2)
    assert_bitwise(step(x, torch.tensor([True])), branch(x, torch.tensor([True])))
    torchsync_pass.reset()
    with pytest.raises(NosyncError, match="released by torchsync_pass.reset"):
        step(x, torch.tensor([False]))


def test_skip_guard_eval_unsafe_keeps_the_stock_behaviour():
    """Warmed on both requests, the nosync guard still picks the entry; a new answer under the
    stance is refused by Dynamo (no recompiles allowed), not served stale."""
    step = torch.compile(branch, backend="nosync", options={"codegen": "eager"})
    x = torch.zeros(2)
    req_a, req_b = torch.tensor([True]), torch.tensor([False])  # two live requests
    step(x, req_a)
    with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
        with pytest.raises(RuntimeError, match="skip_guard_eval_unsafe"):
            step(x, req_b)
    step(x, req_b)
    with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
        for flag in (req_a, req_b, req_b, req_a, torch.tensor([False]), torch.tensor([True])):
            assert_bitwise(step(x, flag), branch(x, flag))


# --------------------------------------------------------------------------------------------
# Limits stated in README "Guarantees and limits": pinned here so the text stays exact
# --------------------------------------------------------------------------------------------
def copysign_step(x, s):
    v = float(s)
    return x + math.copysign(1.0, v)


def test_negative_zero_after_demotion_is_exactly_stock():
    """After demotion the float goes to stock Dynamo, whose guards on a float (``==``, ``<``) do not
    see the sign of zero: nosync then gives, call for call, what stock torch.compile gives."""
    from torch._dynamo.testing import CompileCounterWithBackend

    values = [0.5, 1.5, 2.5, 3.5, -0.0, 0.0, -0.0, 0.0]
    x = torch.ones(2)
    stock = torch.compile(copysign_step, backend=CompileCounterWithBackend("eager"))
    want = [stock(x, torch.tensor(v)) for v in values]
    torch._dynamo.reset()
    step = Compiled(copysign_step)
    got = [step(x, torch.tensor(v)) for v in values]
    assert [d.reason for d in decisions(Action.DEMOTED)] == [Reason.LEAVES_CHANGE]
    for g, w in zip(got, want):
        assert_bitwise(g, w)
    eager = [copysign_step(x, torch.tensor(v)) for v in values]
    assert any(not torch.equal(g, e) for g, e in zip(got, eager))  # the limit is real (stock too)


TABLE = torch.arange(20.0).reshape(10, 2)


def unrolled(x, tokens):
    for i in range(4):
        # the read in arithmetic (a read used only as an index, TABLE[t.item()], is rewritten into
        # a device gather instead: tests/test_rewrite.py)
        x = x + TABLE[1] * tokens[i].item()
    return x


def test_unrolled_item_loop_is_demoted_by_the_recompile_budget():
    """Each request's tokens are new values of one unrolled trace: the site is demoted when its
    frame has used half of recompile_limit, not after max_specializations values."""
    step = Compiled(unrolled)
    x = torch.zeros(2)
    budget = torch._dynamo.config.recompile_limit // 2
    requests = [torch.tensor([k % 10, (k + 1) % 10, (k + 3) % 10, (k + 5) % 10]) for k in range(budget + 2)]
    for k, tokens in enumerate(requests):  # live requests, one after the other, 3 steps each
        for _ in range(3):
            assert_bitwise(step(x, tokens), unrolled(x, tokens))
        demoted = decisions(Action.DEMOTED)
        assert bool(demoted) == (k >= budget), (k, demoted)
    assert {d.reason for d in decisions(Action.DEMOTED)} == {Reason.RECOMPILE_BUDGET}

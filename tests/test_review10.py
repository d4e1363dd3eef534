"""Global state that picks bits but was not in the state key (hostile review 10, 2026-12-03).

``torch.einsum`` reads ``torch.backends.opt_einsum.enabled``/``.strategy`` when it runs (its
contraction order, so its rounding), and ``torch.empty`` under deterministic algorithms reads
``torch.utils.deterministic.fill_uninitialized_memory``; Dynamo guards neither, and nosync's
per-call state check did not read them, so a cached tensor or a hoisted value computed under the
old setting was served after a switch. And on torch before 2.13 (no per-backend precision getter)
the kernel switches were not read at all. Each test fails on the commit before its fix.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.utils.deterministic as deterministic
from torch import nn

import torchsync_pass
from torchsync_pass import _torch_private
from torchsync_pass.guards import precision_reader
from test_core import assert_bitwise

EAGER = {"codegen": "eager"}


class Einsum(nn.Module):
    """A cached einsum and a hoisted one; opt_einsum's path gives other bits than left to right."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.register_buffer("A", torch.randn(3, 40, generator=g))
        self.register_buffer("B", torch.randn(40, 40, generator=g))
        self.register_buffer("C", torch.randn(40, 2, generator=g))

    def forward(self, x, mask):
        t = torch.einsum("ij,jk,kl->il", self.A, self.B, self.C)  # cached (invariant)
        s = torch.einsum("ij,jk,kl->", self.A, self.B, self.C).item()  # hoisted
        if (mask == 0).any():
            x = x * 2
        return x + t + s


@pytest.mark.parametrize("cache", [64 << 20, 0], ids=["cached", "hoisted-only"])
def test_opt_einsum_switch_between_calls(cache):
    pytest.importorskip("opt_einsum")
    oe = torch.backends.opt_einsum
    assert oe.is_available()
    m, x, mask = Einsum(), torch.randn(3, 2), torch.tensor([1, 0])
    before = oe.enabled, oe.strategy
    try:
        oe.enabled, oe.strategy = True, "auto"
        c = torch.compile(m, backend="nosync", options={**EAGER, "invariant_cache_bytes": cache})
        with torch.no_grad():
            on = m(x, mask)
            assert_bitwise(c(x, mask), on)
            assert_bitwise(c(x, mask), on)
            oe.enabled = False  # eager now contracts left to right
            off = m(x, mask)
            assert not torch.equal(on, off)  # the switch does change these bits
            assert_bitwise(c(x, mask), off)
            assert_bitwise(c(x, mask), off)
            oe.enabled, oe.strategy = True, "optimal"
            assert_bitwise(c(x, mask), m(x, mask))
    finally:
        oe.enabled = before[0]
        if before[0]:
            oe.strategy = before[1]


class _ValueThenBranch(nn.Module):
    """``value()`` (cached or hoisted), then a hoisted branch on the request's mask."""

    def forward(self, x, mask):
        v = self.value()
        if (mask == 0).any():
            x = x * 2
        return x + v


def test_fill_uninitialized_memory_switch_between_calls():
    class Empty(_ValueThenBranch):
        def value(self):
            return torch.isnan(torch.empty(1000)).float().sum()  # no input: cached

    m, x, mask = Empty(), torch.zeros(2), torch.tensor([1, 0])
    with _deterministic_unfilled(), torch.no_grad():
        c = torch.compile(m, backend="nosync", options=EAGER)
        c(x, mask)  # uninitialized memory: any value
        for _ in range(2):
            deterministic.fill_uninitialized_memory = True
            assert_bitwise(c(x, mask), torch.full((2,), 1000.0))  # NaN-filled: every element counts
            assert_bitwise(c(x, mask), m(x, mask))
            deterministic.fill_uninitialized_memory = False
            c(x, mask)


@contextlib.contextmanager
def _deterministic_unfilled():
    """Deterministic algorithms on, the fill of uninitialized memory off; both restored after."""
    det, fill = torch.are_deterministic_algorithms_enabled(), deterministic.fill_uninitialized_memory
    try:
        torch.use_deterministic_algorithms(True)
        deterministic.fill_uninitialized_memory = False
        yield
    finally:
        torch.use_deterministic_algorithms(det)
        deterministic.fill_uninitialized_memory = fill


@pytest.mark.parametrize("fn, reader", [
    (lambda a: torch.einsum("ij,jk->ik", a, a), "einsum"),
    (lambda a: (torch.einsum("ij,jk->ik", a, a) @ a).sum(), "einsum"),  # a matmul after: still einsum's
    (lambda a: (a @ torch.einsum("ij,jk->ik", a, a)).sum(), "einsum"),  # and before
    (lambda a: torch.empty(a.size()).add(a), "partial"),
    (lambda a: torch.empty_like(a) + a.new_empty((3, 3)), "partial"),
    (lambda a: (a @ a).sum(), "partial"),
    (lambda a: (a * 2).sum(), None),
])
def test_graphs_read_the_switches_their_ops_depend_on(fn, reader):
    expected = {"einsum": _torch_private.fp32_precisions_einsum, "partial": _torch_private.fp32_precisions_no_attention,
                None: None}[reader]
    assert precision_reader(torch.fx.symbolic_trace(fn).graph) is expected


def test_state_readers_follow_opt_einsum_and_the_fill_switch():
    oe = torch.backends.opt_einsum
    full, with_einsum = _torch_private.fp32_precisions, _torch_private.fp32_precisions_einsum
    partial = _torch_private.fp32_precisions_no_attention
    fill = deterministic.fill_uninitialized_memory
    try:
        for reader in (full, with_einsum, partial):
            now = reader()
            deterministic.fill_uninitialized_memory = not fill
            assert reader() != now
            deterministic.fill_uninitialized_memory = fill
    finally:
        deterministic.fill_uninitialized_memory = fill
    assert full()[-1] == with_einsum()[-1] == (oe.enabled, oe.strategy)


def test_kernel_switches_read_without_the_precision_getter(monkeypatch):
    """torch before 2.13 has no per-backend precision getter: the kernel switches still count."""
    monkeypatch.delattr(torch._C, "_get_fp32_precision_getter", raising=False)
    for attention, einsum in [(True, True), (False, False), (False, True)]:
        reader = _torch_private._fp32_precisions_fn(attention=attention, einsum=einsum)
        now, enabled = reader(), torch.backends.mkldnn.enabled
        try:
            torch.backends.mkldnn.enabled = not enabled
            assert reader() != now
        finally:
            torch.backends.mkldnn.enabled = enabled
        assert reader() == now


class SortedRequest(nn.Module):
    """``torch.sort`` of a request tensor: TorchScript's list overloads (``aten::sort.int(int[](a!)
    self)``) made every sort look like a write to its input, so the sync was rejected."""

    def forward(self, x, mask):
        s, _ = torch.sort(mask)
        if (mask == 0).any():
            x = x * 2
        return x + s


def test_sort_is_not_a_write_to_its_input():
    m, x, mask = SortedRequest(), torch.randn(3), torch.tensor([1, 0, 2])
    c = torch.compile(m, backend="nosync", options=EAGER)
    with torch.no_grad():
        for _ in range(3):
            assert_bitwise(c(x, mask), m(x, mask))
        mask.fill_(1)  # a write between calls: the new answer
        assert_bitwise(c(x, mask), m(x, mask))
    actions = {(d.action, d.reason) for d in torchsync_pass.decisions()}
    assert (torchsync_pass.Action.HOISTED, torchsync_pass.Reason.INVARIANT_CONE) in actions
    assert not any(d.reason is torchsync_pass.Reason.MUTATION for d in torchsync_pass.decisions())


def test_sort_with_out_still_writes_its_outputs():
    from torchsync_pass import cone

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def f(t, v, i):
        torch.sort(t, out=(v, i))
        return torch.sort(t)[0] + v

    t = torch.tensor([3.0, 1.0, 2.0])
    torch.compile(f, backend=capture)(t, torch.empty(3), torch.empty(3, dtype=torch.long))
    sorts = [n for n in graphs[0].graph.nodes if n.op == "call_function" and n.target is torch.sort]
    assert len(sorts) == 2
    written = [sorted(w.name for w in cone.written_nodes(n)) for n in sorts]
    assert sorted(map(len, written)) == [0, 2]  # the out= one writes v and i, never t
    assert all(not any("t" == w.split("_")[1] for w in ws) for ws in written)


def _branchy(x, m):
    return x + 1 if m.any() else x - 1


@pytest.mark.parametrize("inner", ["nosync", "object"])
def test_compile_counter_with_backend_around_nosync(inner):
    """torch._dynamo.testing.CompileCounterWithBackend keeps its backend (a name or an object) in
    ``.backend``: the hooks did not find nosync there, and the frame was traced as stock."""
    from torch._dynamo.testing import CompileCounterWithBackend

    be = CompileCounterWithBackend("nosync" if inner == "nosync" else torchsync_pass.NosyncBackend(EAGER))
    x, m = torch.randn(4), torch.ones(4, dtype=torch.bool)
    g = torch.compile(_branchy, backend=be)
    assert_bitwise(g(x, m), _branchy(x, m))
    expected = _branchy(x, m)
    with torchsync_pass.count_syncs(profiler=False) as c:
        out = g(x, m)
    assert_bitwise(out, expected)
    assert c.total == 0 and be.frame_count == 1
    assert any(d.action is torchsync_pass.Action.HOISTED for d in torchsync_pass.decisions())


class _Hiding:
    """A backend wrapper that keeps nosync under a name the hooks do not look at."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __call__(self, gm, example_inputs, **kwargs):
        return self.inner(gm, example_inputs, **kwargs)


def test_a_hidden_nosync_backend_is_never_silent(monkeypatch):
    import torchsync_pass.backend as backend_module

    monkeypatch.setattr(backend_module, "_WARNED_HIDDEN", [])
    x, m = torch.randn(4), torch.ones(4, dtype=torch.bool)
    g = torch.compile(_branchy, backend=_Hiding(torchsync_pass.NosyncBackend(EAGER)))
    with pytest.warns(UserWarning, match="hides the nosync backend"):
        assert_bitwise(g(x, m), _branchy(x, m))
    torch._dynamo.reset()
    g = torch.compile(_branchy, backend=_Hiding(torchsync_pass.NosyncBackend({**EAGER, "strict": True})))
    with pytest.raises(Exception, match="hides the nosync backend"):
        g(x, m)


# -- device-side rewrites: what the gather would not reproduce (review 10, third helper) --------
class _Doubling(torch.Tensor):
    """Indexing through ``__torch_function__``."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs or {})
        return out * 2 if func is torch.Tensor.__getitem__ else out


class _Tripling(torch.Tensor):
    """Indexing through a Python ``__getitem__``."""

    def __getitem__(self, i):
        return super().__getitem__(i) * 3


class _PlusOne(torch.Tensor):
    """``int()``/``operator.index()`` through ``__torch_function__``."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs or {})
        return out + 1 if func in (torch.Tensor.__int__, torch.Tensor.__index__) else out


class _Plain(torch.Tensor):
    pass


class _ItemPlusOne(torch.Tensor):
    def item(self):
        return super().item() + 1


_W = torch.arange(12.0).reshape(6, 2)
_ROWS = [torch.full((2,), float(k)) for k in range(6)]


def _compare_with_eager(fn, *args):
    """Eager's bits, or stock Dynamo's where stock itself differs from eager (torch 2.11 and 2.12
    apply a subclass's __torch_function__ twice in some paths); the result's class is stock's (it
    drops a subclass eager keeps)."""
    expected = fn(*args).as_subclass(torch.Tensor)
    stock = torch.compile(fn, backend="eager")(*args)
    if not torch.equal(stock.as_subclass(torch.Tensor), expected):
        assert TORCH < (2, 13), "stock Dynamo differs from eager on a torch where it should not"
        expected = stock.as_subclass(torch.Tensor)
    torch._dynamo.reset()
    out = torch.compile(fn, backend="nosync", options=EAGER)(*args)
    assert type(out) is type(stock)
    assert_bitwise(out.as_subclass(torch.Tensor), expected)


TORCH = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


@pytest.mark.parametrize("cls", [_Doubling, _Tripling], ids=["torch_function", "python_getitem"])
def test_a_subclass_table_indexes_its_own_way(cls):
    table = torch.arange(12.0).reshape(6, 2).as_subclass(cls)
    _compare_with_eager(lambda tok: table[tok.item()] + 0, torch.tensor(3))


@pytest.mark.parametrize("cls", [_Plain, pytest.param(_PlusOne, marks=pytest.mark.skipif(
    tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13),
    reason="torch 2.11/2.12: a subclass whose __torch_function__ changes int() is hoisted with the "
           "plain conversion (README: stock applies such a class's __torch_function__ twice there)"))])
@pytest.mark.parametrize("read", ["int", "index"])
def test_a_subclass_index_converts_its_own_way(cls, read):
    import operator

    if read == "int":
        def fn(tok):
            return _W[int(tok)] * 1
    else:
        def fn(tok):
            return _ROWS[operator.index(tok)] * 1
    _compare_with_eager(fn, torch.tensor(2).as_subclass(cls))


def test_a_hoisted_item_applies_a_python_override_once():
    _compare_with_eager(lambda tok: _W[tok.item()] * 1, torch.tensor(2).as_subclass(_ItemPlusOne))


@pytest.mark.parametrize("form", ["item", "subscript", "list", "loop"])
def test_rows_without_elements_still_raise_out_of_range(form):
    if form == "item":
        def fn(tab, t):
            return tab[t.item()] + 0
        tab, bad = torch.zeros(10, 0), torch.tensor(12)
    elif form == "subscript":
        def fn(tab, t):
            return tab[t] + 0
        tab, bad = torch.zeros(10, 0), torch.tensor(-11)
    elif form == "list":
        def fn(tab, t):
            return tab[t.item()] + 0
        tab, bad = [torch.zeros(0)] * 10, torch.tensor(12)
    else:
        def fn(tab, tok):
            return torch.stack([tab[tok[i].item()] for i in range(tok.shape[0])])
        tab, bad = torch.zeros(10, 0), torch.tensor([1, 10])
    stock = torch.compile(fn, backend="eager")
    stock(tab, torch.zeros_like(bad))
    with pytest.raises(Exception) as stock_error:  # IndexError; Dynamo's TorchRuntimeError on 2.11/2.12
        stock(tab, bad)
    torch._dynamo.reset()
    c = torch.compile(fn, backend="nosync", options=EAGER)
    assert_bitwise(c(tab, torch.zeros_like(bad)), fn(tab, torch.zeros_like(bad)))
    with pytest.raises(IndexError):
        fn(tab, bad)
    # on torch 2.11/2.12 a hoisted out-of-range index fails Dynamo's trace (TorchRuntimeError
    # wrapping the IndexError) where stock's graph break reaches eager's IndexError
    old_dynamo = (IndexError, torch._dynamo.exc.TorchRuntimeError) if TORCH < (2, 13) else ()
    with pytest.raises((type(stock_error.value), *old_dynamo), match="out of (bounds|range)"):
        c(tab, bad)


@pytest.mark.parametrize("form", ["item", "subscript"])
def test_a_negative_view_index_is_not_gathered(form):
    key = torch._neg_view(torch.tensor(2))
    if form == "item":
        _compare_with_eager(lambda t: _W[t.item()] * 1, key)
    else:
        _compare_with_eager(lambda t: _W[t] * 1, key)


def test_a_tabulated_fallback_that_raises_prints_nothing(capfd):
    """The original graph that raises eager's error for an index the tables cannot answer ran
    through GraphModule.__call__, which printed an FX traceback to stderr at every such call."""
    class Sched:
        def __init__(self) -> None:
            self.table, self._step_index = torch.tensor([1.0, 2.0, 2.0, 3.0, 0.0, 1.0]), 0

    def step(s, x):
        r = torch.linalg.inv(torch.eye(2) * s.table[s._step_index] + torch.tensor([[1.0, 2.0], [2.0, 4.0]]))
        s._step_index += 1
        return x + r

    f = torch.compile(step, backend=torchsync_pass.NosyncBackend(EAGER))
    s, e = Sched(), Sched()
    for _ in range(4):
        assert_bitwise(f(s, torch.zeros(2, 2)), step(e, torch.zeros(2, 2)))
    capfd.readouterr()
    with pytest.raises(torch.linalg.LinAlgError):
        step(e, torch.zeros(2, 2))
    with pytest.raises(torch.linalg.LinAlgError):
        f(s, torch.zeros(2, 2))
    assert "FX-traced Module" not in capfd.readouterr().err


@torch.library.custom_op("nosync_review10::mul", mutates_args=())
def _custom_mul(a: torch.Tensor, n: int) -> torch.Tensor:
    return a * torch.isnan(torch.empty(n)).float().sum()  # reads the fill switch


@_custom_mul.register_fake
def _(a, n):
    return torch.empty_like(a)


def test_a_custom_op_named_like_an_aten_op_reads_the_state():
    """Only torch's own op is judged by its name: ``torch.ops.mylib.mul`` is any code."""
    class M(_ValueThenBranch):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("one", torch.ones(1))

        def value(self):
            return torch.ops.nosync_review10.mul(self.one, 1000).item()  # hoisted

    m, x, mask = M(), torch.zeros(2), torch.tensor([1, 0])
    with _deterministic_unfilled(), torch.no_grad():
        c = torch.compile(m, backend="nosync", options=EAGER)
        c(x, mask)
        c(x, mask)
        deterministic.fill_uninitialized_memory = True
        assert_bitwise(c(x, mask), m(x, mask))


class _Flip(torch.Tensor):
    def __bool__(self):
        return not super().__bool__()


class _IndexPlusOne(torch.Tensor):
    def __index__(self):
        return super().__index__() + 1


def _branch_on(x, k):
    if k:
        return x + 1
    return x - 1


def test_a_subclass_test_is_not_selected_on_the_device():
    """int()/bool() of a subclass are not hoisted; the branch select must not take the sync
    instead: torch.where on plain truthiness skips the class's __bool__."""
    _compare_with_eager(_branch_on, torch.ones(8), torch.tensor(1).as_subclass(_Flip))


def test_a_slice_bound_of_a_subclass_uses_its_index():
    """``x[:k]``: Dynamo reads ``k`` with an .item() of its own; eager calls the class's __index__."""
    _compare_with_eager(lambda x, k: x[:k] * 1, torch.ones(8), torch.tensor(2).as_subclass(_IndexPlusOne))


@pytest.mark.skipif(tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13),
                    reason="torch 2.11/2.12: int() of a traced NumPy value keeps its sync (as at 2b8ae65)")
def test_numpy_values_are_still_hoisted():
    """A NumPy array Dynamo traces is no subclass: int() of it stays hoisted (0 syncs a call)."""
    def f(x, k):
        return x * int(k.numpy().sum())

    _assert_warm_call_syncs_nothing(f, torch.randn(3), torch.tensor([1, 2, 0]))


def _assert_warm_call_syncs_nothing(f, x, k):
    """Compiled with nosync: a warm call is eager's bits with no sync."""
    c = torch.compile(f, backend="nosync", options=EAGER)
    c(x, k)
    c(x, k)
    expected = f(x, k)
    with torchsync_pass.count_syncs(profiler=False) as n:
        out = c(x, k)
    assert_bitwise(out, expected)
    assert n.total == 0


@pytest.mark.parametrize("read", ["item", "tolist"])
def test_a_subclass_item_or_tolist_call_is_still_hoisted(read):
    """The slice-bound rule above refuses a read Dynamo makes for something else, not the user's
    own ``t.item()``/``t.tolist()`` call, which Dynamo traces through the class's __torch_function__."""
    if read == "item":
        def f(x, k):
            return x * k.item()
        k = torch.tensor(3).as_subclass(_Plain)
    else:
        def f(x, k):
            a, b = k.tolist()
            return x * a + b
        k = torch.tensor([2, 3]).as_subclass(_Plain)
    _assert_warm_call_syncs_nothing(f, torch.randn(3), k)


@pytest.mark.skipif(not hasattr(nn, "Buffer"), reason="torch.nn.Buffer is newer than this torch")
def test_nn_buffer_reads_are_not_subclass_reads():
    """Dynamo reports a registered nn.Buffer's class as Buffer: it is a plain tensor to eager."""
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.n = nn.Buffer(torch.tensor(3))
            self.sigmas = nn.Buffer(torch.linspace(0, 1, 10))

        def forward(self, x, i):
            if self.n:
                x = x + 1
            return x[: int(self.n)] * self.sigmas[i]

    m, x = M(), torch.arange(5.0)
    c = torch.compile(m, backend="nosync", options=EAGER)
    c(x, torch.tensor(0))
    for k in range(1, 4):
        expected = m(x, torch.tensor(k))
        with torchsync_pass.count_syncs(profiler=False) as n:
            out = c(x, torch.tensor(k))
        assert_bitwise(out, expected)
        assert n.total == 0

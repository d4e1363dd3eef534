"""Aliasing the trace did not show (hostile review 9, 2026-12-02).

``dropout`` with ``p == 0`` or not training (``nn.Dropout(0.0)``, any dropout in eval mode) returns
its input object in eager, while Dynamo's fake value for it is a copy: a write to the result, or
returning it, was not seen as a write to (or a return of) the input. A cached tensor was written by
the step at every call, a leaf written through the alias stayed invariant, a hoisted sync read the
leaf before the write, and a rewritten row was a copy eager's write never reached. And the gather
fusion of an unrolled lookup loop dropped ``torch.stack(rows, out=buf)``'s write into ``buf``.
Each test fails on the commit before its fix.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchsync_pass
from torchsync_pass import Action
from test_core import assert_bitwise

EAGER = {"codegen": "eager"}

# Dropouts that return their input at run time: p == 0 in training, any p in eval, both spellings.
IDENTITY_DROPOUTS = [
    pytest.param(lambda h: nn.Dropout(0.0).train()(h), id="nn.Dropout(0)-train"),
    pytest.param(lambda h: nn.Dropout(0.5).eval()(h), id="nn.Dropout(0.5)-eval"),
    pytest.param(lambda h: F.dropout(h, 0.5, training=False), id="F.dropout-eval"),
    pytest.param(lambda h: torch.dropout(h, 0.3, False), id="torch.dropout-eval"),
]


class CachedThenWritten(nn.Module):
    """The step adds into a request-invariant tensor through the dropout's alias."""

    def __init__(self, drop) -> None:
        super().__init__()
        self.register_buffer("pos", torch.arange(8.0))
        self.drop = drop

    def forward(self, x):
        pe = torch.sin(self.pos * 0.5)  # request-invariant: cached, unless written
        h = self.drop(pe)  # pe itself at run time
        h += x
        return h * 2


@pytest.mark.parametrize("drop", IDENTITY_DROPOUTS)
def test_cached_tensor_written_through_a_dropout_alias_is_not_cached(drop):
    m, x = CachedThenWritten(drop), torch.ones(8)
    f = torch.compile(m, backend="nosync", options=EAGER)
    for _ in range(3):  # the step's write would land in a cached sin(): call 2 would add x twice
        assert_bitwise(f(x), m(x))
    assert_bitwise(m.pos, torch.arange(8.0))


class Returned(nn.Module):
    def __init__(self, view: bool = False) -> None:
        super().__init__()
        self.register_buffer("b", torch.arange(8.0))
        self.drop = nn.Dropout(0.1)
        self.view = view

    def forward(self, x):
        c = self.b.cumsum(0) * 2
        out = self.drop(c)  # eval: c itself, handed to the caller
        return out.view(2, 4) if self.view else out, x + 1


def test_tensor_returned_through_a_dropout_alias_is_not_cached():
    """The caller owns what it is returned: writing it must not change the next call's result."""
    m, x = Returned().eval(), torch.randn(8)
    f = torch.compile(m, backend="nosync", options=EAGER)
    first = f(x)[0]
    first.mul_(0)  # the caller post-processes its output in place
    assert_bitwise(f(x)[0], m(x)[0])
    assert f(x)[0] is not f(x)[0]


class Accumulates(nn.Module):
    """A buffer written in place through the dropout's alias, then read."""

    def __init__(self, hoist: bool) -> None:
        super().__init__()
        self.register_buffer("acc", torch.zeros(4))
        self.drop = nn.Dropout(0.0)
        self.hoist = hoist

    def forward(self, x):
        h = self.drop(self.acc)  # acc itself at run time
        h += x  # writes acc (bumps its version)
        if self.hoist:
            if self.acc.sum() > 2:  # eager reads acc after the write
                return x * 100
            return x
        return self.acc.cumsum(0) * 2 + x


@pytest.mark.parametrize("hoist", [False, True], ids=["cached-cumsum", "hoisted-branch"])
def test_leaf_written_through_a_dropout_alias_is_read_after_the_write(hoist):
    mine, ref = Accumulates(hoist), Accumulates(hoist)
    f = torch.compile(mine, backend="nosync", options={**EAGER, "invariant_cache_bytes": 0 if hoist else 1 << 20})
    for _ in range(4):
        assert_bitwise(f(torch.ones(4)), ref(torch.ones(4)))
    assert_bitwise(mine.acc, ref.acc)


class RowWritten(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rows = [torch.zeros(4) for _ in range(3)]
        self.drop = nn.Dropout(0.0)

    def forward(self, tok, x):
        r = self.rows[tok[0].item()]  # a read used only as an index
        h = self.drop(r)  # the row itself at run time
        h += x  # eager writes self.rows[i]
        return h * 1


def test_row_written_through_a_dropout_alias_is_not_rewritten_to_a_copy():
    mine, ref = RowWritten(), RowWritten()
    f = torch.compile(mine, backend="nosync", options=EAGER)
    tok = torch.tensor([1])
    for _ in range(3):
        assert_bitwise(f(tok, torch.ones(4)), ref(tok, torch.ones(4)))
    for a, b in zip(mine.rows, ref.rows):
        assert_bitwise(a, b)
    assert not [d for d in torchsync_pass.decisions() if d.action is Action.REWRITTEN]


def test_training_dropout_with_p_is_a_new_tensor_for_the_alias_analysis():
    """p > 0 in training draws into a new tensor (a random op: nothing cached or hoisted through
    it); writing its result is not a write to its input, as in eager."""
    (out, inp), = dropout_storages(lambda t: F.dropout(t, 0.5, training=True) + 1, torch.randn(4))
    assert out != inp


def dropout_storages(fn, x) -> list:
    """(storage of each F.dropout node's result, of its input), as nosync's alias analysis sees them."""
    from torchsync_pass import cone

    seen = []

    def backend(gm, ex):
        for n in gm.graph.nodes:
            if n.op == "call_function" and n.target is F.dropout:
                seen.append((cone.storage_of(n), cone.storage_of(n.args[0])))
        return gm.forward

    torch.compile(fn, backend=backend)(x)
    return seen


TAB = torch.arange(40.0).reshape(10, 4)


def stack_into(tok, buf):
    torch.stack([TAB[tok[i].item()] for i in range(tok.shape[0])], out=buf)
    return buf + 0


def test_unrolled_lookup_stacked_with_out_keeps_the_write():
    """``torch.stack(rows, out=buf)`` after an unrolled lookup loop: the fused gather replaced the
    stack and dropped its write into ``buf`` (zeros, or uninitialised memory, came back)."""
    f = torch.compile(stack_into, backend="nosync", options=EAGER)
    for i in range(3):
        tok = torch.tensor([i, 9 - i, 5])
        mine, ref = torch.zeros(3, 4), torch.zeros(3, 4)
        assert_bitwise(f(tok, mine), stack_into(tok, ref))
        assert_bitwise(mine, ref)


class Churn:
    """Euler's ``if s_tmin <= sigma <= s_tmax`` in plain torch: a table read at the step counter,
    compared with float arguments."""

    def __init__(self, n: int = 6) -> None:
        self.sigmas = torch.linspace(10, 0, n)
        self._step_index = 0

    def step(self, x, lo, hi):
        sigma = self.sigmas[self._step_index]
        g = 0.5 if lo <= sigma <= hi else 0.0
        self._step_index += 1
        return x * (1 + g) + sigma


@pytest.mark.parametrize("dynamic", [None, True], ids=["float-changes", "dynamic=True"])
def test_float_that_dynamo_passes_as_a_tensor_is_not_a_table_leaf(dynamic):
    """A float Dynamo stops specialising (it changed between calls, or ``dynamic=True``) reaches the
    graph as a 0-d tensor, while its source still holds the float: table lifting took it as a leaf,
    and the guard's read of its ``_version`` raised ("Guard failed on the same frame it was
    created"). diffusers' Euler with ``s_churn`` and a changed ``s_tmax`` hit it."""
    def run(compile_):
        outs = []
        for lo, hi in [(0.0, 5.0), (0.0, 2.0), (1.0, 9.0), (0.0, 3.0)]:
            s = Churn()
            f = compile_(s.step)
            x = torch.ones(3)
            for _ in range(5):
                x = f(x, lo, hi)
                outs.append(x)
        return outs

    ref = run(lambda f: f)
    got = run(lambda f: torch.compile(f, backend="nosync", dynamic=dynamic, options=EAGER))
    for a, b in zip(got, ref):
        assert_bitwise(a, b)
    assert not [d for d in torchsync_pass.decisions() if d.action is Action.HOISTED and "hi" in d.leaves]


# Views of the dropout's result: their trace values are views of the trace's copy, not of the input.
class CachedThenWrittenThroughView(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.register_buffer("pos", torch.arange(8.0))
        self.how = how

    def forward(self, x):
        pe = torch.sin(self.pos * 0.5)
        h = F.dropout(pe, 0.5, training=False)  # pe itself at run time
        if self.how == "view":
            h.view(2, 4).add_(x.view(2, 4))
        else:
            h.unsqueeze(0).mul_(x)
        return pe * 2


@pytest.mark.parametrize("how", ["view", "unsqueeze"])
def test_cached_tensor_written_through_a_view_of_a_dropout_alias(how):
    m, x = CachedThenWrittenThroughView(how), torch.full((8,), 1.5)
    f = torch.compile(m, backend="nosync", options=EAGER)
    for _ in range(3):
        assert_bitwise(f(x), m(x))


def test_tensor_returned_as_a_view_of_a_dropout_alias_is_not_cached():
    m, x = Returned(view=True).eval(), torch.randn(8)
    f = torch.compile(m, backend="nosync", options=EAGER)
    f(x)[0].mul_(0)  # the caller writes what it was returned
    assert_bitwise(f(x)[0], m(x)[0])
    assert f(x)[0].untyped_storage().data_ptr() != f(x)[0].untyped_storage().data_ptr()


class AccumulatesThroughView(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("acc", torch.zeros(4))
        self.drop = nn.Dropout(0.0)

    def forward(self, x):
        self.drop(self.acc).view(2, 2).add_(x.view(2, 2))  # writes acc
        if self.acc.sum() > 2:
            return x * 100
        return x


def test_hoisted_leaf_written_through_a_view_of_a_dropout_alias():
    mine, ref = AccumulatesThroughView(), AccumulatesThroughView()
    f = torch.compile(mine, backend="nosync", options={**EAGER, "invariant_cache_bytes": 0})
    for _ in range(3):
        assert_bitwise(f(torch.ones(4)), ref(torch.ones(4)))
    assert_bitwise(mine.acc, ref.acc)


def test_training_dropout_of_an_empty_tensor_returns_its_input():
    """Eager returns an empty input itself even in training with p > 0 (nothing to draw)."""
    x = torch.zeros(0)
    assert F.dropout(x, 0.5, training=True) is x
    (out, inp), = dropout_storages(lambda t: F.dropout(t, 0.5, training=True) + 1, x)
    assert out == inp


class KeywordInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("pos", torch.arange(8.0))

    def forward(self, x):
        pe = torch.sin(self.pos * 0.5)
        h = F.dropout(input=pe, p=0.0, training=True)  # Dynamo keeps the keyword: no positional args
        h += x
        return h * 2


def test_dropout_with_its_input_as_a_keyword_is_followed():
    m, x = KeywordInput(), torch.ones(8)
    f = torch.compile(m, backend="nosync", options=EAGER)
    for _ in range(3):
        assert_bitwise(f(x), m(x))


def two_selects(x, t):
    a = x * 2
    d1 = F.dropout(a, 0.0, True)  # a itself at run time
    d2 = F.dropout(a, 0.0, True)  # a itself at run time
    y1 = d1 if t[0] > 0 else x + 1
    y2 = d2 if t[1] > 0 else x - 1
    return y1, y2


def test_two_selects_whose_arms_are_one_tensor_in_eager_are_not_rewritten_to_copies():
    """In eager ``y1 is y2`` when both tests pass (both are ``a``): selects returning two copies
    would let a caller's write to one output miss the other."""
    f = torch.compile(two_selects, backend="nosync", options=EAGER)
    x = torch.tensor([1.0, 2.0, 3.0])
    for s in range(8):
        t = torch.tensor([1 if s % 2 == 0 else -1, 1 if s % 3 != 1 else -1])
        (e1, e2), (g1, g2) = two_selects(x, t), f(x, t)
        assert (e1 is e2) == (g1 is g2)
        e1.add_(100)
        g1.add_(100)  # the caller post-processes its first output in place
        assert_bitwise(g1, e1)
        assert_bitwise(g2, e2)


class BatchNormThroughDropout(nn.Module):
    """A hoisted sync on a buffer that a training batch norm updates after it (behind the version
    counter), through an identity dropout added to the graph after the sync."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("stats", torch.zeros(3))
        self.register_buffer("var", torch.ones(3))

    def forward(self, x, *extras):
        for e in extras:
            _ = e.shape[0]  # inputs read for metadata only: Dynamo removes them after tracing
        s = 100.0 if self.stats.sum() > 1.0 else 1.0
        rm = F.dropout(self.stats, 0.0, True)  # stats itself at run time
        y = F.batch_norm(x, rm, self.var, None, None, True, 0.5)  # writes stats, no version bump
        return y * s


def test_alias_map_is_not_stale_when_the_graph_changes_after_the_sync():
    """The map of identity dropouts was cached per graph by node count; with 6 inputs Dynamo
    removes after tracing, the count at the sync came back, and the stale map (no dropout) hid the
    batch norm's write to the hoisted leaf: calls 1 to 4 answered with the value before the write."""
    mine, ref = BatchNormThroughDropout(), BatchNormThroughDropout()
    f = torch.compile(mine, backend="nosync", options={**EAGER, "invariant_cache_bytes": 0})
    extras = [torch.zeros(2) for _ in range(6)]
    for i in range(5):
        x = torch.arange(12.0).view(4, 3) + i
        assert_bitwise(f(x, *extras), ref(x, *extras))
    assert_bitwise(mine.stats, ref.stats)

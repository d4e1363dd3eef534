"""Table lifting: syncs on request-invariant tables read at a Python int step counter.

The pattern is a diffusers scheduler's ``sigma = self.sigmas[self._step_index]; if sigma ...``:
Dynamo makes ``_step_index`` dynamic after it changes once, and nosync then answers the sync from
a host mirror of the tables (one sync per request), never per step. Every run is compared bitwise
with eager; syncs are counted with ``count_syncs()``; graphs with the backend's own record.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

import torchsync_pass
from torchsync_pass import Action, NosyncBackend, Reason


class Sched:
    """A scheduler in miniature: per-request tables and a Python int step counter."""

    def __init__(self, n: int = 8, start: float = 1.0) -> None:
        self.sigmas = torch.linspace(start, 0.0, n + 1)
        self.alphas = torch.linspace(0.5, 2.0, n + 1)
        self._step_index = 0


def two_tables(s, x):
    sigma = s.sigmas[s._step_index]
    if sigma * s.alphas[s._step_index] >= 0:  # True at every index: one answer
        x = x * sigma + s.alphas[s._step_index + 1]
    else:
        x = x - sigma
    s._step_index += 1
    return x


def threshold(s, x):
    if s.sigmas[s._step_index] > 0.5:  # True for the first half of the steps, then False
        x = x * 2
    else:
        x = x + 1
    s._step_index += 1
    return x


def assert_bitwise(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
    assert torch.equal(a, b), (a - b).abs().max()


def run_request(fn, sched, steps, x=None):
    """Run ``steps`` steps of ``fn`` on ``sched``; (output, syncs per step)."""
    x = torch.ones(4) if x is None else x
    per_step = []
    for _ in range(steps):
        with torchsync_pass.count_syncs() as c:
            x = fn(sched, x)
        per_step.append(c.total)
    return x, per_step


def stock_graphs(fn, requests, steps) -> int:
    stock = CompileCounterWithBackend("eager")
    compiled = torch.compile(fn, backend=stock)
    for r in range(requests):
        run_request(compiled, Sched(), steps)
    torch._dynamo.reset()
    return stock.frame_count


def lifted():
    return [d for d in torchsync_pass.decisions() if d.reason is Reason.TABLE_LIFTED]


def compile_nosync(fn, **options):
    options.setdefault("codegen", "eager")
    backend = NosyncBackend(options)
    return torch.compile(fn, backend=backend), backend


def test_several_tables_at_one_index_are_lifted_sync_free():
    stock = stock_graphs(two_tables, 2, 8)
    f, backend = compile_nosync(two_tables)
    for _ in range(3):
        out, syncs = run_request(f, Sched(), 8)
        ref, _ = run_request(two_tables, Sched(), 8)
        assert_bitwise(out, ref)
        assert sum(syncs) <= 1  # the mirror of a new request's tables, once
        assert syncs[2:] == [0] * 6  # every steady step
    (d,) = lifted()
    assert d.action is Action.HOISTED and d.leaves == ("s.sigmas", "s.alphas", "s._step_index")
    assert "1 distinct answer" in d.detail
    assert len(backend.compiled) <= stock  # one graph per compile, no more compiles than stock


def test_table_written_in_place_mid_request_is_seen():
    f, _ = compile_nosync(threshold)
    s, e = Sched(), Sched()
    x, y = torch.ones(4), torch.ones(4)
    for i in range(8):
        if i == 5:
            for t in (s, e):
                t.sigmas[5:] = 0.9  # the remaining steps now take the other branch
        x, y = f(s, x), threshold(e, y)
        assert_bitwise(x, y)
    assert lifted()
    assert counters["nosync"]["guard_syncs"] >= 1  # the write was noticed: the mirror was re-run


def test_new_tables_per_request_cost_one_sync_each():
    f, backend = compile_nosync(two_tables)
    run_request(f, Sched(), 8)
    graphs = len(backend.compiled)
    for start in (1.0, 2.0, 3.0):
        s = Sched(start=start)  # set_timesteps: new tensors every request
        out, syncs = run_request(f, s, 8)
        ref, _ = run_request(two_tables, Sched(start=start), 8)
        assert_bitwise(out, ref)
        assert sum(syncs) == 1, syncs
    assert len(backend.compiled) == graphs  # the same cache entry serves every request


def test_index_out_of_range_raises_as_eager():
    stock = torch.compile(threshold, backend="eager")
    f, _ = compile_nosync(threshold)
    errors = []
    for fn in (threshold, stock, f):
        s, x = Sched(n=4), torch.ones(4)
        for _ in range(5):  # indices 0..4: every entry of the 5-entry table
            x = fn(s, x)
        with pytest.raises(IndexError) as err:
            fn(s, x)
        errors.append(str(err.value))
        torch._dynamo.reset()
    assert lifted()  # the steps before were answered from the mirror
    assert "index 5 is out of bounds" in errors[0]
    assert errors[2] == errors[1]  # Dynamo's own trace-time IndexError, as with stock


def test_index_outside_the_mirror_is_left_to_eager():
    f, _ = compile_nosync(threshold)
    run_request(f, Sched(), 8)
    s, e = Sched(), Sched()
    s._step_index = e._step_index = -3  # valid for eager, not mirrored (0..n-1)
    x, y = torch.ones(4), torch.ones(4)
    for _ in range(3):
        x, y = f(s, x), threshold(e, y)
        assert_bitwise(x, y)
    outside = [d for d in torchsync_pass.decisions() if d.reason is Reason.TABLE_INDEX_OUTSIDE]
    assert outside and "s._step_index = -3; the tables answer at 0..8" in outside[0].detail


def test_answers_that_differ_per_step_are_bounded_and_guards_stay_sync_free():
    f, backend = compile_nosync(threshold)
    for r in range(3):
        out, syncs = run_request(f, Sched(), 8)
        ref, _ = run_request(threshold, Sched(), 8)
        assert_bitwise(out, ref)
        assert sum(syncs) <= 1, syncs  # the mirror once; no guard check ever syncs
    answers = {d.value for d in lifted()}
    assert answers == {"True", "False"}
    # index 0 specialised, then one dynamic entry per distinct answer; nothing new after request 1
    assert len(backend.compiled) == 3


def test_more_answers_than_max_specializations_are_not_lifted():
    def read(s, x):
        v = s.sigmas[s._step_index].item()  # a different value at every step
        s._step_index += 1
        return x * v

    f, backend = compile_nosync(read, max_specializations=3)
    out, syncs = run_request(f, Sched(), 8)
    ref, _ = run_request(read, Sched(), 8)
    assert_bitwise(out, ref)
    varying = [d for d in torchsync_pass.decisions() if d.reason is Reason.TABLE_STEP_VARYING]
    assert varying and "9 distinct answers" in varying[0].detail
    assert not lifted()
    assert len(backend.compiled) <= 4  # no recompile storm


def test_interleaved_requests_with_different_tables():
    f, _ = compile_nosync(threshold)
    run_request(f, Sched(), 8)  # warm: every cache entry compiled
    a, b = Sched(start=1.0), Sched(start=0.7)
    ea, eb = Sched(start=1.0), Sched(start=0.7)
    xa = xb = ya = yb = torch.ones(4)
    syncs = []
    for _ in range(8):
        with torchsync_pass.count_syncs() as c:
            xa = f(a, xa)
            xb = f(b, xb)
        syncs.append(c.total)
        ya, yb = threshold(ea, ya), threshold(eb, yb)
    assert_bitwise(xa, ya)
    assert_bitwise(xb, yb)
    assert sum(syncs) == 2, syncs  # one mirror per request; the memo keeps both


def _breaker(x):
    torch._dynamo.graph_break()
    return x


def handed_across(x):
    y = (x * 2) + _breaker(x)  # x * 2 is on the stack at the break
    return x * y.sum().item()


def test_values_handed_across_a_break_are_never_speculated():
    stock = CompileCounterWithBackend("eager")
    g = torch.compile(handed_across, backend=stock)
    for i in range(6):
        g(torch.full((3,), float(i)))
    torch._dynamo.reset()

    f, backend = compile_nosync(handed_across)
    for i in range(6):
        x = torch.full((3,), float(i))
        assert_bitwise(f(x), handed_across(x))
    reasons = {d.reason for d in torchsync_pass.decisions()}
    assert Reason.CROSS_BREAK_INPUT in reasons
    assert Action.DEMOTED not in {d.action for d in torchsync_pass.decisions()}
    assert len(backend.compiled) <= stock.frame_count


def decreasing(s, x):
    # the mirror runs this cone at every index of sigmas; at the last, sigmas[i + 1] is past the end
    if s.sigmas[s._step_index] > s.sigmas[s._step_index + 1]:
        x = x * 2
    else:
        x = x + 1
    s._step_index += 1
    return x


def test_mirror_is_silent_at_indices_past_a_tables_end(capfd):
    f, _ = compile_nosync(decreasing)
    for _ in range(2):
        out, syncs = run_request(f, Sched(), 8)
        ref, _ = run_request(decreasing, Sched(), 8)
        assert_bitwise(out, ref)
        assert syncs[2:] == [0] * 6
    (d,) = lifted()
    assert d.action is Action.HOISTED
    err = capfd.readouterr().err
    # torch.fx's GraphModule.__call__ printed this for the expected IndexError at the last index
    assert "FX-traced Module" not in err and "IndexError" not in err, err

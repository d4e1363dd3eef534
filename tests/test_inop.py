"""Syncs inside ops: ``torch.linalg.solve`` on request-invariant tables at a step counter.

The loop is diffusers' UniPC corrector in miniature (no diffusers needed): a scheduler object with a
per-request ``sigmas`` table and a Python int ``_step_index``; every step solves a 2x2 system built
from ``sigmas[i]`` and ``sigmas[i + 1]``. ``torch.linalg.solve`` syncs 3 times per call inside the op
(error and pivot checks). With ``codegen="eager"`` nosync tabulates the solve once per request
(:mod:`torchsync_pass.inop`); every call is compared bitwise with eager, syncs are counted with
``count_syncs()``, and a singular system must still raise ``torch.linalg.LinAlgError`` at the call
where eager raises it.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import torchsync_pass
from torchsync_pass import Action, NosyncBackend, Reason
from torchsync_pass.inop import BATCHED_CPU, BATCHED_CPU_MAX_ORDER, SYNCING_OPS, _Batch


class Sched:
    def __init__(self, n: int = 8, start: float = 1.0) -> None:
        self.sigmas = torch.linspace(start, 0.1, n + 1)
        self._step_index = 0


def corrector(s, x):
    """UniPC's ``rhos_c = torch.linalg.solve(R, b)`` on the table at the step counter."""
    i = s._step_index
    s0, s1 = s.sigmas[i], s.sigmas[i + 1]
    one = torch.ones(())
    h = torch.log(s1) - torch.log(s0)
    R = torch.stack([torch.stack([one, s0]), torch.stack([one, s1])])
    b = torch.stack([torch.expm1(h), h * 0.5])
    rhos = torch.linalg.solve(R, b)
    s._step_index += 1
    return x * rhos[0] + rhos[1]


def assert_bitwise(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
    assert torch.equal(a, b), (a - b).abs().max()


def nosync(fn=corrector):
    return torch.compile(fn, backend=NosyncBackend({"codegen": "eager"}))


def run(fn, sched, steps, x):
    """Run ``steps`` steps; (outputs of every step, syncs of every step)."""
    outs, syncs = [], []
    for _ in range(steps):
        with torchsync_pass.count_syncs() as c:
            x = fn(sched, x)
        outs.append(x)
        syncs.append(c.total)
    return outs, syncs


def eager_outputs(sigmas, steps, x):
    s = Sched()
    s.sigmas = sigmas.clone()
    return run(corrector, s, steps, x)[0]


def tabulated():
    return [d for d in torchsync_pass.decisions() if d.action is Action.TABULATED]


def skip_unless_in_op_syncs_are_counted():
    """count_syncs sees a sync inside an op through the profiler (not where another profiler is
    active or the profiler cannot run)."""
    with torchsync_pass.count_syncs() as c:
        torch.linalg.solve(torch.eye(2), torch.ones(2))
    if c.total == 0:
        pytest.skip("count_syncs sees no sync inside ops on this torch build")


def test_solve_tabulated_no_steady_sync_bitwise():
    skip_unless_in_op_syncs_are_counted()
    x = torch.randn(4, generator=torch.Generator().manual_seed(0))
    f = nosync()
    eager_syncs = run(corrector, Sched(), 8, x)[1]
    assert eager_syncs[1:] == [3] * 7  # torch.linalg.solve syncs 3 times per call, eagerly
    for r in range(3):
        s = Sched(start=1.0 - 0.1 * r)
        ref = eager_outputs(s.sigmas, 8, x)
        outs, syncs = run(f, s, 8, x)
        for a, b in zip(outs, ref):
            assert_bitwise(a, b)
        if r:  # a new request: one batched solve over every index of its table (3 syncs), once
            assert sum(syncs) == 3 and syncs[2:] == [0] * 6, syncs
    ds = tabulated()
    assert ds and all(d.reason is Reason.IN_OP_TABULATED and d.kind == "in_op" for d in ds)
    assert any("torch.linalg.solve(R, b)" in d.source for d in ds)
    assert counters["nosync"]["tabulated"] == len(ds)
    assert counters["nosync"]["table_computes"] >= 3


def _table(sig):
    s = Sched()
    s.sigmas = sig.clone()
    return s


def test_singular_system_still_raises_linalgerror():
    sig = torch.linspace(1.0, 0.1, 9)
    sig[5] = sig[4]  # sigmas[4] == sigmas[5]: R is singular at step 4
    expect = run(corrector, _table(sig), 4, torch.ones(4))[0]
    with pytest.raises(torch.linalg.LinAlgError) as eager_err:
        run(corrector, _table(sig), 5, torch.ones(4))
    f = nosync()
    run(f, Sched(), 8, torch.ones(4))  # a good request compiles and tabulates the solve
    assert tabulated()
    s, x, outs = _table(sig), torch.ones(4), []
    with pytest.raises(torch.linalg.LinAlgError) as err:
        for _ in range(5):
            x = f(s, x)
            outs.append(x)
    assert len(outs) == 4  # raised at the same call as eager, not earlier (while tabulating)
    assert str(err.value) == str(eager_err.value) and "singular" in str(err.value)
    for a, b in zip(outs, expect):
        assert_bitwise(a, b)
    # the next (good) request is tabulated and sync-free again
    syncs = run(f, Sched(start=0.9), 8, torch.ones(4))[1]
    assert syncs[-3:] == [0, 0, 0], syncs


def test_table_written_in_place_mid_request_recomputes():
    x = torch.ones(4)
    f = nosync()
    run(f, Sched(), 8, x)
    s, e = Sched(), Sched()
    outs_f, outs_e = [], []
    xf = xe = x
    for k in range(8):
        if k == 4:
            s.sigmas[6] = 0.55  # an in-place write to the table, mid request
            e.sigmas[6] = 0.55
        before = counters["nosync"]["table_computes"]
        xf, xe = f(s, xf), corrector(e, xe)
        assert_bitwise(xf, xe)
        if k == 4:
            assert counters["nosync"]["table_computes"] == before + 1  # recomputed, not stale
    assert tabulated()


def test_new_request_and_interleaved_requests():
    x = torch.ones(4)
    f = nosync()
    run(f, Sched(), 8, x)  # compile both graphs (specialised index 0, then the dynamic index)
    starts = (0.8, 0.6)  # two requests, A and B, one step of each in turn
    nosync_state = [[Sched(start=v), x] for v in starts]
    eager_state = [[Sched(start=v), x] for v in starts]
    computes = counters["nosync"]["table_computes"]
    syncs = []
    for _ in range(8):
        with torchsync_pass.count_syncs() as c:
            for st in nosync_state:
                st[1] = f(*st)
        syncs.append(c.total)
        for st, ref in zip(nosync_state, eager_state):
            ref[1] = corrector(*ref)
            assert_bitwise(st[1], ref[1])
    # each new request's tables are computed once (two graphs share them), then A and B hit the memo
    assert counters["nosync"]["table_computes"] - computes <= 4
    assert syncs[2:] == [0] * 6, syncs
    assert counters["nosync"]["table_hits"] > 0


def solve_input(A, x):
    return torch.linalg.solve(A, x) * 2


def test_leaves_that_change_every_call_are_demoted():
    f = torch.compile(solve_input, backend=NosyncBackend({"codegen": "eager"}))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, generator=g)
    for _ in range(8):
        A = torch.randn(3, 3, generator=g) + 3 * torch.eye(3)
        assert_bitwise(f(A, x), solve_input(A, x))
    demoted = [d for d in torchsync_pass.decisions() if d.action is Action.DEMOTED and d.kind == "in_op"]
    assert len(demoted) == 1 and demoted[0].reason is Reason.LEAVES_CHANGE
    assert counters["nosync"]["table_computes"] == 3  # bounded waste, then the original op runs


def returns_solution(s, x):
    i = s._step_index
    R = torch.stack([torch.stack([torch.ones(()), s.sigmas[i]]), torch.stack([torch.ones(()), s.sigmas[i + 1]])])
    s._step_index += 1
    return x, torch.linalg.solve(R, torch.ones(2))


def test_returned_result_is_kept_with_reason():
    skip_unless_in_op_syncs_are_counted()
    f = torch.compile(returns_solution, backend=NosyncBackend({"codegen": "eager"}))
    s, e = Sched(), Sched()
    for _ in range(4):
        got, ref = f(s, torch.ones(2)), returns_solution(e, torch.ones(2))
        assert_bitwise(got[1], ref[1])
    kept = [d for d in torchsync_pass.decisions() if d.kind == "in_op"]
    assert kept and all(d.action is Action.KEPT and d.reason is Reason.IN_OP_ALIASED for d in kept)
    with torchsync_pass.count_syncs() as c:
        f(s, torch.ones(2))
    assert c.total == 3  # kept: the op still syncs, as stock


@pytest.mark.parametrize("op", sorted(SYNCING_OPS, key=lambda o: o.__name__), ids=lambda o: o.__name__)
def test_syncing_ops_table_is_measured(op):
    """Each op in SYNCING_OPS makes the number of in-op syncs the table says (this torch, CPU)."""
    from torch.profiler import ProfilerActivity, profile

    A = torch.tensor([[4.0, 1.0], [1.0, 3.0]])
    b = torch.tensor([1.0, 2.0])
    args = {
        "solve": (A, b), "solve_ex": (A, b), "inv": (A,), "inv_ex": (A,), "inverse": (A,),
        "lu_factor": (A,), "lu_solve": (*torch.linalg.lu_factor(A), b[:, None]), "cholesky": (A,),
        "cholesky_solve": (b[:, None], torch.linalg.cholesky(A)),
        "eigh": (A,), "eigvalsh": (A,), "svd": (A,), "svdvals": (A,), "pinv": (A,), "matrix_rank": (A,),
    }[op.__name__.replace("linalg_", "")]
    with profile(activities=[ProfilerActivity.CPU]) as p:
        op(*args)
    n = sum(1 for e in p.events() if e.name == "aten::_local_scalar_dense")
    assert n == SYNCING_OPS[op][0], (op.__name__, n)


@pytest.mark.parametrize("op", sorted(BATCHED_CPU, key=lambda o: o.__name__), ids=lambda o: o.__name__)
def test_batched_op_is_bitwise_per_matrix(op):
    """The measurement behind BATCHED_CPU: on CPU, each slice of a batched call, laid out as a call
    on that matrix alone lays it out, has the bits, dtype, shape and strides of that call."""
    g = torch.Generator().manual_seed(0)
    orders = range(1, BATCHED_CPU_MAX_ORDER.get(op, 40) + 1)  # every order that is batched (cholesky: 1..40)
    for k in orders:
        for dtype in (torch.float32, torch.float64):
            A = torch.randn(6, k, k, generator=g, dtype=dtype) + k * torch.eye(k, dtype=dtype)
            A = A @ A.mT  # symmetric positive definite: cholesky too
            cases = [(A, torch.randn(6, k, generator=g, dtype=dtype)),
                     (A, torch.randn(6, k, 3, generator=g, dtype=dtype))] if op is torch.linalg.solve else [(A,)]
            for inputs in cases:
                single = [op(*(t[i] for t in inputs)) for i in range(6)]
                batch = _Batch(None, op, tuple(_slot(j) for j in range(len(inputs))), {}, single[0], BATCHED_CPU[op])
                out = batch._call(inputs)
                for i in range(6):
                    assert_bitwise(batch._layout(out[i]), single[i])


def test_batched_slices_are_fresh_tensors_and_large_orders_run_alone():
    """A table entry is never a view into the batch (``as_strided(..., 0)`` read index 0's matrix),
    and ``solve``/``inv`` above BATCHED_CPU_MAX_ORDER (float64 k = 9: other bits in a batch) are
    computed one index at a time, bitwise equal to eager (review 10)."""
    A = torch.tensor([[4.0, 1.0, 0.0], [1.0, 3.0, 1.0], [0.0, 1.0, 2.0]])

    class S:
        def __init__(self) -> None:
            self.table, self._step_index = torch.linspace(0.5, 2.0, 9), 0

    def step(s, x):
        r = torch.linalg.inv(A * s.table[s._step_index] + torch.eye(3))
        s._step_index += 1
        return x + r.as_strided((3, 3), r.stride(), 0)

    f = torch.compile(step, backend=NosyncBackend({"codegen": "eager"}))
    s, e = S(), S()
    for _ in range(6):
        assert_bitwise(f(s, torch.zeros(3, 3)), step(e, torch.zeros(3, 3)))

    g = torch.Generator().manual_seed(1)
    M = torch.randn(11, 11, dtype=torch.float64, generator=g)
    b = torch.randn(11, dtype=torch.float64, generator=g)

    def solve_step(s, x):
        out = torch.linalg.solve(torch.eye(11, dtype=torch.float64) * s.table[s._step_index] + M, b)
        s._step_index += 1
        return x + out

    h = torch.compile(solve_step, backend=NosyncBackend({"codegen": "eager"}))
    s, e = S(), S()
    for _ in range(8):
        assert_bitwise(h(s, torch.zeros(11, dtype=torch.float64)), solve_step(e, torch.zeros(11, dtype=torch.float64)))


@pytest.mark.parametrize("dtype, left", [(torch.float64, False), (torch.complex64, True)])
def test_solve_batched_only_where_measured_bitwise(dtype, left):
    """``solve(A, B, left=False)`` and complex ``solve`` had other bits in a batch than alone even
    at k <= 8 (review 10): they are tabulated one index at a time, bitwise equal to eager."""
    g = torch.Generator().manual_seed(1)
    k, m = (5, 16) if left is False else (7, 33)
    M = torch.randn(k, k, dtype=dtype, generator=g)
    B = torch.randn(m, k, dtype=dtype, generator=g) if left is False else torch.randn(k, m, dtype=dtype, generator=g)

    class S:
        def __init__(self) -> None:
            self.table, self._step_index = torch.linspace(0.5, 2.0, 9, dtype=torch.float64), 0

    def step(s, x):
        A = torch.eye(k, dtype=dtype) * (3 + s.table[s._step_index]) + M
        s._step_index += 1
        return x + torch.linalg.solve(A, B, left=left)

    h = torch.compile(step, backend=NosyncBackend({"codegen": "eager"}))
    s, e = S(), S()
    for _ in range(6):
        x = torch.zeros(B.shape, dtype=dtype)
        assert_bitwise(h(s, x), step(e, x))


def _slot(j):
    from torchsync_pass.inop import _Slot

    return _Slot(j)


class Table2:
    def __init__(self, start=0.5):
        self.table = torch.linspace(start, 2.0, 9)
        self._step_index = 0


def spd(t):
    v = torch.stack([t, t * 0.5, t * 0.25])
    return torch.eye(3) * 4.0 + torch.outer(v, v)


OPS = {
    "solve_vector": lambda A: torch.linalg.solve(A, torch.tensor([1.0, 2.0, 3.0])),
    "solve_matrix": lambda A: torch.linalg.solve(A, torch.arange(6.0).reshape(3, 2)),
    "inv": torch.linalg.inv,
    "cholesky": torch.linalg.cholesky,
    "eigh_values": lambda A: torch.linalg.eigh(A)[0],  # tabulated one index at a time (not batched)
}


@pytest.mark.parametrize("name", sorted(OPS))
def test_tabulated_ops_bitwise_with_strides(name):
    op = OPS[name]

    def step(s, x):
        out = op(spd(s.table[s._step_index]))
        s._step_index += 1
        return x + out * 2.0

    f = torch.compile(step, backend=NosyncBackend({"codegen": "eager"}))
    for r in range(3):
        s, e = Table2(0.5 + 0.1 * r), Table2(0.5 + 0.1 * r)
        syncs = []
        for _ in range(8):
            x = torch.full((3, 1), 0.5)
            with torchsync_pass.count_syncs() as c:
                got = f(s, x)
            syncs.append(c.total)
            ref = step(e, x)
            assert_bitwise(got, ref)
        if r:
            assert syncs[1:] == [0] * 7, syncs
    assert tabulated()


def test_explain_marks_the_tabulated_op_at_its_line(capsys):
    import json
    import os

    from torchsync_pass import explain

    script = os.path.join(os.path.dirname(__file__), "scripts", "inop_demo.py")
    rc = explain.main(["--json", "--progress", "0", script])
    rep = json.loads(capsys.readouterr().out)
    assert rc == 0
    with open(script) as f:
        (line,) = [i for i, t in enumerate(f, 1) if t.rstrip().endswith("# SITE solve")]
    rows = [s for s in rep["sites"] if s["line"] == line and s["file"].endswith("inop_demo.py")]
    assert len(rows) == 1 and rows[0]["nosync"]["action"] == "tabulated"
    assert rows[0]["nosync"]["reason"] == "IN_OP_TABULATED"
    # 3 requests, 6 steps each: eagerly 18 solves (54 syncs); tabulated: one batched solve per request
    # after the first (whose tabulation ran while the profiler was stopped for a compile)
    assert rows[0]["kind"] == "in_op" and rows[0]["count"] <= 9, rows[0]
    assert any(d["action"] == "tabulated" and d["kind"] == "in_op" for d in rep["nosync"])


@pytest.mark.inductor
def test_inductor_keeps_the_op_and_says_why():
    f = torch.compile(corrector, backend=NosyncBackend({"codegen": "inductor"}))
    s = Sched()
    for _ in range(3):
        f(s, torch.ones(4))
    kept = [d for d in torchsync_pass.decisions() if d.kind == "in_op"]
    assert kept and all(d.action is Action.KEPT and d.reason is Reason.IN_OP_INDUCTOR for d in kept)
    assert "torch.linalg.solve(R, b)" in kept[0].source
    with torchsync_pass.count_syncs() as c:
        f(s, torch.ones(4))
    assert c.by_kind.get("in_op") == 3  # kept: the op syncs inside, as under stock Inductor


def test_table_of_an_inference_mode_request_is_not_served_to_grad_mode():
    """Values computed under inference_mode are inference tensors: a later grad-mode call of the
    same request must not get them (autograd cannot save them for backward): one table per mode."""
    f, s, ref = nosync(), Sched(), Sched()
    x = torch.randn(4, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        for _ in range(3):
            assert_bitwise(f(s, x), corrector(ref, x))
    xg, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, want = f(s, xg), corrector(ref, xr)
    assert_bitwise(out, want)
    out.sum().backward()
    want.sum().backward()
    assert_bitwise(xg.grad, xr.grad)
    assert tabulated()

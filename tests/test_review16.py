"""Review 16 (2026-12-07): each test failing on the commit before its fix."""

from __future__ import annotations

import json
import textwrap
import warnings

import pytest
import torch

import torchsync_pass
from torchsync_pass import dynamo_hooks, explain


def test_explain_keeps_what_the_script_compiled_across_its_own_reset(tmp_path, capsys):
    """A script that reloads its model (``torch._dynamo.reset(); torchsync_pass.reset()``, what the
    README recommends) after nosync hoisted: explain still lists the decision and the graph, and
    does not claim the backend did not run (it read the log that ``reset()`` empties)."""
    script = tmp_path / "reload.py"
    script.write_text(textwrap.dedent("""
        import torch, torchsync_pass
        def step(x, t):
            if (t == 1).any():
                return x * 2
            return x
        c = torch.compile(step, backend="nosync", options={"codegen": "eager"})
        t = torch.tensor([0, 1])
        for _ in range(3):
            c(torch.ones(2), t)
        torch._dynamo.reset(); torchsync_pass.reset()
    """))
    torch._dynamo.reset()
    torchsync_pass.reset()
    assert explain.main(["--json", "--progress", "0", str(script)]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert [(d["action"], d["site"]["line"]) for d in rep["nosync"]] == [("hoisted", 4)]
    assert rep["nosync_graphs"] == 1
    assert "did not run" not in explain.render_text(rep)
    # and the verification list of --verify, from the same record
    torch._dynamo.reset()
    torchsync_pass.reset()
    assert explain.main(["--json", "--progress", "0", "--verify", str(script)]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert [v["status"] for v in rep["verification"]] == ["PASSED"]


def _syncs_per_call(fn, calls, backend):
    """``(run-time, compile-time)`` syncs of each call of ``fn`` compiled with ``backend``."""
    torch._dynamo.reset()
    torchsync_pass.reset()
    opts = {"codegen": "eager"} if backend == "nosync" else None
    g = torch.compile(fn, backend=backend, options=opts)
    rows, outs = [], []
    for args in calls:
        with torchsync_pass.count_syncs() as c:
            try:
                outs.append(g(*args))
            except RuntimeError as e:
                outs.append(type(e))
        rows.append((c.total, c.compile_time))
    return rows, outs


def _short_circuit(x, a, b):
    if a.item() > 0:
        return x + 1
    if b.item() > 0:
        return x + 2
    return x + 3


@torch._dynamo.config.patch(automatic_dynamic_shapes=False)
def test_a_demoted_site_does_not_sync_while_dynamo_logs_why_it_recompiles():
    """Dynamo asks the old cache entries' guards why a call recompiles; a demoted site's guard
    re-ran its cone there (one read stock does not make) because it skipped its "demoted: fail"
    answer whenever a compile was running, meant for the fresh entry's own check only."""
    x = torch.ones(2)
    vals = [(-1.0, 1.0), (-1.0, 1.0), (1.0, 1.0), (1.0, -1.0), (-1.0, -1.0), (-1.0, 1.0), (1.0, 1.0)]
    calls = [(x, torch.tensor(a), torch.tensor(b)) for a, b in vals]  # new tensors every call
    stock, so = _syncs_per_call(_short_circuit, calls, "eager")
    ours, no = _syncs_per_call(_short_circuit, calls, "nosync")
    for a, b in zip(so, no):
        assert torch.equal(a, b)
    assert all(sum(o) <= sum(s) for o, s in zip(ours, stock)), (ours, stock)


def _branch_on(x, s):
    if s:
        return x + 1
    return x - 1


def test_a_uint64_test_is_not_selected_on_the_device():
    """``if s:`` on a uint64 tensor of 2**63 or more raises in eager (bool() goes through int64);
    the device-side select took the true arm and returned a value."""
    x = torch.ones(3)
    for seq in ([2**63], [0, 2**63, 1], [2**64 - 1, 0]):
        calls = [(x, torch.tensor(v, dtype=torch.uint64)) for v in seq]
        eager = []
        for args in calls:
            try:
                eager.append(_branch_on(*args))
            except RuntimeError as e:
                eager.append(type(e))
        _, outs = _syncs_per_call(_branch_on, calls, "nosync")
        for e, o in zip(eager, outs):
            assert (torch.equal(e, o) if isinstance(e, torch.Tensor) else e is o), (seq, eager, outs)
        if dynamo_hooks._torch_version() >= dynamo_hooks.SELECT_MIN_TORCH:  # no select before 2.13
            assert any(d.reason.name == "BRANCH_VALUES" and "uint64" in d.detail for d in torchsync_pass.decisions())


def _two_reads(x, t, g):
    if (t == 1).any():
        x = x * 2
    if g.item() > 1.0:
        x = x + g
    return x


@torch._dynamo.config.patch(recompile_limit=1)
def test_recompile_limit_one_hoists_nothing():
    """With ``recompile_limit = 1`` a hoisted value that changes can never recompile: Dynamo ran
    every later request's frame uncompiled, after the guard's syncs (10 requests x 5 steps: 105
    syncs against stock's 100). Now nothing is hoisted there: stock's counts, every call compiled."""
    x = torch.randn(3)
    calls = []
    for r in range(4):
        t, g = torch.tensor([0, r % 2]), torch.tensor(float(r))
        calls += [(x, t, g)] * 3
    stock, so = _syncs_per_call(_two_reads, calls, "eager")
    ours, no = _syncs_per_call(_two_reads, calls, "nosync")
    for a, b in zip(so, no):
        assert torch.equal(a, b)
    assert [sum(r) for r in ours] == [sum(r) for r in stock]
    assert {(d.action.name, d.reason.name) for d in torchsync_pass.decisions()} >= {("DEMOTED", "RECOMPILE_BUDGET")}
    assert not [d for d in torchsync_pass.decisions() if d.action.name == "HOISTED"]


class _Solved(torch.nn.Module):
    """A step whose invariant part syncs inside: ``linalg.solve``'s error check reads its info."""

    def __init__(self, A):
        super().__init__()
        self.register_buffer("A", A)
        self.register_buffer("b", torch.arange(1.0, 5.0))

    def forward(self, x):
        return x * torch.linalg.solve(self.A, self.b)


def _good_A():
    return torch.eye(4) * 2 + 0.1


def _reads(fn, *args):
    """``fn(*args)`` and its host reads, compile included (the profiler's own count:
    count_syncs stops its profiler while Dynamo compiles, see README "Cost on a long run")."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = fn(*args)
    return out, sum(e.count for e in prof.key_averages() if e.key == "aten::_local_scalar_dense")


@pytest.mark.inductor
def test_invariant_part_under_inductor_runs_once_on_the_compiling_call_and_its_error_is_the_users():
    """Caching under Inductor ran the invariant part at compile time for the step's example inputs
    and threw the values away: the compiling call ran it again (6 syncs against stock's 3). And an
    error it raised there (a singular matrix) was taken for Inductor's failure: a "codegen failed"
    warning, the FX graph served for good, and with ``strict`` a BackendCompilerFailed instead of
    the user's LinAlgError."""
    opts = {"invariant_cache_bytes": 1 << 20}
    x = torch.randn(3, 4)
    with torch.no_grad():
        stock = torch.compile(_Solved(_good_A()), backend="inductor")
        ref, n_stock = _reads(stock, x)
        ours = torch.compile(_Solved(_good_A()), backend="nosync", options=opts)
        out, n_ours = _reads(ours, x)
        assert torch.equal(out, ref)
        assert n_ours == n_stock == 3
        assert [d.action.name for d in torchsync_pass.decisions() if d.kind == "tensor"] == ["CACHED"]

        torch._dynamo.reset()
        torchsync_pass.reset()
        m = _Solved(torch.zeros(4, 4))  # singular on the compiling call
        ours = torch.compile(m, backend="nosync", options={**opts, "strict": True})
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "codegen failed" warning
            with pytest.raises(torch.linalg.LinAlgError):
                ours(x)
        (d,) = [d for d in torchsync_pass.decisions() if d.kind == "tensor"]
        assert d.action.name == "NOT_CACHED" and d.reason.name == "EVAL_FAILED" and "LinAlgError" in d.detail
        m.A.copy_(_good_A())  # the user fixes the matrix: stock Inductor's bits
        assert torch.equal(ours(x), ref)


def _solve_in_cone(x, A, b):
    w = torch.linalg.solve(A, b)
    y = x * w
    if w.sum() > 0:
        print("", end="")  # a branch with a side effect: not selected on the device
        y = y + 1
    return y


def test_a_cone_with_an_op_that_syncs_inside_is_not_hoisted():
    """The guard re-ran the whole cone at each new request, ``linalg.solve`` included (its own 3
    reads), while the step ran the solve again: 7 reads a call against stock's 4 when the leaves
    are new objects every call (the same values, so never demoted)."""
    x, A0, b0 = torch.randn(3, 4), torch.eye(4) * 2 + 0.1, torch.arange(1.0, 5.0)
    calls = [(x, A0.clone(), b0.clone()) for _ in range(5)]
    stock, so = _syncs_per_call(_solve_in_cone, calls, "eager")
    ours, no = _syncs_per_call(_solve_in_cone, calls, "nosync")
    for a, b in zip(so, no):
        assert torch.equal(a, b)
    assert all(sum(o) <= sum(s) for o, s in zip(ours, stock)), (ours, stock)
    ds = [d for d in torchsync_pass.decisions() if d.kind == "bool"]
    assert not [d for d in ds if d.action.name == "HOISTED"], ds
    assert [d for d in ds if d.reason.name == "SYNCING_OP_IN_CONE" and "torch.linalg.solve" in d.detail], ds


def test_nested_taps_close_by_identity():
    """Two open taps with equal contents (both empty) are ``==``: closing the inner one removed the
    outer one (``list.remove``), so a nested explain run missed the outer script's later decisions
    and then raised ``ValueError: list.remove(x): x not in list``."""
    from torchsync_pass import report

    log = report.DecisionLog()
    with log.tap() as outer:
        with log.tap() as inner:
            pass
        log.add("d")  # a stand-in record: the log does not look at it
    assert list(outer) == ["d"] and list(inner) == [] and log._taps == []
    with report.compile_tap() as outer:
        with report.compile_tap():
            pass
        report.compiled({"graph": None})
    assert outer.added == 1 and report._COMPILE_TAPS == []


class _Sched:
    def __init__(self):
        self.sigmas = torch.linspace(1.0, 0.0, 9)
        self.var = torch.ones(9)
        self.i = 0
        self.renorm = False


def _lifted_then_written(s, x, y):
    if s.sigmas[s.i] > 0.5:  # lifted over the step index
        x = x * 2
    else:
        x = x + 1
    if s.renorm:  # batch norm in training mode writes the table behind its version counter
        y = torch.nn.functional.batch_norm(y, s.sigmas, s.var, training=True)
    s.i += 1
    return x, y


def test_a_lifted_site_demoted_in_its_own_compile_passes_its_fresh_entry_check():
    """A table check was built without its compile id, so once a write later in the same graph
    demoted the site, Dynamo's check of the fresh entry failed: "Guard failed on the same frame it
    was created" raised from the user's call."""
    results = []
    for backend in ("eager", "nosync"):
        torch._dynamo.reset()
        torchsync_pass.reset()
        s, y = _Sched(), torch.randn(4, 9, generator=torch.Generator().manual_seed(0))
        opts = {"codegen": "eager"} if backend == "nosync" else None
        g = torch.compile(_lifted_then_written, backend=backend, options=opts)
        outs = []
        for i in range(4):
            s.renorm = i >= 1
            outs.append(g(s, torch.ones(3), y))
        results.append((outs, s.sigmas.clone()))
    (so, ss), (no, ns) = results
    assert torch.equal(ss, ns)
    for a, b in zip(so, no):
        for p, q in zip(a, b):
            assert torch.equal(p, q)
    assert ("DEMOTED", "HIDDEN_WRITER") in {(d.action.name, d.reason.name) for d in torchsync_pass.decisions()}


def test_the_hook_self_test_runs_under_dynamos_default_config():
    """The self-test runs once per process, at the first nosync compile: under the caller's
    ``config.patch(assume_static_by_default=False)`` its probes traced ints as symbols, no hook
    fired, and nosync turned itself off for the whole process (a fresh interpreter: the test
    process ran its self-test long ago)."""
    import subprocess
    import sys

    code = textwrap.dedent("""
        import warnings, torch, torchsync_pass
        def f(x, t):
            if (t == 1).any():
                return x * 2
            return x
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            with torch._dynamo.config.patch(assume_static_by_default=False):
                torch.compile(f, backend="nosync", options={"codegen": "eager"})(torch.ones(2), torch.tensor([0, 1]))
        assert not [x for x in w if "disabled" in str(x.message)], [str(x.message) for x in w]
        torch._dynamo.reset(); torchsync_pass.reset()
        torch.compile(f, backend="nosync", options={"codegen": "eager"})(torch.ones(2), torch.tensor([0, 1]))
        assert [d.action.name for d in torchsync_pass.decisions()] == ["HOISTED"], torchsync_pass.decisions()
        print("done")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "done" in out.stdout, out.stderr[-3000:]


# --- count_syncs (helper review of the counter): each fails on the commit before its fix -------

_X16 = torch.arange(4.0)
_A16, _B16 = torch.eye(3) * 2, torch.ones(3, 1)


def _gen16(n):
    for _ in range(n):
        v = _X16.sum().item()  # SITE16 item
        yield v
        e = torch.equal(_X16, _X16)  # SITE16 equal
        torch.linalg.solve(_A16, _B16)  # SITE16 solve
        yield e


def _line16(tag):
    import inspect

    src, start = inspect.getsourcelines(_gen16)
    (n,) = [start + i for i, t in enumerate(src) if t.rstrip().endswith("# SITE16 " + tag)]
    return n


def test_profiler_only_syncs_in_a_generator_are_at_their_own_lines():
    """The profiler names a resumed generator frame by its ``yield`` line, and the counter searched
    for ``torch.equal(`` / ``linalg.solve(`` from there down: both landed on the ``yield``."""
    with torchsync_pass.count_syncs() as c:
        list(_gen16(3))
    got = {k.line: v for k, v in c.by_site.items() if k.file == __file__}
    assert got == {_line16("item"): 3, _line16("equal"): 3, _line16("solve"): 9}, got


def test_two_masks_count_two_reads_and_a_raising_int_counts_its_read():
    """``x[m1, m2]`` runs one nonzero per mask (2 reads) and counted 1; ``int()`` of a NaN reads
    the value, then raises, and counted 0 (the wrapper recorded only after a return)."""
    x = torch.arange(12.0).reshape(3, 4)
    m1, m2 = torch.tensor([True, False, True]), torch.tensor([True, True, False, False])
    with torchsync_pass.count_syncs() as c:
        x[m1, m2]
    assert c.total == 2, c.by_kind
    with torchsync_pass.count_syncs() as c:
        x[m1, m2] = 0.0
    assert c.total == 2, c.by_kind
    with torchsync_pass.count_syncs() as c:
        with pytest.raises(ValueError):
            int(torch.tensor(float("nan")))
        with pytest.raises(OverflowError):
            int(torch.tensor(float("inf")))
    assert c.total == 2 and c.by_kind == {"int": 2}, c.by_kind


def test_a_user_folder_named_torch_and_inductors_code_are_told_apart(tmp_path):
    """Profiler-only syncs in ``mylib/torch/ops.py`` were put on the caller's line (any path with a
    ``/torch/`` folder counted as torch's own), and one inside an Inductor-compiled function on
    Inductor's generated file in its cache directory."""
    import subprocess
    import sys

    lib = tmp_path / "mylib" / "torch"
    lib.mkdir(parents=True)
    (tmp_path / "mylib" / "__init__.py").write_text("")
    (lib / "__init__.py").write_text("")
    (lib / "ops.py").write_text("import torch\n\ndef same(a):\n    return torch.equal(a, a)\n")
    code = textwrap.dedent("""
        import torch, torchsync_pass
        from mylib.torch.ops import same
        a = torch.ones(3)
        with torchsync_pass.count_syncs() as c:
            same(a)
        print(sorted((k.file.rsplit("/", 2)[-2:], k.line) for k in c.by_site))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[(['torch', 'ops.py'], 4)]", out.stdout
    from torchsync_pass import counting

    assert counting._in_inductor_cache("/tmp/torchinductor_root/l3/cl3sirabc.py")
    assert not counting._py_user_event("/tmp/torchinductor_root/l3/cl3sirabc.py(74): call")
    assert counting._py_user_event("/work/mylib/torch/ops.py(3): same") == ("/work/mylib/torch/ops.py", 3, "same")


class _SolveTables:
    def __init__(self):
        self.A = torch.eye(3).repeat(6, 1, 1) * 2 + 0.1
        self.b = torch.ones(6, 3)
        self.i = 0


def _lifted_solve(s, x):
    w = torch.linalg.solve(s.A[s.i], s.b[s.i])
    if w.sum() > 0:
        print("", end="")  # not selected on the device
        x = x + w
    s.i += 1
    return x


def test_a_cone_with_an_op_that_syncs_inside_is_not_lifted_either():
    """Lifting evaluated ``linalg.solve`` at every index of the tables (18 reads on one call) while
    each step ran it again: 37 reads over 6 steps against stock's 24."""
    counts = []
    for backend in ("eager", "nosync"):
        torch._dynamo.reset()
        torchsync_pass.reset()
        s = _SolveTables()
        g = torch.compile(_lifted_solve, backend=backend, options={"codegen": "eager"} if backend == "nosync" else None)
        rows = []
        for _ in range(6):
            _, n = _reads(g, s, torch.ones(3))
            rows.append(n)
        counts.append(rows)
    stock, ours = counts
    assert all(o <= s for o, s in zip(ours, stock)), (ours, stock)
    assert not [d for d in torchsync_pass.decisions() if d.reason.name == "TABLE_LIFTED"]


def _pinv_cone(x, A):
    if A.pinverse().sum() > 0:
        print("", end="")
        x = x + 1
    return x


def _inv_power_cone(x, A):
    if torch.linalg.matrix_power(A, -1).sum() > 0:
        print("", end="")
        x = x + 1
    return x


@pytest.mark.parametrize("fn", [_pinv_cone, _inv_power_cone])
def test_ops_that_sync_inside_beyond_the_tabulated_ones_keep_their_cone_unhoisted(fn):
    """The rule covered only the tabulated linalg ops: ``A.pinverse()`` or a negative
    ``matrix_power`` in a cone was hoisted, and new tensors every call cost more reads than stock."""
    x, A0 = torch.ones(3), torch.eye(3) * 2 + 0.1
    calls = [(x, A0.clone()) for _ in range(3)]
    counts = []
    for backend in ("eager", "nosync"):
        torch._dynamo.reset()
        torchsync_pass.reset()
        g = torch.compile(fn, backend=backend, options={"codegen": "eager"} if backend == "nosync" else None)
        counts.append([_reads(g, *args)[1] for args in calls])
    stock, ours = counts
    assert all(o <= s for o, s in zip(ours, stock)), (ours, stock)
    assert [d for d in torchsync_pass.decisions() if d.reason.name == "SYNCING_OP_IN_CONE"]


def _decorated16(f):
    return f


@_decorated16
def _multi_line16(
    a,
    b,
):
    x = a.sum()
    return torch.equal(a, b), x  # SITE16b equal


def test_profiler_only_syncs_in_decorated_functions_with_long_signatures_are_at_their_lines():
    """The search for the op's call stopped at a decorated function's ``def`` line, or at a
    multi-line signature's closing line, and put the sync on the function's first line."""
    import inspect

    src, start = inspect.getsourcelines(_multi_line16)
    (line,) = [start + i for i, t in enumerate(src) if t.rstrip().endswith("# SITE16b equal")]
    a = torch.ones(3)
    with torchsync_pass.count_syncs() as c:
        _multi_line16(a, a)
    got = {k.line: v for k, v in c.by_site.items() if k.file == __file__}
    assert got == {line: 1}, (got, line)
    assert c.sites[next(k for k in c.by_site if k.line == line)].line_exact


def test_a_list_of_masks_counts_a_read_per_mask():
    x = torch.arange(12.0).reshape(3, 4)
    m1, m2 = torch.tensor([True, False, True]), torch.tensor([True, True, False, False])
    with torchsync_pass.count_syncs() as c:
        x[[m1, m2]]
        torch.arange(3.0)[[True, False, True]]
    assert c.total == 3, c.by_kind


def test_one_guard_per_list_table_and_graph(monkeypatch):
    """Every read of one list table installed its own per-call check of all the list's tensors (no
    .grad, no Python attributes): 8 reads of a 64-row list checked 512 tensors a call, and nosync
    ran the tiny prefill at 3.3x the hand-vectorized step."""
    from torchsync_pass import dynamo_hooks

    seen = []
    real = dynamo_hooks.add_lambda_guard

    def counting(site, check, description):
        seen.append(description)
        return real(site, check, description)

    monkeypatch.setattr(dynamo_hooks, "add_lambda_guard", counting)
    table = [torch.randn(4) for _ in range(8)]

    def step(tokens):
        out = torch.zeros(4)
        for i in range(4):
            out = out + table[tokens[i].item()]
        return out

    g = torch.compile(step, backend="nosync", options={"codegen": "eager"})
    for toks in ([1, 2, 3, 4], [7, 0, 7, 1]):
        t = torch.tensor(toks)
        assert torch.equal(g(t), step(t))
    assert sum("tensors of a list read on the device" in d for d in seen) == 1, seen
    assert "INDEX_LIST" in [d.reason.name for d in torchsync_pass.decisions()]


_P16 = torch.zeros(4)


def _reads_p16(x):
    return x * _P16.sum().item()


def test_a_leaf_written_while_its_frame_compiles_does_not_fail_the_fresh_entry(monkeypatch):
    """Another thread wrote a hoisted leaf between the trace's read and Dynamo's check of the entry
    just compiled: the check answered the new value, and Dynamo raised "Guard failed on the same
    frame it was created" from the user's call. Here the write is made by the backend itself, right
    after compiling (what the other thread did)."""
    from torchsync_pass import backend

    real = backend._compile

    def compile_then_write(*args, **kwargs):
        out = real(*args, **kwargs)
        _P16.add_(1.0)  # after the trace read the leaf, before Dynamo checks the fresh entry
        return out

    monkeypatch.setattr(backend, "_compile", compile_then_write)
    _P16.zero_()
    g = torch.compile(_reads_p16, backend="nosync", options={"codegen": "eager"})
    x = torch.ones(2)
    assert torch.equal(g(x), x * 0.0)  # the value the trace read: the write came after the read
    monkeypatch.setattr(backend, "_compile", real)
    assert torch.equal(g(x), x * 4.0)  # the next call sees the write (a recompile)
    assert torch.equal(g(x), x * 4.0)

"""Review 16 (2026-12-07): each test failing on the commit before its fix."""

from __future__ import annotations

import json
import textwrap

import torch

import torchsync_pass
from torchsync_pass import explain


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

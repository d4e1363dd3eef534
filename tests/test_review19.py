"""Review 19 (2026-12-07): each test failing on the commit before its fix."""

from __future__ import annotations

import types

import pytest
import torch

import torchsync_pass

EAGER = {"codegen": "eager"}


def _gated(x, mask):
    if mask.any():  # request-invariant: hoisted
        return x * 2
    return x - 1


def _copy(fn: types.FunctionType) -> types.FunctionType:
    """``fn`` with a code object of its own, equal to the original (``code.replace()``)."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__)


def test_equal_code_copies_each_have_their_own_recompile_budget():
    """benchmarks/ab.py and step_overhead.py compile each variant from a ``code.replace()`` copy of
    the step: equal code objects, each a frame of its own to Dynamo. The budget counted them as one
    frame (a dict keyed by the code's equality): from the fifth copy's compile on (half of
    recompile_limit 8) every site was demoted (here the branch became a device-side where running
    both sides; in step_overhead.py's diffusion step the syncs stayed: 2x the hoisted step)."""
    torch._dynamo.reset()
    torchsync_pass.reset()
    x, mask = torch.ones(3), torch.tensor([False, True])
    try:
        for k in range(7):
            fn = _copy(_gated)
            assert fn.__code__ == _gated.__code__ and fn.__code__ is not _gated.__code__
            step = torch.compile(fn, backend="nosync", options=EAGER)
            step(x, mask)
            with torchsync_pass.count_syncs() as c:
                out = step(x, mask)
            assert torch.equal(out, _gated(x, mask))
            assert c.total == 0, f"copy {k}: {c.total} syncs"
        assert not any(d.reason.name == "RECOMPILE_BUDGET" for d in torchsync_pass.decisions())
        assert {d.action.name for d in torchsync_pass.decisions()} == {"HOISTED"}
    finally:
        torch._dynamo.reset()
        torchsync_pass.reset()


def test_checks_of_a_code_copy_are_its_own():
    """serving's per-code check lists were keyed by the code's equality: a copy's checks were
    listed for the original (and the reverse)."""
    from torchsync_pass import guards

    torch._dynamo.reset()
    torchsync_pass.reset()
    x, mask = torch.ones(3), torch.tensor([True])
    try:
        a, b = _copy(_gated), _copy(_gated)
        torch.compile(a, backend="nosync", options=EAGER)(x, mask)
        assert len(guards.checks_for(a.__code__)) == 1
        assert guards.checks_for(b.__code__) == []
        torch.compile(b, backend="nosync", options=EAGER)(x, mask)
        ca, cb = guards.checks_for(a.__code__), guards.checks_for(b.__code__)
        assert len(ca) == len(cb) == 1 and ca[0] is not cb[0]
    finally:
        torch._dynamo.reset()
        torchsync_pass.reset()


_E8M0 = getattr(torch, "float8_e8m0fnu", None)


def _e8m0_branch(a, b, s):
    t = (s + 0 * torch.rand(())).to(_E8M0)  # a random op in the test's cone: not hoisted, selected
    y = a if t else b
    return y * 1


@pytest.mark.skipif(_E8M0 is None, reason="no float8_e8m0fnu in this torch")
def test_branch_on_an_e8m0_test_is_not_a_select():
    """float8_e8m0fnu has no zero: bool(t) is True for its smallest value 2**-127, but the select's
    nonzero test torch.ne(t, 0) compares with 0 converted to 2**-127: the other arm (helper 141)."""
    torch._dynamo.reset()
    torchsync_pass.reset()
    a, b = torch.ones(3), torch.full((3,), 2.0)
    f = torch.compile(_e8m0_branch, backend="nosync", options=EAGER)
    try:
        for v in (2.0 ** -127, 1.0, 2.0 ** -127):
            s = torch.tensor(v)
            torch.manual_seed(0)
            want = _e8m0_branch(a, b, s)
            torch.manual_seed(0)
            assert torch.equal(f(a, b, s), want), v
        assert not any(d.action.name == "REWRITTEN" for d in torchsync_pass.decisions())
    finally:
        torch._dynamo.reset()
        torchsync_pass.reset()


class _Child(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.tensor([1.0, -2.0, 3.0, 0.0]))

    def forward(self, x):
        return x * self.b.sum().item() + self.b  # hoisted: no graph break at the child's call


class _Parent(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.c = _Child()

    def forward(self, x):
        return self.c(x) + 1


def _add_hook(m, kind):
    if kind == "child_pre":
        return m.c.register_forward_pre_hook(lambda mod, args: (args[0] * 10,))
    if kind == "child_forward":
        return m.c.register_forward_hook(lambda mod, args, out: out * 100)
    return torch.nn.modules.module.register_module_forward_pre_hook(
        lambda mod, args: (args[0] * 10,) if mod is m.c else None)


@pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)` when there are global hooks")
@pytest.mark.parametrize("kind", ["child_pre", "child_forward", "global_pre"])
def test_hook_added_to_a_module_inlined_around_a_hoisted_sync_runs(kind):
    """Stock breaks the graph at the child's call (its .item()) and calls the child through
    Module.__call__, which runs a hook added between requests, as eager does. nosync removed the
    break, Dynamo inlined the child without guarding its empty hook dicts (nor the global ones), and
    the hook never ran (helper 140)."""
    torch._dynamo.reset()
    torchsync_pass.reset()
    x = torch.ones(1, 4)
    results = {}
    try:
        for name in ("eager", "nosync"):
            m = _Parent()
            f = m if name == "eager" else torch.compile(m, backend="nosync", options=EAGER)
            with torch.no_grad():
                r1 = f(x)
                h = _add_hook(m, kind)
                try:
                    r2 = f(x)
                finally:
                    h.remove()
                r3 = f(x)
            results[name] = (r1, r2, r3)
        for want, got in zip(results["eager"], results["nosync"]):
            assert torch.equal(got, want), (got, want)
        assert not torch.equal(results["eager"][1], results["eager"][0])  # the hook changed the result
        assert any(d.action.name == "HOISTED" for d in torchsync_pass.decisions())
    finally:
        torch._dynamo.reset()
        torchsync_pass.reset()


def test_explain_passes_a_double_dash_after_the_script_to_it(tmp_path, capsys):
    """``explain script.py -- -x`` gave the script ['-x'] (argparse took the '--'), where python and
    python -m cProfile give it ['--', '-x'] (helper 139); explain's own options still parse."""
    from torchsync_pass import explain

    script = tmp_path / "dd.py"
    script.write_text("import sys\nprint('ARGV', sys.argv[1:])\n")
    assert explain.main([str(script), "--", "-x"]) == 0
    assert "ARGV ['--', '-x']" in capsys.readouterr().out
    assert explain.main(["--max-sites", "3", "--json", "--", str(script), "--json", "--", "y"]) == 0
    cap = capsys.readouterr()  # with --json the script's own output goes to stderr
    assert "ARGV ['--json', '--', 'y']" in cap.err and '"exit_code": 0' in cap.out
    assert explain.main(["--json"]) == 2
    err = capsys.readouterr().err
    assert "required: script" in err and "args" not in err.split("required:")[1]


def test_explain_reports_sys_exit_true_as_status_1(tmp_path, capsys):
    from torchsync_pass import explain

    script = tmp_path / "exit_true.py"
    script.write_text("import sys\nsys.exit(True)\n")
    rc = explain.main(["--json", str(script)])
    out = capsys.readouterr().out
    assert rc == 1 and type(rc) is int
    assert '"exit_code": 1' in out


def test_inductor_key_of_the_options_is_checked_as_plain_settings():
    """options['inductor'] (how NosyncBackend carries Inductor settings over) took any name and
    value: an unknown setting failed inside Inductor at the compile (helper 139)."""
    from torchsync_pass import NosyncOptionsError
    from torchsync_pass.backend import Options

    with pytest.raises(NosyncOptionsError, match="'not_a_setting', which is not an Inductor setting"):
        Options.from_dict({"inductor": (("not_a_setting", 1),)})
    with pytest.raises(NosyncOptionsError, match=r"options\['inductor'\]\['max_autotune'\] must be bool"):
        Options.from_dict({"inductor": (("max_autotune", "yes"),)})
    assert Options.from_dict({"inductor": (("max-autotune", True),)}).inductor == (("max_autotune", True),)

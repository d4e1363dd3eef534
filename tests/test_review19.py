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

    def helper(self, x):
        return x - self.b.max().item()


class _Parent(torch.nn.Module):
    def __init__(self, child=None):
        super().__init__()
        self.c = _Child() if child is None else child

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
    x = torch.ones(1, 4)

    def requests(f, m):
        r1 = f(x)
        h = _add_hook(m, kind)
        try:
            r2 = f(x)
        finally:
            h.remove()
        return [r1, r2, f(x)]

    eager = _parent_eager_vs_nosync(requests, EAGER)
    assert not torch.equal(eager[1], eager[0])  # the hook changed the result


def _parent_eager_vs_nosync(requests, options):
    """``requests(f, model)`` on a fresh _Parent, eagerly and compiled by nosync with
    ``options`` (which hoists the child's sync): each output bitwise equal; the eager outputs."""
    torch._dynamo.reset()
    torchsync_pass.reset()
    results = {}
    try:
        for name in ("eager", "nosync"):
            m = _Parent()
            f = m if name == "eager" else torch.compile(m, backend="nosync", options=options)
            with torch.no_grad():
                results[name] = requests(f, m)
        for want, got in zip(results["eager"], results["nosync"], strict=True):
            assert torch.equal(got, want), (got, want)
        assert any(d.action.name == "HOISTED" for d in torchsync_pass.decisions())
        return results["eager"]
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


@pytest.mark.parametrize("hook_at_compile", [False, True])
def test_hook_removed_from_an_inlined_module_under_a_guard_filter_stops(hook_at_compile):
    """Under keep_nosync_guards(skip_all_guards_unsafe) Dynamo's own guards on a hook dict that
    has hooks are dropped: a hook removed after the compile that traced it kept running (stock with
    the same filter breaks at the child's call and sees the removal; helper 142)."""
    x = torch.ones(1, 4)

    def requests(f, m):
        outs = [] if hook_at_compile else [f(x)]
        h = _add_hook(m, "child_pre")
        outs.append(f(x))
        h.remove()
        return outs + [f(x)]

    filt = torchsync_pass.keep_nosync_guards(torch.compiler.skip_all_guards_unsafe)
    _parent_eager_vs_nosync(requests, {**EAGER, "guard_filter_fn": filt})


_B = torch.tensor([1.0, -2.0, 3.0, 0.0])


class _Scale(torch.nn.Module):
    def forward(self, x, b):
        return x * b.sum().item()


def _built_in_step(x):
    return _Scale()(x, _B) + 1


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_global_hook_reaches_a_module_built_in_the_step():
    """A module built inside the step has no source: no hook guard was installed at all, not even
    on the global hook dicts, and a global pre-hook added later never ran (helper 142)."""
    torch._dynamo.reset()
    torchsync_pass.reset()
    x = torch.ones(4)
    results = {}
    try:
        for name in ("eager", "nosync"):
            f = _built_in_step if name == "eager" else torch.compile(_built_in_step, backend="nosync", options=EAGER)
            outs = [f(x)]
            h = torch.nn.modules.module.register_module_forward_pre_hook(
                lambda mod, a: (a[0] * 10, *a[1:]) if isinstance(mod, _Scale) else None)
            try:
                outs.append(f(x))
            finally:
                h.remove()
            outs.append(f(x))
            results[name] = outs
        for want, got in zip(results["eager"], results["nosync"]):
            assert torch.equal(got, want), (got, want)
        assert any(d.action.name == "HOISTED" for d in torchsync_pass.decisions())
    finally:
        torch._dynamo.reset()
        torchsync_pass.reset()


def test_hook_guard_looks_a_shared_module_path_up_once():
    """The generated hook check names each shared prefix of the modules' sources once (the layers
    of one ModuleList), and tells a changed hook dict of any of them."""
    from torchsync_pass.dynamo_hooks import _hook_state, _hooks_unchanged, _source_cuts

    src = "L['self']._modules['layers']._modules['0']._modules['a.b']"
    assert [src[:c] for c in _source_cuts(src)][-3:] == [
        "L['self']._modules['layers']._modules", "L['self']._modules['layers']._modules['0']",
        "L['self']._modules['layers']._modules['0']._modules"]
    # a key ending in a backslash, then one with brackets: no cut inside a string (helper 145: the
    # generated check did not compile, and the first call raised)
    src = "L['self']._modules['a\\\\']._modules[']z[1']"
    assert [src[:c] for c in _source_cuts(src)][-2:] == [
        "L['self']._modules['a\\\\']", "L['self']._modules['a\\\\']._modules"]
    root = torch.nn.Module()
    root.layers = torch.nn.ModuleList(torch.nn.Linear(1, 1) for _ in range(3))
    root.layers[2].register_forward_hook(lambda *a: None)
    entries = [(f"L['self']._modules['layers']._modules['{i}']",
                tuple((n, _hook_state(getattr(root.layers[i], n))) for n in ("_forward_pre_hooks", "_forward_hooks")))
               for i in range(3)]
    check = _hooks_unchanged(entries, [])
    L = {"self": root}
    assert check(L, {})
    h = root.layers[1].register_forward_pre_hook(lambda *a: None)
    assert not check(L, {})
    h.remove()
    assert check(L, {})
    (k, fn), = root.layers[2]._forward_hooks.items()
    root.layers[2]._forward_hooks[k] = lambda *a: None  # another hook under the same handle id
    assert not check(L, {})
    root.layers[2]._forward_hooks[k] = fn
    assert check(L, {})
    root.layers[2]._forward_hooks.clear()
    assert not check(L, {})
    assert not check({"self": torch.nn.Module()}, {})  # a path that no longer resolves


class _Methods(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.c = _Child()
        self.register_buffer("k", torch.tensor(2.0))

    def lookup(self, x):
        return x * self.k.item()

    def forward(self, x):
        return self.lookup(x) + self.c.helper(x)  # a method of the root and one of a child


def _hook_guards() -> list:
    from torchsync_pass import dynamo_hooks

    return [d for g in dynamo_hooks._groups() for d in g.descriptions if "hooks of each module" in d]


def test_sites_in_methods_not_module_calls_install_no_hook_guard():
    """Syncs in a method of the compiled module, or in a child's method other than forward, run
    no hook in stock either (no Module.__call__ across the break): the hook guard was installed
    anyway and cost every call of such a frame 2.5-4 us (prefill's 64 rewritten reads in
    self.lookup: a frame that had no guard at all; helper 143)."""
    torch._dynamo.reset()
    torchsync_pass.reset()
    x = torch.ones(1, 4)
    try:
        m = _Methods()
        f = torch.compile(m, backend="nosync", options=EAGER)
        with torch.no_grad():
            assert torch.equal(f(x), m(x))
        assert {d.action.name for d in torchsync_pass.decisions()} == {"HOISTED"}
        assert _hook_guards() == []
        torch._dynamo.reset()
        torchsync_pass.reset()
        p = _Parent()  # the child *called*: guarded
        with torch.no_grad():
            assert torch.equal(torch.compile(p, backend="nosync", options=EAGER)(x), p(x))
        assert len(_hook_guards()) == 1
    finally:
        torch._dynamo.reset()
        torchsync_pass.reset()


class _BreakingChild(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.ones(3))

    def forward(self, x):
        if self.b.sum() > 0:  # hoisted
            x = x + 1
        torch._dynamo.graph_break()  # Dynamo then breaks at this module's call and compiles it alone
        return x * 2



def test_site_traced_in_two_frames_evaluates_its_cone_once():
    """The child's site is traced inlined in the parent's frame, then again in the child's own frame
    after the graph break below it: two cones (their leaves have other sources) with a memo each,
    so two reads on the first call where stock makes one (helper 144: diffusers' FasterCache
    hooks, 59 reads a request against stock's 48). Cones of one site computing the same ops now
    share their memos."""
    torch._dynamo.reset()
    torchsync_pass.reset()
    x = torch.ones(3)
    try:
        m = _Parent(_BreakingChild())
        f = torch.compile(m, backend="nosync", options=EAGER)
        with torchsync_pass.count_syncs() as c:
            out = f(x)
        assert torch.equal(out, m(x))
        assert c.total + c.compile_time == 1, (c.total, c.compile_time)
        m.c.b.fill_(-1.0)  # a write to the leaf: the shared memo does not serve the old answer
        assert torch.equal(f(x), m(x))
    finally:
        torch._dynamo.reset()
        torchsync_pass.reset()


class _ScaleLayer(torch.nn.Module):
    def __init__(self, v):
        super().__init__()
        self.register_buffer("s", torch.tensor(float(v)))

    def forward(self, x):
        return x * self.s.item()  # one source line, one cone per layer


class _Layers(torch.nn.Module):
    def __init__(self, k, n=5):
        super().__init__()
        self.layers = torch.nn.ModuleList(_ScaleLayer(i + k) for i in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _serve(m, x):
    return m(x)


def test_layer_loop_cones_keep_their_own_memos():
    """A layer loop asks one question per layer on one source line. The first form of the memo
    sharing (53d622b) gave all those cones one 8-entry memo: one compiled step serving two models
    of 5 layers in turn evicted its own answers, demoted every site and read 100 times in 10 calls
    (stock 50, before 0; helper 147)."""
    torch._dynamo.reset()
    torchsync_pass.reset()
    m1, m2, x = _Layers(1), _Layers(2), torch.ones(2)
    f = torch.compile(_serve, backend="nosync", options=EAGER)
    try:
        for _ in range(3):
            f(m1, x)
            f(m2, x)
        want = [m(x) for m in (m1, m2)]
        with torchsync_pass.count_syncs() as c:
            got = [f((m1, m2)[i % 2], x) for i in range(10)]
        assert c.total == 0
        assert all(torch.equal(g, want[i % 2]) for i, g in enumerate(got))
        assert {d.action.name for d in torchsync_pass.decisions()} == {"HOISTED"}
    finally:
        torch._dynamo.reset()
        torchsync_pass.reset()


def test_recompile_reason_of_an_added_hook_names_the_hook():
    """The hook guard's failure left the group's recompile reason at its default, "a leaf of a
    hoisted sync no longer resolves" (explain printed it for a hook added between requests)."""
    from torchsync_pass import dynamo_hooks

    def requests(f, m):
        outs = [f(x)]
        m.c.register_forward_pre_hook(lambda mod, a: (a[0] * 10,))
        outs.append(f(x))
        reasons.extend(g.failure_reason() for g in dynamo_hooks._groups()
                       if any("hooks of each module" in d for d in g.descriptions))
        return outs

    x, reasons = torch.ones(1, 4), []
    _parent_eager_vs_nosync(requests, EAGER)
    assert reasons and "a hook was added to or removed from a module" in reasons[0], reasons

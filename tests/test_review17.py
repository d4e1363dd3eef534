"""Review 17 (2026-12-07, second session): fixes and the per-call list check, each tested."""

from __future__ import annotations

import gc
import inspect

import pytest
import torch

import torchsync_pass
from torchsync_pass import dynamo_hooks


class _Holder:
    pass


def test_leaf_getter_looks_a_shared_container_up_once_and_returns_the_same_objects():
    """A list table's rows (``L['self'].table[i]``) are fetched through one lookup of the list;
    the objects and their order are those of evaluating each source alone."""
    o = _Holder()
    o.table = [torch.zeros(1) for _ in range(3)]
    o.other = [torch.ones(1)]
    L = {"self": o, "x": [[torch.zeros(2)], torch.ones(2)]}
    srcs = ["L['self'].table[0]", "L['self'].table[2]", "L['self'].other[0]", "L['x'][0][0]",
            "L['x'][1]", "L['x'][0]", "L['self'].table[1]"]
    got = dynamo_hooks.leaf_getter(srcs)(L, {})
    want = [eval(s, {"L": L}) for s in srcs]  # noqa: S307 - the test's own expressions
    assert len(got) == len(want) and all(a is b for a, b in zip(got, want))
    # a shorter list than the sources name raises, as evaluating the source alone does
    o.table.pop()
    with pytest.raises(IndexError):
        dynamo_hooks.leaf_getter(srcs)(L, {})
    assert dynamo_hooks.leaf_getter([])(L, {}) == ()


class _Sub(torch.Tensor):
    pass


def _rows(n=4):
    return [torch.full((2,), float(i)) for i in range(n)]


@pytest.mark.parametrize("change", ["none", "grad", "attribute", "dynamo-attribute", "parameter", "subclass",
                                    "subclass-grad", "empty"])
def test_the_per_call_list_check_answers_what_the_per_row_check_answers(change):
    """The per-call check of a list table's rows (plain tensors, no .grad, no Python attributes),
    which runs its common case in C loops, agrees with the exact per-row test on every kind of row."""
    rows = _rows()
    if change == "grad":
        rows[2].grad = torch.ones(2)
    elif change == "attribute":
        rows[1].is_pad = True
    elif change == "dynamo-attribute":  # Dynamo's own markers are not Python-visible differences
        rows[3]._dynamo_static_input_type = "unguarded"
    elif change == "parameter":
        rows[0] = torch.nn.Parameter(rows[0], requires_grad=False)
    elif change == "subclass":
        rows[1] = rows[1].as_subclass(_Sub)
    elif change == "subclass-grad":  # a plain row whose .grad is a subclass tensor
        rows[1].grad = torch.ones(2).as_subclass(_Sub)
    elif change == "empty":
        rows = []
    exact = not any(dynamo_hooks._python_differs(t) for t in rows)
    assert dynamo_hooks._none_python_differs(tuple(rows)) is exact
    assert exact is (change in ("none", "dynamo-attribute", "empty"))


@torch.no_grad()
def _lookup(tab, t):
    rows = [tab[t[i].item()] for i in range(t.shape[0])]
    row = torch.stack(rows)
    return row * (7 if rows[0].grad is not None else 5)


def test_a_list_table_row_that_gains_a_grad_or_attribute_later_is_still_seen():
    """End to end: the list read stays a gather (no sync) while the rows are plain, and a later
    call whose row has a .grad gives eager's answer (the check fails, Dynamo recompiles)."""
    torch._dynamo.reset()
    f = torch.compile(_lookup, backend="nosync", options={"codegen": "eager"})
    tab = _rows(6)
    for t in ([0, 1], [2, 3], [4, 5]):
        idx = torch.tensor(t)
        with torchsync_pass.count_syncs() as c:
            out = f(tab, idx)
        assert torch.equal(out, _lookup(tab, idx))
    assert c.total == 0
    tab[4].grad = torch.ones(2)
    idx = torch.tensor([4, 0])
    assert torch.equal(f(tab, idx), _lookup(tab, idx))
    assert torch.equal(f(tab, idx), torch.stack([tab[4], tab[0]]) * 7)


class _PreservedWrite(torch.nn.Module):
    """Writes its buffer under ``_unsafe_preserve_version_counter`` after a sync on it."""

    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.tensor([0.1, 0.2, 0.9, 0.3]))

    def forward(self, x):
        c = self.b.exp().cumsum(0)
        out = x * c if (self.b > 0.5).any() else x - c
        with torch.autograd._unsafe_preserve_version_counter(self.b):
            self.b.sub_(0.25)
        return out


class _FakeQuant(torch.nn.Module):
    """A sync on the scale that ``fused_moving_avg_obs_fake_quant`` (QAT) updates in place without
    bumping its version."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.tensor([1.0]))
        self.register_buffer("zp", torch.tensor([0], dtype=torch.int32))
        self.register_buffer("rmin", torch.tensor(float("inf")))
        self.register_buffer("rmax", torch.tensor(float("-inf")))
        self.register_buffer("on", torch.tensor([1], dtype=torch.long))

    def forward(self, x):
        s = self.scale * 2.0
        y = x + s if (self.scale > 0.01).any() else x - s
        return torch.fused_moving_avg_obs_fake_quant(y, self.on, self.on, self.rmin, self.rmax, self.scale,
                                                     self.zp, 0.01, 0, 255, -1)


@pytest.mark.parametrize("cache", [0, 64 << 20], ids=["nocache", "cache"])
@pytest.mark.parametrize("make,inputs", [
    (_PreservedWrite, lambda i: torch.full((4,), 1.0 + i)),
    (_FakeQuant, lambda i: torch.linspace(-1, 1, 16) * (0.2 if i < 2 else 10.0)),
], ids=["preserve_version_counter", "fake_quant"])
def test_a_graph_write_that_leaves_the_version_as_it_was_is_seen(make, inputs, cache):
    """Writes in the graph that do not move the version counter (a write under
    ``_unsafe_preserve_version_counter``, which Dynamo traces as the write and
    ``prims._unsafe_set_version_counter``; QAT's fused fake quant): the site reading the written
    tensor is not served its value from before the write (it was: all elements differed)."""
    torch._dynamo.reset()
    torchsync_pass.reset()
    me, mc = make(), make()
    cm = torch.compile(mc, backend="nosync", options={"codegen": "eager", "invariant_cache_bytes": cache})
    with torch.no_grad():
        for i in range(6):
            x = inputs(i)
            e, r = me(x), cm(x)
            assert torch.equal(r, e), f"call {i}"
            assert all(torch.equal(a, b) for a, b in zip(mc.buffers(), me.buffers()))
    assert any(d.reason.name == "HIDDEN_WRITER" for d in torchsync_pass.decisions())


@pytest.mark.parametrize("op", ["_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_fused_adagrad_",
                                "_amp_foreach_non_finite_check_and_unscale_", "fused_moving_avg_obs_fake_quant"])
def test_the_ops_listed_as_hidden_writers_do_leave_versions_as_they_were(op):
    """What the hidden-writer list says of these ops holds on this torch: they write an argument
    without moving its version counter (when a release starts bumping it, the entry is harmless;
    this test says so)."""
    from torchsync_pass import cone

    g = torch.ones(4)
    if op in ("_fused_adam_", "_fused_adamw_"):
        p, a, b = torch.ones(4), torch.zeros(4), torch.zeros(4)
        written = [p, a, b]
        run = lambda: getattr(torch, op)([p], [g], [a], [b], [], [torch.tensor(1.0)], lr=0.1, beta1=0.9,  # noqa: E731
                                         beta2=0.999, weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False)
    elif op == "_fused_sgd_":
        p, m = torch.ones(4), torch.ones(4)
        written = [p]
        run = lambda: torch._fused_sgd_([p], [g], [m], weight_decay=0.0, momentum=0.9, lr=0.1,  # noqa: E731
                                        dampening=0.0, nesterov=False, maximize=False, is_first_step=False)
    elif op == "_fused_adagrad_":
        p, s = torch.ones(4), torch.zeros(4)
        written = [p, s]
        run = lambda: torch._fused_adagrad_([p], [g], [s], [torch.tensor(1.0)], lr=0.1, lr_decay=0.0,  # noqa: E731
                                            weight_decay=0.0, eps=1e-10, maximize=False)
    elif op == "_amp_foreach_non_finite_check_and_unscale_":
        gr = torch.ones(4)
        written = [gr]
        run = lambda: torch._amp_foreach_non_finite_check_and_unscale_([gr], torch.zeros(1), torch.tensor([0.5]))  # noqa: E731
    else:
        rmin, rmax, sc = torch.tensor(0.0), torch.tensor(0.1), torch.tensor([1.0])
        zp, on = torch.tensor([0], dtype=torch.int32), torch.tensor([1], dtype=torch.long)
        written = [rmin, rmax, sc]
        run = lambda: torch.fused_moving_avg_obs_fake_quant(torch.randn(16), on, on, rmin, rmax, sc, zp,  # noqa: E731
                                                            0.01, 0, 255, 0)
    before = [(t.clone(), t._version) for t in written]
    run()
    assert all(not torch.equal(t, b) and t._version == v for t, (b, v) in zip(written, before))
    assert op in cone._HIDDEN_WRITERS


def test_a_misspelt_invariant_name_is_a_python_warning_once():
    """The README's "gets one warning": a Python warning (filters and ``pytest -W error`` see it),
    once per compiled function and name (it was a log line only)."""
    torch._dynamo.reset()

    def step(x, token_types):
        return x * 2 if (token_types == 1).any() else x

    f = torch.compile(step, backend="nosync", options={"codegen": "eager", "invariant": ["token_type"]})
    with pytest.warns(UserWarning, match=r"options\['invariant'\] names 'token_type'"):
        f(torch.ones(2), torch.tensor([0, 1]))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        f(torch.ones(2), torch.tensor([1, 1]))


class _Gate(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("token_types", torch.tensor([0, 1, 1]))

    def forward(self, x):
        return x * 2 if (self.token_types == 1).any() else x - 1


_NO_ISOLATION = pytest.mark.skipif("isolate_recompiles" not in inspect.signature(torch.compile).parameters,
                                   reason="torch.compile has no isolate_recompiles before torch 2.13")


@_NO_ISOLATION
def test_isolated_compiles_of_one_code_each_have_their_own_recompile_budget():
    """Seven instances of one module, each compiled with ``isolate_recompiles=True`` (what
    verify_loop does per mode): each compiles once and hoists. Dynamo's compile id counts compiles
    of the shared ``forward`` across regions, and from the fifth instance on (half of
    recompile_limit 8) nosync demoted the site: 3 graphs and 2 syncs a call."""
    torch._dynamo.reset()
    torchsync_pass.reset()
    x = torch.ones(3)
    for k in range(7):
        step = torch.compile(_Gate(), backend="nosync", options={"codegen": "eager"}, isolate_recompiles=True)
        step(x)
        with torchsync_pass.count_syncs() as c:
            out = step(x)
        assert torch.equal(out, _Gate()(x))
        assert c.total == 0, f"instance {k}: {c.total} syncs"
    assert not any(d.reason.name == "RECOMPILE_BUDGET" for d in torchsync_pass.decisions())


@_NO_ISOLATION
def test_verify_loop_run_again_in_one_process_still_checks_the_hoisted_graph():
    """verify_loop compiled each mode in its own region, but the budget counted every region's
    compiles of the step: the fifth run's nosync mode was demoted (more graphs, syncs kept) while
    the report said ok."""
    torch._dynamo.reset()
    torchsync_pass.reset()
    calls = [((torch.full((3,), float(i)),), {}) for i in range(3)]
    for r in range(6):
        rep = torchsync_pass.verify_loop(_Gate(), calls, modes=("nosync-eager",))
        assert rep.ok, rep
        (mode,) = [m for m in rep.modes if m.name == "nosync-eager"]
        assert mode.graphs == 1, f"run {r}: {mode.graphs} graphs"
    assert not any(d.reason.name == "RECOMPILE_BUDGET" for d in torchsync_pass.decisions())


_COUNTER_SCRIPT = """
import warnings, torch
import torchsync_pass
{extra}
from torch._dynamo.testing import CompileCounterWithBackend
def f(x, m):
    return x * m.sum().item()
m = torch.ones(3)
cc = CompileCounterWithBackend("nosync")
g = torch.compile(f, backend=cc)
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    with torchsync_pass.count_syncs() as c:
        for i in range(3):
            g(torch.ones(2), m)
late = [x for x in w if "first loaded while Dynamo compiled" in str(x.message)]
print("RESULT", cc.frame_count, c.total, len(late))
# after a reset, compile ids start again at 0/0: a normal strict compile must not be taken for
# the frame traced before the hooks were loaded
torch._dynamo.reset(); torchsync_pass.reset()
def h(x, m):
    return x + m.sum().item()
g2 = torch.compile(h, backend="nosync", options={{"codegen": "eager", "strict": True}})
g2(torch.ones(2), m)
with torchsync_pass.count_syncs() as c2:
    g2(torch.ones(2), m)
print("STRICT", c2.total)
"""


@pytest.mark.parametrize("imported", [False, True], ids=["name-only", "backend-imported"])
def test_a_wrapper_that_names_nosync_is_never_a_silent_no_op(imported):
    """``CompileCounterWithBackend("nosync")`` in a fresh process looks the name up after Dynamo
    traced the frame, before nosync's hooks were installed: nothing was hoisted, and nothing said
    so. Now a warning says so; with ``import torchsync_pass.backend`` first it hoists."""
    import subprocess
    import sys

    extra = "import torchsync_pass.backend" if imported else ""
    out = subprocess.run([sys.executable, "-c", _COUNTER_SCRIPT.format(extra=extra)], capture_output=True,
                         text=True, timeout=300)
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT")]
    assert line, out.stderr[-2000:]
    graphs, syncs, late = map(int, line[0].split()[1:])
    assert "STRICT 0" in out.stdout, out.stderr[-2000:]
    if imported:
        assert (graphs, syncs, late) == (1, 0, 0)
    else:
        assert syncs == 3 and late == 1


def test_verify_loop_refuses_a_codegen_option_that_would_override_the_modes():
    """``options={"codegen": "inductor"}`` turned nosync-eager into an Inductor mode compared with
    eager bitwise: a false FAILED blaming nosync. Now a ValueError naming the option."""
    calls = [((torch.full((3,), 1.0),), {})]
    with pytest.raises(ValueError, match="may not set 'codegen'"):
        torchsync_pass.verify_loop(_Gate(), calls, modes=("nosync-eager",), options={"codegen": "inductor"})


class _WrongReference(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("token_types", torch.tensor([0, 1, 1]))

    def forward(self, x):
        return x * 3  # set up for another request: not the step's answer


def test_verify_loop_names_a_reference_further_from_eager_than_the_mode():
    """A reference step that is itself wrong (a hand-hoisted model set up for another request) made
    the mode FAILED with nothing pointing at the reference; the report now says the reference is
    further from eager than the mode (which here equals eager bitwise)."""
    from torchsync_pass.loop import LoopMode

    torch._dynamo.reset()
    calls = [((torch.full((3,), float(i)),), {}) for i in range(1, 3)]
    modes = (LoopMode("nosync-e", "nosync", {"codegen": "eager"}, must_equal="ref"),
             LoopMode("ref", "eager", None, must_equal=None, step=_WrongReference()))
    rep = torchsync_pass.verify_loop(_Gate(), calls, modes=modes)
    assert not rep.ok
    assert rep.suspect_references() == {"nosync-e": "ref"}
    assert "note: its reference ref is further from eager" in str(rep)
    assert rep.to_json()["suspect_references"] == {"nosync-e": "ref"}
    good = torchsync_pass.verify_loop(_Gate(), calls, modes=("nosync-eager",))
    assert good.ok and good.suspect_references() == {} and "note:" not in str(good)


@pytest.mark.skipif(dynamo_hooks._torch_version() < dynamo_hooks.SELECT_MIN_TORCH,
                    reason="the device-side select needs torch 2.13+ (see dynamo_hooks.SELECT_MIN_TORCH)")
def test_a_kept_select_is_explained_without_rows_and_tables():
    """The reason of a branch kept because its select would be returned spoke of a "row" and its
    "table" (the list-rewrite text) and said the arm was an input, a view or returned, while here
    it is read by another op."""
    torch._dynamo.reset()
    torchsync_pass.reset()

    def f(x, m):
        h = x * 2
        if m.any():
            h = h + 1
        return h

    g = torch.compile(f, backend="nosync", options={"codegen": "eager"})
    for i in range(4):
        m = torch.tensor([i % 2 == 0])
        assert torch.equal(g(torch.ones(2), m), f(torch.ones(2), m))
    kept = [d for d in torchsync_pass.decisions() if d.action.name == "KEPT"]
    assert kept
    text = " ".join(f"{d.reason.value} {d.detail}" for d in kept)
    assert "read by other ops" in text and "table is written" not in text and "row is written" not in text


def test_the_per_call_list_check_takes_its_fast_path_on_plain_rows(monkeypatch):
    """Plain rows never reach the per-row Python test (the fast path once raised a TypeError on
    every call, a name clash, and fell back to it: right answers, no gain)."""
    calls = []
    exact = dynamo_hooks._python_differs
    monkeypatch.setattr(dynamo_hooks, "_python_differs", lambda t: calls.append(t) or exact(t))
    assert dynamo_hooks._none_python_differs(tuple(_rows(64))) is True
    assert calls == []
    # Dynamo marks the list's tensors it saw (``_dynamo_static_input_type``): still the fast path
    # (it fell back on every call of the prefill example: 512 rows, 610 -> 329 us a call)
    marked = _rows(64)
    for t in marked:
        t._dynamo_static_input_type = "unguarded"
    assert dynamo_hooks._none_python_differs(tuple(marked)) is True
    assert calls == []
    rows = _rows(3)
    rows[1].grad = torch.ones(2)
    assert dynamo_hooks._none_python_differs(tuple(rows)) is False
    assert calls  # a row with a .grad: decided by the exact test


def test_the_counter_s_compile_pause_survives_a_dynamo_reset_inside_it():
    """``torch._dynamo.reset()`` inside ``count_syncs()`` emptied Dynamo's compile callbacks, the
    counter's pause among them: later compiles ran under the profiler's Python tracer (a tiny SD3
    loop with a recompile grew past 4 GB). The counter's callbacks now stay; others are cleared."""
    from torch._dynamo.callback import callback_handler

    other = []

    def foreign(_args):
        other.append(1)

    with torchsync_pass.count_syncs():
        mine = list(callback_handler.start_callbacks)
        assert mine
        callback_handler.register_start_callback(foreign)
        torch._dynamo.reset()
        assert list(callback_handler.start_callbacks) == mine
        assert len(callback_handler.end_callbacks) >= 1
        f = torch.compile(lambda x: x * 2, backend="eager")
        f(torch.ones(2))
    assert other == []  # cleared as before
    assert not any(c in callback_handler.start_callbacks for c in mine)  # the counter's exit removed them


def test_a_misspelt_invariant_name_under_warnings_as_errors_reaches_the_caller():
    """Under ``-W error`` the warning is an exception raised inside nosync's policy, whose catch-all
    logged "could not analyse the sync" and went on (hoisting anyway): now it reaches the caller."""
    import warnings

    torch._dynamo.reset()

    def step2(x, token_types):
        return x * 2 if (token_types == 1).any() else x

    f = torch.compile(step2, backend="nosync", options={"codegen": "eager", "invariant": ["token_typ"]})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match="names 'token_typ'"):
            f(torch.ones(2), torch.tensor([0, 1]))


def test_verify_loop_does_not_blame_the_reference_for_a_mode_that_raised():
    """A mode that raised at its second step matched eager at its first: it was called "bitwise
    equal to eager" and its reference suspected."""
    from torchsync_pass.loop import LoopMode

    def crashing_backend(gm, ex):
        n = [0]

        def run(*a):
            n[0] += 1
            if n[0] >= 2:
                raise RuntimeError("mode broke on its second call")
            return gm.forward(*a)
        return run

    torch._dynamo.reset()
    calls = [((torch.full((3,), float(i)),), {}) for i in range(1, 4)]
    modes = (LoopMode("m", crashing_backend, None, must_equal="ref"),
             LoopMode("ref", "eager", None, must_equal=None, step=_WrongReference()))
    rep = torchsync_pass.verify_loop(_Gate(), calls, modes=modes)
    assert not rep.ok and rep["m"].error is not None
    assert rep.suspect_references() == {} and "note:" not in str(rep)


def _two_breaks(x, pos):
    n = int(pos)
    y = x[:n].sum() * 2
    done = bool((y > 1e9).all())
    return y, done


def test_a_specialised_call_in_a_resumed_function_is_counted_at_its_own_line():
    """Python 3.11 runs a specialised ``bool(t)`` inside ``PRECALL``, which Dynamo's rebuilt call
    after a graph break leaves at the previous break's line: once the resume function was
    recompiled (dynamic ``pos``) and warm, 2 of 10 ``bool`` reads were counted at the ``int(pos)``
    line."""
    import inspect as _inspect

    torch._dynamo.reset()
    first = _inspect.getsourcelines(_two_breaks)[1]
    int_line, bool_line = first + 1, first + 3
    f = torch.compile(_two_breaks, backend="eager")
    x, pos = torch.arange(20.0), torch.tensor(3)
    with torchsync_pass.count_syncs() as c:
        for _ in range(10):
            f(x, pos)
            pos += 1
    mine = {k.line: dict(s.kinds) for k, s in c.sites.items() if k.file == __file__}
    assert mine == {int_line: {"int": 10}, bool_line: {"bool": 10}}, mine


def test_keep_nosync_guards_keeps_the_guard_of_a_value_a_graph_break_carries():
    """The README's engine recipe (``keep_nosync_guards(skip_all_guards_unsafe)``) with a guidance
    buffer rewritten in place: the site is demoted (LEAVES_CHANGE) and its ``.item()`` goes back to
    Dynamo, which guards the value it carries to the code after the break (``___stack0``); the
    filter dropped that guard and calls 4-7 returned 3.0 where eager gave 4.0 ... 7.0."""
    torch._dynamo.reset()
    torchsync_pass.reset()

    def step(x, guidance):
        g = guidance.max().item()
        return x * g

    f = torch.compile(step, backend="nosync", options={
        "codegen": "eager", "guard_filter_fn": torchsync_pass.keep_nosync_guards(torch.compiler.skip_all_guards_unsafe)})
    x, buf = torch.ones(3), torch.ones(4)
    for it, v in enumerate([1.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]):
        buf.fill_(v)
        assert torch.equal(f(x, buf), step(x, buf)), f"call {it}"
    assert any(d.reason.name == "LEAVES_CHANGE" for d in torchsync_pass.decisions())


def test_check_request_on_a_batch_of_another_size_reports_instead_of_raising():
    """Compacted slots (``buf[:n]``) of a continuous-batching engine: the hoisted cone was traced
    with ``view(B, 2, 4)`` at B = 4, and check_request ran it on a batch of 3: a raw RuntimeError
    where the compiled call and eager both work. Now a change (the frame recompiles for the shape)."""
    torch._dynamo.reset()
    torchsync_pass.reset()

    def step(x, token_types):
        tt = token_types.view(x.shape[0], 2, 4)
        if (tt[:, 0] == 1).any():
            x = x * 2
        return x + 1

    f = torch.compile(step, backend="nosync", options={"codegen": "eager"})
    buf_tt, buf_x = torch.zeros(4, 8, dtype=torch.long), torch.randn(4, 8)
    for n in (4, 4, 3, 3, 2, 4):
        args = (buf_x[:n], buf_tt[:n])
        rep = torchsync_pass.check_request(f, *args, on_change="report")
        if n != 4:
            assert not rep.ok and any("raised on this request's inputs" in c.why for c in rep.changed)
        assert torch.equal(f(*args), step(*args))


_ENGINE_SCRIPT = '''
import torch, torchsync_pass
W = torch.randn(8, 8)
def step(x, token_types):
    h = x @ W
    m = (token_types == 0).float(); n_txt = int(m.sum())
    return h * n_txt + m.sum(1, keepdim=True)
f = torch.compile(step, backend="nosync", options={"codegen": "eager"})
buf = torch.zeros(4, 8, dtype=torch.long)
x = torch.randn(4, 8)
for it in range(12):
    if it < 3 or it % 3 == 0:
        buf[it % 4, : it % 8] = 1
    out = f(x, buf)
    assert torch.equal(out, step(x, buf))
'''


def test_explain_tags_a_sync_site_with_its_own_decision_not_a_cached_tensor_s(tmp_path, capsys):
    """A persistent slot buffer written in place between steps: the int() at line 6 is hoisted,
    demoted and kept, and a tensor on the same line is cached. The demotion said the leaves
    "change identity" (one buffer, written in place). In the reviewer's larger engine loop the
    site table also said ``[nosync: cached]`` (a cached tensor's decision taken for the sync's);
    this script does not reproduce that order, and checks only that the tag is a sync's."""
    import json

    from torchsync_pass import explain

    script = tmp_path / "engine.py"
    script.write_text(_ENGINE_SCRIPT)
    torch._dynamo.reset()
    torchsync_pass.reset()
    assert explain.main(["--json", "--progress", "0", str(script)]) == 0
    rep = json.loads(capsys.readouterr().out)
    site = [s for s in rep["sites"] if s["line"] == 6 and s["file"].endswith("engine.py")]
    assert site and "cached" not in json.dumps(site[0]["nosync"]), site
    demoted = [d for d in rep["nosync"] if d["action"] == "demoted"]
    assert demoted and all("identity" not in json.dumps(d) for d in demoted)


def test_check_request_does_not_count_an_entry_a_demotion_killed():
    """Site A stays hoisted while site B (a guidance buffer written in place) is demoted: the only
    entry with A's value False also held B's check, so it fails every later call. check_request
    said ok for a request with A = False, and the call recompiled."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    torchsync_pass.reset()

    def step(x, cfg, g):
        if cfg.any():
            x = x * 2
        return x + g.max().item()

    f = torch.compile(step, backend="nosync", options={"codegen": "eager"})
    x, g = torch.randn(4, 3), torch.ones(4)
    cfg_f, cfg_t = torch.zeros(4, dtype=torch.bool), torch.ones(4, dtype=torch.bool)

    def call(cfg):
        rep = torchsync_pass.check_request(f, x, cfg, g, on_change="report")
        before = counters["frames"]["ok"]
        assert torch.equal(f(x, cfg, g), step(x, cfg, g))
        return rep.ok, counters["frames"]["ok"] - before

    call(cfg_f)
    call(cfg_t)
    for v in (2.0, 3.0):
        g.fill_(v)
        call(cfg_t)
    assert any(d.reason.name == "LEAVES_CHANGE" for d in torchsync_pass.decisions())
    g.fill_(1.0)
    ok, compiled = call(cfg_f)
    assert not (ok and compiled), "check_request said ok but the call recompiled"


class _Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, x):
        return x * self.scale.item()


@pytest.mark.parametrize("backend", ["name", "object"])
def test_every_dynamo_reset_forgets_nosync_s_state_for_a_compiled_object_reused(backend):
    """Dynamo records a backend for its reset only when ``torch.compile`` is called, and forgets
    it at the reset: the same compiled module used across resets was reset once. After a second
    reset a ``.data`` write (which ``_version`` does not see) served the stale hoisted value, and
    released guard groups piled up."""
    torch._dynamo.reset()
    torchsync_pass.reset()
    m = _Scaled()
    be = "nosync" if backend == "name" else torchsync_pass.NosyncBackend({"codegen": "eager"})
    step = torch.compile(m, backend=be, options={"codegen": "eager"}) if backend == "name" else \
        torch.compile(m, backend=be)
    x = torch.ones(2)
    groups = []
    with torch.no_grad():
        for cycle in range(4):
            assert torch.equal(step(x), m(x))
            m.scale.data.fill_(m.scale.item() + 3.0)
            torch._dynamo.reset()
            assert torch.equal(step(x), m(x)), f"cycle {cycle}: stale after the reset"
            gc.collect()
            groups.append(len(dynamo_hooks._GROUPS))
    if dynamo_hooks._torch_version() >= (2, 13):
        # torch 2.11/2.12 keep one released group alive per reset (README: documented leftover)
        assert groups[-1] <= groups[0], groups


def test_profiler_chunks_shrink_to_a_bounded_number_of_events():
    """A tight serving loop recorded up to a million profiler events a second: 20 s chunks held 4.4
    million (8 GB). A chunk that held more than PROFILER_CHUNK_EVENTS makes the next one shorter in
    proportion; a nearly empty one makes it twice as long, up to PROFILER_CHUNK_S."""
    from torchsync_pass import counting

    class _Fake:
        def __init__(self, n):
            self.n = n

        def stop(self):
            return [None] * self.n

    session = counting._Session()
    assert session._chunk_s == counting.PROFILER_CHUNK_MIN_S
    seen = []
    for n in (0, 0, 0, 4 * counting.PROFILER_CHUNK_EVENTS, 2 * counting.PROFILER_CHUNK_EVENTS,
              counting.PROFILER_CHUNK_EVENTS // 2):
        session._prof, session.profiling = _Fake(n), True
        session._flush()
        seen.append(session._chunk_s)
    top = counting.PROFILER_CHUNK_S
    assert seen[:3] == [min(top, counting.PROFILER_CHUNK_MIN_S * 2 ** k) for k in (1, 2, 3)]
    assert seen[3] == pytest.approx(seen[2] / 4) and seen[4] == pytest.approx(seen[3] / 2)
    assert seen[5] == seen[4]  # between a quarter and the bound: unchanged
    assert top <= 1.0


def _kept_in_a_local(x, guidance):
    g = guidance.max().item()
    y = x * 2
    print("", end="")  # a second graph break: g reaches the next resume function as a local
    return y * g


def _boxed(x, guidance):
    g = guidance.max().item()
    y = x * g
    del x  # torch 2.13 passes the resume function's frame values boxed (__resume_frame_values)
    return y


@pytest.mark.parametrize("fn", [_kept_in_a_local, _boxed], ids=["local", "boxed"])
def test_keep_nosync_guards_keeps_scalar_guards_wherever_the_value_travels(fn):
    """Keeping the ``___stack*`` guards was not enough: a hoisted value stored in a local and carried
    past a second break is guarded as ``g``, and torch 2.13 boxes frame values
    (``__resume_frame_values[0]``); both were dropped and calls served the first value."""
    torch._dynamo.reset()
    torchsync_pass.reset()
    f = torch.compile(fn, backend="nosync", options={
        "codegen": "eager", "guard_filter_fn": torchsync_pass.keep_nosync_guards(torch.compiler.skip_all_guards_unsafe)})
    x, buf = torch.ones(3), torch.ones(4)
    for it, v in enumerate([1.0, 1.0, 2.0, 3.0, 4.0, 5.0]):
        buf.fill_(v)
        assert torch.equal(f(x, buf), fn(x, buf)), f"call {it}"

"""Hostile review 11 (2026-12-03): defects found by the review helpers, each test failing on the
commit before its fix."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

import torchsync_pass
from torchsync_pass import dynamo_hooks
from test_core import assert_bitwise

EAGER = {"codegen": "eager"}


class DunderWrite(nn.Module):
    """A buffer written by an in-place operator called by its dunder name, then read: Dynamo
    traces ``t.__iadd__(v)`` as a call of that method (not ``operator.iadd``)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.register_buffer("table", torch.arange(64.0).reshape(8, 8) / 7.0)

    def forward(self, x):
        if self.how == "method":
            self.table.__iadd__(1.0)
        elif self.how == "function":
            torch.Tensor.__imul__(self.table, 1.5)
        elif self.how == "idiv":
            self.table.__idiv__(2.0)  # torch.Tensor still has the Python 2 name
        else:
            torch.Tensor.__setitem__(self.table, 0, 2.0)
        y = x + self.table.cumsum(0)  # invariant work but for the write: must not be cached
        if self.table.sum() > 0:  # reads the written buffer: must not be hoisted
            y = y + 1
        return y * self.table[1, 1].item()


@pytest.mark.parametrize("how", ["method", "function", "idiv", "setitem"])
def test_dunder_inplace_write_is_a_write(how):
    m = DunderWrite(how)
    ref = copy.deepcopy(m)
    c = torch.compile(m, backend="nosync", options={**EAGER, "invariant_cache_bytes": 64 << 20})
    x = torch.randn(8, 8)
    with torch.no_grad():
        for _ in range(3):
            assert_bitwise(c(x), ref(x))
    assert torch.equal(m.table, ref.table)
    assert not [d for d in torchsync_pass.decisions() if d.action.name == "CACHED"]


class Cumexp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.randn(8, 8, generator=torch.Generator().manual_seed(0)))

    def forward(self, x):
        return x * self.table.cumsum(0).exp()  # cached (invariant)


def test_cached_under_inference_mode_not_reused_for_autograd():
    """Values cached under ``inference_mode()`` (with ``enable_grad()`` inside: Dynamo's
    global-state snapshot does not tell the two apart) are inference tensors: a later ordinary
    grad-mode call must not reuse them (autograd refuses to save them) and must match eager."""
    m = Cumexp()
    keep = torchsync_pass.keep_nosync_guards(torch.compiler.skip_all_guards_unsafe)
    f = torch.compile(m, backend="nosync", options={**EAGER, "invariant_cache_bytes": 64 << 20,
                                                    "guard_filter_fn": keep})
    x = torch.randn(8, 8)
    with torch.inference_mode(), torch.enable_grad():
        assert_bitwise(f(x), m(x))
    x1 = torch.randn(8, 8, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_(True)
    ref = m(x2)
    ref.sum().backward()
    out = f(x1)
    out.sum().backward()
    assert_bitwise(out.detach(), ref.detach())
    assert_bitwise(x1.grad, x2.grad)
    with torch.inference_mode(), torch.enable_grad():  # and back: the inference values again
        assert_bitwise(f(x), m(x))
    assert torch._dynamo.utils.counters["nosync"]["invariant_computes"] >= 2


_TESTS = [torch.tensor(v) for v in ([1, -2, 0], [0, 3, -1], [-1, -1, 2], [2, 0, 0], [0, 0, 5], [0, 0, 0], [-1, 0, -3])]


def _outcome(f, *a):
    try:
        return "ok", f(*a)
    except RuntimeError as e:
        return "raised", str(e)


@pytest.mark.parametrize("dtype, op, selects", [
    (torch.int8, lambda x: x.clamp(min=300), False),  # 300 does not fit int8: the kernel raises
    (torch.float16, lambda x: x.clamp(min=-1e9), False),  # nor -1e9 float16
    (torch.int8, lambda x: torch.where(x > 1, x, 300), False),
    (torch.float32, lambda x: x.clamp(min=-1e9), True),  # fits: still selected on the device
    (torch.float32, lambda x: torch.nn.functional.leaky_relu(x, 1e40), False),  # the slope is checked
], ids=["int8-clamp", "float16-clamp", "int8-where", "float32-clamp", "float32-leaky-slope"])
def test_select_refuses_arm_with_number_that_overflows(dtype, op, selects):
    """A branch selected on the device runs the arm eager skips; a number the kernel converts to
    the tensor's dtype with an overflow check (a clamp bound, where's scalar) raised there,
    although eager never ran that arm on the call (the fake tensors do not check it)."""
    x = torch.tensor([1, 2, 3], dtype=dtype)

    def step(x, t):
        out = []
        for i in range(t.shape[0]):
            out.append(op(x) if t[i] > 0 else x * 1)
        return torch.stack(out)

    f = torch.compile(step, backend="nosync", options=EAGER)
    with torch.no_grad():
        for t in _TESTS:
            e, g = _outcome(step, x, t), _outcome(f, x, t)
            assert e[0] == g[0], (t, e, g)
            if e[0] == "ok":
                assert_bitwise(g[1], e[1])
    if dynamo_hooks._torch_version() < dynamo_hooks.SELECT_MIN_TORCH:
        return  # no device-side select on this torch: the results above are all there is to check
    reasons = {d.reason.name for d in torchsync_pass.decisions()}
    assert ("BRANCH_WHERE" in reasons) is selects, reasons
    if not selects:  # kept: for the number (on Python 3.13 and torch 2.15 the form may be refused first)
        assert {"BRANCH_MAY_RAISE", "BRANCH_FORM"} & reasons, reasons


def test_unknown_options_of_mixed_key_types_named():
    """A typo beside a non-string key: the unknown keys are named, not a TypeError from sorting."""
    with pytest.raises(torchsync_pass.NosyncOptionsError, match="unknown option.*'verfy'"):
        torchsync_pass.NosyncBackend({"codegen": "eager", 1: True, "verfy": True})


@pytest.mark.parametrize("argv", [["--max-sites", "-1"], ["--max-syncs", "-3"], ["--progress", "-1"],
                                  ["--progress", "nan"], ["--progress", "inf"], ["--progress", "1e300"]])
def test_explain_refuses_negative_counts(argv, tmp_path, capsys):
    """explain's own wrong options exit 2 naming the option (``--max-sites -1`` showed no site row
    and claimed '... 2 more sites')."""
    from torchsync_pass import explain

    script = tmp_path / "s.py"
    script.write_text("import torch\nt = torch.tensor(1.0)\nfor i in range(3):\n    t.item()\n")
    assert explain.main([*argv, str(script)]) == 2
    assert argv[0] in capsys.readouterr().err


# -- options['invariant'] names: checked against the frames Dynamo compiles ---------------------

def _wraps(fn):
    @functools.wraps(fn)
    def wrapper(*a, **k):
        return fn(*a, **k)
    return wrapper


def _hoists(fn, args, invariant, kwargs=None):
    """Compile ``fn`` with strict=True and the declared names; True when a site was hoisted as
    declared (not speculated) and the output is eager's."""
    torch._dynamo.reset()
    torchsync_pass.reset()
    g = torch.compile(fn, backend="nosync", options={**EAGER, "invariant": invariant, "strict": True})
    for _ in range(2):
        assert_bitwise(g(*args, **(kwargs or {})), fn(*args, **(kwargs or {})))
    return any(d.action.value == "hoisted" for d in torchsync_pass.decisions())


class _Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mask", torch.tensor([True, False]))

    def forward(self, x):
        if self.mask.any():
            x = x + 1
        return x


class _InferenceForward(_Masked):
    @torch.inference_mode()
    def forward(self, x):
        return super().forward(x)


def _helper(y):
    z = y * 3
    torch._dynamo.graph_break()  # Dynamo compiles _helper as a frame of its own
    return z + 1


def _step_helper(x, tt):
    if (tt == 2).any():
        x = x + 1
    return _helper(x)


@torch.no_grad()
def _step_no_grad(x, tt):
    if (tt == 2).any():
        x = x + 1
    return x


@_wraps
def _step_wrapped(x, tt):
    if (tt == 2).any():
        x = x + 1
    return x


def _hooked():
    m = _Masked()
    m.register_forward_pre_hook(lambda mod, args: (args[0] * 2,))
    return m


@pytest.mark.parametrize("case", ["no_grad", "wraps", "inference_forward", "pre_hook", "helper_frame"])
def test_strict_accepts_names_of_the_compiled_function(case):
    """strict=True raised NosyncOptionsError for a valid name whenever Dynamo compiled a frame
    other than the user's function: torch's decorator wrappers, a functools.wraps wrapper, a
    forward pre-hook, a callee compiled as its own frame after a graph break."""
    x, tt = torch.ones(2, 3), torch.tensor([2, 0])
    fn, args, names = {
        "no_grad": (_step_no_grad, (x, tt), ["tt"]),
        "wraps": (_step_wrapped, (x, tt), ["tt"]),
        "inference_forward": (_InferenceForward(), (x,), ["self.mask"]),
        "pre_hook": (_hooked(), (x,), ["self.mask"]),
        "helper_frame": (_step_helper, (x, tt), ["tt"]),
    }[case]
    assert _hoists(fn, args, names)


def test_names_through_var_keyword_and_var_positional():
    def step(x, **kw):
        if kw["extra"].any():
            return x + 1
        return x - 1

    def step2(x, *args):
        if args[0].any():
            return x + 1
        return x - 1

    with torch.inference_mode():
        ex = torch.tensor([True])  # an inference tensor: hoisted only when declared
    x = torch.arange(3.0)
    assert _hoists(step, (x,), ["kw.extra"], {"extra": ex})
    assert _hoists(step2, (x, ex), ["args.0"])


class _LoraStyle(nn.Module):
    """A forward wrapped the way diffusers wraps its models' (``wrapper(self, *args, **kwargs)``)."""

    @_wraps
    def forward(self, x, ids):
        if (ids > 0).any():
            return x + 1
        return x


@pytest.mark.parametrize("name", ["ids", "k.ids"])
def test_keyword_name_through_a_wrapped_forward(name, caplog):
    """Declaring an argument of a forward that a decorator wraps in ``**kwargs`` by its own name
    warned 'no argument' and declared nothing; only 'k.ids' (the wrapper's own name) worked, and strict refused it."""
    with torch.inference_mode():
        ids = torch.ones(3)  # an inference tensor: hoisted only when declared
    assert _hoists(_LoraStyle(), (), [name], {"x": torch.randn(3), "ids": ids})
    assert "options['invariant']" not in caplog.text


def test_strict_raises_at_every_compile_for_a_misspelt_name():
    def step(x, token_types):
        if (token_types == 2).any():
            x = x + 1
        return x

    x, tt = torch.ones(2), torch.tensor([2, 0])
    for _ in range(2):
        g = torch.compile(step, backend="nosync", options={**EAGER, "invariant": ["token_type"], "strict": True})
        with pytest.raises(torchsync_pass.NosyncOptionsError, match="token_type"):
            g(x, tt)


def test_declared_module_is_named_not_silently_ignored():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(4, 3)

        def forward(self, x):
            if (self.emb.weight > 0).any():
                x = x + 1
            return x

    g = torch.compile(M(), backend="nosync", options={**EAGER, "invariant": ["self.emb"], "strict": True})
    with pytest.raises(torchsync_pass.NosyncOptionsError, match=r"not a tensor.*self\.emb\.weight"):
        g(torch.ones(2))


@pytest.mark.parametrize("kwargs, error, match", [
    ({"modes": ()}, ValueError, "no mode"),
    ({"calls": []}, ValueError, "calls is empty"),
    ({"calls": 5}, TypeError, "calls must be"),
    ({"calls": lambda i, state, prev: None}, ValueError, "ran no step"),
    ({"steps": 0}, ValueError, "ran no step"),
    ({"modes": None}, ValueError, "modes is None"),
])
def test_verify_loop_refuses_a_loop_that_compares_nothing(kwargs, error, match):
    """verify_loop reported ok having compared nothing (no mode, no step), and calls=5 failed with
    a bare "'int' object is not iterable"."""
    args = {"calls": [((torch.ones(2),), {})], "modes": ("nosync-eager",), **kwargs}
    with pytest.raises(error, match=match):
        torchsync_pass.verify_loop(lambda x: x + 1, args.pop("calls"), **args)


def test_verify_loop_takes_one_mode_as_a_string():
    r = torchsync_pass.verify_loop(lambda x: x + 1, [((torch.ones(2),), {})], modes="nosync-eager")
    assert r.ok and [m.name for m in r.modes] == ["nosync-eager"] and r.steps == 1


# -- hoisted syncs (review 11, helper on staleness) ----------------------------------------------

def _written_then_read(x, m2):
    a = 1 if x.sum() > 0 else 2  # hoisted, leaf x (read before the write)
    x.add_(10)  # the graph writes x
    b = m2.sum().item()  # hoisted, leaf m2 (read after the write)
    return a, b


def _two_leaves_one_written(a, b):
    k1 = a.sum().item()
    a.mul_(2)
    k2 = b.sum().item()
    return k1, k2


@pytest.mark.parametrize("fn, view", [
    (_written_then_read, lambda t: t.view(2, 2).view(-1)),
    (_two_leaves_one_written, lambda t: t[:]),
])
def test_written_leaf_aliased_by_another_leaf_at_run_time(fn, view):
    """An input the graph writes that is itself a hoisted leaf was not checked against the other
    leaves: a second leaf passed as a view of it on a later call was computed by the guard before
    the write, while eager reads it after."""
    c = torch.compile(fn, backend="nosync", options=EAGER)
    c(torch.ones(4), torch.ones(4))  # traced with distinct tensors
    b2, b3 = torch.ones(4), torch.ones(4)
    assert c(b2, view(b2)) == fn(b3, view(b3))
    assert torch.equal(b2, b3)


class _MaskArg(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mask", torch.tensor([1.0, 0.0, 1.0]))

    def forward(self, x, mask):
        k = mask.sum().item()  # the argument `mask`, which nobody declared
        return x * self.mask * k


def test_declared_self_attribute_does_not_declare_an_argument_of_that_name():
    """``invariant=["self.mask"]`` also declared an argument named ``mask`` (an undeclared
    inference tensor, then hoisted and guarded by identity only: stale after an in-place write)."""
    m = _MaskArg()
    c = torch.compile(m, backend="nosync", options={**EAGER, "invariant": ["self.mask"]})
    x = torch.ones(3)
    with torch.inference_mode():
        a = torch.ones(3)
        c(x, a)
        a.mul_(5)
        assert_bitwise(c(x, a), m(x, a))
    assert not [d for d in torchsync_pass.decisions() if d.action.value == "hoisted"]


_GLOBAL_MASK = None


def _reads_global(x):
    return x * _GLOBAL_MASK.sum().item()


def test_declared_name_does_not_declare_a_global():
    """``invariant=["mask"]`` was applied to a module global of that name (an inference tensor,
    then guarded by identity only), though the name check says no argument has it."""
    global _GLOBAL_MASK
    with torch.inference_mode():
        _GLOBAL_MASK = torch.ones(3)
        c = torch.compile(_reads_global, backend="nosync",
                          options={**EAGER, "invariant": ["_GLOBAL_MASK"]})
        x = torch.ones(3)
        c(x)
        _GLOBAL_MASK.mul_(5)
        assert_bitwise(c(x), _reads_global(x))
    _GLOBAL_MASK = None


class _DataWrite(nn.Module):
    def __init__(self, view: str) -> None:
        super().__init__()
        self.view = view
        self.register_buffer("buf", torch.tensor([1.0, 2.0, 3.0]))

    def forward(self, x):
        k = self.buf.sum().item()  # hoisted
        if self.view == "slice":
            self.buf.data[:2].add_(1)
        elif self.view == "unbind":  # through the tuple of a view op that returns several
            self.buf.data.unbind(0)[1].add_(1)
        else:
            self.buf.data.add_(1)  # writes the buffer without bumping its _version
        return x * k


@pytest.mark.parametrize("view", ["", "slice", "unbind"], ids=["data", "data-view", "data-unbind"])
def test_write_through_data_in_the_graph_demotes(view):
    """The graph writes a hoisted leaf through ``.data`` after reading it: the leaf's version does
    not move, so every later call was served the value from before the first write."""
    m, ref = _DataWrite(view), _DataWrite(view)
    c = torch.compile(m, backend="nosync", options=EAGER)
    x = torch.ones(3)
    for _ in range(3):
        assert_bitwise(c(x), ref(x))
    assert [d for d in torchsync_pass.decisions() if d.reason.name == "HIDDEN_WRITER"]


# -- review 11, round 2: the fixes above reviewed -------------------------------------------------

class _KwargsForward(nn.Module):
    """A forward of its own that takes **kwargs (transformers style): not a pass-through wrapper."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mask", torch.tensor([1.0, 1.0]))

    def forward(self, x, **kwargs):
        if (kwargs["mask"] > 1).any():
            x = x * 2
        return x * self.mask


def test_bare_name_for_self_attribute_does_not_declare_a_keyword():
    """``["mask"]`` meant for ``self.mask`` also declared ``kwargs["mask"]`` of a forward taking
    **kwargs: a per-request inference tensor refilled in place was hoisted, guarded by identity."""
    m = _KwargsForward()
    c = torch.compile(m, backend="nosync", options={**EAGER, "invariant": ["mask"]})
    x = torch.ones(2)
    with torch.inference_mode():
        buf = torch.zeros(2)
        for v in (0.0, 2.0, 0.0, 2.0):
            buf.copy_(torch.full((2,), v))
            assert_bitwise(c(x, mask=buf), m(x, mask=buf))


def test_typo_reported_in_a_forward_that_takes_kwargs():
    def forward(input_ids, token_type_ids=None, **kwargs):
        if (token_type_ids == 1).any():
            return input_ids + 1
        return input_ids

    g = torch.compile(forward, backend="nosync", options={**EAGER, "invariant": ["token_types"], "strict": True})
    with pytest.raises(torchsync_pass.NosyncOptionsError, match="token_types"):
        g(torch.ones(2), token_type_ids=torch.tensor([1, 0]))


def test_typo_reported_though_the_same_list_resolved_in_another_function():
    def encoder_step(x, token_types):
        return x + 1 if (token_types == 1).any() else x

    def decoder_step(x, token_type_ids):
        return x + 1 if (token_type_ids == 1).any() else x

    opts = {**EAGER, "invariant": ["token_types"], "strict": True}
    tt = torch.tensor([1, 0])
    torch.compile(encoder_step, backend="nosync", options=opts)(torch.ones(2), tt)
    with pytest.raises(torchsync_pass.NosyncOptionsError, match="token_types"):
        torch.compile(decoder_step, backend="nosync", options=opts)(torch.ones(2), tt)


def test_bare_name_against_a_module_argument_is_reported():
    """In ``step(model, x)`` the name "mask" declares nothing (only ``self.<name>`` is a module's):
    it must be reported, not accepted silently."""
    def step(model, x):
        return x + 1 if model.mask.any() else x

    g = torch.compile(step, backend="nosync", options={**EAGER, "invariant": ["mask"], "strict": True})
    with pytest.raises(torchsync_pass.NosyncOptionsError, match="mask"):
        g(_Masked(), torch.ones(2))


def _assert_selected(op):
    """A per-position branch ``op(x) if t[i] > 0 else x * 1``: equal to eager, and selected on the
    device (BRANCH_WHERE)."""
    x = torch.tensor([1.0, 2.0, 3.0])

    def step(x, t):
        return torch.stack([op(x) if t[i] > 0 else x * 1 for i in range(t.shape[0])])

    f = torch.compile(step, backend="nosync", options=EAGER)
    with torch.no_grad():
        for t in _TESTS:
            assert_bitwise(f(x, t), step(x, t))
    assert "BRANCH_WHERE" in {d.reason.name for d in torchsync_pass.decisions()}


@pytest.mark.skipif(dynamo_hooks._torch_version() < dynamo_hooks.SELECT_MIN_TORCH,
                    reason="the device-side select needs torch 2.13+")
@pytest.mark.parametrize("op", [lambda x: torch.where(x > 1, x, -1e4), lambda x: (x > 1) * 2.5],
                         ids=["where-scalar", "bool-times-float"])
def test_select_keeps_arms_whose_numbers_fit_the_result(op):
    """A number is checked against the dtype the op makes, not a bool condition it reads: these
    were selected before the overflow check and must stay so."""
    _assert_selected(op)


def test_dynamo_restart_signal_from_codegen_is_not_a_codegen_failure(monkeypatch, caplog):
    """Inductor's AOT pass raises TensorifyScalarRestartAnalysis (Dynamo's signal to retrace with
    a float specialised, on a cold cache); nosync caught it as a codegen failure and ran the FX
    graph eagerly: eager's bits instead of stock Inductor's."""
    from torch._dynamo.exc import TensorifyScalarRestartAnalysis

    from torchsync_pass import backend

    real, raised = backend._codegen_tabulated, []

    def once(*a, **k):
        if not raised:
            raised.append(True)
            raise TensorifyScalarRestartAnalysis
        return real(*a, **k)

    monkeypatch.setattr(backend, "_codegen_tabulated", once)

    def fn(x, scale):
        return (x * scale.item()).sum(0)

    x, scale = torch.randn(8, 3, dtype=torch.float64), torch.tensor(0.1, dtype=torch.float64)
    c = torch.compile(fn, backend="nosync", options=EAGER)
    assert_bitwise(c(x, scale), fn(x, scale))
    assert raised and "codegen failed" not in caplog.text


# -- serving.check_request ----------------------------------------------------------------------

@torch.no_grad()
def _wrapped_other(x, tt):  # compiled through Dynamo's wrap_inline frame, like every partial/module
    if (tt == 0).any():
        return x + 1
    return x - 1


def _scaled(x, scale):
    return x * scale.item()


class _Twice(nn.Module):
    def forward(self, x):
        return x * 2


def test_check_request_runs_only_the_functions_own_checks():
    """check_request(g) ran the hoisted checks of another function sharing Dynamo's wrap_inline
    code (a @torch.no_grad() function compiled in the same process): a false HoistedValueChanged
    for g, or 'cannot read L['args'][1]' for a module of another arity."""
    cf = torch.compile(_wrapped_other, backend="nosync", options=EAGER)
    cg = torch.compile(_scaled, backend="nosync", options=EAGER)
    cm = torch.compile(_Twice(), backend="nosync", options=EAGER)
    x = torch.ones(2)
    for _ in range(2):
        cf(x, torch.tensor([0, 1]))
        cg(x, torch.tensor(3.0))
        cm(x)
    r = torchsync_pass.check_request(cg, x, torch.tensor(3.0))
    assert r.ok and r.sites == 1
    r = torchsync_pass.check_request(cm, x)
    assert r.ok and r.sites == 0
    with pytest.raises(torchsync_pass.HoistedValueChanged):  # its own check still runs
        torchsync_pass.check_request(cf, x, torch.tensor([1, 1]))


@pytest.mark.parametrize("what", [42, None, "step"])
def test_check_request_refuses_what_is_not_a_function(what):
    """The step forgotten (check_request(x, tt)) returned ok=True with 0 sites: an engine gating
    requests on report.ok let a changed value through."""
    with pytest.raises(TypeError, match="must be the compiled function"):
        torchsync_pass.check_request(what, torch.ones(2))


# -- review 11, round 3 -------------------------------------------------------------------------

def test_written_leaf_and_empty_leaf_do_not_fail_their_own_guard():
    """Every empty storage's pointer is 0: a written leaf and another empty leaf 'shared memory',
    so the guard failed on the frame it was built for (Dynamo's AssertionError)."""
    c = torch.compile(_written_then_read, backend="nosync", options=EAGER)
    assert c(torch.zeros(0), torch.zeros(0)) == _written_then_read(torch.zeros(0), torch.zeros(0))


def test_typo_reported_for_a_compiled_function_called_inside_a_module():
    """A compiled function called from a module's forward was taken for one of the module's hooks
    (nn.Module._call_impl on the stack): a typo under strict=True passed silently."""
    opts = {**EAGER, "invariant": ["msak"], "strict": True}
    ch = torch.compile(lambda x, mask: x * mask.sum().item(), backend="nosync", options=opts)

    class Outer(nn.Module):
        def forward(self, x, m):
            return ch(x, m)

    with pytest.raises(torchsync_pass.NosyncOptionsError, match="msak"):
        Outer()(torch.ones(3), torch.ones(3))


def test_select_refuses_an_arm_bound_known_only_at_the_call():
    """``x.clamp(min=lo)`` on int8 with ``lo`` a Dynamo-dynamic int: selected on the device, a
    later lo=300 raised the overflow on the arm eager skips."""
    def step(x, t, lo):
        return torch.stack([x.clamp(min=lo) if t[i] > 0 else x * 1 for i in range(t.shape[0])])

    f = torch.compile(step, backend="nosync", options=EAGER)
    x = torch.tensor([1, 2, 3], dtype=torch.int8)
    calls = [([1, 0, 1], 1), ([0, 1, 0], 2), ([1, 1, 0], 3), ([0, 1, 0], 4), ([1, 0, 0], 5),
             ([0, 0, 1], 6), ([0, 0, 0], 300)]
    with torch.no_grad():
        for t, lo in calls:
            e, g = _outcome(step, x, torch.tensor(t), lo), _outcome(f, x, torch.tensor(t), lo)
            assert e[0] == g[0], (t, lo, e, g)
            if e[0] == "ok":
                assert_bitwise(g[1], e[1])


@pytest.mark.skipif(dynamo_hooks._torch_version() < dynamo_hooks.SELECT_MIN_TORCH,
                    reason="the device-side select needs torch 2.13+")
@pytest.mark.parametrize("op", [lambda x: torch.where(x > 2, x, -1e4), lambda x: x * 1e40],
                         ids=["compare-with-number", "mul-overflows-to-inf"])
def test_select_keeps_numbers_the_kernel_does_not_check(op):
    """A comparison's number (result bool) and a product's (overflows to inf) are not converted
    with an overflow check: refusing them only kept a sync."""
    _assert_selected(op)


def _partial_step(x, tt, scale):
    return x * scale.item() if (tt == 0).any() else x


def test_check_request_sees_a_keyword_that_overrides_the_partials():
    """A compiled functools.partial hoisted its stored keyword (L['fn'].keywords['scale']); a
    request passing scale= overrides it, and check_request said ok: an engine skipping Dynamo's
    guards was served the partial's value."""
    keep = torchsync_pass.keep_nosync_guards(torch.compiler.skip_all_guards_unsafe)
    p = functools.partial(_partial_step, scale=torch.tensor(2.0))
    c = torch.compile(p, backend="nosync", options={**EAGER, "guard_filter_fn": keep})
    x, tt = torch.ones(2), torch.tensor([0])
    c(x, tt)
    c(x, tt)
    r = torchsync_pass.check_request(c, x, tt, scale=torch.tensor(5.0), on_change="report")
    assert not r.ok and r.changed and "overrides" in r.changed[0].why
    assert torchsync_pass.check_request(c, x, tt, on_change="report").ok  # without the keyword: fine


def test_keep_nosync_guards_refuses_what_is_not_a_filter():
    with pytest.raises(TypeError, match="guard_filter_fn must be a function"):
        torchsync_pass.keep_nosync_guards(None)


def _break_then_masked_select(x):
    n = int(x.argmax())  # a graph break
    m = torch.masked_select(x, x > 1)  # a sync only the profiler sees, in Dynamo's resume function
    return m.sum() + n


def masked_select_lines(fn) -> list:
    """``(kind, line)`` of the masked_select syncs count_syncs books on a warm call of ``fn``
    compiled by nosync (skips where eager shows none either)."""
    compiled = torch.compile(fn, backend="nosync", options=EAGER)
    x = torch.tensor([0.5, 1.5, 2.5, 9.0])  # the same argmax every call: no recompile when counted
    for i in range(4):
        compiled(x + i)
    with torchsync_pass.count_syncs() as c:
        compiled(x + 5)
    sites = [s for s in c.sorted_sites() if "masked_select" in s.kind]
    if not sites:
        with torchsync_pass.count_syncs() as e:
            fn(x + 5)
        if not [s for s in e.sorted_sites() if "masked_select" in s.kind]:
            pytest.skip("this torch's masked_select makes no read count_syncs sees on the CPU, eager neither")
    assert all(s.line_exact for s in sites), sites
    return [(s.kind, s.site.line) for s in sites]


def test_profiler_only_sync_after_a_break_is_booked_to_its_line():
    """A sync only the profiler sees, made in a resume function, was booked to the graph break's
    line (the resume function starts there) instead of the op's."""
    import inspect

    line = inspect.getsourcelines(_break_then_masked_select)[1] + 2
    assert masked_select_lines(_break_then_masked_select) == [("masked_select", line)]
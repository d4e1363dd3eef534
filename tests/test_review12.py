"""Review 12 (2026-12-03): the findings review 11 left open, each test failing on the commit
before its fix."""

from __future__ import annotations

import functools
import inspect

import pytest
import torch
from torch import nn

import torchsync_pass
from torch._dynamo.utils import counters

from test_core import assert_bitwise
from test_review11 import _Masked, _wraps, masked_select_lines

EAGER = {"codegen": "eager"}


def _compile(fn, invariant):
    torch._dynamo.reset()
    torchsync_pass.reset()
    return torch.compile(fn, backend="nosync", options={**EAGER, "invariant": invariant, "strict": True})


def _hoisted() -> bool:
    return any(d.action.value == "hoisted" for d in torchsync_pass.decisions())


def _scale_hook(mod, args, scale=2.0):
    return (args[0] * scale,)


class _ScaleHook:
    def __call__(self, mod, args):
        return (args[0] * 2.0,)


@pytest.mark.parametrize("hook", [functools.partial(_scale_hook, scale=3.0), _ScaleHook()],
                         ids=["partial", "callable_object"])
def test_strict_accepts_a_module_name_beside_a_hook_that_is_not_a_function(hook):
    """A forward pre-hook given as a functools.partial or a callable object, compiled as a frame of
    its own, was not recognised as a hook: strict=True refused the module's valid 'self.mask'."""
    m = _Masked()
    m.register_forward_pre_hook(hook)
    ref = _Masked()
    ref.register_forward_pre_hook(hook)
    g = _compile(m, ["self.mask"])
    x = torch.ones(2, 3)
    for _ in range(2):
        assert_bitwise(g(x), ref(x))
    assert _hoisted()


class _WrappedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mask", torch.tensor([1.0, 2.0]))

    @_wraps
    def forward(self, x):
        return x * self.mask.exp()  # invariant work only: no sync site


def test_typo_reported_through_a_pass_through_wrapper():
    """In a forward wrapped by a decorator's ``wrapper(*args, **kwargs)`` a misspelt name passed
    silently under strict=True (the wrapper's frame was never checked)."""
    g = _compile(_WrappedForward(), ["self.msak"])
    with pytest.raises(torchsync_pass.NosyncOptionsError, match=r"msak.*forward takes: self, x"):
        g(torch.ones(2))


@torch.no_grad()
def _no_grad_step(x, tt):
    return x * tt.exp()


@pytest.mark.parametrize("partial", [False, True])
def test_typo_reported_under_no_grad_and_partial(partial):
    """Under @torch.no_grad() (and through a functools.partial of such a function) a misspelt name
    passed silently under strict=True: the frame compiled is torch's wrapper."""
    fn = functools.partial(_no_grad_step, torch.ones(2)) if partial else _no_grad_step
    args = (torch.ones(2),) if partial else (torch.ones(2), torch.ones(2))
    g = _compile(fn, ["ttt"])
    with pytest.raises(torchsync_pass.NosyncOptionsError, match=r"'ttt'.*_no_grad_step takes: x, tt"):
        g(*args)
    assert_bitwise(_compile(fn, ["tt"])(*args), fn(*args))


class _Ids(nn.Module):
    def forward(self, x, ids):
        if (ids > 0).any():
            return x + 1
        return x


def _accelerate_style(module):
    """Wrap ``module.forward`` as accelerate's ``add_hook_to_module`` does."""
    old = module.forward

    def new_forward(module, *args, **kwargs):
        return module._old_forward(*args, **kwargs)

    module._old_forward = old
    module.forward = functools.update_wrapper(functools.partial(new_forward, module), old)
    return module


def test_keyword_through_an_accelerate_style_forward():
    """A forward replaced by ``partial(new_forward, module)`` (accelerate's hooks): the keyword
    'ids' was refused under strict=True and, without strict, not declared."""
    with torch.inference_mode():
        ids = torch.ones(3)  # an inference tensor: hoisted only when declared
    x = torch.randn(3)
    g = _compile(_accelerate_style(_Ids()), ["ids"])
    for _ in range(2):
        assert_bitwise(g(x=x, ids=ids), _Ids()(x=x, ids=ids))
    assert _hoisted()


def _helper(y, t):
    if (t == 2).any():
        y = y + 1
    return y


def _loop_calls_helper(x, tt):
    for _ in range(2):
        print("step", end="\r")  # a graph break in a loop: Dynamo compiles only _helper
        x = _helper(x, tt)
    return x


def test_strict_accepts_a_name_of_a_caller_that_was_not_compiled():
    """When Dynamo skips the caller (a graph break inside its loop) and compiles only the callee,
    a name of the caller's was refused under strict=True."""
    x, tt = torch.ones(2), torch.tensor([2, 0])
    g = _compile(_loop_calls_helper, ["tt"])
    for _ in range(2):
        assert_bitwise(g(x, tt), _loop_calls_helper(x, tt))


def _nested_def_then_break(x):
    def helper(y):
        return y + 1
    if x.sum() > -100:
        n = int(x.argmax())  # a graph break inside the if
        x = helper(x) + n
    m = torch.masked_select(x, x > 1)  # a sync only the profiler sees, in the resume function
    return m.sum()


def test_profiler_only_sync_after_a_nested_def_is_booked_to_its_line():
    """The resume function's line search stopped at a nested def above the graph break and missed
    the op after the if block: masked_select was booked to the break's line."""
    line = inspect.getsourcelines(_nested_def_then_break)[1] + 6
    assert masked_select_lines(_nested_def_then_break) == [("masked_select", line)]


def _write_subclass_then_read(x, m, w):
    w.add_(1)
    if m.sum() > 2:
        x = x + 1
    return x + w


@pytest.mark.parametrize("aliased", [False, True])
def test_written_wrapper_subclass_beside_a_hoisted_leaf(aliased):
    """A written tensor subclass (TwoTensor) beside a hoisted leaf made Dynamo raise 'Guard failed
    on the same frame': its storage could not be read, and an inner tensor that is the leaf is an
    alias the trace does not see."""
    two_tensor = pytest.importorskip("torch.testing._internal.two_tensor")
    fn = torch.compile(_write_subclass_then_read, backend="nosync", options=EAGER)
    for _ in range(3):
        outs = []
        for _ in range(2):
            m = torch.ones(3)
            w = two_tensor.TwoTensor(m if aliased else torch.zeros(3), torch.zeros(3))
            outs.append((torch.ones(3), m, w))
        got, want = fn(*outs[0]), _write_subclass_then_read(*outs[1])
        assert torch.equal(got.a, want.a) and torch.equal(got.b, want.b)
        assert torch.equal(outs[0][1], outs[1][1])


def _vmap_then_branch(x, mask):
    y = torch.vmap(lambda r: r * 2)(x)
    if mask.any():  # request-invariant: hoisted
        y = y + 1
    return y


def test_step_with_vmap_and_a_hoisted_sync():
    """A step calling torch.vmap beside a hoisted sync failed to compile (AttributeError: a vmap's
    batched fake tensor has no fake_mode) where eager and stock torch.compile run it (found by
    review 12)."""
    x, mask = torch.ones(4, 4), torch.tensor([1, 0])
    g = _compile(_vmap_then_branch, ["mask"])
    for _ in range(2):
        assert_bitwise(g(x, mask), _vmap_then_branch(x, mask))
    assert _hoisted()


class _ScaledForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, x, **kwargs):
        x = x * self.scale  # the declared buffer
        g = kwargs.get("scale")  # a per-request keyword, not declared
        if g is not None and g.item() > 0:
            x = x + 1
        return x


class _WrappedScaledForward(_ScaledForward):
    forward = _wraps(_ScaledForward.forward)


@pytest.mark.parametrize("cls", [_ScaledForward, _WrappedScaledForward])
def test_bare_name_through_a_wrapper_does_not_declare_the_forwards_own_kwargs(cls):
    """"scale" declares self.scale; through a pass-through wrapper it also declared the keyword
    kwargs["scale"] that the forward takes in its own **kwargs: hoisted as declared (identity only
    for an inference tensor), stale after an in-place write (found by review 12)."""
    m = cls()
    g = _compile(m, ["scale"])
    with torch.inference_mode():
        x, s = torch.ones(2), torch.tensor(1.0)  # s: a request tensor written in place
        for v in (1.0, -1.0, 1.0, -1.0):
            s.fill_(v)
            assert_bitwise(g(x, scale=s), m(x, scale=s))


def _silu_then_branch(x, m):
    s = 2.0 if m.any() else 3.0  # request-invariant: hoisted
    return torch.nn.functional.silu(x) * s


@pytest.mark.parametrize("kind", ["nested_jagged", "two_tensor"])
def test_subclass_input_to_a_python_function_beside_a_hoisted_sync(kind):
    """A nested jagged tensor or a wrapper subclass passed to a Python function Dynamo keeps whole
    (F.silu) failed the compile (AttributeError: no fake_mode) beside a hoisted sync (found by
    review 12)."""
    if kind == "two_tensor":
        x = pytest.importorskip("torch.testing._internal.two_tensor").TwoTensor(torch.randn(4), torch.randn(4))
    else:
        x = torch.nested.nested_tensor([torch.randn(2, 4), torch.randn(3, 4)], layout=torch.jagged)
    m = torch.tensor([1, 0])
    g = _compile(_silu_then_branch, ["m"])
    want = _silu_then_branch(x, m)
    for _ in range(2):
        got = g(x, m)
        if kind == "two_tensor":
            assert torch.equal(got.a, want.a) and torch.equal(got.b, want.b)
        else:
            assert all(torch.equal(a, b) for a, b in zip(got.unbind(), want.unbind()))


class _Solve(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.register_buffer("A", torch.randn(3, 3, generator=g))
        self.register_buffer("b", torch.randn(3, generator=g))

    def forward(self, x):
        m = self.A @ self.A.T + torch.eye(3)  # autocast runs this matmul in bfloat16
        return x * torch.linalg.solve(m, self.b).sum()  # reads back inside: tabulated


def test_tabulated_op_under_autocast_with_dynamos_guards_dropped():
    """A tabulated op's memo was keyed without autocast (and the default dtype): with Dynamo's
    guards dropped as the README shows for serving engines, a call under autocast was served the
    table computed without it (found by review 12)."""
    filt = torchsync_pass.keep_nosync_guards(torch.compiler.skip_all_guards_unsafe)
    torch._dynamo.reset()
    m = _Solve()
    g = torch.compile(_Solve(), backend="nosync", options={**EAGER, "guard_filter_fn": filt})
    for autocast in (False, True, False, True):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            assert_bitwise(g(torch.ones(2)), m(torch.ones(2)))
    assert counters["nosync"]["table_computes"] >= 2


def _with_hook(hook):
    def deco(method):
        @functools.wraps(method)
        def wrapper(*args, **kwargs):
            hook(*args, **kwargs)  # logging, validation, metrics: called before the method
            return method(*args, **kwargs)
        return wrapper
    return deco


def _log_call(module, *args, **kwargs):
    pass


class _HookedIds(nn.Module):
    @_with_hook(_log_call)
    def forward(self, x, ids):
        if (ids > 0).any():
            return x + 1
        return x


def _renamed_keyword(old, new):
    """transformers' ``deprecate_kwarg`` shape: the wrapper takes the old keyword and renames it."""
    def deco(method):
        @functools.wraps(method)
        def wrapper(*args, **kwargs):
            if old in kwargs:
                kwargs[new] = kwargs.pop(old)
            return method(*args, **kwargs)
        return wrapper
    return deco


class _RenamedIds(nn.Module):
    @_renamed_keyword("token_type", "token_types")
    def forward(self, x, token_types=None):
        if (token_types > 0).any():
            x = x + 1
        return x


class _NoGradIds(nn.Module):
    @torch.no_grad()
    def forward(self, x, ids):
        if (ids > 0).any():
            return x + 1
        return x


def _logged_hook(mod, args):
    return (args[0] * 2.0,)


def test_names_through_wrappers_that_call_more_than_the_method():
    """A wrapper calling a hook before the method had the hook taken for the function called (a
    valid name refused under strict); a forward pre-hook wrapped by functools.wraps was not seen
    as a hook (a valid module name refused) (found by review 12)."""
    x, ids = torch.ones(2), torch.tensor([1, 0])
    m = _HookedIds()
    g = _compile(m, ["ids"])
    for _ in range(2):
        assert_bitwise(g(x, ids), m(x, ids))
    m = _Masked()
    m.register_forward_pre_hook(_wraps(_logged_hook))
    ref = _Masked()
    ref.register_forward_pre_hook(_wraps(_logged_hook))
    g = _compile(m, ["self.mask"])
    for _ in range(2):
        assert_bitwise(g(torch.ones(2)), ref(torch.ones(2)))


@pytest.mark.parametrize("model, kwargs, typo", [
    (_NoGradIds, {"ids": torch.tensor([1, 0])}, "idz"),
    (_NoGradIds, {"ids": torch.tensor([1, 0])}, "self.msak"),
    (_RenamedIds, {"token_type": torch.tensor([1, 0])}, "token_tpyes"),
], ids=["no_grad_forward", "no_grad_forward_self", "renamed_keyword"])
def test_typo_reported_through_torch_and_renaming_wrappers(model, kwargs, typo):
    """A typo passed silently under strict=True in a @torch.no_grad() forward (torch's wrapper holds
    the module, not a function) and when the wrapper was called with a keyword it renames (the
    arguments did not bind to the method) (found by review 12)."""
    g = _compile(model(), [typo])
    with pytest.raises(torchsync_pass.NosyncOptionsError, match=typo.replace(".", r"\.")):
        g(torch.ones(2), **kwargs)


def _denoiser(sample, timestep):
    return sample * timestep.exp()


def _denoise(fn, latents, timesteps):
    for t in timesteps:
        latents = fn(latents, t)
    return latents


def test_typo_not_accepted_for_a_name_of_the_loop_that_calls_the_compiled_function():
    """'timesteps' (for the argument 'timestep') passed strict=True silently when the compiled
    function was called from a loop taking 'timesteps': any running caller counted, not only one
    inside the compiled call (found by review 12)."""
    g = _compile(_denoiser, ["timesteps"])
    with pytest.raises(torchsync_pass.NosyncOptionsError, match="timesteps"):
        _denoise(g, torch.ones(2), torch.tensor([0.5, 0.25]))


def _stale_under_writes(compiled, eager, write, calls=4):
    """Call ``compiled`` and ``eager`` under inference mode after ``write(v)`` changes an undeclared
    tensor in place (v = 1, -1, 1, -1): every output must be eager's."""
    with torch.inference_mode():
        for v in (1.0, -1.0, 1.0, -1.0)[:calls]:
            write(v)
            assert_bitwise(compiled(), eager())


def _helper_after_break(mask, y):  # its ``mask`` is the caller's ``x``
    torch._dynamo.graph_break()
    return y * 2.0 if (mask > 0).any() else y * 3.0


def _calls_helper(x, mask):
    return _helper_after_break(x, mask) + 1


class _InnerScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        with torch.inference_mode():
            self.register_buffer("scale", torch.ones(3))  # written in place: not declared

    def forward(self, h):
        torch._dynamo.graph_break()
        return h * 2.0 if (self.scale > 0).any() else h * 3.0


class _OuterScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        with torch.inference_mode():
            self.register_buffer("scale", torch.ones(3))  # the one declared
        self.inner = _InnerScale()

    def forward(self, h):
        return self.inner(h * self.scale)


def test_callee_compiled_alone_is_not_declared_by_its_own_names():
    """A callee compiled as a frame of its own after a graph break had its leaves matched against
    the declared names by its own local names: helper's 'mask' (the caller's undeclared x), a
    submodule's self.scale for the outer module's 'self.scale'; hoisted as declared, stale (found
    by review 12)."""
    with torch.inference_mode():
        x, mask = torch.ones(3), torch.ones(3)
    g = _compile(_calls_helper, ["mask"])
    _stale_under_writes(lambda: g(x, mask), lambda: _calls_helper(x, mask), x.fill_)
    m, h = _OuterScale(), torch.ones(3)
    g = _compile(m, ["self.scale"])
    _stale_under_writes(lambda: g(h), lambda: m(h), m.inner.scale.fill_)


def _forward_hook_style(method):
    """diffusers' ``apply_forward_hook``: ``wrapper(self, *args, **kwargs)`` around a method."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        return method(self, *args, **kwargs)
    return wrapper


class _Score(nn.Module):
    def forward(self, x, mask):  # forward's second argument is "mask"
        return x * mask

    @_forward_hook_style
    def score(self, mask, x):  # score's first
        return mask * 2.0 if (x > 0).any() else mask * 3.0


def _score(x, mask):
    return mask * 2.0 if (x > 0).any() else mask * 3.0


def test_declared_name_belongs_to_the_function_compiled():
    """A wrapped method other than forward had its arguments bound to the module's forward
    ('mask' declared score's x); a partial given __wrapped__ by update_wrapper was bound without the
    partial's own argument; both hoisted an undeclared tensor as declared, stale (found by
    review 12)."""
    m = _Score()
    with torch.inference_mode():
        x, mask = torch.ones(3), torch.ones(3)
    g = _compile(m.score, ["mask"])
    _stale_under_writes(lambda: g(mask, x), lambda: m.score(mask, x), x.fill_)
    p = functools.update_wrapper(functools.partial(_score, x), _score)  # p(mask) = _score(x, mask)
    g = _compile(p, ["mask"])
    _stale_under_writes(lambda: g(mask), lambda: p(mask), x.fill_)


def _plain(fn):
    def inner(*args, **kwargs):  # no functools.wraps: the function it calls is hidden
        return fn(*args, **kwargs)
    return inner


def test_valid_name_not_refused_behind_a_decorator_without_wraps():
    """Behind a decorator without functools.wraps (under one with it) a valid name was refused
    under strict=True (checked against the wrapper's *args/**kwargs) (found by review 12)."""
    x, tt = torch.ones(2), torch.tensor([2, 0])
    fn = _wraps(_plain(_step_with_tt))
    g = _compile(fn, ["tt"])
    for _ in range(2):
        assert_bitwise(g(x, tt), fn(x, tt))


def _step_with_tt(x, tt):
    if (tt == 2).any():
        x = x + 1
    return x


def _solve_plus_a(A, b, x):
    return torch.linalg.solve(A, b) + x


def _solve_plus_b(A, b, x):  # the same cone in another function
    return torch.linalg.solve(A, b) + x


def test_tables_of_the_same_cone_with_other_declared_leaves():
    """The tabulated ops' shared memo kept the declared flags of the graph that made it first: a
    second function with the same cone and declared inference tensors raised at call time
    ('Inference tensors do not track version counter') (found by review 12)."""
    torch._dynamo.reset()
    torchsync_pass.reset()
    torch.manual_seed(0)
    A, b = torch.randn(3, 3) + 3 * torch.eye(3), torch.randn(3)
    with torch.inference_mode():
        Ai, bi = A.clone(), b.clone()
    f_a = torch.compile(_solve_plus_a, backend="nosync", options=EAGER)
    f_b = torch.compile(_solve_plus_b, backend="nosync", options={**EAGER, "invariant": ["A", "b"]})
    with torch.no_grad():
        assert_bitwise(f_a(A, b, torch.ones(3)), _solve_plus_a(A, b, torch.ones(3)))
        assert_bitwise(f_b(Ai, bi, torch.ones(3)), _solve_plus_b(Ai, bi, torch.ones(3)))


def _write_then_solve(A, b, x):
    x.mul_(2.0)  # the step writes an argument in place
    return torch.linalg.solve(A, b) + 1.0  # reads back inside: tabulated


def test_table_not_served_when_a_written_argument_aliases_its_input():
    """A tabulated op's table was looked up before the graph ran: an argument the step writes,
    passed as a view of the table's input, changed the input eager reads (found by review 12)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    A0, b = torch.randn(3, 3) + 3 * torch.eye(3), torch.randn(3)
    f = torch.compile(_write_then_solve, backend="nosync", options=EAGER)
    Af, Ae = A0.clone(), A0.clone()
    for make in (lambda A: torch.zeros(3), lambda A: torch.zeros(3), lambda A: A.view(9)[:3]):
        assert_bitwise(f(Af, b, make(Af)), _write_then_solve(Ae, b, make(Ae)))
        assert torch.equal(Af, Ae)


def _helper_of_two(t):
    torch._dynamo.graph_break()
    return t * 2.0 if (t > 0).any() else t * 0.0


def _calls_helper_twice(x, mask):
    return _helper_of_two(mask) + _helper_of_two(x)


def test_callee_called_with_a_declared_then_an_undeclared_tensor():
    """A callee compiled alone was declared by the identity of its first call's argument (the
    declared mask) and its compiled code reused for the undeclared x: x's value, trusted by
    identity, went stale after in-place writes (found by review 12, round 3)."""
    with torch.inference_mode():
        x, mask = torch.ones(3), torch.ones(3)
    g = _compile(_calls_helper_twice, ["mask"])
    _stale_under_writes(lambda: g(x, mask), lambda: _calls_helper_twice(x, mask), x.fill_)


def _break_then_read_declared(x, mask):
    y = x * 2
    torch._dynamo.graph_break()
    return y + 1 if (mask > 0).any() else y - 1  # in the resume function


def test_declared_argument_read_after_a_graph_break_is_declared():
    """In the top-level function's resume function an argument it never assigns is still the
    declared one: a declared inference tensor is hoisted there."""
    with torch.inference_mode():
        x, mask = torch.ones(3), torch.ones(3)
    g = _compile(_break_then_read_declared, ["mask"])
    _stale_under_writes(lambda: g(x, mask), lambda: _break_then_read_declared(x, mask), x.fill_)
    assert _hoisted()


class _OtherRef(nn.Module):
    def __init__(self, mask) -> None:
        super().__init__()
        self.other = mask  # at first the declared tensor itself, re-pointed later

    def forward(self, x, mask):
        return x * 2.0 if (self.other > 0).any() else x * 0.0


def _same_object_then_break(x, mask):
    y = mask * 2
    torch._dynamo.graph_break()
    return y + 1 if (x > 0).any() else y - 1  # x: the declared object at the first call only


def test_declared_by_path_not_by_the_first_calls_objects():
    """A leaf was declared when its object was the declared one at compile time: an attribute
    bound to the declared tensor at the first call and re-pointed later, an argument passed the
    declared object at the first call and another later; trusted by identity, stale after
    in-place writes (found by review 12, round 4)."""
    with torch.inference_mode():
        x, mask, other = torch.ones(3), torch.ones(3), torch.ones(3)
    m = _OtherRef(mask)
    g = _compile(m, ["mask"])
    with torch.inference_mode():
        assert_bitwise(g(x, mask), m(x, mask))
    m.other = other
    _stale_under_writes(lambda: g(x, mask), lambda: m(x, mask), other.fill_)
    g = _compile(_same_object_then_break, ["mask"])
    with torch.inference_mode():
        assert_bitwise(g(mask, mask), _same_object_then_break(mask, mask))
    _stale_under_writes(lambda: g(x, mask), lambda: _same_object_then_break(x, mask), x.fill_)


class _OwnVarargs(nn.Module):
    def forward(self, *args, **kwargs):
        return args[0] * 2.0 if (kwargs["mask"] > 0).any() else args[0]


def test_typo_reported_in_a_forward_of_ones_own_taking_args_and_kwargs():
    """A forward of one's own taking (self, *args, **kwargs) was taken for a decorator's wrapper:
    a typo passed strict=True silently and a valid 'kwargs.mask' declared nothing (found by review
    12, round 4)."""
    g = _compile(_OwnVarargs(), ["kwargs.mssk"])
    with pytest.raises(torchsync_pass.NosyncOptionsError, match="mssk"):
        g(torch.ones(3), mask=torch.ones(3))
    with torch.inference_mode():
        x, mask = torch.ones(3), torch.ones(3)
    m = _OwnVarargs()
    g = _compile(m, ["kwargs.mask"])
    with torch.inference_mode():
        for _ in range(2):
            assert_bitwise(g(x, mask=mask), m(x, mask=mask))
    assert _hoisted()


def _outer_rebinds(x, mask):
    def swap():
        nonlocal mask
        mask = x  # rebinds the argument from a closure
    swap()
    torch._dynamo.graph_break()
    return x * 2.0 if (mask > 0).any() else x * 3.0  # mask is x here


def _outer_with_same_named_helper(x, mask):
    def _outer_with_same_named_helper(mask):  # a nested function of the same name
        torch._dynamo.graph_break()
        return mask * 2.0 if (mask > 0).any() else mask * 0.0
    return _outer_with_same_named_helper(x)


@pytest.mark.parametrize("fn", [_outer_rebinds, _outer_with_same_named_helper])
def test_resume_function_of_a_rebound_or_nested_name_is_not_declared(fn):
    """A resume function counted as the compiled function's for an argument a closure rebinds
    (nonlocal), and for a nested function of the same name: the caller's undeclared x was
    declared and went stale (found by review 12, round 5)."""
    with torch.inference_mode():
        x, mask = torch.ones(3), torch.ones(3)
    g = _compile(fn, ["mask"])
    _stale_under_writes(lambda: g(x, mask), lambda: fn(x, mask), x.fill_)


class _Tables:
    def __init__(self) -> None:
        torch.manual_seed(0)
        self.A = torch.randn(5, 3, 3, dtype=torch.float64) + 3 * torch.eye(3, dtype=torch.float64)
        self.b = torch.randn(5, 3, dtype=torch.float64)


def _data_write_then_table(s, i, x):
    x.data.add_(1)  # a write that does not move the version counter
    return torch.linalg.solve(s.A[i], s.b[i]) + x.sum()


def test_table_forgotten_after_a_call_whose_hidden_write_aliases_its_input():
    """A call where a written argument aliased a table's input ran the original graph but kept the
    table: the write (through .data) left the input's version as it was, and the next calls were
    served the table from before it (found by review 12, round 7)."""
    torch._dynamo.reset()
    g = torch.compile(_data_write_then_table, backend="nosync", options=EAGER)
    sc, se = _Tables(), _Tables()
    for k in range(5):
        xc = sc.A[3, 0] if k == 2 else torch.zeros(3, dtype=torch.float64)
        xe = se.A[3, 0] if k == 2 else torch.zeros(3, dtype=torch.float64)
        assert_bitwise(g(sc, 3, xc), _data_write_then_table(se, 3, xe))


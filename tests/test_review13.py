"""Review 13 (2026-12-03): declared names (options["invariant"]), each test failing on the commit
before its fix."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import torchsync_pass

from test_core import assert_bitwise

EAGER = {"codegen": "eager"}


def _compile(fn, invariant, strict=True):
    torch._dynamo.reset()
    torchsync_pass.reset()
    return torch.compile(fn, backend="nosync", options={**EAGER, "invariant": invariant, "strict": strict})


def _hoisted_leaves() -> list:
    return [d.leaves for d in torchsync_pass.decisions() if d.action.value == "hoisted"]


class _Block(nn.Module):
    """Holds a child of its own class; the child runs before the graph break."""

    def __init__(self, child=None) -> None:
        super().__init__()
        with torch.inference_mode():
            self.register_buffer("mask", torch.ones(4))
        self.child = child

    def forward(self, x):
        if self.child is not None:
            x = self.child(x)
        print("", end="")  # graph break
        return x * 2 if (self.mask > 0).any() else x * 3


def test_a_child_module_of_the_same_class_is_not_declared_by_the_modules_name():
    """The child's frames have the code of the function given to torch.compile: 'self.mask' (the
    top module's) declared the child's undeclared inference buffer too, guarded by identity only,
    and an in-place write to it was served the branch from before."""
    m = _Block(_Block())
    g = _compile(m, ["self.mask"])
    with torch.inference_mode():
        x = torch.ones(4)
        for v in (1.0, -3.0, 3.0, -3.0):
            m.child.mask.add_(v)
            assert_bitwise(g(x), m(x))


def _recursive(x, mask, inner=None):
    if inner is not None:
        x = _recursive(x, inner)
    print("", end="")  # graph break
    return x * 2 if (mask > 0).any() else x * 3


def _recursive_late(x, mask, inner=None):
    print("", end="")  # graph break: the outer call's resume function compiles first
    if inner is not None:
        x = _recursive_late(x, inner)
    return x * 2 if (mask > 0).any() else x * 3


def test_a_recursive_call_does_not_inherit_the_declared_names():
    """The inner call's 'mask' is the outer call's undeclared 'inner': declared by path before."""
    for fn in (_recursive, _recursive_late):
        g = _compile(fn, ["mask"])
        with torch.inference_mode():
            x, mask, other = torch.ones(4), torch.ones(4), torch.ones(4)
            for v in (1.0, -3.0, 3.0, -3.0):
                other.add_(v)
                assert_bitwise(g(x, mask, other), fn(x, mask, other))
        assert ("mask",) in _hoisted_leaves(), fn.__name__  # the outer call's own name still counts


def test_a_graph_compiled_for_the_call_itself_refuses_a_later_nested_call():
    """The entry and resume graphs compiled (with 'self.mask' declared) before the module had a
    child of its own class; the child's calls then pass their other guards: the nosync guard
    fails them (names.nested), and the recompile there declares nothing."""
    m = _Block()
    g = _compile(m, ["self.mask"])
    with torch.inference_mode():
        x = torch.ones(4)
        assert_bitwise(g(x), m(x))
        assert ("self.mask",) in _hoisted_leaves()
        m.child = _Block()
        for v in (1.0, -3.0, 3.0, -3.0):
            m.child.mask.add_(v)
            assert_bitwise(g(x), m(x))


def _closing_over(mask):
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            with torch.inference_mode():
                self.register_buffer("mask", torch.ones(4))  # the declared one

        def forward(self, x):
            a = 2.0 if (self.mask > 0).any() else 3.0
            return x * a if (mask > 0).any() else x - a  # the closure's, undeclared

    return M()


def test_a_variable_the_function_closes_over_is_not_declared_by_its_name():
    """'mask' (the module's self.mask) declared the closure variable 'mask' too (its guard source
    is L['mask'] like an argument's), so its in-place write was served the branch from before."""
    with torch.inference_mode():
        mask = torch.ones(4)
    m = _closing_over(mask)
    g = _compile(m, ["mask"])
    with torch.inference_mode():
        x = torch.ones(4)
        for v in (1.0, -3.0, 3.0, -3.0):
            mask.add_(v)
            assert_bitwise(g(x), m(x))
    assert ("self.mask",) in _hoisted_leaves()


def _optional_mask(x, attention_mask=None):
    if attention_mask is not None:
        x = x * attention_mask
    return x * 2 if (x > 0).any() else x * 3


def test_strict_accepts_an_optional_tensor_argument_passed_none():
    """attention_mask=None passed explicitly (as transformers' callers do) was refused under
    strict: 'attention_mask is a NoneType, not a tensor'."""
    g = _compile(_optional_mask, ["attention_mask"])
    with torch.inference_mode():
        mask = torch.ones(4)
        for kw in ({"attention_mask": mask}, {"attention_mask": None}, {}):
            assert_bitwise(g(torch.ones(4), **kw), _optional_mask(torch.ones(4), **kw))


class _InferenceMask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        with torch.inference_mode():
            self.register_buffer("mask", torch.ones(4))

    def forward(self, x):
        return x * 2 if (self.mask > 0).any() else x * 3


@pytest.mark.parametrize("name", ["self.mask.data", "self.mask.T", "mask.data"])
def test_strict_refuses_a_path_that_goes_on_past_a_tensor(name):
    """'self.mask.data' resolved to a tensor and passed strict, yet no leaf is ever named so: the
    inference buffer stayed undeclared (rejected) without a word."""
    g = _compile(_InferenceMask(), [name])
    with torch.inference_mode(), pytest.raises(torchsync_pass.NosyncOptionsError, match="a declared path ends at one"):
        g(torch.ones(4))


def _shifts_args(f):
    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        return f(*args[1:], **kwargs)  # drops a leading request id

    return wrapper


def _sync_on_x(x, mask, bias=None):
    a = 2.0 if (x > 0).any() else 3.0
    return x * a + mask if bias is None else x * a + mask + bias


def test_a_wraps_wrapper_that_shifts_its_args_is_where_the_names_belong():
    """A functools.wraps wrapper shaped (*args, **kwargs) that hands on args[1:] was taken as
    passing its arguments on: 'mask' was bound to the wrapper's args.1, the function's x, and the
    undeclared x was served the branch from before its in-place write."""
    w = _shifts_args(_sync_on_x)
    g = _compile(w, ["mask"], strict=False)
    with torch.inference_mode():
        x, mask = torch.ones(4), torch.ones(4)
        for v in (1.0, -3.0, 3.0, -3.0):
            x.add_(v)
            assert_bitwise(g(0, x, mask), w(0, x, mask))


class _Sibling(nn.Module):
    """Calls another module of its own class from a forward hook: a call of the same code made
    after the compiled call's own frames returned."""

    def __init__(self) -> None:
        super().__init__()
        with torch.inference_mode():
            self.register_buffer("mask", torch.ones(4))

    def forward(self, x):
        print("", end="")  # graph break
        return x * 2 if (self.mask > 0).any() else x * 3


def test_a_sibling_of_the_same_class_called_from_a_hook_is_not_declared():
    """The sibling's frames ran after the top's had returned, so nothing on the stack told them
    apart: 'self.mask' declared the sibling's buffer (review 13, round 2). The declared path must
    name the leaf itself in the call's arguments, at the trace and at the guard."""
    top, other = _Sibling(), _Sibling()
    top.register_forward_hook(lambda mod, args, out: other(out))
    g = _compile(top, ["self.mask"])
    with torch.inference_mode():
        x = torch.ones(4)
        for v in (1.0, -3.0, 3.0, -3.0):
            other.mask.add_(v)
            assert_bitwise(g(x), top(x))
    assert ("self.mask",) in _hoisted_leaves()  # the top's own


def _calls_twice(f):
    @functools.wraps(f)
    def w(*args, **kwargs):
        y = f(*args, **kwargs)
        return f(y, kwargs["other"])

    return w


def _sync_on_mask(x, mask, other=None):
    print("", end="")  # graph break
    return x * 2 if (mask > 0).any() else x * 3


def test_a_wrapper_calling_the_function_twice_declares_only_the_first_calls_arguments():
    w = _calls_twice(_sync_on_mask)
    g = _compile(w, ["mask"])
    with torch.inference_mode():
        x, mask, other = torch.ones(4), torch.ones(4), torch.ones(4)
        for v in (1.0, -3.0, 3.0, -3.0):
            other.add_(v)
            assert_bitwise(g(x, mask, other=other), w(x, mask, other=other))


class _Solve(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        with torch.inference_mode():
            self.register_buffer("R", torch.eye(2) * 2)
            self.register_buffer("b", torch.ones(2))

    def forward(self, x):
        print("", end="")  # graph break
        return x * torch.linalg.solve(self.R, self.b).sum()


def test_a_tabulated_op_serves_only_the_call_its_declared_leaves_belong_to():
    """The table's memo checks declared leaves by identity only and no guard asked the paths: a
    sibling of the module's class, called from a hook, was served the top module's table after
    writes to its own undeclared inference buffer (review 13, round 3). Also: the paths were
    resolved inside torch._dynamo.disable's wrapper around the graph, not in the compiled call."""
    top, other = _Solve(), _Solve()
    top.register_forward_hook(lambda mod, args, out: other(out))
    g = _compile(top, ["self.R", "self.b"])
    with torch.inference_mode():
        x = torch.ones(2)
        for v in (0.0, 0.0, 1.0, 3.0):
            other.R.add_(v)
            assert_bitwise(g(x), top(x))
    assert any(d.action.value == "tabulated" for d in torchsync_pass.decisions())


class _PropertyMask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        with torch.inference_mode():
            self.register_buffer("_mask", torch.ones(4))

    @property
    def mask(self):
        return self._mask

    def forward(self, x):
        return x * 2 if (self.mask > 0).any() else x * 3


def test_strict_refuses_a_declared_property():
    """'self.mask' naming a property resolved to a tensor and passed strict, but the leaf is
    named by what the property reads (self._mask): nothing was declared, without a word."""
    g = _compile(_PropertyMask(), ["self.mask"])
    with torch.inference_mode(), pytest.raises(torchsync_pass.NosyncOptionsError, match="is a property"):
        g(torch.ones(4))


def _exp_weight(x, w, b=None, other=None):
    print("", end="")  # graph break
    return x * w.exp()


def _twice_with_other(fn):
    @functools.wraps(fn)
    def wr(*args, **kwargs):
        return fn(*args, **kwargs), fn(kwargs["b"], kwargs["other"])

    return wr


def test_the_invariant_cache_does_not_take_another_calls_weight_as_declared():
    """A declared weight (requires grad) is cached; the second call of the same function inside
    the wrapper passes another, undeclared weight, which was cached too and served stale after a
    write behind its version counter (.data, as fused optimizers do; review 13, round 3)."""
    wr = _twice_with_other(_exp_weight)
    g = _compile(wr, ["w"])
    w, other = nn.Parameter(torch.ones(4)), nn.Parameter(torch.ones(4))
    x = torch.ones(4)
    with torch.no_grad():
        for step in range(4):
            if step >= 2:
                other.data.add_(1.0)
            for got, want in zip(g(x, w, b=x, other=other), wr(x, w, b=x, other=other)):
                assert_bitwise(got, want)
    assert any(d.action.value == "cached" for d in torchsync_pass.decisions())


def _break_then_sync(x, mask):
    print("", end="")  # graph break
    return x * 2 if (mask > 0).any() else x * 3


def test_a_guard_resolves_its_paths_only_in_calls_of_its_own_compile():
    """Dynamo runs a cache entry's guards for a call of another compile of the same function
    too: the declared path was resolved in that call's arguments, so its undeclared tensor was
    memoized as declared (by identity) and served stale to the declaring compile after a write
    (review 13, round 4)."""
    torch._dynamo.reset()
    torchsync_pass.reset()
    declaring = torch.compile(_break_then_sync, backend="nosync",
                              options={**EAGER, "invariant": ["mask"], "strict": True})
    other = torch.compile(_break_then_sync, backend="nosync", options=EAGER)
    with torch.inference_mode():
        x, m1, m2 = torch.ones(4), torch.ones(4), torch.ones(4)
        assert_bitwise(declaring(x, m1), _break_then_sync(x, m1))
        assert_bitwise(other(x, m2), _break_then_sync(x, m2))
        m2.mul_(-1)
        assert_bitwise(declaring(x, m2), _break_then_sync(x, m2))


class _LinBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, mask):
        y = self.lin(x)
        return y * 2 if (mask > 0).any() else y * 3


def test_blocks_compiled_one_by_one_with_the_same_options_share_their_declaration():
    """Regional compilation (diffusers' compile_repeated_blocks: block.compile() per block): one
    graph serves every block; 645cc0d resolved the paths only in calls of the very compile they
    were found in, so each block's call failed the others' guards, recompiled, and the site was
    demoted (review 13, round 5). Calls of compiles declaring the same names share it."""
    torch._dynamo.reset()
    torchsync_pass.reset()
    torch.manual_seed(0)
    blocks = [_LinBlock() for _ in range(6)]
    ref = [_LinBlock() for _ in range(6)]
    for b, r in zip(blocks, ref):
        r.load_state_dict(b.state_dict())
        b.compile(backend="nosync", options={**EAGER, "invariant": ["mask"], "strict": True})
    counters = torch._dynamo.utils.counters
    counters.clear()
    with torch.inference_mode():
        for req in range(4):
            mask = torch.ones(4) * (1 if req % 2 else -1)
            x = y = torch.randn(1, 4)
            for _ in range(3):
                for b, r in zip(blocks, ref):
                    x, y = b(x, mask), r(y, mask)
                assert_bitwise(x, y)
    assert counters["stats"]["unique_graphs"] <= 2
    assert counters["nosync"]["guard_hits"] > 0 and not counters["nosync"]["demoted"]


def test_a_context_whose_callback_raises_declares_nothing():
    """names._declares read the compile's options outside its try: an entry frame's context
    whose callback property raised let the exception out of the guard (review 13, round 6)."""
    from torchsync_pass import names

    class _RaisingCallback:
        @property
        def callback(self):
            raise RuntimeError("boom")

    assert names._declares(_RaisingCallback()) is None

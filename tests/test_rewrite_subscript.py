"""A tensor subscripted at a step-varying 0-d integer tensor: ``table[t]`` as a device-side gather.

Eager's ``table[t]`` reads ``t`` to the host inside the subscript (``t.item()``, then a select);
stock Dynamo breaks the graph there (its fake tensors cannot run the read), before any hook on a
TensorVariable method. nosync wraps the BINARY_SUBSCR handler and traces ``aten.index(table, [t])``
(dynamo_hooks' Note [Rewriting a subscript at a tensor index]). The loop below is the form of
diffusers' DDIMScheduler.step, without the library: a table read at the step's timestep tensor and
at ``prev = t - k`` behind ``if prev >= 0`` (a select, once the test is demoted as step-varying).
Every call is compared bitwise with eager; syncs are counted with ``count_syncs()``.
"""

from __future__ import annotations

import pytest
import torch

from test_rewrite_branch import assert_bitwise, compiled, decisions, syncs
from torchsync_pass import Action, Reason, dynamo_hooks


needs_select = pytest.mark.skipif(dynamo_hooks._torch_version() < dynamo_hooks.SELECT_MIN_TORCH,
                                  reason="the device-side select needs torch 2.13+ (dynamo_hooks.SELECT_MIN_TORCH)")


class Schedule:
    """DDIM's tables at toy size: ``alphas_cumprod`` over 40 train steps, ``final_alpha_cumprod``."""

    def __init__(self, n=40):
        self.alphas_cumprod = torch.cumprod(torch.linspace(0.999, 0.9, n), 0)
        self.final_alpha_cumprod = torch.tensor(1.0)
        self.ratio = 5


def ddim_like(s, x, t):
    prev = t - s.ratio
    alpha = s.alphas_cumprod[t]
    alpha_prev = s.alphas_cumprod[prev] if prev >= 0 else s.final_alpha_cumprod
    return alpha_prev ** 0.5 * (x - (1 - alpha) ** 0.5) / alpha ** 0.5


@needs_select
@torch.no_grad()
def test_schedule_loop_runs_without_syncs_once_steady():
    s, x = Schedule(), torch.linspace(-1.0, 1.0, 8)
    fn = compiled(ddim_like)
    per_call = []
    for request in range(3):
        y = x.clone()
        for t in torch.arange(36, -1, -s.ratio):  # new 0-d tensors, the last one's prev < 0
            y_eager = ddim_like(s, y, t)
            y, n = syncs(fn, s, y, t)
            assert_bitwise(y, y_eager)
            per_call.append(n)
    assert per_call[-8:] == [0] * 8, per_call  # the third request: no host read at all
    assert decisions(Action.REWRITTEN, Reason.INDEX_TENSOR)
    assert decisions(Action.REWRITTEN, Reason.BRANCH_WHERE)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.int8])
@torch.no_grad()
def test_gather_at_any_integer_index_is_eager_s_row(dtype):
    table = torch.randn(10, 3)

    def f(table, t):
        return table[t] * 2

    fn = compiled(f)
    for v in (0, 9, -1, -10, 4):
        t = torch.tensor(v, dtype=dtype)
        got, n = syncs(fn, table, t)
        assert_bitwise(got, f(table, t))
        assert n == 0
    assert decisions(Action.REWRITTEN, Reason.INDEX_TENSOR)


@pytest.mark.parametrize("bad", [10, -11])
@torch.no_grad()
def test_out_of_range_index_raises_eager_s_index_error(bad):
    table = torch.randn(10, 3)

    def f(t):
        return table[t] + 1

    fn = compiled(f)
    assert_bitwise(fn(torch.tensor(3)), f(torch.tensor(3)))
    with pytest.raises(IndexError) as eager_err:
        f(torch.tensor(bad))
    with pytest.raises(IndexError) as err:
        fn(torch.tensor(bad))
    assert str(err.value) == str(eager_err.value)


@torch.no_grad()
def test_row_written_or_returned_keeps_eager_s_view():
    def written(table, t):
        r = table[t]
        r.mul_(2)  # eager writes the table through its view
        return table.sum(0)

    def returned(table, t):
        return table[t]

    for f in (written, returned):
        torch._dynamo.reset()
        fn = compiled(f)
        table_eager, table = torch.arange(12.0).reshape(4, 3), torch.arange(12.0).reshape(4, 3)
        for v in (1, 3):
            want, got = f(table_eager, torch.tensor(v)), fn(table, torch.tensor(v))
            assert_bitwise(got, want)
            assert_bitwise(table, table_eager)
        if f is returned:
            # eager's row: a view of the table's memory, not a copy
            assert got.untyped_storage().data_ptr() == table.untyped_storage().data_ptr()
    assert len({d.code for d in decisions(Action.KEPT, Reason.REWRITE_ALIASED)}) == 2


@torch.no_grad()
def test_keys_and_tables_the_gather_does_not_take():
    strided = torch.randn(3, 5).t()  # rows are strided views: eager's row is not contiguous

    def f(t):
        return strided[t] + 1

    fn = compiled(f)
    for v in (2, 1, 0):
        out, n = syncs(fn, torch.tensor(v))
        assert_bitwise(out, f(torch.tensor(v)))
    # stock Dynamo specializes on an input index's value: a guard reads it at every call
    assert n >= 1
    assert decisions(Action.KEPT, Reason.REWRITE_TABLE)
    table = torch.randn(4, 3)

    def g(t):
        return table[t] * 2

    fn = compiled(g)
    for t in (torch.tensor(True), torch.tensor(1, dtype=torch.uint8), torch.tensor([2, 0])):
        assert_bitwise(fn(t), g(t))  # a 0-d bool/uint8 key is a mask; a 1-d key needs no host read
    assert not decisions(Action.REWRITTEN)


def has_name(name, names):
    """An `in` between two Python constants (no tensor can take part): not an identity use."""
    return name in names


@needs_select
@torch.no_grad()
def test_in_between_constants_after_a_select_keeps_the_select():
    pad = torch.zeros(3)

    def step(x, t):
        y = pad if t[0] > 0 else x * 2
        # nor in `is` between classes or `in` of a dtype in a set of dtypes
        same = has_name("a", ("a", "b")) and type(x) is torch.Tensor and x.dtype in {torch.float32}
        return y + 1 if same else y

    fn = compiled(step)
    for s in range(6):
        t = torch.tensor([1 - 2 * (s % 2)])
        out, n = syncs(fn, torch.ones(3), t)
        assert_bitwise(out, step(torch.ones(3), t))
    assert n == 0
    assert decisions(Action.REWRITTEN, Reason.BRANCH_WHERE)
    assert not decisions(Action.KEPT, Reason.BRANCH_IDENTITY)


def test_new_hook_points_are_self_tested():
    res = dynamo_hooks.self_test()
    names = ["BINARY_SUBSCR (dispatch_table)"]
    if dynamo_hooks._torch_version() >= dynamo_hooks.SELECT_MIN_TORCH:  # they serve the select only
        names += ["IS_OP (dispatch_table)", "CONTAINS_OP (dispatch_table)"]
    for name in names:
        assert res[name] is True, res


@torch.no_grad()
def test_an_active_torch_function_mode_serves_the_subscript():
    # a mode may answer Tensor.__getitem__ itself (serve rows from elsewhere, log them): the hook
    # leaves the subscript to Dynamo, which dispatches the mode (the gather skipped it: wrong rows)
    from torch.overrides import TorchFunctionMode

    table, other = torch.arange(12.0).reshape(4, 3), -torch.arange(12.0).reshape(4, 3)

    class Redirect(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.Tensor.__getitem__ and args[0] is table:
                return other[args[1]]
            return func(*args, **(kwargs or {}))

    def f(t):
        return table[t] + 0

    fn = compiled(f)
    with Redirect():
        for v in (1, 2):
            t = torch.tensor(v)
            assert_bitwise(fn(t), f(t))  # were table's rows, not the mode's
    # (the mode's own other[...] runs with modes off: a gather there is eager's row)
    assert not [d for d in decisions(Action.REWRITTEN) if "table[t]" in d.source]


@torch.no_grad()
def test_a_lazy_conjugate_table_is_not_gathered():
    # eager's row keeps the conjugate bit (view_as_real refuses it); a gathered row was resolved
    table = torch.tensor([[1 + 2j, 3 - 1j], [0.5j, 2 + 0j]], dtype=torch.complex64).conj()

    def f(t):
        return table[t] * 1

    fn = compiled(f)
    t = torch.tensor(1)
    got = fn(t)
    assert got.is_conj() == f(t).is_conj() and torch.equal(got.resolve_conj(), f(t).resolve_conj())
    assert not decisions(Action.REWRITTEN)
    assert [d.reason for d in decisions(Action.KEPT)] == [Reason.REWRITE_TABLE]

"""Errors of device-side reads outside the frame's own handlers (hostile review 7, 2026-12-02).

A rewritten read that raises does so inside the graph, after the trace. Review 6 followed the
exception handlers of the frame and of its callers; this round found the other ways eager's error
differs from the graph's: a read in a generator (its consumer, even its frame, is not known at the
trace), a read in an except body (eager chains the new error to the handled one), and the global
state eager leaves after unwinding (inference mode kept on by the error's traceback, grad mode set
by a bare ``torch.set_grad_enabled``, the SDP overrideable switch and priority order). An attribute
set on a tensor through another name than the list or the arm (a dict, an argument) also reached
eager's object and not nosync's copy. Each test of a defect fails on the commit before; the
with-block cases of the last state test check that those reads stay rewritten.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from test_rewrite_branch import assert_bitwise, compiled, decisions
from torchsync_pass import Action, Reason

TABLE = torch.arange(8.0).reshape(4, 2)


def outcome(fn, *args):
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - the type is what is compared
        return type(e)


def gen(tab, tok):
    yield tab[tok + 0] * 1


def consume(g, tab):
    try:
        return next(g)
    except IndexError:
        return tab[0] * -1


def generator_resumed_in_a_helpers_try(tab, tok):
    return consume(gen(tab, tok), tab)


def genexpr_summed_in_a_helpers_try(tab, tok):
    g = (tab[tok + k] for k in (0,))

    def total():
        try:
            return sum(g)
        except IndexError:
            return tab[0] * -1

    return total()


def make_generator(tab, tok):
    return gen(tab, tok)


def consume_outside(mk, tab, tok):
    g = mk(tab, tok)
    try:
        return next(g)
    except IndexError:
        return "caught"


@pytest.mark.parametrize("fn", [generator_resumed_in_a_helpers_try, genexpr_summed_in_a_helpers_try],
                         ids=["next", "genexpr-sum"])
def test_a_read_in_a_generator_is_kept(fn):
    f = compiled(fn)
    for tok in (1, 9, 2, 9):
        want = outcome(fn, TABLE, torch.tensor(tok))
        got = outcome(f, TABLE, torch.tensor(tok))
        assert isinstance(want, torch.Tensor), want
        assert_bitwise(got, want)
    assert not decisions(Action.REWRITTEN)
    assert any("generator" in d.detail for d in decisions(Action.KEPT, Reason.REWRITE_OTHER_USE))


def test_a_generator_returned_by_the_step_is_not_run_to_an_error_at_the_call():
    f = compiled(make_generator)
    assert_bitwise(consume_outside(f, TABLE, torch.tensor(1)), consume_outside(make_generator, TABLE, torch.tensor(1)))
    assert consume_outside(make_generator, TABLE, torch.tensor(9)) == "caught"
    assert consume_outside(f, TABLE, torch.tensor(9)) == "caught"
    assert not decisions(Action.REWRITTEN)


def read_in_an_except_body(tab, tok):
    try:
        raise ValueError("first")
    except ValueError:
        y = tab[tok + 0] * 1
    return y


def test_a_read_in_an_except_body_keeps_the_error_chained_to_the_handled_one():
    f = compiled(read_in_an_except_body)
    assert_bitwise(f(TABLE, torch.tensor(1)), read_in_an_except_body(TABLE, torch.tensor(1)))
    for fn in (read_in_an_except_body, f):
        with pytest.raises(IndexError) as info:
            fn(TABLE, torch.tensor(9))
        assert type(info.value.__context__) is ValueError
    assert not decisions(Action.REWRITTEN)


def read_in_inference_mode(tab, tok):
    with torch.inference_mode():
        y = tab[tok + 0] * 1
    return y


def read_after_a_bare_no_grad(tab, tok):
    torch.set_grad_enabled(False)
    return tab[tok + 0] * 1


@torch.no_grad()
def _decorated(tab, tok):
    return tab[tok + 0] * 1


def read_in_a_decorated_helper(tab, tok):
    return _decorated(tab, tok) + 0


def read_after_a_bare_sdp_switch(tab, tok):
    torch.backends.cuda.enable_math_sdp(False)
    with sdpa_kernel(SDPBackend.MATH):
        return tab[tok + 0] * 1


def _state():
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), torch.backends.cuda.math_sdp_enabled(),
            torch.backends.cuda.flash_sdp_enabled())


def _reset_state():
    torch.set_grad_enabled(True)
    torch.backends.cuda.enable_math_sdp(True)
    torch.backends.cuda.enable_flash_sdp(True)


@pytest.mark.parametrize("fn", [read_in_inference_mode, read_after_a_bare_no_grad, read_after_a_bare_sdp_switch],
                         ids=["inference_mode", "bare-set_grad_enabled", "bare-sdp-switch"])
def test_a_read_whose_error_leaves_another_state_than_the_entry_state_is_kept(fn):
    f = compiled(fn)
    try:
        for tok in (1, 9, 2, 9):
            _reset_state()
            want = outcome(fn, TABLE, torch.tensor(tok))
            fallback = torch.zeros(1)  # made after the error, as a handler would
            want_state = _state() + (fallback.is_inference(),)
            _reset_state()
            got = outcome(f, TABLE, torch.tensor(tok))
            fallback = torch.zeros(1)
            assert _state() + (fallback.is_inference(),) == want_state
            if isinstance(want, torch.Tensor):
                assert_bitwise(got, want)
            else:
                assert got is want
        assert not decisions(Action.REWRITTEN)
    finally:
        _reset_state()


def read_in_sdpa_kernel_with_priority(tab, tok):
    with sdpa_kernel([SDPBackend.MATH, SDPBackend.FLASH_ATTENTION], set_priority=True):
        return tab[tok + 0] * 1


def read_under_no_grad_block(tab, tok):
    with torch.no_grad():
        return tab[tok + 0] * 1


def _sdp_all():
    over = getattr(torch._C, "_get_overrideable_sdp_enabled", lambda: None)()
    order = getattr(torch._C, "_get_sdp_priority_order", lambda: None)()
    return over, order


@pytest.mark.parametrize("fn", [read_in_sdpa_kernel_with_priority, read_under_no_grad_block, read_in_a_decorated_helper],
                         ids=["sdpa_kernel-priority", "no_grad-block", "no_grad-decorator"])
def test_a_read_in_a_with_block_is_rewritten_and_its_error_restores_every_switch(fn):
    before = _sdp_all()
    f = compiled(fn)
    try:
        assert_bitwise(f(TABLE, torch.tensor(1)), fn(TABLE, torch.tensor(1)))
        assert decisions(Action.REWRITTEN)
        assert outcome(f, TABLE, torch.tensor(9)) is IndexError
        assert _sdp_all() == before
        assert torch.is_grad_enabled()
    finally:
        _reset_state()
        if before[0] is not None:
            torch._C._set_sdp_use_overrideable(before[0])
            torch._C._set_sdp_priority_order(list(before[1]))


def _rows():
    return [torch.arange(2.0) + 2 * i for i in range(4)]


def tag_through_a_dict_then_read_a_row(rows, d, t):
    d["x"].tag = 3
    r = rows[t.item()]
    return r * getattr(r, "tag", 1)


def tag_an_arm_after_the_select(a, b, xs):
    y = a if xs[0] > 0 else b
    a.tag = 2
    return y * getattr(y, "tag", 1)


def tag_a_temporary_arm_after_the_select(x, b, xs):
    a = x * 2
    y = a if xs[0] > 0 else b
    a.tag = 2
    return y * getattr(y, "tag", 1)


def test_an_attribute_set_through_another_name_keeps_the_list_read():
    f = compiled(tag_through_a_dict_then_read_a_row)
    for t in (1, 2, 1):
        rows, theirs = _rows(), _rows()
        got = f(rows, {"x": rows[1]}, torch.tensor(t))
        assert_bitwise(got, tag_through_a_dict_then_read_a_row(theirs, {"x": theirs[1]}, torch.tensor(t)))
    assert not decisions(Action.REWRITTEN)
    assert decisions(Action.KEPT, Reason.REWRITE_ALIASED)


@pytest.mark.parametrize("fn", [tag_an_arm_after_the_select, tag_a_temporary_arm_after_the_select],
                         ids=["input-arm", "temporary-arm"])
def test_an_attribute_set_on_an_arm_after_the_select_keeps_the_branch(fn):
    f = compiled(fn)
    for v in (1, -1, 1, -1, 1, -1):
        args = lambda: (torch.ones(2), torch.full((2,), 3.0), torch.tensor([v]))  # noqa: E731
        assert_bitwise(f(*args()), fn(*args()))
    assert not decisions(Action.REWRITTEN)


# Review 7b (a second hostile review of the rules above).


def read_in_autocast(tab, tok):
    with torch.autocast("cpu", dtype=torch.float16):
        return tab[tok + 0] @ torch.ones(2, 2)


def read_with_saved_tensor_hooks_disabled(tab, tok):
    with torch.autograd.graph.disable_saved_tensors_hooks("no hooks here"):
        return tab[tok + 0] * 1


def _other_state():
    return (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),
            torch._C._autograd._saved_tensors_hooks_is_enabled())


@pytest.mark.parametrize("fn", [read_in_autocast, read_with_saved_tensor_hooks_disabled],
                         ids=["autocast", "saved-tensor-hooks"])
def test_a_read_in_a_with_block_whose_state_is_not_restored_is_kept(fn):
    f = compiled(fn)
    before = _other_state()
    for tok in (1, 9, 2, 9):
        want = outcome(fn, TABLE, torch.tensor(tok))
        assert _other_state() == before
        got = outcome(f, TABLE, torch.tensor(tok))
        assert _other_state() == before
        if isinstance(want, torch.Tensor):
            assert_bitwise(got, want)
        else:
            assert got is want
    assert not decisions(Action.REWRITTEN)


def sets_the_default_dtype(x):
    torch.set_default_dtype(torch.float64)
    return x + torch.zeros(2, dtype=torch.float32)


def test_a_global_setter_in_the_step_runs_at_every_call():
    f = compiled(sets_the_default_dtype)
    try:
        for _ in range(3):
            torch.set_default_dtype(torch.float32)
            want = sets_the_default_dtype(torch.ones(2))
            torch.set_default_dtype(torch.float32)
            assert_bitwise(f(torch.ones(2)), want)
            assert torch.get_default_dtype() is torch.float64
    finally:
        torch.set_default_dtype(torch.float32)

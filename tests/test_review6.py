"""Exception handlers around device-side reads (hostile review 6, 2026-12-01).

Review 5 kept every read under an exception handler, which also kept reads whose handler never
ends the exception: a ``finally`` body, a comprehension's cleanup (Python 3.12+ inlines list
comprehensions, with a handler that restores the loop variable and re-raises), and ``with``
blocks of context managers that never swallow (``record_function``, ``sdpa_kernel``). Those are
rewritten again. A handler in a calling frame (a helper inlined into a ``try``) now counts: its
``except IndexError`` caught eager's error, so that read is kept. Each test fails on the commit
before.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from test_rewrite_branch import assert_bitwise, compiled, decisions
from torchsync_pass import Action, Reason

TABLE = torch.arange(8.0).reshape(4, 2)
ROWS = list(TABLE.clone().unbind(0))


def read_in_record_function(tab, tok):
    with torch.profiler.record_function("step"):
        return tab[tok + 0] * 1


def read_in_sdpa_kernel(tab, tok):
    with sdpa_kernel(SDPBackend.MATH):
        return tab[tok + 0] * 1


def read_in_try_finally(tab, tok):
    try:
        y = tab[tok + 0] * 1
    finally:
        pass
    return y


def read_in_list_comprehension(tab, tok):
    return [tab[tok + 0] * k for k in (1.0, 2.0)][1]


def list_read_in_try_finally(tab, tok):
    try:
        y = tab[tok.item()] * 1
    finally:
        pass
    return y


def outcome(fn, *args):
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - the type is what is compared
        return type(e)


@pytest.mark.parametrize("fn, tab", [(read_in_record_function, TABLE), (read_in_sdpa_kernel, TABLE),
                                     (read_in_try_finally, TABLE), (read_in_list_comprehension, TABLE),
                                     (list_read_in_try_finally, ROWS)],
                         ids=["record_function", "sdpa_kernel", "try-finally", "listcomp", "list-try-finally"])
def test_a_read_under_a_handler_that_reraises_is_rewritten(fn, tab):
    f = compiled(fn)
    for tok in (1, 2, 3, -1):
        args = (tab, torch.tensor(tok))
        assert_bitwise(f(*args), fn(*args))
    assert decisions(Action.REWRITTEN)
    assert not decisions(Action.KEPT, Reason.REWRITE_OTHER_USE)
    # out of range: eager's IndexError passes through the handler; so does the graph's
    assert outcome(fn, tab, torch.tensor(9)) is IndexError
    assert outcome(f, tab, torch.tensor(9)) is IndexError


def read_under_a_bare_except_that_raises_another_error(tab, tok):
    try:
        y = tab[tok + 0] * 1
    except:  # noqa: E722 - the bare form compiles to no CHECK_EXC_MATCH
        raise ValueError("no such row")
    return y


def test_a_read_whose_handler_raises_another_error_is_not_rewritten():
    fn = read_under_a_bare_except_that_raises_another_error
    f = compiled(fn)
    for tok in (1, 9, 2, 9):
        args = (TABLE, torch.tensor(tok))
        got, want = outcome(f, *args), outcome(fn, *args)
        if isinstance(want, torch.Tensor):
            assert_bitwise(got, want)
        else:
            assert got is want
    assert outcome(f, TABLE, torch.tensor(9)) is ValueError
    assert not decisions(Action.REWRITTEN)


def helper(tab, tok):
    return tab[tok + 0] * 1


def caller_catches(tab, tok):
    try:
        y = helper(tab, tok)
    except IndexError:
        y = tab[0] * -1
    return y


def test_a_read_inlined_into_a_callers_try_is_not_rewritten_there():
    f = compiled(caller_catches)
    for tok in (1, 2, 9, 3, 9):
        args = (TABLE, torch.tensor(tok))
        assert_bitwise(outcome(f, *args), caller_catches(*args))
    kept = decisions(Action.KEPT, Reason.REWRITE_OTHER_USE)
    assert kept and "caller" in kept[0].detail


def serve_step(x, token_types):
    if (token_types == 1).any():  # request-invariant: hoisted
        x = x + 1
    return x * 2


def test_check_request_under_another_grad_mode_says_so_and_checks_under_the_steps_mode():
    """An engine runs its steps inside ``torch.inference_mode()``: an entry compiled there cannot
    serve a call under grad mode, so check_request made outside that block reports the site as
    not computed, and says to call it under the steps' state; called there, it checks."""
    from torchsync_pass import HoistedValueChanged, check_request

    step = torch.compile(serve_step, backend="nosync", options={"codegen": "eager"})
    x, a, b = torch.ones(2), torch.tensor([0, 1]), torch.tensor([0, 0])
    with torch.inference_mode():
        step(x, a)
        r = check_request(step, x, a)
        assert (r.ok, r.sites) == (True, 1)
        with pytest.raises(HoistedValueChanged, match=r"False for this request"):
            check_request(step, x, b)  # an ordinary tensor (made outside)
        # made in inference mode: no version counter, the guard refuses it (the call recompiles)
        r = check_request(step, x, torch.tensor([0, 1]), on_change="report")
        assert not r.ok and r.changed[0].value is None and "inference tensor" in r.changed[0].why
        assert torch.equal(step(x, torch.tensor([0, 1])), serve_step(x, torch.tensor([0, 1])))
    r = check_request(step, x, a, on_change="report")
    assert not r.ok and r.changed[0].value is None
    assert re.search(r"not computed: .*state.*call it under the state the steps run in", r.changed[0].why), r.changed[0].why


# On torch 2.11 and 2.12 Dynamo answers ``.grad`` of a tensor the graph computed with a proxy that
# ``is not None`` takes for a tensor; eager's row (a view of the table) has no grad.
def reads_a_rows_grad(tab, t):
    row = tab[t.item()]
    return row * (7 if row.grad is not None else 5)


@torch.no_grad()
def reads_a_rows_grad_at_a_tensor(tab, t):
    row = tab[t + 0]
    return row * (7 if row.grad is not None else 5)


@pytest.mark.parametrize("fn", [reads_a_rows_grad, reads_a_rows_grad_at_a_tensor], ids=["item", "tensor"])
def test_a_gathered_rows_grad_is_none_as_eager_s_row(fn):
    f = compiled(fn)
    for t in (1, 2, 0):
        assert_bitwise(f(TABLE, torch.tensor(t)), fn(TABLE, torch.tensor(t)))
    assert decisions(Action.REWRITTEN)


def test_the_self_test_leaves_no_cache_entry_on_dynamos_shared_wrapper_frame():
    """torch.compile wraps a function without a source file in Dynamo's one ``wrap_inline`` frame
    (torch 2.11, 2.12): the self-test's functions must not fill its recompile budget, which every
    ``@torch.no_grad()`` function the user compiles shares."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from torchsync_pass import dynamo_hooks

    torch._dynamo.reset()
    result = dynamo_hooks.self_test()
    assert result and all(result.values()), result
    assert _debug_get_cache_entry_list(dynamo_hooks.wrap_inline_code()) == []


# Hostile review 6b (same day), of the commit above: a finally body is not mere cleanup; a with
# block's state is set inside the graph; an attribute set on a list's tensor.
def finally_raises_another_error(tab, tok):
    try:
        y = tab[tok + 0] * 1
    finally:
        z = y + 0  # eager: y unbound when the read raised -> UnboundLocalError
    return z


LOG: list = []


def finally_has_a_side_effect(tab, tok):
    try:
        y = tab[tok + 0] * 1
    finally:
        LOG.append("cleanup")
    return y


@pytest.mark.parametrize("fn", [finally_raises_another_error, finally_has_a_side_effect], ids=["raises", "side-effect"])
def test_a_finally_body_that_runs_code_keeps_the_read(fn):
    f = compiled(fn)
    for tok in (1, 9, 2, 9):
        LOG.clear()
        want = outcome(fn, TABLE, torch.tensor(tok))
        want_log = list(LOG)
        LOG.clear()
        got = outcome(f, TABLE, torch.tensor(tok))
        if isinstance(want, torch.Tensor):
            assert_bitwise(got, want)
        else:
            assert got is want
        assert LOG == want_log
    assert not decisions(Action.REWRITTEN)


@torch.no_grad()
def read_under_no_grad(tab, tok):
    return tab[tok + 0] * 1


def read_under_sdpa_kernel(tab, tok):
    with sdpa_kernel(SDPBackend.MATH):
        return tab[tok + 0] * 1


@pytest.mark.parametrize("fn", [read_under_no_grad, read_under_sdpa_kernel], ids=["no_grad", "sdpa_kernel"])
def test_an_out_of_range_read_inside_a_with_leaves_the_global_state_as_eager(fn):
    f = compiled(fn)
    assert_bitwise(f(TABLE, torch.tensor(1)), fn(TABLE, torch.tensor(1)))
    assert decisions(Action.REWRITTEN)
    try:
        assert outcome(f, TABLE, torch.tensor(9)) is IndexError
        assert torch.is_grad_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
    finally:
        torch.set_grad_enabled(True)
        torch.backends.cuda.enable_flash_sdp(True)
        torch.backends.cuda.enable_mem_efficient_sdp(True)


def _list():
    return [torch.arange(2.0) + 2 * i for i in range(4)]


def sets_an_attribute_then_reads_the_row(rows, t):
    r = rows[t.item()]
    r.tag = 3
    return rows[t.item()] * getattr(rows[t.item()], "tag", 1)


def sets_a_grad_then_reads_the_row(rows, t, g):
    r1 = rows[t.item()]
    r1.grad = g
    r2 = rows[t.item()]
    return r2 * (7 if r2.grad is not None else 5)


def test_an_attribute_set_on_a_lists_tensor_is_seen_by_a_later_read_of_its_row():
    f = compiled(sets_an_attribute_then_reads_the_row)
    for t in (1, 2):
        assert_bitwise(f(_list(), torch.tensor(t)), sets_an_attribute_then_reads_the_row(_list(), torch.tensor(t)))
    torch._dynamo.reset()
    f = compiled(sets_a_grad_then_reads_the_row)
    for t in (1, 2):
        mine, theirs = _list(), _list()
        assert_bitwise(f(mine, torch.tensor(t), torch.ones(2)), sets_a_grad_then_reads_the_row(theirs, torch.tensor(t), torch.ones(2)))
        assert [r.grad is not None for r in mine] == [r.grad is not None for r in theirs]

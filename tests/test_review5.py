"""Device-side rewrites where eager's Python sees more than a tensor (hostile review 5, 2026-12-01).

A read rewritten into the graph raises, when its index is out of range, while the graph runs:
after the trace, outside every ``try`` of the frame, so a user's ``except IndexError`` (or a
``contextlib.suppress``) that catches eager's error never sees it. Reads and selects under such a
handler are kept. Each test fails on the commit before.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from test_rewrite_branch import assert_bitwise, compiled, decisions
from test_rewrite_subscript import needs_select
from torchsync_pass import Action, Reason

TABLE = torch.arange(8.0).reshape(4, 2)
ROWS = list(TABLE.clone().unbind(0))


def list_read_in_try(tab, tok, x):
    try:
        y = tab[tok.item()] * 1
    except IndexError:
        y = x * -1
    return y


def tensor_read_in_try(tab, tok, x):
    try:
        y = tab[tok + 0] * 1
    except IndexError:
        y = x * -1
    return y


def read_under_suppress(tab, tok, x):
    y = x * -1
    with contextlib.suppress(IndexError):
        y = tab[tok.item()] * 1
    return y


def read_under_no_grad_in_try(tab, tok, x):
    try:
        with torch.no_grad():
            y = tab[tok + 0] * 1
    except IndexError:
        y = x * -1
    return y


@pytest.mark.parametrize("fn, tab", [(list_read_in_try, ROWS), (tensor_read_in_try, TABLE),
                                     (read_under_suppress, ROWS), (read_under_no_grad_in_try, TABLE)],
                         ids=["list-try", "tensor-try", "suppress", "no_grad-in-try"])
def test_a_read_under_a_handler_eager_runs_is_not_rewritten(fn, tab):
    f = compiled(fn)
    for tok in (1, 2, 9, 3, -7):
        args = (tab, torch.tensor(tok), torch.ones(2))
        assert_bitwise(f(*args), fn(*args))
    assert not decisions(Action.REWRITTEN)
    assert decisions(Action.KEPT, Reason.REWRITE_OTHER_USE)


def read_under_no_grad(tab, tok):
    with torch.no_grad():
        return tab[tok + 0] * 1


def test_a_read_under_no_grad_alone_is_still_rewritten():
    f = compiled(read_under_no_grad)
    for tok in (1, 2, 3):
        assert_bitwise(f(TABLE, torch.tensor(tok)), read_under_no_grad(TABLE, torch.tensor(tok)))
    assert decisions(Action.REWRITTEN, Reason.INDEX_TENSOR)


EMB = torch.arange(8.0).reshape(4, 2)


@torch.no_grad()
def select_in_try(c, tok, x):
    try:
        if c:
            y = torch.nn.functional.embedding(tok, EMB)
        else:
            y = x * 1
        y = y + 0
    except IndexError:
        y = x * -1
    return y


@needs_select
def test_a_branch_under_a_try_is_not_selected():
    f = compiled(select_in_try)
    for c, tok in [(1, 1), (0, 1), (1, 2), (0, 0), (1, 3), (0, 1), (1, 9), (0, 9), (1, 9)]:
        args = (torch.tensor(c), torch.tensor([tok]), torch.ones(1, 2))
        assert_bitwise(f(*args), select_in_try(*args))
    assert not decisions(Action.REWRITTEN, Reason.BRANCH_WHERE)


# A row read from a Python list of tensors is, in eager, the list's own tensor object.
def _rows(marked=None, **attrs):
    rows = [torch.full((2,), float(i + 1)) for i in range(3)]
    for k, v in attrs.items():
        setattr(rows[marked], k, v)
    return rows


@torch.no_grad()
def is_the_pad_row(tab, t):
    row = tab[t.item()]
    return row * 0 if row is tab[0] else row * 3


@torch.no_grad()
def reads_an_attribute(tab, t):
    row = tab[t.item()]
    return row * (0 if getattr(row, "is_pad", False) else 5)


@torch.no_grad()
def reads_the_class(tab, t):
    row = tab[t.item()]
    return row * (7 if isinstance(row, torch.nn.Parameter) else 5)


@torch.no_grad()
def reads_the_grad(tab, t):
    row = tab[t.item()]
    return row * (7 if row.grad is not None else 5)


PARAMS = [torch.nn.Parameter(torch.full((2,), float(i + 1)), requires_grad=False) for i in range(3)]


@pytest.mark.parametrize("fn, make", [
    (is_the_pad_row, _rows),
    (reads_an_attribute, lambda: _rows(0, is_pad=True)),
    (reads_the_class, lambda: PARAMS),
    (reads_the_grad, lambda: _rows(1, grad=torch.ones(2))),
], ids=["is", "attribute", "parameter", "grad"])
def test_a_list_row_python_can_tell_from_a_copy_is_not_gathered(fn, make):
    f = compiled(fn)
    for t in (0, 1, 0, 2, 1):
        assert_bitwise(f(make(), torch.tensor(t)), fn(make(), torch.tensor(t)))
    assert not decisions(Action.REWRITTEN, Reason.INDEX_LIST)


def test_a_later_call_s_list_with_a_grad_is_checked_at_the_call():
    f = compiled(reads_the_grad)
    for t in (0, 1, 2):
        assert_bitwise(f(_rows(), torch.tensor(t)), reads_the_grad(_rows(), torch.tensor(t)))
    assert decisions(Action.REWRITTEN, Reason.INDEX_LIST)  # plain tensors: gathered
    rows = _rows(1, grad=torch.ones(2))
    assert_bitwise(f(rows, torch.tensor(1)), reads_the_grad(rows, torch.tensor(1)))


# A select runs the arm eager skips: its ops must have a kernel for every dtype they see.
@torch.no_grad()
def clamps_in_one_arm(c, m):
    if c:
        r = m.clamp(False, True)
    else:
        r = m & m
    return r


@torch.no_grad()
def adds_in_one_arm(c, m):
    if c:
        r = m + 1
    else:
        r = m * 1
    return r


@torch.no_grad()
def erfcx_in_one_arm(c, m):
    if c:
        r = torch.special.erfcx(m)
    else:
        r = m * 1
    return r


@needs_select
@pytest.mark.parametrize("fn, first, later", [
    (clamps_in_one_arm, torch.tensor([0, 1, 1]), torch.tensor([False, True, True])),
    (adds_in_one_arm, torch.tensor([0, 1, 1]), torch.tensor([0, 1, 1], dtype=torch.uint32)),
    (erfcx_in_one_arm, torch.tensor([0.5, 1.0]), torch.tensor([0.5, 1.0], dtype=torch.bfloat16)),
], ids=["clamp-bool", "add-uint32", "erfcx-bfloat16"])
def test_an_arm_eager_skips_never_runs_an_op_without_a_kernel_for_its_dtype(fn, first, later):
    f = compiled(fn)
    for c in (1.0, 0.0, 1.0, 0.0, 1.0, 0.0):  # the test changes every call: selected on `first`
        assert_bitwise(f(torch.tensor(c), first), fn(torch.tensor(c), first))
    assert decisions(Action.REWRITTEN, Reason.BRANCH_WHERE)
    assert_bitwise(f(torch.tensor(0.0), later), fn(torch.tensor(0.0), later))

"""Review 17 (2026-12-07, second session): fixes and the per-call list check, each tested."""

from __future__ import annotations

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

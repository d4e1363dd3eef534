"""Cone re-runs and check_request outside the compile's context (hostile review 4, 2026-12-01).

A hoisted cone is the graph Dynamo traced through the leaves' ``__torch_function__`` (a
subclass's, a mode's): running it again with that still on applied it twice (a wrong value at the
first call, and in every ``check_request``). ``check_request`` ran cones under the caller's
autocast and stored the result in the memo the guard reads, answered "ok" under a global state no
compiled entry can serve, dropped the entries of another closure of the same factory that Dynamo
would run, and told closures apart by ``id()`` of objects that may have died. Each test fails on
the commit before.
"""

from __future__ import annotations

import gc

import pytest
import torch

import torchsync_pass
from torchsync_pass import HoistedValueChanged, dynamo_hooks
from test_core import assert_bitwise

EAGER = {"codegen": "eager"}


class Doubling(torch.Tensor):
    """A subclass whose ``sum`` is twice the plain one."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs or {})
        return out * 2 if func in (torch.Tensor.sum, torch.sum) else out


class DoublingMode(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return out * 2 if func in (torch.Tensor.sum, torch.sum) else out


def branch(x, t):
    if t.sum() > 5:  # ones(2): 2 plain, 4 doubled: False either way, 8 if doubled twice
        return x + 1
    return x - 1


def plain(t):
    return t.as_subclass(torch.Tensor)


@pytest.mark.parametrize("declared", [False, True], ids=["speculated", "declared"])
def test_a_subclass_leaf_s_torch_function_applies_once(declared):
    options = {**EAGER, "invariant": ["t"]} if declared else EAGER
    f = torch.compile(branch, backend="nosync", options=options)
    x = torch.zeros(2)
    for _ in range(3):
        t = torch.ones(2).as_subclass(Doubling)
        assert_bitwise(plain(f(x, t)), plain(branch(x, t)))
    t = torch.ones(2).as_subclass(Doubling)
    report = torchsync_pass.check_request(f, x, t)
    assert report.sites == 1 and report.ok, report.describe()
    assert_bitwise(plain(f(x, t)), plain(branch(x, t)))


def test_check_request_under_a_mode_leaves_the_memo_right():
    f = torch.compile(branch, backend="nosync", options={**EAGER, "invariant": ["t"]})
    x = torch.zeros(2)
    t = torch.ones(2)
    assert_bitwise(f(x, t), branch(x, t))
    t = torch.ones(2) * 2  # sum 4: False; 8 under the mode
    with DoublingMode():
        torchsync_pass.check_request(f, x, t, on_change="report")
    for _ in range(2):
        assert_bitwise(f(x, t), branch(x, t))


def matmul_scale(x, a, b):
    s = (a @ b).sum().item()
    return x * s


def test_check_request_under_autocast_reports_the_state_and_stores_nothing():
    torch.manual_seed(0)
    f = torch.compile(matmul_scale, backend="nosync", options=EAGER)
    x = torch.ones(2)
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    assert_bitwise(f(x, a, b), matmul_scale(x, a, b))
    a2, b2 = a.clone(), b.clone()  # new leaves, same values
    with torch.autocast("cpu", dtype=torch.bfloat16):
        report = torchsync_pass.check_request(f, x, a2, b2, on_change="report")
    assert len(report.changed) == 1 and report.syncs == 0, report.describe()
    assert "autocast" in report.changed[0].why, report.describe()
    for _ in range(2):  # the guard computes the value itself, outside autocast
        assert_bitwise(f(x, a2, b2), matmul_scale(x, a2, b2))


def test_check_request_names_a_thread_count_change():
    f = torch.compile(matmul_scale, backend="nosync", options=EAGER)
    x, a, b = torch.ones(2), torch.ones(3, 3), torch.ones(3, 3)
    f(x, a, b)
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        with pytest.raises(HoistedValueChanged, match="thread count changed"):
            torchsync_pass.check_request(f, x, a, b)
    finally:
        torch.set_num_threads(threads)
    assert torchsync_pass.check_request(f, x, a, b).ok


def make_step(t):
    def step(x):
        if t.sum().item() > 0:
            return x + 1
        return x - 1

    return step


def test_check_request_checks_a_new_closure_against_the_entries_dynamo_would_run():
    x = torch.zeros(3)
    a = torch.compile(make_step(torch.ones(2)), backend="nosync", options=EAGER)
    a(x)
    same = torch.compile(make_step(torch.ones(2)), backend="nosync", options=EAGER)
    assert torchsync_pass.check_request(same, x).ok  # runs a's entry: the same value
    other = torch.compile(make_step(-torch.ones(2)), backend="nosync", options=EAGER)
    with pytest.raises(HoistedValueChanged, match="-2.0 for this request, compiled for 2.0"):
        torchsync_pass.check_request(other, x)


def _holder(fn):
    def inner():
        return fn

    return inner


def _function():
    def f():
        return None

    return f


def test_a_dead_closure_value_never_owns_a_new_one_at_its_address():
    code = _holder(None).__code__  # co_freevars == ("fn",)
    for _ in range(500):
        old = _function()
        old_id = id(old)
        stored = dynamo_hooks.closure_identity(code, {"fn": old})
        assert dynamo_hooks.same_owner(stored, dynamo_hooks.closure_identity(code, {"fn": old}))
        del old
        gc.collect()
        new = _function()
        if id(new) == old_id:  # CPython reuses the freed block: usually at once
            assert not dynamo_hooks.same_owner(stored, dynamo_hooks.closure_identity(code, {"fn": new}))
            return
    pytest.skip("no function was allocated at a freed one's address in 500 tries")

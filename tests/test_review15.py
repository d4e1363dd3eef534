"""Review 15 (2026-12-03): each test failing on the commit before its fix."""

from __future__ import annotations

import threading

import torch

import torchsync_pass
from torchsync_pass import guards

from test_core import assert_bitwise

EAGER = {"codegen": "eager"}


def _write_behind_version(t, d):
    """Another request's graph: writes ``t`` behind its version counter (what batch norm in
    training mode does), so every memo forgets after its call."""
    t.data.add_(d)
    return d * 2


def _two_requests_and_a_writer(step):
    """``step`` compiled with ``t`` declared, two requests (t1, t2) seen, the writer compiled and
    run once each way (t1 back to its values)."""
    torch._dynamo.reset()
    torchsync_pass.reset()
    w = torch.compile(_write_behind_version, backend="nosync", options=EAGER)
    r = torch.compile(step, backend="nosync", options={**EAGER, "invariant": ["t"]})
    t1, t2 = torch.full((4,), -0.5), torch.full((4,), -0.25)
    x, d = torch.ones(4), torch.tensor(1.0)
    r(x, t1), r(x, t2), r(x, t1)
    w(t1, d), w(t1, -d)
    r(x, t1), r(x, t2)
    return r, w, x, t1, t2, d


def test_memo_entry_found_before_another_threads_forget_is_not_moved_back(monkeypatch):
    # The guard found t1's entry behind t2's; another thread's graph wrote t1 behind its version and
    # forget_all emptied the memo; moving the entry to the front put it back: every later call with
    # t1 took the branch of before the write (3.0 where eager gives 2.0)
    def step(x, t):
        if (t > 0).any():
            return x * 2
        return x * 3

    with torch.no_grad():
        r, w, x, t1, t2, d = _two_requests_and_a_writer(step)
        fire = [False]
        to_front = guards.ConeMemo._to_front

        def switch_then_move(self, e):  # the other thread's whole call lands right after the lookup
            if fire[0]:
                fire[0] = False
                th = threading.Thread(target=w, args=(t1, d))
                th.start()
                th.join()
            return to_front(self, e)

        monkeypatch.setattr(guards.ConeMemo, "_to_front", switch_then_move)
        r(x, t2)
        fire[0] = True
        r(x, t1)
        assert not fire[0], "the thread switch was not forced"
        r(x, t2)
        assert_bitwise(r(x, t1), step(x, t1))


def test_runner_values_computed_before_another_threads_forget_are_not_kept(monkeypatch):
    # InvariantRunner.miss asked forgotten_since, then stored its values as the last call's; the
    # other thread's forget_all (last = None) landing in between was undone: x + exp(t1 before the
    # write) on every later call
    def step(x, t):
        return x + t.exp()

    with torch.no_grad():
        r, w, x, t1, t2, d = _two_requests_and_a_writer(step)
        fire, threads = [False], []
        forgotten_since = guards.forgotten_since

        def check_then_switch(fps):  # the other thread runs right after the answer (or waits for a lock)
            res = forgotten_since(fps)
            if fire[0] and not res:
                fire[0] = False
                th = threading.Thread(target=w, args=(t1, d))
                th.start()
                th.join(timeout=1.0)  # the fix makes its forget wait for the store: no join here then
                threads.append(th)
            return res

        monkeypatch.setattr(guards, "forgotten_since", check_then_switch)
        r(x, t2)
        fire[0] = True
        r(x, t1)
        assert not fire[0], "the thread switch was not forced"
        for th in threads:
            th.join()
        assert_bitwise(r(x, t1), step(x, t1))


def test_reset_in_another_thread_waits_for_a_compile():
    # torchsync_pass.reset() released the guard group of a frame Dynamo was compiling: Dynamo's
    # check of the fresh entry failed ("Guard failed on the same frame it was created. This is a
    # bug") and the call raised
    def step(x, t):
        if (t > 0).any():
            x = x * 2
        return x + 1

    torch._dynamo.reset()
    torchsync_pass.reset()
    f = torch.compile(step, backend="nosync", options=EAGER)
    x, t = torch.ones(4), torch.full((4,), 0.5)
    stop = threading.Event()

    def resetter():
        while not stop.is_set():
            torchsync_pass.reset()

    th = threading.Thread(target=resetter)
    th.start()
    try:
        out = f(x, t)
    finally:
        stop.set()
        th.join()
    assert_bitwise(out, step(x, t))

"""Review 23 (2026-12-07): each test failing on the commit before its fix."""

from __future__ import annotations

import os
import warnings
from typing import NamedTuple

import pytest
import torch

import torchsync_pass
from test_review21 import _clean  # noqa: F401 - the fixture: Dynamo, nosync and counters reset


class _Req(NamedTuple):
    ids: torch.Tensor
    mask: torch.Tensor


def _nt_step(x, req):
    return x * req[1].sum().item()


@pytest.mark.parametrize("declared", ["req.1", "req.mask"])
def test_a_named_tuple_field_is_declared_by_its_position_as_by_its_name(_clean, declared):
    """Dynamo names the leaf ``req.mask`` where the step reads ``req[1]``; ``req.1`` (a tuple's
    item by position, as for a plain tuple or a dict) resolved, so nothing warned, yet declared
    nothing: inference tensors stayed rejected and every warm call read (5 of 5), silently even
    under strict (helper 175)."""
    x = torch.ones(3)
    with torch.inference_mode():  # no version counter: hoisted only when declared
        a = _Req(torch.zeros(2), torch.ones(4))
        b = _Req(torch.zeros(2), torch.full((4,), 2.0))
    f = torch.compile(_nt_step, backend="nosync",
                      options={"codegen": "eager", "invariant": [declared], "strict": True})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(f(x, a), _nt_step(x, a))
        with torchsync_pass.count_syncs() as c:
            got = [f(x, a) for _ in range(5)]
    assert c.total == 0
    assert all(torch.equal(g, _nt_step(x, a)) for g in got)
    (d,) = torchsync_pass.decisions()
    assert d.action.value == "hoisted" and d.leaves == ("req.mask",)
    # another request (another tuple): its own value, never the first one's
    want_b = _nt_step(x, b)
    assert torch.equal(f(x, b), want_b) and torch.equal(f(x, b), want_b)
    assert torch.equal(f(x, a), _nt_step(x, a))


# --------------------------------------------------------------------------------------------
# collectives (helper 173)
# --------------------------------------------------------------------------------------------
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built in")
def test_values_that_depend_on_a_collective_are_never_hoisted_nor_cached(tmp_path):
    """A collective's value depends on the other ranks' tensors, which no leaf of this rank tells
    of, and every rank must run it the same times in the same order. nosync took
    ``_c10d_functional.all_reduce`` for a pure op: ``all_reduce(buf).max().item()`` was hoisted
    (rank 0 kept 3.0 after rank 1's buffer changed to make it 11.0) and ``all_reduce(bias)`` cached
    (rank 1's guard re-ran the collective alone, pairing it with rank 0's step collective: wrong
    sums on both ranks, then a timeout). So was a custom op whose kernel all_reduces (how vLLM and
    SGLang wrap their tensor-parallel all_reduce): a registration cannot say it talks to other
    ranks, so no custom op is pure while a process group is up (helper 180)."""
    import json
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    script = os.path.join(os.path.dirname(__file__), "scripts", "collectives_demo.py")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, script, port], capture_output=True, text=True, timeout=240,
                         env=env, cwd=str(tmp_path))
    files = [tmp_path / f"rank{r}.json" for r in (0, 1)]
    assert all(f.exists() for f in files), run.stdout[-2000:] + run.stderr[-2000:]
    ranks = [json.loads(f.read_text()) for f in files]
    for r in ranks:
        assert "error" not in r, r
        assert r["read"] == [True] * 4 and r["cached"] == [True] * 4 and r["custom"] == [True] * 4, r
        assert ("hoisted", "INVARIANT_CONE") not in [tuple(d) for d in r["decisions"]], r


# --------------------------------------------------------------------------------------------
# global state between calls (helper 174)
# --------------------------------------------------------------------------------------------
_THREADS_SCRIPT = '''
import torch
torch.set_num_threads(1)
def step(x, s):
    return x * s.item()
c = torch.compile(step, backend="nosync", options={"codegen": "eager"})
x = torch.ones(2)
s1, s2 = torch.tensor(2.0), torch.tensor(3.0)
c(x, s1)                      # entry 0: 2.0 hoisted, one thread
torch.set_num_threads(2)
c(x, s1)                      # entry 1: Dynamo recompiles for the thread count
torch.set_num_threads(1)
c(x, s2)                      # one thread again: entry 0 fails on the hoisted value
'''


def test_explain_names_the_nosync_guard_that_failed_behind_another_entrys_reason(_clean, capsys, tmp_path):
    """Dynamo's compile record keeps the first cache entry's reason only: the third call's
    recompile read "11/1: GLOBAL_STATE changed: num_threads" (the two-thread entry) and explain
    never said that entry 0, the one-thread entry, failed on its hoisted value 2.0 -> 3.0."""
    from test_review22 import _explain_json

    script = tmp_path / "threads.py"
    script.write_text(_THREADS_SCRIPT)
    n = torch.get_num_threads()
    try:
        rc, rep = _explain_json(capsys, str(script))
    finally:
        torch.set_num_threads(n)
    assert rc == 0
    (fn,) = [f for f in rep["compiled"] if f["function"] == "step"]
    last = fn["recompiles"][-1]
    assert "GLOBAL_STATE" in last["reason"]
    assert any("a hoisted value changed: 2.0 -> 3.0" in r for r in last["nosync_reasons"]), last
    for r in fn["recompiles"][:-1]:
        assert r["nosync_reasons"] == [], r


# --------------------------------------------------------------------------------------------
# higher-order ops and the counter (helper 178)
# --------------------------------------------------------------------------------------------
def _float_step(x, s):
    table = torch.arange(4.0).exp()  # no input at all: the invariant runner caches it
    return x * s + table  # s, a Python float that changes: Dynamo reads a 0-d tensor in the graph


def test_reads_inside_a_runners_graph_are_counted_at_the_users_line(_clean):
    """The invariant runner's call was exec'd code named ``<string>``: the counter's walk to the
    user's frame stopped there, so the graph's reads were counted at ``<string>:5`` (two functions'
    at one site), where the README says the ``def`` line (stock: the def line, 3 reads)."""
    f = torch.compile(_float_step, backend="nosync", options={"codegen": "eager"})
    x = torch.randn(4)
    with torchsync_pass.count_syncs() as c:
        for s in [0.5, 1.5, 2.5, 3.5]:
            f(x, s)
    assert c.total >= 1
    assert {k.file for k in c.by_site} == {os.path.abspath(__file__)}, c.by_site
    # (torch 2.11's Python guard for the float reads too: at the call's line, as for stock)
    assert any(v.function == "_float_step" for v in c.sites.values()), c.sites


def test_a_graph_inductor_could_not_compile_is_recorded_as_the_eager_graph_it_runs(_clean, monkeypatch):
    """Inductor raised (a flex_attention score_mod capturing a computed tensor on CPU); nosync ran
    the FX graph eagerly, but its record said codegen "inductor" and --verify passed the graph as
    "(inductor codegen)": the bits were eager's, not stock Inductor's."""
    from torchsync_pass import backend

    def broken(*args, **kwargs):
        raise NotImplementedError("Pointwise")  # what Inductor's lowering raised

    monkeypatch.setattr(backend, "_codegen_tabulated", broken)
    be = torchsync_pass.NosyncBackend({"verify": True})

    def f(x, n):
        return x * int(n)

    x = torch.ones(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = torch.compile(f, backend=be)(x, torch.tensor(4))
    assert torch.equal(out, f(x, torch.tensor(4)))
    (rec,) = be.compiled
    assert rec["codegen"] == "eager"
    assert "inductor codegen failed: NotImplementedError: Pointwise" in rec["fell_back"]
    assert "(eager)" in rec["verified"].name


# --------------------------------------------------------------------------------------------
# encoder serving, every call a new batch (helper 176)
# --------------------------------------------------------------------------------------------
class _Label(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(8), requires_grad=False)  # frozen: a cone leaf

    def forward(self, x):
        return x * 2, (x * self.w).sum(-1).argmax().item()  # a classifier returning its label


def test_a_new_value_on_the_next_call_demotes_even_with_a_frozen_weight_in_the_cone(_clean):
    """The next-call rule asked every leaf to be freed or written: the frozen weight beside the
    request's tensor never is, so the site was hoisted again on each new batch until the 3-call
    rule (a reranker recompiled its whole forward on calls 1, 2 and 3, 0.8-6 s each)."""
    m = _Label()
    f = torch.compile(m, backend="nosync", options={"codegen": "eager"})
    demoted_at = None
    with torch.no_grad():
        for i in range(5):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))  # the last batch freed
            got, want = f(x), m(x)
            assert torch.equal(got[0], want[0]) and got[1] == want[1]
            if demoted_at is None and any(d.action.value == "demoted" for d in torchsync_pass.decisions()):
                demoted_at = i
    assert demoted_at == 1
    assert [d.reason.name for d in torchsync_pass.decisions() if d.action.value == "demoted"] == ["LEAVES_CHANGE"]


def test_a_frozen_weight_with_requests_interleaved_is_not_demoted(_clean):
    """The other side of the rule: batches A, B, A with A and B alive are requests served in turn;
    the unchanged weight must not make B's new value look like a per-call change."""
    m = _Label()
    f = torch.compile(m, backend="nosync", options={"codegen": "eager"})
    a = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    b = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for x in (a, b, a, b):
            got, want = f(x), m(x)
            assert torch.equal(got[0], want[0]) and got[1] == want[1]
    assert not any(d.action.value == "demoted" for d in torchsync_pass.decisions())


def _trim(x, attention_mask):
    n = int(attention_mask.sum(-1).max())
    m = attention_mask[:, :n]
    y = x[:, :n]
    if m.all():
        return y * 2
    return (y * m).sum(1) / m.sum(1)


def test_a_slice_bound_is_not_lifted_as_a_table_index(_clean):
    """``mask[:, :n].all()`` was lifted as a table over n in 0..L-1, as ``t[n]`` is: n == L (a
    full-length batch) fell outside the answers (TABLE_INDEX_OUTSIDE, a recompile) and the guard
    re-ran the table on new masks, reading twice at the branch (38 reads against stock's 34 over
    17 new batches). A slice bound is not an index: every value up to the length and past it is
    valid."""
    f = torch.compile(_trim, backend="nosync", options={"codegen": "eager"})
    stock = torch.compile(_trim, backend="eager")
    g = torch.Generator().manual_seed(0)
    shapes = [(4, 16), (2, 12), (4, 16), (3, 16), (4, 10), (2, 12), (5, 7), (4, 16), (1, 3), (2, 12),
              (3, 9), (4, 16), (2, 5), (6, 11), (4, 16), (8, 32), (4, 16)]
    ours = theirs = 0
    for i, (b, n) in enumerate(shapes):
        x = torch.randn(b, n, generator=g)
        lens = torch.randint(1, n + 1, (b,), generator=g)
        if i % 3 == 0:
            lens[:] = n
        mask = (torch.arange(n)[None] < lens[:, None]).long()
        want = _trim(x, mask)
        with torchsync_pass.count_syncs() as c:
            got = f(x, mask)
        with torchsync_pass.count_syncs() as s:
            stock(x, mask)
        assert torch.equal(got, want) and got.stride() == want.stride()
        ours += c.total + c.compile_time
        theirs += s.total + s.compile_time
    assert "TABLE_LIFTED" not in {d.reason.name for d in torchsync_pass.decisions()}
    assert ours <= theirs


class _PoolLayer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8).requires_grad_(False)

    def forward(self, h, tt):
        if ((tt.float() @ self.lin.weight[:4, :4]) > 0).any():
            h = h + 1
        return self.lin(h)


def test_pooled_rows_served_in_turn_beside_a_frozen_weight_stay_hoisted(_clean):
    """Regression of the frozen-weight rule (helper 179): two requests whose token types are rows
    of one pooled tensor, served A, B, A, B, looked like the next elements of one table once the
    frozen weight was set aside: demoted at B's first call, 3 reads on every later call (before:
    1 read in 12 calls)."""
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(_PoolLayer() for _ in range(3))

    def forward(h, tt):
        for layer in layers:
            h = layer(h, tt)
        return h

    f = torch.compile(forward, backend="nosync", options={"codegen": "eager", "select_branches": False})
    pool = torch.tensor([[0, 0, 0, 0], [1, 0, 1, 0]])
    reqs, hs = [pool[0], pool[1]], [torch.randn(1, 8), torch.randn(1, 8)]
    total = 0
    with torch.no_grad():
        for _ in range(6):
            for k in (0, 1):
                want = forward(hs[k], reqs[k])
                with torchsync_pass.count_syncs() as c:
                    got = f(hs[k], reqs[k])
                assert torch.equal(got, want)
                total += c.total
    assert not any(d.action.value == "demoted" for d in torchsync_pass.decisions())
    assert total <= 1


_POOL_SCRIPT = '''
import torch
torch.set_num_threads(1)
torch.manual_seed(0)
class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8).requires_grad_(False)
    def forward(self, h, tt):
        if (tt == 1).any():
            h = h + 1
        return self.lin(h)
class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(Layer() for _ in range(3))
    def forward(self, h, tt):
        for layer in self.layers:
            h = layer(h, tt)
        return h
m = M().eval()
f = torch.compile(m, backend="nosync", options={"codegen": "eager", "select_branches": False})
pool = torch.tensor([[0, 0, 0, 0], [1, 0, 1, 0]])
with torch.no_grad():
    for _ in range(3):
        for k in (0, 1):
            f(torch.randn(1, 8), pool[k])
'''


def test_explain_shows_a_demotion_made_in_a_compile_dynamo_gave_up_on_as_standing(_clean, capsys, tmp_path):
    """The demotion's compile was given up (the frame traced again without the hoist), and explain
    listed the demotion as "[discarded: ... nothing of it ran]" while the site stayed demoted, the
    next decision saying so (helper 179)."""
    from test_review22 import _explain_json

    script = tmp_path / "pool.py"
    script.write_text(_POOL_SCRIPT)
    rc, rep = _explain_json(capsys, str(script))
    assert rc == 0
    demoted = [d for d in rep["nosync"] if d["action"] == "demoted"]
    assert demoted, rep["nosync"]
    assert not any(d.get("discarded") for d in demoted), demoted


_SPANNING_SCRIPT = '''
import torch
torch.set_num_threads(1)
def step(x, n):
    return x * n.item()
def main():
    f = torch.compile(step, backend="nosync", options={"codegen": "eager"})
    for r in range(3):
        x = torch.randn(r + 2)  # a new shape: a compile, the counter's profiler paused and restarted
        out = f(x, torch.tensor(r + 1.0))
        print(out[:2].tolist())
main()
'''


def test_the_calls_column_does_not_count_a_call_once_per_profiler_restart(_clean, capsys, tmp_path):
    """main(), called once, showed one call per profiler restart it spanned (3 to 5 for
    examples/decode_loop.py, changing between runs): the profiler reports a running call again
    at each restart. Such a function's calls are shown '-' (helper 180)."""
    from test_review22 import _explain_json

    script = tmp_path / "spanning.py"
    script.write_text(_SPANNING_SCRIPT)
    rc, rep = _explain_json(capsys, str(script))
    assert rc == 0
    rows = [s for s in rep["sites"] if s.get("function") == "main"]
    assert rows and all(s["count"] == 3 for s in rows), rows
    assert all(s["calls"] in (None, 1) for s in rows), rows


# --------------------------------------------------------------------------------------------
# a look at the session's last commits (helper 181)
# --------------------------------------------------------------------------------------------
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built in")
def test_torchs_own_op_namespaces_stay_pure_while_a_process_group_is_up(_clean):
    """quantized_decomposed (PT2E quantization's ops) was taken for a custom op of one's own while a
    process group was up: its cone rejected, 5 reads where none are needed. A custom op of one's
    own is still refused then, and hoisted again once the group is gone."""
    import socket

    import torch.ao.quantization.fx._decomposed  # noqa: F401 - registers quantized_decomposed
    import torch.distributed as dist

    from test_reliability import _triple  # a pure custom op of one's own namespace

    def ours(x, w):
        return x * torch.ops.quantized_decomposed.quantize_per_tensor(w, 0.1, 0, -128, 127, torch.int8).max().item()

    def theirs(x, w):
        return x * _triple(w).max().item()

    def actions(step) -> list:
        torch._dynamo.reset()
        torchsync_pass.reset()
        f = torch.compile(step, backend="nosync", options={"codegen": "eager"})
        w = torch.tensor([1.5, 3.0])
        for i in range(3):
            x = torch.full((3,), float(i))
            assert torch.equal(f(x, w), step(x, w))
        return [d.action.value for d in torchsync_pass.decisions()]

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        assert actions(ours) == ["hoisted"]
        assert actions(theirs) == ["rejected"]
    finally:
        dist.destroy_process_group()
    assert actions(theirs) == ["hoisted"]


_THREAD_SCRIPT = '''
import threading, torch
torch.set_num_threads(1)
f = torch.compile(lambda x: x * 2, backend="nosync", options={"codegen": "eager"})
def main():
    for r in range(3):
        th = threading.Thread(target=f, args=(torch.randn(r + 2, r + 2),))
        th.start(); th.join()
        v = torch.tensor(float(r)).item()
main()
'''

_GUARD_NAMED_SCRIPT = """
import torch
torch.set_num_threads(1)
ns = {}
exec("def guard(mod, args, out):\\n    s = out.sum().item()\\n    return out\\n", ns)
lin = torch.nn.Linear(2, 2)
lin.register_forward_hook(ns["guard"])
for _ in range(3):
    lin(torch.ones(2))
"""


def test_a_call_spanning_a_restart_made_from_a_worker_thread_is_not_counted_per_restart(_clean, capsys, tmp_path):
    """The profiler stopped in a worker thread (its compile) and restarted in the counting thread:
    the stop recorded the worker's frames, so main(), called once, showed 3 calls."""
    from test_review22 import _explain_json

    script = tmp_path / "thread.py"
    script.write_text(_THREAD_SCRIPT)
    rc, rep = _explain_json(capsys, str(script))
    assert rc == 0
    rows = [s for s in rep["sites"] if s.get("function") == "main"]
    assert rows and all(s["count"] == 3 and s["calls"] in (None, 1) for s in rows), rows


def test_a_users_exec_d_function_named_guard_is_not_taken_for_dynamos_guard(_clean, capsys, tmp_path):
    """Dynamo's generated guard frames are passed by the counter's walk ('<string>', named guard,
    called from torch): a user's exec'd forward hook named guard, called from torch.nn, matched
    too, and its read was counted at the model call's line, which reads nothing."""
    from test_review22 import _explain_json

    script = tmp_path / "hook.py"
    script.write_text(_GUARD_NAMED_SCRIPT)
    rc, rep = _explain_json(capsys, str(script))
    assert rc == 0
    files = {s["file"] for s in rep["sites"] if s.get("count")}
    assert files == {"<string>"}, rep["sites"]

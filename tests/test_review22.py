"""Review 22 (2026-12-07): each test failing on the commit before its fix."""

from __future__ import annotations

import os

import pytest
import torch

import torchsync_pass
from test_review21 import _clean  # noqa: F401 - the fixture: Dynamo, nosync and counters reset


class _Cached(torch.nn.Module):
    """No sync at all: ``w.exp()`` is request-invariant work the invariant runner caches."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(n), requires_grad=False)

    def forward(self, x):
        return x * self.w.exp()


class _Hoisted(torch.nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(n), requires_grad=False)

    def forward(self, x):
        if (self.w > 0).all():
            return x + self.w.sum().item()
        return x - 1


@pytest.mark.parametrize("module", [_Cached, _Hoisted])
def test_a_weight_swapped_by_data_assignment_is_never_served_an_older_weights_value(_clean, module):
    """``m.w.data = new`` keeps the Parameter object and its version; the allocator hands the new
    data the address of a weight freed two swaps earlier, so (identity, version, data pointer,
    metadata) equalled an older memo entry and its value was served (wrong results on 9 to 29 of 40
    calls). The storage's own address, pinned by the memo entry, tells them apart."""
    n = 1024
    m = module(n)
    f = torch.compile(m, backend="nosync", options={"codegen": "eager"})
    x = torch.ones(n)
    wrong = []
    with torch.no_grad():
        for k in range(40):
            m.w.data = torch.full((n,), float((-1) ** k * (k % 5 + 1)) / 4)
            got, want = f(x), m(x)
            if not torch.equal(got, want):
                wrong.append(k)
    assert wrong == []


# --------------------------------------------------------------------------------------------
# explain and count_syncs on scripts nobody wrote for them (helper 166)
# --------------------------------------------------------------------------------------------
def _explain_json(capsys, *argv: str) -> tuple[int, dict]:
    import json

    from torchsync_pass import explain

    rc = explain.main(["--json", "--progress", "0", *argv])
    return rc, json.loads(capsys.readouterr().out)


def _explain_process(script: str) -> tuple:
    """``python -m torchsync_pass.explain --json script`` in a process of its own: (the completed
    process, its JSON report)."""
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "torchsync_pass.explain", "--json", "--progress", "0", script],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    return proc, json.loads(proc.stdout)


def _count_and_calls(capsys, script: str, line: int) -> tuple:
    """(count, calls) of the sync site at ``line`` of ``script`` in explain's report."""
    rc, rep = _explain_json(capsys, script)
    assert rc == 0
    (site,) = [st for st in rep["sites"] if st["line"] == line]
    return site["count"], site["calls"]


def _script(path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_explain_counts_the_reads_of_a_thread_that_outlives_the_scripts_last_line(tmp_path, capsys):
    """The count closed when the script's body returned: a non-daemon worker's reads after it
    were missed (0 of 3) and its output came after the report."""
    s = _script(tmp_path / "worker.py", (
        "import threading, time, torch\n"
        "x = torch.tensor(2.0)\n"
        "def work():\n"
        "    time.sleep(0.3)\n"
        "    for _ in range(3):\n"
        "        x.item()\n"
        "threading.Thread(target=work).start()\n"))
    rc, rep = _explain_json(capsys, s)
    assert rc == 0
    assert rep["totals"]["syncs"] == 3


def test_explain_json_stays_parseable_when_a_child_process_writes_to_stdout(tmp_path):
    """Only sys.stdout was redirected: a child process (or C code) writing to file descriptor 1
    put its text before the JSON object."""
    s = _script(tmp_path / "child.py", (
        "import os, subprocess, sys\n"
        "subprocess.run([sys.executable, '-c', 'print(\"from a child\")'], check=True)\n"
        "os.write(1, b'from fd 1\\n')\n"))
    proc, rep = _explain_process(s)
    assert rep["exit_code"] == 0
    assert "from a child" in proc.stderr and "from fd 1" in proc.stderr


def test_explain_lists_a_compiled_module_whose_forward_is_torchs_own(tmp_path, capsys, _clean):
    """Every function whose file is inside torch was filtered out (meant for nosync's self-test
    probes): a compiled nn.Sequential showed "(none compiled with torch.compile in this run)"."""
    s = _script(tmp_path / "seq.py", (
        "import torch\n"
        "m = torch.compile(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()), backend='eager')\n"
        "m(torch.ones(2))\n"))
    rc, rep = _explain_json(capsys, s)
    assert rc == 0
    assert len(rep["compiled"]) == 1
    assert rep["compiled"][0]["graphs"] == 1


def test_explain_gives_the_script_an_absolute_file_path(tmp_path, capsys, monkeypatch):
    """As Python (3.9+) does: a script run by a relative path that changes directory and then opens
    a file beside it by __file__ failed under explain only (FileNotFoundError)."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "data.txt").write_text("3.5")
    (tmp_path / "sub" / "s.py").write_text(
        "import os\nhere = os.path.dirname(__file__)\nos.chdir(os.sep)\n"
        "print(open(os.path.join(here, 'data.txt')).read())\n")
    monkeypatch.chdir(tmp_path)
    rc, rep = _explain_json(capsys, os.path.join("sub", "s.py"))
    assert rc == 0 and rep["exit_code"] == 0


def test_explain_gate_fails_even_where_the_scripts_status_reads_as_zero(tmp_path, capsys):
    """sys.exit(256) is a non-zero status that the OS reads as 0: a failed --max-syncs gate kept
    it, and the run passed."""
    s = _script(tmp_path / "x.py", "import sys, torch\ntorch.tensor(1.0).item()\nsys.exit(256)\n")
    rc, _ = _explain_json(capsys, "--max-syncs", "0", s)
    assert rc % 256 != 0


def test_explain_calls_column_counts_the_call_running_when_the_profiler_restarts(tmp_path, capsys):
    """An import pauses the profiler, which restarts inside the next call (at its .item()): the
    profiler names that frame by its current line, so the call matched no function (4 of 5)."""
    (tmp_path / "fresh_module_review22.py").write_text("VALUE = 1\n")
    s = _script(tmp_path / "calls.py", (
        "import torch\n"
        "def read(t):\n"
        "    return t.item()\n"
        "x = torch.tensor(1.0)\n"
        "import fresh_module_review22\n"
        "for _ in range(5):\n"
        "    read(x)\n"))
    assert _count_and_calls(capsys, s, 3) == (5, 5)


def test_check_request_lists_the_functions_demoted_sites(_clean):
    """A site demoted during warm-up is no longer hoisted: check_request checked nothing, said
    ok=True, and the call then recompiled (the code after the read holds warm-up's value only)."""
    def step(x, scale):
        amax = scale.abs().max().item()
        return x * (127.0 / amax)

    f = torch.compile(step, backend="nosync", options={"codegen": "eager"})
    x = torch.randn(4)
    for v in (2.0, 0.5):
        f(x, torch.tensor([v, 0.1]))
    rep = torchsync_pass.check_request(f, x, torch.tensor([2.0, 0.1]), on_change="report")
    assert [s.line for s in rep.demoted] == [step.__code__.co_firstlineno + 1]
    assert "demoted" in rep.describe()


def test_explain_tells_compiles_apart_across_a_dynamo_reset(tmp_path, capsys, _clean):
    """Compile ids start again at 0/0 after torch._dynamo.reset(): f's graph break (compile 0/0)
    was listed under h, compiled after the reset as 0/0 too, and a nosync hoist after a reset was
    marked discarded for a failed compile of the same id before it."""
    s = _script(tmp_path / "resets.py", (
        "import torch\n"
        "def f(x):\n"
        "    return x * x.sum().item()\n"
        "def h(x):\n"
        "    return x + 1\n"
        "def bad(x):\n"
        "    torch._dynamo.graph_break()\n"
        "    return x\n"
        "def g(x, s):\n"
        "    if s.item() > 1.0:\n"
        "        x = x * s\n"
        "    return x + 1\n"
        "x = torch.randn(4)\n"
        "torch.compile(f, backend='eager')(x)\n"
        "torch._dynamo.reset()\n"
        "torch.compile(h, backend='eager')(x)\n"
        "torch._dynamo.reset()\n"
        "try:\n"
        "    torch.compile(bad, backend='eager', fullgraph=True)(x)\n"
        "except Exception:\n"
        "    pass\n"
        "torch._dynamo.reset()\n"
        "cg = torch.compile(g, backend='nosync', options={'codegen': 'eager'})\n"
        "for _ in range(3):\n"
        "    cg(x, torch.tensor(2.0))\n"))
    rc, rep = _explain_json(capsys, s)
    assert rc == 0
    by_name = {c["function"]: c for c in rep["compiled"]}
    assert [b["line"] for b in by_name["f"]["graph_breaks"]] == [3]
    assert by_name["h"]["graph_breaks"] == []
    hoists = [d for d in rep["nosync"] if d["action"] == "hoisted" and d["site"]["line"] == 10]
    assert hoists and not any(d.get("discarded") for d in hoists)


def test_a_non_blocking_move_to_the_host_is_not_counted():
    """``x.to("cpu", non_blocking=True)`` makes no sync on a GPU (pinned memory, no wait): it was
    counted as one "cpu" read; a blocking one still counts."""
    x = torch.randn(4)
    with torchsync_pass.count_syncs() as c:
        x.to("cpu", non_blocking=True)
        x.to(device="cpu", non_blocking=True)
        x.to("cpu", torch.float32, True)
    assert c.total == 0
    with torchsync_pass.count_syncs() as c:
        x.to("cpu")
        x.to("cpu", torch.float32, False, True)  # copy=True, blocking
    assert c.total == 2


def test_explain_places_a_profiler_only_sync_at_the_scripts_top_level_on_its_line(tmp_path, capsys):
    """torch.equal at a script's top level (a sync only the profiler sees) was listed at line 0:
    the search for the op's call looked in function bodies only."""
    s = _script(tmp_path / "top.py", (
        "import torch\n"
        "x = torch.randn(4)\n"
        "def unrelated(a, b):\n"
        "    return a + b\n"
        "y = unrelated(x, 1)\n"
        "print(torch.equal(y, x + 1))\n"))
    rc, rep = _explain_json(capsys, s)
    assert rc == 0
    assert [(st["kind"], st["line"]) for st in rep["sites"]] == [("equal", 6)]


# review 22's second look at its own commits (helper 169)
def test_explain_returns_when_the_script_leaves_a_library_worker_thread(tmp_path):
    """explain joined every non-daemon thread the script started: a ThreadPoolExecutor never shut
    down (and Inductor's compile pool on a cold cache), whose workers end only in the
    interpreter's own shutdown, hung it forever."""
    s = _script(tmp_path / "pool.py", (
        "import concurrent.futures, torch\n"
        "ex = concurrent.futures.ThreadPoolExecutor(max_workers=1)\n"
        "x = torch.tensor([3.0])\n"
        "print(ex.submit(lambda: x.item()).result())\n"))
    _, rep = _explain_process(s)
    assert rep["totals"]["syncs"] == 1


def test_explain_calls_column_counts_a_generator_once_not_per_resume(tmp_path, capsys):
    """Each resume of a generator at its yield is a profiler event named by the yield's line: the
    call-line normalisation made each one a call (6 calls for one)."""
    s = _script(tmp_path / "gen.py", (
        "import torch\n"
        "x = torch.tensor(1.0)\n"
        "def steps():\n"
        "    for _ in range(5):\n"
        "        yield x.item()\n"
        "print(sum(steps()))\n"))
    assert _count_and_calls(capsys, s, 5) == (5, 1)


def test_check_request_lists_a_demoted_site_of_an_inlined_submodule(_clean):
    """Only sites whose own code was the compiled frame's were listed: one in a submodule's forward
    that Dynamo inlined was left out."""
    class Inner(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.s = torch.tensor([1.0])

        def forward(self, x):
            return x * self.s.item()

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.t = Inner(), torch.tensor([1.0])

        def forward(self, x):
            return self.inner(x) + self.t.item()

    m = M()
    f = torch.compile(m, backend="nosync", options={"codegen": "eager"})
    x = torch.ones(2)
    for i in range(6):  # both leaves new on every call, with a new value: both sites demoted
        m.inner.s = torch.tensor([float(i % 2)])
        m.t = torch.tensor([float(i % 2)])
        f(x)
    rep = torchsync_pass.check_request(f, x, on_change="report")
    lines = {Inner.forward.__code__.co_firstlineno + 1, M.forward.__code__.co_firstlineno + 1}
    assert {s.line for s in rep.demoted} == lines


def test_explain_verify_names_each_graph_by_its_qualified_compile_id(tmp_path, capsys, _clean):
    """--json --verify qualified the compile id of a graph compiled after a reset but not its name:
    two graphs were both "nosync graph 0/0"."""
    s = _script(tmp_path / "vr.py", (
        "import torch\n"
        "def g(x, s):\n"
        "    return x + s.item()\n"
        "x, s = torch.ones(3), torch.tensor([1.0])\n"
        "for _ in range(2):\n"
        "    torch._dynamo.reset()\n"
        "    torch.compile(g, backend='nosync', options={'codegen': 'eager'})(x, s)\n"))
    rc, rep = _explain_json(capsys, "--verify", s)
    assert rc == 0
    names = [v["name"] for v in rep["verification"]]
    assert len(names) == 2 and len(set(names)) == 2
    assert all(v["compile_id"] in v["name"] for v in rep["verification"])


def test_calls_are_unknown_where_a_read_came_while_the_profiler_was_off(_clean):
    """A function compiled inside the count (stock backend, a graph break at its read) read on its
    first call while the profiler was stopped for the compile: that call was never seen and
    calls read 3 for 4 calls, as if one call read twice. Unknown ("-") now; 4 when warm."""
    def helper(ids):
        return (ids == 3).sum().item()

    def step(x, ids):
        return x * helper(ids)

    f = torch.compile(step, backend="eager")
    ids = [torch.tensor([3, 3, 1, 2]) if k % 2 else torch.tensor([3, 1, 1, 2]) for k in range(4)]
    with torchsync_pass.count_syncs() as cold:
        for t in ids:
            f(torch.ones(4), t)
    with torchsync_pass.count_syncs() as warm:
        for t in ids:
            f(torch.ones(4), t)
    line = helper.__code__.co_firstlineno + 1
    (c,) = [s for s in cold.sites.values() if s.site.line == line]
    (w,) = [s for s in warm.sites.values() if s.site.line == line]
    assert (c.count, c.calls) == (4, None)
    assert (w.count, w.calls) == (4, 4)


def test_the_profiler_restarts_under_a_wrapper_whose_code_a_compiled_function_shares(_clean):
    """A decorator's one wrapper code object around both a compiled function and its uncompiled
    caller (transformers' deprecate_kwarg around generate and forward) has cache entries: the
    caller's frame was taken for compiled code, no safe point restarted the profiler after the
    compile, and profiler-only reads (multinomial's) went uncounted: 0 of 12, with no note."""
    import functools

    def deco(fn):
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            return fn(*args, **kwargs)
        return wrapped

    @deco
    def forward(x):
        return x * 2 + 1

    step = torch.compile(forward, backend="eager")
    probs = torch.softmax(torch.randn(1, 50, generator=torch.Generator().manual_seed(0)), -1)

    @deco
    def generate(n):
        for _ in range(n):
            step(torch.ones(3))
            torch.multinomial(probs.to(torch.float32), num_samples=1)

    with torchsync_pass.count_syncs() as ref:
        for _ in range(6):
            torch.multinomial(probs, num_samples=1)
    with torchsync_pass.count_syncs() as c:
        generate(6)
    assert ref.by_kind["in_op"] > 0
    assert c.by_kind["in_op"] == ref.by_kind["in_op"]


def test_the_hint_for_self_under_a_star_args_wrapper_names_its_position(_clean):
    """Under a wrapper taking only ``*args, **kwargs`` (transformers' deprecate_kwarg), 'self.t'
    was answered "declare 'kwargs.self.t'": self is never passed by keyword, so that declared
    nothing, silently (an argument the call leaves out). The hint names 'args.0.t'."""
    import functools

    from torchsync_pass import NosyncOptionsError

    def rebuilds(func):
        @functools.wraps(func)
        def wrapped(*args, **kwargs):
            if len(args) > 5:
                args = tuple(args)
            return func(*args, **kwargs)
        return wrapped

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.t = torch.arange(4.0)

        @rebuilds
        def forward(self, x):
            return x * (self.t.cumsum(-1) * 0.5).exp()

    m = M()
    x = torch.ones(4)
    strict = {"codegen": "eager", "strict": True}
    with pytest.raises(NosyncOptionsError) as raised:
        torch.compile(m, backend="nosync", options={**strict, "invariant": ["self.t"]})(x)
    assert "'args.0.t'" in str(raised.value) and "kwargs.self" not in str(raised.value)
    torch._dynamo.reset()
    f = torch.compile(m, backend="nosync", options={**strict, "invariant": ["args.0.t"]})
    assert torch.equal(f(x), m(x))

"""count_syncs(): per-kind counts, per-line sites, eager == compiled, and no effect on Dynamo."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from torchsync_pass import SiteKey, count_syncs

HERE = __file__


def line_of(fn, marker: str) -> int:
    """1-based line in this file of the line in ``fn`` that contains ``marker``."""
    src, first = inspect.getsourcelines(fn)
    hits = [first + i for i, text in enumerate(src) if marker in text]
    assert len(hits) == 1, f"marker {marker!r} found {len(hits)} times"
    return hits[0]


def assert_counts(c, expected_kind: dict[str, int], total: int | None = None) -> None:
    assert dict(c.by_kind) == expected_kind, c.summary()
    assert c.total == (sum(expected_kind.values()) if total is None else total), c.summary()


# --- one small function per kind, each with a known count ---------------------------------
X = torch.arange(6.0)
MASK = X > 2


def k_item(x):
    return x.sum().item()


def k_bool(x):
    return 1 if (x > 0).any() else 0


def k_int(x):
    return int(x.argmax())


def k_float(x):
    return float(x[1])


def k_index(x):
    return [10, 20, 30][x[1].long()]


def k_tolist(x):
    return x.tolist()


def k_numpy(x):
    return x.numpy()


def k_cpu(x):
    return x.cpu(), x.to("cpu"), x.to(torch.float64)  # the dtype cast is not a sync


def k_nonzero(x):
    return x.nonzero(), torch.nonzero(x)


def k_mask_index(x):
    return x[x > 2]


def k_mask_assign(x):
    y = x.clone()
    y[y > 2] = 0.0
    return y


def k_equal(x):
    return torch.equal(x, x), x.equal(x)


def k_masked_select(x):
    return torch.masked_select(x, x > 2)


@pytest.mark.parametrize(
    "fn,expected",
    [
        (k_item, {"item": 1}),
        (k_bool, {"bool": 1}),
        (k_int, {"int": 1}),
        (k_float, {"float": 1}),
        (k_index, {"index": 1}),
        (k_tolist, {"tolist": 1}),
        (k_numpy, {"numpy": 1}),
        (k_cpu, {"cpu": 2}),
        (k_nonzero, {"nonzero": 2}),
        (k_mask_index, {"mask_index": 1}),
        (k_mask_assign, {"mask_assign": 1}),
        (k_equal, {"equal": 2}),
        (k_masked_select, {"masked_select": 1}),
    ],
    ids=lambda v: v.__name__ if callable(v) else "",
)
def test_each_kind_counts(fn, expected):
    x = X.clone()
    with count_syncs() as c:
        for _ in range(3):
            fn(x)
    assert_counts(c, {k: 3 * v for k, v in expected.items()})


def test_no_sync_no_count():
    with count_syncs() as c:
        y = (X * 2 + 1).sin()[1:4]
        y = y.to(torch.float64)
    assert c.total == 0 and not c.by_site, c.summary()


def test_other_local_scalar_dense_path_counted():
    # aten::_local_scalar_dense reached from an op the wrappers do not know: run inside a
    # compiled graph that captures .item() (capture_scalar_outputs), seen by the profiler only.
    def f(x):
        return x * x.sum().item()

    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        cf = torch.compile(f, backend="eager", fullgraph=True)
        with count_syncs() as c:
            cf(X)
            cf(X)
    assert c.total == 2, c.summary()


def two_sites(x):
    a = x.sum().item()  # site-a
    b = x.tolist()  # site-b
    return a, b


def test_sites_point_at_the_right_lines():
    with count_syncs() as c:
        for _ in range(4):
            two_sites(X)
    sa = SiteKey(HERE, line_of(two_sites, "# site-a"))
    sb = SiteKey(HERE, line_of(two_sites, "# site-b"))
    assert dict(c.by_site) == {sa: 4, sb: 4}
    assert c.sites[sa].kind == "item" and c.sites[sb].kind == "tolist"
    assert c.sites[sa].source == "a = x.sum().item()  # site-a"
    assert c.sites[sa].function.endswith("two_sites")
    assert c.sites[sa].calls == 4  # calls of the enclosing function, from the profiler


def test_function_form_sites_point_at_their_lines():
    def f(x):
        n = x.nonzero()  # method-form
        e = torch.equal(x, x)  # function-eq
        m = torch.nonzero(x)  # function-nz
        return n, e, m

    with count_syncs() as c:
        f(X)
    assert c.by_site[SiteKey(HERE, line_of(f, "# method-form"))] == 1
    assert c.by_site[SiteKey(HERE, line_of(f, "# function-eq"))] == 1
    assert c.by_site[SiteKey(HERE, line_of(f, "# function-nz"))] == 1


def test_value_stability():
    def f(x, t):
        fixed = x.sum().item()  # fixed
        varies = t.item()  # varies
        return fixed, varies

    with count_syncs() as c:
        for i in range(5):
            f(X, torch.tensor(float(i)))
    fixed = c.sites[SiteKey(HERE, line_of(f, "# fixed"))]
    varies = c.sites[SiteKey(HERE, line_of(f, "# varies"))]
    assert fixed.distinct_values == 1 and fixed.hoisting_candidate
    assert varies.distinct_values == 5 and not varies.hoisting_candidate


def step(x, flags):
    y = x * 2
    s = flags.sum().item()  # step-item
    if (flags > 0).any():  # step-bool
        y = y + s
    n = int(flags.argmax())  # step-int
    return y * n


def test_eager_and_compiled_counts_match():
    x, flags = torch.ones(4), torch.tensor([1.0, 0.0, 2.0])
    with count_syncs() as eager:
        for _ in range(3):
            step(x, flags)
    cf = torch.compile(step, backend="eager")
    cf(x, flags)  # compile outside the counter
    with count_syncs() as compiled:
        for _ in range(3):
            cf(x, flags)
    assert eager.total == 9
    assert dict(compiled.by_kind) == dict(eager.by_kind)
    assert dict(compiled.by_site) == dict(eager.by_site)
    assert compiled.by_site[SiteKey(HERE, line_of(step, "# step-bool"))] == 3


def test_counter_does_not_change_what_dynamo_compiles():
    x, flags = torch.ones(4), torch.tensor([1.0, 0.0, 2.0])

    def compile_and_run(counting: bool):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        cnt = CompileCounterWithBackend("eager")
        cf = torch.compile(step, backend=cnt)
        if counting:
            with count_syncs() as c:
                for _ in range(3):
                    cf(x, flags)
            assert c.total == 9, c.summary()
        else:
            for _ in range(3):
                cf(x, flags)
        breaks = dict(torch._dynamo.utils.counters["graph_break"])
        return cnt.frame_count, cnt.op_count, [g.code for g in cnt.graphs], breaks

    without = compile_and_run(False)
    with_counter = compile_and_run(True)
    assert without[0] >= 3  # the syncs really split the function
    assert with_counter == without


def test_compile_time_reads_kept_apart():
    # compiling inside the counter: Dynamo's own tracing must not add syncs to the total
    x, flags = torch.ones(4), torch.tensor([1.0, 0.0, 2.0])
    cf = torch.compile(step, backend="eager")
    with count_syncs() as c:
        cf(x, flags)
    assert c.total == 3, c.summary()


def test_nested_counters_each_see_their_block():
    with count_syncs() as outer:
        k_item(X)
        with count_syncs() as inner:
            k_tolist(X)
            torch.equal(X, X)
        k_item(X)
    assert dict(inner.by_kind) == {"tolist": 1, "equal": 1}
    assert dict(outer.by_kind) == {"item": 2, "tolist": 1, "equal": 1}


def test_wrappers_removed_after_exit():
    before = {n: torch.Tensor.__dict__.get(n) for n in ("item", "__bool__", "__getitem__")}
    with count_syncs():
        assert torch.Tensor.__dict__.get("item") is not None
    after = {n: torch.Tensor.__dict__.get(n) for n in ("item", "__bool__", "__getitem__")}
    assert after == before


def test_tensors_stay_non_sequences_under_and_after_the_counter():
    """torch.tensor() of a list of 0-d tensors (Qwen2-VL's get_rope_index builds its rope deltas so)
    works under count_syncs() and after it, for torch.Tensor and its subclasses: the wrapped
    __getitem__ must not make tensors Python sequences (Note [Tensor __getitem__ and the sequence
    protocol]); boolean-mask indexing is still counted."""
    def scalars():
        return [torch.tensor(3), torch.nn.Parameter(torch.tensor(4.0), requires_grad=False)]

    expected = torch.tensor([3.0, 4.0])
    with count_syncs() as c:
        inside = torch.tensor(scalars())
        k_mask_index(X)
    after = torch.tensor(scalars())
    for got in (inside, after):
        assert torch.equal(got, expected) and got.dtype == expected.dtype
    assert c.by_kind["mask_index"] == 1, c.summary()

def test_interception_only_mode():
    with count_syncs(profiler=False) as c:
        k_item(X)
        torch.equal(X, X)  # function form: only the profiler sees it
    assert dict(c.by_kind) == {"item": 1}
    assert not c.profiled


@pytest.mark.cuda
def test_cuda_counts_runtime_syncs_and_host_local_reads():
    x = torch.arange(4.0, device="cuda")
    host = torch.arange(4.0)
    with count_syncs() as c:
        x.sum().item()
        x.cpu()
        host.sum().item()  # CPU-resident: host-local, not a sync
    assert dict(c.by_kind) == {"item": 1, "cpu": 1}
    assert sum(c.host_local.values()) == 1
    assert c.cuda.total >= 2
    assert c.cuda.dtoh_memcpy >= 2


def _scaled(x, k):
    return x * k + 1


def _compiles_inside_a_compiled_region(x, k):
    y = x + 1
    torch._dynamo.graph_break()
    z = torch.compile(_scaled, backend="eager")(y, k)  # a new k compiles: the profiler pauses
    s = (z > 0).sum().item()  # an intercepted sync in compiled (resumed) code
    return z * s


def test_profiler_never_restarted_inside_a_compiled_region(monkeypatch):
    # NOTE [Compiled regions] in _torch_private.frame_runs_under_dynamo: a restart in the resumed
    # compiled code corrupted the heap (segfaults in benchmarks/schedulers.py after LMS).
    import sys

    from torchsync_pass import counting

    starts = []
    orig = counting._Profiler.start

    def start(self):
        frame, names = sys._getframe(1), []
        while frame is not None:
            names.append(frame.f_code.co_name)
            frame = frame.f_back
        starts.append(names)
        return orig(self)

    monkeypatch.setattr(counting._Profiler, "start", start)
    f = torch.compile(_compiles_inside_a_compiled_region, backend="eager")
    for k in range(3):
        with count_syncs() as c:
            f(torch.ones(4), k)
        assert c.by_kind["item"] == 1, c.summary()
    inside = [s for s in starts if any(n.startswith("torch_dynamo_resume_in_")
                                       or n == "_compiles_inside_a_compiled_region" for n in s)]
    assert len(starts) >= 3 and not inside, inside


# --- torch x Python combinations (tests/compat.sh) --------------------------------------------
def _bool_first(x):
    y = x * 2
    z = y + 1
    if (x > 0).any():  # first-bool
        z = z - 1
    return z


def _calls_helper(x):
    return _bool_helper(x * 3) + 1


def _bool_helper(x):
    y = x.sin()
    if (x > 1).all():  # helper-bool
        return y
    return -y


def test_compiled_bool_graph_breaks_are_at_their_lines():
    # NOTE [TO_BOOL lines] in counting.py: on Python 3.13 Dynamo's TO_BOOL before the jump it
    # breaks at has no source line; these were counted at the def lines (torch 2.15, Python 3.13).
    cf = torch.compile(_bool_first, backend="eager")
    ch = torch.compile(_calls_helper, backend="eager")
    x = torch.ones(3)
    cf(x), ch(x)  # compile outside the counter
    with count_syncs() as c:
        for _ in range(2):
            cf(x), ch(x)
    assert dict(c.by_site) == {
        SiteKey(HERE, line_of(_bool_first, "# first-bool")): 2,
        SiteKey(HERE, line_of(_bool_helper, "# helper-bool")): 2,
    }, c.summary()


def _events_without_python_tracer(prof):
    """What torch 2.11 gives: the op events only, and no is_python_function() on them."""
    from torchsync_pass import _torch_private

    results = prof.kineto_results
    ops = [e for e in results.events() if not getattr(e, "is_python_function", lambda: False)()]
    return _torch_private.with_tree_python_events(results, ops)


def test_python_calls_from_the_event_tree_match_the_kineto_events():
    from torch.autograd.profiler import profile

    def f(x):
        return torch.equal(x, x), torch.nonzero(x)

    with profile(use_kineto=True, with_stack=True) as p:
        f(X)
    events = p.kineto_results.events()
    if not events or not hasattr(events[0], "is_python_function"):
        pytest.skip(f"torch {torch.__version__}: kineto events carry no Python calls to compare with")

    def key(e):
        return (e.name(), e.start_ns(), e.end_ns(), e.start_thread_id(), e.is_python_function())

    want = sorted(key(e) for e in events if e.device_type() == events[0].device_type())
    got = sorted(key(e) for e in _events_without_python_tracer(p) if e.device_type() == events[0].device_type())
    assert got == want
    assert any(k[0].endswith(": f") and k[4] for k in got)


def test_counts_when_the_kineto_events_lack_python_calls(monkeypatch):
    # torch 2.11: the profiler-only syncs (function forms) were counted 0 times there.
    from torchsync_pass import _torch_private

    monkeypatch.setattr(_torch_private, "profiler_events", _events_without_python_tracer)
    for fn, expected in ((k_nonzero, {"nonzero": 6}), (k_equal, {"equal": 6}),
                         (k_masked_select, {"masked_select": 3})):
        with count_syncs() as c:
            for _ in range(3):
                fn(X)
        assert_counts(c, expected)
        assert not c.notes, c.notes
    test_function_form_sites_point_at_their_lines()
    test_sites_point_at_the_right_lines()  # calls of the enclosing function, from the tree


def test_unreadable_profiler_events_are_said_not_dropped(monkeypatch, caplog):
    from torchsync_pass import _torch_private, counting

    class Bare:  # a kineto event of a release that lacks a method count_syncs reads
        def __init__(self, e):
            self._e = e

        def name(self):
            return self._e.name()

    monkeypatch.setattr(_torch_private, "profiler_events",
                        lambda prof: [Bare(e) for e in prof.kineto_results.events()])
    monkeypatch.setattr(counting, "_warned_unreadable", False, raising=False)
    with count_syncs() as c:
        k_equal(X)
    assert dict(c.by_kind) == {"equal": 1}  # the method form; torch.equal(x, x) is not seen
    note = counting.UNREADABLE_NOTE.format(version=torch.__version__)
    assert c.notes == [note] and f"note: {note}" in c.summary()
    assert note in caplog.text


def test_syncs_of_a_worker_thread_are_counted():
    """A serving engine runs the model in worker threads: the profiler recorded only the thread
    that opened the counter, so a sync inside an op (``linalg.solve``) in a worker was missed while
    its ``.item()`` (seen by the method wrappers) was counted: a plausible, partial total."""
    import threading

    a = torch.randn(3, 3, generator=torch.Generator().manual_seed(0)) + 3 * torch.eye(3)
    b = torch.ones(3)

    def work():
        for _ in range(3):
            torch.linalg.solve(a, b)
            b.sum().item()

    with count_syncs() as here:
        work()
    with count_syncs() as worker:
        t = threading.Thread(target=work)
        t.start()
        t.join()
    assert here.by_kind["in_op"] > 0 and here.by_kind["item"] == 3
    assert dict(worker.by_kind) == dict(here.by_kind) and worker.total == here.total

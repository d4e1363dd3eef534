"""Request-invariant tensor work cached across calls (issue 14, torchsync_pass/invariant.py).

Every test runs codegen="eager" and compares each call bitwise with eager; "runs once per request"
is counted with the profiler (the aten ops of the invariant subgraph executed per call).
"""

from __future__ import annotations

import contextlib
import gc
import re
import weakref

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import torchsync_pass
from torchsync_pass import Action, NosyncBackend, Reason, invariant
from diffusion_loop import make_model, make_request
from test_core import assert_bitwise

EAGER = {"codegen": "eager"}


def op_count(fn, *args, op: str):
    """(result, how many times aten ``op`` ran in ``fn(*args)``), measured with the profiler."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = fn(*args)
    return out, sum(e.count for e in prof.key_averages() if e.key == op)


def cached_decisions(action: Action = Action.CACHED) -> list:
    return [d for d in torchsync_pass.decisions() if d.action is action]


class Masked(nn.Module):
    """A buffer-derived mask (cumsum: the invariant work) added to the step-varying input."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.arange(64.0).reshape(8, 8) / 7.0)

    def forward(self, x):
        mask = (self.table.cumsum(0) > 3.0).float() * 0.5
        return x * mask + x.sin()


def new_request(m: nn.Module) -> None:
    """Write the module's table in place (same values): the next call is a new request."""
    with torch.no_grad():
        m.table.mul_(1.0)


def compiled(m_or_fn, options: dict, *args):
    """Compile and make the first call (tracing runs the ops too, so it is not counted)."""
    f = torch.compile(m_or_fn, backend=NosyncBackend(options))
    torch.manual_seed(0)
    out = f(*args)
    torch.manual_seed(0)
    assert_bitwise(out, m_or_fn(*args))
    if isinstance(getattr(m_or_fn, "table", None), torch.Tensor):
        new_request(m_or_fn)
    return f


def run_both(compiled, eager, *args):
    """One call of each, compared bitwise; returns the number of cumsums the compiled call ran."""
    out, n = op_count(compiled, *args, op="aten::cumsum")
    assert_bitwise(out, eager(*args))
    return n


def test_invariant_subgraph_runs_once_per_request_bitwise():
    m = Masked()
    x = torch.randn(8, 8)
    stock = compiled(m, {**EAGER, "invariant_cache_bytes": 0}, x)
    assert [run_both(stock, m, x) for _ in range(4)] == [1, 1, 1, 1]  # before: every step
    torch._dynamo.reset()
    counters.clear()
    f = compiled(m, EAGER, x)
    assert [run_both(f, m, x) for _ in range(4)] == [1, 0, 0, 0]  # after: once per request
    assert counters["nosync"]["invariant_computes"] == 2  # the first call's request, this one
    assert counters["nosync"]["invariant_hits"] == 3
    (d,) = cached_decisions()
    assert d.reason is Reason.INVARIANT_TENSOR and d.kind == "tensor"
    assert d.nbytes == 8 * 8 * 4 and "256 bytes" in d.detail
    assert d.leaves == ("self.table",) and "cumsum" in d.source


class TwoTables(Masked):
    """The cached mask reads two buffers: a change to either must recompute it."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.full((8, 1), 0.5))

    def forward(self, x):
        mask = (self.table.cumsum(0) > 3.0).float() * self.scale
        return x * mask + x.sin()


@pytest.mark.parametrize("cls", [Masked, TwoTables])
def test_leaf_written_in_place_mid_request_recomputes(cls):
    m = cls()
    x = torch.randn(8, 8)
    f = compiled(m, EAGER, x)
    assert [run_both(f, m, x) for _ in range(2)] == [1, 0]
    names = ["table"] + (["scale"] if cls is TwoTables else [])
    for name in names:  # each leaf in turn (the hot path compares every leaf, not the first)
        with torch.no_grad():
            getattr(m, name)[0, 0] = 100.0  # bumps _version: the cached mask is stale
        assert [run_both(f, m, x) for _ in range(2)] == [1, 0]
    for name in names:
        setattr(m, name, torch.full_like(getattr(m, name), 2.0))  # a new object
        assert [run_both(f, m, x) for _ in range(2)] == [1, 0]
    assert counters["nosync"]["invariant_computes"] == 2 + 2 * len(names)


def test_interleaved_requests_keep_their_own_cached_tensors():
    def step(x, tokens):
        emb = (tokens.float().cumsum(0) * 0.25).exp()
        return x + emb

    x = torch.randn(16)
    f = compiled(step, {**EAGER, "invariant": ["tokens"]}, x, torch.zeros(16, dtype=torch.long))
    a, b = torch.arange(16), torch.arange(16).flip(0)
    seen = []
    for tokens in (a, b, a, b, a):
        seen.append(run_both(f, step, x, tokens))
    assert seen == [1, 1, 0, 0, 0]
    assert counters["nosync"]["invariant_computes"] == 3
    assert counters["nosync"]["invariant_hits"] == 3


def test_undeclared_inputs_are_not_cached():
    def step(x, tokens):
        return x + tokens.float().cumsum(0)

    x, tokens = torch.randn(16), torch.arange(16)
    f = compiled(step, EAGER, x, tokens)
    assert [run_both(f, step, x, tokens) for _ in range(2)] == [1, 1]
    assert cached_decisions() == []


def test_byte_limit_reached_recomputes_and_says_so():
    m = Masked()
    x = torch.randn(8, 8)
    f = compiled(m, {**EAGER, "invariant_cache_bytes": 100}, x)
    assert [run_both(f, m, x) for _ in range(3)] == [1, 1, 1]
    (d,) = cached_decisions(Action.NOT_CACHED)
    assert d.reason is Reason.CACHE_BYTES and d.nbytes == 256
    assert cached_decisions() == []
    assert counters["nosync"]["invariant_computes"] == 0


def test_memo_holds_as_many_requests_as_the_byte_limit_allows():
    def step(x, tokens):
        return x + tokens.float().cumsum(0)  # 64 bytes cached per request

    x = torch.randn(16)
    f = compiled(step, {**EAGER, "invariant": ["tokens"], "invariant_cache_bytes": 64}, x,
                 torch.zeros(16, dtype=torch.long))
    a, b = torch.arange(16), torch.arange(16).flip(0)
    # One request fits: interleaving evicts, and each call recomputes (still bitwise).
    assert [run_both(f, step, x, t) for t in (a, b, a)] == [1, 1, 1]
    assert len(cached_decisions()) == 1


class Table16(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.arange(16.0))


class WritesItsMask(Table16):
    def forward(self, x):
        base = self.table.cumsum(0)
        mask = base * 2.0
        mask.add_(x)  # the step writes this invariant tensor in place: it must not be cached
        return mask * 3.0


def cached_sources() -> list[str]:
    return [d.source for d in cached_decisions()]


def test_tensor_the_step_writes_in_place_is_not_cached():
    m = WritesItsMask()
    f = compiled(m, EAGER, torch.zeros(16))
    for i in range(3):
        x = torch.full((16,), float(i))
        assert run_both(f, m, x) == (1 if i == 0 else 0)
    assert cached_sources() == ["base = self.table.cumsum(0)"]



class WritesAnArgument(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.arange(8.0) / 7.0)

    def forward(self, x, y):
        x.add_(1.0)
        return y * self.table.cumsum(0)


def test_argument_aliasing_a_leaf_written_before_the_leaf_is_read():
    """An argument the step writes in place is, on one call, a view of the buffer the cached work
    reads (not at trace time: the buffer was invariant then). Eager reads the written buffer; the
    runner handed the step values computed before the step ran. It runs the unsplit graph instead."""
    m, ref = WritesAnArgument(), WritesAnArgument()
    f = compiled(m, EAGER, torch.zeros(8), torch.ones(8))
    y = torch.ones(8)
    for _ in range(2):
        assert_bitwise(f(torch.zeros(8), y), ref(torch.zeros(8), y))
    for _ in range(2):
        assert_bitwise(f(m.table[:], y), ref(ref.table[:], y))
        assert_bitwise(m.table, ref.table)
    assert_bitwise(f(torch.zeros(8), y), ref(torch.zeros(8), y))  # and the cache still serves
    assert cached_sources() == ["return y * self.table.cumsum(0)"]
    assert counters["nosync"]["invariant_aliased_calls"] == 2


def test_cached_tensors_die_with_their_leaves_without_a_reset():
    """Deleting the model and the compiled wrapper frees the buffer; the runner (kept by Dynamo's
    cache until torch._dynamo.reset()) kept the tensors computed from it in its memo and its last
    call, up to invariant_cache_bytes each."""
    m, x = Masked(), torch.randn(8, 8)
    f = compiled(m, EAGER, x)
    for _ in range(2):
        f(x)
    [runner] = [o for o in gc.get_objects() if type(o) is invariant.InvariantRunner
                and o.last is not None and any(r() is m.table for r in o.last[1])]
    cached = [weakref.ref(t) for t in runner.last[3]]
    leaf = weakref.ref(m.table)
    del runner, f, m
    gc.collect()
    assert leaf() is None and cached
    assert [c() for c in cached] == [None] * len(cached)

class ReturnsItsMask(Table16):
    def forward(self, x):
        base = self.table.cumsum(0)
        mask = base * 2.0
        return x + mask, mask.view(4, 4)  # the caller gets a view of mask: it must not be cached


def test_tensor_returned_to_the_caller_is_not_cached():
    m = ReturnsItsMask()
    f = torch.compile(m, backend=NosyncBackend(EAGER))
    x = torch.randn(16)
    for _ in range(3):
        out = f(x)
        assert_bitwise(out, m(x))
        out[1].fill_(-1.0)  # the caller owns what it got back
    assert cached_sources() == ["base = self.table.cumsum(0)"]


def test_grad_mode_on_and_off_do_not_share_entries():
    m = Masked()
    f = torch.compile(m, backend=NosyncBackend(EAGER))
    x = torch.randn(8, 8, requires_grad=True)
    for grad in (True, False, True, False):
        with torch.set_grad_enabled(grad):
            out = f(x)
            ref = m(x)
        assert_bitwise(out.detach(), ref.detach())
        assert out.requires_grad == ref.requires_grad == grad
    assert counters["nosync"]["invariant_computes"] == 2
    assert counters["nosync"]["invariant_hits"] == 2
    f(x).sum().backward()
    g = x.grad.clone()
    x.grad = None
    m(x).sum().backward()
    assert_bitwise(g, x.grad)


class Noisy(Table16):
    def forward(self, x):
        base = self.table.cumsum(0)
        noise = torch.randn_like(self.table) * base  # random: a new value at every call
        return x + noise + base


class Autocast(Table16):
    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = self.table.cumsum(0)[:, None] @ torch.ones(1, 16)
        return x + y.float()


def test_random_work_is_never_cached():
    m = Noisy()
    f = compiled(m, EAGER, torch.zeros(16))
    x = torch.randn(16)
    for seed in range(3):
        torch.manual_seed(seed)
        out = f(x)
        torch.manual_seed(seed)
        assert_bitwise(out, m(x))
    assert cached_sources() == ["base = self.table.cumsum(0)"]


def test_autocast_work_is_never_cached():
    m = Autocast()
    f = compiled(m, EAGER, torch.zeros(16, 16))
    x = torch.randn(16, 16)
    assert [run_both(f, m, x) for _ in range(2)] == [1, 1]
    assert cached_decisions() == []


def test_tiny_diffusion_step_caches_its_invariant_work_bitwise():
    model = make_model("tiny")
    request = make_request("tiny")
    args = (request["x"], torch.tensor(1.0), request["token_types"], request["guidance_scale"],
            request["grid_hw"])
    f = compiled(model, EAGER, *args)
    counters.clear()
    exps = []
    for i in range(4):
        call = (args[0], torch.tensor(1.0 - i / 4), *args[2:])
        out, n = op_count(f, *call, op="aten::exp")
        assert_bitwise(out, model(*call))
        exps.append(n)
    # The frequency table of the time embedding reads no input at all: computed on the first
    # call, then never again (and stock recomputes it at every step).
    assert exps == [0, 0, 0, 0]
    assert cached_decisions() and counters["nosync"]["invariant_hits"] == 4


@pytest.mark.parametrize("bad", [-1, 1.5, True, "64MB"])
def test_cache_bytes_option_is_validated(bad):
    with pytest.raises(torchsync_pass.NosyncOptionsError, match="invariant_cache_bytes"):
        NosyncBackend({"invariant_cache_bytes": bad})


def test_explain_lists_each_cached_tensor(capsys):
    from conftest import EXAMPLES
    from torchsync_pass import explain

    script = f"{EXAMPLES}/diffusion_loop.py"
    rc = explain.main([script, "--steps", "3", "--backend", "nosync", "--codegen", "eager"])
    out = capsys.readouterr().out
    assert rc == 0
    assert re.search(r"diffusion_loop\.py:\d+: cached tensor\n\s+computed only from request-invariant "
                     r"inputs through pure ops: once per request \(again on each call whose inputs are new "
                     r"tensors or were written in place;[^)]*\) \(float32\[\d+\], \d+ bytes\)", out), out


class Weighted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.arange(64.0).reshape(8, 8) / 9.0)

    def forward(self, x):
        return x @ (self.w.cumsum(0) * 0.5)


@pytest.mark.parametrize("declared", [False, True])
def test_weights_that_require_grad_are_cached_only_declared_and_without_grad(declared):
    m = Weighted()
    options = {**EAGER, "invariant": ["self.w"] if declared else []}
    x = torch.randn(8, 8)
    with torch.no_grad():
        f = compiled(m, options, x)
        m.w.mul_(1.0)  # a new request
        assert [run_both(f, m, x) for _ in range(3)] == ([1, 0, 0] if declared else [1, 1, 1])
    # With grad on, nothing is cached (the weight's gradient must flow) and backward matches eager.
    f(x)  # recompiles for grad mode: not counted
    assert [run_both(f, m, x) for _ in range(2)] == [1, 1]
    f(x).sum().backward()
    g = m.w.grad.clone()
    m.w.grad = None
    m(x).sum().backward()
    assert_bitwise(g, m.w.grad)
    assert len(cached_decisions()) == (1 if declared else 0)


def test_grad_mode_is_checked_per_call_when_dynamos_guards_are_dropped():
    """A guard_filter_fn that drops every Dynamo guard (a serving engine's) also drops the
    global-state guard, so the entry compiled under no_grad serves grad-mode calls too: the
    runner itself must not hand those calls the tensors cached without grad (the weight's
    gradient would be lost; with grad on they are computed with grad, as eager does)."""
    m = Weighted()
    f = torch.compile(m, backend="nosync", options={
        **EAGER, "invariant": ["self.w"], "guard_filter_fn": lambda entries: [False] * len(entries)})
    x = torch.randn(8, 8)
    with torch.no_grad():
        assert [run_both(f, m, x) for _ in range(3)][1:] == [0, 0]  # cached under no_grad
    out = f(x)  # grad on, the same cache entry
    assert out.requires_grad
    out.sum().backward()
    g = m.w.grad.clone()
    m.w.grad = None
    ref = m(x)
    ref.sum().backward()
    assert_bitwise(out.detach(), ref.detach())
    assert_bitwise(g, m.w.grad)



def drop_all() -> dict:
    """Options that drop every Dynamo guard (a serving engine's filter); a new dict per compile
    (torch.compile pops ``guard_filter_fn`` from the one it is given)."""
    return {**EAGER, "guard_filter_fn": lambda entries: [False] * len(entries)}


class Squared(nn.Module):
    """A buffer whose invariant work saves a tensor for backward (mul): reusing it after a backward
    raises."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.arange(8.0) / 7.0)

    def forward(self, x):
        return x * (self.table * self.table).cumsum(0)


def test_leaf_that_starts_to_require_grad_is_recomputed_with_grad():
    """Dynamo's guards dropped, a buffer's requires_grad flips on after the work was cached: the
    memo key (no requires_grad) served the grad-less cached tensor (no gradient reached the leaf),
    and a cached tensor with grad would be freed by the first backward."""
    m = Squared()
    f = torch.compile(m, backend="nosync", options=drop_all())
    x = torch.ones(8)
    assert [run_both(f, m, x) for _ in range(3)][1:] == [0, 0]
    m.table.requires_grad_(True)
    for _ in range(2):  # the second backward: no cached autograd graph freed by the first
        out = f(x)
        out.sum().backward()
        g = m.table.grad
        m.table.grad = None
        ref = m(x)
        ref.sum().backward()
        assert_bitwise(out.detach(), ref.detach())
        assert g is not None
        assert_bitwise(g, m.table.grad)
        m.table.grad = None
    assert counters["stats"]["unique_graphs"] == 1  # the scenario: no recompile, the runner's own check


class BigSum(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.randn(2_000_003, generator=torch.Generator().manual_seed(0)))

    def forward(self, x):
        return x + self.table.sum()


@contextlib.contextmanager
def thread_count_restored():
    saved = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def skip_unless_threads_change_the_sum(m: BigSum) -> None:
    sums = {}
    for n in (2, 1):
        torch.set_num_threads(n)
        sums[n] = m.table.sum()
    if torch.equal(sums[1], sums[2]):
        pytest.skip("this build sums 2M floats to the same bits with 1 and 2 threads")


def test_thread_count_is_checked_per_call_when_dynamos_guards_are_dropped():
    """A 2M-element sum differs in its bits between 1 and 2 threads; the hoisted guard checks the
    thread count, and so must the runner when Dynamo's global-state guard is dropped."""
    m, x = BigSum(), torch.zeros(4)
    with thread_count_restored():
        skip_unless_threads_change_the_sum(m)
        f = torch.compile(m, backend="nosync", options=drop_all())
        with torch.no_grad():
            for n in (2, 2, 2, 1, 1, 2, 1):
                torch.set_num_threads(n)
                assert_bitwise(f(x), m(x))
    assert counters["stats"]["unique_graphs"] == 1  # the scenario: no recompile, the runner's own check


def test_thread_count_is_checked_at_a_new_request_whose_old_leaves_died():
    """The runner reuses its last state key at a new request (its last call is forgotten when a
    leaf of it dies, as between two requests) only while the global state is unchanged: a table
    the memo holds from a call under another thread count must not be served from that count's
    memo entry."""
    m, x = BigSum(), torch.zeros(4)
    with thread_count_restored():
        skip_unless_threads_change_the_sum(m)
        f = torch.compile(m, backend="nosync", options=drop_all())
        first = m.table
        with torch.no_grad():
            torch.set_num_threads(2)
            assert_bitwise(f(x), m(x))  # memo (2 threads): first
            m.table = first.clone()
            assert_bitwise(f(x), m(x))  # memo (2 threads): the clone, first; the last call: the clone
            torch.set_num_threads(1)
            m.table = first  # the clone dies: the runner forgets its last call
            assert_bitwise(f(x), m(x))  # first, under 1 thread: not the 2-thread entry
    assert counters["stats"]["unique_graphs"] == 1  # the scenario: no recompile, the runner's own check


def test_leaf_written_while_the_invariant_part_runs_is_not_filed_with_the_old_values(monkeypatch):
    """A write to a leaf that lands while the runner computes (another thread's, simulated here
    right after the invariant part returns): the memo entry and the fast path's key were taken
    after the values, so the old values were filed under the new version and served from then on."""
    m = Masked()
    x = torch.randn(8, 8)
    f = compiled(m, EAGER, x)
    run_both(f, m, x)
    compute = invariant.InvariantRunner._compute

    def racing(self, leaves):
        values = compute(self, leaves)
        with torch.no_grad():
            m.table.add_(1.0)  # lands between the values and the bookkeeping
        return values

    new_request(m)
    monkeypatch.setattr(invariant.InvariantRunner, "_compute", racing)
    f(x)  # the racing call: eager would have read either version
    monkeypatch.setattr(invariant.InvariantRunner, "_compute", compute)
    assert [run_both(f, m, x) for _ in range(2)] == [1, 0]  # the written table: recomputed once


RANDOM_ON_A_BUFFER = {
    "dropout1d": lambda b: torch.nn.functional.dropout1d(b.flatten(2), p=0.5, training=True),
    "dropout2d": lambda b: torch.nn.functional.dropout2d(b, p=0.5, training=True),
    "dropout3d": lambda b: torch.nn.functional.dropout3d(b, p=0.5, training=True),
    "fractional_max_pool2d": lambda b: torch.nn.functional.fractional_max_pool2d(b, 2, output_size=(3, 3)),
    "sdpa-dropout": lambda b: torch.nn.functional.scaled_dot_product_attention(b, b, b, dropout_p=0.5),
    "gumbel_softmax": lambda b: torch.nn.functional.gumbel_softmax(b, tau=1.0),
    # torch builtins whose aten op is seeded but whose name no pattern spells
    "binomial": lambda b: torch.binomial(torch.full_like(b, 10.0), b.sigmoid()),
    "rnn_tanh-dropout": lambda b: torch.rnn_tanh(
        b.flatten(2), b.new_zeros(2, 4, 3), [b.new_ones(3, 36) * 0.01] + [b.new_ones(3, 3) * 0.01] * 3,
        False, 2, 0.5, True, False, False)[0],
}


def same_draws_as_eager(f, m, *args, seeds=(0, 1, 2)) -> list:
    """Each seed: ``f`` gives eager's bits and leaves the RNG stream where eager leaves it."""
    outs = []
    for seed in seeds:
        torch.manual_seed(seed)
        out, after = f(*args), torch.rand(1)
        torch.manual_seed(seed)
        assert_bitwise(out, m(*args))
        assert_bitwise(after, torch.rand(1))  # the same draws, in the same order
        outs.append(out)
    return outs


# the deterministic work on the buffer that feeds the draw (the counts, the weights) is cached
RANDOM_OF_CACHED_INPUTS = {"binomial", "rnn_tanh-dropout"}


@pytest.mark.parametrize("name", sorted(RANDOM_ON_A_BUFFER))
def test_random_ops_on_a_buffer_are_never_cached(name):
    """Random ops whose names the random-op pattern missed (dropout2d, fractional pooling,
    attention with dropout, Gumbel noise, torch.binomial, an RNN with dropout) were cached: the
    first call's draw replayed under every
    later seed, and the draws missing from the RNG stream shifted every later random number."""
    op = RANDOM_ON_A_BUFFER[name]

    class Noisy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("b", torch.randn(2, 4, 6, 6, generator=torch.Generator().manual_seed(0)))

        def forward(self, x):
            return x * op(self.b)

    m, x = Noisy(), torch.ones(1)
    f = torch.compile(m, backend="nosync", options=EAGER)
    with torch.no_grad():
        same_draws_as_eager(f, m, x)
    if name not in RANDOM_OF_CACHED_INPUTS:
        assert not cached_decisions()


def test_byte_limit_bounds_the_runner_across_global_states():
    """One memo per global state, each filled to the limit: four states held four times the
    bytes the option allows."""
    class Cum(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("t", torch.randn(1024))  # 4096 bytes cached per request

        def forward(self, x):
            return x * self.t.cumsum(0)

    def runners() -> list:
        return [o for o in gc.get_objects() if type(o) is invariant.InvariantRunner]

    before = {id(r) for r in runners()}
    m, x = Cum(), torch.randn(1024)
    keep = torchsync_pass.keep_nosync_guards(torch.compiler.skip_all_guards_unsafe)
    f = torch.compile(m, backend="nosync", options={**EAGER, "invariant_cache_bytes": 4096, "guard_filter_fn": keep})
    with thread_count_restored():
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for grad in (False, True):
                with torch.set_grad_enabled(grad):
                    for _ in range(2):
                        assert_bitwise(f(x), m(x))
    (runner,) = [r for r in runners() if id(r) not in before]
    held = sum(v.nbytes for memo in runner.memos.values() for e in memo.entries for v in e.value)
    assert 0 < held <= 4096


class ConvOfBuffers(nn.Module):
    def __init__(self, batch: int = 2) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.register_buffer("w", torch.randn(16, 8, 3, 3, generator=g))
        self.register_buffer("img", torch.randn(batch, 8, 32, 32, generator=g))

    def forward(self, x):
        return x + torch.nn.functional.conv2d(self.img, self.w).sum()


def test_mkldnn_switch_is_part_of_the_cached_state():
    """``torch.backends.mkldnn.enabled`` picks the convolution kernel (other bits), and Dynamo's
    global-state guard does not cover it: the tensor cached with mkldnn on was served with it off."""
    m, x = ConvOfBuffers(), torch.randn(4)
    with torch.no_grad():
        with torch.backends.mkldnn.flags(enabled=False):
            off = m(x)
        if not torch.backends.mkldnn.is_available() or torch.equal(off, m(x)):
            pytest.skip("this build computes the convolution to the same bits with mkldnn on and off")
        f = torch.compile(m, backend="nosync", options=EAGER)
        for enabled in (True, True, False, False, True):
            with torch.backends.mkldnn.flags(enabled=enabled):
                assert_bitwise(f(x), m(x))
    assert cached_decisions()


class AttentionOfBuffers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        for n in "qkv":
            self.register_buffer(n, torch.randn(1, 2, 64, 32, generator=g))

    def forward(self, x):
        return x + torch.nn.functional.scaled_dot_product_attention(self.q, self.k, self.v)


def _sdpa_math_only():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.MATH)


class _NnpackOff:
    """``torch.backends.nnpack.flags(enabled=False)`` with mkldnn off (NNPACK is then the CPU
    convolution kernel when the build has it)."""

    def __enter__(self):
        self.stack = contextlib.ExitStack()
        self.stack.enter_context(torch.backends.mkldnn.flags(enabled=False))
        self.stack.enter_context(torch.backends.nnpack.flags(enabled=False))

    def __exit__(self, *exc):
        self.stack.close()


@pytest.mark.parametrize("switch", ["sdpa_kernel", "nnpack"])
def test_kernel_switches_are_part_of_the_cached_state(switch):
    """``torch.nn.attention.sdpa_kernel`` (the attention kernel) and ``torch.backends.nnpack`` (the
    CPU convolution kernel) change the bits, and Dynamo's global-state guard covers neither: the
    tensor cached under one kernel was served under the other."""
    if switch == "sdpa_kernel":
        m, x, off, on = AttentionOfBuffers(), torch.zeros(1), _sdpa_math_only, contextlib.nullcontext
    else:  # NNPACK takes a batch of 16 or more
        m, x, on = ConvOfBuffers(batch=16), torch.randn(4), lambda: torch.backends.mkldnn.flags(enabled=False)
        off = _NnpackOff
    with torch.no_grad():
        with off():
            other = m(x)
        with on():
            if torch.equal(other, m(x)):
                pytest.skip(f"this build computes the same bits with {switch} on and off")
        f = torch.compile(m, backend="nosync", options=EAGER)
        for ctx in (on, on, off, off, on):
            with ctx():
                assert_bitwise(f(x), m(x))
    assert cached_decisions()


def test_kernel_switch_is_checked_by_the_guard_of_a_hoisted_value():
    """The guard of a hoisted ``.item()`` over attention answered from the value it computed with
    the flash kernel inside ``sdpa_kernel(MATH)`` at the call site."""
    m = AttentionOfBuffers()

    def step(x):
        return x + torch.nn.functional.scaled_dot_product_attention(m.q, m.k, m.v).sum().item()

    x = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        with _sdpa_math_only():
            other = step(x)
        if torch.equal(other, step(x)):
            pytest.skip("this build computes the same bits with every attention kernel")
        f = torch.compile(step, backend="nosync", options={**EAGER, "invariant_cache_bytes": 0})
        for ctx in (contextlib.nullcontext, _sdpa_math_only, contextlib.nullcontext):
            with ctx():
                assert_bitwise(f(x), step(x))
    assert cached_decisions(Action.HOISTED)


def ramp(x):
    return x + torch.linspace(0, 1, 8).cumsum(0)


def test_default_dtype_is_checked_per_call_when_dynamos_guards_are_dropped():
    """Work with no leaf at all (a factory op without a dtype) depends on the default dtype: the
    runner served the float32 cached tensor under a float64 default."""
    f = torch.compile(ramp, backend="nosync", options=drop_all())
    x = torch.zeros(8)
    try:
        for dtype in (torch.float32, torch.float32, torch.float32, torch.float64, torch.float64, torch.float32):
            torch.set_default_dtype(dtype)
            assert_bitwise(f(x), ramp(x))
    finally:
        torch.set_default_dtype(torch.float32)
    assert cached_decisions() and counters["nosync"]["invariant_hits"] >= 2
    assert counters["stats"]["unique_graphs"] == 1  # the scenario: no recompile, the runner's own check

# --- Invariant inputs beyond buffers and declarations: the leaves nosync already guards --------


def speculated_step(x, tokens):
    if (tokens > 2).any():  # hoisted: tokens becomes a guarded (speculated) leaf
        x = x * 2.0
    return x + tokens.float().cumsum(0)


def test_leaf_of_a_hoisted_sync_is_invariant_and_a_write_to_it_recomputes():
    x = torch.randn(16)
    tokens = torch.arange(16)
    f = compiled(speculated_step, EAGER, x, tokens)
    assert [run_both(f, speculated_step, x, tokens) for _ in range(2)] == [0, 0]  # computed when compiled
    tokens[0] = 1  # written in place mid request (the hoisted answer stays): recomputed once
    assert [run_both(f, speculated_step, x, tokens) for _ in range(2)] == [1, 0]
    tokens = torch.arange(16).flip(0)  # a new request: a new object
    assert [run_both(f, speculated_step, x, tokens) for _ in range(2)] == [1, 0]
    (d,) = cached_decisions()
    assert d.leaves == ("tokens",) and "cumsum" in d.source
    assert counters["nosync"]["recompiles"] == 0


class Schedule:
    """A scheduler's per-request table read at a Python int step counter (lifted), and at index 0."""

    def __init__(self) -> None:
        self.sigmas = torch.linspace(1.0, 0.0, 11)
        self._step_index = 0


def schedule_step(x, s):
    sigma = s.sigmas[s._step_index]
    if sigma > 0.45:  # a sync on the table at the counter: lifted once the counter is dynamic
        x = x * 2.0
    scale = (s.sigmas[0] ** 2 + 1.0).rsqrt()  # the table at a constant index: invariant
    return x * scale + sigma


def run_schedule(f, x, s, steps):
    seen = []
    for i in range(steps):
        s._step_index = i
        out, n = op_count(f, x, s, op="aten::rsqrt")
        assert_bitwise(out, schedule_step(x, s))
        seen.append(n)
    return seen


def test_lifted_table_read_at_a_constant_index_is_invariant():
    x = torch.randn(4)
    s = Schedule()
    f = torch.compile(schedule_step, backend=NosyncBackend(EAGER))
    run_schedule(f, x, s, 2)  # index 0 (plain hoist), then index 1: the counter is dynamic, lifted
    lifted = [d for d in torchsync_pass.decisions() if d.reason is Reason.TABLE_LIFTED]
    assert lifted and lifted[-1].leaves == ("s.sigmas", "s._step_index")
    assert run_schedule(f, x, s, 6)[2:] == [0] * 4  # one graph for indices 0..5: computed once
    s.sigmas.mul_(1.0)  # the table written in place: recomputed once
    assert run_schedule(f, x, s, 4) == [1, 0, 0, 0]
    s.sigmas = torch.linspace(1.0, 0.0, 11) * 0.9  # set_timesteps: a new request
    assert run_schedule(f, x, s, 4) == [1, 0, 0, 0]
    assert any(d.leaves == ("s.sigmas",) and "rsqrt" in d.source for d in cached_decisions())


def test_speculated_leaf_interleaved_requests_and_grad_mode():
    x = torch.randn(16, requires_grad=True)
    a, b = torch.arange(16), torch.arange(16).flip(0).contiguous()
    with torch.no_grad():
        f = compiled(speculated_step, EAGER, x, a)
        assert [run_both(f, speculated_step, x, t) for t in (b, a, b, a)] == [1, 0, 0, 0]
    # Grad mode on: a recompile (Dynamo guards grad mode) with its own memo; the input's gradient
    # flows through the step part as in eager.
    f(x, a)
    assert [run_both(f, speculated_step, x, t) for t in (a, b, a)] == [0, 1, 0]
    f(x, b).sum().backward()
    g = x.grad.clone()
    x.grad = None
    speculated_step(x, b).sum().backward()
    assert_bitwise(g, x.grad)



@pytest.mark.parametrize("options, split", [({}, False), ({"invariant_cache_bytes": 1 << 20}, True)])
def test_caching_is_opt_in_under_inductor(monkeypatch, options, split):
    """invariant_cache_bytes defaults to off under Inductor (measured slower there on a CPU-bound
    step: README) and on for the eager codegen (the other tests); an explicit limit turns the split
    on. Inductor itself is replaced by a stand-in that runs the graph it is given and records it."""
    from torchsync_pass import _torch_private

    given: list = []

    def stand_in(gm, example_inputs, patches=None):
        given.append(sum(n.op == "placeholder" for n in gm.graph.nodes))
        return gm.forward

    monkeypatch.setattr(_torch_private, "inductor_compile", stand_in)
    m = Masked()
    x = torch.randn(8, 8)
    f = torch.compile(m, backend=NosyncBackend({"codegen": "inductor", **options}))
    for _ in range(3):
        assert_bitwise(f(x), m(x))
    assert given == ([3] if split else [2])  # the split step also takes the cached mask
    assert bool(cached_decisions()) is split


@pytest.mark.parametrize("options", [{**EAGER, "invariant_cache_bytes": 0}, EAGER])
def test_steps_run_generated_code_not_module_calls(options):
    """Per step, codegen="eager" runs the graphs' generated forward: no GraphModule goes through
    nn.Module.__call__ (behind nosync's guard token, a _LazyGraphModule's forward did at every
    step; the runner's step and invariant parts did too). Counted with a global forward hook,
    which every nn.Module.__call__ runs; the outputs stay bitwise equal to eager."""
    model = make_model("tiny")
    request = make_request("tiny")
    args = (request["x"], torch.tensor(1.0), request["token_types"], request["guidance_scale"],
            request["grid_hw"])
    f = compiled(model, options, *args)
    called: list = []

    def hook(module, args):
        called.append(module)

    handle = torch.nn.modules.module.register_module_forward_pre_hook(hook)
    try:
        f(*args)  # Dynamo may recompile for the global hook: not counted
        called.clear()
        for i in range(2):
            tokens = args[2].clone()  # a new request (the invariant part runs again), then steps
            for j in range(2):
                call = (args[0], torch.tensor(1.0 - j / 4), tokens, *args[3:])
                assert_bitwise(f(*call), model(*call))
    finally:
        handle.remove()
    assert sum(c is model for c in called) >= 4  # the hook sees module calls (the eager reference's)
    assert sorted({type(c).__name__ for c in called if isinstance(c, torch.fx.GraphModule)}) == []


def observe_then_read(x, rmin, rmax, scale, zp, on):
    y = torch.fused_moving_avg_obs_fake_quant(x, on, on, rmin, rmax, scale, zp, 0.5, 0, 255, -1)
    return y, rmax.item()  # the running max the op just wrote


def test_builtin_that_writes_its_arguments_by_schema_is_seen_as_a_writer():
    """``torch.fused_moving_avg_obs_fake_quant`` writes its running min/max, scale and zero point
    (``Tensor(a!)`` in its schema, no trailing underscore, no version bump): the later ``.item()``
    on the running max was hoisted, and served the value from before the write on every call."""
    def state():
        return (torch.tensor([0.0]), torch.tensor([0.0]), torch.tensor([1.0]), torch.tensor([0], dtype=torch.int32),
                torch.tensor([1]))

    f = torch.compile(observe_then_read, backend="nosync", options=EAGER)
    mine, ref = state(), state()
    for v in (4.0, 8.0, 8.0, 2.0):
        x = torch.tensor([-v, v])
        got, want = f(x, *mine), observe_then_read(x, *ref)
        assert_bitwise(got[0], want[0])
        assert got[1] == want[1]
    assert not cached_decisions(Action.HOISTED)


class CachedAndHoisted(nn.Module):
    """Cached invariant work (the cumsum of a buffer) and a hoisted sync in one graph: the runner
    takes the guard's token in its own code."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.arange(8.0) / 7.0)

    def forward(self, x, flag):
        y = x * self.table.cumsum(0)
        if flag.item() > 0:
            y = y + 1
        return y


def test_runner_takes_the_guard_token_itself_and_refuses_a_dropped_guard(monkeypatch):
    """The runner's generated call checks the guard token (no wrapper frame around it): with
    nosync's guard dropped by a guard_filter_fn, a second call still raises instead of serving the
    hoisted branch unchecked; with the guard kept (``keep_nosync_guards``) every call is checked."""
    m, x = CachedAndHoisted(), torch.randn(8)
    on, off = torch.tensor(1), torch.tensor(0)
    wrappers = []
    real = invariant.with_guard_token

    def spy(compiled, ran, unguarded):
        merged = real(compiled, ran, unguarded)
        wrappers.append(merged)
        return merged

    monkeypatch.setattr(torchsync_pass.backend, "with_guard_token", spy)
    f = torch.compile(m, backend="nosync", options=drop_all())
    assert_bitwise(f(x, on), m(x, on))
    monkeypatch.undo()
    assert len(wrappers) == 1 and wrappers[0] is not None  # the merged call is what Dynamo runs
    assert wrappers[0]._nosync_runner.call is not wrappers[0]
    with pytest.raises(torchsync_pass.NosyncError, match="guard_filter_fn"):
        f(x, off)  # the hoisted branch (flag > 0) would be taken for flag = 0
    torch._dynamo.reset()
    keep = torchsync_pass.keep_nosync_guards(torch.compiler.skip_all_guards_unsafe)
    g = torch.compile(m, backend="nosync", options={**EAGER, "guard_filter_fn": keep})
    for flag in (on, off, off, on):
        assert_bitwise(g(x, flag), m(x, flag))
    assert cached_decisions()


def test_guard_token_is_not_merged_into_a_wrapper_of_the_runner():
    """``functools.wraps`` copies the runner's marker onto a wrapper (a restore-on-error wrapper):
    such a wrapper is not a runner's own call, so it keeps the separate token check."""
    import functools

    runner = invariant.InvariantRunner.__new__(invariant.InvariantRunner)
    runner.leaf_index, runner.written, runner.precision_sensitive = (), (), False
    runner.read_precisions, runner.last, runner._whole_fn = None, None, None
    runner.step_fn = lambda *a: a
    runner.call = invariant._fast_call_fn(runner, runner.step_fn)

    @functools.wraps(runner.call)
    def wrapper(*args):
        return runner.call(*args)

    refused = []
    assert invariant.with_guard_token(wrapper, object(), lambda: None) is None
    merged = invariant.with_guard_token(runner.call, type("Ran", (), {})(), lambda: refused.append(1))
    assert merged is not None and merged is not runner.call
    runner.miss = lambda args: (7,)
    assert merged(1) == (1, 7) and refused == [1]  # no token left: unguarded() was called

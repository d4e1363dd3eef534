"""Review 21 (2026-12-07): each test failing on the commit before its fix."""

from __future__ import annotations

import collections
import functools
import operator

import pytest
import torch
from torch._dynamo.utils import counters

import torchsync_pass
from test_core import assert_bitwise


@pytest.fixture
def _clean():
    torch._dynamo.reset()
    torchsync_pass.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
    torchsync_pass.reset()


class _DrawsThenReads(torch.nn.Module):
    """A random draw, then a read of buffers only (cached by invariant caching), as an ids lookup."""

    def __init__(self, method: bool = False) -> None:
        super().__init__()
        self.register_buffer("table", torch.arange(10.0))
        self.register_buffer("idx", torch.tensor([1, 2]))
        self.emb = torch.nn.Embedding(5, 2)
        self.method = method

    def forward(self, x, ids):
        noise = torch.full_like(x, 0.5).bernoulli() if self.method else torch.rand(2)
        h = self.emb(ids).sum(0)  # the request's ids: their error comes first in eager
        return x + noise + h + self.table[self.idx] * 2


def _bad_buffer_then_fixed(make) -> list:
    torch.manual_seed(0)
    m = _DrawsThenReads()
    f = make(m)
    x, ids = torch.zeros(2), torch.tensor([0, 1])
    seen = [f(x, ids)]
    m.idx.fill_(20)  # the buffer goes out of range ...
    for bad_ids in (ids, torch.tensor([7, 1])):  # ... and on the second call the request's ids too
        with pytest.raises(IndexError) as raised:
            f(x, bad_ids)
        seen.append(str(raised.value).splitlines()[0])
    m.idx.copy_(torch.tensor([3, 4]))
    seen += [f(x, ids), torch.rand(3)]  # the generator where eager leaves it
    return seen


def test_an_invariant_part_that_raises_leaves_the_steps_draws_and_error_as_eager(_clean):
    """The invariant part ran first and raised at once: the step's earlier random draw was skipped
    (every later draw of the process one behind eager's) and a bad request's own error hidden by
    the buffer's (helper 159). The unsplit graph now runs on such a call."""
    ref = _bad_buffer_then_fixed(lambda m: m)
    got = _bad_buffer_then_fixed(lambda m: torch.compile(m, backend="nosync", options={"codegen": "eager"}))
    assert counters["nosync"]["cached"] >= 1  # the invariant part was split off
    assert got[1:3] == ref[1:3]
    for a, b in zip(got[:1] + got[3:], ref[:1] + ref[3:]):
        assert_bitwise(a, b)


@pytest.mark.inductor
@pytest.mark.parametrize("method", [False, True])
def test_under_inductor_a_graph_with_a_random_op_is_not_split(method, _clean):
    """Under Inductor the unsplit graph a raising invariant part falls back to runs as eager ops,
    whose draws are not stock Inductor's: such a graph is compiled whole, as stock's. Also for a
    random op called as a method, ``t.bernoulli()`` (helper 160)."""
    m = _DrawsThenReads(method)
    step = torch.compile(m, backend="nosync", options={"invariant_cache_bytes": 1 << 20})
    step(torch.zeros(2), torch.tensor([0, 1]))
    assert counters["nosync"].get("cached", 0) == 0
    assert not [d for d in torchsync_pass.decisions() if d.action is torchsync_pass.Action.CACHED]


def _step(x, tt):
    if (tt == 0).any():
        return x * 2
    return x + 1


def test_a_kernel_switch_the_cone_cannot_see_does_not_split_its_memo(_clean):
    """cudnn.benchmark flipped between two compiles (no effect on ``(tt == 0).any()``): each cache
    entry kept a memo of its own, and each new request read the value once per entry (2 against
    stock's 1; helper 159)."""
    step = torch.compile(_step, backend="nosync", options={"codegen": "eager"})
    x = torch.ones(4)
    before = torch.backends.cudnn.benchmark
    try:
        torch.backends.cudnn.benchmark = False
        a = torch.tensor([0, 1, 2])
        for _ in range(3):
            step(x, a)
        torch.backends.cudnn.benchmark = True
        b = torch.tensor([5, 3, 4])
        for _ in range(3):
            step(x, b)  # recompiled: the other answer
        reads = []
        for r in range(4):
            tt = torch.tensor([0, 1, 2]) if r % 2 else torch.tensor([5, 3, 4])
            for _ in range(3):
                with torchsync_pass.count_syncs() as c:
                    out = step(x, tt)
                assert torch.equal(out, _step(x, tt))
                reads.append(c.total)
        assert reads == [1, 0, 0] * 4, (reads, torchsync_pass.decisions())
        tt = torch.tensor([0, 7, 7])
        with torchsync_pass.count_syncs() as c:
            torchsync_pass.check_request(step, x, tt, on_change="report")
            out = step(x, tt)
        assert torch.equal(out, _step(x, tt))
        assert c.total == 1  # check_request's read is the guard's
    finally:
        torch.backends.cudnn.benchmark = before


class _Sched:
    def __init__(self) -> None:
        self.sigmas = torch.linspace(1.0, 0.1, 9, dtype=torch.float64)
        self.M = torch.eye(3, dtype=torch.float64) * 2
        self.step_index = 0

    def step(self, x):
        c = torch.linalg.solve(self.M + self.sigmas[self.step_index], torch.ones(3, dtype=torch.float64))
        self.step_index += 1
        return x + c


def test_verify_does_not_demote_a_tabulated_op(_clean):
    """options['verify'] ran each compiled graph on clones of its inputs, and the tabulated solve
    stored a table for the clones that no call could read: three compiles in a row demoted it (3
    syncs a step from then on, against 0 without verify; helper 159)."""
    s = _Sched()
    step = torch.compile(s.step, backend="nosync", options={"codegen": "eager", "verify": True})
    for dt in (torch.float64, torch.float32, torch.bfloat16, torch.float16):  # a compile each
        step(torch.zeros(3, dtype=dt))
    fresh = _Sched()
    s.sigmas, s.M, s.step_index = fresh.sigmas.clone(), fresh.M.clone(), 0  # a new request
    reads = []
    for _ in range(4):
        x = torch.zeros(3, dtype=torch.float64)
        with torchsync_pass.count_syncs() as c:
            out = step(x)
        assert_bitwise(out, fresh.step(x))
        reads.append(c.total)
    assert reads[1:] == [0, 0, 0], reads
    assert not [d for d in torchsync_pass.decisions() if d.action is torchsync_pass.Action.DEMOTED]


class _Flags:
    def __init__(self, dtype: torch.dtype) -> None:
        self.flags = torch.tensor([1, 0, 1, 1, 0, 1], dtype=dtype)
        self.step_index = 0

    def step(self, x):
        n = operator.index(self.flags[self.step_index])
        self.step_index += 1
        return x * (n + 1), torch.full((2,), n)  # full: int64 for an int n, bool for a bool


def _index_reads(dtype: torch.dtype) -> int:
    torch._dynamo.reset()
    torchsync_pass.reset()
    s, ref = _Flags(dtype), _Flags(dtype)
    step = torch.compile(s.step, backend="nosync", options={"codegen": "eager"})
    x = torch.ones(2)
    for _ in range(2):
        assert_bitwise(step(x), ref.step(x))
    reads = 0
    for _ in range(4):
        with torchsync_pass.count_syncs() as c:
            out = step(x)
        assert_bitwise(out, ref.step(x))
        reads += c.total
    return reads


def test_a_bool_table_read_through_operator_index_is_lifted_as_ints(_clean):
    """operator.index(torch.tensor(True)) is 1 in eager; the lifting took it for an error ("the
    tables answer at no index") and the read synced every step where an int64 table's is lifted
    (helper 159). Lifted as the int64 table is (on 2.11, which lifts neither, both sync)."""
    as_ints = _index_reads(torch.int64)
    assert as_ints == 0 or _release() < (2, 12)
    assert _index_reads(torch.bool) == as_ints


def _breaks_in_an_arm(x, t):
    if t[0] > 0:
        return x * 2
    torch._dynamo.graph_break()
    return x - 1


def _graphs_compiled(backend: str) -> tuple[int, list]:
    torch._dynamo.reset()
    torchsync_pass.reset()
    inner = (torchsync_pass.NosyncBackend({"codegen": "eager"}) if backend == "nosync"
             else torch._dynamo.lookup_backend("eager"))
    compiled = []

    def counting(gm, example_inputs):
        compiled.append(gm)
        return inner(gm, example_inputs)

    counting.compiler_fn = inner  # (so that nosync's tracing hooks see it)
    # dynamic=True: t's cone is rejected as symbolic, and the branch tried as a select at once
    step = torch.compile(_breaks_in_an_arm, backend=counting, dynamic=True)
    outs = [step(torch.ones(3), torch.tensor([(-1.0) ** i, 3.0])) for i in range(4)]
    return len(compiled), outs


def test_a_graph_break_in_an_arm_refuses_the_select_before_a_graph_is_compiled(_clean):
    """The select was refused only after Dynamo had compiled the graph up to the break in the
    arm, a graph that never ran: one backend compile more than stock's (helper 158)."""
    stock, ref = _graphs_compiled("eager")
    nosync, outs = _graphs_compiled("nosync")
    assert nosync == stock, (nosync, stock)
    for a, b in zip(outs, ref):
        assert_bitwise(a, b)
    kept = [d for d in torchsync_pass.decisions() if d.action is torchsync_pass.Action.KEPT]
    if _release() >= (2, 13):  # (2.11 and 2.12 do not try this select: nothing to refuse)
        assert kept and "an arm breaks the graph" in kept[0].detail, torchsync_pass.decisions()


def _release() -> tuple:
    return tuple(map(int, torch.__version__.split("+")[0].split(".")[:2]))


def test_an_int_symbolic_under_dynamic_true_is_not_said_to_have_changed(_clean):
    """dynamic=True makes an int symbolic on the first call; the rejection said Dynamo made it
    dynamic "after it changed between calls", which it never did (helper 158)."""
    def step(x, t, n):
        if (t * n).sum() > 0:
            return x + 1
        return x - 1

    f = torch.compile(step, backend="nosync", options={"codegen": "eager"}, dynamic=True)
    for _ in range(2):
        assert_bitwise(f(torch.ones(2), torch.tensor(-2.0), 3), step(torch.ones(2), torch.tensor(-2.0), 3))
    details = [d.detail for d in torchsync_pass.decisions() if d.reason is torchsync_pass.Reason.SYMBOLIC]
    assert details and all("Python int that Dynamo made dynamic (s" in d for d in details), details
    assert all("dynamic=True, or it changed between calls" in d for d in details), details


class _Out(collections.OrderedDict):
    """A dict subclass read by position, as transformers' ModelOutput (``encoder_outputs[0]``), its
    items also its attributes (``encoder_outputs.last_hidden_state``)."""

    def __init__(self, **items):
        super().__init__(**items)
        for k, v in items.items():
            object.__setattr__(self, k, v)

    def __getitem__(self, k):
        if isinstance(k, str):
            return dict.__getitem__(self, k)
        return self.to_tuple()[k]

    def to_tuple(self):
        return tuple(self[k] for k in self.keys())


def _reads_the_first_field(x, enc):
    return x + (enc[0] * 2).sum()


def _reads_the_field_as_an_attribute(x, enc):
    return x + (enc.h * 2).sum()


@pytest.mark.parametrize("declared", ["enc.h", "enc.0"])
@pytest.mark.parametrize("read", [_reads_the_first_field, _reads_the_field_as_an_attribute])
def test_a_dict_item_is_declared_by_its_key_or_its_position(read, declared, _clean):
    """Dynamo names the item ``dict.__getitem__(L['enc'], list(dict.keys(L['enc']))[0])``: no path
    matched it, so declaring a ModelOutput field (generate's encoder_outputs) cached nothing, with
    no warning; 'enc.0' raised under strict (helper 156). Read as an attribute, the item was not
    declared by its position (helper 160)."""
    step = torch.compile(read, backend="nosync", options={"codegen": "eager", "invariant": [declared], "strict": True})
    x = torch.ones(3)
    for h in (torch.ones(2), torch.ones(2), torch.full((2,), 3.0)):  # then a new request
        enc = _Out(h=h)
        assert_bitwise(step(x, enc), read(x, enc))
    cached = [d for d in torchsync_pass.decisions() if d.action is torchsync_pass.Action.CACHED]
    assert cached, torchsync_pass.decisions()
    h = torch.ones(2)
    enc = _Out(h=h)
    step(x, enc)
    h.mul_(5.0)  # written in place mid request: recomputed
    assert_bitwise(step(x, enc), read(x, enc))


class _Router(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("w", torch.ones(4))

    def forward(self, x):
        if (x * self.w).sum() > 0:
            return x + 1
        return x - 1


def test_a_declared_input_read_with_a_buffer_is_not_demoted_for_the_input_alone(_clean):
    """``if (x * self.w).sum() > 0`` with ``x`` declared and a new x (one of two values) on each
    call: demoted LEAVES_CHANGE as if x were undeclared, though only the declared leaf was new and
    the README says such a site is never demoted for its leaves changing (helper 155)."""
    m = _Router()
    step = torch.compile(m, backend="nosync", options={"codegen": "eager", "invariant": ["x"]})
    for i in range(8):
        x = torch.full((4,), 1.0 if i % 2 == 0 else -1.0)
        assert_bitwise(step(x), m(x))
    actions = [d.action for d in torchsync_pass.decisions()]
    assert torchsync_pass.Action.DEMOTED not in actions and actions.count(torchsync_pass.Action.HOISTED) == 2, actions


@pytest.mark.parametrize("training", [False, True])
def test_a_dropout_with_training_false_is_not_a_random_op(training, _clean):
    """F.dropout(h, p, training=self.training) in an eval model (every transformers layer) draws
    nothing and returns h: its cone was rejected as "random op dropout" (helper 156)."""
    lin = torch.nn.Linear(4, 4).requires_grad_(False)

    def step(enc, x):
        if lin(torch.nn.functional.dropout(enc, p=0.0, training=training)).sum() > 0:
            return x * 0
        return x + 1

    compiled = torch.compile(step, backend="nosync", options={"codegen": "eager"})
    enc, x = torch.randn(2, 4), torch.randn(3)
    for _ in range(3):
        torch.manual_seed(1)
        out = compiled(enc, x)
        torch.manual_seed(1)
        assert_bitwise(out, step(enc, x))
    first = torchsync_pass.decisions()[0]
    if training:
        assert first.reason is torchsync_pass.Reason.IMPURE_OP, first
    else:
        assert first.action is torchsync_pass.Action.HOISTED, first


def _reads_a(x, d):
    return x[: int(d["a"][0])] + d["b"]


def test_a_position_declared_in_one_key_order_does_not_declare_another_orders_item(_clean):
    """'d.0' declared 'a' of {"a": a, "b": b}; the guard then resolved the path the step reads
    (d.a), which names whatever it reads: with the keys in another order ({"b": b, "a": a2}, d.0
    now b) a new inference tensor a2 was taken for declared, kept by identity only, and its
    in-place write served stale (helper 161). The declared path is what a later call resolves."""
    step = torch.compile(_reads_a, backend="nosync", options={"codegen": "eager", "invariant": ["d.0"]})
    with torch.inference_mode():
        x, a, b = torch.arange(4.0), torch.full((1,), 3.0), torch.zeros(1)
        assert_bitwise(step(x, {"a": a, "b": b}), _reads_a(x, {"a": a, "b": b}))
        a2 = torch.full((1,), 3.0)
        d2 = {"b": b, "a": a2}
        assert_bitwise(step(x, d2), _reads_a(x, d2))
        a2.fill_(1.0)
        assert_bitwise(step(x, d2), _reads_a(x, d2))


def _reads_int_key(x, o):
    return x[: int(o[1][0])]


def test_an_int_keyed_dict_item_is_declared_by_its_key(_clean):
    """{1: t, 0: u} with 'o.1' declared: the path was read as the position 1 (u), so t was never
    declared (rejected as an inference tensor, a sync per call; helper 161)."""
    step = torch.compile(_reads_int_key, backend="nosync",
                         options={"codegen": "eager", "invariant": ["o.1"], "strict": True})
    with torch.inference_mode():
        x, o = torch.arange(4.0), {1: torch.full((1,), 3.0), 0: torch.zeros(1)}
        for _ in range(2):
            assert_bitwise(step(x, o), _reads_int_key(x, o))
        with torchsync_pass.count_syncs() as c:
            out = step(x, o)
        assert_bitwise(out, _reads_int_key(x, o))
    assert c.total == 0
    assert [d.action for d in torchsync_pass.decisions()] == [torchsync_pass.Action.HOISTED]


def _passes_on(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)
    return wrapper


def _method_passes_on(fn):
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):  # diffusers' shape
        return fn(self, *args, **kwargs)
    return wrapper


@_passes_on
def _wrapped_reads_a(x, d):
    return x[: int(d["a"][0])] + d["b"]


class _BreaksThenReads(torch.nn.Module):
    @_method_passes_on
    def forward(self, x, img_ids=None):
        x = x * 1
        torch._dynamo.graph_break()
        return x[: int(img_ids[0])]


def _hoisted_with_no_sync(step, ref, *args, **kwargs) -> None:
    with torch.inference_mode():
        for _ in range(2):
            step(*args, **kwargs)
        with torchsync_pass.count_syncs() as c:
            out = step(*args, **kwargs)
        assert_bitwise(out, ref(*args, **kwargs))
    assert c.total == 0, torchsync_pass.decisions()


@pytest.mark.parametrize("declared", ["kwargs.d.0", "kwargs.d.a"])
def test_a_wrappers_own_path_declares_a_dict_item_by_position(declared, _clean):
    """A wraps wrapper's own path to a dict item by its position ('kwargs.d.0') declared nothing
    (matched only exactly), and under strict raised "no argument 'kwargs'" (helper 162)."""
    with torch.inference_mode():
        x, d = torch.arange(4.0), {"a": torch.full((1,), 3.0), "b": torch.zeros(1)}
    step = torch.compile(_wrapped_reads_a, backend="nosync",
                         options={"codegen": "eager", "invariant": [declared], "strict": True})
    _hoisted_with_no_sync(step, _wrapped_reads_a.__wrapped__, x, d=d)


@pytest.mark.parametrize("declared", ["kwargs.img_ids", "img_ids"])
def test_a_wrappers_path_declares_after_a_graph_break_in_the_function_it_wraps(declared, _clean):
    """diffusers' wrapper(self, *args, **kwargs) around a forward with a graph break before the
    read: 'kwargs.img_ids' (the README's own example) declared nothing in the resume function, and
    under strict raised "no argument 'kwargs'" (helper 162)."""
    m = _BreaksThenReads()
    with torch.inference_mode():
        x, ids = torch.arange(4.0), torch.full((1,), 3.0)
    step = torch.compile(m, backend="nosync", options={"codegen": "eager", "invariant": [declared], "strict": True})
    _hoisted_with_no_sync(step, functools.partial(_BreaksThenReads.forward.__wrapped__, m), x, img_ids=ids)

"""Device-side rewrites (issue 13): a per-position branch between tensors becomes ``torch.where``.

``row = pad_row if t == PAD else emb(t)`` reads ``t`` to the host to pick an arm. Once nosync knows
the test varies from step to step (it does not hoist it), both arms are traced and ``torch.where``
selects the taken arm's bits on the device: no host read, every call bitwise equal to eager
(``codegen="eager"``). An index op in an arm eager may skip gets its index masked to 0 when its arm
is not taken (an embedding of a PAD id of -1 must not raise). Branches whose arms cannot both run
keep their sync and say why.
"""

from __future__ import annotations

import linecache
import operator

import pytest
import torch
from torch import nn

import torchsync_pass
from torchsync_pass import Action, NosyncBackend, Reason, dynamo_hooks

pytestmark = pytest.mark.skipif(
    dynamo_hooks._torch_version() < dynamo_hooks.SELECT_MIN_TORCH,
    reason="the device-side select needs torch 2.13+ (see dynamo_hooks.SELECT_MIN_TORCH)")

PAD = -1
WARM = 5  # calls with new tokens before the counted one: the test is speculated, then demoted


def assert_bitwise(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride(), (a.shape, b.shape)
    if a.dtype == torch.float32:  # NaN != NaN: compare the bits
        a, b = a.view(torch.int32), b.view(torch.int32)
    assert torch.equal(a, b), (a - b).abs().max()


def compiled(fn):
    return torch.compile(fn, backend=NosyncBackend({"codegen": "eager"}))


def syncs(fn, *args):
    with torchsync_pass.count_syncs(stacks=False) as c:
        out = fn(*args)
    return out, c.total


def decisions(action, reason=None):
    return [d for d in torchsync_pass.decisions() if d.action is action and (reason is None or d.reason is reason)]


def tokens_of(seed, n=6, vocab=16):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, vocab, (n,), generator=g)
    t[torch.randperm(n, generator=g)[: n // 3]] = PAD
    return t


def run_steps(model, fn, make_args, steps=WARM):
    """Call fn on new arguments ``steps`` times (each bitwise with eager), then count one more."""
    for s in range(steps):
        args = make_args(s)
        assert_bitwise(fn(*args), model(*args))
    args = make_args(steps)
    out, n = syncs(fn, *args)
    assert_bitwise(out, model(*args))
    return n


class PadOrEmbed(nn.Module):
    """The issue's form: a conditional expression, PAD = -1 (out of range for the embedding)."""

    def __init__(self, vocab=16, dim=5):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.register_buffer("pad_row", torch.full((dim,), 0.5))

    def forward(self, tokens):
        rows = []
        for i in range(tokens.shape[0]):
            rows.append(self.pad_row if tokens[i] == PAD else self.emb(tokens[i]))
        return torch.stack(rows) * 2


class PadOrEmbedStatement(PadOrEmbed):
    """The same choice as an if/else statement, each arm appending its row."""

    def forward(self, tokens):
        rows = []
        for i in range(tokens.shape[0]):
            if tokens[i] == PAD:
                rows.append(self.pad_row)
            else:
                rows.append(self.emb(tokens[i]))
        return torch.stack(rows) * 2


@pytest.mark.parametrize("cls", [PadOrEmbed, PadOrEmbedStatement])
@torch.no_grad()
def test_per_position_branch_is_selected_on_the_device(cls):
    torch._dynamo.reset()
    model = cls().eval()
    fn = compiled(model)
    n = run_steps(model, fn, lambda s: (tokens_of(s),))
    assert n == 0
    rewritten = decisions(Action.REWRITTEN, Reason.BRANCH_WHERE)
    assert rewritten and all("PAD" in d.source for d in rewritten)
    # stock Dynamo syncs once per position on the same call
    stock = torch.compile(model, backend="eager")
    stock(tokens_of(99))
    assert syncs(stock, tokens_of(100))[1] == 6


@torch.no_grad()
def test_taken_arm_out_of_range_raises_as_eager():
    torch._dynamo.reset()
    model = PadOrEmbed().eval()
    fn = compiled(model)
    run_steps(model, fn, lambda s: (tokens_of(s),))
    bad = torch.tensor([3, PAD, 16, PAD, 1, 2])  # 16 is taken to the embedding: out of range
    with pytest.raises(IndexError) as eager_err:
        model(bad)
    with pytest.raises(IndexError) as ours:
        fn(bad)
    assert str(ours.value) == str(eager_err.value)
    assert not decisions(Action.KEPT)


@torch.no_grad()
def test_if_without_else_and_special_bits():
    """``if t > 0: x = x * 2`` selects between x*2 and x; NaN payloads and -0.0 keep their bits."""
    torch._dynamo.reset()

    def step(x, t):
        for i in range(t.shape[0]):
            if t[i] > 0:
                x = x * 2
            x = x + 0.0 if t[i] < -5 else x
        return x.clone()  # x itself may be the input: returning it keeps the sync (a select is a copy)

    fn = compiled(step)
    x = torch.tensor([float("nan"), -0.0, 1.5, -float("inf")])
    x[0] = torch.tensor(0x7FC00ABC, dtype=torch.int32).view(torch.float32)  # a NaN with a payload
    n = run_steps(step, fn, lambda s: (x, torch.randint(-8, 8, (4,), generator=torch.Generator().manual_seed(s))))
    assert n == 0
    out = fn(x, torch.tensor([-1, -1, -1, -1]))
    assert torch.equal(out.view(torch.int32), x.view(torch.int32))


@torch.no_grad()
def test_branches_that_cannot_run_both_arms_keep_their_sync():
    torch._dynamo.reset()
    def early_exit(x, t):  # an arm leaves the loop: the arms never join
        for i in range(t.shape[0]):
            if t[i] > 0:
                break
            x = x + 1
        return x * 2

    def shapes_differ(x, t):
        y = x[:2] if t[0] > 0 else x
        return y * 2

    def int_division(x, t):  # x // t raises ZeroDivisionError on the arm eager skips
        y = x // t[1] if t[0] > 0 else x
        return y + 1

    def side_effect(x, t):
        out = []
        if t[0] > 0:
            out.append(x)
            y = x + 1
        else:
            y = x - 1
        return y, len(out)

    def returned(x, t):  # eager returns x itself; a select would return a copy
        return x if t[0] > 0 else x * 2

    cases = [(early_exit, Reason.BRANCH_FORM), (shapes_differ, Reason.BRANCH_VALUES),
             (int_division, Reason.BRANCH_MAY_RAISE), (side_effect, Reason.BRANCH_SIDE_EFFECT),
             (returned, Reason.REWRITE_ALIASED)]
    for fn_, reason in cases:
        x = torch.arange(3) if fn_ is int_division else torch.tensor([1.0, 2.0, 3.0])
        fn = compiled(fn_)
        for s in range(WARM):
            t = torch.tensor([1, 2] if s % 2 else [-1, 0])  # t[1] is 0 only where eager skips x // t[1]
            want, got = fn_(x, t), fn(x, t)
            for w, g in zip(want if isinstance(want, tuple) else (want,), got if isinstance(got, tuple) else (got,)):
                assert w == g if isinstance(w, int) else torch.equal(w, g)
        _, n = syncs(fn, x, torch.tensor([-1, 0]))
        assert n >= 1, fn_.__name__
        kept = [d for d in decisions(Action.KEPT, reason) if fn_.__name__ in d.code]
        assert kept, (fn_.__name__, [(d.action, d.reason, d.code) for d in torchsync_pass.decisions()])


@torch.no_grad()
def test_identity_comparison_after_the_branch_keeps_its_sync():
    torch._dynamo.reset()
    pad = torch.zeros(3)

    def step(x, t):
        y = pad if t[0] > 0 else x
        return y + 1, y is pad

    fn = compiled(step)
    for s in range(WARM):
        t = torch.tensor([1 - 2 * (s % 2)])
        want, got = step(torch.ones(3), t), fn(torch.ones(3), t)
        assert torch.equal(want[0], got[0]) and want[1] == got[1]
    assert [d for d in decisions(Action.KEPT, Reason.BRANCH_IDENTITY) if "step" in d.code]


@pytest.mark.parametrize("probe", ["hash", "operator.contains", "__contains__"])
@torch.no_grad()
def test_identity_seen_through_hashing_or_contains_keeps_its_sync(probe):
    # a tensor hashes by identity, and list containment tries identity first: the select's copy
    # would answer differently from eager's arm
    import operator

    torch._dynamo.reset()
    pad = torch.zeros(1)  # one element: list containment's == fallback is a valid bool in eager
    look = {"hash": lambda y: hash(y) == hash(pad),
            "operator.contains": lambda y: operator.contains([pad], y),
            "__contains__": lambda y: [pad].__contains__(y)}[probe]

    def step(x, t):
        y = pad if t[0] > 0 else x * 2
        return y + 1, look(y)

    fn = compiled(step)
    for s in range(WARM):
        t = torch.tensor([1 - 2 * (s % 2)])
        want, got = step(torch.ones(1), t), fn(torch.ones(1), t)
        assert torch.equal(want[0], got[0]) and bool(want[1]) == bool(got[1])
    assert decisions(Action.KEPT, Reason.BRANCH_IDENTITY)


def test_arm_requiring_grad_keeps_its_sync():
    torch._dynamo.reset()
    model = PadOrEmbed()
    fn = compiled(model)
    for s in range(WARM):
        t = tokens_of(s)
        want, got = model(t), fn(t)
        assert_bitwise(got.detach(), want.detach())
        got.sum().backward()
    assert decisions(Action.KEPT, Reason.BRANCH_VALUES)
    assert not decisions(Action.REWRITTEN, Reason.BRANCH_WHERE)


class PadOrListRow(nn.Module):
    """An arm that reads a row of a Python list at ``t.item()`` (itself rewritten as a gather)."""

    def __init__(self, vocab=16, dim=5):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.table = [torch.randn(dim, generator=g) for _ in range(vocab)]
        self.pad_row = torch.full((dim,), -2.0)

    def forward(self, tokens):
        rows = []
        for i in range(tokens.shape[0]):
            rows.append(self.pad_row if tokens[i] == PAD else self.table[tokens[i].item()])
        return torch.stack(rows)


@torch.no_grad()
def test_arm_with_a_rewritten_index_read():
    torch._dynamo.reset()
    model = PadOrListRow()
    fn = compiled(model)
    assert run_steps(model, fn, lambda s: (tokens_of(s),)) == 0
    assert decisions(Action.REWRITTEN, Reason.BRANCH_WHERE) and decisions(Action.REWRITTEN, Reason.INDEX_LIST)
    with pytest.raises(IndexError):  # 16 taken to the list: eager's IndexError, from the gather
        fn(torch.tensor([1, PAD, 16, 2, 3, PAD]))


@pytest.mark.inductor
@torch.no_grad()
def test_per_position_branch_under_inductor_equals_stock_inductor():
    """The rows are copies (a gather, a select, a stack): stock Inductor, with its graph break and
    sync per position, gives the same bits."""
    torch._dynamo.reset()
    model = PadOrEmbed().eval()
    stock = torch.compile(model, backend="inductor")
    want = [stock(tokens_of(s)) for s in range(WARM + 1)]
    torch._dynamo.reset()  # one backend per code object at a time (each would recompile the other's)
    ours = torch.compile(model, backend="nosync")
    for s in range(WARM + 1):
        assert_bitwise(ours(tokens_of(s)), want[s])
    _, n = syncs(ours, tokens_of(50))
    assert n == 0
    assert decisions(Action.REWRITTEN, Reason.BRANCH_WHERE)


EXPLAIN_SCRIPT = """
import torch

PAD = -1
emb = torch.nn.Embedding(8, 3)
pad_row = torch.zeros(3)


@torch.no_grad()
def step(tokens):
    rows = []
    for i in range(tokens.shape[0]):
        rows.append(pad_row if tokens[i] == PAD else emb(tokens[i]))  # BRANCH
    return torch.stack(rows)


f = torch.compile(step, backend="nosync", options={"codegen": "eager"})
for s in range(8):
    f(torch.tensor([s % 8, PAD, (3 * s) % 8, PAD if s % 2 else 1]))
"""


def test_explain_marks_the_selected_branch(tmp_path, capsys):
    from test_rewrite import explain_site

    from torchsync_pass import explain

    _, row = explain_site(tmp_path, capsys, EXPLAIN_SCRIPT, "# BRANCH")
    assert row["nosync"]["action"] == "rewritten" and row["nosync"]["reason"] == "BRANCH_WHERE", row
    assert explain.main([str(tmp_path / "script.py")]) == 0
    assert "torch.where selects" in capsys.readouterr().out


@torch.no_grad()
def test_truthiness_of_ints_and_nan_and_a_returned_fresh_select():
    """``if t:`` is nonzero (NaN is true); a select of two tensors the step made may be returned."""
    torch._dynamo.reset()

    def step(x, t, f):
        a = x * 2 if t[0] else x - 1  # an int test
        b = a + 1 if f[0] else a * 3  # a float test: NaN and -0.0
        return b * 2 if t[1] > 0 else b - 1  # returned: both arms are new tensors

    fn = compiled(step)
    x = torch.tensor([1.0, -2.5, 3.0])
    floats = [float("nan"), -0.0, 0.0, 2.0, float("nan"), 0.0, -3.0]
    n = run_steps(step, fn, lambda s: (x, torch.tensor([s % 3, 1 - 2 * (s % 2)]), torch.tensor([floats[s]])), steps=6)
    assert n == 0
    assert len({d.site for d in decisions(Action.REWRITTEN, Reason.BRANCH_WHERE)}) == 3


@torch.no_grad()
def test_select_branches_false_keeps_the_sync():
    torch._dynamo.reset()
    model = PadOrEmbed().eval()
    fn = torch.compile(model, backend=NosyncBackend({"codegen": "eager", "select_branches": False}))
    assert run_steps(model, fn, lambda s: (tokens_of(s),)) == 6
    assert not decisions(Action.REWRITTEN)
    with pytest.raises(torchsync_pass.NosyncOptionsError, match="select_branches"):
        NosyncBackend({"select_branches": "no"})


# --- found by review: each case gave another result than eager before its fix ---
TABLE = torch.arange(12).reshape(4, 3)


class FrozenPad(nn.Module):
    def __init__(self):
        super().__init__()
        self.pad = nn.Parameter(torch.zeros(3), requires_grad=False)

    def forward(self, x, t):
        y = self.pad if t[0] > 0 else x * 2
        return y + 1, isinstance(y, nn.Parameter)


class _Cfg:
    pass


def _signed_zero(x, t):  # two float constants that are == but not the same value
    return x * (0.0 if t[0] > 0 else -0.0)


def _one_object_twice(x, t):  # eager returns one object under two names
    a, b = x * 2, x * 3
    if t[0] > 0:
        y = a
        w = a
    else:
        y = b
        w = b
    return y, w


def _two_selects(x, t):  # two selects of the same arms: eager's results may be one object
    a, b = x * 2, x + 1
    outs = []
    for i in range(2):
        outs.append(a if t[i] > 0 else b)
    return outs


def _test_is_an_arm(x, t):
    m = t[0] > 0
    y = m if m else x[0] > 2.5
    m.fill_(False)  # eager's y is m: it sees the write
    return y.clone()


def _identity_in_subscript(x, t):
    pad = x * 0
    rows = [pad if t[0] > 0 else x * 2]
    return rows[0] * 1, pad is rows[0]


def _identity_in_generator(x, t):
    pad = x * 0
    y = pad if t[0] > 0 else x * 2
    return y + 1, any(r is pad for r in [y])


def _identity_by_id(x, t):
    pad = x * 0
    y = pad if t[0] > 0 else x * 2
    return y + 1, id(y) == id(pad)


def _identity_by_operator(x, t):
    pad = x * 0
    y = pad if t[0] > 0 else x * 2
    return y + 1, operator.is_(y, pad)


def _identity_by_in(x, t):  # list.__contains__ tries identity first
    pad = x * 0
    rows = [pad if t[0] > 0 else x * 2]
    return rows[0] + 1, pad in rows


def _nested_if(x, t):  # Python 3.12+ lays each arm's inner `if` out on its own: no join there
    out = []
    for i in range(t.shape[0]):
        if t[i] > 0:
            y = x * 2
            if x.shape[0] > 1:
                out.append(y + 100)
                continue
        else:
            y = x - 1
            if x.shape[0] > 1:
                out.append(y - 100)
                continue
        out.append(y)
    return torch.stack(out)


def _iterator_in_arm(x, t):  # next() advances the iterator only where eager takes the arm
    it = iter(range(100))
    out = []
    for i in range(t.shape[0]):
        out.append(x * next(it) if t[i] > 0 else x - 1)
    return torch.stack(out)


def _bitwise_on_float(x, t):  # the CPU kernel has no float bitwise_or (the fake tensors let it through)
    return torch.bitwise_or(x, x) if t[0] > 0 else x * 2


def _view_arm(x, t):  # eager's y is a view (its _base is x)
    y = x[1] if t[0] > 0 else x[0] * 2
    return y * 1, y._base is None


def _embedding_weight_first(x, t):  # torch.embedding(weight, indices): the indices are masked
    return torch.embedding(TABLE, t * 2).float().sum() if t[0] > 0 else x.sum()


def _try_in_one_arm(x, t):
    if t[0] > 0:
        y = x * 2
        try:
            return y + _Cfg.scale
        except AttributeError:
            return y
    else:
        y = x * 3
        return y + _Cfg.scale


def _tensor_attribute(x, t):
    a, b = x * 2, x * 3
    a.scale, b.scale = 10.0, 20.0
    y = a if t[0] > 0 else b
    return y * y.scale


def _bool_remainder(x, t):  # remainder of bools is not implemented: raises where eager takes the arm
    m, k = x > 1, x > 2
    return torch.remainder(m, k) if t[0] > 0 else torch.logical_and(m, k)


def _int_frac(x, t):  # frac of ints is not implemented
    return torch.frac(x.long()) if t[0] > 0 else x.long() * 2


def _outcome(fn, *args):
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - the same exception type is the expected outcome
        return type(e)


def _same(a, b):
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or (a.dtype, a.shape, a.stride()) != (b.dtype, b.shape, b.stride()):
            return False
        bits = {torch.float32: torch.int32, torch.float64: torch.int64}.get(a.dtype)
        return torch.equal(a.view(bits), b.view(bits)) if bits else torch.equal(a, b)
    return a == b


@pytest.mark.parametrize("step, x, t_of, expect", [
    (_signed_zero, torch.tensor([1.0, 2.0]), None, None),
    (_one_object_twice, torch.arange(3.0), None, "aliases"),
    (_two_selects, torch.arange(3.0), lambda s: torch.tensor([[1, 1], [-1, 1], [1, -1], [-1, -1]][s % 4]), "aliases"),
    (_test_is_an_arm, torch.arange(3.0), None, None),
    (_identity_in_subscript, torch.arange(3.0), None, Reason.BRANCH_IDENTITY),
    (_identity_in_generator, torch.arange(3.0), None, Reason.BRANCH_IDENTITY),
    (_identity_by_id, torch.arange(3.0), None, Reason.BRANCH_IDENTITY),
    (_identity_by_operator, torch.arange(3.0), None, Reason.BRANCH_IDENTITY),
    (_identity_by_in, torch.tensor([3.0]), None, Reason.BRANCH_IDENTITY),  # (one element: == is one bool)
    (_nested_if, torch.arange(3.0), lambda s: torch.tensor([[1, -1], [-1, 1], [1, 1], [-1, -1]][s % 4]), None),
    (_embedding_weight_first, torch.arange(3.0), lambda s: torch.tensor([[1, 1], [-1, 7]][s % 2]), None),
    (_iterator_in_arm, torch.arange(3.0), lambda s: torch.tensor([[1, -1, 1], [-1, 1, 1]][s % 2]), None),
    (_bitwise_on_float, torch.arange(3.0), None, None),
    (_view_arm, torch.arange(6.0).reshape(2, 3), None, None),
    (_try_in_one_arm, torch.arange(3.0), None, None),
    (_tensor_attribute, torch.arange(3.0), None, None),
    (_bool_remainder, torch.arange(4.0), None, None),
    (_int_frac, torch.arange(4.0), None, None),
    (FrozenPad(), torch.arange(3.0), None, None),
], ids=lambda v: getattr(v, "__name__", type(v).__name__) if callable(v) else None)
@torch.no_grad()
def test_select_is_never_told_apart_from_eager(step, x, t_of, expect):
    """Each step, every call: the same result as eager (bits, dtype, shape, stride, the same
    exception type), and the same aliasing between results when the caller writes one of them."""
    torch._dynamo.reset()
    fn = compiled(step)
    t_of = t_of or (lambda s: torch.tensor([[1], [-1]][s % 2]))
    for s in range(8):
        t = t_of(s)
        want, got = _outcome(step, x.clone(), t.clone()), _outcome(fn, x.clone(), t.clone())
        assert _same(want, got), (s, want, got)
        if expect == "aliases":
            want[0].add_(100)
            got[0].add_(100)
            assert _same(want, got), (s, "after the caller wrote the first result", want, got)
    if isinstance(expect, Reason):  # (or never selected: torch 2.11 breaks the graph at id() itself)
        assert decisions(Action.KEPT, expect) or not decisions(Action.REWRITTEN, Reason.BRANCH_WHERE)


@torch.no_grad()
def test_an_input_written_later_may_share_the_arms_memory():
    """Compiled with separate inputs, then called with ``w`` a view of the arm ``a``: eager's ``y``
    is ``a`` and sees the write; a select's copy would not."""
    torch._dynamo.reset()

    def step(a, b, w, t):
        y = a if t[0] > 0 else b
        w.add_(1)
        return y * 1

    fn = compiled(step)
    for s in range(8):
        a, b, t = torch.arange(3.0) + s, torch.ones(3), torch.tensor([[1], [-1]][s % 2])
        w = a[:] if s >= 6 else torch.zeros(3)
        a2, b2 = a.clone(), b.clone()
        w2 = a2[:] if s >= 6 else torch.zeros(3)
        assert_bitwise(fn(a2, b2, w2, t), step(a, b, w, t))


@torch.no_grad()
def test_input_arms_are_checked_at_every_call():
    """What a copy lacks is checked when the select is traced and guarded for later calls: a Python
    attribute, or a grad, on the input arm of a later call."""
    torch._dynamo.reset()

    def step(a, b, t):  # (both arms inputs: torch 2.11-2.12 Dynamo misreads .grad of a tensor the step made)
        y = a if t[0] > 0 else b
        return y * 1, getattr(y, "scale", 1.0), y.grad is None

    fn = compiled(step)
    for s in range(10):
        a, b, t = torch.arange(3.0) + s, torch.ones(3), torch.tensor([1])
        if s == 7:
            a.scale = 3.0
        if s == 8:
            a.grad = torch.ones(3)
        t = torch.tensor([[1], [-1]][s % 2]) if s < 6 else t
        want, got = step(a, b, t), fn(a, b, t)
        assert_bitwise(got[0], want[0])
        assert got[1:] == want[1:], (s, want, got)
    assert decisions(Action.REWRITTEN, Reason.BRANCH_WHERE)


# --- `a & b` and `a | b` trace to operator.and_ / operator.or_: pure ops, not in-place writers ---
@torch.no_grad()
def test_arm_with_bitwise_operators_is_selected():
    """An arm computing ``(x & m) | 1``: both arms run, the select takes eager's bits (before, the
    trailing underscore of ``and_`` made it an in-place op: kept, BRANCH_SIDE_EFFECT)."""
    torch._dynamo.reset()

    def step(x, m, t):
        for i in range(t.shape[0]):
            x = (x & m) | 1 if t[i] > 0 else x + 2
        return x * 1

    fn = compiled(step)
    x, m = torch.arange(-4, 8), torch.tensor(6)
    n = run_steps(step, fn, lambda s: (x, m, torch.randint(-3, 3, (3,), generator=torch.Generator().manual_seed(s))))
    assert n == 0
    assert not decisions(Action.KEPT), [(d.reason, d.detail) for d in decisions(Action.KEPT)]
    assert decisions(Action.REWRITTEN, Reason.BRANCH_WHERE)


@torch.no_grad()
def test_cone_with_bitwise_operators_is_hoisted():
    """``if (flags & mask).any():`` is a pure cone (before: rejected, "in-place op and_")."""
    torch._dynamo.reset()

    def step(x, flags, mask):
        if ((flags & mask) | (flags & 0)).any():
            return x * 2
        return x - 1

    fn = compiled(step)
    flags, mask = torch.tensor([1, 2, 4]), torch.tensor([3, 0, 0])
    for m in (mask, mask, torch.zeros(3, dtype=torch.int64)):
        assert_bitwise(fn(torch.ones(3), flags, m), step(torch.ones(3), flags, m))
    got = [(d.action, d.reason, d.value) for d in torchsync_pass.decisions()]
    assert got == [(Action.HOISTED, Reason.INVARIANT_CONE, "True"), (Action.HOISTED, Reason.INVARIANT_CONE, "False")], got


def _arm_and_assign(y, m):
    y &= m
    return y


@pytest.mark.parametrize("write", [
    _arm_and_assign,
    lambda y, m: y.bitwise_and_(m),
    lambda y, m: torch.Tensor.add_(y, m),
], ids=["iand", "bitwise_and_", "Tensor.add_"])
@torch.no_grad()
def test_arm_with_a_real_in_place_op_keeps_its_sync(write):
    torch._dynamo.reset()

    def step(x, m, t):
        y = x * 1
        z = write(y, m) if t[0] > 0 else y
        return z + 1, y + 0

    fn = compiled(step)
    x, m = torch.arange(6), torch.tensor(3)
    for s in range(WARM):
        t = torch.tensor([1 - 2 * (s % 2)])
        for got, want in zip(fn(x, m, t), step(x, m, t)):
            assert_bitwise(got, want)
    kept = decisions(Action.KEPT, Reason.BRANCH_SIDE_EFFECT)
    assert kept and "in-place op" in kept[0].detail, [(d.reason, d.detail) for d in torchsync_pass.decisions()]
    assert not decisions(Action.REWRITTEN, Reason.BRANCH_WHERE)


def test_written_nodes_of_operator_functions():
    """Functions of ``operator`` write only when in-place (``iand``...), whatever their name."""
    from torchsync_pass import cone

    g = torch.fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    pure = [g.call_function(f, (a, b)) for f in (operator.and_, operator.or_, operator.is_, operator.xor)]
    pure.append(g.call_function(operator.not_, (a,)))
    writers = [g.call_function(operator.iand, (a, b)), g.call_function(operator.ior, (a, b)),
               g.call_method("bitwise_and_", (a, b)), g.call_function(torch.Tensor.add_, (a, b))]
    assert {n.name: cone.written_nodes(n) for n in pure} == {n.name: [] for n in pure}
    assert {n.name: cone.written_nodes(n) for n in writers} == {n.name: [a] for n in writers}


def _shapes_differ(x, t):
    y = x[:2] if t[0] > 0 else x  # refused once both arms are traced (then the trace restarts)
    return y * 2


def _with_in_arm(x, t):
    if t[0] > 0:  # refused before an arm is traced
        with torch.no_grad():
            x = x * 2
    return x + 1


@pytest.mark.parametrize("fn_,reason,detail", [
    (_shapes_differ, Reason.BRANCH_VALUES, "stack item 0 differs in shape, dtype or device between the arms"),
    (_with_in_arm, Reason.BRANCH_FORM, "an arm has a "),  # a BEFORE_WITH instruction on 3.11-3.13
], ids=["after-tracing-the-arms", "before-tracing-the-arms"])
def test_fullgraph_refused_select_names_the_reason(fn_, reason, detail):
    """Under fullgraph=True, a branch that is neither hoisted nor selected raises Unsupported naming
    the site and why the select was refused, as for any other sync nosync leaves in place."""
    torch._dynamo.reset()
    fn = torch.compile(fn_, backend=NosyncBackend({"codegen": "eager"}), fullgraph=True)
    x = torch.tensor([1.0, 2.0, 3.0])
    assert_bitwise(fn(x, torch.tensor([-1])), fn_(x, torch.tensor([-1])))  # hoisted: speculated invariant
    with pytest.raises(torch._dynamo.exc.Unsupported) as info:
        fn(x, torch.tensor([1]))  # a new value: demoted, then the select is tried and refused
    msg = str(info.value)
    line = fn_.__code__.co_firstlineno + 1
    source = linecache.getline(__file__, line).strip()
    assert f"{__file__}:{line}: {source}" in msg, msg
    assert f"not selected on the device: {reason.name}: {reason.value} ({detail}" in msg, msg
    assert [d for d in decisions(Action.KEPT, reason) if d.site.line == line]

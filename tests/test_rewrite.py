"""Device-side rewrites (issue 13, part 1): a step-varying host read used only as an index.

``table[t.item()]`` / ``table[int(t)]`` with a tensor table or a Python list of same-shape tensors
is traced as a device gather: no host read, no graph break, and every call bitwise equal to eager
(``codegen="eager"``). Reads used otherwise keep their sync and say why. Each call is compared
with eager on its own copy of the state; syncs are counted with ``count_syncs()``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import torchsync_pass
from torchsync_pass import Action, NosyncBackend, Reason, dynamo_hooks


def assert_bitwise(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride(), (a.shape, b.shape)
    assert torch.equal(a, b), (a - b).abs().max()


def compiled(fn):
    backend = NosyncBackend({"codegen": "eager"})
    return torch.compile(fn, backend=backend), backend


def syncs(fn, *args):
    with torchsync_pass.count_syncs(stacks=False) as c:
        out = fn(*args)
    return out, c.total


def decisions(action):
    return [d for d in torchsync_pass.decisions() if d.action is action]


class TensorTable(nn.Module):
    def __init__(self, n=16, dim=6):
        super().__init__()
        self.emb = nn.Embedding(n, dim)

    def forward(self, tokens):
        rows = []
        for i in range(tokens.shape[0]):
            rows.append(self.emb.weight[tokens[i].item()])  # index into a tensor
        return torch.stack(rows) * 2


class ListTable(nn.Module):
    def __init__(self, n=16, dim=6, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.table = [torch.randn(dim, generator=g) for _ in range(n)]

    def forward(self, tokens):
        rows = []
        for i in range(tokens.shape[0]):
            rows.append(self.table[tokens[i].item()])  # index into a Python list of tensors
        return torch.stack(rows) + 1


class IntListTable(ListTable):
    def forward(self, tokens):
        rows = []
        for i in range(tokens.shape[0]):
            rows.append(self.table[int(tokens[i])])  # the same, spelled int()
        return torch.stack(rows) + 1


INT_REWRITE = pytest.mark.skipif(
    not dynamo_hooks.int_reads_rewritable(),
    reason=f"torch {torch.__version__}: int(t) is traced as Dynamo's own t.item() (2.11) or its result "
    "must be a Python int (2.14+): only t.item() reads are rewritten",
)


def _check_steps(model, make_tokens, steps=5):
    step, backend = compiled(model)
    with torch.no_grad():
        for s in range(steps):
            tokens = make_tokens(s)
            got, n = syncs(step, tokens)
            assert_bitwise(got, model(tokens))
            assert n == 0, f"step {s}: {n} host syncs"
    assert len(backend.compiled) == 1  # one graph, no break, no recompile
    return backend


def _gathers(backend):
    (entry,) = backend.compiled
    return [n for n in entry["graph"].graph.nodes if n.target is torch.ops.aten.index.Tensor]


def test_tensor_table_is_gathered_on_the_device():
    torch.manual_seed(0)
    model = TensorTable().eval()
    backend = _check_steps(model, lambda s: torch.randint(16, (5,), generator=torch.Generator().manual_seed(s)))
    (d,) = decisions(Action.REWRITTEN)
    assert d.reason is Reason.INDEX_TENSOR and d.kind == "item" and "self.emb.weight" in d.detail
    assert counters["nosync"]["rewritten"] == 1 and counters["nosync"]["hoisted"] == 0
    # the 5 rows the loop stacks are gathered by one op over the whole span of tokens
    (gather,) = _gathers(backend)
    assert tuple(gather.args[1][0].meta["example_value"].shape) == (5,)
    with torch.no_grad(), pytest.raises(IndexError):  # an id out of range in the span still raises
        compiled(model)[0](torch.tensor([1, 2, 16, 0, 3]))


@pytest.mark.parametrize("dim", [6, 4096])
def test_list_table_is_stacked_and_gathered(dim):
    model = ListTable(dim=dim).eval()
    _check_steps(model, lambda s: torch.randint(16, (5,), generator=torch.Generator().manual_seed(s)))
    (d,) = decisions(Action.REWRITTEN)
    assert d.reason is Reason.INDEX_LIST and d.kind == "item" and "5 read(s)" in d.detail
    if dim == 4096:  # 16 KiB rows: the stacked list is computed once per request, then read from the memo
        assert counters["nosync"]["invariant_computes"] == 1 and counters["nosync"]["invariant_hits"] == 4
    else:  # small rows: stacked at every step (cheaper than checking every tensor)
        assert counters["nosync"]["invariant_computes"] == 0


@INT_REWRITE
def test_int_read_is_rewritten_too():
    model = IntListTable().eval()
    _check_steps(model, lambda s: torch.randint(16, (5,), generator=torch.Generator().manual_seed(s)))
    (d,) = decisions(Action.REWRITTEN)
    assert d.reason is Reason.INDEX_LIST and d.kind == "int"


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8])
def test_negative_and_narrow_dtype_indices_match_eager(dtype):
    w = torch.randn(10, 3)

    def f(w, t):
        return w[t.item()] * 1.5

    step, _ = compiled(f)
    for v in ([-1, -10, 0, 9, 4] if dtype is not torch.uint8 else [0, 9, 4]):
        t = torch.tensor(v, dtype=dtype)
        got, n = syncs(step, w, t)
        assert_bitwise(got, f(w, t))
        assert n == 0


@pytest.mark.parametrize("form", ["tensor", "list"])
@pytest.mark.parametrize("bad", [10, -11])
def test_out_of_range_index_raises_index_error(form, bad):
    w = torch.randn(10, 3)
    table = w if form == "tensor" else list(w.unbind(0))

    def f(t):
        return table[t.item()] + 0

    step, _ = compiled(f)
    assert_bitwise(step(torch.tensor(3)), f(torch.tensor(3)))
    with pytest.raises(IndexError):
        f(torch.tensor(bad))  # eager
    with pytest.raises(IndexError):
        step(torch.tensor(bad))
    assert decisions(Action.REWRITTEN)


def test_read_used_as_a_shape_keeps_its_sync_and_says_why():
    def f(x, n):
        return torch.zeros(n.item()) + x.sum()

    step, backend = compiled(f)
    x = torch.ones(3)
    counts = []
    for v in (2, 3, 4, 5, 6, 7):  # new every call: speculated, then demoted, then kept
        n = torch.tensor(v)
        (got, k), (want, k_eager) = syncs(step, x, n), syncs(f, x, n)
        assert_bitwise(got, want)
        counts.append(k)
    assert counts[-1] >= 1  # the sync stays
    kept = decisions(Action.KEPT)
    assert kept and all(d.reason is Reason.REWRITE_OTHER_USE for d in kept)
    assert "passed to a call" in kept[0].detail
    assert not decisions(Action.REWRITTEN)


def test_strided_rows_and_dict_tables_keep_their_sync():
    # eager's row of a transposed table is a strided view: a gathered (contiguous) copy would
    # differ in stride; a dict is not a table of rows
    w = torch.randn(3, 10).t()
    d = {i: torch.randn(2) for i in range(10)}

    def f(t):
        return w[t.item()], d[t.item()] * 1

    step, _ = compiled(f)
    for v in (1, 2, 3, 4, 5, 6):
        t = torch.tensor(v)
        for got, want in zip(step(t), f(t)):
            assert_bitwise(got, want)
    kept = {d.detail for d in decisions(Action.KEPT) if d.reason is Reason.REWRITE_TABLE}
    assert any("not contiguous" in k for k in kept) and any("is a dict" in k for k in kept), kept
    assert not decisions(Action.REWRITTEN)


def test_row_written_in_place_keeps_its_sync():
    # eager's row is a view of the table: writing it writes the table; a gathered copy would not
    def f(w, t):
        row = w[t.item()]
        row.mul_(2)
        return w.sum(0)

    step, _ = compiled(f)
    w1, w2 = torch.randn(6, 4), None
    w2 = w1.clone()
    for v in (1, 4, 1):
        t = torch.tensor(v)
        assert_bitwise(step(w1, t), f(w2, t))
        assert_bitwise(w1, w2)
    (d, *_) = decisions(Action.KEPT)
    assert d.reason is Reason.REWRITE_ALIASED and "written in place" in d.detail
    assert not decisions(Action.REWRITTEN)


def test_list_written_between_two_reads_keeps_its_sync():
    # both reads would share one stack of the list, taken before the write: the second read must
    # see the written tensor, as eager does
    def f(table, a, b):
        r0 = table[a.item()] * 1
        table[2].add_(10.0)
        return r0 + table[b.item()]

    step, _ = compiled(f)
    t1 = [torch.randn(3) for _ in range(4)]
    t2 = [x.clone() for x in t1]
    for a, b in ((0, 2), (1, 2), (3, 2)):
        a_, b_ = torch.tensor(a), torch.tensor(b)
        assert_bitwise(step(t1, a_, b_), f(t2, a_, b_))
    kept = decisions(Action.KEPT)
    assert kept and all(d.reason is Reason.REWRITE_ALIASED for d in kept), kept
    assert "after its stack" in kept[0].detail


def test_returned_row_keeps_its_sync():
    table = [torch.randn(3) for _ in range(4)]

    def f(t):
        return table[t.item()]  # eager returns the list's own tensor

    step, _ = compiled(f)
    for v in (0, 2):
        out = step(torch.tensor(v))
        assert out is table[v]
    assert decisions(Action.KEPT)[0].reason is Reason.REWRITE_ALIASED


@pytest.mark.parametrize("dim", [4, 4096])  # stacked every step / cached once per request
def test_list_table_mutated_between_calls_gives_the_new_answer(dim):
    model = ListTable(n=8, dim=dim).eval()
    ref = copy.deepcopy(model)
    step, _ = compiled(model)
    calls = iter(range(100))

    def check(high=8):
        # new tokens at every call (step-varying), always including the entries changed below
        k = next(calls)
        tokens = torch.tensor([3, 0, (k * 5) % high, high - 1])
        got, n = syncs(step, tokens)
        assert_bitwise(got, ref(tokens))
        assert n == 0

    with torch.no_grad():
        check()
        check()
        for m in (model, ref):  # an element replaced by a new tensor
            m.table[3] = torch.full((dim,), 5.0)
        check()
        for m in (model, ref):  # an element written in place
            m.table[0].add_(1.0)
        check()
        for m in (model, ref):  # the list appended to, and read at the new entry
            m.table.append(torch.full((dim,), -2.0))
        check(high=9)
        check(high=9)


def test_interleaved_requests_hit_their_own_stacked_tables():
    a, b = ListTable(dim=4096, seed=1).eval(), ListTable(dim=4096, seed=2).eval()

    def f(m, tokens):
        return m(tokens)

    step, backend = compiled(f)
    with torch.no_grad():
        for s in range(6):
            m = a if s % 2 == 0 else b
            tokens = torch.randint(16, (5,), generator=torch.Generator().manual_seed(s))
            got, n = syncs(step, m, tokens)
            assert_bitwise(got, m(tokens))
            assert n == 0
    # each request's list is stacked once (the memo is an LRU over requests)
    assert counters["nosync"]["invariant_computes"] == 2


@pytest.mark.inductor
def test_prefill_inductor_equals_stock_inductor_on_the_hand_vectorized_step():
    import prefill_tokens as P

    model, vec = P.make_model(), P.make_vectorized_model()
    nosync = torch.compile(model, backend="nosync")  # codegen="inductor"
    stock = torch.compile(vec, backend="inductor")
    request = P.make_request(seed=2)
    tokens, chunk = request["tokens"], request["chunk"]
    s1 = s2 = request["state"]
    with torch.no_grad():
        for i in range(4):
            t = tokens[i * chunk : (i + 1) * chunk]
            (h1, s1), n = syncs(nosync, t, s1)
            h2, s2 = stock(t, s2)
            assert_bitwise(h1, h2)
            assert_bitwise(s1, s2)
            assert n == 0
    assert decisions(Action.REWRITTEN)


EXPLAIN_SCRIPT = """
import torch

table = [torch.full((3,), float(k)) for k in range(10)]


def step(tokens):
    rows = []
    for i in range(tokens.shape[0]):
        rows.append(table[tokens[i].item()])  # READ
    return torch.stack(rows)


f = torch.compile(step, backend="nosync", options={"codegen": "eager"})
for s in range(3):
    f(torch.tensor([s, s + 1, 9 - s]))
"""


def explain_site(tmp_path, capsys, text: str, marker: str) -> tuple[dict, dict]:
    """Run explain --json on ``text`` saved as a script: (the report, the row of the line marked)."""
    import json

    from torchsync_pass import explain

    script = tmp_path / "script.py"
    script.write_text(text)
    line = next(i for i, t in enumerate(text.splitlines(), 1) if marker in t)
    assert explain.main(["--json", str(script)]) == 0
    rep = json.loads(capsys.readouterr().out)
    (row,) = [s for s in rep["sites"] if s["line"] == line]
    return rep, row


def test_explain_marks_the_rewritten_site(tmp_path, capsys):
    from torchsync_pass import explain

    rep, row = explain_site(tmp_path, capsys, EXPLAIN_SCRIPT, "# READ")
    script = tmp_path / "script.py"
    assert row["nosync"]["action"] == "rewritten" and row["nosync"]["reason"] == "INDEX_LIST"
    assert row["count"] == 0 and rep["totals"]["syncs"] == 0
    assert explain.main([str(script)]) == 0
    text = capsys.readouterr().out
    assert "[nosync: rewritten" in text and "used only as an index into a Python list" in text


# --- autograd and the gather of a span (found by review: each failed before its fix) ---


def _params(n=5, dim=4):
    g = torch.Generator().manual_seed(0)
    return [nn.Parameter(torch.randn(dim, generator=g)) for _ in range(n)]


def test_rows_autograd_records_keep_their_sync():
    """With grad on, a gathered row would have other gradients than eager's row: a list's stack
    hands zeros to parameters the step never read (an optimizer with weight decay then moves them),
    and a saved copy misses an in-place write that eager's saved view reports. Kept, as stock."""
    x = torch.randn(4, generator=torch.Generator().manual_seed(1))

    def step(ps, t, x):
        return (ps[t.item()] * x).sum()

    for leaves in (False, True):  # nn.Parameters (not gathered: not plain tensors), plain leaves
        torch._dynamo.reset()
        torchsync_pass.reset()
        f = torch.compile(step, backend=NosyncBackend({"codegen": "eager"}))
        ps, ref = _params(), _params()
        if leaves:
            ps, ref = ([p.detach().requires_grad_() for p in l] for l in (ps, ref))
        for k in (2, 3, 2):
            f(ps, torch.tensor(k), x).backward()
            step(ref, torch.tensor(k), x).backward()
        for p, r in zip(ps, ref):
            assert (p.grad is None) == (r.grad is None)
            if r.grad is not None:
                assert_bitwise(p.grad, r.grad)
        kept = [d.detail for d in decisions(Action.KEPT)]
        assert kept and not decisions(Action.REWRITTEN)
        assert "autograd records this graph" in kept[0] if leaves else "is a Parameter" in kept[0]

    W = torch.randn(6, 4)
    xg = x.clone().requires_grad_()

    def saved(W, t, x):
        return (W[t.item()] * x).sum()

    out = torch.compile(saved, backend=NosyncBackend({"codegen": "eager"}))(W, torch.tensor(1), xg)
    W.add_(1)  # eager's saved row is a view of W: backward must notice the write
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward()


def test_list_with_a_tensor_that_requires_grad_keeps_its_sync():
    """Under no_grad eager's row of a list is the tensor itself (it requires grad); a stacked copy
    does not: the graph that uses it inside enable_grad would lose the gradient."""
    x = torch.randn(4)

    def step(ps, t, x):
        with torch.no_grad():
            r = ps[t.item()]
        return (r * x).sum()

    f = torch.compile(step, backend=NosyncBackend({"codegen": "eager"}))
    ps = _params()
    out = f(ps, torch.tensor(3), x)
    assert out.requires_grad and out.requires_grad == step(ps, torch.tensor(3), x).requires_grad
    assert not decisions(Action.REWRITTEN)


def test_span_is_not_gathered_across_a_write():
    """fuse_gathers reads the whole span where the stack stands: a write between the first read
    and the stack (the token tensor itself, or any side effect before an out-of-range row) keeps the
    single-row gathers, which read each token when eager does."""
    W = torch.arange(40.0).view(10, 4)

    def consume(tokens, counter):
        rows = []
        for i in range(tokens.shape[0]):
            rows.append(W[tokens[i].item()])
            tokens[i] = 0  # mark position i consumed
            counter.add_(1)
        return torch.stack(rows)

    f, _ = compiled(consume)
    tokens, counter = torch.tensor([3, 5, 7, 9]), torch.zeros(())
    got = f(tokens.clone(), counter)
    assert_bitwise(got, consume(tokens.clone(), torch.zeros(())))
    assert decisions(Action.REWRITTEN)
    bad, c_eager, c_nosync = torch.tensor([3, 70, 7, 9]), torch.zeros(()), torch.zeros(())
    with pytest.raises(IndexError):
        consume(bad.clone(), c_eager)
    with pytest.raises(IndexError):
        f(bad.clone(), c_nosync)
    assert c_nosync.item() == c_eager.item() == 1.0

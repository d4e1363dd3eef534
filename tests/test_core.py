"""The nosync backend on the eager codegen: hoisting, guards, demotion, recompile budget.

Every test compares with eager bitwise (torch.equal plus dtype/shape/stride): codegen="eager" runs
the FX graph itself, so any difference is a wrong hoisted value.
"""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

import torchsync_pass
from torchsync_pass import Action, Reason, NosyncBackend
from diffusion_loop import TEXT, denoise, make_model, make_request


def local_scalar_dense(fn, *args, **kwargs):
    """(result, number of aten::_local_scalar_dense calls) measured with the profiler."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = fn(*args, **kwargs)
    n = sum(e.count for e in prof.key_averages() if e.key == "aten::_local_scalar_dense")
    return out, n


def assert_bitwise(a, b):
    if isinstance(a, (tuple, list)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_bitwise(x, y)
        return
    if not isinstance(a, torch.Tensor):
        assert type(a) is type(b) and a == b, (a, b)
        return
    assert isinstance(b, torch.Tensor)
    assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
    assert torch.equal(a, b), (a - b).abs().max()


def graph_breaks() -> int:
    return sum(counters["graph_break"].values())


class Compiled:
    """A function compiled with nosync (eager codegen) that keeps count of graphs it compiled."""

    def __init__(self, fn, **options):
        options.setdefault("codegen", "eager")
        self.backend = NosyncBackend(options)
        self.fn = torch.compile(fn, backend=self.backend)

    def __call__(self, *args):
        return self.fn(*args)

    @property
    def graphs(self) -> int:
        return len(self.backend.compiled)


def decisions_by_action(action):
    return [d for d in torchsync_pass.decisions() if d.action is action]


# --------------------------------------------------------------------------------------------
# The example loop
# --------------------------------------------------------------------------------------------
def test_example_loop_one_graph_no_sync_bitwise():
    model = make_model("tiny")
    req = make_request("tiny")
    step = Compiled(model)
    with torch.no_grad():
        x = req["x"]
        for i in range(6):
            t = torch.tensor(1.0 - i / 6)
            args = (x, t, req["token_types"], req["guidance_scale"], req["grid_hw"])
            want = model(*args)
            got, syncs = local_scalar_dense(step, *args)
            assert_bitwise(want, got)
            if i >= 1:  # steady state: every hoisted value comes from the memo
                assert syncs == 0, f"step {i}: {syncs} syncs"
            x = x - 0.1 * got
    assert step.graphs == 1
    assert graph_breaks() == 0
    hoisted = decisions_by_action(Action.HOISTED)
    assert sorted(d.kind for d in hoisted) == ["bool", "int", "item", "item", "tolist"]
    assert counters["nosync"]["hoisted"] == 5
    assert counters["nosync"]["guard_syncs"] == 0  # the trace-time value sits in the memo


def test_stock_eager_loop_has_the_syncs_nosync_removed():
    """Control: the same step under stock Dynamo syncs at every step and breaks the graph.

    Four of its five syncs reach aten::_local_scalar_dense; `.tolist()` on a CPU tensor
    dispatches no aten op, so the profiler does not see it.
    """
    model = make_model("tiny")
    req = make_request("tiny")
    step = torch.compile(model, backend="eager")
    args = (req["x"], torch.tensor(0.5), req["token_types"], req["guidance_scale"], req["grid_hw"])
    with torch.no_grad():
        step(*args)
        _, syncs = local_scalar_dense(step, *args)
    assert syncs == 4
    assert graph_breaks() >= 4


def test_new_request_costs_one_recompile_and_old_value_none():
    model = make_model("tiny")
    step = Compiled(model)
    a = make_request("tiny", seed=0, guidance=4.0)
    b = make_request("tiny", seed=1, guidance=1.0)  # CFG off: a different branch
    with torch.no_grad():
        for req in (a, b, a, b):
            want = denoise(model, req, 3)
            got = denoise(step, req, 3)
            assert_bitwise(want, got)
    assert step.graphs == 2
    assert counters["nosync"]["recompiles"] == 1


# --------------------------------------------------------------------------------------------
# Guard cases
# --------------------------------------------------------------------------------------------
def flag_step(x, flag):
    if flag.any():
        return x * 2
    return x - 1


def test_new_object_same_value_no_recompile():
    step = Compiled(flag_step)
    x = torch.arange(4.0)
    step(x, torch.tensor([False, True]))
    out, syncs = local_scalar_dense(step, x, torch.tensor([True, False]))
    assert_bitwise(out, flag_step(x, torch.tensor([True, False])))
    assert syncs == 1  # the guard re-runs the cone once for the new object
    assert step.graphs == 1
    assert counters["nosync"]["guard_syncs"] == 1


@pytest.mark.parametrize(
    "write",
    [
        pytest.param(lambda f: f.fill_(False), id="fill_"),
        pytest.param(lambda f: f.__setitem__(1, False), id="single-element"),
        pytest.param(lambda f: f.view(2, 1)[1].fill_(False), id="through-view"),
    ],
)
def test_in_place_write_is_seen(write):
    step = Compiled(flag_step)
    x = torch.arange(4.0)
    flag = torch.tensor([False, True])
    assert_bitwise(step(x, flag), x * 2)
    assert_bitwise(step(x, flag), x * 2)
    write(flag)
    assert_bitwise(step(x, flag), x - 1)
    assert_bitwise(step(x, flag), x - 1)
    assert step.graphs == 2
    assert counters["nosync"]["recompiles"] == 1


@pytest.mark.parametrize(
    "swap",
    [
        pytest.param(lambda base: base[:1], id="shape"),
        pytest.param(lambda base: base.as_strided((2,), (2,)), id="stride"),
    ],
)
@pytest.mark.parametrize("in_cpp", [True, False], ids=["TensorGuards", "python"])
def test_metadata_swapped_behind_the_version_counter_is_seen(swap, in_cpp, monkeypatch):
    """``t.data = other`` keeps the object, its ``_version`` and (here) its data pointer: only the
    shape or strides tell the guard's fast path that the hoisted answer is stale. Dynamo's own
    tensor guards would see it too, so they are dropped (a serving engine's filter that keeps
    nosync's guard). Both ways of checking metadata: one C++ call, and Python (a torch without
    TensorGuards)."""
    if not in_cpp:
        from torchsync_pass import _torch_private

        monkeypatch.setattr(_torch_private, "tensor_match", lambda tensors: None)
    drop_all = lambda entries: [False] * len(entries)  # noqa: E731
    step = torch.compile(flag_step, backend="nosync", options={
        "codegen": "eager", "guard_filter_fn": torchsync_pass.keep_nosync_guards(drop_all)})
    x = torch.arange(4.0)
    base = torch.tensor([False, True, False, False])
    flag = base[:2]
    for _ in range(3):
        assert_bitwise(step(x, flag), x * 2)
    before = (flag.data_ptr(), flag._version)
    flag.data = swap(base)
    assert (flag.data_ptr(), flag._version) == before and not flag.any()
    assert_bitwise(step(x, flag), x - 1)
    assert_bitwise(step(x, flag), x - 1)




def sign_step(x, r):
    if (r.real.sum() + r.imag.sum() if r.is_complex() else r.sum()) > 0:
        return x * 2
    return x - 1


@pytest.mark.parametrize("bit", ["conj", "neg"])
@pytest.mark.parametrize("in_cpp", [True, False], ids=["TensorGuards", "python"])
def test_conj_or_neg_bit_swapped_behind_the_version_counter_is_seen(bit, in_cpp, monkeypatch):
    """``t.data = c.conj()`` (or the negative-bit view ``c.conj().imag``) keeps the object, its
    ``_version``, data pointer, shape, stride and dtype: only the dispatch keys differ. The fast
    path sees them and falls back to the memo, whose fingerprint must see them too (it did not:
    the stale hoisted answer was served), with Dynamo's guards kept and with them dropped."""
    if not in_cpp:
        from torchsync_pass import _torch_private

        monkeypatch.setattr(_torch_private, "tensor_match", lambda tensors: None)
    drop_all = lambda entries: [False] * len(entries)  # noqa: E731
    for options in ({"codegen": "eager"},
                    {"codegen": "eager", "guard_filter_fn": torchsync_pass.keep_nosync_guards(drop_all)}):
        torch._dynamo.reset()
        step = torch.compile(sign_step, backend="nosync", options=options)
        x = torch.arange(4.0)
        c = torch.tensor([1 + 2j, 0 + 1j], dtype=torch.complex64)
        r = c if bit == "conj" else c.imag  # 1 + 3 > 0, 3 > 0
        for _ in range(3):
            assert_bitwise(step(x, r), x * 2)
        before = (r._version, r.data_ptr(), r.shape, r.stride(), r.dtype)
        r.data = c.conj() if bit == "conj" else c.conj().imag  # 1 - 3 < 0, -3 < 0
        assert (r._version, r.data_ptr(), r.shape, r.stride(), r.dtype) == before
        assert_bitwise(sign_step(x, r), x - 1)
        assert_bitwise(step(x, r), x - 1)
        assert_bitwise(step(x, r), x - 1)


def test_tensor_guards_self_test_passes_under_a_float64_default():
    """The C++ fast path's self-test runs once per process, at the first use, under whatever
    default dtype is current: its test tensors were built with the default dtype, so under float64
    ``a.double()`` was not a different dtype, the self-test failed and the fast path stayed off
    for the whole process."""
    from torchsync_pass import _torch_private

    try:
        torch.set_default_dtype(torch.float64)
        works = _torch_private._tensor_match_works()
    finally:
        torch.set_default_dtype(torch.float32)
    assert works


def zeroes_then_branches(x, flag, y):
    x.zero_()
    if flag.any():
        return y * 2
    return y - 1


def test_argument_aliasing_a_hoisted_leaf_written_before_the_sync():
    """An argument the frame writes in place is, on one call, a view of the hoisted leaf (not at
    trace time). The guard computed the hoisted value before the frame ran, eager reads the leaf
    after the write: the guard must fail for such a call (a recompile, whose trace sees the
    aliasing and does not hoist)."""
    step = torch.compile(zeroes_then_branches, backend="nosync", options={"codegen": "eager"})
    y = torch.arange(4.0)
    flag, ref = torch.tensor([True, True]), torch.tensor([True, True])
    for _ in range(3):
        assert_bitwise(step(torch.ones(2, dtype=torch.bool), flag, y), y * 2)
    assert_bitwise(step(flag[:], flag, y), zeroes_then_branches(ref[:], ref, y))  # y - 1
    assert_bitwise(flag, ref)
    for value in (True, False, True):
        flag.fill_(value)
        assert_bitwise(step(torch.ones(2, dtype=torch.bool), flag, y), y * 2 if value else y - 1)
        assert_bitwise(step(flag[:], flag, y), y - 1)

def test_same_value_copy_no_recompile():
    step = Compiled(flag_step)
    x = torch.arange(4.0)
    flag = torch.tensor([False, True])
    step(x, flag)
    flag.copy_(torch.tensor([True, False]))  # new version, same answer
    out, syncs = local_scalar_dense(step, x, flag)
    assert_bitwise(out, x * 2)
    assert syncs == 1 and step.graphs == 1


def test_value_flip_and_flip_back_recompile_counts():
    step = Compiled(flag_step)
    x = torch.arange(4.0)
    on, off = torch.tensor([True]), torch.tensor([False])
    for _ in range(3):
        step(x, on)
    assert step.graphs == 1
    for _ in range(3):
        assert_bitwise(step(x, off), x - 1)
    assert step.graphs == 2
    for flag, want in ((on, x * 2), (off, x - 1), (on, x * 2)):
        assert_bitwise(step(x, flag), want)
    assert step.graphs == 2
    assert counters["nosync"]["recompiles"] == 1


def test_interleaved_requests_do_not_resync():
    step = Compiled(flag_step)
    x = torch.arange(4.0)
    a, b = torch.tensor([True]), torch.tensor([False])
    step(x, a)
    step(x, a)
    step(x, b)  # second request: one guard sync + one recompile
    step(x, b)
    total = 0
    for _ in range(5):  # A, B, A, B ...
        for flag, want in ((a, x * 2), (b, x - 1)):
            out, syncs = local_scalar_dense(step, x, flag)
            assert_bitwise(out, want)
            total += syncs
    assert total == 0
    assert step.graphs == 2


def test_inference_tensor_undeclared_is_rejected_and_correct():
    step = Compiled(flag_step)
    x = torch.arange(4.0)
    with torch.inference_mode():
        flag = torch.tensor([True])
    with torch.inference_mode():
        assert_bitwise(step(x, flag), x * 2)
    rejected = decisions_by_action(Action.REJECTED)
    assert rejected and rejected[0].reason is Reason.INFERENCE_TENSOR
    assert not decisions_by_action(Action.HOISTED)


def test_inference_tensor_declared_is_hoisted_identity_only():
    step = Compiled(flag_step, invariant=["flag"])
    x = torch.arange(4.0)
    with torch.inference_mode():
        flag = torch.tensor([True])
        other = torch.tensor([False])
        for _ in range(3):
            out, syncs = local_scalar_dense(step, x, flag)
            assert_bitwise(out, x * 2)
        assert syncs == 0
        assert_bitwise(step(x, other), x - 1)  # a different object is seen
    assert decisions_by_action(Action.HOISTED)[0].reason is Reason.INVARIANT_CONE
    assert step.graphs == 2


class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("mask", torch.tensor([True, False, True]))
        self.inner = Inner()

    def forward(self, x):
        if self.mask.all():
            x = x + 1
        return self.inner(x)


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.tensor(3.0))

    def forward(self, x):
        return x * self.scale.item()  # sync inside a submodule's forward


def test_replaced_module_buffer_and_submodule_sync():
    m = Masked()
    step = Compiled(m)
    x = torch.arange(3.0)
    assert_bitwise(step(x), m(x))
    _, syncs = local_scalar_dense(step, x)
    assert syncs == 0
    hoisted = decisions_by_action(Action.HOISTED)
    assert {d.kind for d in hoisted} == {"bool", "item"}
    inner_site = [d for d in hoisted if d.kind == "item"][0]
    assert "self.scale.item()" in inner_site.source
    m.mask = torch.tensor([True, True, True])  # replaced buffer: new object, new value
    assert_bitwise(step(x), m(x))
    m.inner.scale = torch.tensor(5.0)
    assert_bitwise(step(x), m(x))
    assert step.graphs == 3


def scaled(x, t):
    return x * t.item()


def test_guard_hits_still_counted_after_counters_clear():
    # a user (or a benchmark) clears torch._dynamo.utils.counters between phases; the guard's fast
    # path must count into the live counters, not into the one it saw when it was built
    f = torch.compile(scaled, backend="nosync", options={"codegen": "eager"})
    x, t = torch.arange(3.0), torch.tensor(2.0)
    for _ in range(3):
        f(x, t)
    counters.clear()
    for _ in range(5):
        assert_bitwise(f(x, t), scaled(x, t))
    assert counters["nosync"]["guard_hits"] == 5


def test_step_varying_item_is_demoted_with_bounded_compiles():
    x = torch.arange(3.0)
    ts = [torch.tensor(float(i)) for i in range(8)]
    stock = CompileCounterWithBackend("eager")
    compiled = torch.compile(scaled, backend=stock)
    for t in ts:
        compiled(x, t)
    stock_graphs = stock.frame_count
    torch._dynamo.reset()

    step = Compiled(scaled)
    for i in range(8):
        t = torch.tensor(float(i))  # a new timestep tensor every step; the old one is dropped
        assert_bitwise(step(x, t), scaled(x, t))
    demoted = decisions_by_action(Action.DEMOTED)
    assert len(demoted) == 1 and demoted[0].reason is Reason.LEAVES_CHANGE
    # one speculative graph, then exactly the stock graphs: at most one extra compile
    assert step.graphs == stock_graphs + 1
    assert counters["nosync"]["guard_syncs"] == 1  # only the failing check before demotion


def test_max_specializations_demotes():
    step = Compiled(flag_scale, max_specializations=2)
    x = torch.arange(3.0)
    scales = [torch.tensor(float(v)) for v in (1, 2, 3, 4)]
    for s in scales:  # each value lives for three calls: not step-varying
        for _ in range(3):
            assert_bitwise(step(x, s), flag_scale(x, s))
    demoted = decisions_by_action(Action.DEMOTED)
    assert len(demoted) == 1 and demoted[0].reason is Reason.TOO_MANY_VALUES
    graphs = step.graphs
    for s in scales:
        assert_bitwise(step(x, s), flag_scale(x, s))
    assert step.graphs == graphs  # no storm after demotion


def flag_scale(x, s):
    return x * s.item()


def test_step_varying_buffer_written_in_place_is_demoted():
    class Counter(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("n", torch.tensor(0))

        def forward(self, x):
            self.n.add_(1)  # written in the graph, before the sync: never hoisted
            return x * self.n.item()

    m = Counter()
    ref = Counter()
    step = Compiled(m)
    x = torch.arange(3.0)
    for _ in range(4):
        assert_bitwise(step(x), ref(x))
    rejected = decisions_by_action(Action.REJECTED)
    assert rejected and rejected[0].reason is Reason.MUTATION


def test_unknown_option_lists_valid_ones():
    with pytest.raises(torchsync_pass.NosyncOptionsError, match="valid options are: invariant, codegen"):
        NosyncBackend({"codegen": "eager", "speed": 11})
    with pytest.raises(torchsync_pass.NosyncOptionsError, match=r"options\['codegen'\] must be 'inductor' or 'eager'"):
        NosyncBackend({"codegen": "tvm"})
    with pytest.raises(torchsync_pass.NosyncOptionsError, match="a list of input names"):
        NosyncBackend({"invariant": "token_types"})


# --------------------------------------------------------------------------------------------
# Never a stale value
# --------------------------------------------------------------------------------------------
class Step(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.tensor(1.5))

    def forward(self, x, types, cfg):
        h = x * self.scale.item()
        if (types == TEXT).any():
            h = h + 1
        n = int((types > 0).sum())
        if cfg.item() > 1.0:
            h = h * cfg
        return h[:n].sum() + h


def test_randomized_events_never_stale():
    rng = random.Random(1234)
    model = Step()
    step = Compiled(model)
    x = torch.arange(6.0)
    requests = [
        (torch.tensor([0, 1, 1, 2, 0, 1]), torch.tensor(2.0)),
        (torch.tensor([1, 1, 1, 1, 1, 1]), torch.tensor(1.0)),
        (torch.tensor([2, 0, 0, 0, 0, 0]), torch.tensor(3.0)),
    ]
    for _ in range(520):
        event = rng.randrange(8)
        types, cfg = requests[rng.randrange(len(requests))]
        if event == 0:
            types.fill_(rng.randrange(3))
        elif event == 1:
            types[rng.randrange(6)] = rng.randrange(3)
        elif event == 2:
            types.view(2, 3)[rng.randrange(2)].fill_(rng.randrange(3))
        elif event == 3:
            cfg.fill_(rng.choice([0.5, 1.0, 2.0]))
        elif event == 4:
            types.copy_(types.clone())  # same value, new version
        elif event == 5:
            i = rng.randrange(len(requests))
            requests[i] = (requests[i][0].clone(), requests[i][1].clone())  # replaced objects
        elif event == 6:
            model.scale = torch.tensor(rng.choice([1.5, 0.5, -0.0]))
        assert_bitwise(step(x, types, cfg), model(x, types, cfg))
    # the guards did the work: checks answered from the memo, writes and new objects re-synced
    c = counters["nosync"]
    assert c["guard_hits"] > 0 and c["guard_syncs"] > 0
    # bounded: demotion caps the cache entries, never the recompile limit
    assert step.graphs <= 4 * 16
    assert counters["nosync"]["hoisted"] > 0


def test_dynamo_reset_forgets_specialisations_and_demotions():
    f = torch.compile(scaled, backend="nosync", options={"codegen": "eager"})
    x = torch.arange(3.0)
    for i in range(4):
        f(x, torch.tensor(float(i)))  # step-varying: demoted
    assert decisions_by_action(Action.DEMOTED)
    torch._dynamo.reset()  # drops every cache entry: the site starts over
    before = len(decisions_by_action(Action.HOISTED))
    assert_bitwise(f(x, torch.tensor(7.0)), x * 7.0)
    assert len(decisions_by_action(Action.HOISTED)) == before + 1
    assert decisions_by_action(Action.DEMOTED)  # the log of what happened is kept


class GatedLayer(nn.Module):
    def __init__(self, v):
        super().__init__()
        self.register_buffer("gate", torch.tensor(v))

    def forward(self, x):
        return x * self.gate.item()  # one source line, a different buffer in every layer


def test_same_line_in_many_layers_counts_values_per_tensor():
    """A 12-layer loop asks each layer's buffer at one source line: 12 questions with one answer
    each, not one question with 12 answers (which max_specializations would demote)."""
    layers = nn.Sequential(*[GatedLayer(float(i + 1)) for i in range(12)])
    step = Compiled(layers)
    x = torch.ones(2)
    for _ in range(3):
        out, syncs = local_scalar_dense(step, x)
        assert_bitwise(out, layers(x))
    assert syncs == 0
    assert step.graphs == 1 and graph_breaks() == 0
    assert not decisions_by_action(Action.DEMOTED)
    layers[5].gate = torch.tensor(-1.0)  # one layer's answer changes: one recompile
    assert_bitwise(step(x), layers(x))
    assert step.graphs == 2

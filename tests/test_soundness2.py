"""Soundness II, reliability and reporting (issue 9, items 6-12).

- memory across model reloads: reset frees every guard's checks, cones and graphs;
- unpatching (torch >= 2.14 ``tp_methods``): each table entry goes back to its own original;
- a site that cannot be described is never a silent no-op; option resolution errors fall back;
- never more syncs than stock, compile-time syncs included;
- one site per sync instruction (``lo <= sigma <= hi`` is two);
- the recompile reason says whether a value changed or a site was demoted;
- typos in ``options["invariant"]`` warn once (raise with strict).
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import torchsync_pass
from torchsync_pass import Action, NosyncBackend, Reason, _torch_private, backend, dynamo_hooks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EAGER = {"codegen": "eager"}


@contextlib.contextmanager
def nosync_warnings():
    """The warning records of the ``torchsync_pass`` loggers inside the block."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("torchsync_pass")
    handler = Keep(logging.WARNING)
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


def messages(records) -> list[str]:
    return [r.getMessage() for r in records]


def syncs_per_call(fn, calls) -> list[int]:
    """Syncs of each call, the ones Dynamo and nosync make while compiling included."""
    out = []
    for args in calls:
        with torchsync_pass.count_syncs() as c:
            fn(*args)
        out.append(c.total + c.compile_time)
    return out


# --------------------------------------------------------------------------------------------
# 6. Memory across model reloads
# --------------------------------------------------------------------------------------------
def _reload_memory():
    """benchmarks/reload_memory.py: its model (one hoisted sync per layer) and its live-object census."""
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "reload_memory.py")
    spec = importlib.util.spec_from_file_location("benchmarks_reload_memory", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_reload_cycles_free_guards_cones_and_graphs():
    """compile + torch._dynamo.reset(), 8 times: nothing nosync made outlives its reset.

    NOTE: Dynamo keeps each frame's CheckFunctionManager (and the C++ lambda guard with our closure)
    alive after reset; the closure then holds an empty, released group and nothing else.
    benchmarks/reload_memory.py measures the full 40 cycles x 40 layers and RSS against eager.
    """
    bench = _reload_memory()
    live_objects = bench.live
    x = torch.randn(2, 16)

    def cycle(check: bool = False):
        model = bench.Model(6).eval()
        step = torch.compile(model, backend="nosync", options=EAGER)
        with torch.no_grad():
            for _ in range(2):
                assert torch.equal(step(x), model(x))
        if check:  # one guard check per layer's hoisted sync is alive before the reset
            assert live_objects()["SiteCheck"] >= 6
        torch._dynamo.reset()

    cycle(check=True)
    before = live_objects()
    for _ in range(8):
        cycle()
    after = live_objects()
    assert after["SiteCheck"] == 0 and after["guard groups with checks"] == 0, after
    assert after["GraphModule"] - before["GraphModule"] <= 2, (before, after)
    assert after["FakeTensorMode"] - before["FakeTensorMode"] <= 1, (before, after)
    # the records survive a reset, their graphs do not
    assert all(e["graph"] is None for e in backend.compiled_graphs())


def test_decision_log_is_bounded_and_since_counts_dropped_records(monkeypatch):
    from torchsync_pass import report

    monkeypatch.setattr(report, "MAX_DECISIONS", 5)
    log = report.DecisionLog()
    d = report.Decision(report.SiteKey("f.py", 1), "item", Action.HOISTED, Reason.INVARIANT_CONE, "f")
    mark = log.mark()
    for _ in range(8):
        log.add(d)
    assert len(log.all()) == 5
    assert len(log.since(mark)) == 5  # all 8 were added after the mark, 5 are kept
    mark = log.mark()
    log.add(d)
    assert len(log.since(mark)) == 1


# --------------------------------------------------------------------------------------------
# 7. Unpatching restores each tp_methods entry by its own key (torch >= 2.14 dispatch table)
# --------------------------------------------------------------------------------------------
def test_hooks_unpatch_restores_each_tp_methods_entry_by_its_own_key(monkeypatch):
    """The table as torch 2.14 builds it: ``tp_methods = {"item": Method(method_item), ...}``,
    ``Method`` a slots dataclass with a ``handler`` field. Runs on every torch."""
    import dataclasses

    @dataclasses.dataclass(slots=True)
    class Method:
        handler: object

    def method_item(self, tx, *args):
        return "item"

    def method_tolist(self, tx, *args):
        return "tolist"

    def method_size(self, tx, *args):
        return "size"

    class FakeTensorVariable:
        tp_methods = {"item": Method(method_item), "tolist": Method(method_tolist),
                      "size": Method(method_size)}

    originals = {"method_item": method_item, "method_tolist": method_tolist}
    monkeypatch.setattr(dynamo_hooks, "_originals", {f"TensorVariable.{a}": f for a, f in originals.items()})
    table = FakeTensorVariable.tp_methods
    for attr, kind in (("method_item", "item"), ("method_tolist", "tolist")):
        hook = dynamo_hooks._make_method_hook(attr, kind, originals[attr])
        assert dynamo_hooks._replace_tp_method(FakeTensorVariable, attr, hook)
    assert table["item"].handler.__nosync_hook__ and table["tolist"].handler.__nosync_hook__
    for attr, original in originals.items():  # the order _unpatch walks them in
        dynamo_hooks._replace_tp_method_back(FakeTensorVariable, attr, original)
    assert table["item"].handler is method_item
    assert table["tolist"].handler is method_tolist
    assert table["size"].handler is method_size


_DEAD_HOOK_SCRIPT = textwrap.dedent(
    """
    import json, warnings
    import torch
    import torch._dynamo
    from torch._dynamo.variables.tensor import TensorVariable
    import torchsync_pass.dynamo_hooks as H

    def snapshot():
        table = TensorVariable.__dict__.get("tp_methods") or {}
        attrs = {k: v for k, v in vars(TensorVariable).items() if k.startswith(("method_", "nb_", "bool_impl"))}
        return attrs, {k: (v, getattr(v, "handler", v)) for k, v in table.items()}

    before = snapshot()
    # a hook that never fires: the self-test switches the pass off and unpatches everything
    H.self_test = lambda verbose=False: {"TensorVariable.method_item": False, "generic_jump (dispatch_table)": True}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import torchsync_pass.backend
    after = snapshot()

    def f(x):
        a, b = x.tolist()
        return x * x.sum().item() + a + b

    x = torch.tensor([1.0, 2.0])
    torch._dynamo.reset()
    out = torch.compile(f, backend="eager")(x)
    print(json.dumps({
        "disabled": H.disabled_reason(),
        "attrs_restored": all(after[0].get(k) is v for k, v in before[0].items()),
        "table_entries": len(before[1]),
        "table_restored": [k for k, (e, h) in before[1].items() if after[1].get(k, (None, None))[1] is not h],
        "equal": torch.equal(out, f(x)),
        "torch": torch.__version__,
    }))
    """
)


def test_hooks_forced_dead_hook_restores_stock_dispatch(tmp_path):
    """Force a dead hook: the pass switches off and every hook point, attribute and (from torch
    2.14) ``tp_methods`` entry, is the one Dynamo had; ``.tolist()`` and ``.item()`` trace as stock."""
    script = tmp_path / "dead_hook.py"
    script.write_text(_DEAD_HOOK_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "TORCHSYNC_PASS_ANY_TORCH"}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "never fired: TensorVariable.method_item" in res["disabled"]
    assert res["attrs_restored"]
    assert res["table_restored"] == [], res  # every tp_methods entry is its own original again
    assert res["equal"]


# --------------------------------------------------------------------------------------------
# 8. No silent no-op
# --------------------------------------------------------------------------------------------
def two_syncs(x, s, flag):
    h = x * s.item()
    if flag.any():
        h = h + 1
    return h


def test_site_that_cannot_be_described_warns_once_and_stays_stock(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("a Dynamo internal moved")

    monkeypatch.setattr(dynamo_hooks, "_describe", broken)
    x, s, flag = torch.arange(4.0), torch.tensor(2.5), torch.tensor([True, False])
    step = torch.compile(two_syncs, backend="nosync", options=EAGER)
    with nosync_warnings() as records:
        for _ in range(2):
            assert torch.equal(step(x, s, flag), two_syncs(x, s, flag))
    found = [m for m in messages(records) if "could not describe a sync site" in m]
    assert len(found) == 1, messages(records)
    assert "a Dynamo internal moved" in found[0]
    assert counters["nosync"]["hoisted"] == 0


def test_site_that_cannot_be_described_raises_with_strict(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("a Dynamo internal moved")

    monkeypatch.setattr(dynamo_hooks, "_describe", broken)
    step = torch.compile(two_syncs, backend="nosync", options={**EAGER, "strict": True})
    with pytest.raises(torchsync_pass.NosyncError, match="could not describe a sync site"):
        step(torch.arange(4.0), torch.tensor(2.5), torch.tensor([True, False]))


def test_option_resolution_error_falls_back_with_a_warning(monkeypatch):
    """Anything but NosyncError from resolving the options at a sync: warn, leave it to Dynamo."""
    resolve = backend._resolve
    calls = []

    def flaky(options):
        calls.append(options)
        if len(calls) == 1:  # the first sync's policy call
            raise ValueError("options went wrong")
        return resolve(options)

    monkeypatch.setattr(backend, "_resolve", flaky)
    x, s, flag = torch.arange(4.0), torch.tensor(2.5), torch.tensor([True, False])
    step = torch.compile(two_syncs, backend="nosync", options=EAGER)
    with nosync_warnings() as records:
        assert torch.equal(step(x, s, flag), two_syncs(x, s, flag))
    assert any("could not analyse the sync" in m for m in messages(records)), messages(records)


# --------------------------------------------------------------------------------------------
# 9. Never more syncs than stock
# --------------------------------------------------------------------------------------------
def int_float_expr(x, a, b):
    return x * int(a) + float(b)


def int_float_lines(x, a, b):
    n = int(a)
    s = float(b)
    return x * n + s


@pytest.mark.parametrize("fn", [int_float_expr, int_float_lines], ids=["one-expression", "two-lines"])
def test_new_tensors_with_same_values_never_sync_more_than_stock(fn):
    """0-d tensors built anew every step with the same values: every call costs nosync at most
    what stock torch.compile costs, the syncs made while compiling included."""
    x = torch.ones(3)

    def calls():
        return [(x, torch.tensor(3), torch.tensor(2.5)) for _ in range(9)]

    warm = (x, torch.tensor(3), torch.tensor(2.5))
    stock = torch.compile(fn, backend="eager")
    stock(*warm)
    stock_syncs = syncs_per_call(stock, calls())
    torch._dynamo.reset()
    step = torch.compile(fn, backend="nosync", options=EAGER)
    step(*warm)
    nosync_syncs = syncs_per_call(step, calls())
    assert all(n <= s for n, s in zip(nosync_syncs, stock_syncs)), (nosync_syncs, stock_syncs)
    assert sum(nosync_syncs) <= sum(stock_syncs) and sum(nosync_syncs) >= 9  # the guard does sync
    assert counters["nosync"]["demoted"] == 0  # the same answer: no recompile to pay for


def step_varying_scale(x, t):
    return x * t.item()


def test_after_a_demotion_a_site_costs_what_stock_costs():
    x = torch.ones(3)
    calls = [(x, torch.tensor(float(i))) for i in range(10)]
    stock = torch.compile(step_varying_scale, backend="eager")
    stock_syncs = syncs_per_call(stock, calls)
    torch._dynamo.reset()
    step = torch.compile(step_varying_scale, backend="nosync", options=EAGER)
    nosync_syncs = syncs_per_call(step, calls)
    assert counters["nosync"]["demoted"] == 1
    # speculation, 3 live tensors with new values, the demotion's recompile, then exactly stock
    assert nosync_syncs[5:] == stock_syncs[5:], (nosync_syncs, stock_syncs)
    assert sum(nosync_syncs) <= sum(stock_syncs), (nosync_syncs, stock_syncs)


# --------------------------------------------------------------------------------------------
# 10. A site is one sync instruction
# --------------------------------------------------------------------------------------------
def in_range(x, lo, sigma, hi):
    if lo <= sigma <= hi:
        return x + 1
    return x - 1


def test_chained_comparison_is_two_sites():
    x, lo, sigma = torch.ones(2), torch.tensor(0.0), torch.tensor(0.5)
    step = torch.compile(in_range, backend="nosync", options=EAGER)
    assert torch.equal(step(x, lo, sigma, torch.tensor(1.0)), x + 1)
    hoisted = [d for d in torchsync_pass.decisions() if d.action is Action.HOISTED]
    assert len(hoisted) == 2 and counters["nosync"]["hoisted"] == 2
    assert hoisted[0].site == hoisted[1].site  # one source line, two sync instructions


def test_demoting_the_second_comparison_keeps_the_first_hoisted():
    """Only ``hi`` changes (a new tensor, a new answer, every call): ``sigma <= hi`` is demoted
    (then selected on the device: its arms are ``x + 1`` and ``x - 1``); ``lo <= sigma`` stays a
    guarded constant: no sync per call."""
    x, lo, sigma = torch.ones(2), torch.tensor(0.0), torch.tensor(0.5)
    step = torch.compile(in_range, backend="nosync", options=EAGER)
    calls = [(x, lo, sigma, torch.tensor(1.0 if i % 2 else 0.25)) for i in range(10)]
    for args in calls[:5]:
        assert torch.equal(step(*args), in_range(*args))
    assert counters["nosync"]["demoted"] == 1
    selects = dynamo_hooks._torch_version() >= dynamo_hooks.SELECT_MIN_TORCH
    for args in calls[5:]:
        with torchsync_pass.count_syncs() as c:
            out = step(*args)
        assert torch.equal(out, in_range(*args))
        assert c.total == (0 if selects else 1), c.by_kind
    assert counters["nosync"]["demoted"] == 1  # the first comparison was never demoted
    rewritten = [d.reason for d in torchsync_pass.decisions() if d.action is Action.REWRITTEN]
    assert rewritten == ([Reason.BRANCH_WHERE] if selects else [])


# --------------------------------------------------------------------------------------------
# 11. The recompile reason says why
# --------------------------------------------------------------------------------------------
def flag_branch(x, t):
    if t.sum() > 0:
        return x + 1
    return x - 1


def recompile_reasons(fn, eager, calls) -> list[str]:
    watch = _torch_private.CompilationWatch()
    for args in calls:
        assert torch.equal(fn(*args), eager(*args))
    return [r.recompile_reason for r in watch.stop() if r.recompile_reason]


def test_recompile_reason_names_a_value_change():
    x = torch.ones(2)
    step = torch.compile(flag_branch, backend="nosync", options=EAGER)
    t = torch.tensor([1.0])
    reasons = recompile_reasons(step, flag_branch, [(x, t), (x, t.neg())])
    assert len(reasons) == 1
    assert "nosync: a hoisted value changed: True -> False" in reasons[0]
    assert "if t.sum() > 0:" in reasons[0]


def test_recompile_reason_names_a_demotion():
    """Live step tensors, a new one with a new value every call: two value changes recompile, then
    the guard fails because the site is demoted (its leaves were new 3 calls in a row), before it
    re-runs the cone: that recompile is not a value change."""
    x = torch.ones(2)
    schedule = [torch.tensor(float(i)) for i in range(6)]
    step = torch.compile(step_varying_scale, backend="nosync", options=EAGER)
    reasons = recompile_reasons(step, step_varying_scale, [(x, t) for t in schedule])
    assert counters["nosync"]["demoted"] == 1
    reasons = [r for r in reasons if "nosync" in r]  # not stock's own (the resume function's float)
    assert len(reasons) == 3, reasons
    assert all("nosync: a hoisted value changed" in r for r in reasons[:2]), reasons
    assert "nosync: site demoted (LEAVES_CHANGE), not a value change" in reasons[2]
    assert "value changed" not in reasons[2]


def test_recompile_reason_names_a_thread_count_change():
    """The guard fails when the thread count changed (a reduction's bits depend on it); the reason
    says so, not the cause of an earlier failure (here: a value change). Dynamo's own global-state
    guard, which also sees the thread count, is dropped here as a serving engine drops it."""
    x, t = torch.ones(2), torch.tensor([1.0])
    keep = torchsync_pass.keep_nosync_guards(lambda entries: [False] * len(entries))
    step = torch.compile(flag_branch, backend="nosync", options={**EAGER, "guard_filter_fn": keep})
    saved = torch.get_num_threads()
    try:
        assert "value changed" in recompile_reasons(step, flag_branch, [(x, t), (x, t.neg())])[0]
        torch.set_num_threads(1 if saved != 1 else 2)
        reasons = recompile_reasons(step, flag_branch, [(x, t)])
    finally:
        torch.set_num_threads(saved)
    assert len(reasons) == 1, reasons
    assert f"nosync: the thread count changed ({saved} -> " in reasons[0], reasons


# --------------------------------------------------------------------------------------------
# 12. Typos in options["invariant"]
# --------------------------------------------------------------------------------------------
class Tokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Module()
        self.attn.register_buffer("mask", torch.ones(3))

    def forward(self, x, token_types):
        if (token_types == 1).any():
            x = x + 1
        return x * self.attn.mask.sum().item()


TYPOS = [
    ("token_type", "there is no argument 'token_type' and self (Tokens) has no attribute 'token_type'"),
    ("self.atn.mask", "self (Tokens) has no attribute 'atn'"),
    ("token_types.mask", "token_types is a tensor: a declared path ends at one"),
]


@pytest.mark.parametrize("name,problem", TYPOS, ids=[t[0] for t in TYPOS])
def test_invariant_typo_warns_once_naming_it(name, problem):
    model = Tokens()
    args = (torch.ones(3), torch.tensor([1, 2]))
    step = torch.compile(model, backend="nosync", options={**EAGER, "invariant": [name, "token_types"]})
    with nosync_warnings() as records:
        for i in range(3):
            args = (torch.ones(3), torch.tensor([1, i]))  # new values: recompiles of the frame
            assert torch.equal(step(*args), model(*args))
    found = [m for m in messages(records) if "options['invariant']" in m]
    assert len(found) == 1, found
    assert f"names {name!r}, but {problem}" in found[0]


@pytest.mark.parametrize("name,problem", TYPOS, ids=[t[0] for t in TYPOS])
def test_invariant_typo_raises_with_strict(name, problem):
    step = torch.compile(Tokens(), backend="nosync",
                         options={**EAGER, "invariant": [name], "strict": True})
    with pytest.raises(torchsync_pass.NosyncOptionsError, match="options\\['invariant'\\] names") as info:
        step(torch.ones(3), torch.tensor([1, 2]))
    assert problem in str(info.value)


def test_invariant_typo_is_reported_in_a_graph_without_syncs():
    # invariant caching alone (no sync site asks): the name is checked for each compiled graph
    def step(x, weight):
        return x + (weight * 2).sin()

    x, w = torch.randn(4), torch.randn(4)
    lenient = torch.compile(step, backend="nosync", options={**EAGER, "invariant": ["wieght"]})
    with nosync_warnings() as records:
        for _ in range(2):
            assert torch.equal(lenient(x, w), step(x, w))
    found = [m for m in messages(records) if "options['invariant']" in m]
    assert len(found) == 1 and "names 'wieght', but there is no argument 'wieght'" in found[0]
    torch._dynamo.reset()
    strict = torch.compile(step, backend="nosync", options={**EAGER, "invariant": ["wieght"], "strict": True})
    with pytest.raises(torchsync_pass.NosyncOptionsError, match="names 'wieght'"):
        strict(x, w)


def test_invariant_names_that_resolve_do_not_warn():
    model = Tokens()
    args = (torch.ones(3), torch.tensor([1, 2]))
    names = ["token_types", "self.attn.mask", "attn.mask"]
    step = torch.compile(model, backend="nosync", options={**EAGER, "invariant": names, "strict": True})
    with nosync_warnings() as records:
        assert torch.equal(step(*args), model(*args))
    assert not [m for m in messages(records) if "options['invariant']" in m]
    assert counters["nosync"]["hoisted"] == 2

"""Serving readiness: the supported torch range, counting device moves, diffusers entry points."""

from __future__ import annotations

import configparser
import functools
import inspect
import os

import pytest
import torch

import torchsync_pass
from torchsync_pass import dynamo_hooks
from test_core import assert_bitwise

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --------------------------------------------------------------------------------------------
# 1. One supported range, one hook table
# --------------------------------------------------------------------------------------------
def test_setup_cfg_pins_the_package_constant():
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    reqs = [r.strip() for r in cfg["options"]["install_requires"].splitlines() if r.strip()]
    (torch_req,) = [r for r in reqs if r.startswith("torch")]
    assert torch_req == torchsync_pass.TORCH_REQUIREMENT == "torch>=2.11,<2.16"
    assert dynamo_hooks.SUPPORTED_TORCH == ((2, 11), (2, 16))


def test_hook_table_has_a_row_per_supported_release():
    lo, hi = dynamo_hooks.SUPPORTED_TORCH
    assert sorted(dynamo_hooks.HOOK_TABLE) == [(lo[0], m) for m in range(lo[1], hi[1])]
    # 2.11 has no hook point for operator.index (nor bool/int/float: they reach .item())
    assert dynamo_hooks.hook_row((2, 11, 0))["index"] is None
    assert dynamo_hooks.hook_row((2, 12, 1))["index"] == "nb_index_impl"
    assert dynamo_hooks.hook_row((2, 15, 0))["bool"] == "nb_bool_impl"
    assert dynamo_hooks.hook_row((2, 10))["index"] is None  # experiments: the nearest row
    assert dynamo_hooks.hook_row((2, 17))["bool"] == "nb_bool_impl"


def test_running_torch_has_every_hook_of_its_row():
    from torch._dynamo.variables.tensor import TensorVariable

    row = dynamo_hooks.hook_row()
    for kind in row:
        attr = dynamo_hooks._method_attr(kind)
        assert attr == row[kind]
        assert attr is None or hasattr(TensorVariable, attr)


# --------------------------------------------------------------------------------------------
# 2. count_syncs(): a device move counts only when it would be a device-to-host read on a GPU
# --------------------------------------------------------------------------------------------
def moves(x, other):
    a = x[None].to(other.device)  # MOVE same-device
    b = x.to(other)  # MOVE same-device
    c = x.to(device=other.device)  # MOVE same-device
    d = x.to("cpu")  # MOVE host
    e = x.cpu()  # MOVE host
    f = x.to(torch.device("cpu"))  # MOVE host
    g = x.to(device="cpu", dtype=torch.float64)  # MOVE host
    return a.sum() + b + c + d + e + f + g


def same_device_moves(x, other):
    t = x[None].to(other.device)
    return t.to(other) * 2 + x.to(device=other.device)


def _lines(fn, marker):
    src, first = inspect.getsourcelines(fn)
    return {first + i for i, t in enumerate(src) if t.rstrip().endswith(marker)}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only rule")
def test_count_syncs_counts_only_moves_that_name_the_host():
    x, other = torch.tensor(3.0), torch.randn(2)
    with torchsync_pass.count_syncs(profiler=False) as c:
        moves(x, other)
    host, same = _lines(moves, "# MOVE host"), _lines(moves, "# MOVE same-device")
    assert len(host) == 4 and len(same) == 3
    counted = {k.line for k in c.by_site if k.file == __file__}
    assert counted == host
    assert c.by_kind == {"cpu": 4} and c.total == 4


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only rule")
@pytest.mark.parametrize("how", ["eager", "stock-eager-backend", "nosync-eager"])
def test_same_device_moves_count_zero_whatever_the_codegen(how):
    torch._dynamo.reset()
    fn = {
        "eager": same_device_moves,
        "stock-eager-backend": torch.compile(same_device_moves, backend="eager"),
        "nosync-eager": torch.compile(same_device_moves, backend="nosync", options={"codegen": "eager"}),
    }[how]
    x, other = torch.tensor(3.0), torch.randn(2)
    fn(x, other)  # compile outside the counter
    with torchsync_pass.count_syncs() as c:
        out = fn(x, other)
    assert torch.equal(out, same_device_moves(x, other))
    assert c.total == 0, c.summary()


def _unet_line(needle: str) -> tuple[str, int]:
    from diffusers.models.unets import unet_2d_condition

    path = inspect.getsourcefile(unet_2d_condition)
    with open(path) as f:
        (line,) = [i for i, t in enumerate(f, 1) if needle in t]
    return path, line


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only rule")
def test_diffusers_unet_timestep_move_is_not_a_sync():
    pytest.importorskip("diffusers")
    from real_pipelines import CROSS_DIM, tiny_unet

    path, line = _unet_line("timesteps = timesteps[None].to(sample.device)")
    torch.manual_seed(0)
    unet = tiny_unet()
    sample, emb = torch.randn(2, 4, 8, 8), torch.randn(2, 7, CROSS_DIM)
    with torch.no_grad(), torchsync_pass.count_syncs() as c:
        for t in (torch.tensor(981), torch.tensor(961)):  # 0-d timesteps: the .to() line runs
            unet(sample, t, encoder_hidden_states=emb)
    assert torchsync_pass.SiteKey(path, line) not in c.by_site
    assert "cpu" not in c.by_kind
    assert c.total == 0, c.summary()


# --------------------------------------------------------------------------------------------
# 3. explain's wording
# --------------------------------------------------------------------------------------------
class Counter:
    """A plain object with an int that changes every call (a scheduler's step counter)."""

    def __init__(self):
        self.w = torch.tensor([1.0, 2.0])
        self.n = 1

    def step(self, x):
        if (self.w * self.n).sum() > 3:  # the cone reads the int
            x = x * 2
        self.n += 1
        return x


def test_symbolic_decision_on_a_dynamic_int_does_not_say_size():
    from torchsync_pass import Reason

    c = Counter()
    step = torch.compile(c.step, backend="nosync", options={"codegen": "eager"})
    x = torch.ones(2)
    for _ in range(3):
        step(x)
    (dec,) = [d for d in torchsync_pass.decisions() if d.reason is Reason.SYMBOLIC]
    assert "size" not in dec.detail and "size" not in dec.reason.value
    assert "L['self'].n is a Python int that Dynamo made dynamic" in dec.detail


# --------------------------------------------------------------------------------------------
# 4. Serving engines: diffusers' compile entry points, and the per-request check
# --------------------------------------------------------------------------------------------
def _nosync_graphs() -> int:
    from torchsync_pass import backend

    return len(backend.compiled_graphs())


def _unet_call():
    from real_pipelines import CROSS_DIM, tiny_unet

    torch.manual_seed(0)
    unet = tiny_unet()
    args = (torch.randn(2, 4, 8, 8), torch.tensor(981))
    kwargs = {"encoder_hidden_states": torch.randn(2, 7, CROSS_DIM)}
    return unet, args, kwargs


@pytest.mark.parametrize("entry", ["compile_repeated_blocks", "module.compile"])
def test_diffusers_compile_entry_points_take_nosync(entry):
    pytest.importorskip("diffusers")
    unet, args, kwargs = _unet_call()
    with torch.no_grad():
        ref = unet(*args, **kwargs).sample
        before = _nosync_graphs()
        opts = {"backend": "nosync", "options": {"codegen": "eager"}}
        if entry == "compile_repeated_blocks":
            unet.compile_repeated_blocks(**opts)  # diffusers' regional compilation
        else:
            unet.compile(**opts)  # nn.Module.compile, what pipe.transformer.compile(...) calls
        outs = [unet(*args, **kwargs).sample for _ in range(2)]
        with torchsync_pass.count_syncs() as c:  # a warm call: the .to(sample.device) line is no sync
            outs.append(unet(*args, **kwargs).sample)
    assert _nosync_graphs() > before  # nosync compiled the graphs
    assert c.total == 0, c.summary()
    for out in outs:
        assert torch.equal(out, ref) and out.stride() == ref.stride()


def serve_step(x, token_types):
    if (token_types == 1).any():  # request-invariant: hoisted
        x = x + 1
    return x * 2


class Denoiser(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("mask", torch.tensor([True, False]))

    def forward(self, x, scale):
        if self.mask.any():
            x = x * scale.item()
        return x


def test_check_request_on_a_function():
    from torchsync_pass import HoistedValueChanged, check_request

    step = torch.compile(serve_step, backend="nosync", options={"codegen": "eager"})
    x, a = torch.ones(2), torch.tensor([0, 1])
    step(x, a)
    r = check_request(step, x, a)
    assert (r.ok, r.sites, r.syncs) == (True, 1, 0)  # the memo answers: no sync
    r = check_request(step, x, token_types=torch.tensor([1, 1]))  # new object, same answer
    assert (r.ok, r.sites, r.syncs) == (True, 1, 1)
    b = torch.tensor([0, 0])
    with pytest.raises(HoistedValueChanged, match=r"(?s)serve_step.*\(token_types == 1\)\.any\(\).*False for this request"):
        check_request(step, x, b)
    r = check_request(step, x, b, on_change="report")
    assert not r.ok and r.changed[0].value is False and r.changed[0].compiled_for == (True,)
    assert check_request(serve_step, x, a).ok  # the original function names the same frame


def _two_tests(x, a, b):
    y = x + 1 if a.any() else x - 1
    return y * 2 if b.any() else y * 3


def test_check_request_wants_one_entry_with_the_whole_combination():
    """Entries compiled for (True, True) and (False, False); a request (True, False) matched some
    entry at each site, and check_request said no recompile. One entry must pass all its checks."""
    from torch._dynamo.utils import counters

    c = torch.compile(_two_tests, backend="nosync", options={"codegen": "eager", "select_branches": False})
    x = torch.ones(2)
    keep = [torch.tensor([v]) for v in (True, True, False, False)]  # the compiled requests stay alive
    c(x, keep[0], keep[1])
    c(x, keep[2], keep[3])
    a, b = torch.tensor([True]), torch.tensor([False])
    report = torchsync_pass.check_request(c, x, a, b, on_change="report")
    assert not report.ok and "different cache entries" in report.changed[0].why
    graphs = counters["stats"]["unique_graphs"]
    assert_bitwise(c(x, a, b), _two_tests(x, a, b))
    assert counters["stats"]["unique_graphs"] > graphs  # what it predicted
    assert torchsync_pass.check_request(c, x, keep[0], keep[1], on_change="report").ok  # one entry: ok


def _writes_its_buffer(buf, w):
    buf.mul_(-1)
    if w.sum() > 0:
        return buf + 1
    return buf - 1


def test_check_request_sees_a_written_argument_that_aliases_a_leaf():
    """The guard refuses a call whose written argument shares memory with a hoisted leaf (the
    call recompiles); check_request skipped that check and said no recompile."""
    c = torch.compile(_writes_its_buffer, backend="nosync", options={"codegen": "eager"})
    c(torch.zeros(2), torch.ones(2))
    t = torch.ones(2)
    report = torchsync_pass.check_request(c, t.view(-1), t, on_change="report")
    assert not report.ok and "shares memory" in report.changed[0].why
    assert torchsync_pass.check_request(c, torch.zeros(2), torch.ones(2), on_change="report").ok


def test_check_request_on_a_module_and_reset():
    from torchsync_pass import check_request, guards

    m = Denoiser()
    cm = torch.compile(m, backend="nosync", options={"codegen": "eager"})
    x, s = torch.ones(2), torch.tensor(3.0)
    assert torch.equal(cm(x, s), m(x, s))
    r = check_request(cm, x, s)
    assert r.ok and r.sites == 2  # mask.any() and scale.item()
    r = check_request(cm, x, torch.tensor(4.0), on_change="reset")
    assert [c.value for c in r.changed] == [4.0]
    assert guards.checks_for(type(m).forward.__code__) == []  # forgotten: the next call recompiles
    assert torch.equal(cm(x, torch.tensor(4.0)), m(x, torch.tensor(4.0)))


def test_check_request_sees_what_a_guard_dropping_engine_would_miss():
    """An engine that drops Dynamo's guards (vLLM's guard_filter_fn) calls check_request instead."""
    from torchsync_pass import HoistedValueChanged, check_request

    step = torch.compile(serve_step, backend="nosync", options={"codegen": "eager"})
    x = torch.ones(2)
    step(x, torch.tensor([0, 1]))
    with pytest.raises(HoistedValueChanged):
        check_request(step, x, torch.tensor([0, 0]))
    assert check_request(step, x, torch.tensor([1, 0])).ok
    with pytest.raises(TypeError):
        check_request(step, x)  # a call the function would refuse


# check_request finds the frame Dynamo compiled: decorated functions and forwards, partials,
# closures; sites it cannot check (after a graph break) are reported, never taken for absent.
E = {"codegen": "eager"}
ZEROS, ONES = torch.zeros(3, dtype=torch.long), torch.ones(3, dtype=torch.long)


def logged(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)

    return wrapper


def _branch(x, tt):
    if (tt == 0).any():  # request-invariant: hoisted
        return x + 1
    return x - 1


@logged
def logged_step(x, tt):
    return _branch(x, tt)


@torch.no_grad()
def no_grad_step(x, tt):
    return _branch(x, tt)


@torch.inference_mode()
def inference_step(x, tt):
    return _branch(x, tt)


def _assert_checked(g, *args):
    """Hoist on ZEROS, then: the same request is ok, ONES is a change (raise and report)."""
    from torchsync_pass import HoistedValueChanged, check_request

    g(*args, ZEROS)
    g(*args, ZEROS)
    assert [d.action.value for d in torchsync_pass.decisions()] == ["hoisted"]
    r = check_request(g, *args, ONES, on_change="report")
    assert (r.ok, r.sites, [c.value for c in r.changed]) == (False, 1, [False])
    r = check_request(g, *args, ZEROS)
    assert (r.ok, r.sites, r.unchecked) == (True, 1, [])
    with pytest.raises(HoistedValueChanged, match=r"\(tt == 0\)\.any\(\).*False for this request"):
        check_request(g, *args, ONES)


@pytest.mark.parametrize("step", [logged_step, no_grad_step, inference_step], ids=lambda f: f.__name__)
def test_check_request_on_a_decorated_function(step):
    _assert_checked(torch.compile(step, backend="nosync", options=E), torch.ones(3))


class DecoratedForward(torch.nn.Module):
    @logged
    def forward(self, x, tt):
        return _branch(x, tt)


class NoGradForward(torch.nn.Module):
    @torch.no_grad()
    def forward(self, x, tt):
        return _branch(x, tt)


@pytest.mark.parametrize("cls", [DecoratedForward, NoGradForward], ids=lambda c: c.__name__)
def test_check_request_on_a_module_whose_forward_is_decorated(cls):
    _assert_checked(torch.compile(cls(), backend="nosync", options=E), torch.ones(3))


def test_check_request_on_a_partial():
    _assert_checked(torch.compile(functools.partial(_branch, torch.ones(3)), backend="nosync", options=E))


class Server:
    @torch.no_grad()
    def step(self, x, tt):
        return _branch(x, tt)


def test_check_request_on_a_decorated_method_given_again():
    """``server.step`` is a new bound method at each access: the check still finds its frame."""
    from torchsync_pass import check_request

    server = Server()
    g = torch.compile(server.step, backend="nosync", options=E)
    g(torch.ones(3), ZEROS)
    assert check_request(server.step, torch.ones(3), ZEROS).ok
    r = check_request(server.step, torch.ones(3), ONES, on_change="report")
    assert (r.sites, [c.value for c in r.changed]) == (1, [False])


def test_check_request_keeps_functions_sharing_a_wrapper_apart():
    """Every @logged function is compiled in the one ``wrapper`` code: each gets only its checks."""
    from torchsync_pass import check_request

    @logged
    def other(x, tt):
        return _branch(x, tt + 1)  # hoists False for ZEROS

    g, h = (torch.compile(f, backend="nosync", options=E) for f in (logged_step, other))
    x = torch.ones(3)
    g(x, ZEROS)
    h(x, ZEROS)
    assert len(torchsync_pass.decisions()) == 2
    for f in (g, h):
        r = check_request(f, x, ZEROS)
        assert (r.ok, r.sites) == (True, 1)
    assert check_request(h, x, -ONES, on_change="report").changed[0].value is True


def _closure_step(mask):
    def step(x):
        if (mask == 0).any():  # mask: a closure variable
            return x + 1
        return x - 1

    def drop():
        nonlocal mask
        del mask

    def rebind(new):
        nonlocal mask
        mask = new

    return step, drop, rebind


def test_check_request_reads_closure_variables():
    from torchsync_pass import NosyncError, check_request

    mask = torch.zeros(3, dtype=torch.long)
    step, drop, rebind = _closure_step(mask)
    g = torch.compile(step, backend="nosync", options=E)
    x = torch.ones(3)
    g(x)
    g(x)
    r = check_request(g, x)
    assert (r.ok, r.sites) == (True, 1)
    mask.fill_(1)  # the closure's tensor changed in place
    assert [c.value for c in check_request(g, x, on_change="report").changed] == [False]
    other, _, _ = _closure_step(torch.ones(3, dtype=torch.long))  # same code, its own closure
    g2 = torch.compile(other, backend="nosync", options=E)
    g2(x)
    assert [(r.sites, [c.value for c in r.changed]) for r in
            (check_request(f, x, on_change="report") for f in (g, g2))] == [(1, [False]), (1, [])]
    rebind(torch.zeros(3, dtype=torch.long))  # `nonlocal mask; mask = ...`: the cell stays
    assert check_request(g, x).ok
    rebind(torch.ones(3, dtype=torch.long))
    assert [c.value for c in check_request(g, x, on_change="report").changed] == [False]
    drop()
    with pytest.raises(NosyncError, match=r"'mask' is a closure variable of _closure_step.<locals>.step"):
        check_request(g, x)


GLOBAL_MASK = torch.zeros(3, dtype=torch.long)


@torch.no_grad()
def _reads_a_global(x):
    if (GLOBAL_MASK == 0).any():  # a global, read through Dynamo's wrap_inline frame
        return x + 1
    return x - 1


def test_check_request_reads_globals_of_a_decorated_function():
    from torchsync_pass import check_request

    g = torch.compile(_reads_a_global, backend="nosync", options=E)
    x = torch.ones(3)
    g(x)
    assert check_request(g, x).sites == 1
    GLOBAL_MASK.fill_(1)
    try:
        assert [c.value for c in check_request(g, x, on_change="report").changed] == [False]
    finally:
        GLOBAL_MASK.fill_(0)


def _break_then_hoist(x, tt):
    x = x * 2
    torch._dynamo.graph_break()
    if (tt == 0).any():  # hoisted in Dynamo's resume function
        return x + 1
    return x - 1


def _hoist_then_check_ones(fn):
    """Compile ``fn``, hoist on ZEROS, and check_request a request with ONES (report only)."""
    from torchsync_pass import check_request

    g = torch.compile(fn, backend="nosync", options=E)
    x = torch.ones(3)
    for _ in range(2):
        g(x, ZEROS)
    assert [d.action.value for d in torchsync_pass.decisions()] == ["hoisted"]
    return g, check_request(g, x, ONES, on_change="report")


def test_check_request_reports_sites_after_a_graph_break_as_unchecked():
    from torchsync_pass import NosyncError, check_request

    g, r = _hoist_then_check_ones(_break_then_hoist)
    x = torch.ones(3)
    assert not r.ok and r.sites == 0 and r.changed == []
    from torchsync_pass.serving import HoistedValueUnchecked
    (u,) = r.unchecked
    assert u.frame.startswith("torch_dynamo_resume_in__break_then_hoist_at_") and "graph break" in u.why
    assert u.site.line == _break_then_hoist.__code__.co_firstlineno + 3
    for mode in ("raise", "reset"):
        with pytest.raises(HoistedValueUnchecked, match=r"(?s)NOT checked.*\(tt == 0\)\.any\(\).*graph break"):
            check_request(g, x, ZEROS, on_change=mode)
    assert issubclass(HoistedValueUnchecked, NosyncError)


def _helper_that_breaks(x, tt):
    torch._dynamo.graph_break()
    return _branch(x, tt)  # hoisted in the helper's resume function, compiled on its own


def _calls_a_breaking_helper(x, tt):
    return _helper_that_breaks(x * 2, tt)


def test_check_request_reports_sites_of_frames_compiled_during_the_call_as_unchecked():
    _, r = _hoist_then_check_ones(_calls_a_breaking_helper)
    assert not r.ok
    (u,) = r.unchecked
    assert u.frame.startswith("torch_dynamo_resume_in__helper_that_breaks_at_")
    assert "during a call of _calls_a_breaking_helper" in u.why


def test_nested_graph_breaks_hoist_in_the_caller_s_resume_and_check_request_lists_them():
    # Dynamo's nested_graph_breaks: a break inside a callee may resume in a function made from the
    # caller or from the callee; either way results stay eager's and the hoisted site, in a resume
    # function, is reported unchecked
    with torch._dynamo.config.patch(nested_graph_breaks=True):
        g = torch.compile(_calls_a_breaking_helper, backend="nosync", options=E)
        for tt in (ZEROS, ZEROS, ONES, ONES, ZEROS):
            x = torch.arange(3.0)
            assert_bitwise(g(x, tt), _calls_a_breaking_helper(x, tt))
        r = torchsync_pass.check_request(g, torch.ones(3), ONES, on_change="report")
    assert not r.ok and r.sites == 0
    assert r.unchecked and all(u.frame.startswith("torch_dynamo_resume_in_") for u in r.unchecked)
    assert {u.site.line for u in r.unchecked} == {_branch.__code__.co_firstlineno + 1}


def _explain_json(capsys, *argv):
    import json

    from torchsync_pass import explain

    rc = explain.main(["--json", *argv])
    captured = capsys.readouterr()
    return rc, json.loads(captured.out), captured.err


SERVING_DEMO = os.path.join(ROOT, "tests", "scripts", "serving_demo.py")


def _demo_line(tag):
    with open(SERVING_DEMO) as f:
        (line,) = [i for i, t in enumerate(f, 1) if t.rstrip().endswith(f"# SITE {tag}")]
    return line


def _python_tracer_records_calls() -> bool:
    """The profiler's Python tracer works here (without it no profiler-only sync has a user line).
    Read as count_syncs reads it: on torch 2.11 the Python calls are in the event tree only."""
    from torch.autograd.profiler import profile

    from torchsync_pass import _torch_private

    with profile(use_kineto=True, with_stack=True) as p:
        _demo_line("solve")
    return any(e.is_python_function() for e in _torch_private.profiler_events(p))


def test_explain_sync_inside_an_op_in_an_inlined_helper_is_at_its_line(capsys):
    if not _python_tracer_records_calls():
        pytest.skip("the profiler's Python tracer records no Python calls on this torch build")
    rc, rep, _ = _explain_json(capsys, SERVING_DEMO, "--solve")
    assert rc == 0
    (s,) = [s for s in rep["sites"] if s["kind"] == "in_op"]
    assert (s["file"], s["line"], s["line_exact"]) == (SERVING_DEMO, _demo_line("solve"), True)
    assert s["source"] == "return torch.linalg.solve(R, b)  # SITE solve"


def test_explain_says_what_happened_when_nosync_found_no_sync(capsys):
    from torchsync_pass import explain

    rc, rep, _ = _explain_json(capsys, SERVING_DEMO, "--nosync-no-sync")
    assert rc == 0 and rep["nosync"] == [] and rep["nosync_graphs"] == 1
    text = explain.render_text(rep)
    assert "nosync compiled 1 graph(s) and met no host sync" in text
    assert "did not run" not in text
    rc, rep, _ = _explain_json(capsys, SERVING_DEMO)
    assert rep["nosync_graphs"] == 0
    assert "(none: the nosync backend did not run)" in explain.render_text(rep)


def test_explain_prints_progress_on_long_runs(capsys):
    rc, rep, err = _explain_json(capsys, "--progress", "0.05", SERVING_DEMO, "--sleep", "0.5")
    assert rc == 0
    lines = [ln for ln in err.splitlines() if "host syncs so far" in ln]
    assert len(lines) >= 3, err


def test_profiler_is_off_while_a_module_imports_and_back_after(tmp_path, monkeypatch):
    from torchsync_pass import _torch_private, count_syncs

    (tmp_path / "heavy_module_for_test.py").write_text(
        "from torchsync_pass import _torch_private\nPROFILING = _torch_private.profiler_enabled()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    a, b = torch.ones(3), torch.ones(3)
    with count_syncs() as c:
        assert _torch_private.profiler_enabled()
        import heavy_module_for_test

        a[:1]  # a safe point: the profiler restarts
        after = _torch_private.profiler_enabled()
        torch.equal(a, b)  # seen by the profiler only (where the op syncs: not on every release)
    assert heavy_module_for_test.PROFILING is False
    assert after is True
    assert c.total == sum(c.by_kind.values()) <= 1, c.summary()

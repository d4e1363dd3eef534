"""nosync behaves like a first-class torch.compile backend: registration, compile conventions, logs."""

from __future__ import annotations

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
from torchsync_pass import Action, NosyncBackend, Reason
from torchsync_pass.backend import compiled_graphs

EAGER = {"codegen": "eager"}


def flag_step(x, flag):
    if flag.any():
        return x * 2
    return x - 1


def hoisted_sites():
    return [d for d in torchsync_pass.decisions() if d.action is Action.HOISTED]


def run_python(code: str, env: dict | None = None, cwd: str | None = None) -> subprocess.CompletedProcess:
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, timeout=300, env=full_env, cwd=cwd,
    )


# --------------------------------------------------------------------------------------------
# Registration: both import orders
# --------------------------------------------------------------------------------------------
PROBE = """
    import torch
    {pre}
    def f(x, flag):
        if flag.any():
            return x * 2
        return x
    g = torch.compile(f, backend="nosync", options={{"codegen": "eager"}})
    print(g(torch.ones(2), torch.tensor([True])).tolist())
    import torchsync_pass
    print(len([d for d in torchsync_pass.decisions() if d.action.value == "hoisted"]))
"""


@pytest.mark.parametrize("pre", ["", "import torchsync_pass"], ids=["string-first", "import-first"])
def test_backend_found_by_name_in_both_import_orders(pre):
    proc = run_python(PROBE.format(pre=pre))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["[2.0,", "2.0]", "1"]
    assert "duplicate name" not in proc.stderr


def test_nosync_listed_among_backends():
    from torch._dynamo import list_backends

    assert "nosync" in list_backends()


# --------------------------------------------------------------------------------------------
# torch.compile conventions
# --------------------------------------------------------------------------------------------
def test_mode_is_forwarded_to_the_backend():
    # torch.compile refuses mode= together with options=; a NosyncBackend object carries options.
    backend = NosyncBackend(EAGER)
    f = torch.compile(flag_step, backend=backend, mode="max-autotune-no-cudagraphs")
    f(torch.ones(2), torch.tensor([True]))
    assert backend.compiled[-1]["mode"] == "max-autotune-no-cudagraphs"
    assert hoisted_sites()


def test_mode_patches_reach_inductor(monkeypatch):
    from torch._inductor import compile_fx as cfx

    seen = {}

    def fake_compile_fx(gm, example_inputs, config_patches=None, **kw):
        seen["patches"] = config_patches
        return gm.forward

    monkeypatch.setattr(cfx, "compile_fx", fake_compile_fx)
    f = torch.compile(flag_step, backend="nosync", mode="max-autotune")
    f(torch.ones(2), torch.tensor([True]))
    assert seen["patches"]["max_autotune"] is True


def test_unknown_mode_is_refused_by_name():
    backend = NosyncBackend(EAGER)
    with pytest.raises(Exception, match="unknown mode 'fastest'"):
        backend(torch.fx.symbolic_trace(lambda x: x + 1), [torch.ones(1)], mode="fastest")


def test_dynamic_true_keeps_meaning_and_results():
    f = torch.compile(flag_step, backend="nosync", dynamic=True, options=EAGER)
    for n in (3, 5, 7):
        x = torch.arange(float(n))
        assert torch.equal(f(x, torch.tensor([True])), x * 2)
    assert len(compiled_graphs()) == 1  # one dynamic graph serves every size
    assert hoisted_sites()


def test_dynamic_cone_on_symbolic_sizes_is_rejected():
    def count(x):
        return x * int((x > 0).sum())

    f = torch.compile(count, backend="nosync", dynamic=True, options=EAGER)
    for n in (3, 5):
        x = torch.arange(float(n)) - 1
        assert torch.equal(f(x), count(x))
    rejected = [d for d in torchsync_pass.decisions() if d.action is Action.REJECTED]
    assert rejected and rejected[0].reason is Reason.SYMBOLIC
    assert "symbolic size" in rejected[0].detail


def test_fullgraph_unhoistable_sync_names_the_site():
    def noisy(x):
        r = torch.rand(3)
        if r.sum() > 10:  # random: never hoisted
            return x + 1
        return x

    f = torch.compile(noisy, backend="nosync", fullgraph=True, options=EAGER)
    with pytest.raises(torch._dynamo.exc.Unsupported) as info:
        f(torch.ones(3))
    msg = str(info.value)
    assert "nosync: sync could not be hoisted" in msg
    assert f"{__file__}:{noisy.__code__.co_firstlineno + 2}: if r.sum() > 10:" in msg
    assert "random op rand" in msg


def test_fullgraph_hoistable_sync_compiles_one_graph():
    f = torch.compile(flag_step, backend="nosync", fullgraph=True, options=EAGER)
    assert torch.equal(f(torch.ones(2), torch.tensor([False])), torch.zeros(2))
    assert len(compiled_graphs()) == 1


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("gate", torch.tensor(True))
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        if self.gate:
            return self.lin(x)
        return x


def test_module_compile_method():
    m = Block()
    ref = Block()
    ref.load_state_dict(m.state_dict())
    m.compile(backend="nosync", options=EAGER)
    x = torch.randn(2, 3)
    assert torch.equal(m(x), ref(x))
    assert [d.kind for d in hoisted_sites()] == ["bool"]


def test_decorator_form():
    @torch.compile(backend="nosync", options=EAGER)
    def step(x, scale):
        return x * scale.item()

    assert torch.equal(step(torch.ones(2), torch.tensor(3.0)), torch.full((2,), 3.0))
    assert [d.kind for d in hoisted_sites()] == ["item"]


class Scheduler:
    """A plain Python object, like a diffusers scheduler: tables are attributes."""

    def __init__(self, steps: int):
        self.sigmas = torch.linspace(1.0, 0.0, steps + 1)
        self.order = torch.tensor(2)

    def step(self, x, eps):
        if self.order.item() > 1:  # request-invariant: hoisted
            eps = 0.5 * eps
        return x - (self.sigmas[0] - self.sigmas[-1]) * eps


def test_bound_method_of_plain_object():
    sched = Scheduler(10)
    step = torch.compile(sched.step, backend="nosync", options=EAGER)
    x, eps = torch.ones(3), torch.full((3,), 0.2)
    for _ in range(3):
        assert torch.equal(step(x, eps), sched.step(x, eps))
    [d] = hoisted_sites()
    assert d.leaves == ("self.order",)
    sched.order = torch.tensor(1)  # replaced attribute: guard sees a new object
    assert torch.equal(step(x, eps), sched.step(x, eps))


def test_compiler_disable_region_is_respected():
    @torch.compiler.disable
    def host_logic(flag):
        return bool(flag.any())  # runs eagerly: nosync never sees it

    def step(x, flag):
        if host_logic(flag):
            return x + 1
        return x

    f = torch.compile(step, backend="nosync", options=EAGER)
    assert torch.equal(f(torch.ones(2), torch.tensor([True])), torch.full((2,), 2.0))
    assert not hoisted_sites()
    assert sum(counters["graph_break"].values()) >= 1


# --------------------------------------------------------------------------------------------
# Observability
# --------------------------------------------------------------------------------------------
class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_registered_log_name_shows_decisions():
    # torch's log setup stops propagation to the root logger, so listen on ours directly
    handler = _Records()
    logger = logging.getLogger("torchsync_pass")
    torch._logging.set_logs(modules={"nosync": logging.INFO})  # the registered log name
    logger.addHandler(handler)
    try:
        f = torch.compile(flag_step, backend="nosync", options=EAGER)
        f(torch.ones(2), torch.tensor([True]))
        g = torch.compile(lambda x: x * torch.rand(1).item(), backend="nosync", options=EAGER)
        g(torch.ones(2))
    finally:
        logger.removeHandler(handler)
        torch._logging.set_logs()
    msgs = handler.messages
    assert any(m.startswith("nosync: hoisted ") and "if flag.any():" in m and "flag" in m for m in msgs), msgs
    assert any(m.startswith("nosync: rejected ") and "random op rand" in m for m in msgs), msgs


def test_torch_logs_env_and_torch_trace(tmp_path):
    code = """
        import torch
        import torchsync_pass
        def f(x, flag):
            if flag.any():
                return x * 2
            return x
        torch.compile(f, backend="nosync", options={"codegen": "eager"})(torch.ones(2), torch.tensor([True]))
    """
    trace_dir = tmp_path / "trace"
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(code))
    proc = run_python(f"exec(compile(open({str(script)!r}).read(), {str(script)!r}, 'exec'))",
                      env={"TORCH_LOGS": "torchsync_pass", "TORCH_TRACE": str(trace_dir)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "nosync: hoisted" in proc.stderr and "if flag.any():" in proc.stderr
    payloads = []
    for p in trace_dir.iterdir():
        text = p.read_text()
        if "nosync_decision" in text:
            lines = text.splitlines()
            for i, line in enumerate(lines):
                if "nosync_decision" in line:
                    payloads.append(json.loads(lines[i + 1].lstrip("\t")))
    assert payloads, "no nosync_decision artifact in the structured trace"
    assert payloads[0]["action"] == "hoisted" and payloads[0]["kind"] == "bool"

"""Hostile review 11 (2026-12-03): defects found by the review helpers, each test failing on the
commit before its fix."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import torchsync_pass
from test_core import assert_bitwise

EAGER = {"codegen": "eager"}


class DunderWrite(nn.Module):
    """A buffer written by an in-place operator called by its dunder name, then read: Dynamo
    traces ``t.__iadd__(v)`` as a call of that method (not ``operator.iadd``)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.register_buffer("table", torch.arange(64.0).reshape(8, 8) / 7.0)

    def forward(self, x):
        if self.how == "method":
            self.table.__iadd__(1.0)
        elif self.how == "function":
            torch.Tensor.__imul__(self.table, 1.5)
        else:
            torch.Tensor.__setitem__(self.table, 0, 2.0)
        y = x + self.table.cumsum(0)  # invariant work but for the write: must not be cached
        if self.table.sum() > 0:  # reads the written buffer: must not be hoisted
            y = y + 1
        return y * self.table[1, 1].item()


@pytest.mark.parametrize("how", ["method", "function", "setitem"])
def test_dunder_inplace_write_is_a_write(how):
    m = DunderWrite(how)
    ref = copy.deepcopy(m)
    c = torch.compile(m, backend="nosync", options={**EAGER, "invariant_cache_bytes": 64 << 20})
    x = torch.randn(8, 8)
    with torch.no_grad():
        for _ in range(3):
            assert_bitwise(c(x), ref(x))
    assert torch.equal(m.table, ref.table)
    assert not [d for d in torchsync_pass.decisions() if d.action.name == "CACHED"]


class Cumexp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.randn(8, 8, generator=torch.Generator().manual_seed(0)))

    def forward(self, x):
        return x * self.table.cumsum(0).exp()  # cached (invariant)


def test_cached_under_inference_mode_not_reused_for_autograd():
    """Values cached under ``inference_mode()`` (with ``enable_grad()`` inside: Dynamo's
    global-state snapshot does not tell the two apart) are inference tensors: a later ordinary
    grad-mode call must not reuse them (autograd refuses to save them) and must match eager."""
    m = Cumexp()
    keep = torchsync_pass.keep_nosync_guards(torch.compiler.skip_all_guards_unsafe)
    f = torch.compile(m, backend="nosync", options={**EAGER, "invariant_cache_bytes": 64 << 20,
                                                    "guard_filter_fn": keep})
    x = torch.randn(8, 8)
    with torch.inference_mode(), torch.enable_grad():
        assert_bitwise(f(x), m(x))
    x1 = torch.randn(8, 8, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_(True)
    ref = m(x2)
    ref.sum().backward()
    out = f(x1)
    out.sum().backward()
    assert_bitwise(out.detach(), ref.detach())
    assert_bitwise(x1.grad, x2.grad)
    with torch.inference_mode(), torch.enable_grad():  # and back: the inference values again
        assert_bitwise(f(x), m(x))
    assert torch._dynamo.utils.counters["nosync"]["invariant_computes"] >= 2


_TESTS = [torch.tensor(v) for v in ([1, -2, 0], [0, 3, -1], [-1, -1, 2], [2, 0, 0], [0, 0, 5], [0, 0, 0], [-1, 0, -3])]


def _outcome(f, *a):
    try:
        return "ok", f(*a)
    except RuntimeError as e:
        return "raised", str(e)


@pytest.mark.parametrize("dtype, op, selects", [
    (torch.int8, lambda x: x.clamp(min=300), False),  # 300 does not fit int8: the kernel raises
    (torch.float16, lambda x: x.clamp(min=-1e9), False),  # nor -1e9 float16
    (torch.int8, lambda x: torch.where(x > 1, x, 300), False),
    (torch.float32, lambda x: x.clamp(min=-1e9), True),  # fits: still selected on the device
], ids=["int8-clamp", "float16-clamp", "int8-where", "float32-clamp"])
def test_select_refuses_arm_with_number_that_overflows(dtype, op, selects):
    """A branch selected on the device runs the arm eager skips; a number the kernel converts to
    the tensor's dtype with an overflow check (a clamp bound, where's scalar) raised there,
    although eager never ran that arm on the call (the fake tensors do not check it)."""
    x = torch.tensor([1, 2, 3], dtype=dtype)

    def step(x, t):
        out = []
        for i in range(t.shape[0]):
            out.append(op(x) if t[i] > 0 else x * 1)
        return torch.stack(out)

    f = torch.compile(step, backend="nosync", options=EAGER)
    with torch.no_grad():
        for t in _TESTS:
            e, g = _outcome(step, x, t), _outcome(f, x, t)
            assert e[0] == g[0], (t, e, g)
            if e[0] == "ok":
                assert_bitwise(g[1], e[1])
    reasons = {d.reason.name for d in torchsync_pass.decisions()}
    assert ("BRANCH_WHERE" in reasons) is selects, reasons
    assert ("BRANCH_MAY_RAISE" in reasons) is not selects, reasons


def test_unknown_options_of_mixed_key_types_named():
    """A typo beside a non-string key: the unknown keys are named, not a TypeError from sorting."""
    with pytest.raises(torchsync_pass.NosyncOptionsError, match="unknown option.*'verfy'"):
        torchsync_pass.NosyncBackend({"codegen": "eager", 1: True, "verfy": True})


@pytest.mark.parametrize("argv", [["--max-sites", "-1"], ["--max-syncs", "-3"], ["--progress", "-1"],
                                  ["--progress", "nan"]])
def test_explain_refuses_negative_counts(argv, tmp_path, capsys):
    """explain's own wrong options exit 2 naming the option (``--max-sites -1`` showed no site row
    and claimed '... 2 more sites')."""
    from torchsync_pass import explain

    script = tmp_path / "s.py"
    script.write_text("import torch\nt = torch.tensor(1.0)\nfor i in range(3):\n    t.item()\n")
    assert explain.main([*argv, str(script)]) == 2
    assert argv[0] in capsys.readouterr().err

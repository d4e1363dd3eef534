"""Global state a hoisted value or a cached invariant tensor depends on (review round 4).

* The per-backend precision settings (``torch.backends.mkldnn.matmul.fp32_precision = "bf16"``)
  change fp32 matmul bits on a CPU with bf16 support; Dynamo's global-state guard does not cover
  them, so nosync's own keys and per-call checks must.
* After a per-backend setting, ``torch.get_float32_matmul_precision()`` raises ("mix of the legacy
  and new APIs"); eager and stock torch.compile still run, and so must nosync.
* With a ``guard_filter_fn`` that drops Dynamo's global-state guard but keeps nosync's
  (``keep_nosync_guards(skip_all_guards_unsafe)``, the README's recipe), nosync's checks alone see
  a changed matmul precision or autocast.

Every comparison is bitwise against eager (``codegen="eager"``). The settings are process-wide:
the ``precision`` fixture puts them back.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import torchsync_pass

PAIRS = [(b, o) for b in ("generic", "cuda", "mkldnn") for o in ("all", "matmul", "conv", "rnn")]
_get = getattr(torch._C, "_get_fp32_precision_getter", None)
_set = getattr(torch._C, "_set_fp32_precision_setter", None)
needs_backend_api = pytest.mark.skipif(_get is None, reason="this torch has no per-backend fp32_precision")


def _pairs() -> list:
    out = []
    for p in PAIRS:
        try:
            out.append((p, _get(*p)))
        except Exception:
            continue
    return out


@pytest.fixture
def precision():
    """Restore the legacy and per-backend precision settings (process-wide) after the test."""
    legacy = torch.get_float32_matmul_precision()
    saved = _pairs() if _get is not None else []
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(legacy)
        for p, v in saved:  # generic, then each backend's "all", then its ops (PAIRS' order)
            _set(*p, v)
        assert torch.get_float32_matmul_precision() == legacy and _pairs() == saved


def bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a, b) and a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()


class Hoisted(nn.Module):  # a request-invariant .item() of a matmul: hoisted
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("w", torch.randn(512, 512, generator=torch.Generator().manual_seed(0)))

    def forward(self, x):
        with torch.no_grad():  # a traced grad region: the guard must compare the frame's entry state
            s = (self.w @ self.w).sum().item()
        return x * s


class Cached(nn.Module):  # invariant tensor work: cached by the invariant runner (codegen="eager")
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("w", torch.randn(512, 512, generator=torch.Generator().manual_seed(0)))

    def forward(self, x):
        return x + (self.w @ self.w)[0]


def _skip_guards() -> dict:
    return {"codegen": "eager",
            "guard_filter_fn": torchsync_pass.keep_nosync_guards(torch.compiler.skip_all_guards_unsafe)}


def _switch_changes_eager(m: nn.Module, x: torch.Tensor, switch) -> torch.Tensor:
    """Eager after ``switch()``; skips where this CPU computes the same bits either way."""
    before = m(x)
    switch()
    after = m(x)
    if torch.equal(before, after):
        pytest.skip("this CPU computes fp32 matmuls the same under the new precision")
    return after


def _mkldnn_bf16() -> None:
    torch.backends.mkldnn.matmul.fp32_precision = "bf16"


def _medium() -> None:
    torch.set_float32_matmul_precision("medium")


@needs_backend_api
@pytest.mark.parametrize("cls", [Hoisted, Cached])
@pytest.mark.parametrize("filtered", [False, True], ids=["guards", "skip_all_guards_unsafe"])
def test_a_per_backend_precision_switch_recomputes(precision, cls, filtered):
    """``torch.backends.mkldnn.matmul.fp32_precision = "bf16"`` after two calls under "ieee": the
    hoisted ``.item()`` and the cached ``w @ w`` are computed again (they were served stale)."""
    torch.backends.mkldnn.matmul.fp32_precision = "ieee"
    m, x = cls(), torch.ones(3, 512)
    f = torch.compile(m, backend="nosync", options=_skip_guards() if filtered else {"codegen": "eager"})
    for _ in range(2):
        assert bitwise(f(x), m(x))
    want = _switch_changes_eager(m, x, _mkldnn_bf16)
    assert bitwise(f(x), want)
    assert bitwise(f(x), want)


@pytest.mark.parametrize("cls", [Hoisted, Cached])
def test_a_matmul_precision_switch_recomputes_without_dynamo_global_guard(precision, cls):
    """``torch.set_float32_matmul_precision("medium")`` with Dynamo's global-state guard dropped:
    the runner's fast path and the fused hoisted guard check the state themselves."""
    m, x = cls(), torch.ones(3, 512)
    f = torch.compile(m, backend="nosync", options=_skip_guards())
    for _ in range(3):
        assert bitwise(f(x), m(x))
    if cls is Hoisted:  # the traced no_grad region does not fail the guard: no recompile per call
        assert counters["nosync"]["guard_hits"] >= 2
    want = _switch_changes_eager(m, x, _medium)
    assert bitwise(f(x), want)
    torch.set_float32_matmul_precision("highest")  # and back: the earlier values again
    assert bitwise(f(x), m(x))


@pytest.mark.parametrize("cls", [Hoisted, Cached])
def test_a_later_autocast_call_recomputes_without_dynamo_global_guard(cls):
    """A call under autocast after two calls outside: the cached ``w @ w`` is computed again under
    autocast (it was served from the fp32 memo), the hoisted ``.item()``'s guard fails."""
    m, x = cls(), torch.randn(3, 512, generator=torch.Generator().manual_seed(1))
    f = torch.compile(m, backend="nosync", options=_skip_guards())
    for _ in range(2):
        assert bitwise(f(x), m(x))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = m(x)
        assert bitwise(f(x), want)
        assert bitwise(f(x), want)
    if cls is Cached:  # (the entry compiled under autocast hoists nothing: under this filter it keeps
        assert bitwise(f(x), m(x))  # no guard at all, and serves the later calls as stock would)


class Step(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("A", torch.eye(3) * 2 + 0.1)
        self.register_buffer("B", torch.ones(3, 1))

    def forward(self, x):
        # a tabulated solve, a cached cumsum and a hoisted .item()
        return x + torch.linalg.solve(self.A, self.B) + self.B.cumsum(0) * self.B.sum().item()


@needs_backend_api
def test_mixed_precision_apis_do_not_raise(precision):
    """After ``torch.backends.cuda.matmul.fp32_precision = "tf32"`` (no effect on a CPU run),
    ``torch.get_float32_matmul_precision()`` raises; nosync computes, caches and hoists as before."""
    m, x = Step(), torch.zeros(3, 1)
    f = torch.compile(m, backend="nosync", options={"codegen": "eager"})
    with torch.no_grad():
        assert bitwise(f(x), m(x))
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        with pytest.raises(RuntimeError):
            torch.get_float32_matmul_precision()
        for _ in range(2):
            assert bitwise(f(x), m(x))
        m.B = torch.full((3, 1), 2.0)  # a new request
        for _ in range(2):
            assert bitwise(f(x), m(x))
        torch._dynamo.reset()
        torchsync_pass.reset()
        g = torch.compile(m, backend="nosync", options={"codegen": "eager", "strict": True})
        assert bitwise(g(x), m(x))  # hoisting does not fall back (strict: it would raise)
        assert any(d.action is torchsync_pass.Action.HOISTED for d in torchsync_pass.decisions())


@pytest.mark.parametrize("fn, sensitive", [
    (lambda a: ((a == 1).sum() + a.exp().cumsum(0)[0] * 2).any(), False),  # elementwise, reductions, indexing
    (lambda a: torch.cat([a.sin(), a.cos()]).reshape(-1).amax(), False),
    # names whose default overload is the Python-scalar one (aten.mul.default, aten.eq.default)
    (lambda a: torch.where(torch.eq(a, 1), a.mul(2), a.add(1).sub(a).div(3)).ne(0).sum(), False),
    (lambda a: torch.lt(a, 2).logical_or(torch.ge(a, 3)).remainder(2).sum(), False),
    (lambda a: (a @ a).sum(), True),
    (lambda a: torch.nn.functional.linear(a, a).sum(), True),
    (lambda a: torch.linalg.inv(a), True),  # an op not on the list counts
    (lambda a: torch.einsum("ij,jk->ik", a, a), True),
])
def test_which_graphs_a_precision_setting_can_change(fn, sensitive):
    """The per-backend precisions are read per call only for a cone or invariant part that has an
    op outside elementwise ops, reductions and data movement; an op nosync does not know counts."""
    from torchsync_pass.guards import precision_sensitive

    assert precision_sensitive(torch.fx.symbolic_trace(fn).graph) is sensitive
    gm = torch.fx.symbolic_trace(nn.Sequential(nn.ReLU()))  # a module call: counted
    assert precision_sensitive(gm.graph)


@pytest.mark.parametrize("fn, attention", [
    (lambda a: (a @ a).sum(), False),
    (lambda a: torch.nn.functional.linear(a, a).sum(), False),
    (lambda a: torch.nn.functional.conv1d(a[None], a[:, :, None]).sum(), False),
    (lambda a: torch.nn.functional.scaled_dot_product_attention(a[None], a[None], a[None]).sum(), True),
    (lambda a: torch.linalg.inv(a), True),  # an op nosync does not know: everything is read
])
def test_attention_switches_are_read_only_where_attention_may_run(fn, attention):
    """The attention kernels' switches cost 0.6 us a call: a graph of matmuls and convolutions
    does not read them; one with attention, or with an op nosync does not know, does."""
    from torchsync_pass import _torch_private
    from torchsync_pass.guards import precision_reader

    reader = precision_reader(torch.fx.symbolic_trace(fn).graph)
    full, partial = _torch_private.fp32_precisions, _torch_private.fp32_precisions_no_attention
    assert reader is (full if attention else partial)
    if hasattr(torch._C, "_get_flash_sdp_enabled"):
        assert len(partial()) < len(full())

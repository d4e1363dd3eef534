"""Bitwise verification: compiled against eager, per graph and per loop.

A sync-removal pass is only worth using if it provably never changes a result, so "equal" here is
strict: two tensors are equal when they have the same dtype, shape, significant strides and device
and the same *bit patterns* element by element (``-0.0`` and ``0.0`` differ; NaNs in the same places
count as equal whatever their payload). ``torch.allclose`` is never used. Where a difference is
expected (Inductor against eager on CPU) it is *reported* as the largest absolute difference and the
largest distance in units in the last place (ULP), never hidden behind a tolerance.

Three layers, each usable alone:

* :func:`compare_outputs` walks two arbitrary nested outputs (tensors, tuples, lists, dicts,
  dataclasses, Python scalars) and returns one :class:`Mismatch` record per differing leaf, named by
  its path (``out[1]['h']``).
* :func:`verify_compiled` is what the nosync backend calls with ``options["verify"]``: it runs the
  Dynamo graph as FX (eager) and the compiled artifact on clones of the real example inputs and
  compares every output and every input the graph mutates. A mismatch is one warning per graph that
  names the output, the differences and the user lines that produced it (``strict``: an error).
* :func:`verify_loop` runs a whole per-step loop from identical deep-copied starting states eagerly
  and under each compiled mode and reports the first step and tensor at which a mode diverges.

Example inputs: on torch 2.13 Dynamo hands a backend the *real* tensors it traced with
(``OutputGraph.example_inputs()`` returns ``GraphArg.example`` for each placeholder), but SymInts for
dynamic sizes. Those are replaced by their hints. When a backend is driven with FakeTensors instead
(another wrapper, export), the real values are taken from the placeholders'
``meta["grapharg"].example`` when Dynamo left them there; otherwise verification is *skipped and
says so*, it never passes silently.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import inspect
import json
import logging
import math
import random
import re
import struct
import sys
import warnings
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from .errors import VerificationError

log = logging.getLogger(__name__)

__all__ = [
    "Diff",
    "LoopMode",
    "LoopReport",
    "Mismatch",
    "ModeReport",
    "StepMismatch",
    "VerificationSkippedWarning",
    "VerificationWarning",
    "VerifyResult",
    "VerifyStatus",
    "compare_outputs",
    "format_mismatches",
    "max_ulp_distance",
    "reference_graph",
    "resolve_modes",
    "verify_compiled",
    "verify_loop",
]


class VerificationWarning(UserWarning):
    """A compiled graph or loop produced output that is not bitwise equal to eager."""


class VerificationSkippedWarning(VerificationWarning):
    """Verification was requested but could not run (for instance: only fake example inputs)."""


# --------------------------------------------------------------------------------------------
# Records
# --------------------------------------------------------------------------------------------


class Diff(enum.Enum):
    """What differs between an expected and an actual leaf."""

    TYPE = "type"
    STRUCTURE = "structure"
    DEVICE = "device"
    LAYOUT = "layout"
    DTYPE = "dtype"
    SHAPE = "shape"
    STRIDE = "stride"
    VALUE = "value"
    ERROR = "error"


@dataclasses.dataclass(frozen=True)
class Mismatch:
    """One leaf of an output that is not bitwise equal to the expected one.

    ``max_abs`` is the largest absolute difference over the differing elements (``nan`` when a NaN
    sits on one side only); ``max_ulp`` the largest distance in units in the last place, for
    float16, bfloat16, float32 and float64 (complex: per component), ``None`` where undefined.
    ``index`` is an element with the largest difference and ``expected_value``/``actual_value`` the
    values there. ``source`` names the user lines that produced the output, when known.
    """

    path: str
    diffs: tuple[Diff, ...]
    detail: str
    max_abs: float | None = None
    max_ulp: int | None = None
    num_different: int | None = None
    numel: int | None = None
    index: tuple[int, ...] | None = None
    expected_value: Any = None
    actual_value: Any = None
    source: str = ""

    @property
    def kind(self) -> Diff:
        return self.diffs[0]

    def summary(self) -> str:
        """One line: path, what differs, max abs and ULP."""
        parts = [f"{self.path}: {self.detail}"]
        if self.max_abs is not None:
            parts.append(f"max abs diff {_fmt_float(self.max_abs)}")
        if self.max_ulp is not None:
            parts.append(f"max ULP distance {self.max_ulp}")
        if self.index is not None:
            parts.append(
                f"at index {list(self.index)}: expected {self.expected_value!r}, got {self.actual_value!r}"
            )
        return "; ".join(parts)

    def describe(self) -> str:
        text = self.summary()
        if self.source:
            text += "\n" + _indent(self.source, "    ")
        return text

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "diffs": [d.value for d in self.diffs],
            "detail": self.detail,
            "max_abs": _json_float(self.max_abs),
            "max_ulp": self.max_ulp,
            "num_different": self.num_different,
            "numel": self.numel,
            "index": list(self.index) if self.index is not None else None,
            "expected_value": _json_scalar(self.expected_value),
            "actual_value": _json_scalar(self.actual_value),
            "source": self.source,
        }


def format_mismatches(mismatches: Iterable[Mismatch], *, limit: int = 10) -> str:
    """Render mismatches one per line (with their source lines), at most ``limit`` of them."""
    items = list(mismatches)
    if not items:
        return "(bitwise equal)"
    lines = [m.describe() for m in items[:limit]]
    if len(items) > limit:
        lines.append(f"... and {len(items) - limit} more")
    return "\n".join(lines)


def _fmt_float(x: float) -> str:
    if math.isnan(x) or math.isinf(x):
        return str(x)
    return f"{x:.6g}"


def _indent(text: str, prefix: str) -> str:
    return "\n".join(prefix + line for line in text.splitlines())


def _json_float(x: float | None) -> float | str | None:
    if x is None:
        return None
    if math.isnan(x) or math.isinf(x):
        return str(x)
    return x


def _json_scalar(x: Any) -> Any:
    if x is None or isinstance(x, (bool, int, str)):
        return x
    if isinstance(x, float):
        return _json_float(x)
    return repr(x)


# --------------------------------------------------------------------------------------------
# Bit-level tensor comparison
# --------------------------------------------------------------------------------------------

# dtypes whose ULP distance is defined here, with the signed integer type of the same width.
_ULP_INT = {
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns of ``t`` as integers (complex: as pairs of float bit patterns)."""
    if t.is_complex():
        t = torch.view_as_real(t.resolve_conj()) if t.is_conj() else torch.view_as_real(t)
    t = t.resolve_neg() if t.is_neg() else t
    if t.dtype == torch.bool:
        return t.to(torch.uint8)
    int_dtype = _INT_OF_SIZE.get(t.element_size())
    if int_dtype is None:  # pragma: no cover - no such dtype in 2.13
        raise TypeError(f"cannot take the bit pattern of {t.dtype}")
    return t.view(int_dtype)


def _real_view(t: torch.Tensor) -> torch.Tensor:
    if t.is_complex():
        return torch.view_as_real(t.resolve_conj())
    return t


def _ordinal(bits: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split sign-magnitude float bits (sign-extended to int64) into ``(negative, magnitude)``.

    On the integer line ``-magnitude if negative else magnitude`` adjacent floats are 1 apart and
    ``-0.0`` and ``0.0`` both sit at 0, so the ULP distance is a difference of two such numbers.
    """
    return bits < 0, bits & ((1 << (width - 1)) - 1)


def _max_ulp_of_bits(a_bits: torch.Tensor, b_bits: torch.Tensor, width: int) -> int:
    """Largest ULP distance between two flat signed-int views of float bits of ``width`` bits."""
    if a_bits.numel() == 0:
        return 0
    # .to(int64) sign-extends the signed view, so the float's sign bit becomes the int64 sign.
    na, ma = _ordinal(a_bits.to(torch.int64), width)
    nb, mb = _ordinal(b_bits.to(torch.int64), width)
    same = na == nb
    if width < 64:
        return int((torch.where(na, -ma, ma) - torch.where(nb, -mb, mb)).abs().max().item())
    # float64. Same sign: |ma - mb| fits in int64. Opposite signs: the distance is ma + mb, up to
    # 2**64, which does not; take its maximum exactly as 2*h + r with h = ma//2 + mb//2 and
    # r = ma%2 + mb%2 (r <= 2, so the maximum has the largest h, then the largest r).
    best = int(torch.where(same, (ma - mb).abs(), torch.zeros_like(ma)).max().item())
    cross = ~same
    if bool(cross.any()):
        h = torch.where(cross, (ma >> 1) + (mb >> 1), torch.full_like(ma, -1))
        hmax = int(h.max().item())
        rmax = int(((ma & 1) + (mb & 1))[h == hmax].max().item())
        best = max(best, 2 * hmax + rmax)
    return best


def max_ulp_distance(expected: torch.Tensor, actual: torch.Tensor) -> int | None:
    """Largest distance in units in the last place between two same-shape float tensors.

    Defined for float16, bfloat16, float32 and float64 (complex64/128: per real component).
    ``-0.0`` and ``0.0`` are 0 ULP apart; positions where both are NaN are ignored; a NaN on one side
    only makes the distance undefined (``None``). Computed exactly on integer views of the bits.
    """
    if expected.dtype != actual.dtype or expected.shape != actual.shape:
        raise ValueError("max_ulp_distance needs tensors of the same dtype and shape")
    e = _real_view(expected).detach()
    a = _real_view(actual).detach()
    int_dtype = _ULP_INT.get(e.dtype)
    if int_dtype is None:
        return None
    if a.device != e.device:
        a = a.to(e.device)
    e_nan, a_nan = e.isnan(), a.isnan()
    if bool((e_nan ^ a_nan).any()):
        return None
    keep = ~(e_nan & a_nan)
    eb = e.view(int_dtype)[keep]
    ab = a.view(int_dtype)[keep]
    return _max_ulp_of_bits(eb, ab, e.element_size() * 8)


def _significant_strides(t: torch.Tensor) -> tuple[int, ...]:
    # A dimension of size 1 never moves the address, so its stride carries no meaning (the rule
    # torch._prims_common uses for "significant" strides); an empty tensor has no layout at all.
    if t.numel() == 0:
        return ()
    return tuple(st for sz, st in zip(t.shape, t.stride()) if sz > 1)


def _compare_tensors(path: str, e: torch.Tensor, a: torch.Tensor, out: list[Mismatch]) -> None:
    diffs: list[Diff] = []
    details: list[str] = []
    if e.device != a.device:
        diffs.append(Diff.DEVICE)
        details.append(f"device {e.device} vs {a.device}")
    if e.layout != a.layout:
        diffs.append(Diff.LAYOUT)
        details.append(f"layout {e.layout} vs {a.layout}")
    if e.dtype != a.dtype:
        diffs.append(Diff.DTYPE)
        details.append(f"dtype {e.dtype} vs {a.dtype}")
    if e.shape != a.shape:
        diffs.append(Diff.SHAPE)
        details.append(f"shape {list(e.shape)} vs {list(a.shape)}")
        out.append(Mismatch(path, tuple(diffs), ", ".join(details)))
        return
    e = e.detach()
    a = a.detach()
    if e.layout != torch.strided or a.layout != torch.strided:
        e = e.to_dense() if e.layout != torch.strided else e
        a = a.to_dense() if a.layout != torch.strided else a
    elif _significant_strides(e) != _significant_strides(a):
        diffs.append(Diff.STRIDE)
        details.append(f"stride {e.stride()} vs {a.stride()}")
    if "meta" in (e.device.type, a.device.type):
        if Diff.DEVICE not in diffs:
            diffs.append(Diff.DEVICE)
            details.append("meta tensors hold no values to compare")
        out.append(Mismatch(path, tuple(diffs), ", ".join(details), numel=e.numel()))
        return
    if a.device != e.device:
        a = a.to(e.device)
    numel = e.numel()

    if Diff.DTYPE in diffs:
        # Different dtypes have different bit patterns; report the value difference only.
        if numel:
            common = torch.promote_types(e.dtype, a.dtype)
            if not torch.equal(e.to(common), a.to(common)):
                diffs.append(Diff.VALUE)
                details.append("values differ after promotion to " + str(common))
            max_abs = (_real_view(e.to(common)).double() - _real_view(a.to(common)).double()).abs().max()
            out.append(Mismatch(path, tuple(diffs), ", ".join(details), max_abs=float(max_abs), numel=numel))
        else:
            out.append(Mismatch(path, tuple(diffs), ", ".join(details), numel=numel))
        return

    value = _value_mismatch(e, a) if numel else None
    if value is not None:
        diffs.append(Diff.VALUE)
        details.append(value["detail"])
    if not diffs:
        return
    value = value or {}
    out.append(
        Mismatch(
            path,
            tuple(diffs),
            ", ".join(details),
            max_abs=value.get("max_abs"),
            max_ulp=value.get("max_ulp"),
            num_different=value.get("num_different", 0),
            numel=numel,
            index=value.get("index"),
            expected_value=value.get("expected_value"),
            actual_value=value.get("actual_value"),
        )
    )


def _value_mismatch(e: torch.Tensor, a: torch.Tensor) -> dict[str, Any] | None:
    """Element-wise bit comparison of two same-shape, same-dtype strided tensors."""
    eb, ab = _bits(e), _bits(a)
    if torch.equal(eb, ab):
        return None
    ev, av = _real_view(e), _real_view(a)
    differ = eb != ab
    if ev.is_floating_point():
        both_nan = ev.isnan() & av.isnan()
        differ = differ & ~both_nan
        one_nan = ev.isnan() ^ av.isnan()
    else:
        one_nan = torch.zeros_like(differ)
    if e.is_complex():
        # A complex element differs when either component does.
        differ = differ.any(-1)
        one_nan = one_nan.any(-1)
    n_diff = int(differ.sum().item())
    if n_diff == 0:
        return None  # only NaN payloads differ
    res: dict[str, Any] = {"num_different": n_diff}
    n_one_nan = int(one_nan.sum().item())
    what = f"values differ in {n_diff} of {e.numel()} elements"
    if n_one_nan:
        what += f" ({n_one_nan} NaN on one side only)"
    res["detail"] = what

    # Largest absolute difference (and where), over the differing elements.
    if e.dtype == torch.bool:
        absdiff = differ.to(torch.float64)
    elif e.is_complex():
        absdiff = (e.to(torch.complex128) - a.to(torch.complex128)).abs()
    else:
        absdiff = (e.to(torch.float64) - a.to(torch.float64)).abs()
    absdiff = torch.where(differ, absdiff, torch.zeros_like(absdiff))
    if n_one_nan:
        res["max_abs"] = math.nan
        flat = int(torch.nonzero(one_nan.reshape(-1))[0].item())
    else:
        # A -0.0 vs 0.0 difference has abs diff 0 but still differs; prefer the largest, then any.
        score = torch.where(differ, absdiff + 1.0, torch.zeros_like(absdiff)).reshape(-1)
        flat = int(score.argmax().item())
        res["max_abs"] = float(absdiff.max().item())
        if ev.dtype in _ULP_INT:
            ulp = max_ulp_distance(e, a)
            res["max_ulp"] = ulp
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), e.shape)) if e.dim() else ()
    res["index"] = index
    res["expected_value"] = e[index].item() if e.dim() else e.item()
    res["actual_value"] = a[index].item() if a.dim() else a.item()
    return res


# --------------------------------------------------------------------------------------------
# Structural walk
# --------------------------------------------------------------------------------------------


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _py_float_ulp(x: float, y: float) -> int | None:
    if math.isnan(x) or math.isnan(y):
        return None

    def ordinal(v: float) -> int:
        b = _float_bits(v)
        mag = b & ((1 << 63) - 1)
        return -mag if b < 0 else mag

    return abs(ordinal(x) - ordinal(y))


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def compare_outputs(expected: Any, actual: Any, *, root: str = "out") -> list[Mismatch]:
    """Compare two (nested) outputs bitwise; return one :class:`Mismatch` per differing leaf.

    Tensors are equal when device, layout, dtype, shape and significant strides (those of
    dimensions larger than 1) agree and every element has the same bit pattern, except that
    positions where both are NaN count as equal. Python floats compare the same way; other scalars
    and objects with ``==`` and an exact type match. Containers (tuple, list, ``torch.Size``, named
    tuples, dicts, dataclass instances) are walked; a different container type or length, or
    different dict keys, is a ``Diff.STRUCTURE``/``Diff.TYPE`` mismatch and the common part is
    still compared. ``requires_grad`` and tensor subclass types are not compared.

    Paths read like Python: ``out[1]['h']``, ``out.logits``.
    """
    out: list[Mismatch] = []
    _walk(root, expected, actual, out)
    return out


def _walk(path: str, e: Any, a: Any, out: list[Mismatch]) -> None:
    if isinstance(e, torch.Tensor) or isinstance(a, torch.Tensor):
        if not (isinstance(e, torch.Tensor) and isinstance(a, torch.Tensor)):
            out.append(Mismatch(path, (Diff.TYPE,), f"type {type(e).__name__} vs {type(a).__name__}"))
            return
        _compare_tensors(path, e, a, out)
        return
    if dataclasses.is_dataclass(e) and not isinstance(e, type):
        if type(e) is not type(a):
            out.append(Mismatch(path, (Diff.TYPE,), f"type {type(e).__name__} vs {type(a).__name__}"))
            return
        for f in dataclasses.fields(e):
            _walk(f"{path}.{f.name}", getattr(e, f.name), getattr(a, f.name), out)
        return
    if isinstance(e, Mapping) and isinstance(a, Mapping):
        if type(e) is not type(a):
            out.append(Mismatch(path, (Diff.TYPE,), f"type {type(e).__name__} vs {type(a).__name__}"))
        missing = [k for k in e if k not in a]
        extra = [k for k in a if k not in e]
        if missing or extra:
            out.append(
                Mismatch(path, (Diff.STRUCTURE,), f"keys missing {missing!r}, unexpected {extra!r}")
            )
        for k in e:
            if k in a:
                _walk(f"{path}[{k!r}]", e[k], a[k], out)
        return
    if isinstance(e, (list, tuple)) and isinstance(a, (list, tuple)):
        if type(e) is not type(a):
            out.append(Mismatch(path, (Diff.TYPE,), f"type {type(e).__name__} vs {type(a).__name__}"))
        if len(e) != len(a):
            out.append(Mismatch(path, (Diff.STRUCTURE,), f"length {len(e)} vs {len(a)}"))
        named = _is_namedtuple(e) and type(e) is type(a)
        for i, (x, y) in enumerate(zip(e, a)):
            sub = f"{path}.{type(e)._fields[i]}" if named else f"{path}[{i}]"
            _walk(sub, x, y, out)
        return
    if type(e) is not type(a):
        out.append(Mismatch(path, (Diff.TYPE,), f"type {type(e).__name__} vs {type(a).__name__}"))
        return
    if isinstance(e, float):
        if (math.isnan(e) and math.isnan(a)) or _float_bits(e) == _float_bits(a):
            return
        if math.isnan(e) or math.isnan(a):
            out.append(Mismatch(path, (Diff.VALUE,), "NaN on one side only", max_abs=math.nan,
                                num_different=1, numel=1, expected_value=e, actual_value=a))
            return
        out.append(Mismatch(path, (Diff.VALUE,), "float values differ", max_abs=abs(e - a),
                            max_ulp=_py_float_ulp(e, a), num_different=1, numel=1,
                            expected_value=e, actual_value=a))
        return
    if isinstance(e, complex):
        for part in ("real", "imag"):
            _walk(f"{path}.{part}", getattr(e, part), getattr(a, part), out)
        return
    try:
        same = bool(e == a)
    except Exception as exc:  # an object whose == does not give a bool
        out.append(Mismatch(path, (Diff.ERROR,), f"cannot compare {type(e).__name__}: {exc}"))
        return
    if not same:
        detail = f"{e!r} vs {a!r}"
        if len(detail) > 200:
            detail = detail[:200] + "..."
        numeric = isinstance(e, (int, bool))
        out.append(Mismatch(path, (Diff.VALUE,), detail,
                            max_abs=float(abs(e - a)) if numeric else None,
                            num_different=1, numel=1,
                            expected_value=e if numeric else None, actual_value=a if numeric else None))


# --------------------------------------------------------------------------------------------
# Cloning real inputs exactly
# --------------------------------------------------------------------------------------------


def _clone_exact(t: torch.Tensor, storages: dict[Any, Any]) -> torch.Tensor:
    """A copy of ``t`` with the same size, stride, storage offset, dtype, device and requires_grad.

    Tensors that shared a storage share the cloned storage (``storages`` is the memo), so inputs
    that alias each other still alias, and a graph that writes through one sees it through the
    other exactly as on the real inputs.
    """
    plain = type(t) in (torch.Tensor, torch.nn.Parameter)
    if not plain or t.layout != torch.strided or t.is_conj() or t.is_neg() or t.device.type == "meta":
        return t.detach().clone(memory_format=torch.preserve_format).requires_grad_(t.requires_grad)
    storage = t.untyped_storage()
    key = (t.device, storage.data_ptr(), storage.nbytes())
    new_storage = storages.get(key) if storage.nbytes() else None
    if new_storage is None:
        new_storage = storage.clone()
        if storage.nbytes():
            storages[key] = new_storage
    ctx = torch.inference_mode() if t.is_inference() else torch.no_grad()
    with ctx:
        c = torch.empty((0,), dtype=t.dtype, device=t.device)
        c.set_(new_storage, t.storage_offset(), t.size(), t.stride())
    if t.requires_grad:
        c.requires_grad_(True)
    return c


def _snapshot(obj: Any) -> Any:
    """Deep snapshot of an output for later comparison: tensors cloned exactly, detached."""
    storages: dict[Any, Any] = {}

    def go(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return _clone_exact(x.detach(), storages)
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            return dataclasses.replace(x, **{f.name: go(getattr(x, f.name)) for f in dataclasses.fields(x) if f.init})
        if isinstance(x, Mapping):
            try:
                return type(x)((k, go(v)) for k, v in x.items())
            except Exception:
                return {k: go(v) for k, v in x.items()}
        if _is_namedtuple(x):
            return type(x)(*(go(v) for v in x))
        if isinstance(x, (list, tuple)):
            try:
                return type(x)(go(v) for v in x)
            except Exception:
                return [go(v) for v in x]
        return x

    return go(obj)


# --------------------------------------------------------------------------------------------
# verify_compiled: one graph at compile time
# --------------------------------------------------------------------------------------------


class VerifyStatus(enum.Enum):
    PASSED = "passed"
    FAILED = "failed"
    SKIPPED = "skipped"


class VerifyResult(list):
    """The mismatches of one graph (a ``list[Mismatch]``) plus how the check went.

    ``status`` is PASSED, FAILED or SKIPPED; ``reason`` says why it was skipped; ``inputs_from``
    says where the real inputs came from (``"example_inputs"`` or ``"grapharg"``); ``message`` is the
    text that was warned or raised. An empty list with ``status == SKIPPED`` is *not* a pass.
    """

    def __init__(
        self,
        mismatches: Iterable[Mismatch] = (),
        *,
        name: str,
        status: VerifyStatus,
        reason: str = "",
        inputs_from: str = "",
        message: str = "",
    ) -> None:
        super().__init__(mismatches)
        self.name = name
        self.status = status
        self.reason = reason
        self.inputs_from = inputs_from
        self.message = message

    @property
    def ok(self) -> bool:
        return self.status is VerifyStatus.PASSED

    @property
    def skipped(self) -> bool:
        return self.status is VerifyStatus.SKIPPED

    def __repr__(self) -> str:
        extra = f", reason={self.reason!r}" if self.reason else ""
        return f"VerifyResult({self.name!r}, {self.status.value}, {list.__repr__(self)}{extra})"


def reference_graph(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``gm``'s graph, sharing its parameters and submodules, to keep as the eager reference.

    NOTE: Inductor's pre-grad passes rewrite the GraphModule they are given in place, so a backend
    that wants to compare its compiled artifact with the graph *as Dynamo produced it* must take
    this copy before handing ``gm`` to Inductor. Node ``meta`` (``stack_trace``, ``grapharg``) is
    kept, so messages still point at user code.
    """
    graph = copy.deepcopy(gm.graph)
    ref = torch.fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    # Placeholder attributes Dynamo set outside meta (the source of each input).
    for old, new in zip(gm.graph.find_nodes(op="placeholder"), ref.graph.find_nodes(op="placeholder")):
        if hasattr(old, "_dynamo_source"):
            new._dynamo_source = old._dynamo_source
    return ref


def _is_fake(x: Any) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return isinstance(x, torch.Tensor) and is_fake(x)


def _concrete(x: Any) -> tuple[Any, str]:
    """A real value for one example input, or ``(None, why_not)``."""
    if isinstance(x, torch.Tensor):
        if _is_fake(x):
            return None, "is a FakeTensor"
        if x.device.type == "meta":
            return None, "is a meta tensor"
        return x, ""
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        node = x.node
        hint = node.hint if node.has_hint() else None
        if hint is None or isinstance(hint, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            try:
                from torch.fx.experimental.symbolic_shapes import guarding_hint_or_throw

                hint = guarding_hint_or_throw(x)  # reads the hint; adds no guard
            except Exception:
                return None, f"is a symbolic value ({x}) without a real hint"
        return hint, ""
    return x, ""


def _real_inputs(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> tuple[list[Any] | None, str, str]:
    """The real values to run the graph on: ``(values, where_from, why_skipped)``."""
    values, why = [], ""
    for i, x in enumerate(example_inputs):
        v, problem = _concrete(x)
        if problem:
            why = f"example input {i} {problem}"
            break
        values.append(v)
    else:
        return values, "example_inputs", ""
    # Fall back to the real tensors Dynamo traced with (kept on each placeholder's grapharg).
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    if len(placeholders) != len(example_inputs):
        return None, "", f"{why}, and the graph's placeholders do not match the example inputs"
    values = []
    for i, node in enumerate(placeholders):
        grapharg = node.meta.get("grapharg")
        if grapharg is None:
            return None, "", f"{why}, and placeholder {node.name!r} carries no real value (no grapharg)"
        try:
            example = grapharg.example
        except Exception as exc:  # the weak reference to the real tensor expired
            return None, "", f"{why}, and the real value of placeholder {node.name!r} is gone ({exc})"
        if example is None:
            example = grapharg.example_strong_ref
        v, problem = _concrete(example)
        if problem:
            return None, "", f"{why}, and the traced value of placeholder {node.name!r} {problem}"
        values.append(v)
    return values, "grapharg", ""


def _clone_inputs(values: Sequence[Any]) -> list[Any]:
    storages: dict[Any, Any] = {}
    return [_clone_exact(v, storages) if isinstance(v, torch.Tensor) else v for v in values]


def _no_fake_mode():
    try:
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        return unset_fake_temporarily()
    except ImportError:  # pragma: no cover - older torch
        import contextlib

        return contextlib.nullcontext()


class _RngState:
    """CPU (and initialized CUDA) generator states plus Python's and NumPy's, to replay and restore."""

    def __init__(self) -> None:
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        self.py = random.getstate()
        np = sys.modules.get("numpy")
        self.np = np.random.get_state() if np is not None else None

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        random.setstate(self.py)
        if self.np is not None:
            sys.modules["numpy"].random.set_state(self.np)


def _as_list(out: Any) -> list[Any]:
    if isinstance(out, (list, tuple)) and not _is_namedtuple(out):
        return list(out)
    return [out]


class _ModuleState:
    """Tensors the graph owns (buffers, ``get_attr`` constants): snapshot, detect writes, restore."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        found: dict[int, tuple[str, torch.Tensor]] = {}
        for name, buf in gm.named_buffers():
            found.setdefault(id(buf), (name, buf))
        for node in gm.graph.find_nodes(op="get_attr"):
            obj: Any = gm
            try:
                for part in str(node.target).split("."):
                    obj = getattr(obj, part)
            except AttributeError:
                continue
            if isinstance(obj, torch.Tensor) and not isinstance(obj, torch.nn.Parameter):
                found.setdefault(id(obj), (str(node.target), obj))
        self.items = list(found.values())
        self.saved = [(t._version, t.detach().clone()) for _, t in self.items]
        self.params = [(n, p, p._version) for n, p in gm.named_parameters()]

    def written(self) -> dict[str, torch.Tensor]:
        return {name: _snapshot(t) for (name, t), (v0, _) in zip(self.items, self.saved) if t._version != v0}

    def restore(self) -> None:
        with torch.no_grad():
            for (_, t), (v0, val) in zip(self.items, self.saved):
                if t._version != v0:
                    t.copy_(val)
        # Record the restored versions so the next run's writes are detected again.
        self.saved = [(t._version, val) for (_, t), (_, val) in zip(self.items, self.saved)]

    def written_params(self) -> list[str]:
        return [n for n, p, v in self.params if p._version != v]


def _user_frames(stack_trace: str) -> list[tuple[str, int, str, str]]:
    """Parse ``File "f", line n, in fn`` / source pairs out of a node's ``stack_trace``."""
    frames = []
    lines = stack_trace.splitlines()
    pattern = re.compile(r'\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<fn>.+)$')
    for i, line in enumerate(lines):
        m = pattern.match(line)
        if m:
            src = lines[i + 1].strip() if i + 1 < len(lines) else ""
            if src.startswith("File ") or set(src) <= set("^~ "):
                src = ""
            frames.append((m["file"], int(m["line"]), m["fn"].strip(), src))
    return frames


def _node_source(node: Any) -> str:
    """``file:line: source`` of the user code that produced ``node`` (innermost frame first)."""
    if not isinstance(node, torch.fx.Node):
        return f"a constant ({node!r})" if node is not None else ""
    seen: set[torch.fx.Node] = set()
    queue = [node]
    while queue:
        cur = queue.pop(0)
        if cur in seen:
            continue
        seen.add(cur)
        trace = cur.meta.get("stack_trace")
        if trace:
            frames = _user_frames(trace)
            if not frames:
                return trace.strip()
            file, line, fn, src = frames[-1]
            text = f"produced by {file}:{line} in {fn}: {src}" if src else f"produced by {file}:{line} in {fn}"
            if cur is not node:
                text += f" (nearest traced producer of {node.name!r})"
            for file, line, fn, src in reversed(frames[:-1]):
                text += f"\n  called from {file}:{line} in {fn}: {src}"
            return text
        if cur.op == "placeholder":
            if cur is node:
                return f"the graph input {cur.name!r} returned unchanged"
            continue
        queue.extend(cur.all_input_nodes)
    return f"no user stack trace on {node.name!r} or its inputs"


def _writes_in_place(node: torch.fx.Node) -> bool:
    if node.op == "call_method":
        return str(node.target).endswith("_")
    if node.op == "call_function":
        schema = getattr(node.target, "_schema", None)
        if schema is not None:
            return bool(schema.is_mutable)
        return getattr(node.target, "__name__", "").endswith("_")
    return False


def _output_nodes(gm: torch.fx.GraphModule) -> list[Any]:
    out = gm.graph.output_node()
    result = out.args[0] if out.args else None
    if isinstance(result, (list, tuple)):
        return list(result)
    return [result]


def _attach_sources(gm: torch.fx.GraphModule, mismatches: list[Mismatch]) -> list[Mismatch]:
    nodes = _output_nodes(gm)
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    res = []
    for m in mismatches:
        source = ""
        hit = re.match(r"out\[(\d+)\]", m.path)
        if hit and int(hit[1]) < len(nodes):
            target = nodes[int(hit[1])]
            if isinstance(target, (list, tuple, dict)):
                inner: list[torch.fx.Node] = []
                torch.fx.node.map_arg(target, lambda n: inner.append(n) or n)
                source = "\n".join(_node_source(n) for n in inner[:3])
            else:
                source = _node_source(target)
        hit = re.match(r"input\[(\d+)\]", m.path)
        if hit and int(hit[1]) < len(placeholders):
            node = placeholders[int(hit[1])]
            writers = [u for u in node.users if _writes_in_place(u)] or [u for u in node.users if u.op != "output"]
            source = f"graph input {node.name!r}, written in place"
            if writers:
                source += " by\n" + "\n".join(_node_source(u) for u in writers[:3])
        res.append(dataclasses.replace(m, source=source) if source else m)
    return res


def verify_compiled(
    gm: torch.fx.GraphModule,
    compiled_fn: Callable[..., Any],
    example_inputs: Sequence[Any],
    *,
    strict: bool,
    name: str,
) -> VerifyResult:
    """Run ``gm`` as FX (eager) and ``compiled_fn`` on clones of the real inputs; compare bitwise.

    ``gm`` is the reference: pass :func:`reference_graph` of Dynamo's graph when the compiler may
    rewrite ``gm`` in place (Inductor does). ``compiled_fn`` is called the way Dynamo calls it
    (``compiled_fn(*args)``; Dynamo ignores ``_boxed_call`` here). ``example_inputs`` are
    what the backend received; FakeTensors and SymInts are replaced by the real values Dynamo traced
    with where it left them (see module docstring).

    Each run gets its own exact clones of the inputs (same strides, storage offsets and aliasing),
    starts from the same RNG state, and the caller's RNG state, the inputs and the module's buffers
    are left as they were. Every output is compared with :func:`compare_outputs`, and so is every
    input or buffer that either run wrote in place.

    On a mismatch: one :class:`VerificationWarning` for the graph (and one ``log.warning``) naming
    each differing output, the max abs difference, the ULP distance and the user lines that produced
    it; with ``strict`` a :class:`~torchsync_pass.errors.VerificationError` with the same text
    instead. When the check cannot run (only fake inputs, the FX graph raises), the result has
    ``status == SKIPPED`` and a reason, and a :class:`VerificationSkippedWarning` says so (``strict``:
    an error). Returns a :class:`VerifyResult`, a ``list[Mismatch]`` that is empty when it passed.
    """
    values, inputs_from, why = _real_inputs(gm, example_inputs)
    if values is None:
        return _skip(name, why, strict)

    with _no_fake_mode():
        rng = _RngState()
        state = _ModuleState(gm)
        ref_inputs = _clone_inputs(values)
        ref_versions = [v._version if isinstance(v, torch.Tensor) else None for v in ref_inputs]
        try:
            expected = gm(*ref_inputs)
        except Exception as exc:
            rng.restore()
            state.restore()
            log.warning("nosync verify: graph %s: the eager FX graph raised on the real inputs", name, exc_info=True)
            return _skip(name, f"the eager FX graph raised {type(exc).__name__}: {exc}", strict)
        ref_written = state.written()
        state.restore()
        rng.restore()

        act_inputs = _clone_inputs(values)
        act_versions = [v._version if isinstance(v, torch.Tensor) else None for v in act_inputs]
        mismatches: list[Mismatch] = []
        try:
            actual = compiled_fn(*act_inputs)  # as Dynamo's bytecode calls it
        except Exception as exc:
            log.debug("nosync verify: graph %s: compiled artifact raised", name, exc_info=True)
            actual = None
            mismatches.append(Mismatch("out", (Diff.ERROR,), f"the compiled graph raised {type(exc).__name__}: {exc}"))
        act_written = state.written()
        state.restore()
        rng.restore()

    if actual is not None or not mismatches:
        exp_list, act_list = _as_list(expected), _as_list(actual)
        if len(exp_list) != len(act_list):
            mismatches.append(Mismatch("out", (Diff.STRUCTURE,), f"{len(exp_list)} outputs vs {len(act_list)}"))
        for i, (e, a) in enumerate(zip(exp_list, act_list)):
            mismatches.extend(compare_outputs(e, a, root=f"out[{i}]"))
        # Inputs either run wrote in place must end up the same.
        for i, (r, a) in enumerate(zip(ref_inputs, act_inputs)):
            if isinstance(r, torch.Tensor) and (r._version != ref_versions[i] or a._version != act_versions[i]):
                mismatches.extend(compare_outputs(r, a, root=f"input[{i}]"))
        for key in sorted(set(ref_written) | set(act_written)):
            if key not in ref_written or key not in act_written:
                who = "compiled graph" if key in act_written else "eager FX graph"
                mismatches.append(Mismatch(f"gm.{key}", (Diff.VALUE,), f"written in place only by the {who}"))
            else:
                mismatches.extend(compare_outputs(ref_written[key], act_written[key], root=f"gm.{key}"))
    written_params = state.written_params()
    if written_params:
        log.warning(
            "nosync verify: graph %s wrote parameters %s in place; verification ran it twice", name, written_params
        )

    if not mismatches:
        log.debug("nosync verify: graph %s: %d outputs bitwise equal to eager", name, len(_as_list(expected)))
        return VerifyResult(name=name, status=VerifyStatus.PASSED, inputs_from=inputs_from)

    mismatches = _attach_sources(gm, mismatches)
    n_out = len(_as_list(expected))
    bad_outputs = {re.match(r"out\[\d+\]", m.path)[0] for m in mismatches if re.match(r"out\[\d+\]", m.path)}
    others = [m.path for m in mismatches if not re.match(r"out\[\d+\]", m.path)]
    if any(m.diffs == (Diff.ERROR,) for m in mismatches):
        head = f"nosync verify: graph {name!r}: the compiled graph raised on inputs the eager FX graph accepts"
    else:
        what = f"{len(bad_outputs)} of {n_out} outputs differ" if bad_outputs else "all outputs equal"
        if others:
            what += f"; also {', '.join(others)}"
        head = f"nosync verify: graph {name!r}: compiled graph is not bitwise equal to eager ({what})"
    hint = (
        "set options={'verify': False} to skip this check"
        if strict
        else "set options={'strict': True} to raise instead of warning"
    )
    message = f"{head}\n{_indent(format_mismatches(mismatches), '  ')}\n  ({hint})"
    result = VerifyResult(mismatches, name=name, status=VerifyStatus.FAILED, inputs_from=inputs_from, message=message)
    if strict:
        raise VerificationError(message)
    log.warning("%s", message)
    warnings.warn(message, VerificationWarning, stacklevel=2)
    return result


def _skip(name: str, why: str, strict: bool) -> VerifyResult:
    message = (
        f"nosync verify: graph {name!r}: verification skipped: {why}; "
        "the compiled graph was NOT checked against eager"
    )
    if strict:
        raise VerificationError(message + " (options['strict'] is set, so this is an error)")
    log.warning("%s", message)
    warnings.warn(message, VerificationSkippedWarning, stacklevel=3)
    return VerifyResult(name=name, status=VerifyStatus.SKIPPED, reason=why, message=message)


# --------------------------------------------------------------------------------------------
# verify_loop: a whole per-step loop, eager against each compiled mode
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LoopMode:
    """One way of running the step in :func:`verify_loop`.

    ``backend`` and ``options`` go to ``torch.compile`` (with ``compile_kwargs`` such as
    ``dynamic``/``fullgraph``). ``must_equal`` names the run whose outputs this mode must reproduce
    bitwise (``"eager"``, another mode's name, or ``None`` for "report the difference only").
    ``step`` compiles another callable instead of the loop's step (a hand-hoisted reference); it is
    deep-copied together with the step, so a bound method of the same module binds to the copy.
    """

    name: str
    backend: Any
    options: Mapping[str, Any] | None = None
    must_equal: str | None = "eager"
    step: Callable[..., Any] | None = None
    compile_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def describe_backend(self) -> str:
        b = self.backend if isinstance(self.backend, str) else getattr(self.backend, "__name__", repr(self.backend))
        return f"{b} {dict(self.options)}" if self.options else str(b)


_PRESETS = {
    "nosync-eager": lambda: LoopMode("nosync-eager", "nosync", {"codegen": "eager"}, must_equal="eager"),
    "nosync-inductor": lambda: LoopMode("nosync-inductor", "nosync", {"codegen": "inductor"}, must_equal="inductor"),
    "inductor": lambda: LoopMode("inductor", "inductor", None, must_equal=None),
    "aot_eager": lambda: LoopMode("aot_eager", "aot_eager", None, must_equal="eager"),
    "dynamo-eager": lambda: LoopMode("dynamo-eager", "eager", None, must_equal="eager"),
}


def resolve_modes(
    modes: Iterable[str | LoopMode],
    options: Mapping[str, Any] | None = None,
    hoisted: Callable[..., Any] | None = None,
) -> list[LoopMode]:
    """The :class:`LoopMode` list :func:`verify_loop` runs for ``modes`` (presets expanded, references added)."""
    out: list[LoopMode] = []
    for m in modes:
        if isinstance(m, LoopMode):
            out.append(m)
        elif isinstance(m, str) and m in _PRESETS:
            out.append(_PRESETS[m]())
        elif m == "eager":
            raise ValueError("'eager' is the reference that every mode is compared with; do not list it in modes")
        else:
            raise ValueError(f"unknown mode {m!r}: use one of {sorted(_PRESETS)} or a LoopMode")
    if options:
        out = [
            dataclasses.replace(m, options={**(m.options or {}), **options}) if m.backend == "nosync" else m
            for m in out
        ]
    if hoisted is not None:
        out.append(LoopMode("inductor-hoisted", "inductor", None, must_equal=None, step=hoisted))
        out = [
            dataclasses.replace(m, must_equal="inductor-hoisted") if m.name == "nosync-inductor" else m for m in out
        ]
    names = [m.name for m in out]
    if len(set(names)) != len(names):
        raise ValueError(f"mode names must be unique, got {names}")
    for m in list(out):
        if m.must_equal not in (None, "eager") and m.must_equal not in names:
            if m.must_equal in _PRESETS:
                out.append(_PRESETS[m.must_equal]())
                names.append(m.must_equal)
            else:
                raise ValueError(f"mode {m.name!r} must equal {m.must_equal!r}, which is not a mode")
    return out


@dataclasses.dataclass(frozen=True)
class StepMismatch:
    """A difference found at one step (``phase == "step"``) or in the state after the loop (``"final"``)."""

    step: int
    reference: str
    mismatch: Mismatch
    phase: str = "step"

    def describe(self) -> str:
        where = f"step {self.step}" if self.phase == "step" else "final state"
        return f"{where}, vs {self.reference}: {self.mismatch.summary()}"

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "phase": self.phase, "reference": self.reference, "mismatch": self.mismatch.to_json()}


@dataclasses.dataclass(frozen=True)
class ModeReport:
    """What one mode did over the loop, compared with eager and with its bitwise reference."""

    name: str
    backend: str
    must_equal: str | None
    steps_run: int
    expected_steps: int
    graphs: int
    mismatches: tuple[StepMismatch, ...] = ()
    diverging_steps: int = 0
    eager_max_abs: float | None = None
    eager_max_ulp: int | None = None
    eager_first_step: int | None = None
    error: str | None = None

    @property
    def first_divergence(self) -> StepMismatch | None:
        return self.mismatches[0] if self.mismatches else None

    @property
    def ok(self) -> bool:
        return self.error is None and not self.mismatches and self.steps_run == self.expected_steps

    def describe(self) -> str:
        status = "ok" if self.ok else "FAILED"
        graphs = f"{self.graphs} graph{'' if self.graphs == 1 else 's'} compiled"
        head = f"{self.name:<18} {status:<7} {self.steps_run} steps, {graphs} [{self.backend}]"
        lines = [head]
        if self.error:
            lines.append(f"    error: {self.error}")
        if self.steps_run != self.expected_steps and not self.error:
            lines.append(f"    ran {self.steps_run} steps, eager ran {self.expected_steps}")
        if self.must_equal:
            if self.mismatches:
                first = self.mismatches[0]
                lines.append(f"    first divergence from {self.must_equal}: {first.describe()}")
                lines.append(f"    {self.diverging_steps} of {self.steps_run} steps differ from {self.must_equal}")
            elif self.steps_run:
                lines.append(f"    bitwise equal to {self.must_equal} on every step")
        if self.must_equal != "eager" and self.steps_run:
            if self.eager_first_step is None:
                lines.append("    vs eager: bitwise equal on every step")
            else:
                ulp = "n/a" if self.eager_max_ulp is None else str(self.eager_max_ulp)
                lines.append(
                    f"    vs eager: max abs diff {_fmt_float(self.eager_max_abs or 0.0)}, max ULP {ulp} "
                    f"(first difference at step {self.eager_first_step}; reported, not required equal)"
                )
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "backend": self.backend,
            "must_equal": self.must_equal,
            "ok": self.ok,
            "steps_run": self.steps_run,
            "expected_steps": self.expected_steps,
            "graphs": self.graphs,
            "first_divergence": self.first_divergence.to_json() if self.first_divergence else None,
            "diverging_steps": self.diverging_steps,
            "mismatches": [m.to_json() for m in self.mismatches],
            "vs_eager": {
                "max_abs": _json_float(self.eager_max_abs),
                "max_ulp": self.eager_max_ulp,
                "first_step": self.eager_first_step,
            },
            "error": self.error,
        }


@dataclasses.dataclass(frozen=True)
class LoopReport:
    """Result of :func:`verify_loop`: the eager step count and one :class:`ModeReport` per mode."""

    steps: int
    modes: tuple[ModeReport, ...]

    @property
    def ok(self) -> bool:
        return all(m.ok for m in self.modes)

    def __getitem__(self, name: str) -> ModeReport:
        for m in self.modes:
            if m.name == name:
                return m
        raise KeyError(name)

    def __str__(self) -> str:
        status = "ok" if self.ok else "FAILED"
        lines = [f"verify_loop: {self.steps} eager steps, {len(self.modes)} modes: {status}"]
        lines.extend(_indent(m.describe(), "  ") for m in self.modes)
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "steps": self.steps,
            "modes": [m.to_json() for m in self.modes],
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2)


def _module_of(step: Any) -> torch.nn.Module | None:
    if isinstance(step, torch.nn.Module):
        return step
    owner = getattr(step, "__self__", None)
    return owner if isinstance(owner, torch.nn.Module) else None


def _module_state(step: Any) -> dict[str, torch.Tensor]:
    mod = _module_of(step)
    if mod is None:
        return {}
    state = {n: p for n, p in mod.named_parameters()}
    state.update({n: b for n, b in mod.named_buffers()})
    return state


def _check_call(item: Any, i: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if (
        not isinstance(item, (tuple, list))
        or len(item) != 2
        or not isinstance(item[0], (tuple, list))
        or not isinstance(item[1], Mapping)
    ):
        raise TypeError(
            f"verify_loop: call {i} must be an (args, kwargs) pair such as ((x, t), {{}}), got {type(item).__name__}"
        )
    return tuple(item[0]), dict(item[1])


class _Run:
    """One pass over the loop: the step (plain or compiled), its own copy of calls and state."""

    def __init__(self, step: Any, calls: Any, state: Any, steps: int | None) -> None:
        self.step = step
        self.calls = calls
        self.state = state
        self.steps = steps

    def __iter__(self):
        prev = None
        i = 0
        while self.steps is None or i < self.steps:
            if callable(self.calls):
                item = self.calls(i, self.state, prev)
                if item is None:
                    return
            else:
                if i >= len(self.calls):
                    return
                item = self.calls[i]
            args, kwargs = _check_call(item, i)
            prev = self.step(*args, **kwargs)
            yield i, prev
            i += 1


def _compile_supports_isolation() -> bool:
    try:
        return "isolate_recompiles" in inspect.signature(torch.compile).parameters
    except (TypeError, ValueError):  # pragma: no cover
        return False


def _unique_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def verify_loop(
    step: Callable[..., Any],
    calls: Iterable[tuple[Sequence[Any], Mapping[str, Any]]] | Callable[[int, Any, Any], Any],
    *,
    modes: Sequence[str | LoopMode] = ("nosync-eager", "nosync-inductor", "inductor"),
    setup: Callable[[], Any] | None = None,
    steps: int | None = None,
    options: Mapping[str, Any] | None = None,
    hoisted: Callable[..., Any] | None = None,
    compile_kwargs: Mapping[str, Any] | None = None,
    max_mismatches: int = 20,
) -> LoopReport:
    """Run a per-step loop eagerly and under each compiled mode; compare every step bitwise.

    Args:
        step: the uncompiled step, a function or an ``nn.Module`` (or a bound method of one). Each
            mode gets its own ``copy.deepcopy`` of it, so modes never share parameters or buffers;
            a plain function is shared (``deepcopy`` keeps functions), so keep loop state in the
            module, the calls or ``setup``'s state rather than in globals.
        calls: what to call the step with, either
            * a list (or any iterable, read once) of ``(args, kwargs)`` pairs, one per step:
              ``[((x, t0), {}), ((x, t1), {})]``; or
            * a function ``calls(i, state, prev) -> (args, kwargs) | None`` producing step ``i``'s
              arguments from the carried ``state`` (what ``setup()`` returned) and ``prev``, this
              mode's output of step ``i - 1`` (``None`` at step 0). Return ``None`` to end the loop.
              It may update ``state`` in place (``state["x"] = state["x"] - prev / n``), which is
              how a denoising loop carries its latents.
        modes: compiled modes to run, by name or as :class:`LoopMode`. ``"nosync-eager"``
            (``backend="nosync"``, ``codegen="eager"``) must equal eager bitwise;
            ``"nosync-inductor"`` must equal stock ``"inductor"`` bitwise (added if not listed) and
            its difference from eager is reported as max abs / ULP; ``"inductor"`` is reported
            against eager only. Also ``"aot_eager"`` and ``"dynamo-eager"`` (must equal eager).
        setup: ``setup() -> state``, called once; every run (eager and each mode) gets a deep copy.
        steps: stop after this many steps (default: all of ``calls``, or until it returns ``None``).
        options: extra options for the nosync modes (``{"invariant": [...]}``).
        hoisted: the hand-hoisted step (request-invariant values passed as Python constants). If
            given, stock Inductor on it becomes the bitwise reference of ``"nosync-inductor"``,
            which is the exact one (removing a break lets Inductor fuse across it, so stock Inductor
            on the split original may legitimately differ by an ULP).
        compile_kwargs: more ``torch.compile`` arguments for every mode (``dynamic``, ``fullgraph``).
        max_mismatches: at most this many differing steps are kept per mode (all are counted).

    The step, calls and state are deep-copied *together* for each run, so aliasing between them
    (a buffer passed as an argument, one tensor used at every step) is the same in every run.
    Every run starts from the same torch/CUDA/Python/NumPy RNG state, and the caller's RNG state is
    restored at the end. Each mode is compiled with ``isolate_recompiles=True`` where torch has it,
    so modes do not share Dynamo cache entries or recompile budgets and nothing calls
    ``torch._dynamo.reset()``. Outputs are compared right after each step (before ``calls`` sees
    them); after the loop the module's parameters and buffers, the state and the (possibly
    mutated) call arguments are compared too (``phase == "final"``). An exception in a mode is
    recorded as that mode's ``error``; one in the eager run is re-raised.

    Returns:
        a :class:`LoopReport`; ``report.ok``, ``report["nosync-eager"].first_divergence``,
        ``print(report)``, ``report.to_json()``.
    """
    resolved = resolve_modes(modes, options, hoisted)
    if not callable(calls):
        calls = list(calls)
        for i, item in enumerate(calls):
            _check_call(item, i)
    state0 = setup() if setup is not None else None
    extra_steps = tuple(m.step for m in resolved if m.step is not None)
    originals = (step, extra_steps, calls, state0)
    needed = {m.must_equal for m in resolved if m.must_equal not in (None, "eager")}
    isolate = _compile_supports_isolation()

    rng = _RngState()
    try:
        # ---- eager reference: snapshot every step's outputs
        eager_step, _, eager_calls, eager_state = copy.deepcopy(originals)
        eager_outs: list[Any] = []
        try:
            for _, out in _Run(eager_step, eager_calls, eager_state, steps):
                eager_outs.append(_snapshot(out))
        finally:
            rng.restore()
        eager_final = _snapshot(_final_state(eager_step, eager_calls, eager_state))
        n = len(eager_outs)

        reference_outs: dict[str, list[Any]] = {}
        reports: dict[str, ModeReport] = {}
        for mode in _execution_order(resolved):
            reports[mode.name] = _run_mode(
                mode, originals, steps, n, eager_outs, eager_final, reference_outs,
                keep=mode.name in needed, isolate=isolate, compile_kwargs=compile_kwargs or {},
                max_mismatches=max_mismatches, rng=rng,
            )
        return LoopReport(steps=n, modes=tuple(reports[m.name] for m in resolved))
    finally:
        rng.restore()


def _execution_order(modes: list[LoopMode]) -> list[LoopMode]:
    """References before the modes that must equal them."""
    done: list[LoopMode] = []
    names = {m.name: m for m in modes}

    def visit(m: LoopMode, stack: tuple[str, ...]) -> None:
        if m in done:
            return
        if m.name in stack:
            raise ValueError(f"modes reference each other in a cycle: {stack + (m.name,)}")
        if m.must_equal in names:
            visit(names[m.must_equal], stack + (m.name,))
        done.append(m)

    for m in modes:
        visit(m, ())
    return done


def _final_state(step: Any, calls: Any, state: Any) -> dict[str, Any]:
    final: dict[str, Any] = {"module": _module_state(step)}
    if state is not None:
        final["state"] = state
    if not callable(calls):
        final["calls"] = calls
    return final


def _run_mode(
    mode: LoopMode,
    originals: tuple[Any, ...],
    steps: int | None,
    n: int,
    eager_outs: list[Any],
    eager_final: Any,
    reference_outs: dict[str, list[Any]],
    *,
    keep: bool,
    isolate: bool,
    compile_kwargs: Mapping[str, Any],
    max_mismatches: int,
    rng: _RngState,
) -> ModeReport:
    step, extra_steps, calls, state = copy.deepcopy(originals)
    target = step
    if mode.step is not None:
        target = extra_steps[[s is mode.step for s in originals[1]].index(True)]
    kwargs: dict[str, Any] = {**compile_kwargs, **mode.compile_kwargs}
    if isolate:
        kwargs.setdefault("isolate_recompiles", True)
    if mode.options:
        kwargs["options"] = dict(mode.options)
    compiled = torch.compile(target, backend=mode.backend, **kwargs)
    log.debug("verify_loop: running mode %s (%s)", mode.name, mode.describe_backend())

    ref_name = mode.must_equal
    ref_outs = eager_outs if ref_name == "eager" else reference_outs.get(ref_name) if ref_name else None
    mismatches: list[StepMismatch] = []
    diverging = 0
    e_abs: float | None = None
    e_ulp: int | None = None
    e_first: int | None = None
    ran = 0
    error = None
    kept: list[Any] = []
    graphs0 = _unique_graphs()
    rng.restore()
    try:
        for i, out in _Run(compiled, calls, state, steps):
            ran = i + 1
            if keep:
                kept.append(_snapshot(out))
            if i >= n:
                continue  # ran longer than eager; reported through steps_run
            vs_eager = compare_outputs(eager_outs[i], out)
            if vs_eager:
                if e_first is None:
                    e_first = i
                e_abs, e_ulp = _accumulate(vs_eager, e_abs, e_ulp)
            if ref_outs is not None and i < len(ref_outs):
                found = vs_eager if ref_name == "eager" else compare_outputs(ref_outs[i], out)
                if found:
                    diverging += 1
                    if len(mismatches) < max_mismatches:
                        mismatches.extend(StepMismatch(i, ref_name, m) for m in found[:3])
        if ref_name == "eager":
            final = compare_outputs(eager_final, _final_state(step, calls, state), root="final")
            mismatches.extend(StepMismatch(ran, "eager", m, phase="final") for m in final[:max_mismatches])
    except Exception as exc:
        log.warning("verify_loop: mode %s raised at step %d", mode.name, ran, exc_info=True)
        error = f"{type(exc).__name__} at step {ran}: {exc}"
    finally:
        rng.restore()
    if keep:
        reference_outs[mode.name] = kept
    return ModeReport(
        name=mode.name,
        backend=mode.describe_backend(),
        must_equal=ref_name,
        steps_run=ran,
        expected_steps=n,
        graphs=_unique_graphs() - graphs0,
        mismatches=tuple(mismatches),
        diverging_steps=diverging,
        eager_max_abs=e_abs,
        eager_max_ulp=e_ulp,
        eager_first_step=e_first,
        error=error,
    )


def _accumulate(found: list[Mismatch], max_abs: float | None, max_ulp: int | None) -> tuple[float | None, int | None]:
    for m in found:
        if m.max_abs is not None:
            if max_abs is None or math.isnan(m.max_abs) or (not math.isnan(max_abs) and m.max_abs > max_abs):
                max_abs = m.max_abs
        if m.max_ulp is not None and (max_ulp is None or m.max_ulp > max_ulp):
            max_ulp = m.max_ulp
    return max_abs, max_ulp

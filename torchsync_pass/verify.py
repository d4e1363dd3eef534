"""Bitwise verification of compiled graphs against eager (the loop comparison is in loop.py).

A sync-removal pass is only worth using if it provably never changes a result, so "equal" here is
strict: two tensors are equal when they have the same dtype, shape, significant strides and device
and the same *bit patterns* element by element (``-0.0`` and ``0.0`` differ, and so do two NaNs
with another sign or payload). ``torch.allclose`` is never used. Where a difference is
expected (Inductor against eager on CPU) it is *reported* as the largest absolute difference and the
largest distance in units in the last place (ULP), never hidden behind a tolerance.

Two layers here, each usable alone, and a third in :mod:`torchsync_pass.loop`:

* :func:`compare_outputs` walks two arbitrary nested outputs (tensors, pytree containers such as
  tuples, lists, dicts and named tuples, dataclasses, Python scalars) and returns one
  :class:`Mismatch` record per differing leaf, named by its path (``out[1]['h']``).
* :func:`verify_compiled` is what the nosync backend calls with ``options["verify"]``: it runs the
  Dynamo graph as FX (eager) and the compiled artifact on clones of the real example inputs and
  compares every output and every input the graph mutates. A mismatch is one warning per graph that
  names the output, the differences and the user lines that produced it (``strict``: an error).
* :func:`torchsync_pass.loop.verify_loop` runs a whole per-step loop eagerly and under each compiled
  mode and reports the first step and tensor at which a mode diverges.

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
import logging
import math
import operator
import random
import re
import sys
import textwrap
import warnings
from typing import Any, Callable, Iterable, Sequence

import torch

from . import _torch_private as private
from .cone import _nodes_in, user_frames, written_nodes
from .errors import VerificationError
from .guards import value_key
from .inop import unstored

log = logging.getLogger(__name__)

__all__ = [
    "Diff",
    "Mismatch",
    "VerificationSkippedWarning",
    "VerificationWarning",
    "VerifyResult",
    "VerifyStatus",
    "compare_outputs",
    "format_mismatches",
    "max_ulp_distance",
    "reference_graph",
    "snapshot",
    "verify_compiled",
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
    sits on one side only, or when only NaNs' sign or payload bits differ); ``max_ulp`` the largest
    distance in units in the last place, for float16, bfloat16, float32 and float64 (complex: per
    component), ``None`` where undefined.
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

    def summary(self) -> str:
        """One line: path, what differs, max abs and ULP."""
        parts = [f"{self.path}: {self.detail}"]
        if self.max_abs is not None:
            parts.append(f"max abs diff {self.max_abs:.6g}")
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
            text += "\n" + textwrap.indent(self.source, "    ")
        return text

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.update(diffs=[x.value for x in self.diffs], index=list(self.index) if self.index is not None else None)
        return {k: json_scalar(v) for k, v in d.items()}


def format_mismatches(mismatches: Iterable[Mismatch], *, limit: int = 10) -> str:
    """Render mismatches one per line (with their source lines), at most ``limit`` of them."""
    items = list(mismatches)
    if not items:
        return "(bitwise equal)"
    lines = [m.describe() for m in items[:limit]]
    if len(items) > limit:
        lines.append(f"... and {len(items) - limit} more")
    return "\n".join(lines)


def json_scalar(x: Any) -> Any:
    """``x`` as JSON holds it: ``nan``/``inf`` as strings, other non-JSON scalars as their repr."""
    if isinstance(x, float):
        return x if math.isfinite(x) else str(x)
    return x if x is None or isinstance(x, (bool, int, str, list)) else repr(x)


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
    t = _real_view(t).resolve_neg()
    if t.dtype == torch.bool:
        return t.to(torch.uint8)
    return t.view(_INT_OF_SIZE[t.element_size()])


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
    e = _real_view(expected).detach().resolve_neg()  # a view refuses a tensor with the negative bit
    a = _real_view(actual).detach().resolve_neg()
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
    for diff, x, y in ((Diff.DEVICE, e.device, a.device), (Diff.LAYOUT, e.layout, a.layout),
                       (Diff.DTYPE, e.dtype, a.dtype), (Diff.SHAPE, list(e.shape), list(a.shape))):
        if x != y:
            diffs.append(diff)
            details.append(f"{diff.value} {x} vs {y}")
    if Diff.SHAPE in diffs:
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
        max_abs = None
        if numel:
            common = torch.promote_types(e.dtype, a.dtype)
            if not torch.equal(e.to(common), a.to(common)):
                diffs.append(Diff.VALUE)
                details.append("values differ after promotion to " + str(common))
            max_abs = float((_real_view(e.to(common)).double() - _real_view(a.to(common)).double()).abs().max())
        out.append(Mismatch(path, tuple(diffs), ", ".join(details), max_abs=max_abs, numel=numel))
        return

    value = _value_mismatch(e, a) if numel else None
    if value is not None:
        diffs.append(Diff.VALUE)
        details.append(value.pop("detail"))
    if diffs:
        out.append(Mismatch(path, tuple(diffs), ", ".join(details), numel=numel, **(value or {"num_different": 0})))


def _value_mismatch(e: torch.Tensor, a: torch.Tensor) -> dict[str, Any] | None:
    """Element-wise bit comparison of two same-shape, same-dtype strided tensors."""
    eb, ab = _bits(e), _bits(a)
    if torch.equal(eb, ab):
        return None
    ev, av = _real_view(e), _real_view(a)
    differ = eb != ab
    if ev.is_floating_point():
        e_nan, a_nan = ev.isnan(), av.isnan()
        one_nan = e_nan ^ a_nan
        nan_bits = differ & e_nan & a_nan  # NaN on both sides, with another sign or payload
    else:
        one_nan = nan_bits = torch.zeros_like(differ)
    if e.is_complex():
        # A complex element differs when either component does.
        differ, one_nan, nan_bits = differ.any(-1), one_nan.any(-1), nan_bits.any(-1)
    n_diff = int(differ.sum().item())
    res: dict[str, Any] = {"num_different": n_diff}
    n_one_nan, n_nan_bits = int(one_nan.sum().item()), int(nan_bits.sum().item())
    what = f"values differ in {n_diff} of {e.numel()} elements"
    if n_one_nan:
        what += f" ({n_one_nan} NaN on one side only)"
    if n_nan_bits:
        what += f" ({n_nan_bits} NaN on both sides with another sign or payload)"
    res["detail"] = what

    # Largest absolute difference (and where), over the differing elements that are numbers on
    # both sides.
    numeric = differ & ~one_nan & ~nan_bits
    if e.dtype == torch.bool:
        absdiff = differ.to(torch.float64)
    elif e.is_complex():
        absdiff = (e.to(torch.complex128) - a.to(torch.complex128)).abs()
    else:
        absdiff = (e.to(torch.float64) - a.to(torch.float64)).abs()
    absdiff = torch.where(numeric, absdiff, torch.zeros_like(absdiff))
    if n_one_nan or not bool(numeric.any()):  # shown: a NaN on one side, else NaNs' bits
        res["max_abs"] = math.nan
        flat = int(torch.nonzero((one_nan if n_one_nan else nan_bits).reshape(-1))[0].item())
    else:
        # A -0.0 vs 0.0 difference has abs diff 0 but still differs; prefer the largest, then any.
        score = torch.where(numeric, absdiff + 1.0, torch.zeros_like(absdiff)).reshape(-1)
        flat = int(score.argmax().item())
        res["max_abs"] = float(absdiff.max().item())
        if ev.dtype in _ULP_INT:
            ulp = max_ulp_distance(e, a)
            res["max_ulp"] = ulp
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), e.shape)) if e.dim() else ()
    res["index"] = index
    res["expected_value"] = e[index].item() if e.dim() else e.item()
    res["actual_value"] = a[index].item() if a.dim() else a.item()
    if not e.is_complex() and bool(nan_bits.reshape(-1)[flat]):  # "expected nan, got nan": the bits
        width = 2 * e.element_size()
        bits = [int(b.reshape(-1)[flat].item()) & ((1 << 4 * width) - 1) for b in (eb, ab)]
        res["detail"] += f"; at {list(index)}: bits 0x{bits[0]:0{width}x} vs 0x{bits[1]:0{width}x}"
    return res


# --------------------------------------------------------------------------------------------
# Structural walk
# --------------------------------------------------------------------------------------------


def compare_outputs(expected: Any, actual: Any, *, root: str = "out") -> list[Mismatch]:
    """Compare two (nested) outputs bitwise; return one :class:`Mismatch` per differing leaf.

    Tensors are equal when device, layout, dtype, shape and significant strides (those of
    dimensions larger than 1) agree and every element has the same bit pattern (two NaNs with
    another sign or payload differ). Python floats compare the same way; other scalars
    and objects with ``==`` and an exact type match. Containers (the pytree ones: tuple, list,
    ``torch.Size``, named tuples, dicts, registered classes; and dataclass instances) are walked: a
    different container type is a ``Diff.TYPE`` mismatch, a different length or key set a
    ``Diff.STRUCTURE`` one, and the common part is still compared. ``requires_grad`` and tensor
    subclass types are not compared.

    Paths read like Python: ``out[1]['h']``, ``out.logits``.
    """
    out: list[Mismatch] = []
    _walk(root, expected, actual, out)
    return out


def _children(x: Any) -> dict[Any, tuple[str, Any]] | None:
    """``{key: (path piece, child)}`` of a container, ``None`` for a leaf (tensors are leaves)."""
    if isinstance(x, torch.Tensor):
        return None
    if _is_dataclass(x):
        return {f.name: (f".{f.name}", getattr(x, f.name)) for f in dataclasses.fields(x)}
    return private.children(x)


def _walk(path: str, e: Any, a: Any, out: list[Mismatch]) -> None:
    if isinstance(e, torch.Tensor) and isinstance(a, torch.Tensor):  # subclasses are not compared
        _compare_tensors(path, e, a, out)
        return
    if _is_numpy(e) and _is_numpy(a) and type(e) is type(a):
        _compare_numpy(path, e, a, out)
        return
    ce, ca = _children(e), _children(a)
    if type(e) is not type(a):
        out.append(Mismatch(path, (Diff.TYPE,), f"type {type(e).__name__} vs {type(a).__name__}"))
        if ce is None or ca is None:
            return
    if ce is not None and ca is not None:
        if ce.keys() != ca.keys():
            sequences = isinstance(e, (list, tuple)) and isinstance(a, (list, tuple))
            missing, extra = [k for k in ce if k not in ca], [k for k in ca if k not in ce]
            what = f"length {len(ce)} vs {len(ca)}" if sequences else f"keys missing {missing!r}, unexpected {extra!r}"
            out.append(Mismatch(path, (Diff.STRUCTURE,), what))
        for k, (piece, x) in ce.items():
            if k in ca:
                _walk(path + piece, x, ca[k][1], out)
    elif isinstance(e, float):
        _compare_floats(path, e, a, out)
    elif isinstance(e, complex):
        for part in ("real", "imag"):
            _walk(f"{path}.{part}", getattr(e, part), getattr(a, part), out)
    else:
        _compare_objects(path, e, a, out)


def _is_numpy(x: Any) -> bool:
    np = sys.modules.get("numpy")  # never imported here: a value can be numpy only once it is
    return np is not None and isinstance(x, (np.ndarray, np.generic))


def _compare_numpy(path: str, e: Any, a: Any, out: list[Mismatch]) -> None:
    """A numpy array or scalar (``np.float64`` is a ``float``), compared as a tensor of its dtype:
    bits, dtype and shape."""
    np = sys.modules["numpy"]
    try:
        te = torch.from_numpy(np.array(e, copy=True, order="C"))
        ta = torch.from_numpy(np.array(a, copy=True, order="C"))
    except (TypeError, ValueError):  # a dtype torch does not have (object, str, a byte order)
        same = e.dtype == a.dtype and e.shape == a.shape and bool(np.array_equal(e, a))
        if not same:
            out.append(Mismatch(path, (Diff.VALUE,), f"numpy values differ: {e!r} vs {a!r}"[:240]))
        return
    _compare_tensors(path, te, ta, out)


def _compare_floats(path: str, e: float, a: float, out: list[Mismatch]) -> None:
    if value_key(e) == value_key(a):
        return
    if math.isnan(e) or math.isnan(a):
        what = "NaNs with another sign or payload" if math.isnan(e) and math.isnan(a) else "NaN on one side only"
        out.append(Mismatch(path, (Diff.VALUE,), what, max_abs=math.nan,
                            num_different=1, numel=1, expected_value=e, actual_value=a))
        return
    ulp = max_ulp_distance(torch.tensor([e], dtype=torch.float64), torch.tensor([a], dtype=torch.float64))
    out.append(Mismatch(path, (Diff.VALUE,), "float values differ", max_abs=abs(e - a), max_ulp=ulp,
                        num_different=1, numel=1, expected_value=e, actual_value=a))


def _compare_objects(path: str, e: Any, a: Any, out: list[Mismatch]) -> None:
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


def snapshot(tree: Any) -> Any:
    """``tree`` with every tensor in its containers (pytree's, and dataclasses) replaced by an exact clone.

    Tensors that alias each other still alias in the copy (see :func:`_clone_exact`); other leaves
    are kept as they are.
    """
    storages: dict[Any, Any] = {}

    def copy(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return _clone_exact(x, storages)
        if _is_dataclass(x):  # a leaf to pytree: copy its init fields
            fields = [f.name for f in dataclasses.fields(x) if f.init]
            return dataclasses.replace(x, **{n: private.map_leaves(copy, getattr(x, n), _is_dataclass) for n in fields})
        return x

    return private.map_leaves(copy, tree, _is_dataclass)


def _is_dataclass(x: Any) -> bool:
    return dataclasses.is_dataclass(x) and not isinstance(x, type)


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
    private.copy_input_sources(gm.graph, ref.graph)
    return ref


def _concrete(x: Any) -> tuple[Any, str]:
    """A real value for one example input, or ``(None, why_not)``."""
    if isinstance(x, torch.Tensor):
        if private.is_fake(x):
            return None, "is a FakeTensor"
        if x.device.type == "meta":
            return None, "is a meta tensor"
        return x, ""
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        hint = private.symint_hint(x)
        return (None, f"is a symbolic value ({x}) without a real hint") if hint is None else (hint, "")
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
    for node in placeholders:
        example, problem = private.traced_example(node)
        if problem:
            return None, "", f"{why}, and {problem}"
        v, problem = _concrete(example)
        if problem:
            return None, "", f"{why}, and the traced value of placeholder {node.name!r} {problem}"
        values.append(v)
    return values, "grapharg", ""


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
    if type(out) in (list, tuple):
        return list(out)
    return [out]


class _ModuleState:
    """Tensors the graph owns (buffers, ``get_attr`` constants): snapshot, detect writes, restore."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        found: dict[int, tuple[str, torch.Tensor]] = {}
        for name, buf in gm.named_buffers():
            found.setdefault(id(buf), (name, buf))
        for node in gm.graph.find_nodes(op="get_attr"):
            try:
                obj = operator.attrgetter(str(node.target))(gm)
            except AttributeError:
                continue
            if isinstance(obj, torch.Tensor) and not isinstance(obj, torch.nn.Parameter):
                found.setdefault(id(obj), (str(node.target), obj))
        self.items = list(found.values())
        self.saved = [(_version(t), t.detach().clone()) for _, t in self.items]
        self.params = [(n, p, _version(p)) for n, p in gm.named_parameters()]

    def written(self) -> dict[str, torch.Tensor]:
        return {name: snapshot(t) for (name, t), (v0, _) in zip(self.items, self.saved) if _written(t, v0)}

    def restore(self) -> None:
        with torch.no_grad():
            for (_, t), (v0, val) in zip(self.items, self.saved):
                if _written(t, v0):
                    with torch.inference_mode(t.is_inference()):  # a write to one needs the mode
                        t.copy_(val)
        # Record the restored versions so the next run's writes are detected again.
        self.saved = [(_version(t), val) for (_, t), (_, val) in zip(self.items, self.saved)]

    def written_params(self) -> list[str]:
        return [n for n, p, v in self.params if _written(p, v)]


def _version(t: torch.Tensor) -> int | None:
    """``t._version``; None for an inference tensor, which has none (verification under
    ``torch.inference_mode()``, the usual serving set-up, raised reading it)."""
    return None if t.is_inference() else t._version


def _written(t: torch.Tensor, version: int | None) -> bool:
    """May ``t`` have been written since it was at ``version``? (Always, for an inference tensor:
    then its values are compared.)"""
    return version is None or t._version != version


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
            frames = user_frames(trace)
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


def _attach_sources(gm: torch.fx.GraphModule, mismatches: list[Mismatch]) -> list[Mismatch]:
    out = gm.graph.output_node()
    result = out.args[0] if out.args else None
    nodes = list(result) if isinstance(result, (list, tuple)) else [result]
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    res = []
    for m in mismatches:
        source = ""
        hit = re.match(r"out\[(\d+)\]", m.path)
        if hit and int(hit[1]) < len(nodes):
            target = nodes[int(hit[1])]
            if isinstance(target, (list, tuple, dict)):
                source = "\n".join(_node_source(n) for n in _nodes_in(target)[:3])
            else:
                source = _node_source(target)
        hit = re.match(r"input\[(\d+)\]", m.path)
        if hit and int(hit[1]) < len(placeholders):
            node = placeholders[int(hit[1])]
            writers = [u for u in node.users if node in written_nodes(u)] or [u for u in node.users if u.op != "output"]
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
    with private.no_fake_mode():
        rng, state = _RngState(), _ModuleState(gm)
        ref = _run_once(gm, values, state, rng)
        if ref.error is not None:
            log.warning("nosync verify: graph %s: the eager FX graph raised on the real inputs", name,
                        exc_info=ref.error)
            return _skip(name, f"the eager FX graph raised {type(ref.error).__name__}: {ref.error}", strict)
        with unstored():  # tables for these clones: never read again
            act = _run_once(compiled_fn, values, state, rng)  # as Dynamo's bytecode calls it
    mismatches = _compare_runs(ref, act)
    written_params = state.written_params()
    if written_params:
        log.warning(
            "nosync verify: graph %s wrote parameters %s in place; verification ran it twice", name, written_params
        )
    expected = ref.out
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
    message = f"{head}\n{textwrap.indent(format_mismatches(mismatches), '  ')}\n  ({hint})"
    result = VerifyResult(mismatches, name=name, status=VerifyStatus.FAILED, inputs_from=inputs_from, message=message)
    if strict:
        raise VerificationError(message)
    log.warning("%s", message)
    warnings.warn(message, VerificationWarning, stacklevel=2)
    return result


@dataclasses.dataclass
class _Run:
    """One run of a graph on its own exact clones of the inputs."""

    inputs: list[Any]
    versions: list[int | None]
    out: Any = None
    error: Exception | None = None
    written: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)


def _run_once(fn: Callable[..., Any], values: Sequence[Any], state: _ModuleState, rng: _RngState) -> _Run:
    """Run ``fn`` on fresh clones of ``values``; put the module's buffers and the RNG back after."""
    inputs = snapshot(list(values))
    run = _Run(inputs, [_version(v) if isinstance(v, torch.Tensor) else None for v in inputs])
    try:
        run.out = fn(*inputs)
    except Exception as exc:
        log.debug("nosync verify: %s raised", getattr(fn, "__name__", fn), exc_info=True)
        run.error = exc
    run.written = state.written()
    state.restore()
    rng.restore()
    return run


def _compare_runs(ref: _Run, act: _Run) -> list[Mismatch]:
    """Outputs, inputs either run wrote in place, and module buffers either run wrote."""
    if act.error is not None:
        err = act.error
        return [Mismatch("out", (Diff.ERROR,), f"the compiled graph raised {type(err).__name__}: {err}")]
    mismatches = []
    exp_list, act_list = _as_list(ref.out), _as_list(act.out)
    if len(exp_list) != len(act_list):
        mismatches.append(Mismatch("out", (Diff.STRUCTURE,), f"{len(exp_list)} outputs vs {len(act_list)}"))
    for i, (e, a) in enumerate(zip(exp_list, act_list)):
        mismatches.extend(compare_outputs(e, a, root=f"out[{i}]"))
    for i, (r, a) in enumerate(zip(ref.inputs, act.inputs)):
        if isinstance(r, torch.Tensor) and (_written(r, ref.versions[i]) or _written(a, act.versions[i])):
            mismatches.extend(compare_outputs(r, a, root=f"input[{i}]"))
    for key in sorted(set(ref.written) | set(act.written)):
        if key not in ref.written or key not in act.written:
            who = "compiled graph" if key in act.written else "eager FX graph"
            mismatches.append(Mismatch(f"gm.{key}", (Diff.VALUE,), f"written in place only by the {who}"))
        else:
            mismatches.extend(compare_outputs(ref.written[key], act.written[key], root=f"gm.{key}"))
    return mismatches


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

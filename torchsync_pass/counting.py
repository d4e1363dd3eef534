"""Count host synchronizations (or what would be one on a GPU) without changing torch.compile.

Why two sources: a sync is a host read of device data, and no single probe sees all of them.

* Python-level interception of the ``torch.Tensor`` methods that read data on the host
  (``item``, ``__bool__``, ``__int__``, ``__float__``, ``__index__``, ``tolist``, ``numpy``,
  ``cpu``/``to("cpu")``, ``nonzero``, ``equal``, ``masked_select``, boolean-mask
  ``__getitem__``/``__setitem__``). It gives the exact user line, the kind and the value read.
  ``.tolist()`` on a CPU tensor dispatches no aten op, so only this probe sees it.
* The autograd profiler, for the paths no method wrapper sees: ``torch.equal(a, b)``,
  ``torch.nonzero(x)``, ``aten::_local_scalar_dense`` run inside a compiled graph, and on CUDA the
  ``cudaStreamSynchronize``/``cudaDeviceSynchronize``/DtoH ``cudaMemcpyAsync`` runtime calls. Each
  intercepted call runs inside a ``torchsync_pass::<kind>`` profiler range, so the aten events it
  causes are not counted twice. Its Python tracer also gives the calls of each enclosing function.

NOTE: no ``TorchDispatchMode``/``TorchFunctionMode`` is used: with one active Dynamo runs the
compiled function eagerly. Dynamo traces tensor methods by name, never through the class
attribute, so the wrappers do not change what it captures; the wrappers' own frames are marked
"skip" for Dynamo (see ``_patch_tensor_methods``) so it does not try to compile them when compiled code
calls them after a graph break. Every torch-internal access (and the ``torch.Tensor`` patching
itself) goes through :mod:`torchsync_pass._torch_private`; this module only builds the wrappers.

Where the tensor lives decides what counts: on a run without an accelerator every host read is
counted as the sync it would be on a GPU (``SyncCounts.mode == "cpu-as-device"``). With an
accelerator, reads of device tensors are counted and reads of CPU-resident tensors are listed apart
as host-local (``host_local``), not in ``total``.

Syncs run by Dynamo/Inductor while compiling are kept apart in ``compile_time``.
"""

from __future__ import annotations

import collections
import contextlib
import dis
import functools
import hashlib
import linecache
import logging
import os
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from . import _torch_private, dynamo_hooks
from .guards import value_key
from .report import SiteKey, current_guard_site

log = logging.getLogger(__name__)

__all__ = ["count_syncs", "SyncCounts", "SiteStats", "CudaCounts", "KINDS"]

#: Every kind this module reports, with what the user wrote.
KINDS = {
    "item": ".item()",
    "bool": "bool(t) / truthiness",
    "int": "int(t)",
    "float": "float(t)",
    "index": "t.__index__() (range(t), seq[t])",
    "tolist": ".tolist()",
    "numpy": ".numpy()",
    "cpu": ".cpu() / .to('cpu')",
    "nonzero": "nonzero",
    "mask_index": "x[bool_mask]",
    "mask_assign": "x[bool_mask] = v",
    "equal": "torch.equal",
    "masked_select": "masked_select",
    "in_op": "inside an op (linalg error checks, data-dependent sizes, ...)",
    "local_scalar_dense": "other aten::_local_scalar_dense",
}

_MAX_VALUES = 64  # distinct values remembered per site
_MAX_HASHED_NUMEL = 4096  # larger results are not hashed (their values count as unknown)

_OWN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_BUILTIN_RE = re.compile(r"^<built-in (?:method|function) (\w+)")
_PY_EVENT_RE = re.compile(r"^(.*)\((\d+)\): (.+)$")

_MASK_DTYPES = (torch.bool, torch.uint8)


# --------------------------------------------------------------------------------------------
# Result objects
# --------------------------------------------------------------------------------------------
@dataclass
class SiteStats:
    """Everything seen at one user source line."""

    site: SiteKey
    function: str = ""
    count: int = 0
    host_local: int = 0
    kinds: collections.Counter = field(default_factory=collections.Counter)
    devices: set = field(default_factory=set)
    values: dict = field(default_factory=dict)  # value key -> short repr (at most _MAX_VALUES)
    values_overflow: bool = False
    values_unknown: int = 0  # reads whose value was not recorded
    calls: int | None = None  # calls of the enclosing function, from the profiler's Python tracer
    line_exact: bool = True  # False when the line was inferred from the function's source
    _code_key: tuple | None = None
    # a read here came while the profiler was off (a compile, an import): a call then may be one
    # the tracer never saw, so ``calls`` is unknown (None), not a count short of the truth
    _calls_unseen: bool = False

    @property
    def kind(self) -> str:
        """The most frequent kind at this site (``a+b`` when several)."""
        if not self.kinds:
            return "?"
        return "+".join(k for k, _ in self.kinds.most_common())

    @property
    def source(self) -> str:
        return self.site.source()

    @property
    def distinct_values(self) -> int | None:
        """How many distinct values the site returned; None when none was recorded."""
        return len(self.values) or None

    @property
    def hoisting_candidate(self) -> bool:
        """One value across several reads and nothing unknown: request-invariant so far."""
        return (
            self.distinct_values == 1
            and not self.values_unknown
            and (self.count + self.host_local) > 1
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "file": self.site.file,
            "line": self.site.line,
            "kind": self.kind,
            "kinds": dict(self.kinds),
            "count": self.count,
            "host_local": self.host_local,
            "source": self.source,
            "function": self.function,
            "calls": self.calls,
            "distinct_values": self.distinct_values,
            "distinct_values_capped": self.values_overflow,
            "values": list(self.values.values())[:8],
            "devices": sorted(self.devices),
            "hoisting_candidate": self.hoisting_candidate,
            "line_exact": self.line_exact,
        }


@dataclass
class CudaCounts:
    """CUDA runtime calls that block the host, from the profiler (zero without CUDA)."""

    stream_synchronize: int = 0
    device_synchronize: int = 0
    dtoh_memcpy: int = 0
    by_site: dict = field(default_factory=collections.Counter)

    @property
    def total(self) -> int:
        return self.stream_synchronize + self.device_synchronize + self.dtoh_memcpy

    def to_json(self) -> dict[str, Any]:
        return {
            "cudaStreamSynchronize": self.stream_synchronize,
            "cudaDeviceSynchronize": self.device_synchronize,
            "dtoh_cudaMemcpyAsync": self.dtoh_memcpy,
            "by_site": {str(k): v for k, v in self.by_site.items()},
        }


class SyncCounts:
    """What ``count_syncs()`` saw. Also the context manager itself.

    ``total``       syncs (host reads of device data; every read on a CPU-only run)
    ``by_kind``     {kind: count}, kinds as in ``KINDS``
    ``by_site``     {SiteKey(file, line): count}
    ``sites``       {SiteKey: SiteStats} with source text, kinds, distinct values, calls
    ``host_local``  {SiteKey: count} of reads of CPU-resident tensors on an accelerator run
    ``compile_time`` syncs run while Dynamo/Inductor compiled (not in ``total``)
    ``cuda``        CudaCounts
    """

    def __init__(self, *, profiler: bool = True, stacks: bool = True) -> None:
        self.want_profiler = profiler
        self.want_stacks = stacks
        self.mode = "device" if torch.cuda.is_available() else "cpu-as-device"
        self.total = 0
        self.by_kind: dict[str, int] = collections.Counter()
        self.by_site: dict[SiteKey, int] = collections.Counter()
        self.host_local: dict[SiteKey, int] = collections.Counter()
        self.sites: dict[SiteKey, SiteStats] = {}
        self.compile_time = 0
        self.cuda = CudaCounts()
        self.profiled = False
        self.notes: list[str] = []
        self._lock = threading.Lock()
        self._py_calls: collections.Counter = collections.Counter()
        self._calls_spanning: set = set()  # code keys of calls that ran across a profiler restart
        self._active = False

    # context manager -----------------------------------------------------------------------
    def __enter__(self) -> SyncCounts:
        if self._active:
            raise RuntimeError("this SyncCounts is already active; call count_syncs() again")
        self._active = True
        _SESSION.enter(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            _SESSION.exit(self)
        finally:
            self._active = False
            self._resolve_calls()

    # recording -----------------------------------------------------------------------------
    def _add(self, ev: _Event) -> None:
        with self._lock:
            if ev.compile_time:
                self.compile_time += 1
                return
            st = self.sites.get(ev.site)
            if st is None:
                st = self.sites[ev.site] = SiteStats(site=ev.site, function=ev.function, _code_key=ev.code_key)
            st.line_exact = st.line_exact and ev.line_exact
            if not ev.profiled:
                st._calls_unseen = True
            st.kinds[ev.kind] += 1
            if ev.device:
                st.devices.add(ev.device)
            host_local = self.mode == "device" and ev.device == "cpu"
            if host_local:
                st.host_local += 1
                self.host_local[ev.site] += 1
            else:
                st.count += 1
                self.total += 1
                self.by_kind[ev.kind] += 1
                self.by_site[ev.site] += 1
            if ev.value_key is _UNKNOWN:
                st.values_unknown += 1
            elif ev.value_key not in st.values:
                if len(st.values) < _MAX_VALUES:
                    st.values[ev.value_key] = ev.value_repr
                else:
                    st.values_overflow = True

    def _resolve_calls(self) -> None:
        """Fill SiteStats.calls from the Python tracer's function-call events."""
        index: dict[tuple[str, str], list[tuple[str, int, int]]] = collections.defaultdict(list)
        for (efile, first, name), n in self._py_calls.items():
            # A call already running when the profiler (re)started is named by the line it was on
            # (review 22: a function called 5 times after an import showed 4 calls): counted with
            # its function's, by the function's first line (``co_firstlineno``)
            # (not a generator's or a coroutine's: each resume at a yield is an event of its own,
            # named by the yield's line, and is no call)
            found = _innermost(_find_file(efile), first, name)
            if found is not None and not found[4]:
                first = found[0]
            index[(os.path.basename(efile), name)].append((efile, first, n))
        for st in self.sites.values():
            if st._code_key is None:
                continue
            filename, first, name = st._code_key
            if st._calls_unseen:  # a call the tracer may have missed (review 22: 3 of 4 shown)
                continue
            if st._code_key in self._calls_spanning:  # reported again at each restart it spans
                continue
            if name == "<module>":  # top-level code: no calls to count (shown "-", as a read's there)
                continue
            m = dynamo_hooks.RESUME_RE.match(name)
            if m:  # a Dynamo resume function: count calls of the function it resumes
                name, first = m.group(1), None
            cands = [
                (f, n)
                for efile, f, n in index.get((os.path.basename(filename), name), ())
                if filename.endswith(efile) or efile.endswith(filename)
            ]
            if first is not None:
                cands = [(f, n) for f, n in cands if f == first]
            elif len({f for f, _ in cands}) > 1:  # ambiguous: the closest def above the site
                best = max((f for f, _ in cands if f <= st.site.line), default=None)
                cands = [(f, n) for f, n in cands if f == best]
            if cands:
                st.calls = sum(n for _, n in cands)

    # reading -------------------------------------------------------------------------------
    def sorted_sites(self) -> list[SiteStats]:
        return sorted(
            self.sites.values(), key=lambda s: (-(s.count + s.host_local), s.site.file, s.site.line)
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "profiled": self.profiled,
            "totals": {
                "syncs": self.total,
                "host_local": sum(self.host_local.values()),
                "compile_time": self.compile_time,
                "by_kind": dict(self.by_kind),
            },
            "sites": [s.to_json() for s in self.sorted_sites()],
            "cuda": self.cuda.to_json(),
            "notes": list(self.notes),
        }

    def summary(self) -> str:
        lines = [f"{self.total} host syncs ({self.mode})"]
        for st in self.sorted_sites():
            lines.append(f"  {st.site}: {st.kind} x{st.count}  {st.source}")
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"SyncCounts(total={self.total}, by_kind={dict(self.by_kind)})"


def count_syncs(*, profiler: bool = True, stacks: bool = True) -> SyncCounts:
    """Count host syncs in the ``with`` block, on any device, without changing torch.compile.

    ``profiler=False`` uses the method interception only (cheaper; misses ``torch.equal(a, b)``,
    ``torch.nonzero(x)`` and syncs inside compiled graphs). ``stacks=False`` keeps the profiler
    but drops its Python tracer: no enclosing-function call counts, and profiler-only syncs are
    attributed to the caller of the intercepted region only when known.

    Contexts may nest; each one sees what ran while it was active.
    """
    return SyncCounts(profiler=profiler, stacks=stacks)


# --------------------------------------------------------------------------------------------
# Events and sites
# --------------------------------------------------------------------------------------------
_UNKNOWN = object()
_IMPORT_SITE = SiteKey("<import>", 0)
_KNOWN_FILES: set[str] = set()  # user files seen, to map the profiler's trimmed paths back


def register_file(path: str) -> None:
    """Name a file as the program runs it, so profiler-only sites use the same path."""
    _KNOWN_FILES.add(path)


@dataclass
class _Event:
    kind: str
    site: SiteKey
    function: str
    code_key: tuple | None
    device: str = ""
    value_key: Any = _UNKNOWN
    value_repr: str = ""
    compile_time: bool = False
    line_exact: bool = True
    profiled: bool = True  # the profiler was on when it was recorded (method wrappers' reads)


def _is_internal_file(filename: str) -> bool:
    return (filename.startswith((dynamo_hooks.TORCH_DIR, _OWN_DIR, "<eval_with_key>"))
            or filename == dynamo_hooks.SELF_TEST_FILE)


def is_own_file(filename: str) -> bool:
    """Is ``filename`` torchsync_pass's own code (its self-test probes included)?"""
    return filename.startswith(_OWN_DIR) or filename == dynamo_hooks.SELF_TEST_FILE


def _open_frames(thread: int) -> dict[int, Any]:
    """The frames running in thread ``thread`` now (the counting thread, whichever thread stops the
    profiler: a worker's compile; review 23): id -> code. Only ids: holding the frames would keep a
    finished call's locals (tensors a guard sees freed) alive. A frame at the same id with the same
    code at a stop and at the restart is taken for the same call; the next call of a function
    whose frame ended between them can look so too, and its calls then show '-' as well."""
    out: dict[int, Any] = {}
    frame = sys._getframe(1) if thread == threading.get_ident() else sys._current_frames().get(thread)
    while frame is not None:
        out[id(frame)] = frame.f_code
        frame = frame.f_back
    return out


def _code_key(code: Any) -> tuple:
    return (code.co_filename, code.co_firstlineno, code.co_name)


def _user_frame(frame: Any) -> Any:
    """The first frame outside torch, torchsync_pass and FX-generated code (None if none)."""
    while frame is not None and (_is_internal_file(frame.f_code.co_filename)
                                 or dynamo_hooks.is_dynamo_guard_frame(frame)):
        frame = frame.f_back
    return frame


def _is_import_machinery(filename: str) -> bool:
    return (filename.startswith("<frozen importlib")
            or filename.endswith(os.path.join(os.sep, "importlib", "__init__.py")))


def _site_of(frame: Any) -> tuple[SiteKey, str, tuple | None]:
    hoisted = current_guard_site()
    if hoisted is not None:
        # a nosync guard re-running a hoisted cone: the sync belongs to the hoisted line
        return hoisted, "nosync guard", None
    uf = _user_frame(frame)
    if uf is None or _is_import_machinery(uf.f_code.co_filename) or dynamo_hooks.in_self_test():
        # NOTE: reads done while a module is being imported (e.g. the nosync backend's
        # import-time self-test) are not the program's: they go with the compile-time reads.
        return _IMPORT_SITE, "", None
    code = uf.f_code
    _KNOWN_FILES.add(code.co_filename)
    resumed = dynamo_hooks.RESUME_RE.match(code.co_name)  # name a resume function by its original
    return (
        SiteKey(code.co_filename, _frame_line(uf)),
        resumed.group(1) if resumed else code.co_qualname,
        (code.co_filename, code.co_firstlineno, code.co_name),
    )


_TO_BOOL = dis.opmap.get("TO_BOOL")  # Python 3.13+
_COND_JUMPS = ("POP_JUMP_IF_TRUE", "POP_JUMP_IF_FALSE")


def _frame_line(frame: Any) -> int:
    """The source line of the instruction ``frame`` runs.

    NOTE [TO_BOOL lines]: on Python 3.13 ``if t:`` compiles to ``TO_BOOL`` + ``POP_JUMP_IF_*``, and
    ``TO_BOOL`` is what calls ``Tensor.__bool__``. Where Dynamo breaks the graph at such a jump
    (torch 2.15: ``generic_jump`` in symbolic_convert.py) it emits a fresh ``TO_BOOL`` without a
    source position, so in the code it runs ``TO_BOOL`` carries the line of the instruction before
    it (the previous graph break's line), while the jump it precedes keeps the user's line. CPython
    gives a ``TO_BOOL`` and the jump that consumes it the same position, so taking the jump's line
    is exact for both.

    NOTE [PRECALL lines]: the same on Python 3.11, where a call is ``PRECALL`` + ``CALL`` and a
    specialised call of a builtin class (``bool(t)``, ``int(t)``: PRECALL_BUILTIN_CLASS) runs inside
    ``PRECALL``: where Dynamo rebuilt the call after a graph break, ``PRECALL`` carries the previous
    break's line and the ``CALL`` the user's (a recompiled resume function's ``bool(...)`` was
    counted at the line of the ``int(pos)`` before it once specialised).
    """
    line = frame.f_lineno
    lasti = frame.f_lasti
    if _SHIFTED and lasti >= 0:
        co = frame.f_code.co_code
        nxt = _SHIFTED.get(co[lasti]) if lasti < len(co) else None
        if nxt is not None:
            line = _next_line(frame.f_code, lasti, nxt) or line
    return line or frame.f_code.co_firstlineno


# opcode that may carry another instruction's line -> the opnames of the instruction after it that
# carries the user's (TO_BOOL exists from Python 3.13, PRECALL only on 3.11)
_SHIFTED = {op: names for op, names in ((_TO_BOOL, _COND_JUMPS), (dis.opmap.get("PRECALL"), ("CALL",)))
            if op is not None}


@functools.lru_cache(maxsize=256)
def _next_line(code: Any, lasti: int, opnames: tuple) -> int | None:
    """The line of the instruction right after ``lasti`` when it is one of ``opnames`` (else None)."""
    for ins in dis.get_instructions(code):
        if ins.offset > lasti:
            if ins.opname in opnames and ins.positions is not None:
                return ins.positions.lineno
            return None
    return None


def _value_key(kind: str, out: Any) -> tuple[Any, str]:
    """A hashable, bounded key for the value a sync returned, and a short repr."""
    try:
        if isinstance(out, float):
            return value_key(out), repr(out)  # bitwise: -0.0 != 0.0
        if isinstance(out, (bool, int, complex)):
            return (type(out).__name__, out), repr(out)
        if kind in ("nonzero", "mask_index", "masked_select") and isinstance(out, torch.Tensor):
            shape = tuple(out.shape)
            return ("shape", shape), f"shape {shape}"
        if isinstance(out, list):
            flat = repr(out)
            if len(flat) > 20000:
                return _UNKNOWN, ""
            return ("list", hashlib.blake2b(flat.encode(), digest_size=12).digest()), _short(flat)
        if isinstance(out, torch.Tensor):
            if out.numel() > _MAX_HASHED_NUMEL or out.device.type != "cpu":
                return _UNKNOWN, ""
            # NOTE: runs inside a wrapper (_TLS.depth set), so this .tolist() is not recorded.
            data = repr(out.detach().tolist())
            key = (str(out.dtype), tuple(out.shape), hashlib.blake2b(data.encode(), digest_size=12).digest())
            return key, _short(data)
        if hasattr(out, "tobytes") and getattr(out, "size", _MAX_HASHED_NUMEL + 1) <= _MAX_HASHED_NUMEL:
            key = (str(out.dtype), tuple(out.shape), hashlib.blake2b(out.tobytes(), digest_size=12).digest())
            return key, _short(repr(out))
    except Exception:  # a value we cannot key is not worth failing the user's program
        log.debug("could not key a %s value", kind, exc_info=True)
    return _UNKNOWN, ""


def _short(s: str, n: int = 60) -> str:
    s = " ".join(s.split())
    return s if len(s) <= n else s[: n - 3] + "..."


# --------------------------------------------------------------------------------------------
# Method interception
# --------------------------------------------------------------------------------------------
_TLS = threading.local()


def _to_target(args: tuple, kwargs: dict) -> Any:
    """What ``Tensor.to(...)`` moves to: a str, a torch.device, a tensor (its device), or None."""
    dev = kwargs.get("device")
    if dev is None and args and isinstance(args[0], (str, torch.device, torch.Tensor)):
        dev = args[0]
    return dev


def _device_type(dev: Any) -> str | None:
    try:
        return (dev.device if isinstance(dev, torch.Tensor) else torch.device(dev)).type
    except (RuntimeError, TypeError):
        return None


_NAMES_CPU = re.compile(r"""\.cpu\s*\(|["']cpu(?::\d+)?["']""")


def _line_names_cpu(frame: Any) -> bool:
    """True when the user's source line that made the call names the host (``"cpu"``, ``.cpu()``)."""
    uf = _user_frame(frame)
    if uf is None:
        return False
    return bool(_NAMES_CPU.search(linecache.getline(uf.f_code.co_filename, uf.f_lineno or 0)))


def _moves_to_host(name: str, self: torch.Tensor, args: tuple, kwargs: dict, frame: Any) -> bool:
    """NOTE [Which moves count]: a move counts when it would be a device-to-host read on a GPU.

    On an accelerator run that is a move of a device tensor to the CPU. On a CPU-only run every
    tensor is on the CPU, so ``t.to(other.device)`` (diffusers' ``timesteps[None].to(sample.device)``,
    transformers' stopping criteria) would be a device-to-device no-op on a GPU: it counts only when
    the move names the host: ``.cpu()``, ``.to("cpu")``/``.to(device="cpu")``, or a torch.device whose
    call line names ``"cpu"`` (``.to(torch.device("cpu"))``). ``.to(other_tensor)`` never counts
    there. The rule looks at the call, not at what the codegen does with it, so eager, nosync's eager
    codegen and Inductor agree. A move with ``non_blocking=True`` never counts: a GPU copies into
    pinned memory without waiting (the wait is the stream or event synchronize the program makes
    before reading it, which the profiler counts on a GPU run; review 22).
    """
    flags = [a for a in args if type(a) is bool]  # to(..., non_blocking, copy) by position
    if kwargs.get("non_blocking") is True or (flags and flags[0]):
        return False
    if _SESSION.accelerator:
        if self.device.type == "cpu":
            return False
        return name == "cpu" or _device_type(_to_target(args, kwargs)) == "cpu"
    if name == "cpu":
        return True
    target = _to_target(args, kwargs)
    if isinstance(target, str):
        return _device_type(target) == "cpu"
    if isinstance(target, torch.device):
        return target.type == "cpu" and _line_names_cpu(frame)
    return False


def _masks(idx: Any) -> int:
    """How many boolean masks index with ``idx`` (each is one nonzero: one read)."""
    if type(idx) is list:
        if idx and all(type(i) is bool for i in idx):
            return 1  # a list of bools is a mask
        if not any(isinstance(i, torch.Tensor) for i in idx):
            return 0
        idx = tuple(idx)  # torch indexes with a list holding tensors as with a tuple
    return sum(isinstance(i, torch.Tensor) and i.dtype in _MASK_DTYPES
               for i in (idx if type(idx) is tuple else (idx,)))


def _has_mask(idx: Any) -> bool:
    return _masks(idx) > 0


def _classify(name: str, self: torch.Tensor, args: tuple, kwargs: dict, frame: Any) -> str | None:
    if name in _ALWAYS:
        return _ALWAYS[name]
    if name in ("cpu", "to"):
        return "cpu" if _moves_to_host(name, self, args, kwargs, frame) else None
    if name == "__getitem__":
        return "mask_index" if args and _has_mask(args[0]) else None
    if name == "__setitem__":
        return "mask_assign" if args and _has_mask(args[0]) else None
    return None


_ALWAYS = {
    "item": "item",
    "__bool__": "bool",
    "__int__": "int",
    "__float__": "float",
    "__index__": "index",
    "tolist": "tolist",
    "numpy": "numpy",
    "nonzero": "nonzero",
    "equal": "equal",
    "masked_select": "masked_select",
}
# (backward: no sync of its own, a safe point to restart the profiler in a training loop)
_PATCHED = [*_ALWAYS, "cpu", "to", "__getitem__", "__setitem__", "backward"]


def _record(kind: str, self: torch.Tensor, out: Any, frame: Any) -> None:
    # reads made while Dynamo/AOT/Inductor compile are not the program's
    site, fn, code_key = (SiteKey("<compile>", 0), "", None) if dynamo_hooks.compiling() else _site_of(frame)
    if site.line == 0 and site.file in ("<compile>", "<import>"):
        ev = _Event(kind, site, "", None, compile_time=True)
    else:
        vkey, vrepr = (_UNKNOWN, "") if kind == "mask_assign" else _value_key(kind, out)
        try:
            device = self.device.type
        except Exception:
            device = ""
        ev = _Event(kind, site, fn, code_key, device, vkey, vrepr, profiled=_SESSION.profiling)
    for rec in _SESSION.recorders():
        rec._add(ev)
    _SESSION.maybe_rotate(frame)


def _make_wrapper(name: str, orig: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(self, *args, **kwargs):
        if getattr(_TLS, "depth", 0) or not _SESSION.active:
            return orig(self, *args, **kwargs)
        frame = sys._getframe(1)
        if _SESSION.resume_pending:
            _SESSION.resume(frame)
        kind = _classify(name, self, args, kwargs, frame)
        if kind is None:
            return orig(self, *args, **kwargs)
        _TLS.depth = 1
        try:
            marked = _SESSION.profiling  # a profiler range, so its aten events are not counted twice
            try:
                with _torch_private.profiler_range("torchsync_pass::" + kind) if marked else contextlib.nullcontext():
                    out = orig(self, *args, **kwargs)
            except (ValueError, OverflowError):
                # int() of a NaN or an infinity: the value was read, then the conversion raised
                if kind == "int" and self.is_floating_point():
                    _record(kind, self, None, frame)
                raise
            # x[m1, m2]: one nonzero (one read) per mask
            for _ in range(_masks(args[0]) if kind in ("mask_index", "mask_assign") else 1):
                _record(kind, self, out, frame)
        finally:
            _TLS.depth = 0
        return out

    wrapper.__name__ = wrapper.__qualname__ = name
    wrapper.__doc__ = getattr(orig, "__doc__", None)
    wrapper._torchsync_orig = orig  # type: ignore[attr-defined]
    return wrapper


_hidden = False


def _patch_tensor_methods() -> Callable[[], None]:
    """Install the method wrappers on ``torch.Tensor`` (while any counter is active); return
    ``restore()``.

    Dynamo is first told never to compile the wrappers' frames (nor what they call): otherwise
    compiled code that calls a wrapper after a graph break makes Dynamo try to compile the wrapper
    frame, which adds a graph-break record to the user's counters.
    """
    global _hidden
    wrappers = {name: _make_wrapper(name, getattr(torch.Tensor, name)) for name in _PATCHED}
    if not _hidden:
        _hidden = True
        try:  # all wrappers share one code object; _record and helpers run under its SKIP
            _torch_private.skip_frames_in_dynamo([next(iter(wrappers.values()))])
        except Exception:
            log.warning("torchsync_pass: could not mark the sync counter's wrappers as skipped for "
                        "Dynamo; graph-break counts under count_syncs() may include the counter's "
                        "own frames", exc_info=True)
    return _torch_private.patch_tensor_methods(wrappers)


def _nothing() -> None:
    pass


# --------------------------------------------------------------------------------------------
# Profiler
# --------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Kineto prints 'profiler_start/stop' lines on fd 2; keep them out of the user's output."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            try:
                yield
            finally:
                os.dup2(saved, 2)
    finally:
        os.close(saved)


class _Profiler:
    def __init__(self, stacks: bool) -> None:
        self.stacks = stacks
        self.prof: Any = None

    def start(self) -> bool:
        if _torch_private.profiler_enabled():
            return False
        from torch.autograd.profiler import profile

        # every thread's ops: a sync inside an op or a compiled graph run by a worker thread is
        # seen by the profiler only (the method wrappers see every thread's .item(), bool(), ...)
        config = _torch_private.all_threads_profiler_config()
        self.prof = profile(
            use_kineto=True,
            use_device="cuda" if torch.cuda.is_available() else None,
            with_stack=self.stacks,
            record_shapes=False,
            **({"experimental_config": config} if config is not None else {}),
        )
        with _quiet_stderr():
            self.prof.__enter__()
        return True

    def stop(self) -> list[Any]:
        """Stop and return the raw events. NOTE: the events point into the profiler's results:
        this object keeps them alive; drop it only after the events were digested."""
        prof = self.prof  # set: only a started _Profiler is ever stopped
        with _quiet_stderr():
            prof.__exit__(None, None, None)
        try:
            return _torch_private.profiler_events(prof)
        except Exception:
            log.warning("torchsync_pass: could not read profiler events", exc_info=True)
            return []


_SYNC_OPS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::equal", "aten::masked_select"}
_OP_KIND = {
    "aten::item": "item",
    "aten::is_nonzero": "bool",
    "aten::equal": "equal",
    "aten::nonzero": "nonzero",
    "aten::masked_select": "masked_select",
    "aten::index": "mask_index",
    "aten::index_put_": "mask_assign",
    "aten::_index_put_impl_": "mask_assign",
    "aten::_local_scalar_dense": "local_scalar_dense",
}
# runtime call -> the CudaCounts field it counts in (a DtoH cudaMemcpyAsync: dtoh_memcpy)
_CUDA_SYNC = {"cudaStreamSynchronize": "stream_synchronize", "cudaDeviceSynchronize": "device_synchronize"}


@dataclass
class _Ev:
    name: str
    start: int
    end: int
    tid: int
    is_py: bool
    corr: int = 0


def _name(e: Any) -> str | None:
    try:
        return e.name()
    except Exception:  # some Python-tracer names are not valid UTF-8
        return None


def _py_user_event(name: str) -> tuple[str, int, str] | None:
    m = _PY_EVENT_RE.match(name)
    if not m:
        return None
    efile = m.group(1)
    # NOTE: torch's own files by torch's directory, not any path with a folder named torch (a
    # user library's ``mylib/torch/ops.py``); and Inductor's generated code (its cache directory):
    # a sync there belongs to the compiled function that called it
    if efile.startswith(("torch/", "torchsync_pass/", "<", _OWN_DIR, dynamo_hooks.TORCH_DIR, _TORCH_REAL_DIR)) \
            or _in_inductor_cache(efile):
        return None
    return efile, int(m.group(2)), m.group(3)


_TORCH_REAL_DIR = os.path.realpath(dynamo_hooks.TORCH_DIR) + os.sep


def _in_inductor_cache(efile: str) -> bool:
    """Is ``efile`` code Inductor generated (its cache directory: ``TORCHINDUCTOR_CACHE_DIR`` or
    the default ``<tmp>/torchinductor_<user>``)?"""
    if "torchinductor_" in efile:
        return True
    custom = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    return bool(custom) and os.path.abspath(efile).startswith(os.path.abspath(custom) + os.sep)


_NAMESPACED = re.compile(r"^(linalg|fft|special|nn)_(\w+)$")


def _guess_line(
    efile: str, first: int, fname: str, op: tuple[str, bool] | None,
    span: tuple[int, int, int] | None = None,
) -> tuple[SiteKey, bool]:
    """The line of ``op(`` in the function that starts at ``efile:first`` (exact when only one).

    The profiler's Python tracer knows the function, not the line; for syncs only the profiler
    sees (``torch.equal(a, b)``), look for the call in the function's source: its body, when
    ``span`` (:func:`_function_span`) is known, else the lines below ``first`` indented deeper.
    """
    import linecache

    path = _find_file(efile)
    if op:
        name, function_form = op
        prefix = r"(?:\btorch\.|(?<![.\w]))" if function_form else r"\."
        spelled = re.escape(name)
        ns = _NAMESPACED.match(name) if function_form else None
        if ns:  # <built-in function linalg_solve> is written torch.linalg.solve(...)
            spelled = f"(?:{spelled}|{ns.group(1)}\\.{ns.group(2)})"
        pat = re.compile(prefix + spelled + r"\s*\(")
        lines = linecache.getlines(path)
        if span is not None:  # the body, whatever its signature's layout
            _, body, end = span
            hits = [i for i in range(body, min(end, len(lines)) + 1) if pat.search(lines[i - 1])]
            if hits:  # several calls of the op in the function: the first, marked inexact
                return SiteKey(path, hits[0]), len(hits) == 1
            return SiteKey(path, first), False
        if fname == "<module>":  # a script's or module's top level: its lines outside every def
            inside = [(f[0], f[3]) for f in _functions(path, len(lines))]
            hits = [i for i in range(1, len(lines) + 1)
                    if pat.search(lines[i - 1]) and not any(a <= i <= b for a, b in inside)]
            if hits:  # several calls of the op at top level: the first, marked inexact
                return SiteKey(path, hits[0]), len(hits) == 1
        if 0 < first <= len(lines):
            head = lines[first - 1]
            indent = len(head) - len(head.lstrip())
            start = first
            resume = dynamo_hooks.RESUME_RE.match(fname.rsplit(".", 1)[-1])
            if resume:
                # Dynamo's resume function starts at the graph break's line, a statement inside the
                # original function (named in the resume function's name): scan from that line to
                # the end of that ``def``, not of a nested one above the break
                start = first - 1
                own = re.compile(rf"\s*(?:async\s+)?def\s+{re.escape(resume.group(1))}\s*\(")
                for j in range(first - 2, -1, -1):
                    text = lines[j]
                    if own.match(text) and len(text) - len(text.lstrip()) < indent:
                        indent = len(text) - len(text.lstrip())
                        break
            hits = []
            for i in range(start, len(lines)):
                text = lines[i]
                if text.strip() and (len(text) - len(text.lstrip())) <= indent:
                    break
                if pat.search(text):
                    hits.append(i + 1)
            if hits:  # several calls of the op in the function: the first, marked inexact
                return SiteKey(path, hits[0]), len(hits) == 1
    return SiteKey(path, first), False


def _function_span(path: str, line: int, fname: str) -> tuple[int, int, int] | None:
    """``(def line, first body line, last line)`` of the innermost function named like ``fname``
    whose text (decorators and signature included) holds ``line``; None for module code, a
    resume function or a file that does not parse.

    The profiler's Python tracer names a frame by the line it was on when the tracer first saw it:
    the ``def`` (or its first decorator) for a call made under the profiler, a later line for a
    frame that was already running when the profiler (re)started (after a compile, at a chunk's
    rotation) and for a generator resumed at its ``yield``; the op's call is searched in the
    function's body found here.
    """
    best = _innermost(path, line, fname)
    return best[1:4] if best is not None else None


def _innermost(path: str, line: int, fname: str) -> tuple[int, int, int, int, bool] | None:
    """``(first decorator or def line, def line, first body line, last line, resumable)`` (see
    :func:`_functions`) of the function :func:`_function_span` finds."""
    short = fname.rsplit(".", 1)[-1]
    if short.startswith("<") or dynamo_hooks.RESUME_RE.match(short):
        return None
    best = None
    for start, def_line, body, end, name, resumable in _functions(path, len(linecache.getlines(path))):
        if name == short and start <= line <= end and (best is None or start >= best[0]):
            best = (start, def_line, body, end, resumable)
    return best


@functools.lru_cache(maxsize=256)
def _functions(path: str, n_lines: int) -> tuple[tuple[int, int, int, int, str, bool], ...]:
    """Every function of ``path`` as ``(first decorator or def line, def line, first body line,
    last line, name, resumable)`` (cached per file and length: linecache's text is the one
    parsed); ``resumable``: a generator or a coroutine (``async def``, or its own body, not a
    nested function's, yields), whose every resume the profiler names as a frame of its own."""
    import ast

    try:
        tree = ast.parse("".join(linecache.getlines(path)))
    except (SyntaxError, ValueError):
        return ()

    def yields(node: Any) -> bool:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Yield, ast.YieldFrom)):
                return True
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)) \
                    and yields(child):
                return True
        return False

    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            out.append((start, node.lineno, node.body[0].lineno, node.end_lineno or node.lineno, node.name,
                        isinstance(node, ast.AsyncFunctionDef) or yields(node)))
    return tuple(out)


def _find_file(efile: str) -> str:
    for known in _KNOWN_FILES:
        if known.endswith(os.sep + efile) or known == efile:
            return known
    for p in sys.path:
        cand = os.path.join(p or os.getcwd(), efile)
        if os.path.exists(cand):
            return cand
    return efile


def _process_events(
    raw: list[Any], mode: str
) -> tuple[list[_Event], collections.Counter, CudaCounts, int]:
    """Turn raw profiler events into sync events the method wrappers did not already record.

    Also returns how many events could not be read (a torch release whose events lack a method
    read here): the caller says so rather than count fewer syncs silently.
    """
    evs: dict[int, list[_Ev]] = collections.defaultdict(list)
    py_calls: collections.Counter = collections.Counter()
    gpu_dtoh: set[int] = set()
    cuda = CudaCounts()
    unreadable = 0
    for e in raw:
        name = _name(e)
        if name is None:
            continue
        try:
            is_py = e.is_python_function()
            if str(e.device_type()).endswith("CUDA"):
                if name.startswith("Memcpy DtoH"):
                    gpu_dtoh.add(e.correlation_id())
                # NOTE: some builds report the runtime API calls (cudaStreamSynchronize, ...)
                # with the CUDA device type too: keep those, drop kernels and GPU-side copies.
                if name not in _CUDA_SYNC and name != "cudaMemcpyAsync":
                    continue
            ev = _Ev(name, e.start_ns(), e.end_ns(), e.start_thread_id(), is_py, e.correlation_id())
        except Exception:
            unreadable += 1
            continue
        if is_py:
            u = _py_user_event(name)
            if u is not None:
                py_calls[u] += 1
        evs[ev.tid].append(ev)

    out: list[_Event] = []
    for tid_events in evs.values():
        tid_events.sort(key=lambda x: (x.start, -x.end))
        stack: list[_Ev] = []
        counted: set[int] = set()
        for ev in tid_events:
            while stack and not (stack[-1].start <= ev.start and ev.end <= stack[-1].end):
                stack.pop()
            is_sync_op = ev.name in _SYNC_OPS
            is_cuda_sync = ev.name in _CUDA_SYNC or (
                ev.name == "cudaMemcpyAsync" and ev.corr in gpu_dtoh
            )
            if is_sync_op or is_cuda_sync:
                site, fn, code_key, exact = _attribute(stack)
                if is_cuda_sync:
                    counted_as = _CUDA_SYNC.get(ev.name, "dtoh_memcpy")
                    setattr(cuda, counted_as, getattr(cuda, counted_as) + 1)
                    cuda.by_site[site] += 1
                elif not any(
                    s.name.startswith("torchsync_pass::") for s in stack
                ):  # the wrappers recorded this one already
                    compile_time = site == _IMPORT_SITE or any(
                        s.name.endswith("(dynamo_timed)") for s in stack
                    )
                    outer = next((s for s in stack if not s.is_py and s.name in _OP_KIND), ev)
                    if id(outer) not in counted:
                        counted.add(id(outer))
                        kind = _OP_KIND.get(outer.name, "local_scalar_dense")
                        above = stack[: stack.index(outer)] if outer is not ev else stack
                        if any(not s.is_py and s.name.startswith("aten::") for s in above):
                            # e.g. aten::linalg_solve reading its info tensor (aten::item)
                            kind = "in_op"
                        device = "cpu" if mode == "cpu-as-device" else ""
                        out.append(
                            _Event(kind, site, fn, code_key, device, compile_time=compile_time,
                                   line_exact=exact)
                        )
            stack.append(ev)
    # NOTE: on an accelerator run a profiler-only read has no tensor device attached; it is
    # counted as a sync (most are reads of device tensors inside compiled graphs).
    return out, py_calls, cuda, unreadable


_STACK_LINE_RE = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def _fx_site(fx_file: str, op: str) -> tuple[SiteKey, str, bool] | None:
    """The user line of the call of ``op`` in the nosync FX graph whose code is ``fx_file``.

    NOTE: an op run by a compiled graph (nosync's eager codegen runs the FX graph's own Python,
    ``<eval_with_key>.N``) was traced from a user line that may sit in a function Dynamo inlined;
    the graph node's ``stack_trace`` keeps that line. Exact when one node calls ``op`` (or all
    such nodes come from one line).
    """
    backend = sys.modules.get(__package__ + ".backend")
    if backend is None:
        return None
    inop = sys.modules.get(__package__ + ".inop")  # a tabulated op's cone runs as its own module
    tabulated = inop.cone_modules() if inop is not None else []
    for gm in [entry.get("graph") for entry in reversed(backend.compiled_graphs())] + tabulated:
        code = getattr(getattr(gm, "forward", None), "__code__", None)
        if code is None or code.co_filename != fx_file:
            continue
        lines = []
        for node in gm.graph.nodes:
            name = getattr(node.target, "__name__", str(node.target)).split(".")[0]
            if node.op in ("call_function", "call_method") and name == op:
                m = _STACK_LINE_RE.findall(node.meta.get("stack_trace") or "")
                if m:
                    lines.append(m[-1])
        if lines:
            path, line, fname = lines[0]
            _KNOWN_FILES.add(path)
            return SiteKey(path, int(line)), fname, len(set(lines)) == 1
        return None
    return None


def _attribute(stack: list[_Ev]) -> tuple[SiteKey, str, tuple | None, bool]:
    op = None
    for s in reversed(stack):
        if not s.is_py:
            continue
        m = _BUILTIN_RE.match(s.name)
        if m:
            if op is None:
                op = (m.group(1), " of Tensor object" not in s.name)
            continue
        if op is not None and s.name.startswith("<eval_with_key>"):
            found = _fx_site(s.name.split("(", 1)[0], op[0])
            if found is not None:
                site, fname, exact = found
                return site, fname, None, exact
            continue
        u = _py_user_event(s.name)
        if u is not None:
            efile, first, fname = u
            if _is_import_machinery(efile) or efile.startswith("importlib/"):
                return _IMPORT_SITE, "", None, False
            span = _function_span(_find_file(efile), first, fname)
            if span is not None:
                first = span[0]  # the def line: the function, whichever line the profiler saw
            site, exact = _guess_line(efile, first, fname, op, span)
            return site, fname, (site.file, first, fname), exact
    return SiteKey("<unknown>", 0), "", None, False


# --------------------------------------------------------------------------------------------
# The process-wide session: one set of wrappers, one profiler, many (nested) counters
# --------------------------------------------------------------------------------------------
#: A profiler chunk is closed and digested after at most this many seconds (at the next
#: intercepted sync), so a long run keeps a bounded trace in memory.
PROFILER_CHUNK_S = 1.0
#: ... and a chunk's length adapts to the events it holds: the first lasts PROFILER_CHUNK_MIN_S;
#: a chunk that held more than PROFILER_CHUNK_EVENTS makes the next one shorter in proportion,
#: one that held fewer than a quarter of that makes it twice as long. NOTE: a serving loop of tiny
#: steps records about 730 events a step (the Python tracer), up to 600,000 a second: 20 s of it
#: were 4.4 million events, 8 GB to hold and 86 s to digest (review 17); about 2 KB an event.
PROFILER_CHUNK_MIN_S = 0.25
PROFILER_CHUNK_EVENTS = 100_000


class _Session:
    """NOTE [Profiler chunks]: the profiler's Python tracer records every Python call. Left on
    while Dynamo compiles or modules import (millions of Python calls) it made explain on a tiny
    diffusers pipeline take minutes and 2-12 GB (importing diffusers under the tracer alone:
    100 s, 7.7 GB). So the profiler is stopped, its events digested, while Dynamo compiles a frame
    and while a module loads, and a running chunk is digested after at most ``PROFILER_CHUNK_S``
    seconds (shorter where chunks hold many events: ``PROFILER_CHUNK_EVENTS``).
    It restarts at the next safe point (see :meth:`resume`); profiler-only syncs
    (``torch.equal(a, b)``, syncs inside ops) that run before then are not seen, while the method
    wrappers see theirs throughout. Reads made while compiling are ``compile_time``, not in
    ``total``.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._recs: list[SyncCounts] = []
        self._prof: _Profiler | None = None
        self._unpatch: Callable[[], None] = _nothing
        self._unwatch: Callable[[], None] = _nothing
        self._paused = 0  # compiles in progress that stopped the profiler
        self._chunk_end = 0.0
        self._chunk_s = PROFILER_CHUNK_MIN_S  # see PROFILER_CHUNK_EVENTS
        self.resume_pending = False
        self._pending_since = 0.0  # when the profiler last stopped waiting for a safe point
        self._owner = 0  # the thread of the newest count still open: see resume
        self._open_at_stop: dict[int, Any] = {}  # the owner's running frames at the last stop
        self._missed = False  # a safe point of another thread (or an unsafe one) came while paused
        self.active = False
        self.profiling = False
        self.accelerator = False

    def recorders(self) -> list[SyncCounts]:
        return list(self._recs)

    def enter(self, rec: SyncCounts) -> None:
        with self._lock:
            self._flush()
            if not self._recs:
                self.accelerator = torch.cuda.is_available()
                self._unpatch = _patch_tensor_methods()
                self._watch_pauses()
            rec._thread = threading.get_ident()
            self._recs.append(rec)
            self._owner = rec._thread  # the newest count's thread: see resume
            self.active = True
            self._restart()
            if rec.want_profiler and not self.profiling:
                rec.notes.append(
                    "another profiler was active: only Python-level interception was used "
                    "(torch.equal(a, b), torch.nonzero(x) and in-graph syncs are not counted)"
                )

    def exit(self, rec: SyncCounts) -> None:
        with self._lock:
            gap = time.monotonic() - self._pending_since
            if (rec.want_profiler and rec.profiled and self.resume_pending and not self._paused
                    and (gap > GAP_NOTE_S or self._missed)):
                rec.notes.append(GAP_NOTE.format(gap=gap))
            self._flush()
            self._recs.remove(rec)
            if self._recs:
                self._owner = self._recs[-1]._thread
            if not self._recs:
                self.active = False
                self._unpatch()
                self._unwatch()
                self._unpatch = self._unwatch = _nothing
                self._paused = 0
                self.resume_pending = False
            self._restart()

    def _watch_pauses(self) -> None:
        removers = []
        for what, watch in (("Dynamo compiles", _torch_private.watch_compiles),
                            ("module imports", _torch_private.watch_imports)):
            try:
                removers.append(watch(self._paused_by, self._ended))
            except Exception:
                log.warning("torchsync_pass: could not watch %s; the profiler stays on during them "
                            "(slow, memory-hungry on large programs)", what, exc_info=True)
        try:  # each call of a compiled function is a safe point too (see resume)
            removers.append(_torch_private.watch_compiled_calls(self.at_safe_point))
        except Exception:
            log.warning("torchsync_pass: could not watch calls of compiled functions; after a compile "
                        "the profiler restarts only at an intercepted tensor method", exc_info=True)

        self._unwatch = lambda: [remove() for remove in removers]

    def _paused_by(self) -> None:
        """Dynamo starts compiling, or a module starts loading: digest the chunk, stop the profiler."""
        with self._lock:
            if self._paused or self.profiling or self.resume_pending:
                self._paused += 1
                if self._paused == 1:
                    self.resume_pending = False
                    self._flush()

    def _ended(self) -> None:
        """The compile or import is done: the profiler restarts at the next safe point."""
        with self._lock:
            if self._paused:
                self._paused -= 1
                self.resume_pending = not self._paused
                self._pending_since = time.monotonic()
                self._missed = False

    def resume(self, frame: Any) -> None:
        """Restart the paused profiler, if ``frame`` is a safe point.

        NOTE: a safe point is an intercepted tensor method call (``.to()``, ``t[i]``, ``.item()``,
        ...) with neither Dynamo, the import machinery nor a compiled function (nor the output
        code of one: see NOTE [Compiled regions]) on the stack
        (:func:`_torch_private.frame_runs_under_dynamo`): starting the Python tracer from Dynamo's
        compile callbacks, from the import machinery, while compiled code ran, or from a
        ``sys.setprofile`` callback made the interpreter crash when the tracer stopped.

        Only in the thread of the newest count still open (``_owner``): a restart (or a chunk's
        digest) from a worker thread while another ran ops lost most of that thread's events
        (review 18: 1.26 of 3 reads inside a solve a call counted, two worker threads calling a
        compiled function). An older count's thread working while the newest's waits is not
        counted by the profiler then (the stop note says so).
        """
        if threading.get_ident() != self._owner or self._unsafe(frame):
            self._missed = self._missed or self.resume_pending
            return
        with self._lock:
            if self.resume_pending and not self._paused:
                self.resume_pending = False
                self._missed = False
                self._restart()

    @staticmethod
    def _unsafe(frame: Any) -> bool:
        try:
            return _torch_private.frame_runs_under_dynamo(frame)
        except Exception:  # unknown is unsafe: a restart inside a compiled region corrupts the heap
            log.debug("torchsync_pass: could not check the stack for a safe point", exc_info=True)
            return True

    def at_safe_point(self, frame: Any) -> None:
        """A call that may restart the paused profiler (a compiled function's entry, ``backward``):
        restart it, or digest an old chunk, where ``frame`` is safe."""
        if not self.active:
            return
        if self.resume_pending:
            self.resume(frame)
        else:
            self.maybe_rotate(frame)

    def maybe_rotate(self, frame: Any) -> None:
        """Digest the running profiler chunk when it is older than ``PROFILER_CHUNK_S`` (in the
        newest open count's thread only: see resume)."""
        if self.profiling and time.monotonic() > self._chunk_end and threading.get_ident() == self._owner:
            with self._lock:
                if self.profiling and not self._paused:
                    self._flush()
                    self.resume_pending = True
                    self._pending_since = time.monotonic()
            self.resume(frame)

    def _restart(self) -> None:
        want = [r for r in self._recs if r.want_profiler]
        if not want or self._paused or self.profiling:  # a compile in progress restarts it when done
            return
        prof = _Profiler(stacks=any(r.want_stacks for r in want))
        try:
            ok = prof.start()
        except Exception:
            log.warning("torchsync_pass: could not start the profiler", exc_info=True)
            ok = False
        if ok:
            self._prof = prof
            self.profiling = True
            # A call running since before the last stop is reported again by the new session (as
            # running): its function's calls would count it once per restart (review 23: main()
            # called once showed 3 to 5 calls, one per profiler chunk). Such functions show '-'.
            before = self._open_at_stop
            spanning = {_code_key(code) for key, code in _open_frames(self._owner).items()
                        if before.get(key) is code}
            if spanning:
                for r in want:
                    with r._lock:
                        r._calls_spanning |= spanning
            self._chunk_end = time.monotonic() + self._chunk_s
            for r in want:
                r.profiled = True
        elif any(r.profiled for r in want):  # another profiler took over (one started inside)
            self.resume_pending = True  # try again at the next safe point: it may have ended
            for r in want:
                if CUT_NOTE not in r.notes:
                    r.notes.append(CUT_NOTE)

    def _flush(self) -> None:
        prof, self._prof = self._prof, None
        self.profiling = False
        if prof is None:
            return
        self._open_at_stop = _open_frames(self._owner)
        # NOTE: Kineto runs one session: a torch.profiler.profile() entered and left inside the
        # counted code ends ours too, and what ours had recorded is gone
        cut = not _torch_private.profiler_enabled()
        raw = prof.stop()
        n = len(raw) if isinstance(raw, (list, tuple)) else 0
        if n > PROFILER_CHUNK_EVENTS:
            self._chunk_s = max(PROFILER_CHUNK_MIN_S / 16, self._chunk_s * PROFILER_CHUNK_EVENTS / n)
        elif n < PROFILER_CHUNK_EVENTS // 4:
            self._chunk_s = min(PROFILER_CHUNK_S, self._chunk_s * 2)
        recs = [r for r in self._recs if r.want_profiler]
        for r in recs if cut else ():
            if CUT_NOTE not in r.notes:
                r.notes.append(CUT_NOTE)
        try:
            if not raw or not recs:
                return
            events, py_calls, cuda, unreadable = _process_events(raw, recs[0].mode)
        finally:
            del raw, prof  # the profiler's results: free them before recording
        if unreadable:
            _say_unreadable(unreadable, recs)
        for r in recs:
            for ev in events:
                r._add(ev)
            with r._lock:
                r._py_calls.update(py_calls)
            r.cuda.stream_synchronize += cuda.stream_synchronize
            r.cuda.device_synchronize += cuda.device_synchronize
            r.cuda.dtoh_memcpy += cuda.dtoh_memcpy
            r.cuda.by_site.update(cuda.by_site)


#: the profiler stayed off this long (seconds) before the end of a count: say so
GAP_NOTE_S = 0.01
GAP_NOTE = (
    "the profiler stopped for a compile, an import or a chunk's digest and no safe point to restart it came "
    "in the last {gap:.2f} s of the counted code (no intercepted tensor method, backward() or compiled "
    "function call outside compiled code, in the thread of the newest count still open): syncs only the profiler "
    "sees (torch.equal(a, b), syncs inside ops and compiled graphs) in that time are not counted")
CUT_NOTE = (
    "a profiler session started inside the counted code (torch.profiler.profile, "
    "torch.autograd.profiler.profile) stopped the counter's own for a while: syncs only the profiler sees "
    "(torch.equal(a, b), torch.nonzero(x), syncs inside ops and compiled graphs) are undercounted"
)
UNREADABLE_NOTE = (
    "some profiler events could not be read on torch {version}: syncs only the profiler sees "
    "(torch.equal(a, b), torch.nonzero(x), syncs inside ops and compiled graphs) may be undercounted"
)
_warned_unreadable = False


def _say_unreadable(n: int, recs: list[SyncCounts]) -> None:
    """Profiler events were dropped: note it on every counter that missed them, warn once."""
    global _warned_unreadable
    note = UNREADABLE_NOTE.format(version=torch.__version__)
    for r in recs:
        if note not in r.notes:
            r.notes.append(note)
    if not _warned_unreadable:
        _warned_unreadable = True
        log.warning("torchsync_pass.count_syncs: %d %s", n, note)


_SESSION = _Session()

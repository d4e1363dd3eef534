"""Records of what torchsync_pass saw and decided.

Every decision the nosync backend takes about a sync site (hoisted, rejected, demoted) is a frozen
dataclass with an Enum reason. The explain CLI, the ``TORCH_LOGS=nosync`` log, the counters and the
tests all read these same records, so none of them parses log text.

This module is pure Python (no torch import) so the CLI can render reports cheaply.
"""

from __future__ import annotations

import contextlib
import enum
import linecache
import threading
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator


@dataclass(frozen=True, order=True)
class SiteKey:
    """A user source location: the file as the program ran it and a 1-based line."""

    file: str
    line: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}"

    def source(self) -> str:
        return linecache.getline(self.file, self.line).strip()


class Action(enum.Enum):
    HOISTED = "hoisted"
    REJECTED = "rejected"
    DEMOTED = "demoted"
    TABULATED = "tabulated"  # an op that syncs inside, computed for every index once per request (inop.py)
    CACHED = "cached"  # a request-invariant tensor computed once per request (invariant.py)
    NOT_CACHED = "not cached"
    REWRITTEN = "rewritten"  # a host read used only as an index, traced as device work (rewrite.py)
    KEPT = "kept"  # a host read that was not rewritten: the sync stays (rewrite.py; the Reason says why)


class Reason(enum.Enum):
    # HOISTED
    INVARIANT_CONE = "every leaf is request-invariant and the cone is pure"
    TABLE_LIFTED = (
        "a pure function of request-invariant tables read at a host int index: answered for every "
        "index from a host mirror computed once per request"
    )
    # REJECTED
    NO_TENSOR_LEAF = "the value does not come from a tensor the pass can trace back"
    CONSTANT_LEAF = "depends on a tensor created inside the step (no input leaf to guard on)"
    IMPURE_OP = "the cone contains a random or side-effecting op"
    MUTATION = "a leaf (or a view of it) is written in place before the sync"
    SUBGRAPH = "the value is computed inside a higher-order op subgraph"
    SYMBOLIC = "the cone depends on a symbolic value (dynamic shapes, or an int Dynamo made dynamic)"
    CROSS_BREAK_INPUT = (
        "a leaf is a value an earlier graph of this frame computed and handed across a graph break: "
        "new on every call, never speculated"
    )
    TABLE_INDEX_OUTSIDE = ("the tables give no answer to hoist at this index: it is outside them, or the answer "
                           "there is one eager raises for or nosync does not hoist (a complex value); left to "
                           "eager (the same answer or error)")
    TABLE_STEP_VARYING = "the table answer varies with the index: more distinct answers than max_specializations"
    TABLE_TOO_LARGE = "the tables are too long to mirror on the host"
    NO_SOURCE = "a leaf has no guardable source (created inside the step)"
    INFERENCE_TENSOR = "an inference tensor has no _version; declare it in options['invariant'] to hoist"
    TRAINABLE_LEAF = (
        "a leaf requires grad: optimizers can update it without bumping _version (fused Adam/SGD); "
        "declare it in options['invariant'] to hoist"
    )
    HIDDEN_WRITER = (
        "a leaf is written by an op that does not bump _version (batch-norm running statistics "
        "in training mode, QAT's fused fake quant, fused optimizers, a write under "
        "_unsafe_preserve_version_counter); declare it in options['invariant'] to hoist"
    )
    AUTOCAST = "traced under autocast: the value depends on the autocast state"
    UNSUPPORTED_VALUE = "the value has a dtype or shape the pass does not hoist"
    EVAL_FAILED = "evaluating the cone at trace time failed"
    SYNCING_OP_IN_CONE = (
        "the cone runs an op that syncs inside (a linalg error check): each evaluation of the cone (at "
        "the trace, and by the guard at a new request) would cost its syncs again, on top of the step's"
    )
    NOT_ROOT_TRACER = "the sync sits in a nested tracer (e.g. a torch.cond branch)"
    DISABLED = "the site was demoted earlier and is left to stock Dynamo"
    # TABULATED / REJECTED syncs inside ops (inop.py)
    IN_OP_TABULATED = (
        "an op that syncs inside (linalg error and pivot checks) on request-invariant tables at a host "
        "int index: its value at every index computed once per request by the same ops, read per step"
    )
    STATE_REGION = (
        "the step changes a global setting (default dtype, a backend switch, deterministic "
        "algorithms, ...) in the graph: a guard re-running the cone would run it under the caller's setting"
    )
    IN_OP_ALIASED = "the graph writes the op's result in place or returns it: a cached value could be changed"
    IN_OP_STATE_REGION = (
        "the graph changes grad mode, inference mode or autocast inside: a table computed once per "
        "request would run under the caller's state, not the region's"
    )
    IN_OP_INDUCTOR = (
        "Inductor codegen: Inductor computes the op's inputs with its own fused kernels, so a table "
        "computed by the eager ops would not be bitwise equal to stock Inductor; use codegen='eager'"
    )
    # DEMOTED
    TOO_MANY_VALUES = "the value took more distinct values than max_specializations"
    LEAVES_CHANGE = "its leaves change on most calls (new tensors, or the same ones written in place)"
    RECOMPILE_BUDGET = "its frame used up the recompile budget; compiled the stock way from now on"
    # CACHED / NOT_CACHED (tensors, not syncs)
    INVARIANT_TENSOR = ("computed only from request-invariant inputs through pure ops: once per request "
                        "(again on each call whose inputs are new tensors or were written in place; an input "
                        "speculated invariant because a hoisted sync read it, such as a timestep, may be new "
                        "at every step until that sync is demoted)")
    CACHE_BYTES = "does not fit in options['invariant_cache_bytes']: recomputed every step"
    # REWRITTEN / KEPT (rewrite.py: reads used only as an index)
    INDEX_TENSOR = "used only as an index into a tensor: traced as a device-side gather (aten.index), no host read"
    INDEX_LIST = (
        "used only as an index into a Python list of same-shape tensors: the stacked list is gathered "
        "on the device (aten.index), no host read"
    )
    BRANCH_WHERE = (
        "a step-varying test that only chooses between tensors: both arms traced, torch.where selects "
        "the taken arm's bits on the device (index ops of the arm not taken masked to 0), no host read"
    )
    BRANCH_FORM = "the branch is not an if/else whose arms are straight-line code that joins again"
    BRANCH_SIDE_EFFECT = "an arm has a side effect (a mutation, an in-place or random op): it cannot run untaken"
    BRANCH_VALUES = "the arms differ in something other than contiguous tensors of one shape, dtype and device"
    BRANCH_MAY_RAISE = "an arm runs an op that may raise for the values of the arm eager skips"
    BRANCH_COST = "an arm traces too many ops to run both arms at every step"
    BRANCH_IDENTITY = "later code compares the chosen object by identity (`is`)"
    REWRITE_OTHER_USE = ("the read is not one the index rewrite takes (a direct read in user code used only as an "
                         "index into a tensor or a list of tensors)")
    REWRITE_TABLE = "the indexed object is not a tensor or a list of same-shape contiguous tensors"
    REWRITE_ALIASED = (
        "eager's own tensor would be observable (a list row, or a branch's arm, written in place or "
        "returned, or its table written after the read): a gathered row or a select is a copy"
    )


@dataclass(frozen=True)
class Decision:
    """One decision of the nosync backend about one sync site."""

    site: SiteKey
    kind: str  # "item", "tolist", "bool", "int", "float"
    action: Action
    reason: Reason
    code: str  # qualified name of the compiled function's code object
    source: str = ""
    detail: str = ""
    value: str = ""  # repr of the hoisted value, when hoisted
    leaves: tuple[str, ...] = ()  # user names of the cone leaves
    compile_id: str = ""  # Dynamo's compile id of the frame being traced ("0/1", ...)
    nbytes: int = 0  # bytes of a cached (or too large) invariant tensor

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["site"] = {"file": self.site.file, "line": self.site.line}
        d["action"] = self.action.value
        d["reason"] = self.reason.name
        d["reason_text"] = self.reason.value
        return d


MAX_DECISIONS = 10_000


@dataclass
class DecisionLog:
    """Process-wide list of decisions, in the order they were taken (thread-safe).

    Bounded: a server that reloads its model keeps compiling, so only the newest
    ``MAX_DECISIONS`` records are kept.
    """

    _items: deque = field(default_factory=lambda: deque(maxlen=MAX_DECISIONS))
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _added: int = 0  # records ever added (never reset), for since()
    _taps: "Taps" = field(default_factory=lambda: Taps())  # open through tap(): see there

    def add(self, d: Decision) -> None:
        with self._lock:
            self._items.append(d)
            self._added += 1
            self._taps.send(d)

    def tap(self, stamp: Any = None) -> Any:
        """A :class:`Tap` that receives every record added while the block runs, in order (the
        newest ``MAX_DECISIONS``); ``clear()`` (``torchsync_pass.reset()`` inside the block) does
        not empty it (explain's record)."""
        return self._taps.open(MAX_DECISIONS, stamp)

    def all(self) -> list[Decision]:
        with self._lock:
            return list(self._items)

    def mark(self) -> int:
        """A position in the log, for :meth:`since`."""
        with self._lock:
            return self._added

    def since(self, mark: int) -> list[Decision]:
        """The records added after ``mark`` (those still kept)."""
        with self._lock:
            n = self._added - mark
            return list(self._items)[-n:] if n > 0 else []

    def clear(self) -> None:
        with self._lock:
            self._items.clear()


class Tap(deque):
    """What a tap received: the newest records (bounded, as the log is), and how many it got;
    with a ``stamp`` function, ``stamps`` holds what it returned as each record came."""

    added = 0
    stamp: Any = None

    def append(self, x: Any) -> None:
        super().append(x)
        self.added += 1
        if self.stamp is not None:
            self.stamps.append(self.stamp())


class Taps(list):
    """The taps open on one stream of records (a list of them, thread-safe)."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()

    def send(self, x: Any) -> None:
        """Hand ``x`` to every open tap."""
        with self._lock:
            for t in self:
                t.append(x)

    @contextlib.contextmanager
    def open(self, maxlen: int, stamp: Any = None) -> Iterator[Tap]:
        got = Tap(maxlen=maxlen)
        if stamp is not None:
            got.stamp, got.stamps = stamp, deque(maxlen=maxlen)
        with self._lock:
            self.append(got)
        try:
            yield got
        finally:
            with self._lock:
                # NOTE: by identity, not list.remove's ==: two open taps holding the same records
                # (both empty) are equal, and closing the inner one of nested explain runs removed
                # the outer one
                del self[next(i for i, t in enumerate(self) if t is got)]


DECISIONS = DecisionLog()


def decisions() -> list[Decision]:
    """All nosync decisions taken in this process so far."""
    return DECISIONS.all()


# The backend's compile records (``backend.compiled_graphs()``) as explain sees them: the backend
# hands each new record to the lists open here, which ``torchsync_pass.reset()`` does not empty
# (kept in this module, which explain imports without loading the backend).
_COMPILE_TAPS = Taps()
MAX_COMPILE_RECORDS = 1024  # a tap keeps the newest (each holds its graph until torch._dynamo.reset())


def compiled(entry: dict) -> None:
    """Called by the backend for each graph it compiled."""
    _COMPILE_TAPS.send(entry)


def compile_tap(stamp: Any = None) -> Any:
    """A :class:`Tap` that receives every compile record the backend makes while the block runs."""
    return _COMPILE_TAPS.open(MAX_COMPILE_RECORDS, stamp)


_guard_tls = threading.local()


class guard_site:  # noqa: N801 - used as a function: ``with guard_site(site):``
    """Marks a nosync guard re-running the cone of ``site`` (its one real sync per request).

    The sync counter attributes reads made inside to the hoisted line instead of Dynamo's
    generated guard code. (A class, not a generator context manager: it runs once per hoisted
    cone at every new request.)
    """

    __slots__ = ("site", "saved")

    def __init__(self, site: SiteKey) -> None:
        self.site = site

    def __enter__(self) -> None:
        self.saved = getattr(_guard_tls, "site", None)
        _guard_tls.site = self.site

    def __exit__(self, *exc: Any) -> bool:
        _guard_tls.site = self.saved
        return False


def current_guard_site() -> "SiteKey | None":
    return getattr(_guard_tls, "site", None)

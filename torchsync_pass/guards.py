"""Hoisted constants: the per-site state, the memo, the guard, and demotion.

A hoisted sync becomes a Python constant in the traced frame plus a guard over the cone's leaves:

    guard(L, G):
        leaves = (L['token_types'], L['self']._buffers['mask'])
        key = memo.lookup(leaves)           # weak identity + _version, data_ptr, shape, stride, dtype
        if key is None:                     # new object or written in place: one real sync
            key = run_cone(leaves); memo.store(leaves, key)
        return key == specialised_key       # floats compared bitwise

The memo is a small LRU per cone, shared by every cache entry of the site, so interleaved requests
(A, B, A, B, ...) hit it and only a genuinely new leaf costs a sync. A new value fails the guard;
Dynamo recompiles, the policy sees the value again (from the memo, no second sync) and specialises
a new cache entry. Returning to an old value costs nothing.

All checks of one cache entry run as one function (:meth:`SiteCheck.fuse`): each leaf is read
once, and a call whose leaves are the very objects of the last passing call, unchanged, is answered
without touching the memos.

Demotion keeps speculation from turning into a recompile storm: its rules are listed together
in the section "Demotion: the rules" below.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import itertools
import json
import logging
import operator
import struct
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from . import _torch_private, dynamo_hooks, names
from .cone import (FREEZING_NOTE, FREEZING_WARNING, HOISTED_LEAF_META, WARNED_FROZEN, ConeResult,
                   _autocast_devices, analyze_cone, cone_of, hidden_writes_to_hoisted, mark_hoisted, op_namespace,
                   state_region_of, storage_of, written_storages)
from .errors import never_silent
from .report import DECISIONS, Action, Decision, Reason, SiteKey, guard_site

log = logging.getLogger(__name__)

MEMO_SIZE = 8
MAX_LIST_LEN = 1024


counters = _torch_private.nosync_counters


# ----------------------------------------------------------------------------------------------
# Values
# ----------------------------------------------------------------------------------------------
# NOTE: torch.Tensor's own methods, not ``t.item()``/``bool(t)``: a cone that returns its leaf
# returns the caller's object, and a subclass's Python override (``def item(self): return
# super().item() + 1``) was already traced by Dynamo around the read (the read is its inner
# ``Tensor.item``): calling the override again would apply it twice. Looked up on the class at
# each call, not bound here: count_syncs wraps them there, and books a guard's read to its site.
_CONVERT: dict[str, Callable[[torch.Tensor], Any]] = {
    "item": lambda t: torch.Tensor.item(t),
    "tolist": lambda t: torch.Tensor.tolist(t),
    "bool": lambda t: torch.Tensor.__bool__(t),
    "int": lambda t: torch.Tensor.__int__(t),
    "float": lambda t: torch.Tensor.__float__(t),
    "index": lambda t: torch.Tensor.__index__(t),
}


# the reads that are Python builtins on the tensor (``int(t)``, ``bool(t)``, ``if t:``,
# ``operator.index(t)``), not methods Dynamo dispatches to a subclass as eager does
_BUILTIN_READS = frozenset({"bool", "int", "float", "index"})


def value_key(v: Any) -> Any:
    """Hashable key equal for two values iff they are the same value bit for bit."""
    t = type(v)
    if t is float:
        return (float, struct.pack("<d", v))
    if t is list:
        return (list, tuple(value_key(x) for x in v))
    if t in (bool, int):
        return (t, v)
    raise UnhoistableValue(f"value of type {t.__name__}")


class UnhoistableValue(TypeError):
    """:func:`value_key` of a value nosync does not hoist (complex, a tuple, ...)."""


def _hoistable(v: Any, depth: int = 0) -> bool:
    if type(v) in (bool, int, float):
        return True
    if type(v) is list and depth < 4:
        return len(v) <= MAX_LIST_LEN and all(_hoistable(x, depth + 1) for x in v)
    return False


# ----------------------------------------------------------------------------------------------
# Memo
# ----------------------------------------------------------------------------------------------
# What identifies a leaf's contents without reading them. Written once, as expressions over ``t``:
# _fingerprints, the memo lookup and the generated fast paths (SiteCheck.fuse, the invariant
# runner) all use these.
# Besides version, data pointer, shape, stride and dtype: device, requires_grad and the conjugate
# and negative bits (``t.data = t.conj()`` keeps all the others; a leaf whose requires_grad flips
# needs a cached value with its autograd graph), so the memo is never looser than the fast path.
# An undeclared leaf: ``_version`` raises on an inference tensor, so the guard fails closed.
# The address of the leaf's StorageImpl (:func:`_torch_private.storage_address`) tells a
# ``t.data = new`` swap apart: the swap keeps the object and its version, and the allocator may
# hand the new data the address a freed earlier weight had (an older memo entry then matched:
# review 22). A key holds weak references to its leaves' storages (:func:`storage_pins`): while it
# lives, no other storage can be made at an address it names.
_FP_VERSIONED = "({t}._version, {t}.data_ptr(), _nosync_storage_address({t}), {t}.shape, {t}.stride(), {t}.dtype, {t}.device, {t}.requires_grad, {t}.is_conj(), {t}.is_neg())"
# A declared leaf, decided per tensor (never per cone: one argument can be an inference tensor on
# one call and an ordinary one on the next): an inference tensor has no ``_version``, it is checked
# by identity and metadata only (the user promised no in-place writes); any other by its version.
_FP_DECLARED = "({t}.is_inference() or {t}._version, {t}.data_ptr(), _nosync_storage_address({t}), {t}.shape, {t}.stride(), {t}.dtype, {t}.device, {t}.requires_grad, {t}.is_conj(), {t}.is_neg())"
# the name the fingerprint expressions call the storage's address by: every namespace that runs
# them (these lambdas, the fused guard, the invariant runner) binds it (FP_ENV)
FP_ENV = {"_nosync_storage_address": _torch_private.storage_address}
_fp_versioned = eval("lambda t: " + _FP_VERSIONED.format(t="t"), dict(FP_ENV))  # noqa: S307 - constant source
_fp_declared = eval("lambda t: " + _FP_DECLARED.format(t="t"), dict(FP_ENV))  # noqa: S307 - constant source


def storage_pins(leaves: tuple) -> tuple:
    """Weak references to the leaves' storages: they keep each StorageImpl's memory (not its data)
    allocated, so its address, in the fingerprints taken with them, names no later storage."""
    return tuple([_torch_private.storage_pin(t) for t in leaves])


def _fingerprints(leaves: tuple, declared: Any) -> tuple:
    return tuple([_fp_declared(t) if d else _fp_versioned(t) for t, d in zip(leaves, declared)])


# The fast paths ("the very leaves of the last call, unchanged": the fused guard, the invariant
# runner) compare the same fingerprint split in two: version and data pointer in Python, and
# dtype, sizes and strides (with device, requires_grad and dispatch keys: stricter, so a fast path
# falls back to the memo more often, never less) in one C++ call, ``_torch_private.tensor_match``.
# Where that is unavailable the key holds the full fingerprints and no check.
_VP_VERSIONED = "{t}._version, {t}.data_ptr(), _nosync_storage_address({t})"
_VP_DECLARED = "{t}.is_inference() or {t}._version, {t}.data_ptr(), _nosync_storage_address({t})"


def fast_key(leaves: tuple, declared: Any, previous: Optional[tuple] = None) -> tuple:
    """``(values, check, pins)``: what :func:`same_call_expr` compares the leaves of a later call
    with (``pins``: :func:`storage_pins`, held as long as the key).

    ``previous``, the caller's last key: its metadata check is kept when it passes on these leaves
    (a new request's tensors usually have the last one's shapes), so the check says exactly what a
    new one built from them would; building one costs tens of microseconds per new request.
    """
    check = previous[1] if previous is not None else None
    try:
        reuse = check is not None and check(*leaves) is True
    except Exception:  # not tensors, or another count: build one (or none) as without a previous key
        reuse = False
    if not reuse:
        check = _torch_private.tensor_match(leaves)
    pins = storage_pins(leaves)  # taken before the fingerprints (item 2 of each key names them)
    if check is None:
        return _fingerprints(leaves, declared), None, pins
    values: list = []
    for t, d in zip(leaves, declared):
        values.append(t.is_inference() or t._version if d else t._version)
        values.append(t.data_ptr())
        values.append(_torch_private.storage_address(t))
    return tuple(values), check, pins


def same_call_expr(names: list[str], declared: Any, refs: str, key: str) -> str:
    """A Python expression: the leaves bound to ``names`` are the objects the weak references
    ``refs`` point to, unchanged since ``key = fast_key(...)`` was taken (identity first, so a
    fingerprint is read only from the very objects it was taken from)."""
    def tup(items: list[str]) -> str:
        return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"

    same = " and ".join(f"{refs}[{i}]() is {t}" for i, t in enumerate(names))
    full = tup([(_FP_DECLARED if d else _FP_VERSIONED).format(t=t) for t, d in zip(names, declared)])
    split = tup([(_VP_DECLARED if d else _VP_VERSIONED).format(t=t) for t, d in zip(names, declared)])
    return (f"({same}) and ({key}[0] == {full} if {key}[1] is None else "
            f"({key}[1]({', '.join(names)}) and {key}[0] == {split}))")


def bits_state() -> tuple:
    """The global state besides the inputs that changes the bits a cone computes.

    A reduction's bits depend on the thread count (a 2M-element float sum differs between 1 and
    2 threads); matmul precision (the legacy setting and the per-backend ``fp32_precision``
    settings, the last item) and reduced-precision reductions change matmuls. Each guard keeps the
    memo of the state it was compiled under, and checks on every call that the state is still that
    of the frame it was compiled for (:meth:`SiteCheck.state_changed`). Never raises (a mix of the
    legacy and per-backend precision APIs makes ``torch.get_float32_matmul_precision()`` raise).
    """
    matmul = torch.backends.cuda.matmul
    return (
        torch.get_num_threads(),
        _torch_private.float32_matmul_precision(),
        torch.are_deterministic_algorithms_enabled(),
        matmul.allow_fp16_reduced_precision_reduction,
        matmul.allow_bf16_reduced_precision_reduction,
        torch.backends.cudnn.allow_tf32,
        _torch_private.fp32_precisions(),
    )


def value_state() -> tuple:
    """The global state a cached tensor value depends on besides its inputs (the key of the
    invariant runner's and the tabulated ops' memos): grad mode (what a value carries),
    :func:`bits_state`, the default dtype, autocast (each device type's autocast dtype where it is
    on), inference mode (values computed under it are inference tensors). Position 4 is inference
    mode."""
    return (torch.is_grad_enabled(), bits_state(), torch.get_default_dtype(),
            tuple([(d, torch.get_autocast_dtype(d)) for d in _autocast_devices()]),
            torch.is_inference_mode_enabled())


# The ops whose bits no precision setting changes (elementwise ops and reductions as torch tags
# them, and these by name: data movement, indexing, factories); any other op, a module call
# included, counts as one that may (a matmul, a convolution, an RNN, linalg, attention, ...).
_PRECISION_FREE = frozenset({
    "getitem", "__getitem__", "view", "reshape", "permute", "transpose", "t", "contiguous", "expand",
    "expand_as", "squeeze", "unsqueeze", "flatten", "unflatten", "split", "chunk", "narrow", "select",
    "index_select", "gather", "take", "cat", "stack", "roll", "flip", "repeat", "tile", "clone", "to",
    "float", "double", "half", "bfloat16", "int", "long", "bool", "type", "type_as", "embedding",
    "arange", "zeros", "ones", "full", "zeros_like", "ones_like", "full_like",
    "tensor", "size", "dim", "numel", "nonzero", "sort", "argsort", "topk", "cumsum", "cumprod",
    "masked_select", "tril", "triu", "diagonal", "item", "tolist", "detach", "unbind", "movedim",
    "new_zeros", "new_ones", "new_full", "new_tensor", "scalar_tensor",
    "where",  # ``aten.where.default`` is the one-argument form (nonzero's); ``where.self`` selects
})
_PRECISION_TAGS = tuple(t for t in (getattr(torch.Tag, "pointwise", None), getattr(torch.Tag, "reduction", None))
                        if t is not None)


@functools.lru_cache(maxsize=None)
def _precision_free_name(name: str) -> bool:
    if name in _PRECISION_FREE:
        return True
    packet = getattr(torch.ops.aten, name, None) if name.isidentifier() else None
    if packet is None or not _PRECISION_TAGS:
        return False
    # The overloads that take a tensor: the default one where it does (others take Python
    # scalars: ``aten.sum.int``), else any (``aten.mul.default``, ``aten.eq.default`` are the
    # Python-scalar ones; a tensor's ``x.mul(y)``, ``torch.eq(a, b)`` run ``.Tensor``/``.Scalar``).
    try:
        overloads = [getattr(packet, o) for o in packet.overloads()]
        overloads = [o for o in overloads if any(_takes_tensor(a.type) for a in o._schema.arguments)]
    except Exception:
        return False
    default = [o for o in overloads if o._overloadname == "default"]
    return any(t in o.tags for o in (default or overloads) for t in _PRECISION_TAGS)


def _takes_tensor(t: Any) -> bool:
    """Is a schema argument's type a tensor (``Tensor``, ``Tensor?``, ``Tensor[]``)?"""
    return "Tensor" in str(t)


# Ops known to run no attention kernel among those a precision setting or kernel switch changes:
# their graphs skip the attention kernels' switches in the per-call check (0.6 us a call).
_NO_ATTENTION = frozenset({
    "linear", "matmul", "mm", "bmm", "addmm", "addbmm", "baddbmm", "addmv", "mv", "dot", "vdot",
    "einsum", "tensordot", "inner", "outer", "bilinear", "chain_matmul", "__matmul__", "__rmatmul__",
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "convolution", "_convolution",
})


# Ops whose result is uninitialized memory, unless deterministic algorithms fill it
# (``torch.utils.deterministic.fill_uninitialized_memory``: a kernel switch nothing else guards).
_UNINITIALIZED = frozenset({"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided"})


def precision_reader(graph: Any) -> Optional[Callable[[], tuple]]:
    """What to read on every call so that a precision setting (``torch.backends.*.fp32_precision``)
    or a kernel switch that can change what ``graph`` computes is seen: None when none can,
    :func:`_torch_private.fp32_precisions_no_attention` when only matmuls, convolutions and
    uninitialized allocations (``torch.empty``) can, :func:`_torch_private.fp32_precisions_einsum`
    when an einsum can also (opt_einsum's settings pick its contraction order), else
    :func:`_torch_private.fp32_precisions` (an attention op, or any op nosync does not know)."""
    partial, einsum = _torch_private.fp32_precisions_no_attention, _torch_private.fp32_precisions_einsum
    reader = None
    for n in graph.nodes:
        if n.op in ("placeholder", "output", "get_attr"):
            continue
        t = n.target
        if n.op == "call_function" and getattr(t, "__module__", None) in ("_operator", "operator"):
            if t in (operator.matmul, operator.imatmul) and reader is None:
                reader = partial
            continue
        if n.op not in ("call_function", "call_method"):
            return _torch_private.fp32_precisions
        name = t if isinstance(t, str) else getattr(t, "__name__", None)
        if not isinstance(name, str) or (n.op == "call_function" and not _torch_own(t, name)):
            return _torch_private.fp32_precisions  # a custom op or a Python function named ``mul``
        if not _precision_free_name(name):
            if name not in _NO_ATTENTION and name not in _UNINITIALIZED:
                return _torch_private.fp32_precisions
            reader = einsum if name == "einsum" or reader is einsum else partial
    return reader


# where torch's own functions of a name live (what a call_function target must be found at for
# its name to say what it computes)
_TORCH_NAMESPACES = (torch, torch.Tensor, torch.nn.functional, torch.special, torch.linalg, torch.fft)


def _torch_own(t: Any, name: str) -> bool:
    """Is ``t`` torch's own op of that name (an aten op, ``torch.mul``, ``F.linear``, ...), not a
    custom op (``torch.ops.mylib.mul``) or a user function that happens to share the name?"""
    ns = op_namespace(t)
    if ns is not None:
        return ns == "aten"
    return any(getattr(ns, name, None) is t for ns in _TORCH_NAMESPACES)


def precision_sensitive(graph: Any) -> bool:
    """May a precision setting (``torch.backends.*.fp32_precision``) change what ``graph`` computes?"""
    return precision_reader(graph) is not None


@dataclass(eq=False)  # NOTE: never compare entries by value: weakref == compares the tensors
class _Entry:
    refs: tuple
    fps: tuple
    key: Any
    value: Any
    hits: int = 0  # call-time guard evaluations answered by this entry
    pins: tuple = ()  # storage_pins of the leaves its fingerprints name


class _Fps(tuple):
    """Fingerprints, with the number of :func:`forget_all` calls begun when they were taken, and
    whether one was running then."""

    def __new__(cls, fps: tuple, pins: tuple = ()) -> "_Fps":
        self = super().__new__(cls, fps)
        self.pins = pins
        self.forgets, ended = _FORGETS  # (one read: a list's unpacking holds the GIL)
        self.quiet = self.forgets == ended
        return self


def forgotten_since(fps: tuple) -> bool:
    """Did :func:`forget_all` run since ``fps`` (:meth:`ConeMemo.fingerprints`) were taken, or
    was one running then (its walk may not have reached the memo they were looked up in yet)?"""
    return isinstance(fps, _Fps) and (not fps.quiet or fps.forgets != _FORGETS[0])


class ConeMemo:
    """LRU of leaf identity/version -> value for one cone under one :func:`bits_state`."""

    def __init__(self, declared: tuple[bool, ...], size: int = MEMO_SIZE,
                 on_dead: Optional[Callable[[], None]] = None) -> None:
        self.declared = declared
        self.size = size
        self.entries: list[_Entry] = []
        # re-entrant: _leaf_died takes it, and runs wherever a leaf dies (inside store too)
        self.lock = threading.RLock()
        self.on_dead = on_dead  # called after a leaf of an entry died (the entry is dropped)

    def clear(self) -> None:
        """Forget every entry (the memo object stays: checks hold it)."""
        with self.lock:
            # NOTE: the entries die after the lock is let go: a cached value that is another memo's
            # leaf runs that memo's _leaf_died, which takes its lock (two memos cleared by two
            # threads would otherwise wait for each other)
            dropped, self.entries = self.entries, []
        del dropped

    def lookup(self, leaves: tuple) -> Optional[_Entry]:
        # Hot path (every guard evaluation): plain loops, no generators, no helper calls for the
        # common single-leaf cone.
        entries = self.entries
        if len(leaves) == 1 and not self.declared[0]:
            t = leaves[0]
            fp = None
            for i, e in enumerate(entries):
                if e.refs[0]() is t:
                    if fp is None:
                        fp = (_fp_versioned(t),)
                    if fp == e.fps:
                        if i:
                            self._to_front(e)
                        return e
            return None
        fps = None
        for i, e in enumerate(entries):
            same = True
            for r, t in zip(e.refs, leaves):
                if r() is not t:
                    same = False
                    break
            if not same:
                continue
            if fps is None:
                fps = _fingerprints(leaves, self.declared)
            if fps == e.fps:
                if i:
                    self._to_front(e)
                return e
        return None

    def _leaf_died(self, _ref: Any) -> None:
        """Weak reference callback: drop the entries whose leaves died, so what they cached (a
        tensor of the invariant runner) does not outlive the model until the next store.

        NOTE: under the lock (re-entrant: the callback can run inside ``store``, in a collection
        while it holds the lock): a clear() from another thread's forget_all must not land between
        the read of the entries and the assignment, which would put them back."""
        with self.lock:
            dropped, self.entries = self.entries, [e for e in self.entries if all(r() is not None for r in e.refs)]
        del dropped  # outside the lock: see clear
        if self.on_dead is not None:
            self.on_dead()

    def _to_front(self, e: _Entry) -> None:
        with self.lock:
            rest = [x for x in self.entries if x is not e]
            # NOTE: an entry a clear() dropped since the lookup found it (another thread's
            # forget_all) stays dropped: moving it back would serve its value again
            if len(rest) != len(self.entries):
                self.entries = [e] + rest

    def fingerprints(self, leaves: tuple) -> tuple:
        """What :meth:`store` keys an entry by; take it *before* computing the value (see store)."""
        pins = storage_pins(leaves)
        return _Fps(_fingerprints(leaves, self.declared), pins)

    def store(self, leaves: tuple, key: Any, value: Any, fps: Optional[tuple] = None) -> _Entry:
        """Remember ``value`` for ``leaves`` as they were when ``fps = self.fingerprints(leaves)``
        was taken, before the value was computed: a write that lands while it is computed (from
        another thread) then leaves an entry that no later lookup matches, instead of the new
        version filed with the old value. Without ``fps``, the leaves as they are now."""
        # Once per new request and cone: plain loops, no generators.
        dead = self._leaf_died
        if fps is None:
            pins = storage_pins(leaves)
            fps = _fingerprints(leaves, self.declared)
        else:
            pins = fps.pins if isinstance(fps, _Fps) else storage_pins(leaves)
        e = _Entry(tuple([weakref.ref(t, dead) for t in leaves]), fps, key, value, pins=pins)
        with self.lock:
            # NOTE: asked under the lock clear() takes after forget_all counts: a forget either is
            # seen here or empties the memo after this store
            if forgotten_since(fps):
                return e  # a hidden write was forgotten while it was computed (another thread): not kept
            live = [e]
            for x in self.entries:
                for r in x.refs:
                    if r() is None:
                        break
                else:
                    live.append(x)
            del live[self.size :]
            dropped, self.entries = self.entries, live
        del dropped  # outside the lock: see clear
        return e


# ----------------------------------------------------------------------------------------------
# Per-site state
# ----------------------------------------------------------------------------------------------
@dataclass
class Spec:
    """One specialised value of a site (one Dynamo cache entry)."""

    value: Any
    key: Any
    hits: int = 0
    leaf_refs: tuple = ()
    leaf_versions: tuple = ()


@dataclass
class ConeState:
    result: ConeResult
    kind: str
    site: SiteKey
    # Values are counted per cone: one source line can read several tensors (a layer loop asking
    # each layer's buffer), and each of them is its own question with its own answers.
    specs: dict = field(default_factory=dict)  # value key -> Spec
    last_spec: Optional[Spec] = None
    miss_streak: int = 0  # consecutive calls whose leaves were new (guard re-ran the cone)
    last_miss: Optional[_Entry] = None
    memos: dict = field(default_factory=dict)  # memo_key(bits_state()) -> ConeMemo
    streak_keys: set = field(default_factory=set)  # values the guard computed during the streak
    share_key: tuple = ()  # what it computes, its leaves' sources aside: see _from_another_cone

    def __post_init__(self) -> None:
        forgettable(self)
        # The per-backend precisions and kernel switches that can change what the cone computes
        # (what SiteCheck reads per call; all of them for a cone of no module, a table's)
        module = self.result.module
        self.read_precisions = (_torch_private.fp32_precisions if module is None
                                else precision_reader(module.graph))

    def memo_key(self, bits: tuple) -> tuple:
        """The key of this cone's memo under ``bits`` (:func:`bits_state`, taken now): its last
        item, every precision and kernel switch, replaced by those that can change this cone's
        value. A switch it cannot see (``cudnn.benchmark`` for ``(tt == 0).any()``) flipped between
        two compiles left the two cache entries a memo each, and a new request read the value once
        per entry (review 21)."""
        read = self.read_precisions
        return bits[:-1] + (read() if read is not None else None,)

    def forget(self) -> None:
        """Drop the memoised values (a write behind the version counter, Note [Writes behind the
        version counter across graphs])."""
        # NOTE: emptied, not dropped: each SiteCheck holds its own; over a copy: another thread may
        # add a memo (memo_for) meanwhile, which holds nothing computed before the forget (its
        # store asks forgotten_since)
        for memo in list(self.memos.values()):
            memo.clear()
        self.last_miss = None

    def memo_for(self, bits: tuple) -> ConeMemo:
        key = self.memo_key(bits)
        memo = self.memos.get(key)
        if memo is None:
            memo = self.memos[key] = ConeMemo(tuple(l.declared for l in self.result.leaves))
        return memo

    def evaluate(self, leaves: tuple, memo: ConeMemo) -> _Entry:
        """Run the cone on these leaves: one real sync. Stores the value in the memo."""
        module = self.result.module
        assert module is not None
        fps = memo.fingerprints(leaves)  # before the value: see ConeMemo.store
        with self.running():
            # NOTE: the generated forward, not nn.Module.__call__ (microseconds per new request)
            value = _CONVERT[self.kind](module.forward(*leaves))
        key = value_key(value)
        return memo.store(leaves, key, value, fps)

    def running(self) -> "_Running":
        """The state the cone runs in: no grad, the traced default dtype, syncs booked to the site.

        NOTE: a guard Dynamo runs after its global-state guard passed sees the traced grad mode,
        default dtype and autocast (off: cones traced under autocast are rejected); the default
        dtype is pinned for the calls that skip that guard: ``serving.check_request``, and a
        ``guard_filter_fn`` that keeps nosync's guard but drops the global-state one.
        """
        return _Running(self.result.default_dtype, self.site)

    def current(self, leaves: tuple, memo: ConeMemo) -> tuple[_Entry, bool]:
        """(entry, synced): the memoized value, or a fresh one computed with one sync."""
        e = memo.lookup(leaves)
        if e is not None:
            return e, False
        return self.evaluate(leaves, memo), True


class _Running:
    """:meth:`ConeState.running` as a plain context manager: it runs for every hoisted cone at every
    new request, where a generator context manager and ``torch.no_grad()`` cost microseconds."""

    __slots__ = ("dtype", "site", "saved_dtype", "saved_grad", "marker", "no_tf")

    def __init__(self, dtype: Optional[torch.dtype], site: SiteKey) -> None:
        self.dtype = dtype
        self.site = site

    def __enter__(self) -> None:
        self.saved_dtype = saved = torch.get_default_dtype()
        if self.dtype is not None and self.dtype is not saved:
            torch.set_default_dtype(self.dtype)
        self.saved_grad = grad = torch.is_grad_enabled()
        if grad:
            _torch_private.set_grad_mode(False)
        # Dynamo traced the cone through the leaves' __torch_function__ (a subclass's, a mode's):
        # its ops already hold what those did; running them again would apply it twice. (A guard
        # runs so already; decide at trace time and serving.check_request do not.)
        self.no_tf = _torch_private.no_torch_function()
        self.no_tf.__enter__()
        self.marker = guard_site(self.site)
        self.marker.__enter__()

    def __exit__(self, *exc: Any) -> bool:
        self.marker.__exit__()
        self.no_tf.__exit__(None, None, None)
        if self.saved_grad:
            _torch_private.set_grad_mode(True)
        if self.dtype is not None and self.dtype is not self.saved_dtype:
            torch.set_default_dtype(self.saved_dtype)
        return False


@dataclass
class SiteState:
    code: Any
    offset: int
    kind: str
    site: SiteKey
    source: str
    code_name: str
    cones: dict = field(default_factory=dict)  # fingerprint -> ConeState
    demoted: Optional[Reason] = None
    guard_syncs: int = 0
    guard_hits: int = 0
    # the code of each frame a check of the site was compiled for (its own code, or the frame it
    # was inlined into): check_request's list of a function's demoted sites
    frames: set = field(default_factory=set)

    @property
    def specs(self) -> dict:
        """Every specialised value of the site, over all its cones (for reports and tests)."""
        return {k: spec for cone in self.cones.values() for k, spec in cone.specs.items()}


_sites: dict[tuple, SiteState] = {}
_recorded: set = set()
_lock = threading.RLock()


def reset(keep_decisions: bool = False) -> None:
    """Forget every site's state and memo, and (unless ``keep_decisions``) the decision records.
    Waits for a compile in another thread to finish (see dynamo_hooks.compile_lock)."""
    with dynamo_hooks.compile_lock():
        _reset(keep_decisions)


def _reset(keep_decisions: bool) -> None:
    with _lock:
        _sites.clear()
        _checks_by_code.clear()
        _owner_of.clear()
        _callers_of.clear()
        _written_by_compile.clear()  # compile ids start again after torch._dynamo.reset()
        _recorded.clear()
        _budget_frames.clear()
        _recompiles_seen.clear()
    dynamo_hooks.reset()
    names.reset()
    if not keep_decisions:
        DECISIONS.clear()


def sites() -> list[SiteState]:
    with _lock:
        return list(_sites.values())


# ----------------------------------------------------------------------------------------------
# The policy Dynamo asks at each sync
# ----------------------------------------------------------------------------------------------
def _record(state: SiteState, action: Action, reason: Reason, detail: str = "", value: Any = None,
            leaves: tuple = (), compile_id: Optional[str] = None) -> None:
    d = Decision(
        site=state.site,
        kind=state.kind,
        action=action,
        reason=reason,
        code=state.code_name,
        source=state.source,
        detail=detail,
        value="" if value is None else repr(value),
        leaves=leaves,
        compile_id=compile_id or "",
    )
    # Dynamo restarted the trace: do not count the same decision twice (but a loop Dynamo unrolls
    # asks at one offset once per iteration: each distinct value is a record of its own)
    record_decision(d, once=None if compile_id is None else (compile_id, state.code, state.offset, state.kind,
                                                             action, d.value))


def record_decision(d: Decision, once: Optional[tuple] = None) -> None:
    """Publish one decision: keep it in DECISIONS, count it, log it, put it in the structured trace.

    Every module that decides (guards, tables, inop, rewrite, invariant) records through here, so the
    report, the counters, the log and ``TORCH_TRACE`` always show the same records. ``once``: a key
    under which a decision is recorded once only (a retrace of the same compile takes it again);
    forgotten at :func:`reset`.
    """
    if once is not None:
        with _lock:
            if once in _recorded:
                return
            _recorded.add(once)
    DECISIONS.add(d)
    counters()[d.action.value] += 1
    if d.action is Action.HOISTED:
        log.info("nosync: hoisted %s: %s = %s (guarded on %s)", d.site, d.source, d.value,
                 ", ".join(d.leaves) or "nothing")
    else:
        log.info("nosync: %s %s: %s: %s%s", d.action.value, d.site, d.source, d.reason.value,
                 f" ({d.detail})" if d.detail else "")
    _trace_structured(d)


def _trace_structured(d: Decision) -> None:
    try:
        _torch_private.trace_artifact("nosync_decision", lambda: json.dumps(d.to_json()))
    except Exception:  # structured tracing is best effort
        log.debug("nosync: trace_structured failed", exc_info=True)


def decide(site: dynamo_hooks.SyncSite, opts: Any) -> tuple[bool, Any]:
    """The policy: (True, value) to hoist, (False, why_not) to leave the sync to Dynamo."""
    # NOTE: one sync instruction is one site, whichever handler saw it, and whether Dynamo traces
    # it in the function or in a resume function after a graph break (another code object): its
    # source position, and which of the instructions sharing that position it is.
    key = (site.file, site.line, site.col, site.occurrence)
    compile_id = dynamo_hooks.current_compile_id()
    _count_recompile(site, compile_id)
    with _lock:
        state = _sites.get(key)
        if state is None:
            state = SiteState(site.code, site.offset, site.kind, SiteKey(site.file, site.line),
                              site.source_line, site.code_name)
            _sites[key] = state
    if state.demoted is None and _budget_exhausted(site):
        _demote(state, Reason.RECOMPILE_BUDGET, f"compile {site.frame_compile + 1} of "
                f"{site.frame_code.co_name}; recompile_limit is {dynamo_hooks.recompile_limit()}", compile_id)
        return False, f"demoted: {Reason.RECOMPILE_BUDGET.value}"
    if state.demoted is not None:
        _record(state, Action.REJECTED, Reason.DISABLED, state.demoted.value, compile_id=compile_id)
        return False, f"demoted earlier: {state.demoted.value}"

    names.check_declared_names(site.frame_code, site.frame_locals, opts)
    # a subclass's int()/bool()/...: its own conversion; a read Dynamo made of one for something
    # else (a slice bound ``x[:t]``, which eager converts with the class's __index__)
    name = dynamo_hooks.subclass_name(site.tensor_class)
    if name is not None and (dynamo_hooks.builtin_read_differs(site.tensor_class) if site.kind in _BUILTIN_READS
                             else not site.direct_read):
        return _reject(state, Reason.UNSUPPORTED_VALUE, f"{site.kind} read of a {name}: eager converts it through "
                       "the class's own methods (__bool__, __int__, __index__, ...), which Dynamo's traced read "
                       "skips", compile_id)
    region = state_region_of(site.node.graph, cone_of(site.node))
    if region is not None:  # hoisted or lifted, the cone would re-run under the caller's setting
        return _reject(state, Reason.STATE_REGION, region, compile_id)
    result = analyze_cone(site.node, site.leaves, declared=opts.invariant,
                          in_root_tracer=site.in_root_tracer)
    syncing = syncing_op_in_cone(state, result, compile_id)
    if syncing is not None:
        return syncing
    if result.reason is Reason.SYMBOLIC:  # a table read at a step counter?
        from . import tables

        lifted = tables.lift(state, site, opts, compile_id, key)
        if lifted is not None:
            return lifted
    if not result.ok:
        if result.reason is Reason.CONSTANT_LEAF and FREEZING_NOTE in result.detail:
            never_silent(opts.strict, WARNED_FROZEN, FREEZING_WARNING)
        return _reject(state, result.reason, result.detail, compile_id)

    # NOTE: the state keeps weak references only; holding the leaf tensors here would keep a
    # step-varying input alive and hide that it changes every step.
    leaves = tuple(result.leaf_examples)
    result.leaf_examples = []
    # NOTE: nor the traced graph: its nodes carry fake tensors (and through them the fake mode and
    # the shape env), and a guard living in Dynamo's C++ guard manager, which Python's GC cannot
    # traverse, would keep them alive after torch._dynamo.reset(). Only mark_hoisted needs them.
    traced_nodes, result.nodes = result.nodes, frozenset()
    fp = (result.fingerprint, site.kind)  # what the cone computes, and how it is converted
    cone = state.cones.get(fp)
    if cone is None:
        cone = ConeState(result, site.kind, state.site)
        ops = tuple((op, None if op == "placeholder" else target, args)  # placeholders: named by source
                    for op, target, args in result.signature)
        cone.share_key = (ops, result.default_dtype, tuple(l.declared for l in result.leaves), site.kind)
        state.cones[fp] = cone
    bits = bits_state()
    try:
        memo = cone.memo_for(bits)
        entry = (memo.lookup(leaves) or _from_another_cone(state, cone, leaves, memo, bits)
                 or cone.evaluate(leaves, memo))
    except UnhoistableValue as e:  # evaluated fine: a value nosync cannot key (a complex .item())
        return _reject(state, Reason.UNSUPPORTED_VALUE, str(e), compile_id)
    except Exception as e:
        return _reject(state, Reason.EVAL_FAILED, f"{type(e).__name__}: {e}", compile_id)
    value = entry.value
    if not _hoistable(value):
        return _reject(state, Reason.UNSUPPORTED_VALUE, f"value of type {type(value).__name__}", compile_id)

    spec = cone.specs.get(entry.key)
    if spec is None:
        demoted = _new_value_demotion(state, cone, result, leaves, opts, compile_id)
        if demoted is not None:
            return False, f"demoted: {demoted.value}"
        spec = Spec(
            value,
            entry.key,
            leaf_refs=tuple(weakref.ref(t) for t in leaves),
            leaf_versions=tuple(None if t.is_inference() else t._version for t in leaves),
        )
        cone.specs[entry.key] = spec
    cone.last_spec = spec

    srcs = [l.source for l in result.leaves]
    mark_hoisted(dataclasses.replace(result, nodes=traced_nodes), owner=(key, fp))
    check = SiteCheck(state, cone, spec, srcs, bits, _written_inputs_of(compile_id), compile_id)
    _register_check(site.frame_code, check, dynamo_hooks.frame_owner(site), dynamo_hooks.calling_code_keys())
    if site.frame_code is not None:
        state.frames.add(site.frame_code)
    dynamo_hooks.add_lambda_guard(site, check, f"{state.site}: {state.source} == {value!r}")
    _record(state, Action.HOISTED, Reason.INVARIANT_CONE,
            "speculated invariant" if result.speculative else "", value,
            tuple(l.name for l in result.leaves), compile_id=compile_id)
    return True, value


_recompiles_seen = dynamo_hooks.CodeMap()  # frame code -> the compile ids counted


def syncing_op_in_cone(state: SiteState, result: ConeResult, compile_id: Optional[str]) -> Optional[tuple[bool, Any]]:
    """The rejection of a cone that runs an op syncing inside (``inop.SYNCING_OPS``), else None:
    hoisted or lifted, the cone is evaluated at the trace (lifted: at every index) and again by the
    guard at a new request, each time paying the op's own syncs on top of the step's run of it."""
    from . import inop  # (inop imports this module)

    syncing = [name for name in map(inop.syncs_inside, result.nodes) if name is not None]
    if not syncing:
        return None
    return _reject(state, Reason.SYNCING_OP_IN_CONE, f"{syncing[0]} in the cone: evaluating it to "
                   "hoist or lift the value would make more syncs than stock", compile_id)


def _count_recompile(site: dynamo_hooks.SyncSite, compile_id: Optional[str]) -> None:
    """counters['nosync']['recompiles']: compiles of a nosync frame after its first one."""
    if site.frame_compile > 0 and compile_id is not None:
        with _lock:
            seen = _recompiles_seen.setdefault(site.frame_code, set())
            if compile_id in seen:
                return
            seen.add(compile_id)
        counters()["recompiles"] += 1


def _from_another_cone(state: SiteState, cone: "ConeState", leaves: tuple, memo: "ConeMemo",
                       bits: tuple) -> Optional[_Entry]:
    """At a compile, where ``cone``'s own memo has no value for ``leaves`` (asked first): the value another cone
    of the site computing the same ops (``share_key``) holds for these very tensors, stored in
    ``memo`` too; else None.

    NOTE: one site traced in several frames (a hook's forward inlined into its caller, then
    compiled on its own after a graph break in it: diffusers' FasterCache) has a cone per frame,
    their leaves named by other sources; each evaluated on the first call, reading more than stock
    (review 19, helper 144). The memos themselves stay apart: a layer loop's cones (one line, one
    buffer per layer) sharing one memo evicted each other (helper 147)."""
    for other in list(state.cones.values()):
        if other is cone or other.share_key != cone.share_key:
            continue
        theirs = other.memos.get(other.memo_key(bits))
        e = theirs.lookup(leaves) if theirs is not None else None
        if e is not None:
            return memo.store(leaves, e.key, e.value, e.fps)
    return None


def _reject(state: SiteState, reason: Reason, detail: str, compile_id: Optional[str]) -> tuple[bool, Any]:
    """Record the site as rejected; the policy's answer (False, why not)."""
    _record(state, Action.REJECTED, reason, detail, compile_id=compile_id)
    return False, reason.value + (f" ({detail})" if detail else "")


_FAILURES = itertools.count()


class WrittenInputs:
    """The inputs that the graph of one compile writes in place, each with the hoisted leaves it
    did not share memory with at trace time, as a getter over the frame's ``L, G``: filled by
    :func:`guard_written_inputs` once the backend has the whole graph, read by every guard of that
    compile."""

    __slots__ = ("getter", "pairs", "__weakref__")

    def __init__(self) -> None:
        self.getter: Optional[Callable[[Any, Any], tuple]] = None
        # (position of a written input, positions of the leaves to compare it with) in getter's tuple
        self.pairs: tuple[tuple[int, tuple[int, ...]], ...] = ()

    def alias(self, L: Any, G: Any) -> bool:
        """Does one of these inputs share memory (its storage) with one of its leaves on this call?"""
        if self.getter is None:
            return False
        try:
            values = self.getter(L, G)
        except Exception:
            return True  # cannot tell: fail the guard (a recompile), never a stale value
        return any(dynamo_hooks.may_share_storage((values[w],), [values[i] for i in others])
                   for w, others in self.pairs)


_written_by_compile: "weakref.WeakValueDictionary[Any, WrittenInputs]" = weakref.WeakValueDictionary()


def _written_inputs_of(compile_id: Optional[str]) -> WrittenInputs:
    with _lock:
        w = _written_by_compile.get(compile_id) if compile_id is not None else None
        if w is None:
            w = WrittenInputs()
            if compile_id is not None:
                _written_by_compile[compile_id] = w
    return w


def guard_written_inputs(graph: Any, compile_id: Optional[str]) -> None:
    """Make the guards of this compile fail on a call where an input the graph writes in place
    shares memory with a hoisted leaf (a view of the leaf passed as that argument): the guard
    computes the hoisted value before the frame runs, eager reads the leaf after the write.

    NOTE: an input is not compared with a leaf whose storage its traced value already shared: the
    cone analysis saw that aliasing (and a graph that writes a leaf itself bumps its version).
    """
    with _lock:
        holder = _written_by_compile.get(compile_id)
    if holder is None:
        return
    placeholders = list(graph.find_nodes(op="placeholder"))
    leaves = [(q, storage_of(q)) for q in placeholders if q.meta.get(HOISTED_LEAF_META)]
    leaves = [(q, key) for q, key in leaves if key is not None]
    if not leaves:
        return
    written = written_storages(graph)
    sources: list[str] = []

    def at(source: str) -> int:
        if source not in sources:
            sources.append(source)
        return sources.index(source)

    pairs = []
    for p in placeholders:
        key = storage_of(p)
        if key is None or key not in written:
            continue
        # NOTE: a written input that is itself a hoisted leaf (or shared a leaf's storage at trace
        # time) is compared with the *other* leaves: a second leaf passed as a view of it is read
        # after the write in eager, before it by the guard
        others = [dynamo_hooks.leaf_of(q) for q, k in leaves if k != key]
        if not others:
            continue
        leaf = dynamo_hooks.leaf_of(p)
        if leaf is None or any(o is None for o in others):  # no source a guard can read
            _demote_graph_sites(graph, f"graph input {p.name} is written in place and has no source "
                                "a guard can read to check that it does not alias a leaf", compile_id)
            return
        pairs.append((at(leaf.source), tuple(at(o.source) for o in others)))
    if pairs:
        holder.pairs = tuple(pairs)
        holder.getter = dynamo_hooks.leaf_getter(sources)
        # the trace's own inputs may alias in a way the trace did not see (a tensor subclass's
        # inner tensor): the guard would fail on the call it was made for; keep the syncs instead
        L, G = dynamo_hooks.current_frame()[1], dynamo_hooks.current_frame_globals()
        if L is not None and G is not None and holder.alias(L, G):
            what = "an argument the graph writes in place shares memory with a hoisted leaf on this call"
            _demote_graph_sites(graph, what, compile_id)
            holder.pairs, holder.getter = (), None
            dynamo_hooks.restart_analysis(f"nosync: {what}; keeping the sync")


def _demote_graph_sites(graph: Any, what: str, compile_id: Optional[str]) -> None:
    for p in graph.find_nodes(op="placeholder"):
        for key, _ in p.meta.get(HOISTED_LEAF_META) or ():
            with _lock:
                state = _sites.get(key)
            if state is not None and state.demoted is None:
                _demote(state, Reason.HIDDEN_WRITER, what, compile_id)


class SiteCheck:
    """The guard of one cache entry of one site: ``check(L, G) -> bool``, True when unchanged."""

    def __init__(self, state: SiteState, cone: ConeState, spec: Spec, sources: list[str], bits: tuple,
                 written: Optional[WrittenInputs] = None, compile_id: Optional[str] = None) -> None:
        self.state = state
        self.compile_id = compile_id  # the compile whose cache entry this guards
        self.written = written if written is not None else WrittenInputs()
        self.cone = cone
        self.spec = spec
        self.sources = list(sources)
        self.bits = bits
        self.memo = cone.memo_for(bits)
        self.declared = self.memo.declared
        self.getter = dynamo_hooks.leaf_getter(sources)
        self.may_demote = not all(self.declared)
        # A declared leaf is one of the compiled call's own objects; the same code can run in
        # another call of the function (a recursive call, a child module of the same class, a
        # hook calling a sibling) with other objects: when the leaves are not the last call's,
        # the declared paths must still name them in the call running now, else the guard fails
        # (names.still_declared; a recompile there declares nothing).
        self.wheres = names.to_ask(l.where for l in cone.result.leaves)
        # The global state a call must still be in (the memo holds values computed under ``bits``):
        # the frame's entry state (what Dynamo's own global-state guard compares, but a
        # guard_filter_fn can drop that guard; not the state now: inside a traced ``no_grad``
        # region it is that region's), and the per-backend precision settings, which that
        # snapshot does not cover, where the cone has an op they can change.
        self.entry = _torch_private.frame_entry_state()
        self.read_precisions = cone.read_precisions
        # NOTE: read now, in the compile whose bits_state() is ``bits``
        self.precisions = self.read_precisions() if self.read_precisions is not None else None

    def state_changed(self) -> bool:
        """Is this call's global state not the one this entry was compiled under?"""
        entry = self.entry
        return ((entry is not None and not _torch_private.snapshot_for_context(entry).check())
                or torch.get_num_threads() != self.bits[0]
                or (self.precisions is not None and self.read_precisions() != self.precisions))

    def __call__(self, L: Any, G: Any) -> bool:
        if self.state_changed():
            return self._fail_state()
        try:
            leaves = self.getter(L, G)
        except Exception:
            log.debug("nosync guard for %s: a leaf no longer resolves", self.state.site, exc_info=True)
            return self._fail("a leaf no longer resolves")
        if self.written.alias(L, G):
            return self._fail_aliased()
        if self.wheres and not names.still_declared(self.wheres, leaves):
            return self._fail_undeclared()
        return self.check_leaves(leaves)

    def _fail_undeclared(self) -> bool:
        return self._fail("a declared leaf is not the object its name gives in this call "
                          "(another call of the compiled function)")

    def check_leaves(self, leaves: tuple) -> bool:
        return self.check_entry(leaves, None)

    def _only_declared_new(self, leaves: tuple) -> bool:
        """On a miss: are this call's undeclared leaves (a router's weight, a buffer) the last
        miss's objects, unchanged, so that only declared leaves are new? A new request by the
        user's promise, which rule 4 spares as for a site whose leaves are all declared (review 21:
        ``if (x * self.w).sum() > 0`` with ``x`` declared was demoted for ``x`` alone)."""
        last = self.cone.last_miss
        if last is None or not any(self.declared):
            return False
        fps = _fingerprints(leaves, self.declared)
        return all(d or (r() is t and f == g)
                   for d, r, t, f, g in zip(self.declared, last.refs, leaves, fps, last.fps))

    def answer(self, e: _Entry, index: Any) -> Any:
        """The value key ``e`` answers (a lifted table's check: at ``index``)."""
        return e.key

    def check_entry(self, leaves: tuple, index: Any) -> bool:
        """Find (or compute, one sync) the memo entry of ``leaves``; True when its answer is this
        cache entry's specialised key."""
        state, spec = self.state, self.spec
        compiling = dynamo_hooks.compiling
        # the stock entry compiled after demotion serves this call; but Dynamo's own check of a
        # fresh entry (on the trace's inputs, whose value is right) must pass: a site can be
        # demoted once the whole graph is known (demote_hidden_writes). An older entry checked
        # while Dynamo compiles (to log why it recompiles) fails at once, without a sync.
        if state.demoted is not None and not self._own_compile():
            return self._fail_demoted()
        c = counters()
        try:
            e = self.memo.lookup(leaves)
            if e is None:
                if compiling():  # Dynamo checking a fresh entry on the trace's own inputs
                    e = self.cone.evaluate(leaves, self.memo)
                else:
                    if _runtime_miss(state, self.cone, self.may_demote and not self._only_declared_new(leaves)):
                        return self._fail_demoted()
                    e = self.cone.evaluate(leaves, self.memo)
                    self.cone.last_miss = e
                    self.cone.streak_keys.add(e.key)
                    state.guard_syncs += 1
                    c["guard_syncs"] += 1
            else:
                if not compiling():  # Dynamo's own checks of a fresh entry are not call-time hits
                    state.guard_hits += 1
                    c["guard_hits"] += 1
                cone = self.cone
                if e is not cone.last_miss:
                    cone.miss_streak = 0
                elif e.hits <= len(cone.specs) and not compiling():
                    e.hits += 1
        except Exception:
            log.debug("nosync guard for %s failed; treating as a miss", state.site, exc_info=True)
            return self._fail("the check raised (TORCH_LOGS=+torchsync_pass shows it)")
        if self.answer(e, index) == spec.key:
            if spec.hits or not compiling():  # demotion asks "hit at call time yet?"
                spec.hits += 1
            return True
        if self._own_compile():
            # Dynamo's check of the entry it just compiled, on the trace's own inputs: another
            # thread wrote a leaf since the trace read it. This call runs with the value the trace
            # read (as if the write came after the read, which the threads did not order); the memo
            # now holds the new value, so the next call fails this entry (failing here raised
            # "Guard failed on the same frame it was created" from the user's call).
            return True
        if state.demoted is not None:  # Dynamo re-checking why the call failed (while compiling)
            return self._fail_demoted()
        return self._fail(f"a hoisted value changed: {spec.value!r} -> {e.value!r}")

    def _own_compile(self) -> bool:
        """Is this Dynamo checking the entry it just compiled, at the end of this check's own
        compile (not an older entry, asked why a call recompiles, nor a call)?"""
        return dynamo_hooks.compiling() and dynamo_hooks.current_compile_id() == self.compile_id

    # Why the last failed check failed, for Dynamo's recompile reason (failure paths only).
    failure: Optional[tuple[int, str]] = None

    def _fail(self, why: str) -> bool:
        self.failure = (next(_FAILURES), f"nosync: {why} at {self.state.site}: {self.state.source}")
        return False

    def _fail_state(self) -> bool:
        # the memo of this entry holds values computed under another state
        return self._fail(self.state_change())

    def state_change(self) -> str:
        """What :meth:`state_changed` found, said plainly."""
        if torch.get_num_threads() != self.bits[0]:
            return f"the thread count changed ({self.bits[0]} -> {torch.get_num_threads()})"
        entry = self.entry
        snapshot = _torch_private.snapshot_for_context(entry) if entry is not None else None
        if snapshot is not None and not snapshot.check():
            return f"the global state changed ({snapshot.reason().strip() or 'grad mode, autocast, ...'})"
        return ("a per-backend fp32_precision setting or a kernel switch (mkldnn/cudnn/nnpack enabled, "
                "cudnn allow_tf32/benchmark/deterministic, the SDPA kernels, ...) changed "
                f"(now {_torch_private.fp32_precisions()})")

    def _fail_aliased(self) -> bool:
        # NOTE: the write may not move the leaf's version (through .data, a wrapper subclass): the
        # values memoised from the leaf, and every entry's fast path (the epoch), are forgotten
        self.cone.forget()
        _DEMOTIONS[0] += 1
        return self._fail("an argument the graph writes in place shares memory with a hoisted leaf")

    def _fail_demoted(self) -> bool:
        reason = self.state.demoted
        return self._fail(f"site demoted ({reason.name if reason is not None else '?'}), not a value change")

    def fast_hit(self) -> None:
        """Book a call whose leaves are exactly those of the last call that passed."""
        self.state.guard_hits += 1
        self.cone.miss_streak = 0
        self.spec.hits += 1

    @staticmethod
    def fuse(checks: list["SiteCheck"], ran: Any, failed: Callable[[], bool]) -> Callable[[Any, Any], bool]:
        """One function for all checks of a frame, with a fast path for an unchanged call.

        The leaves of every site are read once (a tensor two sites share, once). When they are
        the very objects of the last call that passed, with the same version, data pointer and
        metadata, every check would answer from its memo exactly as then: answer True at once.
        When the function passes it sets ``ran.ok`` (the guard token); when it fails it returns
        ``failed()`` (False).
        """
        sources: list[str] = []
        declared: list[bool] = []
        plans = []
        for chk in checks:
            idx = []
            for src, d in zip(chk.sources, chk.declared):
                if src not in sources:
                    sources.append(src)
                    declared.append(d)
                idx.append(sources.index(src))
            plans.append((chk, tuple(idx)))
        n = len(checks)
        # [weak refs, fast_key of the last call that passed the full checks, booked, the demotion
        # epoch when it passed]
        last: list = [None, None, False, -1]
        # one compile: every check has the same bits_state() and frame entry state
        entry = checks[0].entry
        # each reader once (a frame's cones may read different sets), with its compile-time value
        readers = {c.read_precisions: c.precisions for c in reversed(checks) if c.precisions is not None}
        written = checks[0].written  # one compile: every check has the same
        first = checks[0]
        # the declared paths of every check, as positions in ``leaves``
        wheres = tuple({(idx[i], w) for chk, idx in plans for i, w in chk.wheres})

        def slow(L: Any, G: Any, leaves: tuple) -> bool:
            epoch = _DEMOTIONS[0]  # before the checks: a demotion while they run is seen next call
            # The fast path's key, also taken before the checks: a leaf written while they run
            # (by another thread) no longer matches it, so the next call checks again.
            key = None
            if not dynamo_hooks.compiling():
                try:
                    key = fast_key(leaves, declared, last[1])
                except Exception:  # a leaf without a version (the checks below fail on it)
                    key = None
            if wheres and not names.still_declared(wheres, leaves):
                last[0] = None
                return first._fail_undeclared() or failed()
            # A demoted site fails the entry without a read: before any other site's cone runs (a
            # live site's re-run, one sync, would be wasted on an entry that fails anyway)
            for chk, _ in plans:
                if chk.state.demoted is not None and not chk._own_compile():
                    last[0] = None
                    return chk._fail_demoted() or failed()
            for chk, idx in plans:
                if not chk.check_leaves(tuple([leaves[i] for i in idx])):
                    last[0] = None
                    return failed()
            if key is not None:
                last[0] = tuple([weakref.ref(t) for t in leaves])
                last[1] = key
                last[2] = False
                last[3] = epoch
            ran.ok = True
            return True

        def book() -> None:  # the first repeat of a call: book it as the checks would
            last[2] = True
            for chk, _ in plans:
                chk.fast_hit()

        def resolve_failed() -> bool:
            log.debug("nosync guard: a leaf no longer resolves", exc_info=True)
            return first._fail("a leaf no longer resolves")

        # Generated straight-line code (this runs on every call of the compiled step): the state
        # check (the entry state's check covers the thread count), the leaves read once, and the
        # fast path (the very leaves of the last call that passed, unchanged, and no site demoted
        # since: every check would answer from its memo exactly as then); anything else runs the
        # checks one by one (``slow``).
        # NOTE: every name the code adds has the prefix: the sources are Dynamo's guard expressions,
        # evaluated among Dynamo's own guard globals (``guard_env``), which must not be shadowed.
        p = "_nosync_"
        tnames = [f"{p}t{i}" for i in range(len(sources))]
        state = f"not {p}entry_check()" if entry is not None else f"{p}get_num_threads() != {p}threads"
        for i in range(len(readers)):
            state += f" or {p}get_precisions{i}() != {p}precisions{i}"
        leaves = "(" + ", ".join(tnames) + ("," if len(tnames) == 1 else "") + ")"
        lines = [
            "def run(L, G):",
            f"    if {state}:",
            f"        return {p}first._fail_state() or {p}failed()",
            "    try:",
            f"        {leaves} = ({', '.join(sources)}{',' if len(sources) == 1 else ''})",
            "    except Exception:",
            f"        return {p}resolve_failed() or {p}failed()",
            f"    if {p}written.getter is not None and {p}written.alias(L, G):",
            f"        return {p}aliased_call() or {p}failed()",
            f"    {p}refs = {p}last[0]",
            f"    if ({p}refs is not None and {p}last[3] == {p}demotions[0]",
            "            and " + same_call_expr(tnames, declared, f"{p}refs", f"{p}last[1]") + "):",
            f"        if not {p}last[2]:",
            f"            {p}book()",
            # NOTE: looked up per call: torch._dynamo.utils.counters.clear() replaces the Counter
            f"        {p}counters()['guard_hits'] += {n}",
            f"        {p}ran.ok = True",
            "        return True",
            f"    return {p}slow(L, G, {leaves})",
        ]
        def aliased_call() -> bool:  # every cone of the entry: see _fail_aliased
            for chk in checks[1:]:
                chk.cone.forget()
            last[0] = None
            return first._fail_aliased()

        ours = dict(first=first, resolve_failed=resolve_failed, ran=ran, failed=failed, written=written,
                    aliased_call=aliased_call,
                    last=last, book=book, slow=slow, demotions=_DEMOTIONS, counters=counters,
                    threads=checks[0].bits[0], get_num_threads=torch.get_num_threads,
                    entry_check=(_torch_private.snapshot_for_context(entry).check if entry is not None else None))
        for i, (reader, value) in enumerate(readers.items()):
            ours[f"get_precisions{i}"], ours[f"precisions{i}"] = reader, value
        env = dynamo_hooks.guard_env()
        env.update({p + k: v for k, v in ours.items()})
        env.update(FP_ENV)
        exec("\n".join(lines), env)  # noqa: S102 - sources are Dynamo guard expressions
        run = env["run"]
        return run


# ----------------------------------------------------------------------------------------------
# Demotion: the rules
# ----------------------------------------------------------------------------------------------
# A site is handed back to stock Dynamo for good (one recompile; its old guards then fail at once,
# without a sync) when
# 1. RECOMPILE_BUDGET: its frame has used half of Dynamo's ``recompile_limit`` (_budget_exhausted);
# 2. TOO_MANY_VALUES: one of its cones takes more than ``max_specializations`` values;
# 3. LEAVES_CHANGE: its value changed on the very next call after it was specialised while the
#    old leaf is gone, was written in place, or is the next element of the same table (2 and 3:
#    _new_value_demotion, asked by decide for a value the cone has not taken before);
# 4. LEAVES_CHANGE: the guard had to re-run a cone on MISS_STREAK_DEMOTE calls in a row (leaves
#    new every call) and the value changed along the way (_runtime_miss, asked by the guard);
# 5. HIDDEN_WRITER: the graph writes one of its leaves behind the version counter
#    (demote_hidden_writes, asked by the backend once the whole graph is known).
# Rules 3-5 spare a site whose leaves are all declared: the user promised they stay fixed.
MISS_STREAK_DEMOTE = 3
_budget_frames = dynamo_hooks.CodeMap()  # frame code -> the isolate_recompiles regions out of budget
# Demotions so far: a guard's fast path answers only while none happened since its checks last
# passed (every demotion goes through _demote).
_DEMOTIONS = [0]


def _demote(state: SiteState, reason: Reason, detail: str, compile_id: Optional[str] = None) -> Reason:
    state.demoted = reason
    _DEMOTIONS[0] += 1
    _record(state, Action.DEMOTED, reason, detail, compile_id=compile_id)
    return reason


def _budget_exhausted(site: dynamo_hooks.SyncSite) -> bool:
    """Rule 1: True once the frame has used half of ``recompile_limit`` (rounded down).

    ``max_specializations`` bounds the values of one site, but Dynamo keeps one cache entry per
    *combination* of hoisted values (4 two-valued sites: 16 entries). From this compile on, every
    site of the frame is demoted, so the entry compiled now serves every later value. The other
    half of the budget stays for Dynamo's own reasons to recompile (dtype or shape changes, ints
    passed across a graph break), so the frame does not reach the limit because of our guards.
    """
    # per code object (by identity, as Dynamo's cache: equal copies are frames of their own) and
    # isolate_recompiles region, as Dynamo's limit
    regions = _budget_frames.setdefault(site.frame_code, set())
    if site.frame_region in regions:
        return True
    # recompile_limit 1 leaves no recompile for a value that changes: nothing is hoisted (with a
    # hoist, Dynamo would run every later request's frame uncompiled, after the guard's sync)
    if site.frame_compile >= dynamo_hooks.recompile_limit() // 2:
        regions.add(site.frame_region)
        return True
    return False


def _new_value_demotion(state: SiteState, cone: ConeState, result: ConeResult, leaves: tuple, opts: Any,
                        compile_id: Optional[str]) -> Optional[Reason]:
    """Rules 2 and 3, for a value ``cone`` has not taken before; the reason when it demoted."""
    if len(cone.specs) >= opts.max_specializations:
        return _demote(state, Reason.TOO_MANY_VALUES, (
            f"{len(cone.specs) + 1} distinct values > max_specializations={opts.max_specializations}"
        ), compile_id)
    last = cone.last_spec
    all_declared = all(l.declared for l in result.leaves)
    if (last is not None and not all_declared and last.hits == 0
            and _leaves_changed(last, leaves, tuple(l.declared for l in result.leaves))):
        return _demote(state, Reason.LEAVES_CHANGE,
                       "the value changed on the call right after it was specialised", compile_id)
    return None


def _leaves_changed(spec: Spec, leaves: tuple, declared: tuple) -> bool:
    """Were ``spec``'s leaves freed or written in place since it was specialised, or replaced by
    the next element of the same table? At least one undeclared leaf must have changed so (a
    declared one new is a new request, by the user's word: review 21); one alive and replaced by
    another object is another request's (A, B, A), never a reason to demote. Leaves that are the
    very tensors it read, unwritten (a frozen weight beside the request's tensor), are set aside
    when an undeclared leaf was freed or written (review 23: a reranker whose cone read the input
    and 44 weights recompiled its whole forward on each of 3 calls before the 3-call rule), but
    not beside a leaf that is only another view of the same storage: rows of one pooled tensor,
    served in turn, look like the next element of a table (review 23, helper 179)."""
    if not spec.leaf_refs:
        return False
    freed_or_written = next_element = kept = False
    if any(ref() is not None and ref() is not cur for ref, cur in zip(spec.leaf_refs, leaves)):
        # NOTE: a tensor dropped by the caller can still sit in a reference cycle (Dynamo's
        # frame state); collect once so "freed" means freed. Only reached on a recompile.
        gc.collect()
    for ref, ver, cur, d in zip(spec.leaf_refs, spec.leaf_versions, leaves, declared):
        old = ref()
        if old is None:
            freed_or_written |= not d  # freed: the previous step's tensor is gone
        elif old is cur and ver is not None and not cur.is_inference() and cur._version != ver:
            freed_or_written |= not d  # same object written in place
        elif old is not cur and _same_storage(old, cur):
            next_element |= not d  # the next element of one table (``for t in scheduler.timesteps``)
        elif old is not cur or ver is None or cur.is_inference():
            return False  # another live tensor (or one whose writes cannot be told)
        else:
            kept = True  # the same tensor, unwritten
    return freed_or_written or (next_element and not kept)


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() != 0
    except Exception:
        return False


def _runtime_miss(state: SiteState, cone: ConeState, may_demote: bool) -> bool:
    """Rule 4. Book a call whose leaves are new; True when the site is demoted instead of re-synced.

    NOTE: within one call the entry stored by the miss is hit again by the guards of the other
    cache entries of the cone (at most ``len(specs) - 1`` times); more hits than that mean a later
    call reused it, so the leaves did not change on every call.
    """
    last = cone.last_miss
    if last is not None and last.hits < len(cone.specs):
        cone.miss_streak += 1
    else:
        cone.miss_streak = 1
        cone.streak_keys = set()
    # NOTE: leaves that are new on every call but keep their value (a 0-d tensor built anew each
    # step) are not demoted: the guard's one sync per call replaces the sync stock Dynamo would make,
    # and the graph stays whole. Demoting would cost a recompile (and the syncs Dynamo makes while
    # compiling) for nothing, so nosync would sync more than stock. Only a streak that also brought
    # a new value, i.e. a recompile per call, demotes.
    if may_demote and cone.miss_streak >= MISS_STREAK_DEMOTE and len(cone.streak_keys) > 1:
        _demote(state, Reason.LEAVES_CHANGE,
                f"its leaves were new on {cone.miss_streak} calls in a row, so the guard re-ran the "
                "cone (one sync) every call")
        return True
    return False


def forget_after_hidden_writes(written: bool, compiled: Callable[..., Any],
                               maybe_unversioned: Sequence[int] = ()) -> Callable[..., Any]:
    """``compiled``, or, when the graph writes an input without bumping its version (``written``,
    from :func:`cone.writes_inputs_unseen`, read before codegen: a batch norm in training mode on a
    buffer of another name, ``t.data.add_``, also inside a higher-order op or a function kept
    whole), a wrapper that forgets every memoised value after each call (:func:`forget_all`): the
    next graph of the function (after a graph break), another compiled function, or this graph's
    next call would take what it hoisted or cached from them as still current (Note [Writes behind
    the version counter across graphs]). ``maybe_unversioned``: the positions of the inputs a
    custom op writes that may or may not bump their version
    (:func:`cone.inputs_custom_ops_may_write_unseen`): forgotten after a call where one of them
    kept its version."""
    if not written and maybe_unversioned:
        positions = tuple(maybe_unversioned)

        @functools.wraps(compiled)
        def check(*args: Any) -> Any:
            before = [_version_or_none(args[i]) for i in positions]
            try:
                return compiled(*args)
            finally:
                if any(v is None or _version_or_none(args[i]) == v for i, v in zip(positions, before)):
                    forget_all()

        return check
    if not written:
        return compiled

    @functools.wraps(compiled)
    def run(*args: Any) -> Any:
        try:
            return compiled(*args)
        finally:
            forget_all()

    return run


def _version_or_none(t: Any) -> Optional[int]:
    """``t._version``, or None for what has none (an inference tensor, not a tensor)."""
    try:
        return t._version if isinstance(t, torch.Tensor) and not t.is_inference() else None
    except Exception:
        return None


# Note [Writes behind the version counter across graphs]
# Within one graph, a hidden write to a hoisted leaf demotes its site (demote_hidden_writes), and one
# to an invariant leaf makes the cone impure. A graph cannot see the writes of another graph, such as
# the one before a graph break in the same function, run at every call: so the graph that writes
# makes every memo forget (the cones', the invariant runners', the tabulated ops'), and every
# guard's fast path fail once (the demotion epoch). Everything, not only what was computed from
# the written tensor: another function may read its memory under another name, through another
# storage object (two torch.from_numpy of one array), a wrapper subclass's inner tensor, or
# after the writer swapped the storage (t.data = other). Bumping the written tensor's version
# instead broke autograd: a tensor saved for a backward (before the call, in it, inside a
# function kept whole that turns grad mode on) failed that backward, which eager runs.
# The price: after each call of such a graph (a training step with batch norm), every hoisted
# site asks its question again (one sync each) on its next call.
_FORGETTABLE: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
_FORGET_LOCK = threading.Lock()
# forget_all calls begun and ended so far: a value computed across one, or while one runs (another
# thread's write behind the version), is not memoised
_FORGETS = [0, 0]


def forgettable(obj: Any) -> None:
    """Register ``obj``, which memoises values computed from tensors (a ``forget()`` method), with
    :func:`forget_all`."""
    with _FORGET_LOCK:
        _FORGETTABLE[id(obj)] = obj


def forget_all() -> None:
    """Forget every value memoised from tensors, and fail every guard's fast path once."""
    with _FORGET_LOCK:  # a registration from another thread (a compile) must not break the walk
        _FORGETS[0] += 1  # (two threads' forgets count twice)
        objs = list(_FORGETTABLE.values())
    try:
        errors = []
        for obj in objs:  # one that raises must not leave the others' values in place
            try:
                obj.forget()
            except Exception as e:  # noqa: BLE001 - raised below, after the others forgot
                errors.append(e)
        if errors:
            raise errors[0]
    finally:
        with _FORGET_LOCK:
            _FORGETS[1] += 1
        _DEMOTIONS[0] += 1


def demote_hidden_writes(graph: Any, compile_id: Optional[str]) -> None:
    """Rule 5: demote every site hoisted from a leaf that the graph writes behind the version
    counter (unless all its leaves are declared: then the user promised the value does not change)."""
    for (key, fp), what in hidden_writes_to_hoisted(graph):
        with _lock:
            state = _sites.get(key)
        cone = state.cones.get(fp) if state is not None else None
        if cone is None or state.demoted is not None or all(l.declared for l in cone.result.leaves):
            continue
        _demote(state, Reason.HIDDEN_WRITER, what, compile_id)


# ----------------------------------------------------------------------------------------------
# The checks of a compiled frame, for callers that run them themselves (serving.check_request)
# ----------------------------------------------------------------------------------------------
_checks_by_code = dynamo_hooks.CodeMap()  # frame code (by identity) -> weakref.WeakSet of its checks
_owner_of: "weakref.WeakKeyDictionary[SiteCheck, Optional[tuple]]" = weakref.WeakKeyDictionary()
_callers_of: "weakref.WeakKeyDictionary[SiteCheck, frozenset]" = weakref.WeakKeyDictionary()


def _register_check(frame_code: Any, check: SiteCheck, owner: Optional[tuple] = None,
                    callers: frozenset = frozenset()) -> None:
    """Remember ``check`` under the code object of the frame it guards (weakly: a cache entry that
    Dynamo frees takes its checks with it), with ``owner``, the identity of that frame's closure
    (:func:`dynamo_hooks.closure_identity`): functions sharing one code object are told apart; and
    ``callers``, the :func:`dynamo_hooks.code_key` of the frames it was compiled inside."""
    if frame_code is None:
        return
    with _lock:
        _checks_by_code.setdefault(frame_code, weakref.WeakSet()).add(check)
        _owner_of[check] = owner
        _callers_of[check] = callers


def checks_for(frame_code: Any, owner: Optional[tuple] = None) -> list[SiteCheck]:
    """The live checks of the cache entries compiled for ``frame_code``, demoted sites excluded;
    with ``owner``, only those of frames with that closure identity (or an unknown one)."""
    with _lock:
        checks = list(_checks_by_code.get(frame_code, ()))
        owners = [_owner_of.get(c) for c in checks]
    return [c for c, o in zip(checks, owners)
            if c.state.demoted is None and dynamo_hooks.same_owner(o, owner)]


def demoted_sites(frame_code: Any) -> list[SiteKey]:
    """The demoted sites of ``frame_code`` (of any closure of it), in source order: its own, and
    those of functions inlined into it that were hoisted there before."""
    with _lock:
        states = [st for st in _sites.values()
                  if st.demoted is not None and (st.code is frame_code or frame_code in st.frames)]
    return sorted({st.site for st in states}, key=lambda k: (k.file, k.line))


def checks_compiled_inside(key: tuple) -> list[tuple[Any, SiteCheck]]:
    """``(frame code, check)`` of the live checks compiled while a frame of ``key``
    (:func:`dynamo_hooks.code_key`) was running: the frames a function's call compiled on their
    own (a callee after a graph break at its call, a resume function)."""
    with _lock:
        found = [(code, c) for code, checks in _checks_by_code.items() for c in checks
                 if key in _callers_of.get(c, ())]
    return [(code, c) for code, c in found if c.state.demoted is None]

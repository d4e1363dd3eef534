"""Table lifting: a sync on request-invariant tables read at a host int index (a step counter).

A diffusers scheduler reads its per-request tables at a Python int counter, then syncs on the
result at every step::

    sigma = self.sigmas[self.step_index]                   # self._step_index: a Python int
    gamma = ... if s_tmin <= sigma <= s_tmax else 0.0      # two bool(tensor) syncs per step

Dynamo specialises ``_step_index`` on its first value and makes it dynamic (a SymInt) once it
changes, so the cone of the sync has an int leaf and cannot be hoisted as one constant. Its value is
still a pure function of ``(tables, i)``: this module evaluates it for every index of the tables once
per request (one sync, into a host *mirror*), and the guard answers from the mirror with the index it
reads from the frame, with no sync at all.

Before (Dynamo graph at the sync)::

    %l_self_step_index : SymInt = placeholder[L['self']._step_index]
    %l_self_sigmas     : Tensor = placeholder[L['self'].sigmas]
    %sigma = torch.select(%l_self_sigmas, 0, %l_self_step_index)
    %ge    = operator.ge(%sigma, 0.0)                       <- `if s_tmin <= sigma`

Mirror (once per request: the cone run at i = 0..n-1, stacked, one ``.tolist()``)::

    (True, True, True, ..., True)

Guard (an epilogue lambda over ``L['self'].sigmas`` and ``L['self']._step_index``)::

    entry = memo.lookup((sigmas,))        # identity + _version + metadata, as for any hoisted cone
    if entry is None:                     # set_timesteps built new tables: one sync
        entry = mirror(sigmas)
    return entry.mirror[step_index] == specialised_answer     # no sync

One answer for every index: one cache entry serves every step. Different answers: one cache entry
per distinct answer, the guard of each still sync-free; more distinct answers over the tables than
``max_specializations``: not lifted (``TABLE_STEP_VARYING``), the sync stays. An index where the cone
fails (outside the tables: ``IndexError``) has no answer in the mirror: the guard fails, and the
trace at that index leaves the sync to stock Dynamo, which raises as eager does.

This module owns the analysis and the mirror; the memo, the per-site state, demotion and the guard
plumbing are :mod:`torchsync_pass.guards`' (a lifted cone is a ``ConeState`` whose memo entry holds
a mirror instead of one value). It touches no Dynamo internals.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from . import _torch_private, dynamo_hooks
from .cone import ConeResult, _example, analyze_cone, cone_of, dotted_name, mark_hoisted
from .guards import (
    _CONVERT,
    ConeMemo,
    ConeState,
    bits_state,
    SiteCheck,
    SiteState,
    Spec,
    syncing_op_in_cone,
    WrittenInputs,
    _written_inputs_of,
    _new_value_demotion,
    _hoistable,
    _record,
    _reject,
    value_key,
)
from .report import Action, Reason

log = logging.getLogger(__name__)

MAX_TABLE_LEN = 4096  # indices mirrored per request, at most

# The conversions of guards._CONVERT, applied to the Python values one .tolist() produced.
_FROM_HOST: dict[str, Callable[[Any], Any]] = {"item": lambda v: v, "tolist": lambda v: v, "bool": bool, "int": int,
                                               "float": float, "index": lambda v: int(operator.index(v))}
assert set(_FROM_HOST) == set(_CONVERT)
# NOTE: torch's Tensor.__int__, __index__ and __bool__ convert through int64 and raise for a
# uint64 value >= 2**63 (review 18); Python's int(), operator.index() and bool() of the .tolist()
# value do not
_UINT64 = getattr(torch, "uint64", None)
_INT64_CHECKED = frozenset({"int", "index", "bool"})
_SIZE_SOURCES = (".size()", ".stride()", ".storage_offset()", "__len__")


class TableTooLarge(ValueError):
    pass


@dataclass(frozen=True, repr=False)
class Mirror:
    """The cone's answer at every index of the tables: a value key and value, None where it failed."""

    keys: tuple
    values: tuple

    def key_at(self, i: Any) -> Any:
        if type(i) is int and 0 <= i < len(self.keys):
            return self.keys[i]
        return None

    def distinct(self) -> set:
        return {k for k in self.keys if k is not None}

    def __repr__(self) -> str:  # in guard-failure messages: short
        return f"<mirror of {len(self.keys)} indices, {len(self.distinct())} distinct answers>"


def index_range(tables: tuple) -> int:
    """How many indices to mirror: the longest dimension of any table."""
    n = max((max(t.shape, default=1) for t in tables), default=0)
    if n > MAX_TABLE_LEN:
        raise TableTooLarge(f"a table dimension has {n} entries > {MAX_TABLE_LEN}")
    return n


def evaluate_mirror(module: torch.fx.GraphModule, index_pos: int, kind: str, tables: tuple) -> Mirror:
    """Run the cone at every index; one ``.tolist()`` (one sync) per output shape and dtype."""
    n = index_range(tables)
    outs: dict[int, torch.Tensor] = {}
    for i in range(n):
        args = list(tables)
        args.insert(index_pos, i)
        try:
            # NOTE: forward, not module(...): GraphModule.__call__ prints a "Call using an
            # FX-traced Module ... <--- HERE" traceback to stderr for every exception, and an
            # index past a table's end (``sigmas[i + 1]`` at the last i) is expected here.
            out = module.forward(*args)
        except Exception:  # IndexError and the like: no answer here; the trace will see eager's error
            continue
        if not isinstance(out, torch.Tensor) or out.is_complex():
            continue
        if kind != "tolist":
            # (a bool tensor's index is its int: operator.index(torch.tensor(True)) == 1)
            if out.numel() != 1 or (kind == "index" and out.is_floating_point()):
                continue  # eager raises for these: leave them to eager
            out = out.reshape(())
        outs[i] = out
    groups: dict[tuple, list[int]] = {}
    for i, out in outs.items():
        groups.setdefault((tuple(out.shape), out.dtype, out.device), []).append(i)
    keys: list = [None] * n
    values: list = [None] * n
    convert = _FROM_HOST[kind]
    for (_, dtype, _), idx in groups.items():
        host = torch.stack([outs[i] for i in idx]).tolist()  # the one sync
        for i, v in zip(idx, host):
            if dtype is _UINT64 and kind in _INT64_CHECKED and v >= 1 << 63:
                continue  # eager's int(t), index(t), bool(t) raise: leave them to eager
            try:
                value = convert(v)
                keys[i] = value_key(value)
            except (TypeError, ValueError, OverflowError):
                continue
            values[i] = value
    return Mirror(tuple(keys), tuple(values))


@dataclass
class TableConeState(ConeState):
    """A lifted cone: its memo maps the tables (identity, ``_version``, metadata) to a mirror."""

    index_source: str = ""

    def evaluate(self, leaves: tuple, memo: ConeMemo) -> Any:
        module, pos = self.result.module, self.result.index_pos
        assert module is not None and pos is not None
        fps = memo.fingerprints(leaves)  # before the mirror: see ConeMemo.store
        with self.running():
            mirror = evaluate_mirror(module, pos, self.kind, leaves)
        return memo.store(leaves, None, mirror, fps)


class TableCheck(SiteCheck):
    """The guard of one cache entry of a lifted site: the answer at the frame's index, no sync."""

    def __init__(self, state: SiteState, cone: TableConeState, spec: Spec, sources: list[str], bits: tuple,
                 written: Optional[WrittenInputs] = None, compile_id: Optional[str] = None) -> None:
        super().__init__(state, cone, spec, sources, bits, written, compile_id)
        self.getter = dynamo_hooks.leaf_getter(self.sources + [cone.index_source])

    def check_leaves(self, leaves: tuple) -> bool:
        return self.check_entry(leaves[:-1], leaves[-1])

    def answer(self, e: Any, index: Any) -> Any:
        return e.value.key_at(index)

    # NOTE: SiteCheck.fuse's fast path keeps weak references to every leaf; an int index has none,
    # so table checks run one after the other (the guard group's plain path).
    fuse = None


def _index_leaf(site: dynamo_hooks.SyncSite) -> Optional[dynamo_hooks.Leaf]:
    """The one int placeholder (an argument or attribute made dynamic) the synced value depends on."""
    cone = cone_of(site.node)
    ints = [
        leaf for leaf in site.leaves
        if leaf.node in cone and leaf.role == "symbolic" and isinstance(leaf.example, (torch.SymInt, int))
    ]
    if len(ints) != 1 or any(s in ints[0].source for s in _SIZE_SOURCES):
        return None
    return ints[0] if _only_indexes(ints[0].node, cone) else None


_INDEXING = {operator.getitem, torch.select, torch.narrow, "select", "narrow", "__getitem__"}


def _only_indexes(index: torch.fx.Node, cone: set) -> bool:
    """Does the int reach tensors only as an index (``t[i]``, ``t[i + 1]``, ``t.select(0, i)``)?

    ``x.sum() * n`` reads no table at ``n``: mirroring it over a table's length would be
    meaningless, so such a cone keeps its ``SYMBOLIC`` rejection.
    """
    todo, seen, indexed = [index], set(), False
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        for user in n.users:
            if user not in cone:
                continue
            if isinstance(_example(user), (torch.SymInt, int)):
                todo.append(user)  # int arithmetic: i + 1, len(t) - 1 - i
            elif user.target in _INDEXING and not _slice_bound(n, user):
                indexed = True
            else:
                return False
    return indexed


def _slice_bound(n: torch.fx.Node, user: torch.fx.Node) -> bool:
    """Is ``n`` a bound or step of a slice in the subscript ``user`` (``t[:, :n]``)? Such an int is
    not an index: every value up to the dimension's length, and past it, is valid (review 23:
    ``mask[:, :n].all()`` mirrored over 0..15 missed n == 16, the full-length batch)."""
    def bounds(value: Any) -> bool:
        if isinstance(value, slice):
            return any(v is n for v in (value.start, value.stop, value.step))
        if isinstance(value, (tuple, list)):
            return any(bounds(v) for v in value)
        return False

    return any(bounds(a) for a in (*user.args[1:], *user.kwargs.values()))


def _int_value(x: Any) -> Optional[int]:
    """The int a (backed) SymInt stood for when traced, read without adding a guard."""
    if type(x) is int:
        return x
    value = _torch_private.symint_hint(x) if isinstance(x, torch.SymInt) else None
    return value if type(value) is int else None


def lift(state: SiteState, site: dynamo_hooks.SyncSite, opts: Any, compile_id: Optional[str],
         site_key: tuple) -> Optional[tuple[bool, Any]]:
    """Hoist ``site`` as a table read at a host int index; None when the site is not one.

    ``site_key`` is guards.decide's key of the site, under which hidden writers find it.
    """
    index = _index_leaf(site)
    i = None if index is None else _int_value(index.example)
    if index is None or i is None:
        return None
    result = analyze_cone(site.node, site.leaves, declared=opts.invariant,
                          in_root_tracer=site.in_root_tracer, index=index.node)
    if not result.ok:
        return _reject(state, result.reason, result.detail, compile_id)
    syncing = syncing_op_in_cone(state, result, compile_id)
    if syncing is not None:
        return syncing
    if not result.leaves:
        return None  # a function of the int alone: nothing to mirror
    tables = tuple(result.leaf_examples)
    result.leaf_examples = []  # weak references only (see guards.decide)
    traced_nodes, result.nodes = result.nodes, frozenset()  # nor the traced graph (ditto)
    cone, fp = _cone_state(state, site, result, index.source)
    bits = bits_state()
    try:
        entry, _ = cone.current(tables, cone.memo_for(bits))
    except TableTooLarge as e:
        return _reject(state, Reason.TABLE_TOO_LARGE, str(e), compile_id)
    except Exception as e:
        return _reject(state, Reason.EVAL_FAILED, f"{type(e).__name__}: {e}", compile_id)
    mirror: Mirror = entry.value
    name = dotted_name(index.source)
    key = mirror.key_at(i)
    if key is None:
        covered = [j for j, k in enumerate(mirror.keys) if k is not None]
        span = f"{covered[0]}..{covered[-1]}" if covered else "no index"
        return _reject(state, Reason.TABLE_INDEX_OUTSIDE, f"{name} = {i}; the tables answer at {span}", compile_id)
    value = mirror.values[i]
    distinct = mirror.distinct()
    if len(distinct) > opts.max_specializations or not _hoistable(value):
        detail = f"{len(distinct)} distinct answers over {name} in 0..{len(mirror.keys) - 1}"
        return _reject(state, Reason.TABLE_STEP_VARYING, detail, compile_id)
    spec = cone.specs.get(key)
    if spec is None:
        demoted = _new_value_demotion(state, cone, result, tables, opts, compile_id)
        if demoted is not None:
            return False, f"demoted: {demoted.value}"
        spec = Spec(value, key)
        cone.specs[key] = spec
    cone.last_spec = spec
    mark_hoisted(dataclasses.replace(result, nodes=traced_nodes), owner=(site_key, fp))
    check = TableCheck(state, cone, spec, [l.source for l in result.leaves], bits, _written_inputs_of(compile_id),
                       compile_id)
    dynamo_hooks.add_lambda_guard(site, check, f"{state.site}: {state.source} == {value!r} at {name}")
    detail = (f"lifted over {name} in 0..{len(mirror.keys) - 1}: {len(distinct)} distinct answer(s)"
              + ("; speculated invariant" if result.speculative else ""))
    _record(state, Action.HOISTED, Reason.TABLE_LIFTED, detail, value,
            tuple(l.name for l in result.leaves) + (name,), compile_id=compile_id)
    return True, value


def _cone_state(state: SiteState, site: dynamo_hooks.SyncSite, result: ConeResult,
                index_source: str) -> tuple[TableConeState, tuple]:
    fp = ("table", index_source, result.fingerprint, site.kind)
    cone = state.cones.get(fp)
    if cone is None:
        cone = TableConeState(result, site.kind, state.site, index_source=index_source)
        state.cones[fp] = cone
    return cone, fp


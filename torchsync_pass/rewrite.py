"""Device-side rewrites: a host read used only as an index becomes a gather on the device.

A step-varying read cannot be hoisted (its value is new at every step), but when the value only
indexes a table, the host does not need it at all::

    rows.append(self.emb.weight[tokens[i].item()])    # index into a tensor
    rows.append(self.table[int(tokens[i])])            # index into a Python list of tensors

Before (stock Dynamo: a graph break and a sync at every position)::

    %select = torch.select(%l_tokens_, 0, 3)
    item = select.item()                               <- graph break, host read
    row = self.table[item]                             (Python, outside the graph)

After (one graph, no host read)::

    %select = torch.select(%l_tokens_, 0, 3)
    %stack  = torch.stack([%l_self_table_0_, ..., %l_self_table_63_])     # list form only
    %row    = torch.ops.aten.index.Tensor(%stack, [%select])

``aten.index`` with a 0-d index copies the row's bits (same values, shape, dtype and, for the tables
accepted, strides), wraps a negative index as Python does and raises ``IndexError`` for one out of
range (on CUDA: a device-side assert). The hook point that recognises the pattern and traces these
ops is in :mod:`torchsync_pass.dynamo_hooks` (Note [Rewriting a read used as an index]); this module
is the policy and the records:

* :meth:`Rewriter.allow`: a site refused earlier keeps its sync; every other candidate is rewritten.
* :func:`check_graph` (the backend, before codegen): eager's row is a view of the table (a tensor
  table) or the list's tensor itself, the rewrite's is a copy. When the graph writes the row (or a
  view of it) in place, returns it, or writes the table after the read, the copy would be
  observable: the site is refused for good (``KEPT``, ``REWRITE_ALIASED``) and the frame is traced
  again, keeping the sync as stock Dynamo does.
* Records: a ``Decision`` per rewritten site and graph (``REWRITTEN``, reason ``INDEX_TENSOR`` or
  ``INDEX_LIST``) and per integer read that was neither hoisted nor rewritten (``KEPT``, with why),
  counted in ``counters["nosync"]`` under the action's name, logged under ``TORCH_LOGS=nosync`` and
  in ``TORCH_TRACE`` (artifact ``nosync_decision``).

The stacked list of the list form is a pure function of the list's tensors: for rows of at least
``CACHE_MIN_ROW_BYTES`` it is cached once per request by :mod:`torchsync_pass.invariant` (by
default with codegen="eager", under Inductor when invariant_cache_bytes is set; its memo keys each
tensor by identity, ``_version`` and metadata; Dynamo's own
guards cover the list's length), so a list whose element is replaced, written in place or appended
gives the new answer.
"""

from __future__ import annotations

import dataclasses
import dis
import functools
import logging
import math
import operator
import threading
import types
from typing import Any, Optional

import torch

from . import _torch_private, cone, dynamo_hooks, guards
from .report import Action, Decision, Reason, SiteKey

log = logging.getLogger(__name__)

_kept: dict[tuple, tuple] = {}  # site key -> (Reason, detail): why it keeps its sync (found after a rewrite)
_lock = threading.Lock()


def reset() -> None:
    with _lock:
        _kept.clear()


def _site_key(site: dynamo_hooks.SyncSite) -> tuple:
    # the key guards.decide uses: one sync instruction, in the function or a resume function
    return (site.file, site.line, site.col, site.occurrence)


def _record(use_or_site: Any, action: Action, reason: Reason, detail: str, compile_id: Optional[str]) -> None:
    u = use_or_site
    d = Decision(site=u.site, kind=u.kind, action=action, reason=reason, code=u.code, source=u.source,
                 detail=detail, compile_id=compile_id or "")
    # once: the same decision in a retrace of the same compile
    guards.record_decision(d, once=("rewrite", compile_id, u.site_key, action))


def _with_site(use: dynamo_hooks.RewriteUse, site: dynamo_hooks.SyncSite) -> dynamo_hooks.RewriteUse:
    return dataclasses.replace(use, site_key=_site_key(site), site=SiteKey(site.file, site.line),
                               kind=site.kind, source=site.source_line, code=site.code_name)


# --------------------------------------------------------------------------------------------
# A branch selected on the device (Note [Rewriting a branch as a select] in dynamo_hooks)
# --------------------------------------------------------------------------------------------
# Both arms run, so every op in the arm eager skips must be unable to raise or change state because
# of the values it reads. Shape errors and the dtype checks of meta functions show at trace time (on
# fake tensors), and random or in-place ops are refused; what is left raises in the kernel only: a
# value (an index out of range: masked, below; an integer division by zero; a negative integer
# power) or a dtype the kernel does not implement (``remainder`` of bools, ``frac`` of ints, which
# the fake tensors let through). So: views, layout and conversions on any dtype; on floating point
# (32, 64, 16 bits), matmuls, norms, reductions of static shape and the pointwise ops (aten's
# ``pointwise`` tag); on integers, bools and complex numbers, only equality, logic, addition,
# multiplication and selection (_ANY_DTYPE), ordering and clamping but not on complex, and bitwise
# ops on integers and bools only (the CPU kernels reject the rest, the fake tensors do not).
_LAYOUT = frozenset({
    "view", "reshape", "flatten", "unflatten", "permute", "transpose", "t", "unsqueeze", "squeeze",
    "expand", "expand_as", "contiguous", "clone", "narrow", "select", "split", "chunk", "unbind", "flip",
    "repeat", "to", "type_as", "float", "half", "bfloat16", "double", "long", "int", "bool", "stack", "cat",
    "size", "dim",
})
_FLOAT_SAFE = frozenset({
    "linear", "matmul", "mm", "bmm", "addmm", "layer_norm", "group_norm", "rms_norm", "softmax",
    "log_softmax", "sum", "mean", "amax", "amin", "cumsum", "truediv", "neg", "pos", "relu", "gelu", "silu",
    "mish", "softplus", "hardtanh", "leaky_relu", "elu",
})
_ANY_DTYPE = frozenset({"add", "mul", "eq", "ne", "logical_and", "logical_or", "logical_xor", "logical_not",
                        "where"})
_NOT_COMPLEX = frozenset({"lt", "le", "gt", "ge", "minimum", "maximum", "clamp"})  # no order on complex
_INTEGRAL_ONLY = frozenset({"bitwise_and", "bitwise_or", "bitwise_xor", "and_", "or_", "xor"})
_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
# The dtypes an arm's ops may run on: the unsigned 16- to 64-bit, float8 and complex32 dtypes lack
# many kernels (add, lt, flip on the CPU) that fake tensors let through.
_KERNEL_DTYPES = frozenset({torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                            *_FLOATS, torch.complex64, torch.complex128})
# (position of the index, position of the indexed tensor); torch.embedding takes (weight, indices),
# torch.nn.functional.embedding (input, weight)
_INDEX_OPS = {"embedding": (1, 0), "index_select": (2, 0), "getitem": (1, 0), "index": (1, 0)}
MAX_ARM_OPS = 32  # ops traced per arm: the arm eager skips costs device work at every step


def _pointwise(name: str) -> bool:
    packet = getattr(torch.ops.aten, name.strip("_"), None)
    try:
        tags = [getattr(packet, o).tags for o in packet.overloads()] if packet is not None else []
    except Exception:
        return False
    return any(torch.Tag.pointwise in t for t in tags) and not any(torch.Tag.nondeterministic_seeded in t for t in tags)


def _index_of(n: torch.fx.Node, name: str) -> Optional[tuple[torch.fx.Node, int]]:
    """(the index node, the size of the dimension it indexes) of an index op, else None."""
    if name not in _INDEX_OPS:
        return None
    pos, table_pos = (0, 1) if n.target is torch.nn.functional.embedding else _INDEX_OPS[name]
    if name == "embedding" and n.target not in (torch.nn.functional.embedding, torch.embedding,
                                                torch.ops.aten.embedding.default):
        return None
    if name == "index" and n.target is not torch.ops.aten.index.Tensor:
        return None
    if name == "getitem" and n.target is not operator.getitem:
        return None
    idx = n.args[pos] if len(n.args) > pos else None
    if name == "index":
        idx = idx[0] if isinstance(idx, (list, tuple)) and len(idx) == 1 else None
    table = cone._example(n.args[table_pos]) if len(n.args) > table_pos else None
    iex = cone._example(idx) if isinstance(idx, torch.fx.Node) else None
    if not isinstance(iex, torch.Tensor) or not isinstance(table, torch.Tensor) or table.dim() == 0:
        return None
    if iex.dtype not in (torch.int64, torch.int32):
        return None
    dim = n.args[1] if name == "index_select" else 0
    if not isinstance(dim, int) or not isinstance(table.shape[dim], int):
        return None
    return idx, int(table.shape[dim])


def _static_key(key: Any) -> bool:
    """A subscript of ints, slices, None and Ellipsis only (a view, no value read)."""
    if isinstance(key, tuple):
        return all(_static_key(k) for k in key)
    if isinstance(key, slice):
        return all(v is None or isinstance(v, int) for v in (key.start, key.stop, key.step))
    return key is None or key is Ellipsis or isinstance(key, int)


class Rewriter:
    """The policy dynamo_hooks asks at each read used only as an index."""

    def allow(self, site: dynamo_hooks.SyncSite, use: dynamo_hooks.RewriteUse) -> Optional[dynamo_hooks.RewriteUse]:
        """The use, filled with its site, to rewrite; None to leave the read to the ordinary path."""
        key = _site_key(site)
        with _lock:
            why = _kept.get(key)
        if why is not None:
            _record(_with_site(use, site), Action.KEPT, why[0], why[1], dynamo_hooks.current_compile_id())
            return None
        return _with_site(use, site)

    def kept(self, site: dynamo_hooks.SyncSite, reason: str, detail: str) -> None:
        """An integer read that was neither hoisted nor rewritten: say why it was not rewritten."""
        use = _with_site(dynamo_hooks.RewriteUse("", "", 0), site)
        _record(use, Action.KEPT, Reason[reason], detail, dynamo_hooks.current_compile_id())

    def refuse_branch(self, site: dynamo_hooks.SyncSite, reason: str, detail: str) -> None:
        """A branch whose arms cannot be selected on the device: it keeps its sync from now on."""
        with _lock:
            _kept[_site_key(site)] = (Reason[reason], detail)
        self.kept(site, reason, detail)

    def refusal(self, site: dynamo_hooks.SyncSite) -> Optional[str]:
        """Why ``site`` keeps its sync instead of a rewrite or select (``"REASON: text (detail)"``),
        or None when it was not refused; for the error raised under fullgraph=True."""
        with _lock:
            why = _kept.get(_site_key(site))
        return None if why is None else f"{why[0].name}: {why[0].value} ({why[1]})"

    def branch_plan(self, *arms: list) -> list[tuple[torch.fx.Node, torch.fx.Node]]:
        """The (index op, index) pairs whose index dynamo_hooks masks to 0 when the op's arm is not
        taken; raises ``dynamo_hooks.BranchRefused`` for an op the arm eager skips must not run."""
        refused = dynamo_hooks.BranchRefused
        masks = []
        for nodes in arms:
            ops = [n for n in nodes if n.op in ("call_function", "call_method", "call_module", "get_attr")]
            if len(ops) > MAX_ARM_OPS:
                raise refused("BRANCH_COST", f"an arm traces {len(ops)} ops (at most {MAX_ARM_OPS} run in "
                              "both arms at every step)")
            for n in ops:
                name = cone._target_name(n).split(".")[0]  # aten.index.Tensor: "index"
                impure = cone._impure_reason(n) if n.op != "get_attr" else None
                if impure is not None or n.op == "call_module":
                    raise refused("BRANCH_SIDE_EFFECT", f"an arm runs {impure[1] if impure else name} "
                                  "(the arm eager skips would run too)")
                index = _index_of(n, name)
                if index is not None:
                    if index[1] == 0 or (n.target is torch.nn.functional.embedding and any(
                            v is not None for v in list(n.args[3:4]) + [n.kwargs.get("max_norm")])):
                        raise refused("BRANCH_MAY_RAISE", f"{name} in an arm cannot be masked (an empty "
                                      "table, or max_norm writes the weight)")
                    masks.append((n, index[0]))
                    continue
                if n.op == "get_attr" or (name == "getitem" and _static_key(n.args[1])):
                    continue
                exs = [cone._example(x) for x in n.all_input_nodes] + [cone._example(n)]
                dts = {e.dtype for e in exs if isinstance(e, torch.Tensor)}
                odd = dts - _KERNEL_DTYPES
                if odd:
                    raise refused("BRANCH_MAY_RAISE", f"an arm runs {name} on {', '.join(sorted(map(str, odd)))} "
                                  "(many ops have no kernel for it: it could raise where eager skips the arm)")
                if name in _LAYOUT:
                    continue
                misfit = _scalar_misfit(n, exs[-1])
                if misfit is not None:
                    raise refused("BRANCH_MAY_RAISE", f"an arm runs {name} with the number {misfit[0]}, which "
                                  f"{misfit[1]} cannot hold (the kernel's conversion raises where eager skips the arm)")
                if name in _ANY_DTYPE:
                    continue
                if name in _NOT_COMPLEX and not any(d.is_complex for d in dts) and not (
                        name == "clamp" and torch.bool in dts):  # no clamp kernel for bool
                    continue
                if name in _INTEGRAL_ONLY:
                    if not any(d.is_floating_point or d.is_complex for d in dts):
                        continue
                    raise refused("BRANCH_MAY_RAISE", f"an arm runs {name} on floating point (no such kernel: it "
                                  "raises where eager skips the arm)")
                if any(isinstance(e, torch.Tensor) and e.dtype not in _FLOATS for e in exs):
                    raise refused("BRANCH_MAY_RAISE", f"an arm runs {name} on integer, bool or complex tensors "
                                  "(it may raise for some values or dtypes where eager skips the arm)")
                if name not in _FLOAT_SAFE and not _pointwise(name):
                    raise refused("BRANCH_MAY_RAISE", f"an arm runs {name}, which nosync cannot show never "
                                  "raises for the values of the arm eager skips")
                if name not in _FLOAT_SAFE and dts & {torch.float16, torch.bfloat16}:
                    raise refused("BRANCH_MAY_RAISE", f"an arm runs {name} on float16/bfloat16 (some pointwise "
                                  "functions have no such kernel: it could raise where eager skips the arm)")
        return masks


def _fits(v: Any, dtype: torch.dtype) -> bool:
    """Does the Python number ``v`` convert to ``dtype`` without the kernels' overflow error (a
    clamp bound, ``torch.where``'s scalar, ``add``'s ``alpha``: ``c10::checked_convert``)?"""
    if isinstance(v, complex):
        return dtype.is_complex and all(_fits(p, torch.float64) for p in (v.real, v.imag))
    if dtype is torch.bool:
        return v in (0, 1)
    floating = dtype.is_floating_point or dtype.is_complex
    if isinstance(v, float) and not math.isfinite(v):
        return floating  # inf and NaN: a float holds them, an integer dtype raises
    info = torch.finfo(dtype) if floating else torch.iinfo(dtype)
    return info.min <= v <= info.max  # (finfo's min is -max)


# Ops whose Python numbers the kernel does not convert with an overflow check (a comparison
# against 300 on int8 is a wrapped-number comparison; ``x * 1e40`` overflows to inf; the
# activations' slopes are checked: ``leaky_relu(x, 1e40)`` raises on float32), and those
# where only ``alpha`` is converted so (``x.add(y, alpha=300)`` on int8 raises; ``x + 300`` wraps).
_SCALAR_UNCHECKED = frozenset({"lt", "le", "gt", "ge", "eq", "ne", "mul", "truediv", "div", "gelu"})
_SCALAR_ALPHA_ONLY = frozenset({"add", "sub", "rsub"})
_WIDE = frozenset({torch.int64, torch.float64, torch.complex128})


def _scalar_misfit(n: torch.fx.Node, outs: Any) -> Optional[tuple[Any, torch.dtype]]:
    """A Python number among an arm op's arguments (one list deep) that a dtype the op makes (of
    its traced result ``outs``: the one the kernel converts its numbers to) cannot hold, with that
    dtype; None when every number fits. Numbers that are not values (a ``dim``) are checked too:
    refusing a select keeps the sync, still right. A number Dynamo made a graph input (a
    SymInt/SymFloat bound, its value unknown until the call) fits only the widest dtypes."""
    name = cone._target_name(n).split(".")[0]
    if name in _SCALAR_UNCHECKED:
        return None
    dtypes = {o.dtype for o in (outs if isinstance(outs, (list, tuple)) else [outs]) if isinstance(o, torch.Tensor)}
    if name in _SCALAR_ALPHA_ONLY:
        vals = [n.kwargs.get("alpha", n.args[2] if len(n.args) > 2 else None)]
    else:
        vals = [*n.args, *n.kwargs.values()]
        vals += [x for v in vals if isinstance(v, (list, tuple)) for x in v]
    for v in vals:
        if isinstance(v, torch.fx.Node) and isinstance(cone._example(v), (torch.SymInt, torch.SymFloat)):
            narrow = sorted(dtypes - _WIDE, key=str)
            if narrow:
                return f"{v.name} (a number known only at the call)", narrow[0]
        elif isinstance(v, (int, float, complex)) and not isinstance(v, bool):
            for d in sorted(dtypes, key=str):
                if not _fits(v, d):
                    return v, d
    return None


REWRITER = Rewriter()


def _use(n: torch.fx.Node) -> Optional[dynamo_hooks.RewriteUse]:
    u = n.meta.get(dynamo_hooks.REWRITE_META)
    return u if isinstance(u, dynamo_hooks.RewriteUse) else None


# Rows smaller than this are stacked at every step rather than cached per request: the memo checks
# each tensor's identity, _version and metadata in Python (about 1 us a tensor), which costs more
# than copying a small row (measured on prefill_tokens, codegen="eager", one step: 64 rows of 128
# bytes, 154 us cached against 96 us re-stacked; 512 rows, 760 us against 302 us).
CACHE_MIN_ROW_BYTES = 16 * 1024


def is_table_leaf(n: torch.fx.Node) -> bool:
    """Is ``n`` a placeholder read only by the stack of a rewritten list table, with rows large
    enough to be worth caching once per request (invariant.py)?"""
    ex = cone._example(n)
    if not isinstance(ex, torch.Tensor) or ex.numel() * ex.element_size() < CACHE_MIN_ROW_BYTES:
        return False
    return bool(n.users) and all(_use(u) is not None and u.target is torch.stack for u in n.users)


def check_graph(gm: torch.fx.GraphModule, compile_id: Optional[str]) -> None:
    """Record the rewrites of ``gm``; refuse (and retrace) any whose row would be observably a copy;
    then gather each stacked span of rows at once (:func:`fuse_gathers`)."""
    graph = gm.graph
    written = dynamo_hooks.attribute_written_selects()
    problem = ("the step sets a Python attribute on a tensor, which eager may set on the arm's object or "
               "the list's tensor that a select or gathered row copies")
    for use in written:
        reason = Reason.BRANCH_VALUES if use.form == "branch" else Reason.REWRITE_ALIASED
        with _lock:
            _kept[use.site_key] = (reason, problem)
        _record(use, Action.KEPT, reason, problem, compile_id)
    if written:
        dynamo_hooks.restart_analysis(f"nosync: {written[0].site}: {problem}; keeping the sync")
    rows = [n for n in graph.nodes if _use(n) is not None and n.target is not torch.stack]
    if not rows:
        return
    order = {n: i for i, n in enumerate(graph.nodes)}
    output = next(iter(graph.find_nodes(op="output")))
    returned = [_key(o) for o in cone._nodes_in(output.args)]
    inputs = {_key(n) for n in graph.nodes if n.op in ("placeholder", "get_attr")}
    placeholders = list(graph.find_nodes(op="placeholder"))
    writes = [(order[n], _key(w)) for n in graph.nodes for w in cone.written_nodes(n)]
    # Autograd sees the copy: a gather's backward is not a select's (index_put accumulates: other
    # bits, -0.0 becomes 0.0), a saved copy misses a later in-place write that eager's saved view
    # reports, and a list's stack hands gradients (zeros) to tensors eager never read.
    recorded = next((n for n in graph.nodes if n.op != "placeholder" and _requires_grad(n)), None)
    for row in rows:
        use = _use(row)
        assert use is not None
        key = _key(row)
        branch = use.form == "branch"  # torch.where(test, a, b): a and b are eager's objects
        table = row.args[0]
        stacked = not branch and _use(table) is not None
        tables = ([a for a in row.args[1:3] if isinstance(a, torch.fx.Node)] if branch
                  else table.all_input_nodes if stacked else [table])
        table_keys = {_key(t) for t in tables} - {None}
        # a list's stack is shared by the reads after it: a write to a listed tensor after the
        # stack would be missed by every later read (eager reads the tensor itself)
        since = order[table] if stacked else order[row]
        problem = None
        if key is None:
            problem = "the row has no traced value to check"
        elif key in returned and not (branch and _fresh_arms(row, tables, returned, inputs)):
            problem = ("the selected tensor (or a view of it) is returned, and an arm is not a tensor the graph "
                       "made for this select alone (it is an input, a view, returned too, or read by other ops, "
                       "so eager's returned object could be seen elsewhere)" if branch
                       else "the row (or a view of it) is returned from the graph")
        elif any(k == key for _, k in writes):
            problem = "the row (or a view of it) is written in place"
        elif any(i > since and k in table_keys for i, k in writes):
            problem = ("an arm's tensor is written in place after the select" if branch else
                       "the table is written in place after the read" + (" (or after its stack)" if stacked else ""))
        elif any(i > since and k in inputs for i, k in writes) and table_keys & inputs and not \
                dynamo_hooks.guard_disjoint_storage([p for p in placeholders if _key(p) in table_keys],
                                                    [p for p in placeholders if _key(p) in
                                                     {k for i, k in writes if i > since}]):
            problem = ("the graph writes an input after the " + ("select" if branch else "read") + ", and "
                       + ("an arm" if branch else "the table") + " is an input: at run time the two may "
                       "share memory (a view passed in), which eager's " + ("object" if branch else "row")
                       + " would see")
        elif recorded is not None:
            problem = (f"autograd records this graph ({recorded.name} requires grad): a "
                       + ("select sends gradients to the arm eager skips" if branch else "gathered row has other gradients"))
        elif stacked and any(_requires_grad(t) for t in tables):
            problem = "a tensor of the list requires grad: eager's row is that tensor itself"
        if problem is not None:
            with _lock:
                _kept[use.site_key] = (Reason.REWRITE_ALIASED, problem)
            _record(use, Action.KEPT, Reason.REWRITE_ALIASED, problem, compile_id)
            dynamo_hooks.restart_analysis(f"nosync: {use.site}: {problem}; keeping the sync")
    # a select is a copy, not the arm's object; a row gathered from a list, not the list's tensor
    object_rows = [r for r in rows if _use(r).form in ("branch", "list")]
    used = _identity_found() if object_rows else None
    if used is not None:
        problem = (f"{used} compares objects by identity (`is`, id()): a select or a row gathered from a "
                   "list is a copy, not eager's object; checked over every function traced into this graph")
        def reason(r: torch.fx.Node) -> Reason:
            return Reason.BRANCH_IDENTITY if _use(r).form == "branch" else Reason.REWRITE_ALIASED

        with _lock:
            for r in object_rows:
                _kept[_use(r).site_key] = (reason(r), problem)
        for r in object_rows:
            _record(_use(r), Action.KEPT, reason(r), problem, compile_id)
        dynamo_hooks.restart_analysis(f"nosync: {_use(object_rows[0]).site}: {problem}; keeping the sync")
    reads: dict[tuple, list] = {}
    for row in rows:
        reads.setdefault(_use(row).site_key, []).append(_use(row))
    for uses in reads.values():
        use = uses[0]
        if use.form == "branch":
            _record(use, Action.REWRITTEN, Reason.BRANCH_WHERE, f"{use.length} value(s) selected; "
                    f"{len(uses)} select(s) in this graph", compile_id)
            continue
        reason = Reason.INDEX_LIST if use.form == "list" else Reason.INDEX_TENSOR
        _record(use, Action.REWRITTEN, reason,
                f"{dotted(use.table)}, {use.length} entries; {len(uses)} read(s) in this graph", compile_id)
    fuse_gathers(gm)


def _key(n: torch.fx.Node) -> Optional[int]:
    return cone.storage_of(n)


def _fresh_arms(row: torch.fx.Node, arms: list, returned: list, inputs: set) -> bool:
    """Is a returned select indistinguishable from eager's arm: each arm a tensor the graph made,
    not a view, read by this select alone, whose memory is returned only through it (once)?"""
    key = _key(row)
    if returned.count(key) != 1:
        return False
    for a in arms:
        ex, k = cone._example(a), _key(a)
        if (k is None or k in inputs or k in returned or not isinstance(ex, torch.Tensor)
                or _torch_private.is_view(ex) or len(a.users) != 1):
            return False  # (an arm read elsewhere, e.g. by another select, could be eager's other result)
        # another node with this memory at run time (``d1 = F.dropout(a, 0.0)``, ``a.float()`` of a
        # float: eager's ``a`` itself): two selects could return one object in eager, copies here
        if any(n is not a and _key(n) == k for n in a.graph.nodes):
            return False
    return True


_CONST_OPERAND = ("LOAD_CONST", "LOAD_SMALL_INT")
_NAME_LOADS = ("LOAD_GLOBAL", "LOAD_NAME", "LOAD_DEREF", "LOAD_ATTR", "LOAD_METHOD", "IMPORT_FROM")
_PUSH_ONE = ("LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_GLOBAL", "LOAD_DEREF", "LOAD_NAME", "LOAD_CONST")


# Names whose call compares objects by identity, or hashes them (a tensor hashes by id):
# id(y), operator.is_ / is_not, hash(y), operator.contains(rows, y), rows.__contains__(y).
_IDENTITY_NAMES = ("id", "is_", "is_not", "hash", "__hash__", "contains", "__contains__")


@functools.lru_cache(maxsize=4096)
def _identity_in(code: types.CodeType, ops: bool = True) -> Optional[str]:
    """'file:line' of the first ``is`` / ``is not`` / ``in`` in ``code`` (or a function, lambda or
    comprehension it defines) not against a literal (``x is None``, ``"k" in d``), or of a use of
    one of ``_IDENTITY_NAMES``; only the latter when ``ops`` is False."""
    insts = list(dis.get_instructions(code))
    for k, ins in enumerate(insts):
        const = k >= 1 and (insts[k - 1].opname in _CONST_OPERAND or (
            k >= 2 and insts[k - 1].opname in _PUSH_ONE and insts[k - 2].opname in _CONST_OPERAND))
        if (ops and ins.opname in ("IS_OP", "CONTAINS_OP") and not const) or (
                ins.opname in _NAME_LOADS and ins.argval in _IDENTITY_NAMES):
            line = ins.positions.lineno if ins.positions is not None and ins.positions.lineno else code.co_firstlineno
            return f"{code.co_filename}:{line}"
    for c in code.co_consts:
        if isinstance(c, types.CodeType) and (found := _identity_in(c, ops)) is not None:
            return found
    return None


def _identity_use(codes: tuple, ops: bool = True) -> Optional[str]:
    return next((found for c in codes if (found := _identity_in(c, ops)) is not None), None)


def _identity_found() -> Optional[str]:
    """Where the graph being compiled may compare a select by identity: an ``is`` / ``in`` Dynamo
    traced between two objects that are not Python constants (dynamo_hooks' Note [Identity
    comparisons a select could change]), or a use of ``id`` / ``operator.is_`` in the traced code.
    Without the traced record, every ``is`` / ``in`` in the traced code counts."""
    codes = tuple(_torch_private.traced_code())
    uses = dynamo_hooks.identity_uses()
    if uses is None:
        return _identity_use(codes)
    return uses[0] if uses else _identity_use(codes, ops=False)


def _requires_grad(n: torch.fx.Node) -> bool:
    ex = cone._example(n)
    return isinstance(ex, torch.Tensor) and ex.requires_grad


def fuse_gathers(gm: torch.fx.GraphModule) -> int:
    """Turn ``torch.stack([row(T[0]), ..., row(T[n-1])])`` into one gather ``table[T]``.

    An unrolled lookup loop (``for i in range(len(tokens)): rows.append(table[tokens[i].item()])``
    then ``torch.stack(rows)``) becomes n single-row gathers and a stack; a gather of the whole
    1-D int64 span ``T`` at once is the same copy of the same bits (a contiguous ``[n, *row]``
    tensor: the stack of contiguous rows), in one op instead of 2n + 1. Only rows read nowhere else.
    Returns how many stacks were replaced.
    """
    graph = gm.graph
    fused = 0
    order: Optional[dict] = None  # node positions, taken once (no node moves before the stack)
    for st in list(graph.nodes):
        if st.op != "call_function" or st.target is not torch.stack or _use(st) is not None:
            continue
        rows = st.args[0] if st.args else st.kwargs.get("tensors")
        dim = st.args[1] if len(st.args) > 1 else st.kwargs.get("dim", 0)
        # NOTE: ``out=`` writes the stack into a tensor of the caller's: a new gather would drop it
        if set(st.kwargs) - {"tensors", "dim"} or len(st.args) > 2:
            continue
        if dim != 0 or not isinstance(rows, (list, tuple)) or len(rows) < 2:
            continue
        if not all(isinstance(r, torch.fx.Node) and _use(r) is not None and r.target is torch.ops.aten.index.Tensor
                   and len(r.users) == 1 for r in rows):
            continue
        table = rows[0].args[0]
        idx = [r.args[1][0] for r in rows]
        span = idx[0].args[0] if idx[0].op == "call_function" and idx[0].target is operator.getitem else None
        ex = cone._example(span) if isinstance(span, torch.fx.Node) else None
        if (not isinstance(ex, torch.Tensor) or ex.dim() != 1 or ex.dtype != torch.int64
                or tuple(ex.shape) != (len(rows),) or any(r.args[0] is not table for r in rows)
                or any(i.op != "call_function" or i.target is not operator.getitem or i.args != (span, k)
                       for k, i in enumerate(idx))):
            continue
        # The gather reads the whole span where the stack stands: nothing in between may write (the
        # span, or anything: eager's side effects before an out-of-range row must stay as they are).
        if order is None:
            nodes = list(graph.nodes)
            order = {n: k for k, n in enumerate(nodes)}
        between = nodes[min(order[i] for i in idx):order[st]]
        if any(cone.written_nodes(n) or (n.op == "call_function" and n not in rows and n not in idx
                                          and cone._impure_reason(n) is not None) for n in between):
            continue
        with graph.inserting_before(st):
            whole = graph.call_function(torch.ops.aten.index.Tensor, (table, [span]))
        whole.meta.update(st.meta)  # its traced value: a contiguous [n, *row] tensor, as the stack's
        whole.meta[dynamo_hooks.REWRITE_META] = _use(rows[0])
        st.replace_all_uses_with(whole)
        graph.erase_node(st)
        for r, i in zip(rows, idx):
            graph.erase_node(r)
            if not i.users:
                graph.erase_node(i)
        fused += 1
        order = None  # nodes were erased and one inserted: take positions again if needed
    if fused:
        graph.lint()
        gm.recompile()
    return fused


def dotted(source: str) -> str:
    return cone.dotted_name(source) if source.startswith(("L[", "G[")) else source


# NOTE [Global state when a rewritten read raises]: a ``with torch.no_grad()`` (or
# ``sdpa_kernel``) inside the compiled frame becomes graph nodes that set the state and set it back.
# A rewritten read out of range raises between them: eager's ``__exit__`` restores the state, the
# graph does not (with ``codegen="eager"`` grad mode stays off for the rest of the process; stock
# Dynamo's eager backend shares this for any error raised inside such a graph, but stock keeps the
# read's sync and raises in Python). A graph with a rewrite and such nodes restores, when it
# raises, the state it found: grad mode and the scaled-dot-product backend switches (with the
# overrideable backend and the priority order). That is eager's state after its error only when
# unwinding the ``with`` blocks open at the read gives the entry state back: a read after a bare
# ``torch.set_grad_enabled(False)``, in a ``with`` block of another state (inference mode, whose
# guard the error's traceback would keep alive; autocast; ...) or after a bare SDP switch in the
# step is kept (dynamo_hooks._error_state_differs), as are reads in generators and except bodies.
def _state_nodes(gm: torch.fx.GraphModule) -> set:
    kinds: set = set()
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if _torch_private.is_grad_mode_setter(n.target):
            kinds.add("grad")
        elif getattr(n.target, "__module__", "") == "torch.nn.attention" and getattr(n.target, "__name__", "") == "_sdpa_kernel":
            kinds.add("sdp")
    return kinds


def restore_state_on_error(gm: torch.fx.GraphModule, compiled: Any) -> Any:
    """``compiled``, or a wrapper restoring grad mode and the SDP switches when it raises (Note
    [Global state when a rewritten read raises]); only for graphs with a rewrite and state nodes."""
    if not any(_use(n) is not None for n in gm.graph.nodes):
        return compiled
    kinds = _state_nodes(gm)
    if not kinds:
        return compiled
    sdp = "sdp" in kinds

    @functools.wraps(compiled)
    def run(*args: Any) -> Any:
        grad = torch.is_grad_enabled()
        state = _torch_private.sdp_state() if sdp else None
        try:
            return compiled(*args)
        except BaseException:
            torch.set_grad_enabled(grad)
            if state is not None:
                _torch_private.set_sdp_state(state)
            raise

    return run

"""Syncs inside ops: tabulate a request-invariant op that reads back from the device in its kernel.

Some ops synchronize inside their kernel, with no graph break and no Python-level read for a hook
to see: ``torch.linalg.solve`` reads its LAPACK ``info`` back to raise ``LinAlgError`` on a
singular matrix and checks its pivots (3 ``_local_scalar_dense`` per call on torch 2.13, CPU).
Dynamo keeps such an op inside the graph, so it syncs at every step under stock Dynamo, Inductor
and nosync's hoisting alike. diffusers' ``UniPCMultistepScheduler`` solves a small system at every
step whose matrix and right-hand side depend only on the request's ``sigmas`` table at the step
counter::

    sigma_t, sigma_s0 = self.sigmas[self.step_index], self.sigmas[self.step_index - 1]
    ...                                               # pure elementwise ops on those scalars
    rhos_c = torch.linalg.solve(R, b)                  # 3 syncs per step

When the op's whole cone (its dataflow back to the graph inputs) is pure and its leaves are
request-invariant tensors (the same rules as a hoisted sync, :func:`cone.analyze_cone`) plus at
most one host int used only as an index into them (the step counter Dynamo made dynamic, as in
table lifting, :mod:`torchsync_pass.tables`), :func:`tabulate` (``codegen="eager"``) rewrites the
graph so that the op's value is an extra input, and :class:`TabulatedStep` computes it for every
index once per request::

    table = [cone(tables, i) for i in range(n)]        # once per request: the same ops, same kernels
    step(*args, table[args[index]])                     # every call: a host list read, no sync

Before (the graph Dynamo hands over)::

    def forward(self, l_self_step_index, l_self_sigmas, l_sample_, ...):
        select = torch.select(l_self_sigmas, 0, l_self_step_index)
        ...
        linalg_solve = torch._C._linalg.linalg_solve(R, b)
        to = linalg_solve.to(torch.float32)

After (step graph, every call)::

    def forward(self, l_self_step_index, l_self_sigmas, l_sample_, ..., nosync_tabulated_0):
        to = nosync_tabulated_0.to(torch.float32)

The table entry at ``i`` is the very tensor the cone computed at ``i`` with the same ops on the
same inputs, so values, dtype, shape and strides are identical to eager. On CPU, the ops of
:data:`BATCHED_CPU` (``solve``, ``inv``, ``cholesky``) run once on the stacked inputs of every
index (LAPACK runs per matrix: each slice has the bits of a call on that matrix alone, measured),
so a request costs the op's syncs once (3 for ``solve``), not once per index; each slice is laid out
with the strides of a call on that matrix alone. The table is keyed like a
hoisted value (:class:`guards.ConeMemo`: weak identity, ``_version``, data pointer, shape, stride,
dtype of every leaf; one memo per :func:`guards.bits_state`): ``set_timesteps`` building new tables
is a new request and recomputes; a table written in place recomputes; interleaved requests hit the
LRU.

Errors stay eager's: an index where the cone raised while tabulating (a singular matrix:
``torch.linalg.LinAlgError``; an index past a table's end: ``IndexError``), an index outside
``0..n-1``, or grad mode with a leaf that requires grad, runs the *original* graph for that call,
which raises exactly what eager raises, at the same call. Speculated leaves that turn out to change
on every call (3 tables computed in a row that no later call read) demote the op: the original
graph runs from then on, as stock.

Not done (and why), each recorded as a decision: Inductor codegen (Inductor computes the op's
inputs with its own fused kernels, whose rounding differs from the eager ops a table would use, so
the result would not be bitwise equal to stock Inductor); an op whose result the graph writes in
place or returns (the caller could write the cached tensor); a cone with a step-varying input.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import fx

from . import cone, dynamo_hooks, names
from .guards import MEMO_SIZE, ConeMemo, counters, forget_all, forgettable, record_decision, value_state
from .report import Action, Decision, Reason
from .tables import TableTooLarge, _int_value, _only_indexes, _SIZE_SOURCES, index_range

log = logging.getLogger(__name__)

# Ops that read back from the device inside their kernel: (function, _local_scalar_dense per call
# measured on torch 2.13.0+cpu with small well-conditioned inputs; where each read comes from).
# benchmarks/inop_survey.py measures them; tests/test_inop.py checks each still syncs. Not here:
# torch.linalg.lstsq (1 sync) is not repeatable eagerly on CPU (gelsy gave 2-6 distinct results over
# 300 calls on one 3x3 input), and Dynamo breaks the graph at it (data-dependent output shape).
SYNCING_OPS: dict[Callable, tuple[int, str]] = {
    torch.linalg.solve: (3, "_linalg_check_errors (info) + 2 in linalg_lu_solve (pivot checks)"),
    torch.linalg.solve_ex: (2, "2 in linalg_lu_solve (pivot checks)"),
    torch.linalg.inv: (3, "_linalg_check_errors + 2 pivot checks of the solve it runs"),
    torch.linalg.inv_ex: (2, "2 pivot checks of the solve it runs"),
    torch.inverse: (3, "as torch.linalg.inv"),
    torch.linalg.lu_factor: (1, "_linalg_check_errors (info)"),
    torch.linalg.lu_solve: (2, "pivot checks"),
    torch.linalg.cholesky: (1, "_linalg_check_errors (info)"),
    torch.cholesky_solve: (1, "_linalg_check_errors in _cholesky_solve_helper"),
    torch.linalg.eigh: (1, "_linalg_check_errors (info)"),
    torch.linalg.eigvalsh: (1, "_linalg_check_errors (info)"),
    torch.linalg.svd: (1, "_linalg_check_errors (info)"),
    torch.linalg.svdvals: (1, "_linalg_check_errors (info)"),
    torch.linalg.pinv: (1, "_linalg_check_errors of the SVD it runs"),
    torch.linalg.matrix_rank: (1, "_linalg_check_errors of the SVD it runs"),
}
# The same ops called as tensor methods (``R.inverse()``).
SYNCING_METHODS: dict[str, Callable] = {"inverse": torch.inverse, "cholesky_solve": torch.cholesky_solve}

# Ops whose batched call gives, for each matrix of a batch, the same bits as a call on that matrix
# alone, measured on torch 2.13.0+cpu (tests/test_inop.py::test_batched_op_is_bitwise_per_matrix):
# LAPACK runs per matrix on CPU. Only there: on CUDA the batched path may pick other kernels (cuBLAS/
# MAGMA batched routines), not measured, so a CUDA table is computed one index at a time. The value is
# the number of core dims of each tensor input (no batch dims allowed, so stacking adds exactly one).
BATCHED_CPU: dict[Callable, tuple[tuple[int, ...], ...]] = {
    torch.linalg.solve: ((2, 1), (2, 2)),   # A (k, k) with b (k,) or B (k, m)
    torch.linalg.inv: ((2,),),
    torch.linalg.cholesky: ((2,),),
}
# The largest order k batched, where not every k is: a slice of a batched ``solve``/``inv`` does
# not have the bits of a call on that matrix alone from k = 9 on (float64 k = 9, 11, float32 k = 17,
# 19, 25, 33, ... measured on torch 2.13.0+cpu, MKL: the slices sit at offsets a fresh allocation
# would not have, and the library's kernels depend on alignment); k <= 8 matched in every trial
# (tests/test_inop.py::test_batched_op_is_bitwise_per_matrix). ``cholesky`` matched at every k
# measured (1 to 256). A larger matrix is computed one index at a time.
BATCHED_CPU_MAX_ORDER: dict[Callable, int] = {torch.linalg.solve: 8, torch.linalg.inv: 8}
# Batched only for real matrices and ``left=True``: ``solve(A, B, left=False)`` and complex ``solve``
# had other bits in a batch than alone even at k <= 8 (review 10: float64 k = 5, 7 with 16+
# columns; complex64 k = 7), so such a call is computed one index at a time.
BATCHED_CPU_REAL_LEFT_ONLY = frozenset({torch.linalg.solve})

STALE_TABLES = 3  # tables computed in a row that no call read: the leaves change on every call


# Ops that read a value back inside (error checks, convergence flags) that are not tabulated:
# measured on torch 2.13.0+cpu by review 16 (reads per eager call). With SYNCING_OPS they make a
# cone unfit to hoist or lift (guards.syncing_op_in_cone). An op missing here is hoisted as any
# other; an op listed that does not sync on some input only keeps its site's stock sync.
SYNCS_INSIDE: frozenset = frozenset({
    torch.linalg.eig, torch.linalg.eigvals, torch.linalg.tensorinv, torch.linalg.tensorsolve,
    torch.linalg.lstsq, torch.linalg.cond, torch.linalg.ldl_factor, torch.lu_solve, torch.pinverse,
    torch.cholesky, torch.svd, torch.cholesky_inverse,
})
SYNCS_INSIDE_METHODS = frozenset({"pinverse", "cholesky", "svd", "cholesky_inverse", "lu_solve"})
_SPECTRAL_ORDS = (2, -2, "nuc")  # a matrix norm of these orders runs an SVD (its error check)


def syncs_inside(node: fx.Node) -> Optional[str]:
    """The name of the op ``node`` calls when that op reads a value back inside, else None."""
    op = syncing_op(node)
    if op is not None:
        return op_name(op)
    target, args, kwargs = node.target, node.args, node.kwargs
    if node.op == "call_function" and target in SYNCS_INSIDE:
        return op_name(target)
    if node.op == "call_method" and target in SYNCS_INSIDE_METHODS:
        return f"Tensor.{target}"
    power = (node.op == "call_function" and target is torch.linalg.matrix_power) or (
        node.op == "call_method" and target == "matrix_power")
    if power:  # a negative power inverts (an error check)
        n = args[1] if len(args) > 1 else kwargs.get("n")
        return "torch.linalg.matrix_power" if not isinstance(n, int) or n < 0 else None
    if node.op == "call_function" and target in (torch.linalg.norm, torch.linalg.matrix_norm):
        ord_ = args[1] if len(args) > 1 else kwargs.get("ord")
        return op_name(target) if ord_ in _SPECTRAL_ORDS else None
    return None


def syncing_op(node: fx.Node) -> Optional[Callable]:
    """The public op ``node`` calls when it is one of :data:`SYNCING_OPS`, else None."""
    if node.op == "call_function" and node.target in SYNCING_OPS:
        return node.target
    if node.op == "call_method" and node.target in SYNCING_METHODS:
        return SYNCING_METHODS[node.target]
    return None


def op_name(op: Callable) -> str:
    mod = getattr(op, "__module__", "") or ""
    name = op.__name__
    return f"torch.linalg.{name[len('linalg_'):]}" if name.startswith("linalg_") or "linalg" in mod else f"torch.{name}"


@dataclass
class Table:
    """One request's values of a tabulated op: ``values[i]`` is the op's output at index ``i``
    (``ok[i]`` False where the cone raised: that call runs the original graph)."""

    values: list
    ok: list
    hits: int = 0  # later calls that found this table in the memo


class _Tables:
    """The memo of one cone, shared by every graph that contains the same cone (one frame compiles
    a graph per solver order, each with the same solve): one tabulation per request, not one per
    graph."""

    def __init__(self) -> None:
        self.memos: dict[tuple, ConeMemo] = {}
        self.recent: list[Table] = []  # the newest tables computed, to notice leaves that never repeat
        self.demoted = False
        forgettable(self)

    def forget(self) -> None:
        """Drop the tables (Note [Writes behind the version counter across graphs])."""
        for memo in list(self.memos.values()):  # over a copy: see ConeState.forget
            memo.clear()


_SHARED: "weakref.WeakValueDictionary[tuple, _Tables]" = weakref.WeakValueDictionary()
_MODULES: "weakref.WeakSet[fx.GraphModule]" = weakref.WeakSet()
_MODULES_LOCK = threading.Lock()  # a WeakSet's iteration breaks on another thread's add (a compile)


def cone_modules() -> list[fx.GraphModule]:
    """The cones of the live tabulated ops (count_syncs places their syncs at the op's line)."""
    with _MODULES_LOCK:
        return list(_MODULES)


_UNSTORED = threading.local()


@contextlib.contextmanager
def unstored():
    """Tabulated ops compute their table for the calls made inside (in this thread) without
    storing it or counting it: verify's run of a compiled graph on clones of its inputs, whose
    tables no later call can read. Stored, three such compiles in a row demoted the op as one whose
    tables are never read, and it synced at every step from then on (review 21)."""
    before = getattr(_UNSTORED, "on", False)
    _UNSTORED.on = True
    try:
        yield
    finally:
        _UNSTORED.on = before


class TabulatedOp:
    """The runtime side of one tabulated op: its cone, where its leaves and index sit among the
    graph's arguments, and its memo of tables."""

    def __init__(self, module: fx.GraphModule, leaf_pos: tuple[int, ...], index_pos: Optional[int],
                 module_index_pos: Optional[int], declared: tuple[bool, ...], decision: Decision,
                 fingerprint: tuple, batch: Optional["_Batch"] = None, wheres: tuple = ()) -> None:
        self.module = module
        self.batch = batch
        with _MODULES_LOCK:
            _MODULES.add(module)
        self.leaf_pos = leaf_pos
        self.index_pos = index_pos
        self.module_index_pos = module_index_pos
        self.declared = declared
        # The declared leaves' paths (names.declaration): the memo checks a declared leaf by
        # identity only, so a call whose leaves are not the last checked ones must still be the
        # call they were declared in (the same code runs for a sibling of a module's own class
        # too): else the original graph runs.
        self.wheres = wheres
        self._named: Optional[tuple] = None  # weak refs of the last leaves the paths named
        self.decision = decision
        # NOTE: keyed by the declared flags too: the memo checks a declared leaf by identity only
        # (an inference tensor has no version counter), another graph's leaves by their versions
        key = (fingerprint, declared)
        shared = _SHARED.get(key)
        if shared is None:
            shared = _SHARED[key] = _Tables()
        self.shared = shared

    def _evaluate(self, leaves: tuple, i: Optional[int]) -> Any:
        args = list(leaves)
        if self.module_index_pos is not None:
            args.insert(self.module_index_pos, i)
        # NOTE: forward, not module(...): GraphModule.__call__ prints a traceback to stderr for every
        # exception, and an index past a table's end is expected here.
        return self.module.forward(*args)

    def _compute(self, leaves: tuple) -> Table:
        n = 1 if self.module_index_pos is None else index_range(leaves)
        if self.batch is not None and n > 1:
            return self.batch.compute(self, leaves, n)
        values: list = [None] * n
        ok = [False] * n
        for i in range(n):
            try:
                values[i] = self._evaluate(leaves, i)
                ok[i] = True
            except Exception:  # LinAlgError, IndexError, ...: the original graph raises it at that call
                continue
        return Table(values, ok)

    def _still_declared(self, leaves: tuple) -> bool:
        named = self._named
        if named is not None and all(r() is t for r, t in zip(named, leaves)):
            return True
        if not names.still_declared(self.wheres, leaves):
            return False
        self._named = tuple(weakref.ref(t) for t in leaves)
        return True

    def lookup(self, args: tuple) -> tuple[bool, Any]:
        """(True, value) for this call, or (False, None): run the original graph."""
        shared = self.shared
        if shared.demoted:
            return False, None
        leaves = tuple(args[p] for p in self.leaf_pos)
        if self.index_pos is None:
            i = 0
        else:
            i = args[self.index_pos]
            if type(i) is not int:
                return False, None
        if torch.is_grad_enabled() and any(t.requires_grad for t in leaves):
            return False, None  # a cached value would carry one call's autograd graph
        if self.wheres and not self._still_declared(leaves):
            return False, None
        if getattr(_UNSTORED, "on", False):  # verify's run on clones of the inputs (see unstored)
            try:
                table = self._compute(leaves)
            except TableTooLarge:
                return False, None
        else:
            table = self._stored_table(leaves)
            if table is None:
                return False, None
        if not (0 <= i < len(table.ok)) or not table.ok[i]:
            return False, None
        return True, table.values[i]

    def _stored_table(self, leaves: tuple) -> Optional[Table]:
        """The memo's table for ``leaves``, computed and stored on a miss; None when there is none
        to read (the op is demoted now, or the table would be too large)."""
        shared = self.shared
        # NOTE: one table per global state a value depends on (grad and inference mode, autocast,
        # default dtype, bits state): a graph with a table and no hoisted site has no nosync guard
        # to check that state, and a guard filter may have dropped Dynamo's own
        bits = value_state()
        memo = shared.memos.get(bits)
        if memo is None:
            memo = shared.memos[bits] = ConeMemo(self.declared, MEMO_SIZE)
        entry = memo.lookup(leaves)
        c = counters()
        if entry is None:
            if len(shared.recent) >= STALE_TABLES and not any(t.hits for t in shared.recent):
                self._demote()
                return None
            fps = memo.fingerprints(leaves)  # before the table: see ConeMemo.store
            try:
                table = self._compute(leaves)
            except TableTooLarge:
                return None
            entry = memo.store(leaves, None, table, fps)
            shared.recent = (shared.recent + [table])[-STALE_TABLES:]
            c["table_computes"] += 1
        else:
            c["table_hits"] += 1
            entry.value.hits += 1
        return entry.value

    def _demote(self) -> None:
        self.shared.demoted = True
        record_decision(dataclasses.replace(
            self.decision, action=Action.DEMOTED, reason=Reason.LEAVES_CHANGE,
            detail=f"{STALE_TABLES} tables in a row were computed and never read: the original op runs "
                   "from now on"))


class _Batch:
    """One batched call of the op over every index instead of one call per index (CPU, see
    :data:`BATCHED_CPU`): the cone up to the op's inputs runs per index (no sync), the op once on
    the stacked inputs (its syncs once per request instead of once per index), and each index's
    slice is laid out with the strides a call on that index alone returns (a copy of its bits).
    When the batched call raises (one singular matrix fails the batch), the op runs per index, so
    each index keeps its own outcome."""

    def __init__(self, pre: Optional[fx.GraphModule], op: Callable, args: tuple, kwargs: dict,
                 example: torch.Tensor, core_dims: tuple[tuple[int, ...], ...], stack_trace: str = "") -> None:
        self.pre = pre  # the cone up to the op: forward(*leaves[, i]) -> the op's tensor inputs
        # The op alone as a module whose node keeps the user's stack: count_syncs places its syncs
        # at the op's line (see counting._fx_site).
        g = fx.Graph()
        inputs = [g.placeholder(f"input{j}") for j in range(sum(isinstance(a, _Slot) for a in args))]
        node = g.call_function(op, tuple(inputs[a.j] if isinstance(a, _Slot) else a for a in args), kwargs)
        node.meta["stack_trace"] = stack_trace
        g.output(node)
        self.call = fx.GraphModule(torch.nn.Module(), g, class_name="NosyncBatchedOp")
        with _MODULES_LOCK:
            _MODULES.add(self.call)
        self.shape, self.stride = tuple(example.shape), tuple(example.stride())
        self.core_dims = core_dims
        self.max_order = BATCHED_CPU_MAX_ORDER.get(op, sys.maxsize)

    def _call(self, inputs: tuple) -> Any:
        return self.call.forward(*inputs)

    def compute(self, tab: "TabulatedOp", leaves: tuple, n: int) -> Table:
        values: list = [None] * n
        ok = [False] * n
        inputs: dict[int, tuple] = {}
        for i in range(n):
            args = list(leaves)
            args.insert(tab.module_index_pos, i)
            try:
                inputs[i] = tuple(self.pre.forward(*args))
            except Exception:  # IndexError and the like: the original graph raises it at that call
                continue
        groups: dict[tuple, list[int]] = {}
        for i, ins in inputs.items():
            meta = tuple((t.shape, t.dtype, t.device) for t in ins)
            if (all(t.device.type == "cpu" for t in ins) and tuple(t.dim() for t in ins) in self.core_dims
                    and ins[0].shape[-1] <= self.max_order):
                groups.setdefault(meta, []).append(i)
            else:
                groups.setdefault(("one at a time", i), []).append(i)
        for idx in groups.values():
            batched = None
            if len(idx) > 1:
                try:
                    batched = self._call(tuple(torch.stack([inputs[i][j] for i in idx]) for j in range(len(inputs[idx[0]]))))
                except Exception:
                    batched = None  # e.g. one singular matrix: each index on its own below
            for pos, i in enumerate(idx):
                try:
                    v = self._call(inputs[i]) if batched is None else self._layout(batched[pos])
                except Exception:  # LinAlgError: the original graph raises it at that call
                    continue
                values[i], ok[i] = v, True
        return Table(values, ok)

    def _layout(self, v: torch.Tensor) -> torch.Tensor:
        """A slice of the batched result as a call on that matrix alone returns it: its own memory
        (never a view into the batch: ``as_strided`` or ``untyped_storage()`` would see the other
        indices), with that call's strides."""
        stride = self.stride if tuple(v.shape) == self.shape else v.stride()
        return torch.empty_strided(v.shape, stride, dtype=v.dtype, device=v.device).copy_(v)


@dataclass(frozen=True)
class _Slot:
    j: int


def _batch_for(module: fx.GraphModule, op: Callable, example: Any) -> Optional[_Batch]:
    """The batched form of a cone module whose output is ``op(...)``, when ``op`` is batchable."""
    if op not in BATCHED_CPU or not isinstance(example, torch.Tensor):
        return None
    graph = module.graph
    node = next(iter(graph.find_nodes(op="output"))).args[0]
    if not isinstance(node, fx.Node) or node.op != "call_function" or cone._nodes_in(node.kwargs):
        return None
    if op in BATCHED_CPU_REAL_LEFT_ONLY and (example.is_complex() or node.kwargs.get("left", True) is not True):
        return None
    tensor_args = [a for a in node.args if isinstance(a, fx.Node)]
    if any(cone._nodes_in(a) for a in node.args if not isinstance(a, fx.Node)):
        return None  # a tensor inside a list argument: not one of the simple forms
    args = tuple(_Slot(tensor_args.index(a)) if isinstance(a, fx.Node) else a for a in node.args)
    pre_graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    pre_graph.graph_copy(graph, env)
    pre_graph.output(tuple(env[a] for a in tensor_args))
    pre_graph.eliminate_dead_code()
    pre = fx.GraphModule(module, pre_graph, class_name="NosyncConeInputs")
    return _Batch(pre, op, args, dict(node.kwargs), example, BATCHED_CPU[op], node.meta.get("stack_trace", ""))


class TabulatedStep:
    """Calls the step graph with this call's value of every tabulated op, or the original graph."""

    def __init__(self, original: Callable, step: Callable, ops: list[TabulatedOp], written: tuple[int, ...]) -> None:
        self.original = original
        self.step = step
        self.ops = ops
        self.written = written
        self.leaf_pos = tuple(sorted({p for op in ops for p in op.leaf_pos}))

    def aliased(self, args: tuple) -> bool:
        """Does an input the graph writes share memory with a table's leaf on this call (a view of
        it passed as that argument)? The table is looked up before the graph runs, eager reads
        the leaf after the write."""
        return dynamo_hooks.may_share_storage([args[w] for w in self.written], [args[p] for p in self.leaf_pos])

    def __call__(self, *args: Any) -> Any:
        if self.written and self.aliased(args):
            counters()["table_fallbacks"] += 1
            for op in self.ops:  # the write may not move the input's version (.data, a subclass)
                op.shared.forget()
            try:
                return self.original(*args)
            finally:  # also after it: another thread may have tabulated the input before the write
                forget_all()
        extra = []
        for op in self.ops:
            ok, value = op.lookup(args)
            if not ok:
                counters()["table_fallbacks"] += 1
                return self.original(*args)
            extra.append(value)
        return self.step(*args, *extra)


@dataclass
class Tabulation:
    """What :func:`tabulate` did: ``step`` is None when nothing was tabulated."""

    step: Optional[fx.GraphModule] = None
    ops: list[TabulatedOp] = field(default_factory=list)
    examples: list = field(default_factory=list)  # example values of the new placeholders
    decisions: list[Decision] = field(default_factory=list)
    written: tuple[int, ...] = ()  # positions of the inputs the graph writes in place

    def wrap(self, original: Callable, compiled_step: Callable) -> Callable:
        return TabulatedStep(original, compiled_step, self.ops, self.written) if self.step is not None else original


def record_kept(gm: fx.GraphModule, reason: Reason, detail: str, compile_id: Optional[str]) -> None:
    """Record every in-op sync of ``gm`` as kept, with ``reason`` (e.g. Inductor codegen)."""
    for n in gm.graph.nodes:
        op = syncing_op(n)
        if op is not None:
            record_decision(_decision(n, op, Action.KEPT, reason, detail, (), compile_id))


def _decision(node: fx.Node, op: Callable, action: Action, reason: Reason, detail: str,
              leaves: tuple[str, ...], compile_id: Optional[str]) -> Decision:
    site, fn, src = cone.user_site(node)
    syncs, where = SYNCING_OPS[op]
    what = f"{op_name(op)}: {syncs} sync(s) per call on torch 2.13 CPU ({where})"
    return Decision(site=site, kind="in_op", action=action, reason=reason, code=fn, source=src,
                    detail=f"{what}; {detail}" if detail else what, leaves=leaves, compile_id=compile_id or "")


def _index_of(node: fx.Node, cone_nodes: set, leaves: dict[fx.Node, Any]) -> tuple[Optional[fx.Node], str]:
    """(the int placeholder the cone reads tables at, or None; why not, when it cannot be one)."""
    ints = [n for n in cone_nodes if n in leaves and leaves[n].role == "symbolic"]
    if not ints:
        return None, ""
    if len(ints) > 1:
        return None, f"{len(ints)} host ints reach the op ({', '.join(sorted(leaves[n].source for n in ints))})"
    index = ints[0]
    leaf = leaves[index]
    if any(s in leaf.source for s in _SIZE_SOURCES) or not _only_indexes(index, cone_nodes):
        return None, f"{cone.dotted_name(leaf.source)} is used as more than an index into tables"
    if _int_value(leaf.example) is None:
        return None, f"{cone.dotted_name(leaf.source)} is not an int"
    return index, ""


def _aliased(graph: fx.Graph, node: fx.Node) -> Optional[str]:
    """Does the graph write the op's output (or a view of it) in place, or return it?"""
    keys = {cone._storage_key(v) for v in _tensors(cone._example(node))} - {None}
    if not keys:
        return None
    for n in graph.nodes:
        for w in cone.written_nodes(n):
            if cone.storage_of(w) in keys:
                return f"{cone._target_name(n)} writes its result in place"
    output = next(iter(graph.find_nodes(op="output")))
    for o in cone._nodes_in(output.args):
        if cone.storage_of(o) in keys:
            return "the graph returns its result (or a view of it)"
    return None


def _tensors(value: Any) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def tabulate(gm: fx.GraphModule, opts: Any, compile_id: Optional[str]) -> Tabulation:
    """Find the in-op syncs of ``gm`` that can be tabulated per request; see the module doc.

    Returns a :class:`Tabulation` whose ``step`` is a new GraphModule (``gm`` is not modified) with
    one extra trailing placeholder per tabulated op, or ``step=None`` when there is none.
    """
    graph = gm.graph
    nodes = [(n, op) for n in graph.nodes for op in [syncing_op(n)] if op is not None]
    out = Tabulation()
    if not nodes:
        return out
    placeholders = list(graph.find_nodes(op="placeholder"))
    leaves = {p: leaf for p in placeholders for leaf in [dynamo_hooks.leaf_of(p)] if leaf is not None}
    chosen: list[tuple[fx.Node, Callable, cone.ConeResult, Optional[fx.Node], set]] = []
    region = cone.global_state_change(graph)
    for node, op in nodes:
        if region is not None:
            out.decisions.append(_decision(node, op, Action.KEPT, Reason.IN_OP_STATE_REGION, region, (), compile_id))
            continue
        cone_nodes = cone.cone_of(node)
        index, why = _index_of(node, cone_nodes, leaves)
        if why:
            out.decisions.append(_decision(node, op, Action.KEPT, Reason.SYMBOLIC, why, (), compile_id))
            continue
        result = cone.analyze_cone(node, list(leaves.values()), declared=opts.invariant, index=index)
        if not result.ok:
            out.decisions.append(_decision(node, op, Action.KEPT, result.reason, result.detail, (), compile_id))
            continue
        if not result.leaves:
            detail = "its inputs come from no graph input" if index is None else "it reads no table"
            out.decisions.append(_decision(node, op, Action.KEPT, Reason.CONSTANT_LEAF, detail, (), compile_id))
            continue
        aliased = _aliased(graph, node)
        if aliased is not None:
            out.decisions.append(_decision(node, op, Action.KEPT, Reason.IN_OP_ALIASED, aliased, (), compile_id))
            continue
        chosen.append((node, op, result, index, cone_nodes))
    if chosen:
        _rewrite(gm, chosen, placeholders, leaves, opts, compile_id, out)
        out.written = cone.written_inputs(graph)
    for d in out.decisions:
        record_decision(d)
    return out


def _rewrite(gm: fx.GraphModule, chosen: list, placeholders: list[fx.Node], leaves: dict,
             opts: Any, compile_id: Optional[str], out: Tabulation) -> None:
    graph = gm.graph
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    output = new.graph_copy(graph, env)
    new.output(output)
    last = env[placeholders[-1]]
    position = {p: i for i, p in enumerate(placeholders)}
    for k, (node, op, result, index, cone_nodes) in enumerate(chosen):
        with new.inserting_after(last):
            ph = new.placeholder(f"nosync_tabulated_{k}")
        ph.meta.update({key: v for key, v in env[node].meta.items() if key != "grapharg"})
        last = ph
        env[node].replace_all_uses_with(ph)
        leaf_names = tuple(l.name for l in result.leaves)
        by_source = {leaves[p].source: p for p in placeholders if p in leaves}
        leaf_pos = tuple(position[by_source[l.source]] for l in result.leaves)
        i = None if index is None else _int_value(leaves[index].example)
        detail = (f"tabulated over {cone.dotted_name(leaves[index].source)} (traced at {i}): the op's value "
                  f"at every index, once per request" if index is not None else "computed once per request")
        if result.speculative:
            detail += "; speculated invariant"
        d = _decision(node, op, Action.TABULATED, Reason.IN_OP_TABULATED, detail,
                      leaf_names + ((cone.dotted_name(leaves[index].source),) if index is not None else ()), compile_id)
        out.decisions.append(d)
        out.ops.append(TabulatedOp(
            result.module, leaf_pos, None if index is None else position[index], result.index_pos,
            tuple(l.declared for l in result.leaves), d,
            (result.fingerprint, None if index is None else leaves[index].source, result.index_pos),
            None if index is None else _batch_for(result.module, op, cone._example(node)),
            names.to_ask(l.where for l in result.leaves),
        ))
        out.examples.append(cone._example(node))
    # Drop what only the tabulated ops read (pure by construction: their cones passed analyze_cone).
    cones = {env[n] for (_, _, _, _, c) in chosen for n in c if n.op != "placeholder"}
    for n in reversed(list(new.nodes)):
        if n in cones and not n.users:
            new.erase_node(n)
    new.lint()
    out.step = fx.GraphModule(gm, new, class_name="NosyncTabulatedStep")


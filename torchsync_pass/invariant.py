"""Cache request-invariant tensor work across calls (both codegens).

Hoisting removes the *syncs* of a step, but every tensor computed only from request-invariant
inputs (a mask built from a buffer, an embedding of a fixed table) is still recomputed at every
step. :func:`cache_invariant` splits the graph nosync hands to codegen into

* an *invariant* GraphModule: the maximal pure subgraph whose every input is a request-invariant
  placeholder, returning the values the rest of the graph reads (the *frontier*), and
* a *step* GraphModule: the original graph with each cached frontier value turned into an extra
  placeholder (nodes that nothing reads any more are dropped). With ``codegen="inductor"`` the
  backend compiles it with Inductor (``compile_step``); the invariant part always runs as FX.

:class:`InvariantRunner` runs the invariant part once per request and keeps its results in a small
LRU memo keyed like a hoisted value (:class:`torchsync_pass.guards.ConeMemo`: weak identity,
``_version``, data pointer, shape, stride, dtype, device, requires_grad and conjugate/negative bits
of every leaf), one memo per grad mode, :func:`torchsync_pass.guards.bits_state` (thread count,
matmul precisions, ...), default dtype and autocast state, each checked on every call. A write to
a leaf, a new leaf object or another global state misses and recomputes; under grad mode, a leaf that requires grad is recomputed on every call (never cached). The cached tensors are
the same eager ops on the same inputs, so with ``codegen="eager"`` the outputs stay bitwise equal
to eager.

Before::

    def forward(self, l_x_, l_self_buffers_mask_):
        cumsum = l_self_buffers_mask_.cumsum(0)
        mul = cumsum * 2.0
        add = l_x_ + mul
        return (add,)

After (invariant part, run on a memo miss)::

    def forward(self, l_self_buffers_mask_):
        cumsum = l_self_buffers_mask_.cumsum(0)
        mul = cumsum * 2.0
        return (mul,)

After (step part, every call)::

    def forward(self, l_x_, l_self_buffers_mask_, nosync_invariant_0):
        add = l_x_ + nosync_invariant_0
        return (add,)

The rule (see the README, "Invariant tensors across calls"):

* invariant leaves: tensor placeholders that are buffers or parameters of the compiled module, are
  named in ``options["invariant"]``, or are already guarded by nosync for a hoisted or lifted sync
  of this graph (:func:`guarded`: speculated inputs, lifted tables); none may have symbolic sizes
  or be an inference tensor (no ``_version`` to notice a write), and one that requires grad must be
  declared (fused optimizers update parameters without bumping ``_version``);
* an op is invariant when all its inputs are invariant and it is a plain op (no random op, no
  in-place or ``out=`` writer, no internal, module or higher-order op: :func:`cone._impure_reason`);
  no node whose memory (by storage, so views count) the graph writes or returns is invariant;
* a frontier value is cached only when it is a tensor that does not alias a leaf (a bare view of an
  input is not worth caching) and does not require grad (traced with grad mode off, or from leaves
  that do not require grad), and while the request's cached bytes stay within
  ``options["invariant_cache_bytes"]``; a value that does not fit stays in the step and its
  decision says so;
* a graph traced under autocast, or that enters autocast itself, is left alone.

NOTE: a cached tensor is never handed to the caller (values the graph returns are excluded) and is
never written by the step (written storages are excluded), so it needs no copy.

NOTE: with Inductor the step part is fused without the invariant ops, so its bits are those of stock
Inductor on the *hand-split* step (the invariant tensors computed in eager and passed in), not
necessarily those of stock Inductor on the whole graph.

Public, stable: :func:`cache_invariant`, :class:`InvariantSplit`, :class:`InvariantRunner`,
:func:`guarded`, ``DEFAULT_CACHE_BYTES``.

This module only builds new graphs; it never mutates the graph it is given.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
from torch import fx

from . import _torch_private, cone, dynamo_hooks, guards, names, rewrite, symbolic
from .guards import (FP_ENV, MEMO_SIZE, ConeMemo, counters, fast_key, forgettable, precision_reader, record_decision,
                     same_call_expr, value_state)
from .report import Action, Decision, Reason

log = logging.getLogger(__name__)

DEFAULT_CACHE_BYTES = 64 * 1024 * 1024


@dataclass
class InvariantSplit:
    """What :func:`cache_invariant` did: ``modified`` is False when nothing is cached."""

    modified: bool
    fn: Callable[..., Any]
    cached: list[Decision] = field(default_factory=list)
    skipped: list[Decision] = field(default_factory=list)
    runner: Optional["InvariantRunner"] = None
    step_graph: Optional[fx.GraphModule] = None  # the step part before codegen (for tests, explain)


def _nbytes(t: torch.Tensor) -> int:
    # NOTE: the storage of a fake tensor Dynamo traced can report a wrong size (a [16, 4096] float32
    # torch.stack of graph inputs read 67,092,484 bytes on torch 2.13): a contiguous tensor at
    # offset 0 is counted by its elements
    if t.is_contiguous() and t.storage_offset() == 0:
        return t.numel() * t.element_size()
    return t.untyped_storage().nbytes()


def _kept_bytes(t: torch.Tensor) -> int:
    """The bytes a cached ``t`` keeps alive: a view (a slice of a temporary, also one made inside a
    function kept whole) its base's whole storage, not only its own elements."""
    return max(_nbytes(t), t.untyped_storage().nbytes() if t._is_view() else 0)


def _invariant_leaf(n: fx.Node, declared: tuple[str, ...], wheres: dict) -> Optional[str]:
    """The user name of a request-invariant tensor placeholder, or None; ``wheres[n]``, its
    :func:`names.declaration` when it is declared."""
    leaf = dynamo_hooks.leaf_of(n)
    if leaf is None or not isinstance(leaf.example, torch.Tensor):
        return None
    name = cone.dotted_name(leaf.source)
    where = wheres[n] = names.declaration(name, declared, leaf.source, leaf.example)
    decl = where is not None
    # (also: the tensors of a list table that a rewritten read stacks, rewrite.py)
    if leaf.role not in ("parameter", "buffer") and not decl and not guarded(n) and not rewrite.is_table_leaf(n):
        return None
    if leaf.example.is_inference() or (leaf.example.requires_grad and not decl):
        return None
    if leaf.role == "buffer" and name.rsplit(".", 1)[-1] in cone.HIDDEN_WRITTEN_BUFFERS and not decl:
        return None  # batch norm in training mode updates it without bumping _version (as for hoisting)
    if symbolic.free_symbols_of(leaf.example, cone._example(n)):
        return None
    return name


def guarded(n: fx.Node) -> bool:
    """Is placeholder ``n`` a leaf that nosync already guards for a hoisted sync of this graph?

    The leaves of hoisted cones (:func:`torchsync_pass.guards.decide`: buffers, declared and
    *speculated* inputs) and the tables of lifted cones (:mod:`torchsync_pass.tables`, whatever
    index the graph reads them at) carry ``cone.HOISTED_LEAF_META``. Their invariance was already
    judged (and a site whose leaves change on every call is demoted, so a later graph has no tag).
    """
    return bool(n.meta.get(cone.HOISTED_LEAF_META))


def _invariant_nodes(graph: fx.Graph, declared: tuple[str, ...]
                     ) -> tuple[set[fx.Node], dict[fx.Node, str], set[int], dict[fx.Node, Optional[tuple]]]:
    """(invariant nodes, leaf names, leaf storages, each leaf's names.declaration)."""
    written = cone.written_storages(graph)
    output = next(iter(graph.find_nodes(op="output")))
    for o in cone._nodes_in(output.args):
        key = cone.storage_of(o)
        if key is not None:
            written.add(key)  # returned to the caller, who may write it
    inv: set[fx.Node] = set()
    leaf_names: dict[fx.Node, str] = {}
    wheres: dict[fx.Node, Optional[tuple]] = {}
    leaf_storages: set[int] = set()
    for n in graph.nodes:
        key = cone.storage_of(n)
        if key is not None and key in written:
            continue
        if n.op == "placeholder":
            name = _invariant_leaf(n, declared, wheres)
            if name is not None:
                inv.add(n)
                leaf_names[n] = name
                if key is not None:
                    leaf_storages.add(key)
            continue
        if n.op not in ("call_function", "call_method") or cone._impure_reason(n) is not None:
            continue
        if symbolic.free_symbols_of(cone._example(n)):
            continue
        ex = cone._example(n)
        if ex is None or not n.users:
            continue  # a call for its effect (a setter), not its value: it stays in the step
        if isinstance(ex, torch.Tensor) and getattr(ex, "_version", 0) > 0:
            continue  # belt and braces: written by an op the table does not know
        if all(i in inv for i in n.all_input_nodes):
            inv.add(n)
    return inv, leaf_names, leaf_storages, wheres


def _decision(n: fx.Node, action: Action, reason: Reason, nbytes: int, leaves: tuple[str, ...],
              compile_id: Optional[str]) -> Decision:
    site, fn, src = cone.user_site(n)
    ex = cone._example(n)
    shape = f"{str(ex.dtype).replace('torch.', '')}{list(ex.shape)}"
    return Decision(
        site=site, kind="tensor", action=action, reason=reason, code=fn, source=src,
        detail=f"{shape}, {nbytes} bytes", leaves=leaves, compile_id=compile_id or "", nbytes=nbytes,
    )


def _ancestors_leaves(n: fx.Node, names: dict[fx.Node, str]) -> tuple[str, ...]:
    return tuple(sorted(names[m] for m in cone.cone_of(n) if m in names))


CompileStep = Callable[[fx.GraphModule, list], Callable[..., Any]]


def cache_invariant(gm: fx.GraphModule, opts: Any, example_inputs: Optional[Sequence[Any]] = None,
                    compile_step: Optional[CompileStep] = None) -> InvariantSplit:
    """Split ``gm`` into an invariant part (once per request) and a step part; see the module doc.

    ``opts`` needs ``invariant`` (declared names) and ``invariant_cache_bytes``. Without
    ``compile_step`` the step part runs as its FX graph (``codegen="eager"``). With it, the step
    part is compiled as ``compile_step(step_gm, example_inputs + cached)``, where ``cached`` are the
    invariant part's real results on ``example_inputs`` (the tensors the step will be fed, same
    sizes and strides); the invariant part itself always runs as its FX graph (eager ops).
    Returns ``InvariantSplit(modified=False, fn=gm.forward)`` when nothing is cached (then nothing
    was compiled: the caller compiles ``gm`` whole).
    """
    graph = gm.graph
    limit = opts.invariant_cache_bytes
    if limit is None:
        # Default: on for the eager codegen; opt-in under Inductor, where it was measured slower on a
        # CPU-bound step (Inductor fuses the invariant work for free; the runner costs per step).
        limit = DEFAULT_CACHE_BYTES if compile_step is None else 0
    if limit == 0 or cone._autocast_devices() or cone.global_state_change(graph) is not None:
        return InvariantSplit(False, gm.forward)
    if compile_step is not None and _symbolic(graph):
        # NOTE: Inductor would take the cached tensors (real, not in Dynamo's tracing context) as
        # new dynamic inputs and duck-size them: one of the size of an input at the trace got
        # that input's symbol, and a call with another input size failed its assert
        log.debug("nosync: a graph with symbolic sizes is not split under Inductor")
        return InvariantSplit(False, gm.forward)
    if compile_step is not None and any(cone.is_random(n) for n in graph.nodes if n.op in ("call_function", "call_method")):
        # NOTE: a call whose invariant part raises runs the unsplit graph as eager ops (see
        # InvariantRunner._compute): eager's draws, not the ones stock Inductor's code makes
        log.debug("nosync: a graph with a random op is not split under Inductor")
        return InvariantSplit(False, gm.forward)
    inv, leaf_names, leaf_storages, wheres = _invariant_nodes(graph, opts.invariant)
    compile_id = dynamo_hooks.current_compile_id()
    cached: list[fx.Node] = []
    decisions: list[Decision] = []
    skipped: list[Decision] = []
    total = 0
    kept: set[Any] = set()  # the storages the cached tensors keep alive (counted once each)
    for n in graph.nodes:
        if n not in inv or n.op == "placeholder" or all(u in inv for u in n.users):
            continue
        ex = cone._example(n)
        storage = cone.storage_of(n)
        if not isinstance(ex, torch.Tensor) or storage in leaf_storages:
            continue  # not a tensor, or a view of an input: nothing to save
        if ex.requires_grad:
            continue  # it carries this call's autograd graph: a backward would free it
        # a view (a slice of a temporary) keeps its base's whole storage: count that, once
        nbytes = 0 if storage in kept else _kept_bytes(ex)
        leaves = _ancestors_leaves(n, leaf_names)
        if total + nbytes > limit:
            skipped.append(_decision(n, Action.NOT_CACHED, Reason.CACHE_BYTES, nbytes, leaves, compile_id))
            continue
        total += nbytes
        kept.add(storage)
        cached.append(n)
        decisions.append(_decision(n, Action.CACHED, Reason.INVARIANT_TENSOR, nbytes, leaves, compile_id))
    if not cached:
        for d in skipped:
            record_decision(d)
        return InvariantSplit(False, gm.forward, decisions, skipped)
    inv_gm, leaf_index = _invariant_module(gm, cached)
    step_gm = _step_module(gm, cached, inv)
    size = max(1, min(MEMO_SIZE, limit // max(total, 1)))
    placeholders = list(graph.find_nodes(op="placeholder"))
    runner = InvariantRunner(inv_gm, step_gm, leaf_index, size, cone.written_inputs(graph), gm,
                             names.to_ask(wheres.get(placeholders[i]) for i in leaf_index))
    if compile_step is not None:
        try:
            examples = _step_examples(runner, cached, example_inputs)
        except Exception as e:  # the user's error on the compiling call's inputs (a singular matrix)
            # NOTE: not Inductor's failure: the graph is compiled whole, and the call raises it from
            # the same op, as stock does; a later call with fixed inputs runs stock's graph
            failed = f"; the invariant part raised on the compiling call ({type(e).__name__}: {e}): compiled whole"
            for d in [dataclasses.replace(d, action=Action.NOT_CACHED, reason=Reason.EVAL_FAILED,
                                          detail=d.detail + failed[:300]) for d in decisions] + skipped:
                record_decision(d)
            return InvariantSplit(False, gm.forward, [], skipped)
        runner.set_step(compile_step(step_gm, examples))
    for d in decisions + skipped:
        record_decision(d)
    return InvariantSplit(True, runner.call, decisions, skipped, runner, step_gm)


def _symbolic(graph: fx.Graph) -> bool:
    """Does an input of ``graph`` have a symbolic size or stride, or is one a symbolic int?"""
    for p in graph.find_nodes(op="placeholder"):
        ex = cone._example(p)
        if isinstance(ex, torch.SymInt) or (isinstance(ex, torch.Tensor) and any(
                isinstance(d, torch.SymInt) for d in (*ex.shape, *ex.stride()))):
            return True
    return False


def _step_examples(runner: "InvariantRunner", cached: list[fx.Node], example_inputs: Optional[Sequence[Any]]) -> list:
    """The step part's example inputs: the graph's own, then the invariant part's results on them.

    NOTE: real results, not the fake values of the trace: Inductor specialises on the strides of
    its example inputs (and asserts them at every call), and these are the very eager ops that
    will produce the cached tensors at run time. Computed by the runner (``miss``), so they are
    memoised: the compiling call's own step finds them instead of computing them again (the
    invariant part's syncs once, as stock). Fake leaves (no real value to run on) fall back to the
    trace's fake values. Raises what the invariant part raises on these inputs.
    """
    if example_inputs is None:
        raise ValueError("cache_invariant: compile_step needs the graph's example_inputs")
    args = tuple(example_inputs)
    if any(_torch_private.is_fake(args[i]) for i in runner.leaf_index):
        values: Any = [cone._example(n) for n in cached]
    else:
        runner.raise_errors = True  # the user's error itself: the caller compiles whole
        try:
            values = runner.miss(args)
        finally:
            runner.raise_errors = False
    return list(args) + [v.detach() if isinstance(v, torch.Tensor) else v for v in values]


def _invariant_module(gm: fx.GraphModule, cached: list[fx.Node]) -> tuple[fx.GraphModule, tuple[int, ...]]:
    graph = gm.graph
    needed: set[fx.Node] = set()
    stack = list(cached)
    while stack:
        m = stack.pop()
        if m not in needed:
            needed.add(m)
            stack.extend(m.all_input_nodes)
    placeholders = list(graph.find_nodes(op="placeholder"))
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    index = []
    for i, p in enumerate(placeholders):
        if p in needed:
            env[p] = new.placeholder(p.name)
            index.append(i)
    for n in graph.nodes:
        if n in needed and n not in env:
            env[n] = new.node_copy(n, lambda x: env[x])
    new.output(tuple(env[n] for n in cached))
    new.lint()
    return fx.GraphModule(gm, new, class_name="NosyncInvariant"), tuple(index)


def _step_module(gm: fx.GraphModule, cached: list[fx.Node], inv: set[fx.Node]) -> fx.GraphModule:
    graph = gm.graph
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for p in graph.find_nodes(op="placeholder"):
        env[p] = new.node_copy(p, lambda x: env[x])
    for i, n in enumerate(cached):
        env[n] = new.placeholder(f"nosync_invariant_{i}")
        env[n].meta.update(n.meta)  # its fake value and stack trace
    for n in graph.nodes:
        if n in env:
            continue
        if n.op == "output":
            new.output(fx.node.map_arg(n.args[0], lambda x: env[x]))
        else:
            env[n] = new.node_copy(n, lambda x: env[x])
    # Drop the invariant nodes nothing reads any more (pure by construction).
    copies = {env[n] for n in inv if n.op != "placeholder" and n not in cached}
    for n in reversed(list(new.nodes)):
        if n in copies and not n.users:
            new.erase_node(n)
    new.lint()
    return fx.GraphModule(gm, new, class_name="NosyncStep")


class InvariantRunner:
    """Calls the step with the invariant values of this request: memoized, recomputed on a miss.

    ``call`` (what the backend hands to Dynamo) is the hot path, generated per runner as
    straight-line code (:func:`_fast_call_fn`); calling the runner object does the same.
    """

    def __init__(self, invariant: fx.GraphModule, step: Callable[..., Any], leaf_index: tuple[int, ...],
                 size: int, written: tuple[int, ...] = (), whole: Optional[fx.GraphModule] = None,
                 wheres: tuple = ()) -> None:
        self.invariant = invariant
        # the declared leaves' paths (names.declaration): a call whose leaves are not the last
        # call's computes without caching unless they still name its leaves (see miss)
        self.wheres = wheres
        self.step = step
        self.leaf_index = leaf_index
        self.size = size
        # The inputs the graph writes in place, and the unsplit graph (its FX forward: eager ops)
        # for a call where one of them shares memory with a leaf (a view of a buffer passed as an
        # argument the step writes before the leaf is read: values computed before the step ran
        # would be stale). Never at trace time (such a leaf is not invariant), only at run time.
        self.raise_errors = False  # set while the compile computes the step's example inputs
        self.written = written if whole is not None else ()
        # also for a call whose invariant part raises (see _compute)
        self._whole_fn = _torch_private.graph_forward(whole) if whole is not None else None
        self.declared = (False,) * len(leaf_index)  # inference leaves never reach the memo (see miss)
        # One memo per global state that changes the invariant part's bits: grad mode,
        # guards.bits_state() (the thread count, matmul precisions, ...), the default dtype (a
        # factory op without a dtype, ``torch.linspace``) and autocast (the invariant part runs
        # under the caller's), checked here even when a guard_filter_fn drops Dynamo's
        # global-state guard.
        self.memos: dict[tuple, ConeMemo] = {}
        # taken by forget() and by miss's store of ``last``: a forget_all from another thread
        # either is seen by the store or drops what it stored
        self._lock = threading.Lock()
        forgettable(self)
        # The last call's answer: (grad mode, weak refs and guards.fast_key of its leaves, values,
        # the check of a snapshot of the global state Dynamo guards (grad mode, autocast, thread
        # count, default dtype, ...: _torch_private.global_state_now), the per-backend precisions,
        # inference mode),
        # what a memo lookup compares, checked by ``call`` without the memo.
        self.last: Optional[tuple] = None
        # (snapshot check, per-backend precisions, memo state key) of the last miss, and its
        # fast_key: kept when ``last`` is forgotten (see ``miss``).
        self.last_state: Optional[tuple] = None
        self.last_key: Optional[tuple] = None
        # Read the per-backend fp32 precisions on every call only where they can change the bits.
        self.read_precisions = precision_reader(invariant.graph)
        self.precision_sensitive = self.read_precisions is not None
        # NOTE: a GraphModule's generated forward, not the module: nn.Module.__call__ costs
        # microseconds per call; same ops.
        self._invariant_fn = _torch_private.graph_forward(invariant)
        self.step_fn = _torch_private.graph_forward(step) if isinstance(step, fx.GraphModule) else step
        self.call = _fast_call_fn(self, self.step_fn)

    def __call__(self, *args: Any) -> Any:
        return self.call(*args)

    def set_step(self, step: Callable[..., Any]) -> None:
        """Call ``step`` (the step part compiled) from now on."""
        self.step = step
        self.step_fn = _torch_private.graph_forward(step) if isinstance(step, fx.GraphModule) else step
        self.call = _fast_call_fn(self, self.step_fn)

    def _leaf_died(self) -> None:
        """A leaf of a memo entry died: forget the last call if it was that entry's (its values)."""
        last = self.last
        if last is not None and any(r() is None for r in last[1]):
            self.last = None

    def aliased(self, args: tuple) -> bool:
        """Does an input the graph writes share memory (its storage) with a leaf on this call?"""
        return dynamo_hooks.may_share_storage([args[w] for w in self.written], [args[i] for i in self.leaf_index])

    def _compute(self, leaves: tuple) -> Optional[tuple]:
        # NOTE: the invariant part runs before the step's ops; an op of it that raises (an index out
        # of range after a leaf changed) would raise before what the step does first: an in-place
        # write, a random draw (the generator then one call behind eager's for the rest of the
        # process), an op that raises the request's own error. None: the caller runs the unsplit
        # graph, which raises where eager does (review 21).
        try:
            return tuple(self._invariant_fn(*leaves))
        except Exception:
            if self._whole_fn is None or self.raise_errors:
                raise
            return None

    def forget(self) -> None:
        """Drop the cached values (Note [Writes behind the version counter across graphs])."""
        self._replace_memos({})

    def _replace_memos(self, memos: dict) -> None:
        """``memos`` for the runner's, and no last call. NOTE: the memos dropped are emptied too,
        under the lock: a miss in another thread may hold one it took before and look its leaves
        up there afterwards, where no later forget_all would reach it."""
        with self._lock:
            for memo in list(self.memos.values()):
                memo.clear()
            self.memos, self.last = memos, None

    def run_whole(self, args: tuple) -> Any:
        counters()["invariant_aliased_calls"] += 1
        # the write may not move the leaf's version (through .data, a wrapper subclass): forget
        # the values computed from it, also after the write (another thread's miss may cache the
        # leaf as it was before it: everything forgets, as after a graph that writes so)
        self.forget()
        try:
            return self._whole_fn(*args)
        finally:
            guards.forget_all()

    def miss(self, args: tuple) -> Any:
        """The values for a call that is not the last one's: memo lookup, or the invariant part.

        None when the invariant part raised: the caller runs the unsplit graph, which raises the
        error eager raises, after what eager does before it (writes, random draws).
        """
        leaves = tuple([args[i] for i in self.leaf_index])
        grad = torch.is_grad_enabled()
        if any(t.is_inference() for t in leaves) or (grad and any(t.requires_grad for t in leaves)) \
                or (self.wheres and not names.still_declared(self.wheres, leaves)):
            # NOTE: declared inference tensors have no _version; the identity-only memo would be the
            # user's promise, which the step's own writes could break: recompute instead. A leaf
            # that requires grad under grad mode (``requires_grad_(True)`` after the compile, with
            # Dynamo's guards dropped): the values carry this call's autograd graph, which a
            # backward frees, so they are never reused. A declared leaf whose path does not name
            # it in this call (another call of the same code): it is not declared here.
            counters()["invariant_computes"] += 1
            return self._compute(leaves)
        # The state key costs tens of microseconds at a new request: reuse the last one while the
        # global state is still the one it was taken in (the snapshot's one C++ check covers every
        # part of it but the per-backend precisions, compared where they change the bits; kept
        # when the last call is forgotten with its leaves, as between two requests).
        known = self.last_state
        read = self.read_precisions
        # NOTE: inference mode is not in Dynamo's global-state snapshot (``inference_mode()`` with
        # ``enable_grad()`` inside passes its check), but values computed under it are inference
        # tensors, which autograd refuses to save on a later ordinary call: part of the key.
        inference = torch.is_inference_mode_enabled()
        if known is not None and known[0]() and known[2][4] is inference and (read is None or known[1] == read()):
            check, precisions, state = known
        else:
            check = _torch_private.global_state_now().check
            precisions = read() if read is not None else None
            state = value_state()
            self.last_state = (check, precisions, state)
        memo = self.memos.get(state)
        if memo is None:
            # One state's memo at a time: the byte limit bounds the runner's cached tensors as a
            # whole (a switch of grad mode, thread count, ... recomputes on the way back).
            memo = ConeMemo(self.declared, self.size, self._leaf_died)
            self._replace_memos({state: memo})
        # The fast path's key and the memo's fingerprints are taken before the values: a leaf
        # written while they are computed (by another thread) then misses on the next call.
        last = self.last  # read once: another thread may set it to None (forget, a leaf's death)
        previous = last[2] if last is not None else self.last_key
        key = self.last_key = fast_key(leaves, self.declared, previous)
        fps = memo.fingerprints(leaves)
        e = memo.lookup(leaves)
        if e is not None:
            counters()["invariant_hits"] += 1
        else:
            counters()["invariant_computes"] += 1
            values = self._compute(leaves)
            if values is None:
                return None
            e = memo.store(leaves, None, values, fps)
        # NOTE: the latest entry is the front of its memo, so this keeps nothing the memo dropped;
        # nor values computed across a forget_all (another thread's write behind the version)
        with self._lock:
            if not guards.forgotten_since(fps):
                self.last = (grad, e.refs, key, e.value, check, precisions, inference)
        return e.value


def _fast_call_fn(runner: InvariantRunner, step: Callable[..., Any],
                  token: Optional[tuple[Any, Callable[[], None]]] = None) -> Callable[..., Any]:
    """``call(*args)``: the step with the last call's values when this call's leaves are the very
    objects of the last call, unchanged (version, data pointer, and metadata:
    :func:`torchsync_pass.guards.same_call_expr`) under the same global state (grad mode, autocast,
    thread count, default dtype, ...: one C++ check, and the per-backend precisions where the
    invariant part has an op they change); otherwise
    ``runner.miss``. What a memo lookup would answer, without the lookup.

    Generated straight-line code for the runner's leaf positions (this runs on every step): no
    tuple of leaves, no loop, no helper call on a hit. An identity is compared before the
    fingerprint is read, so an inference tensor (no ``_version``) never reaches the fingerprint:
    it is never the object of a stored call (see ``miss``).

    ``token``: ``(ran, unguarded)`` of the frame's nosync guard (:func:`with_guard_token`): the
    call first takes the token the guard left, and calls ``unguarded()`` (which raises) when there
    is none; the same as :func:`torchsync_pass.dynamo_hooks.require_guard`'s wrapper, without
    a second Python frame per step.
    """
    index = runner.leaf_index
    lines = ["def call(*args):"]
    if token is not None:
        lines.append('    if not getattr(ran, "ok", False):')
        lines.append("        unguarded()")
        lines.append("    ran.ok = False")
    if runner.written:  # only a graph that writes an input pays for this check
        lines.append("    if runner.aliased(args):")
        lines.append("        return runner.run_whole(args)")
    precisions = " and last[5] == fp32_precisions()" if runner.precision_sensitive else ""
    lines += ["    last = runner.last",
              f"    if last is not None and last[4]() and last[6] is inference_mode(){precisions}:"]
    if index:
        names = [f"t{i}" for i in range(len(index))]
        lines.append(f"        {', '.join(names)} = " + ", ".join(f"args[{i}]" for i in index))
        lines.append("        if " + same_call_expr(names, runner.declared, "last[1]", "last[2]") + ":")
        indent = "            "
    else:
        indent = "        "  # values computed from no input at all (``torch.arange``): the same every call
    lines.append(indent + 'counters()["invariant_hits"] += 1')
    lines.append(indent + "return step(*args, *last[3])")
    lines.append("    values = runner.miss(args)")
    lines.append("    if values is None:")
    lines.append("        return whole(*args)  # the invariant part raised: see InvariantRunner.miss")
    lines.append("    return step(*args, *values)")
    env = {"runner": runner, "step": step, "whole": runner._whole_fn, "counters": counters,
           "inference_mode": torch.is_inference_mode_enabled,
           "fp32_precisions": runner.read_precisions}
    if token is not None:
        env["ran"], env["unguarded"] = token
    env.update(FP_ENV)
    dynamo_hooks.run_generated("\n".join(lines), env)  # generated from integers only
    call = env["call"]
    call._nosync_runner = runner
    return call


def with_guard_token(compiled: Callable[..., Any], ran: Any, unguarded: Callable[[], None]) -> Optional[Callable[..., Any]]:
    """``compiled`` with the guard token's check built in, when it is a runner's own call (not a
    wrapper around one: ``functools.wraps`` copies the marker); else None."""
    runner = getattr(compiled, "_nosync_runner", None)
    if runner is None or runner.call is not compiled:
        return None
    return _fast_call_fn(runner, runner.step_fn, (ran, unguarded))

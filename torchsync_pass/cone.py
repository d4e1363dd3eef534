"""The cone of a sync: which graph inputs a synced value depends on, and whether it may be hoisted.

A sync ``v = f(a, b).item()`` can become a guarded constant only when ``v`` is a pure function of
tensors that stay fixed for the request. Given the Dynamo FX graph traced so far and the node of the
synced tensor, :func:`analyze_cone` walks the dataflow back to the placeholders (:func:`cone_of`)
and checks, in this order:

1. the sync sits in the root tracer (not inside a ``torch.cond``/HOP subgraph);
2. every node of the cone is a plain op: no ``get_attr`` constant, no ``call_module``, no
   higher-order op, no random op, no in-place or otherwise side-effecting op;
3. no leaf has symbolic sizes (``dynamic=True``), see :mod:`torchsync_pass.symbolic`;
4. no node anywhere in the graph so far writes in place to a leaf, an intermediate of the cone, or
   any view of them (aliasing is decided by the fake tensors' storages, so ``x[0] = 1``,
   ``x.view(-1).fill_(0)``, ``x.data.add_`` and ``y = s * 2; y.add_(1); y.item()`` are caught);
5. every leaf is request-invariant: a parameter or buffer, an input named in
   ``options["invariant"]``, or (speculatively) another tensor input; an undeclared inference
   tensor is rejected, since it has no ``_version`` to notice in-place writes.

It never mutates the traced graph. When the cone passes, it is copied into a small standalone
``GraphModule`` whose inputs are the leaves, so the guard can re-run exactly these ops on new leaf
tensors.

Before (Dynamo graph at the sync)::

    %l_tt : placeholder[L['token_types']]
    %eq   : call_function[operator.eq](%l_tt, 0)
    %any  : call_method[any](%eq)          <- `if (token_types == 0).any():`

Cone module::

    def forward(self, l_tt):
        eq = l_tt == 0
        return eq.any()
"""

from __future__ import annotations

import functools
import inspect
import logging
import operator
import re
import struct
import sys
import types
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
from torch import fx

from . import _torch_private, dynamo_hooks, names, symbolic
from .report import Reason, SiteKey

log = logging.getLogger(__name__)

_RANDOM_RE = re.compile(
    r"(^|_)(rand|randn|randint|randperm|bernoulli|multinomial|normal|poisson|uniform|"
    r"exponential|cauchy|geometric|log_normal|dropout|alpha_dropout|feature_alpha_dropout|"
    r"rrelu|random|seed|manual_seed|get_rng_state|set_rng_state)(_|$|_like$)"
)
# Random ops the pattern above cannot spell, found anywhere in the name: every dropout variant
# (dropout1d/2d/3d, feature_dropout, native_dropout, ...), fractional max pooling (random regions),
# Gumbel noise; and attention, random unless its dropout_p is a literal 0 (see is_random).
_RANDOM_ANYWHERE = re.compile(r"dropout|fractional_max_pool|gumbel")
_ATTENTION_RE = re.compile(r"scaled_dot_product_attention$")
_INPLACE_OPERATORS = {operator.setitem} | {  # x[i] = v, and x += y, x -= y, ...
    getattr(operator, "i" + op) for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow",
                                           "and", "or", "xor", "lshift", "rshift", "matmul")
}
# ``t.__iadd__(v)`` spelled out: Dynamo traces it as a call of the method itself, not as
# ``operator.iadd``, and its name ends with "__", not "_".
_INPLACE_DUNDERS = {"__i" + op + "__" for op in ("add", "sub", "mul", "div", "truediv", "floordiv", "mod",
                                                   "pow", "and", "or", "xor", "lshift", "rshift", "matmul")}
_SAFE_PRIVATE = {"_unsafe_view"}
# A resume function's stack inputs: values an earlier graph of the frame handed across a break.
_RESUME_STACK = re.compile(r"L\['___stack\d+'\]")


@dataclass(frozen=True)
class LeafInfo:
    source: str  # guard expression, e.g. "L['token_types']"
    name: str  # dotted user name, e.g. "token_types", "self.attn.mask"
    role: str
    declared: bool
    # (scope, path, names) it is declared by (names.declaration), what the guard resolves again
    where: Optional[tuple] = None


@dataclass
class ConeResult:
    ok: bool
    reason: Reason
    detail: str = ""
    leaves: list[LeafInfo] = field(default_factory=list)
    leaf_examples: list[Any] = field(default_factory=list)
    module: Optional[fx.GraphModule] = None
    speculative: bool = False  # some leaf is an undeclared input (auto mode)

    signature: tuple = ()  # the cone's ops, independent of node names
    nodes: frozenset = frozenset()  # the cone's nodes in the traced graph

    default_dtype: Any = None  # torch.get_default_dtype() when traced: int/int division etc.
    index_pos: Optional[int] = None  # table lifting: position of the int index among the module's inputs

    @property
    def fingerprint(self) -> tuple:
        """What identifies the computation: leaf sources, the cone's ops, the default dtype, and
        which leaves are declared by which path (a site compiled for the call itself and for
        another call of its function, where nothing is declared, keeps two cones)."""
        return (tuple(l.source for l in self.leaves), self.signature, self.default_dtype,
                tuple(l.where for l in self.leaves))


# Dynamo's names for an item of a dict subclass (a transformers ModelOutput, read ``out[0]`` or
# ``out["last_hidden_state"]``): ``dict.__getitem__(B, list(dict.keys(B))[0])`` and
# ``dict.__getitem__(B, 'key')``; of a dict by a key it could not write as a constant,
# ``B[list(dict.keys(B))[0]]``. Made ``B[0]`` / ``B['key']`` (review 21: a ModelOutput field could
# not be declared).
_DICT_ITEM_RES = (
    (re.compile(r"dict\.__getitem__\((?P<b>.+), list\(dict\.keys\((?P=b)\)\)\[(?P<i>\d+)\]\)"), r"\g<b>[\g<i>]"),
    (re.compile(r"dict\.__getitem__\((?P<b>.+), (?P<k>'[^'\\]*')\)"), r"\g<b>[\g<k>]"),
    (re.compile(r"(?P<b>.+)\[list\(dict\.keys\((?P=b)\)\)\[(?P<i>\d+)\]\]"), r"\g<b>[\g<i>]"),
)


def dotted_name(source: str) -> str:
    """``L['self']._modules['attn']._buffers['mask']`` -> ``self.attn.mask``; an item of a dict
    (a ModelOutput) by its position among the keys, ``L['out'][0]`` -> ``out.0``."""
    while "dict.__getitem__(" in source or "list(dict.keys(" in source:
        before = source
        for pattern, repl in _DICT_ITEM_RES:
            source = pattern.sub(repl, source, count=1)
        if source == before:
            break
    s = re.sub(r"\._(?:modules|buffers|parameters)\['([^']+)'\]", r".\1", source)
    s = re.sub(r"^[LG]\['([^']+)'\]", r"\1", s)
    s = re.sub(r"\['([^']+)'\]", r".\1", s)
    s = re.sub(r"\[(\d+)\]", r".\1", s)
    return s


def _target_name(node: fx.Node) -> str:
    t = node.target
    return t if isinstance(t, str) else getattr(t, "__name__", None) or str(t)


def aten_overloads(node: fx.Node) -> list:
    """The aten overloads a call node may run: its target's own (an OpOverload, a packet's), and
    for a torch builtin (``torch.binomial``: Dynamo's graphs call these, not aten ops) or a tensor
    method, those of the aten op of the same name. Empty for anything else (a Python function, a
    function of the ``operator`` module)."""
    t = node.target
    if _torch_private.is_op_overload(t):
        return [t]
    packet = t if _torch_private.is_op_packet(t) else None
    if packet is None:
        name = _target_name(node)
        builtin = (node.op == "call_function" and isinstance(t, types.BuiltinFunctionType)
                   and not _is_operator_function(node))
        if (builtin or node.op == "call_method") and name.isidentifier():
            packet = getattr(torch.ops.aten, name, None)
    if not _torch_private.is_op_packet(packet):
        return []
    try:
        return [getattr(packet, o) for o in packet.overloads()]
    except Exception:  # an overload that does not resolve on this build
        return []


def dispatched(node: fx.Node) -> Optional[tuple[list, list[fx.Node]]]:
    """For a call of a Python function Dynamo keeps whole in the graph (``torch.svd_lowrank``,
    ``F.multi_head_attention_forward``: their names say nothing of the ``torch.randn`` or dropout
    inside): ``(aten overloads it dispatches, argument nodes it writes)``, found by running it on
    fake copies of its inputs' example values (cached on the node). None for any other node, and
    for a call that could not be run so (:func:`_impure_reason` then refuses it)."""
    t = node.target
    if node.op != "call_function" or not kept_whole_callable(t):
        return None
    if "nosync_dispatched" in node.meta:
        return node.meta["nosync_dispatched"]
    if _changes_global_state(node):  # never run a setter (torch.manual_seed) at compile time
        node.meta["nosync_dispatched"] = None
        return None
    nodes: list[fx.Node] = []

    def example(n: fx.Node) -> Any:
        nodes.append(n)
        return _torch_private.example_value(n)

    args, kwargs = fx.node.map_arg((node.args, node.kwargs), example)
    out = None
    if all(_torch_private.example_value(n) is not None for n in nodes):
        run = _torch_private.dispatched_ops(t, args, kwargs, _HIDDEN_WRITERS)
        if run is not None:  # the written example values, back to their nodes
            by_example = {id(_torch_private.example_value(n)): n for n in nodes}
            written = [by_example[id(x)] for x in run[1] if id(x) in by_example]
            out = (run[0], written) if len(written) == len(run[1]) else None
    node.meta["nosync_dispatched"] = out
    return out


def user_kept_whole(node: fx.Node) -> bool:
    """A call of a Python function from outside torch that Dynamo keeps whole in the graph
    (``torch.compiler.allow_in_graph``): eager runs its body at every call, so it may read Python
    state (a global, a dict entry, an object's attribute) that no leaf's identity or version tells
    of; the graph holds what it read at trace time. torch's own (``torch.svd_lowrank``) are not."""
    t = node.target
    if node.op != "call_function" or not kept_whole_callable(t):
        return False
    owner = t if isinstance(t, (types.FunctionType, types.MethodType)) else type(t)
    module = getattr(owner, "__module__", None) or ""
    return module.partition(".")[0] != "torch"


def kept_whole_callable(t: Any) -> bool:
    """Is ``t`` Python code a graph calls whole: a function, a bound method (a classmethod too), or
    an object with ``__call__`` (review 18: a method or callable object passed to allow_in_graph
    was neither refused nor run on fake inputs to see its writes). Not an op, a higher-order op,
    a builtin (torch's C functions, ``operator``'s) or a class."""
    if isinstance(t, (types.FunctionType, types.MethodType)):
        return True
    if isinstance(t, (types.BuiltinFunctionType, types.BuiltinMethodType, type, functools.partial)):
        return False
    if _torch_private.is_op_overload(t) or _torch_private.is_op_packet(t) or _torch_private.is_higher_order_op(t):
        return False
    return callable(t) and isinstance(getattr(type(t), "__call__", None), types.FunctionType)


def _unseen(node: fx.Node) -> bool:
    """A Python function kept whole whose ops :func:`dispatched` could not see."""
    return node.op == "call_function" and kept_whole_callable(node.target) and dispatched(node) is None


def _seeded(op: Any) -> bool:
    """An aten overload that draws from a random generator (tagged so, or taking one)."""
    if torch.Tag.nondeterministic_seeded in op.tags:
        return True
    return any("Generator" in str(a.type) for a in op._schema.arguments)


_RNN_OPS = frozenset({"lstm", "gru", "rnn_tanh", "rnn_relu"})


def _rnn_dropout(node: fx.Node) -> bool:
    """``torch.lstm(input, hx, params, has_biases, num_layers, dropout, train, ...)`` (or the packed
    form, ``(data, batch_sizes, hx, params, ...)``, one position later) draws only with a nonzero
    ``dropout`` in training: False only when both are literals that say it does not."""
    a = node.args
    for i in (5, 6):  # the dense form, then the packed one
        if len(a) > i + 1 and type(a[i]) in (int, float) and type(a[i + 1]) is bool:
            return not (a[i] == 0 or a[i + 1] is False)
    return True


def _dropout_off(node: fx.Node) -> bool:
    """A dropout called with a literal ``training=False`` (``F.dropout(h, p, training=self.training)``
    in an eval model, every transformers layer; ``torch.dropout(x, p, train)``, aten's
    ``native_dropout(x, p, train)``: the flag is third): it returns its input and draws nothing
    (review 21: such a cone was rejected as random). Not a literal ``p == 0`` with training on:
    the fused kernel may still draw its mask."""
    train = node.kwargs.get("training", node.kwargs.get("train", node.args[2] if len(node.args) > 2 else None))
    return train is False


def is_random(node: fx.Node) -> bool:
    name = _target_name(node)
    if _ATTENTION_RE.search(name):  # F.scaled_dot_product_attention(q, k, v, mask, dropout_p, ...)
        # NOTE: before the aten tags: attention is tagged seeded for its dropout, random only
        # when dropout_p is not a literal 0
        p = node.kwargs.get("dropout_p", node.args[4] if len(node.args) > 4 else 0.0)
        return not (type(p) in (int, float) and p == 0)
    if "dropout" in name and _dropout_off(node):
        return False
    if _RANDOM_RE.search(name) or _RANDOM_ANYWHERE.search(name):
        return True
    if name in _RNN_OPS:  # tagged seeded for their dropout between layers
        return _rnn_dropout(node)
    # torch.binomial, ...
    if any(_seeded(op) for op in aten_overloads(node)):
        return True
    seen = dispatched(node)  # a Python function kept whole: what it runs
    return seen is not None and any(_seeded(op) for op in seen[0])


def _nodes_in(value: Any) -> list[fx.Node]:
    out: list[fx.Node] = []
    fx.node.map_arg(value, lambda n: out.append(n) or n)
    return out


def _schema_writes(schema: Any, node: fx.Node) -> list[fx.Node]:
    written: list[fx.Node] = []
    for pos, arg in enumerate(schema.arguments):
        info = getattr(arg, "alias_info", None)
        if info is None or not info.is_write:
            continue
        if pos < len(node.args) and not getattr(arg, "kwarg_only", False):
            value = node.args[pos]
        elif arg.name in node.kwargs:
            value = node.kwargs[arg.name]
        else:
            continue
        if _list_param_given_a_tensor(arg, value):
            continue  # TorchScript's list overloads (``aten::sort.int(int[](a!) self)``): not this call's
        written += _nodes_in(value)
    return written


def _list_param_given_a_tensor(arg: Any, value: Any) -> bool:
    """Is ``value`` one node traced as a single tensor, passed where ``arg`` is a list
    (``Tensor[]``, ``int[]``, ``t[]``: ``List[...]``)? Then the overload cannot be the one that runs."""
    return (str(arg.type).startswith("List[") and isinstance(value, fx.Node)
            and isinstance(_torch_private.example_value(value), torch.Tensor))


def _inplace_flag(node: fx.Node) -> bool:
    """``F.relu(x, inplace=True)``, also with ``inplace`` passed by position."""
    if node.kwargs.get("inplace") is True:
        return True
    t = node.target
    if node.op != "call_function" or not callable(t) or "inplace" in node.kwargs:
        return False
    try:
        bound = inspect.signature(t).bind(*node.args, **node.kwargs)
    except (TypeError, ValueError):
        return False
    return bound.arguments.get("inplace") is True


# Ops that write an argument in place without bumping its version counter (and whose schema, where
# they have one, does not say so): name -> (written argument names, flag that must be True for the
# write, or "" when it always writes). NOTE: nn.BatchNorm*/InstanceNorm* in training mode update
# running_mean/running_var this way; _version stays the same, so a memo keyed on it goes stale.
_HIDDEN_WRITERS: dict[str, tuple[tuple[str, ...], str]] = {
    "batch_norm": (("running_mean", "running_var"), "training"),
    "native_batch_norm": (("running_mean", "running_var"), "training"),
    "_native_batch_norm_legit": (("running_mean", "running_var"), "training"),
    "_batch_norm_with_update": (("running_mean", "running_var"), ""),
    "_batch_norm_impl_index": (("running_mean", "running_var"), "training"),
    "cudnn_batch_norm": (("running_mean", "running_var"), "training"),
    "miopen_batch_norm": (("running_mean", "running_var"), "training"),
    "instance_norm": (("running_mean", "running_var"), "use_input_stats"),
    # quantization-aware training's observer + fake quant (torch.ao's FusedMovingAvgObsFakeQuantize)
    "fused_moving_avg_obs_fake_quant": (("running_min", "running_max", "scale", "zero_point"), ""),
    "_fused_moving_avg_obs_fq_helper": (("running_min", "running_max", "scale", "zero_point"), ""),
    # fused optimizers (``Adam(fused=True)``) and GradScaler's unscale: their schema says they write,
    # but the kernels leave every version counter as it was (measured on torch 2.13, CPU)
    "_fused_adam_": (("self", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs"), ""),
    "_fused_adamw_": (("self", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs"), ""),
    "_fused_sgd_": (("self", "grads", "momentum_buffer_list"), ""),
    "_fused_adagrad_": (("self", "grads", "state_sums", "state_steps"), ""),
    "_amp_foreach_non_finite_check_and_unscale_": (("self", "found_inf"), ""),
    # ``with torch.autograd._unsafe_preserve_version_counter(t): t.add_(1)`` traces as the write
    # and then this op, which sets the version back: the write is hidden from then on
    "_unsafe_set_version_counter": (("tensors",), ""),
}
# Buffers those ops write, by the name nn modules give them: a sync on them is not hoisted unless
# declared, since the module may run in training mode anywhere between two calls (also eagerly).
HIDDEN_WRITTEN_BUFFERS = ("running_mean", "running_var")


# Graph nodes that change the global state the ops after them run under: ``with torch.no_grad()``,
# ``torch.enable_grad()``, ``torch.inference_mode()``, ``torch.autocast(...)`` inside the traced
# code (Dynamo emits them only where the mode changes).
# NOTE: also every other setter of global state a step can call (the default dtype or device,
# deterministic algorithms, thread counts, matmul precision, SDP backends): ops moved out of the
# graph would run before it, under the caller's setting (``torch.zeros(2)`` after a
# ``torch.set_default_dtype(torch.float64)`` in the step), and the setter itself could be moved.
# Any function called ``set_...``/``_set_...`` counts too (``torch._C._set_mkldnn_enabled``, which
# ``torch.backends.mkldnn.flags`` calls, the NNPACK, cuDNN, BLAS and linalg backend setters, ...).
_GLOBAL_STATE_OPS = ("set_grad_enabled", "inference_mode", "autocast", "set_default_", "deterministic",
                     "set_num_threads", "set_num_interop_threads", "set_flush_denormal", "matmul_precision",
                     "_sdp", "set_rng_state", "manual_seed", "seed")
# The ones that change no value a cone computes (a cone runs without grad either way): see
# state_region_of
_GRAD_MODE_OPS = ("set_grad_enabled", "inference_mode")


def _changes_global_state(n: fx.Node) -> bool:
    if n.op not in ("call_function", "call_method"):
        return False
    name = _target_name(n)
    if n.op == "call_function" and name.startswith(("set_", "_set_")) and not name.endswith("_"):
        return True  # (not Tensor.set_ and other in-place ops: writes, not settings)
    return any(k in name for k in _GLOBAL_STATE_OPS)


def global_state_change(graph: fx.Graph) -> Optional[str]:
    """The first node of ``graph`` that changes grad mode, inference mode, autocast or another
    global setting (its ``file:line``), or None.

    NOTE: work moved out of the graph (computed once per request, or tabulated) would run under
    the caller's state, not the region's: a tensor computed under ``no_grad`` inside the step would
    carry autograd history, one under ``autocast`` or after ``torch.set_default_dtype`` would have
    other bits.
    """
    for n in graph.nodes:
        if _changes_global_state(n):
            return f"{_target_name(n)} at {_where(n)}"
    return None


def state_region_of(graph: fx.Graph, nodes: set) -> Optional[str]:
    """The setter (its name and ``file:line``) under whose setting one of ``nodes`` runs, or None:
    a node between ``_enter_autocast`` and its ``_exit_autocast`` (the exit restores the state
    exactly), or after any other setter that changes values (the default dtype, a backend switch,
    ...: whether a later call restores the caller's setting cannot be told, so it counts for the
    rest of the graph). Grad and inference mode change no value a cone computes."""
    depth, opened, sticky = 0, None, None
    for n in graph.nodes:
        if _changes_global_state(n):
            name = _target_name(n)
            if any(k in name for k in _GRAD_MODE_OPS):
                continue
            if name == "_enter_autocast":
                depth, opened = depth + 1, opened or n
            elif name == "_exit_autocast":
                depth = max(depth - 1, 0)
                opened = opened if depth else None
            elif sticky is None:
                sticky = n
            continue
        if n in nodes and n.op not in ("placeholder", "get_attr") and (depth or sticky is not None):
            setter = opened if depth else sticky
            return f"{_target_name(setter)} at {_where(n)}"
    return None


def _bound_arguments(node: fx.Node) -> Optional[dict]:
    """``{argument name: value}`` of a call node, or None when its signature is unknown."""
    t = node.target
    schemas = [op._schema for op in aten_overloads(node)]
    if not schemas and inspect.isfunction(t):
        try:
            return dict(inspect.signature(t).bind(*node.args, **node.kwargs).arguments)
        except (TypeError, ValueError):
            return None
    for schema in schemas:
        names = [a.name for a in schema.arguments]
        if len(node.args) <= len(names) and all(k in names for k in node.kwargs):
            bound = dict(zip(names, node.args))
            bound.update(node.kwargs)
            return bound
    return None


def _subgraphs(node: fx.Node) -> list[fx.Graph]:
    """The graphs of the subgraph modules a higher-order op's node calls (``wrap``, ``cond``,
    activation checkpointing, ...), read through its ``get_attr`` arguments."""
    if node.op != "call_function" or not _torch_private.is_higher_order_op(node.target):
        return []
    root = node.graph.owning_module
    out = []
    for a in _nodes_in((node.args, node.kwargs)):
        if a.op != "get_attr" or not isinstance(a.target, str):
            continue
        # NOTE: during Dynamo's trace the graph has no owning module yet: its subgraphs are kept by
        # the tracer (a write inside one was missed by the trace's analysis, right only from the
        # backend on: the call the graph was traced for was served the value from before it)
        sub = getattr(root, a.target, None) if root is not None else dynamo_hooks.traced_submodule(a.target)
        if isinstance(sub, fx.GraphModule):
            out.append(sub.graph)
    return out


def _subgraph_writes(node: fx.Node, written: Callable[[fx.Node], list[fx.Node]]) -> list[fx.Node]:
    """Every tensor ``node`` passes to its subgraphs when a node in one of them (or in theirs) writes
    something (``written``: :func:`written_nodes` or :func:`hidden_written_nodes`), or, for
    :func:`written_nodes`, when one of them returns an operand or a view of it: the subgraph's
    placeholders are the operands, and which operand each one is differs from op to op, so every
    operand counts as written.

    NOTE: ``torch.cond``'s output is a new tensor in the trace, but a branch returning ``t.view(4)``
    makes it a view of the operand at run time: a write to the output, or the caller's, writes the
    operand, which the analysis would take as unwritten (a cached operand, a buffer read by the
    invariant part). Taken as written by the op itself instead."""
    subs = _subgraphs(node)
    if any(written(m) for g in subs for m in g.nodes if m.op != "output") or (
            written is written_nodes and any(_returns_an_input(g) for g in subs)):
        return [n for n in _nodes_in((node.args, node.kwargs)) if n.op != "get_attr"]
    return []


def _returns_an_input(graph: fx.Graph) -> bool:
    """Does ``graph`` return one of its inputs or a view of one (or a value the trace does not
    describe)?"""
    inputs = {_storage_key(_example(p)) for p in graph.find_nodes(op="placeholder")} - {None}
    out = graph.find_nodes(op="output")
    for n in _nodes_in(out[0].args if out else ()):
        ex = _example(n)
        if n.op == "placeholder" or ex is None or _storage_key(ex) in inputs:
            return True
    return False


def hidden_written_nodes(node: fx.Node) -> list[fx.Node]:
    """The nodes ``node`` writes in place without bumping their version counter."""
    if node.op != "call_function":
        return []
    if _torch_private.is_higher_order_op(node.target):
        return _subgraph_writes(node, _hidden_targets)
    spec = _HIDDEN_WRITERS.get(_target_name(node).split(".")[0])
    if spec is None:
        return []
    names, flag = spec
    bound = _bound_arguments(node)
    if bound is None:  # cannot tell the arguments apart: any of them may be written
        return _nodes_in((node.args, node.kwargs))
    if flag and bound.get(flag) is False:
        return []
    return [n for name in names for n in _nodes_in(bound.get(name))]


def _unversioned_custom_writes(node: fx.Node) -> list[fx.Node]:
    """The arguments a custom op's schema marks written (``Tensor(a!)``) where the op has no
    ADInplaceOrView kernel, the one that bumps a written tensor's version: registered from a
    schema with a backend kernel only (a C++ extension's, ``torch.library.Library.define``), it
    bumps the version only where its kernel writes through in-place ops, not where it writes the
    memory itself (review 18: a paged-KV cache writer). ``torch.library.custom_op`` registers one."""
    out: list[fx.Node] = []
    for op in aten_overloads(node):
        if getattr(op, "namespace", "aten") in ("aten", "prims") or _torch_private.bumps_versions(op):
            continue
        out += _schema_writes(op._schema, node)
    return out


def _is_operator_function(node: fx.Node) -> bool:
    """A call of a function of Python's ``operator`` module (``a & b`` traces to ``operator.and_``).

    NOTE: these are named with a trailing underscore to dodge keywords (``and_``, ``or_``, ``not_``,
    ``is_``) and write nothing; the ones that write are in ``_INPLACE_OPERATORS`` (``iand``, ...).
    """
    t = node.target
    name = getattr(t, "__name__", None)
    return node.op == "call_function" and isinstance(name, str) and getattr(operator, name, None) is t


def written_nodes(node: fx.Node) -> list[fx.Node]:
    """The nodes whose memory ``node`` writes (empty when it writes nothing).

    NOTE: an op that writes is not always spelled with a trailing underscore: ``out=`` (a tensor or
    a tuple of them), ``F.relu(x, inplace=True)``, ``torch._foreach_add_([a, b], 1)`` (a list),
    operators whose schema marks an argument as written (custom ops with ``mutates_args``).
    """
    if node.op not in ("call_function", "call_method"):
        return []
    first = node.args[0] if node.args else None
    written: list[fx.Node] = []
    if "out" in node.kwargs:
        written += _nodes_in(node.kwargs["out"])
    name = _target_name(node)
    t = node.target
    if node.op == "call_function" and t in _INPLACE_OPERATORS:
        written += _nodes_in(first)
    elif name in _INPLACE_DUNDERS or name == "__setitem__":  # a method or ``torch.Tensor.__iadd__(t, v)``
        written += _nodes_in(first)
    elif name.endswith("_") and not name.endswith("__") and not _is_operator_function(node):
        written += _nodes_in(first)  # add_, fill_, _foreach_add_ (a list of tensors)
    if _inplace_flag(node):
        written += _nodes_in(first)
    # every overload's schema (the graph does not say which one runs): custom ops with
    # ``mutates_args``, and torch builtins that write an argument with no trailing underscore
    # (``torch.fused_moving_avg_obs_fake_quant`` writes its running min/max, scale and zero point)
    for op in aten_overloads(node):
        written += _schema_writes(op._schema, node)
    seen = dispatched(node)  # a Python function kept whole: the arguments it wrote on fake copies
    if seen is not None:
        written += seen[1]
    written += _subgraph_writes(node, written_nodes)  # a write inside a higher-order op's subgraph
    return list(dict.fromkeys(written + hidden_written_nodes(node)))  # each node once, in order


FREEZING_WARNING = ("nosync: with Inductor's freezing (torch._inductor.config.freezing=True, under no_grad; "
                    "or torch._dynamo.config.prepare_freezing) Dynamo passes a module's parameters and "
                    "buffers into the graph as constants (not inputs), so no sync on them and no tensor "
                    "computed from them is hoisted or cached (decisions: CONSTANT_LEAF). Turn freezing "
                    "off for nosync.")
WARNED_FROZEN: list = []  # the warning once per process
FREEZING_NOTE = ("; torch._inductor.config.freezing=True makes Dynamo pass the module's parameters and "
                 "buffers as graph constants, which nosync cannot guard: nothing computed from them is "
                 "hoisted or cached (turn freezing off for nosync)")


def _impure_reason(node: fx.Node) -> Optional[tuple[Reason, str]]:
    name = _target_name(node)
    if node.op == "get_attr":
        # a subgraph or an opaque function (nonstrict_trace's) that a call takes: not a tensor
        owner = node.graph.owning_module
        attr = getattr(owner, node.target, None) if isinstance(node.target, str) and owner is not None else None
        caller = next((u for u in node.users if u.op == "call_function"), None)
        is_tensor = isinstance(_torch_private.example_value(node), torch.Tensor)
        if (caller is not None and not is_tensor
                and not isinstance(attr, torch.Tensor) and (attr is None or callable(attr))):
            return Reason.SUBGRAPH, f"{_target_name(caller)} calls {node.target!r} (a subgraph or opaque function)"
        # (a tensor constant, not a higher-order op's subgraph, while the trace's grad mode lets
        # freezing make module tensors constants)
        frozen = is_tensor and _torch_private.freezing_on(torch.is_grad_enabled())
        return Reason.CONSTANT_LEAF, f"reads graph attribute {node.target!r}" + (FREEZING_NOTE if frozen else "")
    if node.op == "call_module":
        return Reason.SUBGRAPH, f"calls module {node.target!r}"
    if node.op not in ("call_function", "call_method"):
        return None
    t = node.target
    if _torch_private.is_higher_order_op(t):
        return Reason.SUBGRAPH, f"higher-order op {name}"
    if user_kept_whole(node):
        return Reason.IMPURE_OP, (f"{name}: a Python function kept whole in the graph (allow_in_graph); "
                                  "it may read Python state that no leaf tells of")
    if is_random(node):
        return Reason.IMPURE_OP, f"random op {name}"
    talks = _communicates(node)
    if talks is not None:
        return Reason.IMPURE_OP, talks
    if _unseen(node):
        return Reason.IMPURE_OP, f"{name}: a Python function whose ops could not be seen (run on fake inputs failed)"
    if written_nodes(node):
        return Reason.IMPURE_OP, f"in-place op {name}"
    if node.op == "call_function" and name.startswith("_") and name not in _SAFE_PRIVATE:
        return Reason.IMPURE_OP, f"side-effecting or internal op {name}"
    return None


# op namespaces whose ops talk to other processes (torch.distributed's collectives, functional or
# in place, DTensor's and symmetric memory's)
_COMM_NAMESPACES = frozenset({"_c10d_functional", "c10d_functional", "_c10d_functional_autograd",
                              "c10d", "_dtensor", "symm_mem", "_symm_mem"})


# torch's own op namespaces (their ops run no collective); any other is a custom op's
_TORCH_NAMESPACES = frozenset({
    "aten", "prims", "prim", "rngprims", "debugprims", "inductor_prims", "quantized", "_quantized",
    "quantized_decomposed", "quantization", "mkldnn", "mkldnn_prepacked", "mkl", "onednn", "sparse",
    "_native", "inductor", "_inductor_test", "higher_order", "profiler", "debug_mode_ops", "export",
    "static_runtime", "_test",
})


def _process_group_up() -> bool:
    dist = sys.modules.get("torch.distributed")
    try:
        return dist is not None and dist.is_available() and dist.is_initialized()
    except Exception:
        return False


def op_namespace(t: Any) -> Optional[str]:
    """The namespace of an op overload or packet (``aten``, ``mylib``), None for anything else."""
    if _torch_private.is_op_overload(t):
        return t.namespace
    if _torch_private.is_op_packet(t):
        return str(t).partition(".")[0]  # (``_c10d_functional.all_reduce``)
    return None


def _communicates(node: fx.Node) -> Optional[str]:
    """Why ``node`` may exchange data with other processes, or None. A collective's result depends
    on the other ranks' tensors, which no leaf of this rank tells of, and each rank must run it
    the same number of times in the same order: one hoisted or cached would be stale when another
    rank's tensor changes, and a guard re-running it on one rank alone pairs it with another
    collective of the other rank (review 23: stale values, wrong sums, hangs, gloo aborts). So
    is a Python function of torch.distributed kept in the graph, and any op on a DTensor (its
    dispatch may redistribute: ``w.full_tensor()``, a reduction of a sharded tensor)."""
    if node.op == "call_function":
        t = node.target
        ns = op_namespace(t)
        if ns in _COMM_NAMESPACES:
            return f"collective {_target_name(node)} ({ns}): its value depends on other processes"
        if ns is not None and ns not in _TORCH_NAMESPACES and _process_group_up():
            # a registration cannot say that its kernel talks to other ranks (vLLM's and SGLang's
            # tensor-parallel all_reduce is such a custom op: review 23, helper 180)
            return (f"custom op {ns}::{_target_name(node)} while a torch.distributed process group is up: "
                    "its kernel may run a collective")
        module = getattr(t, "__module__", None) or ""
        if module == "torch.distributed" or module.startswith("torch.distributed."):
            return f"{_target_name(node)} of {module}: it may talk to other processes"
    dtensor = _dtensor_type()
    if dtensor is not None:
        values = [_torch_private.example_value(node)] + [_torch_private.example_value(a) for a in _nodes_in(
            (node.args, node.kwargs))]
        if any(isinstance(v, dtensor) for v in values):
            return f"{_target_name(node)} on a DTensor: its dispatch may talk to other processes"
    return None


def _dtensor_type() -> Optional[type]:
    """DTensor when torch.distributed is built in and DTensor already imported (a graph cannot hold
    one before), else None."""
    mod = sys.modules.get("torch.distributed.tensor")
    return getattr(mod, "DTensor", None) if mod is not None else None


def _storage_key(value: Any) -> Optional[int]:
    if isinstance(value, torch.Tensor):
        try:
            return _torch_private.storage_id(value)
        except Exception:
            return None
    return None


_example = _torch_private.example_value


def _returns_its_input(n: fx.Node) -> Optional[fx.Node]:
    """The input node that ``n`` may return itself at run time while its trace value is a new
    tensor; else None.

    ``dropout`` (``F.dropout``, ``torch.dropout``, ``nn.Dropout``) with ``p == 0`` or not training
    returns its input object in eager, while Dynamo's fake value for it is a copy (its
    decomposition clones): a write to the result is a write to the input, and returning it returns
    the input. The other dropouts' fake values alias their input as eager does.
    """
    if n.op != "call_function" or n.target not in _DROPOUTS:
        return None
    args, kwargs = n.args, n.kwargs
    src = args[0] if args else kwargs.get("input")  # F.dropout(input=x): Dynamo keeps the keyword
    if not isinstance(src, fx.Node):
        return None
    functional = n.target is torch.nn.functional.dropout
    p = args[1] if len(args) > 1 else kwargs.get("p", 0.5 if functional else None)
    train = args[2] if len(args) > 2 else kwargs.get("training" if functional else "train", True if functional else None)
    numel = _example(n).numel() if isinstance(_example(n), torch.Tensor) else None
    if isinstance(p, (int, float)) and isinstance(train, bool) and train and p != 0 and not (type(numel) is int and numel == 0):
        return None  # a random draw into a new tensor (p == 1: zeros, new too); empty: the input
    return src  # not training, p == 0, or not known at trace time: may be the input itself


# The dropout targets as Dynamo records them (``nn.Dropout`` is inlined to ``F.dropout``;
# ``torch._VF.dropout`` is ``torch.dropout``); the others are built.
_DROPOUTS = (torch.nn.functional.dropout, torch.dropout, torch.ops.aten.dropout, torch.ops.aten.dropout.default)


def _run_time_aliases(graph: fx.Graph) -> dict[int, int]:
    """``{storage of a node's trace value: storage it is at run time}`` for the nodes that return
    their input at run time (:func:`_returns_its_input`).

    NOTE: the dropouts are looked up on every call (FX indexes nodes by target: this costs the
    dropouts of the graph, not its size), since the graph changes between analyses (Dynamo prunes
    inputs, nosync rewrites); the map is rebuilt only when they are other nodes than last time."""
    dropouts = tuple(n for target in _DROPOUTS for n in graph.find_nodes(op="call_function", target=target))
    known = _ALIASES.get(graph)
    if known is not None and known[0] == dropouts:
        return known[1]
    aliases: dict[int, int] = {}
    for n in dropouts:
        src = _returns_its_input(n)
        if src is not None:
            key, real = _storage_key(_example(n)), _storage_key(_example(src))
            if key is not None and real is not None and key != real:
                aliases[key] = real
    _ALIASES[graph] = (dropouts, aliases)
    return aliases


# Per graph: (its dropout nodes, held so their identity stays meaningful; the map built from them).
_ALIASES: "weakref.WeakKeyDictionary[fx.Graph, tuple[tuple, dict[int, int]]]" = weakref.WeakKeyDictionary()


def storage_of(n: Any) -> Optional[int]:
    """The storage node ``n``'s tensor has at run time: its trace value's (views share their base's),
    except that the trace value of an op returning its input at run time, and every view of it, is
    its input's storage (:func:`_returns_its_input`); None for no tensor."""
    if not isinstance(n, fx.Node):
        return None
    key = _storage_key(_example(n))
    if key is None:
        return None
    aliases = _run_time_aliases(n.graph)
    for _ in range(len(aliases)):  # a dropout of a dropout: follow the chain (it cannot cycle)
        if key not in aliases:
            break
        key = aliases[key]
    return key


def cone_of(node: fx.Node) -> set[fx.Node]:
    """``node`` and every node it reads, directly or not: a walk back over ``all_input_nodes``."""
    cone, todo = {node}, [node]
    while todo:
        for inp in todo.pop().all_input_nodes:
            if inp not in cone:
                cone.add(inp)
                todo.append(inp)
    return cone


def analyze_cone(
    node: fx.Node,
    leaves: Sequence[Any],  # dynamo_hooks.Leaf
    *,
    declared: Iterable[str] = (),
    in_root_tracer: bool = True,
    index: Optional[fx.Node] = None,
) -> ConeResult:
    """Decide whether the value of ``node`` may be hoisted; see the module docstring.

    ``index``: the placeholder of a host int the cone reads tables at (table lifting, see
    :mod:`torchsync_pass.tables`). It becomes the module input at ``index_pos`` and is not a leaf;
    symbolic sizes are then allowed, since the guard re-reads the real tables and index.
    """
    declared = list(declared)
    if not in_root_tracer:
        return ConeResult(False, Reason.NOT_ROOT_TRACER)
    autocast = _autocast_devices()
    if autocast:
        return ConeResult(False, Reason.AUTOCAST, f"autocast is on for {', '.join(autocast)}")
    graph = node.graph
    cone_nodes = cone_of(node)
    by_node = {leaf.node: leaf for leaf in leaves}

    leaf_nodes = [n for n in graph.nodes if n in cone_nodes and n.op == "placeholder"]
    for n in graph.nodes:
        if n not in cone_nodes or n.op == "placeholder":
            continue
        bad = _impure_reason(n)
        if bad is not None:
            return ConeResult(False, bad[0], f"{bad[1]} at {_where(n)}")

    infos: list[LeafInfo] = []
    examples: list[Any] = []
    speculative = False
    for n in leaf_nodes:
        leaf = by_node.get(n)
        if leaf is None:
            return ConeResult(False, Reason.NO_SOURCE, f"input {n.name} has no guardable source")
        if n is index:
            continue
        syms = symbolic.free_symbols_of(leaf.example, _example(n))
        if leaf.role == "symbolic" or (syms and index is None):
            return ConeResult(False, Reason.SYMBOLIC, symbolic.describe(leaf.source, syms, leaf.example))
        if not isinstance(leaf.example, torch.Tensor):
            what = ("a Python float (or NumPy scalar) that Dynamo passes to the graph as a tensor"
                    if leaf.role == "wrapped" else f"a {type(leaf.example).__name__}")
            return ConeResult(False, Reason.NO_TENSOR_LEAF, f"{leaf.source} is {what}")
        name = dotted_name(leaf.source)
        where = names.declaration(name, declared, leaf.source, leaf.example)
        decl = where is not None
        if leaf.example.is_inference() and not decl:
            return ConeResult(False, Reason.INFERENCE_TENSOR, f"{name} is an inference tensor")
        if leaf.example.requires_grad and not decl:
            return ConeResult(False, Reason.TRAINABLE_LEAF, f"{name} requires grad")
        if leaf.role == "buffer" and name.rsplit(".", 1)[-1] in HIDDEN_WRITTEN_BUFFERS and not decl:
            return ConeResult(False, Reason.HIDDEN_WRITER, f"{name} is a batch-norm running statistic")
        if _RESUME_STACK.fullmatch(leaf.source) and not decl:
            return ConeResult(False, Reason.CROSS_BREAK_INPUT, f"{leaf.source} of a resume function")
        if leaf.role not in ("parameter", "buffer") and not decl:
            speculative = True
        infos.append(LeafInfo(leaf.source, name, leaf.role, decl, where))
        examples.append(leaf.example)

    for n in cone_nodes if index is None else ():
        if n.op != "placeholder":
            syms = symbolic.free_symbols_of(_example(n))
            if syms:
                return ConeResult(False, Reason.SYMBOLIC, symbolic.describe(n.name, syms))

    mutated = _mutated_cone(graph, leaf_nodes, cone_nodes)
    if mutated is not None:
        return ConeResult(False, Reason.MUTATION, mutated)

    module = extract_cone(graph, node, leaf_nodes, cone_nodes)
    return ConeResult(
        True, Reason.INVARIANT_CONE, "", infos, examples, module=module, speculative=speculative,
        signature=signature(module.graph), nodes=frozenset(cone_nodes),
        default_dtype=torch.get_default_dtype(),
        index_pos=None if index is None else leaf_nodes.index(index),
    )


HOISTED_META = "nosync_hoisted_cone"
HOISTED_LEAF_META = "nosync_hoisted_leaf_of"


def mark_hoisted(result: ConeResult, owner: Any = None) -> None:
    """Tag the cone's nodes in the traced graph (node meta only) so the backend may drop them
    once nothing reads them (no other node is ever removed), and its leaves with ``owner`` so the
    backend can find writes to them later in the graph (:func:`hidden_writes_to_hoisted`)."""
    for n in result.nodes:
        if n.op != "placeholder":
            n.meta[HOISTED_META] = True
        elif owner is not None:
            n.meta.setdefault(HOISTED_LEAF_META, []).append(owner)


def written_storages(graph: fx.Graph) -> set[int]:
    """The storages (of the trace's fake values) that an op of ``graph`` writes in place."""
    written: set[int] = set()
    for n in graph.nodes:
        for w in written_nodes(n):
            key = storage_of(w)
            if key is not None:
                written.add(key)
    return written


def written_inputs(graph: fx.Graph) -> tuple[int, ...]:
    """The positions of the tensor placeholders whose memory ``graph`` writes in place."""
    written = written_storages(graph)
    return tuple(i for i, p in enumerate(graph.find_nodes(op="placeholder")) if storage_of(p) in written)


def hidden_writes_to_hoisted(graph: fx.Graph) -> list[tuple[Any, str]]:
    """``(owner, what)`` for each hoisted leaf that an op of the whole graph writes without bumping
    its version counter (a batch norm in training mode *after* the sync).

    NOTE: such a write happens after the value was computed for this call, so this call is right;
    but on the next call the leaf is the same object at the same version, and the memo would
    answer with the value from before the write.
    """
    leaves: dict[int, fx.Node] = {}
    for n in graph.nodes:
        if n.op == "placeholder" and n.meta.get(HOISTED_LEAF_META):
            key = storage_of(n)
            if key is not None:
                leaves[key] = n
    out: list[tuple[Any, str]] = []
    if not leaves:
        return out
    for n, target in _hidden_writes(graph):
        leaf = leaves.get(storage_of(target))
        if leaf is not None:
            what = f"{_target_name(n)} writes {leaf.name} without bumping _version at {_where(n)}"
            out += [(owner, what) for owner in leaf.meta[HOISTED_LEAF_META]]
    return out


def _hidden_writes(graph: fx.Graph) -> Iterable[tuple[fx.Node, fx.Node]]:
    """``(writer, written)`` for each write of the graph that leaves the written tensor's version as
    it was: a batch norm in training mode, a write through ``t.data`` (or a view of it), which bumps
    the version of the ``.data`` tensor, not the tensor's."""
    for n in graph.nodes:
        for target in _hidden_targets(n):
            yield n, target


def _hidden_targets(n: fx.Node) -> list[fx.Node]:
    """What ``n`` writes without bumping its version (a higher-order op: every operand, when its
    subgraph has such a write)."""
    if n.op == "call_function" and _torch_private.is_higher_order_op(n.target):
        return hidden_written_nodes(n)
    seen = dispatched(n)  # a function kept whole: its writes may be hidden ones (t.data, batch norm)
    return hidden_written_nodes(n) + [w for w in written_nodes(n) if _through_data(w)] + (
        seen[1] if seen is not None else [])


def inputs_custom_ops_may_write_unseen(graph: fx.Graph) -> list[int]:
    """The positions of the placeholders (in order) whose memory a custom op of the graph may write
    without bumping the version (:func:`_unversioned_custom_writes`): whether it did can only be
    seen at run time, by their versions (:func:`guards.forget_after_hidden_writes`)."""
    written = {storage_of(t) for n in graph.nodes if n.op == "call_function"
               for t in _unversioned_custom_writes(n)} - {None}
    return [i for i, p in enumerate(graph.find_nodes(op="placeholder")) if storage_of(p) in written]


def writes_inputs_unseen(graph: fx.Graph) -> bool:
    """Does the graph write one of its inputs without bumping its version (see
    :func:`_hidden_writes`)? NOTE: a module's batch-norm running statistics count too: nothing is
    hoisted or cached from a buffer named so, but another function may read the tensor under
    another name (an argument)."""
    written = {storage_of(t) for _, t in _hidden_writes(graph)} - {None}
    return any(storage_of(p) in written for p in graph.find_nodes(op="placeholder"))


def _through_data(node: fx.Node) -> bool:
    """Is ``node`` a ``t.data`` (``_get_data_attr``) or a view of one (same storage, first argument;
    through the tuple of a view op that returns several)?"""
    key = storage_of(node)
    for _ in range(64):
        # (a function kept whole may return ``t.data[:2]``: the trace cannot tell, so it counts)
        if _target_name(node) == "_get_data_attr" or dispatched(node) is not None:
            return True
        first = node.args[0] if node.op in ("call_function", "call_method") and node.args else None
        # NOTE: a view op returning several (unbind, chunk, split) is a tuple between the view and
        # its input: walked through
        if not isinstance(first, fx.Node) or key is None or (
                storage_of(first) != key and not isinstance(_example(first), (tuple, list))):
            return False
        node = first
    return False


def signature(graph: fx.Graph) -> tuple:
    """What a graph computes, independent of node names: (op, target, arguments) per node.

    NOTE: targets are compared by identity and constants by type and bits, never by name or
    ``repr``: ``F.max_pool1d`` and ``F.adaptive_max_pool1d`` are both ``boolean_dispatch.<locals>.fn``,
    and ``repr`` does not tell ``-0.0`` from ``0.0`` in every container or an int from a float.
    """
    index: dict[fx.Node, int] = {}
    out = []
    for i, n in enumerate(graph.nodes):
        index[n] = i
        args = _const_key((n.args, n.kwargs), index)
        target = n.target if isinstance(n.target, str) else _Ident(n.target)
        out.append((n.op, target, args))
    return tuple(out)


class _Ident:
    """Hashable by identity; holds the object so that its id is never reused while compared."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Ident) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __repr__(self) -> str:
        return f"<{getattr(self.obj, '__qualname__', type(self.obj).__name__)} at {id(self.obj):#x}>"


def _const_key(v: Any, index: dict) -> Any:
    """A key equal for two argument structures iff they hold the same nodes and the same constants
    (same type; floats bit for bit)."""
    t = type(v)
    if t is fx.Node:
        return ("%", index[v])
    if t is float:
        return (float, struct.pack("<d", v))
    if t in (bool, int, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format):
        return (t, v)
    if isinstance(v, (tuple, list)):  # also torch.Size, named tuples, FX's immutable_list
        return (t, tuple(_const_key(x, index) for x in v))
    if isinstance(v, dict):
        return (dict, tuple((k, _const_key(x, index)) for k, x in v.items()))
    if t is slice:
        return (slice, _const_key((v.start, v.stop, v.step), index))
    return _Ident(v)


def _autocast_devices() -> list[str]:
    """Device types with autocast on right now (Dynamo enters autocast for real while tracing)."""
    on = []
    for device_type in ("cpu", "cuda", "xpu", "mps"):
        try:
            if torch.is_autocast_enabled(device_type):
                on.append(device_type)
        except (RuntimeError, TypeError, ValueError):
            continue
    return on


def user_frames(stack_trace: str) -> list[tuple[str, int, str, str]]:
    """``(file, line, function, source)`` of each frame in a node's ``stack_trace``, outermost first."""
    lines = stack_trace.splitlines()
    frames = []
    for i, line in enumerate(lines):
        m = _FRAME_RE.match(line)
        if m:
            src = lines[i + 1].strip() if i + 1 < len(lines) else ""
            if src.startswith("File ") or set(src) <= set("^~ "):
                src = ""
            frames.append((m["file"], int(m["line"]), m["fn"].strip(), src))
    return frames


_FRAME_RE = re.compile(r'\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<fn>.+)$')


NO_SITE = SiteKey("<graph>", 0)  # a node without a user stack trace


def user_site(n: fx.Node) -> tuple[SiteKey, str, str]:
    """``(file:line, function, source text)`` of the innermost user frame that made ``n``;
    ``(NO_SITE, "", node name)`` when its ``stack_trace`` names none."""
    frames = user_frames(n.meta.get("stack_trace") or "")
    if not frames:
        return NO_SITE, "", n.name
    file, line, fn, src = frames[-1]
    return SiteKey(file, line), fn, src


def _where(n: fx.Node) -> str:
    """``file:line`` of the user code that made ``n`` (its node name when unknown), for messages."""
    site = user_site(n)[0]
    return n.name if site == NO_SITE else str(site)


def _mutated_cone(graph: fx.Graph, leaf_nodes: list[fx.Node], cone_nodes: set[fx.Node]) -> Optional[str]:
    """Describe an in-place write, anywhere in the graph so far, to memory the cone reads.

    NOTE: the writer is usually *not* in the cone: after ``y = s * 2; y.add_(1)``, Dynamo's
    variable ``y`` still names the ``mul`` node, so ``y.item()`` has ``mul`` in its cone while
    ``add_`` only uses it. Aliasing is therefore decided by storage (the fake tensors of views share
    their base's storage), over every node of the cone, leaves and intermediates alike.
    """
    reads = leaf_nodes + [n for n in graph.nodes if n in cone_nodes]
    storages: dict[int, fx.Node] = {}
    for n in reads:
        key = storage_of(n)
        if key is not None:
            storages.setdefault(key, n)
    if not storages:
        return None
    for n in graph.nodes:
        for target in written_nodes(n):
            key = storage_of(target)
            if key in storages:
                read = storages[key]
                what = "input" if read.op == "placeholder" else "value"
                return f"{_target_name(n)} writes to {what} {read.name} (or a view of it) at {_where(n)}"
    # Belt and braces: a write the op table above does not know about still bumps the version
    # counter of the fake tensor Dynamo traced with.
    for n in reads:
        ex = _example(n)
        if isinstance(ex, torch.Tensor):
            try:
                version = ex._version
            except Exception:  # inference tensors have none
                continue
            if version > 0:
                return f"{n.name} was written in place before the sync (version {version})"
    return None


def extract_cone(
    graph: fx.Graph, node: fx.Node, leaf_nodes: list[fx.Node], cone_nodes: set[fx.Node]
) -> fx.GraphModule:
    """Copy the cone into a standalone GraphModule: ``forward(*leaves) -> value of node``."""
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, n in enumerate(leaf_nodes):
        env[n] = new.placeholder(f"leaf{i}_{n.name}")
    for n in graph.nodes:  # graph order is a topological order
        if n in cone_nodes and n not in env:
            env[n] = new.node_copy(n, lambda x: env[x])
            # NOTE: node_copy copies the meta, whose fake tensors hold the trace's fake mode and
            # shape env; the cone lives as long as its guard, so it keeps the stack trace only.
            env[n].meta = {"stack_trace": n.meta["stack_trace"]} if "stack_trace" in n.meta else {}
    new.output(env[node])
    new.lint()
    return fx.GraphModule(torch.nn.Module(), new, class_name="NosyncCone")


def remove_dead_cones(gm: fx.GraphModule) -> bool:
    """Drop the computations of hoisted syncs that nothing reads any more. Returns "modified".

    When a sync is hoisted, Dynamo has already put its cone into the graph (``eq = tt == 0;
    any_1 = eq.any()``) and the constant replaced only the *use* of ``any_1``. Inductor removes such
    dead nodes itself, but ``codegen="eager"`` runs the FX graph as is and would recompute every
    cone at every step. Only nodes of hoisted cones (tagged by :func:`mark_hoisted`) that nothing
    reads any more are removed. They are pure by construction (the cone analysis rejected every
    in-place, random, internal or higher-order op) and were evaluated on these very inputs when
    they were hoisted, so the outputs and every write the graph makes stay exactly as they were.

    Before::

        eq = l_token_types_ == 0
        any_1 = eq.any();  eq = any_1 = None
        embedding = torch.nn.functional.embedding(l_token_types_, ...)

    After::

        embedding = torch.nn.functional.embedding(l_token_types_, ...)
    """
    graph = gm.graph
    modified = False
    for node in reversed(list(graph.nodes)):
        if node.op not in ("call_function", "call_method") or node.users:
            continue
        if not node.meta.get(HOISTED_META) or _impure_reason(node) is not None or node.is_impure():
            continue
        graph.erase_node(node)
        modified = True
    if modified:
        graph.lint()
        gm.recompile()
    return modified

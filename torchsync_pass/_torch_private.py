"""Every private torch name the package uses outside the Dynamo hook points.

The Dynamo hook points live in :mod:`torchsync_pass.dynamo_hooks` (with its own self-test); the
rest of the private torch surface is here, one small function per need, so that a new torch
release is one file's work. ``tests/test_private_surface.py`` fails when a private torch name is
used anywhere else in the package.

Release table: each name is present, and tests/test_verify.py passes through it, on torch 2.13.0
(CPU) and 2.14.1 (the ``tests/compat.sh`` venv); not yet checked on 2.11, 2.12 and 2.15. The rows
from ``lookup_backend`` down (moved here from backend.py, cone.py, counting.py and guards.py) are
checked on 2.13.0 (CPU) only.

===============================================================  ==============================
private name                                                     used by
===============================================================  ==============================
``torch._subclasses.fake_tensor.is_fake``                        :func:`is_fake`
``torch._subclasses.fake_tensor.unset_fake_temporarily``         :func:`no_fake_mode`
``torch.fx.experimental.symbolic_shapes.guarding_hint_or_throw`` :func:`symint_hint`
``torch.fx.experimental.symbolic_shapes.free_symbols``           :func:`free_symbols`
``node.meta["grapharg"]`` (Dynamo's ``GraphArg``)                :func:`traced_example`
``placeholder._dynamo_source``                                   :func:`copy_input_sources`
``torch._dynamo.utils.counters["stats"]["unique_graphs"]``       :func:`unique_graphs`
``torch._dynamo.backends.registry._COMPILER_FNS``                :func:`register_backend`
``torch._logging._internal.register_log``                        :func:`register_log_alias`
``torch.utils._pytree.tree_flatten_with_path``                   :func:`children`
``torch.utils._pytree.tree_map``                                 :func:`map_leaves`
``torch._dynamo.backends.registry.lookup_backend``               :func:`lookup_backend`
``torch._inductor.compile_fx.compile_fx``                        :func:`inductor_compile`
``torch._inductor.list_mode_options``                            :func:`inductor_mode_options`
``torch._ops.OpOverload`` / ``OpOverloadPacket``                 :func:`is_op_overload`,
                                                                 :func:`is_op_packet`
``torch._ops.HigherOrderOperator``                               :func:`is_higher_order_op`
``untyped_storage()._cdata``                                     :func:`storage_id`
``node.meta["example_value"]`` (Dynamo's traced value)           :func:`example_value`
``profile.kineto_results``                                       :func:`profiler_events`
``torch._dynamo.utils.counters["nosync"]``                       :func:`nosync_counters`
``torch._logging.trace_structured``                              :func:`trace_artifact`
===============================================================  ==============================

NOTE: :func:`symint_hint` asks ``guarding_hint_or_throw`` only when ``node.hint`` is missing; it
reads the hint without adding a guard. Every import is inside the function that needs it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch


def is_fake(x: Any) -> bool:
    """True for a FakeTensor (a tensor with metadata only)."""
    from torch._subclasses.fake_tensor import is_fake as _is_fake

    return isinstance(x, torch.Tensor) and _is_fake(x)


def no_fake_mode() -> Any:
    """A context that leaves any active fake mode, so real tensors run real kernels."""
    try:
        from torch._subclasses.fake_tensor import unset_fake_temporarily
    except ImportError:  # pragma: no cover - older torch
        return contextlib.nullcontext()
    return unset_fake_temporarily()


def symint_hint(x: Any) -> Any:
    """The concrete value behind a SymInt/SymFloat/SymBool, or ``None``; adds no guard."""
    node = x.node
    hint = node.hint if node.has_hint() else None
    if hint is None or isinstance(hint, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        try:
            from torch.fx.experimental.symbolic_shapes import guarding_hint_or_throw

            return guarding_hint_or_throw(x)
        except Exception:
            return None
    return hint


def free_symbols(v: Any) -> set:
    """Free sympy symbols of a (fake) tensor or SymInt; raises for tensors without a shape env."""
    from torch.fx.experimental.symbolic_shapes import free_symbols as _free_symbols

    return set(_free_symbols(v))


def traced_example(node: torch.fx.Node) -> tuple[Any, str]:
    """``(value, "")``: the real input Dynamo traced a placeholder with; ``(None, why_not)``."""
    grapharg = node.meta.get("grapharg")
    if grapharg is None:
        return None, f"placeholder {node.name!r} carries no real value (no grapharg)"
    try:
        example = grapharg.example
    except Exception as exc:  # the weak reference to the real tensor expired
        return None, f"the real value of placeholder {node.name!r} is gone ({exc})"
    return (grapharg.example_strong_ref if example is None else example), ""


def copy_input_sources(old: torch.fx.Graph, new: torch.fx.Graph) -> None:
    """Copy the source Dynamo set on each placeholder (outside ``meta``) onto a copied graph."""
    for a, b in zip(old.find_nodes(op="placeholder"), new.find_nodes(op="placeholder")):
        if hasattr(a, "_dynamo_source"):
            b._dynamo_source = a._dynamo_source


def unique_graphs() -> int:
    """How many graphs Dynamo has compiled in this process (its ``unique_graphs`` counter)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def register_backend(name: str, load: Callable[[], Callable[..., Any]]) -> None:
    """Register ``load()`` as the ``torch.compile`` backend ``name`` unless the name is taken."""
    from torch._dynamo.backends.registry import _COMPILER_FNS
    from torch._dynamo.backends.registry import register_backend as _register

    if name not in _COMPILER_FNS:
        _register(load(), name=name)


def register_log_alias(alias: str, qnames: list[str]) -> None:
    """Make ``torch._logging.set_logs(modules={alias: level})`` reach the loggers ``qnames``."""
    from torch._logging._internal import log_registry, register_log

    if alias not in log_registry.log_alias_to_log_qnames:
        register_log(alias, qnames)


def children(x: Any) -> dict[Any, tuple[str, Any]] | None:
    """``{key: (path piece, child)}`` for a pytree container, ``None`` for a leaf.

    Keys are the index, dict key or field name; pieces read like Python (``[0]``, ``['h']``,
    ``.y``). Containers are whatever ``torch.utils._pytree`` knows (tuple, list, dict, named tuples,
    ``OrderedDict``, ``deque``, registered classes such as ``transformers``' ``ModelOutput``).
    """
    from torch.utils._pytree import tree_flatten, tree_flatten_with_path

    def top(y: Any) -> bool:
        return y is not x

    try:
        pairs, spec = tree_flatten_with_path(x, is_leaf=top)
    except ValueError:  # a node registered without key paths
        leaves, spec = tree_flatten(x, is_leaf=top)
        pairs = [((i,), c) for i, c in enumerate(leaves)]
    if spec.is_leaf():
        return None
    raw = [getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for (k,), _ in pairs]
    return {r: (f"[{k}]" if isinstance(k, int) else str(k), c) for r, ((k,), c) in zip(raw, pairs)}


def map_leaves(fn: Callable[[Any], Any], tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> Any:
    """``tree`` rebuilt with ``fn`` applied to every leaf of its pytree containers."""
    from torch.utils._pytree import tree_map

    return tree_map(fn, tree, is_leaf=is_leaf)


def lookup_backend(name: str) -> Callable[..., Any]:
    """The ``torch.compile`` backend registered as ``name`` (e.g. ``"cudagraphs"``)."""
    from torch._dynamo.backends.registry import lookup_backend as _lookup

    return _lookup(name)


def inductor_compile(gm: torch.fx.GraphModule, example_inputs: list, config_patches: dict | None) -> Any:
    """Inductor's ``compile_fx`` on ``gm`` with ``config_patches``."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs, config_patches=config_patches)


def inductor_mode_options(mode: str) -> dict[str, Any]:
    """The Inductor config patches that ``torch.compile(mode=mode)`` stands for."""
    import torch._inductor

    return torch._inductor.list_mode_options(mode)


def is_op_overload(t: Any) -> bool:
    """True for an aten op overload (``torch.ops.aten.add.Tensor``)."""
    return isinstance(t, torch._ops.OpOverload)


def is_op_packet(t: Any) -> bool:
    """True for an aten op packet (``torch.ops.aten.add``)."""
    return isinstance(t, torch._ops.OpOverloadPacket)


def is_higher_order_op(t: Any) -> bool:
    """True for a higher-order operator (``cond``, ``while_loop``, ...)."""
    return isinstance(t, torch._ops.HigherOrderOperator)


def storage_id(t: torch.Tensor) -> int:
    """An id of the storage behind ``t``, equal for views of the same storage."""
    return t.untyped_storage()._cdata


def example_value(node: torch.fx.Node) -> Any:
    """The (fake) value Dynamo traced ``node`` with, else its ``val``; None when neither is set."""
    return node.meta.get("example_value", node.meta.get("val"))


def profiler_events(prof: Any) -> list[Any]:
    """The raw kineto events of a stopped ``torch.autograd.profiler.profile``."""
    return list(prof.kineto_results.events())


def nosync_counters() -> Any:
    """``torch._dynamo.utils.counters["nosync"]``, the package's counters."""
    from torch._dynamo.utils import counters

    return counters["nosync"]


def trace_artifact(name: str, payload_fn: Callable[[], str]) -> None:
    """Write a JSON artifact ``name`` to the structured trace (``TORCH_TRACE``)."""
    torch._logging.trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": name, "encoding": "json"},
        payload_fn=payload_fn,
    )

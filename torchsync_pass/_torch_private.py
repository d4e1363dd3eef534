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
``FakeTensor.fake_mode``, ``TorchDispatchMode``                   :func:`dispatched_ops`
``ShapeEnv.ignore_fresh_unbacked_symbols``                       :func:`dispatched_ops`
``torch._C._profiler._ExperimentalConfig(profile_all_threads=)``  :func:`all_threads_profiler_config`
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
``fn._torchdynamo_orig_callable`` (a ``disable`` wrapper)         :func:`undisabled`
``torch._inductor.list_mode_options``                            :func:`inductor_mode_options`
``torch._inductor.config.get_config_copy``, ``.get_type``          :func:`inductor_config_names`,
                                                                 :func:`inductor_setting_type`
``torch._C._dispatch_has_kernel_for_dispatch_key``               :func:`bumps_versions`
``torch._inductor.config.freezing``, ``torch._dynamo.config``    :func:`freezing_on`
``.prepare_freezing``
``torch._ops.OpOverload`` / ``OpOverloadPacket``                 :func:`is_op_overload`,
                                                                 :func:`is_op_packet`
``torch._ops.HigherOrderOperator``                               :func:`is_higher_order_op`
``untyped_storage()._cdata``                                     :func:`storage_id`
``torch._C._storage_address``                                    :func:`storage_address`
``torch.multiprocessing.reductions.StorageWeakRef``              :func:`storage_pin`
``Tensor._is_view``                                              :func:`is_view`
``torch._guards.TracingContext.get_traced_code``                 :func:`traced_code`
``node.meta["example_value"]`` (Dynamo's traced value)           :func:`example_value`
``profile.kineto_results``                                       :func:`profiler_events`
(``.experimental_event_tree()`` on torch 2.11)
``torch._dynamo.utils.counters["nosync"]``                       :func:`nosync_counters`
``torch._C._set_grad_enabled`` (Dynamo's grad-mode graph node)   :func:`is_grad_mode_setter`
``torch._logging.trace_structured``                              :func:`trace_artifact`
``torch._dynamo.eval_frame.set_code_exec_strategy``              :func:`skip_frames_in_dynamo`
``torch._C._profiler._RecordFunctionFast``                       :func:`profiler_range`
``torch._dynamo.callback.callback_handler``                      :func:`watch_compiles`
``_frozen_importlib._find_and_load``                             :func:`watch_imports`
``torch._dynamo.eval_frame._callback_from_stance``               :func:`watch_compiled_calls`
``torch._dynamo.utils.orig_code_map``                           :func:`frame_runs_under_dynamo`
``torch._dynamo.eval_frame.cached_backends``                      :func:`reset_with_dynamo`
``_get_cache_entries_for_region``, ``get_eval_frame_isolate_recompiles_id``
(``_debug_get_cache_entry_list`` before torch 2.13)              :func:`compiled_entries`
``torch.autograd.profiler._is_profiler_enabled``                 :func:`profiler_enabled`
``torch._logging.getArtifactLogger``                             :func:`graph_break_logger`
``torch._dynamo.utils.get_compilation_metrics``                  :class:`CompilationWatch`
``torch.fx._lazy_graph_module._LazyGraphModule``                 :func:`graph_forward`
``torch._C._dynamo.guards.TensorGuards``                         :func:`tensor_match`
``torch._C.TensorBase.__getitem__``; CPython's type layout       :func:`keep_tensors_non_sequences`
(``PyTypeObject.tp_as_sequence->sq_item``, through ctypes)
``torch._C._get_fp32_precision_getter`` (() where missing)       :func:`fp32_precisions`
``torch._C._get_mkldnn_enabled``, ``_get_cudnn_enabled``, ...    :func:`fp32_precisions`
(the kernel switches, each where present)
``torch.backends.opt_einsum``'s wrapper ``__dict__``, ``.m``     :func:`fp32_precisions`
(its ``enabled``/``strategy``; the public attributes where absent)
``torch._C._dynamo.guards.GlobalStateGuard`` (Python fallback)   :func:`global_state_now`
``torch._dynamo.convert_frame.initial_global_state``, its JSON   :func:`frame_entry_state`
``__getstate__``/``__setstate__``, ``torch._C.DisableTorchFunction``
``torch._C._is_torch_function_all_disabled``                     :func:`snapshot_for_context`
``torch._C.DisableTorchFunction``                                :func:`no_torch_function`
``torch._C._set_grad_enabled`` (a plain call, no context object)  :func:`set_grad_mode`
===============================================================  ==============================

NOTE: :func:`symint_hint` asks ``guarding_hint_or_throw`` only when ``node.hint`` is missing; it
reads the hint without adding a guard. Every import is inside the function that needs it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

log = logging.getLogger(__name__)


def is_fake(x: Any) -> bool:
    """True for a FakeTensor (a tensor with metadata only)."""
    from torch._subclasses.fake_tensor import is_fake as _is_fake

    return isinstance(x, torch.Tensor) and _is_fake(x)


def no_fake_mode() -> Any:
    """A context that leaves any active fake mode, so real tensors run real kernels."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


def dispatched_ops(fn: Callable, args: tuple, kwargs: dict,
                   hidden_writers: Optional[dict] = None) -> Optional[tuple[list, list]]:
    """``(aten overloads, written tensors)``: what ``fn(*args, **kwargs)`` dispatches, run on fake
    copies of the fake tensors among ``args``/``kwargs`` (a graph node's example values) under
    their fake mode, and which of those tensors (the originals) it wrote. None when there is no
    fake tensor or the run fails. ``hidden_writers``: ``{op name: (names of the arguments it
    writes, name of the flag that must be true for it to write them, or "")}``, for ops whose
    schema does not say they write (``native_batch_norm`` in training mode)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    flat, spec = torch.utils._pytree.tree_flatten((args, kwargs))
    # NOTE: the examples' own mode, not the tracing context's (detect_fake_mode prefers that one,
    # and a backend runs under a fresh one: "Mixing fake modes NYI")
    # (a functorch-wrapped fake, a vmap's batched tensor, is fake without a mode of its own)
    modes = {id(m): m for x in flat if is_fake(x) for m in [getattr(x, "fake_mode", None)]}
    if len(modes) != 1 or None in modes.values():
        return None
    (fake_mode,) = modes.values()
    ops: list = []
    storages: set = set()  # of the tensors an op's schema says it writes

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, a=(), kw=None):  # noqa: ANN001 - torch's protocol
            ops.append(func)
            # NOTE: by storage, not only by version: a write through ``t.data`` (a tensor with a
            # version counter of its own), and batch norm in training mode (its running statistics
            # are ``Tensor(a!)`` in the schema of the op it dispatches, but their version does not
            # move), leave the argument's version as it was
            kw = kw or {}
            bound = {arg.name: (kw.get(arg.name) if arg.kwarg_only or i >= len(a) else a[i])
                     for i, arg in enumerate(func._schema.arguments)}
            names = [arg.name for arg in func._schema.arguments
                     if arg.alias_info is not None and arg.alias_info.is_write]
            spec = (hidden_writers or {}).get(func._schema.name.split("::")[-1])
            if spec is not None and (not spec[1] or bound.get(spec[1]) is True):
                names += list(spec[0])
            for name in names:
                val = bound.get(name)
                for t in val if isinstance(val, (list, tuple)) else (val,):
                    if isinstance(t, torch.Tensor):
                        storages.add(storage_id(t))
            return func(*a, **kw)

    # NOTE: an op of data-dependent output size (torch.unique under
    # capture_dynamic_output_shape_ops) makes a fresh unbacked symbol in the trace's shape
    # environment, which Dynamo then expects the graph to bind ("PendingUnbackedSymbolNotFound")
    shape_env = getattr(fake_mode, "shape_env", None)
    ignore = getattr(shape_env, "ignore_fresh_unbacked_symbols", None)
    try:
        with fake_mode, (ignore() if ignore is not None else contextlib.nullcontext()):
            copies = [x.clone() if is_fake(x) else x for x in flat]
            versions = [x._version if is_fake(x) else None for x in copies]
            # ``t.data = other`` swaps the storage without a version bump or an op
            before = [storage_id(x) if is_fake(x) else None for x in copies]
            a, kw = torch.utils._pytree.tree_unflatten(copies, spec)
            with Record():
                fn(*a, **kw)
    except Exception:
        log.debug("could not run %r on fake inputs", fn, exc_info=True)
        return None
    written = [orig for orig, x, v, st in zip(flat, copies, versions, before)
               if v is not None and (x._version != v or storage_id(x) in storages or storage_id(x) != st)]
    return ops, written


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

    top = lambda y: y is not x  # noqa: E731 - only x itself is a node; its children are leaves
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

    return undisabled(compile_fx(gm, example_inputs, config_patches=config_patches))


def freezing_on(grad_enabled: Optional[bool] = None) -> bool:
    """Does Dynamo pass a module's parameters and buffers into the graph as constants (``get_attr``)
    instead of inputs: ``torch._inductor.config.freezing`` with grad mode off (as Dynamo's trace
    sees it: ``grad_enabled``; None: either), or ``torch._dynamo.config.prepare_freezing``."""
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as config

    frozen = bool(getattr(config, "freezing", False)) and grad_enabled is not True
    return frozen or bool(getattr(dynamo_config, "prepare_freezing", False))


def undisabled(fn: Any) -> Any:
    """The callable inside ``torch._dynamo.disable(fn)`` wrappers (``fn`` itself when not wrapped).

    NOTE: aot_autograd returns its compiled graph wrapped in ``disable``, and Dynamo wraps what a
    backend returns in ``disable`` once more (``OutputGraph``), so the inner wrapper switches the
    eval-frame callback off and on again per call for nothing: about 1.5 us a call on this
    project's CPU, paid by every step. What the backend returns is always called inside Dynamo's
    own wrapper, so the inner one is dropped.
    """
    while getattr(fn, "_torchdynamo_disable", False) and callable(getattr(fn, "_torchdynamo_orig_callable", None)):
        fn = fn._torchdynamo_orig_callable
    return fn


def graph_forward(gm: torch.fx.GraphModule) -> Any:
    """``gm.forward`` as generated code, for a backend to return (what the graph runs per call).

    NOTE: Dynamo hands backends a ``_LazyGraphModule`` whose ``forward`` before its first
    recompile is ``_lazy_forward``: it recompiles if needed, then goes through
    ``nn.Module.__call__`` on *every* call (microseconds per step). Dynamo swaps a returned
    ``_lazy_forward`` for the real one (``OutputGraph.compile_and_call_fx_graph``), but cannot see
    it inside a wrapper (nosync's guard token, a runner), so the backend recompiles here.
    """
    from torch.fx._lazy_graph_module import _LazyGraphModule

    if isinstance(gm, _LazyGraphModule):
        _LazyGraphModule.force_recompile(gm)
    return gm.forward


_TENSOR_MATCH: list = []  # [bool]: TensorGuards checks sizes, strides and dtype as tensor_match says


def tensor_match(tensors: Sequence[torch.Tensor]) -> Optional[Callable[..., bool]]:
    """``check(*ts)``: True only when each ``ts[i]`` has the dtype, device, requires_grad, dispatch
    keys, sizes and strides that ``tensors[i]`` has now (one C++ call: Dynamo's ``TensorGuards``,
    what its tensor guards were built from). Identity and contents are not checked. None where
    this torch has no such check, or for tensors it cannot describe (the caller checks in Python).

    NOTE: the sizes and strides are passed as static values: ``None`` there means a dynamic dim
    (not checked). A self-test on first use checks that a different size, stride or dtype fails.
    """
    if not _TENSOR_MATCH:
        _TENSOR_MATCH.append(_tensor_match_works())
    if not _TENSOR_MATCH[0]:
        return None
    try:
        return _tensor_guards(tensors)
    except Exception:
        return None


def _tensor_guards(tensors: Sequence[torch.Tensor]) -> Callable[..., bool]:
    from torch._C._dynamo.guards import TensorGuards

    tg = TensorGuards(*tensors, dynamic_dims_sizes=[list(t.size()) for t in tensors],
                      dynamic_dims_strides=[list(t.stride()) for t in tensors])
    if tg.check(*tensors) is not True:
        raise RuntimeError("TensorGuards rejects the tensors it was built from")
    return tg.check


def _tensor_match_works() -> bool:
    try:
        # NOTE: explicit dtype and device: under a float64 default (or another default device)
        # the checks below would not differ from ``a`` and the fast path would be off for good
        cpu, f32 = torch.device("cpu"), torch.float32
        a, b = torch.zeros(4, 6, dtype=f32, device=cpu), torch.zeros(3, dtype=torch.int64, device=cpu)
        check = _tensor_guards([a, b])
        return (check(torch.ones(4, 6, dtype=f32, device=cpu), b) is True and not check(a[:, :5], b)
                and not check(a.t(), b) and not check(a.to(torch.float64), b) and not check(a, b[:2]) and not check(a.reshape(24), b))
    except Exception:
        log.debug("nosync: TensorGuards unusable; leaf metadata is checked in Python", exc_info=True)
        return False


# The per-backend fp32 precision settings (``torch.backends.mkldnn.matmul.fp32_precision = "bf16"``
# changes fp32 matmul bits on a CPU with AMX/avx512_bf16). Dynamo's global-state guard does not
# cover them. Read: the generic setting and each (backend, op) pair of the backends this build has
# (an op's getter answers the setting in effect: a backend's "all" setter writes its ops, and an op
# set to "none" answers its parent's), found once; none where torch has no getter (before 2.13: the
# kernel switches and opt_einsum's settings below are read on every release).
_FP32_BACKENDS = {"cuda": lambda: torch.backends.cuda.is_built(), "cudnn": lambda: torch.backends.cuda.is_built(),
                  "mkldnn": lambda: torch.backends.mkldnn.is_available()}


def _opt_einsum_state() -> Callable[[], tuple]:
    """``() -> (enabled, strategy)`` of ``torch.backends.opt_einsum``, as ``torch.einsum`` reads
    them when it runs to pick its contraction order (and so its bits); Dynamo guards neither.

    The module object is a wrapper (``PropModule``) without descriptors: ``opt_einsum.enabled =
    False`` sets the wrapper's own attribute, ``opt_einsum.flags(...)`` the wrapped module's global,
    and a read takes the first of the two; read here the same way from both dicts (0.1 us, against
    2 to 5 us through the wrapper's ``__getattr__``), else through the attributes.
    """
    from torch.backends import opt_einsum as w

    d, g = getattr(w, "__dict__", None), getattr(getattr(w, "m", None), "__dict__", None)

    def slow() -> tuple:
        return (w.enabled, getattr(w, "strategy", None))

    if (isinstance(d, dict) and isinstance(g, dict) and "enabled" in g and "strategy" in g
            and not hasattr(type(w), "enabled") and not hasattr(type(w), "strategy")):
        def fast() -> tuple:
            return (d["enabled"] if "enabled" in d else g["enabled"], d["strategy"] if "strategy" in d else g["strategy"])

        if fast() == slow():
            return fast
    return slow


def _fp32_precisions_fn(attention: bool = True, einsum: bool = True) -> Callable[[], tuple]:
    get = getattr(torch._C, "_get_fp32_precision_getter", None)
    candidates = [("generic", "all")] if get is not None else []  # no per-backend precisions before 2.13
    for b, built in (_FP32_BACKENDS.items() if get is not None else ()):
        try:
            if built():
                candidates += [(b, o) for o in ("matmul", "conv", "rnn")]
        except Exception:
            continue
    pairs = []
    for b, o in candidates:
        try:
            get(b, o)
        except Exception:  # not a pair this torch knows ("Invalid (backend, op) pair", "Unknown backend")
            continue
        pairs.append((b, o))
    calls = [f"get({b!r}, {o!r})" for b, o in pairs]
    # The backend switches that pick a convolution, matmul or attention kernel (and so its bits)
    # without being a precision (_KERNEL_SWITCHES). Dynamo's global-state guard covers none of them.
    switches = {}
    # NOTE: the backend preferences pick CUDA/ROCm kernels only, and each read builds an enum
    # (0.4 us, against 0.05 for a flag): read per call only where a GPU is there to use them
    gpu = torch.cuda.is_available()
    for n in _KERNEL_SWITCHES + (_ATTENTION_SWITCHES if attention else ()) + (_GPU_BACKEND_SWITCHES if gpu else ()):
        fn = getattr(torch._C, n, None)
        try:
            v = fn()
        except Exception:  # not a getter of this torch build (or one that needs an argument here)
            continue
        switches[n] = fn
        # a list (the SDPA priority order) becomes a tuple: the state is a dict key
        calls.append(f"tuple({n}())" if isinstance(v, list) else f"{n}()")
    if einsum:
        switches["opt_einsum"] = _opt_einsum_state()
        calls.append("opt_einsum()")
    if not calls:
        return tuple
    # one straight-line tuple of C calls: this runs per call where a cone or cached tensor does a matmul
    return eval(f"lambda: ({', '.join(calls)},)", {"get": get, **switches})  # noqa: S307 - constant names


# ``torch.backends.mkldnn.enabled``/``deterministic``, ``torch.backends.cudnn.enabled``/``allow_tf32``/
# ``benchmark``/``deterministic``, ``torch.backends.nnpack`` (CPU convolutions), the attention kernels
# ``torch.nn.attention.sdpa_kernel`` and ``torch.backends.cuda.enable_*_sdp`` choose from, their
# priority order and the math kernel's fp16/bf16 reduction, the reduced-precision switches of
# CPU and cuBLAS gemms, the quantized engine, deterministic's fill of uninitialized memory, and
# where a GPU is available, the preferred BLAS/linalg/ROCm flash-attention backends. A getter this
# torch lacks is skipped.
_KERNEL_SWITCHES = (
    "_get_mkldnn_enabled", "_get_mkldnn_deterministic", "_get_cudnn_enabled", "_get_cudnn_allow_tf32",
    "_get_cudnn_benchmark", "_get_cudnn_deterministic", "_get_nnpack_enabled",
    "_get_cpu_allow_fp16_reduced_precision_reduction", "_get_cublas_allow_fp16_accumulation",
    "_get_qengine", "_get_deterministic_fill_uninitialized_memory",
)
# read only for work that may run attention (see guards.precision_reader): 0.6 us a call together
_ATTENTION_SWITCHES = (
    "_get_flash_sdp_enabled", "_get_math_sdp_enabled", "_get_mem_efficient_sdp_enabled",
    "_get_cudnn_sdp_enabled", "_get_overrideable_sdp_enabled", "_get_fa3_sdp_enabled",
    "_get_sdp_priority_order", "_get_math_sdp_allow_fp16_bf16_reduction",
)
_GPU_BACKEND_SWITCHES = ("_get_blas_preferred_backend", "_get_linalg_preferred_backend",
                         "_get_rocm_fa_preferred_backend")
fp32_precisions: Callable[[], tuple] = _fp32_precisions_fn()
fp32_precisions.__doc__ = ("The per-backend fp32 precision settings, one string per (backend, op) this torch "
                           "has, then the backend switches that pick a convolution, matmul or attention kernel, "
                           "and torch.backends.opt_einsum's (enabled, strategy).")
fp32_precisions_no_attention: Callable[[], tuple] = _fp32_precisions_fn(attention=False, einsum=False)
fp32_precisions_no_attention.__doc__ = (":func:`fp32_precisions` without the attention kernels' switches and "
                                        "opt_einsum's settings.")
fp32_precisions_einsum: Callable[[], tuple] = _fp32_precisions_fn(attention=False, einsum=True)
fp32_precisions_einsum.__doc__ = ":func:`fp32_precisions` without the attention kernels' switches."

# What :func:`float32_matmul_precision` answers when the legacy and per-backend APIs were mixed.
MIXED_PRECISION = "mixed legacy and per-backend settings"


def float32_matmul_precision() -> str:
    """``torch.get_float32_matmul_precision()``, which never raises: after a per-backend setting
    (``torch.backends.cuda.matmul.fp32_precision = "tf32"``) torch refuses to answer ("mix of the
    legacy and new APIs"); that state answers :data:`MIXED_PRECISION` (the per-backend settings,
    :func:`fp32_precisions`, then tell the states apart)."""
    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError:
        return MIXED_PRECISION


class _PyGlobalState:
    """:func:`global_state_now` where torch has no ``GlobalStateGuard``: the same state in Python."""

    __slots__ = ("state",)

    def __init__(self) -> None:
        self.state = self.read()

    @staticmethod
    def read() -> tuple:
        autocast = []
        for device_type in ("cpu", "cuda"):
            try:
                autocast.append((torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)))
            except (RuntimeError, TypeError, ValueError):
                continue
        matmul = torch.backends.cuda.matmul
        return (torch.is_grad_enabled(), tuple(autocast), torch.get_default_dtype(), torch.get_num_threads(),
                torch.are_deterministic_algorithms_enabled(), float32_matmul_precision(),
                torch.backends.cudnn.allow_tf32, matmul.allow_fp16_reduced_precision_reduction,
                matmul.allow_bf16_reduced_precision_reduction)

    def check(self) -> bool:
        return self.read() == self.state

    def reason(self) -> str:
        return "global state"


def global_state_now() -> Any:
    """A snapshot of the global state Dynamo's global-state guard checks (grad mode, autocast,
    default dtype, thread count, deterministic algorithms, legacy matmul precision and allow_tf32,
    reduced-precision reductions; not :func:`fp32_precisions`): ``.check()`` is True while the
    state is still the same (one C++ call), ``.reason()`` names what changed after a False."""
    try:
        from torch._C._dynamo.guards import GlobalStateGuard
    except ImportError:
        return _PyGlobalState()
    return GlobalStateGuard()


def frame_entry_state() -> Optional[tuple]:
    """While Dynamo traces a frame: ``(as taken, as a guard sees it)``, the :func:`global_state_now`
    snapshot Dynamo took when it entered the frame (what its own global-state guard compares a
    call with; inside a traced ``with torch.no_grad():`` region the live state is that region's),
    and the same with the torch-function state that a snapshot taken under
    ``DisableTorchFunction`` records: Dynamo's guard manager runs a lambda guard with
    ``__torch_function__`` disabled (:func:`snapshot_for_context` picks). None outside a trace, or
    where this torch has no such snapshot or another format.
    """
    try:
        from torch._dynamo import convert_frame

        entry = convert_frame.initial_global_state
        if entry is None:
            return None
        cls = type(entry)
        with torch._C.DisableTorchFunction():
            disabled = json.loads(cls().__getstate__())
        state = json.loads(entry.__getstate__())
        for key in ("torch_function", "torch_function_all_disabled"):
            state[key] = disabled[key]
        in_guard = cls.__new__(cls)
        in_guard.__setstate__(json.dumps(state))
        return (entry, in_guard)
    except Exception:
        log.debug("nosync: no frame entry state; guards check the thread count only", exc_info=True)
        return None


def set_grad_mode(mode: bool) -> None:
    """Set grad mode: what ``torch.set_grad_enabled(mode)`` does, without building its context
    object (a hoisted cone runs under ``no_grad`` at every new request)."""
    torch._C._set_grad_enabled(mode)


def no_torch_function() -> Any:
    """A context manager with ``__torch_function__`` off, for subclasses and modes alike: what a
    graph Dynamo traced through them (their effects are in its ops already) runs under again."""
    return torch._C.DisableTorchFunction()


def snapshot_for_context(snapshots: tuple) -> Any:
    """The one of :func:`frame_entry_state`'s snapshots for this context's torch-function state."""
    return snapshots[1] if torch._C._is_torch_function_all_disabled() else snapshots[0]


def bumps_versions(op: Any) -> bool:
    """Does the op overload ``op`` have an ADInplaceOrView kernel (the one that bumps the version of
    the tensors it writes)? True when that cannot be read (assume the common case).

    NOTE: ``torch._C._dispatch_has_kernel_for_dispatch_key``.
    """
    try:
        return bool(torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "ADInplaceOrView"))
    except Exception:
        return True


def inductor_config_names() -> frozenset:
    """The names ``torch._inductor.config.patch`` (and stock ``torch.compile(options=...)``) take,
    dotted for nested ones (``"triton.cudagraphs"``)."""
    import torch._inductor.config

    return frozenset(torch._inductor.config.get_config_copy())


def inductor_setting_type(name: str) -> Optional[type]:
    """The type ``torch._inductor.config`` declares for the setting ``name`` (None where it is a
    generic such as ``Optional[int]``, which stock ``torch.compile(options=...)`` does not check
    either, or unknown)."""
    import typing

    import torch._inductor.config

    try:
        declared = torch._inductor.config.get_type(name)
    except Exception:
        return None
    return declared if typing.get_origin(declared) is None and isinstance(declared, type) else None


def inductor_mode_options(mode: Optional[str]) -> dict[str, Any]:
    """The Inductor config patches that ``torch.compile(mode=mode)`` stands for (``None``: every
    mode's, by name)."""
    import torch._inductor

    return torch._inductor.list_mode_options(mode)


def compile_entry_call() -> Optional[tuple[Any, tuple, dict]]:
    """``(callable, args, kwargs)`` of the compiled call running now: the function
    ``torch.compile`` was given and this call's arguments, from Dynamo's entry frame on the stack
    (``compile_wrapper`` in eval_frame.py, 2.11 to 2.15, which holds them as ``fn``, ``args``,
    ``kwargs``); None when there is none (the innermost one counts; the walk goes past torch's
    own frames in between, a graph runs inside ``_fn`` wrappers of that file)."""
    found = compile_entry()
    return found[1] if found is not None else None


def compile_entry() -> Optional[tuple[Any, tuple[Any, tuple, dict]]]:
    """``(owner, (callable, args, kwargs))``: :func:`compile_entry_call`'s, and the object that
    owns that entry frame (``self`` there: the context ``torch.compile`` made, one per
    ``torch.compile`` call): what tells two compiles of one function apart (Dynamo runs a cache
    entry's guards for a call of another compile of the same code too)."""
    from torch._dynamo import eval_frame

    # NOTE: by name: a graph runs inside torch._dynamo.disable's ``_fn`` wrappers (same file,
    # their own fn/args/kwargs), which are not the entry
    f = sys._getframe(1)
    while f is not None:
        if f.f_code.co_name == "compile_wrapper" and f.f_code.co_filename == eval_frame.__file__:
            scope = f.f_locals
            fn, args, kwargs = scope.get("fn"), scope.get("args"), scope.get("kwargs")
            if fn is not None and isinstance(args, tuple) and isinstance(kwargs, dict):
                return scope.get("self"), (fn, args, kwargs)
        f = f.f_back
    return None


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


# The address of a tensor's StorageImpl (what ``untyped_storage()._cdata`` gives; it runs per leaf in
# every guard's fast path: 0.21 us a call either way, measured).
storage_address: Callable[[torch.Tensor], int] = getattr(
    torch._C, "_storage_address", lambda t: t.untyped_storage()._cdata)


def storage_pin(t: torch.Tensor) -> Any:
    """A weak reference to ``t``'s storage: while it lives, the storage's StorageImpl memory stays
    allocated (its data does not), so no other storage gets the address :func:`storage_id` gave."""
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(t.untyped_storage())


def traced_code() -> list:
    """The code objects Dynamo traced for the graph being compiled (the frame and every function
    it inlined); empty outside a compile."""
    from torch._guards import TracingContext

    return list(TracingContext.get_traced_code() or [])


def is_view(t: torch.Tensor) -> bool:
    return bool(t._is_view())


def example_value(node: torch.fx.Node) -> Any:
    """The (fake) value Dynamo traced ``node`` with, else its ``val``; None when neither is set."""
    return node.meta.get("example_value", node.meta.get("val"))


def profiler_events(prof: Any) -> list[Any]:
    """The raw kineto events of a stopped ``torch.autograd.profiler.profile``, Python tracer
    events included; each has ``is_python_function()``.

    NOTE: on torch 2.11 ``kineto_results.events()`` holds the op and device events only, and
    ``_KinetoEvent`` has no ``is_python_function()``: the Python tracer's calls are only in
    ``kineto_results.experimental_event_tree()`` (its ``PyCall``/``PyCCall`` nodes, same clock and
    thread ids as the events). From 2.12 on ``events()`` holds them too.
    """
    results = prof.kineto_results
    events = list(results.events())
    if events and hasattr(events[0], "is_python_function"):
        return events
    return with_tree_python_events(results, events)


def with_tree_python_events(results: Any, op_events: list[Any]) -> list[Any]:
    """``op_events`` (kineto events without the Python tracer's) plus the Python tracer's calls
    from ``results.experimental_event_tree()``, all read like ``_KinetoEvent``s."""
    out: list[Any] = [_OpEvent(e) for e in op_events]
    todo = list(results.experimental_event_tree())
    while todo:
        node = todo.pop()
        todo.extend(node.children)
        if str(node.tag).rsplit(".", 1)[-1] in ("PyCall", "PyCCall"):
            out.append(_PyTreeEvent(node))
    return out


class _OpEvent:
    """A torch 2.11 ``_KinetoEvent`` (an op or device event) with ``is_python_function()``."""

    __slots__ = ("_e",)

    def __init__(self, e: Any) -> None:
        self._e = e

    def __getattr__(self, name: str) -> Any:
        return getattr(self._e, name)

    def is_python_function(self) -> bool:
        return False


class _PyTreeEvent:
    """A Python tracer node of the experimental event tree, read like a ``_KinetoEvent``."""

    __slots__ = ("_n",)

    def __init__(self, node: Any) -> None:
        self._n = node

    def name(self) -> str:
        return self._n.name  # may raise on a name that is not valid UTF-8, as _KinetoEvent's

    def is_python_function(self) -> bool:
        return True

    def device_type(self) -> Any:
        return torch.autograd.DeviceType.CPU

    def start_ns(self) -> int:
        return self._n.start_time_ns

    def end_ns(self) -> int:
        return self._n.end_time_ns

    def start_thread_id(self) -> int:
        return self._n.start_tid

    def correlation_id(self) -> int:
        return self._n.correlation_id


_COUNTERS: list = []  # torch._dynamo.utils.counters, imported once (hot paths ask at every call)


def nosync_counters() -> Any:
    """``torch._dynamo.utils.counters["nosync"]``, the package's counters."""
    if not _COUNTERS:
        from torch._dynamo.utils import counters

        _COUNTERS.append(counters)
    return _COUNTERS[0]["nosync"]


def trace_artifact(name: str, payload_fn: Callable[[], str]) -> None:
    """Write a JSON artifact ``name`` to the structured trace (``TORCH_TRACE``)."""
    torch._logging.trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": name, "encoding": "json"},
        payload_fn=payload_fn,
    )


# ---- Observability helpers (used by counting.py and explain.py) ----
# NOTE: ``count_syncs()`` and the explain CLI watch a run without changing what Dynamo does. What
# they need from torch internals, and the one monkeypatch they make (the torch.Tensor method
# wrappers), lives here so the private surface stays in this module. These helpers may raise when a
# torch release moves something; their callers catch that, warn or note it, and carry on.

_ABSENT = object()


def skip_frames_in_dynamo(fns: list[Callable[..., Any]]) -> None:
    """Tell Dynamo never to compile the frames of ``fns``, nor anything they call.

    NOTE: Dynamo-internal: ``set_code_exec_strategy`` with ``FrameAction.SKIP`` for the frame and
    its callees (what ``torch._dynamo.eval_frame.skip_code`` does, applied recursively). Importing
    Dynamo here, before any Tensor method wrapper is installed, also keeps Dynamo's snapshot of the
    tensor methods (``variables.tensor.all_tensor_attrs``) free of the wrappers.
    """
    import torch._dynamo  # noqa: F401
    from torch._dynamo.eval_frame import set_code_exec_strategy
    from torch._dynamo.types import FrameAction, FrameExecStrategy

    for fn in fns:
        set_code_exec_strategy(fn.__code__, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))


def patch_tensor_methods(wrappers: dict[str, Callable[..., Any]]) -> Callable[[], None]:
    """Install ``wrappers`` as ``torch.Tensor`` attributes; return ``restore()``, which undoes it.

    ``restore()`` puts back exactly what ``torch.Tensor.__dict__`` held (a name that was only
    inherited from ``torch._C.TensorBase`` is deleted again, not pinned) and is idempotent.
    """
    saved = {name: torch.Tensor.__dict__.get(name, _ABSENT) for name in wrappers}
    for name, wrapper in wrappers.items():
        setattr(torch.Tensor, name, wrapper)
    if "__getitem__" in wrappers:
        keep_tensors_non_sequences()

    def restore() -> None:
        for name, old in saved.items():
            if old is _ABSENT:
                with contextlib.suppress(AttributeError):
                    delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, old)
        if "__getitem__" in saved:
            keep_tensors_non_sequences()
        saved.clear()

    return restore


# NOTE [Tensor __getitem__ and the sequence protocol]: torch.Tensor gets ``__getitem__`` from the C
# type ``TensorBase`` as a *mapping* slot only, so ``PySequence_Check(tensor)`` is false and
# ``torch.tensor([t0, t1])`` of 0-d tensors reads each as a scalar. Setting a Python
# ``__getitem__`` on the class makes CPython fill the *sequence* slot ``sq_item`` as well (of the
# class and of every subclass), and deleting it again does not empty that slot (both slots of the
# name are filled by then, so CPython keeps the generic one). From then on
# ``torch.tensor([torch.tensor(3)])`` calls ``len()`` of a 0-d tensor and raises ``TypeError``:
# ``count_syncs()`` would break programs (Qwen2-VL's ``get_rope_index`` builds its deltas so), and
# the process stayed broken after the counter ended. :func:`keep_tensors_non_sequences` empties
# ``sq_item`` again on each class whose ``__getitem__`` is TensorBase's or the counter's wrapper.
_TP_AS_SEQUENCE = 13  # PyTypeObject.tp_as_sequence, in pointers (3.11-3.13, no Py_TRACE_REFS)
_TP_BASICSIZE = 4  # PyTypeObject.tp_basicsize, in pointers: the layout check
_SQ_ITEM = 3  # PySequenceMethods.sq_item, in pointers
_sequence_slot_warned = False


def _sq_item_address(tp: type) -> Optional[int]:
    """The address of ``tp``'s ``sq_item`` slot, or None where the layout is not the one known."""
    import ctypes

    word = ctypes.sizeof(ctypes.c_void_p)
    if sys.implementation.name != "cpython" or hasattr(sys, "getobjects"):
        return None
    if ctypes.c_ssize_t.from_address(id(tp) + _TP_BASICSIZE * word).value != tp.__basicsize__:
        return None
    seq = ctypes.c_void_p.from_address(id(tp) + _TP_AS_SEQUENCE * word).value
    # a heap type's PySequenceMethods sit inside its own PyHeapTypeObject
    if not seq or not id(tp) < seq < id(tp) + type.__basicsize__:
        return None
    return seq + _SQ_ITEM * word


def _classes_under(root: type) -> list[type]:
    out, todo = [], [root]
    while todo:
        tp = todo.pop()
        if tp not in out:
            out.append(tp)
            todo.extend(type.__subclasses__(tp))
    return out


def keep_tensors_non_sequences() -> bool:
    """Empty the ``sq_item`` slot that a Python ``__getitem__`` on torch.Tensor filled (see
    Note [Tensor __getitem__ and the sequence protocol]); True when every class was put right.

    Only classes whose ``__getitem__`` is TensorBase's, or the one torch.Tensor holds itself (the
    counter's wrapper) are touched: a subclass with its own ``__getitem__`` is a sequence by its
    own choice. Unknown layout: one warning, nothing written.
    """
    import ctypes

    global _sequence_slot_warned
    base = torch._C.TensorBase.__dict__["__getitem__"]
    own = torch.Tensor.__dict__.get("__getitem__", base)
    ok = True
    for tp in _classes_under(torch.Tensor):
        if getattr(tp, "__getitem__", None) not in (base, own):
            continue
        addr = _sq_item_address(tp)
        if addr is None:
            ok = False
            continue
        ctypes.c_void_p.from_address(addr).value = None
    if not ok and not _sequence_slot_warned:
        _sequence_slot_warned = True
        log.warning("torchsync_pass: unknown type layout; while count_syncs() wraps "
                    "Tensor.__getitem__, torch.tensor([t0, t1]) of 0-d tensors may raise TypeError")
    return ok


def profiler_range(name: str) -> Any:
    """A context manager that marks a named range in the running profiler.

    NOTE: ``torch._C._profiler._RecordFunctionFast`` (what Dynamo and Inductor use for their own
    ranges): about 2-4 us per range against about 20 us for the public
    ``torch.profiler.record_function`` with the profiler's Python tracer on, whose own Python
    frames also land in the trace. ``count_syncs()`` opens one per intercepted sync. Present in
    every supported torch (since 2.2).
    """
    return torch._C._profiler._RecordFunctionFast(name)


def watch_compiles(on_start: Callable[[], None], on_end: Callable[[], None]) -> Callable[[], None]:
    """Call ``on_start()`` when Dynamo begins compiling a frame (outermost compile only) and
    ``on_end()`` when it is done; return ``remove()``.

    NOTE: ``torch._dynamo.callback.callback_handler`` (the registry behind the public
    ``torch._dynamo.callback.on_compile_start``/``on_compile_end`` decorators, which cannot be
    unregistered). The callbacks run in the compiling thread.
    """
    from torch._dynamo.callback import callback_handler

    start, end = (lambda _args: on_start()), (lambda _args: on_end())
    # NOTE: torch._dynamo.reset() empties the registry (callback_handler.clear()): a reset inside a
    # count_syncs() block left the later compiles unpaused, and the profiler's Python tracer, on
    # through them, grew the process by gigabytes. Our callbacks survive that clear.
    for attr in ("start_callbacks", "end_callbacks"):
        current = getattr(callback_handler, attr)
        if type(current) is list:
            setattr(callback_handler, attr, _ClearKeeps(current))
    # one reset clears both lists: the start list counts it (dynamo_resets)
    if isinstance(callback_handler.start_callbacks, _ClearKeeps):
        callback_handler.start_callbacks.counts_resets = True
    _KEPT_CALLBACKS.update((id(start), id(end)))
    callback_handler.register_start_callback(start)
    callback_handler.register_end_callback(end)

    def remove() -> None:
        _KEPT_CALLBACKS.difference_update((id(start), id(end)))
        for unregister, cb in ((callback_handler.remove_start_callback, start),
                               (callback_handler.remove_end_callback, end)):
            with contextlib.suppress(ValueError):  # already removed
                unregister(cb)

    return remove


_KEPT_CALLBACKS: set = set()  # ids of watch_compiles' live callbacks


class _ClearKeeps(list):
    """Dynamo's callback list whose ``clear()`` (``torch._dynamo.reset()``) keeps
    :func:`watch_compiles`' live callbacks and drops every other one, as before."""

    counts_resets = False

    def clear(self) -> None:
        kept = [c for c in self if id(c) in _KEPT_CALLBACKS]
        super().clear()
        self.extend(kept)
        if self.counts_resets:
            _RESETS[0] += 1
            for fn in list(_RESET_LISTENERS):
                fn()


# torch._dynamo.reset() calls seen while watch_compiles' callbacks were installed (a count_syncs
# block: explain's run), and what to call at each: compile ids start again at 0/0 after one
_RESETS = [0]
_RESET_LISTENERS: list = []


def dynamo_resets() -> int:
    """How many ``torch._dynamo.reset()`` calls ran while :func:`watch_compiles` was installed."""
    return _RESETS[0]


def qualified_compile_id(cid: Optional[str], resets: int) -> Optional[str]:
    """A compile id told apart from the same id before ``resets`` resets of Dynamo (which start
    ids again at 0/0): ``"0/0"`` as is, ``"r1:0/0"`` after one."""
    return cid if cid is None or resets <= 0 else f"r{resets}:{cid}"


def watch_imports(on_start: Callable[[], None], on_end: Callable[[], None]) -> Callable[[], None]:
    """Call ``on_start()``/``on_end()`` around each outermost module load; return ``remove()``.

    NOTE: not torch, but the one other monkeypatch of the counter, kept here with the rest: the
    interpreter's ``import`` statement and ``importlib.import_module`` both load a module that is
    not in ``sys.modules`` through ``_frozen_importlib._find_and_load`` (looked up on the module at
    each call in CPython 3.11-3.13), so wrapping that attribute sees every real load, and nothing
    for modules already loaded.
    """
    bootstrap = sys.modules["_frozen_importlib"]
    original = bootstrap._find_and_load
    depth = threading.local()

    @functools.wraps(original)
    def _find_and_load(name: str, import_: Any) -> Any:
        d = getattr(depth, "n", 0)
        depth.n = d + 1
        if d == 0:
            on_start()
        try:
            return original(name, import_)
        finally:
            depth.n = d
            if d == 0:
                on_end()

    bootstrap._find_and_load = _find_and_load

    def remove() -> None:
        if bootstrap._find_and_load is _find_and_load:
            bootstrap._find_and_load = original

    return remove


_DYNAMO_DIR = os.path.join(os.path.dirname(torch.__file__), "_dynamo") + os.sep
_EVAL_FRAME = _DYNAMO_DIR + "eval_frame.py"


def watch_compiled_calls(on_call: Callable[[Any], None]) -> Callable[[], None]:
    """Call ``on_call(frame)`` at each entry into a ``torch.compile``'d function or module from
    Python, before Dynamo's frame evaluation is switched on for it (``frame``: the entry wrapper's
    own frame, in eval_frame.py); return ``remove()``. Exceptions of ``on_call`` are logged.

    NOTE: wraps ``torch._dynamo.eval_frame._callback_from_stance``, which the compiled callable's
    wrapper (``_TorchDynamoContext.__call__``'s ``_fn``) looks up as a module global at every call
    (torch 2.11 to 2.15; the enter and exit of Dynamo's context managers call it too).
    """
    from torch._dynamo import eval_frame

    original = eval_frame._callback_from_stance

    @functools.wraps(original)
    def _callback_from_stance(callback: Any) -> Any:
        try:
            on_call(sys._getframe(1))
        except Exception:
            log.debug("torchsync_pass: compiled-call watcher failed", exc_info=True)
        return original(callback)

    eval_frame._callback_from_stance = _callback_from_stance
    skip_frames_in_dynamo([_callback_from_stance])

    def remove() -> None:
        if eval_frame._callback_from_stance is _callback_from_stance:
            eval_frame._callback_from_stance = original

    return remove


def reset_with_dynamo(backend: Any) -> None:
    """Have ``torch._dynamo.reset()`` call ``backend.reset()``.

    NOTE: Dynamo records a backend in ``eval_frame.cached_backends`` when ``torch.compile`` is
    called, and empties that dict at every reset: a compiled object called again after a reset
    (the same ``torch.compile(model)``) was reset once, and nosync's sites, memos and released
    guard groups outlived every later reset (a ``.data`` write then served a stale hoisted value).
    Called at every nosync compile.
    """
    from torch._dynamo import eval_frame

    cache = getattr(eval_frame, "cached_backends", None)
    if isinstance(cache, dict):
        cache.setdefault(id(backend), backend)


def compiled_entries(code: Any) -> tuple[Optional[int], int]:
    """``(entries, region)``: how many cache entries Dynamo holds for ``code`` in the
    ``isolate_recompiles`` region the current call runs in (what Dynamo compares with
    ``recompile_limit``), and that region's id (-1: the default one, and every region before
    torch 2.13, which has no isolation). ``entries`` is None where torch cannot say.

    NOTE: Dynamo's compile id (``frame_compile_id``) counts compiles of a code object across every
    region: ``verify_loop`` compiles each mode in its own region, and ``isolate_recompiles=True``
    instances share their code, so that count reached half the limit where no region had.
    """
    ev = torch._C._dynamo.eval_frame
    try:
        if hasattr(ev, "_get_cache_entries_for_region") and hasattr(ev, "get_eval_frame_isolate_recompiles_id"):
            region = int(ev.get_eval_frame_isolate_recompiles_id())
            return len(ev._get_cache_entries_for_region(code, region)), region
        return len(ev._debug_get_cache_entry_list(code)), -1
    except Exception:  # a torch release that moved these
        log.debug("cannot count the cache entries of %r", code, exc_info=True)
        return None, -1


def frame_runs_under_dynamo(frame: Any) -> bool:
    """True when ``frame`` or a caller is Dynamo itself (a compile, its frame-evaluation
    callback), a function Dynamo compiled, or the import machinery. The ``torch.compile`` wrapper
    in eval_frame.py is not Dynamo running: a call into a compiled function passes it first.

    NOTE: starting the profiler's Python tracer with such a frame on the stack crashed the
    interpreter later, when the tracer was stopped (a segfault, torch 2.13, Python 3.11).
    A frame whose code object has cache entries but runs that code itself (not Dynamo's output
    code) runs uncompiled and is safe: a decorator's wrapper whose one code object wraps both a
    compiled function and the uncompiled caller (transformers' ``deprecate_kwarg`` around
    ``generate`` and ``forward``), or a frame past the recompile limit. Refused there, the profiler
    stayed off from a request's first compile to the end of the count (review 22: 6 of 30
    ``multinomial`` reads counted over 3 sampled ``generate`` requests, with no note).

    NOTE [Compiled regions]: a frame that runs a compiled function runs Dynamo's *output* code
    (``frame.f_code`` is the transformed code object, which has no cache entries of its own);
    ``torch._dynamo.utils.orig_code_map`` maps each output code to the code it was compiled from.
    A profiler stopped (for the compile of the code after a graph break) and restarted by an
    intercepted sync in that resumed compiled code corrupted the heap: segfaults later, in guard
    evaluation or in ``_disable_profiler``, or ``munmap_chunk(): invalid pointer``, also with
    ``with_stack=False`` (torch 2.13, Python 3.11; ``benchmarks/schedulers.py`` crashed in 5 runs
    of 6 before this check, in none of 4 after). The likely mechanism: Dynamo's C frame evaluator
    wraps each run of output code in a ``RecordFunction`` ("Torch-Compiled Region: i/j") whose
    end callback writes into the event of the profiler that was running when it began.
    """
    from torch._dynamo.utils import orig_code_map

    while frame is not None:
        code = frame.f_code
        name = code.co_filename
        if name.startswith("<frozen importlib") or (name.startswith(_DYNAMO_DIR) and name != _EVAL_FRAME):
            return True
        if code in orig_code_map:
            return True
        frame = frame.f_back
    return False


def all_threads_profiler_config() -> Any:
    """Kineto's experimental config that records the ops of every thread, not only the one that
    started the profiler (a serving engine's worker threads); None where torch lacks it.

    NOTE: ``torch._C._profiler._ExperimentalConfig(profile_all_threads=True)``.
    """
    try:
        return torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except Exception:
        return None


def profiler_enabled() -> bool:
    """True while an autograd/Kineto profiler is running in this process.

    NOTE: reads ``torch.autograd.profiler._is_profiler_enabled``; no public API says this.
    """
    return bool(torch.autograd.profiler._is_profiler_enabled)


def graph_break_logger() -> logging.Logger:
    """The logger of Dynamo's ``graph_breaks`` artifact (what ``TORCH_LOGS=graph_breaks`` shows).

    Its records carry each break's user location, reason and user stack; attach a handler to
    collect them (see ``explain._BreakHandler`` for the two record formats).
    """
    import torch._dynamo  # noqa: F401  (registers the artifact)
    import torch._logging

    return torch._logging.getArtifactLogger("torch._dynamo.symbolic_convert", "graph_breaks")


@dataclass(frozen=True)
class CompileRecord:
    """One frame compile, copied out of Dynamo's compilation metrics as plain data."""

    co_name: Optional[str]
    co_filename: Optional[str]
    co_firstlineno: Optional[int]
    compile_id: Optional[str]
    graph_op_count: Optional[int]
    recompile_reason: Optional[str]
    fail_type: Optional[str]
    fail_reason: Optional[str]
    is_runtime: Optional[bool]


class CompilationWatch:
    """Collects the compilation-metrics records of the compiles between ``__init__`` and ``stop()``.

    NOTE: Dynamo-internal: ``torch._dynamo.utils.get_compilation_metrics`` (one record per frame
    compile: code name/file/line, graph op count, compile id, recompile and failure reasons). Dynamo
    keeps only the last 64 by default, so the limit is raised while watching and put back by
    ``stop()``.
    """

    def __init__(self) -> None:
        import torch._dynamo  # noqa: F401
        from torch._dynamo import utils as dutils

        self._dutils = dutils
        self._seen = {id(m) for m in dutils.get_compilation_metrics()}
        self._old_limit = getattr(dutils._compilation_metrics, "maxlen", None)
        dutils.set_compilation_metrics_limit(1_000_000)
        # at each torch._dynamo.reset(): the last record then (ids start again after it); the
        # metrics themselves outlive a reset
        self._boundaries: list = []
        _RESET_LISTENERS.append(self._at_reset)

    def _at_reset(self) -> None:
        metrics = self._dutils.get_compilation_metrics()
        self._boundaries.append(metrics[-1] if metrics else None)

    def stop(self) -> list[CompileRecord]:
        """The records of the compiles since the watch began, oldest first, their compile ids
        qualified by the resets before them (:func:`qualified_compile_id`); restores the limit."""
        dutils = self._dutils
        with contextlib.suppress(ValueError):
            _RESET_LISTENERS.remove(self._at_reset)
        try:
            metrics = dutils.get_compilation_metrics()
        finally:
            if self._old_limit:
                dutils.set_compilation_metrics_limit(self._old_limit)
        out, resets, pending = [], 0, list(self._boundaries)
        while pending and pending[0] is None:  # a reset before any record
            pending.pop(0)
            resets += 1
        for m in metrics:
            if id(m) not in self._seen:
                rec = CompileRecord(**{f.name: getattr(m, f.name) for f in dataclasses.fields(CompileRecord)})
                out.append(dataclasses.replace(rec, compile_id=qualified_compile_id(rec.compile_id, resets)))
            while pending and pending[0] is m:
                pending.pop(0)
                resets += 1
        return out


def frame_entry_grad_mode() -> Optional[bool]:
    """While Dynamo traces a frame: the grad mode it was entered with (:func:`frame_entry_state`)."""
    entry = frame_entry_state()
    if entry is None:
        return None
    try:
        mode = json.loads(entry[0].__getstate__()).get("grad_mode")
    except Exception:
        return None
    return mode if isinstance(mode, bool) else None


_SDP_SWITCHES = ("flash", "mem_efficient", "math", "cudnn")


def sdp_state() -> tuple:
    """The switches ``sdpa_kernel`` sets: each backend's, the overrideable backend's and, where
    this torch has one, the priority order (``set_priority=True``)."""
    b = torch.backends.cuda
    switches = tuple(getattr(b, f"{k}_sdp_enabled")() for k in _SDP_SWITCHES)
    get_over = getattr(torch._C, "_get_overrideable_sdp_enabled", None)
    get_order = getattr(torch._C, "_get_sdp_priority_order", None)
    return (switches, get_over() if get_over is not None else None,
            tuple(get_order()) if get_order is not None else None)


def set_sdp_state(state: tuple) -> None:
    b = torch.backends.cuda
    switches, over, order = state
    for k, on in zip(_SDP_SWITCHES, switches):
        getattr(b, f"enable_{k}_sdp")(on)
    if over is not None:
        torch._C._set_sdp_use_overrideable(over)
    if order is not None:
        torch._C._set_sdp_priority_order(list(order))


def is_grad_mode_setter(target: Any) -> bool:
    """Is ``target`` the function Dynamo traces a grad-mode switch (``with torch.no_grad()``) as?"""
    return target is torch._C._set_grad_enabled

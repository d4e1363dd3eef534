"""The only module of torchsync_pass that touches TorchDynamo internals.

Why hooks at all: Dynamo splits a frame at every host sync *before* it calls a backend, so a plain
``(gm, example_inputs)`` backend never sees the whole step and cannot remove a graph break. The
nosync pass therefore acts inside Dynamo's tracing, at these hook points, and only for frames whose
backend is nosync (every other frame sees stock Dynamo):

=====================================  =====================================================
hook point                             sync it intercepts
=====================================  =====================================================
``TensorVariable.method_item``         ``t.item()``
``TensorVariable.method_tolist``       ``t.tolist()``
``TensorVariable.bool_impl``           ``bool(t)``
``TensorVariable.nb_int_impl``         ``int(t)``
``TensorVariable.nb_float_impl``       ``float(t)``
``TensorVariable.nb_index_impl``       ``operator.index(t)`` (``range(t)``, ``x[t]`` of ints)
``generic_jump`` handlers              ``if t:``, ``while t:``, ``and``/``or``, ``assert t``
=====================================  =====================================================

NOTE: two ways a hook can be silently dead. From torch 2.14 ``TensorVariable.call_method`` looks
handlers up in the class-level ``tp_methods`` table captured when the class was created, so the
table entry is replaced too. The jump handlers are copied into each translator class's
``dispatch_table`` when the class is created, so every table entry that holds a ``generic_jump``
handler is replaced, not just the class attribute. :func:`self_test` compiles tiny functions and
checks that each hook actually fires; if one does not, the pass is switched off with one warning and
nosync behaves exactly like stock Inductor.

The rest of the package talks to this module through plain data (:class:`SyncSite`, :class:`Leaf`)
and three callables: :func:`install` (with a policy), :func:`add_lambda_guard` and
:func:`unsupported`.
"""

from __future__ import annotations

import collections
import functools
import inspect
import itertools
import linecache
import logging
import operator
import os
import re
import struct
import sys
import threading
import types
import warnings
import weakref
import dataclasses
import dis
from dataclasses import dataclass, field
from typing import Any, Callable, NoReturn, Optional

import torch

log = logging.getLogger(__name__)

#: The supported torch releases. setup.cfg's ``install_requires`` carries the same string (a test
#: checks it); :data:`SUPPORTED_TORCH` is parsed from it.
TORCH_REQUIREMENT = "torch>=2.11,<2.16"


def _parse_requirement(req: str) -> tuple[tuple[int, int], tuple[int, int]]:
    m = re.fullmatch(r"torch>=(\d+)\.(\d+),<(\d+)\.(\d+)", req)
    if m is None:
        raise ValueError(f"cannot parse {req!r}")
    a, b, c, d = map(int, m.groups())
    return (a, b), (c, d)


SUPPORTED_TORCH = _parse_requirement(TORCH_REQUIREMENT)  # [min, max)

JUMP_KIND = "bool"


@dataclass(frozen=True)
class Leaf:
    """A graph input that a synced value depends on."""

    node: torch.fx.Node
    source: str  # guard expression over L / G, e.g. "L['self']._buffers['mask']"
    example: Any  # the real value at trace time
    # "parameter", "buffer", "input", "attribute", "global", "symbolic", "other", or "wrapped": a Python
    # float or NumPy scalar that Dynamo passes to the graph as a tensor (example None)
    role: str


@dataclass
class SyncSite:
    """One sync Dynamo is about to trace, described with plain data."""

    kind: str  # "item", "tolist", "bool", "int", "float", "index"
    node: torch.fx.Node  # the FX node of the tensor being synced
    code: types.CodeType
    offset: int
    file: str
    line: int
    col: int
    in_root_tracer: bool
    fullgraph: bool
    options: Any  # the raw options of the nosync backend
    frame_code: Any = None  # code object of the frame being compiled (owns the cache entries)
    frame_compile: int = 0  # how many times that frame was compiled before (0: first compile), in its region
    frame_region: int = -1  # the isolate_recompiles region compiled in (-1: the default one)
    # Later instructions of the same opcode at the same source position: the two jumps of
    # `if lo <= x <= hi:` share one position and are two syncs (0: the last one).
    occurrence: int = 0
    frame_locals: Any = None  # the compiled frame's real arguments (to check declared names)
    # The Python class of the tensor read (a subclass: Dynamo turns ``int(t)``/``bool(t)`` into
    # its own read, without the subclass's ``__int__``/``__bool__`` or ``__torch_function__``)
    tensor_class: Any = torch.Tensor
    # For a subclass: is the instruction the read itself (``t.item()``), not a read Dynamo made for
    # something else (a slice bound ``x[:t]``, which eager converts with the class's __index__)?
    direct_read: bool = True
    leaves: list[Leaf] = field(default_factory=list)
    _tx: Any = None  # the translator; opaque outside this module

    @property
    def source_line(self) -> str:
        return linecache.getline(self.file, self.line).strip()

    @property
    def code_name(self) -> str:
        return self.code.co_qualname


# A policy maps a SyncSite to ``(True, value)`` to hoist (the value replaces the sync) or
# ``(False, None)`` to leave the sync to stock Dynamo.
Policy = Callable[[SyncSite], "tuple[bool, Any]"]

_state = threading.local()
_policy: Optional[Policy] = None
_backend_matcher: Optional[Callable[[Any], bool]] = None
_originals: dict[str, Any] = {}
_wrapped_methods: list[tuple[type, str, Any]] = []  # (class, name, original) of each _wrap_method
_installed = False
_self_test_result: Optional[dict[str, bool]] = None
_disabled_reason: Optional[str] = None
_install_lock = threading.RLock()


# --------------------------------------------------------------------------------------------
# Which backend is tracing this frame?
# --------------------------------------------------------------------------------------------
def _unwrap_backend(fn: Any) -> tuple[Any, dict]:
    """Walk the wrappers Dynamo puts around a backend; return (innermost, kwargs).

    Under ``torch.compile`` the chain is WrapBackendDebug -> _TorchCompileWrapper -> backend, and
    the options travel in ``_TorchCompileWrapper.kwargs`` (copied onto the debug wrapper).
    """
    kwargs: dict = {}
    for _ in range(8):
        if fn is None:
            break
        if _backend_matcher is not None and _backend_matcher(fn):
            return fn, kwargs
        kw = getattr(fn, "kwargs", None)
        if isinstance(kw, dict) and not kwargs:
            kwargs = dict(kw)
        # NOTE: ``backend``: torch._dynamo.testing.CompileCounterWithBackend's attribute, a name
        # it looks up per compile
        fn = next((c for attr in ("_torchdynamo_orig_backend", "compiler_fn", "__wrapped__", "backend")
                   if (c := _registered(getattr(fn, attr, None))) is not None and c is not fn), None)
    return None, {}


def _registered(c: Any) -> Any:
    """A backend by object or by registered name (a name not registered, or not a backend: None)."""
    if isinstance(c, str):
        from ._torch_private import lookup_backend

        try:
            return lookup_backend(c)
        except Exception:
            return None
    return c if callable(c) else None


def backend_hidden() -> bool:
    """True when the frame being compiled reached nosync's backend through a wrapper the hooks
    cannot see into (its options were not found, so nothing was hoisted or rewritten in it);
    False under a visible nosync backend, outside a trace, or while nosync compiles for itself."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    if _policy is None or getattr(_state, "busy", False):
        return False
    try:
        tx = InstructionTranslator.current_tx()
    except Exception:  # not inside a trace (a backend called directly)
        return False
    return tx is not None and _nosync_options(tx) is None


def _nosync_options(tx: Any) -> Any:
    """Options dict if this frame's backend is nosync, else None (stock Dynamo)."""
    if _policy is None or getattr(_state, "busy", False):
        return None
    try:
        compiler_fn = tx.output.compiler_fn
    except AttributeError:
        return None
    return _options_behind(compiler_fn)


def compile_options(owner: Any) -> Any:
    """The nosync options of the ``torch.compile`` that made ``owner`` (the context of Dynamo's
    entry frame, :func:`torchsync_pass._torch_private.compile_entry`), or None when its backend
    is not nosync (another backend, or a run-only context)."""
    return _options_behind(getattr(owner, "callback", None))


def _options_behind(compiler_fn: Any) -> Any:
    backend, kwargs = _unwrap_backend(compiler_fn)
    if backend is None:
        return None
    opts = kwargs.get("options")
    merged = getattr(backend, "merged_options", None)  # NosyncBackend(options) and options= both
    if merged is not None:
        opts = merged(opts)
    return {} if opts is None else opts


# --------------------------------------------------------------------------------------------
# Describing a sync site
# --------------------------------------------------------------------------------------------
def _source_name(source: Any) -> Optional[str]:
    return None if source is None else source.name  # a (cached) property on every supported torch


def _role(source_name: str, example: Any) -> str:
    if not isinstance(example, torch.Tensor):
        return "symbolic" if isinstance(example, (torch.SymInt, torch.SymFloat, int, float)) else "other"
    if "._parameters[" in source_name:
        return "parameter"
    if "._buffers[" in source_name:
        return "buffer"
    if source_name.startswith("G["):
        return "global"
    if source_name.startswith("L[") and "]" in source_name and source_name.index("]") == len(source_name) - 1:
        return "input"
    return "attribute"


def leaf_of(node: torch.fx.Node) -> Optional[Leaf]:
    """A placeholder of a graph handed to the backend as a Leaf (None without a guardable source)."""
    ga = node.meta.get("grapharg")
    if ga is None:
        return None
    src = _source_name(getattr(ga, "source", None))
    if src is None:
        return None
    try:
        example = ga.example
    except Exception:  # example released
        return None
    if getattr(ga, "pass_arg_as_tensor", False) and not getattr(ga, "is_tensor", True):
        # NOTE: a Python float Dynamo no longer specialises (or a NumPy scalar) reaches the graph as
        # a 0-d tensor it makes per call; the source still holds the scalar, which has no _version a
        # guard could read: the leaf is not a tensor. (An int made dynamic is a SymInt, "symbolic";
        # a NumPy array's source is Dynamo's ``___from_numpy(...)``, a new tensor every call.)
        return Leaf(node=node, source=src, example=None, role="wrapped")
    return Leaf(node=node, source=src, example=example, role=_role(src, example))


# Files under TORCH_DIR are torch's own Python; RESUME_RE matches the code objects Dynamo makes for
# the rest of a frame after a graph break (group 1: the original function's name).
TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
RESUME_RE = re.compile(r"^torch_dynamo_resume_in_(.+)_at_\d+$")


def _user_translator(tx: Any) -> Any:
    """The innermost translator running user code.

    NOTE: a sync can be traced inside torch's own Python, e.g. ``torch.device("cuda")``'s
    ``__torch_function__`` (torch/utils/_device.py) that Dynamo inlines around every call under
    that context; the site is where the user's code called into it.
    """
    t = tx
    while t is not None and t.f_code.co_filename.startswith(TORCH_DIR):
        t = getattr(t, "parent", None)
    return t if t is not None else tx


def _describe(tx: Any, var: Any, kind: str, options: dict) -> SyncSite:
    utx = _user_translator(tx)
    inst = utx.current_instruction
    code = utx.f_code
    positions = getattr(inst, "positions", None)
    line = (positions.lineno if positions is not None and positions.lineno else None) or getattr(
        inst, "starts_line", None
    ) or utx.lineno
    col = positions.col_offset if positions is not None and positions.col_offset is not None else 0
    node = var.as_proxy().node
    output = tx.output
    site = SyncSite(
        kind=kind,
        node=node,
        code=code,
        offset=inst.offset if inst.offset is not None else -1,
        file=code.co_filename,
        line=int(line),
        col=int(col),
        in_root_tracer=output.current_tracer is output.root_tracer,
        fullgraph=bool(getattr(tx, "one_graph", False)),
        options=options,
        frame_code=output.root_tx.f_code,
        occurrence=_later_twins(utx, inst),
        frame_locals=getattr(output.root_tx, "f_locals", None),
        tensor_class=(cls := _python_type(var)),
        direct_read=cls in PLAIN_READ_TYPES or _direct_call(utx, kind),
        _tx=tx,
    )
    site.leaves = [leaf for n in node.graph.find_nodes(op="placeholder") if (leaf := leaf_of(n)) is not None]
    site.frame_compile, site.frame_region = _frame_compile_index(site.frame_code)
    _guard_inlined_module_hooks(tx)
    return site


# the hook dicts Module._call_impl consults before it takes the plain path (the *_with_kwargs and
# *_always_called dicts only qualify hooks that are in these)
_MODULE_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_MODULE_CALL_NAMES = frozenset({"forward", "_call_impl", "_wrapped_call_impl", "__call__"})
_GLOBAL_HOOK_DICTS = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks",
                      "_global_backward_hooks")


def _inlined_modules(tx: Any) -> list[tuple[Optional[str], Any]]:
    """``(source, module)`` of each ``nn.Module`` *called* between the compiled frame and ``tx``:
    an inlined ``forward`` (or ``_call_impl``, where the module has hooks) whose first argument is a
    module other than the compiled frame's own; the source None for a module the frame does not
    reach from its inputs or globals (built in the step)."""
    def module_of(t: Any) -> tuple[Any, Any]:
        code = t.f_code
        vt = t.symbolic_locals.get(code.co_varnames[0]) if code.co_argcount else None
        # NOTE: read from the tracker's own attributes: ``value`` is a property on some trackers
        # (a list's evaluates it as a constant and raises for one holding tensors)
        own = vars(vt) if vt is not None and hasattr(vt, "__dict__") else {}
        mod = own.get("value")
        if not isinstance(mod, torch.nn.Module) and own.get("module_key") is not None:
            mod = t.output.get_submodule(own["module_key"])  # a module Dynamo specialised
        return (vt, mod) if isinstance(mod, torch.nn.Module) else (vt, None)

    mods = []
    t, root = tx, tx.output.root_tx
    _, root_mod = module_of(root)
    while t is not None and t is not root:
        vt, mod = module_of(t)
        # a module *called* (its forward, or _call_impl where it has hooks): a plain method call
        # (self.encode(x)) runs no hook in stock either; the compiled frame's own module runs its
        # hooks outside the frame
        if mod is not None and mod is not root_mod and t.f_code.co_name in _MODULE_CALL_NAMES:
            mods.append((_source_name(getattr(vt, "source", None)), mod))
        t = getattr(t, "parent", None)
    return mods


def _hook_state(d: Any) -> Optional[tuple]:
    """What the hook guard compares for one hook dict: () while empty, else its items (each hook's
    handle id and the hook: a hook added, removed or put in another's place changes them). None for
    something that is not a dict."""
    return tuple(d.items()) if isinstance(d, dict) else None


def _guard_inlined_module_hooks(tx: Any) -> None:
    """Guard the hook dicts of the modules whose call Dynamo inlines around a sync, and the global
    hook dicts: each must keep the hooks it had when traced (none, mostly).

    NOTE: stock Dynamo breaks the graph at the call of a module whose forward reaches a sync, and
    calls that module through ``Module.__call__``, which runs the hooks it has at that call (eager
    does too). nosync removes the break, so Dynamo inlines the module, and by default
    (``skip_nnmodule_hook_guards``) does not guard its empty hook dicts, nor the global ones: a
    hook added between requests was never run (review 19, helper 140). The dicts that had hooks
    are compared too: Dynamo guards them itself, but a guard filter (``keep_nosync_guards`` around
    ``skip_all_guards_unsafe``) drops those guards and keeps ours (helper 142). A module built in
    the step (no source) has no hooks of its own at a later call, but the global ones still run.
    One check per compile, growing as sites are traced; a failure recompiles, and the new trace
    inlines the hooks there are."""
    mods = _inlined_modules(tx)
    if not mods:
        return
    out = tx.output
    state = out.__dict__.get("_nosync_hook_guard")
    if state is None:
        import torch.nn.modules.module as module_py

        globals_ = [(d, _hook_state(d)) for d in (getattr(module_py, n, None) for n in _GLOBAL_HOOK_DICTS)
                    if _hook_state(d) is not None]
        entries: list[tuple[str, tuple]] = []  # (module source, ((hook dict name, its state), ...))
        state = out.__dict__["_nosync_hook_guard"] = (set(), entries)
        built: list = []  # at the first call, when every site of the compile has added its modules

        def check(L: Any, G: Any) -> bool:
            if not built:
                built.append(_hooks_unchanged(entries, globals_))
            if built[0](L, G):
                return True
            from .guards import _FAILURES

            # what the recompile reason says (the group's failure_reason reads it)
            check.failure = (next(_FAILURES), "nosync: a hook was added to or removed from a module called "
                             "around a hoisted sync, or a global module hook (stock calls such a module "
                             "across its graph break, running the hooks it has)")
            return False

        _install_guard(out, "module_hooks", check, "nosync: the hooks of each module inlined around a "
                       "hoisted sync (stock calls it eagerly, across the graph break), and the global module "
                       "hooks, are those it had when traced")
    seen, entries = state
    for src, m in mods:
        if src is not None and src not in seen:
            seen.add(src)
            dicts = tuple((n, st) for n in _MODULE_HOOK_DICTS if (st := _hook_state(m.__dict__.get(n))) is not None)
            entries.append((src, dicts))


def _source_cuts(src: str) -> list[int]:
    """Where ``src`` (a guard expression such as ``L['self']._modules['layers']._modules['0']``)
    can be cut into a prefix that is an expression itself: before each ``.`` or ``[`` outside
    brackets and quotes."""
    cuts, depth, quote, escaped = [], 0, None, False
    for i, ch in enumerate(src):
        if quote is not None:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch in "[(":
            if depth == 0 and ch == "[" and i > 0:
                cuts.append(i)
            depth += 1
        elif ch in "])":
            depth -= 1
        elif ch == "." and depth == 0:
            cuts.append(i)
    return cuts


def _hooks_unchanged(entries: list[tuple[str, tuple]], globals_: list[tuple[dict, tuple]]) -> Callable[[Any, Any], bool]:
    """One generated function: True while each module's hook dicts (by the module's source) and
    the global ones have the hooks they had when traced; False otherwise, or where a source no
    longer resolves. Sources sharing a prefix (the layers of one ModuleList) look it up once."""
    env = guard_env()
    # a variable for every prefix that two sources share, and for each source
    sources = {src for src, _ in entries}
    uses: dict[str, int] = {}
    for src in sources:
        for p in {src[:c] for c in _source_cuts(src) if not src[:c].isidentifier()} | {src}:  # not L or G
            uses[p] = uses.get(p, 0) + 1
    named = sorted((p for p, n in uses.items() if n > 1 or p in sources), key=len)
    var: dict[str, str] = {}
    lines = ["def check(L, G):", "    try:", "        pass"]
    for p in named:
        base = max((q for q in var if p.startswith(q) and p[len(q)] in ".["), key=len, default=None)
        var[p] = f"_m{len(var)}"
        lines.append(f"        {var[p]} = " + (var[base] + p[len(base):] if base is not None else p))
    for i, (src, dicts) in enumerate(entries):
        if not dicts:
            continue
        lines.append(f"        d = {var[src]}.__dict__")
        tests = []
        for n, st in dicts:
            if st:
                env[f"_k{i}_{n}"] = st
                tests.append(f"tuple(d[{n!r}].items()) != _k{i}_{n}")
            else:
                tests.append(f"d[{n!r}]")
        lines += ["        if " + " or ".join(tests) + ":", "            return False"]
    lines += ["    except Exception:", "        return False"]
    tests = []
    for j, (d, st) in enumerate(globals_):
        env[f"_g{j}"] = d
        if st:
            env[f"_gk{j}"] = st
            tests.append(f"tuple(_g{j}.items()) != _gk{j}")
        else:
            tests.append(f"_g{j}")
    lines.append("    return not (" + " or ".join(tests) + ")" if tests else "    return True")
    run_generated("\n".join(lines), env)  # sources are Dynamo guard expressions
    return env["check"]


def _later_twins(tx: Any, inst: Any) -> int:
    """How many instructions after ``inst`` have its opcode and source position.

    NOTE: counted from the end, so the count is the same in a resume function, which keeps the
    instructions from the resume point on (and prepends its own).
    """
    where = getattr(inst, "positions", None)
    if where is None or where.lineno is None:
        return 0
    at = (where.lineno, where.col_offset)
    insts = tx.instructions
    try:
        start = next(i for i, x in enumerate(insts) if x is inst)
    except StopIteration:
        return 0
    return sum(1 for x in insts[start + 1 :] if x.opname == inst.opname
               and (pos := getattr(x, "positions", None)) is not None and (pos.lineno, pos.col_offset) == at)


class CodeMap:
    """A mapping keyed by code objects' *identity*, holding them weakly (an entry goes with its
    code). Code objects compare equal by content (a ``code.replace()`` copy, functions exec'd from
    one text), but each is a frame of its own to Dynamo, with its own cache entries."""

    def __init__(self) -> None:
        self._d: dict[int, tuple[weakref.ref, Any]] = {}

    def _drop(self, k: int, ref: weakref.ref) -> None:
        e = self._d.get(k)
        if e is not None and e[0] is ref:  # not a newer code that took the same id
            self._d.pop(k, None)

    def setdefault(self, code: types.CodeType, default: Any) -> Any:
        k = id(code)
        e = self._d.get(k)
        if e is None or e[0]() is not code:
            e = self._d[k] = (weakref.ref(code, lambda r, k=k: self._drop(k, r)), default)
        return e[1]

    def get(self, code: types.CodeType, default: Any = None) -> Any:
        e = self._d.get(id(code))
        return e[1] if e is not None and e[0]() is code else default

    def items(self) -> list[tuple[types.CodeType, Any]]:
        return [(c, v) for r, v in list(self._d.values()) if (c := r()) is not None]

    def clear(self) -> None:
        self._d.clear()


# frame code (by identity, as Dynamo keeps its cache) -> {isolate_recompiles region: the compile ids
# of its compiles so far, in order}. NOTE: code objects compare equal by content (a ``code.replace()``
# copy, as benchmarks/ab.py's isolate makes), and equal copies counted as one frame reached the
# budget together (step_overhead.py: every nosync variant demoted, 2x the hoisted step).
_REGION_COMPILES = CodeMap()
_REGION_COMPILES_LOCK = threading.Lock()


def _frame_compile_index(code: Any) -> tuple[int, int]:
    """``(compiles of the frame before this one, region)``, counted in the ``isolate_recompiles``
    region compiled in (each ``verify_loop`` mode, each isolated ``torch.compile`` starts at 0):
    the compiles nosync saw there, failed ones included (a frame whose trace raises, a clamp bound
    the fake tensor refuses on torch 2.15, leaves no cache entry and is compiled again at every
    call), and at least the cache entries the region holds."""
    from torch._guards import CompileContext

    from ._torch_private import compiled_entries

    entries, region = compiled_entries(code)
    cid = str(CompileContext.current_compile_id())
    with _REGION_COMPILES_LOCK:
        seen = _REGION_COMPILES.setdefault(code, {}).setdefault(region, [])
        if cid not in seen:
            seen.append(cid)
        before = seen.index(cid)
    return max(before, entries or 0), region


def recompile_limit() -> int:
    import torch._dynamo.config as cfg

    return int(cfg.recompile_limit)  # named so since torch 2.7 (was cache_size_limit)


def _ask_policy(tx: Any, var: Any, kind: str) -> tuple[bool, Any, Optional[SyncSite]]:
    """(True, value, site) to hoist; (False, why_not, site) to leave it to stock Dynamo."""
    if getattr(_state, "in_stock", False):
        # NOTE: stock Dynamo's handler for a sync we declined can reach another hook for the same
        # instruction (its bool handler calls item); that is the same sync, already decided.
        return False, None, None
    options = _nosync_options(tx)
    if options is None:
        return False, None, None
    if not getattr(var, "is_tensor", lambda: False)():
        return False, None, None
    try:
        site = _describe(tx, var, kind, options)
    except Exception as e:
        _describe_failed(kind, options, e)
        return False, None, None
    _state.busy = True
    try:
        ok, value = _policy(site)  # type: ignore[misc]
    finally:
        _state.busy = False
    return ok, value, site


_warned: set = set()


def option(options: Any, name: str, default: Any) -> Any:
    """One option of a frame's raw nosync options (a dict, or backend.Options)."""
    return options.get(name, default) if isinstance(options, dict) else getattr(options, name, default)


def _describe_failed(kind: str, options: Any, exc: Exception) -> None:
    """A sync could not be described (a Dynamo internal moved): never a silent no-op."""
    strict = option(options, "strict", False)
    message = (f"nosync: could not describe a sync site ({kind}; {type(exc).__name__}: {exc}); "
               "it is left to stock Dynamo, not hoisted")
    if strict is True:
        from .errors import NosyncError

        err = NosyncError(message + " (options['strict'] is True)")
        err.__cause__ = exc
        raise_through_dynamo(err)
    if "describe" in _warned:
        log.debug(message, exc_info=True)
        return
    _warned.add("describe")
    log.warning("%s; later sites that fail the same way are logged at debug level", message,
                exc_info=True)


def reset() -> None:
    """Release every nosync guard (see release_guards) and re-arm the one-time warnings."""
    release_guards()
    _warned.clear()
    with _REGION_COMPILES_LOCK:
        _REGION_COMPILES.clear()  # compile ids start again after torch._dynamo.reset()


def _stock(site: Optional[SyncSite], why_not: Any, run: Callable[[], Any]) -> Any:
    """Run Dynamo's own handler; under fullgraph=True, replace its generic error with ours."""
    saved = getattr(_state, "in_stock", False)
    _state.in_stock = site is not None
    try:
        if site is None or not site.fullgraph or not why_not:
            return run()
        from torch._dynamo.exc import Unsupported

        try:
            return run()
        except Unsupported:
            unsupported(site, str(why_not))
    finally:
        _state.in_stock = saved


def _const(tx: Any, value: Any) -> Any:
    from torch._dynamo.variables import ConstantVariable

    if isinstance(value, list):
        from torch._dynamo.variables.lists import ListVariable

        return ListVariable([_const(tx, v) for v in value])
    return ConstantVariable.create(value)


# --------------------------------------------------------------------------------------------
# Guard installation and errors
# --------------------------------------------------------------------------------------------
class _GuardGroup:
    """All nosync checks of one compiled frame, run by a single epilogue lambda guard.

    Each hoisted site still installs its own ``Guard`` (so Dynamo's own bookkeeping, including
    rolling back guards of abandoned speculation, decides which sites survive), but their
    ``create_fn``s only add the site's check to this group; the first one emits one lambda guard
    that runs them all. One call from the guard manager per frame instead of one per site.
    """

    def __init__(self) -> None:
        self.checks: list[Callable[[Any, Any], bool]] = []
        self.descriptions: list[str] = []
        self.emitted: set[int] = set()
        # What the lambda guard calls (``group.run(L, G)``): built on the first call from the
        # checks installed by then (rebuilt when one is added), ``_fail_guard`` once released.
        self.run: Callable[[Any, Any], bool] = self._build
        self.ran = threading.local()  # .ok: the guard passed since the graph last ran (this thread)
        self.released = False
        self.released_checks = False
        self.managers: list = []  # weak refs to the CheckFunctionManagers that hold this group
        with _GROUPS_LOCK:
            _GROUPS[id(self)] = self

    def release(self) -> None:
        """Let go of every check (and what they hold); the guard fails from now on."""
        self.released = True
        # what require_guard must still refuse to run unguarded: a group that guarded something
        self.released_checks = self.released_checks or bool(self.checks)
        self.checks, self.descriptions = [], []
        self.run = _fail_guard

    def __call__(self, L: Any, G: Any) -> bool:
        return self.run(L, G)

    def _build(self, L: Any, G: Any) -> bool:
        run = self.run = self._fused()
        return run(L, G)

    def _failed(self) -> bool:
        """Log why the guard failed (the check that failed recorded it); False."""
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s; hoisted here: %s", self.failure_reason(), "; ".join(self.descriptions))
        return False

    def failure_reason(self) -> str:
        """Why the last call failed: the newest failure a check recorded (see SiteCheck._fail)."""
        if self.released:
            return "nosync: the guards were released by a reset"
        marks = [m for m in (getattr(c, "failure", None) for c in self.checks) if m is not None]
        return max(marks)[1] if marks else "nosync: a leaf of a hoisted sync no longer resolves"

    def _fused(self) -> Callable[[Any, Any], bool]:
        """The guard's function: True (and the token left, see require_guard) when every check
        passes; False (logged) otherwise."""
        if self.released:
            return _fail_guard
        # Checks that know how to run together (guards.SiteCheck.fuse) share one leaf lookup and
        # a fast path; anything else runs one after the other.
        # (a frame with hoisted sites and lifted tables fuses each kind of check separately).
        by_type: dict[type, list] = {}
        for c in self.checks:
            by_type.setdefault(type(c), []).append(c)
        ran, failed = self.ran, self._failed
        if len(by_type) == 1:
            (cls, checks), = by_type.items()
            fuse = getattr(cls, "fuse", None)
            if fuse is not None:  # one generated function: it leaves the token itself
                return fuse(checks, ran, failed)
        runners = []
        for cls, checks in by_type.items():
            fuse = getattr(cls, "fuse", None)
            # (each part's own token and failure go nowhere: ``run`` below leaves the token)
            runners.append(fuse(checks, types.SimpleNamespace(), _false) if fuse is not None else _all_of(checks))

        def run(L: Any, G: Any) -> bool:
            for r in runners:
                if not r(L, G):
                    return failed()
            ran.ok = True
            return True

        return run

    def create_fn(self, check: Callable, description: str) -> Callable[[Any, Any], None]:
        def create(builder: Any, guard: Any) -> None:
            self.checks.append(check)
            self.descriptions.append(description)
            self.run = self._build
            if id(builder) in self.emitted:
                return
            self.emitted.add(id(builder))
            manager = getattr(builder, "check_fn_manager", None)
            if manager is not None:
                self.managers.append(weakref.ref(manager))
            name = f"___nosync_guards_{id(self):x}"
            # NOTE: with more than one verbose part, Dynamo evaluates each part to find the
            # recompile reason and reports the first string one: the first part asks this group
            # why it failed (a value changed, or a site was demoted); the second is the fallback.
            builder.add_python_lambda_leaf_guard_to_root(
                [f"{name}.run(L, G)"],
                [f"__import__({__name__!r}, fromlist=['_']).failure_reason({id(self)})",
                 f"nosync: a hoisted check failed (first site: {description})"],
                closure_vars={name: self},
            )

        return create


# Note [A guard nobody can drop silently]
# A caller can drop Dynamo's guards: torch.compile(options={"guard_filter_fn": ...}) (serving
# engines drop them all), which removes nosync's guard with the rest, and a hoisted branch would
# then be taken for every later request, silently. The nosync guard of a frame therefore leaves a
# token each time it passes, and the compiled graph of that frame (wrapped by :func:`require_guard`)
# takes the token before it runs: a graph that runs twice without its guard having passed in
# between raises NosyncError instead of serving a hoisted value unchecked. The first run after a
# compile needs no token: Dynamo runs a fresh graph on the very inputs the values were taken from.
GUARD_NAME_PREFIX = "__nosync_"


def is_nosync_guard(entry: Any) -> bool:
    """Is this ``guard_filter_fn`` entry (a GuardFilterEntry) nosync's guard?"""
    return GUARD_NAME_PREFIX in str(getattr(entry, "name", ""))


def traced_submodule(name: str) -> Any:
    """The module a ``get_attr`` node of the graph Dynamo is tracing names (a higher-order op's
    subgraph: Dynamo keeps them in its output graph until it builds the GraphModule, so the node's
    graph has no owning module yet); None outside a trace or for an unknown name."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    try:
        return InstructionTranslator.current_tx().output.nn_modules.get(name)
    except Exception:  # not inside a trace
        return None


def require_guard(compiled: Callable, merge: Optional[Callable[..., Optional[Callable]]] = None) -> Callable:
    """Wrap the graph being compiled so that it refuses to run when its nosync guard was dropped.

    Returns ``compiled`` itself when nothing was hoisted in this frame. ``merge(compiled, ran,
    unguarded)``, when given and not None, is used instead of the wrapper: ``compiled`` with the
    same check built in (take ``ran.ok``, else call ``unguarded()``, which raises).
    """
    from torch._dynamo.symbolic_convert import InstructionTranslator

    try:
        output = InstructionTranslator.current_tx().output
    except Exception:  # not inside a trace (a backend called directly)
        return compiled
    group = output.__dict__.get("_nosync_guard_group")
    if group is None:
        return compiled
    ran = group.ran
    ran.ok = True

    def unguarded() -> None:
        """The graph is about to run without its guard having passed since it last ran."""
        # NOTE: a group whose guards Dynamo rolled back (abandoned speculation) has no checks and
        # nothing hoisted to protect; a released one (torchsync_pass.reset()) has no checks left
        # either, but still its hoisted values
        if group.checks or group.released_checks:
            from .errors import NosyncError

            what = ("; ".join(group.descriptions[:3]) if group.checks
                    else "its checks were released by torchsync_pass.reset()")
            raise NosyncError(
                "nosync: a compiled graph ran without its nosync guard, so a hoisted value ("
                + what + ") would be used unchecked. A guard_filter_fn "
                "passed in torch.compile(..., options={'guard_filter_fn': ...}) dropped it (or guard "
                "evaluation was skipped). Keep nosync's guard in the filter with "
                "torchsync_pass.keep_nosync_guards(your_filter), or compile without nosync."
            )

    if merge is not None:  # ``compiled`` takes the token in its own code: one Python frame less per step
        merged = merge(compiled, ran, unguarded)
        if merged is not None:
            return merged

    def run(*args: Any) -> Any:
        if not getattr(ran, "ok", False):
            unguarded()
        ran.ok = False
        return compiled(*args)

    run._boxed_call = getattr(compiled, "_boxed_call", False)  # type: ignore[attr-defined]
    return run
def _fail_guard(L: Any, G: Any) -> bool:
    return False


def _false() -> bool:
    return False


# NOTE [Guards outlive torch._dynamo.reset()]: Dynamo keeps a frame's CheckFunctionManager, and
# with it the C++ guard manager and the closures of its lambda guards, alive after
# torch._dynamo.reset(): weakref.finalize callbacks on objects that never die (classes, modules,
# builtins) hold it. Python's GC cannot see into the C++ lambda guard, so whatever a nosync guard
# references would live for the rest of the process. Each group is therefore released when nosync
# resets: the closure keeps an empty group, and the checks, cones and memos are freed.
_GROUPS: "weakref.WeakValueDictionary[int, _GuardGroup]" = weakref.WeakValueDictionary()
# taken to add a group (a compile, any thread) and to list them: a WeakValueDictionary's iteration
# is Python code, which another thread's insertion breaks ("dictionary changed size")
_GROUPS_LOCK = threading.Lock()


def _groups() -> list:
    with _GROUPS_LOCK:
        return list(_GROUPS.values())


def entries_of(checks: list) -> list[list]:
    """``checks`` grouped by the cache entry (the guard group) each belongs to: what one entry
    needs to pass at once. A check in no live group, or in an entry with a demoted site, is left
    out."""
    ids = {id(c) for c in checks}
    out = []
    for group in _groups():
        members = [c for c in group.checks if id(c) in ids]
        # an entry holding a demoted site's check fails every later call (the site went back to
        # stock Dynamo): it serves nothing, whatever its other checks answer
        if members and not any(getattr(getattr(c, "state", None), "demoted", None) is not None
                               for c in group.checks):
            out.append(members)
    return out


def compile_lock() -> Any:
    """Dynamo's lock around compiling a frame (a re-entrant lock), or a null context where this
    torch has none: held while nosync's state is reset, so that no frame is between its guards'
    creation and Dynamo's check of them on its own inputs (a released group fails that check, which
    Dynamo reports as its own bug)."""
    import contextlib

    from torch._dynamo import convert_frame

    lock = getattr(convert_frame, "compile_lock", None)
    return lock if lock is not None else contextlib.nullcontext()


def release_guards() -> None:
    """Release every nosync guard installed so far (see Note [Guards outlive torch._dynamo.reset()])."""
    for group in _groups():
        group.release()


def forget_guard_managers() -> None:
    """Right after ``torch._dynamo.reset()``: let the guard managers of nosync frames be freed.

    NOTE: see Note [Guards outlive torch._dynamo.reset()]. What keeps a CheckFunctionManager alive
    is the ``weakref.finalize(obj, manager.invalidate)`` Dynamo registers for each object it guards
    by identity; for classes, modules and builtins it never runs. After a reset the manager's cache
    entry is gone, so invalidating it has nothing left to do: the finalizers of the managers that
    hold a nosync guard are detached, and the whole guard tree (a frame of a 40-layer model is
    about a megabyte of it) is freed. Only on a Dynamo reset: while the cache entries live, the
    finalizers are what keeps an entry from matching a new object at a freed address.
    """
    managers = []
    for group in _groups():
        managers += [m for m in (ref() for ref in group.managers) if m is not None]
        group.managers = []
    if not managers:
        return
    ours = {id(m) for m in managers}
    for fin in list(getattr(weakref.finalize, "_registry", {})):
        info = fin.peek()
        fn = info[1] if info is not None else None
        fn = getattr(fn, "func", fn)  # functools.partial(manager.invalidate, obj_str=...)
        if id(getattr(fn, "__self__", None)) in ours:
            fin.detach()


# (number, compile id, resets of Dynamo so far, reason) of the nosync guards Dynamo asked why they failed, during the
# compile that followed: Dynamo's compilation metrics keep only the first cache entry's reason
# (review 23: after a thread-count entry, a hoisted value's change was reported as "GLOBAL_STATE
# changed"). explain reads them (:func:`recompile_reasons`); bounded, the newest kept.
_REASONS: "collections.deque[tuple[int, str, int, str]]" = collections.deque(maxlen=4096)
_REASON_NUMBERS = itertools.count(1)


def failure_reason(group_id: int) -> str:
    """Dynamo's recompile reason for a failed nosync guard (evaluated by Dynamo on a recompile)."""
    try:
        group = _GROUPS.get(group_id)
        reason = group.failure_reason() if group is not None else "nosync: the guards were released by a reset"
    except Exception:  # never break Dynamo's reporting
        return "nosync: a hoisted check failed"
    try:
        from . import _torch_private

        cid = current_compile_id()
        if cid is not None:
            _REASONS.append((next(_REASON_NUMBERS), cid, _torch_private.dynamo_resets(), reason))
    except Exception:
        pass
    return reason


def recompile_reasons(after: int = 0) -> list[tuple[str, int, str]]:
    """The nosync guard failures Dynamo asked about, ``(compile id of the recompile, resets of
    Dynamo before it, reason)``, recorded after the ``after``-th (:func:`recompile_reason_mark`
    before a run)."""
    return [(cid, resets, r) for n, cid, resets, r in list(_REASONS) if n > after]


def recompile_reason_mark() -> int:
    """The number of the last recorded failure (0: none yet)."""
    return _REASONS[-1][0] if _REASONS else 0


def _all_of(checks: list) -> Callable[[Any, Any], bool]:
    return lambda L, G: all(c(L, G) for c in checks)


def add_lambda_guard(site: SyncSite, check: Callable[[Any, Any], bool], description: str) -> None:
    """Guard the frame being traced with ``check(L, G) -> bool`` (an epilogue guard).

    Epilogue guards run after every other guard passed. ``check`` must catch its own errors (a
    leaf source that no longer resolves) and answer False.
    """
    _install_guard(site._tx.output, f"{site.code.co_name}_{site.offset}", check, description)


def _install_guard(output: Any, name: str, check: Callable[[Any, Any], bool], description: str) -> None:
    from torch._dynamo.guards import install_guard
    from torch._dynamo.source import GlobalSource
    from torch._guards import Guard

    group = output.__dict__.get("_nosync_guard_group")
    if group is None:
        group = output.__dict__["_nosync_guard_group"] = _GuardGroup()
    # The source only names the guard; the check itself reads its leaves from L and G.
    install_guard(Guard(GlobalSource(f"{GUARD_NAME_PREFIX}{name}"), group.create_fn(check, description)))


def shares_storage(these: Any, those: Any) -> bool:
    """Does a tensor of ``these`` share its storage with a tensor of ``those`` (others ignored)? A
    wrapper subclass (``TwoTensor``, whose own storage cannot be read) by the tensors it holds."""
    # NOTE: storages of no bytes share nothing (every empty storage's pointer is 0)
    ptrs = {p for t in those for p in _storage_ptrs(t)}
    return any(p in ptrs for t in these for p in _storage_ptrs(t))


def may_share_storage(these: Any, those: Any) -> bool:
    """:func:`shares_storage`, True where it cannot tell (a caller then takes the path that is right
    either way: the unsplit graph, a failed guard)."""
    try:
        return shares_storage(these, those)
    except Exception:
        return True


def _storage_ptrs(t: Any, depth: int = 0) -> list[int]:
    if not isinstance(t, torch.Tensor):
        return []
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if is_traceable_wrapper_subclass(t) and depth < 8:
        return [p for a in t.__tensor_flatten__()[0] for p in _storage_ptrs(getattr(t, a), depth + 1)]
    s = t.untyped_storage()
    return [s.data_ptr()] if s.nbytes() else []


def guard_env() -> dict:
    """The names Dynamo's guard expressions (a leaf's source, ``L['self']._buffers['b']``) may use,
    for code generated to evaluate them at guard time (a fresh dict: the caller may add to it)."""
    from torch._dynamo.guards import _get_closure_vars

    return dict(_get_closure_vars())


_ITEM_SOURCE = re.compile(r"^(.+)\[(\d+)\]$")


def leaf_getter(sources: list[str]) -> Callable[[Any, Any], tuple]:
    """Compile ``lambda L, G: (src1, src2, ...)`` for guard-time leaf lookup.

    Items of one container (``L['self'].table[0]``, ``L['self'].table[1]``, ...: a list table's
    rows, read at every call) look the container up once."""
    counts: dict[str, int] = {}
    for s in sources:
        m = _ITEM_SOURCE.match(s)
        if m:
            counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    shared = {prefix: f"_c{i}" for i, prefix in enumerate(p for p, n in counts.items() if n > 1)}
    items = []
    for s in sources:
        m = _ITEM_SOURCE.match(s)
        items.append(f"{shared[m.group(1)]}[{m.group(2)}]" if m and m.group(1) in shared else s)
    lines = ["def get(L, G):"]
    lines += [f"    {name} = {prefix}" for prefix, name in shared.items()]
    lines.append(f"    return ({', '.join(items)}{',' if items else ''})")
    env = guard_env()  # a fresh dict each call
    run_generated("\n".join(lines), env)  # sources are Dynamo guard expressions
    return env["get"]


def unsupported(site: SyncSite, message: str) -> None:
    """Raise Dynamo's graph-break exception with our own message (for fullgraph=True)."""
    from torch._dynamo.exc import unimplemented

    unimplemented(
        gb_type="nosync: sync could not be hoisted",
        context=f"{site.file}:{site.line}: {site.source_line}",
        explanation=message,
        hints=[_hint_for(message)],
    )


def _hint_for(message: str) -> str:
    """What may let nosync hoist the sync, by the reason it did not."""
    if "symbolic" in message:  # declaring changes nothing: the cone has no concrete sizes to run at
        return ("Compile with dynamic=False (or torch._dynamo.mark_static on the input) so the sync's "
                "inputs have concrete sizes, or move the sync out of the compiled step.")
    return ("Declare the request-invariant inputs with options={'invariant': [...]}, "
            "or move the sync out of the compiled step.")


_PASSTHROUGH: dict[type, type] = {}


def is_restart_signal(exc: BaseException) -> bool:
    """Is ``exc`` Dynamo's signal to trace the frame again (``RestartAnalysis``: Inductor's AOT pass
    raises ``TensorifyScalarRestartAnalysis`` to have a float specialised), which a backend must
    let through rather than treat as a codegen failure?"""
    from torch._dynamo.exc import RestartAnalysis

    return isinstance(exc, RestartAnalysis)


def raise_through_dynamo(exc: BaseException) -> "NoReturn":
    """Raise ``exc`` so that it reaches the caller of the compiled function as itself.

    Dynamo re-wraps most exceptions raised while it traces (``InternalTorchDynamoError``) or while
    a backend compiles (``BackendCompilerFailed``), so the type a user sees would depend on where
    the error was found. Exceptions deriving from ``ShortenTraceback`` pass through both paths
    unchanged; re-raise ``exc`` as a subclass of both its own type and that one.
    """
    from torch._dynamo.exc import ShortenTraceback, TorchDynamoException

    cls = type(exc)
    sub = _PASSTHROUGH.get(cls)
    if sub is None:
        sub = type(cls.__name__, (cls, ShortenTraceback), {"__module__": cls.__module__})
        _PASSTHROUGH[cls] = sub
    new = sub.__new__(sub, *exc.args)
    Exception.__init__(new, *exc.args)
    # the attributes TorchDynamoException.__init__ sets (frame_exec_strategy: Dynamo reads it where
    # config.suppress_errors turns the error into a skipped frame; missing, it raised AttributeError)
    for name, value in vars(TorchDynamoException()).items():
        new.__dict__.setdefault(name, value)
    new.first_useful_frame = None
    raise new.with_traceback(exc.__traceback__) from exc.__cause__


def caching_precompile_on() -> bool:
    """Does Dynamo save and load whole compiled frames (``torch._dynamo.config.caching_precompile``,
    ``TORCH_CACHING_PRECOMPILE=1``)? False where this torch has no such setting."""
    from torch._dynamo import config

    return bool(getattr(config, "caching_precompile", False))


def _probe_config() -> Any:
    """Dynamo's own config as a fresh session has it, and no whole-frame cache, for the self-test:
    it asks whether the hooks fire on this torch, which the caller's settings must not decide (a
    ``config.patch(assume_static_by_default=False)`` around the first compile made the probes trace
    their ints as symbols, and the pass turned itself off for the whole process). Every setting
    whose value differs from its default is set back for the probes (entries that are aliases of
    others, deprecated, or without a plain default are left alone)."""
    import contextlib

    from torch._dynamo import config

    changes: dict[str, Any] = {}
    for name, entry in (getattr(config, "_config", None) or {}).items():
        default = getattr(entry, "default", None)
        if getattr(entry, "alias", None) or getattr(entry, "deprecated", False) or type(default) is object:
            continue
        try:
            if getattr(config, name) != default:
                changes[name] = default
        except Exception:  # a setting that cannot be read or compared: left as it is
            continue
    if hasattr(config, "caching_precompile"):
        changes["caching_precompile"] = False  # traced here, never loaded from a saved cache
    return config.patch(changes) if changes else contextlib.nullcontext()


def in_aot_compile() -> bool:
    """Is the backend being called by ``torch.compile(...).aot_compile`` (a capture to be saved,
    outside Dynamo's trace of a running frame)?"""
    f = sys._getframe(1)
    for _ in range(64):
        if f is None:
            return False
        if f.f_code.co_name == "aot_compile_fullgraph" and f.f_globals.get("__name__", "").startswith("torch._dynamo"):
            return True
        f = f.f_back
    return False


def _current_tx() -> Any:
    """The instruction translator Dynamo is running on this thread, or None: outside a trace
    (a backend called directly, ``torch.compile(...).aot_compile``), ``current_tx`` raises where
    no translator ever ran on the thread and returns None after one ran."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    try:
        return InstructionTranslator.current_tx()
    except AttributeError:
        return None


def current_frame() -> tuple[Any, Any]:
    """``(code, real locals)`` of the frame Dynamo is compiling, or ``(None, None)`` outside a trace."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    try:
        root = InstructionTranslator.current_tx().output.root_tx
    except Exception:  # not inside a trace (a backend called directly)
        return None, None
    return getattr(root, "f_code", None), getattr(root, "f_locals", None)


def current_frame_globals() -> Any:
    """The globals of the frame Dynamo is compiling, or None outside a trace."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    try:
        return InstructionTranslator.current_tx().output.root_tx.f_globals
    except Exception:  # not inside a trace (a backend called directly)
        return None


def current_compile_id() -> Optional[str]:
    from torch._guards import CompileContext

    cid = CompileContext.current_compile_id()
    return None if cid is None else str(cid)


def graph_break_context(gm: torch.fx.GraphModule) -> Optional[str]:
    """Why ``gm`` is not a whole step, or None: it ends at a graph break, or it is the graph of a
    resume function (the code after an earlier break)."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    if reason is None:
        return None
    for frame in getattr(reason, "user_stack", None) or ():
        if RESUME_RE.match(str(getattr(frame, "name", ""))):
            return f"it resumes after a graph break ({frame.filename}:{frame.lineno})"
    if getattr(reason, "graph_break", False):
        where = reason.user_stack[-1] if reason.user_stack else None
        at = f" at {where.filename}:{where.lineno}" if where is not None else ""
        first = str(reason.reason).strip().splitlines()[0] if reason.reason else "graph break"
        return f"it ends at a graph break{at}: {first}"
    return None


def compiling() -> bool:
    """True while Dynamo compiles a frame in this thread (it evaluates new guards then too)."""
    ctx = _compile_context_try_get()
    return ctx is not None and ctx.compile_id is not None


def _compile_context_try_get() -> Any:
    global _compile_context_try_get
    from torch._guards import CompileContext

    _compile_context_try_get = CompileContext.try_get  # bind once: this runs in every guard
    return CompileContext.try_get()


# --------------------------------------------------------------------------------------------
# The hooks
# --------------------------------------------------------------------------------------------
# NOTE [Hook table per release]: the TensorVariable attribute that implements each sync kind, per
# torch release (the row of the newest release not newer than the running torch; an experiment
# with TORCHSYNC_PASS_ANY_TORCH=1 outside the range takes the nearest row). None: that release has
# no hook point of its own for the kind.
# - 2.11: BuiltinVariable.call_bool/call_int/call_float call Tensor.item(), so bool(t), int(t) and
#   float(t) reach the "item" hook (which names them bool/int/float, see _builtin_caller_kind), and
#   operator.index(t) (range(t), seq[t] with a 0-d int tensor) has no hook: it stays a stock graph
#   break and a sync at every call, and is never hoisted.
# - 2.12, 2.13: one hook per kind; bool() is ``bool_impl``.
# - 2.14, 2.15: bool() is ``nb_bool_impl``, and call_method dispatches through the class-level
#   ``tp_methods`` table, whose entries are replaced too (see _replace_tp_method).
_HOOKS_2_12 = {"item": "method_item", "tolist": "method_tolist", "bool": "bool_impl",
               "int": "nb_int_impl", "float": "nb_float_impl", "index": "nb_index_impl"}
HOOK_TABLE: dict[tuple[int, int], dict[str, Optional[str]]] = {
    (2, 11): {"item": "method_item", "tolist": "method_tolist", "bool": None, "int": None,
              "float": None, "index": None},
    (2, 12): _HOOKS_2_12,
    (2, 13): _HOOKS_2_12,
    (2, 14): {**_HOOKS_2_12, "bool": "nb_bool_impl"},
    (2, 15): {**_HOOKS_2_12, "bool": "nb_bool_impl"},
}
_METHOD_HOOKS = HOOK_TABLE[(2, 13)]  # the kinds, in hook order


def hook_row(version: Optional[tuple[int, ...]] = None) -> dict[str, Optional[str]]:
    """The HOOK_TABLE row for ``version`` (default: the running torch)."""
    ver = tuple(version or _torch_version())[:2]
    older = [r for r in HOOK_TABLE if r <= ver]
    return HOOK_TABLE[max(older) if older else min(HOOK_TABLE)]


def _method_attr(kind: str) -> Optional[str]:
    """The hook point of ``kind`` on the running torch; None where its release has none."""
    from torch._dynamo.variables.tensor import TensorVariable

    attr = hook_row()[kind]
    if attr is None or hasattr(TensorVariable, attr):
        return attr
    # a release between table rows may have renamed it: try the other rows' names
    for other in dict.fromkeys(row[kind] for row in HOOK_TABLE.values()):
        if other is not None and hasattr(TensorVariable, other):
            return other
    raise AttributeError(f"TensorVariable has no attribute {attr!r} (hook point of {kind})")


def _torch_version() -> tuple[int, ...]:
    return tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


def _builtin_caller_kind(depth: int = 6) -> str:
    """On torch 2.11 (no hook point for bool/int/float, see HOOK_TABLE) Dynamo's
    ``BuiltinVariable.call_bool``/``_call_int_float`` trace ``bool(t)``/``int(t)``/``float(t)`` as
    ``t.item()``: name the sync as the user wrote it. "item" everywhere else."""
    if hook_row()["int"] is not None:
        return "item"
    f = sys._getframe(2)
    for _ in range(depth):
        if f is None:
            break
        name = f.f_code.co_name
        if name == "call_bool":
            return "bool"
        if name == "_call_int_float":
            return "float" if getattr(f.f_locals.get("self"), "fn", None) is float else "int"
        f = f.f_back
    return "item"


def _make_method_hook(attr: str, kind: str, original: Callable) -> Callable:
    @functools.wraps(original)
    def hook(self: Any, tx: Any, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs:
            return original(self, tx, *args, **kwargs)
        # >>> device-side rewrite hook point (issue 13, see "Device-side rewrites" below)
        rewritten, not_rewritten = _try_rewrite(tx, self, kind)
        if rewritten is not None:
            return rewritten
        # <<<
        ok, value, site = _ask_policy(tx, self, _builtin_caller_kind() if kind == "item" else kind)
        if ok:
            return _const(tx, value)
        if not_rewritten is not None and site is not None and _rewriter is not None:
            _rewriter.kept(site, *not_rewritten)  # the sync stays: say why it was not rewritten
        return _stock(site, value, lambda: original(self, tx))

    hook.__nosync_hook__ = True  # type: ignore[attr-defined]
    return hook


# --------------------------------------------------------------------------------------------
# Device-side rewrites (issue 13): a step-varying read used only as an index
# --------------------------------------------------------------------------------------------
# NOTE [Rewriting a read used as an index]: ``table[t.item()]`` / ``table[int(t)]`` reads ``t`` to
# the host only to index ``table``. When the instruction after the read's CALL is the
# BINARY_SUBSCR that consumes it, and the subscripted object (then on top of the translator's
# stack) is a tensor or a list/tuple of tensors of one shape, dtype and device, the hook traces
# ``aten.index(table, [t])`` (``torch.stack(list)`` first for a list) instead, pops the table off
# the stack and skips the BINARY_SUBSCR: the CALL pushes the gathered row, exactly what the
# subscript would have pushed. aten.index on a 0-d index wraps negative indices like Python and
# raises IndexError out of range (a device-side assert on CUDA), and copies the row's bits. The
# rewrite policy (:mod:`torchsync_pass.rewrite`) may refuse a site (a graph it was rewritten in
# aliased the row, see restart_analysis): the read then takes the ordinary path.
_rewriter: Any = None  # torchsync_pass.rewrite (set by install_rewriter)
REWRITE_META = "nosync_rewrite"  # node.meta key: the RewriteUse of a gather / a stacked table
MAX_LIST_TABLE = 4096  # tensors in a list table, at most (each one becomes a graph input)
_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


@dataclass(frozen=True)
class RewriteUse:
    """A read used as an index, as plain data for the rewrite policy."""

    form: str  # "tensor" (index into a tensor) or "list" (into a list/tuple of tensors)
    table: str  # the table's user source, e.g. "L['self'].table"
    length: int  # entries along the indexed dimension
    # filled by the policy: the site (key, location, kind, source line, function) for its records
    site_key: tuple = ()
    site: Any = None
    kind: str = ""
    source: str = ""
    code: str = ""


def install_rewriter(rewriter: Any) -> None:
    """Let ``rewriter`` (an object with ``allow(site, use)`` and ``kept(site, reason, detail)``)
    decide the reads used as an index. None switches the rewrite off."""
    global _rewriter
    _rewriter = rewriter


# NOTE: from torch 2.14 Dynamo's int()/operator.index() (object_protocol.pynumber_int/_index) check
# that the hook returned a Python int, as CPython does, and raise TypeError for a tensor: there only
# ``.item()`` reads are rewritten, int()/operator.index() keep the ordinary path.
_CHECKS_INT_RESULT = ("pynumber_int", "pynumber_index")


def int_reads_rewritable() -> bool:
    """Whether ``table[int(t)]`` can be rewritten on the running torch (``.item()`` always can): 2.11
    traces int(t) as ``t.item()`` called by Dynamo itself, 2.14+ check int()'s result (above)."""
    try:
        from torch._dynamo.variables import object_protocol
    except ImportError:
        object_protocol = None
    return hook_row()["int"] is not None and not any(
        hasattr(object_protocol, name) for name in _CHECKS_INT_RESULT)


def _direct_call(tx: Any, kind: str) -> bool:
    """Is the instruction being traced the read itself (``t.item()``, ``t.tolist()``, ``int(t)``,
    ``operator.index(t)``), so that its result is the read's value?"""
    inst = tx.current_instruction
    if inst.opname != "CALL":
        return False
    if kind in ("item", "tolist"):
        i = next((k for k, x in enumerate(tx.instructions) if x is inst), None)
        prev = tx.instructions[i - 1] if i else None
        # (Dynamo 2.15 on Python 3.12 spells a method call LOAD_ATTR, PUSH_NULL, SWAP 2, CALL)
        while prev is not None and prev.opname in ("PRECALL", "KW_NAMES", "PUSH_NULL", "SWAP") and i > 1:
            i -= 1
            prev = tx.instructions[i - 1]
        return inst.arg == 0 and prev is not None and prev.opname in ("LOAD_METHOD", "LOAD_ATTR") \
            and prev.argval == kind
    want = {"int": int, "index": operator.index}.get(kind)
    if want is None or inst.arg != 1:
        return False
    # the builtin being called: the nearest BuiltinVariable.call_function of this translator
    f = sys._getframe(2)
    for _ in range(16):
        if f is None or f.f_code.co_name in _CHECKS_INT_RESULT:
            return False
        loc = f.f_locals
        if f.f_code.co_name == "call_function" and loc.get("tx") is tx:
            fn = getattr(loc.get("self"), "fn", None)
            return type(loc.get("self")).__name__ == "BuiltinVariable" and fn is want
        f = f.f_back
    return False


_USE_WORDS = {"CALL": "passed to a call (a shape, a print, a Python function)", "PRECALL": "passed to a call",
              "BINARY_OP": "used in arithmetic", "COMPARE_OP": "compared", "STORE_FAST": "stored in a local",
              "STORE_ATTR": "stored in an attribute", "RETURN_VALUE": "returned", "POP_TOP": "discarded",
              "FORMAT_VALUE": "formatted as text"}


def _index_use(tx: Any, var: Any, kind: str) -> tuple[Any, Any]:
    """(table variable, RewriteUse) when the read is used only as an index into a tensor or a list
    of tensors, else (None, (reason name, detail)) saying why not, or (None, None) when the read is
    not an integer read this rewrite is about."""
    ex = var.as_proxy().node.meta.get("example_value")
    if not isinstance(ex, torch.Tensor) or ex.dtype not in _INT_DTYPES or kind not in ("item", "int", "index"):
        return None, None
    if any(not isinstance(d, int) for d in ex.shape) or ex.numel() != 1:
        return None, ("REWRITE_OTHER_USE", "the index tensor has symbolic or non-scalar size")
    key_problem = _key_problem(var, ex)
    if key_problem is not None:
        return None, ("REWRITE_OTHER_USE", key_problem)
    if _user_translator(tx) is not tx or not _direct_call(tx, kind):
        int_read = kind == "int" or _builtin_caller_kind() == "int"  # (2.11 traces int(t) as t.item())
        return None, ("REWRITE_OTHER_USE", "the read is not a direct .item()/int() call in user code"
                      + ("" if int_reads_rewritable() or not int_read else
                         f"; on torch {torch.__version__.split('+')[0]} int(t) is not rewritten: index with t.item()"))
    if tx.output.current_tracer is not tx.output.root_tracer:
        return None, ("REWRITE_OTHER_USE", "the read sits in a nested tracer")
    nxt = tx.instructions[tx.instruction_pointer] if tx.instruction_pointer is not None else None
    why = user_handler(tx, nxt) if nxt is not None else None
    if why is not None:  # an index out of range would raise inside the graph
        return None, ("REWRITE_OTHER_USE", why)
    if nxt is None or nxt.opname != "BINARY_SUBSCR" or not tx.stack:
        name = "" if nxt is None else nxt.opname
        words = _USE_WORDS.get(name, f"used in an expression (next instruction: {name})")
        return None, ("REWRITE_OTHER_USE", f"the value is {words}")
    table = tx.stack[-1].realize()
    src = _source_name(getattr(table, "source", None)) or "<a value built in the step>"
    if table.is_tensor():
        problem = _tensor_table_problem(table, src, ex.device)
        if problem is not None:
            return None, ("REWRITE_TABLE", problem)
        return table, RewriteUse("tensor", src, int(table.as_proxy().node.meta["example_value"].shape[0]))
    if type(table).__name__ not in ("ListVariable", "TupleVariable"):
        return None, ("REWRITE_TABLE", f"{src} is a {table.python_type_name()}, not a tensor or a list of tensors")
    items = table.items
    if not 0 < len(items) <= MAX_LIST_TABLE:
        return None, ("REWRITE_TABLE", f"{src} has {len(items)} entries (1..{MAX_LIST_TABLE} are rewritten)")
    # NOTE: checked on the real values before any item is realized (realizing makes each tensor a
    # graph input with its guards, which a list that is not rewritten must not get), then again on
    # the traced values
    for realize in (False, True):
        metas = set()
        for item in items:
            if not realize and not item.is_realized():
                iex = item.peek_value()
            else:
                item = item.realize()
                iex = item.as_proxy().node.meta.get("example_value") if item.is_tensor() else None
            if not isinstance(iex, torch.Tensor) or not all(isinstance(d, int) for d in iex.shape):
                return None, ("REWRITE_TABLE", f"{src} holds something other than tensors of static size")
            real = iex if not realize else _real_tensor(item)
            if real is not None and not _torch_private_is_fake(real) and _python_differs(real):
                return None, ("REWRITE_TABLE", f"a tensor of {src} is a {type(real).__name__} or has a .grad or "
                              "Python attributes: eager's row is that object, a gathered row a plain copy")
            if iex.numel() == 0:
                return None, ("REWRITE_TABLE", f"the tensors of {src} have no elements: {_EMPTY_ROWS}")
            metas.add((tuple(iex.shape), iex.dtype, iex.device,
                       tuple(iex.stride()) == _contiguous_strides(iex.shape)))
        meta = next(iter(metas)) if len(metas) == 1 else None
        if meta is None or not meta[3]:
            return None, ("REWRITE_TABLE", f"the tensors of {src} differ in shape, dtype or device, or are not contiguous")
        if meta[2] != ex.device:
            return None, ("REWRITE_TABLE", f"the tensors of {src} are on {meta[2]}, the index on {ex.device}")
    return table, RewriteUse("list", src, len(items))


# ``aten.index`` checks the index's range only while copying elements: none to copy, no error
_EMPTY_ROWS = "eager's out-of-range index raises, a gather of nothing would not"
# the classes whose indexing, truthiness and integer conversion are torch.Tensor's own (a NumPy
# array Dynamo traces is a tensor in the graph: its int()/float() are NumPy's, which Dynamo traces)
def _plain_read_types() -> tuple:
    # NOTE: torch.nn.Buffer: Dynamo reports a registered buffer's class as Buffer (its _is_buffer
    # flag), though the object is a plain torch.Tensor
    types_ = (torch.Tensor, torch.nn.Parameter) + ((torch.nn.Buffer,) if hasattr(torch.nn, "Buffer") else ())
    try:
        import numpy
    except ImportError:
        return types_
    return types_ + (numpy.ndarray,)


PLAIN_READ_TYPES = _plain_read_types()


def _python_type(v: Any) -> Any:
    try:
        return v.python_type()
    except Exception:
        return None


def subclass_name(cls: Any) -> Optional[str]:
    """The name of ``cls`` when it is not one of :data:`PLAIN_READ_TYPES` (a tensor subclass, or
    a class that could not be read), else None."""
    if cls in PLAIN_READ_TYPES:
        return None
    return getattr(cls, "__name__", "tensor of unknown class")


_CONVERSIONS = ("__bool__", "__int__", "__float__", "__index__")


def builtin_read_differs(cls: Any) -> bool:
    """May ``int()``/``float()``/``bool()``/``operator.index()`` of an instance of ``cls`` give
    another answer in eager than Dynamo's own read of it (which a hoisted value copies)?

    A Python-level conversion (``def __bool__``) always may. A custom ``__torch_function__`` may too
    (it sees ``Tensor.__int__``; Dynamo's read shows it ``Tensor.item``) from torch 2.13 on, where
    stock Dynamo then converts as eager does. On 2.11 and 2.12 stock Dynamo applies such a class's
    ``__torch_function__`` to the ops before the read twice, which the hoisted value (computed with
    ``__torch_function__`` off) does not: the value is hoisted there, as before.
    """
    if cls in PLAIN_READ_TYPES:
        return False
    if not isinstance(cls, type) or any(getattr(cls, m, None) is not getattr(torch.Tensor, m) for m in _CONVERSIONS):
        return True
    own = getattr(getattr(cls, "__torch_function__", None), "__func__", None)
    return own is not getattr(torch.Tensor.__torch_function__, "__func__", None) and _torch_version() >= (2, 13)


def _key_problem(var: Any, ex: torch.Tensor) -> Optional[str]:
    """Why the index tensor ``var`` (traced value ``ex``) cannot be gathered with (None: it can)."""
    name = subclass_name(_python_type(var))
    if name is not None:
        return f"the index is a {name}: its own conversion to an integer would not run"
    if ex.is_neg() or ex.is_conj():
        return "the index is a lazy negative or conjugate view: a gather would not apply the bit"
    return None


def _tensor_table_problem(table: Any, src: str, device: torch.device) -> Optional[str]:
    """Why a gather of one row of the tensor ``table`` would not be eager's row (None: it would)."""
    tex = table.as_proxy().node.meta.get("example_value")
    if not isinstance(tex, torch.Tensor) or tex.dim() == 0 or not all(isinstance(d, int) for d in tex.shape):
        return "a 0-d tensor or a tensor with symbolic sizes"
    name = subclass_name(_python_type(table))
    if name is not None:
        return f"{src} is a {name}: its own indexing would not run"
    if tex.numel() == 0:
        return f"rows of {src} have no elements: {_EMPTY_ROWS}"
    if tex.shape[0] == 0 or tuple(tex.stride()[1:]) != _contiguous_strides(tex.shape[1:]):
        return f"rows of {src} are not contiguous: eager's row would be a strided view"
    if tex.device != device:
        return f"{src} is on {tex.device}, the index on {device}"
    if tex.is_conj() or tex.is_neg():
        return f"{src} is a lazy conjugate or negative view: eager's row keeps the bit, a gathered one would not"
    return None


def _contiguous_strides(shape: Any) -> tuple:
    strides, acc = [], 1
    for d in reversed(tuple(shape)):
        strides.append(acc)
        acc *= max(int(d), 1)
    return tuple(reversed(strides))


def _traced(tx: Any, kind: str, target: Any, *args: Any) -> Any:
    """Trace one call (``kind``: call_function / call_method) into the graph; its variable."""
    from torch._dynamo.variables.builder import wrap_fx_proxy

    return wrap_fx_proxy(tx, tx.output.create_proxy(kind, target, args, {}))


def _try_rewrite(tx: Any, var: Any, kind: str) -> tuple[Any, Any]:
    """(gathered row, None) when the read was rewritten; (None, why_not) otherwise."""
    if _rewriter is None or getattr(_state, "in_stock", False) or not getattr(var, "is_tensor", lambda: False)():
        return None, None
    options = _nosync_options(tx)
    if options is None:
        return None, None
    try:
        table, use = _index_use(tx, var, kind)
        if table is None:
            return None, use
        site = _describe(tx, var, kind, options)
    except Exception as e:
        _describe_failed(kind, options, e)
        return None, None
    _state.busy = True
    try:
        use = _rewriter.allow(site, use)
    finally:
        _state.busy = False
    if use is None:
        return None, None  # refused earlier (recorded then): the read takes the ordinary path
    out = tx.output

    def op(kind_: str, target: Any, *args: Any) -> Any:
        return _traced(tx, kind_, target, *args)

    idx = var
    ex = var.as_proxy().node.meta["example_value"]
    if ex.dim() != 0:
        idx = op("call_function", torch.reshape, idx.as_proxy(), ())
    if ex.dtype != torch.int64:
        idx = op("call_method", "to", idx.as_proxy(), torch.int64)
    if use.form == "list":
        _guard_list_items(site, [i.realize() for i in table.items])
        # one stack per list contents and graph: the reads of an unrolled loop share it
        items = tuple(i.realize().as_proxy().node for i in table.items)
        stacks = out.__dict__.setdefault("_nosync_stacks", {})
        stacked = stacks.get(items)
        if stacked is None or getattr(stacked.as_proxy().node, "_erased", False):
            stacked = stacks[items] = op("call_function", torch.stack, [i.realize().as_proxy() for i in table.items])
            stacked.as_proxy().node.meta[REWRITE_META] = use
        table = stacked
    row = op("call_function", torch.ops.aten.index.Tensor, table.as_proxy(), [idx.as_proxy()])
    row.as_proxy().node.meta[REWRITE_META] = use
    tx.pop()  # the table; the CALL pushes the row in place of ``table[value]``
    tx.instruction_pointer += 1  # skip the BINARY_SUBSCR
    return row, None


# NOTE [Rewriting a subscript at a tensor index]: ``table[t]`` with ``t`` a 0-d integer tensor
# (``self.alphas_cumprod[timestep]`` in diffusers' DDIMScheduler, ``timestep`` an element of
# ``scheduler.timesteps``) reads ``t`` to the host inside the subscript: eager's indexing calls
# ``t.item()`` and returns ``table.select(0, i)``. Dynamo traces ``operator.getitem(table, t)`` and
# fake-propagates it before any TensorVariable method is called, so no hook above ever sees it: when
# ``t`` was computed in the step, its fake tensor cannot run the read and the graph breaks at the
# BINARY_SUBSCR; when ``t`` is an input, its fake tensor carries a backed symbol for its value
# (``item_memo``), which the select specializes: a guard that reads ``t`` at every call and one
# recompile per value (diffusers' ``timestep``). The BINARY_SUBSCR handler of each
# translator is wrapped instead: in user code of a nosync frame, when the subscripted value is a
# plain tensor and the key a plain 0-d integer tensor (not uint8 or bool: those index as masks),
# the hook traces ``aten.index(table, [t])`` as for ``table[t.item()]`` (the same table checks,
# policy, records and graph checks, kind "index") and pushes the row. Anything else, and a site the
# policy refuses, goes to Dynamo's own handler.
# NOTE: the rewrite runs outside Dynamo's ``break_graph_if_unsupported`` wrapper of BINARY_SUBSCR,
# which takes a speculation checkpoint only to graph-break there; a subscript that is rewritten
# never breaks, and the decision is the same in a retrace (a refusal restarts the analysis with a
# cleared speculation log, see restart_analysis).
SUBSCR_KIND = "index"
_MASK_DTYPES = (torch.bool, torch.uint8)


def _peek_tensor(v: Any) -> Any:
    """``v`` realized when it is a plain TensorVariable (a lazy one is realized only then), else None."""
    if hasattr(v, "is_realized"):  # a LazyVariableTracker
        if not v.is_realized() and type(v.peek_value()) not in (torch.Tensor, torch.nn.Parameter):
            return None
        v = v.realize()
    return v if type(v).__name__ == "TensorVariable" else None


def _try_subscript(tx: Any) -> bool:
    """Trace ``table[t]`` (a tensor at a 0-d integer tensor) as a gather; True when done (the two
    operands popped, the row pushed), False: Dynamo's handler runs."""
    if _rewriter is None or getattr(_state, "in_stock", False) or len(tx.stack) < 2:
        return False
    options = _nosync_options(tx)
    if options is None:
        return False
    key = _peek_tensor(tx.stack[-1])
    ex = key.as_proxy().node.meta.get("example_value") if key is not None else None
    if (not isinstance(ex, torch.Tensor) or ex.dim() != 0 or ex.dtype not in _INT_DTYPES
            or ex.dtype in _MASK_DTYPES):
        return False
    table = _peek_tensor(tx.stack[-2])
    if table is None or _user_translator(tx) is not tx or tx.output.current_tracer is not tx.output.root_tracer:
        return False
    if _python_type(key) not in PLAIN_READ_TYPES:
        return False  # a subclass's own __index__: Dynamo's handler
    if _in_torch_function_mode(tx):
        return False  # a mode may serve Tensor.__getitem__ itself: Dynamo's handler dispatches it
    src = _source_name(getattr(table, "source", None)) or "<a value built in the step>"
    try:
        site = _describe(tx, key, SUBSCR_KIND, options)
    except Exception as e:
        _describe_failed(SUBSCR_KIND, options, e)
        return False
    problem = _tensor_table_problem(table, src, ex.device)
    if problem is not None:
        _rewriter.kept(site, "REWRITE_TABLE", problem)
        return False
    problem = _key_problem(key, ex)
    if problem is not None:
        _rewriter.kept(site, "REWRITE_OTHER_USE", problem)
        return False
    why = user_handler(tx, tx.current_instruction)
    if why is not None:  # an index out of range would raise inside the graph
        _rewriter.kept(site, "REWRITE_OTHER_USE", why)
        return False
    _state.busy = True
    try:
        use = _rewriter.allow(site, RewriteUse("tensor", src, int(table.as_proxy().node.meta["example_value"].shape[0])))
    finally:
        _state.busy = False
    if use is None:
        return False  # refused earlier (recorded then): Dynamo's handler breaks the graph as stock
    idx = key if ex.dtype == torch.int64 else _traced(tx, "call_method", "to", key.as_proxy(), torch.int64)
    row = _traced(tx, "call_function", torch.ops.aten.index.Tensor, table.as_proxy(), [idx.as_proxy()])
    row.as_proxy().node.meta[REWRITE_META] = use
    tx.popn(2)
    tx.push(row)
    return True


def _in_torch_function_mode(tx: Any) -> bool:
    """Is a TorchFunctionMode active where ``tx`` traces (True when Dynamo's state cannot be read)?"""
    try:
        state = tx.symbolic_torch_function_state
        return bool(state.torch_function_mode_enabled and state.in_torch_function_mode())
    except Exception:
        return True


def _make_subscr_hook(original: Callable) -> Callable:
    @functools.wraps(original)
    def hook(self: Any, inst: Any) -> Any:
        # >>> device-side rewrite hook point: Note [Rewriting a subscript at a tensor index]
        if _try_subscript(self):
            return None
        # <<<
        return original(self, inst)

    hook.__nosync_hook__ = True  # type: ignore[attr-defined]
    return hook


# NOTE [Identity comparisons a select could change]: a select (Note [Rewriting a branch as a
# select]) is a copy, not the arm's object, so an ``is`` / ``in`` that compares it by identity could
# answer otherwise than eager. Instead of refusing every graph whose traced code contains an ``is``
# or ``in`` anywhere (``name in self.keys()`` in diffusers' BaseOutput.__setattr__ made every DDIM
# step keep its syncs), the IS_OP and CONTAINS_OP handlers of each translator note each comparison
# Dynamo traces whose operands are both other than Python constants (a str, an int, None, a class,
# a tuple of those: none can be or hold a tensor, so its answer is the same for the copy and the
# arm), on the OutputGraph; :func:`identity_uses` hands them to the graph check. ``id`` and
# ``operator.is_`` are still found in the traced code by name (rewrite.py).
_IDENTITY_ATTR = "_nosync_identity_uses"
_IDENTITY_OPS = ("IS_OP", "CONTAINS_OP")


def _identity_hooked() -> bool:
    """Are IS_OP / CONTAINS_OP hooked? Only where the select runs (SELECT_MIN_TORCH)."""
    return _torch_version() >= SELECT_MIN_TORCH


# variables that can never be or hold a tensor (by class name: an unknown or renamed one counts as
# one that can, and the select keeps its sync)
_IDENTITY_FREE_VARS = ("ConstantVariable", "EnumVariable", "UserDefinedClassVariable")


def _identity_free(v: Any, depth: int = 0) -> bool:
    """Is ``v`` a Python constant (a str, a number, None, a class, a tuple or list of those), which
    can neither be nor hold a tensor? Decided without realizing anything (no guard is added)."""
    if hasattr(v, "is_realized"):  # a LazyVariableTracker
        if not v.is_realized():
            value = v.peek_value()
            return type(value) in _PLAIN or isinstance(value, type)
        v = v.realize()
    name = type(v).__name__
    if name in ("TupleVariable", "ListVariable") and depth == 0:
        return all(_identity_free(i, 1) for i in v.items)
    return name in _IDENTITY_FREE_VARS


def _make_identity_hook(original: Callable) -> Callable:
    @functools.wraps(original)
    def hook(self: Any, inst: Any) -> Any:
        if (len(self.stack) >= 2 and _nosync_options(self) is not None
                and not (_identity_free(self.stack[-1]) or _identity_free(self.stack[-2]))):
            where = getattr(inst, "positions", None)
            line = where.lineno if where is not None and where.lineno else self.lineno
            self.output.__dict__.setdefault(_IDENTITY_ATTR, []).append(f"{self.f_code.co_filename}:{line}")
        return original(self, inst)

    hook.__nosync_hook__ = True  # type: ignore[attr-defined]
    return hook


def identity_uses() -> Optional[list[str]]:
    """'file:line' of each ``is`` / ``in`` between objects traced into the graph being compiled
    (Note [Identity comparisons a select could change]); None when no translator is current or
    the comparisons are not hooked."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    if not _identity_hooked() or not _installed or _disabled_reason is not None:
        return None
    try:
        tx = InstructionTranslator.current_tx()
    except AttributeError:  # no translator ever ran on this thread
        tx = None
    return None if tx is None else list(tx.output.__dict__.get(_IDENTITY_ATTR, ()))


# --------------------------------------------------------------------------------------------
# Device-side rewrites (issue 13): a step-varying branch that only chooses between tensors
# --------------------------------------------------------------------------------------------
# NOTE [Rewriting a branch as a select]: ``row = A if t == PAD else B`` (or the same as an if/else
# statement) reads ``t`` to the host to pick an arm. When nosync does not hoist the test (its value
# changes from step to step), the jump hook traces *both* arms from the state at the jump, up to the
# join: the instruction from which the two arms run the same code (in 3.11 the target of the first
# arm's JUMP_FORWARD; in 3.12+ the start of the tails the compiler duplicated into each arm). Each
# value that then differs between the two states (on the stack or in a local) becomes
# ``torch.where(t, a, b)``, which copies the bits of the arm eager takes; tracing goes on at the join,
# once, on the merged values. This is done only when
# - each arm is straight-line code of loads, calls and operators (no jump, return, raise, ``with``,
#   or store other than to a local) and traces no Python side effect (Dynamo's check of each
#   mutation is trapped while an arm is traced);
# - each differing value is a tensor in both arms, of one shape, dtype and device, contiguous (the
#   select's result has eager's strides) and not requiring grad;
# - every op the arms trace is one the policy (:meth:`rewrite.Rewriter.branch_plan`) shows cannot
#   raise or change state because of the values it reads, since the arm eager skips runs too; an
#   index op's index is masked to 0 when its arm is not taken (``emb(t)`` of a PAD id of -1 must not
#   raise when eager took the other arm), and the taken arm's index is the index eager uses;
# - the code after the join (in the function and its callers) compares nothing by identity (``is``)
#   but with a constant: the merged tensor is a copy, not the arm's object.
# A refusal found once an arm was traced marks the site and traces the frame again (restart), where
# the site keeps its sync: the translator's state is never restored by hand. The graph-level checks
# (the selected tensor written in place or returned, an arm's tensor written after the select,
# autograd recording the graph) are :func:`rewrite.check_graph`'s, as for a rewritten index read.
_ARM_OPS = frozenset({
    "NOP", "CACHE", "LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_LOAD_FAST", "LOAD_CONST", "LOAD_SMALL_INT",
    "LOAD_GLOBAL", "LOAD_DEREF", "LOAD_ATTR", "LOAD_METHOD", "BINARY_SUBSCR", "BINARY_SLICE", "BINARY_OP",
    "UNARY_NEGATIVE", "UNARY_NOT", "UNARY_INVERT", "COMPARE_OP", "PRECALL", "CALL", "CALL_KW", "KW_NAMES",
    "PUSH_NULL", "COPY", "SWAP", "BUILD_TUPLE", "BUILD_SLICE", "STORE_FAST", "STORE_FAST_LOAD_FAST",
    "STORE_FAST_STORE_FAST", "POP_TOP", "TO_BOOL", "JUMP_FORWARD",
})
_RUN_ENDS = frozenset({"RETURN_VALUE", "RETURN_CONST", "RAISE_VARARGS", "RERAISE", "JUMP_BACKWARD",
                       "JUMP_BACKWARD_NO_INTERRUPT", "JUMP_ABSOLUTE"})
_UNCONDITIONAL = frozenset({"JUMP_FORWARD", "JUMP_BACKWARD", "JUMP_BACKWARD_NO_INTERRUPT", "JUMP_ABSOLUTE"})
MAX_BRANCH_RUN = 512  # instructions followed from each arm's start to find the join


# torch 2.11 and 2.12 Dynamo misread attributes of a tensor the step made (``(b * 2).grad is None``
# traces as False, with or without nosync); a select makes such a tensor where eager had the arm's
# own object, so ``y.grad is None`` after it would be wrong there: the select needs torch 2.13+.
SELECT_MIN_TORCH = (2, 13)


class BranchRefused(Exception):
    """An arm cannot be selected on the device: ``reason`` (a Reason name) and ``detail``."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason, self.detail = reason, detail


def _run_from(tx: Any, start: int) -> Optional[list]:
    """The instructions executed from ``start`` up to a return, raise, backward or conditional jump
    (followed through forward jumps); None when longer than MAX_BRANCH_RUN."""
    insts, out, i = tx.instructions, [], start
    while i < len(insts) and len(out) < MAX_BRANCH_RUN:
        inst = insts[i]
        out.append(inst)
        if inst.opname in _RUN_ENDS:
            return out
        if inst.opname == "JUMP_FORWARD":
            i = tx.indexof[inst.target]
        elif inst.target is not None:
            return out  # a conditional jump (or a loop's FOR_ITER) ends the run
        else:
            i += 1
    return None


def _handler(inst: Any) -> Any:
    """The exception handler an instruction runs under (None outside any try or with block)."""
    entry = getattr(inst, "exn_tab_entry", None)
    return None if entry is None else (entry.target, entry.depth, entry.lasti)


# Context managers whose ``__exit__`` never swallows an exception (Dynamo's variables for them;
# the names differ between releases, an unknown one is refused).
_NON_SUPPRESSING_WITH = frozenset({
    "GradModeVariable", "InferenceModeVariable", "AutocastModeVariable", "NullContextVariable",
    "TorchFunctionDisableVariable", "DeterministicAlgorithmsVariable", "DisabledSavedTensorsHooksVariable",
    "ProfilerContextVariable", "ProfilerRecordFunctionContextVariable", "RecordFunctionVariable",
    "SDPAKernelVariable", "PreserveVersionContextVariable", "FxTracebackAnnotateVariable",
    "StreamContextVariable", "StreamVariable", "CudaStreamVariable", "GenericDeviceVariable",
    "CUDADeviceVariable", "AcceleratorDeviceIndexVariable",
})
# A handler that reaches one of these (an except clause's test, a jump out of the handler, a
# return, a raise of another exception) may end or replace the exception; one that reaches RERAISE
# first only runs cleanup code (a finally body, a comprehension restoring its variable, a with
# block's exit) and passes the same exception on.
_MAY_CATCH = frozenset({"CHECK_EXC_MATCH", "CHECK_EG_MATCH", "RETURN_VALUE", "RETURN_CONST", "YIELD_VALUE",
                        "SEND", "END_ASYNC_FOR", "CLEANUP_THROW", "RAISE_VARARGS"})
# What a re-raising handler may run besides RERAISE: stack shuffles, the exception state, stores
# to locals (a comprehension restoring its variable). Nothing that can raise or be seen.
_INERT = frozenset({"PUSH_EXC_INFO", "POP_EXCEPT", "SWAP", "COPY", "POP_TOP", "NOP", "STORE_FAST", "CACHE",
                    "EXTENDED_ARG", "LOAD_CONST"})
_MAX_HANDLER_SCAN = 256


def _block_context(tx: Any, b: Any) -> Any:
    """The context manager variable of the block ``b`` of ``tx`` (None for a try block): on the
    block itself, or (an inlined frame's block keeps none) in the exit function the with statement
    left on the value stack, just below the block's own values."""
    if getattr(b, "with_context", None) is not None:
        return b.with_context
    stack = getattr(tx, "stack", ())
    k = getattr(b, "stack_index", None)
    if isinstance(k, int) and 0 < k <= len(stack) and type(stack[k - 1]).__name__ == "WithExitFunctionVariable":
        return getattr(stack[k - 1], "ctx", None)
    return None


def _with_context(tx: Any, target: Any) -> Any:
    """The context manager variable of the ``with`` block whose exit handler is ``target``."""
    for b in reversed(getattr(tx, "block_stack", ())):
        if getattr(b, "target", None) is target:
            return _block_context(tx, b)
    return None


def _handler_catches(tx: Any, entry: Any) -> tuple[Optional[str], Any]:
    """(why the handler ``entry`` leads to may end the exception, None) or (None, the entry of the
    handler it re-raises to: None when the exception leaves the frame)."""
    insts, i = tx.instructions, tx.indexof.get(entry.target)
    for _ in range(_MAX_HANDLER_SCAN):
        if i is None or i >= len(insts):
            break
        inst = insts[i]
        if inst.opname == "RERAISE":
            return None, getattr(inst, "exn_tab_entry", None)
        if inst.opname == "WITH_EXCEPT_START":
            ctx = _with_context(tx, entry.target)
            if ctx is None or type(ctx).__name__ not in _NON_SUPPRESSING_WITH:
                what = type(ctx).__name__ if ctx is not None else "an unknown context manager"
                return f"a with block ({what}) whose __exit__ may catch an error the graph raises", None
            return None, getattr(inst, "exn_tab_entry", None)
        if inst.opname in _MAY_CATCH or inst.target is not None:
            return "a try block, whose handler cannot catch an error the graph raises", None
        if inst.opname not in _INERT:
            # a finally body (or an except clause that re-raises) running code: eager runs it
            # before the error leaves, and it may raise another error or make a side effect
            return ("a try block whose finally (or except) code runs before the error leaves, which the "
                    "graph's error would skip"), None
        i += 1
    return "a try block, whose handler cannot catch an error the graph raises", None


def user_handler(tx: Any, inst: Any) -> Optional[str]:
    """Why an error raised at ``inst`` by the graph (which runs after the trace, outside every
    handler of the frame and of the frames that call it) would skip a handler that eager runs: the
    instruction runs in a ``try`` block with an ``except`` clause, in a ``with`` block whose context
    manager may swallow exceptions (``contextlib.suppress``), or a call of a function inlined there.
    None: no handler, or only handlers that re-raise (``finally`` bodies, a comprehension's cleanup,
    ``with`` blocks of context managers that never swallow: grad mode, autocast, profiling ...)."""
    why = _error_state_differs(tx)
    if why is not None:
        return why
    where = "it runs in"
    for _ in range(64):
        entry = getattr(inst, "exn_tab_entry", None)
        for _ in range(64):
            if entry is None:
                break
            why, entry = _handler_catches(tx, entry)
            if why is not None:
                return f"{where} {why}"
        parent = getattr(tx, "parent", None)
        if parent is None:
            return None
        tx, inst, where = parent, getattr(parent, "current_instruction", None), "its caller runs in"
        if inst is None:
            return "its caller's instruction is unknown"
    return "the handlers nest too deep to follow"


_GENERATOR_FLAGS = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR | inspect.CO_ITERABLE_COROUTINE


def _frames(tx: Any) -> list:
    """The translator of the instruction and those of the frames it is inlined in, innermost first."""
    out = []
    while tx is not None and len(out) < 64:
        out.append(tx)
        tx = getattr(tx, "parent", None)
    return out


def _open_contexts(tx: Any) -> list:
    """The context manager variables of the ``with`` blocks open at the instruction being traced,
    outermost first (the compiled frame's, then those of each inlined call)."""
    contexts = (_block_context(t, b) for t in reversed(_frames(tx)) for b in getattr(t, "block_stack", ()))
    return [c for c in contexts if c is not None]


# The ``with`` blocks a read may raise in: their state is restored on the graph's error (grad mode
# and SDP switches: rewrite.restore_state_on_error) or they leave none behind that a later call sees.
_STATE_RESTORED_WITH = frozenset({
    "GradModeVariable", "SDPAKernelVariable", "NullContextVariable", "ProfilerContextVariable",
    "ProfilerRecordFunctionContextVariable", "RecordFunctionVariable", "FxTracebackAnnotateVariable",
    "PreserveVersionContextVariable",
})


def _is_sdp_setter(target: Any) -> bool:
    name = getattr(target, "__name__", "")
    module = getattr(target, "__module__", "") or ""
    return ((module.startswith("torch.backends.cuda") and name.startswith("enable_") and name.endswith("_sdp"))
            or name.startswith("_set_sdp"))


def _error_state_differs(tx: Any) -> Optional[str]:
    """Why an error the graph raised here would leave Python in another state than eager's error:
    eager raises inside a generator (its consumer's handlers, even its frame, unknown at the trace),
    while another exception is handled (the error's ``__context__``), or where unwinding the open
    ``with`` blocks leaves grad mode other than the graph's entry mode, which is what nosync
    restores (Note [Global state when a rewritten read raises]): after a bare
    ``torch.set_grad_enabled(False)``, in a ``with`` block whose state nosync does not restore
    (inference mode, whose guard an error's traceback keeps alive; autocast; saved-tensor hooks
    ...), in inference mode or autocast entered in the step, after a bare SDP backend switch."""
    frames = _frames(tx)
    for t in frames:
        code = getattr(t, "f_code", None)
        if code is not None and code.co_flags & _GENERATOR_FLAGS:
            return (f"it runs in a generator ({code.co_name}), whose consumer (and the handlers around it) the "
                    "graph's error would not reach")
        exc = getattr(t, "exn_vt_stack", None)
        try:
            handling = exc is not None and len(exc) > 0
        except TypeError:
            handling = True
        if handling:
            return "it runs while an exception is handled (an except body), whose error the graph's would not chain to"
    contexts = _open_contexts(tx)
    for c in contexts:
        if type(c).__name__ not in _STATE_RESTORED_WITH:
            return (f"it runs in a with block ({type(c).__name__}) whose state the graph's error would leave set "
                    "(nosync restores grad mode and SDP switches only)")
    entered = {"inference_mode": 0, "autocast": 0}
    for n in tx.output.graph.nodes:
        if n.op != "call_function":
            continue
        name = getattr(n.target, "__name__", "")
        if name in ("_enter_inference_mode", "_enter_autocast"):
            entered[name[len("_enter_"):]] += 1
        elif name in ("_exit_inference_mode", "_exit_autocast"):
            entered[name[len("_exit_"):]] -= 1
        elif _is_sdp_setter(n.target):
            return "it runs after an SDP backend switch set in the step, which nosync would undo on the graph's error"
    for what, k in entered.items():
        if k:
            return f"it runs in {what} entered in the step, which the graph's error would leave on"
    grads = [c for c in contexts if type(c).__name__ == "GradModeVariable"]
    after = bool(grads[0].initial_values[0]) if grads else torch.is_grad_enabled()
    from ._torch_private import frame_entry_grad_mode

    entry = frame_entry_grad_mode()
    if entry is None or after != entry:
        return (f"grad mode after its error would be {after} in eager (a bare set_grad_enabled or a decorator), "
                f"the graph's entry mode ({entry}) after the graph's error")
    return None


def _same_inst(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if a.opname != b.opname or _handler(a) != _handler(b):
        return False
    if a.target is not None or b.target is not None:
        # an unconditional jump is the same jump when it goes to the same place; a conditional one
        # only when it is the same instruction (its fall-through code is not compared)
        return a.opname in _UNCONDITIONAL and a.target is b.target
    try:
        return a.arg == b.arg and type(a.argval) is type(b.argval) and bool(a.argval == b.argval)
    except Exception:
        return False


def _branch_arms(tx: Any, inst: Any) -> tuple[list, list, Any]:
    """(the first arm's own instructions, the second's, the join) of the branch at ``inst``."""
    runs = [_run_from(tx, tx.instruction_pointer), _run_from(tx, tx.indexof[inst.target])]
    if runs[0] is None or runs[1] is None:
        raise BranchRefused("BRANCH_FORM", f"an arm runs more than {MAX_BRANCH_RUN} instructions before the join")
    a, b = runs
    k = 0
    while k < min(len(a), len(b)) and _same_inst(a[-1 - k], b[-1 - k]):
        k += 1
    if k == 0:
        raise BranchRefused("BRANCH_FORM", "the arms never join (each returns, raises or loops on its own)")
    join = a[len(a) - k]
    why = user_handler(tx, inst)
    if why is not None:  # the arm eager skips may raise (an index out of range) inside the graph
        raise BranchRefused("BRANCH_FORM", why)
    cores = [[i for i in run[: len(run) - k] if i.opname != "JUMP_FORWARD"] for run in (a, b)]
    for i in cores[0] + cores[1] + [join]:
        if i.opname not in _ARM_OPS and i is not join:
            raise BranchRefused("BRANCH_FORM", f"an arm has a {i.opname} instruction (only loads, calls, operators "
                                "and stores to locals are traced in both arms)")
        if _handler(i) != _handler(inst):
            raise BranchRefused("BRANCH_FORM", "an arm or the join runs under another exception handler than the "
                                "test (a try block in one arm)")
    for core in cores:
        if core and core[-1].opname in ("KW_NAMES", "PUSH_NULL", "PRECALL"):
            raise BranchRefused("BRANCH_FORM", "the arms join inside a call")
    return cores[0], cores[1], join


def _trace_arm(tx: Any, core: list, stack: list, local_vars: dict) -> tuple[list, dict, list]:
    """Trace ``core`` from the given state; (stack, locals, FX nodes it appended)."""
    tx.stack[:] = stack
    tx.symbolic_locals.clear()
    tx.symbolic_locals.update(local_vars)
    graph = tx.output.graph
    last = next(iter(reversed(graph.nodes)))
    j = 0
    while j < len(core):
        inst = core[j]
        ip = tx.indexof[inst]
        tx.current_instruction, tx.instruction_pointer = inst, ip + 1
        if getattr(inst, "starts_line", None):
            tx.starts_line(inst.starts_line)
        tx.dispatch_table[inst.opcode](tx, inst)
        j += 1
        if tx.instruction_pointer == ip + 2 and j < len(core) and tx.indexof[core[j]] == ip + 1:
            j += 1  # a read rewritten as an index consumed its BINARY_SUBSCR (Note [Rewriting a read ...])
        elif tx.instruction_pointer != ip + 1:
            raise BranchRefused("BRANCH_FORM", f"{inst.opname} in an arm changed the control flow")
    nodes, n = [], last.next
    while n is not last and n.op != "root":
        nodes.append(n)
        n = n.next
    return list(tx.stack), dict(tx.symbolic_locals), nodes


_BOOKKEEPING = ("nn_module_stack_source", "source_location")  # Dynamo's notes on a variable, not its state


def _recorded_effects(side_effects: Any, values: list) -> tuple:
    """The attribute writes and hooks Dynamo has recorded (some skip its side-effect check), and the
    fields of every non-tensor variable the arms can reach: some variables change in place without
    telling side_effects (an iterator's position: ``next(it)`` in an arm)."""
    from torch._dynamo.variables.base import VariableTracker

    fields: dict = {}
    todo = [(v, 0) for v in list(values) + list(side_effects.id_to_variable.values())]
    while todo:
        v, depth = todo.pop()
        if isinstance(v, (list, tuple)):
            todo.extend((x, depth) for x in v)
            continue
        if isinstance(v, dict):
            todo.extend((x, depth) for x in v.values())
            continue
        tracker = isinstance(v, VariableTracker)
        translator = type(v).__name__.endswith("InstructionTranslator")  # a generator's own frame
        if (id(v) in fields or depth > 4 or not (tracker or translator) or type(v).__name__ == "LazyVariableTracker"
                or (tracker and v.is_tensor())):
            continue
        own = {k: x for k, x in vars(v).items() if k not in _BOOKKEEPING}
        fields[id(v)] = {k: id(x) for k, x in own.items()}
        if tracker:
            todo.extend((x, depth + 1) for x in own.values())
    return ({k: dict(v) for k, v in side_effects.store_attr_mutations.items()}, dict(side_effects.tensor_hooks),
            fields)


def _refuse_side_effect(item: Any) -> "NoReturn":
    raise BranchRefused("BRANCH_SIDE_EFFECT", f"an arm mutates {item.python_type_name()} "
                        "(the arm eager skips would run too)")


def _select_values(a: Any, b: Any, where: str, side_effects: Any) -> None:
    """Check that the arms' differing values ``a``, ``b`` can be selected bitwise, and that nothing
    but their bits can tell eager's object from the select (its class, Python attributes, lazy
    conjugate or negative bits)."""
    if not (a.is_tensor() and b.is_tensor()):
        raise BranchRefused("BRANCH_VALUES", f"{where} is a {a.python_type_name()} in one arm and a "
                            f"{b.python_type_name()} in the other (only tensors are selected on the device)")
    ea, eb = (v.as_proxy().node.meta.get("example_value") for v in (a, b))
    if not (isinstance(ea, torch.Tensor) and isinstance(eb, torch.Tensor)):
        raise BranchRefused("BRANCH_VALUES", f"{where} has no traced value")
    if not all(isinstance(d, int) for d in tuple(ea.shape) + tuple(eb.shape)):
        raise BranchRefused("BRANCH_VALUES", f"{where} has symbolic sizes")
    if (tuple(ea.shape), ea.dtype, ea.device) != (tuple(eb.shape), eb.dtype, eb.device):
        raise BranchRefused("BRANCH_VALUES", f"{where} differs in shape, dtype or device between the arms "
                            f"({tuple(ea.shape)} {ea.dtype} {ea.device} / {tuple(eb.shape)} {eb.dtype} {eb.device})")
    if tuple(ea.stride()) != _contiguous_strides(ea.shape) or tuple(eb.stride()) != _contiguous_strides(eb.shape):
        raise BranchRefused("BRANCH_VALUES", f"{where} is not contiguous in an arm (the select's result would "
                            "have other strides than eager's)")
    if ea.requires_grad or eb.requires_grad:
        raise BranchRefused("BRANCH_VALUES", f"{where} requires grad (the select would send gradients "
                            "to the arm eager skips)")
    for v, e in ((a, ea), (b, eb)):
        if v.python_type() is not torch.Tensor:
            raise BranchRefused("BRANCH_VALUES", f"{where} is a {v.python_type().__name__} in an arm (isinstance "
                                "and type() of the select would differ; a buffer is a plain tensor)")
        if e.is_conj() or e.is_neg():
            raise BranchRefused("BRANCH_VALUES", f"{where} is a lazy conjugate or negative view in an arm")
        if v in side_effects.store_attr_mutations or e._is_view() or _real_meta(v):
            raise BranchRefused("BRANCH_VALUES", f"{where} carries Python attributes, is a view, has a .grad or "
                                "shares a larger storage in an arm (what Python reads of it would not be the "
                                "select's)")


def _real_meta(v: Any) -> bool:
    """Does the real tensor of a graph input differ from a fresh copy in what Python can read?"""
    node = v.as_proxy().node
    if node.op != "placeholder":
        return False
    from ._torch_private import traced_example

    return _meta_differs(traced_example(node)[0])


def _python_differs(real: Any) -> bool:
    """Does Python see more of this tensor than of a copy of its bits (its class, a .grad, its own
    attributes)? What a list-table row shows that a gathered one does not (its memory aside: see
    the README's limits)."""
    return (type(real) is not torch.Tensor or real.grad is not None
            or any(not k.startswith("_dynamo") for k in getattr(real, "__dict__", None) or ()))


_GRAD = operator.attrgetter("grad")
_DICT = operator.attrgetter("__dict__")
_PLAIN_TENSOR = frozenset((torch.Tensor,))
_NO_GRAD = frozenset((None,))


def _none_python_differs(ts: tuple) -> bool:
    """``not any(_python_differs(t) for t in ts)``, with C loops for the common case (plain tensors
    without .grad or attributes): a list table's rows are checked at every call (with the getter's
    one lookup of the list: 512 rows 201 -> 69 us a call, 64 rows 27 -> 9 us, on this project's
    CPU)."""
    try:
        if set(map(type, ts)) <= _PLAIN_TENSOR and set(map(_GRAD, ts)) <= _NO_GRAD:
            # every attribute name of every row at once (Dynamo marks the tensors it saw with
            # ``_dynamo_*`` attributes, which a copy lacking them does not show to the program)
            return all(k.startswith("_dynamo") for k in set().union(*map(_DICT, ts)))
    except Exception:  # an odd .grad (unhashable): the exact check below decides
        pass
    return not any(_python_differs(t) for t in ts)


def _none_meta_differs(ts: tuple) -> bool:
    return not any(_meta_differs(t) for t in ts)


def _torch_private_is_fake(t: Any) -> bool:
    from ._torch_private import is_fake

    return is_fake(t)


def _real_tensor(v: Any) -> Any:
    """The real tensor behind a graph input's variable (None for anything else)."""
    node = v.as_proxy().node if getattr(v, "is_tensor", lambda: False)() else None
    if node is None or node.op != "placeholder":
        return None
    from ._torch_private import is_fake, traced_example

    real = traced_example(node)[0]
    return None if real is None or is_fake(real) else real


def _guard_list_items(site: SyncSite, items: list) -> None:
    """Keep checking at every call what the list form checked of the list's input tensors at
    compile time (a later call's list may hold a tensor with a .grad or attributes; a tensor the
    step computes has neither, but an attribute the step sets: see attribute_written_selects)."""
    names = [n for n in (_source_name(getattr(v, "source", None)) for v in items) if n is not None]
    if names:
        _guard_none_differs(site, names, _none_python_differs, "the tensors of a list read on the device are plain "
                            f"tensors without .grad or Python attributes ({', '.join(names[:3])}"
                            f"{', ...' if len(names) > 3 else ''})")


def _guard_none_differs(site: SyncSite, names: list, none_differ: Callable[[tuple], bool], what: str) -> None:
    """Guard the frame with "``none_differ`` of the tensors ``names`` is True", every call.

    Once per graph for a set of tensors: every read of one list table asks the same of its tensors
    (8 reads of a 64-row list guarded 512 tensors per call, 3.3x the hand-vectorized step)."""
    asked = site._tx.output.__dict__.setdefault("_nosync_none_differs", set())
    key = (none_differ, tuple(sorted(set(names))))
    if key in asked:
        return
    asked.add(key)
    get = leaf_getter(names)

    def check(L: Any, G: Any) -> bool:
        try:
            return none_differ(get(L, G))
        except Exception:
            return False

    add_lambda_guard(site, check, f"nosync: {what}")


def _meta_differs(real: Any) -> bool:
    return (type(real) is not torch.Tensor or real.grad is not None or real._is_view()
            or real.storage_offset() != 0 or real.untyped_storage().nbytes() != real.numel() * real.element_size()
            or any(not k.startswith("_dynamo") for k in getattr(real, "__dict__", None) or ()))


def _guard_input_arms(site: SyncSite, arms: list) -> None:
    """Keep checking, at every call, what _select_values checked of the input arms at compile time
    (a later call could pass a tensor with attributes, a grad, writes or a shared storage)."""
    names = [_source_name(getattr(v, "source", None)) for v in arms]
    if any(n is None for n in names):
        raise BranchRefused("BRANCH_VALUES", "an input arm has no source to guard")
    _guard_none_differs(site, names, _none_meta_differs, "the input arms of a select carry nothing a copy lacks "
                        f"({', '.join(names)}: no Python attributes, grad or shared storage)")


def guard_disjoint_storage(read: list, written: list) -> bool:
    """From the backend: guard the frame being compiled with "no tensor of ``read`` shares memory
    with one of ``written``" (placeholder nodes), checked at every call. False when a placeholder
    has no source to guard on (the caller then keeps its sync)."""
    names = [(leaf.source if (leaf := leaf_of(n)) is not None else None) for n in read + written]
    tx = _current_tx()
    if tx is None or any(n is None for n in names):
        return False
    get = leaf_getter(names)
    k = len(read)

    def check(L: Any, G: Any) -> bool:
        try:
            ts = get(L, G)
            return not shares_storage(ts[k:], ts[:k])
        except Exception:
            return False

    count = tx.output.__dict__["_nosync_disjoint"] = tx.output.__dict__.get("_nosync_disjoint", 0) + 1
    _install_guard(tx.output, f"disjoint_{count}", check, "nosync: a table or arm read by the device does not "
                   f"share memory with an input the graph writes ({', '.join(names)})")
    return True


def attribute_written_selects() -> list:
    """The RewriteUse of every select and gathered list row of the graph being compiled when the
    frame set a Python attribute (or ``.grad``) on any tensor: eager sets it on an object that a
    select or a gathered row may be (the arm, the list's tensor, reached through any other name: a
    dict, a tuple copy, an argument), while they are copies without it (and an unused select is not
    even in the graph the backend sees). Note [Attributes set on a gathered row]."""
    tx = _current_tx()
    if tx is None:
        return []
    # (Dynamo's own record as well, should the hook have missed one)
    written = getattr(tx.output, "_nosync_tensor_attr_written", False) or any(
        getattr(v, "is_tensor", lambda: False)() for v in tx.output.side_effects.store_attr_mutations)
    if not written:
        return []
    uses = list(getattr(tx.output, "_nosync_attr_written", ()))
    for n in tx.output.graph.nodes:
        use = n.meta.get(REWRITE_META)
        if isinstance(use, RewriteUse) and use.form in ("branch", "list") and use not in uses:
            uses.append(use)
    return uses


# dtypes whose truthiness a select's nonzero test (``torch.ne(t, 0)``) would not give as bool() does
_UNSELECTABLE_TESTS = {
    torch.uint64: "the test is a uint64 tensor: bool() raises on a value of 2**63 or more (it does not "
                  "fit int64), a select would not",
    getattr(torch, "float8_e8m0fnu", None): "the test is a float8_e8m0fnu tensor: the type has no zero (0 "
    "converts to 2**-127), so every value is true to bool() while a select's nonzero test is false for "
    "2**-127 (review 19)",
}
_UNSELECTABLE_TESTS.pop(None, None)  # a torch without e8m0


def _try_branch(tx: Any, inst: Any, truth_fn: Callable, push: bool, site: Optional[SyncSite]) -> bool:
    """Trace the jump at ``inst`` on a step-varying tensor test as a select between its arms (see
    Note [Rewriting a branch as a select]). True when done: the test is popped and the translator
    stands at the join with the merged state. False: the jump takes the ordinary path."""
    if (_rewriter is None or site is None or push or getattr(_state, "in_stock", False)
            or option(site.options, "select_branches", True) is False or _torch_version() < SELECT_MIN_TORCH):
        return False
    value = tx.stack[-1]
    ex = value.as_proxy().node.meta.get("example_value")
    if (not isinstance(ex, torch.Tensor) or not all(isinstance(d, int) for d in ex.shape) or ex.numel() != 1
            or _user_translator(tx) is not tx or tx.output.current_tracer is not tx.output.root_tracer):
        return False
    if any(tx.instructions[i].opname == "LOAD_ASSERTION_ERROR" for i in (tx.instruction_pointer, tx.indexof[inst.target])):
        return False  # ``assert t``: stock Dynamo traces it as torch._assert_async, no sync
    name = subclass_name(_python_type(value))
    if name is not None:
        _rewriter.refuse_branch(site, "BRANCH_VALUES", f"the test is a {name}: its own __bool__ would not run")
        return False
    why = _UNSELECTABLE_TESTS.get(ex.dtype)
    if why is not None:
        _rewriter.refuse_branch(site, "BRANCH_VALUES", why)
        return False
    use = RewriteUse("branch", "", 0)
    try:
        arm_a, arm_b, join = _branch_arms(tx, inst)
    except BranchRefused as e:
        _rewriter.refuse_branch(site, e.reason, e.detail)
        return False
    use = _rewriter.allow(site, use)
    if use is None:
        return False  # refused before (recorded then)
    out = tx.output

    def op(target: Any, *args: Any) -> Any:
        return _traced(tx, "call_function", target, *args)

    tx.pop()
    cond = value
    if ex.dtype != torch.bool:
        cond = op(torch.ne, cond.as_proxy(), 0)  # truthiness: nonzero (NaN is true, as in bool())
    if ex.dim() != 0:
        cond = op(torch.reshape, cond.as_proxy(), ())
    fall_when_true = not truth_fn(True)  # POP_JUMP_IF_FALSE falls through to the arm of a true test
    stack0, locals0 = list(tx.stack), dict(tx.symbolic_locals)
    side_effects = out.side_effects
    reachable = stack0 + list(locals0.values())
    effects = _recorded_effects(side_effects, reachable)
    side_effects.check_allowed_side_effect = _refuse_side_effect
    try:
        arms = []
        for core in (arm_a, arm_b):
            arms.append(_trace_arm(tx, core, stack0, locals0))
            after = _recorded_effects(side_effects, reachable)
            if after[:2] != effects[:2] or any(after[2].get(k) != f for k, f in effects[2].items()):
                raise BranchRefused("BRANCH_SIDE_EFFECT", "an arm sets an attribute, registers a hook or "
                                    "changes a Python object in place (an iterator's next()): the arm eager "
                                    "skips would run too")
        (stack_a, locals_a, nodes_a), (stack_b, locals_b, nodes_b) = arms
        if len(stack_a) != len(stack_b) or locals_a.keys() != locals_b.keys():
            raise BranchRefused("BRANCH_FORM", "the arms leave different stacks or locals")
        pairs = [(f"stack item {k}", stack_a, stack_b, k) for k in range(len(stack_a))]
        pairs += [(f"local {name!r}", locals_a, locals_b, name) for name in locals_a]
        merged = []
        for where, sa, sb, k in pairs:
            a, b = sa[k], sb[k]
            if a is b or (not (a.is_tensor() and b.is_tensor()) and _equivalent(a, b)):
                continue
            _select_values(a, b, where, side_effects)
            merged.append((sa, k, a, b))
        masks = _rewriter.branch_plan(nodes_a, nodes_b)
        # the index of an index op in an arm eager may skip: 0 (in range) unless its arm is taken
        taken = {True: cond, False: None}
        graph = out.graph
        for arm_nodes, arm_true in ((nodes_a, fall_when_true), (nodes_b, not fall_when_true)):
            for node, index in masks:
                if node not in arm_nodes:
                    continue
                if taken[arm_true] is None:
                    with graph.inserting_after(cond.as_proxy().node):
                        taken[arm_true] = op(torch.logical_not, cond.as_proxy())
                with graph.inserting_before(node):
                    safe = op(torch.where, taken[arm_true].as_proxy(), torch.fx.Proxy(index, out.current_tracer), 0)
                node.replace_input_with(index, safe.as_proxy().node)
        inputs = [v for _, _, a, b in merged for v in (a, b) if v.as_proxy().node.op == "placeholder"]
        if inputs:
            _guard_input_arms(site, list({id(v): v for v in inputs}.values()))
        selects: dict = {}  # one select per pair: two names of one object stay one object
        for sa, k, a, b in merged:
            sel = selects.get((id(a), id(b)))
            if sel is None:
                va, vb = (a, b) if fall_when_true else (b, a)
                sel = selects[(id(a), id(b))] = op(torch.where, cond.as_proxy(), va.as_proxy(), vb.as_proxy())
                sel.as_proxy().node.meta[REWRITE_META] = dataclasses.replace(use, length=len(merged))
            sa[k] = sel
    except Exception as e:
        from torch._dynamo.exc import RestartAnalysis, SpeculationRestartAnalysis

        if isinstance(e, SpeculationRestartAnalysis):
            # NOTE: a graph break in an arm (``.item()`` there): Dynamo marks the instruction and
            # traces again, when its handler compiles the graph so far before the break, a compile
            # the refusal then throws away (one backend compile more than stock, and the reads
            # Dynamo makes while compiling: review 21). Refused now; the retrace keeps the sync.
            e = BranchRefused("BRANCH_FORM", f"an arm breaks the graph ({getattr(e, 'restart_reason', e)})")
        elif isinstance(e, RestartAnalysis):
            raise
        if not isinstance(e, BranchRefused):
            e = BranchRefused("BRANCH_FORM", f"tracing an arm failed ({type(e).__name__}: {e})")
        _rewriter.refuse_branch(site, e.reason, e.detail)
        restart_analysis(f"nosync: {site.file}:{site.line}: {e.detail}; keeping the sync")
    finally:
        if side_effects.__dict__.get("check_allowed_side_effect") is _refuse_side_effect:
            del side_effects.check_allowed_side_effect
    tx.stack[:] = stack_a
    tx.symbolic_locals.clear()
    tx.symbolic_locals.update(locals_a)
    tx.instruction_pointer = tx.indexof[join]
    return True


_PLAIN = (str, int, float, bool, complex, type(None), torch.dtype, torch.device)
_WHERE_MADE = ("source_location",)  # a variable's record of the line that made it, not its value


def _equivalent(a: Any, b: Any, depth: int = 0) -> bool:
    """Are two variables the arms built the same thing (a constant, a bound method of one object,
    a function loaded twice)? Field by field: the same objects, equal plain values or sources, or
    equivalent variables; tensors never (two proxies are two values)."""
    from torch._dynamo.source import Source
    from torch._dynamo.variables.base import VariableTracker

    if a is b:
        return True
    if depth > 3 or type(a) is not type(b):
        return False
    if isinstance(a, VariableTracker):
        if a.is_tensor():
            return False
        da, db = vars(a), vars(b)
        return da.keys() == db.keys() and all(_equivalent(da[k], db[k], depth + 1) for k in da
                                              if k not in _WHERE_MADE)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equivalent(x, y, depth + 1) for x, y in zip(a, b))
    if isinstance(a, (float, complex)):  # 0.0 == -0.0, but they are two values
        return struct.pack("<2d", a.real, a.imag) == struct.pack("<2d", b.real, b.imag)
    if isinstance(a, _PLAIN) or isinstance(a, Source):
        try:
            return bool(a == b)
        except Exception:
            return False
    return False


class _RestartForRewrite(Exception):
    pass


def restart_analysis(reason: str) -> "NoReturn":
    """Trace the frame being compiled again from the start (from inside the backend).

    NOTE: for a rewritten read whose graph turned out to alias the row (written in place,
    returned): the policy has marked the site, and the second trace keeps the sync. The exception
    derives from ShortenTraceback so that ``_call_user_compiler`` lets it through, and from
    RestartAnalysis so that ``convert_frame`` retraces; the speculation log is cleared because the
    second trace takes another path through the bytecode (as Dynamo's compiler-collective restart
    does).
    """
    from torch._dynamo.exc import RestartAnalysis, ShortenTraceback
    from torch._dynamo.symbolic_convert import InstructionTranslator

    global _RestartForRewrite
    if not issubclass(_RestartForRewrite, RestartAnalysis):
        _RestartForRewrite = type("NosyncRewriteRestart", (RestartAnalysis, ShortenTraceback), {})
    InstructionTranslator.current_tx().speculation_log.clear()
    err = _RestartForRewrite.__new__(_RestartForRewrite)
    Exception.__init__(err, reason)
    err.restart_reason = reason
    err.first_useful_frame = None
    raise err


def _is_generic_jump(fn: Any) -> bool:
    return (
        isinstance(fn, types.FunctionType)
        and fn.__qualname__.startswith("generic_jump.")
        and fn.__code__.co_freevars is not None
        and "truth_fn" in fn.__code__.co_freevars
    )


def _closure(fn: Any) -> dict[str, Any]:
    return {name: cell.cell_contents for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ())}


def _make_jump_hook(original: Callable) -> Callable:
    cl = _closure(original)
    truth_fn, push = cl["truth_fn"], cl["push"]

    @functools.wraps(original)
    def hook(self: Any, inst: Any) -> Any:
        value = self.stack[-1] if self.stack else None
        if value is not None and getattr(value, "is_tensor", lambda: False)():
            ok, decided, site = _ask_policy(self, value.realize(), JUMP_KIND)
            if not ok:
                # >>> device-side rewrite hook point (issue 13): Note [Rewriting a branch as a select]
                if _try_branch(self, inst, truth_fn, push, site):
                    return None
                if site is not None and site.fullgraph and decided and _rewriter is not None:
                    refused = _rewriter.refusal(site)  # name it in the fullgraph error too
                    decided = f"{decided}; not selected on the device: {refused}" if refused else decided
                # <<<
                return _stock(site, decided, lambda: original(self, inst))
            # Hoist the *decision*: keep the tested tensor itself on the stack when the
            # instruction leaves it there (JUMP_IF_*_OR_POP: `c = a.any() or b`).
            self.pop()
            if truth_fn(bool(decided)):
                if push:
                    self.push(value)
                self.jump(inst)
            return None
        return original(self, inst)

    hook.__nosync_hook__ = True  # type: ignore[attr-defined]
    return hook


def _translator_classes() -> list[type]:
    from torch._dynamo.symbolic_convert import InstructionTranslatorBase

    out, todo = [], [InstructionTranslatorBase]
    while todo:
        cls = todo.pop()
        out.append(cls)
        todo.extend(cls.__subclasses__())
    return out


def _replace_tp_method(cls: type, attr: str, hook: Callable) -> bool:
    """torch>=2.14: replace the entry of the class-level method table too."""
    original = _originals.get(f"TensorVariable.{attr}")
    return _swap_tp_method(cls, attr, lambda v: v is original, hook)


def _swap_tp_method(cls: type, attr: str, is_old: Callable[[Any], bool], new: Callable) -> bool:
    """Put ``new`` wherever the ``tp_methods`` entries under ``attr``'s own keys hold a handler
    for which ``is_old`` is true (the entry itself, or its ``fn``/``func``/... field); True when
    one was replaced. Another attribute's entry keeps its own handler."""
    table = getattr(cls, "tp_methods", None)
    if not isinstance(table, dict):
        return False
    name = attr[len("method_") :] if attr.startswith("method_") else attr
    replaced = False
    for key in (name, attr):
        entry = table.get(key)
        if entry is None:
            continue
        for fld in ("fn", "func", "impl", "handler"):
            if hasattr(entry, fld) and is_old(getattr(entry, fld)):
                try:
                    setattr(entry, fld, new)
                except (AttributeError, TypeError):
                    import dataclasses

                    if dataclasses.is_dataclass(entry):
                        table[key] = dataclasses.replace(entry, **{fld: new})
                replaced = True
        if not replaced and callable(entry) and is_old(entry):
            table[key] = new
            replaced = True
    return replaced


# A weak reference to the compile context of the frame Dynamo was compiling when the hooks were
# installed (None: none was): that frame was traced without them (see installed_while_tracing).
# NOTE: the context object, not the compile id: ids start again at 0/0 after torch._dynamo.reset().
_installed_in_compile: Any = None


def _compile_context() -> Any:
    from torch._guards import CompileContext

    return CompileContext.try_get()


def installed_while_tracing() -> bool:
    """Were the hooks installed during the compile of the frame being compiled now? Then that frame
    was traced without them: the nosync backend was first loaded from inside the compile (a
    wrapper that looks ``"nosync"`` up by name when it is called, after the trace:
    ``CompileCounterWithBackend("nosync")``), and no sync of the frame was hoisted or rewritten."""
    ctx = _compile_context()
    return ctx is not None and _installed_in_compile is not None and _installed_in_compile() is ctx


def install(policy: Policy, backend_matcher: Callable[[Any], bool]) -> bool:
    """Install the hooks (idempotent). Returns False when the pass is disabled for this torch."""
    global _policy, _backend_matcher, _installed, _disabled_reason, _installed_in_compile
    with _install_lock:
        _backend_matcher = backend_matcher
        if _installed:
            _policy = policy
            return _disabled_reason is None
        ctx = _compile_context()
        _installed_in_compile = weakref.ref(ctx) if ctx is not None else None
        reason = _unsupported_reason()
        if reason is None:
            try:
                _patch()
            except Exception as e:  # a hook point moved
                reason = f"could not install a Dynamo hook: {type(e).__name__}: {e}"
                log.debug("nosync: hook install failed", exc_info=True)
                _unpatch()
        _installed = True
        if reason is None:
            _policy = policy
            result = self_test()
            dead = [k for k, ok in result.items() if not ok]
            if dead:
                reason = "Dynamo hook(s) installed but never fired: " + ", ".join(dead)
                _unpatch()
        if reason is not None:
            _policy = None
            _disabled_reason = reason
            warnings.warn(
                f"torchsync_pass: the nosync pass is disabled on torch {torch.__version__} "
                f"(Python {sys.version_info.major}.{sys.version_info.minor}): {reason}. "
                "backend='nosync' now behaves exactly like stock Inductor.",
                RuntimeWarning,
                stacklevel=3,
            )
            return False
        return True  # _policy was set for the self-test


def disabled_reason() -> Optional[str]:
    return _disabled_reason


def _unsupported_reason() -> Optional[str]:
    ver = _torch_version()
    lo, hi = SUPPORTED_TORCH
    if os.environ.get("TORCHSYNC_PASS_ANY_TORCH") == "1":
        # Experiments only (e.g. a GPU box whose torch is older): the self-test still decides.
        log.warning("TORCHSYNC_PASS_ANY_TORCH=1: skipping the torch version check (torch %s)", torch.__version__)
    elif not (lo <= ver < hi):
        return f"torch {torch.__version__} is outside the supported range >={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]}"
    if sys.version_info < (3, 11) or sys.version_info >= (3, 14):
        return f"Python {sys.version_info.major}.{sys.version_info.minor} is not supported (3.11-3.13)"
    return None


def _patch() -> None:
    from torch._dynamo.variables.tensor import TensorVariable

    for kind in _METHOD_HOOKS:
        attr = _method_attr(kind)  # AttributeError: hook point missing
        if attr is None:  # no hook point on this release (see HOOK_TABLE)
            continue
        original = getattr(TensorVariable, attr)
        _originals[f"TensorVariable.{attr}"] = original
        hook = _make_method_hook(attr, kind, original)
        setattr(TensorVariable, attr, hook)
        _replace_tp_method(TensorVariable, attr, hook)

    found = 0
    hooks: dict[int, Callable] = {}
    for cls in _translator_classes():
        for name, fn in list(vars(cls).items()):
            if _is_generic_jump(fn):
                _originals.setdefault(f"{cls.__qualname__}.{name}", fn)
                hooks.setdefault(id(fn), _make_jump_hook(fn))
                setattr(cls, name, hooks[id(fn)])
                found += 1
        table = cls.__dict__.get("dispatch_table")
        if isinstance(table, list):
            for i, fn in enumerate(table):
                if _is_generic_jump(fn):
                    hooks.setdefault(id(fn), _make_jump_hook(fn))
                    _originals.setdefault(f"{cls.__qualname__}.dispatch_table[{i}]", fn)
                    table[i] = hooks[id(fn)]
                    found += 1
    if not found:
        raise AttributeError("no generic_jump handlers found on the instruction translators")
    _patch_subscript()
    _patch_grad()
    _patch_store_attr()
    _patch_check_all()


# NOTE [The .grad of a gathered row]: eager's row is a view of the table (or the list's own
# tensor, checked at every call to have no .grad): its ``.grad`` is None. The gathered row is a new
# tensor in the graph, and Dynamo before torch 2.13 answers ``.grad`` of any tensor computed in the
# graph with an attribute proxy, which ``is not None`` takes for a tensor (stock ``(x * 1).grad is
# not None`` is True on 2.11; 2.12 answers it for some rows only; 2.13 answers None for a tensor
# the graph made, in ``method_attr_grad``). On those releases
# the row's ``.grad`` is answered None, as eager's row answers, unless the step set it.
def _grad_hooked() -> bool:
    return _torch_version() < (2, 13)


def _make_grad_hook(original: Callable) -> Callable:
    @functools.wraps(original)
    def var_getattr(self: Any, tx: Any, name: str) -> Any:
        if name == "grad" and type(self).__name__ == "TensorVariable":
            proxy = getattr(self, "proxy", None)
            node = getattr(proxy, "node", None)
            if node is not None and REWRITE_META in node.meta and node.target is torch.ops.aten.index.Tensor \
                    and not tx.output.side_effects.has_pending_mutation_of_attr(self, "grad"):
                from torch._dynamo.variables import ConstantVariable

                return ConstantVariable.create(None)
        return original(self, tx, name)

    var_getattr.__nosync_hook__ = True  # type: ignore[attr-defined]
    return var_getattr


# NOTE [Attributes set on a gathered row]: Dynamo drops the attribute writes of a tensor nobody
# reads after the trace (the row of ``r = rows[i]; r.tag = 3``) before the backend sees the graph,
# while eager set the attribute on the list's own tensor, which a later read of the same row sees.
# Every attribute write Dynamo records is noted here at the time, on the traced frame's output.
def _make_store_attr_hook(original: Callable) -> Callable:
    @functools.wraps(original)
    def store_attr(self: Any, item: Any, name: str, value: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            if getattr(item, "is_tensor", lambda: False)():
                use = item.as_proxy().node.meta.get(REWRITE_META)
                if isinstance(use, RewriteUse) and in_self_test():
                    _state.attr_seen = True  # the self-test's row is a tensor table's: a view in eager
                tx = _current_tx()
                if tx is not None:  # any tensor: it may be an arm or a list's tensor under another name
                    tx.output.__dict__["_nosync_tensor_attr_written"] = True
                    if isinstance(use, RewriteUse) and use.form in ("branch", "list"):
                        tx.output.__dict__.setdefault("_nosync_attr_written", []).append(use)
        except Exception:  # noqa: BLE001 - never break Dynamo's own store
            log.debug("nosync: attribute-store note failed", exc_info=True)
        return original(self, item, name, value, *args, **kwargs)

    store_attr.__nosync_hook__ = True  # type: ignore[attr-defined]
    return store_attr


def _patch_store_attr() -> None:
    from torch._dynamo.side_effects import SideEffects

    _wrap_method(SideEffects, "store_attr", _make_store_attr_hook)


def _wrap_method(cls: type, name: str, make: Callable[[Callable], Callable]) -> None:
    """Replace ``cls.name`` by ``make(original)`` (once), keeping the original for _unpatch."""
    original = cls.__dict__[name]
    if getattr(original, "__nosync_hook__", False):
        return
    _wrapped_methods.append((cls, name, original))
    setattr(cls, name, make(original))


def _patch_grad() -> None:
    from torch._dynamo.variables.tensor import TensorVariable

    if _grad_hooked():
        _wrap_method(TensorVariable, "var_getattr", _make_grad_hook)


# NOTE [torch._check_tensor_all before torch 2.13]: transformers' ``torch_check`` (Qwen2-VL's
# image-token count check) calls ``torch._check_tensor_all(cond)``. Torch 2.13 traces it as
# ``cond._is_all_true().item()`` and a check of the value, so the read reaches the ``.item()`` hook;
# 2.11 and 2.12 put the call in the graph as it is, and its fake run breaks inside the op ("Data
# dependent operator") where no hook sees it. On those releases the call is handed to the policy
# as 2.13 would: ``cond._is_all_true()`` traced, its read asked for; a hoisted True makes the check
# a no-op (eager's check passes, its message is never built). Anything else (not hoisted, or False:
# eager raises) takes Dynamo's own path, as stock.
def _check_all_hooked() -> bool:
    return _torch_version() < (2, 13)


def _check_all_cond(fn: Any, args: Any, kwargs: Any) -> Any:
    """The ``cond`` argument of ``torch._check_tensor_all(cond, message=None)`` or
    ``torch._check_tensor_all_with(error_type, cond, message=None)``, None when not given."""
    pos = 1 if fn is torch._check_tensor_all_with else 0
    return args[pos] if len(args) > pos else kwargs.get("cond")


def _make_check_all_hook(original: Callable) -> Callable:
    @functools.wraps(original)
    def call_function(self: Any, tx: Any, args: Any, kwargs: Any) -> Any:
        fn = getattr(self, "value", None)
        if (fn is torch._check_tensor_all or fn is torch._check_tensor_all_with) \
                and not getattr(_state, "in_stock", False) and _nosync_options(tx) is not None:
            cond = _check_all_cond(fn, args, kwargs)
            # (a cond of another dtype: torch's own check raises TypeError first, as stock shows)
            if cond is not None and getattr(cond, "is_tensor", lambda: False)() \
                    and getattr(cond.as_proxy().node.meta.get("example_value"), "dtype", None) is torch.bool:
                scalar = cond.call_method(tx, "_is_all_true", [], {})
                ok, value, site = _ask_policy(tx, scalar, "item")
                if ok and value:
                    return _const(tx, None)
                return _stock(site, value if not ok else "the check fails: eager raises",
                              lambda: original(self, tx, args, kwargs))
        return original(self, tx, args, kwargs)

    call_function.__nosync_hook__ = True  # type: ignore[attr-defined]
    return call_function


def _patch_check_all() -> None:
    from torch._dynamo.variables.torch import TorchInGraphFunctionVariable

    if _check_all_hooked():
        _wrap_method(TorchInGraphFunctionVariable, "call_function", _make_check_all_hook)


def _patch_subscript() -> None:
    """Wrap the BINARY_SUBSCR handler (Note [Rewriting a subscript at a tensor index]) and, where
    the select runs (torch 2.13+), the IS_OP / CONTAINS_OP handlers (Note [Identity comparisons a
    select could change])."""
    _patch_opcode("BINARY_SUBSCR", _make_subscr_hook)
    if _identity_hooked():
        for opname in _IDENTITY_OPS:
            _patch_opcode(opname, _make_identity_hook)


def _patch_opcode(opname: str, make: Callable[[Callable], Callable]) -> None:
    """Wrap the handler of ``opname``: the class attribute where a translator class defines it,
    and its dispatch_table entry in every class."""
    opcode = dis.opmap.get(opname)
    if opcode is None:
        raise AttributeError(f"this Python has no {opname} opcode")
    hooks: dict[int, Callable] = {}
    found = 0
    for cls in _translator_classes():
        fn = cls.__dict__.get(opname)
        if fn is not None and not getattr(fn, "__nosync_hook__", False):
            _originals.setdefault(f"{cls.__qualname__}.{opname}", fn)
            setattr(cls, opname, hooks.setdefault(id(fn), make(fn)))
        table = cls.__dict__.get("dispatch_table")
        fn = table[opcode] if isinstance(table, list) else None
        if fn is not None and not getattr(fn, "__nosync_hook__", False):
            _originals.setdefault(f"{cls.__qualname__}.dispatch_table[{opcode}]", fn)
            table[opcode] = hooks.setdefault(id(fn), make(fn))
            found += 1
    if not found:
        raise AttributeError(f"no {opname} handler found on the instruction translators")


def _unpatch() -> None:
    from torch._dynamo.variables.tensor import TensorVariable

    for cls, name, original in _wrapped_methods:
        setattr(cls, name, original)
    _wrapped_methods.clear()
    for key, original in list(_originals.items()):
        owner, _, attr = key.partition(".")
        if owner == "TensorVariable":
            setattr(TensorVariable, attr, original)
            _replace_tp_method_back(TensorVariable, attr, original)
    for cls in _translator_classes():
        for name, fn in list(vars(cls).items()):
            if getattr(fn, "__nosync_hook__", False):
                setattr(cls, name, _originals.get(f"{cls.__qualname__}.{name}", fn.__wrapped__))
        table = cls.__dict__.get("dispatch_table")
        if isinstance(table, list):
            for i, fn in enumerate(table):
                if getattr(fn, "__nosync_hook__", False):
                    table[i] = fn.__wrapped__
    _originals.clear()


def _replace_tp_method_back(cls: type, attr: str, original: Callable) -> None:
    """Undo :func:`_replace_tp_method` for ``attr``: only where the entries hold the hook wrapping
    ``original``."""

    def ours(v: Any) -> bool:
        return getattr(v, "__nosync_hook__", False) and getattr(v, "__wrapped__", None) is original

    _swap_tp_method(cls, attr, ours, original)


# --------------------------------------------------------------------------------------------
# Self-test: does each hook actually fire on a tiny function?
# --------------------------------------------------------------------------------------------
class _SelfTestBackend:
    """The self-test's backend (the hooks treat it as nosync): counts the graphs it is given."""

    def __init__(self) -> None:
        self.graphs = 0
        self.identity_uses: list[str] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
        self.graphs += 1
        self.identity_uses += identity_uses() or []
        return gm.forward


SELF_TEST_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_self_test_fns.py")

# The file name of the code nosync generates (guard checks, leaf getters, the invariant runner's
# call): inside the package, so the sync counter's walk to the user's frame passes it like the
# package's own code (review 23: named ``<string>``, a read inside a runner's graph was counted at
# ``<string>:5``, two functions' reads at one site).
GENERATED_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "<generated>")


def is_dynamo_guard_frame(frame: Any) -> bool:
    """Is ``frame`` a guard function Dynamo generated (``exec``'d as ``<string>``, named ``guard``,
    called from Dynamo's code: torch 2.11's Python guard for a float argument reads a 0-d tensor
    there; a user's exec'd hook named ``guard``, called from torch.nn, is not: review 23)?
    NOTE: Dynamo-internal naming; the sync counter passes such a frame like torch's own code."""
    code = frame.f_code
    back = frame.f_back
    return (code.co_filename == "<string>" and code.co_name == "guard" and back is not None
            and back.f_code.co_filename.startswith(os.path.join(TORCH_DIR, "_dynamo", "")))


def run_generated(source: str, env: dict) -> None:
    """``exec`` nosync-generated ``source`` in ``env`` under :data:`GENERATED_FILE`."""
    exec(compile(source, GENERATED_FILE, "exec"), env)  # noqa: S102 - generated by nosync itself


def in_self_test() -> bool:
    """True while the hook self-test runs (its syncs and graphs are not the user's)."""
    return getattr(_state, "self_test", False)


def _self_test_fns() -> dict[str, Callable]:
    # NOTE: compiled from source on every call, so each self-test run has fresh code objects: it
    # never meets cache entries of an earlier run and never needs torch._dynamo.reset(), which
    # would throw away everything the user's process has compiled so far.
    env: dict[str, Any] = {"operator": operator, "check_all": torch._check_tensor_all}
    with open(SELF_TEST_FILE, encoding="utf-8") as f:
        exec(compile(f.read(), SELF_TEST_FILE, "exec"), env)  # noqa: S102
    out = {}
    for kind in _METHOD_HOOKS:
        fn = env[f"f_{kind}"]
        try:
            attr = _method_attr(kind)
        except AttributeError:
            attr = hook_row()[kind]
        if attr is None:  # torch 2.11, no hook point of its own: bool/int/float via Tensor.item()
            if kind != "index":  # operator.index(t) stays a stock graph break there: not tested
                out[f"{kind}() via TensorVariable.method_item"] = fn
            continue
        out[f"TensorVariable.{attr}"] = fn
    out["generic_jump (dispatch_table)"] = env["f_jump"]
    out["BINARY_SUBSCR (dispatch_table)"] = env["f_subscript"]
    if _grad_hooked():
        out["TensorVariable.var_getattr (a gathered row's .grad)"] = env["f_row_grad"]
    out["SideEffects.store_attr (an attribute set on a gathered row)"] = env["f_row_attr"]
    if _check_all_hooked():
        out["TorchInGraphFunctionVariable.call_function (torch._check_tensor_all)"] = env["f_check_all"]
    if _identity_hooked():
        out["IS_OP (dispatch_table)"] = env["f_is"]
        out["CONTAINS_OP (dispatch_table)"] = env["f_contains"]
    return out


class _ProbeRewriter:
    """The self-test's rewrite policy: allows every rewrite and notes its kind."""

    def __init__(self, seen: list) -> None:
        self.seen = seen

    def allow(self, site: SyncSite, use: RewriteUse) -> RewriteUse:
        self.seen.append(site.kind)
        return use

    def kept(self, site: SyncSite, reason: str, detail: str) -> None:
        pass


def self_test(verbose: bool = False) -> dict[str, bool]:
    """Compile one tiny function per hook point with a marker backend; True where the hook fired.

    Each function's sync must reach our policy *and* be replaced by a constant: the compiled
    function must then produce one graph (no break) and the eager result.
    """
    global _policy, _backend_matcher, _self_test_result
    results: dict[str, bool] = {}
    seen: list[str] = []

    def probe_policy(site: SyncSite) -> tuple[bool, Any]:
        seen.append(site.kind)
        real = site.leaves[0].example
        with torch.no_grad():
            t = real.sum() if site.kind != "tolist" else real
            value = {"item": torch.Tensor.item, "tolist": torch.Tensor.tolist, "int": int, "float": float,
                     "index": operator.index}.get(site.kind, bool)(t)  # bool: bool() and the jump
        return True, value

    if not _installed:
        # Standalone use (python -c "...self_test()"): install with a do-nothing policy first;
        # install() runs this self-test itself.
        install(lambda site: (False, None), lambda fn: False)
        if _self_test_result is not None:
            if verbose:
                for k, ok in _self_test_result.items():
                    print(f"  {'ok  ' if ok else 'DEAD'} {k}")
            return dict(_self_test_result)
    if not _originals:
        return {k: False for k in _self_test_fns()}
    saved = (_policy, _backend_matcher)
    from torch._dynamo.utils import counters

    saved_counters = {k: dict(v) for k, v in counters.items()}
    saved_rewriter = _rewriter
    _state.self_test = True
    _policy = probe_policy
    _backend_matcher = lambda fn: isinstance(fn, _SelfTestBackend)  # noqa: E731
    install_rewriter(_ProbeRewriter(seen))
    try:
        for name, fn in _self_test_fns().items():
            seen.clear()
            ints = fn.__name__ in ("f_tolist", "f_index", "f_int", "f_subscript", "f_row_grad", "f_row_attr")
            x = torch.tensor([2, 3]) if ints else torch.tensor([2.0, 3.0])
            try:
                backend = _SelfTestBackend()
                _state.attr_seen = False
                with _probe_config():  # the default config; traced, never loaded from a saved cache
                    got = torch.compile(fn, backend=backend)(x)
                fired = backend.identity_uses if fn.__name__ in ("f_is", "f_contains") else seen
                if fn.__name__ == "f_row_attr":
                    fired = fired if getattr(_state, "attr_seen", False) else []
                ok = bool(fired) and backend.graphs == 1 and torch.equal(got, fn(x))
            except Exception:
                log.debug("nosync self-test %s failed", name, exc_info=True)
                ok = False
            results[name] = ok
            if verbose:
                print(f"  {'ok  ' if ok else 'DEAD'} {name}")
    finally:
        _state.self_test = False
        _policy, _backend_matcher = saved
        install_rewriter(saved_rewriter)
        counters.clear()
        for k, v in saved_counters.items():
            counters[k].update(v)
    _self_test_result = results
    return results


def hook_points() -> list[str]:
    """Names of every hook point, as the self-test reports them."""
    return list(_self_test_fns())


if __name__ == "__main__":  # python -m torchsync_pass.dynamo_hooks
    ok = install(lambda site: (False, None), lambda fn: False)
    print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")
    res = _self_test_result or {}
    for k in hook_points():
        print(f"  {'ok  ' if res.get(k) else 'DEAD'} {k}")
    sys.exit(0 if ok else 1)


# --------------------------------------------------------------------------------------------
# Which compiled frames belong to a function (serving.check_request)
# --------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)  # one per process; check_request asks per request
def wrap_inline_code() -> types.CodeType:
    """The code of Dynamo's ``wrap_inline`` frame, ``inner(*args, **kwargs): return fn(*args,
    **kwargs)``, which ``torch.compile`` puts around a callable it cannot start tracing in (a
    ``torch.no_grad()``-decorated function, a ``functools.partial``, a module whose forward is in a
    skipped file). One code object for every such callable: its closure ``fn`` tells them apart."""
    from torch._dynamo import external_utils

    return external_utils.wrap_inline(len).__code__


@functools.lru_cache(maxsize=None)  # one per process; check_request asks per request
def wrap_inline_globals() -> dict:
    """The globals of Dynamo's ``wrap_inline`` frame: where Dynamo installs the modules
    (``G['__import___main__']``) through which the guards read the globals of the functions that
    frame inlines."""
    from torch._dynamo import external_utils

    return external_utils.wrap_inline(len).__globals__


def resume_codes(code: types.CodeType) -> list[types.CodeType]:
    """The resume functions Dynamo generated from ``code`` after graph breaks, transitively (a
    resume function's own graph breaks generate more; Dynamo caches them under the code they were
    generated from, ``ContinueExecutionCache.cache[code][key]``)."""
    from torch._dynamo.resume_execution import ContinueExecutionCache

    out: list[types.CodeType] = []
    todo, seen = [code], {id(code)}
    while todo:
        for resume in (ContinueExecutionCache.cache.get(todo.pop()) or {}).values():
            if id(resume) not in seen:
                seen.add(id(resume))
                out.append(resume)
                todo.append(resume)
    return out


def closure_identity(code: types.CodeType, frame_locals: Any, cells: Any = None) -> Optional[tuple]:
    """Who a compiled frame belongs to among the functions sharing its code, in two parts: the ids
    of its closure cells (they stay when a closure variable is rebound) and the identity of their
    contents, read from the frame's locals by name (what a caller can name without the cells: the
    callable Dynamo's wrap_inline frame wraps; a bound method counts as its function and instance,
    each attribute access making a new method object). :func:`same_owner` matches either part.
    None when neither is known (matches any frame)."""
    by_cell = None
    if cells is not None and len(cells) == len(code.co_freevars):
        by_cell = tuple(id(c) for c in cells)
    by_value = None
    if frame_locals is not None:
        try:
            by_value = tuple(_identity(frame_locals[name]) for name in code.co_freevars)
        except (KeyError, TypeError):
            pass
    return None if by_cell is None and by_value is None else (by_cell, by_value)


def same_owner(a: Optional[tuple], b: Optional[tuple]) -> bool:
    """Whether two :func:`closure_identity` may be the same function's (unknown: yes; one whose
    closure values died: no, whatever now lives at their addresses)."""
    if a is None or b is None:
        return True
    if not (_alive(a[1]) and _alive(b[1])):
        return False
    return any(x is not None and x == y for x, y in zip(a, b))


class _Ident:
    """An object's identity that outlives it without keeping it: its ``id`` and, where the object
    takes one, a weak reference; equal to another only while both objects are alive (an id is
    reused as soon as its object dies)."""

    __slots__ = ("id", "ref")

    def __init__(self, value: Any) -> None:
        self.id = id(value)
        try:
            self.ref: Any = weakref.ref(value)
        except TypeError:  # ints, strings, tuples, cells: the id only
            self.ref = None

    def alive(self) -> bool:
        return self.ref is None or self.ref() is not None

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, _Ident) and self.id == other.id and self.alive() and other.alive()

    __hash__ = None  # type: ignore[assignment]


def _alive(by_value: Optional[tuple]) -> bool:
    for v in by_value or ():
        for part in v if isinstance(v, tuple) else (v,):
            if isinstance(part, _Ident) and not part.alive():
                return False
    return True


def _identity(value: Any) -> Any:
    if isinstance(value, types.MethodType):
        return ("method", _Ident(value.__func__), _Ident(value.__self__))
    return _Ident(value)


def frame_owner(site: SyncSite) -> Optional[tuple]:
    """:func:`closure_identity` of the frame ``site`` is being compiled in (its cells are the
    frame's closure, which the root translator keeps)."""
    if site.frame_code is None:
        return None
    root = getattr(getattr(site._tx, "output", None), "root_tx", None)
    return closure_identity(site.frame_code, site.frame_locals, getattr(root, "closure", None))


def inline_wrapper_of(compiled: Any) -> Any:
    """The wrap_inline function ``torch.compile`` put around a callable, from the function it
    returned (its ``compile_wrapper`` closes over it as ``fn``), or None."""
    code = getattr(compiled, "__code__", None)
    if code is None or "fn" not in code.co_freevars:
        return None
    try:
        inner = compiled.__closure__[code.co_freevars.index("fn")].cell_contents
    except (ValueError, TypeError):
        return None
    return inner if getattr(inner, "__code__", None) is wrap_inline_code() else None


def code_key(code: types.CodeType) -> tuple:
    """A code object's place in the source (file, first line, name): the same for the code Dynamo
    transforms it into, which is what runs in the caller's frame while a callee is compiled."""
    return (code.co_filename, code.co_firstlineno, code.co_name)


def calling_code_keys(limit: int = 256) -> frozenset:
    """:func:`code_key` of every Python frame on the stack (the frames a compile happens inside):
    a frame Dynamo compiles on its own after a graph break at a call is compiled while its
    caller's compiled code runs."""
    keys = set()
    f = sys._getframe(1)
    while f is not None and len(keys) < limit:
        keys.add(code_key(f.f_code))
        f = f.f_back
    return frozenset(keys)

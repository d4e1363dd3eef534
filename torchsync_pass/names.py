"""The names of ``options['invariant']``: which leaves they declare, and whether they name anything.

A declared name is an argument of the function given to ``torch.compile`` or a dotted path from
one (``token_types``, ``self.attn.mask``, ``kwargs.ids``, ``args.0``); a bare name also stands
for the module's own attribute (``mask`` for ``self.mask``). Dynamo does not always compile that
function as the frame: a decorator's wrapper (``functools.wraps``, torch's around
``@torch.no_grad()``, diffusers' wrapped forwards, accelerate's ``partial(new_forward, module)``)
calls it, a module's hook or a callee after a graph break is compiled as a frame of its own, code
after a graph break runs in a resume function. So the names are resolved where they belong: in
the function ``torch.compile`` was given, found on the stack (:func:`_entry_scope`: Dynamo's entry
frame holds it and this call's arguments), unwrapped and bound to the arguments. A leaf is
declared when its object is one a declared name resolves to (:func:`is_declared`).
"""

from __future__ import annotations

import dis
import functools
import inspect
import itertools
import logging
import re
import types
from typing import Any, Iterable, Iterator, Optional

import torch

from . import _torch_private, dynamo_hooks
from .errors import NosyncOptionsError

log = logging.getLogger("torchsync_pass")


def is_declared(name: str, declared: Iterable[str], source: str = "") -> bool:
    """Is the leaf of user name ``name`` (``self.attn.mask``) and guard source ``source`` (read on
    the frame being compiled) among the declared names? Inside a compiled call: when its object is
    one the declared names resolve to (:func:`declared_objects`); nothing is when the function
    cannot be told (a decorator without ``functools.wraps`` hides it). Elsewhere, by name: ``mask``
    declares ``self.mask`` (and an argument ``mask``), ``self.mask`` only the module's. A global
    (``G[...]``) is never declared (names are arguments and their attributes)."""
    if source.startswith("G["):
        return False
    declared = tuple(declared)
    if _torch_private.compile_entry_call() is None:  # not inside a compiled call
        return name in declared or (name.startswith("self.") and name[5:] in declared)
    entry = _entry_scope()
    if entry is None or not source or not _stands_for_entry(dynamo_hooks.current_frame()[0], entry, source):
        return False  # the function is hidden, or the frame is a callee's, a hook's: not declared
    objects = declared_objects(declared)
    try:
        leaf = dynamo_hooks.leaf_getter([source])(dynamo_hooks.current_frame()[1], dynamo_hooks.current_frame_globals())[0]
    except Exception:  # a source only Dynamo can read: not declared (a sync, never a stale value)
        return False
    return any(o is leaf for o in objects)


def _stands_for_entry(code: Any, entry: tuple, source: str) -> bool:
    """Does the leaf of ``source`` in the frame ``code`` stand for the same path of the function
    given to torch.compile on every call? Yes in that function's frame and its wrappers' on the way;
    in its resume function (the code after a graph break) for an argument the function never
    assigns. Not in a callee or hook compiled as a frame of its own: it may be called with other
    objects (``helper(mask)`` then ``helper(x)``), and a decision by identity would outlive them."""
    codes, fn_code, _ = entry
    if code is None:
        return False
    if dynamo_hooks.code_key(code) in codes:
        return True
    resume = dynamo_hooks.RESUME_RE.match(code.co_name)
    root = re.match(r"L\['([^']+)'\]", source)
    if not resume or root is None or resume.group(1) != fn_code.co_name or code.co_filename != fn_code.co_filename:
        return False
    stored = {i.argval for i in dis.get_instructions(fn_code) if i.opname in ("STORE_FAST", "DELETE_FAST", "STORE_DEREF")}
    return root.group(1) in _arg_names(fn_code) and root.group(1) not in stored


def declared_objects(declared: tuple) -> Optional[list]:
    """The objects the declared names resolve to in this compiled call (each name in the function
    ``torch.compile`` was given and, when the frame compiled is one of its wrappers, in that
    frame), or None outside a compiled call."""
    entry = _entry_scope()
    if entry is None:
        return None
    out = []
    for code, scope in _scopes(entry):
        for name in declared:
            for path in _paths(name, _arg_names(code)):
                obj = _resolve(path, scope)
                if obj is not None:
                    out.append(obj)
    return out


def _scopes(entry: tuple) -> list[tuple[Any, dict]]:
    """Where the names resolve: the function given to torch.compile, and the frame compiled when
    it is a wrapper on the way to it (its own names: ``kwargs.ids``)."""
    codes, fn_code, bound = entry
    scopes = [(fn_code, bound)]
    code, frame_locals = dynamo_hooks.current_frame()
    if code is not None and isinstance(frame_locals, dict) and dynamo_hooks.code_key(code) in codes \
            and dynamo_hooks.code_key(code) != dynamo_hooks.code_key(fn_code):
        scopes.append((code, frame_locals))
    return scopes


def _entry_scope() -> Optional[tuple[set, Any, dict]]:
    """``(codes on the way, code, arguments)`` of the function ``torch.compile`` was given, for
    the compiled call running now: Dynamo's entry frame (:func:`_torch_private.compile_entry_call`)
    holds the callable and this call's arguments; unwrapped (:func:`_unwrapping`) and bound to them
    (keywords it does not take dropped: a wrapper may rename them). None when not found or they
    do not bind."""
    call = _torch_private.compile_entry_call()
    if call is None:
        return None
    codes = set()
    for fn, args, kwargs in _unwrapping(*call):
        c = getattr(fn, "__code__", None)
        if c is not None:
            codes.add(dynamo_hooks.code_key(c))
    if not isinstance(fn, types.FunctionType) or _opaque(fn.__code__):
        return None
    try:
        sig = inspect.signature(fn, follow_wrapped=False)
        if not any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
            kwargs = {n: v for n, v in kwargs.items() if n in sig.parameters}
        bound = sig.bind_partial(*args, **kwargs)
    except (TypeError, ValueError):
        return None
    return codes, fn.__code__, dict(bound.arguments)


def _unwrapping(fn: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Iterator[tuple[Any, tuple, dict]]:
    """Each callable a call of ``fn(*args, **kwargs)`` goes through, with the arguments it gets,
    down to the Python function it runs: a module (its ``forward``; also torch's own methods of
    one, ``_wrapped_call_impl``), bound methods, ``__wrapped__`` (``functools.wraps``: the same
    arguments; on a partial only as accelerate's ``partial(new_forward, module)`` forward, whose
    ``__wrapped__`` is the module's old forward), ``functools.partial``, a callable object (its
    ``__call__``), torch's own wrapper that passes its arguments on to the one callable it closes
    over."""
    kwargs = dict(kwargs or {})
    for _ in range(32):
        yield fn, args, kwargs
        call = getattr(type(fn), "__call__", None)
        wrapped = getattr(fn, "__wrapped__", None)
        if isinstance(fn, types.MethodType) and isinstance(fn.__self__, torch.nn.Module) \
                and getattr(torch.nn.Module, fn.__name__, None) is fn.__func__:  # _wrapped_call_impl
            fn = fn.__self__
        elif isinstance(fn, types.MethodType):
            args, fn = (fn.__self__, *args), fn.__func__
        elif isinstance(fn, torch.nn.Module):
            fn = fn.forward
        elif isinstance(fn, functools.partial) and isinstance(wrapped, types.MethodType) \
                and len(fn.args) == 1 and fn.args[0] is wrapped.__self__:  # accelerate's forward
            fn = wrapped
        elif isinstance(wrapped, types.FunctionType | functools.partial | types.MethodType) \
                and not isinstance(fn, functools.partial):
            fn = wrapped
        elif isinstance(fn, functools.partial):
            args, kwargs, fn = (*fn.args, *args), {**fn.keywords, **kwargs}, fn.func
        elif isinstance(fn, types.FunctionType) and _in_torch(fn.__code__) and _opaque(fn.__code__) \
                and len(inner := [c.cell_contents for c in fn.__closure__ or () if _is_callable_cell(c)]) == 1:
            fn = inner[0]  # torch's own pass-on wrapper (Dynamo's wrap_inline around a no_grad forward)
        elif not isinstance(fn, (types.FunctionType, type)) and isinstance(call, types.FunctionType):
            args, fn = (fn, *args), call
        else:
            return


def _is_callable_cell(cell: Any) -> bool:
    try:
        v = cell.cell_contents
    except ValueError:  # an empty cell
        return False
    return callable(v) and not isinstance(v, type)


def _opaque(code: Any) -> bool:
    """Does ``code`` only pass its arguments on (``wrapper(*args, **kwargs)``, or with one receiver
    before them): a decorator without ``functools.wraps``, which hides the function it calls?"""
    flags = inspect.CO_VARARGS | inspect.CO_VARKEYWORDS
    return code.co_flags & flags == flags and code.co_argcount <= 1 and not code.co_kwonlyargcount


def _in_torch(code: Any) -> bool:
    return code is not None and code.co_filename.startswith(dynamo_hooks.TORCH_DIR)


def _arg_names(code: Any) -> tuple:
    n = code.co_argcount + code.co_kwonlyargcount
    n += bool(code.co_flags & inspect.CO_VARARGS) + bool(code.co_flags & inspect.CO_VARKEYWORDS)
    return code.co_varnames[:n]


def _paths(name: str, args: tuple) -> list[list[str]]:
    """The paths ``name`` may mean in a function taking ``args``: the argument, and for a bare or
    dotted name not starting with ``self.``, also the module's ``self.<name>``."""
    parts = name.split(".")
    out = [parts] if parts[0] in args else []
    if "self" in args and parts[0] != "self":
        out.append(["self"] + parts)
    return out


def _item(obj: Any, part: str) -> Any:
    """One step of a dotted name: a dict's key, a list's index, an attribute."""
    if isinstance(obj, dict):
        return obj[part]
    if isinstance(obj, (list, tuple)) and part.isdigit():
        return obj[int(part)]
    return getattr(obj, part)


def _resolve(path: list[str], scope: dict) -> Any:
    obj = scope.get(path[0])
    for part in path[1:]:
        try:
            obj = _item(obj, part)
        except (AttributeError, KeyError, IndexError, TypeError):
            return None
    return obj if isinstance(obj, torch.Tensor) else None


_warned: set = set()


def reset() -> None:
    _warned.clear()


def check_declared_names(code: Any, frame_locals: Any, opts: Any) -> None:
    """Warn once per name when ``options['invariant']`` names nothing the compiled function can
    reach: no such argument, or a dotted path whose attribute does not exist, or a path to
    something that is not a tensor (a typo would otherwise just leave the site speculated or
    rejected, or nothing cached). With ``strict``, raise instead (at every compile that meets it).
    Asked at each sync site and, for invariant caching, for each compiled graph.

    Checked where the names belong (:func:`_entry_scope`: the function given to torch.compile,
    and the frame compiled when it is a wrapper on the way to it), whichever frame of the call
    Dynamo compiles. Not reported where the function cannot be told (a decorator without
    ``functools.wraps`` hides it, its arguments do not bind); outside a compiled call (no entry
    found): against the frame itself, unless it is torch's own, a wrapper or a resume function.
    """
    if not opts.invariant or code is None:
        return
    entry = _entry_scope()
    if entry is not None:
        scopes = _scopes(entry)
    elif dynamo_hooks.RESUME_RE.match(code.co_name) or _in_torch(code) or _opaque(code) \
            or _torch_private.compile_entry_call() is not None:  # a function hidden by a wrapper
        return
    else:
        scopes = [(code, frame_locals)]
    where = scopes[0][0]
    for name in map(str, opts.invariant):
        problems = [_declared_name_problem(name, _arg_names(c), s) for c, s in scopes]
        if None in problems:
            continue
        args = _arg_names(where)
        message = (f"nosync: options['invariant'] names {name!r}, but {problems[0]} "
                   f"({where.co_name} takes: {', '.join(args) or 'no arguments'})")
        if opts.strict:
            raise NosyncOptionsError(message + "; options['strict'] is True")
        key = (dynamo_hooks.code_key(where), name)
        if key not in _warned:  # warned once per compiled function and name
            _warned.add(key)
            log.warning("%s", message)


def _declared_name_problem(name: str, args: tuple, scope: Any, fallback: bool = True) -> Optional[str]:
    """Why ``name`` (``"token_types"``, ``"self.attn.mask"``, ``"mask"`` for ``self.mask``) does
    not resolve in the frame, or None when it does (or cannot be checked). ``fallback=False``: an
    argument that is not there is a problem even when it cannot be looked up."""
    parts = name.split(".")
    if parts[0] in args:
        path = parts
    elif "self" in args:
        path = ["self"] + parts  # "mask" may mean self.mask
    else:
        return f"there is no argument {parts[0]!r}"
    if not isinstance(scope, dict) or path[0] not in scope:
        return None if fallback else "it cannot be looked up"
    obj = scope[path[0]]
    for i, part in enumerate(path[1:], 1):
        try:
            obj = _item(obj, part)
        except (AttributeError, KeyError, IndexError, TypeError):
            what = f"{'.'.join(path[:i])} ({type(obj).__name__}) has no attribute {part!r}"
            return what if path is parts else f"there is no argument {parts[0]!r} and {what}"
    if not isinstance(obj, torch.Tensor):  # a declaration names one tensor: a module declares nothing
        tensors = [n for n, _ in itertools.chain(obj.named_parameters(), obj.named_buffers())][:3] \
            if isinstance(obj, torch.nn.Module) else []
        hint = f" (declare its tensors: {', '.join(repr(name + '.' + t) for t in tensors)})" if tensors else ""
        return f"{'.'.join(path)} is a {type(obj).__name__}, not a tensor{hint}"
    return None

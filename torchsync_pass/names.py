"""The names of ``options['invariant']``: which leaves they declare, and whether they name anything.

A declared name is an argument of the compiled function or a dotted path from one
(``token_types``, ``self.attn.mask``, ``kwargs.ids``, ``args.0``); a bare name also stands for the
module's own attribute (``mask`` for ``self.mask``). Dynamo does not always compile the user's
function as the frame: a decorator's pass-through wrapper (``wrapper(*args, **kwargs)``, torch's
``@torch.no_grad()``, diffusers' wrapped forwards, accelerate's ``partial(new_forward, module)``)
calls it inlined, a module's hook is a frame of its own, a callee is compiled alone after a graph
break. :func:`check_declared_names` finds the function a wrapper calls (through its closure,
``functools.partial`` and ``__wrapped__``) and binds the wrapper's arguments to it, and a name is
also accepted when it resolves in a caller running on the stack.
"""

from __future__ import annotations

import dis
import functools
import inspect
import itertools
import logging
import os
import sys
import types
from typing import Any, Iterable, Optional

import torch

from . import _torch_private, dynamo_hooks
from .errors import NosyncOptionsError

log = logging.getLogger("torchsync_pass")

_OWN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def pass_through(code: Any) -> bool:
    """Is ``code`` a decorator's pass-through wrapper: ``wrapper(*args, **kwargs)``, or with one
    receiver before them (``wrapper(self, *args, **kwargs)`` as diffusers wraps its models'
    forward, ``new_forward(module, *args, **kwargs)`` as accelerate does), that passes its
    ``*args`` on in a call?"""
    flags = inspect.CO_VARARGS | inspect.CO_VARKEYWORDS
    if code.co_flags & flags != flags or code.co_argcount > 1 or code.co_kwonlyargcount:
        return False
    return any(i.opname == "CALL_FUNCTION_EX" for i in dis.get_instructions(code))


def is_declared(name: str, declared: Iterable[str], source: str = "") -> bool:
    """Is the leaf of user name ``name`` (``self.attn.mask``) and guard source ``source`` among the
    declared names? ``mask`` declares ``self.mask`` (and an argument ``mask``); ``self.mask`` only
    the module's; a global (``G[...]``) is never declared (names are arguments and their
    attributes). In a pass-through wrapper's frame a leaf is also declared by its name in the
    function the wrapper calls (:func:`inner_name`: ``kwargs.ids`` is ``ids`` there when that
    function takes ``ids``, ``kw.ids`` when its own ``**kw`` gets it)."""
    if source.startswith("G["):
        return False
    code, scope = dynamo_hooks.current_frame()
    if code is not None and pass_through(code) and name not in declared:
        inner = inner_name(name, code, scope)
        if inner is None and not name.startswith("self."):  # the function called is not known
            return False
        name = inner or name
    return name in declared or (name.startswith("self.") and name[5:] in declared)


def inner_name(name: str, code: Any, scope: Any) -> Optional[str]:
    """The name, in the function the pass-through wrapper frame ``code`` calls, of the wrapper's
    ``name`` (``kwargs.ids`` -> ``ids``, ``module.mask`` -> ``self.mask``, ``args.0`` -> ``x``):
    the parameter the very object was bound to. None when the function or the object is not found."""
    called = _called_function(code, scope)
    if called is None:
        return None
    parts = name.split(".")
    obj = scope.get(parts[0])
    head = 1
    if parts[0] in _arg_names(code)[code.co_argcount:] and len(parts) > 1:  # args.0, kwargs.ids
        head = 2
        try:
            obj = obj[int(parts[1])] if isinstance(obj, tuple) else obj[parts[1]]
        except (KeyError, IndexError, TypeError, ValueError):
            return None
    for param, v in called[1].items():
        if v is obj:
            return ".".join([param, *parts[head:]])
        for k, x in (v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, tuple) else ()):
            if x is obj:
                return ".".join([param, str(k), *parts[head:]])
    return None


def _arg_names(code: Any) -> tuple:
    n = code.co_argcount + code.co_kwonlyargcount
    n += bool(code.co_flags & inspect.CO_VARARGS) + bool(code.co_flags & inspect.CO_VARKEYWORDS)
    return code.co_varnames[:n]


def _unwrap(fn: Any, args: tuple = (), kwargs: Optional[dict] = None) -> tuple[Any, tuple, dict]:
    """The Python function a call of ``fn(*args, **kwargs)`` runs, with the arguments it gets:
    through bound methods, ``__wrapped__`` (``functools.wraps``: the same arguments; also on a
    partial, as accelerate's forward) and ``functools.partial``."""
    kwargs = dict(kwargs or {})
    for _ in range(32):
        if isinstance(fn, types.MethodType):
            args, fn = (fn.__self__, *args), fn.__func__
        elif isinstance(getattr(fn, "__wrapped__", None), types.FunctionType | functools.partial | types.MethodType):
            fn = fn.__wrapped__
        elif isinstance(fn, functools.partial):
            args, kwargs, fn = (*fn.args, *args), {**fn.keywords, **kwargs}, fn.func
        else:
            break
    return fn, args, kwargs


def callable_code(fn: Any) -> Any:
    """The code object a call of ``fn`` runs (a function, partial, bound method, callable object),
    or None."""
    fn = _unwrap(fn)[0]
    code = getattr(fn, "__code__", None)
    if code is None and not isinstance(fn, type):
        code = getattr(getattr(type(fn), "__call__", None), "__code__", None)
    return code


def _called_function(code: Any, scope: Any) -> Optional[tuple[Any, dict]]:
    """For a pass-through wrapper frame: ``(code, arguments)`` of the user function it calls, its
    arguments bound to that function's parameters, or None. Looked for among the callables of the
    wrapper's closure and, when its receiver is a module, the module's ``forward`` (accelerate's
    ``new_forward(module, *args, **kwargs)``, a plain function, replaced it)."""
    if not pass_through(code) or not isinstance(scope, dict):
        return None
    names = _arg_names(code)
    args, kwargs = tuple(scope.get(names[-2], ())), scope.get(names[-1]) or {}
    receiver = (scope.get(names[0]),) if code.co_argcount else ()
    candidates = [(scope.get(free), (*receiver, *args)) for free in code.co_freevars]
    if receiver and isinstance(receiver[0], torch.nn.Module):
        candidates.append((getattr(receiver[0], "forward", None), args))
    for fn, a in candidates:
        fn, a, k = _unwrap(fn, a, kwargs)
        inner = getattr(fn, "__code__", None)
        if not isinstance(fn, types.FunctionType) or dynamo_hooks.code_key(inner) == dynamo_hooks.code_key(code) \
                or _in_torch(inner.co_filename):
            continue
        try:
            bound = inspect.signature(fn, follow_wrapped=False).bind(*a, **k)
        except (TypeError, ValueError):
            continue
        return inner, dict(bound.arguments)
    return None


def _in_torch(filename: str) -> bool:
    return filename.startswith(dynamo_hooks.TORCH_DIR)


_warned: set = set()


def reset() -> None:
    _warned.clear()


def check_declared_names(code: Any, frame_locals: Any, opts: Any) -> None:
    """Warn once per name when ``options['invariant']`` names nothing the compiled function can
    reach: no such argument, or a dotted path whose attribute does not exist, or a path to
    something that is not a tensor (a typo would otherwise just leave the site speculated or
    rejected, or nothing cached). With ``strict``, raise instead (at every compile that meets it).
    Asked at each sync site and, for invariant caching, for each compiled graph.

    A name may belong to the frame compiled, to the function a pass-through wrapper frame calls
    (:func:`_called_function`), or to a caller running on the stack (a callee compiled as a frame
    of its own after a graph break). Not reported where the names cannot be told: a pass-through
    wrapper whose callee is not found, torch's own frames, a module's hook (called by
    ``nn.Module._call_impl``, not its ``forward``).
    """
    if not opts.invariant or code is None or dynamo_hooks.RESUME_RE.match(code.co_name):
        return
    scopes = [] if _in_torch(code.co_filename) else [(code, frame_locals)]
    inner = _called_function(code, frame_locals)
    if inner is not None:
        scopes.append(inner)
    failed = []
    for name in map(str, opts.invariant):
        problems = [_declared_name_problem(name, _arg_names(c), s) for c, s in scopes]
        if problems and None not in problems and not _resolves_on_stack(name):
            failed.append((name, problems[-1]))
    if not failed or (inner is None and pass_through(code)) or _is_module_hook(code):
        return
    where, _ = scopes[-1]
    for name, problem in failed:
        args = _arg_names(where)
        message = (f"nosync: options['invariant'] names {name!r}, but {problem} "
                   f"({where.co_name} takes: {', '.join(args) or 'no arguments'})")
        if opts.strict:
            raise NosyncOptionsError(message + "; options['strict'] is True")
        key = (code, name)
        if key not in _warned:  # warned once per compiled function and name
            _warned.add(key)
            log.warning("%s", message)


def _resolves_on_stack(name: str) -> bool:
    """Does ``name`` resolve in a user frame running now (a caller of the frame compiled)?
    (``f_locals`` is a proxy, not a dict, from Python 3.13.)"""
    f = sys._getframe(1)
    while f is not None:
        file = f.f_code.co_filename
        if not (_in_torch(file) or file.startswith(_OWN_DIR)) and \
                _declared_name_problem(name, _arg_names(f.f_code), dict(f.f_locals), fallback=False) is None:
            return True
        f = f.f_back
    return False


def _is_module_hook(code: Any) -> bool:
    """Is ``code`` a forward (pre-)hook of a module being called (``nn.Module._call_impl`` on the
    stack runs it), compiled as a frame of its own?"""
    call_impl = _torch_private.module_call_code()
    key = dynamo_hooks.code_key(code)
    f = sys._getframe(1)
    while f is not None:
        if f.f_code is call_impl:
            for h in _torch_private.module_hooks(f.f_locals.get("self")):
                c = callable_code(h)
                if c is not None and dynamo_hooks.code_key(c) == key:
                    return True
        f = f.f_back
    return False


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
            if isinstance(obj, dict):
                obj = obj[part]
            elif isinstance(obj, (list, tuple)) and part.isdigit():
                obj = obj[int(part)]
            else:
                obj = getattr(obj, part)
        except (AttributeError, KeyError, IndexError, TypeError):
            what = f"{'.'.join(path[:i])} ({type(obj).__name__}) has no attribute {part!r}"
            return what if path is parts else f"there is no argument {parts[0]!r} and {what}"
    if not isinstance(obj, torch.Tensor):  # a declaration names one tensor: a module declares nothing
        tensors = [n for n, _ in itertools.chain(obj.named_parameters(), obj.named_buffers())][:3] \
            if isinstance(obj, torch.nn.Module) else []
        hint = f" (declare its tensors: {', '.join(repr(name + '.' + t) for t in tensors)})" if tensors else ""
        return f"{'.'.join(path)} is a {type(obj).__name__}, not a tensor{hint}"
    return None

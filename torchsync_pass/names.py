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
from typing import Any, Iterable, Iterator, Optional

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
    if name in declared or (name.startswith("self.") and name[5:] in declared):
        return True
    code, scope = dynamo_hooks.current_frame()
    if code is None or not pass_through(code):
        return False
    return any(n in declared or (n.startswith("self.") and n[5:] in declared) for n in inner_name(name, code, scope))


def inner_name(name: str, code: Any, scope: Any) -> list[str]:
    """The names, in the functions the pass-through wrapper frame ``code`` may call, of the
    wrapper's ``name`` (``kwargs.ids`` -> ``ids``, ``module.mask`` -> ``self.mask``, ``args.0`` ->
    ``x``): the parameter the very object was bound to. Empty when no function or object is found."""
    parts = name.split(".")
    obj = scope.get(parts[0]) if isinstance(scope, dict) else None
    head = 1
    if parts[0] in _arg_names(code)[code.co_argcount:] and len(parts) > 1:  # args.0, kwargs.ids
        head = 2
        try:
            obj = obj[int(parts[1])] if isinstance(obj, tuple) else obj[parts[1]]
        except (KeyError, IndexError, TypeError, ValueError):
            return []
    out = []
    for _, bound in _called_functions(code, scope):
        for param, v in bound.items():
            if v is obj:
                out.append(".".join([param, *parts[head:]]))
            for k, x in (v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, tuple) else ()):
                if x is obj:
                    out.append(".".join([param, str(k), *parts[head:]]))
    return out


def _arg_names(code: Any) -> tuple:
    n = code.co_argcount + code.co_kwonlyargcount
    n += bool(code.co_flags & inspect.CO_VARARGS) + bool(code.co_flags & inspect.CO_VARKEYWORDS)
    return code.co_varnames[:n]


def _unwrapping(fn: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Iterator[tuple[Any, tuple, dict]]:
    """Each callable a call of ``fn(*args, **kwargs)`` goes through, with the arguments it gets,
    down to the Python function it runs: through bound methods, a module (its ``forward``), a
    callable object (its ``__call__``), ``__wrapped__`` (``functools.wraps``: the same arguments;
    also on a partial, as accelerate's forward) and ``functools.partial``."""
    kwargs = dict(kwargs or {})
    for _ in range(32):
        yield fn, args, kwargs
        call = getattr(type(fn), "__call__", None)
        if isinstance(fn, types.MethodType):
            args, fn = (fn.__self__, *args), fn.__func__
        elif isinstance(fn, torch.nn.Module):
            fn = fn.forward
        elif isinstance(getattr(fn, "__wrapped__", None), types.FunctionType | functools.partial | types.MethodType):
            fn = fn.__wrapped__
        elif isinstance(fn, functools.partial):
            args, kwargs, fn = (*fn.args, *args), {**fn.keywords, **kwargs}, fn.func
        elif not isinstance(fn, (types.FunctionType, type)) and isinstance(call, types.FunctionType):
            args, fn = (fn, *args), call
        else:
            return


def _called_functions(code: Any, scope: Any) -> list[tuple[Any, dict]]:
    """For a pass-through wrapper frame: ``(code, arguments)`` of each user function it may call,
    the wrapper's arguments bound to that function's parameters (keywords it does not take
    dropped: a decorator may rename them, as transformers' ``deprecate_kwarg``). Looked for among
    the callables of the wrapper's closure and, when its receiver is a module, the module's
    ``forward`` (accelerate's ``new_forward(module, *args, **kwargs)``, a plain function, replaced
    it)."""
    if not pass_through(code) or not isinstance(scope, dict):
        return []
    names = _arg_names(code)
    args, kwargs = tuple(scope.get(names[-2], ())), scope.get(names[-1]) or {}
    receiver = (scope.get(names[0]),) if code.co_argcount else ()
    candidates = [(scope.get(free), (*receiver, *args)) for free in code.co_freevars]
    if receiver and isinstance(receiver[0], torch.nn.Module):
        candidates.append((getattr(receiver[0], "forward", None), args))
    out = []
    for fn, a in candidates:
        *_, (fn, a, k) = _unwrapping(fn, a, kwargs)
        inner = getattr(fn, "__code__", None)
        if not isinstance(fn, types.FunctionType) or dynamo_hooks.code_key(inner) == dynamo_hooks.code_key(code) \
                or _in_torch(inner.co_filename):
            continue
        try:
            sig = inspect.signature(fn, follow_wrapped=False)
            if not any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
                k = {n: v for n, v in k.items() if n in sig.parameters}
            bound = sig.bind_partial(*a, **k)
        except (TypeError, ValueError):
            continue
        out.append((inner, dict(bound.arguments)))
    return out


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
    (:func:`_called_functions`), or to a caller running inside the compiled call (a callee
    compiled as a frame of its own after a graph break: :func:`_resolves_in_a_caller`). Not reported where the names cannot be told: a pass-through
    wrapper whose callee is not found, torch's own frames, a module's hook (called by
    ``nn.Module._call_impl``, not its ``forward``).
    """
    if not opts.invariant or code is None or dynamo_hooks.RESUME_RE.match(code.co_name):
        return
    scopes = [] if _in_torch(code.co_filename) else [(code, frame_locals)]
    inner = _called_functions(code, frame_locals)
    scopes += inner
    failed = []
    for name in map(str, opts.invariant):
        problems = [_declared_name_problem(name, _arg_names(c), s) for c, s in scopes]
        if problems and None not in problems and not _resolves_in_a_caller(name):
            failed.append((name, problems[-1]))
    if not failed or (not inner and pass_through(code)) or _is_module_hook(code):
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


def _resolves_in_a_caller(name: str) -> bool:
    """Does ``name`` resolve in a user frame running inside the compiled call (a caller of the frame
    compiled, below the entry of the function ``torch.compile`` returned: not a loop that calls
    it)? (``f_locals`` is a proxy, not a dict, from Python 3.13.)"""
    f = sys._getframe(1)
    while f is not None and not _torch_private.is_compile_entry(f.f_code):
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
                if any(key == dynamo_hooks.code_key(c) for fn, _, _ in _unwrapping(h)
                       if (c := getattr(fn, "__code__", None)) is not None):
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

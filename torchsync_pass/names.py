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
declared when a declared name's path resolves to its very object (:func:`declaration`).
"""

from __future__ import annotations

import dataclasses
import dis
import functools
import inspect
import itertools
import logging
import os
import re
import types
import warnings
import weakref
from typing import Any, Iterable, Iterator, Optional

import torch

from . import _torch_private, dynamo_hooks
from .errors import NosyncOptionsError

log = logging.getLogger("torchsync_pass")


def declaration(name: str, declared: Iterable[str], source: str = "", obj: Any = None) -> Optional[tuple]:
    """``(scope, path, names)`` by which the leaf of user name ``name`` (the dotted form of its
    guard source ``source``), whose object is ``obj`` now, is declared, or None: by path
    (:func:`_declared_path`) and, in a compiled call, by object: the path resolves to ``obj``
    itself in the call's arguments (:func:`resolve`). Scope None: outside a compiled call (by path
    alone; nothing to ask again, :func:`to_ask`)."""
    where = _declared_path(name, declared, source)
    if where is None or where[0] is None or obj is None:
        return where
    return where if resolve(where, _torch_private.compile_entry()) is obj else None


def to_ask(wheres: Iterable[Optional[tuple]]) -> tuple:
    """``(position, where)`` of each leaf's :func:`declaration` (None: not declared) that a
    check asks again (:func:`still_declared`) when its leaves are not the last call's."""
    return tuple((i, w) for i, w in enumerate(wheres) if w is not None and w[0] is not None)


def _declared_path(name: str, declared: Iterable[str], source: str = "") -> Optional[tuple]:
    """``(scope, path, names)`` by which the leaf of user name ``name`` (``self.attn.mask``, the
    dotted form of its guard source ``source``) is declared by path (``names``: the compile's
    declared names, ``declared``), or None. In the namespace of the
    function given to torch.compile (``mask`` declares an argument ``mask`` and ``self.mask``,
    ``self.mask`` only the module's): in that function's frame and its resume function's (for an
    argument it never assigns; not a variable it closes over), and in a wrapper's on the way to it
    through the argument the wrapper hands on (:func:`_translate`; or its own path, ``kwargs.ids``:
    scope, that wrapper's code key). Nothing in a frame Dynamo compiles on its own for a callee or
    hook (it may be called with other objects), nor where the function is hidden (a decorator
    without ``functools.wraps``). A global (``G[...]``) is never declared. Scope None: outside a
    compiled call (nothing to resolve the path in).

    The same code can run in another call of the function (a recursive call, a child module of
    the module's own class, a hook calling a sibling): a path names the compiled call's own object
    only where it resolves to it in this call's arguments (:func:`resolve`), asked when the leaf
    is traced and again by the guard whenever the leaves are not the last call's."""
    if source.startswith("G["):
        return None
    declared = tuple(declared)
    found = _torch_private.compile_entry()
    if found is None:  # not inside a compiled call
        return (None, name, declared) if _by_name(name, declared) else None
    entry = _entry_scope(found[1])
    code = dynamo_hooks.current_frame()[0]
    if entry is None or code is None:
        return None
    key = dynamo_hooks.code_key(code)
    own = key == dynamo_hooks.code_key(entry.code)
    if (own and name.split(".")[0] in _arg_names(entry.code)) or (not own and _resume_of(code, entry.code, name)):
        path = _declared_as(name, declared, entry.real)
        if path is not None:
            return ("entry", path, declared)
        # or by a wrapper's own path to it (``kwargs.img_ids`` for ``img_ids``), where the function
        # is compiled as a frame of its own or resumed after a graph break in it (review 21)
        for k, _, _ in entry.wrappers():
            for d in declared:
                inner = _translate(d.split("."), entry.levels[k], entry.structural)
                if inner is not None and _declared_as(name, (".".join(inner),), entry.real) is not None:
                    return (k, d, declared)
        return None
    if own:
        return None
    level = entry.levels.get(key)
    if level is None:
        return None
    if name in declared:
        return (key, name, declared)
    # a dict item by key and by position in the wrapper's own names (``kwargs.d.0``; review 21)
    by_key = _by_key_or_position(name, declared, _fill(level, entry.args, entry.kwargs))
    if by_key is not None:
        return (key, by_key, declared)
    path = _translate(name.split("."), level, entry.structural)
    found_as = _declared_as(".".join(path), declared, entry.real) if path is not None else None
    return ("entry", found_as, declared) if found_as is not None else None


_DECLARING: "weakref.WeakKeyDictionary[Any, Optional[tuple]]" = weakref.WeakKeyDictionary()


def _declares(owner: Any) -> Optional[tuple]:
    """The names the ``torch.compile`` that made ``owner`` declares (None: not a nosync compile)."""
    try:
        return _DECLARING[owner]
    except (KeyError, TypeError):
        pass
    from .backend import _resolve

    try:
        opts = dynamo_hooks.compile_options(owner)
        names = tuple(_resolve(opts).invariant) if opts is not None else None
    except Exception:  # (bad options: that compile raises them itself; a callback that raises)
        names = None
    try:
        _DECLARING[owner] = names
    except TypeError:  # (no weak references)
        pass
    return names


def resolve(where: tuple, found: Optional[tuple], entry: Optional["_Entry"] = None) -> Any:
    """The object the declared path ``where`` (:func:`declaration`) names in the compiled call
    ``found`` (:func:`_torch_private.compile_entry`; ``entry``, its :func:`_entry_scope` when
    known), or a fresh object (matching nothing) where it names none. Only in a call of a compile
    that declares the same names as the one the path was found in: Dynamo runs a cache entry's
    guards for calls of other compiles of the same code too (another ``torch.compile`` of the
    function, an outer compiled function calling it); one per block of the same class, with the
    same options (diffusers' ``compile_repeated_blocks``), is the same declaration."""
    missing = object()
    scope, path, declared = where
    if found is None or _declares(found[0]) != declared:
        return missing
    call = found[1]
    if entry is None:
        entry = _entry_scope(call)
    if entry is None:
        return missing
    if scope == "entry":
        obj: Any = entry.real
    elif scope in entry.levels:
        obj = _fill(entry.levels[scope], call[1], call[2])
    else:
        return missing
    for part in path.split("."):
        try:
            obj = _step(obj, part)
        except Exception:  # (a property may raise anything)
            return missing
    return obj


def _step(obj: Any, part: str) -> Any:
    """One part of a dotted path: a key, an index or an attribute."""
    if isinstance(obj, dict):
        if part not in obj and part.isdigit():
            if int(part) in obj:  # an int key
                return obj[int(part)]
            return obj[list(obj.keys())[int(part)]]  # an item by its position (a ModelOutput's ``out[0]``)
        return obj[part]
    if isinstance(obj, (list, tuple)) and part.isdigit():
        return obj[int(part)]
    return getattr(obj, part)


def still_declared(wheres: tuple, leaves: tuple) -> bool:
    """At a guard: do the declared paths ``wheres`` (``(index, where)`` pairs) name these very
    leaves in the compiled call running now (not another call of the same code)?"""
    found = _torch_private.compile_entry()
    entry = _entry_scope(found[1]) if found is not None else None
    return entry is not None and all(resolve(where, found, entry) is leaves[i] for i, where in wheres)


def _by_name(name: str, declared: tuple) -> bool:
    return name in declared or (name.startswith("self.") and name[5:] in declared)


def _declared_as(name: str, declared: tuple, real: Any) -> Optional[str]:
    """The path by which the leaf named ``name`` is declared, or None: ``name`` itself, or a
    declared path that names it with a dict's key where ``name`` has its position among the keys
    in this call's arguments ``real`` (``out.0`` declared as ``out.last_hidden_state``), or the
    reverse. The declared path is what later calls resolve (:func:`still_declared`): a dict whose
    keys come in another order names another tensor by the same position (review 21)."""
    if _by_name(name, declared):
        return name
    if not isinstance(real, dict):
        return None
    return _by_key_or_position(name, [*declared, *("self." + d for d in declared if name.startswith("self."))], real)


def _by_key_or_position(name: str, paths: Iterable[str], real: dict) -> Optional[str]:
    """The first of ``paths`` that names the item ``name`` names in ``real`` (a namespace: its
    names -> this call's objects), one by a dict's key where the other has its position."""
    for d in paths:
        if (_positional(name) or _positional(d)) and _same_by_key(name, d, real):
            return d
    return None


def _positional(path: str) -> bool:
    return any(p.isdigit() for p in path.split(".")[1:])


def _key_at(obj: Any, key: str, position: str) -> bool:
    """Is ``key`` the key of the dict ``obj`` at ``position`` (a part that is not a key itself), or
    the field of the named tuple ``obj`` at that position (``req.1`` for ``req.mask``; review 23)?"""
    if not position.isdigit():
        return False
    if isinstance(obj, tuple):
        fields = getattr(type(obj), "_fields", None)
        return isinstance(fields, tuple) and key in fields and fields.index(key) == int(position)
    return (isinstance(obj, dict) and position not in obj and key in obj
            and list(obj.keys()).index(key) == int(position))


def _same_by_key(name: str, declared: str, real: dict) -> bool:
    """Does ``declared`` name the item ``name`` names, one of them by a key of a dict on the way
    and the other by its position among the keys?"""
    parts, other = name.split("."), declared.split(".")
    if len(parts) != len(other) or parts[0] != other[0] or parts[0] not in real:
        return False
    obj = real[parts[0]]
    for a, b in zip(parts[1:], other[1:]):
        if a != b and not (_key_at(obj, b, a) or _key_at(obj, a, b)):
            return False
        try:
            obj = _step(obj, a)
        except Exception:
            return False
    return True


def _resume_of(code: Any, fn_code: Any, name: str) -> bool:
    """Is ``code`` the resume function of ``fn_code`` (the code after a graph break) and the root
    of ``name`` an argument ``fn_code`` never assigns (the same object there on every call)?"""
    line = _resume_line(code, fn_code)
    if line is None:
        return False
    if not _spans(fn_code, line) or any(_spans(c, line) for c in fn_code.co_consts if isinstance(c, types.CodeType)):
        return False  # another function's, or a nested function's of the same name
    stored = {i.argval for i in dis.get_instructions(fn_code) if i.opname in ("STORE_FAST", "DELETE_FAST", "STORE_DEREF")}
    root = name.split(".")[0]
    # (an argument a closure captures may be rebound by it: ``nonlocal mask``)
    return root in _arg_names(fn_code) and root not in stored and root not in fn_code.co_cellvars


def _resume_line(code: Any, fn_code: Any) -> Optional[int]:
    """The line of ``fn_code`` whose graph break ``code`` resumes after, where ``code`` is named
    as a resume function of it (same name, same file); else None."""
    resume = re.match(r"^torch_dynamo_resume_in_(.+)_at_(\d+)$", code.co_name)
    if not resume or resume.group(1) != fn_code.co_name or code.co_filename != fn_code.co_filename:
        return None
    return int(resume.group(2))


def _spans(code: Any, line: int) -> bool:
    lines = [n for _, _, n in code.co_lines() if n is not None]
    return bool(lines) and min(lines) <= line <= max(lines)


def _translate(parts: list[str], level: dict, final: dict) -> Optional[list[str]]:
    """A wrapper's path (``kwargs.ids``, ``args.0``, ``self.mask``) as the path of the function it
    calls, through the argument slot it hands on (:class:`_Slot`, the same every call)."""
    v, rest = level.get(parts[0]), parts[1:]
    if isinstance(v, tuple) and rest and rest[0].isdigit():
        v, rest = (v[int(rest[0])] if int(rest[0]) < len(v) else None), rest[1:]
    elif isinstance(v, dict) and rest:
        v, rest = v.get(rest[0]), rest[1:]
    if v is None:
        return None
    for q, w in final.items():
        if w is v:
            return [q, *rest]
        for k, x in (w.items() if isinstance(w, dict) else enumerate(w) if isinstance(w, tuple) else ()):
            if x is v:
                return [q, str(k), *rest]
    return None


def _scopes(entry: "_Entry", compiled: Any = None) -> list[tuple[Any, dict]]:
    """Where the names resolve: the function given to torch.compile, and the frame compiled when
    it is a wrapper on the way to it (its own names: ``kwargs.ids``)."""
    scopes = [(entry.code, entry.real)]
    code, frame_locals = dynamo_hooks.current_frame()
    if code is not None and isinstance(frame_locals, dict) and dynamo_hooks.code_key(code) in entry.levels \
            and dynamo_hooks.code_key(code) != dynamo_hooks.code_key(entry.code):
        scopes.append((code, frame_locals))
    frame = compiled if compiled is not None else code
    if frame is not None and (dynamo_hooks.code_key(frame) == dynamo_hooks.code_key(entry.code)
                              or _resume_line(frame, entry.code) is not None):
        # the function compiled as a frame of its own (a graph break in it under its wrapper's
        # frame), or the code after a graph break in it: the wrappers' own paths name its arguments too
        scopes += [(c, real) for _, c, real in entry.wrappers()]
    return scopes


class _Slot:
    """Stands for one argument of the compiled call while the call is bound by position and
    keyword alone (which parameter of each function on the way gets it)."""

    __slots__ = ("key",)

    def __init__(self, key: Any) -> None:
        self.key = key


@dataclasses.dataclass
class _Entry:
    code: Any  # of the function given to torch.compile, unwrapped
    real: dict  # its parameters -> this call's arguments
    structural: dict  # its parameters -> _Slot (or an object the wrappers add: a bound self)
    levels: dict  # code_key of each function on the way -> its parameters -> _Slot
    fn: Any = None  # the function itself
    codes: dict = dataclasses.field(default_factory=dict)  # code_key of each function on the way -> its code
    args: tuple = ()  # this call's arguments, as given to the compiled callable
    kwargs: dict = dataclasses.field(default_factory=dict)

    def wrappers(self) -> Iterator[tuple[Any, Any, dict]]:
        """(code key, code, its parameters -> this call's arguments) of each function on the way to
        the one given to torch.compile (a decorator's wrapper), not that function itself."""
        own = dynamo_hooks.code_key(self.code)
        for k, level in self.levels.items():
            if k != own and k in self.codes:
                yield k, self.codes[k], _fill(level, self.args, self.kwargs)


def _bind(fn: Any, args: tuple, kwargs: dict) -> Optional[dict]:
    try:
        sig = _signature(fn)
        if not any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
            kwargs = {n: v for n, v in kwargs.items() if n in sig.parameters}
        return dict(sig.bind_partial(*args, **kwargs).arguments)
    except (TypeError, ValueError):
        return None


_SIGNATURES: "weakref.WeakKeyDictionary[Any, tuple]" = weakref.WeakKeyDictionary()


def _signature(fn: types.FunctionType) -> inspect.Signature:
    # NOTE: the guard resolves declared paths at every new request, and a signature costs tens of
    # microseconds: kept per function (and its code: ``__code__`` can be replaced)
    known = _SIGNATURES.get(fn)
    if known is None or known[0] is not fn.__code__:
        known = _SIGNATURES[fn] = (fn.__code__, inspect.signature(fn, follow_wrapped=False))
    return known[1]


def _fill(v: Any, args: tuple, kwargs: dict) -> Any:
    if isinstance(v, _Slot):
        return args[v.key] if isinstance(v.key, int) else kwargs[v.key]
    if isinstance(v, tuple):
        return tuple(_fill(x, args, kwargs) for x in v)
    if isinstance(v, dict):
        return {k: _fill(x, args, kwargs) for k, x in v.items()}
    return v


def _entry_scope(call: Optional[tuple] = None) -> Optional[_Entry]:
    """The function ``torch.compile`` was given, for the compiled call running now: Dynamo's entry
    frame (:func:`_torch_private.compile_entry_call`) holds the callable and this call's
    arguments; unwrapped (:func:`_unwrapping`) and bound to them (keywords it does not take
    dropped: a wrapper may rename them). None when not found, hidden or they do not bind."""
    call = call or _torch_private.compile_entry_call()
    if call is None:
        return None
    fn, args, kwargs = call
    slots = tuple(_Slot(i) for i in range(len(args))), {k: _Slot(k) for k in kwargs}
    levels, codes = {}, {}
    for fn, a, k in _unwrapping(fn, *slots):
        if isinstance(fn, types.FunctionType) and (bound := _bind(fn, a, k)) is not None:
            levels[dynamo_hooks.code_key(fn.__code__)] = bound
            codes[dynamo_hooks.code_key(fn.__code__)] = fn.__code__
    # NOTE: a functools.wraps wrapper the unwrapping stopped at (it rebuilds its ``*args``) is the
    # function whose names count, not a hidden one: its ``__wrapped__`` says what it wraps
    if not isinstance(fn, types.FunctionType) or (_opaque(fn) and not hasattr(fn, "__wrapped__")):
        return None
    structural = levels.get(dynamo_hooks.code_key(fn.__code__))
    if structural is None:
        return None
    return _Entry(fn.__code__, {p: _fill(v, args, kwargs) for p, v in structural.items()}, structural, levels, fn,
                  codes, args, kwargs)


def _unwrapping(fn: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Iterator[tuple[Any, tuple, dict]]:
    """Each callable a call of ``fn(*args, **kwargs)`` goes through, with the arguments it gets,
    down to the Python function it runs: a module (its ``forward``; also torch's own methods of
    one, ``_wrapped_call_impl``), bound methods, ``__wrapped__`` (``functools.wraps``, where the
    wrapper passes its ``*args, **kwargs`` on: :func:`_passes_on`; on a partial only as accelerate's ``partial(new_forward, module)`` forward, whose
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
                and not isinstance(fn, functools.partial) and _passes_on(fn):
            fn = wrapped
        elif isinstance(fn, functools.partial):
            args, kwargs, fn = (*fn.args, *args), {**fn.keywords, **kwargs}, fn.func
        elif isinstance(fn, types.FunctionType) and _in_torch(fn.__code__) and _opaque(fn) \
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


def _opaque(fn: Any) -> bool:
    """Does ``fn`` only pass its arguments on (``inner(*args, **kwargs)``, or with one receiver
    before them) to a callable it closes over: a decorator without ``functools.wraps``, which hides
    the function it calls? (A function of one's own taking ``(self, *args, **kwargs)`` is not.)"""
    return _pass_on_shape(fn.__code__) and any(_is_callable_cell(c) for c in fn.__closure__ or ())


def _passes_on(fn: Any) -> bool:
    """Does the function ``fn`` (with a ``__wrapped__``) hand its arguments on unchanged: shaped
    ``(*args, **kwargs)`` (or with one receiver) and calling with them? A ``functools.wraps``
    wrapper that takes its own parameters (``w(a, b)``, which may call ``fn(b, a)``) is the
    function the names belong to."""
    code = getattr(fn, "__code__", None)
    return code is not None and _pass_on_shape(code) and _calls_on(code)


@functools.lru_cache(maxsize=1024)
def _calls_on(code: Any) -> bool:
    # (asked at every new request by the guard's declared check: one disassembly per code)
    ins = list(dis.get_instructions(code))
    return any(i.opname == "CALL_FUNCTION_EX" for i in ins) and _hands_on_args(code, ins)


def _hands_on_args(code: Any, ins: list) -> bool:
    """Is the ``*args`` of ``code`` never rebound and only ever handed on whole (``f(*args,
    ...)``, ``f(self, *args, ...)``), never sliced, indexed or rebuilt (``f(*args[1:])``, which
    shifts every argument)?"""
    name = code.co_varnames[code.co_argcount]  # the *args parameter
    if name in code.co_cellvars:
        return False
    for i, nxt in zip(ins, ins[1:] + [None]):
        argval = i.argval if isinstance(i.argval, tuple) else (i.argval,)
        if name not in argval:
            continue
        if i.opname.startswith(("STORE", "DELETE")) or not i.opname.startswith("LOAD_FAST") \
                or len(argval) != 1 or nxt is None \
                or nxt.opname not in ("CALL_FUNCTION_EX", "BUILD_MAP", "LIST_EXTEND"):
            return False
    return True


def _pass_on_shape(code: Any) -> bool:
    """``(*args, **kwargs)``, or with one receiver before them, nothing else."""
    flags = inspect.CO_VARARGS | inspect.CO_VARKEYWORDS
    return code.co_flags & flags == flags and code.co_argcount <= 1 and not code.co_kwonlyargcount


def _in_torch(code: Any) -> bool:
    return code is not None and code.co_filename.startswith(dynamo_hooks.TORCH_DIR)


def _arg_names(code: Any) -> tuple:
    n = code.co_argcount + code.co_kwonlyargcount
    n += bool(code.co_flags & inspect.CO_VARARGS) + bool(code.co_flags & inspect.CO_VARKEYWORDS)
    return code.co_varnames[:n]


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
    call = _torch_private.compile_entry_call()
    entry = _entry_scope(call)
    if entry is not None:
        scopes = _scopes(entry, code)
    elif call is not None or dynamo_hooks.RESUME_RE.match(code.co_name) or _in_torch(code) \
            or _pass_on_shape(code):  # a function hidden by a wrapper
        return
    else:
        scopes = [(code, frame_locals)]
    where = scopes[0][0]
    for name in map(str, opts.invariant):
        problems = [_declared_name_problem(name, _arg_names(c), s) for c, s in scopes]
        if None in problems or _not_passed(entry, name):
            continue
        args = _arg_names(where)
        message = (f"nosync: options['invariant'] names {name!r}, but {problems[0]} "
                   f"({where.co_name} takes: {', '.join(args) or 'no arguments'})"
                   f"{_wrapper_hint(entry, name)}")
        if opts.strict:
            raise NosyncOptionsError(message + "; options['strict'] is True")
        key = (dynamo_hooks.code_key(where), name)
        if key not in _warned:  # warned once per compiled function and name
            _warned.add(key)
            warnings.warn(message, stacklevel=2)  # seen by warning filters and ``pytest -W error``
            log.warning("%s", message)


def _wrapper_varargs(fn: Any) -> tuple[Optional[str], Optional[str]]:
    """The names of the ``*args`` and ``**kwargs`` parameters of a function."""
    code = fn.__code__
    n = code.co_argcount + code.co_kwonlyargcount
    star = code.co_varnames[n] if code.co_flags & inspect.CO_VARARGS else None
    n += star is not None
    return star, (code.co_varnames[n] if code.co_flags & inspect.CO_VARKEYWORDS else None)


def _wrapped_params(fn: Any) -> Optional[Any]:
    """The parameters of the function ``fn`` (a ``functools.wraps`` wrapper) wraps, None when they
    cannot be read."""
    try:
        return inspect.signature(inspect.unwrap(fn), follow_wrapped=False).parameters
    except (TypeError, ValueError):
        return None


def _not_passed(entry: Optional[_Entry], name: str) -> bool:
    """Is ``name`` a wrapper's path (``kwargs.mask``, ``args.1``) to an argument of the function it
    wraps that this call does not pass that way (left out, or passed by position rather than by
    keyword)? Nothing to declare on that call, as for an argument passed None."""
    fn = entry.fn if entry is not None else None
    parts = name.split(".")
    inner = _wrapped_params(fn) if fn is not None and hasattr(fn, "__wrapped__") and len(parts) > 1 else None
    if inner is None:
        return False
    star, starstar = _wrapper_varargs(fn)
    given = entry.real.get(parts[0])
    if parts[0] == starstar and isinstance(given, dict):
        return parts[1] not in given and parts[1] in inner
    if parts[0] == star and isinstance(given, tuple) and parts[1].isdigit():
        positional = [p for p in inner.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        # the wrapper's own leading parameters (``self`` in ``wrapper(self, *args)``) take the
        # first ones: its ``*args`` holds what follows them
        return len(given) <= int(parts[1]) < len(positional) - fn.__code__.co_argcount
    return False


def _wrapper_hint(entry: Optional[_Entry], name: str) -> str:
    """For a name of the function a ``functools.wraps`` wrapper wraps, where the wrapper rebuilds
    its ``*args`` (so its own names count): how to declare it by the wrapper's path."""
    fn = entry.fn if entry is not None else None
    inner = _wrapped_params(fn) if fn is not None and _pass_on_shape(fn.__code__) else None
    head = name.split(".")[0]
    if inner is None or head not in inner or head in _arg_names(fn.__code__):  # (already the wrapper's path)
        return ""
    code = fn.__code__
    where = f"{code.co_name} at {os.path.basename(code.co_filename)}:{code.co_firstlineno}"
    rest = name[len(head):]
    lead = (f"; the function compiled is a functools.wraps wrapper ({where}) around "
            f"{inspect.unwrap(fn).__qualname__} that rebuilds its *args, so the names are its own: ")
    if head == "self" and next(iter(inner), None) == "self":
        # a method's self comes first among the wrapper's *args, never by keyword (review 22: the
        # hint 'kwargs.self...' declared nothing, silently: an argument the call leaves out)
        return lead + f"declare 'args.0{rest}' (self is the first of its positional arguments)"
    # NOTE: no position is offered: the wrapper may reorder its *args, and a call may pass the
    # argument by keyword; ``args.N`` is its position among this call's positional arguments
    return (lead + f"declare 'kwargs.{head}{rest}' where the call passes it by keyword, or 'args.N{rest}' "
            "with N its position among the call's positional arguments")


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
    obj = parent = scope[path[0]]
    for i, part in enumerate(path[1:], 1):
        if isinstance(obj, torch.Tensor):  # (no leaf is named so: ``.data``, ``.T`` name nothing)
            return f"{'.'.join(path[:i])} is a tensor: a declared path ends at one"
        if not isinstance(obj, (dict, list, tuple)) and isinstance(getattr(type(obj), part, None), property):
            # (the leaf is named by what the property reads: ``self._mask``)
            return f"{'.'.join(path[:i + 1])} is a property: declare the attribute it returns"
        parent = obj
        try:
            obj = _step(obj, part)
        except (AttributeError, KeyError, IndexError, TypeError):
            what = f"{'.'.join(path[:i])} ({type(obj).__name__}) has no attribute {part!r}"
            return what if path is parts else f"there is no argument {parts[0]!r} and {what}"
    if obj is None and (len(path) == 1 or isinstance(parent, dict)
                        or (isinstance(parent, torch.nn.Module)
                            and (path[-1] in parent._buffers or path[-1] in parent._parameters))):
        return None  # an optional tensor argument (buffer, parameter) left None: nothing to declare
    if not isinstance(obj, torch.Tensor):  # a declaration names one tensor: a module declares nothing
        tensors = [n for n, _ in itertools.chain(obj.named_parameters(), obj.named_buffers())][:3] \
            if isinstance(obj, torch.nn.Module) else []
        hint = f" (declare its tensors: {', '.join(repr(name + '.' + t) for t in tensors)})" if tensors else ""
        return f"{'.'.join(path)} is a {type(obj).__name__}, not a tensor{hint}"
    return None

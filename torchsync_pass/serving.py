"""The per-request check, for serving engines that do not run Dynamo's guards on every call.

nosync's guarded constants rely on Dynamo evaluating the frame's guards before each call. An engine
that compiles once and then calls the compiled code without guards (vLLM's guard filter, a custom
dispatcher) would serve a value hoisted for an earlier request. nosync refuses that (see "Guards
nobody can drop silently" in the README). :func:`check_request` is the documented call such an
engine makes at the start of each request instead: it runs nosync's checks for every value hoisted
in the compiled function, on the request's own inputs, and says whether the compiled code still
holds for them:

    step = torch.compile(model.step, backend="nosync")
    ...
    torchsync_pass.check_request(step, x, t, token_types)   # at request start; raises on a change

Per hoisted cone it costs what the guard costs: nothing when the leaf tensors are the ones already
checked (the memo), one real sync when they are new. It reads the function's arguments the way
Dynamo's guards read the frame (``L['token_types']``, ``L['self']._buffers['mask']``).

This module owns only the binding of a call to the compiled frame's locals and the report; the
checks, memo and specialised values stay in :mod:`torchsync_pass.guards`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import re
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from . import dynamo_hooks, guards
from .errors import NosyncError
from .report import SiteKey

log = logging.getLogger(__name__)

__all__ = ["check_request", "RequestCheck", "HoistedValueChanged", "HoistedValueUnchecked"]


class _RequestError(NosyncError):
    """A request :func:`check_request` cannot let through; ``report`` says why."""

    def __init__(self, message: str, report: "RequestCheck") -> None:
        super().__init__(message)
        self.report = report


class HoistedValueChanged(_RequestError):
    """A value nosync hoisted in a compiled function differs for this request's inputs."""


@dataclass(frozen=True)
class Change:
    """One hoisted site whose value differs for the request's inputs."""

    site: SiteKey
    source: str
    value: Any  # the value for this request (None when not computed: see ``why``)
    compiled_for: tuple  # the values the compiled cache entries were specialised on
    why: str = ""  # set when no entry applies whatever the value: the global state differs


@dataclass
class RequestCheck:
    """What :func:`check_request` found.

    ``sites``: hoisted cones checked; ``syncs``: cones re-run because their leaves were new (one
    real sync each); ``changed``: the sites whose value differs from every compiled value;
    ``unchecked``: hoisted sites of the function that cannot be checked from the arguments (``ok``
    is False while there are any); ``demoted``: the function's sites nosync demoted (no longer
    hoisted: the call reads them with a sync, as stock, and the code Dynamo compiled after such a
    read is guarded by Dynamo on the values it has seen, which nothing here checks: ``ok`` says
    nothing of them).
    """

    function: str
    sites: int = 0
    syncs: int = 0
    changed: list[Change] = field(default_factory=list)
    unchecked: list[Unchecked] = field(default_factory=list)
    demoted: list[SiteKey] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.changed and not self.unchecked

    def describe(self) -> str:
        lines = [f"check_request({self.function}): {self.sites} hoisted value(s) checked, "
                 f"{self.syncs} sync(s), {len(self.changed)} changed"]
        for ch in self.changed:
            now = ch.why if ch.why else f"{ch.value!r} for this request"
            lines.append(f"  {ch.site}: {ch.source}: {now}, compiled for "
                         + ", ".join(repr(v) for v in ch.compiled_for))
        if self.unchecked:
            lines.append(f"  {len(self.unchecked)} hoisted value(s) NOT checked:")
        for u in self.unchecked:
            lines.append(f"  {u.site}: {u.source}: {u.why}")
        if self.demoted:
            lines.append(f"  {len(self.demoted)} site(s) demoted (read by the call as stock; the code "
                         "Dynamo compiled after the read recompiles for a value it has not seen): "
                         + ", ".join(str(s) for s in self.demoted))
        return "\n".join(lines)


@dataclass(frozen=True)
class Unchecked:
    """One hoisted site of a frame that belongs to the function but that :func:`check_request`
    cannot evaluate from the request's arguments (see :func:`check_request` for the rule)."""

    site: SiteKey
    source: str
    frame: str  # the compiled frame's code name (``torch_dynamo_resume_in_step_at_12``)
    why: str


class HoistedValueUnchecked(_RequestError):
    """The compiled function has hoisted values :func:`check_request` cannot check for a request."""


@dataclass(frozen=True)
class _Frame:
    """A frame Dynamo may have compiled for the call: its code, locals and globals as the guards
    read them, and the user's callable it stands for (for messages)."""

    code: types.CodeType
    L: dict
    G: dict
    name: str
    innermost: bool = False  # the user's own function (under its wrappers): on the stack of a call
    cells: Any = None  # the function's closure cells, where known (who owns a shared code)


def _name(obj: Any) -> str:
    if isinstance(obj, functools.partial):
        return f"functools.partial({_name(obj.func)})"
    if inspect.ismethod(obj):
        return _name(obj.__func__)
    if isinstance(obj, torch.nn.Module):
        return type(obj).__qualname__
    return getattr(obj, "__qualname__", None) or repr(obj)


def _closure(func: Any) -> dict:
    """The contents of ``func``'s closure cells by name (Dynamo's frame locals include them)."""
    out = {}
    for name, cell in zip(func.__code__.co_freevars, func.__closure__ or ()):
        try:
            out[name] = cell.cell_contents
        except ValueError:  # an empty cell: left out, reported by name if a leaf reads it
            pass
    return out


def _function_frames(f: Any, args: tuple, kwargs: dict, name: str) -> list[_Frame]:
    """A frame per level of ``f``'s wrapper chain (``functools.wraps``' ``__wrapped__``, a
    ``functools.partial``'s function, a callable object's ``__call__``), each with the request's
    arguments bound to that level's own signature: Dynamo compiles the outermost level it does
    not skip, and a skipped wrapper (torch's own decorators) passes its arguments through."""
    out: list[_Frame] = []
    self_: Any = None
    seen: set[int] = set()
    inline = dynamo_hooks.wrap_inline_code()
    while f is not None and id(f) not in seen:
        seen.add(id(f))
        if isinstance(f, functools.partial):
            args, kwargs = (*f.args, *args), {**f.keywords, **kwargs}
            f = f.func
            continue
        if inspect.ismethod(f):
            self_, f = f.__self__, f.__func__
            continue
        code = getattr(f, "__code__", None)
        if code is None:
            call = getattr(type(f), "__call__", None)
            f = call.__get__(f) if inspect.isfunction(call) and self_ is None else None
            continue
        if code is not inline:
            call_args = (self_, *args) if self_ is not None else args
            try:
                bound = inspect.signature(f, follow_wrapped=False).bind(*call_args, **kwargs)
            except (TypeError, ValueError):
                pass
            else:
                bound.apply_defaults()
                out.append(_Frame(code, {**_closure(f), **bound.arguments}, f.__globals__, name,
                                  cells=f.__closure__ or ()))
        f = getattr(f, "__wrapped__", None)
    if out:
        out[-1] = dataclasses.replace(out[-1], innermost=True)
    return out


def _inline_frame(wrapped: Any, args: tuple, kwargs: dict, name: str, inner: Any) -> _Frame:
    """Dynamo's ``wrap_inline`` frame around ``wrapped`` (see :func:`dynamo_hooks.wrap_inline_code`);
    ``inner``: the wrap_inline function torch.compile made, when it can be found (its cells)."""
    cells = inner.__closure__ if inner is not None and _closure(inner).get("fn") is wrapped else None
    return _Frame(dynamo_hooks.wrap_inline_code(), {"args": args, "kwargs": kwargs, "fn": wrapped},
                  dynamo_hooks.wrap_inline_globals(), name, cells=cells)


def _bind_or_raise(target: Any, args: tuple, kwargs: dict) -> None:
    """A call ``target`` would refuse is an error, not a request with nothing to check."""
    if getattr(target, "__code__", None) is dynamo_hooks.wrap_inline_code():
        target = _closure(target).get("fn", target)
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):  # no signature to check the call against (a builtin)
        return
    try:
        sig.bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(f"check_request({_name(target)}): the arguments given do not fit its "
                        f"signature {sig}: {e}") from e


def _frames(fn: Any, args: tuple, kwargs: dict) -> list[_Frame]:
    """The frames Dynamo may have compiled for ``fn(*args, **kwargs)``, with their locals.

    ``fn`` is what the engine calls: a ``torch.compile`` result (function, bound method or
    ``OptimizedModule``), or the original function/method/module. ``torch.compile`` calls the
    callable it was given, and Dynamo compiles the first frame it does not skip: the callable's own
    frame (a ``functools.wraps`` wrapper's ``*args, **kwargs`` frame when decorated), or Dynamo's
    ``wrap_inline`` frame around it (``torch.no_grad()``-decorated functions, partials, modules
    whose forward is in a skipped file), or, for a module, its ``forward`` or
    ``nn.Module.__call__``'s implementation. All are tried; a check is run only in the frame
    whose closure it was compiled with.
    """
    user = getattr(fn, "_torchdynamo_orig_callable", fn)
    mod = getattr(fn, "_orig_mod", None)
    if mod is None and isinstance(fn, torch.nn.Module):
        mod = fn
    _bind_or_raise(mod.forward if mod is not None else user, args, kwargs)
    if mod is not None:
        name = _name(mod)
        inner = dynamo_hooks.inline_wrapper_of(getattr(fn, "forward", None)) if mod is not fn else None
        out = [_inline_frame(mod, args, kwargs, name, inner),
               _inline_frame(mod.forward, args, kwargs, name, inner)]
        out += _function_frames(type(mod).forward, (mod, *args), kwargs, name)
        for impl in ("_call_impl", "_wrapped_call_impl"):  # both on every supported torch
            f = getattr(torch.nn.Module, impl)
            out.append(_Frame(f.__code__, {"self": mod, "args": args, "kwargs": kwargs}, f.__globals__, name))
        return out
    inner = dynamo_hooks.inline_wrapper_of(fn)
    if getattr(user, "__code__", None) is dynamo_hooks.wrap_inline_code():
        inner, user = user, _closure(user).get("fn", user)  # torch.compile wrapped it already: a partial
    name = _name(user)
    return [_inline_frame(user, args, kwargs, name, inner), *_function_frames(user, args, kwargs, name)]


def check_request(fn: Callable, /, *args: Any, on_change: str = "raise", **kwargs: Any) -> RequestCheck:
    """Run nosync's checks of ``fn``'s hoisted values on this request's inputs.

    Call it with the arguments of the request's first call of ``fn`` (what the engine is about to
    pass). For every hoisted cone of every cache entry nosync compiled for ``fn`` it reads the
    leaf tensors from those arguments (and from the compiled function's closure variables and
    globals), recomputes the value when they are new (one sync) and compares it, bitwise, with the
    values the compiled code was specialised on.

    The frames that belong to ``fn``: the frame Dynamo compiles for the call (see :func:`_frames`:
    decorated functions and forwards, partials and ``torch.no_grad()`` included), and every resume
    function Dynamo generated from that frame's code after a graph break (Dynamo's
    ``torch_dynamo_resume_in_<name>_at_<line>``, found through the cache it generates them in).
    A resume function's locals exist only in the middle of a call, so its hoisted sites cannot be
    checked from the request's arguments: they are listed in ``unchecked`` and make ``ok`` False.
    Not covered: a function ``fn`` calls that Dynamo compiles as a frame of its own (after a graph
    break at that call); check it with its own ``check_request`` where its arguments are known.

    ``on_change``: ``"raise"`` (default) raises :class:`HoistedValueChanged` when a value changed,
    and :class:`HoistedValueUnchecked` when a hoisted value cannot be checked; ``"reset"`` forgets
    the compiled code instead when a value changed (``torch.compiler.reset()`` and
    ``torchsync_pass.reset()``), so the next call compiles for the new value, and also raises
    :class:`HoistedValueUnchecked` for values it cannot check; ``"report"`` only returns the
    :class:`RequestCheck`. A function nosync hoisted nothing in gives ``sites == 0``.
    """
    if on_change not in ("raise", "reset", "report"):
        raise ValueError(f"on_change must be 'raise', 'reset' or 'report', got {on_change!r}")
    if not callable(fn):  # the step forgotten (check_request(x, tt)): never "ok, nothing to check"
        raise TypeError(f"check_request: the first argument must be the compiled function (or the "
                        f"function, method or module compiled), got {type(fn).__name__}")
    frames = _frames(fn, args, kwargs)
    report = RequestCheck(frames[0].name)
    seen: set[int] = set()
    for fr in frames:
        # Another function's entries when none of this one's: Dynamo tries every entry of a code
        # object (a new closure of a factory runs an older closure's entry when its values match).
        # NOTE: not for Dynamo's wrap_inline code, which every torch.compile'd partial, module and
        # @torch.no_grad() function shares: its entries guard the wrapped callable's identity, so
        # another function's never run for this one
        checks = guards.checks_for(fr.code, dynamo_hooks.closure_identity(fr.code, fr.L, fr.cells))
        if not checks and fr.code is not dynamo_hooks.wrap_inline_code():
            checks = guards.checks_for(fr.code)
        _run_checks([c for c in checks if id(c) not in seen], fr, report)
        seen.update(id(c) for c in checks)
        for code in dynamo_hooks.resume_codes(fr.code):
            cells = fr.cells if code.co_freevars == fr.code.co_freevars else None
            for chk in guards.checks_for(code, dynamo_hooks.closure_identity(code, fr.L, cells)):
                if id(chk) not in seen:
                    seen.add(id(chk))
                    report.unchecked.append(Unchecked(
                        chk.state.site, chk.state.source, code.co_name,
                        f"hoisted in {code.co_name}, the code Dynamo resumes {fr.name} in after a "
                        "graph break: its locals exist only in the middle of a call, not in the "
                        "request's arguments"))
    for fr in frames:
        for code in (fr.code, *dynamo_hooks.resume_codes(fr.code)):
            for site in guards.demoted_sites(code):
                if site not in report.demoted:
                    report.demoted.append(site)
    for fr in frames:
        if not fr.innermost:
            continue
        for code, chk in guards.checks_compiled_inside(dynamo_hooks.code_key(fr.code)):
            if id(chk) not in seen:
                seen.add(id(chk))
                report.unchecked.append(Unchecked(
                    chk.state.site, chk.state.source, code.co_name,
                    f"hoisted in {code.co_qualname}, a frame Dynamo compiled on its own during a "
                    f"call of {fr.name} (a callee after a graph break at its call, or a function "
                    "compiled separately): its locals are not the request's arguments"))
    if report.changed:
        log.info("%s", report.describe())
        if on_change == "raise":
            raise HoistedValueChanged(
                report.describe() + "\nThe compiled code was specialised on other values; with its "
                "guards skipped it would serve them to this request. Recompile (call it with "
                "Dynamo's guards on, or check_request(..., on_change='reset')) or serve this request "
                "without the compiled function.", report)
        if on_change == "reset":
            from .backend import reset

            torch.compiler.reset()
            reset()
            return report
    if report.unchecked and on_change != "report":
        raise HoistedValueUnchecked(
            report.describe() + "\nThese values cannot be checked before the call; with Dynamo's "
            "guards skipped a changed one would be served silently. Keep Dynamo's guards on for "
            "this function, or remove the graph break before the hoisted sync (see "
            "torchsync_pass.explain).", report)
    return report


def _run_checks(checks: list, fr: _Frame, report: RequestCheck) -> None:
    bits = guards.bits_state()  # the value under today's global state (thread count, ...)
    changes = len(report.changed)
    current: dict[int, tuple] = {}  # id(cone) -> (value key, value) for this request
    by_cone: dict[int, list] = {}
    for chk in checks:  # several cache entries (specs) share one cone and its memo
        by_cone.setdefault(id(chk.cone), []).append(chk)
    raised: dict = {}  # site -> the change to report if no cone of the site could be asked
    asked: set = set()
    for group in by_cone.values():
        chk, cone = group[0], group[0].cone
        # NOTE: the specs of these checks, not all of the cone's: functions sharing one code
        # (closures of one factory, one decorator's wrapper) share its sites and cones.
        specs = {c.spec.key: c.spec for c in group}
        report.sites += 1
        # An entry compiled under another global state (autocast, a precision setting, the thread
        # count: what the guard checks first) cannot serve this call, and its cone must not run
        # under this state (the memo the guard reads would keep that value).
        live = [c for c in group if not c.state_changed()]
        if not live:
            report.changed.append(Change(chk.state.site, chk.state.source, None,
                                         tuple(s.value for s in specs.values()),
                                         why=f"not computed: {chk.state_change()} since the compile "
                                             "(check_request runs under the global state it is called "
                                             "under: call it under the state the steps run in, e.g. "
                                             "inside the engine's torch.inference_mode())"))
            continue
        specs = {c.spec.key: c.spec for c in live}
        shadowed = _shadowed_keyword(chk.sources, fr)
        if shadowed is not None:  # the call reads the request's keyword, the compiled code read this
            report.changed.append(Change(
                chk.state.site, chk.state.source, None, tuple(s.value for s in specs.values()),
                why=f"not computed: the request passes {shadowed[0]}=, which overrides the compiled "
                    f"partial's keyword the value was hoisted from ({shadowed[1]}): Dynamo's guard on "
                    "the call's keywords, which the engine skips, would recompile"))
            continue
        try:
            leaves = chk.getter(fr.L, fr.G)
        except Exception as e:
            raise NosyncError(
                f"check_request({fr.name}): {chk.state.site}: cannot read {', '.join(chk.sources)}: "
                f"{_unreadable(chk.sources, fr)} ({type(e).__name__}: {e})") from e
        inference = [src for t, d, src in zip(leaves, chk.declared, chk.sources)
                     if not d and isinstance(t, torch.Tensor) and t.is_inference()]
        if inference:  # no version counter: the guard cannot keep the value, it fails the entry
            report.changed.append(Change(
                chk.state.site, chk.state.source, None, tuple(s.value for s in specs.values()),
                why=f"not computed: {', '.join(inference)} is an inference tensor (made under "
                    "torch.inference_mode(); it has no version counter), which the guard refuses, so "
                    "the call recompiles; make it outside inference mode, or declare it in "
                    "options['invariant'] (no in-place writes)"))
            continue
        try:
            entry, synced = cone.current(tuple(leaves), cone.memo_for(bits))
        except Exception as e:  # the question cannot be asked of these inputs as this cone was traced
            # NOTE: leaves of another shape (a batch that shrank: ``t.view(B, 2, 4)`` in the cone):
            # Dynamo's own guards select another entry (its own cone, traced at that shape) or
            # recompile; a change only when no cone of the site could be asked
            raised.setdefault(chk.state.site, Change(
                chk.state.site, chk.state.source, None, tuple(s.value for s in specs.values()),
                why=f"not computed: the hoisted cone raised on this request's inputs ({type(e).__name__}: "
                    f"{e}): it was traced for inputs of another shape, dtype or device, so the call is "
                    "served by another cache entry (one compiled for such inputs, where the site may not "
                    "be hoisted: with dynamic shapes a cone over a symbolic size is not) or recompiles; "
                    "check_request cannot tell which"))
            continue
        asked.add(chk.state.site)
        report.syncs += int(synced)
        current[id(cone)] = (entry.key, entry.value)
        if entry.key not in specs:
            report.changed.append(Change(chk.state.site, chk.state.source, entry.value,
                                         tuple(s.value for s in specs.values())))
    report.changed.extend(change for site, change in raised.items() if site not in asked)
    if len(report.changed) == changes:
        _check_one_entry_serves(checks, current, fr, report)


_PARTIAL_KEYWORD = re.compile(r"L\['fn'\]\.keywords\['([^']+)'\]")


def _shadowed_keyword(sources: list, fr: _Frame) -> Optional[tuple[str, str]]:
    """(keyword, source) when a leaf is a compiled ``functools.partial``'s keyword that this
    request's keyword arguments override (the call reads theirs)."""
    kwargs = fr.L.get("kwargs") if isinstance(fr.L, dict) else None
    if not isinstance(kwargs, dict) or not isinstance(fr.L.get("fn"), functools.partial):
        return None
    for src in sources:
        m = _PARTIAL_KEYWORD.search(src)
        if m is not None and m.group(1) in kwargs:
            return m.group(1), src
    return None


def _check_one_entry_serves(checks: list, current: dict, fr: _Frame, report: RequestCheck) -> None:
    """Every value matched some compiled entry's; the call needs *one* entry that all its checks
    pass at once: values compiled in different entries, or an argument the entry's graph writes
    that shares memory with a hoisted leaf on this call (what the guard refuses), recompile."""
    entries = dynamo_hooks.entries_of(checks)
    aliased = False
    for members in entries:
        if any(c.state_changed() or id(c.cone) not in current or current[id(c.cone)][0] != c.spec.key
               for c in members):
            continue
        # one compile: every check of an entry has the same; alias() is True where it cannot tell
        if members[0].written.alias(fr.L, fr.G):
            aliased = True
            continue
        return
    if not entries:
        return
    chk = entries[0][0]
    why = ("an argument the compiled graph writes in place shares memory with a hoisted leaf on "
           "this call: the guard refuses it, so the call recompiles" if aliased else
           "each value was compiled, but in different cache entries: no one entry has this "
           "combination (" + ", ".join(f"{c.state.site}: {current[id(c.cone)][1]!r}" for c in entries[0]
                                       if id(c.cone) in current) + "), so the call recompiles")
    report.changed.append(Change(chk.state.site, chk.state.source, current.get(id(chk.cone), (None, None))[1],
                                 tuple(m[0].spec.value for m in entries), why=why))


def _unreadable(sources: list[str], fr: _Frame) -> str:
    """Why a leaf source cannot be read from ``fr``: the first name it misses, said plainly."""
    for src in sources:
        m = re.match(r"([LG])\[(['\"])(.+?)\2\]", src)
        if m is None:
            continue
        scope, name = m.group(1), m.group(3)
        if scope == "G" and name not in fr.G and name.startswith("__import_"):
            return (f"{name!r} is the module Dynamo installs in the globals of {fr.name}'s compiled "
                    "frame to read another module's globals, and it is not there")
        if scope == "G" and name not in fr.G:
            return f"{name!r} is a global of {fr.name} that is not defined in its module"
        if scope == "L" and name not in fr.L:
            if name in fr.code.co_freevars:
                return (f"{name!r} is a closure variable of {fr.name} whose cell is empty "
                        "(assigned after the function was created, or deleted)")
            return (f"{name!r} is a local variable of {fr.name}'s compiled frame that is not among "
                    "the arguments given; pass the arguments of the compiled call")
    return "the value it names is not in the arguments given; pass the arguments of the compiled call"

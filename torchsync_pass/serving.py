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

import inspect
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from . import guards
from .errors import NosyncError
from .report import SiteKey

log = logging.getLogger(__name__)

__all__ = ["check_request", "RequestCheck", "HoistedValueChanged"]


class HoistedValueChanged(NosyncError):
    """A value nosync hoisted in a compiled function differs for this request's inputs."""

    def __init__(self, message: str, report: "RequestCheck") -> None:
        super().__init__(message)
        self.report = report


@dataclass(frozen=True)
class Change:
    """One hoisted site whose value differs for the request's inputs."""

    site: SiteKey
    source: str
    value: Any  # the value for this request
    compiled_for: tuple  # the values the compiled cache entries were specialised on


@dataclass
class RequestCheck:
    """What :func:`check_request` found.

    ``sites``: hoisted cones checked; ``syncs``: cones re-run because their leaves were new (one
    real sync each); ``changed``: the sites whose value differs from every compiled value.
    """

    function: str
    sites: int = 0
    syncs: int = 0
    changed: list[Change] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.changed

    def describe(self) -> str:
        lines = [f"check_request({self.function}): {self.sites} hoisted value(s) checked, "
                 f"{self.syncs} sync(s), {len(self.changed)} changed"]
        for ch in self.changed:
            lines.append(f"  {ch.site}: {ch.source}: {ch.value!r} for this request, compiled for "
                         + ", ".join(repr(v) for v in ch.compiled_for))
        return "\n".join(lines)


def _frames(fn: Any, args: tuple, kwargs: dict) -> list[tuple[Any, dict, dict]]:
    """Candidate (code object, L, G) of the frame Dynamo compiled for ``fn(*args, **kwargs)``.

    ``fn`` is what the engine calls: a ``torch.compile`` result (function, bound method or
    ``OptimizedModule``), or the original function/method/module. A module compiled with
    ``torch.compile(module)`` or ``module.compile()`` may be traced from its ``forward`` or from
    ``nn.Module.__call__``'s implementation; all are tried.
    """
    fn = getattr(fn, "_torchdynamo_orig_callable", fn)
    mod = getattr(fn, "_orig_mod", None)
    if mod is None and isinstance(fn, torch.nn.Module):
        mod = fn
    if mod is not None:
        out = []
        fwd = type(mod).forward
        try:
            bound = inspect.signature(fwd).bind(mod, *args, **kwargs)
            bound.apply_defaults()
            out.append((fwd.__code__, dict(bound.arguments), fwd.__globals__))
        except TypeError:
            pass
        for impl in ("_call_impl", "_wrapped_call_impl"):  # both on every supported torch
            f = getattr(torch.nn.Module, impl)
            out.append((f.__code__, {"self": mod, "args": args, "kwargs": kwargs}, f.__globals__))
        return out
    func, self_ = (fn.__func__, fn.__self__) if inspect.ismethod(fn) else (fn, None)
    func = inspect.unwrap(func)
    if not hasattr(func, "__code__"):
        raise TypeError(f"check_request: cannot find the Python function behind {fn!r}")
    call_args = (self_, *args) if self_ is not None else args
    bound = inspect.signature(func).bind(*call_args, **kwargs)
    bound.apply_defaults()
    return [(func.__code__, dict(bound.arguments), func.__globals__)]


def check_request(fn: Callable, /, *args: Any, on_change: str = "raise", **kwargs: Any) -> RequestCheck:
    """Run nosync's checks of ``fn``'s hoisted values on this request's inputs.

    Call it with the arguments of the request's first call of ``fn`` (what the engine is about to
    pass). For every hoisted cone of every cache entry nosync compiled for ``fn`` it reads the
    leaf tensors from those arguments, recomputes the value when they are new (one sync) and
    compares it, bitwise, with the values the compiled code was specialised on.

    ``on_change``: ``"raise"`` (default) raises :class:`HoistedValueChanged` when a value changed;
    ``"reset"`` forgets the compiled code instead (``torch.compiler.reset()`` and
    ``torchsync_pass.reset()``), so the next call compiles for the new value; ``"report"`` only
    returns the :class:`RequestCheck`. A function nosync hoisted nothing in gives ``sites == 0``.
    """
    if on_change not in ("raise", "reset", "report"):
        raise ValueError(f"on_change must be 'raise', 'reset' or 'report', got {on_change!r}")
    report: RequestCheck | None = None
    for code, L, G in _frames(fn, args, kwargs):
        checks = guards.checks_for(code)
        if not checks:
            continue
        report = RequestCheck(code.co_qualname)
        _run_checks(checks, L, G, report)
        break
    if report is None:
        report = RequestCheck(getattr(fn, "__qualname__", type(fn).__name__))
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


def _run_checks(checks: list, L: dict, G: dict, report: RequestCheck) -> None:
    bits = guards.bits_state()  # the value under today's global state (thread count, ...)
    seen: set[int] = set()
    for chk in checks:
        cone = chk.cone
        if id(cone) in seen:  # several cache entries (specs) share one cone and its memo
            continue
        seen.add(id(cone))
        report.sites += 1
        try:
            leaves = chk.getter(L, G)
        except Exception as e:
            raise NosyncError(
                f"check_request: {chk.state.site}: cannot read {', '.join(chk.sources)} from the "
                f"arguments given ({type(e).__name__}: {e}); pass the arguments of the compiled call"
            ) from e
        entry, synced = cone.current(tuple(leaves), cone.memo_for(bits))
        report.syncs += int(synced)
        if entry.key not in cone.specs:
            report.changed.append(Change(chk.state.site, chk.state.source, entry.value,
                                         tuple(s.value for s in cone.specs.values())))

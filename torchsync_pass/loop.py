"""verify_loop: a whole per-step loop, eager against each compiled mode, step by step, bitwise.

Every run (eager, then each :class:`LoopMode`) starts from its own deep copy of the step, the calls
and the setup state, and from the same RNG state; after each step its outputs are compared with
:func:`torchsync_pass.verify.compare_outputs` against eager and against the mode's bitwise
reference (``must_equal``). The report names the first step and tensor at which a mode diverges.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import logging
import math
import textwrap
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch

from . import _torch_private as private
from .verify import Mismatch, _RngState, compare_outputs, json_scalar, snapshot

log = logging.getLogger(__name__)

__all__ = ["LoopMode", "LoopReport", "ModeReport", "StepMismatch", "resolve_modes", "verify_loop"]


@dataclasses.dataclass(frozen=True)
class LoopMode:
    """One way of running the step in :func:`verify_loop`.

    ``backend`` and ``options`` go to ``torch.compile`` (with ``compile_kwargs`` such as
    ``dynamic``/``fullgraph``). ``must_equal`` names the run whose outputs this mode must reproduce
    bitwise (``"eager"``, another mode's name, or ``None`` for "report the difference only"); a mode
    named that way must itself equal ``"eager"`` or ``None`` (one level of references).
    ``step`` compiles another callable instead of the loop's step (a hand-hoisted reference); it is
    deep-copied together with the step, so a bound method of the same module binds to the copy.
    """

    name: str
    backend: Any
    options: Mapping[str, Any] | None = None
    must_equal: str | None = "eager"
    step: Callable[..., Any] | None = None
    compile_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def describe_backend(self) -> str:
        b = self.backend if isinstance(self.backend, str) else getattr(self.backend, "__name__", repr(self.backend))
        return f"{b} {dict(self.options)}" if self.options else str(b)


_PRESETS = {m.name: m for m in (  # frozen: shared by every call
    LoopMode("nosync-eager", "nosync", {"codegen": "eager"}, must_equal="eager"),
    LoopMode("nosync-inductor", "nosync", {"codegen": "inductor"}, must_equal="inductor"),
    LoopMode("inductor", "inductor", None, must_equal=None),
    LoopMode("aot_eager", "aot_eager", None, must_equal="eager"),
    LoopMode("dynamo-eager", "eager", None, must_equal="eager"),
)}


def resolve_modes(
    modes: Iterable[str | LoopMode],
    options: Mapping[str, Any] | None = None,
    hoisted: Callable[..., Any] | None = None,
) -> list[LoopMode]:
    """The :class:`LoopMode` list :func:`verify_loop` runs for ``modes`` (presets expanded, references added)."""
    if isinstance(modes, (str, LoopMode)):  # one mode: not its characters
        modes = (modes,)
    if modes is None:
        raise ValueError("modes is None: give mode names (e.g. ('nosync-eager',)) or LoopMode objects")
    out: list[LoopMode] = []
    for m in modes:
        if isinstance(m, LoopMode):
            out.append(m)
        elif isinstance(m, str) and m in _PRESETS:
            out.append(_PRESETS[m])
        elif m == "eager":
            raise ValueError("'eager' is the reference that every mode is compared with; do not list it in modes")
        else:
            raise ValueError(f"unknown mode {m!r}: use one of {sorted(_PRESETS)} or a LoopMode")
    if options and "codegen" in options:
        # each mode names its own codegen (nosync-eager must equal eager, nosync-inductor stock
        # Inductor): one codegen for all would compare a mode with the wrong reference
        raise ValueError(f"verify_loop: options may not set 'codegen' ({options['codegen']!r}): each mode "
                         "sets its own (nosync-eager: 'eager', nosync-inductor: 'inductor'); choose the codegen by "
                         "the modes you list, or pass a LoopMode with the options you want")
    if options:
        out = [
            dataclasses.replace(m, options={**(m.options or {}), **options}) if m.backend == "nosync" else m
            for m in out
        ]
    if hoisted is not None:
        out.append(LoopMode("inductor-hoisted", "inductor", None, must_equal=None, step=hoisted))
        out = [
            dataclasses.replace(m, must_equal="inductor-hoisted") if m.name == "nosync-inductor" else m for m in out
        ]
    names = [m.name for m in out]
    if len(set(names)) != len(names):
        raise ValueError(f"mode names must be unique, got {names}")
    for m in list(out):
        if m.must_equal not in (None, "eager") and m.must_equal not in names:
            if m.must_equal in _PRESETS:
                out.append(_PRESETS[m.must_equal])
                names.append(m.must_equal)
            else:
                raise ValueError(f"mode {m.name!r} must equal {m.must_equal!r}, which is not a mode")
    by_name = {m.name: m for m in out}
    for m in out:  # one level of references: a reference is compared with eager or with nothing
        ref = by_name.get(m.must_equal)
        if ref is not None and ref.must_equal not in (None, "eager"):
            raise ValueError(f"mode {m.name!r} must equal {ref.name!r}, which itself must equal "
                             f"{ref.must_equal!r}: a reference must equal 'eager' or None")
    return out


@dataclasses.dataclass(frozen=True)
class StepMismatch:
    """A difference found at one step (``phase == "step"``) or in the state after the loop (``"final"``)."""

    step: int
    reference: str
    mismatch: Mismatch
    phase: str = "step"

    def describe(self) -> str:
        where = f"step {self.step}" if self.phase == "step" else "final state"
        return f"{where}, vs {self.reference}: {self.mismatch.summary()}"

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "phase": self.phase, "reference": self.reference, "mismatch": self.mismatch.to_json()}


@dataclasses.dataclass(frozen=True)
class ModeReport:
    """What one mode did over the loop, compared with eager and with its bitwise reference."""

    name: str
    backend: str
    must_equal: str | None
    steps_run: int
    expected_steps: int
    graphs: int
    mismatches: tuple[StepMismatch, ...] = ()
    diverging_steps: int = 0
    eager_max_abs: float | None = None
    eager_max_ulp: int | None = None
    eager_first_step: int | None = None
    error: str | None = None

    @property
    def first_divergence(self) -> StepMismatch | None:
        return self.mismatches[0] if self.mismatches else None

    @property
    def ok(self) -> bool:
        return self.error is None and not self.mismatches and self.steps_run == self.expected_steps

    def describe(self) -> str:
        status = "ok" if self.ok else "FAILED"
        graphs = f"{self.graphs} graph{'' if self.graphs == 1 else 's'} compiled"
        lines = [f"{self.name:<18} {status:<7} {self.steps_run} steps, {graphs} [{self.backend}]"]
        if self.error:
            lines.append(f"    error: {self.error}")
        if self.steps_run != self.expected_steps and not self.error:
            lines.append(f"    ran {self.steps_run} steps, eager ran {self.expected_steps}")
        if self.must_equal:
            if self.mismatches:
                first = self.mismatches[0]
                lines.append(f"    first divergence from {self.must_equal}: {first.describe()}")
                lines.append(f"    {self.diverging_steps} of {self.steps_run} steps differ from {self.must_equal}")
            elif self.steps_run:
                lines.append(f"    bitwise equal to {self.must_equal} on every step")
        if self.must_equal != "eager" and self.steps_run:
            if self.eager_first_step is None:
                lines.append("    vs eager: bitwise equal on every step")
            else:
                ulp = "n/a" if self.eager_max_ulp is None else str(self.eager_max_ulp)
                lines.append(
                    f"    vs eager: max abs diff {self.eager_max_abs or 0.0:.6g}, max ULP {ulp} "
                    f"(first difference at step {self.eager_first_step}; reported, not required equal)"
                )
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if not f.name.startswith("eager_")}
        first = self.first_divergence
        d.update(ok=self.ok, first_divergence=first.to_json() if first else None,
                 mismatches=[m.to_json() for m in self.mismatches],
                 vs_eager={"max_abs": json_scalar(self.eager_max_abs), "max_ulp": self.eager_max_ulp,
                           "first_step": self.eager_first_step})
        return d


@dataclasses.dataclass(frozen=True)
class LoopReport:
    """Result of :func:`verify_loop`: the eager step count and one :class:`ModeReport` per mode."""

    steps: int
    modes: tuple[ModeReport, ...]

    @property
    def ok(self) -> bool:
        return all(m.ok for m in self.modes)

    def __getitem__(self, name: str) -> ModeReport:
        for m in self.modes:
            if m.name == name:
                return m
        raise KeyError(name)

    def suspect_references(self) -> dict[str, str]:
        """``{mode: reference}`` for each mode that differs from its reference while that reference
        is further from eager than the mode is (a hand-hoisted step set up for another request,
        say): the reference is the first suspect, not the mode."""
        by_name = {m.name: m for m in self.modes}
        out = {}
        for m in self.modes:
            ref = by_name.get(m.must_equal) if m.must_equal not in (None, "eager") else None
            if ref is None or not m.mismatches or ref.eager_first_step is None:
                continue
            if m.error is not None or m.steps_run != m.expected_steps:  # the mode failed on its own
                continue
            if m.eager_first_step is None or (ref.eager_max_abs or 0.0) > (m.eager_max_abs or 0.0):
                out[m.name] = ref.name
        return out

    def __str__(self) -> str:
        status = "ok" if self.ok else "FAILED"
        lines = [f"verify_loop: {self.steps} eager steps, {len(self.modes)} modes: {status}"]
        suspect = self.suspect_references()
        for m in self.modes:
            lines.append(textwrap.indent(m.describe(), "  "))
            if m.name in suspect:
                ref = self[suspect[m.name]]
                mine = "bitwise equal to eager" if m.eager_first_step is None else f"max abs {m.eager_max_abs or 0.0:.6g}"
                lines.append(f"    note: its reference {ref.name} is further from eager (max abs "
                             f"{ref.eager_max_abs or 0.0:.6g}) than {m.name} is ({mine}): check the reference "
                             "(a hand-hoisted step set up for this request's values?)")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "steps": self.steps, "modes": [m.to_json() for m in self.modes],
                "suspect_references": self.suspect_references()}


def _module_state(step: Any) -> dict[str, torch.Tensor]:
    """Parameters and buffers of the step's module (the step itself, or the owner of a bound method)."""
    mod = step if isinstance(step, torch.nn.Module) else getattr(step, "__self__", None)
    if not isinstance(mod, torch.nn.Module):
        return {}
    return {**dict(mod.named_parameters()), **dict(mod.named_buffers())}


def _check_call(item: Any, i: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if (
        not isinstance(item, (tuple, list))
        or len(item) != 2
        or not isinstance(item[0], (tuple, list))
        or not isinstance(item[1], Mapping)
    ):
        raise TypeError(
            f"verify_loop: call {i} must be an (args, kwargs) pair such as ((x, t), {{}}), got {type(item).__name__}"
        )
    return tuple(item[0]), dict(item[1])


def _run(step: Any, calls: Any, state: Any, steps: int | None) -> Iterator[tuple[int, Any]]:
    """One pass over the loop: ``(i, output)`` of the step (plain or compiled) at each step."""
    prev = None
    i = 0
    while steps is None or i < steps:
        item = calls(i, state, prev) if callable(calls) else calls[i] if i < len(calls) else None
        if item is None:
            return
        args, kwargs = _check_call(item, i)
        prev = step(*args, **kwargs)
        yield i, prev
        i += 1


def _compile_supports_isolation() -> bool:
    try:
        return "isolate_recompiles" in inspect.signature(torch.compile).parameters
    except (TypeError, ValueError):  # pragma: no cover
        return False


def verify_loop(
    step: Callable[..., Any],
    calls: Iterable[tuple[Sequence[Any], Mapping[str, Any]]] | Callable[[int, Any, Any], Any],
    *,
    modes: Sequence[str | LoopMode] = ("nosync-eager", "nosync-inductor", "inductor"),
    setup: Callable[[], Any] | None = None,
    steps: int | None = None,
    options: Mapping[str, Any] | None = None,
    hoisted: Callable[..., Any] | None = None,
    compile_kwargs: Mapping[str, Any] | None = None,
    max_mismatches: int = 20,
) -> LoopReport:
    """Run a per-step loop eagerly and under each compiled mode; compare every step bitwise.

    Args:
        step: the uncompiled step, a function or an ``nn.Module`` (or a bound method of one). Each
            mode gets its own ``copy.deepcopy`` of it, so modes never share parameters or buffers;
            a plain function is shared (``deepcopy`` keeps functions), so keep loop state in the
            module, the calls or ``setup``'s state rather than in globals.
        calls: what to call the step with, either
            * a list (or any iterable, read once) of ``(args, kwargs)`` pairs, one per step:
              ``[((x, t0), {}), ((x, t1), {})]``; or
            * a function ``calls(i, state, prev) -> (args, kwargs) | None`` producing step ``i``'s
              arguments from the carried ``state`` (what ``setup()`` returned) and ``prev``, this
              mode's output of step ``i - 1`` (``None`` at step 0). Return ``None`` to end the loop.
              It may update ``state`` in place (``state["x"] = state["x"] - prev / n``), which is
              how a denoising loop carries its latents.
        modes: compiled modes to run, by name or as :class:`LoopMode`. ``"nosync-eager"``
            (``backend="nosync"``, ``codegen="eager"``) must equal eager bitwise;
            ``"nosync-inductor"`` must equal stock ``"inductor"`` bitwise (added if not listed) and
            its difference from eager is reported as max abs / ULP; ``"inductor"`` is reported
            against eager only. Also ``"aot_eager"`` and ``"dynamo-eager"`` (must equal eager).
        setup: ``setup() -> state``, called once; every run (eager and each mode) gets a deep copy.
        steps: stop after this many steps (default: all of ``calls``, or until it returns ``None``).
        options: extra options for the nosync modes (``{"invariant": [...]}``); not ``codegen``,
            which each mode sets (a ``ValueError``).
        hoisted: the hand-hoisted step (request-invariant values passed as Python constants). If
            given, stock Inductor on it becomes the bitwise reference of ``"nosync-inductor"``,
            which is the exact one (removing a break lets Inductor fuse across it, so stock Inductor
            on the split original may legitimately differ by an ULP). When nosync caches invariant
            tensors (README, "Invariant tensors across calls"), the exact reference is the
            hand-*split* step (those tensors computed in eager and passed in), or pass
            ``options={"invariant_cache_bytes": 0}``.
        compile_kwargs: more ``torch.compile`` arguments for every mode (``dynamic``, ``fullgraph``).
        max_mismatches: at most this many differing steps are kept per mode (all are counted).

    The step, calls and state are deep-copied *together* for each run, so aliasing between them
    (a buffer passed as an argument, one tensor used at every step) is the same in every run.
    Every run starts from the same torch/CUDA/Python/NumPy RNG state, and the caller's RNG state is
    restored at the end. Each mode is compiled with ``isolate_recompiles=True`` where torch has it,
    so modes do not share Dynamo cache entries or recompile budgets and nothing calls
    ``torch._dynamo.reset()``. Outputs are compared right after each step (before ``calls`` sees
    them); after the loop the module's parameters and buffers, the state and the (possibly
    mutated) call arguments are compared too (``phase == "final"``). An exception in a mode is
    recorded as that mode's ``error``; one in the eager run is re-raised.

    Returns:
        a :class:`LoopReport`; ``report.ok``, ``report["nosync-eager"].first_divergence``,
        ``print(report)``, ``report.to_json()``.
    """
    resolved = resolve_modes(modes, options, hoisted)
    if not callable(calls):
        try:
            calls = list(calls)
        except TypeError:
            raise TypeError(f"verify_loop: calls must be a list of (args, kwargs) pairs or a function "
                            f"calls(i, state, prev), got {type(calls).__name__}") from None
        if not calls:
            raise ValueError("verify_loop: calls is empty: no step to compare")
        for i, item in enumerate(calls):
            _check_call(item, i)
    if not resolved:
        raise ValueError("verify_loop: no mode to compare with eager (modes is empty)")
    state0 = setup() if setup is not None else None
    extra_steps = tuple(m.step for m in resolved if m.step is not None)
    originals = (step, extra_steps, calls, state0)
    needed = {m.must_equal for m in resolved if m.must_equal not in (None, "eager")}
    isolate = _compile_supports_isolation()

    rng = _RngState()
    try:
        # ---- eager reference: snapshot every step's outputs
        eager_step, _, eager_calls, eager_state = copy.deepcopy(originals)
        eager_outs: list[Any] = []
        try:
            for _, out in _run(eager_step, eager_calls, eager_state, steps):
                eager_outs.append(snapshot(out))
        finally:
            rng.restore()
        eager_final = snapshot(_final_state(eager_step, eager_calls, eager_state))
        n = len(eager_outs)
        if n == 0:
            raise ValueError("verify_loop: the loop ran no step (calls ended at once, or steps is 0): "
                             "nothing to compare")

        reference_outs: dict[str, list[Any]] = {}
        reference_finals: dict[str, Any] = {}
        reports: dict[str, ModeReport] = {}
        # References first (resolve_modes allows one level of them), so their outputs are kept in
        # time for the modes that must equal them.
        for mode in sorted(resolved, key=lambda m: m.name not in needed):
            reports[mode.name] = _run_mode(
                mode, originals, steps, n, eager_outs, eager_final, reference_outs, reference_finals,
                keep=mode.name in needed, isolate=isolate, compile_kwargs=compile_kwargs or {},
                max_mismatches=max_mismatches, rng=rng,
            )
        return LoopReport(steps=n, modes=tuple(reports[m.name] for m in resolved))
    finally:
        rng.restore()


def _final_state(step: Any, calls: Any, state: Any) -> dict[str, Any]:
    final: dict[str, Any] = {"module": _module_state(step)}
    if state is not None:
        final["state"] = state
    if not callable(calls):
        final["calls"] = calls
    return final


def _run_mode(
    mode: LoopMode,
    originals: tuple[Any, ...],
    steps: int | None,
    n: int,
    eager_outs: list[Any],
    eager_final: Any,
    reference_outs: dict[str, list[Any]],
    reference_finals: dict[str, Any],
    *,
    keep: bool,
    isolate: bool,
    compile_kwargs: Mapping[str, Any],
    max_mismatches: int,
    rng: _RngState,
) -> ModeReport:
    step, extra_steps, calls, state = copy.deepcopy(originals)
    target = step
    if mode.step is not None:
        target = extra_steps[[s is mode.step for s in originals[1]].index(True)]
    kwargs: dict[str, Any] = {**compile_kwargs, **mode.compile_kwargs}
    if isolate:
        kwargs.setdefault("isolate_recompiles", True)
    if mode.options:
        kwargs["options"] = dict(mode.options)
    compiled = torch.compile(target, backend=mode.backend, **kwargs)
    log.debug("verify_loop: running mode %s (%s)", mode.name, mode.describe_backend())

    ref_name = mode.must_equal
    ref_outs = eager_outs if ref_name == "eager" else reference_outs.get(ref_name) if ref_name else None
    mismatches: list[StepMismatch] = []
    diverging = 0
    e_abs: float | None = None
    e_ulp: int | None = None
    e_first: int | None = None
    ran = 0
    error = None
    kept: list[Any] = []
    graphs0 = private.unique_graphs()
    rng.restore()
    try:
        for i, out in _run(compiled, calls, state, steps):
            ran = i + 1
            if keep:
                kept.append(snapshot(out))
            if i >= n:
                continue  # ran longer than eager; reported through steps_run
            vs_eager = compare_outputs(eager_outs[i], out)
            if vs_eager:
                if e_first is None:
                    e_first = i
                e_abs, e_ulp = _accumulate(vs_eager, e_abs, e_ulp)
            if ref_outs is not None and i < len(ref_outs):
                found = vs_eager if ref_name == "eager" else compare_outputs(ref_outs[i], out)
                if found:
                    diverging += 1
                    if len(mismatches) < max_mismatches:
                        mismatches.extend(StepMismatch(i, ref_name, m) for m in found[:3])
        # NOTE: the module's buffers, the loop state and the arguments after the last step, against
        # the reference's (the in-place writes a mode makes are checked whatever it must equal)
        final_state = _final_state(step, calls, state)
        if keep:
            reference_finals[mode.name] = final_state
        ref_final = eager_final if ref_name == "eager" else reference_finals.get(ref_name) if ref_name else None
        if ref_final is not None:
            final = compare_outputs(ref_final, final_state, root="final")
            mismatches.extend(StepMismatch(ran, ref_name, m, phase="final") for m in final[:max_mismatches])
    except Exception as exc:
        log.warning("verify_loop: mode %s raised at step %d", mode.name, ran, exc_info=True)
        error = f"{type(exc).__name__} at step {ran}: {exc}"
    finally:
        rng.restore()
    if keep:
        reference_outs[mode.name] = kept
    return ModeReport(
        name=mode.name,
        backend=mode.describe_backend(),
        must_equal=ref_name,
        steps_run=ran,
        expected_steps=n,
        graphs=private.unique_graphs() - graphs0,
        mismatches=tuple(mismatches),
        diverging_steps=diverging,
        eager_max_abs=e_abs,
        eager_max_ulp=e_ulp,
        eager_first_step=e_first,
        error=error,
    )


def _accumulate(found: list[Mismatch], max_abs: float | None, max_ulp: int | None) -> tuple[float | None, int | None]:
    for m in found:
        if m.max_abs is not None:
            if max_abs is None or math.isnan(m.max_abs) or (not math.isnan(max_abs) and m.max_abs > max_abs):
                max_abs = m.max_abs
        if m.max_ulp is not None and (max_ulp is None or m.max_ulp > max_ulp):
            max_ulp = m.max_ulp
    return max_abs, max_ulp

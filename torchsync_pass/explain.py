"""``python -m torchsync_pass.explain [--json] [--max-syncs N] [--verify] script.py [args...]``

Runs a user script as ``__main__`` the way ``python -m cProfile`` does (its own ``sys.argv``, its
folder first on ``sys.path``, its exit code kept) under ``count_syncs()`` and prints:

* the host-sync sites sorted by count: ``file:line``, kind, count, calls of the enclosing
  function, distinct values (one value over many reads marks a hoisting candidate);
* for every function compiled with ``torch.compile`` in the run: frames, graphs, graph breaks with
  reason and user location (sync-caused ones marked), recompiles, in the spirit of
  ``torch._dynamo.explain``'s "Graph Count / Break Reasons / User Stack". That helper compiles with
  its own backend and so cannot show what the real backend (nosync) did; this report watches the
  real run instead;
* the nosync backend's decisions (``torchsync_pass.report.DECISIONS``), also marked in the sites
  table: every decided site has a row there, with a count of 0 when no sync ran at it (a hoisted
  site syncs only inside the guard, once per new request);
* with ``--verify``: every graph nosync compiled in the run, checked bitwise against the eager FX
  graph at compile time (``backend.forced_options(verify=True)``), with its status and message.

``--json`` prints one JSON object instead (the script's own stdout then goes to stderr so stdout
stays parseable). ``--max-syncs N`` exits 1 when the run syncs more than N times (a CI gate).
Exit status (see ``--help``): 2 when the script cannot be read or compiled; else the script's own
non-zero status (1 when it raised); else 1 when ``--max-syncs`` is exceeded or ``--verify`` found a
FAILED graph; else 0.
"""

from __future__ import annotations

import argparse
import builtins
import contextlib
import dataclasses
import io
import json
import logging
import os
import re
import sys
import threading
import time
import traceback
import types
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

from . import report
from .report import DECISIONS, Action, Decision, SiteKey

log = logging.getLogger(__name__)

PROG = "python -m torchsync_pass.explain"
_SYNC_REASON_RE = re.compile(
    r"item\(\)|tolist|data.dependent|generic_jump|nonzero|dynamic output shape|"
    r"_local_scalar_dense|__bool__|\.numpy\(\)|torch\.equal|Tensor\.equal",
    re.IGNORECASE,
)


class _UsageError(Exception):
    """The script cannot be run at all: one line on stderr, exit 2."""


# --------------------------------------------------------------------------------------------
# What Dynamo compiled
# --------------------------------------------------------------------------------------------
@dataclass
class GraphBreak:
    file: str
    line: int
    reason: str
    compile_id: str | None = None
    user_stack: list[str] = field(default_factory=list)
    sync: bool = False


@dataclass
class CompiledFunction:
    name: str
    file: str
    line: int
    frames: set = field(default_factory=set)
    graphs: int = 0
    ops: int = 0
    compiles: list = field(default_factory=list)  # compile ids
    recompiles: list = field(default_factory=list)  # (compile id, reason, nosync's reasons)
    failures: list = field(default_factory=list)
    failed: set = field(default_factory=set)  # compile ids Dynamo gave up on (no cache entry)
    breaks: list = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "function": self.name,
            "file": self.file,
            "line": self.line,
            "frames": len(self.frames),
            "graphs": self.graphs,
            "graph_ops": self.ops,
            "graph_breaks": [asdict(b) for b in self.breaks],
            "sync_graph_breaks": sum(b.sync for b in self.breaks),
            "recompiles": [{"compile_id": c, "reason": r, "nosync_reasons": n} for c, r, n in self.recompiles],
            "failures": self.failures,
            "compile_ids": self.compiles,
        }


class _BreakHandler(logging.Handler):
    """Collects Dynamo's graph-break log records (the ``graph_breaks`` artifact)."""

    _HEAD = re.compile(
        r"Graph break in user code at (?P<file>.+?):(?P<line>\d+)\n"
        r"Graph Break Reason: (?P<reason>.*?)(?:\n\s*\nUser code traceback:\n(?P<stack>.*))?$",
        re.DOTALL,
    )

    def __init__(self, compile_id_fn: Any) -> None:
        super().__init__(logging.DEBUG)
        self.compile_id_fn = compile_id_fn
        self.breaks: list[GraphBreak] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            cid = self.compile_id_fn()
            if record.args and "suppressed" in str(record.msg):
                file, line, reason = record.args[:3]  # type: ignore[misc]
                self.breaks.append(GraphBreak(str(file), int(line), _first_para(str(reason)), cid))
                return
            m = self._HEAD.match(record.getMessage())
            if not m:
                return
            stack = [
                ln.rstrip() for ln in (m.group("stack") or "").splitlines() if ln.strip()
            ][-8:]
            self.breaks.append(
                GraphBreak(m.group("file"), int(m.group("line")), _first_para(m.group("reason")),
                           cid, stack)
            )
        except Exception:  # a report detail must never break the user's run
            pass


def _first_para(reason: str) -> str:
    """The informative line of a break reason (Dynamo prefixes a generic 'Encountered ...')."""
    paras = [p.strip() for p in reason.strip().split("\n\n") if p.strip()]
    paras = [p for p in paras if not p.startswith("Encountered graph break when attempting to trace")] or paras
    return paras[0].splitlines()[0].strip() if paras else ""


class _CompileWatcher:
    """Watches what Dynamo compiles during the run.

    Through :mod:`torchsync_pass._torch_private` only: its ``CompilationWatch`` (Dynamo's
    compilation-metrics records, one per frame compile: code name/file/line, graph op count,
    compile id, recompile and failure reasons), ``graph_break_logger()`` (reason and user stack of
    each break) and ``current_compile_id()`` (which compile a break belongs to). Any of these
    missing leaves the "compiled" section empty with a note, never a failed run.
    """

    def __init__(self) -> None:
        self.note = ""
        self._stop: Any = None
        self.resets0 = 0  # torch._dynamo.reset() calls before the run: ids restart after each

    def resets(self) -> int:
        """The resets of Dynamo since the watch started."""
        from . import _torch_private

        return _torch_private.dynamo_resets() - self.resets0

    def start(self) -> None:
        metrics = None
        try:
            from . import _torch_private, dynamo_hooks

            self.resets0 = _torch_private.dynamo_resets()
            metrics = _torch_private.CompilationWatch()
            mark = dynamo_hooks.recompile_reason_mark()
            lg = _torch_private.graph_break_logger()
            saved = (lg.level, lg.propagate)
            handler = _BreakHandler(lambda: _torch_private.qualified_compile_id(
                dynamo_hooks.current_compile_id(), self.resets()))
            lg.addHandler(handler)
            if not lg.isEnabledFor(logging.DEBUG):  # TORCH_LOGS=graph_breaks not set: collect, print nothing
                lg.setLevel(logging.DEBUG)
                lg.propagate = False
        except Exception as e:
            self.note = f"compiled-function info unavailable on this torch ({e!r})"
            if metrics is not None:  # put Dynamo's metrics limit back
                with contextlib.suppress(Exception):
                    metrics.stop()
            log.debug("compile watcher not started", exc_info=True)
            return

        def stop() -> list[CompiledFunction]:
            lg.removeHandler(handler)
            lg.setLevel(saved[0])
            lg.propagate = saved[1]
            ours: dict[str, list[str]] = {}
            for cid, resets, reason in dynamo_hooks.recompile_reasons(mark):
                ours.setdefault(_torch_private.qualified_compile_id(cid, resets - self.resets0), []).append(reason)
            return _group(metrics.stop(), handler.breaks, ours)

        self._stop = stop

    def stop(self) -> list[CompiledFunction]:
        if self._stop is None:
            return []
        try:
            return self._stop()
        except Exception as e:
            self.note = f"compiled-function info unavailable on this torch ({e!r})"
            log.debug("compile watcher failed", exc_info=True)
            return []


def _group(metrics: list[Any], breaks: list[GraphBreak],
           nosync_reasons: Optional[dict] = None) -> list[CompiledFunction]:
    nosync_reasons = nosync_reasons or {}
    funcs: dict[tuple, CompiledFunction] = {}
    by_cid: dict[str, CompiledFunction] = {}
    from .dynamo_hooks import RESUME_RE as _RESUME_RE

    # originals first so resume functions find their function's first line
    ordered = sorted(metrics, key=lambda m: bool(_RESUME_RE.match(m.co_name or "")))
    for m in ordered:
        if not m.co_name or m.is_runtime:
            continue
        rm = _RESUME_RE.match(m.co_name)
        name = rm.group(1) if rm else m.co_name
        key = next(
            (k for k in funcs if rm and k[0] == m.co_filename and k[1] == name),
            (m.co_filename, name, m.co_firstlineno),
        )
        cf = funcs.get(key)
        if cf is None:
            cf = funcs[key] = CompiledFunction(name, m.co_filename or "?", m.co_firstlineno or 0)
        cid = m.compile_id or "?"
        cf.compiles.append(cid)
        by_cid[cid] = cf
        frame_id, _, attempt = cid.partition("/")
        cf.frames.add(frame_id)
        if m.graph_op_count:
            cf.graphs += 1
            cf.ops += m.graph_op_count
        if attempt not in ("", "0"):
            first = (m.recompile_reason or "").strip()
            # nosync's guards that failed too: Dynamo's metrics keep the first entry's reason only
            ours = [r for r in dict.fromkeys(nosync_reasons.get(cid, ())) if r not in first]
            cf.recompiles.append((cid, first, ours))
        if m.fail_reason:
            cf.failures.append(f"{m.fail_type}: {m.fail_reason}".strip())
            cf.failed.add(cid)
    for b in breaks:
        cf = by_cid.get(b.compile_id or "")
        if cf is None:  # unknown compile: put it with a function of the same file
            cf = next((f for f in funcs.values() if f.file == b.file), None)
        if cf is not None:
            cf.breaks.append(b)
    return list(funcs.values())


# --------------------------------------------------------------------------------------------
# Running the script
# --------------------------------------------------------------------------------------------
def _load(path: str) -> types.CodeType:
    try:
        with io.open_code(path) as f:
            src = f.read()
    except OSError as e:
        raise _UsageError(f"can't open file {path!r}: {e.strerror or e}") from None
    try:
        return compile(src, path, "exec", dont_inherit=True)
    except SyntaxError as e:
        where = f"{e.filename or path}:{e.lineno or 0}:{e.offset or 0}"
        raise _UsageError(f"{where}: {type(e).__name__}: {e.msg}") from None
    except ValueError as e:  # null bytes
        raise _UsageError(f"{path}: {e}") from None


@dataclass
class _Outcome:
    exit_code: int = 0
    exc: BaseException | None = None


def _exit_code(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return int(e.code)  # sys.exit(True) exits 1
    print(e.code, file=sys.stderr)
    return 1


def _run(code: types.CodeType, path: str, args: list[str], stdout_to_stderr: bool) -> _Outcome:
    main_mod = types.ModuleType("__main__")
    main_mod.__dict__.update(
        # absolute, as Python (3.9+) gives a script run by path: a script that changes directory
        # still finds its files by __file__ (review 22)
        {"__file__": os.path.abspath(path), "__builtins__": builtins, "__cached__": None, "__spec__": None,
         "__loader__": None, "__package__": None}
    )
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    saved_main = sys.modules.get("__main__")
    sys.argv = [path, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    sys.modules["__main__"] = main_mod
    out = _Outcome()
    redirect = _stdout_to_stderr() if stdout_to_stderr else contextlib.nullcontext()
    try:
        with redirect:
            before = set(threading.enumerate())
            try:
                exec(code, main_mod.__dict__)
            finally:
                _join_threads(before)
    except SystemExit as e:
        out.exit_code = _exit_code(e)
    except BaseException as e:  # noqa: BLE001 - the report comes first, then the traceback
        out.exit_code = 1
        out.exc = e
    finally:
        sys.argv[:] = saved_argv
        sys.path[:] = saved_path
        if saved_main is not None:
            sys.modules["__main__"] = saved_main
        with contextlib.suppress(Exception):
            sys.stdout.flush()
    return out


def _join_threads(before: set) -> None:
    """Wait for the non-daemon threads the script started that run its own code (not the standard
    library's or an installed package's), as the interpreter waits before it exits: their syncs
    are the run's (review 22: a worker's reads after the script's last line were missed, and
    printed after the report). A library's worker (a ``ThreadPoolExecutor``'s, Inductor's compile
    pool) ends only in the interpreter's own shutdown, after explain's report: never waited for."""
    me = threading.current_thread()
    while True:
        alive = [t for t in threading.enumerate()
                 if t is not me and t not in before and not t.daemon and t.is_alive() and _runs_user_code(t)]
        if not alive:
            return
        for t in alive:
            t.join()


def _runs_user_code(t: threading.Thread) -> bool:
    """Does ``t`` run code outside the standard library and the installed packages? (Its target's,
    or its ``run`` override's; unknown: no.)"""
    import sysconfig

    target = getattr(t, "_target", None) if type(t).run is threading.Thread.run else type(t).run
    code = getattr(getattr(target, "__func__", target), "__code__", None)
    if code is None:
        return False
    paths = sysconfig.get_paths()
    libs = tuple(os.path.join(os.path.realpath(paths[k]), "") for k in ("stdlib", "platstdlib", "purelib", "platlib")
                 if paths.get(k))
    filename = os.path.realpath(code.co_filename)
    return not filename.startswith(libs) and not code.co_filename.startswith("<frozen")


@contextlib.contextmanager
def _stdout_to_stderr() -> Any:
    """Send what the script writes to standard output to standard error, so that explain's own
    stdout holds only its report (``--json``): ``sys.stdout`` and, where it is the process's, file
    descriptor 1 too (a child process, C code, ``os.write(1, ...)``: review 22)."""
    saved = None
    try:
        sys.stdout.flush()
        if sys.stdout.fileno() == 1 and sys.stderr.fileno() == 2:
            saved = os.dup(1)
            os.dup2(2, 1)
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        saved = None  # a stdout with no descriptor (captured): sys.stdout alone
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        if saved is not None:
            with contextlib.suppress(Exception):
                sys.stderr.flush()
            os.dup2(saved, 1)
            os.close(saved)


def _print_traceback(exc: BaseException) -> None:
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb, file=sys.stderr)


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------
def _same_file(a: str, b: str) -> bool:
    if a == b:
        return True
    try:
        return os.path.abspath(a) == os.path.abspath(b) or os.path.samefile(a, b)
    except OSError:
        return False


def _mark_sync_breaks(funcs: list[CompiledFunction], counts: Any) -> None:
    # a sync counted on the break's line tells of a sync break, except one only inside an op
    # (Dynamo never breaks for those: multinomial's own read beside a break for its generator)
    sites = [k for k, st in counts.sites.items() if set(st.kinds) - {"in_op"}]
    for cf in funcs:
        for b in cf.breaks:
            at_site = any(s.line == b.line and _same_file(s.file, b.file) for s in sites)
            b.sync = at_site or bool(_SYNC_REASON_RE.search(b.reason))


def build_report(
    script: str, args: list[str], outcome: _Outcome, counts: Any, funcs: list[CompiledFunction],
    decisions: list[Decision], notes: list[str], verification: list[dict] | None = None,
) -> dict[str, Any]:
    # the last decision of each site; a counted sync is tagged with a sync's decision where its
    # line has one (a cached tensor's is not a sync's: a demoted int() on the line of a cached
    # tensor was tagged "cached")
    # decisions of a compile Dynamo then gave up on (the frame ran uncompiled, or fullgraph raised)
    # describe no code that ran: listed as discarded, never on a site's row
    # A demotion stands though (the site's state, which every later compile reads: review 23, a
    # demotion that took effect was shown as "discarded ... nothing of it ran")
    failed = set().union(*(cf.failed for cf in funcs)) if funcs else set()
    gone = [d.compile_id in failed and d.action is not Action.DEMOTED for d in decisions]
    discarded = [d for d, g in zip(decisions, gone) if g]
    decisions = [d for d, g in zip(decisions, gone) if not g]
    latest = {d.site: d for d in decisions}
    # (filtered before taking the last: a demoted sync whose site's last record is a cached tensor),
    # and of those one of the row's own kind first (a kept bool() beside a rewritten index)
    of_syncs: dict[SiteKey, Decision] = {}
    of_kind: dict[str, dict[SiteKey, Decision]] = {}
    for d in decisions:
        if d.action not in (Action.CACHED, Action.NOT_CACHED):
            of_syncs[d.site] = of_kind.setdefault(d.kind, {})[d.site] = d
    body = counts.to_json()
    sites = []
    for st in counts.sorted_sites():
        j = st.to_json()
        j["counted"] = True
        d = next((found for k, _ in st.kinds.most_common()
                  for found in [_decision_for(st.site, of_kind.get(k, {}))] if found is not None), None)
        d = d or _decision_for(st.site, of_syncs) or _decision_for(st.site, latest)
        j["nosync"] = None if d is None else _decision_mark(d)
        sites.append(j)
    # Every nosync decision gets a row, also where no sync ran (a hoisted site syncs only in its
    # guard, once per new request).
    counted = list(counts.sites)
    for key, d in sorted(latest.items(), key=lambda kv: (kv[0].file, kv[0].line)):
        if not any(k.line == key.line and _same_file(k.file, key.file) for k in counted):
            sites.append(_decision_row(d))
    return {
        "script": script,
        "argv": [script, *args],
        "exit_code": outcome.exit_code,
        "mode": body["mode"],
        "totals": body["totals"],
        "sites": sites,
        "compiled": [cf.to_json() for cf in funcs],
        "nosync": [d.to_json() for d in decisions] + [{**d.to_json(), "discarded": True} for d in discarded],
        "verification": verification,
        "cuda": body["cuda"],
        "notes": body["notes"] + notes,
    }


def _decision_mark(d: Decision) -> dict[str, Any]:
    return {"action": d.action.value, "reason": d.reason.name, "value": d.value,
            "compile_id": d.compile_id}


def _decision_row(d: Decision) -> dict[str, Any]:
    """A sites-table row for a decided site where no sync was counted."""
    from .counting import SiteStats

    row = SiteStats(site=d.site, function=d.code).to_json()
    row.update(kind=d.kind, source=d.source or row["source"], values=[d.value] if d.value else [],
               counted=False, nosync=_decision_mark(d))
    return row


def _qualified_name(name: str, cid: Any, qualified: Any) -> str:
    """A graph's name (``nosync graph 0/0 (eager)``) with its compile id qualified as the entry's."""
    if cid and qualified and qualified != cid:
        return name.replace(f"graph {cid}", f"graph {qualified}", 1)
    return name


def _verification_entry(entry: dict, resets: int = 0) -> dict[str, Any]:
    """One graph of ``backend.compiled_graphs()`` as the report's "verification" list shows it
    (its compile id qualified by the Dynamo resets before it)."""
    from . import _torch_private

    v = entry.get("verified")
    base = {"compile_id": _torch_private.qualified_compile_id(entry.get("compile_id"), resets),
            "codegen": entry.get("codegen"),
            "fell_back": entry.get("fell_back"),  # why the requested codegen failed (eager ran)
            "mode": entry.get("mode")}
    if v is None:  # compiled outside --verify's reach (should not happen under forced_options)
        return {**base, "name": "", "status": "NOT_VERIFIED", "message": "", "reason": "",
                "mismatches": []}
    status = v.status.name  # PASSED / FAILED / SKIPPED
    message = v.message
    if status == "FAILED" and entry.get("codegen") == "inductor":
        # NOTE: Inductor is not bitwise equal to the FX graph run eagerly on CPU (fused
        # reductions, vectorised math): a difference is reported, not a failure. The bitwise
        # promise for Inductor is against stock Inductor (torchsync_pass.verify_loop).
        status = "DIFFERS"
        message = ("inductor codegen: not bitwise equal to the eager FX graph (expected on CPU; "
                   "verify_loop checks nosync against stock Inductor). " + (message or ""))
    return {
        **base,
        "name": _qualified_name(v.name, entry.get("compile_id"), base["compile_id"]),
        "status": status,  # PASSED / FAILED / SKIPPED / DIFFERS (Inductor rounding)
        "message": message,
        "reason": v.reason,
        "mismatches": [m.path for m in v],
    }


def _decision_for(site: SiteKey, latest: dict[SiteKey, Decision]) -> Decision | None:
    return latest.get(site) or next(
        (v for k, v in latest.items() if k.line == site.line and _same_file(k.file, site.file)), None
    )


def _rel(path: str) -> str:
    try:
        rel = os.path.relpath(path)
        return rel if not rel.startswith("..") else path
    except ValueError:
        return path


def _no_decisions_line(rep: dict[str, Any]) -> str:
    n, disabled = rep.get("nosync_graphs") or 0, rep.get("nosync_disabled")
    if disabled:
        return f"  (none: the nosync pass is disabled, nosync ran as stock Inductor: {disabled})"
    sync_breaks = sum(cf.get("sync_graph_breaks") or 0 for cf in rep.get("compiled") or ())
    if n and sync_breaks:
        # a break Dynamo takes inside an op's fake run ("Data dependent operator": torch._assert on
        # a tensor, torch._check_tensor_all before torch 2.13) reaches none of nosync's hooks
        return (f"  (none: nosync compiled {n} graph(s) and intercepted no host sync while tracing them; "
                f"the {sync_breaks} graph break(s) tagged [sync] above are syncs Dynamo takes inside an op "
                "(as stock does: torch._assert on a tensor, ...), which nosync does not intercept: nothing "
                "hoisted)")
    if n:
        return (f"  (none: nosync compiled {n} graph(s) and met no host sync while tracing them: "
                "nothing to hoist)")
    return "  (none: the nosync backend did not run)"


def render_text(rep: dict[str, Any], max_sites: int = 40) -> str:
    out: list[str] = []
    t = rep["totals"]
    out.append(f"torchsync_pass explain: {rep['script']} (exit {rep['exit_code']})")
    out.append("=" * 78)
    mode_note = (
        "CPU-only run: every host read is counted as the sync it would be on a GPU"
        if rep["mode"] == "cpu-as-device"
        else "accelerator run: reads of CPU-resident tensors are listed as host-local"
    )
    out.append(f"Host syncs: {t['syncs']}   ({mode_note})")
    if t.get("host_local"):
        out.append(f"Host-local reads (CPU tensors, not syncs): {t['host_local']}")
    if t.get("compile_time"):
        out.append(f"Reads during compilation or imports (not counted): {t['compile_time']}")
    if t["by_kind"]:
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(t["by_kind"].items(), key=lambda x: -x[1]))
        out.append(f"By kind: {kinds}")
    cuda = rep.get("cuda") or {}
    if any(cuda.get(k) for k in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "dtoh_cudaMemcpyAsync")):
        out.append(
            "CUDA: cudaStreamSynchronize {0}, cudaDeviceSynchronize {1}, DtoH cudaMemcpyAsync {2}".format(
                cuda["cudaStreamSynchronize"], cuda["cudaDeviceSynchronize"], cuda["dtoh_cudaMemcpyAsync"]
            )
        )
    out.append("")
    out.append("Sync sites (by count)")
    sites = rep["sites"]
    if not sites:
        out.append("  (none)")
    else:
        out.append(f"  {'count':>6} {'kind':<12} {'calls':>6} {'values':>7}  site")
        for s in sites[:max_sites]:
            calls = "-" if s["calls"] is None else str(s["calls"])
            dv = s["distinct_values"]
            vals = "?" if dv is None else (f">{dv}" if s["distinct_values_capped"] else str(dv))
            n = s["count"] + s["host_local"]
            flags = []
            if s["hoisting_candidate"]:
                flags.append(f"hoisting candidate: one value ({s['values'][0]})" if s["values"]
                             else "hoisting candidate")
            if s["host_local"]:
                flags.append(f"host-local x{s['host_local']}")
            if s["nosync"]:
                val = f" = {s['nosync']['value']}" if s["nosync"].get("value") else ""
                flags.append(f"nosync: {s['nosync']['action']}{val}")
            if not s.get("counted", True):
                flags.append("no sync counted at this line")
            if not s["line_exact"]:
                flags.append("line inferred")
            out.append(f"  {n:>6} {s['kind']:<12} {calls:>6} {vals:>7}  {_rel(s['file'])}:{s['line']}")
            if s["source"]:
                out.append(f"  {'':>35}{s['source']}")
            if flags:
                out.append(f"  {'':>35}[{'; '.join(flags)}]")
        if len(sites) > max_sites:
            out.append(f"  ... {len(sites) - max_sites} more sites (see --json)")
    out.append("")
    out.append("Compiled functions")
    if not rep["compiled"]:
        out.append("  (none compiled with torch.compile in this run)")
    for cf in rep["compiled"]:
        out.append(f"  {cf['function']}  ({_rel(cf['file'])}:{cf['line']})")
        out.append(
            f"    Frames: {cf['frames']}   Graph Count: {cf['graphs']}   "
            f"Graph Break Count: {len(cf['graph_breaks'])} ({cf['sync_graph_breaks']} from syncs)   "
            f"Recompiles: {len(cf['recompiles'])}"
        )
        if cf["graph_breaks"]:
            out.append("    Break Reasons:")
            for i, b in enumerate(cf["graph_breaks"], 1):
                tag = "[sync] " if b["sync"] else ""
                reason = b["reason"].splitlines()[0] if b["reason"] else "?"
                out.append(f"      {i}. {tag}{_rel(b['file'])}:{b['line']}: {reason}")
                src = SiteKey(b["file"], b["line"]).source()
                if src:
                    out.append(f"         User Stack: ... {src}")
        for r in cf["recompiles"]:
            reason = r["reason"]
            out.append(f"    Recompile {r['compile_id']}: {reason.splitlines()[0] if reason else '?'}")
            out.extend(f"      and {ours}" for ours in r.get("nosync_reasons", ()))
        for f in cf["failures"]:
            out.append(f"    Compile failure: {f.splitlines()[0]}")
    out.append("")
    out.append("nosync decisions")
    if not rep["nosync"]:
        out.append(_no_decisions_line(rep))
    for d in rep["nosync"]:
        val = f" = {d['value']}" if d.get("value") else ""
        gone = (f" [discarded: Dynamo gave up on compile {d.get('compile_id')}; nothing of it ran]"
                if d.get("discarded") else "")
        out.append(f"  {_rel(d['site']['file'])}:{d['site']['line']}: {d['action']} {d['kind']}{val}{gone}")
        out.append(f"      {d['reason_text']}{' (' + d['detail'] + ')' if d.get('detail') else ''}")
    if rep.get("verification") is not None:
        out.append("")
        out.append("Verification (--verify: each nosync graph vs the eager FX graph, bitwise)")
        if not rep["verification"]:
            out.append("  (none: the nosync backend compiled no graph in this run)")
        for v in rep["verification"]:
            mode = f", mode {v['mode']}" if v.get("mode") else ""
            out.append(f"  {v['status']:<8} graph {v['compile_id'] or '?'} ({v['codegen']} codegen{mode})")
            if v.get("fell_back"):
                out.append(f"           runs the FX graph eagerly: {v['fell_back'].splitlines()[0]}")
            if v["status"] != "PASSED" and v["message"]:
                lines = v["message"].splitlines()
                out.extend(f"           {ln}" for ln in lines[:12])
                if len(lines) > 12:
                    out.append(f"           ... ({len(lines) - 12} more lines, see --json)")
    for n in rep["notes"]:
        out.append(f"note: {n}")
    return "\n".join(out)


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------
_EPILOG = """\
exit status (first that applies):
  2  the script cannot be read or compiled, or explain's own options are wrong (nothing ran)
  N  the script's own non-zero status: its sys.exit code, or 1 when it raised (report first,
     then its traceback); the gates below still print their message but do not change it
  1  the script succeeded but a gate failed: the run synced more than --max-syncs N times,
     or --verify found a graph that is not bitwise equal to eager (FAILED)
  0  otherwise. Under --verify a SKIPPED graph (the check could not run) is listed in the
     report, and does not fail the run; graphs of other backends are not verified.
"""


def _non_negative(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse type: ``kind`` of the text, refused (exit 2, naming the option) below 0 or from
    1e9 on."""
    def parse(text: str) -> Any:
        value = kind(text)
        if not 0 <= value < 1e9:  # NaN and inf too (a wait that long overflows the clock)
            raise argparse.ArgumentTypeError(f"must be 0 or more and finite (below 1e9), got {text}")
        return value
    parse.__name__ = kind.__name__  # argparse names the type in its message
    return parse


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Run a script and report its host syncs, graph breaks and nosync decisions.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=_EPILOG,
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--max-syncs", type=_non_negative(int), metavar="N", default=None,
                   help="exit 1 when the run syncs more than N times (CI gate)")
    p.add_argument("--verify", action="store_true",
                   help="compare every graph the nosync backend compiles in the run bitwise with "
                   "the eager FX graph at compile time (options verify=True forced on); list "
                   "each graph's status and exit 1 when one FAILED")
    p.add_argument("--max-sites", type=_non_negative(int), metavar="N", default=40,
                   help="sites shown in the text report (default 40)")
    p.add_argument("--no-profiler", action="store_true",
                   help="count with method interception only (faster; misses the syncs inside "
                   "ops: torch.equal(a, b), torch.allclose, torch.nonzero(x), masked_select, "
                   "complex(t), t.is_nonzero(), torch.arange(t), ..., and syncs inside compiled graphs)")
    p.add_argument("--progress", type=_non_negative(float), metavar="SECONDS", default=30.0,
                   help="print a progress line on stderr every SECONDS while the script runs "
                   "(default 30; 0: never)")
    p.add_argument("script", help="the Python script to run as __main__")
    p.add_argument("args", nargs="*", default=[], help="arguments passed to the script, as given (a '--' included)")
    return p


# explain's options that take a value (as "--name VALUE"; "--name=VALUE" is one word)
_VALUED = ("--max-syncs", "--max-sites", "--progress")


def _split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(explain's own words up to the script included, the script's arguments as given): the
    script's arguments are never parsed here, so a ``--`` after the script reaches it, as with
    ``python script.py -- -x`` and ``python -m cProfile script.py -- -x``."""
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--":  # the script follows
            return argv[: i + 2], argv[i + 2:]
        if not a.startswith("-") or a == "-":
            return argv[: i + 1], argv[i + 1:]
        # an option taking a value (argparse also takes an unambiguous prefix: "--max-syncs" as "--max-sy")
        valued = [o for o in _VALUED if o.startswith(a)] if a.startswith("--") and "=" not in a else []
        i += 2 if len(valued) == 1 else 1
    return argv, []


@contextlib.contextmanager
def _progress(counter: Any, interval: float, decisions: Any) -> Any:
    """Prints ``torchsync-explain: 60 s, 412 host syncs so far, 7 nosync decisions`` on stderr
    every ``interval`` seconds while the script runs (a daemon thread that only reads counts)."""
    stop, t0 = threading.Event(), time.monotonic()

    def loop() -> None:
        while not stop.wait(interval):
            print(f"{PROG}: {time.monotonic() - t0:.0f} s, {counter.total} host syncs so far, "
                  f"{decisions.added} nosync decisions", file=sys.stderr, flush=True)

    thread = threading.Thread(target=loop, name="torchsync-explain-progress", daemon=True)
    if interval > 0:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        if thread.is_alive():
            thread.join()


def main(argv: list[str] | None = None) -> int:
    """Run the CLI in-process; returns the exit status instead of exiting."""
    try:
        own, script_args = _split_argv(sys.argv[1:] if argv is None else list(argv))
        ns = _parser().parse_args(own)
        ns.args = script_args
    except SystemExit as e:  # argparse: usage error (2) or --help (0)
        return _exit_code(e)
    try:
        code = _load(ns.script)
    except _UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2

    from . import _torch_private, counting

    counting.register_file(ns.script)
    verify_ctx: Any = contextlib.nullcontext()
    if ns.verify:
        # imported before the watcher and counter start: its import-time hook self-test compiles
        # probes of its own
        from . import backend

        verify_ctx = backend.forced_options(verify=True)
    watcher = _CompileWatcher()
    watcher.start()
    counter = counting.count_syncs(profiler=not ns.no_profiler)
    # what the script's compiles recorded, kept even when it calls torchsync_pass.reset(); each
    # record stamped with the Dynamo resets before it (compile ids start again after one)
    with DECISIONS.tap(watcher.resets) as decisions, report.compile_tap(watcher.resets) as graphs:
        with counter, verify_ctx, _progress(counter, ns.progress, decisions):
            outcome = _run(code, ns.script, list(ns.args), stdout_to_stderr=ns.json)
    # the nosync self-test compiles tiny probes of its own on first use: not the user's functions
    # (torch's own code is: the user compiled nn.Sequential, whose forward is in torch; review 22)
    funcs = [
        f for f in watcher.stop()
        if not counting.is_own_file(f.file) and not counting.is_own_file(os.path.abspath(f.file))
    ]
    _mark_sync_breaks(funcs, counter)
    notes = [watcher.note] if watcher.note else []
    verification = None
    if ns.verify:
        verification = [_verification_entry(e, r) for e, r in zip(graphs, graphs.stamps)]
        if not verification:
            notes.append("--verify: the nosync backend compiled no graph in this run; nothing was verified")
    qualified = [dataclasses.replace(d, compile_id=_torch_private.qualified_compile_id(d.compile_id, r))
                 if d.compile_id and r else d for d, r in zip(decisions, decisions.stamps)]
    rep = build_report(
        ns.script, list(ns.args), outcome, counter, funcs, qualified, notes, verification,
    )
    rep["nosync_graphs"] = graphs.added
    hooks = sys.modules.get(f"{__package__}.dynamo_hooks")
    rep["nosync_disabled"] = hooks.disabled_reason() if hooks is not None else None
    if ns.json:
        print(json.dumps(rep, indent=2, default=str))
    else:
        print(render_text(rep, ns.max_sites))
    sys.stdout.flush()
    if outcome.exc is not None:
        _print_traceback(outcome.exc)
    status = outcome.exit_code
    # a gate's 1 where the OS would read the script's status as 0 (sys.exit(256)): review 22
    gate = 1 if status % 256 == 0 else status
    if ns.max_syncs is not None and counter.total > ns.max_syncs:
        print(f"{PROG}: {counter.total} host syncs > --max-syncs {ns.max_syncs}", file=sys.stderr)
        status = gate
    failed = [v for v in verification or () if v["status"] == "FAILED"]
    if failed:
        ids = ", ".join(str(v["compile_id"] or "?") for v in failed)
        print(f"{PROG}: --verify: {len(failed)} nosync graph(s) not bitwise equal to eager: {ids}",
              file=sys.stderr)
        status = gate
    return status


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env bash
# benchmarks/gpu_check.sh - the CUDA checks of torchsync_pass, on one GPU, in under 8 minutes.
#
#   bash benchmarks/gpu_check.sh              # run (skips cleanly, exit 0, where there is no CUDA)
#   bash benchmarks/gpu_check.sh --dry-run    # print the plan and the environment, run nothing heavy
#
# Steps (total at most GPU_CHECK_BUDGET_S, default 420 s, so that start-up and the run fit in
# 8 minutes on an H200; each step has its own time limit):
#   0. torch version: the pass supports torch>=2.11,<2.16 (the GPU box has 2.11.0). Only OUTSIDE
#      that range does this script export TORCHSYNC_PASS_ANY_TORCH=1 for an experiment, skipping
#      the version check only; the hook self-test still decides whether the pass is on. Every
#      output (env.txt, summary.txt, ab_cuda.md) then says that the pass ran on an UNSUPPORTED torch.
#   1. install (real CUDA runs only): pip install -e . --no-deps --no-build-isolation --no-index
#      into $PYTHON's environment, so the torch_dynamo_backends entry point "nosync" is
#      registered; if that fails, the checkout runs from PYTHONPATH (importing torchsync_pass
#      registers the backend itself). Dry runs and CPU-only machines install nothing.
#   2. environment: nvidia-smi, python, torch and CUDA, packages, the nosync entry point, and the
#      hook self-test per hook point (LIVE or DISABLED; where DISABLED, nosync behaves exactly like
#      stock Inductor and the GPU numbers measure stock Inductor, not the pass);
#   3. the CUDA-only tests:  pytest -m cuda tests  (limit 120 s);
#   4. a small A/B on CUDA (benchmarks/ab.py --device cuda, examples diffusion-tiny then decode,
#      5 timed requests, no guard-overhead step): eager, stock Inductor, hand-hoisted, nosync,
#      nosync (eager codegen) and the cudagraphs column, with cudaStreamSynchronize counts per
#      step. ab.py rewrites its JSON after each example, so a run cut by the limit keeps those.
#   5. per-step CUDA syncs measured two ways (benchmarks/cuda_sync_check.py, limit T_SYNC=100 s):
#      torch.cuda.set_sync_debug_mode("warn") warnings counted, next to count_syncs() and the
#      profiler's CUDA runtime counters, for eager / stock Inductor / nosync / nosync+cudagraphs
#      (SYNC_EXAMPLES, default diffusion-tiny,decode) -> sync_check.md, sync_check.json.
# Nothing is downloaded: the machine may be offline. Packages come from the image; a missing one
# can be carried as wheels in <repo>/.whl (installed with --no-index into a private folder).
# The GPU's settings are never touched.
#
# Outputs go to $OUT when set (else <repo>/gpu_check_out), 9 files: env.txt, pytest_cuda.log,
# ab_cuda.md, ab_cuda.json, ab_cuda.png (if matplotlib), ab_cuda.log, sync_check.md,
# sync_check.json, summary.txt.
# Exit status: 0 when every step that ran passed (or there is no CUDA), 1 otherwise, 2 bad usage.
#
# Knobs: PYTHON (default: python3, /opt/torch/.venv/bin/python3, .venv/bin/python),
# GPU_CHECK_BUDGET_S, AB_EXAMPLES (comma-separated, in the order to run; default
# diffusion-tiny,decode,diffusion-large,prefill), AB_ARGS (ab.py arguments replacing the default "--repeats 5 --no-guard").
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
DRY=0
for a in "$@"; do
  case "$a" in
    --dry-run) DRY=1 ;;
    -h|--help) sed -n '2,46p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $a (try --help)" >&2; exit 2 ;;
  esac
done

OUTDIR="${OUT:-$REPO/gpu_check_out}"
mkdir -p "$OUTDIR"
BUDGET="${GPU_CHECK_BUDGET_S:-420}"
T_ENV=150
T_TESTS=120
T_SYNC=100
SYNC_EXAMPLES="${SYNC_EXAMPLES:-diffusion-tiny,decode}"
AB_EXAMPLES="${AB_EXAMPLES:-diffusion-tiny,decode,diffusion-large,diffusion-xl,prefill}"
AB_ARGS="${AB_ARGS:---repeats 5 --no-guard}"
START=$(date +%s)
export PYTHONUNBUFFERED=1

say() { echo "[gpu_check $(( $(date +%s) - START ))s] $*" | tee -a "$OUTDIR/summary.txt" >&2; }
: > "$OUTDIR/summary.txt"

# ---- which python ----
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  for cand in python3 /opt/torch/.venv/bin/python3 "$REPO/.venv/bin/python"; do
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c "import torch" >/dev/null 2>&1; then PY="$cand"; break; fi
  done
fi
if [ -z "$PY" ]; then
  say "no python with torch found (tried \$PYTHON, python3, /opt/torch/.venv/bin/python3, .venv/bin/python): nothing to check"
  exit 1
fi

# ---- carried wheels (offline) ----
EXTRA_PATH=""
if [ -d "$REPO/.whl" ] && ls "$REPO"/.whl/*.whl >/dev/null 2>&1; then
  if [ "$DRY" = 1 ]; then
    say "would install carried wheels from .whl into /tmp/gpu_check_site (--no-index)"
  else
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/gpu_check_site "$REPO"/.whl/*.whl && EXTRA_PATH="/tmp/gpu_check_site" \
      || say "installing carried wheels failed (continuing with the image's packages)"
  fi
fi
[ -n "$EXTRA_PATH" ] && export PYTHONPATH="$EXTRA_PATH${PYTHONPATH:+:$PYTHONPATH}"

# ---- 0. torch version: the experiment override, only below the supported range ----
read -r TORCH_VER OLD_TORCH HAS_CUDA < <("$PY" -c "
import torch
v = tuple(int(p) for p in torch.__version__.split('+')[0].split('.')[:2])
print(torch.__version__, int(not ((2, 11) <= v < (2, 16))), int(torch.cuda.is_available()))" 2>/dev/null || echo "? 0 0")
if [ "$TORCH_VER" = "?" ]; then
  say "could not import torch with $PY: nothing to check"
  exit 1
fi
if [ "$OLD_TORCH" = 1 ]; then
  export TORCHSYNC_PASS_ANY_TORCH=1
  EXPERIMENT="EXPERIMENT ON AN UNSUPPORTED TORCH: torch $TORCH_VER is outside the supported 2.11-2.15; TORCHSYNC_PASS_ANY_TORCH=1 is set for this experiment (version check skipped; the hook self-test still decides whether the pass is on)"
  say "$EXPERIMENT"
else
  unset TORCHSYNC_PASS_ANY_TORCH
  EXPERIMENT=""
fi

# ---- 1. project install (real CUDA runs only: it changes $PY's environment) ----
INSTALL="not installed (dry run or no CUDA): running from the checkout via PYTHONPATH"
if [ "$DRY" = 0 ] && [ "$HAS_CUDA" = 1 ]; then
  if timeout 120 "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --disable-pip-version-check \
      -e "$REPO" > /tmp/gpu_check_install.log 2>&1; then
    INSTALL="pip install -e . --no-deps --no-build-isolation --no-index: ok"
  else
    INSTALL="pip install -e . FAILED (running from the checkout via PYTHONPATH): $(tail -n 3 /tmp/gpu_check_install.log | tr '\n' ' ')"
    export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
  fi
else
  export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
fi
say "project: $INSTALL"

# ---- 2. environment and hook self-test ----
{
  echo "date: $(date -u +%FT%TZ)"
  echo "python: $PY ($("$PY" -c 'import sys; print(sys.version.split()[0])'))"
  echo "project: $INSTALL"
  echo "TORCHSYNC_PASS_ANY_TORCH=${TORCHSYNC_PASS_ANY_TORCH:-<unset>}"
  [ -n "$EXPERIMENT" ] && echo "$EXPERIMENT"
  (nvidia-smi -L 2>/dev/null || echo "nvidia-smi: not available")
  timeout "$T_ENV" "$PY" - <<'EOF'
import importlib, os, platform, sys, warnings
import torch
print(f"torch {torch.__version__}, CUDA build {torch.version.cuda}, cuda available {torch.cuda.is_available()}")
if torch.cuda.is_available():
    try:
        print(f"device 0: {torch.cuda.get_device_name(0)}, capability {torch.cuda.get_device_capability(0)}")
    except Exception as e:
        print(f"device 0: could not query ({type(e).__name__}: {e})")
print("cpu:", platform.processor() or platform.machine())
for name in ("pytest", "sympy", "networkx", "numpy", "matplotlib"):
    try:
        m = importlib.import_module(name)
        print(f"{name} {getattr(m, '__version__', '?')}")
    except Exception as e:
        print(f"{name}: MISSING ({type(e).__name__})")
try:
    import torchsync_pass
    from importlib.metadata import entry_points
    ep = "nosync" in entry_points(group="torch_dynamo_backends").names
    print(f"torchsync_pass from {os.path.dirname(torchsync_pass.__file__)}; backend 'nosync' "
          + ("registered by its entry point" if ep else "registered at import (source checkout)"))
    from torchsync_pass import dynamo_hooks
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        live = dynamo_hooks.install(lambda site: (False, None), lambda fn: False)
    res = dynamo_hooks._self_test_result or {}
    for k in dynamo_hooks.hook_points():
        print(f"  hook {'ok  ' if res.get(k) else 'DEAD'} {k}")
    if live:
        extra = ""
        if os.environ.get("TORCHSYNC_PASS_ANY_TORCH") == "1":
            extra = (f" -- UNSUPPORTED torch {torch.__version__} (supported 2.11-2.15), enabled by "
                     "TORCHSYNC_PASS_ANY_TORCH=1 for this experiment only")
        print(f"nosync hooks: LIVE ({sum(map(bool, res.values()))}/{len(res)} hook points fired){extra}")
    else:
        print(f"nosync hooks: DISABLED: {dynamo_hooks.disabled_reason()}")
except Exception as e:
    print(f"nosync hooks: could not check ({type(e).__name__}: {e})")
EOF
} > "$OUTDIR/env.txt" 2>&1
cat "$OUTDIR/env.txt" >&2

if grep -q "nosync hooks: DISABLED" "$OUTDIR/env.txt"; then
  say "NOTE: the nosync pass is DISABLED on this torch; 'nosync' columns below are stock Inductor"
elif grep -q "nosync hooks: LIVE" "$OUTDIR/env.txt"; then
  say "$(grep "nosync hooks: LIVE" "$OUTDIR/env.txt")"
else
  say "NOTE: the nosync hook self-test did not report (see env.txt)"
fi
MISSING=$(grep -c "MISSING" "$OUTDIR/env.txt" || true)

AB_CMD=(benchmarks/ab.py --device cuda --examples "$AB_EXAMPLES" --json "$OUTDIR/ab_cuda.json"
        --plot "$OUTDIR/ab_cuda.png")
# shellcheck disable=SC2206
AB_CMD+=($AB_ARGS)
if [ "$DRY" = 1 ]; then
  say "dry run: would run (cuda available: $HAS_CUDA, budget ${BUDGET}s, TORCHSYNC_PASS_ANY_TORCH=${TORCHSYNC_PASS_ANY_TORCH:-<unset>}):"
  say "  $PY -m pip install -e $REPO --no-deps --no-build-isolation --no-index   (CUDA runs only)"
  say "  timeout $T_TESTS $PY -m pytest -m cuda -q -p no:cacheprovider --continue-on-collection-errors tests  > $OUTDIR/pytest_cuda.log"
  say "  timeout <rest of budget - ${T_SYNC}s> $PY ${AB_CMD[*]}  > $OUTDIR/ab_cuda.md"
  say "  timeout $T_SYNC $PY benchmarks/cuda_sync_check.py --examples $SYNC_EXAMPLES --steps 10 --json $OUTDIR/sync_check.json > $OUTDIR/sync_check.md"
  say "dry run of the sync cross-check on the CPU (code path only, 1 step):"
  timeout 300 "$PY" benchmarks/cuda_sync_check.py --dry-run --examples diffusion-tiny \
    > "$OUTDIR/sync_check_dry.md" 2> "$OUTDIR/sync_check_dry.log" \
    && say "  ok: $(grep -c '^| diffusion' "$OUTDIR/sync_check_dry.md") rows in sync_check_dry.md" \
    || { say "  FAILED (see sync_check_dry.log)"; exit 1; }
  exit 0
fi
if [ "$HAS_CUDA" != 1 ]; then
  say "no CUDA device visible to torch: skipping the GPU checks (nothing failed)"
  exit 0
fi

STATUS=0
# ---- 3. CUDA-only tests ----
if grep -q "pytest: MISSING" "$OUTDIR/env.txt"; then
  say "pytest missing: CUDA tests not run (carry a pytest wheel in .whl)"; STATUS=1
else
  say "CUDA tests: pytest -m cuda (limit ${T_TESTS}s)"
  timeout "$T_TESTS" "$PY" -m pytest -m cuda -q -p no:cacheprovider --continue-on-collection-errors tests \
    > "$OUTDIR/pytest_cuda.log" 2>&1
  rc=$?
  tail -n 5 "$OUTDIR/pytest_cuda.log" >&2
  if [ $rc -eq 0 ]; then say "CUDA tests: passed"; elif [ $rc -eq 124 ]; then say "CUDA tests: TIMED OUT"; STATUS=1
  else say "CUDA tests: FAILED (rc $rc, see pytest_cuda.log)"; STATUS=1; fi
fi

# ---- 4. small A/B on CUDA, with the cudagraphs column ----
T_AB=$(( BUDGET - ($(date +%s) - START) - T_SYNC - 10 ))
if [ "$T_AB" -lt 30 ]; then
  say "A/B: skipped, only ${T_AB}s of the ${BUDGET}s budget left"; STATUS=1
else
  say "A/B on CUDA: $AB_EXAMPLES (limit ${T_AB}s)"
  {
    if [ -n "$EXPERIMENT" ]; then echo "> $EXPERIMENT"; echo; fi
    grep -E "^nosync hooks:" "$OUTDIR/env.txt" | tail -n 1 | sed 's/^/> /'
    echo
  } > "$OUTDIR/ab_cuda.md"
  timeout "$T_AB" "$PY" "${AB_CMD[@]}" >> "$OUTDIR/ab_cuda.md" 2> "$OUTDIR/ab_cuda.log"
  rc=$?
  cat "$OUTDIR/ab_cuda.md"
  if [ $rc -eq 0 ]; then say "A/B: done"
  elif [ $rc -eq 124 ]; then say "A/B: TIMED OUT after ${T_AB}s (finished examples are in ab_cuda.json; log in ab_cuda.log)"; STATUS=1
  else say "A/B: FAILED (rc $rc, see ab_cuda.log)"; tail -n 5 "$OUTDIR/ab_cuda.log" >&2; STATUS=1; fi
fi

# ---- 5. per-step CUDA syncs, two independent counts ----
say "sync cross-check: $SYNC_EXAMPLES (limit ${T_SYNC}s)"
timeout "$T_SYNC" "$PY" benchmarks/cuda_sync_check.py --examples "$SYNC_EXAMPLES" --steps 10 \
  --json "$OUTDIR/sync_check.json" > "$OUTDIR/sync_check.md" 2> "$OUTDIR/sync_check.log"
rc=$?
cat "$OUTDIR/sync_check.md"
if [ $rc -eq 0 ]; then say "sync cross-check: done"
elif [ $rc -eq 124 ]; then say "sync cross-check: TIMED OUT (rows so far in sync_check.json)"; STATUS=1
else say "sync cross-check: FAILED (rc $rc, see sync_check.log)"; STATUS=1; fi

[ "$MISSING" != 0 ] && say "note: $MISSING optional package(s) missing, see env.txt"
[ -n "$EXPERIMENT" ] && say "REMINDER: $EXPERIMENT"
say "finished, status $STATUS, outputs in $OUTDIR"
exit $STATUS

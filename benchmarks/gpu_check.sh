#!/usr/bin/env bash
# benchmarks/gpu_check.sh - the CUDA checks of torchsync_pass, on one GPU, in under 8 minutes.
#
#   bash benchmarks/gpu_check.sh              # run (skips cleanly, exit 0, where there is no CUDA)
#   bash benchmarks/gpu_check.sh --dry-run    # print the plan and the environment, run nothing
#
# Steps, each with its own time limit (total at most GPU_CHECK_BUDGET_S, default 450 s):
#   1. environment: nvidia-smi, python, torch and CUDA, whether the nosync hooks are live on this
#      torch (they need torch>=2.13,<2.16; elsewhere nosync behaves exactly like stock Inductor and
#      this script says so in its summary: the GPU numbers then measure stock Inductor, not the pass);
#   2. the CUDA-only tests:  pytest -m cuda tests;
#   3. the A/B benchmark on CUDA (benchmarks/ab.py --device cuda): eager, stock Inductor,
#      hand-hoisted, nosync, nosync (eager codegen) and the cudagraphs column, with
#      cudaStreamSynchronize counts per step.
# Nothing is downloaded: the machine may be offline. Packages come from the image; a missing one
# can be carried as wheels in <repo>/.whl (installed with --no-index into a private folder).
# The GPU's settings are never touched.
#
# Outputs go to $OUT when set (else <repo>/gpu_check_out): env.txt, pytest_cuda.log,
# ab_cuda.md, ab_cuda.json, ab_cuda.png (if matplotlib), ab_cuda.log, summary.txt.
# Exit status: 0 when every step that ran passed (or there is no CUDA), 1 otherwise.
#
# Knobs: PYTHON (default: python3, else .venv/bin/python), GPU_CHECK_BUDGET_S, AB_EXAMPLES
# (comma-separated, in the order to run), AB_ARGS (extra arguments for ab.py, e.g. "--no-guard").
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
DRY=0
for a in "$@"; do
  case "$a" in
    --dry-run) DRY=1 ;;
    -h|--help) sed -n '2,28p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $a (try --help)" >&2; exit 2 ;;
  esac
done

OUTDIR="${OUT:-$REPO/gpu_check_out}"
mkdir -p "$OUTDIR"
BUDGET="${GPU_CHECK_BUDGET_S:-450}"
T_TESTS=120
T_AB=$(( BUDGET - T_TESTS - 30 ))
START=$(date +%s)
export PYTHONUNBUFFERED=1
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

say() { echo "[gpu_check $(( $(date +%s) - START ))s] $*" | tee -a "$OUTDIR/summary.txt" >&2; }
: > "$OUTDIR/summary.txt"

# ---- which python ----
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  for cand in python3 "$REPO/.venv/bin/python"; do
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c "import torch" >/dev/null 2>&1; then PY="$cand"; break; fi
  done
fi
if [ -z "$PY" ]; then
  say "no python with torch found (tried \$PYTHON, python3, .venv/bin/python): nothing to check"
  exit 1
fi

# ---- carried wheels (offline) ----
if [ -d "$REPO/.whl" ] && ls "$REPO"/.whl/*.whl >/dev/null 2>&1; then
  if [ "$DRY" = 1 ]; then
    say "would install carried wheels from .whl into /tmp/gpu_check_site (--no-index)"
  else
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/gpu_check_site "$REPO"/.whl/*.whl && export PYTHONPATH="/tmp/gpu_check_site:$PYTHONPATH" \
      || say "installing carried wheels failed (continuing with the image's packages)"
  fi
fi

# ---- environment ----
{
  echo "date: $(date -u +%FT%TZ)"
  echo "python: $PY ($("$PY" -c 'import sys; print(sys.version.split()[0])'))"
  (nvidia-smi -L 2>/dev/null || echo "nvidia-smi: not available")
  "$PY" - <<'EOF'
import importlib, platform
import torch
print(f"torch {torch.__version__}, CUDA build {torch.version.cuda}, cuda available {torch.cuda.is_available()}")
if torch.cuda.is_available():
    print(f"device 0: {torch.cuda.get_device_name(0)}, capability {torch.cuda.get_device_capability(0)}")
print("cpu:", platform.processor() or platform.machine())
for name in ("pytest", "sympy", "networkx", "numpy", "matplotlib"):
    try:
        m = importlib.import_module(name)
        print(f"{name} {getattr(m, '__version__', '?')}")
    except Exception as e:
        print(f"{name}: MISSING ({type(e).__name__})")
try:
    from torchsync_pass import dynamo_hooks
    reason = dynamo_hooks._unsupported_reason()
    print("nosync hooks:", "supported on this torch" if reason is None else f"DISABLED: {reason}")
except Exception as e:
    print(f"nosync hooks: could not check ({type(e).__name__}: {e})")
EOF
} > "$OUTDIR/env.txt" 2>&1
cat "$OUTDIR/env.txt" >&2

HAS_CUDA=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
if grep -q "nosync hooks: DISABLED" "$OUTDIR/env.txt"; then
  say "NOTE: the nosync pass is disabled on this torch; 'nosync' columns below are stock Inductor"
fi
MISSING=$(grep -c "MISSING" "$OUTDIR/env.txt" || true)

if [ "$DRY" = 1 ]; then
  say "dry run: would run (cuda available: $HAS_CUDA, budget ${BUDGET}s):"
  say "  timeout $T_TESTS $PY -m pytest -m cuda -q tests  > $OUTDIR/pytest_cuda.log"
  say "  timeout $T_AB $PY benchmarks/ab.py --device cuda --repeats 5 --examples ${AB_EXAMPLES:-diffusion-tiny,decode,diffusion-large,prefill} --json $OUTDIR/ab_cuda.json --plot $OUTDIR/ab_cuda.png ${AB_ARGS:-}"
  exit 0
fi
if [ "$HAS_CUDA" != 1 ]; then
  say "no CUDA device visible to torch: skipping the GPU checks (nothing failed)"
  exit 0
fi

STATUS=0
# ---- 1. CUDA-only tests ----
if grep -q "pytest: MISSING" "$OUTDIR/env.txt"; then
  say "pytest missing: CUDA tests not run (carry a pytest wheel in .whl)"; STATUS=1
else
  say "CUDA tests: pytest -m cuda (limit ${T_TESTS}s)"
  timeout "$T_TESTS" "$PY" -m pytest -m cuda -q -p no:cacheprovider tests > "$OUTDIR/pytest_cuda.log" 2>&1
  rc=$?
  tail -n 5 "$OUTDIR/pytest_cuda.log" >&2
  if [ $rc -eq 0 ]; then say "CUDA tests: passed"; elif [ $rc -eq 124 ]; then say "CUDA tests: TIMED OUT"; STATUS=1
  else say "CUDA tests: FAILED (rc $rc, see pytest_cuda.log)"; STATUS=1; fi
fi

# ---- 2. A/B on CUDA, with the cudagraphs column ----
REMAIN=$(( BUDGET - ($(date +%s) - START) - 15 ))
[ "$REMAIN" -lt "$T_AB" ] && T_AB=$REMAIN
say "A/B on CUDA (limit ${T_AB}s)"
# shellcheck disable=SC2086
# most telling examples first: ab.py writes its JSON after each example, so a timeout keeps those
timeout "$T_AB" "$PY" benchmarks/ab.py --device cuda --repeats 5 \
  --examples "${AB_EXAMPLES:-diffusion-tiny,decode,diffusion-large,prefill}" \
  --json "$OUTDIR/ab_cuda.json" --plot "$OUTDIR/ab_cuda.png" ${AB_ARGS:-} \
  > "$OUTDIR/ab_cuda.md" 2> "$OUTDIR/ab_cuda.log"
rc=$?
cat "$OUTDIR/ab_cuda.md"
if [ $rc -eq 0 ]; then say "A/B: done"; elif [ $rc -eq 124 ]; then say "A/B: TIMED OUT (partial log in ab_cuda.log)"; STATUS=1
else say "A/B: FAILED (rc $rc, see ab_cuda.log)"; STATUS=1; fi

[ "$MISSING" != 0 ] && say "note: $MISSING optional package(s) missing, see env.txt"
say "finished, status $STATUS, outputs in $OUTDIR"
exit $STATUS

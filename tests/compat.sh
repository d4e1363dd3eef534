#!/usr/bin/env bash
# tests/compat.sh - torch x Python compatibility matrix for torchsync_pass.
#
#   bash tests/compat.sh                       # whole default matrix
#   bash tests/compat.sh 2.15.0:3.13 2.14.1:3.11   # only these combinations
#
# For every TORCH:PYTHON combination it
#   1. finds a CPython X.Y interpreter (pyenv install, then pythonX.Y on PATH),
#   2. builds $COMPAT_DIR/torch<T>-py<P> once (idempotent: a stamp file records
#      what was installed; delete the folder to rebuild),
#   3. installs this project into it (`pip install -e . --no-deps`, so the
#      setup.cfg entry points, e.g. torch_dynamo_backends/nosync, get registered),
#   4. smoke-checks torch (version + torch.compile(backend="eager")),
#   5. runs the hook self-test and the selected pytest tests,
# then prints a markdown results table (also written to $COMPAT_DIR/results.md).
# Exit status: 0 only if every combination had its interpreter, built, passed
# the self-test and its tests; 2 if an interpreter is missing; 1 otherwise.
#
# Environment knobs:
#   COMPAT_MATRIX        space-separated TORCH:PY list
#                        (default: torch 2.11.0, 2.12.1, 2.13.0, 2.14.1, 2.15.0 on Python 3.11,
#                        plus 3.12 on 2.11.0 and 2.15.0, and 3.13 on 2.15.0)
#   COMPAT_DIR           where venvs/logs live (default <repo>/.compat, git-ignored); share
#                        venvs between checkouts with e.g. COMPAT_DIR=/work/compat
#   COMPAT_PY<XY>        interpreter to use for Python X.Y, e.g. COMPAT_PY313=/usr/bin/python3.13
#   COMPAT_SELFTEST      python code of the self-test step (default: run
#                        torchsync_pass.dynamo_hooks.self_test(verbose=True) and fail
#                        unless every hook point in its returned dict is True)
#   COMPAT_PYTEST_ARGS   pytest arguments (shell words), default:
#                        -q tests -m "not inductor" -k "core or torture or hooks or serving or
#                        tables or wrong_results or soundness2 or invariant or rewrite or inop or
#                        counting or review"
#   COMPAT_NO_BUILD=1    do not build missing venvs (report them as "no venv")
#   COMPAT_ALLOW_NO_TESTS=1  a pytest run that collects no test is not a failure
#   COMPAT_TIMEOUT       seconds per self-test / pytest step (default 1800)
#
# torch pins: torch 2.13.0 has a local CPU wheel here; the others are CUDA builds (~5 GiB each
# installed) that run on the CPU.  /etc/xdg/pip/constraints.txt caps torch<=2.14.1 for this machine.
# Only the pip commands run here lift it, via PIP_CONSTRAINT=/dev/null (the env
# value replaces the config-file value; an empty PIP_CONSTRAINT does not).  The
# rest of pip.conf (find-links /opt/wheels, extra indexes) stays in force, so
# torch==2.13.0 resolves to the local 2.13.0+cpu wheel as in the Makefile.

set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
COMPAT_DIR=${COMPAT_DIR:-$ROOT/.compat}
LOGS=$COMPAT_DIR/logs
MATRIX=${COMPAT_MATRIX:-"2.11.0:3.11 2.11.0:3.12 2.12.1:3.11 2.13.0:3.11 2.14.1:3.11 2.15.0:3.11 2.15.0:3.12 2.15.0:3.13"}
[ $# -gt 0 ] && MATRIX="$*"
# self_test() returns {hook point: fired?} rather than raising, so judge its result: any
# False entry (or a False/raised result) fails the step.  Prints "SELFTEST <ok>/<total>".
DEFAULT_SELFTEST='
import sys
import torchsync_pass.dynamo_hooks as h
r = h.self_test(verbose=True)
if isinstance(r, dict):
    dead = [k for k, v in r.items() if not v]
    print("SELFTEST %d/%d dead=%s" % (len(r) - len(dead), len(r), dead))
    sys.exit(1 if dead or not r else 0)
sys.exit(0 if r is None or r is True else 1)
'
SELFTEST=${COMPAT_SELFTEST:-$DEFAULT_SELFTEST}
if [ -n "${COMPAT_PYTEST_ARGS:-}" ]; then
    eval "PYTEST_ARGS=(${COMPAT_PYTEST_ARGS})"
else
    PYTEST_ARGS=(-q tests -m "not inductor" -k "core or torture or hooks or serving or tables or wrong_results or soundness2 or invariant or rewrite or inop or counting or review")
fi
STEP_TIMEOUT=${COMPAT_TIMEOUT:-1800}
BASE_PKGS=(sympy networkx pytest numpy "setuptools>=61" wheel)

mkdir -p "$LOGS"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1

say() { printf '[compat] %s\n' "$*" >&2; }

# find_python X.Y -> prints the path of a working CPython X.Y, or nothing.
find_python() {
    local want=$1 var cand cands=()
    var="COMPAT_PY${want/./}"
    [ -n "${!var:-}" ] && cands+=("${!var}")
    local pyenv_root=${PYENV_ROOT:-$HOME/.pyenv}
    # newest pyenv patch release first (sort -V), skipping -dev/t (free-threaded) builds
    while IFS= read -r cand; do cands+=("$cand"); done < <(
        ls -d "$pyenv_root"/versions/"$want".[0-9]* 2>/dev/null | grep -E "/$want\.[0-9]+$" |
            sort -V -r | sed "s|\$|/bin/python$want|")
    for cand in "/usr/local/bin/python$want" "/usr/bin/python$want"; do cands+=("$cand"); done
    cand=$(command -v "python$want" 2>/dev/null) && cands+=("$cand")
    for cand in "${cands[@]}"; do
        [ -x "$cand" ] || continue
        # pyenv shims exist but fail when that version is not selected: run it to be sure
        if "$cand" -c "import sys, venv, ensurepip; sys.exit(0 if '%d.%d' % sys.version_info[:2] == '$want' else 1)" \
            >/dev/null 2>&1; then
            echo "$cand"
            return 0
        fi
    done
    return 1
}

# build_venv TORCH PY VENV INTERP LOG : create venv + install torch & base deps (idempotent)
build_venv() {
    local tv=$1 pv=$2 venv=$3 interp=$4 log=$5
    local stamp=$venv/.compat-stamp want="torch==$tv python$pv"
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$venv/bin/python" ]; then
        return 0
    fi
    if [ "${COMPAT_NO_BUILD:-0}" = 1 ]; then
        say "$venv missing and COMPAT_NO_BUILD=1"
        return 3
    fi
    local free_gb
    free_gb=$(df -Pk "$COMPAT_DIR" | awk 'NR==2 {print int($4/1048576)}')
    say "building $venv (torch==$tv, $interp; ${free_gb} GiB free; a CUDA torch needs ~6 GiB) - log: $log"
    [ "$free_gb" -lt 8 ] && say "WARNING: less than 8 GiB free on $COMPAT_DIR"
    local findlinks=()
    [ -d "$COMPAT_DIR/wheelhouse" ] && findlinks=(--find-links "$COMPAT_DIR/wheelhouse")
    (
        set -x
        "$interp" -m venv "$venv" &&
            PIP_CONSTRAINT=/dev/null "$venv/bin/python" -m pip install "${findlinks[@]}" \
                "torch==$tv" "${BASE_PKGS[@]}" &&
            "$venv/bin/python" -c "import torch, sympy, networkx, pytest, numpy; print(torch.__version__)"
    ) >>"$log" 2>&1 || return 1
    echo "$want" >"$stamp"
}

results=()   # rows of the markdown table
overall=0
any_missing_py=0

for combo in $MATRIX; do
    tv=${combo%%:*}
    pv=${combo##*:}
    name="torch${tv}-py${pv}"
    venv=$COMPAT_DIR/$name
    t0=$(date +%s)
    actual_torch="-" smoke="-" selftest="-" passed="-" failed="-" note=""
    say "=== $name"

    if ! interp=$(find_python "$pv"); then
        say "ERROR: no CPython $pv interpreter found (tried COMPAT_PY${pv/./}, pyenv versions, python$pv on PATH)."
        say "       Install one (e.g. 'pyenv install $pv') or set COMPAT_PY${pv/./}=/path/to/python$pv."
        results+=("| $tv | $pv | - | - | - | - | - | 0s | no Python $pv interpreter |")
        overall=1
        any_missing_py=1
        continue
    fi

    build_venv "$tv" "$pv" "$venv" "$interp" "$LOGS/$name-build.log"
    rc=$?
    if [ $rc -ne 0 ]; then
        if [ $rc -eq 3 ]; then note="no venv (COMPAT_NO_BUILD=1)"; else note="venv build failed, see $LOGS/$name-build.log"; fi
        say "$note"
        results+=("| $tv | $pv | - | - | - | - | - | $(($(date +%s) - t0))s | $note |")
        overall=1
        continue
    fi
    py=$venv/bin/python

    # Project install (cheap; redone every run so entry points follow setup.cfg edits).
    if ! (cd "$ROOT" && "$py" -m pip install -q --no-deps --no-build-isolation -e "$ROOT") \
        >"$LOGS/$name-install.log" 2>&1; then
        note="project install failed, see $LOGS/$name-install.log"
        say "$note"
        results+=("| $tv | $pv | - | - | - | - | - | $(($(date +%s) - t0))s | $note |")
        overall=1
        continue
    fi

    # Smoke: torch version, entry point registered, trivial torch.compile(backend="eager").
    smoke_out=$(cd "$ROOT" && timeout 600 "$py" - 2>&1 <<'EOF'
import sys, importlib.metadata as md, torch
eps = [e.name for e in md.entry_points(group="torch_dynamo_backends")]
def f(x):
    return (x * 2).sin() + 1
x = torch.randn(8)
torch._dynamo.reset()
ok = torch.allclose(torch.compile(f, backend="eager", fullgraph=True)(x), f(x))
print("TORCH", torch.__version__, "PY", "%d.%d.%d" % sys.version_info[:3],
      "EAGER", "ok" if ok else "MISMATCH", "EP", ",".join(eps) or "none")
EOF
    )
    echo "$smoke_out" >"$LOGS/$name-smoke.log"
    line=$(grep '^TORCH ' <<<"$smoke_out" | tail -1)
    if [ -n "$line" ]; then
        read -r _ actual_torch _ actual_py _ eager _ eps <<<"$line"
        smoke="eager $eager"
        [ "$eager" = ok ] || overall=1
        case ",$eps," in *,nosync,*) ;; *) note="${note}entry point nosync not registered; " ; overall=1 ;; esac
    else
        smoke="FAIL"
        note="${note}smoke failed, see $LOGS/$name-smoke.log; "
        overall=1
    fi

    # Hook self-test.
    (cd "$ROOT" && timeout "$STEP_TIMEOUT" "$py" -c "$SELFTEST") >"$LOGS/$name-selftest.log" 2>&1
    rc=$?
    st_count=$(grep -oE '^SELFTEST [0-9]+/[0-9]+' "$LOGS/$name-selftest.log" | tail -1 | cut -d' ' -f2)
    if [ $rc -eq 0 ]; then
        selftest="PASS${st_count:+ ($st_count)}"
    else
        overall=1
        if grep -q "No module named 'torchsync_pass.dynamo_hooks'" "$LOGS/$name-selftest.log"; then
            selftest="FAIL (module missing)"
        elif [ $rc -eq 124 ]; then
            selftest="FAIL (timeout)"
        elif [ -n "$st_count" ]; then
            selftest="FAIL ($st_count hooks fired)"
        else
            selftest="FAIL (rc=$rc)"
        fi
        note="${note}self-test log: $LOGS/$name-selftest.log; "
    fi

    # Tests.
    (cd "$ROOT" && timeout "$STEP_TIMEOUT" "$py" -m pytest -p no:cacheprovider "${PYTEST_ARGS[@]}") \
        >"$LOGS/$name-pytest.log" 2>&1
    rc=$?
    summary=$(grep -E '(passed|failed|error|skipped|deselected|no tests ran)' "$LOGS/$name-pytest.log" |
        grep -E ' in [0-9.]+s' | tail -1)
    count() { grep -oE "[0-9]+ $1" <<<"$summary" | head -1 | cut -d' ' -f1; }
    passed=$(count passed); passed=${passed:-0}
    failed=$(count failed); failed=${failed:-0}
    errors=$(count 'errors?'); errors=${errors:-0}
    skipped=$(count skipped); skipped=${skipped:-0}
    [ "$errors" != 0 ] && failed="$failed (+$errors errors)"
    [ "$skipped" != 0 ] && passed="$passed (+$skipped skipped)"
    case $rc in
        0) ;;
        5) if [ "${COMPAT_ALLOW_NO_TESTS:-0}" = 1 ]; then note="${note}no tests selected; "
           else note="${note}pytest collected no tests; "; overall=1; fi ;;
        124) note="${note}pytest timeout; "; overall=1 ;;
        *) note="${note}pytest rc=$rc, log: $LOGS/$name-pytest.log; "; overall=1 ;;
    esac

    dur=$(($(date +%s) - t0))
    results+=("| $tv | $pv | $actual_torch | $smoke | $selftest | $passed | $failed | ${dur}s | ${note%; } |")
done

{
    echo
    echo "## torchsync_pass compatibility ($(date -u '+%Y-%m-%d %H:%M UTC'))"
    echo
    echo "pytest: \`python -m pytest $(printf '%q ' "${PYTEST_ARGS[@]}")\`"
    echo
    echo "| torch | python | installed torch | smoke | self-test | tests passed | tests failed | duration | notes |"
    echo "|---|---|---|---|---|---|---|---|---|"
    printf '%s\n' "${results[@]}"
} | tee "$COMPAT_DIR/results.md"

if [ $any_missing_py -eq 1 ]; then
    exit 2
fi
exit $overall

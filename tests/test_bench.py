"""benchmarks/ab.py: argument parsing, formatting, the target checks, and a tiny smoke run.

No timing is asserted anywhere: the smoke run checks structure and behaviour (syncs, graphs,
bitwise equality), which do not depend on how loaded the machine is."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load_ab():
    spec = importlib.util.spec_from_file_location("benchmarks_ab", os.path.join(ROOT, "benchmarks", "ab.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


ab = _load_ab()


def result(example, variant, median, **kw):
    """A Result with a median and p10/p90 around it (numbers are test inputs, not measurements)."""
    return ab.Result(example, variant, steps=4, repeats=3, median_us=median, p10_us=median * 0.9,
                     p90_us=median * 1.1, **kw)


# --------------------------------------------------------------------------------------------
# parsing


def test_defaults_select_every_example_and_variant():
    args = ab.parse_args(["--device", "cpu"])
    on_request = ("diffusion-xl", "prefill-long", "prefill-wide")  # GPU-sized; extra prefill sizes
    assert args.examples == [n for n in ab.EXAMPLES if n not in on_request]
    assert args.variants == list(ab.VARIANTS)
    assert not args.quick and args.json is None and args.plot is None


def test_examples_and_variants_are_comma_separated_lists():
    args = ab.parse_args(["--device", "cpu", "--examples", "decode, prefill", "--variants", "eager,nosync-eager"])
    assert args.examples == ["decode", "prefill"]
    assert args.variants == ["eager", "nosync-eager"]


@pytest.mark.parametrize("argv", [["--examples", "nope"], ["--variants", "eager,fast"], ["--examples", ","],
                                  ["--guard-sites", "0,4"], ["--guard-sites", "a"]])
def test_bad_arguments_exit_with_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as e:
        ab.parse_args(["--device", "cpu", *argv])
    assert e.value.code == 2
    assert "error" in capsys.readouterr().err


def test_guard_sites_are_sorted_and_unique():
    assert ab.parse_args(["--device", "cpu", "--guard-sites", "32,1,32"]).guard_sites == (1, 32)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_cuda_device_refused_without_cuda(capsys):
    with pytest.raises(SystemExit):
        ab.parse_args(["--device", "cuda"])
    assert "CUDA is not available" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# statistics and formatting


def test_p10_p90_interpolate_between_samples():
    assert ab.p10_p90([4.0, 1.0, 3.0, 2.0, 5.0]) == pytest.approx((1.4, 4.6))
    assert ab.p10_p90([2.0]) == (2.0, 2.0)


def test_bitwise_equal_checks_dtype_shape_and_stride():
    a = torch.arange(6.0).reshape(2, 3)
    assert ab.bitwise_equal(a, a.clone())
    assert not ab.bitwise_equal(a, a.double())
    assert not ab.bitwise_equal(a, a.reshape(3, 2))
    assert not ab.bitwise_equal(a, a.t().contiguous().t())  # same values, other strides
    assert not ab.bitwise_equal(a, a + 1e-7)
    assert ab.max_abs_diff(a, a + 0.5) == pytest.approx(0.5)


def test_table_has_one_row_per_result_ratios_and_skips():
    results = [
        result("diffusion-tiny", "eager", 300.0, syncs_per_step=5.0, syncs_per_request=250, bitwise_eager=True),
        result("diffusion-tiny", "inductor", 200.0, graphs=5, graph_breaks=4, recompiles=0, bitwise_eager=False),
        result("diffusion-tiny", "hoisted-inductor", 50.0, graphs=1, graph_breaks=0),
        result("diffusion-tiny", "nosync", 55.0, syncs_per_step=0.0, graphs=1, graph_breaks=0, bitwise_hoisted=True),
        ab.Result("diffusion-tiny", "cudagraphs", error="cudagraphs needs CUDA"),
    ]
    rows = ab.table_rows(results)
    assert rows[3]["vs_inductor"] == pytest.approx(55.0 / 200.0)
    assert rows[3]["vs_hoisted"] == pytest.approx(55.0 / 50.0)
    text = ab.format_table(rows)
    lines = text.splitlines()
    assert len(lines) == 2 + len(results)
    assert lines[0].startswith("| example | variant | us/step |")
    assert all(line.count("|") == lines[0].count("|") for line in lines[2:])
    assert "| diffusion-tiny | nosync | 55.0 |" in text
    assert "| 0.28 | 1.10 |" in text  # x inductor, x hoisted
    assert "skipped: cudagraphs needs CUDA" in lines[-1]
    assert "| NO |" in lines[3]  # inductor not bitwise equal to eager is shown, not hidden
    assert "streamSync/step" in ab.format_table(rows, with_cuda=True).splitlines()[0]


def test_acceptance_checks_follow_the_issue_targets():
    ok = [
        result("diffusion-tiny", "inductor", 200.0),
        result("diffusion-tiny", "hoisted-inductor", 50.0),
        result("diffusion-tiny", "nosync", 45.0, syncs_per_step=0.0),
        result("diffusion-large", "nosync", 1000.0),
        result("diffusion-large", "nosync-nocache", 990.0),
        result("decode", "nosync", 80.0, syncs_per_step=1.0),
        result("prefill", "eager", 80.0, syncs_per_step=8.0),
        result("prefill", "nosync", 60.0, syncs_per_step=0.0),  # every read rewritten
    ]
    guard = {"per_site_us": 1.0, "sites_hoisted": True}
    checks = ab.acceptance(ok, guard)
    assert len(checks) == 8  # issue 14: nosync < 1.0x hand-hoisted, and within noise of no caching
    assert all(c["ok"] for c in checks), checks
    slow = [result("diffusion-tiny", "inductor", 200.0), result("diffusion-tiny", "hoisted-inductor", 50.0),
            result("diffusion-tiny", "nosync", 150.0, syncs_per_step=2.0),
            result("diffusion-large", "nosync", 1100.0), result("diffusion-large", "nosync-nocache", 1000.0),
            result("prefill", "nosync", 80.0, syncs_per_step=8.0)]
    bad = {c["check"]: c["ok"] for c in ab.acceptance(slow, {"per_site_us": 9.0, "sites_hoisted": True})}
    assert not any(bad.values()), bad
    unhoisted = ab.acceptance([], {"per_site_us": 1.0, "sites_hoisted": False})
    assert [c["ok"] for c in unhoisted] == [False]


def test_report_names_the_machine_and_the_targets():
    payload = {
        "machine": ab.machine_info(torch.device("cpu")),
        "config": {"quick": True},
        "results": ab.table_rows([result("decode", "eager", 10.0)]),
        "guard_overhead": {"rows": [{"sites": 1, "nosync_us": 3.0, "hoisted_us": 2.0, "nosync_graphs": 1,
                                     "nosync_breaks": 0}], "per_site_us": 1.0, "per_call_us": None,
                           "avg_per_site_us": 1.0, "calls": 10, "repeats": 3, "note": ""},
        "acceptance": [{"check": "something", "value": 1.0, "ok": True}],
    }
    text = ab.format_report(payload)
    assert payload["machine"]["torch"] in text
    assert f"torch threads {torch.get_num_threads()}" in text
    assert payload["machine"]["cpu"] in text
    assert "| decode | eager | 10.0 |" in text
    assert "Guard overhead per hoisted site" in text
    assert "- [x] something: measured 1.00" in text


def test_plot_without_matplotlib_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    out = tmp_path / "chart.png"
    assert ab.write_plot({"results": [], "machine": {}}, str(out)) is False
    assert "matplotlib is not installed" in capsys.readouterr().err
    assert not out.exists()


def test_plot_with_matplotlib_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    payload = {"machine": ab.machine_info(torch.device("cpu")),
               "results": ab.table_rows([result("decode", "eager", 10.0), result("decode", "nosync", 5.0)])}
    out = tmp_path / "chart.png"
    assert ab.write_plot(payload, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------------------------
# smoke runs (eager and nosync with eager codegen only: no Inductor compile)


def test_smoke_run_writes_table_and_json(tmp_path, capsys):
    path = tmp_path / "ab.json"
    variants = "eager,nosync-eager"
    rc = ab.main(["--quick", "--device", "cpu", "--examples", "diffusion-tiny,prefill", "--variants", variants,
                  "--guard-sites", "1,2", "--json", str(path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "| diffusion-tiny | eager |" in out and "| prefill | nosync-eager |" in out
    payload = json.loads(path.read_text())
    assert set(payload) >= {"machine", "config", "results", "guard_overhead", "acceptance"}
    assert payload["machine"]["torch"] == torch.__version__
    rows = {(r["example"], r["variant"]): r for r in payload["results"]}
    assert set(rows) == {(e, v) for e in ("diffusion-tiny", "prefill") for v in variants.split(",")}
    for r in rows.values():
        assert r["error"] is None, r
        assert r["median_us"] > 0 and r["p10_us"] <= r["median_us"] <= r["p90_us"]
        assert r["bitwise_eager"] is True  # eager codegen is the bitwise path
    eager = rows[("diffusion-tiny", "eager")]
    assert eager["graphs"] is None and eager["syncs_per_step"] > 0
    chunk = ab.importlib.import_module("prefill_tokens").SIZES["tiny"][2]
    assert rows[("prefill", "eager")]["syncs_per_step"] == chunk
    assert [g["sites"] for g in payload["guard_overhead"]["rows"]] == [1, 2]
    nos = rows[("diffusion-tiny", "nosync-eager")]
    assert (nos["graphs"], nos["graph_breaks"], nos["recompiles"]) == (1, 0, 0)
    assert nos["syncs_per_step"] == 0
    assert rows[("prefill", "nosync-eager")]["syncs_per_step"] == 0  # each read rewritten into a gather


def test_cli_runs_as_a_subprocess():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "ab.py"), "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--quick" in proc.stdout and "--json" in proc.stdout and "--plot" in proc.stdout


def test_gpu_check_dry_run_and_cpu_skip(tmp_path):
    script = os.path.join(ROOT, "benchmarks", "gpu_check.sh")
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    proc = subprocess.run(["bash", script, "--dry-run"], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "pytest -m cuda" in proc.stderr and "benchmarks/ab.py --device cuda" in proc.stderr
    env_txt = (tmp_path / "env.txt").read_text()
    assert f"torch {torch.__version__}" in env_txt and "nosync hooks:" in env_txt
    if not torch.cuda.is_available():
        proc = subprocess.run(["bash", script], capture_output=True, text=True, env=env, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert "no CUDA device" in (tmp_path / "summary.txt").read_text()
    bad = subprocess.run(["bash", script, "--bogus"], capture_output=True, text=True, env=env, timeout=60)
    assert bad.returncode == 2


@pytest.mark.cuda
def test_smoke_run_on_cuda_with_cudagraphs_column(tmp_path):
    path = tmp_path / "ab.json"
    rc = ab.main(["--quick", "--device", "cuda", "--examples", "diffusion-tiny", "--variants",
                  "eager,nosync-eager,cudagraphs", "--no-guard", "--json", str(path)])
    assert rc == 0
    rows = {r["variant"]: r for r in json.loads(path.read_text())["results"]}
    assert rows["eager"]["stream_syncs_per_step"] is not None
    assert rows["nosync-eager"]["bitwise_eager"] is True
    assert "cudagraphs" in rows


@pytest.mark.inductor
def test_verify_flag_runs_verify_loop_on_the_diffusion_example(tmp_path):
    path = tmp_path / "ab.json"
    rc = ab.main(["--quick", "--device", "cpu", "--examples", "diffusion-tiny", "--variants",
                  "eager,nosync-eager", "--no-guard", "--verify", "--json", str(path)])
    assert rc == 0
    report = json.loads(path.read_text())["verify_loop"]["diffusion-tiny"]
    assert report["ok"] is True
    modes = {m["name"]: m for m in report["modes"]}
    assert {"nosync-eager", "nosync-inductor", "inductor"} <= set(modes)
    assert all(m["first_divergence"] is None for name, m in modes.items() if name.startswith("nosync"))


@pytest.mark.parametrize("variants", ["hoisted,fast", "split,nosync", ""])
def test_step_overhead_refuses_unknown_variants_and_a_missing_reference(variants, capsys):
    """benchmarks/step_overhead.py (timed on Inductor only, never in tests): usage errors."""
    spec = importlib.util.spec_from_file_location("benchmarks_step_overhead",
                                                  os.path.join(ROOT, "benchmarks", "step_overhead.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with pytest.raises(SystemExit) as e:
        mod.main(["--variants", variants])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert ("unknown variant" in err and "fast" in err) if "fast" in variants else "must include hoisted" in err

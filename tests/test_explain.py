"""The explain CLI: text and JSON on a script with known sites, exit codes, a real subprocess."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from torchsync_pass import explain

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
DEMO = os.path.join(TESTS, "scripts", "syncs_demo.py")
EXAMPLE = os.path.join(ROOT, "examples", "diffusion_loop.py")


def marked_lines(path: str, marker: str) -> dict[int, str]:
    """{line: text} of the lines of ``path`` that carry ``marker`` (the known sync sites)."""
    with open(path) as f:
        return {i: t for i, t in enumerate(f, 1) if marker in t}


def demo_line(tag: str) -> int:
    (line,) = [n for n, t in marked_lines(DEMO, "# SITE").items() if t.rstrip().endswith(tag)]
    return line


def run_json(capsys, *argv: str) -> tuple[int, dict]:
    rc = explain.main(["--json", *argv])
    out = capsys.readouterr().out
    return rc, json.loads(out)


def site(rep: dict, line: int) -> dict:
    (s,) = [s for s in rep["sites"] if s["line"] == line]
    return s


def test_json_on_known_sites(capsys):
    rc, rep = run_json(capsys, DEMO, "--steps", "4")
    assert rc == 0
    assert rep["totals"]["syncs"] == 9  # 4 x item, 4 x bool, 1 x tolist
    s_item, s_bool, s_list = site(rep, demo_line("item")), site(rep, demo_line("bool")), site(
        rep, demo_line("tolist")
    )
    assert (s_item["kind"], s_item["count"], s_item["file"]) == ("item", 4, DEMO)
    assert (s_bool["kind"], s_bool["count"]) == ("bool", 4)
    assert (s_list["kind"], s_list["count"]) == ("tolist", 1)
    assert s_item["source"] == "scale = flags.sum().item()  # SITE item"
    assert s_item["distinct_values"] == 1 and s_item["hoisting_candidate"]
    assert s_item["calls"] == 4
    assert rep["compiled"] == [] and rep["nosync"] == []
    assert rep["sites"][0]["count"] >= rep["sites"][-1]["count"]  # sorted by count


def test_json_on_compiled_function(capsys):
    rc, rep = run_json(capsys, DEMO, "--steps", "3", "--compile")
    assert rc == 0
    assert rep["totals"]["syncs"] == 7
    (cf,) = rep["compiled"]
    assert cf["function"] == "step" and cf["file"] == DEMO
    assert cf["graphs"] == 3 and cf["recompiles"] == []
    breaks = {(b["line"], b["sync"]) for b in cf["graph_breaks"]}
    assert breaks == {(demo_line("item"), True), (demo_line("bool"), True)}
    assert cf["sync_graph_breaks"] == 2


def test_text_report(capsys):
    rc = explain.main([DEMO, "--steps", "2", "--compile"])
    out = capsys.readouterr().out
    assert rc == 0
    assert out.index("done [2, 3]") < out.index("Sync sites")  # script output first
    rel = os.path.relpath(DEMO)
    assert re.search(rf"\s2 item\s+2\s+1\s+{re.escape(rel)}:{demo_line('item')}\n", out), out
    assert "hoisting candidate: one value (3.0)" in out
    assert "Graph Count: 3" in out and "Graph Break Count: 2 (2 from syncs)" in out
    assert f"[sync] {rel}:{demo_line('bool')}: Data-dependent branching" in out


def test_script_error_still_reports(capsys):
    rc = explain.main([DEMO, "--steps", "1", "--fail"])
    cap = capsys.readouterr()
    assert rc == 1
    assert "Sync sites" in cap.out
    assert "ValueError: requested failure" in cap.err
    assert "torchsync_pass/explain.py" not in cap.err  # the traceback starts in user code


def test_script_exit_code_kept(tmp_path, capsys):
    script = tmp_path / "exits.py"
    script.write_text("import sys\nsys.exit(3)\n")
    assert explain.main([str(script)]) == 3


def test_missing_file(capsys):
    rc = explain.main(["/nonexistent/nope.py"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1 and "can't open file '/nonexistent/nope.py'" in err


def test_syntax_error(tmp_path, capsys):
    script = tmp_path / "broken.py"
    script.write_text("x = 1\nif x\n")
    rc = explain.main([str(script)])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1 and f"{script}:2" in err and "SyntaxError" in err


def test_max_syncs_gate(capsys):
    assert explain.main(["--max-syncs", "9", DEMO, "--steps", "4"]) == 0
    capsys.readouterr()
    assert explain.main(["--max-syncs", "8", DEMO, "--steps", "4"]) == 1
    assert "9 host syncs > --max-syncs 8" in capsys.readouterr().err


def test_script_sees_its_own_argv_and_folder(tmp_path, capsys):
    (tmp_path / "helper_mod_for_explain.py").write_text("VALUE = 7\n")
    script = tmp_path / "argv.py"
    script.write_text(
        "import sys, helper_mod_for_explain as h\n"
        "assert __name__ == '__main__'\n"
        "print('ARGV', sys.argv[1:], h.VALUE)\n"
    )
    argv_before = sys.argv[:]
    assert explain.main([str(script), "a", "--json"]) == 0
    assert "ARGV ['a', '--json'] 7" in capsys.readouterr().out
    assert sys.argv == argv_before


def test_bundled_example_names_each_sync_site(capsys):
    rc, rep = run_json(capsys, EXAMPLE, "--backend", "eager", "--steps", "2", "--requests", "1")
    assert rc == 0
    expected = marked_lines(EXAMPLE, "# sync:")
    assert len(expected) == 5
    by_line = {s["line"]: s for s in rep["sites"] if s["file"] == EXAMPLE}
    for line, text in expected.items():
        assert line in by_line, f"missing {EXAMPLE}:{line}: {text.strip()}"
        assert by_line[line]["count"] == 2
        assert by_line[line]["source"] == text.strip()


def test_real_subprocess():
    proc = subprocess.run(
        [sys.executable, "-m", "torchsync_pass.explain", "--json", "--max-syncs", "100",
         DEMO, "--steps", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout)
    assert rep["totals"]["syncs"] == 5
    assert "done [2, 3]" in proc.stderr  # in --json mode the script's stdout goes to stderr
    assert "USDT" not in proc.stderr  # the profiler's start/stop chatter is kept out

"""Review 16 (2026-12-07): each test failing on the commit before its fix."""

from __future__ import annotations

import json
import textwrap

import torch

import torchsync_pass
from torchsync_pass import explain


def test_explain_keeps_what_the_script_compiled_across_its_own_reset(tmp_path, capsys):
    """A script that reloads its model (``torch._dynamo.reset(); torchsync_pass.reset()``, what the
    README recommends) after nosync hoisted: explain still lists the decision and the graph, and
    does not claim the backend did not run (it read the log that ``reset()`` empties)."""
    script = tmp_path / "reload.py"
    script.write_text(textwrap.dedent("""
        import torch, torchsync_pass
        def step(x, t):
            if (t == 1).any():
                return x * 2
            return x
        c = torch.compile(step, backend="nosync", options={"codegen": "eager"})
        t = torch.tensor([0, 1])
        for _ in range(3):
            c(torch.ones(2), t)
        torch._dynamo.reset(); torchsync_pass.reset()
    """))
    torch._dynamo.reset()
    torchsync_pass.reset()
    assert explain.main(["--json", "--progress", "0", str(script)]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert [(d["action"], d["site"]["line"]) for d in rep["nosync"]] == [("hoisted", 4)]
    assert rep["nosync_graphs"] == 1
    assert "did not run" not in explain.render_text(rep)
    # and the verification list of --verify, from the same record
    torch._dynamo.reset()
    torchsync_pass.reset()
    assert explain.main(["--json", "--progress", "0", "--verify", str(script)]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert [v["status"] for v in rep["verification"]] == ["PASSED"]

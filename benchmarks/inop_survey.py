"""Which ops sync inside, and what nosync does about each (the README's "Syncs inside ops" table).

For every op: ``aten::_local_scalar_dense`` per eager call (torch profiler) and ``count_syncs()``
per eager call; then the op inside a step that reads request-invariant tables at a Python int step
counter (``self.table[self._step_index]``), compiled with nosync (``codegen="eager"``): syncs per
steady call (``count_syncs()``, median of the last calls of a request already tabulated), graphs
per call, and nosync's decision. Every nosync output is compared bitwise with eager.

    python benchmarks/inop_survey.py [--out benchmarks/results/inop_survey.md]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from typing import Any, Callable

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])
import torchsync_pass  # noqa: E402
from torchsync_pass import NosyncBackend  # noqa: E402

N = 8


def spd(i_table: torch.Tensor) -> torch.Tensor:
    """A 3x3 symmetric positive definite matrix built from one table row (pure ops)."""
    v = torch.stack([i_table, i_table * 0.5, i_table * 0.25])
    return torch.eye(3) * 4.0 + torch.outer(v, v)


class Step:
    def __init__(self, table: torch.Tensor) -> None:
        self.table = table
        self._step_index = 0


def _cases() -> dict[str, Callable[[torch.Tensor], Any]]:
    b = torch.tensor([1.0, 2.0, 3.0])
    return {
        "torch.linalg.solve": lambda A: torch.linalg.solve(A, b),
        "torch.linalg.solve_ex": lambda A: torch.linalg.solve_ex(A, b)[0],
        "torch.linalg.inv": lambda A: torch.linalg.inv(A),
        "torch.linalg.inv_ex": lambda A: torch.linalg.inv_ex(A)[0],
        "torch.linalg.cholesky": lambda A: torch.linalg.cholesky(A),
        "torch.linalg.cholesky_ex": lambda A: torch.linalg.cholesky_ex(A)[0],
        "torch.cholesky_solve": lambda A: torch.cholesky_solve(b[:, None], torch.linalg.cholesky_ex(A)[0]),
        "torch.linalg.lu_factor": lambda A: torch.linalg.lu_factor(A)[0],
        "torch.linalg.lu_factor_ex": lambda A: torch.linalg.lu_factor_ex(A)[0],
        "torch.linalg.lstsq": lambda A: torch.linalg.lstsq(A, b[:, None]).solution,
        "torch.linalg.eigh": lambda A: torch.linalg.eigh(A)[0],
        "torch.linalg.svd": lambda A: torch.linalg.svd(A)[1],
        "torch.linalg.pinv": lambda A: torch.linalg.pinv(A),
        "torch.linalg.det": lambda A: torch.linalg.det(A),
        "torch.linalg.qr": lambda A: torch.linalg.qr(A)[0],
        "torch.linalg.solve_triangular": lambda A: torch.linalg.solve_triangular(torch.triu(A), b[:, None], upper=True),
        "torch.nonzero": lambda A: torch.nonzero(A > 4.5),
        "torch.masked_select": lambda A: torch.masked_select(A, A > 4.5),
        "boolean-mask index A[A > 4.5]": lambda A: A[A > 4.5],
        "torch.repeat_interleave (no output_size)": lambda A: torch.repeat_interleave(A[0], torch.tensor([1, 2, 0])),
        "torch.repeat_interleave (output_size=3)": lambda A: torch.repeat_interleave(A[0], torch.tensor([1, 2, 0]), output_size=3),
        "torch.unique": lambda A: torch.unique(A.round()),
    }


def _profile_syncs(fn: Callable, A: torch.Tensor) -> int:
    with profile(activities=[ProfilerActivity.CPU]) as p:
        fn(A)
    return sum(1 for e in p.events() if e.name == "aten::_local_scalar_dense")


def _bitwise(a: Any, b: Any) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride() and torch.equal(a, b)


def survey_one(name: str, op: Callable) -> dict:
    table = torch.linspace(0.5, 2.0, N + 1)
    A = spd(table[0])
    row = {"op": name, "profiler_syncs_per_call": _profile_syncs(op, A)}
    with torchsync_pass.count_syncs() as c:
        op(A)
    row["count_syncs_per_call"] = c.total

    def step(s: Step, x: torch.Tensor) -> Any:
        out = op(spd(s.table[s._step_index]))  # the step uses the op's result (does not return it)
        s._step_index += 1
        return x + out.sum()

    torch._dynamo.reset()
    torchsync_pass.reset()
    graphs = {"n": 0}
    be = NosyncBackend({"codegen": "eager"})

    def counting(gm: Any, ex: Any, **kw: Any) -> Any:
        fn = be(gm, ex, **kw)

        def run(*args: Any) -> Any:
            graphs["n"] += 1
            return fn(*args)

        return run

    f = torch.compile(step, backend=counting)
    ok = repeatable = True
    per_call: list[int] = []
    for r in range(2):  # request 0 compiles; request 1 is measured
        tab = torch.linspace(0.5 + 0.1 * r, 2.0, N + 1)
        s, e, e2 = Step(tab.clone()), Step(tab.clone()), Step(tab.clone())
        per_call, g0, ok = [], graphs["n"], True
        for _ in range(N):
            x = torch.full((2,), 0.5)
            with torchsync_pass.count_syncs() as c:
                got = f(s, x)
            per_call.append(c.total)
            ref = step(e, x)
            ok = ok and _bitwise(got, ref)
            repeatable = repeatable and _bitwise(step(e2, x), ref)
    decisions = [d for d in torchsync_pass.decisions() if d.kind == "in_op"]
    row.update(
        nosync_syncs_per_call=per_call,
        nosync_steady=statistics.median(per_call[3:]),
        graphs_per_call=(graphs["n"] - g0) / N,
        bitwise=ok,
        eager_repeatable=repeatable,
        decision=(f"{decisions[-1].action.value} ({decisions[-1].reason.name})" if decisions else "-"),
    )
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/results/inop_survey.md")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = [survey_one(name, op) for name, op in _cases().items()]
    machine = (f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch thread, "
               f"torch {torch.__version__}, Python {platform.python_version()}")
    lines = [
        f"Syncs inside ops ({machine}); nosync: `codegen=\"eager\"`, the op on a matrix built from "
        f"`self.table[self._step_index]` whose result the step uses (`x + op(A).sum()`), request 1 of 2 ({N} calls), steady = median of calls 4-{N}.",
        "",
        "| op | `_local_scalar_dense` per eager call | count_syncs per eager call | nosync syncs per call (request 1) | steady | graphs/call | bitwise | nosync decision |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['op']} | {r['profiler_syncs_per_call']} | {r['count_syncs_per_call']} | "
            f"{r['nosync_syncs_per_call']} | {r['nosync_steady']:g} | {r['graphs_per_call']:g} | "
            f"{'yes' if r['bitwise'] else 'NO'}{'' if r['eager_repeatable'] else ' (eager itself differs between two runs)'} | "
            f"{r['decision']} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    with open(args.out, "w") as fh:
        fh.write(text)
    with open(args.out.rsplit(".", 1)[0] + ".json", "w") as fh:
        json.dump({"machine": machine, "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

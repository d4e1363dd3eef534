"""Where nosync's per-step time goes on the tiny diffusion step under Inductor (issue 14).

Every variant is called with the *same* arguments in a tight loop: no new request, so no
per-request work (cone re-runs, invariant misses) at all; what remains is the fixed cost of each
call. Each variant is its own compiled model (private code objects, as in ``ab.py``), timed in
blocks of calls that rotate between the variants in one process; medians over the blocks.

    hoisted          stock Inductor on the hand-hoisted step (the invariant answers as Python constants)
    split            stock Inductor on the hand-split step (also the invariant tensors passed in)
    nosync           nosync (Inductor), invariant caching on (64 MiB): the split, found automatically
    nosync-nocache   nosync (Inductor) without caching: the default under Inductor

and, for the measurement only, variants that break nosync's guarantee (a value is never checked):

    nosync/free-guard          nosync whose guard answers True without reading anything
    nosync/free-guard+runner   ... and whose runner hands the step the last values without checking
    nocache/free-guard         nosync-nocache whose guard answers True without reading anything

    python benchmarks/step_overhead.py [--blocks 200] [--calls 100] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
for _p in (ROOT, ROOT / "examples", ROOT / "benchmarks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import diffusion_loop as dl  # noqa: E402
from ab import DIFFUSION_INVARIANT, isolate, machine_info  # noqa: E402

from torchsync_pass import dynamo_hooks, invariant  # noqa: E402

VARIANTS = ("hoisted", "split", "nosync", "nosync-nocache", "nosync/free-guard", "nosync/free-guard+runner",
            "nocache/free-guard")


@contextlib.contextmanager
def _runner_box(box: list):
    """While compiling: make the invariant runner's call hand the step ``box[0]`` (the values) once
    it is set, without checking anything (measurement only)."""
    real = invariant._fast_call_fn

    def make(runner, step):
        call = real(runner, step)
        box.append(runner)

        def free(*args):
            values = box[0]
            if values is None:
                return call(*args)
            return step(*args, *values)

        return free

    invariant._fast_call_fn = make
    try:
        yield
    finally:
        invariant._fast_call_fn = real


def _free_guards(groups: list) -> None:
    """Make each guard group answer True at once, leaving its token (measurement only)."""
    for g in groups:
        def run(L, G, ran=g.ran):
            ran.ok = True
            return True
        g.run = run


def build(variant: str, request: dict, args: tuple):
    """A warm compiled step for ``variant``."""
    if variant in ("hoisted", "split"):
        model = isolate(dl.make_hoisted_model("tiny") if variant == "hoisted" else dl.make_split_model("tiny"))
        model.set_request(request)
        step = torch.compile(model, backend="inductor")
        for _ in range(3):
            step(*args)
        return step
    cache = not variant.startswith(("nosync-nocache", "nocache"))
    options = {"codegen": "inductor", "invariant": list(DIFFUSION_INVARIANT),
               "invariant_cache_bytes": (64 << 20) if cache else 0}
    step = torch.compile(isolate(dl.make_model("tiny")), backend="nosync", options=options)
    before = set(dynamo_hooks._GROUPS)
    box: list = [None]
    with _runner_box(box) if variant.endswith("+runner") else contextlib.nullcontext():
        for _ in range(3):
            step(*args)
    if variant.endswith("+runner"):
        box[0] = box[1].last[3]
    if "free-guard" in variant:
        _free_guards([g for k, g in dynamo_hooks._GROUPS.items() if k not in before])
    return step


def measure(blocks: int, calls: int, variants: tuple = VARIANTS) -> dict:
    torch.set_num_threads(1)
    request = dl.make_request("tiny")
    args = (request["x"], torch.tensor(0.5), request["token_types"], request["guidance_scale"], request["grid_hw"])
    VARIANTS = variants  # noqa: N806 - the ones asked for, in the module's order
    with torch.no_grad():
        steps = {v: build(v, request, args) for v in VARIANTS}
        outs = {v: s(*args) for v, s in steps.items()}
        samples: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for b in range(blocks):
            k = b % len(VARIANTS)
            for v in VARIANTS[k:] + VARIANTS[:k]:
                s = steps[v]
                t0 = time.perf_counter_ns()
                for _ in range(calls):
                    s(*args)
                samples[v].append((time.perf_counter_ns() - t0) / calls / 1e3)
    med = {v: statistics.median(x) for v, x in samples.items()}
    return {
        "machine": machine_info(torch.device("cpu")),
        "blocks": blocks, "calls": calls,
        "us_per_call": med,
        "x_hoisted": {v: m / med["hoisted"] for v, m in med.items()},
        # the same graph, the same inputs: the measurement-only variants still compute the same bits
        "bitwise_nosync_split": bool(torch.equal(outs["nosync"], outs["split"])) if {"nosync", "split"} <= set(outs) else None,
        "bitwise_nocache_hoisted": (bool(torch.equal(outs["nosync-nocache"], outs["hoisted"]))
                                    if {"nosync-nocache", "hoisted"} <= set(outs) else None),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=200)
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--json", default=None)
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, from: " + ", ".join(VARIANTS))
    a = p.parse_args(argv)
    asked = [v for v in a.variants.split(",") if v]
    bad = [v for v in asked if v not in VARIANTS]
    if bad or "hoisted" not in asked:
        p.error(f"unknown variant(s) {bad}; choose from {', '.join(VARIANTS)} (hoisted is the reference and required)"
                if bad else "--variants must include hoisted (the reference)")
    r = measure(a.blocks, a.calls, tuple(v for v in VARIANTS if v in asked))
    m = r["machine"]
    print(f"Machine: {m['cpu']} ({m['cpus']} CPUs, torch threads 1); torch {m['torch']}, Python {m['python']}; "
          f"load average {m['load_avg_1m']}")
    print(f"Same arguments every call; {a.blocks} rotating blocks of {a.calls} calls; medians.\n")
    print("| variant | us/call | x hoisted |\n|---|---|---|")
    for v in r["us_per_call"]:
        print(f"| {v} | {r['us_per_call'][v]:.1f} | {r['x_hoisted'][v]:.3f} |")
    print(f"\nnosync == split bitwise: {r['bitwise_nosync_split']}; "
          f"nosync-nocache == hoisted bitwise: {r['bitwise_nocache_hoisted']}")
    if a.json:
        Path(a.json).write_text(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()

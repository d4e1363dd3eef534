"""Per-step CUDA syncs of each A/B variant, measured two independent ways.

    python benchmarks/cuda_sync_check.py [--examples diffusion-tiny,decode] [--json out.json]
    python benchmarks/cuda_sync_check.py --dry-run      # CPU: exercises the code path, 1 step

For each example and variant (eager, stock Inductor, nosync, nosync + CUDA graphs) it runs one
warm-up request, then one steady-state request of the same values with new tensors, and counts
the synchronizing CUDA calls of that request two ways:

* ``sync_debug``: ``torch.cuda.set_sync_debug_mode("warn")`` makes torch warn on every
  synchronizing CUDA call it issues (``cudaStreamSynchronize`` behind ``.item()``, device-to-host
  copies, ``nonzero``, ...); the warnings are counted.
* ``count_syncs``: ``torchsync_pass.count_syncs()`` (method interception plus the profiler's
  ``aten::_local_scalar_dense``), and the profiler's CUDA runtime counters (``cudaStreamSynchronize``,
  ``cudaDeviceSynchronize``, DtoH ``cudaMemcpyAsync``), which read 0 on some builds.

The two agree when both see every sync; the table prints both, per step, so a reader sees which
method produced which number. Without CUDA it prints a note and exits 0 (``--dry-run`` runs the
CPU path with the sync-debug column marked n/a).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "examples")]

import ab  # noqa: E402  (benchmarks/ab.py: the examples and variants)

import torchsync_pass  # noqa: E402

VARIANTS = ("eager", "inductor", "nosync", "cudagraphs")


def _sync_debug_count(fn) -> int | None:
    """Synchronizing CUDA calls made by ``fn()``, from torch's sync debug mode (None without CUDA)."""
    if not torch.cuda.is_available():
        fn()
        return None
    torch.cuda.synchronize()
    old = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(old)
    return sum("synchroniz" in str(w.message).lower() for w in caught)


def measure(ex: ab.Example, variant: str, steps: int, device: torch.device) -> dict:
    row = {"example": ex.name, "variant": variant, "steps": steps}
    try:
        step, run = ab.build_variant(ex, variant, device)
    except ValueError as e:
        row["error"] = str(e)
        return row
    try:
        with torch.no_grad(), ab._device_ctx(device):
            out = run(step, ab.new_request(ex, device), steps)  # compile + first request
            run(step, ab.new_request(ex, device), steps)  # warm: the request is known
            n = ab.Example.steps_taken(out, steps, ex.module)
            req = ab.new_request(ex, device)
            debug = _sync_debug_count(lambda: run(step, req, steps))
            req = ab.new_request(ex, device)
            with torchsync_pass.count_syncs(stacks=False) as c:
                run(step, req, steps)
                ab.sync_device(device)
    except Exception as e:  # a failing variant is reported, the others still run
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return row
    row.update(
        steps=n,
        sync_debug_per_step=None if debug is None else debug / n,
        count_syncs_per_step=c.total / n,
        cuda_runtime_per_step=(c.cuda.stream_synchronize + c.cuda.device_synchronize
                               + c.cuda.dtoh_memcpy) / n,
    )
    return row


def _fmt(v) -> str:
    return "n/a" if v is None else f"{v:.2f}"


def table(rows: list[dict]) -> str:
    out = ["| example | variant | sync_debug_mode warnings/step | count_syncs/step | "
           "profiler CUDA runtime syncs/step |", "|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['example']} | {r['variant']} | error: {r['error']} | | |")
            continue
        out.append(f"| {r['example']} | {r['variant']} | {_fmt(r['sync_debug_per_step'])} | "
                   f"{_fmt(r['count_syncs_per_step'])} | {_fmt(r['cuda_runtime_per_step'])} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", default="diffusion-tiny,diffusion-large,diffusion-xl,decode,prefill")
    ap.add_argument("--steps", type=int, default=0, help="steps per request (default: the example's)")
    ap.add_argument("--json", default=None, help="write the rows here as JSON")
    ap.add_argument("--dry-run", action="store_true",
                    help="run on the CPU, 1 step, eager and nosync only (checks the code path)")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.dry_run:
        print("cuda_sync_check: no CUDA device: nothing measured (use --dry-run to check the code path)")
        return 0
    device = torch.device("cuda" if cuda and not args.dry_run else "cpu")
    variants = ("eager", "nosync") if args.dry_run else VARIANTS
    names = [n for n in args.examples.split(",") if n]
    if args.dry_run:
        names = [n for n in names if n != "diffusion-xl"][:2]
    rows = []
    for name in names:
        ex = ab.EXAMPLES[name]
        steps = 1 if args.dry_run else (args.steps or ex.steps)
        for variant in variants:
            ab.reset_dynamo()
            rows.append(measure(ex, variant, steps, device))
            print(f"[cuda_sync_check] {name} / {variant}: {rows[-1]}", file=sys.stderr, flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"device": str(device), "torch": torch.__version__, "rows": rows}, f, indent=2)
    print(f"Per-step syncs on {device} (torch {torch.__version__}): sync_debug_mode counts torch's "
          "warnings under torch.cuda.set_sync_debug_mode('warn'); count_syncs is "
          "torchsync_pass.count_syncs(); the last column is the profiler's CUDA runtime counters.")
    print()
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

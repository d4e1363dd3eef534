"""Per-scheduler sync table: diffusers' own ``scheduler.step`` loops, Llama and Qwen2-VL ``generate``.

For each diffusers scheduler (EulerDiscrete, EulerAncestralDiscrete, HeunDiscrete, LMSDiscrete,
DDIM, DPMSolverMultistep, UniPCMultistep, FlowMatchEulerDiscrete) it runs the pipeline's loop
(``examples/diffusers_pipeline.py``: set_timesteps, scale_model_input, denoiser, scheduler.step) with
the denoiser and ``scheduler.step`` compiled, three requests of ``--steps`` steps each:

- eager (the reference latents), stock Dynamo (``backend="eager"``: Dynamo splits the step at the
  same syncs as stock Inductor, without Inductor's compile time), nosync with ``codegen="eager"``;
- syncs/step: ``count_syncs()`` per step of the last request, median over its steady steps (from the
  third step on: the first two steps of a request run ``_init_step_index`` and the entry
  specialised on index 1);
- graphs/step: compiled graphs run per steady step; compiles: graphs compiled over the run;
- bitwise: the nosync latents of every request are ``torch.equal`` to eager's;
- why a sync remains: the nosync decision recorded at that line, or the sync kind where nosync
  never saw it (an op-internal or host-local sync).

Then Llama ``generate`` (a tiny random LlamaConfig, greedy, the LM's forward compiled) the same way,
and Qwen2-VL ``generate`` with an image in the prompt (``examples/qwen2_vl_generate.py``): its
syncs/step and graphs/step are per steady decode step (``generate`` of ``--tokens`` and of twice as
many new tokens on the same request, the difference per token), not averaged over the whole call.

    python benchmarks/schedulers.py [--steps 8] [--denoiser tiny|unet] [--out benchmarks/results/schedulers]

writes ``<out>.md`` (the README table) and ``<out>.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parent.parent
for _p in (ROOT, ROOT / "examples"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import torchsync_pass  # noqa: E402
import diffusers_pipeline as dp  # noqa: E402

log = logging.getLogger("schedulers")


def _steady(per_step: list[int]) -> float:
    tail = per_step[2:] or per_step
    return statistics.median(tail)


def _reasons(sites: dict) -> list[str]:
    """Why each line that still synced under nosync was left alone."""
    latest = {d.site: d for d in torchsync_pass.decisions()}  # the last decision per line
    out = []
    for key, n in sorted(sites.items(), key=lambda kv: -kv[1]):
        d = latest.get(key)
        where = _short(key.file) + f":{key.line}"
        if d is not None and d.action.value != "hoisted":
            why = f"{d.action.value}: {d.reason.name}"
        elif key.file == __file__ or key.file.endswith("diffusers_pipeline.py"):
            why = "an aten::_local_scalar_dense inside compiled code, as with stock Dynamo"
        else:
            why = "not a sync nosync intercepts (op-internal or host-local)"
        out.append(f"{where} ({why})")
    return out


def _short(path: str) -> str:
    for root in ("site-packages" + os.sep, str(ROOT) + os.sep):
        if root in path:
            return path.split(root, 1)[1]
    return os.path.basename(path)


def run_loop(kind: str, scheduler: str, steps: int, denoiser: str, requests: int = 3) -> dict:
    """One backend on one scheduler: latents per request, per-step syncs and sites of the last one."""
    torch._dynamo.reset()
    torchsync_pass.reset()
    counter = None
    unet = dp.build_unet() if denoiser == "unet" else dp.TinyDenoiser().eval()
    step: Callable = dp.scheduler_step
    if kind != "eager":
        inner = torchsync_pass.NosyncBackend({"codegen": "eager"}) if kind == "nosync" else "eager"
        counter = dp.Counting(inner)
        unet, step = torch.compile(unet, backend=counter), torch.compile(step, backend=counter)
    sched = dp.make_scheduler(scheduler)
    outs, per_step, sites, runs = [], [], {}, []
    for r in range(requests):
        last = r == requests - 1
        if last:
            runs_before = counter.runs if counter else 0
        out, per_step = dp.denoise(unet, step, sched, steps, seed=r, count=True)
        outs.append(out)
    if counter is not None:
        runs.append((counter.runs - runs_before) / max(1, len(per_step)))
    # the sites of one steady step of one more request
    if kind == "nosync":
        sites = _steady_sites(unet, step, sched, steps)
    return {"latents": outs, "per_step": per_step, "compiles": counter.compiled if counter else 0,
            "graphs_per_step": runs[0] if runs else 0.0, "sites": sites}


def _steady_sites(unet: Callable, step: Callable, sched: Any, steps: int) -> dict:
    sites: dict = {}
    orig = torchsync_pass.count_syncs

    class Spy:
        def __init__(self) -> None:
            self.i = 0

    spy = Spy()

    def counting():
        ctx = orig()
        spy.i += 1
        if spy.i == 3:  # the third step: steady
            spy.ctx = ctx
        return ctx

    dp.torchsync_pass.count_syncs = counting
    try:
        dp.denoise(unet, step, sched, steps, seed=7, count=True)
    finally:
        dp.torchsync_pass.count_syncs = orig
    ctx = getattr(spy, "ctx", None)
    if ctx is not None:
        sites = dict(ctx.by_site)
    return sites


def bench_scheduler(name: str, steps: int, denoiser: str) -> dict:
    t0 = time.perf_counter()
    ref = run_loop("eager", name, steps, denoiser)
    stock = run_loop("stock", name, steps, denoiser)
    nos = run_loop("nosync", name, steps, denoiser)
    bitwise = all(_bitwise(a, b) for a, b in zip(nos["latents"], ref["latents"]))
    row = {
        "case": dp.SCHEDULERS[name],
        "eager_syncs_per_step": _steady(ref["per_step"]),
        "stock_syncs_per_step": _steady(stock["per_step"]),
        "nosync_syncs_per_step": _steady(nos["per_step"]),
        "stock_per_step": stock["per_step"],
        "nosync_per_step": nos["per_step"],
        "stock_graphs_per_step": stock["graphs_per_step"],
        "nosync_graphs_per_step": nos["graphs_per_step"],
        "stock_compiles": stock["compiles"],
        "nosync_compiles": nos["compiles"],
        "bitwise": bitwise,
        "remaining": _reasons(nos["sites"]),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    return row


def _bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride() and torch.equal(a, b)


def build_llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval()


def run_generate(kind: str, tokens: int, requests: int = 3) -> dict:
    torch._dynamo.reset()
    torchsync_pass.reset()
    model = build_llama()
    counter = None
    if kind != "eager":
        inner = torchsync_pass.NosyncBackend({"codegen": "eager"}) if kind == "nosync" else "eager"
        counter = dp.Counting(inner)
        model.forward = torch.compile(model.forward, backend=counter)
    outs, syncs, runs0 = [], 0, 0
    for r in range(requests):
        ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(r))
        if r == requests - 1:
            runs0 = counter.runs if counter else 0
        with torch.no_grad(), torchsync_pass.count_syncs() as c:
            out = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                                 pad_token_id=0)
        outs.append(out)
        syncs = c.total
    return {"out": outs, "syncs_per_step": syncs / tokens, "syncs": syncs, "compiles": counter.compiled if counter else 0,
            "graphs_per_step": ((counter.runs - runs0) / tokens) if counter else 0.0,
            "sites": {}}


def _generate_counts(ref: dict, stock: dict, nos: dict) -> dict:
    """The table columns of a generate case, from its eager, stock and nosync runs."""
    return {
        "eager_syncs_per_step": ref["syncs_per_step"],
        "stock_syncs_per_step": stock["syncs_per_step"],
        "nosync_syncs_per_step": nos["syncs_per_step"],
        "stock_graphs_per_step": stock["graphs_per_step"],
        "nosync_graphs_per_step": nos["graphs_per_step"],
        "stock_compiles": stock["compiles"],
        "nosync_compiles": nos["compiles"],
    }


def bench_llama(tokens: int) -> dict:
    t0 = time.perf_counter()
    ref = run_generate("eager", tokens)
    stock = run_generate("stock", tokens)
    nos = run_generate("nosync", tokens)
    return {
        "case": "Llama generate (LM forward compiled)",
        **_generate_counts(ref, stock, nos),
        "bitwise": all(torch.equal(a, b) for a, b in zip(nos["out"], ref["out"])),
        "remaining": ["generate's stop check (unfinished_sequences.max() == 0) runs outside the compiled "
                      "forward and changes every step"] if nos["syncs_per_step"] else [],
        "seconds": round(time.perf_counter() - t0, 1),
    }


def bench_qwen2vl(tokens: int) -> dict:
    """Qwen2-VL generate with an image (examples/qwen2_vl_generate.py): steady per decode step."""
    import qwen2_vl_generate as qv

    t0 = time.perf_counter()
    qv.quiet()
    ref, stock, nos = (qv.run(kind, tokens) for kind in ("eager", "stock", "nosync"))
    stop_check = os.path.join("transformers", "generation", "utils.py")
    remaining = [f"{_short(k.file)}:{k.line} ({n:g}/step: " + (
        "generate's stop check bool(unfinished_sequences.max() == 0), outside the compiled forward, new every step)"
        if k.file.endswith(stop_check) else "a sync per decode step, not classified here)")
        for k, n in nos["step_sites"].items()]
    return {
        "case": "Qwen2-VL generate, image prompt (forward compiled)",
        **_generate_counts(ref, stock, nos),
        "stock_prefill": {"graphs": stock["prefill_graphs"], "forward_syncs": stock["forward_syncs"][0]},
        "nosync_prefill": {"graphs": nos["prefill_graphs"], "forward_syncs": nos["forward_syncs"][0]},
        "bitwise": all(qv.same_bits(a, b) for a, b in zip(nos["outs"], ref["outs"])),
        "remaining": remaining,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def render(rows: list[dict], args: argparse.Namespace) -> str:
    import diffusers
    import transformers

    only = f" --tokens {args.tokens} --only {' '.join(args.only)}" if args.only else ""
    head = (f"`python benchmarks/schedulers.py --steps {args.steps} --denoiser {args.denoiser}{only}` on "
            f"{platform.processor() or platform.machine()}, torch {torch.__version__}, Python "
            f"{platform.python_version()}, diffusers {diffusers.__version__}, transformers "
            f"{transformers.__version__}. Stock: Dynamo with `backend=\"eager\"` (the same graph splits "
            "as stock Inductor); nosync: `codegen=\"eager\"`. Syncs/step: median over the steady steps "
            "(third on) of the third request; graphs/step: compiled graphs run per step (mean over the third request, whose first two steps run more); compiles: "
            "graphs compiled over 3 requests; bitwise: nosync's final latents (tokens) of every request "
            "equal eager's.\n")
    if any(r["case"].startswith("Qwen2-VL") for r in rows):
        head += ("Qwen2-VL: syncs/step and graphs/step per steady decode step (generate of `--tokens` and of "
                 "twice as many new tokens on the same request, the difference per token); compiles over 2 "
                 "requests and those two calls; bitwise: the tokens and every step's logits.\n")
    lines = [head, "| case | syncs/step (eager; stock → nosync) | graphs/step (stock → nosync) | compiles (stock → nosync) | bitwise | syncs left under nosync: why |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['case']} | not run: {r['skipped']} | | | | |")
            continue
        lines.append(
            f"| {r['case']} | {r.get('eager_syncs_per_step', '-'):g}; {r['stock_syncs_per_step']:g} → {r['nosync_syncs_per_step']:g} | "
            f"{r['stock_graphs_per_step']:g} → {r['nosync_graphs_per_step']:g} | "
            f"{r['stock_compiles']} → {r['nosync_compiles']} | {'yes' if r['bitwise'] else 'NO'} | "
            f"{'; '.join(r['remaining']) or '-'} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="per-scheduler syncs: stock vs nosync")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--denoiser", choices=("tiny", "unet"), default="tiny")
    p.add_argument("--only", nargs="*", default=None, help="scheduler names (and/or 'llama', 'qwen2vl')")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "schedulers"))
    args = p.parse_args(argv)
    dp.quiet_diffusers()
    warnings.filterwarnings("ignore")
    logging.getLogger("torch._dynamo").setLevel(logging.ERROR)
    names = args.only if args.only else list(dp.SCHEDULERS) + ["llama", "qwen2vl"]
    rows = []
    for name in names:
        try:
            if name in ("llama", "qwen2vl"):
                row = (bench_llama if name == "llama" else bench_qwen2vl)(args.tokens)
            else:
                row = bench_scheduler(name, args.steps, args.denoiser)
        except ImportError as e:  # LMSDiscrete needs scipy
            row = {"case": dp.SCHEDULERS.get(name, name), "skipped": str(e).strip().splitlines()[0]}
        print(json.dumps({k: v for k, v in row.items()}), flush=True)
        rows.append(row)
    text = render(rows, args)
    print(text)
    if args.out:
        Path(args.out + ".md").write_text(text)
        Path(args.out + ".json").write_text(json.dumps(rows, indent=2))
    return 0 if all(r.get("bitwise", True) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())

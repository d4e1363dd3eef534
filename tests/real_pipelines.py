"""Real diffusers pipelines with tiny random weights, built from configs (no hub download).

Used by the tests of counting, explain and the serving-engine entry points, and runnable as a
script, which is what explain is measured on:

    python tests/real_pipelines.py [--scheduler euler|unipc] [--steps N] [--requests N]
                                   [--backend nosync|none] [--codegen eager|inductor]
                                   [--compile both|unet|step]

The script compiles the denoiser (``pipe.unet``) and ``pipe.scheduler.step`` with the chosen
backend and runs ``--requests`` requests of ``--steps`` denoising steps each. The prompt
embeddings are passed in (no tokenizer or text encoder: those would need files from the hub).
"""

from __future__ import annotations

import argparse
import logging
import time

import torch

CROSS_DIM = 32


def tiny_unet() -> "torch.nn.Module":
    """A UNet2DConditionModel with SD's block layout at toy size, random weights."""
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(32, 64), norm_num_groups=16,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=CROSS_DIM, attention_head_dim=8,
    ).eval()


def tiny_vae() -> "torch.nn.Module":
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, layers_per_block=1, norm_num_groups=16,
        block_out_channels=(16, 32), sample_size=16,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
    ).eval()


SD_SCHEDULER = dict(
    num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
    steps_offset=1,
)


def scheduler(name: str = "euler") -> object:
    import diffusers

    cls = {"euler": diffusers.EulerDiscreteScheduler, "unipc": diffusers.UniPCMultistepScheduler}[name]
    return cls(**SD_SCHEDULER)


def tiny_sd_pipeline(scheduler_name: str = "euler") -> object:
    """A StableDiffusionPipeline (UNet, VAE, scheduler) without tokenizer and text encoder."""
    from diffusers import StableDiffusionPipeline
    from diffusers.utils import logging as dlogging

    dlogging.set_verbosity_error()
    torch.manual_seed(0)
    pipe = StableDiffusionPipeline(
        vae=tiny_vae(), text_encoder=None, tokenizer=None, unet=tiny_unet(),
        scheduler=scheduler(scheduler_name), safety_checker=None, feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def prompt_embeds(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(1, 7, CROSS_DIM, generator=g)
    return emb, torch.zeros_like(emb)


def run_request(pipe: object, seed: int, steps: int) -> torch.Tensor:
    emb, neg = prompt_embeds(seed)
    with torch.no_grad():
        out = pipe(
            prompt_embeds=emb, negative_prompt_embeds=neg, num_inference_steps=steps,
            guidance_scale=7.5, height=16, width=16, output_type="pt",
            generator=torch.Generator().manual_seed(seed),
        )
    return out.images


def compile_denoiser_and_step(pipe: object, backend: str, codegen: str, what: str = "both") -> None:
    """Compile ``pipe.unet`` and/or ``pipe.scheduler.step`` (bound method) in place."""
    if backend == "none":
        return
    opts = {"options": {"codegen": codegen}} if backend == "nosync" else {}
    if what in ("both", "unet"):
        pipe.unet = torch.compile(pipe.unet, backend=backend, **opts)
    if what in ("both", "step"):
        pipe.scheduler.step = torch.compile(pipe.scheduler.step, backend=backend, **opts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scheduler", default="euler", choices=("euler", "unipc"))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--backend", default="nosync")
    ap.add_argument("--codegen", default="eager", choices=("eager", "inductor"))
    ap.add_argument("--compile", default="both", choices=("both", "unet", "step"))
    args = ap.parse_args(argv)
    if args.backend == "nosync":
        import torchsync_pass  # noqa: F401  (source-tree use: registers the backend)
    logging.getLogger("diffusers").setLevel(logging.ERROR)
    pipe = tiny_sd_pipeline(args.scheduler)
    compile_denoiser_and_step(pipe, args.backend, args.codegen, args.compile)
    for r in range(args.requests):
        t0 = time.perf_counter()
        img = run_request(pipe, seed=r, steps=args.steps)
        print(f"request {r}: {args.steps} steps in {time.perf_counter() - t0:.2f} s, "
              f"image mean {img.mean().item():.6f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

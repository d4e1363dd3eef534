"""A diffusers denoising loop with the denoiser and ``scheduler.step`` compiled by nosync.

A tiny random-weight ``UNet2DConditionModel`` (built from a config: no hub access) and a diffusers
scheduler constructed from its defaults run the loop a pipeline's ``__call__`` runs::

    scheduler.set_timesteps(steps)                     # new per-request tables (sigmas, timesteps)
    for t in scheduler.timesteps:
        x = scheduler.scale_model_input(latents, t)
        noise = unet(x, t, encoder_hidden_states=text).sample
        latents = scheduler.step(noise, t, latents).prev_sample

``EulerDiscreteScheduler.step`` reads ``self.sigmas[self.step_index]`` and syncs on it twice per
step (``if s_tmin <= sigma <= s_tmax``); nosync lifts those table reads (one sync per request).

Run it:  python examples/diffusers_pipeline.py [--scheduler euler] [--backend nosync|inductor|eager]
         python -m torchsync_pass.explain examples/diffusers_pipeline.py --backend nosync
"""

from __future__ import annotations

import argparse
import inspect
import logging
from typing import Any, Callable, Optional

import torch

import torchsync_pass

SCHEDULERS = {
    "euler": "EulerDiscreteScheduler",
    "euler_ancestral": "EulerAncestralDiscreteScheduler",
    "heun": "HeunDiscreteScheduler",
    "lms": "LMSDiscreteScheduler",
    "ddim": "DDIMScheduler",
    "dpmsolver": "DPMSolverMultistepScheduler",
    "unipc": "UniPCMultistepScheduler",
    "flow_match_euler": "FlowMatchEulerDiscreteScheduler",
}
LATENT = (1, 4, 8, 8)
TEXT = (1, 4, 8)  # batch, tokens, cross-attention dim


def quiet_diffusers() -> None:
    import diffusers

    diffusers.utils.logging.set_verbosity_error()
    logging.getLogger("diffusers").setLevel(logging.ERROR)


def build_unet(seed: int = 0) -> torch.nn.Module:
    """A tiny random-weight UNet2DConditionModel (about 60k parameters)."""
    from diffusers import UNet2DConditionModel

    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        sample_size=LATENT[-1], in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(8, 16), norm_num_groups=4, cross_attention_dim=TEXT[-1],
        attention_head_dim=2, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    )
    return unet.eval()


class TinyDenoiser(torch.nn.Module):
    """A stand-in for the UNet that compiles in a second: one conv, a timestep scale, a text bias."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.conv = torch.nn.Conv2d(LATENT[1], LATENT[1], 3, padding=1)
        self.text = torch.nn.Linear(TEXT[-1], LATENT[1])

    def forward(self, x: torch.Tensor, t: torch.Tensor, encoder_hidden_states: torch.Tensor) -> torch.Tensor:
        bias = self.text(encoder_hidden_states.mean(1))[:, :, None, None]
        return torch.tanh(self.conv(x) * (t / 1000.0) + bias)


def make_scheduler(name: str, **config: Any) -> Any:
    import diffusers

    return getattr(diffusers, SCHEDULERS[name])(**config)


def scheduler_step(scheduler: Any, noise: torch.Tensor, t: torch.Tensor, latents: torch.Tensor,
                   generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """``scheduler.step(...).prev_sample``: the function compiled with nosync."""
    kwargs = {"generator": generator} if generator is not None else {}
    return scheduler.step(noise, t, latents, **kwargs).prev_sample


def denoise(unet: Callable, step: Callable, scheduler: Any, steps: int = 8, seed: int = 0,
            count: bool = False) -> tuple[torch.Tensor, list[int]]:
    """One request: the pipeline's loop. Returns the final latents and the syncs of each step."""
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn(LATENT, generator=g)
    text = torch.randn(TEXT, generator=g)
    # schedulers that draw noise (ancestral, SDE) take a generator; the others have no such argument
    takes_generator = "generator" in inspect.signature(scheduler.step).parameters
    noise_gen = torch.Generator().manual_seed(seed + 1) if takes_generator else None
    scheduler.set_timesteps(steps)
    latents = latents * getattr(scheduler, "init_noise_sigma", 1.0)  # flow matching has none
    per_step: list[int] = []
    with torch.no_grad():
        for t in scheduler.timesteps:
            with torchsync_pass.count_syncs() as c:
                x = scheduler.scale_model_input(latents, t) if hasattr(scheduler, "scale_model_input") else latents
                noise = unet(x, t, encoder_hidden_states=text)
                noise = getattr(noise, "sample", noise)
                latents = step(scheduler, noise, t, latents, noise_gen)
            per_step.append(c.total if count else 0)
    return latents, per_step


def compile_loop(backend: str, codegen: str = "eager", denoiser: str = "unet") -> tuple[Callable, Callable, Any]:
    """(denoiser, step, backend object) compiled the way ``backend`` names: eager, inductor, nosync."""
    unet = build_unet() if denoiser == "unet" else TinyDenoiser().eval()
    if backend == "eager":
        return unet, scheduler_step, None
    if backend == "nosync":
        be: Any = torchsync_pass.NosyncBackend({"codegen": codegen})
        return torch.compile(unet, backend=be), torch.compile(scheduler_step, backend=be), be
    return torch.compile(unet, backend=backend), torch.compile(scheduler_step, backend=backend), backend


class Counting:
    """A backend wrapper that counts compiled graphs and how many times they run."""

    def __init__(self, inner: Any) -> None:
        from torch._dynamo.backends.registry import lookup_backend

        self.compiler_fn = lookup_backend(inner) if isinstance(inner, str) else inner  # nosync finds its options here
        self.compiled = 0
        self.runs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Callable:
        fn = self.compiler_fn(gm, example_inputs, **kwargs)
        self.compiled += 1

        def run(*args: Any) -> Any:
            self.runs += 1
            return fn(*args)

        return run


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scheduler", choices=sorted(SCHEDULERS), default="euler")
    p.add_argument("--backend", choices=("eager", "inductor", "nosync"), default="nosync")
    p.add_argument("--codegen", choices=("eager", "inductor"), default="eager")
    p.add_argument("--denoiser", choices=("unet", "tiny"), default="unet")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--requests", type=int, default=2)
    args = p.parse_args(argv)
    quiet_diffusers()
    unet, step, _ = compile_loop(args.backend, args.codegen, args.denoiser)
    scheduler = make_scheduler(args.scheduler)
    for r in range(args.requests):
        latents, syncs = denoise(unet, step, scheduler, args.steps, seed=r, count=True)
        print(f"request {r}: syncs per step {syncs}, latents sum {latents.double().sum().item():.6f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

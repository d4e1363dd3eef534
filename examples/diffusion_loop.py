"""A diffusion-style denoising loop that syncs the host at every step.

Mirrors the seed workload (a 50-step image model that made 700 ``aten::_local_scalar_dense`` calls
per image): the denoiser's forward asks request-invariant questions of tensors at every step,

* which token types are present   -> ``if (token_types == TEXT).any():``   (truthiness)
* how many image tokens there are  -> ``int((token_types == IMAGE).sum())`` (int())
* is classifier-free guidance on   -> ``if guidance_scale.item() > 1.0:``  (.item())
* the vision grid                  -> ``gh, gw = grid_hw.tolist()``         (.tolist())
* a fixed noise-scale embedding    -> ``self.noise_scale.item()``           (.item() on a buffer)

while the timestep ``t`` changes every step and is only used in tensor math (no sync).
The answers are the same for all 50 steps of a request, so the nosync backend hoists them.

Run it:  python examples/diffusion_loop.py [--size tiny|large] [--backend eager|inductor|nosync]
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from torch import nn

TEXT, IMAGE, PAD = 0, 1, 2

SIZES = {
    # name: (hidden dim, image grid side, text tokens)
    "tiny": (32, 4, 8),  # CPU-bound: the step is a handful of small kernels
    "large": (512, 32, 64),  # compute-bound on a CPU: 1,088 tokens x 512 dims
    "xl": (2048, 64, 256),  # compute-bound on a datacenter GPU: 4,352 tokens x 2,048 dims
}


class Denoiser(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.proj_in = nn.Linear(dim, dim)
        self.type_embed = nn.Embedding(3, dim)
        self.proj_out = nn.Linear(dim, dim)
        self.register_buffer("noise_scale", torch.tensor(0.25))

    def frequencies(self, device: torch.device) -> torch.Tensor:
        half = self.dim // 2
        steps = torch.arange(half, dtype=torch.float32, device=device)
        return torch.exp(steps * (-math.log(1e4) / half))

    def time_embed(self, t: torch.Tensor) -> torch.Tensor:
        ang = t.float()[None] * self.frequencies(t.device)
        return torch.cat([ang.sin(), ang.cos()])

    def forward(self, x, t, token_types, guidance_scale, grid_hw):
        h = self.proj_in(x) + self.time_embed(t)
        if (token_types == TEXT).any():  # sync: truthiness, request-invariant
            h = h + self.type_embed(token_types)
        n_img = int((token_types == IMAGE).sum())  # sync: int(), request-invariant
        gh, gw = grid_hw.tolist()  # sync: .tolist(), request-invariant
        img = h[-n_img:].reshape(gh, gw, self.dim)
        img = img + 0.5 * img.roll(1, dims=0)
        h = torch.cat([h[:-n_img], img.reshape(n_img, self.dim)])
        out = self.proj_out(torch.nn.functional.silu(h))
        if guidance_scale.item() > 1.0:  # sync: .item(), request-invariant (is CFG on?)
            out = out * guidance_scale
        return out * self.noise_scale.item()  # sync: .item() on a buffer


class DenoiserHoisted(Denoiser):
    """Hand-hoisted reference: the request-invariant answers are plain Python attributes.

    What a person would write by hand to get rid of the syncs: ``set_request`` asks each question
    once per request (one real sync each), and ``forward`` reads Python constants, so Dynamo traces
    the whole step as one graph. Same weights (``make_hoisted_model``) and the same arithmetic as
    ``Denoiser``: under eager, outputs are bitwise equal to it. The benchmarks use it as the
    reference the nosync backend should match.
    """

    def set_request(self, request) -> None:
        token_types = request["token_types"]
        self.has_text = bool((token_types == TEXT).any())
        self.n_img = int((token_types == IMAGE).sum())
        self.gh, self.gw = request["grid_hw"].tolist()
        self.cfg_on = request["guidance_scale"].item() > 1.0
        self.noise_scale_value = self.noise_scale.item()

    def type_embedding(self, token_types: torch.Tensor) -> torch.Tensor:
        return self.type_embed(token_types)

    def forward(self, x, t, token_types, guidance_scale, grid_hw):
        n_img = self.n_img
        h = self.proj_in(x) + self.time_embed(t)
        if self.has_text:
            h = h + self.type_embedding(token_types)
        img = h[-n_img:].reshape(self.gh, self.gw, self.dim)
        img = img + 0.5 * img.roll(1, dims=0)
        h = torch.cat([h[:-n_img], img.reshape(n_img, self.dim)])
        out = self.proj_out(torch.nn.functional.silu(h))
        if self.cfg_on:
            out = out * guidance_scale
        return out * self.noise_scale_value


class DenoiserSplit(DenoiserHoisted):
    """Hand-split reference: the hand-hoisted step, with its request-invariant *tensors* (the time
    embedding's frequency table, the type embedding) also computed once per request, in eager.

    The exact reference for nosync with invariant caching under Inductor: the same eager ops make
    the cached tensors, and the step that reads them is the same graph as nosync's step part.
    """

    def set_request(self, request) -> None:
        super().set_request(request)
        with torch.no_grad():
            self.freqs = self.frequencies(request["x"].device)
            self.type_emb = self.type_embed(request["token_types"])

    def time_embed(self, t: torch.Tensor) -> torch.Tensor:
        ang = t.float()[None] * self.freqs
        return torch.cat([ang.sin(), ang.cos()])

    def type_embedding(self, token_types: torch.Tensor) -> torch.Tensor:
        return self.type_emb


def make_request(size: str = "tiny", seed: int = 0, guidance: float = 4.0):
    """A request: initial latents plus the tensors that stay fixed for all of its steps."""
    dim, side, n_text = SIZES[size]
    g = torch.Generator().manual_seed(seed)
    n_img = side * side
    x = torch.randn(n_text + n_img, dim, generator=g)
    token_types = torch.cat([torch.full((n_text,), TEXT), torch.full((n_img,), IMAGE)])
    return {
        "x": x,
        "token_types": token_types,
        "guidance_scale": torch.tensor(guidance),
        "grid_hw": torch.tensor([side, side]),
    }


def make_model(size: str = "tiny", seed: int = 0) -> Denoiser:
    torch.manual_seed(seed)
    return Denoiser(SIZES[size][0]).eval()


def make_hoisted_model(size: str = "tiny", seed: int = 0) -> DenoiserHoisted:
    """The hand-hoisted reference with the same weights as ``make_model(size, seed)``."""
    torch.manual_seed(seed)
    return DenoiserHoisted(SIZES[size][0]).eval()


def make_split_model(size: str = "tiny", seed: int = 0) -> DenoiserSplit:
    """The hand-split reference with the same weights as ``make_model(size, seed)``."""
    torch.manual_seed(seed)
    return DenoiserSplit(SIZES[size][0]).eval()


def denoise(step, request, steps: int = 50):
    """The per-request loop: the timestep changes every step, nothing else does."""
    x = request["x"]
    # The schedule is made once per request on the latents' device, as a scheduler's timesteps are:
    # ``torch.tensor(v, device="cuda")`` inside the loop would be a host-to-device copy that
    # waits for the stream at every step.
    timesteps = torch.tensor([1.0 - i / steps for i in range(steps)], device=x.device)
    for i in range(steps):
        t = timesteps[i]
        eps = step(x, t, request["token_types"], request["guidance_scale"], request["grid_hw"])
        x = x - (1.0 / steps) * eps
    return x


def denoise_hoisted(step, model: DenoiserHoisted, request, steps: int = 50):
    """``denoise`` for the hand-hoisted reference: ask the invariant questions once, then loop."""
    model.set_request(request)
    return denoise(step, request, steps)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=sorted(SIZES), default="tiny")
    p.add_argument("--backend", choices=["eager", "inductor", "nosync"], default="nosync")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--requests", type=int, default=2)
    p.add_argument("--codegen", choices=["inductor", "eager"], default=None,
                   help="nosync codegen: inductor (default) or eager (the FX graph, bitwise equal to eager)")
    args = p.parse_args(argv)

    model = make_model(args.size)
    kwargs = {"options": {"codegen": args.codegen}} if args.backend == "nosync" and args.codegen else {}
    step = model if args.backend == "eager" else torch.compile(model, backend=args.backend, **kwargs)
    with torch.no_grad():
        for r in range(args.requests):
            request = make_request(args.size, seed=r)
            t0 = time.perf_counter()
            x = denoise(step, request, args.steps)
            dt = time.perf_counter() - t0
            print(f"request {r}: {args.steps} steps in {dt * 1e3:.1f} ms, |x| = {x.norm():.4f}")


if __name__ == "__main__":
    main()

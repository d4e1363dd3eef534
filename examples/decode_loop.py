"""An LLM-style decode loop whose sampler asks request-invariant questions at every token.

Mirrors the sampling path of a serving engine or of ``transformers``' ``generate()``: the per-request
sampling settings (temperature, top-k, repetition penalty) arrive as 0-d tensors batched with the
request, and the logits processors read them back to the host at every decode step,

* greedy or sampled?                -> ``if temperature.item() == 0.0:``      (.item())
* how many candidates to keep       -> ``torch.topk(logits, int(top_k))``     (int())
* is a repetition penalty set?      -> ``if rep_penalty.item() != 1.0:``      (.item())
* does the request ban any tokens?  -> ``if banned.any():``                   (truthiness)

where ``banned`` and ``prompt_vocab`` are masks derived from the prompt (a bad-words list and the
set of prompt tokens the penalty applies to). All four answers are fixed for the whole request, so
the nosync backend hoists them.

One sync is genuinely step-varying and must stay: the stop check on the token just generated,
``bool(torch.isin(next_token, stop_ids).any())``. Its value depends on the token buffer, the
position and the sampling noise, which change at every step; nosync must leave it alone (or demote
it after speculating) and the loop must stop at exactly the step eager stops at.

Sampling is reproducible and bitwise comparable: it is Gumbel-max over the top-k logits, with the
uniform noise drawn in the loop from a generator seeded by the request, and handed to the step as an
input (no random op inside the compiled step). The context is a static buffer of ``max_len`` tokens
with a causal mask up to ``pos`` (as in static-cache decoding), so shapes never change between steps.

Run it:  python examples/decode_loop.py [--backend eager|inductor|nosync] [--max-new N]
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from torch import nn

SIZES = {
    # name: (vocab, hidden dim, context length, prompt length)
    "tiny": (512, 64, 96, 16),
}


class Decoder(nn.Module):
    """One attention block over a static context buffer, plus the sampler."""

    def __init__(self, vocab: int, dim: int, max_len: int) -> None:
        super().__init__()
        self.dim = dim
        self.embed = nn.Embedding(vocab, dim)
        self.pos_embed = nn.Embedding(max_len, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.norm1 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.norm2 = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("positions", torch.arange(max_len))

    def logits(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Next-token logits at position ``pos`` (0-d tensor) of the static buffer ``tokens``."""
        h = self.embed(tokens) + self.pos_embed.weight
        q, k, v = self.qkv(self.norm1(h)).chunk(3, dim=-1)
        at = pos.reshape(1)
        att = (q.index_select(0, at) @ k.T) / math.sqrt(self.dim)
        att = att.masked_fill(self.positions > pos, float("-inf")).softmax(dim=-1)
        hl = h.index_select(0, at) + att @ v
        hl = hl + self.mlp(self.norm2(hl))
        return self.lm_head(hl)[0]

    def forward(self, tokens, pos, noise, temperature, top_k, rep_penalty, banned, prompt_vocab, stop_ids):
        logits = self.logits(tokens, pos)
        if rep_penalty.item() != 1.0:  # sync: .item(), request-invariant
            penalized = torch.where(logits > 0, logits / rep_penalty, logits * rep_penalty)
            logits = torch.where(prompt_vocab, penalized, logits)
        if banned.any():  # sync: truthiness of a prompt-derived mask, request-invariant
            logits = logits.masked_fill(banned, float("-inf"))
        if temperature.item() == 0.0:  # sync: .item(), request-invariant (greedy?)
            next_token = logits.argmax(dim=-1, keepdim=True)
        else:
            vals, idx = torch.topk(logits / temperature, int(top_k))  # sync: int(), request-invariant
            gumbel = -torch.log(-torch.log(noise.gather(0, idx)))
            next_token = idx.gather(0, (vals + gumbel).argmax(dim=-1, keepdim=True))
        finished = bool(torch.isin(next_token, stop_ids).any())  # sync: STEP-VARYING, must stay
        return next_token, finished


class DecoderHoisted(Decoder):
    """Hand-hoisted reference: the request-invariant answers are plain Python attributes.

    ``set_request`` asks the four questions once per request (the one real sync per question per
    request); ``forward`` then reads Python constants, so Dynamo traces one graph per step up to the
    stop check. Same weights and same arithmetic as ``Decoder``: outputs are bitwise equal to it.
    """

    def set_request(self, request) -> None:
        self.penalize = request["rep_penalty"].item() != 1.0
        self.any_banned = bool(request["banned"].any())
        self.greedy = request["temperature"].item() == 0.0
        self.k = int(request["top_k"])

    def forward(self, tokens, pos, noise, temperature, top_k, rep_penalty, banned, prompt_vocab, stop_ids):
        logits = self.logits(tokens, pos)
        if self.penalize:
            penalized = torch.where(logits > 0, logits / rep_penalty, logits * rep_penalty)
            logits = torch.where(prompt_vocab, penalized, logits)
        if self.any_banned:
            logits = logits.masked_fill(banned, float("-inf"))
        if self.greedy:
            next_token = logits.argmax(dim=-1, keepdim=True)
        else:
            vals, idx = torch.topk(logits / temperature, self.k)
            gumbel = -torch.log(-torch.log(noise.gather(0, idx)))
            next_token = idx.gather(0, (vals + gumbel).argmax(dim=-1, keepdim=True))
        finished = bool(torch.isin(next_token, stop_ids).any())  # still step-varying
        return next_token, finished


def make_model(size: str = "tiny", seed: int = 0) -> Decoder:
    vocab, dim, max_len, _ = SIZES[size]
    torch.manual_seed(seed)
    return Decoder(vocab, dim, max_len).eval()


def make_hoisted_model(size: str = "tiny", seed: int = 0) -> DecoderHoisted:
    """The hand-hoisted reference with the same weights as ``make_model(size, seed)``."""
    vocab, dim, max_len, _ = SIZES[size]
    torch.manual_seed(seed)
    return DecoderHoisted(vocab, dim, max_len).eval()


def make_request(
    size: str = "tiny",
    seed: int = 0,
    temperature: float = 0.8,
    top_k: int = 40,
    rep_penalty: float = 1.3,
    n_banned: int = 4,
    stop_ids=None,
    n_stop: int = 8,
):
    """A request: the prompt, its sampling settings and masks, all fixed for every decode step.

    ``stop_ids`` (a list of token ids) overrides the ``n_stop`` stop tokens drawn from the seed;
    pass ``[]`` to decode up to ``max_new`` tokens.
    """
    vocab, _, max_len, prompt_len = SIZES[size]
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(vocab, (prompt_len,), generator=g)
    banned = torch.zeros(vocab, dtype=torch.bool)
    banned[torch.randperm(vocab, generator=g)[:n_banned]] = True
    prompt_vocab = torch.zeros(vocab, dtype=torch.bool)
    prompt_vocab[prompt] = True
    if stop_ids is None:
        stop = torch.randperm(vocab, generator=g)[:n_stop]
    else:
        stop = torch.tensor(list(stop_ids), dtype=torch.long)
    sample_seed = int(torch.randint(2**31 - 1, (1,), generator=g))  # the noise stream of this request
    return {
        "prompt": prompt,
        "max_len": max_len,
        "sample_seed": sample_seed,
        "temperature": torch.tensor(temperature),
        "top_k": torch.tensor(top_k),
        "rep_penalty": torch.tensor(rep_penalty),
        "banned": banned,
        "prompt_vocab": prompt_vocab,
        "stop_ids": stop,
    }


def generate(step, request, max_new: int = 64) -> torch.Tensor:
    """The per-request loop: the position, the buffer and the noise change every step.

    Returns the generated tokens (int64, 1-D); its length says at which step the stop check fired.
    """
    prompt = request["prompt"]
    device = prompt.device
    tokens = torch.zeros(request["max_len"], dtype=torch.long, device=device)
    tokens[: prompt.numel()] = prompt
    g = torch.Generator(device=device).manual_seed(request["sample_seed"])
    vocab = request["banned"].numel()
    last = min(request["max_len"] - 1, prompt.numel() - 1 + max_new)
    # positions made once on the device: ``torch.tensor(pos, device="cuda")`` per step would be a
    # host-to-device copy that synchronizes the stream
    positions = torch.arange(prompt.numel() - 1, max(last, prompt.numel() - 1), device=device)
    out = []
    for j, pos in enumerate(range(prompt.numel() - 1, last)):
        noise = torch.rand(vocab, generator=g, device=device).clamp_(min=1e-12)
        next_token, finished = step(
            tokens,
            positions[j],
            noise,
            request["temperature"],
            request["top_k"],
            request["rep_penalty"],
            request["banned"],
            request["prompt_vocab"],
            request["stop_ids"],
        )
        tokens[pos + 1 : pos + 2] = next_token
        out.append(next_token)
        if finished:
            break
    return torch.cat(out) if out else torch.empty(0, dtype=torch.long, device=device)


def generate_hoisted(step, model: DecoderHoisted, request, max_new: int = 64) -> torch.Tensor:
    """``generate`` for the hand-hoisted reference: ask the invariant questions once, then loop."""
    model.set_request(request)
    return generate(step, request, max_new)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=["eager", "inductor", "nosync"], default="nosync")
    p.add_argument("--max-new", type=int, default=64)
    p.add_argument("--requests", type=int, default=2)
    args = p.parse_args(argv)

    model = make_model()
    step = model if args.backend == "eager" else torch.compile(model, backend=args.backend)
    with torch.no_grad():
        for r in range(args.requests):
            request = make_request(seed=r)
            t0 = time.perf_counter()
            out = generate(step, request, args.max_new)
            dt = time.perf_counter() - t0
            stopped = "stop token" if out.numel() < args.max_new else "max_new"
            print(
                f"request {r}: {out.numel()} tokens ({stopped}) in {dt * 1e3:.1f} ms: "
                f"{out[:12].tolist()}{' ...' if out.numel() > 12 else ''}"
            )


if __name__ == "__main__":
    main()

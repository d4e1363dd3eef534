"""A speech-style prefill that reads every token back to the host, and nosync's device-side rewrite.

Mirrors the front end of text-to-speech and speech-prompted models: the text (or phoneme) ids of a
request are turned into per-position features by looking each id up in a table that lives on the
Python side (a lexicon or a cache of per-token prompt features), one position at a time,

    for i in range(tokens.shape[0]):
        rows.append(self.table[tokens[i].item()])     # one host read per position

and the request is prefilled in chunks, so each step of the loop sees a new chunk of tokens.

These reads are *not* request-invariant: every step reads different positions and every request
brings new tokens, so there is nothing to hoist. But each value is used only to index a Python list
of same-shape tensors, so the host never needs it: nosync traces each read as a gather on the device
(the list stacked into one tensor, then one ``aten.index`` at the chunk's tokens), which copies the
same bits: 8 syncs per step (one per token) become 0, in one graph with no break, bitwise equal to
eager (see README, "Reads used only as an index"). On a CPU, where a host read costs about a
microsecond, the list's 64 tensors as graph inputs cost more than the reads; the ``long-tensor``
size (the table as one tensor) is where the compiled step wins there (README, "Results").
``make_vectorized_model`` is the same model with the gather written by hand
(``torch.stack(self.table)[tokens]``): stock Inductor on it is the exact reference of nosync with
Inductor.

Sizes: ``tiny`` (8 tokens per chunk, 64-entry table) and ``long`` (64 tokens per chunk, 512
entries) are CPU-bound: the host side (one read and one Python-level lookup per token) dominates.
``wide`` (8 tokens, 1,024 features) is compute-bound on a CPU: its two matmuls dominate.
``long-tensor`` is ``long`` with the table as one tensor buffer (``self.table[i]`` indexes a tensor).
``tiny-pad`` is ``tiny`` with about a quarter of the positions set to ``PAD`` (-1), looked up with a
per-position branch, ``self.pad_row if tokens[i] == PAD else self.table[tokens[i].item()]``: eager
reads each test and each non-PAD token back; nosync traces both arms and selects with
``torch.where`` (the table read masked to row 0 where the position is PAD), no host read.

Run it:  python examples/prefill_tokens.py [--backend eager|inductor|nosync] [--steps N] [--size S]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

SIZES = {
    # name: (table entries, feature dim, tokens per chunk, chunks per request)
    "tiny": (64, 32, 8, 16),
    "long": (512, 32, 64, 8),
    "wide": (64, 1024, 8, 4),
    "long-tensor": (512, 32, 64, 8),  # "long" with the table as one tensor (a buffer), not a list
    "tiny-pad": (64, 32, 8, 16),  # "tiny" with PAD positions: a per-position branch (see PAD)
}
TENSOR_TABLE = {"long-tensor"}
PADDED = {"tiny-pad"}
PAD = -1  # the padding id of PADDED sizes: its row is ``pad_row``, not a table entry


class Prefill(nn.Module):
    def __init__(self, n_entries: int, dim: int, tensor_table: bool = False, padded: bool = False) -> None:
        super().__init__()
        self.padded = padded
        g = torch.Generator().manual_seed(1234)
        # A host-side table: a Python list of per-token features, not a parameter (or, with
        # tensor_table, the same rows as one [n_entries, dim] buffer).
        rows = [torch.randn(dim, generator=g) for _ in range(n_entries)]
        if tensor_table:
            self.register_buffer("table", torch.stack(rows))
        else:
            self.table = rows
        self.register_buffer("pad_row", torch.zeros(dim))
        self.proj = nn.Linear(dim, dim)
        self.mix = nn.Linear(2 * dim, dim)

    def _apply(self, fn, recurse=True):
        # Keep the host-side table on the module's device when it is moved (``model.to("cuda")``).
        super()._apply(fn, recurse)
        if isinstance(self.table, list):
            self.table = [fn(row) for row in self.table]
        return self

    def lookup(self, tokens: torch.Tensor) -> torch.Tensor:
        rows = []
        for i in range(tokens.shape[0]):
            if self.padded:  # a host read for the branch, and one more for each non-PAD position
                rows.append(self.pad_row if tokens[i] == PAD else self.table[tokens[i].item()])
            else:
                rows.append(self.table[tokens[i].item()])  # a host read per position (eager, stock Dynamo)
        return torch.stack(rows)

    def forward(self, tokens: torch.Tensor, state: torch.Tensor):
        feats = self.proj(self.lookup(tokens))
        h = self.mix(torch.cat([feats, state.expand_as(feats)], dim=-1)).tanh()
        return h, 0.9 * state + 0.1 * h.mean(dim=0, keepdim=True)


class VectorizedPrefill(Prefill):
    """The hand fix: one gather on the device for the whole chunk, no host read."""

    def lookup(self, tokens: torch.Tensor) -> torch.Tensor:
        table = self.table if isinstance(self.table, torch.Tensor) else torch.stack(self.table)
        if self.padded:
            return torch.where((tokens == PAD)[:, None], self.pad_row, table[tokens.clamp(min=0)])
        return table[tokens]


def make_model(size: str = "tiny", seed: int = 0) -> Prefill:
    n_entries, dim, _, _ = SIZES[size]
    torch.manual_seed(seed)
    return Prefill(n_entries, dim, size in TENSOR_TABLE, size in PADDED).eval()


def make_vectorized_model(size: str = "tiny", seed: int = 0) -> VectorizedPrefill:
    """Same weights and table as ``make_model(size, seed)``, gather written by hand."""
    n_entries, dim, _, _ = SIZES[size]
    torch.manual_seed(seed)
    return VectorizedPrefill(n_entries, dim, size in TENSOR_TABLE, size in PADDED).eval()


def make_request(size: str = "tiny", seed: int = 0):
    """A request: the token ids of one utterance (new for every request) and the initial state."""
    n_entries, dim, chunk, n_chunks = SIZES[size]
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(n_entries, (chunk * n_chunks,), generator=g)
    if size in PADDED:  # about a quarter of the positions are padding
        tokens[torch.rand(tokens.shape, generator=g) < 0.25] = PAD
    return {
        "tokens": tokens,
        "chunk": chunk,
        "state": torch.zeros(1, dim),
    }


def prefill(step, request, steps: int | None = None) -> torch.Tensor:
    """The per-request loop: each step prefills the next chunk of tokens (new values every step)."""
    tokens, chunk, state = request["tokens"], request["chunk"], request["state"]
    n_chunks = tokens.numel() // chunk
    steps = n_chunks if steps is None else min(steps, n_chunks)
    outs = []
    for i in range(steps):
        h, state = step(tokens[i * chunk : (i + 1) * chunk], state)
        outs.append(h)
    return torch.cat(outs)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=["eager", "inductor", "nosync"], default="nosync")
    p.add_argument("--steps", type=int, default=None, help="chunks per request (default: all)")
    p.add_argument("--requests", type=int, default=2)
    p.add_argument("--size", choices=sorted(SIZES), default="tiny")
    args = p.parse_args(argv)

    model = make_model(args.size)
    step = model if args.backend == "eager" else torch.compile(model, backend=args.backend)
    with torch.no_grad():
        for r in range(args.requests):
            request = make_request(args.size, seed=r)
            t0 = time.perf_counter()
            out = prefill(step, request, args.steps)
            dt = time.perf_counter() - t0
            print(f"request {r}: {out.shape[0]} positions in {dt * 1e3:.1f} ms, |h| = {out.norm():.4f}")


if __name__ == "__main__":
    main()

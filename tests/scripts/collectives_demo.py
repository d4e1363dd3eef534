"""Two gloo ranks on this machine's CPU: a host read and a request-invariant tensor that depend on a
collective (the other rank's buffer). Rank 1 changes its buffer before call 2; rank 0 does not.
Writes rank0.json and rank1.json in the working directory: per call, is the compiled result bitwise
the expected one. Usage: python collectives_demo.py PORT (run by tests/test_review23.py)."""

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
import torch.multiprocessing as mp


class Read(torch.nn.Module):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.register_buffer("scale", torch.full((3,), float(rank + 1)))

    def forward(self, x):
        return x * fc.all_reduce(self.scale, "sum", dist.group.WORLD).max().item()


class Cached(torch.nn.Module):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.register_buffer("bias", torch.full((4,), float(rank + 1)))

    def forward(self, x):
        return fc.all_reduce(x * 2, "sum", dist.group.WORLD) + fc.all_reduce(self.bias, "sum", dist.group.WORLD)


@torch.library.custom_op("collectives_demo::allsum", mutates_args=())
def allsum(x: torch.Tensor) -> torch.Tensor:
    """A tensor-parallel all_reduce wrapped as a custom op (as vLLM and SGLang wrap theirs)."""
    y = x.clone()
    dist.all_reduce(y)
    return y


@allsum.register_fake
def _(x):
    return torch.empty_like(x)


class Custom(torch.nn.Module):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.register_buffer("scale", torch.full((3,), float(rank + 1)))

    def forward(self, x):
        return x * allsum(self.scale).max().item()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride() and torch.equal(a, b)


def _rank(rank: int, port: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=20))
    import torchsync_pass

    out = {"rank": rank, "read": [], "cached": [], "custom": [], "decisions": []}
    try:
        read, cached, custom = Read(rank), Cached(rank), Custom(rank)
        f = torch.compile(read, backend="nosync", options={"codegen": "eager"})
        h = torch.compile(custom, backend="nosync", options={"codegen": "eager"})
        g = torch.compile(cached, backend="nosync", options={"codegen": "eager", "invariant_cache_bytes": 1 << 20})
        totals = [3.0, 3.0]  # the two ranks' scales, summed: 1 + 2; then 1 + 10
        bias = [1.0, 2.0]
        with torch.no_grad():
            for call in range(4):
                if call == 2:
                    totals = [11.0, 11.0]
                    bias[1] = 10.0
                    if rank == 1:
                        read.scale.fill_(10.0)
                        cached.bias.fill_(10.0)
                        custom.scale.fill_(10.0)
                x = torch.ones(3)
                out["read"].append(_same(f(x), x * totals[0]))
                out["custom"].append(_same(h(x), x * totals[0]))
                xs = [torch.full((4,), 100.0 * (call + 1) + r) for r in range(2)]
                want = (xs[0] * 2 + xs[1] * 2) + (torch.full((4,), bias[0]) + torch.full((4,), bias[1]))
                out["cached"].append(_same(g(xs[rank]), want))
        out["decisions"] = [(d.action.value, d.reason.name) for d in torchsync_pass.decisions()]
    except Exception as e:  # a collective paired with the wrong one times out or aborts
        out["error"] = f"{type(e).__name__}: {str(e)[:200]}"
    with open(f"rank{rank}.json", "w") as f:  # (one file each: two ranks' prints interleave)
        json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.start_processes(_rank, args=(sys.argv[1],), nprocs=2, join=True, start_method="spawn")

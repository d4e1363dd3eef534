"""Memory across model reloads: what stays alive after ``torch._dynamo.reset()``, nosync vs eager.

A server that reloads its model compiles it again and calls ``torch._dynamo.reset()`` in between.
Each cycle here builds an N-layer module (one hoistable ``.item()`` per layer), compiles it, runs
three steps and resets Dynamo. After the cycles it counts, with the garbage collector, the objects
still alive beyond those after two warm-up cycles, and the RSS growth per cycle:

    FakeTensorMode    the trace's fake mode (and with it the shape env and fake tensors)
    SiteCheck         nosync's per-site guard checks (they hold the cone, memo and site state)
    guard groups      nosync's closures inside Dynamo's lambda guards, with checks / released
    GraphModule       traced graphs and cone modules

    python benchmarks/reload_memory.py                      # 40 cycles x 40 layers, each variant
    python benchmarks/reload_memory.py --cycles 10 --layers 8 --backends nosync

Variants: ``nosync`` (eager codegen), ``eager`` (stock, a graph break per layer) and
``eager-hoisted`` (stock on the hand-hoisted model: the same single graph nosync produces).
Run one variant per process for RSS figures that do not depend on what ran before.

NOTE: stock Dynamo itself keeps one CheckFunctionManager per compiled frame alive after a reset
(``weakref.finalize`` callbacks on long-lived objects such as classes hold it), and with it its
C++ lambda guards; nosync releases what its closures hold, so an empty group is all that remains.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

import torch
import torch._dynamo
from torch import nn


class Layer(nn.Module):
    def __init__(self, i: int) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.register_buffer("scale", torch.tensor(float(i % 3 + 1)))

    def forward(self, x):
        if self.scale.item() > 1.5:
            x = x * 2
        return self.lin(x)


class HoistedLayer(Layer):
    """The same layer with the answer passed as a Python constant: one unbroken graph for stock."""

    def __init__(self, i: int) -> None:
        super().__init__(i)
        self.big = float(i % 3 + 1) > 1.5

    def forward(self, x):
        if self.big:
            x = x * 2
        return self.lin(x)


class Model(nn.Module):
    def __init__(self, layers: int, hoisted: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList((HoistedLayer if hoisted else Layer)(i) for i in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def live() -> dict[str, int]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from torchsync_pass import dynamo_hooks
    from torchsync_pass.guards import SiteCheck

    gc.collect()
    out = dict.fromkeys(["FakeTensorMode", "SiteCheck", "guard groups with checks",
                         "guard groups released", "GraphModule"], 0)
    for o in gc.get_objects():
        t = type(o)
        if t is FakeTensorMode:
            out["FakeTensorMode"] += 1
        elif t is SiteCheck:
            out["SiteCheck"] += 1
        elif t is dynamo_hooks._GuardGroup:
            out["guard groups with checks" if o.checks else "guard groups released"] += 1
        elif isinstance(o, torch.fx.GraphModule):
            out["GraphModule"] += 1
    return out


def measure(backend: str, cycles: int, layers: int) -> dict:
    import torchsync_pass  # noqa: F401  (registers "nosync" from a source tree)

    x = torch.randn(4, 16)
    hoisted = backend == "eager-hoisted"
    backend = "eager" if hoisted else backend
    opts = {"options": {"codegen": "eager"}} if backend == "nosync" else {}

    def cycle() -> None:
        model = Model(layers, hoisted).eval()
        step = torch.compile(model, backend=backend, **opts)
        with torch.no_grad():
            for _ in range(3):
                step(x)
        torch._dynamo.reset()

    cycle()
    cycle()
    before, rss0 = live(), rss()
    t0 = time.perf_counter()
    for _ in range(cycles):
        cycle()
    seconds = time.perf_counter() - t0
    after, rss1 = live(), rss()
    return {
        "backend": backend + (" (hand-hoisted model)" if hoisted else ""), "cycles": cycles, "layers": layers,
        "extra_alive": {k: after[k] - before[k] for k in after},
        "rss_growth_mb_per_cycle": round((rss1 - rss0) / cycles / 1e6, 3),
        "seconds": round(seconds, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cycles", type=int, default=40)
    p.add_argument("--layers", type=int, default=40)
    p.add_argument("--backends", default="nosync,eager,eager-hoisted")
    ns = p.parse_args()
    for backend in ns.backends.split(","):
        print(json.dumps(measure(backend, ns.cycles, ns.layers)))


if __name__ == "__main__":
    main()

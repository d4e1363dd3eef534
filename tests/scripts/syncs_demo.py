"""A small script with known sync sites, for the explain CLI tests.

Usage: syncs_demo.py [--steps N] [--compile] [--fail]
"""

import sys

import torch


def step(x, flags):
    y = x * 2
    scale = flags.sum().item()  # SITE item
    if (flags > 0).any():  # SITE bool
        y = y + scale
    n = int(flags.numel())
    return y * n


def main(argv):
    steps = int(argv[argv.index("--steps") + 1]) if "--steps" in argv else 3
    fn = torch.compile(step, backend="eager") if "--compile" in argv else step
    x = torch.ones(4)
    flags = torch.tensor([1.0, 0.0, 2.0])
    for _ in range(steps):
        x = fn(x, flags)
    grid = torch.tensor([2, 3]).tolist()  # SITE tolist
    print("done", grid)
    if "--fail" in argv:
        raise ValueError("requested failure")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

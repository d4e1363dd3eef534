"""A script for the serving-ready explain tests.

Usage: serving_demo.py [--nosync-no-sync] [--solve] [--sleep S]
  --nosync-no-sync  compile a step without any sync with nosync (nosync runs, finds nothing)
  --solve           compile (nosync, eager codegen) a step whose inlined helper calls
                    torch.linalg.solve: a sync inside an op, at the helper's line
  --sleep S         sleep S seconds (for the progress line)
"""

import sys
import time

import torch


def plain_step(x):
    return (x * 2).sin()


def solve(R, b):
    return torch.linalg.solve(R, b)  # SITE solve


def solve_step(R, b):
    y = R * 2
    return y, solve(R, b)


def main(argv):
    if "--nosync-no-sync" in argv:
        f = torch.compile(plain_step, backend="nosync", options={"codegen": "eager"})
        for _ in range(3):
            f(torch.ones(3))
    if "--solve" in argv:
        f = torch.compile(solve_step, backend="nosync", options={"codegen": "eager"})
        R, b = torch.eye(3) + 0.1, torch.ones(3)
        for _ in range(2):
            R = R.to(b.device)  # pipeline code between steps (a safe point for the profiler)
            f(R, b)
    if "--sleep" in argv:
        time.sleep(float(argv[argv.index("--sleep") + 1]))


if __name__ == "__main__":
    main(sys.argv[1:])

"""A script for the explain test of a tabulated sync inside an op (tests/test_inop.py).

Two requests of a scheduler-like step that solves a 2x2 system built from its table at the step
counter, compiled with nosync (codegen="eager"): the solve is tabulated once per request.
"""

import torch


class Sched:
    def __init__(self, start):
        self.sigmas = torch.linspace(start, 0.1, 7)
        self._step_index = 0


def step(s, x):
    i = s._step_index
    one = torch.ones(())
    R = torch.stack([torch.stack([one, s.sigmas[i]]), torch.stack([one, s.sigmas[i + 1]])])
    rhos = torch.linalg.solve(R, torch.stack([s.sigmas[i], one]))  # SITE solve
    s._step_index += 1
    return x * rhos[0] + rhos[1]


def main():
    f = torch.compile(step, backend="nosync", options={"codegen": "eager"})
    for start in (1.0, 0.9, 0.8):
        s, x = Sched(start), torch.ones(3)
        for _ in range(6):
            x = x.to(s.sigmas.device)  # pipeline code between steps (a safe point for the profiler)
            x = f(s, x)


if __name__ == "__main__":
    main()

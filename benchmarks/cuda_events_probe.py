"""Which profiler events does a host sync produce on this CUDA build? (diagnostic for count_syncs)

Prints, for ``x.sum().item()`` and ``x.cpu()`` on a CUDA tensor, the events that two profiler
front ends report: their names, device types, and thread ids. Exits 0 without CUDA.
"""

from __future__ import annotations

import torch


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA: nothing to probe")
        return 0
    x = torch.arange(1024.0, device="cuda")
    torch.cuda.synchronize()

    def work():
        x.sum().item()
        x.cpu()

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        work()
    print("== torch.profiler.profile(CPU, CUDA): key_averages")
    for e in prof.key_averages():
        print(f"  {e.key!r} count={e.count} device_type={getattr(e, 'device_type', '?')}")

    with torch.autograd.profiler.profile(use_kineto=True, use_device="cuda") as p2:
        work()
    print("== autograd.profiler.profile(use_kineto, use_device=cuda): kineto_results.events()")
    for e in p2.kineto_results.events():
        try:
            print(f"  {e.name()!r} device_type={e.device_type()} tid={e.start_thread_id()} "
                  f"corr={e.correlation_id()}")
        except Exception as err:  # noqa: BLE001 - diagnostic
            print("  <unreadable event>", err)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

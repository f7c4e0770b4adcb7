"""Does torch.compile's worker pool load the host after a process's first compile?

After the first compile, every 0.5 s for 8 s: how many processes descend from this one
(``children``), their CPU seconds so far, and the host time of 200 back-to-back tiny eager
CUDA ops (us per call). A busy pool would show as climbing CPU seconds and slower eager calls.
Usage:

    python compile_workers_probe.py > OUT.log
    TORCHINDUCTOR_COMPILE_THREADS=1 python compile_workers_probe.py   # no pool
"""

from __future__ import annotations

import os
import time

import torch
import torch._inductor.config as inductor_config


def descendants() -> list[tuple[int, float]]:
    """(pid, CPU seconds so far) of every process descending from this one (Linux /proc)."""
    procs: dict[int, tuple[int, float]] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the process ended while listed
            continue
        procs[int(name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    found: list[tuple[int, float]] = []
    frontier = {os.getpid()}
    while frontier:
        frontier = {pid for pid, (parent, _) in procs.items() if parent in frontier}
        found += [(pid, procs[pid][1]) for pid in frontier]
    return found


def main() -> None:
    threads = os.environ.get("TORCHINDUCTOR_COMPILE_THREADS")
    cpus = len(os.sched_getaffinity(0))
    pool = inductor_config.compile_threads
    print(f"threads setting {threads} compile_threads {pool} cpus {cpus}")
    fn = torch.compile(lambda x: (x.sin() * 2).sum())
    start = time.perf_counter()
    fn(torch.randn(64, device="cuda"))
    torch.cuda.synchronize()
    print(f"first compile {time.perf_counter() - start:.2f} s")
    x = torch.randn(1024, device="cuda")
    for i in range(16):
        kids = descendants()
        start = time.perf_counter()
        for _ in range(200):
            x.add_(1)
        torch.cuda.synchronize()
        us = (time.perf_counter() - start) / 200 * 1e6
        cpu = sum(c for _, c in kids)
        when = f"t={i * 0.5:4.1f}s"
        print(f"{when} children={len(kids)} cpu_s={cpu:6.2f} eager add_ {us:5.1f} us/call")
        time.sleep(0.5)


if __name__ == "__main__":
    main()

"""What a synchronous copy costs on the CPU through HostBackend's copy thread,
against the same copy run by the thread that waits for it (Note [Waiter runs
the copy] in csrc/core/host_backend.cpp).

Each round issues one copy and waits for it at once, after a small matmul (as
between two unpacks: the copy thread has gone back to sleep), alternating the
two ways in one process: ``copy_to_host(...)`` (the worker is woken, the waiter
sleeps until it is done) and ``copy_to_host(..., for_waiter=True)`` (what the
allocation path's synchronous swap-out and an unpack's missed swap-in use).
Prints the median wall time per copy, the median memcpy time inside it (copy
timeline), how many copies the waiter ran, and the ratio of wall times.

    python bench/bench_copy_handoff.py [--kib 64,2048] [--rounds 200]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
import torch  # noqa: E402

from membudget._C import core  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kib", default="64,2048", help="copy sizes in KiB, comma-separated")
    parser.add_argument("--rounds", type=int, default=200, help="copies per size and way")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    torch.set_num_threads(1)
    backend = core.HostBackend(1 << 30)
    a, w = torch.randn(256, 256), torch.randn(256, 512)
    print(f"load average before: {os.getloadavg()[0]:.1f}")
    print("| copy | way | wall per copy (median) | memcpy (median) | run by waiter | wall, worker / waiter |")
    print("|---|---|---|---|---|---|")
    for kib in (int(k) for k in args.kib.split(",")):
        size = kib << 10
        device, host = backend.device_alloc(size), backend.host_alloc(size)
        backend.write_bytes(device, b"\x01" * size)
        walls = {False: [], True: []}
        busy = {False: [], True: []}
        by_waiter = {False: 0, True: 0}
        for _ in range(args.rounds):
            for for_waiter in (False, True):
                backend.set_waiter_runs_copies(for_waiter)
                torch.mm(a, w)
                backend.set_copy_timeline(True)
                start = time.perf_counter()
                backend.copy_to_host(host, device, size, for_waiter=for_waiter).wait()
                walls[for_waiter].append(time.perf_counter() - start)
                timeline = backend.copy_timeline()
                (copy,) = timeline["copies"]
                busy[for_waiter].append(copy[5] - copy[4])
                by_waiter[for_waiter] += timeline["totals"]["copies_by_waiter.d2h"]
        backend.set_copy_timeline(False)
        backend.device_free(device, size)
        backend.host_free(host, size)
        ratio = statistics.median(walls[False]) / statistics.median(walls[True])
        for for_waiter in (False, True):
            print(f"| {kib} KiB | {'for_waiter' if for_waiter else 'worker'} | "
                  f"{statistics.median(walls[for_waiter]) * 1e6:.1f} us | "
                  f"{statistics.median(busy[for_waiter]) * 1e6:.1f} us | {by_waiter[for_waiter]} / {args.rounds} | "
                  f"{f'{ratio:.2f}x' if for_waiter else ''} |")
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

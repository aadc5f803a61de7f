"""What rung 3 of expandable segments costs on the CPU: unmapping free pages
and mapping new ones, against moving the same pages (Note [Page recycling]).

Drives HostBackend's own map_pages / unmap_pages / move_pages (mmap with
MAP_POPULATE, a PROT_NONE mapping over released pages, mremap) over one
reserved range: ``--mib`` MiB in runs of ``--run-kib`` KiB, ``--rounds``
times each, alternating, in one process. Prints milliseconds per round and the
ratio. Then the cost of one cached allocate + deallocate by size with fixed and
with expandable segments (the mapped-page bookkeeping must not grow with the
block's page count).

    python bench/bench_page_moves.py [--mib 116] [--run-kib 1024] [--rounds 5]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
import torch  # noqa: E402,F401  (loads libtorch before the extension)

from membudget._C import core  # noqa: E402

MiB = 1 << 20


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=116, help="MiB of pages per round (default 116)")
    parser.add_argument("--run-kib", type=int, default=1024, help="KiB per contiguous run (default 1024)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of each (default 5)")
    args = parser.parse_args()
    backend = core.HostBackend()
    page = backend.page_bytes()
    run = args.run_kib * 1024
    total = args.mib * MiB
    if run % page or total % run or args.rounds < 1:
        parser.error(f"--run-kib must be a multiple of the {page} B page and divide --mib; --rounds >= 1")
    base = backend.reserve_address_range(2 * total)
    halves = (base, base + total)
    for offset in range(0, total, run):
        assert backend.map_pages(halves[0] + offset, run)

    remap, move = [], []
    side = 0
    for _ in range(args.rounds):
        start = time.perf_counter()  # release every run, then back it again
        for offset in range(0, total, run):
            backend.unmap_pages(halves[side] + offset, run)
        for offset in range(0, total, run):
            assert backend.map_pages(halves[side] + offset, run)
        remap.append(time.perf_counter() - start)
        start = time.perf_counter()  # move every run to the other half
        for offset in range(0, total, run):
            assert backend.move_pages(halves[side] + offset, halves[1 - side] + offset, run)
        move.append(time.perf_counter() - start)
        side = 1 - side
    for offset in range(0, total, run):
        backend.unmap_pages(halves[side] + offset, run)
    backend.release_address_range(base, 2 * total)
    remap_ms, move_ms = statistics.median(remap) * 1e3, statistics.median(move) * 1e3
    print(f"{args.mib} MiB in {args.run_kib} KiB runs, {page} B pages, median of {args.rounds} rounds:")
    print(f"  unmap + map : {remap_ms:8.2f} ms")
    print(f"  move        : {move_ms:8.2f} ms")
    print(f"  ratio       : {remap_ms / move_ms:8.1f}x")

    print("cached allocate + deallocate, microseconds (median of 5 x 2000):")
    print(f"  {'size':>10}  {'fixed':>8}  {'expandable':>10}")
    for size in (64 * 1024, 4 * MiB, 64 * MiB, 256 * MiB):
        cells = []
        for expandable in (False, True):
            allocator = core.CachingAllocator(core.HostBackend(), 4096 * MiB, expandable_segments=expandable)
            allocator.deallocate(allocator.allocate(size))
            rounds = []
            for _ in range(5):
                start = time.perf_counter()
                for _ in range(2000):
                    allocator.deallocate(allocator.allocate(size))
                rounds.append((time.perf_counter() - start) / 2000 * 1e6)
            cells.append(statistics.median(rounds))
        print(f"  {size // 1024:>7} KiB  {cells[0]:8.2f}  {cells[1]:10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

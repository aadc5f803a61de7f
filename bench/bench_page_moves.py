"""What rung 3 of expandable segments costs on the CPU: unmapping free pages
and mapping new ones, against moving the same pages (Note [Page recycling]).

Drives HostBackend's own map_pages / unmap_pages / move_pages (mmap with
MAP_POPULATE, a PROT_NONE mapping over released pages, mremap) over one
reserved range: ``--mib`` MiB in runs of ``--run-kib`` KiB, ``--rounds``
times each, alternating, in one process. Prints milliseconds per round and the
ratio. Then the cost of one cached allocate + deallocate by size with fixed and
with expandable segments (the mapped-page bookkeeping must not grow with the
block's page count). Last, Note [Host pages]: ``--churn-rounds`` rounds that
fill a ``--churn-mib`` MiB budget with small blocks, free a random half and
fill the holes into larger blocks (rung 3 moves pages every round), with the
kernel's 4 KiB pages and with the budget's page: milliseconds per round at
the start and at the end, and the kernel mappings left. With ``--train
MODEL:PERCENT``, a training run of bench_recompute.py's workload at that
fraction of its unmanaged peak (``delta``, both actions, one torch thread,
``--train-steps`` steps) with expandable and with fixed segments, each in a
fresh process: median step time of the first and of the last tenth of the
steps (after two warm-up steps).

    python bench/bench_page_moves.py [--mib 116] [--run-kib 1024] [--rounds 5]
                                     [--churn-rounds 400] [--churn-mib 64]
                                     [--train cnn:70 [--train-steps 60]]
"""
from __future__ import annotations

import argparse
import random
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
    parser.add_argument("--churn-rounds", type=int, default=400, help="rounds of fragmenting churn (default 400)")
    parser.add_argument("--churn-mib", type=int, default=64, help="budget of the churn rounds (default 64)")
    parser.add_argument("--train", metavar="MODEL:PERCENT", help="also time a training run (e.g. cnn:70)")
    parser.add_argument("--train-steps", type=int, default=60, help="steps of that run (default 60)")
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

    if args.churn_rounds >= 10:
        budget = args.churn_mib * MiB
        print(f"{args.churn_rounds} rounds of churn under a {args.churn_mib} MiB budget (Note [Host pages]):")
        print(f"  {'page':>10}  {'ms/round, first tenth':>21}  {'last tenth':>10}  {'kernel mappings left':>20}")
        pages = (page, core.HostBackend.segment_page_for(budget))
        for segment_page in pages:
            first, last, mappings = churn(budget, segment_page, args.churn_rounds, straddle=2 * max(pages))
            print(f"  {segment_page // 1024:>6} KiB  {first:21.2f}  {last:10.2f}  {mappings:20d}")
    if args.train:
        model, _, percent = args.train.partition(":")
        if not percent.isdigit() or args.train_steps < 22:
            parser.error("--train takes MODEL:PERCENT (e.g. cnn:70), with --train-steps of at least 22")
        train(model, int(percent) / 100, args.train_steps)
    return 0


def train(model: str, fraction: float, steps: int) -> None:
    """The ``--train`` runs: expandable then fixed segments, fresh processes."""
    from membudget import harness

    worker = [sys.executable, str(Path(__file__).resolve().parent / "bench_recompute.py")]
    base = dict(model=model, steps=steps, size="default", device="cpu", threads=1)
    peak_run = harness.spawn_worker(worker, harness.RunSpec(mode="unbudgeted", actions="swap", **base))
    if "error" in peak_run:
        print(f"{model}: unbudgeted run failed: {peak_run['error']}")
        return
    budget = int(peak_run["stats"]["reserved_bytes.all.peak"] * fraction)
    print(f"{model} at {fraction:.0%} of its peak ({budget / MiB:.1f} MiB), {steps} steps, ms per step:")
    print(f"  {'segments':>10}  {'first tenth':>11}  {'last tenth':>10}  {'MiB of pages moved per step':>27}")
    for expandable in (True, False):
        run = harness.spawn_worker(worker, harness.RunSpec(mode="managed", budget=budget, policy="delta",
                                                           actions="both", expandable_segments=expandable,
                                                           **base), timeout=1800)
        if "error" in run:
            print(f"  {'expandable' if expandable else 'fixed':>10}  failed: {run['error']}")
            continue
        times = run["step_seconds"][2:]
        tenth = max(1, len(times) // 10)
        moved = run["stats"].get("moved_bytes_total", 0) / MiB / steps
        print(f"  {'expandable' if expandable else 'fixed':>10}  {statistics.median(times[:tenth]) * 1e3:11.1f}  "
              f"{statistics.median(times[-tenth:]) * 1e3:10.1f}  {moved:27.1f}")


def kernel_mappings() -> int:
    with open("/proc/self/maps") as maps:
        return sum(1 for _ in maps)


def churn(budget: int, segment_page: int, rounds: int, straddle: int):
    """``rounds`` rounds under ``budget``: small blocks up to the budget, a
    random half freed, larger blocks into the holes (pages move at rung 3),
    all freed. Each block counts ``straddle`` bytes more against the budget
    (the pages its ends may share), so both page sizes make the same
    requests. Returns the median milliseconds per round of the first and of
    the last tenth of the rounds, and the kernel mappings the allocator's
    segments added."""
    before = kernel_mappings()
    allocator = core.CachingAllocator(core.HostBackend(), budget, expandable_segments=True,
                                      segment_page_bytes=segment_page)
    rng = random.Random(0)
    seconds = []
    for _ in range(rounds):
        start = time.perf_counter()
        blocks, used = [], 0
        for low, high in ((64, 1024), (1024, 3072)):
            size = rng.randrange(low, high) * 1024
            while used + size + straddle <= budget - 2 * MiB:
                blocks.append((allocator.allocate(size), size + straddle))
                used += size + straddle
                size = rng.randrange(low, high) * 1024
            if low == 64:
                rng.shuffle(blocks)
                half = len(blocks) // 2
                for address, size_ in blocks[:half]:
                    allocator.deallocate(address)
                    used -= size_
                blocks = blocks[half:]
        for address, _ in blocks:
            allocator.deallocate(address)
        seconds.append(time.perf_counter() - start)
    mappings = kernel_mappings() - before
    tenth = max(1, rounds // 10)
    return statistics.median(seconds[:tenth]) * 1e3, statistics.median(seconds[-tenth:]) * 1e3, mappings


if __name__ == "__main__":
    sys.exit(main())

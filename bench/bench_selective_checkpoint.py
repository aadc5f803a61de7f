"""Selective activation checkpointing under a budget: the test model of
tests/test_checkpoint_regions.py (four blocks, a policy that keeps matrix
products) trained 3 steps at shares of its own selectively checkpointed
peak, with its regions kept as torch's (``checkpoint="keep"``) and run as
plain code under the policy as a plan (``replace``; Note [Selective
checkpoints as a plan] in python/membudget/_checkpoint_regions.py). Each
cell: planned drops / replays / swaps of a run that fitted and trained bit
for bit as plain PyTorch's selectively checkpointed run, OOM where it ran
out of memory, DIFF where it fitted with other results.

    MEMBUDGET_LINEAGE={cxx,python} PYTHONPATH=python python bench/bench_selective_checkpoint.py

Then the step time, median of 10 steps after 2 warm-up steps, side by side
in this process: plain PyTorch's selective checkpoint, and membudget at
twice the peak (no eviction needed) with the regions kept and replaced, as
ratios to the plain run.
"""
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "python"), str(ROOT / "tests")]

import torch  # noqa: E402

import membudget  # noqa: E402
from test_checkpoint_regions import _SelectivelyCheckpointed, _selective_batch, _selective_loss  # noqa: E402
from training import assert_identical, run_managed, run_plain  # noqa: E402

SHARES = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def main() -> int:
    reference = run_plain(_SelectivelyCheckpointed, _selective_batch, _selective_loss, 3)
    peak = run_managed(_SelectivelyCheckpointed, _selective_batch, _selective_loss, 3, budget=None,
                       min_tensor_bytes=0).stats["reserved_bytes.all.peak"]
    recorder = os.environ.get("MEMBUDGET_LINEAGE", "default")
    print(f"# selectively checkpointed peak {peak / 2**20:.2f} MiB; recorder {recorder}")
    print("| checkpoint | actions | " + " | ".join(str(s) for s in SHARES) + " |")
    print("|---|---|" + "---|" * len(SHARES))
    for mode, actions in [("keep", "both"), ("replace", "both"), ("replace", "recompute"), ("replace", "swap")]:
        cells = []
        for share in SHARES:
            try:
                run = run_managed(_SelectivelyCheckpointed, _selective_batch, _selective_loss, 3,
                                  budget=int(peak * share), min_tensor_bytes=0, actions=actions, checkpoint=mode)
            except torch.OutOfMemoryError:
                membudget.uninstall()
                cells.append("OOM")
                continue
            try:
                assert_identical(reference, run)
                stats = run.stats
                cells.append(f"{stats['planned_drops']}/{stats['recompute_count']}/{stats['swap_out_count']}")
            except AssertionError:
                cells.append("DIFF")
        print(f"| {mode} | {actions} | " + " | ".join(cells) + " |", flush=True)
    plain = _median_step_seconds(None)
    print("\n| run | median step | ratio to plain |\n|---|---|---|")
    print(f"| plain PyTorch, selective checkpoint | {plain * 1e3:.1f} ms | 1.00x |")
    for mode in ("keep", "replace"):
        seconds = _median_step_seconds(dict(budget=2 * peak, min_tensor_bytes=0, checkpoint=mode))
        print(f"| membudget, 2x the peak, checkpoint={mode} | {seconds * 1e3:.1f} ms | {seconds / plain:.2f}x |",
              flush=True)
    return 0


def _median_step_seconds(install, steps: int = 12) -> float:
    """Median time of a training step after 2 warm-up steps."""
    if install is not None:
        membudget.install(**install)
    try:
        torch.manual_seed(0)
        model = _SelectivelyCheckpointed()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        times = []
        for _ in range(steps):
            inputs = _selective_batch()
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            _selective_loss(model, inputs).backward()
            optimizer.step()
            times.append(time.perf_counter() - start)
        return statistics.median(times[2:])
    finally:
        if install is not None:
            membudget.uninstall()


if __name__ == "__main__":
    sys.exit(main())

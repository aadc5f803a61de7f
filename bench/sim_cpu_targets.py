"""Issue 3's CPU target (`delta` no slower than `dtr` at 70/50/40% of the
unmanaged peak) on modelled time: bench_recompute.py's workloads, traced for
real on this machine, replayed through the real policies over the `cpu-host`
device model. Timed CPU runs differ by more than the 1-4% this target turns
on (bench/RESULTS.md, "paired rounds"); the simulation is deterministic once
its two inputs are fixed, so they are kept:

* the traces (measured op durations), in ``--cache`` as ``<model>.trace``;
* the calibrated device model (link rate alone, beside compute, both
  directions), in ``--cache`` as ``cpu-host.json``.

Delete them to re-measure. Prints, per cell, each policy's modelled step time
over plain PyTorch's, its stall split into unpack waits and the rest (copy-outs
and waits on the allocation path), recompute time and bytes swapped out.

    PYTHONPATH=python python bench/sim_cpu_targets.py [--models gpt2,cnn,lstm] [--cache DIR] [--iterations N]

``--iterations`` (default 2) is ``simulate``'s, as in ``sim_targets.py``: the
step runs N times and the last is measured (docs/simulator.md).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import mmap
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

from membudget import costs  # noqa: E402
from membudget.simulate import simulate  # noqa: E402
from membudget.trace import Trace  # noqa: E402

BUDGETS = ["70%", "50%", "40%"]
POLICIES = ["delta", "dtr", "msps", "lru", "largest"]
MIN_TENSOR_BYTES = 16 * 1024  # bench_recompute.py's runs (membudget.harness)


def cached_device(cache: Path) -> costs.DeviceModel:
    path = cache / "cpu-host.json"
    if not path.exists():
        print("calibrating cpu-host (once; kept in", path, ")", flush=True)
        # At the runs' thread count: with two torch threads on two cores the
        # copy thread takes a core from compute (Note [Compute beside a
        # copy]: x0.44 against x0.90 at one thread, the runs' count).
        torch.set_num_threads(1)
        path.write_text(json.dumps(dataclasses.asdict(costs.device_model("cpu-host"))))
    fields = json.loads(path.read_text())
    fields.setdefault("copies_ahead", False)  # kept before the field existed: cpu-host never copies ahead
    if fields.get("page_bytes") == mmap.PAGESIZE:
        fields["page_bytes"] = 0  # kept before Note [Host pages]: the host backend's page for each budget
    return costs.DeviceModel(**fields)


def cached_trace(cache: Path, name: str) -> Trace:
    path = cache / f"{name}.trace"
    if not path.exists():
        import bench_recompute
        from bench_simulate import _trace_workload

        print(f"tracing {name} (once; kept in {path})", flush=True)
        torch.set_num_threads(1)  # as bench_recompute.py's runs
        _trace_workload(bench_recompute.WORKLOADS[name]["default"]()).save(path)
    return Trace.load(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="gpt2,cnn,lstm")
    parser.add_argument("--cache", default=str(ROOT / "build" / "sim_cpu_targets"),
                        help="where the traces and the calibrated device model are kept")
    parser.add_argument("--iterations", type=int, default=2, help="steps run per point; the last is measured")
    args = parser.parse_args()
    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    device = cached_device(cache)
    print(f"device: {device.note}\n")
    print("| model | budget | policy | step / plain | unpack stall ms | other stall ms | recompute ms | swap MiB |")
    print("|---|---|---|---|---|---|---|---|")
    met = total = 0
    for name in args.models.split(","):
        rows = simulate(cached_trace(cache, name), BUDGETS, POLICIES, device, baselines=(),
                        min_tensor_bytes=MIN_TENSOR_BYTES, iterations=args.iterations)
        by_budget: dict = {}
        for row in rows:
            by_budget.setdefault(row.budget_bytes, {})[row.policy] = row
        for budget_label, (budget, cell) in zip(BUDGETS, by_budget.items()):
            for policy in POLICIES:
                r = cell[policy]
                if not r.feasible:
                    print(f"| {name} | {budget_label} | {policy} | infeasible | | | | |")
                    continue
                print(f"| {name} | {budget_label} | {policy} | {r.overhead_ratio:.4f} | {r.unpack_stall_s * 1e3:.2f} | "
                      f"{(r.stall_s - r.unpack_stall_s) * 1e3:.2f} | {r.recompute_s * 1e3:.2f} | "
                      f"{r.swap_bytes / 2**20:.0f} |", flush=True)
            delta, dtr = cell["delta"], cell["dtr"]
            if delta.feasible and dtr.feasible:
                total += 1
                met += delta.overhead_ratio <= dtr.overhead_ratio
    print(f"\ndelta no slower than dtr: {met}/{total} feasible cells")
    return 0


if __name__ == "__main__":
    sys.exit(main())

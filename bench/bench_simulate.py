"""Simulator benchmark: validation against real CPU runs, and the policy table on h200.

    python bench/bench_simulate.py validate [--quick] [--actions both]  # cpu-host predictions vs real runs
    python bench/bench_simulate.py table [--models gpt2,bert,...] [--budgets 80%,60%,40%]

``validate``: for each workload of membudget.models, real runs in fresh
processes (membudget.harness: plain, unbudgeted, managed at each budget with
the delta policy, one torch thread), and beside them a trace of the same step
(real tensors, measured op durations, one thread) simulated with the
``cpu-host`` device model at the same budgets and settings. Prints predicted
and measured peak reserved bytes, bytes swapped per step, and predicted stall +
recompute against the measured stall per step (the run's counters over its
steps, divided by their number) and the measured step-time overhead over the
plain run (medians).

``table``: each model of membudget.sim_models traced on fake tensors and
simulated on ``h200`` at each budget (percent of its unbudgeted peak) under
every policy and baseline, with the optimal floor; prints step time as a
ratio to the floor.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))

import torch  # noqa: E402

import membudget  # noqa: E402
from membudget import harness, models  # noqa: E402
from membudget.simulate import simulate, unbudgeted_peak  # noqa: E402

MiB = 2**20


def _trace_workload(workload):
    """A real-tensor trace of one harness step (zero_grad, forward, backward,
    Adam step), after one unrecorded step that creates the optimizer state."""
    torch.manual_seed(0)

    def setup():
        model = workload.build()
        model.train()
        return model, torch.optim.Adam(model.parameters(), lr=1e-3)

    def step(state):
        model, optimizer = state
        optimizer.zero_grad(set_to_none=True)
        workload.loss(model, workload.batch(torch.device("cpu"))).backward()
        optimizer.step()

    return membudget.trace(step, setup=setup, warmup=1, metadata={"model": workload.name})


def validate(size: str, fractions, steps: int, actions: str = "swap") -> None:
    """Print the validation table (see module doc)."""
    import os

    torch.set_num_threads(1)
    os.environ["MEMBUDGET_ACTIONS"] = actions  # the workers read it in install()
    command = [sys.executable, "-m", "membudget.demo"]
    print("| model | budget | peak predicted | peak measured | error | swapped predicted | swapped measured | "
          "stall+recompute predicted | unpack stall predicted | unpack stall measured | step overhead measured |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in ("gpt", "cnn"):
        workload = models.WORKLOADS[name][size]()
        base = dict(model=name, size=size, steps=steps, threads=1)
        plain = harness.spawn_worker(command, harness.RunSpec(mode="plain", **base))
        free = harness.spawn_worker(command, harness.RunSpec(mode="unbudgeted", **base))
        if "error" in plain or "error" in free:
            print(f"| {name} | run failed: {plain.get('error') or free.get('error')} |")
            continue
        peak = free["stats"]["reserved_bytes.all.peak"]
        trace = _trace_workload(workload)
        budgets = [int(f * peak) for f in fractions]
        predicted = {r.budget_bytes: r for r in simulate(
            trace, [peak, *budgets], ["delta"], "cpu-host", baselines=(),
            min_tensor_bytes=harness.DEFAULT_MIN_TENSOR_BYTES, actions=actions)}
        for fraction, budget in zip([1.0, *fractions], [peak, *budgets]):
            if fraction == 1.0:
                real = free
            else:
                real = harness.spawn_worker(command, harness.RunSpec(mode="managed", budget=budget, policy="delta",
                                                                     **base))
            p = predicted[budget]
            if "error" in real:
                print(f"| {name} | {fraction:.0%} | {p.peak_reserved_bytes / MiB:.1f} MiB | run failed | | | | |")
                continue
            measured = real["stats"]["reserved_bytes.all.peak"]
            # The run's counters cover all its steps: per step, to compare with one simulated step.
            swapped = (real["stats"]["swap_out_bytes"] + real["stats"]["swap_in_bytes"]) / steps
            stall = real["stats"]["stall_seconds"] / steps
            overhead = real["median_step_s"] - plain["median_step_s"]
            print(f"| {name} | {fraction:.0%} ({budget / MiB:.1f} MiB) | "
                  f"{p.peak_reserved_bytes / MiB:.1f} MiB{'' if p.feasible else ' (OOM)'} | "
                  f"{measured / MiB:.1f} MiB | {(p.peak_reserved_bytes - measured) / measured:+.1%} | "
                  f"{p.swap_bytes / MiB:.0f} MiB | {swapped / MiB:.0f} MiB | "
                  f"{(p.stall_s + p.recompute_s) * 1e3:.1f} ms | {p.unpack_stall_s * 1e3:.1f} ms | "
                  f"{stall * 1e3:.1f} ms | "
                  f"{overhead * 1e3:.1f} ms (plain step {plain['median_step_s'] * 1e3:.0f} ms, "
                  f"predicted step {p.step_s * 1e3:.0f} ms) |")
        sys.stdout.flush()


def table(names, budgets, device: str) -> None:
    """Print the policy table on ``device`` (see module doc)."""
    from membudget.sim_models import trace_model

    for name in names:
        start = time.perf_counter()
        trace = trace_model(name)
        traced = time.perf_counter() - start
        rows = simulate(trace, budgets, device=device, floor=True)
        peak = unbudgeted_peak(trace, device)
        meta = trace.metadata
        print(f"\n**{name}** (batch {meta['batch']}, seq/image {meta['seq']}, {meta['dtype']}; "
              f"{len(trace.ops)} ops; unbudgeted peak {peak / 2**30:.1f} GiB; traced in {traced:.1f} s, "
              f"simulated in {time.perf_counter() - start - traced:.1f} s)\n")
        policies = list(dict.fromkeys(r.policy for r in rows))
        sizes = list(dict.fromkeys(r.budget_bytes for r in rows))
        print("| budget | floor step | " + " | ".join(policies) + " |")
        print("|---|---|" + "---|" * len(policies))
        for b, label in zip(sizes, budgets):
            cells = []
            for p in policies:
                r = next(r for r in rows if r.policy == p and r.budget_bytes == b)
                cells.append(f"{r.overhead_ratio:.2f}" if r.feasible else "OOM")
            floor = next(r.floor_s for r in rows if r.budget_bytes == b)
            floor_text = f"{floor * 1e3:.1f} ms" if floor is not None else "infeasible"
            print(f"| {label} ({b / 2**30:.1f} GiB) | {floor_text} | " + " | ".join(cells) + " |")
        sys.stdout.flush()


def main() -> int:
    """Parse the command line and run ``validate`` or ``table``."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    v = sub.add_parser("validate")
    v.add_argument("--quick", action="store_true", help="the small test-sized workloads")
    v.add_argument("--steps", type=int, default=5)
    v.add_argument("--actions", default="both", choices=("swap", "recompute", "both"))
    t = sub.add_parser("table")
    t.add_argument("--models", default="gpt2,bert,resnet50,lstm-nmt,llama-7b")
    t.add_argument("--budgets", default="80%,60%,40%")
    t.add_argument("--device", default="h200")
    args = parser.parse_args()
    if args.command == "validate":
        validate("quick" if args.quick else "default", (0.8, 0.6, 0.5), args.steps, args.actions)
    else:
        table(args.models.split(","), args.budgets.split(","), args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())

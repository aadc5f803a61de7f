"""Recompute ahead of use (issue 3 part 7, MEMBUDGET_RECOMPUTE_AHEAD): on against off, side by side.

    python bench/bench_recompute_ahead.py sim [--models gpt2,bert,resnet50,lstm-nmt,llama-7b]
                                              [--budgets 80%,60%,40%] [--overlaps 0,0.25,0.5,1]
    python bench/bench_recompute_ahead.py cpu [--quick] [--steps 6] [--cells gpt2:70,gpt2:50,...]

``sim``: each model of ``membudget simulate`` (fake-tensor traces) on the
``h200`` device model, ``delta`` with ``actions`` recompute and both, at each
budget: modelled step time with recompute-ahead off, and on with each assumed
side-stream overlap (Note [Side stream contention] in csrc/core/sim_backend.h:
the share of a side-stream replay that backward's kernels leave room for; 0
is the pessimistic bound, 1 a free side stream). Deterministic.

``cpu``: bench_recompute.py's cells that recompute (``delta``, actions
recompute and both), each run three ways in fresh processes one after the
other between two plain runs: off, on (the CPU default timing: replays ahead
only while backward would wait for a swap-in copy) and on with ``immediate``
timing (at the prefetch point, on the thread that runs backward). Step time
ratios are to the mean of the plain runs around the group, as in
bench_recompute.py; ``ahead`` is ``recomputed_ahead_count`` of the run.
"""
from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

MiB = 1 << 20
VARIANTS = (("off", "off"), ("on", "on"), ("immediate", "immediate"))
DEFAULT_CELLS = "gpt2:70,gpt2:50,gpt2:40,cnn:70,cnn:50,lstm:70"


def bench_sim(args) -> None:
    from membudget.sim_models import SIM_MODELS, trace_model
    from membudget.simulate import simulate

    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in SIM_MODELS]
    if unknown:
        raise SystemExit(f"unknown models {unknown}; known: {', '.join(sorted(SIM_MODELS))}")
    budgets = [b.strip() for b in args.budgets.split(",") if b.strip()]
    overlaps = [float(o) for o in args.overlaps.split(",")]
    print(f"python bench/bench_recompute_ahead.py sim --models {','.join(models)} --budgets {','.join(budgets)} "
          f"--overlaps {args.overlaps} --device {args.device}\n")
    print("| model | budget | actions | off: step ms (recomputes, recompute ms, stall ms) | "
          + " | ".join(f"on, overlap {o:g}: step ratio (ahead/recomputes, stall ms)" for o in overlaps) + " |")
    print("|---|---|---|---|" + "---|" * len(overlaps))
    for name in models:
        trace = trace_model(name)
        for actions in ("recompute", "both"):
            off = simulate(trace, budgets, ["delta"], args.device, baselines=(), actions=actions)
            ons = [simulate(trace, budgets, ["delta"], args.device, baselines=(), actions=actions,
                            recompute_ahead=True, side_stream_overlap=o) for o in overlaps]
            for i, label in enumerate(budgets):
                base = off[i]
                if not base.feasible:
                    cells = ["OOM"]
                else:
                    cells = [f"{base.step_s * 1e3:.1f} ({base.recompute_count}, {base.recompute_s * 1e3:.1f}, "
                             f"{base.stall_s * 1e3:.1f})"]
                for rows in ons:
                    r = rows[i]
                    if not r.feasible:
                        cells.append("OOM")
                    elif not base.feasible:
                        cells.append(f"{r.step_s * 1e3:.1f} ms ({r.recomputed_ahead_count}/{r.recompute_count})")
                    else:
                        cells.append(f"{r.step_s / base.step_s:.3f} ({r.recomputed_ahead_count}/{r.recompute_count}, "
                                     f"{r.stall_s * 1e3:.1f})")
                print(f"| {name} | {label} ({base.budget_bytes / 2**30:.1f} GiB) | {actions} | " + " | ".join(cells)
                      + " |", flush=True)


def bench_cpu(args, argv: List[str]) -> int:
    import bench_recompute as br
    from bench_swap import machine_line

    args.models = "gpt2,cnn,lstm"
    args.plain_every = len(VARIANTS)
    args.threads = 1
    args.timeout = 300.0
    args.steps = args.steps or (3 if args.quick else 6)
    args.warmup = 1 if args.quick else 2
    cells: Dict[str, List[float]] = {}
    for cell in args.cells.split(","):
        model, percent = cell.strip().split(":")
        cells.setdefault(model, []).append(int(percent) / 100)
    started = time.perf_counter()
    rows: List[Dict[str, Any]] = []
    class AheadBench(br.ModelBench):
        def _finish(self, row, result, plain_s):
            super()._finish(row, result, plain_s)
            if "error" not in result:
                stats = result["stats"]
                row["ahead"] = int(stats.get("recomputed_ahead_count", 0))
                row["ahead_failed"] = int(stats.get("recompute_ahead_failed", 0))
                row["ahead_wasted"] = int(stats.get("recompute_ahead_wasted", 0))
                row["stall_ms"] = float(stats.get("stall_seconds", 0.0)) * 1e3 / args.steps

    for model, fractions in cells.items():
        bench = AheadBench(model, args)
        unbudgeted = bench.spawn(mode="unbudgeted", actions="swap")
        if "error" in unbudgeted:
            print(f"[{model}] unbudgeted run failed: {unbudgeted['error']}")
            continue
        peak = int(unbudgeted["stats"]["reserved_bytes.all.peak"])
        bench.plain_run()
        for fraction in fractions:
            for actions in ("recompute", "both"):
                for label, setting in VARIANTS:
                    row = bench.measure({"budget_label": f"{fraction:.0%}", "policy": f"delta ahead={label}",
                                         "actions": actions},
                                        mode="managed", budget=int(peak * fraction), policy="delta",
                                        actions=actions, recompute_ahead=setting)
                    row["_ahead_run"] = True
        bench.close()
        rows.extend(bench.rows)
        plain_spread = [round(br.step_seconds(p, args.warmup), 4) for p in bench.plains]
        rows.append({"_spread": f"{model}: plain step-time medians {plain_spread} s"})
    elapsed = time.perf_counter() - started
    command = "python " + " ".join(shlex.quote(a) for a in ["bench/bench_recompute_ahead.py", *argv])
    print(f"\n{command}\n{machine_line('cpu', 1)}; {args.steps} steps per run, median after {args.warmup}; "
          f"{elapsed:.0f} s in all\n")
    print("| model | budget | actions | variant | step ratio | recomputes | ahead (failed, wasted) | "
          "unpack stall ms/step | identical |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        if "_spread" in row or not row.get("_ahead_run"):
            continue
        variant = row["policy"].split("=", 1)[1]
        if "error" in row:
            print(f"| {row['model']} | {row['budget_label']} | {row['actions']} | {variant} | "
                  f"{'OOM' if 'out of memory' in row['error'] else 'FAILED'} | | | | |")
            continue
        print(f"| {row['model']} | {row['budget_label']} | {row['actions']} | {variant} | {row['ratio']:.2f}x | "
              f"{row['recompute_count']} | {row.get('ahead', 0)} ({row.get('ahead_failed', 0)}, "
              f"{row.get('ahead_wasted', 0)}) | {row.get('stall_ms', 0.0):.1f} | "
              f"{'yes' if row['identical'] else 'NO'} |")
    print("")
    for row in rows:
        if "_spread" in row:
            print(row["_spread"])
    errors = [r for r in rows if "error" in r]
    for r in errors:
        print(f"- {r['model']} {r['budget_label']} {r['policy']}/{r['actions']}: {r['error'].splitlines()[0]}")
    return 1 if any(r.get("_ahead_run") and "error" not in r and not r["identical"] for r in rows) else 0


def main() -> int:
    argv = sys.argv[1:]
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("sim")
    s.add_argument("--models", default="gpt2,bert,resnet50,lstm-nmt,llama-7b")
    s.add_argument("--budgets", default="80%,60%,40%")
    s.add_argument("--overlaps", default="0,0.25,0.5,1")
    s.add_argument("--device", default="h200")
    c = sub.add_parser("cpu")
    c.add_argument("--quick", action="store_true", help="test-sized models")
    c.add_argument("--steps", type=int, default=None)
    c.add_argument("--cells", default=DEFAULT_CELLS, help="model:percent list (default %(default)s)")
    args = parser.parse_args(argv)
    if args.command == "sim":
        bench_sim(args)
        return 0
    return bench_cpu(args, argv)


if __name__ == "__main__":
    sys.exit(main())

"""Decision logs of real runs: ``delta`` and ``dtr`` on one of
bench_recompute.py's workloads at a fraction of its unmanaged peak, each in a
fresh worker process (bench_recompute.py's, 1 torch thread) with
``MEMBUDGET_LOG=decisions``. Prints the swap-out bytes after every step (what
the timed head-to-head reports per run) and writes each policy's log, for
reading which evictions and background copy-outs a step made.

    PYTHONPATH=python python bench/log_pair.py lstm 0.7 [--steps 6] [--out DIR]

Counters, not timings: the copies a policy makes are what it chose, whatever
the machine's load did to the step time (a background copy's start still
depends on when earlier ones finished).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))

from membudget import harness  # noqa: E402

WORKER = [sys.executable, str(ROOT / "bench" / "bench_recompute.py")]
MiB = 1 << 20


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a bench_recompute.py workload: gpt2, cnn, lstm")
    parser.add_argument("fraction", type=float, help="budget as a fraction of the unmanaged peak")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", default=".", help="where <model>-<policy>.log are written")
    args = parser.parse_args()
    base = dict(model=args.model, steps=args.steps, size="default", device="cpu", threads=1)
    peak_run = harness.spawn_worker(WORKER, harness.RunSpec(mode="unbudgeted", actions="swap", **base))
    if "error" in peak_run:
        print(peak_run["error"])
        return 1
    peak = int(peak_run["stats"]["reserved_bytes.all.peak"])
    budget = int(peak * args.fraction)
    print(f"{args.model}: unmanaged peak {peak / MiB:.1f} MiB, budget {budget} bytes")
    env = dict(os.environ, MEMBUDGET_LOG="decisions",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "python"), os.environ.get("PYTHONPATH")])))
    for policy in ("delta", "dtr"):
        spec = harness.RunSpec(mode="managed", budget=budget, policy=policy, actions="both", **base)
        proc = subprocess.run([*WORKER, "--worker", spec.to_json()], env=env, capture_output=True, text=True)
        log = Path(args.out) / f"{args.model}-{policy}.log"
        log.write_text(proc.stderr)
        results = [json.loads(line[len(harness._RESULT_PREFIX):]) for line in proc.stdout.splitlines()
                   if line.startswith(harness._RESULT_PREFIX)]
        if not results:
            print(f"{policy}: no result (see {log})")
            continue
        steps = results[-1]["step_stats"]
        out = [s["swap_out_bytes"] / MiB for s in steps]
        per_step = [round(b - a, 1) for a, b in zip([0.0, *out], out)]
        print(f"{policy}: swap-out MiB per step {per_step}, per run {out[-1]:.1f}, "
              f"recomputes {steps[-1]['recompute_count']}; log {log}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The prefetch window (MEMBUDGET_PREFETCH_BYTES) at GPU scale, simulated.

For each model of ``membudget simulate`` (traced with fake tensors) and each
budget, the simulated step time and stall of ``delta`` and ``dtr`` on the
``h200`` device model with each window, side by side. Deterministic (the
simulator's clock is modelled), so it runs on any machine. The default window
(256 MiB, capped at a quarter of the budget) is changed only if a larger one
is better everywhere; see bench/RESULTS.md.

    python bench/bench_prefetch_window.py [--models gpt2,bert,resnet50,llama-7b] [--windows 256MiB,1GiB,4GiB]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

from membudget.config import parse_bytes  # noqa: E402
from membudget.sim_models import SIM_MODELS, trace_model  # noqa: E402
from membudget.simulate import simulate  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="gpt2,bert,resnet50,llama-7b", help="comma-separated SIM_MODELS names")
    parser.add_argument("--windows", default="256MiB,1GiB,4GiB", help="comma-separated prefetch windows")
    parser.add_argument("--budgets", default="80%,60%,40%", help="comma-separated budgets")
    parser.add_argument("--device", default="h200", help="device model (default h200)")
    args = parser.parse_args()
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in SIM_MODELS]
    if unknown:
        parser.error(f"unknown models {unknown}; known: {', '.join(sorted(SIM_MODELS))}")
    windows = [parse_bytes(w.strip(), "--windows") for w in args.windows.split(",") if w.strip()]
    budgets = [b.strip() for b in args.budgets.split(",") if b.strip()]
    print(f"python bench/bench_prefetch_window.py --models {','.join(models)} --windows {args.windows} "
          f"--budgets {','.join(budgets)} --device {args.device}")
    print("\n| model | budget | policy | " + " | ".join(f"{w >> 20} MiB: step ms (stall ms)" for w in windows) + " |")
    print("|---|---|---|" + "---|" * len(windows))
    for name in models:
        trace = trace_model(name)
        cells = {}
        for window in windows:
            for row in simulate(trace, budgets, ["delta", "dtr"], args.device, baselines=(), prefetch_bytes=window):
                step = (row.compute_s + row.stall_s + row.recompute_s) * 1e3
                text = f"{step:.1f} ({row.stall_s * 1e3:.1f})" if row.feasible else "OOM"
                cells.setdefault((row.budget_bytes, row.policy), []).append(text)
        for (budget, policy), texts in sorted(cells.items(), key=lambda item: (-item[0][0], item[0][1])):
            print(f"| {name} | {budget / 2**30:.1f} GiB | {policy} | " + " | ".join(texts) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

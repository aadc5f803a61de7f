"""Issue 4's two policy targets on `h200`, to four decimals: `delta`'s
overhead ratio to the optimal floor (target: at most 1.10) and against
`dtr` (target: no worse), at 80/60/40% of each model's unbudgeted peak.
The same simulation as ``bench_simulate.py table`` for those two policies.

    PYTHONPATH=python python bench/sim_targets.py [--iterations N]

``--iterations`` (default 2) is ``simulate``'s: the step runs N times and the
last is measured (docs/simulator.md).
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

from membudget.sim_models import trace_model  # noqa: E402
from membudget.simulate import simulate  # noqa: E402

MODELS = ["gpt2", "bert", "resnet50", "lstm-nmt", "llama-7b"]


def main() -> int:
    parser = argparse.ArgumentParser(description="issue 4's policy targets on h200")
    parser.add_argument("--iterations", type=int, default=2, help="steps run per point; the last is measured")
    iterations = parser.parse_args().iterations
    within = worse = total = 0
    print("| model | budget | delta | dtr | within 1.10x | no worse than dtr |\n|---|---|---|---|---|---|")
    for name in MODELS:
        rows = simulate(trace_model(name), ["80%", "60%", "40%"], ["delta", "dtr"], "h200", baselines=(), floor=True,
                        iterations=iterations)
        by_budget = {}
        for row in rows:
            by_budget.setdefault(row.budget_bytes, {})[row.policy] = row
        for budget, cell in by_budget.items():
            delta, dtr = cell["delta"], cell["dtr"]
            if not delta.feasible or delta.floor_s is None:
                continue
            total += 1
            ok_floor = delta.overhead_ratio <= 1.10
            ok_dtr = delta.overhead_ratio <= dtr.overhead_ratio
            within += ok_floor
            worse += not ok_dtr
            print(f"| {name} | {budget / 2**30:.1f} GiB | {delta.overhead_ratio:.4f} | {dtr.overhead_ratio:.4f} | "
                  f"{'yes' if ok_floor else 'no'} | {'yes' if ok_dtr else 'no'} |", flush=True)
    print(f"\nwithin 1.10x of the floor: {within}/{total}; no worse than dtr: {total - worse}/{total}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Issue 4's two policy targets, to four decimals: `delta`'s overhead ratio
to the optimal floor (target: at most 1.10) and against `dtr` (target: no
worse), per model and budget. By default on `h200` at 80/60/40% of each
model's unbudgeted peak, issue 4's table; the same simulation as
``bench_simulate.py table`` for those two policies. Other devices and
budgets show where the targets hold beyond it.

    PYTHONPATH=python python bench/sim_targets.py [--iterations N]
    PYTHONPATH=python python bench/sim_targets.py --device rtx4090 --budgets 80%,60%,40%,30% \\
        --models gpt2,bert,resnet50:32,lstm-nmt

``--iterations`` (default 2) is ``simulate``'s: the step runs N times and the
last is measured (docs/simulator.md). A model may carry its batch size after
a colon (``resnet50:32``); otherwise its default batch is traced.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

from membudget.sim_models import SIM_MODELS, trace_model  # noqa: E402
from membudget.simulate import simulate  # noqa: E402

MODELS = ["gpt2", "bert", "resnet50", "lstm-nmt", "llama-7b"]


def _model_and_batch(spec: str):
    name, _, batch = spec.partition(":")
    if name not in SIM_MODELS:
        raise SystemExit(f"unknown model {name!r}: known are {', '.join(SIM_MODELS)}")
    if batch and (not batch.isdigit() or int(batch) < 1):
        raise SystemExit(f"bad batch size in {spec!r}: expected a positive integer after the colon")
    return name, int(batch) if batch else None


def main() -> int:
    parser = argparse.ArgumentParser(description="issue 4's policy targets (default: h200, its table)")
    parser.add_argument("--iterations", type=int, default=2, help="steps run per point; the last is measured")
    parser.add_argument("--device", default="h200", help="device model (default h200)")
    parser.add_argument("--budgets", default="80%,60%,40%", help="comma list of budgets (default 80%%,60%%,40%%)")
    parser.add_argument("--models", default=",".join(MODELS), help="comma list of models, each optionally NAME:BATCH")
    args = parser.parse_args()
    models = [_model_and_batch(spec) for spec in args.models.split(",") if spec]
    budgets = [b for b in args.budgets.split(",") if b]
    within = worse = total = 0
    print(f"device {args.device}, {args.iterations} iterations")
    print("| model | budget | delta | dtr | within 1.10x | no worse than dtr |\n|---|---|---|---|---|---|")
    for name, batch in models:
        label = f"{name}:{batch}" if batch else name
        rows = simulate(trace_model(name, batch=batch), budgets, ["delta", "dtr"], args.device, baselines=(),
                        floor=True, iterations=args.iterations)
        by_budget = {}
        for row in rows:
            by_budget.setdefault(row.budget_bytes, {})[row.policy] = row
        for budget, cell in by_budget.items():
            delta, dtr = cell["delta"], cell["dtr"]
            if not delta.feasible or delta.floor_s is None:
                why = "infeasible" if not delta.feasible else "no floor"
                print(f"| {label} | {budget / 2**30:.1f} GiB | {why} | | | |", flush=True)
                continue
            total += 1
            ok_floor = delta.overhead_ratio <= 1.10
            ok_dtr = delta.overhead_ratio <= dtr.overhead_ratio
            within += ok_floor
            worse += not ok_dtr
            print(f"| {label} | {budget / 2**30:.1f} GiB | {delta.overhead_ratio:.4f} | {dtr.overhead_ratio:.4f} | "
                  f"{'yes' if ok_floor else 'no'} | {'yes' if ok_dtr else 'no'} |", flush=True)
    print(f"\nwithin 1.10x of the floor: {within}/{total}; no worse than dtr: {total - worse}/{total}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

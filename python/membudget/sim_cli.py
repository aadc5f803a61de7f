"""``membudget simulate``: will this fit, and how slow will it be?

Where this sits in the flow: the ``simulate`` subcommand of :mod:`membudget.cli`.
It traces a named model (:mod:`membudget.sim_models`, fake tensors) or loads a
saved trace, sweeps budgets x policies with :func:`membudget.simulate` (a
progress bar on stderr), and prints a table, JSON (``--json``) and/or a plot of
step-time ratio against budget per policy (``--plot``, matplotlib).

    membudget simulate --model gpt2 --batch 8 --seq 1024 --device h200 --budgets 80%,60%,40%
    membudget simulate run.trace.gz --device a100-40gb --budgets 30GiB,20GiB --json
    membudget simulate --model bert --actions swap --iterations 4   # swap only, the fourth step
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import List, Optional, Sequence

__all__ = ["add_parser", "main"]


def add_parser(commands) -> argparse.ArgumentParser:
    """Register the ``simulate`` subcommand on ``commands`` (argparse
    subparsers) and return its parser."""
    from .config import ACTIONS, DEFAULT_ACTIONS
    from .costs import DEVICES
    from .sim_models import SIM_MODELS

    p = commands.add_parser("simulate", help="simulate a training step under budgets on a modelled device",
                            description="Trace a model (fake tensors) or load a trace, replay it through the "
                            "real allocator and residency manager on a modelled device, per budget and policy.")
    p.add_argument("trace_file", nargs="?", help="a trace saved by Trace.save (instead of --model)")
    p.add_argument("--model", choices=sorted(SIM_MODELS), help="trace this model")
    p.add_argument("--batch", type=int, help="batch size (default: the model's)")
    p.add_argument("--seq", type=int, help="sequence length, or image size (default: the model's)")
    p.add_argument("--real", action="store_true", help="trace on real tensors (measured durations) instead of fake")
    p.add_argument("--device", default="h200", choices=DEVICES, help="device model (default h200)")
    p.add_argument("--budgets", default="80%,60%,40%",
                   help="comma-separated sizes (12GiB) or percentages of the unbudgeted peak (default 80%%,60%%,40%%)")
    p.add_argument("--policies", help="comma-separated manager policies (default: all in this build)")
    p.add_argument("--baselines", default="none,checkpoint-blocks,swap-all,offload-prefetch",
                   help="comma-separated baselines, or '' for none")
    p.add_argument("--min-tensor-bytes", default="1MiB", help="manage saved tensors from this size (default 1MiB)")
    p.add_argument("--actions", default=DEFAULT_ACTIONS, choices=ACTIONS,
                   help="what the manager may do to a victim, as MEMBUDGET_ACTIONS (default both)")
    p.add_argument("--iterations", type=int, default=2,
                   help="steps run per point, the last measured (default 2; from 3 the measured step is "
                        "predicted from a predicted one, as in steady training)")
    p.add_argument("--no-floor", action="store_true", help="skip the optimal floor (membudget.optimal)")
    p.add_argument("--fixed-segments", action="store_true",
                   help="simulate the allocator with fixed segments (MEMBUDGET_EXPANDABLE_SEGMENTS=0)")
    p.add_argument("--save-trace", metavar="PATH", help="also write the trace here")
    p.add_argument("--json", action="store_true", help="print rows as JSON instead of a table")
    p.add_argument("--plot", metavar="PNG", help="plot step-time ratio against budget per policy")
    return p


def _progress(done: int, total: int, label: str) -> None:
    width = 30
    filled = int(width * done / max(total, 1))
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label[:40]:40s}")
    if done >= total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f}"


def format_table(rows) -> str:
    """The rows as an aligned text table (one line per policy and budget)."""
    head = ("policy", "budget GiB", "fits", "peak GiB", "compute s", "stall s", "recomp s", "swap GiB", "x floor")
    lines = [head]
    for r in rows:
        ratio = f"{r.overhead_ratio:.3f}" if r.feasible and math.isfinite(r.overhead_ratio) else "-"
        lines.append((r.policy, _gib(r.budget_bytes), "yes" if r.feasible else "OOM", _gib(r.peak_reserved_bytes),
                      f"{r.compute_s:.4f}", f"{r.stall_s:.4f}", f"{r.recompute_s:.4f}", _gib(r.swap_bytes), ratio))
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in
                               enumerate(zip(line, widths))) for line in lines)


def plot(rows, path: str, title: str) -> None:
    """Save step time over the optimal (or compute) time against budget, one
    line per policy; infeasible points are left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(r.policy for r in rows):
        pts = sorted((r.budget_bytes / 2**30, r.overhead_ratio) for r in rows
                     if r.policy == name and r.feasible and math.isfinite(r.overhead_ratio))
        if pts:
            ax.plot(*zip(*pts), marker="o", label=name)
    ax.set_xlabel("budget (GiB)")
    ax.set_ylabel("step time / optimal step time")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(args: argparse.Namespace) -> int:
    """Run the subcommand with parsed ``args``; returns the exit status."""
    from .config import ConfigError, parse_bytes
    from .simulate import simulate
    from .trace import Trace

    if bool(args.trace_file) == bool(args.model):
        print("membudget simulate: give a trace file or --model (one of them)", file=sys.stderr)
        return 2
    try:
        min_bytes = int(parse_bytes(args.min_tensor_bytes, "--min-tensor-bytes", allow_zero=True))
    except ConfigError as error:
        print(f"membudget simulate: {error}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    if args.model:
        from .sim_models import trace_model

        print(f"tracing {args.model} ({'real' if args.real else 'fake'} tensors) ...", file=sys.stderr)
        trace = trace_model(args.model, args.batch, args.seq, fake=not args.real)
    else:
        trace = Trace.load(args.trace_file)
    print(f"trace: {trace.summary()} [{time.perf_counter() - start:.1f} s]", file=sys.stderr)
    if args.save_trace:
        trace.save(args.save_trace)
    budgets: List[str] = [b.strip() for b in args.budgets.split(",") if b.strip()]
    policies: Optional[Sequence[str]] = args.policies.split(",") if args.policies else None
    baselines = [b for b in args.baselines.split(",") if b]
    try:
        rows = simulate(trace, budgets, policies, args.device, baselines=baselines, min_tensor_bytes=min_bytes,
                        actions=args.actions, iterations=args.iterations,
                        expandable_segments=not args.fixed_segments, floor=not args.no_floor,
                        progress=None if args.json else _progress)
    except (ValueError, ConfigError) as error:
        print(f"membudget simulate: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"trace": trace.metadata, "device": args.device, "actions": args.actions,
                          "iterations": args.iterations, "rows": [r.to_dict() for r in rows]}, indent=1))
    else:
        print(format_table(rows))
    if args.plot:
        plot(rows, args.plot, f"{trace.metadata.get('model', 'trace')} on {args.device}")
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0

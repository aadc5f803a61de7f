"""``membudget demo``: train two built-in models plain, unbudgeted and under a budget.

Where this sits in the flow: what ``make demo`` runs (``python -m membudget
demo``, dispatched here by :mod:`membudget.cli`). For each model of
:mod:`membudget.models` (a GPT-style transformer and a ResNet-style CNN) it runs
the same seeded training steps three times, each in its own process
(:mod:`membudget.harness`):

1. plain PyTorch, nothing installed: the reference losses, parameters and step time;
2. through membudget with no budget: the *unmanaged peak* of reserved bytes;
3. under ``--fraction`` of that peak.

It then prints a side-by-side table and exits 1 if a budgeted run's losses or
parameters differ from the plain run's by a single bit or its peak reserved
bytes exceed the budget (or a run fails). ``--json`` adds the summary as one
JSON line at the end of the output, for tests and scripts.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

from .harness import RunSpec, identical, spawn_worker, worker_main
from .models import WORKLOADS

__all__ = ["main", "run_demo", "format_table"]

MiB = 1 << 20
_WORKER_COMMAND = [sys.executable, "-m", "membudget.demo"]


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="membudget demo",
        description="Train a small transformer and a small CNN plain, through membudget without a budget "
        "(the unmanaged peak) and under a fraction of that peak; compare losses and parameters bit for bit.",
    )
    parser.add_argument("--steps", type=int, default=None, help="training steps per run (default 4; 3 with --quick)")
    parser.add_argument("--quick", action="store_true", help="tiny models and few steps (seconds; for tests)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="device to train on (default: cuda when visible, else cpu)")
    parser.add_argument("--fraction", type=float, default=0.5,
                        help="budget as a fraction of the unmanaged peak (default 0.5)")
    parser.add_argument("--models", default=",".join(WORKLOADS),
                        help=f"comma-separated models to run (default {','.join(WORKLOADS)})")
    parser.add_argument("--prefetch-bytes", default=None, metavar="SIZE",
                        help="prefetch window for the budgeted runs (bytes or 4MiB-style; default: membudget's)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads per run (default on cpu: 1, see below; on cuda: torch's)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds allowed per run (default 300)")
    parser.add_argument("--json", action="store_true", help="end the output with the summary as one JSON line")
    args = parser.parse_args(list(argv))
    if not 0.0 < args.fraction <= 1.0:
        parser.error(f"--fraction {args.fraction}: expected a number above 0 and at most 1")
    if args.steps is None:
        args.steps = 3 if args.quick else 4
    if args.steps < 2:
        parser.error(f"--steps {args.steps}: at least 2 (the first step is left out of the step time)")
    if args.prefetch_bytes is not None:
        from .config import ConfigError, parse_value

        try:
            args.prefetch_bytes = parse_value("MEMBUDGET_PREFETCH_BYTES", args.prefetch_bytes, label="--prefetch-bytes")
        except ConfigError as error:
            parser.error(str(error))
    args.models = [name.strip() for name in args.models.split(",") if name.strip()]
    unknown = [name for name in args.models if name not in WORKLOADS]
    if unknown or not args.models:
        parser.error(f"--models: unknown {', '.join(unknown) or '(none given)'}; known: {', '.join(WORKLOADS)}")
    return args


def _progress(message: str) -> None:
    print(message, flush=True)


def _run(spec: RunSpec, label: str, timeout: float) -> Dict[str, Any]:
    _progress(f"  {label:<34} ...")
    result = spawn_worker(_WORKER_COMMAND, spec, timeout=timeout)
    if "error" in result:
        _progress(f"  {label:<34} FAILED: {result['error']}")
    else:
        _progress(f"  {label:<34} done in {result['wall_s']:.1f} s "
                  f"(median step {result['median_step_s'] * 1e3:.0f} ms)")
    return result


def run_demo(models: Sequence[str], *, steps: int, quick: bool, device: str, fraction: float,
             threads: Optional[int] = None, prefetch_bytes: Optional[int] = None,
             timeout: float = 300.0) -> List[Dict[str, Any]]:
    """Run the three configurations for each model and return one summary row
    per model (a dict; see :func:`format_table` for the columns). A row's
    ``ok`` is False when a run failed, a membudget run is not bit-identical to
    the plain one, or the managed peak exceeds the budget."""
    rows = []
    size = "quick" if quick else "default"
    for model in models:
        _progress(f"[{model}] {steps} steps on {device}")
        base = dict(model=model, steps=steps, size=size, device=device, threads=threads)
        plain = _run(RunSpec(mode="plain", **base), "plain PyTorch", timeout)
        unbudgeted = _run(RunSpec(mode="unbudgeted", **base), "membudget, no budget (peak)", timeout)
        row: Dict[str, Any] = {"model": model, "fraction": fraction, "ok": False}
        rows.append(row)
        if "error" in plain or "error" in unbudgeted:
            row["error"] = plain.get("error") or unbudgeted.get("error")
            continue
        peak = int(unbudgeted["stats"]["reserved_bytes.all.peak"])
        budget = int(peak * fraction)
        managed = _run(RunSpec(mode="managed", budget=budget, prefetch_bytes=prefetch_bytes, **base),
                       f"membudget, budget {budget / MiB:.1f} MiB ({fraction:.0%})", timeout)
        row.update(unmanaged_peak=peak, budget=budget, unbudgeted_identical=identical(plain, unbudgeted),
                   plain_step_s=plain["median_step_s"])
        if "error" in managed:
            row["error"] = managed["error"]
            continue
        stats = managed["stats"]
        row.update(
            managed_peak=int(stats["reserved_bytes.all.peak"]),
            managed_step_s=managed["median_step_s"],
            step_ratio=managed["median_step_s"] / plain["median_step_s"],
            swap_out_bytes=int(stats["swap_out_bytes"]),
            swap_in_bytes=int(stats["swap_in_bytes"]),
            prefetch_hits=int(stats["prefetch_hits"]),
            prefetch_misses=int(stats["prefetch_misses"]),
            recompute_count=int(stats.get("recompute_count", 0)),
            stall_seconds=float(stats["stall_seconds"]),
            num_ooms=int(stats["num_ooms"]),
            identical=identical(plain, managed),
            losses=plain["losses"],
        )
        row["within_budget"] = row["managed_peak"] <= budget
        row["ok"] = row["identical"] and row["unbudgeted_identical"] and row["within_budget"]
    return rows


def _mib(count: Optional[int]) -> str:
    return "-" if count is None else f"{count / MiB:.1f}"


def format_table(rows: Sequence[Dict[str, Any]]) -> str:
    """The side-by-side table: per model the unmanaged peak, the budget, the
    managed peak reserved (MiB), the managed/plain median step-time ratio,
    MiB swapped out/in, prefetch hits/misses, activations dropped and
    recomputed, and whether losses and
    parameters are bit-identical to plain PyTorch."""
    header = (f"{'model':<6} {'unmanaged':>10} {'budget':>8} {'managed':>8} {'step':>6} "
              f"{'swap out':>9} {'swap in':>8} {'prefetch':>9} {'recomputed':>10} {'identical':>9}")
    units = (f"{'':<6} {'peak MiB':>10} {'MiB':>8} {'peak MiB':>8} {'ratio':>6} "
             f"{'MiB':>9} {'MiB':>8} {'hit/miss':>9} {'tensors':>10} {'':>9}")
    lines = [header, units, "-" * len(header)]
    for row in rows:
        if "managed_peak" not in row:
            lines.append(f"{row['model']:<6} FAILED: {row.get('error', 'unknown error')}")
            continue
        identical_text = "yes" if row["identical"] else "NO"
        lines.append(
            f"{row['model']:<6} {_mib(row['unmanaged_peak']):>10} {_mib(row['budget']):>8} "
            f"{_mib(row['managed_peak']):>8} {row['step_ratio']:>5.2f}x "
            f"{_mib(row['swap_out_bytes']):>9} {_mib(row['swap_in_bytes']):>8} "
            f"{str(row['prefetch_hits']) + '/' + str(row['prefetch_misses']):>9} "
            f"{row.get('recompute_count', 0):>10} {identical_text:>9}"
        )
        if not row["within_budget"]:
            lines.append(f"{'':<6} managed peak above the budget")
        if not row["unbudgeted_identical"]:
            lines.append(f"{'':<6} the unbudgeted membudget run differs from plain PyTorch")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``membudget demo`` (``argv`` defaults to
    ``sys.argv[1:]``); returns the exit status: 0 when every model trained
    bit-identically within its budget, 1 otherwise. ``--worker SPEC_JSON`` runs
    one configuration in this process instead (how the demo starts its runs)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        return worker_main(argv, WORKLOADS)
    args = _parse(argv)
    device = args.device or _default_device()
    # On a CPU shared with other work, torch's default (one thread per core)
    # makes a step wait for whichever thread the OS has descheduled: a 20 ms
    # step then takes ~1 s at random. One thread keeps plain and managed step
    # times comparable; --threads overrides.
    threads = args.threads if args.threads is not None else (1 if device == "cpu" else None)
    started = time.perf_counter()
    rows = run_demo(args.models, steps=args.steps, quick=args.quick, device=device, fraction=args.fraction,
                    threads=threads, prefetch_bytes=args.prefetch_bytes, timeout=args.timeout)
    size = "quick" if args.quick else "default"
    print(f"\nmembudget demo: {args.steps} steps per run on {device} ({size} models, "
          f"torch threads: {threads or 'default'}), "
          f"budget {args.fraction:.0%} of the unmanaged peak, {time.perf_counter() - started:.0f} s in all")
    print("step ratio: median step time under the budget / plain PyTorch, first step left out")
    print(format_table(rows))
    ok = all(row["ok"] for row in rows)
    print("all runs bit-identical to plain PyTorch and within budget" if ok else "FAILED: see the table above")
    if args.json:
        summary = {"ok": ok, "device": device, "threads": threads, "steps": args.steps, "quick": args.quick,
                   "fraction": args.fraction, "rows": rows}
        print(json.dumps(summary))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Expandable against fixed segments at equal budgets in bytes.

Fixed segments (PyTorch's default allocator design) can fail a request while
the cache holds more free memory than it asks for, spread over segments that
other blocks keep alive; expandable segments (MEMBUDGET_EXPANDABLE_SEGMENTS=1,
the default) unmap free pages and back the request in one growing range. For
each model (those of ``bench/bench_recompute.py``: transformers GPT-2 with
dropout, the built-in CNN, an nn.LSTM language model) this measures the
unmanaged peak with fixed segments — what PyTorch's caching allocator design
reserves — and with expandable ones, then trains at 70, 50 and 40% of the
*fixed* peak with each kind of segment (``delta``, ``actions=both``), so both
get the same budget in bytes. Plain PyTorch runs alternate with the others as
in bench_recompute.py, and each step time is a ratio to them.

    python bench/bench_segments.py [--quick] [--models gpt2,cnn,lstm] [--markdown bench/RESULTS.md]
"""
from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

from bench_recompute import BENCHED_MODELS, FRACTIONS, ModelBench, resolve_run_options  # noqa: E402
from bench_swap import machine_line  # noqa: E402
from bench_tables import render_table  # noqa: E402

MiB = 1 << 20
SEGMENTS = {"fixed": False, "expandable": True}


def bench_model(model: str, args) -> List[Dict[str, Any]]:
    """The unmanaged peaks, then every fraction with both kinds of segment."""
    bench = ModelBench(model, args)
    peaks: Dict[str, int] = {}
    for name, expandable in SEGMENTS.items():
        run = bench.spawn(mode="unbudgeted", actions="swap", expandable_segments=expandable)
        if "error" in run:
            return [{"model": model, "budget_label": "-", "segments": name, "error": f"unbudgeted: {run['error']}"}]
        peaks[name] = int(run["stats"]["reserved_bytes.all.peak"])
    print(f"[{model}] unmanaged peak: fixed {peaks['fixed'] / MiB:.1f} MiB, "
          f"expandable {peaks['expandable'] / MiB:.1f} MiB", flush=True)
    reference = bench.plain_run()
    bench.rows.append({"model": model, "budget_label": "unmanaged", "segments": "-", "plain": True,
                       "peaks": peaks, "step_s": reference["median_step_s"]})
    fractions = (0.5,) if args.quick else FRACTIONS
    for fraction in fractions:
        budget = int(peaks["fixed"] * fraction)
        for name, expandable in SEGMENTS.items():
            bench.measure({"budget_label": f"{fraction:.0%}", "segments": name, "policy": "delta",
                           "actions": "both"},
                          mode="managed", budget=budget, policy="delta", actions="both",
                          expandable_segments=expandable)
    bench.close()
    return bench.rows


def format_rows(rows: List[Dict[str, Any]], markdown: bool) -> str:
    header = ["model", "budget", "segments", "budget MiB", "peak MiB", "step ratio", "recomputes",
              "swap out MiB", "evictions wasted", "identical"]
    body, errors = [], []
    for row in rows:
        label = [row["model"], row["budget_label"], row["segments"]]
        if row.get("plain"):
            peaks = row["peaks"]
            body.append(label + ["-", f"fixed {peaks['fixed'] / MiB:.1f} / expandable "
                                      f"{peaks['expandable'] / MiB:.1f}",
                                 f"plain {row['step_s'] * 1e3:.0f} ms", "-", "-", "-", "ref"])
            continue
        budget = f"{row['budget'] / MiB:.1f}" if row.get("budget") else "-"
        if "error" in row:
            reason = "OOM" if "out of memory" in row["error"] else "FAILED"
            body.append(label + [budget, f"{reason} (see below)"] + [""] * (len(header) - 5))
            errors.append(f"{row['model']} {row['budget_label']} {row['segments']}: {row['error']}")
            continue
        peak = f"{row['peak'] / MiB:.1f}" + (" > budget!" if row["peak"] > row["budget"] else "")
        body.append(label + [budget, peak, f"{row['ratio']:.2f}x", str(row["recompute_count"]),
                             f"{row['swap_out'] / MiB:.0f}", str(row["evictions_wasted"]),
                             "yes" if row["identical"] else "NO"])
    return render_table(header, body, errors, markdown, left_columns=3)


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small models, 50%% only")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default 6; 3 with --quick)")
    parser.add_argument("--warmup", type=int, default=None, help="steps left out of the median (default 2)")
    parser.add_argument("--models", default=",".join(BENCHED_MODELS),
                        help="comma-separated subset of " + ",".join(BENCHED_MODELS))
    parser.add_argument("--plain-every", type=int, default=2, help="a plain run after every N runs (default 2)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per run (default 1)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    parser.add_argument("--markdown", metavar="FILE", help="append the table and the command to FILE")
    args = parser.parse_args(argv)
    models = resolve_run_options(parser, args)

    started = time.perf_counter()
    rows: List[Dict[str, Any]] = []
    for model in models:
        rows.extend(bench_model(model, args))
    command = "python " + " ".join(shlex.quote(a) for a in ["bench/bench_segments.py", *argv])
    setup = (f"{machine_line('cpu', args.threads)}; {args.steps} steps per run, median step time after "
             f"{args.warmup} warm-up steps; {time.perf_counter() - started:.0f} s in all")
    print(f"\n{command}\n{setup}")
    print(format_rows(rows, markdown=False))
    if args.markdown:
        with open(args.markdown, "a") as out:
            out.write(f"\n```\n{command}\n```\n\n{setup}.\n\n{format_rows(rows, markdown=True)}\n")
    bad = any(not r.get("plain") and "error" not in r and (not r["identical"] or r["peak"] > r["budget"])
              for r in rows)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

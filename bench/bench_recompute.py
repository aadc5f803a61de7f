"""Recomputation benchmark: swap, recompute or both, by policy, next to plain PyTorch.

Models (as in ``bench/bench_swap.py``): transformers GPT-2 from a small config
with dropout 0.1, membudget's built-in ResNet-style CNN and an nn.LSTM language
model. For each model the unmanaged peak is measured first (membudget installed
with no budget, ``actions='swap'``); then the model is trained at 70, 50 and
40% of that peak with every policy (``delta``, ``dtr``, ``msps``, ``lru``,
``largest``) and ``actions='both'``, and with ``delta`` restricted to
``actions='swap'`` and to ``actions='recompute'``.

For GPT-2 the same run also has transformers' gradient checkpointing
(``model.gradient_checkpointing_enable(use_reentrant=False)``, no membudget
budget): its peak (membudget installed with no budget, which only counts) and
its step time as a plain run, and then membudget ``delta``/``both`` with that
peak as the budget, side by side; and the checkpointed model itself under
membudget (``delta+ckpt``: its regions run as plain code, Note [Checkpoint
regions under a budget]) at that peak (``gc``) and at the smallest fraction
benched (below that peak: checkpointing alone cannot run there).

Every configuration is a fresh process of this script (``--worker``), and
plain-PyTorch runs alternate with the others (plain, run, run, plain, run, run,
..., plain: one after every ``--plain-every`` runs, default 2, which keeps the
default bench under 15 minutes where starting a process that imports
transformers takes several seconds) so that each step time is divided by the
mean of the plain runs just before and after its group. Step time is the median over the steps after
``--warmup`` warm-up steps. A run that fails (out of memory under its budget,
a crash) is a row with its error, not the end of the bench.

    python bench/bench_recompute.py [--quick] [--steps 6] [--models gpt2,cnn,lstm]
    python bench/bench_recompute.py --head-to-head gpt2:50,cnn:70 [--rounds 5]
                                    [--markdown bench/RESULTS.md]

Columns: budget (% of the unmanaged peak, or ``gc`` for the
gradient-checkpointing peak), policy, actions, peak reserved MiB, step-time
ratio to plain PyTorch (plain row: its median step time), ``recompute_count``,
MiB swapped out, ``evictions_wasted``, and whether losses and parameters are
bit-identical to the plain run.
"""
from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "python") not in sys.path:
    sys.path.insert(0, str(ROOT / "python"))
BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

from membudget import models as builtin  # noqa: E402
from membudget.harness import RunSpec, identical, spawn_worker, worker_main  # noqa: E402

from bench_tables import render_table  # noqa: E402
from bench_swap import gpt2, lstm, machine_line  # noqa: E402

MiB = 1 << 20
WORKER_COMMAND = [sys.executable, str(Path(__file__).resolve())]
POLICIES = ("delta", "dtr", "msps", "lru", "largest")
FRACTIONS = (0.7, 0.5, 0.4)
GC_SUFFIX = "-gc"  # a model name ending in this runs with gradient checkpointing
CKPT_SCRIPT = "delta+ckpt"  # the row label of the checkpointed model under membudget (delta/both)


def configurations(quick: bool) -> List[Tuple[float, str, str]]:
    """(fraction of the unmanaged peak, policy, actions), in the order they run."""
    if quick:
        return [(0.5, "delta", "both"), (0.5, "dtr", "both")]
    runs = []
    for fraction in FRACTIONS:
        runs += [(fraction, policy, "both") for policy in POLICIES]
        runs += [(fraction, "delta", "swap"), (fraction, "delta", "recompute")]
    return runs


# --- Workloads ---------------------------------------------------------------------

def with_gradient_checkpointing(make: Callable[[], builtin.Workload]) -> Callable[[], builtin.Workload]:
    """The same transformers workload with non-reentrant gradient checkpointing
    enabled on every block."""

    def make_checkpointed() -> builtin.Workload:
        workload = make()
        build_plain = workload.build

        def build():
            model = build_plain()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # renamed activation_checkpointing_* in v5
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            return model

        return builtin.Workload(workload.name + GC_SUFFIX, build, workload.batch, workload.loss)

    return make_checkpointed


_GPT2_SIZES = {"default": lambda: gpt2(batch=16, seq=256), "quick": gpt2}
WORKLOADS: Dict[str, Dict[str, Callable[[], builtin.Workload]]] = {
    # Sizes as in bench_swap.py: quick those of tests/models.py; default a
    # step of 0.1-0.3 s on one CPU thread.
    "gpt2": _GPT2_SIZES,
    "cnn": builtin.WORKLOADS["cnn"],
    "lstm": {"default": lambda: lstm(batch=32, seq=128), "quick": lstm},
    "gpt2" + GC_SUFFIX: {size: with_gradient_checkpointing(make) for size, make in _GPT2_SIZES.items()},
}
BENCHED_MODELS = ("gpt2", "cnn", "lstm")
GRADIENT_CHECKPOINTED = {"gpt2"}  # models also compared with transformers' gradient checkpointing


# --- Measurement ------------------------------------------------------------------

def step_seconds(result: Dict[str, Any], warmup: int) -> float:
    """Median step time after ``warmup`` steps."""
    return statistics.median(result["step_seconds"][warmup:])


class ModelBench:
    """The runs of one model, with a plain run after every ``plain_every``
    runs: each run's step time is divided by the mean of the plain runs just
    before and after its group."""

    def __init__(self, model: str, args):
        self.model = model
        self.args = args
        self.base = dict(steps=args.steps, size="quick" if args.quick else "default", device="cpu",
                         threads=args.threads or None)
        self.plains: List[Dict[str, Any]] = []
        self.rows: List[Dict[str, Any]] = []
        self.pending: List[Tuple[Dict[str, Any], Dict[str, Any]]] = []  # (row, result) awaiting the next plain

    def spawn(self, **spec) -> Dict[str, Any]:
        merged = dict(self.base, model=self.model)
        merged.update(spec)
        return spawn_worker(WORKER_COMMAND, RunSpec(**merged), timeout=self.args.timeout)

    def plain_run(self) -> Dict[str, Any]:
        """A plain run; it closes the group of runs since the previous one."""
        result = self.spawn(mode="plain")
        if "error" in result:
            raise RuntimeError(f"plain run of {self.model}: {result['error']}")
        self.plains.append(result)
        if len(self.plains) > 1:
            plain_s = (step_seconds(self.plains[-2], self.args.warmup)
                       + step_seconds(self.plains[-1], self.args.warmup)) / 2
            for row, run in self.pending:
                self._finish(row, run, plain_s)
        self.pending = []
        return result

    def measure(self, label: Dict[str, Any], **spec) -> Dict[str, Any]:
        """One run (its row is completed at the next plain run); returns its row."""
        result = self.spawn(**spec)
        row: Dict[str, Any] = dict(model=self.model, budget=spec.get("budget"), **label)
        self.rows.append(row)
        self.pending.append((row, result))
        if len(self.pending) >= self.args.plain_every:
            self.plain_run()
        return row

    def close(self) -> None:
        """A last plain run if runs are still waiting for one."""
        if self.pending:
            self.plain_run()

    def _finish(self, row: Dict[str, Any], result: Dict[str, Any], plain_s: float) -> None:
        if "error" in result:
            row["error"] = result["error"]
        else:
            stats = result["stats"]
            row.update(
                peak=int(stats.get("reserved_bytes.all.peak", 0)),
                step_s=step_seconds(result, self.args.warmup),
                ratio=step_seconds(result, self.args.warmup) / plain_s,
                recompute_count=int(stats.get("recompute_count", 0)),
                recompute_s=float(stats.get("recompute_seconds", 0.0)),
                drop_count=int(stats.get("drop_count", 0)),
                swap_out=int(stats.get("swap_out_bytes", 0)),
                evictions_wasted=int(stats.get("evictions_wasted", 0)),
                policy_s_per_step=float(stats.get("policy_seconds", 0.0)) / self.args.steps,
                mapped=int(stats.get("mapped_bytes_total", 0)),
                unmapped=int(stats.get("unmapped_bytes_total", 0)),
                moved=int(stats.get("moved_bytes_total", 0)),
                identical=identical(self.plains[0], result),
            )
            if row.get("peak_override") is not None:
                row["peak"] = row.pop("peak_override")  # a plain run counts nothing
        status = row.get("error") or (f"peak {row['peak'] / MiB:.1f} MiB, ratio {row['ratio']:.2f}x, "
                                      f"recomputes {row['recompute_count']}, "
                                      f"identical {'yes' if row['identical'] else 'NO'}")
        print(f"[{self.model}] {row['budget_label']} {row['policy']}/{row['actions']}: {status}", flush=True)


def bench_model(model: str, args) -> List[Dict[str, Any]]:
    """All configurations of one model; one row per configuration."""
    bench = ModelBench(model, args)
    print(f"[{model}] unmanaged peak ...", flush=True)
    unbudgeted = bench.spawn(mode="unbudgeted", actions="swap")
    if "error" in unbudgeted:
        return [{"model": model, "budget_label": "-", "policy": "-", "actions": "-",
                 "error": f"unbudgeted run: {unbudgeted['error']}"}]
    peak = int(unbudgeted["stats"]["reserved_bytes.all.peak"])
    print(f"[{model}] unmanaged peak {peak / MiB:.1f} MiB", flush=True)
    try:
        reference = bench.plain_run()
    except RuntimeError as error:
        return [{"model": model, "budget_label": "-", "policy": "-", "actions": "-", "error": str(error)}]
    bench.rows.append({"model": model, "budget_label": "plain", "policy": "-", "actions": "-", "plain": True,
                       "step_s": step_seconds(reference, args.warmup), "unmanaged_peak": peak,
                       "unbudgeted_identical": identical(reference, unbudgeted)})
    try:
        for fraction, policy, actions in configurations(args.quick):
            budget = int(peak * fraction)
            bench.measure({"budget_label": f"{fraction:.0%}", "policy": policy, "actions": actions},
                          mode="managed", budget=budget, policy=policy, actions=actions)
        if model in GRADIENT_CHECKPOINTED and not args.no_gc:
            gc_model = model + GC_SUFFIX
            gc_peak_run = bench.spawn(model=gc_model, mode="unbudgeted", actions="swap")
            if "error" in gc_peak_run:
                bench.rows.append({"model": model, "budget_label": "gc", "policy": "grad-ckpt", "actions": "-",
                                   "error": f"gradient-checkpointing peak run: {gc_peak_run['error']}"})
            else:
                gc_peak = int(gc_peak_run["stats"]["reserved_bytes.all.peak"])
                print(f"[{model}] gradient-checkpointing peak {gc_peak / MiB:.1f} MiB "
                      f"({gc_peak / peak:.0%} of unmanaged)", flush=True)
                # The plain run's peak is the unbudgeted run's (a plain run counts nothing).
                bench.measure({"budget_label": "gc", "policy": "grad-ckpt", "actions": "-", "peak_override": gc_peak},
                              model=gc_model, mode="plain")
                for policy in args.gc_policies:
                    bench.measure({"budget_label": "gc", "policy": policy, "actions": "both"},
                                  mode="managed", budget=gc_peak, policy=policy, actions="both")
                # The checkpointed script itself under membudget, its regions run as plain code
                # (Note [Checkpoint regions under a budget]): at the checkpointing peak, and at the
                # smallest budget benched, below it, where checkpointing alone cannot run.
                smallest = min(fraction for fraction, _, _ in configurations(args.quick))
                for label, budget in (("gc", gc_peak), (f"{smallest:.0%}", int(peak * smallest))):
                    bench.measure({"budget_label": label, "policy": CKPT_SCRIPT, "actions": "both"},
                                  model=gc_model, mode="managed", budget=budget, policy="delta", actions="both")
        bench.close()
    except RuntimeError as error:  # a plain run failed: the ratios after it mean nothing
        for row, _ in bench.pending:
            row.setdefault("error", "no plain run after it to compare with")
        bench.rows.append({"model": model, "budget_label": "-", "policy": "-", "actions": "-", "error": str(error)})
    plain_row = bench.rows[0] if len(bench.rows) and bench.rows[0].get("plain") else None
    if plain_row is not None:
        plain_row["plain_runs_identical"] = all(identical(reference, other) for other in bench.plains[1:])
        plain_row["plain_step_spread"] = [round(step_seconds(p, args.warmup), 4) for p in bench.plains]
    return bench.rows


def head_to_head(model: str, fractions: List[float], args) -> List[str]:
    """``--head-to-head``: at each fraction of the unmanaged peak, ``--rounds``
    rounds of one ``delta`` and one ``dtr`` run (``actions=both``; which goes
    first alternates by round) followed by a plain run, so that both ratios
    of a round share the plain runs around them. One run per configuration
    cannot tell a 1% difference from this machine's run-to-run spread; the
    paired per-round ratio and the median over rounds can. Returns the
    summary lines."""
    bench = ModelBench(model, args)
    unbudgeted = bench.spawn(mode="unbudgeted", actions="swap")
    if "error" in unbudgeted:
        return [f"{model}: unbudgeted run failed: {unbudgeted['error']}"]
    peak = int(unbudgeted["stats"]["reserved_bytes.all.peak"])
    bench.plain_run()
    lines = []
    for fraction in fractions:
        label = f"{fraction:.0%}"
        rounds = []
        for k in range(args.rounds):
            order = ("delta", "dtr") if k % 2 == 0 else ("dtr", "delta")
            rows = {policy: bench.measure({"budget_label": label, "policy": policy, "actions": "both"},
                                          mode="managed", budget=int(peak * fraction), policy=policy, actions="both")
                    for policy in order}
            bench.close()
            rounds.append(rows)
        failed = [r for rows in rounds for r in rows.values() if "error" in r]
        if failed:
            lines.append(f"{model} {label}: {len(failed)} run(s) failed: {failed[0]['error'][:200]}")
            continue
        delta = [rows["delta"]["ratio"] for rows in rounds]
        dtr = [rows["dtr"]["ratio"] for rows in rounds]
        paired = [d / t for d, t in zip(delta, dtr)]
        counters = {policy: (statistics.median(rows[policy]["recompute_count"] for rows in rounds),
                             statistics.median(rows[policy]["swap_out"] for rows in rounds) / MiB,
                             statistics.median(rows[policy]["policy_s_per_step"] for rows in rounds) * 1e3)
                    for policy in ("delta", "dtr")}
        verdict = "met" if statistics.median(paired) <= 1.0 else "MISSED"
        lines.append(
            f"{model} {label}: {args.rounds} rounds; delta median {statistics.median(delta):.3f}x "
            f"({', '.join(f'{v:.2f}' for v in delta)}), dtr median {statistics.median(dtr):.3f}x "
            f"({', '.join(f'{v:.2f}' for v in dtr)}); delta/dtr per round "
            f"{', '.join(f'{v:.3f}' for v in paired)}, median {statistics.median(paired):.3f}, delta faster in "
            f"{sum(v < 1.0 for v in paired)} of {len(paired)}; recomputes / swap-out MiB per run (median): "
            f"delta {counters['delta'][0]:g} / {counters['delta'][1]:.0f}, dtr {counters['dtr'][0]:g} / "
            f"{counters['dtr'][1]:.0f}; ranking victims, ms per step (median): delta {counters['delta'][2]:.2f}, "
            f"dtr {counters['dtr'][2]:.2f}; delta no slower than dtr (median paired ratio <= 1): {verdict}")
        print(lines[-1], flush=True)
    return lines


def format_rows(rows: List[Dict[str, Any]], markdown: bool) -> str:
    """The results table, as text columns or as a markdown table."""
    header = ["model", "budget", "policy", "actions", "peak MiB", "step ratio", "recomputes", "swap out MiB",
              "evictions wasted", "identical"]
    body = []
    for row in rows:
        label = [row["model"], row["budget_label"], row["policy"], row["actions"]]
        if "error" in row:
            reason = "OOM" if "out of memory" in row["error"] else "FAILED"
            body.append(label + [f"{reason} (see below)"] + [""] * (len(header) - 5))
            continue
        if row.get("plain"):
            body.append(label + [f"({row['unmanaged_peak'] / MiB:.1f})", f"{row['step_s'] * 1e3:.0f} ms",
                                 "-", "-", "-",
                                 "ref" + ("" if row["unbudgeted_identical"] else " (unbudgeted run differs!)")])
            continue
        peak = f"{row['peak'] / MiB:.1f}"
        if row.get("budget") and row["peak"] > row["budget"]:
            peak += " > budget!"
        body.append(label + [peak, f"{row['ratio']:.2f}x", str(row["recompute_count"]),
                             f"{row['swap_out'] / MiB:.0f}", str(row["evictions_wasted"]),
                             "yes" if row["identical"] else "NO"])
    errors = [f"{row['model']} {row['budget_label']} {row['policy']}/{row['actions']}: {row['error']}"
              for row in rows if "error" in row]
    return render_table(header, body, errors, markdown, left_columns=4)


def target_lines(rows: List[Dict[str, Any]]) -> List[str]:
    """The issue-3 targets, checked: delta no slower than dtr at every budget
    (both with actions=both), and at the gradient-checkpointing peak lower
    overhead than gradient checkpointing."""

    def find(model: str, budget_label: str, policy: str, actions: str) -> Optional[Dict[str, Any]]:
        for row in rows:
            if (row["model"], row["budget_label"], row["policy"], row["actions"]) == (model, budget_label, policy,
                                                                                      actions):
                return row
        return None

    def ratio(row: Optional[Dict[str, Any]]) -> str:
        if row is None:
            return "not run"
        return "OOM" if "error" in row and "out of memory" in row["error"] else (
            "failed" if "error" in row else f"{row['ratio']:.2f}x")

    lines = []
    for model in dict.fromkeys(row["model"] for row in rows):
        labels = [label for label in dict.fromkeys(r["budget_label"] for r in rows if r["model"] == model)
                  if label.endswith("%")]
        for label in labels:
            delta, dtr = find(model, label, "delta", "both"), find(model, label, "dtr", "both")
            if delta is None or dtr is None:
                continue
            if "error" in delta:
                met = "MISSED (delta failed" + (", dtr too)" if "error" in dtr else ")")
            elif "error" in dtr:
                met = "met (dtr failed)"
            else:
                met = "met" if delta["ratio"] <= dtr["ratio"] else "MISSED"
            lines.append(f"{model} {label}: delta {ratio(delta)} vs dtr {ratio(dtr)}: delta no slower than dtr {met}")
        gc_row = find(model, "gc", "grad-ckpt", "-")
        delta_gc = find(model, "gc", "delta", "both")
        if gc_row is not None and delta_gc is not None:
            if "error" in delta_gc:
                met = "MISSED (delta failed)"
            elif "error" in gc_row:
                met = "not measured (gradient checkpointing failed)"
            else:
                met = "met" if delta_gc["ratio"] < gc_row["ratio"] else "MISSED"
            lines.append(f"{model} at the gradient-checkpointing peak: delta/both {ratio(delta_gc)} vs "
                         f"gradient checkpointing {ratio(gc_row)}: lower overhead {met}")
        for row in rows:
            if row["model"] == model and row["policy"] == CKPT_SCRIPT:
                same = "" if "error" in row else f", identical {'yes' if row['identical'] else 'NO'}"
                where = ("the checkpointing peak" if row["budget_label"] == "gc"
                         else f"{row['budget_label']} of the unmanaged peak")
                lines.append(f"{model} with gradient checkpointing on, under membudget at {where}: "
                             f"{ratio(row)}{same}")
    return lines


def resolve_run_options(parser: argparse.ArgumentParser, args) -> List[str]:
    """Fill in the --steps/--warmup defaults, check them and --plain-every,
    and return the --models list (a parser error names what is wrong)."""
    args.steps = args.steps or (3 if args.quick else 6)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    if args.steps <= args.warmup:
        parser.error("--steps must exceed --warmup")
    if args.plain_every < 1:
        parser.error("--plain-every must be at least 1")
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in BENCHED_MODELS]
    if unknown:
        parser.error(f"unknown models {unknown}; known: {', '.join(BENCHED_MODELS)}")
    return models


def run_head_to_head(parser: argparse.ArgumentParser, args, argv: List[str], started: float) -> int:
    """``--head-to-head CELLS``: parse the cells, run them, print (and with
    ``--markdown`` append) the summary lines."""
    cells: Dict[str, List[float]] = {}
    for cell in args.head_to_head.split(","):
        model, _, percent = cell.strip().partition(":")
        if model not in BENCHED_MODELS or not percent.isdigit() or not 0 < int(percent) <= 100:
            parser.error(f"--head-to-head: {cell!r} is not MODEL:PERCENT with MODEL one of {', '.join(BENCHED_MODELS)}")
        cells.setdefault(model, []).append(int(percent) / 100)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    lines = [line for model, fractions in cells.items() for line in head_to_head(model, fractions, args)]
    setup = (f"{machine_line('cpu', args.threads)}; {args.steps} steps per run, median step time after "
             f"{args.warmup} warm-up steps; {time.perf_counter() - started:.0f} s in all")
    return report_lines("bench/bench_recompute.py", argv, setup, lines, args.markdown)


def report_lines(script: str, argv: List[str], setup: str, lines: List[str], markdown: Optional[str]) -> int:
    """Print the command, the set-up and the summary lines (and append them
    to ``markdown``); 1 when a line reports a failed run, else 0."""
    command = "python " + " ".join(shlex.quote(a) for a in [script, *argv])
    print(f"\n{command}\n{setup}\n" + "\n".join(lines))
    if markdown:
        with open(markdown, "a") as out:
            out.write(f"\n```\n{command}\n```\n\n{setup}.\n\n" + "".join(f"- {line}\n" for line in lines))
    return 1 if any("failed" in line for line in lines) else 0


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        return worker_main(argv, WORKLOADS)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="small models, 50%% only, delta and dtr (actions=both), and the gradient-checkpointing pair")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default 6; 3 with --quick)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="steps left out of the median (default 2; 1 with --quick)")
    parser.add_argument("--models", default=",".join(BENCHED_MODELS),
                        help="comma-separated subset of " + ",".join(BENCHED_MODELS))
    parser.add_argument("--gc-policies", default="delta",
                        help="policies (actions=both) run at the gradient-checkpointing peak (default delta)")
    parser.add_argument("--no-gc", action="store_true", help="skip the gradient-checkpointing comparison")
    parser.add_argument("--plain-every", type=int, default=2,
                        help="a plain run after every N runs (default 2; 1: strict alternation)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per run (default 1; "
                        "0: torch's default)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    parser.add_argument("--markdown", metavar="FILE", help="append the table and the command to FILE")
    parser.add_argument("--head-to-head", metavar="CELLS",
                        help="only delta against dtr (actions=both) at these cells, e.g. gpt2:50,cnn:70, each "
                             "repeated --rounds times with paired ratios (see head_to_head)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per --head-to-head cell (default 5)")
    args = parser.parse_args(argv)
    args.gc_policies = [p.strip() for p in args.gc_policies.split(",") if p.strip()]
    models = resolve_run_options(parser, args)

    started = time.perf_counter()
    if args.head_to_head:
        return run_head_to_head(parser, args, argv, started)
    rows: List[Dict[str, Any]] = []
    for model in models:
        rows.extend(bench_model(model, args))
    elapsed = time.perf_counter() - started
    command = "python " + " ".join(shlex.quote(a) for a in ["bench/bench_recompute.py", *argv])
    setup = (f"{machine_line('cpu', args.threads)}; {args.steps} steps per run, median step time after "
             f"{args.warmup} warm-up steps; {elapsed:.0f} s in all")
    targets = target_lines(rows)
    spreads = [f"{row['model']}: plain step-time medians of the alternating plain runs {row['plain_step_spread']} s; "
               f"plain runs identical to each other: {row['plain_runs_identical']}"
               for row in rows if row.get("plain") and "plain_step_spread" in row]
    print(f"\n{command}\n{setup}")
    print(format_rows(rows, markdown=False))
    print("\n".join(["", *targets, *spreads]))
    if args.markdown:
        with open(args.markdown, "a") as out:
            out.write(f"\n```\n{command}\n```\n\n{setup}.\n\n{format_rows(rows, markdown=True)}\n\n")
            out.write("".join(f"- {line}\n" for line in targets))
            out.write("".join(f"\n{line}\n" for line in spreads))
    failed = any("error" in r or (not r.get("plain") and not r.get("identical", False))
                 or (r.get("peak") is not None and r.get("budget") and r["peak"] > r["budget"]) for r in rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Lineage benchmark: what recording forward ops for recomputation costs per op.

With recomputation allowed (``actions='recompute'`` or ``'both'``),
membudget enters a Python ``TorchDispatchMode`` (:mod:`membudget.lineage`)
that records every aten op of the forward pass; with ``actions='swap'`` it
does not. Lineage is recorded only under a budget, so every configuration
gets the same roomy one (``BUDGET``: nothing is ever evicted). This bench
trains the same model in ONE process, switching between three configurations
by calling ``membudget.install()`` again (which re-pushes the hooks):

* ``swap``: membudget's saved-tensor hooks, no lineage: the baseline;
* ``noop-mode``: ``swap`` plus an empty ``TorchDispatchMode`` that only
  forwards each op: the floor that any Python dispatch mode pays;
* ``cpp-observer``: ``swap`` plus the C++ op-observer probe (a thread-local
  ``at::RecordFunction`` callback capturing each top-level op's tensor
  metadata; Note [Op observer probe] in csrc/torch/op_observer.cpp): the
  floor of a C++ recorder, which the Python mode's floor is compared with;
* ``both``: lineage recording (and the pack-time bookkeeping of
  :meth:`membudget.lineage.Lineage.on_pack`);
* ``both-unparked``: ``both`` with the mode left on the stack during
  ``optimizer.step()`` (Note [Lineage mode parked during optimizer steps]
  switched off), as before parking existed: the step pays the mode's floor.
* ``cxx``: ``both`` with the C++ recorder (``MEMBUDGET_LINEAGE=cxx``,
  Note [C++ lineage recorder] in csrc/torch/lineage_recorder.cpp): the same
  lineage recorded from a RecordFunction callback, closure and replay in C++.

The configurations alternate ``--rounds`` times (swap, noop, observer, both, both-unparked, cxx, swap, ...);
each round runs ``--steps`` training steps, of which the first is left out
(first step after a switch). The overhead per op is
``(median step time of both - median of swap) / ops recorded per step``
(``cxx``: the same with its own step times and op count), the ops per step
read from ``membudget._runtime._lineage.ops_recorded``.
On a shared machine other processes only ever add time, so the same
difference of the *fastest* steps ("min") is given too.
Target (issue 3): at most 10 µs per op.

    python bench/bench_lineage.py [--quick] [--rounds 12] [--steps 5] [--models gpt2,cnn,lstm]
                                  [--markdown bench/RESULTS.md]

Recorders side by side, forward only: ``--forward-recorders`` times each
model's forward with no recorder, the Python one and the C++ one,
interleaved in one process (no pack hook, no optimizer), in wall time and in
this thread's CPU time (``time.thread_time``, which does not count waiting
for a core on a shared machine).

Before/after in one process: ``--compare-lineage OTHER/python/membudget/lineage.py``
loads another checkout's recorder beside this one's and times the forward
pass of each model under each recorder's ``LineageMode`` (no pack hook, no
optimizer: the recording alone), interleaved, against no mode at all.
"""
from __future__ import annotations

import argparse
import gc
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "python") not in sys.path:
    sys.path.insert(0, str(ROOT / "python"))
BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import membudget  # noqa: E402
from membudget import _runtime  # noqa: E402
from membudget import models as builtin  # noqa: E402
from membudget._native import load_extension  # noqa: E402
from membudget.harness import DEFAULT_MIN_TENSOR_BYTES  # noqa: E402

from bench_swap import gpt2, lstm, machine_line  # noqa: E402

TARGET_US_PER_OP = 10.0
# Far above what these models use: recording is on, nothing is evicted.
BUDGET = "64GiB"
CONFIGURATIONS = ("swap", "noop-mode", "cpp-observer", "both", "both-unparked", "cxx")


def configurations() -> tuple:
    """CONFIGURATIONS, less the C++ observer where the extension predates it
    (so that the bench also runs at older commits, for before/after tables)."""
    missing = set()
    if not hasattr(load_extension(), "observe_ops_start"):
        missing.add("cpp-observer")
    if not hasattr(_runtime, "_parking_allowed"):
        missing.add("both-unparked")
    if not hasattr(load_extension(), "lineage"):
        missing.add("cxx")
    return tuple(c for c in CONFIGURATIONS if c not in missing)

# Sizes: those of tests/models.py (a step in tens of milliseconds on one thread).
WORKLOADS = {
    "gpt2": {"default": lambda: gpt2(batch=8, seq=128), "quick": lambda: gpt2(batch=4, seq=64)},
    "cnn": {"default": builtin.WORKLOADS["cnn"]["default"], "quick": builtin.WORKLOADS["cnn"]["quick"]},
    "lstm": {"default": lambda: lstm(batch=16, seq=64), "quick": lambda: lstm(batch=8, seq=32)},
}


class ForwardOnlyMode(TorchDispatchMode):
    """A dispatch mode that does nothing but run the op: the cost floor of
    any Python ``TorchDispatchMode``, lineage's included."""

    def __init__(self):
        super().__init__()
        self.ops = 0  # every op dispatched: forward, backward and optimizer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


class Switched:
    """What ``switch_to`` turned on beyond ``install()``: exit it before the next switch."""

    def __init__(self, configuration: str):
        self.configuration = configuration
        self.mode: Optional[ForwardOnlyMode] = None
        self.observed: Optional[Dict[str, int]] = None
        if configuration == "noop-mode":
            self.mode = ForwardOnlyMode()
            self.mode.__enter__()
        elif configuration == "cpp-observer":
            load_extension().observe_ops_start()

    def exit(self) -> None:
        if self.mode is not None:
            self.mode.__exit__(None, None, None)
        elif self.configuration == "cpp-observer":
            self.observed = dict(load_extension().observe_ops_stop())


def switch_to(configuration: str) -> Switched:
    """Reinstall membudget (roomy budget) for ``configuration`` and turn on
    its extra (no-op mode, C++ observer)."""
    actions = "both" if configuration.startswith("both") or configuration == "cxx" else "swap"
    recorder = {"lineage": "cxx" if configuration == "cxx" else "python"} if "cxx" in configurations() else {}
    membudget.install(budget=BUDGET, actions=actions, min_tensor_bytes=DEFAULT_MIN_TENSOR_BYTES, **recorder)
    if configuration == "both-unparked":
        _runtime._parking_allowed = False  # reset by the next install()
    return Switched(configuration)


def bench_model(name: str, args) -> Dict[str, Any]:
    """All rounds of one model; returns its row."""
    workload = WORKLOADS[name]["quick" if args.quick else "default"]()
    switch_to("swap").exit()  # install before the model is built, as a user would
    torch.manual_seed(0)
    model = workload.build()
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    device = torch.device("cpu")

    def step() -> tuple:
        """(step seconds, forward seconds)."""
        start = time.perf_counter()
        data = workload.batch(device)
        optimizer.zero_grad(set_to_none=True)
        loss = workload.loss(model, data)
        forward = time.perf_counter() - start
        loss.backward()
        optimizer.step()
        loss.item()
        return time.perf_counter() - start, forward

    for _ in range(2):  # warm-up outside the timed rounds
        step()
    chosen = configurations()
    times: Dict[str, List[float]] = {c: [] for c in chosen}
    forward_times: Dict[str, List[float]] = {c: [] for c in chosen}
    round_medians: Dict[str, List[float]] = {c: [] for c in chosen}
    ops_per_step: List[float] = []
    cxx_ops_per_step: List[float] = []
    dispatched_per_step: List[float] = []
    observed_per_step: List[float] = []
    for _ in range(args.rounds):
        for configuration in chosen:
            switched = switch_to(configuration)
            try:
                gc.collect()
                measured = [step() for _ in range(args.steps)][1:]
                if configuration == "both":
                    ops_per_step.append(_runtime._lineage.ops_recorded / args.steps)
                if configuration == "cxx":
                    cxx_ops_per_step.append(_runtime._lineage.ops_recorded / args.steps)
                if switched.mode is not None:
                    dispatched_per_step.append(switched.mode.ops / args.steps)
            finally:
                switched.exit()
            if switched.observed is not None:
                observed_per_step.append(switched.observed["ops"] / args.steps)
            seconds = [total for total, _ in measured]
            times[configuration].extend(seconds)
            forward_times[configuration].extend(forward for _, forward in measured)
            round_medians[configuration].append(statistics.median(seconds))
    membudget.install(budget=BUDGET, actions="swap")  # stop recording before the next model
    medians = {c: statistics.median(times[c]) for c in chosen}
    fastest = {c: min(times[c]) for c in chosen}
    forward_medians = {c: statistics.median(forward_times[c]) for c in chosen}
    nan = float("nan")
    observer = "cpp-observer" in chosen
    unparked = "both-unparked" in chosen
    cxx = "cxx" in chosen
    ops = statistics.median(ops_per_step)
    cxx_ops = statistics.median(cxx_ops_per_step) if cxx else nan
    dispatched = statistics.median(dispatched_per_step)
    # Per-round differences (each round's configurations ran back to back):
    # their spread says how much to trust the median difference.
    per_round_us = [(b - s) / ops * 1e6 for b, s in zip(round_medians["both"], round_medians["swap"])]
    row = {
        "model": name,
        "ops": ops,
        "swap_ms": medians["swap"] * 1e3,
        "noop_ms": medians["noop-mode"] * 1e3,
        "both_ms": medians["both"] * 1e3,
        "us_per_op": (medians["both"] - medians["swap"]) / ops * 1e6,
        "min_us_per_op": (fastest["both"] - fastest["swap"]) / ops * 1e6,
        "noop_us_per_op": (medians["noop-mode"] - medians["swap"]) / ops * 1e6,
        "observer_ms": medians["cpp-observer"] * 1e3 if observer else nan,
        "observed": statistics.median(observed_per_step) if observer else nan,
        "observer_us_per_op": (medians["cpp-observer"] - medians["swap"]) / ops * 1e6 if observer else nan,
        "observer_min_us_per_op": (fastest["cpp-observer"] - fastest["swap"]) / ops * 1e6 if observer else nan,
        "forward_us_per_op": (forward_medians["both"] - forward_medians["swap"]) / ops * 1e6,
        "forward_min_us_per_op": (min(forward_times["both"]) - min(forward_times["swap"])) / ops * 1e6,
        "observer_forward_min_us_per_op": ((min(forward_times["cpp-observer"]) - min(forward_times["swap"])) / ops * 1e6
                                           if observer else nan),
        "dispatched": dispatched,
        "us_per_dispatched": (medians["both"] - medians["swap"]) / dispatched * 1e6,
        "noop_us_per_dispatched": (medians["noop-mode"] - medians["swap"]) / dispatched * 1e6,
        "ratio": medians["both"] / medians["swap"],
        "unparked_us_per_op": (medians["both-unparked"] - medians["swap"]) / ops * 1e6 if unparked else nan,
        "unparked_min_us_per_op": (fastest["both-unparked"] - fastest["swap"]) / ops * 1e6 if unparked else nan,
        "per_round_us": per_round_us,
        "cxx_ops": cxx_ops,
        "cxx_ms": medians["cxx"] * 1e3 if cxx else nan,
        "cxx_us_per_op": (medians["cxx"] - medians["swap"]) / cxx_ops * 1e6 if cxx else nan,
        "cxx_min_us_per_op": (fastest["cxx"] - fastest["swap"]) / cxx_ops * 1e6 if cxx else nan,
        "cxx_forward_min_us_per_op": ((min(forward_times["cxx"]) - min(forward_times["swap"])) / cxx_ops * 1e6
                                      if cxx else nan),
        "cxx_per_round_us": ([(c - s) / cxx_ops * 1e6 for c, s in zip(round_medians["cxx"], round_medians["swap"])]
                             if cxx else [nan]),
    }
    print(f"[{name}] {ops:.0f} ops/step, swap {row['swap_ms']:.1f} ms, both {row['both_ms']:.1f} ms, "
          f"{row['us_per_op']:.1f} µs/op (min {row['min_us_per_op']:.1f}; rounds: "
          f"{', '.join(f'{u:.1f}' for u in per_round_us)}); C++ observer {row['observer_us_per_op']:.1f} µs/op "
          f"(min {row['observer_min_us_per_op']:.1f}); C++ recorder {row['cxx_us_per_op']:.1f} µs/op "
          f"(min {row['cxx_min_us_per_op']:.1f}; rounds: {', '.join(f'{u:.1f}' for u in row['cxx_per_round_us'])})",
          flush=True)
    return row


def _forward_only_setup(name: str, args):
    """Installs the swap-only, roomy configuration and builds the model and
    its batch: the common start of the forward-only comparisons."""
    workload = WORKLOADS[name]["quick" if args.quick else "default"]()
    membudget.install(budget=BUDGET, actions="swap", min_tensor_bytes=DEFAULT_MIN_TENSOR_BYTES)
    native = load_extension()
    torch.manual_seed(0)
    model = workload.build()
    model.train()
    return workload, native, model, workload.batch(torch.device("cpu"))


def compare_lineage(name: str, other_path: str, args) -> Dict[str, Any]:
    """Forward-only recording cost of ``other_path``'s lineage recorder
    against this checkout's, in one process (see the module docstring)."""
    import importlib.util

    from membudget import lineage as this

    spec = importlib.util.spec_from_file_location("membudget._lineage_compared", other_path)
    other = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = other
    spec.loader.exec_module(other)
    workload, native, model, data = _forward_only_setup(name, args)
    recorders = {"other": other.Lineage(native), "this": this.Lineage(native)}
    modes = {"other": other.LineageMode(recorders["other"]), "this": this.LineageMode(recorders["this"])}
    times: Dict[str, List[float]] = {"none": [], "other": [], "this": []}
    ops: Dict[str, int] = {}
    for _ in range(args.rounds * 2):
        for key in times:
            for _ in range(args.steps):
                mode = modes.get(key)
                if mode is not None:
                    recorders[key].note_unpack()
                    before = recorders[key].ops_recorded
                    mode.__enter__()
                start = time.perf_counter()
                loss = workload.loss(model, data)
                seconds = time.perf_counter() - start
                if mode is not None:
                    mode.__exit__(None, None, None)
                    ops[key] = recorders[key].ops_recorded - before
                loss.backward()
                model.zero_grad(set_to_none=True)
                times[key].append(seconds)
    row = {"model": name, "ops": ops["this"], "other_ops": ops["other"]}
    for key in ("other", "this"):
        row[f"{key}_min"] = (min(times[key]) - min(times["none"])) / ops[key] * 1e6
        row[f"{key}_median"] = (statistics.median(times[key]) - statistics.median(times["none"])) / ops[key] * 1e6
    print(f"[{name}] forward recording, µs/op (min / median): other {row['other_min']:.1f} / "
          f"{row['other_median']:.1f}, this {row['this_min']:.1f} / {row['this_median']:.1f}", flush=True)
    return row


def forward_recorders(name: str, args) -> Dict[str, Any]:
    """Forward-only recording cost of the Python recorder and the C++ one,
    interleaved in this process against no recorder (no pack hook, no
    optimizer: the recording alone; see the module docstring)."""
    from membudget import lineage as python_lineage

    workload, native, model, data = _forward_only_setup(name, args)
    python_recorder = python_lineage.Lineage(native)
    mode = python_lineage.LineageMode(python_recorder)
    times: Dict[str, List[float]] = {"none": [], "python": [], "cxx": []}
    # This thread's CPU time: on a shared machine, time spent waiting for a
    # core is not counted (torch runs one intra-op thread here, this one).
    cpu_times: Dict[str, List[float]] = {"none": [], "python": [], "cxx": []}
    ops: Dict[str, float] = {}
    for _ in range(args.rounds * 2):
        for key in times:
            for _ in range(args.steps):
                if key == "python":
                    python_recorder.note_unpack()
                    before = python_recorder.ops_recorded
                    mode.__enter__()
                elif key == "cxx":
                    native.lineage.start()
                start, cpu_start = time.perf_counter(), time.thread_time()
                loss = workload.loss(model, data)
                seconds, cpu_seconds = time.perf_counter() - start, time.thread_time() - cpu_start
                if key == "python":
                    mode.__exit__(None, None, None)
                    ops[key] = python_recorder.ops_recorded - before
                elif key == "cxx":
                    ops[key] = native.lineage.ops_recorded()
                    native.lineage.stop()
                loss.backward()
                model.zero_grad(set_to_none=True)
                times[key].append(seconds)
                cpu_times[key].append(cpu_seconds)
    row: Dict[str, Any] = {"model": name, "ops": ops["python"], "other_ops": ops["cxx"]}
    for key, label in (("python", "other"), ("cxx", "this")):
        row[f"{label}_min"] = (min(times[key]) - min(times["none"])) / ops[key] * 1e6
        row[f"{label}_median"] = (statistics.median(times[key]) - statistics.median(times["none"])) / ops[key] * 1e6
        row[f"{label}_cpu_median"] = ((statistics.median(cpu_times[key]) - statistics.median(cpu_times["none"]))
                                      / ops[key] * 1e6)
        row[f"{label}_cpu_min"] = (min(cpu_times[key]) - min(cpu_times["none"])) / ops[key] * 1e6
    print(f"[{name}] forward recording, µs/op (CPU median / CPU min / wall median): python "
          f"{row['other_cpu_median']:.1f} / {row['other_cpu_min']:.1f} / {row['other_median']:.1f}, cxx "
          f"{row['this_cpu_median']:.1f} / {row['this_cpu_min']:.1f} / {row['this_median']:.1f}", flush=True)
    membudget.install(budget=BUDGET, actions="swap")
    return row


def format_comparison(rows: List[Dict[str, Any]], other_path: str) -> str:
    """The --compare-lineage table (markdown)."""
    lines = [f"| model | ops/forward (this / other) | other µs/op (min) | this µs/op (min) | other (median) "
             f"| this (median) |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['ops']} / {r['other_ops']} | {r['other_min']:.1f} | {r['this_min']:.1f} "
              f"| {r['other_median']:.1f} | {r['this_median']:.1f} |" for r in rows]
    return f"other = {other_path}\n\n" + "\n".join(lines)


def format_rows(rows: List[Dict[str, Any]], markdown: bool) -> str:
    """The results table, as text columns or as a markdown table."""
    header = ["model", "recorded ops/step", "dispatched ops/step", "swap ms", "noop-mode ms", "both ms",
              "µs/recorded op", "(per round)", "(min)", "fwd-only µs/recorded op", "(min)", "µs/dispatched op",
              "noop-mode µs/dispatched op", "C++ observer ops/step", "C++ observer µs/recorded op", "(min)",
              "C++ observer fwd-only (min)", "both-unparked µs/recorded op", "(min)",
              "step ratio both/swap", f"≤ {TARGET_US_PER_OP:.0f} µs/op",
              "cxx recorded ops/step", "cxx ms", "cxx µs/recorded op", "(per round)", "(min)", "cxx fwd-only (min)",
              f"cxx ≤ {TARGET_US_PER_OP:.0f} µs/op"]
    body = [[r["model"], f"{r['ops']:.0f}", f"{r['dispatched']:.0f}", f"{r['swap_ms']:.1f}", f"{r['noop_ms']:.1f}",
             f"{r['both_ms']:.1f}", f"{r['us_per_op']:.1f}",
             f"{min(r['per_round_us']):.0f}..{max(r['per_round_us']):.0f}", f"{r['min_us_per_op']:.1f}",
             f"{r['forward_us_per_op']:.1f}", f"{r['forward_min_us_per_op']:.1f}",
             f"{r['us_per_dispatched']:.1f}", f"{r['noop_us_per_dispatched']:.1f}", f"{r['observed']:.0f}",
             f"{r['observer_us_per_op']:.1f}", f"{r['observer_min_us_per_op']:.1f}",
             f"{r['observer_forward_min_us_per_op']:.1f}", f"{r['unparked_us_per_op']:.1f}",
             f"{r['unparked_min_us_per_op']:.1f}", f"{r['ratio']:.2f}x",
             "yes" if r["us_per_op"] <= TARGET_US_PER_OP else "NO",
             f"{r['cxx_ops']:.0f}", f"{r['cxx_ms']:.1f}", f"{r['cxx_us_per_op']:.1f}",
             f"{min(r['cxx_per_round_us']):.0f}..{max(r['cxx_per_round_us']):.0f}", f"{r['cxx_min_us_per_op']:.1f}",
             f"{r['cxx_forward_min_us_per_op']:.1f}",
             "yes" if r["cxx_us_per_op"] <= TARGET_US_PER_OP else "NO"] for r in rows]
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        return "\n".join(lines + ["| " + " | ".join(cells) + " |" for cells in body])
    widths = [max(len(header[i]), *(len(cells[i]) for cells in body)) for i in range(len(header))]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths))]
    lines.append("-" * len(lines[0]))
    lines += ["  ".join(c.rjust(w) for c, w in zip(cells, widths)) for cells in body]
    return "\n".join(lines)


def _emit(command: str, setup: str, table: str, markdown: Optional[str]) -> None:
    """Prints a forward-only comparison and appends it to ``--markdown``."""
    print(f"\n{command}\n{setup}\n{table}")
    if markdown:
        with open(markdown, "a") as out:
            out.write(f"\n```\n{command}\n```\n\n{setup}.\n\n{table}\n")


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller models, fewer rounds")
    parser.add_argument("--rounds", type=int, default=None, help="alternations (default 12; 2 with --quick)")
    parser.add_argument("--steps", type=int, default=None,
                        help="steps per configuration and round, the first left out (default 5; 3 with --quick)")
    parser.add_argument("--models", default=",".join(WORKLOADS), help="comma-separated subset of "
                        + ",".join(WORKLOADS))
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1; 0: torch's)")
    parser.add_argument("--markdown", metavar="FILE", help="append the table and the command to FILE")
    parser.add_argument("--forward-recorders", action="store_true",
                        help="forward only: the Python recorder against the C++ one, interleaved (see above)")
    parser.add_argument("--compare-lineage", metavar="LINEAGE_PY",
                        help="time another checkout's lineage.py against this one's, forward only (see above)")
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (2 if args.quick else 12)
    args.steps = args.steps or (3 if args.quick else 5)
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first is left out)")
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in WORKLOADS]
    if unknown:
        parser.error(f"unknown models {unknown}; known: {', '.join(WORKLOADS)}")
    if args.threads:
        torch.set_num_threads(args.threads)

    started = time.perf_counter()
    if args.forward_recorders:
        rows = [forward_recorders(model, args) for model in models]
        command = "python " + " ".join(shlex.quote(a) for a in ["bench/bench_lineage.py", *argv])
        lines = [f"| model | ops/forward (python / cxx) | python CPU µs/op (median) | cxx CPU µs/op (median) "
                 f"| python CPU (min) | cxx CPU (min) | python wall (median) | cxx wall (median) "
                 f"| cxx ≤ {TARGET_US_PER_OP:.0f} µs/op (CPU median) |", "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['model']} | {r['ops']} / {r['other_ops']} | {r['other_cpu_median']:.1f} "
                  f"| {r['this_cpu_median']:.1f} | {r['other_cpu_min']:.1f} | {r['this_cpu_min']:.1f} "
                  f"| {r['other_median']:.1f} | {r['this_median']:.1f} "
                  f"| {'yes' if r['this_cpu_median'] <= TARGET_US_PER_OP else 'NO'} |" for r in rows]
        table = "\n".join(lines)
        setup = (f"{machine_line('cpu', args.threads)}; {args.rounds * 2} rounds of none / python / cxx, "
                 f"{args.steps} forwards each; {time.perf_counter() - started:.0f} s in all")
        _emit(command, setup, table, args.markdown)
        return 0
    if args.compare_lineage:
        rows = [compare_lineage(model, args.compare_lineage, args) for model in models]
        command = "python " + " ".join(shlex.quote(a) for a in ["bench/bench_lineage.py", *argv])
        table = format_comparison(rows, args.compare_lineage)
        setup = (f"{machine_line('cpu', args.threads)}; {args.rounds * 2} rounds of none / other / this, "
                 f"{args.steps} forwards each; {time.perf_counter() - started:.0f} s in all")
        _emit(command, setup, table, args.markdown)
        return 0
    rows = [bench_model(model, args) for model in models]
    elapsed = time.perf_counter() - started
    command = "python " + " ".join(shlex.quote(a) for a in ["bench/bench_lineage.py", *argv])
    setup = (f"{machine_line('cpu', args.threads)}; {args.rounds} rounds of {' / '.join(configurations())}, "
             f"{args.steps} steps each (first left out); {elapsed:.0f} s in all")
    print(f"\n{command}\n{setup}")
    print(format_rows(rows, markdown=False))
    if args.markdown:
        with open(args.markdown, "a") as out:
            out.write(f"\n```\n{command}\n```\n\n{setup}.\n\n{format_rows(rows, markdown=True)}\n")
    key = "cxx_us_per_op" if "cxx" in configurations() else "us_per_op"  # the recorder meant to meet it
    return 0 if all(r[key] <= TARGET_US_PER_OP for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

"""``delta`` against ``dtr`` in one process: issue 3's timed target without
the spread between processes.

Note [Policies in one process]: bench_recompute.py's ``--head-to-head`` runs
each policy in a fresh process and pairs the two of a round. On this machine
whole processes of one configuration differ by up to 10% in step time,
consistently through their steps (LSTM at 70%: one ``dtr`` run 117.5 ms per
step against 108.4 and 109.6 for two others), which pairing does not remove
and which is larger than any difference between the policies. Here each round
is one process (bench_recompute.py's worker, one torch thread) that trains in
blocks of ``--block-steps`` steps, the policies in turn, calling
``membudget.install()`` again with the next policy between two steps (the
budget, actions and everything else unchanged): both policies run on the same
memory layout and the same machine state. The first ``--warmup`` steps and
the first ``--settle`` steps of every block are left out: a policy's first
two steps after the other's copy what its own run's first two do (LSTM at
70%: ``delta`` 60-68 then 66 MiB out, then 36 a step; ``dtr`` 38-40 twice,
then 36), which the separate runs' warm-up leaves out too. Each policy's
step time is the median of its other steps, and the round's ratio is
``delta``/``dtr``. Which policy starts alternates by
round. Every run's losses and parameters are compared with a plain run's.
Beside it, each ``delta`` block against the ``dtr`` blocks next to it (Note
[Neighbouring blocks]), which cancels a drift of the machine within a
process.

    PYTHONPATH=python python bench/bench_in_process.py gpt2:70,cnn:50 [--rounds 4]
        [--blocks 3] [--block-steps 5] [--settle 2] [--policies delta,dtr] [--markdown bench/RESULTS.md]

Note [A against A]: ``--policies dtr,dtr`` runs one policy in both slots
(labelled ``dtr#1`` and ``dtr#2``): the same work in every block, so the
ratios it prints are what this machine alone produces, the spread against
which a ``delta``/``dtr`` ratio has to be read.

What it cannot show: a policy's cost that lasts beyond a block (none is
known: the unpack order, the link's and the replays' measurements are the
manager's, shared by both).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(ROOT / "bench"))

from membudget.harness import RunSpec, identical, spawn_worker  # noqa: E402

from bench_recompute import BENCHED_MODELS, WORKER_COMMAND, report_lines  # noqa: E402
from bench_recompute import POLICIES as KNOWN_POLICIES  # noqa: E402
from bench_swap import machine_line  # noqa: E402

MiB = 1 << 20
POLICIES = ("delta", "dtr")  # the default pair: the first is the numerator of every ratio


def per_policy(result: Dict[str, Any], warmup: int, block_steps: int, settle: int,
               labels: Tuple[str, str] = POLICIES) -> Dict[str, Dict[str, float]]:
    """Each policy's median step time over its measured steps (not the
    warm-up, not a block's first ``settle``), and its MiB copied out,
    replays and milliseconds the compute thread waited for copies (Note
    [Copy timeline]: unpacks and the allocation path alike) per measured
    step, from the cumulative per-step counters."""
    times: Dict[str, List[float]] = {p: [] for p in labels}
    out: Dict[str, List[float]] = {p: [] for p in labels}
    replays: Dict[str, List[float]] = {p: [] for p in labels}
    waits: Dict[str, List[float]] = {p: [] for p in labels}
    stats = result["step_stats"]
    for step, (policy, seconds) in enumerate(zip(result["step_policies"], result["step_seconds"])):
        if step < warmup or step % block_steps < settle:
            continue
        before = stats[step - 1] if step > 0 else {}
        times[policy].append(seconds)
        out[policy].append((stats[step]["swap_out_bytes"] - before.get("swap_out_bytes", 0)) / MiB)
        replays[policy].append(stats[step]["recompute_count"] - before.get("recompute_count", 0))
        waits[policy].append((stats[step].get("wait_seconds", 0.0) - before.get("wait_seconds", 0.0)) * 1e3)
    return {p: {"step_s": statistics.median(times[p]), "out_mib": statistics.mean(out[p]),
                "replays": statistics.mean(replays[p]), "wait_ms": statistics.mean(waits[p])} for p in labels}


def block_ratios(result: Dict[str, Any], warmup: int, block_steps: int, settle: int,
                 labels: Tuple[str, str] = POLICIES) -> List[float]:
    """Note [Neighbouring blocks]: for each ``delta`` block, the median of
    its measured steps over the mean of the medians of the ``dtr`` blocks
    just before and after it (one at either end). This machine drifts within
    a process: at LSTM 70% one run's steps went from 100 to 277 ms over 20
    steps with the work unchanged (session 17), so a policy's median over the
    whole process depends on which blocks the slow stretch fell in; a drift
    that is linear over three blocks cancels in this ratio."""
    medians: List[Any] = []  # (policy, median seconds) per block, None without measured steps
    policies, seconds = result["step_policies"], result["step_seconds"]
    for start in range(0, len(seconds), block_steps):
        kept = [seconds[step] for step in range(start, min(start + block_steps, len(seconds)))
                if step >= warmup and step - start >= settle]
        medians.append((policies[start], statistics.median(kept)) if kept else None)
    ratios = []
    for index, block in enumerate(medians):
        if block is None or block[0] != labels[0]:
            continue
        around = [medians[j][1] for j in (index - 1, index + 1)
                  if 0 <= j < len(medians) and medians[j] is not None and medians[j][0] == labels[1]]
        if around:
            ratios.append(block[1] / statistics.mean(around))
    return ratios


def slot_labels(policies: Tuple[str, str]) -> Tuple[str, str]:
    """The two slots' labels: the policies' names, numbered when they are
    the same policy (Note [A against A])."""
    first, second = policies
    return (first, second) if first != second else (f"{first}#1", f"{second}#2")


def cell(model: str, fraction: float, peak: int, plain: Dict[str, Any], args) -> str:
    """The rounds at one fraction of the peak; returns the summary line.
    Every ratio is the first of ``args.policies`` over the second."""
    steps = args.warmup + 2 * args.blocks * args.block_steps
    labels = slot_labels(args.policies)
    policy_of = dict(zip(labels, args.policies))
    first, second = labels
    paired, rows, differs, blocks = [], [], 0, []
    for k in range(args.rounds):
        order = list(labels) if k % 2 == 0 else list(reversed(labels))
        spec = RunSpec(model=model, mode="managed", steps=steps, size="default", device="cpu", threads=1,
                       budget=int(peak * fraction), actions="both",
                       alternate_policies=[policy_of[label] for label in order], alternate_steps=args.block_steps)
        result = spawn_worker(WORKER_COMMAND, spec, timeout=args.timeout)
        if "error" in result:
            return f"{model} {fraction:.0%}: round {k + 1} failed: {result['error'][:300]}"
        # Each step's slot, not its policy's name: the two are the same policy in an A/A run.
        result["step_policies"] = [order[(step // args.block_steps) % 2] for step in range(len(result["step_seconds"]))]
        row = per_policy(result, args.warmup, args.block_steps, args.settle, labels)
        rows.append(row)
        paired.append(row[first]["step_s"] / row[second]["step_s"])
        blocks.extend(block_ratios(result, args.warmup, args.block_steps, args.settle, labels))
        differs += not identical(plain, result)
        print(f"[{model}] {fraction:.0%} round {k + 1}: {first} {row[first]['step_s'] * 1e3:.1f} ms, "
              f"{second} {row[second]['step_s'] * 1e3:.1f} ms, ratio {paired[-1]:.3f}", flush=True)

    def median_of(label: str, key: str) -> float:
        return statistics.median(r[label][key] for r in rows)

    def per_step(label: str) -> str:
        return (f"{label} {median_of(label, 'step_s') * 1e3:.1f} ms, {median_of(label, 'out_mib'):.1f} MiB out, "
                f"{median_of(label, 'replays'):.2g} replays, {median_of(label, 'wait_ms'):.1f} ms waited for copies")

    verdict = "met" if statistics.median(paired) <= 1.0 else "MISSED"
    block_verdict = "met" if blocks and statistics.median(blocks) <= 1.0 else "MISSED"
    same_work = all(abs(r[first]["out_mib"] - r[second]["out_mib"]) < 0.05
                    and r[first]["replays"] == 0 == r[second]["replays"] for r in rows)
    return (f"{model} {fraction:.0%}: {args.rounds} processes; {first}/{second} per process "
            f"{', '.join(f'{v:.3f}' for v in paired)}, median {statistics.median(paired):.3f}, {first} faster in "
            f"{sum(v < 1.0 for v in paired)} of {len(paired)}; against neighbouring blocks (Note [Neighbouring "
            f"blocks]) median {statistics.median(blocks) if blocks else float('nan'):.3f}, {first} faster in "
            f"{sum(v < 1.0 for v in blocks)} of {len(blocks)} blocks ({block_verdict}), blocks range "
            f"{min(blocks, default=float('nan')):.3f}-{max(blocks, default=float('nan')):.3f}; "
            f"{'the same MiB out and no replays in every process; ' if same_work else ''}"
            f"per measured step (median over processes): {per_step(first)}; {per_step(second)}; "
            f"losses and parameters identical to plain PyTorch: "
            f"{'yes' if differs == 0 else f'NO ({differs} runs differ)'}; "
            f"{first} no slower than {second} (median ratio <= 1): {verdict}")


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("cells", help="MODEL:PERCENT list, e.g. gpt2:70,cnn:50 (models: "
                        + ", ".join(BENCHED_MODELS) + ")")
    parser.add_argument("--rounds", type=int, default=4, help="processes per cell (default 4)")
    parser.add_argument("--blocks", type=int, default=3, help="blocks per policy in each process (default 3)")
    parser.add_argument("--block-steps", type=int, default=5, help="steps per block (default 5)")
    parser.add_argument("--settle", type=int, default=2, help="first steps of each block left out (default 2)")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out (default 2)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per process")
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help="the two policies compared, FIRST,SECOND: every ratio is FIRST over SECOND "
                             "(default delta,dtr; the same one twice measures the machine, Note [A against A])")
    parser.add_argument("--markdown", metavar="FILE", help="append the command and the lines to FILE")
    args = parser.parse_args(argv)
    policies = tuple(p.strip() for p in args.policies.split(","))
    if len(policies) != 2 or not all(p in KNOWN_POLICIES for p in policies):
        parser.error(f"--policies takes two of {', '.join(KNOWN_POLICIES)} as FIRST,SECOND; got {args.policies!r}")
    args.policies = policies
    cells = []
    for text in args.cells.split(","):
        model, _, percent = text.strip().partition(":")
        if model not in BENCHED_MODELS or not percent.isdigit() or not 0 < int(percent) <= 100:
            parser.error(f"{text!r} is not MODEL:PERCENT with MODEL one of {', '.join(BENCHED_MODELS)}")
        cells.append((model, int(percent) / 100))
    if args.rounds < 1 or args.blocks < 1 or args.warmup < 0 or not 0 <= args.settle < args.block_steps:
        parser.error("--rounds and --blocks must be at least 1, --warmup at least 0, and --settle below "
                     "--block-steps")
    started = time.perf_counter()
    lines, peaks, plains = [], {}, {}
    for model, fraction in cells:
        if model not in peaks:
            base = dict(model=model, steps=args.warmup + 2 * args.blocks * args.block_steps, size="default",
                        device="cpu", threads=1)
            unbudgeted = spawn_worker(WORKER_COMMAND, RunSpec(mode="unbudgeted", actions="swap", **base),
                                      timeout=args.timeout)
            plains[model] = spawn_worker(WORKER_COMMAND, RunSpec(mode="plain", **base), timeout=args.timeout)
            for name, run in (("unbudgeted", unbudgeted), ("plain", plains[model])):
                if "error" in run:
                    print(f"{model}: {name} run failed: {run['error']}")
                    return 1
            peaks[model] = int(unbudgeted["stats"]["reserved_bytes.all.peak"])
        lines.append(cell(model, fraction, peaks[model], plains[model], args))
        print(lines[-1], flush=True)
    setup = (f"{machine_line('cpu', 1)}; {args.blocks} blocks of {args.block_steps} steps per policy in each "
             f"process, the first {args.warmup} steps and every block's first {args.settle} left out; "
             f"{time.perf_counter() - started:.0f} s in all")
    return report_lines("bench/bench_in_process.py", argv, setup, lines, args.markdown)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

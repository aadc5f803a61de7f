"""Simulator benchmark: validation against real CPU runs, and the policy table on h200.

    python bench/bench_simulate.py validate [--quick] [--actions both,swap,recompute] [--save F | --load F [--variants]]
    python bench/bench_simulate.py table [--models gpt2,bert,...] [--budgets 80%,60%,40%]

``validate``: for each ``--actions`` choice in turn (both, swap-only,
recompute-only: each its own measurement window) and each workload of
membudget.models, real runs in fresh
processes (membudget.harness: plain, unbudgeted, then ``--repeats`` rounds of
managed runs at each budget with the delta policy, one torch thread), and a
trace of the same step (real tensors, measured op durations, one thread)
simulated with the ``cpu-host`` device model at the same budgets and settings.
The machine is shared, so the model is the one of the measurement window: the
link calibrated before every managed run and the step traced before and after
(medians). Prints predicted and measured peak reserved bytes, bytes swapped,
misses, and predicted stall + recompute against the measured per steady step
(the first ``--warmup`` steps left out; medians over the steps of every run):
copy waits outside replays (Note [Copy timeline]) plus replay wall time, which
is what the simulator's stall_s + recompute_s count on modelled time.
``--save``/``--load`` keep the runs' results (and traces beside them) to
predict again; ``--variants`` prints stall + recompute under the model part
by part (the link's parts, then the host time at backward's start, then
every traced host gap).

``table``: each model of membudget.sim_models traced on fake tensors and
simulated on ``h200`` at each budget (percent of its unbudgeted peak) under
every policy and baseline, with the optimal floor; prints step time as a
ratio to the floor.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))

import torch  # noqa: E402

import membudget  # noqa: E402
from membudget import harness, models  # noqa: E402
from membudget.config import ACTIONS  # noqa: E402
from membudget.simulate import simulate, unbudgeted_peak  # noqa: E402

MiB = 2**20


def _trace_workload(workload):
    """A real-tensor trace of one harness step (zero_grad, forward, backward,
    Adam step), after one unrecorded step that creates the optimizer state.
    membudget is installed without a budget while it runs, so that the trace
    measures each op's scratch memory (Note [Op workspace]) on the allocator
    the managed runs use; it is uninstalled after."""
    torch.manual_seed(0)

    def setup():
        model = workload.build()
        model.train()
        return model, torch.optim.Adam(model.parameters(), lr=1e-3)

    def step(state):
        model, optimizer = state
        optimizer.zero_grad(set_to_none=True)
        workload.loss(model, workload.batch(torch.device("cpu"))).backward()
        optimizer.step()

    membudget.install(budget=None)
    try:
        return membudget.trace(step, setup=setup, warmup=1, metadata={"model": workload.name})
    finally:
        membudget.uninstall()


def _steady(run: dict, warmup: int, key: str) -> list:
    """Per-step increments of the cumulative counter ``key`` over the steps
    after the first ``warmup`` (the first step has no unpack order to
    prefetch by, and its host copies fault their pages in)."""
    values = [0.0] + [step.get(key, 0.0) for step in run["step_stats"]]
    return [b - a for a, b in zip(values, values[1:])][warmup:]


_LINK_FIELDS = ("link_bytes_per_s", "link_duplex_share", "link_compute_share", "link_latency_s")


def _stall_and_recompute(run: dict, warmup: int) -> list:
    """Per steady step: copy waits outside replays plus the replays' wall time."""
    return [w - inside + c for w, inside, c in zip(_steady(run, warmup, "wait_seconds"),
                                                  _steady(run, warmup, "recompute_wait_seconds"),
                                                  _steady(run, warmup, "recompute_seconds"))]


def measure(names, size: str, fractions, steps: int, warmup: int, repeats: int, actions: str,
            trace_dir: Path) -> dict:
    """Real runs (fresh processes, one torch thread): per model the plain and
    unbudgeted runs, then ``repeats`` rounds of one managed run per budget
    (rounds interleaved, so that load on the machine spreads over all
    budgets). The machine is shared, so what the prediction uses is measured
    in the same window: the ``cpu-host`` link is calibrated before every
    managed run, and the step is traced (op durations) before the first
    round and after the last (saved under ``trace_dir``). Returns plain data
    (JSON), with the load average before each run."""
    import dataclasses
    import os

    from membudget import costs

    command = [sys.executable, "-m", "membudget.demo"]
    out = {"size": size, "steps": steps, "warmup": warmup, "actions": actions, "models": {}, "calibrations": []}

    def calibrate():
        model = dataclasses.asdict(costs.calibrate_cpu_host())
        out["calibrations"].append({key: model[key] for key in ("flops_per_s", "memory_bytes_per_s", "launch_s",
                                                                 "link_rate_by_size", "compute_copy_share",
                                                                 *_LINK_FIELDS)})

    def trace(name: str, index: int) -> str:
        path = trace_dir / f"{name}-{index}.trace"
        _trace_workload(models.WORKLOADS[name][size]()).save(path)
        return str(path)

    for name in names:
        base = dict(model=name, size=size, steps=steps, threads=1, actions=actions)
        plain = harness.spawn_worker(command, harness.RunSpec(mode="plain", **base))
        free = harness.spawn_worker(command, harness.RunSpec(mode="unbudgeted", **base))
        if "error" in plain or "error" in free:
            raise RuntimeError(f"{name}: {plain.get('error') or free.get('error')}")
        peak = free["stats"]["reserved_bytes.all.peak"]
        model = {"plain": plain, "unbudgeted": free, "peak": peak, "runs": {}, "traces": [trace(name, 0)]}
        for _ in range(repeats):
            for fraction in fractions:
                budget = int(fraction * peak)
                calibrate()
                load = os.getloadavg()[0]
                run = harness.spawn_worker(command, harness.RunSpec(mode="managed", budget=budget, policy="delta",
                                                                    **base))
                run["load_before"] = load
                model["runs"].setdefault(str(fraction), []).append(run)
                print(f"  {name} {fraction:.0%}: load {load:.1f}, "
                      f"{'failed: ' + run['error'] if 'error' in run else 'done'}", file=sys.stderr, flush=True)
        model["traces"].append(trace(name, 1))
        out["models"][name] = model
    return out


def window_device(measured: dict):
    """The ``cpu-host`` model of the measurement window: each calibrated
    figure's median over the calibrations taken beside the runs."""
    import dataclasses
    import statistics

    from membudget import costs

    base = costs.device_model("cpu-host")
    calibrations = measured.get("calibrations") or []
    if not calibrations:
        return base
    fields = {key: statistics.median(c[key] for c in calibrations)
              for key in ("memory_bytes_per_s", "launch_s", *_LINK_FIELDS)}
    # Note [Rate by copy size]: each size's median (older saved runs have none).
    sized = [c.get("link_rate_by_size") or () for c in calibrations]
    fields["link_rate_by_size"] = ()
    if all(len(s) == len(sized[0]) and s for s in sized):
        fields["link_rate_by_size"] = tuple((size, statistics.median(s[i][1] for s in sized))
                                            for i, (size, _) in enumerate(sized[0]))
    # Note [Compute beside a copy]: saved runs older than the field had none;
    # they keep the share of the calibration made now (base), as before.
    shares = [c["compute_copy_share"] for c in calibrations if "compute_copy_share" in c]
    if len(shares) == len(calibrations):
        fields["compute_copy_share"] = statistics.median(shares)
    fields["flops_per_s"] = {k: statistics.median(c["flops_per_s"][k] for c in calibrations)
                             for k in calibrations[0]["flops_per_s"]}
    spread = {key: (min(c[key] for c in calibrations), max(c[key] for c in calibrations)) for key in _LINK_FIELDS}
    note = (f"median of {len(calibrations)} calibrations beside the runs: link "
            f"{fields['link_bytes_per_s'] / 1e9:.1f} GB/s ({spread['link_bytes_per_s'][0] / 1e9:.1f}-"
            f"{spread['link_bytes_per_s'][1] / 1e9:.1f}), duplex share {fields['link_duplex_share']:.2f} "
            f"({spread['link_duplex_share'][0]:.2f}-{spread['link_duplex_share'][1]:.2f}), compute share "
            f"{fields['link_compute_share']:.2f} ({spread['link_compute_share'][0]:.2f}-"
            f"{spread['link_compute_share'][1]:.2f}), hand-off {fields['link_latency_s'] * 1e6:.0f} us "
            f"({spread['link_latency_s'][0] * 1e6:.0f}-{spread['link_latency_s'][1] * 1e6:.0f})"
            + (", " + costs.describe_rate_by_size(fields["link_rate_by_size"]) if fields["link_rate_by_size"] else ", one rate for every copy size (no sizes calibrated)"))
    return dataclasses.replace(base, note=note, **fields)


def window_trace(paths):
    """The first trace with each op's duration the median over all the traces
    of the window (same program: same ops in the same order)."""
    import statistics

    from membudget.trace import Trace

    traces = [Trace.load(p) for p in paths]
    first = traces[0]
    if any(len(t.ops) != len(first.ops) or [o.name for o in t.ops] != [o.name for o in first.ops]
           for t in traces[1:]):
        return first
    for index, op in enumerate(first.ops):
        if op.duration_s is not None:
            op.duration_s = statistics.median(t.ops[index].duration_s for t in traces)
    return first


def predict(measured: dict, device, host_time="backward") -> dict:
    """Simulate each measured model's traced step at the measured budgets on
    ``device`` (a DeviceModel): by model and fraction, a :class:`Predicted`
    over the same steps as the measured ones. ``host_time``: ``simulate``'s
    (Note [Host time between ops], Note [Backward's start])."""
    rows = {}
    # Note [Predict the measured steps]: the real runs' numbers are medians
    # over their steps from ``warmup`` on, so the prediction is the median
    # over the same simulated steps. ``simulate`` measures its last
    # iteration: one simulation per step, each running up to it (a few ms
    # each on these traces). A single simulated step (what this did before)
    # compared one step of a pattern that alternates with the median of it:
    # at GPT 50%, both actions, the simulated steps wait 0.9, 1.8, 1.5,
    # 1.8, 1.5, ... ms; the third alone predicted 1.1 ms against a measured
    # median of 2.0, the median over the measured steps predicts 1.8
    # (bench/RESULTS.md, "Lead, session 21").
    steps = range(max(1, measured["warmup"]), max(measured["steps"], measured["warmup"] + 1))
    for name, model in measured["models"].items():
        if model.get("traces"):
            trace = window_trace(model["traces"])
        else:
            trace = _trace_workload(models.WORKLOADS[name][measured["size"]]())
        fractions = [float(f) for f in model["runs"]]
        budgets = [model["peak"], *(int(f * model["peak"]) for f in fractions)]
        by_step = [simulate(trace, budgets, ["delta"], device, baselines=(),
                            min_tensor_bytes=harness.DEFAULT_MIN_TENSOR_BYTES, actions=measured["actions"],
                            host_time=host_time, iterations=step + 1) for step in steps]
        rows[name] = {f: Predicted([sim[i] for sim in by_step]) for i, f in enumerate(["1.0", *model["runs"]])}
    return rows


class Predicted:
    """The simulated steps of one budget point (SimRows, one per measured
    step): each figure the report prints is the median over them, as the
    measured figures are over the real steps; the peak is the largest."""

    def __init__(self, steps):
        self.steps = steps
        self.feasible = all(r.feasible for r in steps)
        self.peak_reserved_bytes = max(r.peak_reserved_bytes for r in steps)

    def __getattr__(self, field):
        return _median([getattr(r, field) for r in self.steps])

    def median_of(self, figure) -> float:
        """Median over the steps of ``figure(row)``: for sums, whose measured
        figure is the median of the sum, not the sum of the medians."""
        return _median([figure(r) for r in self.steps])

    @property
    def stall_and_recompute_s(self) -> float:
        """Median over the steps of stall_s + recompute_s."""
        return self.median_of(lambda r: r.stall_s + r.recompute_s)


def _median(values) -> float:
    import statistics

    return statistics.median(values) if values else 0.0


def report(measured: dict, predicted: dict) -> list:
    """Print the validation table (see the module doc) from measured runs and
    their predictions; returns, per budget point, whether the predicted stall
    + recompute is within 25% of the measured median."""
    within = []
    warmup = measured["warmup"]
    print("| model | budget | peak predicted | peak measured | error | swapped predicted | swapped measured | "
          "stall+recompute predicted | stall+recompute measured (median, mean) | error | per-run medians | "
          "copy waits predicted / measured | recompute predicted / measured less its waits (count) | "
          "unpack stall predicted | unpack stall + recompute measured | misses predicted / measured | loads |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, model in measured["models"].items():
        free, plain = model["unbudgeted"], model["plain"]
        p = predicted[name]["1.0"]
        peak = free["stats"]["reserved_bytes.all.peak"]
        print(f"| {name} | 100% ({model['peak'] / MiB:.1f} MiB) | {p.peak_reserved_bytes / MiB:.1f} MiB | "
              f"{peak / MiB:.1f} MiB | {(p.peak_reserved_bytes - peak) / peak:+.1%} | "
              f"{p.swap_bytes / MiB:.0f} MiB | 0 MiB | {p.stall_and_recompute_s * 1e3:.1f} ms | "
              f"0.0 ms | | | | | {p.unpack_stall_s * 1e3:.1f} ms | | | (plain step {plain['median_step_s'] * 1e3:.0f} ms, "
              f"predicted {p.step_s * 1e3:.0f} ms) |")
        for fraction, runs in model["runs"].items():
            p = predicted[name][fraction]
            runs = [r for r in runs if "error" not in r]
            if not runs:
                print(f"| {name} | {float(fraction):.0%} | run failed |")
                continue
            budget = runs[0]["spec"]["budget"]
            peak = max(r["stats"]["reserved_bytes.all.peak"] for r in runs)
            # Per steady-state step, over every run at this budget: the
            # simulator's stall_s counts every wait for a copy, which is what
            # the copy timeline's wait_seconds counts on the real clock; a
            # replay's wall time (recompute_seconds) already holds the waits
            # made inside it, so those are counted once.
            waits = [r_total for r in runs for r_total in _stall_and_recompute(r, warmup)]
            unpack = [w + c for r in runs for w, c in zip(_steady(r, warmup, "stall_seconds"),
                                                           _steady(r, warmup, "recompute_seconds"))]
            swapped = [a + b for r in runs for a, b in zip(_steady(r, warmup, "swap_in_bytes"),
                                                           _steady(r, warmup, "swap_out_bytes"))]
            misses = [m for r in runs for m in _steady(r, warmup, "prefetch_misses")]
            copy_waits = [w for r in runs for w in _steady(r, warmup, "wait_seconds")]
            recomputed = [c - w for r in runs for c, w in zip(_steady(r, warmup, "recompute_seconds"),
                                                              _steady(r, warmup, "recompute_wait_seconds"))]
            recompute_counts = [c for r in runs for c in _steady(r, warmup, "recompute_count")]
            predicted_total = p.stall_and_recompute_s
            measured_total = _median(waits)
            error = (predicted_total - measured_total) / measured_total if measured_total > 0 else float("nan")
            within.append(abs(error) <= 0.25 if measured_total > 0 else predicted_total == 0)
            loads = ", ".join(f"{r['load_before']:.1f}" for r in runs)
            per_run = ", ".join(f"{_median(_stall_and_recompute(r, warmup)) * 1e3:.1f}" for r in runs)
            print(f"| {name} | {float(fraction):.0%} ({budget / MiB:.1f} MiB) | "
                  f"{p.peak_reserved_bytes / MiB:.1f} MiB{'' if p.feasible else ' (OOM)'} | {peak / MiB:.1f} MiB | "
                  f"{(p.peak_reserved_bytes - peak) / peak:+.1%} | {p.swap_bytes / MiB:.0f} MiB | "
                  f"{_median(swapped) / MiB:.0f} MiB | {predicted_total * 1e3:.1f} ms | "
                  f"{measured_total * 1e3:.1f} ms, {sum(waits) / len(waits) * 1e3:.1f} ms | {error:+.0%} | {per_run} ms | "
                  f"{p.stall_s * 1e3:.1f} / {_median(copy_waits) * 1e3:.1f} ms | "
                  f"{p.recompute_s * 1e3:.1f} ({p.recompute_count:g}) / {_median(recomputed) * 1e3:.1f} ms "
                  f"({_median(recompute_counts):g}) | "
                  f"{p.median_of(lambda r: r.unpack_stall_s + r.recompute_s) * 1e3:.1f} ms | {_median(unpack) * 1e3:.1f} ms | "
                  f"{p.prefetch_misses:g} / {_median(misses):g} | {loads} |")
        sys.stdout.flush()
    return within


def ablate(measured: dict) -> None:
    """The link model part by part against one measurement: main's model
    before this branch (torch copy rate, a GPU's pages), the host backend's
    copy rate alone, then with the duplex and compute shares, then with the
    hand-off latency, then with the rate by copy size (Note [Rate by copy
    size]), then with the host time before backward's first op (the full
    window model, Note [Backward's start]); last, every traced host gap
    between ops (Note [Host time between ops]; both zero in traces made
    before host time was recorded)."""
    import dataclasses
    import statistics

    final = window_device(measured)
    torch_copy = statistics.median(c["memory_bytes_per_s"] for c in measured["calibrations"]) / 2
    variants = {
        f"torch copy rate ({torch_copy / 1e9:.1f} GB/s), 2 MiB pages": (dataclasses.replace(
            final, link_bytes_per_s=torch_copy, link_duplex_share=1.0, link_compute_share=1.0, link_latency_s=0.0,
            page_bytes=2 << 20, link_rate_by_size=()), False),
        "host-backend copy rate": (dataclasses.replace(final, link_duplex_share=1.0, link_compute_share=1.0,
                                                       link_latency_s=0.0, link_rate_by_size=()), False),
        "+ duplex and compute shares": (dataclasses.replace(final, link_latency_s=0.0, link_rate_by_size=()), False),
        "+ hand-off latency": (dataclasses.replace(final, link_rate_by_size=()), False),
        "+ rate by copy size": (final, False),
        "+ backward's start (the model)": (final, "backward"),
        "+ every host gap between ops (traced)": (final, True),
    }
    warmup = measured["warmup"]
    points = {(name, f): _median([x for r in runs if "error" not in r for x in _stall_and_recompute(r, warmup)])
              for name, model in measured["models"].items() for f, runs in model["runs"].items()}
    print("| link model | " + " | ".join(f"{n} {float(f):.0%}" for n, f in points) + " |")
    print("|---|" + "---|" * len(points))
    print("| measured stall+recompute (median) | " + " | ".join(f"{v * 1e3:.1f} ms" for v in points.values()) + " |")
    for label, device in variants.items():
        device, host_time = device
        rows = predict(measured, device, host_time)
        cells = []
        for (n, f), m in points.items():
            p = rows[n][f].stall_and_recompute_s
            cells.append(f"{p * 1e3:.1f} ms" + (f" ({(p - m) / m:+.0%})" if m > 0 else ""))
        print(f"| {label} | " + " | ".join(cells) + " |")


def validate(size: str, fractions, steps: int, warmup: int, repeats: int, actions: str, models_: str,
             save: str = None, load: str = None, variants: bool = False) -> None:
    """Measure (or ``load`` earlier measurements), predict with the
    ``cpu-host`` model, print the table."""
    import json

    import tempfile

    torch.set_num_threads(1)
    if load:
        saved = json.loads(Path(load).read_text())
        # One measurement (older files, one ``actions``), or one per actions.
        windows = saved["validations"] if "validations" in saved else [saved]
    else:
        trace_dir = Path(save).with_suffix("") if save else Path(tempfile.mkdtemp(prefix="membudget-validate-"))
        windows = []
        for choice in actions.split(","):
            print(f"actions={choice}:", file=sys.stderr, flush=True)
            (trace_dir / choice).mkdir(parents=True, exist_ok=True)
            windows.append(measure(models_.split(","), size, fractions, steps, warmup, repeats, choice,
                                   trace_dir / choice))
            if save:  # kept as each window ends: nothing lost if a later one fails
                Path(save).write_text(json.dumps({"validations": windows}))
    within = []
    for measured in windows:
        device = window_device(measured)
        print(f"\n**actions={measured['actions']}**\n")
        if variants:
            ablate(measured)
            continue
        print(f"cpu-host model: {device.note}\n")
        within += report(measured, predict(measured, device))
    if within:
        print(f"\nstall+recompute within 25%: {sum(within)}/{len(within)} points")


def table(names, budgets, device: str) -> None:
    """Print the policy table on ``device`` (see module doc)."""
    from membudget.sim_models import trace_model

    for name in names:
        start = time.perf_counter()
        trace = trace_model(name)
        traced = time.perf_counter() - start
        rows = simulate(trace, budgets, device=device, floor=True)
        peak = unbudgeted_peak(trace, device)
        meta = trace.metadata
        print(f"\n**{name}** (batch {meta['batch']}, seq/image {meta['seq']}, {meta['dtype']}; "
              f"{len(trace.ops)} ops; unbudgeted peak {peak / 2**30:.1f} GiB; traced in {traced:.1f} s, "
              f"simulated in {time.perf_counter() - start - traced:.1f} s)\n")
        policies = list(dict.fromkeys(r.policy for r in rows))
        sizes = list(dict.fromkeys(r.budget_bytes for r in rows))
        print("| budget | floor step | " + " | ".join(policies) + " |")
        print("|---|---|" + "---|" * len(policies))
        for b, label in zip(sizes, budgets):
            cells = []
            for p in policies:
                r = next(r for r in rows if r.policy == p and r.budget_bytes == b)
                cells.append(f"{r.overhead_ratio:.2f}" if r.feasible else "OOM")
            floor = next(r.floor_s for r in rows if r.budget_bytes == b)
            floor_text = f"{floor * 1e3:.1f} ms" if floor is not None else "infeasible"
            print(f"| {label} ({b / 2**30:.1f} GiB) | {floor_text} | " + " | ".join(cells) + " |")
        sys.stdout.flush()


def main() -> int:
    """Parse the command line and run ``validate`` or ``table``."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    v = sub.add_parser("validate")
    v.add_argument("--quick", action="store_true", help="the small test-sized workloads")
    v.add_argument("--steps", type=int, default=10)
    v.add_argument("--warmup", type=int, default=2, help="steps left out of the measured per-step numbers")
    v.add_argument("--repeats", type=int, default=2, help="managed runs per budget (interleaved rounds)")
    v.add_argument("--models", default="gpt,cnn")
    v.add_argument("--save", help="write the real runs' results here (JSON)")
    v.add_argument("--load", help="predict against results saved by --save instead of running")
    v.add_argument("--actions", default="both,swap,recompute",
                   help="comma list of swap, recompute, both: one measurement window each, in turn")
    v.add_argument("--variants", action="store_true",
                   help="with --load: stall+recompute under the model part by part")
    t = sub.add_parser("table")
    t.add_argument("--models", default="gpt2,bert,resnet50,lstm-nmt,llama-7b")
    t.add_argument("--budgets", default="80%,60%,40%")
    t.add_argument("--device", default="h200")
    args = parser.parse_args()
    if args.command == "validate":
        bad = [a for a in args.actions.split(",") if a not in ACTIONS]
        if bad:
            parser.error(f"--actions: {', '.join(bad)} is not one of {', '.join(ACTIONS)}")
        validate("quick" if args.quick else "default", (0.8, 0.6, 0.5), args.steps, args.warmup, args.repeats,
                 args.actions, args.models, args.save, args.load, args.variants)
    else:
        table(args.models.split(","), args.budgets.split(","), args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())

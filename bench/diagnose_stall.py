"""Where the stall of a real CPU run goes, copy by copy, against its simulation.

    python bench/diagnose_stall.py [--models gpt,cnn] [--fractions 0.8,0.6,0.5] [--steps 6] [--record 3]

For each workload of membudget.models (default size, one torch thread) and each
budget (a fraction of the unbudgeted peak): one real run under the budget in a
fresh process, recording the HostBackend's copy timeline (Note [Copy
timeline]) over steps ``--record`` onwards; and the same step traced and
replayed over SimBackend with the ``cpu-host`` device model, recording the
measured iteration's timeline on modelled time. Per step, side by side:

* copies per direction: count, MiB, busy seconds (memcpy running) and the rate
  they achieved, seconds queued behind earlier copies;
* blocking waits of the compute thread on a copy, split by what the copy was
  doing when the wait began: ``miss`` (issued by the waiter itself: a
  synchronous swap-in or swap-out), ``queued`` (issued earlier but not started
  yet: behind other copies on its stream), ``running`` (started, not done);
  for each, the count and seconds, and for ``queued`` the part of the wait
  spent before the copy started.

The real run also reports the copy rate of a lone memcpy thread against the
same thread beside a busy compute thread (``--contention``), which is what
the ``cpu-host`` link is calibrated from.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))

MiB = 2**20
_PREFIX = "DIAGNOSE_RESULT "


def _worker(spec: Dict[str, Any]) -> Dict[str, Any]:
    """One real run in this fresh process (as membudget.harness.run_worker
    does it), recording the copy timeline from step ``record`` on."""
    import gc

    import torch

    import membudget
    from membudget import harness, models
    from membudget._native import load_extension

    torch.set_num_threads(1)
    native = load_extension()
    membudget.install(budget=spec["budget"], policy="delta", actions=spec["actions"],
                      min_tensor_bytes=harness.DEFAULT_MIN_TENSOR_BYTES, device=torch.device("cpu"))
    gc.collect()
    native.release_cached()
    membudget.reset_counters()
    workload = models.WORKLOADS[spec["model"]]["default"]()
    torch.manual_seed(0)
    model = workload.build()
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    steps: List[Dict[str, Any]] = []
    import time

    for index in range(spec["steps"]):
        native.set_copy_timeline(index >= spec["record"], True)
        before = membudget.memory_stats()
        start = time.perf_counter()
        data = workload.batch(torch.device("cpu"))
        optimizer.zero_grad(set_to_none=True)
        loss = workload.loss(model, data)
        loss.backward()
        optimizer.step()
        loss.item()
        seconds = time.perf_counter() - start
        del loss, data
        after = membudget.memory_stats()
        timeline = native.copy_timeline()
        steps.append({
            "seconds": seconds,
            "timeline": timeline,
            "stall_seconds": after["stall_seconds"] - before["stall_seconds"],
            "recompute_seconds": after["recompute_seconds"] - before["recompute_seconds"],
            "prefetch_hits": after["prefetch_hits"] - before["prefetch_hits"],
            "prefetch_misses": after["prefetch_misses"] - before["prefetch_misses"],
            "swap_in_bytes": after["swap_in_bytes"] - before["swap_in_bytes"],
            "swap_out_bytes": after["swap_out_bytes"] - before["swap_out_bytes"],
        })
    return {"steps": steps, "peak": membudget.memory_stats()["reserved_bytes.all.peak"]}


def _spawn(spec: Dict[str, Any]) -> Dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], env=env, capture_output=True,
                          text=True, timeout=900)
    for line in proc.stdout.splitlines():
        if line.startswith(_PREFIX):
            return json.loads(line[len(_PREFIX):])
    raise RuntimeError(f"worker failed: {proc.stderr.strip()[-2000:]}")


def classify_waits(timeline: Dict[str, Any]) -> Dict[str, Any]:
    """Split the blocking waits of one timeline (see the module doc). A copy
    issued within ``slack`` of the wait's start is the waiter's own (a miss):
    the real clock reads the two times microseconds apart."""
    copies = {c[0]: c for c in timeline["copies"]}
    out = {kind: {"count": 0, "seconds": 0.0, "before_start_s": 0.0} for kind in ("miss", "queued", "running",
                                                                                   "unknown")}
    slack = 200e-6
    for copy_index, started, ended in timeline["waits"]:
        c = copies.get(copy_index)
        if c is None:
            kind, before = "unknown", 0.0
        else:
            _, _, _, enqueued, copy_started, _ = c
            if enqueued >= started - slack:
                kind = "miss"
            elif copy_started > started:
                kind = "queued"
            else:
                kind = "running"
            before = max(0.0, min(copy_started, ended) - started)
        out[kind]["count"] += 1
        out[kind]["seconds"] += ended - started
        out[kind]["before_start_s"] += before
    return out


def summarize(timeline: Dict[str, Any]) -> Dict[str, Any]:
    """Per direction: copies, MiB, busy and queued seconds, achieved rate;
    and the waits classified."""
    t = timeline["totals"]
    summary: Dict[str, Any] = {}
    for lane in ("d2h", "h2d"):
        busy = t[f"busy_seconds.{lane}"]
        summary[lane] = {"copies": t[f"copies.{lane}"], "mib": t[f"bytes.{lane}"] / MiB, "busy_ms": busy * 1e3,
                         "queued_ms": t[f"queued_seconds.{lane}"] * 1e3,
                         "gb_per_s": t[f"bytes.{lane}"] / busy / 1e9 if busy > 0 else 0.0}
    summary["waits"] = t["waits"]
    summary["wait_ms"] = t["wait_seconds"] * 1e3
    summary["by_kind"] = classify_waits(timeline)
    return summary


def _trace(name: str):
    """The trace bench_simulate.py's validation simulates for this workload."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_simulate import _trace_workload
    from membudget import models

    return _trace_workload(models.WORKLOADS[name]["default"]())


def _simulate(trace, budget: int, actions: str, device) -> Dict[str, Any]:
    from membudget import harness
    from membudget.replay_program import backward_start_seconds, op_durations
    from membudget.simulate import _replay

    durations = op_durations(trace, device)
    # As simulate() by default: the host time at backward's start (Note [Backward's start]).
    return _replay(trace, durations, "manager", "delta", budget, device.memory_bytes, device,
                   harness.DEFAULT_MIN_TENSOR_BYTES, 256 << 20, 0.8, 2, actions, True, record_timeline=True,
                   host=backward_start_seconds(trace, device))


def _line(label: str, s: Dict[str, Any]) -> str:
    k = s["by_kind"]
    return (f"| {label} | " + " | ".join(
        f"{s[d]['copies']} / {s[d]['mib']:.0f} / {s[d]['busy_ms']:.1f} ms / {s[d]['gb_per_s']:.2f} / "
        f"{s[d]['queued_ms']:.1f} ms" for d in ("d2h", "h2d"))
        + f" | {s['waits']} / {s['wait_ms']:.1f} ms | "
        + " | ".join(f"{k[kind]['count']} / {k[kind]['seconds'] * 1e3:.1f} ms" for kind in ("miss", "running"))
        + f" | {k['queued']['count']} / {k['queued']['seconds'] * 1e3:.1f} ms "
          f"({k['queued']['before_start_s'] * 1e3:.1f} before start) |")


def main() -> int:
    """Parse the command line; run the worker or the comparison."""
    if sys.argv[1:2] == ["--worker"]:
        result = _worker(json.loads(sys.argv[2]))
        print(_PREFIX + json.dumps(result))
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="gpt,cnn")
    parser.add_argument("--fractions", default="0.8,0.6,0.5")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--record", type=int, default=2, help="first step whose timeline is kept")
    parser.add_argument("--actions", default="both")
    parser.add_argument("--peaks", default="gpt=224198656,cnn=55717888",
                        help="unbudgeted peaks in bytes (from bench_simulate.py validate)")
    args = parser.parse_args()
    import torch

    from membudget import costs

    torch.set_num_threads(1)
    device = costs.device_model("cpu-host")
    print(f"cpu-host: link {device.link_bytes_per_s / 1e9:.2f} GB/s, fp32 {device.flops_per_s['fp32'] / 1e9:.1f} "
          f"GFLOP/s; load average {os.getloadavg()}")
    peaks = dict((k, int(v)) for k, v in (p.split("=") for p in args.peaks.split(",")))
    print("| run | d2h copies / MiB / busy / GB/s / queued | h2d copies / MiB / busy / GB/s / queued | "
          "waits / total | miss | running | queued |")
    print("|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        trace = _trace(name)
        for fraction in (float(f) for f in args.fractions.split(",")):
            budget = int(fraction * peaks[name])
            sim = _simulate(trace, budget, args.actions, device)
            print(_line(f"{name} {fraction:.0%} sim", summarize(sim["timeline"])) +
                  f" unpack stall {sim['unpack_stall_s'] * 1e3:.1f} ms, recompute {sim['recompute_s'] * 1e3:.1f} ms,"
                  f" hits/misses {sim['prefetch_hits']}/{sim['prefetch_misses']}, step {sim['total_s'] * 1e3:.0f} ms")
            real = _spawn({"model": name, "budget": budget, "steps": args.steps, "record": args.record,
                           "actions": args.actions})
            for index, step in enumerate(real["steps"]):
                if index < args.record:
                    continue
                print(_line(f"{name} {fraction:.0%} real step {index}", summarize(step["timeline"])) +
                      f" unpack stall {step['stall_seconds'] * 1e3:.1f} ms, recompute "
                      f"{step['recompute_seconds'] * 1e3:.1f} ms, hits/misses {step['prefetch_hits']}/"
                      f"{step['prefetch_misses']}, step {step['seconds'] * 1e3:.0f} ms")
            sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())

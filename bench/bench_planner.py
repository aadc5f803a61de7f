"""Echo planner vs PyTorch's activation_memory_budget, side by side, same executor.

Every run is a fresh process (membudget's allocator is process-wide): it
installs membudget with no budget (it only counts, nothing is managed), builds
a workload from :mod:`membudget.planner.workloads`, compiles its loss with
AOTAutograd and a partitioner, and reports the measured peak of allocated
bytes over one training step (forward + backward, parameters, gradients and
inputs included) and the median step time.

Partitioners, all executed the same way (the partitioned FX graphs run op by
op, ``boxed_nop``, so that measured memory is the partitioner's and not a
code generator's):

* ``eager``: no compile, the reference;
* ``torch-default``: ``min_cut_rematerialization_partition`` with
  ``activation_memory_budget=1.0`` (torch.compile's default partitioner);
* ``torch-{dp,greedy,ilp}@f``: the same with ``activation_memory_budget=f``
  and that solver;
* ``echo@f``: ours, ``compile_backend(budget="f%")`` (f of the graph's
  activation memory above its parameters and inputs);
* ``echo@=torch``: ours given, as an absolute budget, the lowest peak any of
  torch's solvers measured at that f: equal peak, compare time.

Usage: ``PYTHONPATH=python .venv/bin/python bench/bench_planner.py [--models gpt2,bert] [--fractions 0.5,0.2]``
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
PREFIX = "PLANNER_RESULT "


def recompute_counter(partition, counts: Dict[str, float]):
    """Wrap a partition function to count what its backward recomputes: call
    nodes present in both the forward and the backward graph (views and
    getitems left out), their FLOPs and their modelled time by membudget's
    cost model (``cpu-host`` roofline, the planner's own: the same yardstick
    for every partitioner)."""
    import operator

    from membudget import costs
    from membudget.planner.graph import _roofline

    device = costs.device_model("cpu-host")

    def counted(gm, joint_inputs, **kwargs):
        fw, bw = partition(gm, joint_inputs, **kwargs)
        forward = {n.name for n in fw.graph.nodes if n.op == "call_function"}
        for n in bw.graph.nodes:
            if n.op != "call_function" or n.name not in forward or n.target is operator.getitem:
                continue
            if costs.op_category(n.target) == "view":
                continue
            val = lambda x: x.meta.get("val")  # noqa: E731
            import torch.fx as fx

            args = fx.node.map_arg(n.args, val)
            kwargs_ = fx.node.map_arg(n.kwargs, val)
            counts["ops"] = counts.get("ops", 0) + 1
            try:
                counts["flops"] = counts.get("flops", 0) + costs.op_flops(n.target, args, kwargs_, n.meta.get("val"))
            except Exception:  # noqa: BLE001
                pass
            counts["model_s"] = counts.get("model_s", 0.0) + _roofline(n.target, args, kwargs_, n.meta.get("val"),
                                                                        device)[1]
        return fw, bw

    counted.__dict__.update(getattr(partition, "__dict__", {}))
    return counted


def calibrated_device() -> Dict[str, Any]:
    """The ``cpu-host`` cost model, calibrated once in the parent process
    (one torch thread, as the workers run) and handed to every worker: the
    calibration is a timing, so per-process calibration on a loaded machine
    would give every run its own yardstick (and our planner its own costs)."""
    import dataclasses

    import torch
    from membudget import costs

    torch.set_num_threads(1)
    return dataclasses.asdict(costs.device_model("cpu-host"))


def _use_device(fields: Optional[Dict[str, Any]]) -> None:
    if not fields:
        return
    from membudget import costs

    device = costs.DeviceModel(**fields)
    costs._calibrated_cpu_host = lambda: device  # device_model("cpu-host") now returns the parent's


def _setup(device: Optional[Dict[str, Any]] = None):
    import torch

    torch.set_num_threads(1)
    _use_device(device)
    import membudget

    membudget.install(budget=None, min_tensor_bytes="1TiB", actions="swap")  # count only
    import transformers

    transformers.logging.set_verbosity_error()


def compiled(w, spec: Dict[str, Any], counts: Dict[str, float]):
    """``(fn, backend)``: the workload's loss compiled as ``spec`` says
    (``eager``, ``torch-*`` or ``echo``), every compiled mode run by the same
    ``boxed_nop`` executor. The partition runs on the first call: torch's
    ``activation_memory_budget`` settings are read then."""
    import torch
    from membudget.planner import compile_backend
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop
    from torch._functorch import config as fconfig
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    mode = spec["mode"]
    if mode == "eager":
        return w.loss, None
    if mode.startswith("torch"):
        fconfig.activation_memory_budget = spec.get("fraction", 1.0)
        fconfig.activation_memory_budget_solver = spec.get("solver") or "dp"
        backend = aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop,
                               partition_fn=recompute_counter(min_cut_rematerialization_partition, counts))
    else:
        echo = compile_backend(spec["budget"], compiler="aot_eager", method=spec.get("method", "greedy"))
        backend = aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop,
                               partition_fn=recompute_counter(echo.partitioner, counts))
        backend.partitioner = echo.partitioner
    return torch.compile(w.loss, backend=backend), backend


def worker(spec: Dict[str, Any]) -> Dict[str, Any]:
    _setup(spec.get("device"))
    import membudget
    import torch
    from membudget._native import load_extension
    from membudget.planner.workloads import workload

    w = workload(spec["model"])
    torch.manual_seed(0)
    model = w.build()
    batch = w.batch()
    counts: Dict[str, float] = {}
    fn, backend = compiled(w, spec, counts)
    times: List[float] = []
    losses: List[float] = []
    peak = 0
    compile_s = None
    for step in range(spec.get("steps", 15)):
        model.zero_grad(set_to_none=True)
        if step == 1:
            gc.collect()
            load_extension().release_cached()
            membudget.reset_peak_stats()
        start = time.perf_counter()
        loss = fn(model, batch)
        loss.backward()
        losses.append(loss.item())
        del loss
        if step == 0:
            compile_s = time.perf_counter() - start
        else:
            times.append(time.perf_counter() - start)
    peak = membudget.memory_stats()["allocated_bytes.all.peak"]
    result = {"spec": spec, "peak": peak, "step_s": statistics.median(times), "losses": losses,
              "compile_s": compile_s, "recomputed_ops": int(counts.get("ops", 0)),
              "recomputed_gflop": counts.get("flops", 0) / 1e9, "recompute_model_ms": 1e3 * counts.get("model_s", 0.0)}
    if backend is not None and hasattr(backend, "partitioner"):
        result["predicted"] = [p["selection"].predicted_peak for p in backend.partitioner.plans]
        result["recomputed"] = sum(len(p["selection"].recompute) for p in backend.partitioner.plans)
        result["feasible"] = all(p["selection"].feasible for p in backend.partitioner.plans)
    return result


def timing_worker(spec: Dict[str, Any]) -> Dict[str, Any]:
    """Step times of several variants of one model in one process,
    interleaved: round r runs one step of every variant in turn, so that
    load from other processes on the machine falls on all of them alike.
    Memory is not measured here (the allocator's peak is process-wide)."""
    _setup()
    import torch
    from membudget.planner.workloads import workload

    torch._dynamo.config.cache_size_limit = 64  # one entry per variant (dynamo guards on the backend)
    torch._dynamo.config.accumulated_cache_size_limit = 512
    w = workload(spec["model"])
    torch.manual_seed(0)
    model = w.build()
    batch = w.batch()
    fns = []
    for variant in spec["variants"]:
        fn, _ = compiled(w, variant, {})
        for _ in range(2):  # compile, then one warm step
            model.zero_grad(set_to_none=True)
            fn(model, batch).backward()
        fns.append(fn)
    times: List[List[float]] = [[] for _ in fns]
    for _ in range(spec.get("rounds", 30)):
        for i, fn in enumerate(fns):
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            fn(model, batch).backward()
            times[i].append(time.perf_counter() - start)
    return {"spec": spec, "median_s": [statistics.median(t) for t in times],
            "q1_s": [statistics.quantiles(t, n=4)[0] for t in times],
            "q3_s": [statistics.quantiles(t, n=4)[2] for t in times]}


DEVICE: Dict[str, Any] = {}


def spawn(spec: Dict[str, Any], timeout: float = 900) -> Dict[str, Any]:
    """Run ``spec`` in a fresh worker process (with the parent's cost model)."""
    if DEVICE:
        spec = dict(spec, device=DEVICE)
        if "variants" in spec:
            spec["variants"] = [dict(v, device=DEVICE) for v in spec["variants"]]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMBUDGET_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "python"), env.get("PYTHONPATH")]))
    try:
        proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], env=env,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"spec": spec, "error": "timeout"}
    for line in proc.stdout.splitlines():
        if line.startswith(PREFIX):
            return json.loads(line[len(PREFIX):])
    tail = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()[-1]
    return {"spec": spec, "error": tail[:300]}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker")
    parser.add_argument("--models", default="gpt2,bert,resnet,seq2seq")
    parser.add_argument("--fractions", default="0.5,0.2")
    parser.add_argument("--solvers", default="dp,greedy,ilp")
    parser.add_argument("--rounds", type=int, default=30, help="interleaved timing rounds per variant")
    args = parser.parse_args()
    if args.worker:
        spec = json.loads(args.worker)
        print(PREFIX + json.dumps(timing_worker(spec) if "variants" in spec else worker(spec)), flush=True)
        return 0
    import platform

    import torch

    DEVICE.update(calibrated_device())
    print(f"# bench_planner: {platform.machine()} CPU, torch {torch.__version__}, 1 torch thread per run, "
          f"aot_eager executor (boxed_nop), peak = allocated bytes over one step")
    print(f"# cost model (cpu-host, calibrated once, used by every run): {DEVICE['flops_per_s']['fp32'] / 1e9:.1f} "
          f"GFLOP/s fp32, {DEVICE['memory_bytes_per_s'] / 1e9:.1f} GB/s, launch {1e6 * DEVICE['launch_s']:.1f} us")
    start = time.time()
    summary = []
    for model in args.models.split(","):
        eager = spawn({"model": model, "mode": "eager"})
        default = spawn({"model": model, "mode": "torch-default", "fraction": 1.0})
        rows = [("eager", eager), ("torch-default", default)]
        targets: Dict[int, Any] = {}
        for f in [float(x) for x in args.fractions.split(",")]:
            torch_runs = []
            for solver in args.solvers.split(","):
                r = spawn({"model": model, "mode": f"torch-{solver}", "fraction": f, "solver": solver})
                rows.append((f"torch-{solver}@{f}", r))
                if "error" not in r:
                    torch_runs.append(r)
            rows.append((f"echo@{f}", spawn({"model": model, "mode": "echo", "budget": f"{100 * f:g}%"})))
            if torch_runs:
                target = int(min(r["peak"] for r in torch_runs))
                targets[target] = spawn({"model": model, "mode": "echo", "budget": target})
                rows.append((f"echo@=torch({f})", targets[target]))
        ok = [(name, r) for name, r in rows if "error" not in r]
        torch_best = min(((n, r) for n, r in ok if n.startswith("torch-") and n != "torch-default"),
                         key=lambda x: (x[1]["peak"], x[1]["recompute_model_ms"]), default=None)
        if torch_best is not None and int(torch_best[1]["peak"]) not in targets:
            targets[int(torch_best[1]["peak"])] = spawn({"model": model, "mode": "echo",
                                                         "budget": int(torch_best[1]["peak"])})
            rows.append(("echo@=torch(best)", targets[int(torch_best[1]["peak"])]))
            ok.append(rows[-1])
        echo_best = min(((n, r) for n, r in ok if n.startswith("echo")),
                        key=lambda x: (x[1]["peak"], x[1]["recompute_model_ms"]), default=None)
        equal = targets.get(int(torch_best[1]["peak"])) if torch_best is not None else None
        # Step times interleaved in one process: eager, torch-default, torch's
        # lowest peak, ours at that peak, ours at our lowest peak.
        variants = [("eager", eager), ("torch-default", default)]
        if torch_best is not None:
            variants.append((torch_best[0], torch_best[1]))
        if equal is not None and "error" not in equal:
            variants.append(("echo@=torch(best)", equal))
        if echo_best is not None:
            variants.append((echo_best[0], echo_best[1]))
        timing = spawn({"model": model, "variants": [r["spec"] for _, r in variants], "rounds": args.rounds})
        base_t = default.get("step_s") or float("nan")
        ref_loss = eager.get("losses", [None])[-1]
        print(f"\n## {model}\n")
        print("| run | peak MiB | vs eager | step ms | vs torch-default | ops recomputed | recompute GFLOP "
              "| recompute ms (model) | loss = eager |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
        for name, r in rows:
            if "error" in r:
                print(f"| {name} | failed: {r['error']} | | | | | | | |")
                continue
            print(f"| {name} | {r['peak'] / 2**20:.2f} | {r['peak'] / eager['peak']:.2f} | {1e3 * r['step_s']:.1f} "
                  f"| {r['step_s'] / base_t:.2f} | {r['recomputed_ops']} | {r['recomputed_gflop']:.3f} "
                  f"| {r['recompute_model_ms']:.2f} | {abs(r['losses'][-1] - ref_loss) <= 1e-5 * abs(ref_loss)} |")
        if "error" not in timing:
            print(f"\nStep time, {args.rounds} rounds interleaved in one process (median [q1, q3] ms):\n")
            print("| run | median ms | q1-q3 ms | vs torch-default |")
            print("| --- | ---: | ---: | ---: |")
            for (name, _), med, q1, q3 in zip(variants, timing["median_s"], timing["q1_s"], timing["q3_s"]):
                print(f"| {name} | {1e3 * med:.1f} | {1e3 * q1:.1f}-{1e3 * q3:.1f} | {med / timing['median_s'][1]:.2f} |")
        else:
            print(f"\ninterleaved timing failed: {timing['error']}")
        if torch_best is not None and echo_best is not None:
            summary.append((model, torch_best, echo_best, equal, timing, variants))
        sys.stdout.flush()
    print("\n## Verdict\n")
    print("| model | torch lowest peak (run) | ours lowest peak (run) | lower peak | ours at torch's peak "
          "| GFLOP / model ms: ours@= vs torch | interleaved ms: ours@= vs torch |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for model, (tn, tr), (en, er), equal, timing, variants in summary:
        lower = er["peak"] < tr["peak"]
        cells = [f"{tr['peak'] / 2**20:.2f} ({tn})", f"{er['peak'] / 2**20:.2f} ({en})",
                 "met" if lower else "missed"]
        if equal is not None and "error" not in equal:
            cells.append(f"{equal['peak'] / 2**20:.2f} ({'<=' if equal['peak'] <= tr['peak'] else '>'} torch)")
            cells.append(f"{equal['recomputed_gflop']:.3f} / {equal['recompute_model_ms']:.2f} vs "
                         f"{tr['recomputed_gflop']:.3f} / {tr['recompute_model_ms']:.2f}")
            names = [n for n, _ in variants]
            if "error" not in timing and "echo@=torch(best)" in names:
                med = timing["median_s"]
                cells.append(f"{1e3 * med[names.index('echo@=torch(best)')]:.1f} vs {1e3 * med[names.index(tn)]:.1f}")
            else:
                cells.append("n/a")
        else:
            cells += ["failed", "", ""]
        print(f"| {model} | " + " | ".join(cells) + " |")
    print(f"\n{time.time() - start:.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())

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
from typing import Any, Dict, List

ROOT = Path(__file__).resolve().parents[1]
PREFIX = "PLANNER_RESULT "


def recompute_counter(partition, counts: Dict[str, float]):
    """Wrap a partition function to count what its backward recomputes: call
    nodes present in both the forward and the backward graph (views and
    getitems left out), and their FLOPs by membudget's cost model."""
    import operator

    from membudget import costs

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
        return fw, bw

    counted.__dict__.update(getattr(partition, "__dict__", {}))
    return counted


def worker(spec: Dict[str, Any]) -> Dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    import membudget
    from membudget._native import load_extension

    membudget.install(budget=None, min_tensor_bytes="1TiB", actions="swap")  # count only
    import transformers

    transformers.logging.set_verbosity_error()
    from membudget.planner import compile_backend
    from membudget.planner.workloads import workload
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop
    from torch._functorch import config as fconfig
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    w = workload(spec["model"])
    torch.manual_seed(0)
    model = w.build()
    batch = w.batch()
    mode = spec["mode"]
    backend = None
    counts: Dict[str, float] = {}
    if mode == "eager":
        fn = w.loss
    else:
        if mode.startswith("torch"):
            fconfig.activation_memory_budget = spec.get("fraction", 1.0)
            if spec.get("solver"):
                fconfig.activation_memory_budget_solver = spec["solver"]
            backend = aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop,
                                   partition_fn=recompute_counter(min_cut_rematerialization_partition, counts))
        else:
            backend = compile_backend(spec["budget"], compiler="aot_eager", method=spec.get("method", "greedy"))
            partitioner = backend.partitioner
            backend = aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop,
                                   partition_fn=recompute_counter(partitioner, counts))
            backend.partitioner = partitioner
        fn = torch.compile(w.loss, backend=backend)
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
              "recomputed_gflop": counts.get("flops", 0) / 1e9}
    if backend is not None and hasattr(backend, "partitioner"):
        result["predicted"] = [p["selection"].predicted_peak for p in backend.partitioner.plans]
        result["recomputed"] = sum(len(p["selection"].recompute) for p in backend.partitioner.plans)
        result["feasible"] = all(p["selection"].feasible for p in backend.partitioner.plans)
    return result


def spawn(spec: Dict[str, Any], timeout: float = 900) -> Dict[str, Any]:
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
    args = parser.parse_args()
    if args.worker:
        print(PREFIX + json.dumps(worker(json.loads(args.worker))), flush=True)
        return 0
    import platform

    import torch

    print(f"# bench_planner: {platform.machine()} CPU, torch {torch.__version__}, 1 torch thread per run, "
          f"aot_eager executor (boxed_nop), peak = allocated bytes over one step")
    start = time.time()
    for model in args.models.split(","):
        eager = spawn({"model": model, "mode": "eager"})
        default = spawn({"model": model, "mode": "torch-default", "fraction": 1.0})
        rows = [("eager", eager), ("torch-default", default)]
        for f in [float(x) for x in args.fractions.split(",")]:
            torch_runs = []
            for solver in args.solvers.split(","):
                r = spawn({"model": model, "mode": f"torch-{solver}", "fraction": f, "solver": solver})
                rows.append((f"torch-{solver}@{f}", r))
                if "error" not in r:
                    torch_runs.append(r)
            rows.append((f"echo@{f}", spawn({"model": model, "mode": "echo", "budget": f"{100 * f:g}%"})))
            if torch_runs:
                target = min(r["peak"] for r in torch_runs)
                rows.append((f"echo@=torch({f})", spawn({"model": model, "mode": "echo", "budget": int(target)})))
        base_t = default.get("step_s") or float("nan")
        ref_loss = eager.get("losses", [None])[-1]
        print(f"\n## {model}\n")
        print("| run | peak MiB | vs eager | step ms | vs torch-default | ops recomputed | recompute GFLOP "
              "| loss = eager |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
        for name, r in rows:
            if "error" in r:
                print(f"| {name} | failed: {r['error']} | | | | | |")
                continue
            print(f"| {name} | {r['peak'] / 2**20:.2f} | {r['peak'] / eager['peak']:.2f} | {1e3 * r['step_s']:.1f} "
                  f"| {r['step_s'] / base_t:.2f} | {r['recomputed_ops']} | {r['recomputed_gflop']:.3f} "
                  f"| {abs(r['losses'][-1] - ref_loss) <= 1e-5 * abs(ref_loss)} |")
        sys.stdout.flush()
    print(f"\n{time.time() - start:.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Seeded training runs measured one per subprocess: plain, unbudgeted, managed.

Where this sits in the flow: nothing in the runtime uses this module. The demo
(:mod:`membudget.demo`) and the benchmarks (``bench/``) compare the same seeded
training run three ways:

* ``plain``: nothing of membudget installed; PyTorch's own allocator. The
  reference losses, parameters and step time.
* ``unbudgeted``: membudget installed with no budget, which only counts; its
  peak reserved bytes are *the unmanaged peak* that budgets are fractions of.
* ``managed``: membudget installed under a budget in bytes.

The allocator is process-wide (and on CUDA cannot be swapped back within a
process), so each run is a fresh ``python`` process: :func:`spawn_worker` starts
one with a :class:`RunSpec` as JSON and reads back one JSON result line, which
:func:`run_worker` (called by the worker's ``--worker`` entry point) prints.
A result holds the exact loss floats (JSON keeps a float's every bit) and a
SHA-256 digest of every parameter's and buffer's bytes, so "identical" is decided without
shipping tensors between processes.
"""
from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

__all__ = [
    "RunSpec",
    "MODES",
    "DEFAULT_MIN_TENSOR_BYTES",
    "run_worker",
    "worker_main",
    "spawn_worker",
    "parameter_digest",
    "median_step_seconds",
    "identical",
]

MODES = ("plain", "unbudgeted", "managed")

#: The demo and benches manage saved tensors from 16 KiB up (the library's
#: default is 1 MiB), so that the small CPU-sized models have most of their
#: activations managed, as a model 100x larger would with the default.
DEFAULT_MIN_TENSOR_BYTES = 16 * 1024

_RESULT_PREFIX = "MEMBUDGET_RESULT "

# memory_stats() keys copied into a result.
_STAT_KEYS = (
    "reserved_bytes.all.peak",
    "allocated_bytes.all.peak",
    "budget_bytes",
    "swap_out_bytes",
    "swap_in_bytes",
    "swap_out_count",
    "swap_in_count",
    "evicted_bytes",
    "prefetch_hits",
    "prefetch_misses",
    "stall_seconds",
    "num_alloc_retries",
    "num_ooms",
    # Recomputation (issue 3).
    "recompute_count",
    "recompute_bytes",
    "recompute_seconds",
    "drop_count",
    "dropped_bytes",
    "planned_drops",
    "evictions_wasted",
    "policy_seconds",
    # Recompute ahead of use (issue 3 part 7).
    "recomputed_ahead_count",
    "recompute_ahead_failed",
    "recompute_ahead_wasted",
    # Expandable segments: pages mapped / unmapped (re-mapping near the budget).
    "mapped_bytes_total",
    "unmapped_bytes_total",
    "moved_bytes_total",
    "link_bytes_per_s",
)

# Counters also read after every step (``step_stats``), so that a comparison
# can leave out the first steps: the first step has no unpack order to
# prefetch by, so every swap-in it does is a synchronous miss.
_STEP_STAT_KEYS = (
    "swap_out_bytes",
    "swap_in_bytes",
    "swap_in_count",
    "prefetch_hits",
    "prefetch_misses",
    "stall_seconds",
    "recompute_count",
    "recompute_seconds",
    "policy_seconds",
    "reserved_bytes.all.peak",
)


@dataclass
class RunSpec:
    """What one worker process runs: ``model`` names a workload the worker's
    entry point can build (``size`` picks its variant), ``mode`` is one of
    :data:`MODES`, ``budget`` is in bytes (``managed`` only), and ``policy``,
    ``actions`` (``swap``, ``recompute`` or ``both``), ``host_budget`` (bytes),
    ``min_tensor_bytes``, ``prefetch_bytes``, ``expandable_segments`` and
    ``recompute_ahead`` go to
    :func:`membudget.install` (``None``: the library's default; ``recompute_ahead``
    ``"immediate"`` is on, with the CPU replaying ahead at the prefetch point
    rather than during copy waits: Note [Recompute ahead timing]); ``threads`` sets torch's intra-op
    threads (``None``: torch's default). ``alternate_policies`` (``managed``
    only) runs blocks of ``alternate_steps`` steps with each policy in turn,
    in this one process, by calling :func:`membudget.install` again with the
    next one between steps (the result's ``step_policies`` says which ran
    each step): two policies compared in one process share its memory layout
    and machine state, which separate processes do not (Note [Policies in
    one process] in bench/bench_in_process.py). Fields added later default to
    ``None``, so older specs (the demo's, bench_swap's) read unchanged."""

    model: str
    mode: str
    steps: int = 4
    size: str = "default"
    device: str = "cpu"
    budget: Optional[int] = None
    policy: Optional[str] = None
    min_tensor_bytes: Optional[int] = DEFAULT_MIN_TENSOR_BYTES
    prefetch_bytes: Optional[int] = None
    seed: int = 0
    threads: Optional[int] = None
    actions: Optional[str] = None
    host_budget: Optional[int] = None
    expandable_segments: Optional[bool] = None
    recompute_ahead: Optional[str] = None
    alternate_policies: Optional[List[str]] = None
    alternate_steps: Optional[int] = None

    def to_json(self) -> str:
        """The spec as one line of JSON, as :meth:`from_json` reads it."""
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "RunSpec":
        """Parse :meth:`to_json`'s output; unknown keys are an error."""
        spec = cls(**json.loads(text))
        if spec.mode not in MODES:
            raise ValueError(f"RunSpec.mode {spec.mode!r}: expected one of {', '.join(MODES)}")
        if spec.mode == "managed" and not spec.budget:
            raise ValueError("RunSpec: a managed run needs a budget in bytes")
        if spec.alternate_policies is not None:
            if spec.mode != "managed" or not spec.alternate_policies or not spec.alternate_steps \
                    or spec.alternate_steps < 1:
                raise ValueError("RunSpec: alternate_policies needs a managed run and alternate_steps >= 1")
        return spec


def parameter_digest(model) -> str:
    """SHA-256 over every parameter's and then every buffer's name, dtype,
    shape and raw bytes, in ``named_parameters()`` and ``named_buffers()``
    order: equal digests mean bit-identical parameters and buffers (batch
    norm's running statistics are buffers: a replay that updated them again
    changed no parameter)."""
    import itertools

    import torch

    digest = hashlib.sha256()
    for name, parameter in itertools.chain(model.named_parameters(), model.named_buffers()):
        value = parameter.detach().cpu().contiguous()
        digest.update(f"{name}:{value.dtype}:{tuple(value.shape)};".encode())
        digest.update(value.view(-1).view(dtype=torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def median_step_seconds(step_seconds: Sequence[float]) -> Optional[float]:
    """The median step time, leaving out the first step (allocator warm-up,
    one-time kernel selection, and membudget's first pass that records the
    unpack order); ``None`` with no steps."""
    timed = list(step_seconds[1:] if len(step_seconds) > 1 else step_seconds)
    if not timed:
        return None
    timed.sort()
    middle = len(timed) // 2
    return timed[middle] if len(timed) % 2 else (timed[middle - 1] + timed[middle]) / 2


def identical(reference: Dict[str, Any], other: Dict[str, Any]) -> bool:
    """True when two results have the same losses, float for float, and the
    same parameter digest."""
    return (
        "error" not in reference
        and "error" not in other
        and reference["losses"] == other["losses"]
        and reference["params_sha256"] == other["params_sha256"]
    )


def run_worker(spec: RunSpec, workload) -> Dict[str, Any]:
    """Run ``spec`` in this (fresh) process on ``workload`` (a
    :class:`membudget.models.Workload` or anything with ``build``, ``batch`` and
    ``loss``) and return the result dict: losses, parameter digest, per-step
    seconds, their median, and for membudget runs the counters of
    :func:`membudget.memory_stats` read right after the last step, and
    ``step_stats``: some of them read after every step (cumulative), on the
    cpu with the copy timeline's totals (``wait_seconds``: blocking waits on
    copies; bytes, busy and queued seconds per direction).

    membudget is installed (for ``unbudgeted``/``managed``) before the model is
    built, its cached segments released and its peaks and counters reset, so
    the peak is this training run's alone."""
    import torch

    if spec.threads:
        torch.set_num_threads(spec.threads)
    device = torch.device(spec.device)
    if device.type == "cuda":
        # Bit-identical runs need deterministic kernels (cuDNN, index_add, ...).
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
        torch.use_deterministic_algorithms(True, warn_only=True)

    membudget = None
    install_args = dict(
        budget=spec.budget if spec.mode == "managed" else None,
        policy=spec.alternate_policies[0] if spec.alternate_policies else spec.policy,
        actions=spec.actions,
        host_budget=spec.host_budget,
        min_tensor_bytes=spec.min_tensor_bytes,
        prefetch_bytes=spec.prefetch_bytes,
        expandable_segments=spec.expandable_segments,
        recompute_ahead="on" if spec.recompute_ahead == "immediate" else spec.recompute_ahead,
        device=device,
    )
    if spec.mode != "plain":
        import membudget
        from membudget._native import load_extension

        membudget.install(**install_args)
        if spec.recompute_ahead == "immediate":
            load_extension().set_cpu_recompute_ahead_timing("immediate")
        gc.collect()
        load_extension().release_cached()
        membudget.reset_counters()
        membudget.reset_peak_stats()
    elif device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()

    torch.manual_seed(spec.seed)
    model = workload.build().to(device)
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses: List[float] = []
    step_seconds: List[float] = []
    step_stats: List[Dict[str, Any]] = []
    step_policies: List[Optional[str]] = []
    for step in range(spec.steps):
        if spec.alternate_policies:
            policy = spec.alternate_policies[(step // spec.alternate_steps) % len(spec.alternate_policies)]
            if step > 0 and step % spec.alternate_steps == 0:
                membudget.install(**dict(install_args, policy=policy))  # between steps: nothing is saved
            step_policies.append(policy)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        data = workload.batch(device)
        optimizer.zero_grad(set_to_none=True)
        loss = workload.loss(model, data)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())  # waits for the device
        step_seconds.append(time.perf_counter() - start)
        del loss, data
        if membudget is not None:
            stats = membudget.memory_stats()
            step_stats.append({key: stats.get(key, 0) for key in _STEP_STAT_KEYS})
            if device.type == "cpu":
                # Every blocking wait on a copy (Note [Copy timeline]): the
                # simulator's stall_s counts the same waits on modelled time.
                step_stats[-1].update(load_extension().copy_timeline()["totals"])

    result: Dict[str, Any] = {"spec": dataclasses.asdict(spec), "losses": losses, "step_seconds": step_seconds,
                              "median_step_s": median_step_seconds(step_seconds),
                              "threads": torch.get_num_threads()}
    if spec.alternate_policies:
        result["step_policies"] = step_policies
    if membudget is not None:
        stats = membudget.memory_stats()
        result["stats"] = {key: stats.get(key, 0) for key in _STAT_KEYS}
        result["step_stats"] = step_stats
        from . import _runtime

        # Forward ops lineage recorded over all steps (0: recomputation not allowed).
        lineage = _runtime._lineage
        result["stats"]["ops_recorded"] = lineage.ops_recorded if lineage is not None else 0
    elif device.type == "cuda":
        result["stats"] = {"reserved_bytes.all.peak": torch.cuda.max_memory_reserved(device)}
    else:
        result["stats"] = {}
    result["params_sha256"] = parameter_digest(model)
    return result


def worker_main(argv: Sequence[str], workloads) -> int:
    """The ``--worker SPEC_JSON`` entry point: build ``workloads[model][size]()``
    (a mapping like :data:`membudget.models.WORKLOADS`), run the spec and print
    the result as one prefixed JSON line on stdout. Returns the exit code."""
    if len(argv) != 2 or argv[0] != "--worker":
        print("usage: --worker SPEC_JSON", file=sys.stderr)
        return 2
    spec = RunSpec.from_json(argv[1])
    sizes = workloads.get(spec.model)
    if sizes is None or spec.size not in sizes:
        print(f"worker: unknown model {spec.model!r} (size {spec.size!r})", file=sys.stderr)
        return 2
    result = run_worker(spec, sizes[spec.size]())
    sys.stdout.write(_RESULT_PREFIX + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


def _package_root() -> str:
    return str(Path(__file__).resolve().parents[1])


def spawn_worker(command: Sequence[str], spec: RunSpec, timeout: float = 600.0) -> Dict[str, Any]:
    """Run ``command + ["--worker", spec_json]`` (``command`` is for instance
    ``[sys.executable, "-m", "membudget.demo"]``) in a fresh process, with this
    membudget importable, and return its result dict, or ``{"error": ...}``
    if it failed, timed out or printed no result. ``wall_s`` is added: the
    process's wall time, start-up included."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [_package_root(), env.get("PYTHONPATH")]))
    env.setdefault("PYTHONFAULTHANDLER", "1")  # a crash in native code leaves its Python stack on stderr
    start = time.perf_counter()
    try:
        proc = subprocess.run([*command, "--worker", spec.to_json()], env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s", "spec": dataclasses.asdict(spec)}
    wall = time.perf_counter() - start
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(_RESULT_PREFIX) and proc.returncode == 0:
            result = json.loads(line[len(_RESULT_PREFIX):])
            result["wall_s"] = wall
            return result
    if proc.returncode < 0:  # killed by a signal: say which, and where faulthandler saw Python
        try:
            name = signal.Signals(-proc.returncode).name
        except ValueError:
            name = f"signal {-proc.returncode}"
        stack = [line.strip() for line in proc.stderr.splitlines() if line.strip().startswith("File ")]
        where = f"; innermost Python frames: {' <- '.join(stack[:3])}" if stack else ""
        return {"error": f"exit {proc.returncode} ({name}){where}", "spec": dataclasses.asdict(spec)}
    last_line = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()[-1]
    return {"error": f"exit {proc.returncode}: {last_line[:600]}", "spec": dataclasses.asdict(spec)}

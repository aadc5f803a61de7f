"""Training runs shared by the integration tests: the same seeded steps run
plain (PyTorch's own allocator, nothing installed) and under membudget, so the
tests can compare losses and parameters bit for bit."""
from __future__ import annotations

import gc
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch

import membudget
from membudget._native import load_extension


@dataclass
class RunResult:
    losses: List[float]
    params: Dict[str, torch.Tensor]
    stats: Dict[str, float] = field(default_factory=dict)
    per_step: List[Dict[str, float]] = field(default_factory=list)
    # Buffers too (batch norm's running statistics): a replay that updated
    # them again changed no parameter (tests/test_recompute_cases.py).
    buffers: Dict[str, torch.Tensor] = field(default_factory=dict)


def ops_recorded() -> int:
    """Forward ops the installed recorder has recorded, either recorder."""
    from membudget import _runtime

    lineage = _runtime._lineage
    return lineage.ops_recorded if _runtime._lineage_mode is not None else load_extension().lineage.ops_recorded()


def entry_holders() -> str:
    """Who holds the live managed entries, for an assertion's message: the
    entry ids, whether autograd still holds a handle, and the Python
    recorder's held inputs reached through an entry."""
    from membudget import _runtime

    native = load_extension()
    lines = [f"live entries {sorted(native.live_entry_ids())}, saved for backward "
             f"{native.any_entry_saved_for_backward()}"]
    lineage = _runtime._lineage
    if _runtime._lineage_mode is not None and lineage is not None:
        through = [held.handle.entry_id for held in list(lineage.held_inputs) if held.handle is not None]
        lines.append(f"python recorder: held through entries {through}, unwritten {len(lineage.unwritten)}, "
                     f"in_backward {lineage.in_backward}, op_index {lineage.op_index}")
    return "\n".join(lines)


# One training step of a loop shaped otherwise (tests/test_training_loops.py):
# step(model, optimizer) runs it whole and returns its loss.
StepFn = Callable[[torch.nn.Module, torch.optim.Optimizer], float]


def train(build: Callable[[], torch.nn.Module], batch: Callable[[], tuple], loss_fn: Callable,
          steps: int, seed: int = 0, after_step: Optional[Callable[[int], None]] = None,
          step_fn: Optional[StepFn] = None) -> RunResult:
    """Seeded training: build model and optimizer, run `steps` steps of
    forward, backward and Adam (or of ``step_fn``, which then stands for
    ``batch`` and ``loss_fn``). Parameters are returned as clones made with
    torch's own allocator so they survive uninstall."""
    torch.manual_seed(seed)
    model = build()
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        if step_fn is not None:
            losses.append(step_fn(model, optimizer))
        else:
            inputs = batch()
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model, inputs)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            del loss, inputs
        if after_step is not None:
            after_step(step)
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    del model, optimizer
    gc.collect()
    return RunResult(losses, params, buffers=buffers)


def run_plain(build, batch, loss_fn, steps: int, step_fn: Optional[StepFn] = None, seed: int = 0) -> RunResult:
    """The unmanaged reference: nothing of membudget installed."""
    assert not membudget.is_installed()
    return train(build, batch, loss_fn, steps, seed=seed, step_fn=step_fn)


def run_managed(build, batch, loss_fn, steps: int, budget: Optional[int], step_fn: Optional[StepFn] = None,
                runner: Callable[[Callable[[], RunResult]], RunResult] = lambda run: run(),
                seed: int = 0, **install_args) -> RunResult:
    """The same run under membudget; returns its stats and per-step stats.
    ``runner(run)`` runs the training (default: here; tests/test_started_threads.py
    runs it on another thread), after ``install()`` on this thread."""
    gc.collect()
    membudget.install(budget=budget if budget else None, **install_args)
    load_extension().release_cached()  # so the peak is this run's alone
    membudget.reset_counters()
    membudget.reset_peak_stats()
    per_step = []
    result = runner(lambda: train(build, batch, loss_fn, steps, seed=seed,
                                  after_step=lambda _: per_step.append(membudget.memory_stats()), step_fn=step_fn))
    result.stats = membudget.memory_stats()
    result.per_step = per_step
    membudget.uninstall()
    # The clones were made while installed: copy them out of our memory.
    result.params = {k: v.clone() for k, v in result.params.items()}
    result.buffers = {k: v.clone() for k, v in result.buffers.items()}
    gc.collect()
    return result


def assert_identical(reference: RunResult, managed: RunResult) -> None:
    """Losses, every parameter and every buffer equal bit for bit."""
    assert managed.losses == reference.losses, (managed.losses, reference.losses)
    assert reference.params.keys() == managed.params.keys()
    for name, value in reference.params.items():
        assert torch.equal(value, managed.params[name]), f"parameter {name} differs"
    assert reference.buffers.keys() == managed.buffers.keys()
    for name, value in reference.buffers.items():
        assert torch.equal(value, managed.buffers[name]), f"buffer {name} differs"


def assert_budget_kept(stats: Dict[str, float], budget: int, actions: str) -> None:
    """A budgeted run's counters: its peak within the budget, no
    out-of-memory error, and a recompute-only run that replayed and never
    swapped."""
    assert stats["reserved_bytes.all.peak"] <= budget
    assert stats["num_ooms"] == 0
    if actions == "recompute":
        assert stats["recompute_count"] > 0 and stats["swap_out_bytes"] == 0


def reference_and_half_peak(work, steps: int, min_tensor_bytes: int):
    """The plain run of ``work`` and half the peak reserved by an unbudgeted
    managed run (a budget that forces eviction): the start of most tests
    that compare a budgeted run with plain PyTorch."""
    reference = run_plain(work.build, work.batch, work.loss, steps)
    unbudgeted = run_managed(work.build, work.batch, work.loss, steps, budget=None,
                             min_tensor_bytes=min_tensor_bytes)
    return reference, unbudgeted.stats["reserved_bytes.all.peak"] // 2

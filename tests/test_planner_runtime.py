"""A static plan handed to the runtime (``membudget.install(plan=...)``):
planned tensors are dropped at pack time, the rest is left to the dynamic
policy. Results stay bit-identical to plain PyTorch and the runtime evicts
less by itself than with no plan at the same budget."""
import gc

import pytest
import torch

import membudget
from models import gpt2
from training import assert_identical, reference_and_half_peak, run_managed

pytestmark = pytest.mark.requires_native

STEPS = 3
MIN_TENSOR_BYTES = 16 * 1024


def test_plan_with_runtime_is_exact_and_evicts_less():
    work = gpt2(batch=4, seq=128)
    reference, budget = reference_and_half_peak(work, STEPS, MIN_TENSOR_BYTES)
    dynamic = run_managed(work.build, work.batch, work.loss, STEPS, budget=budget, actions="recompute",
                          min_tensor_bytes=MIN_TENSOR_BYTES)
    assert_identical(reference, dynamic)

    torch.manual_seed(0)
    model = work.build()
    batch = work.batch()
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # The plan covers activations, parameters and gradients; Adam's two
    # moments are outside the step it sees.
    plan = membudget.plan(model, budget - 2 * parameter_bytes, step=lambda: work.loss(model, batch))
    assert plan.entries and plan.numbering == "dispatch"
    del model, batch
    gc.collect()

    planned = run_managed(work.build, work.batch, work.loss, STEPS, budget=budget, actions="recompute",
                          min_tensor_bytes=MIN_TENSOR_BYTES, plan=plan)
    assert_identical(reference, planned)
    stats = planned.stats
    assert stats["reserved_bytes.all.peak"] <= budget
    assert stats["planned_drops"] > 0
    runtime_evictions = stats["drop_count"] - stats["planned_drops"]
    assert runtime_evictions < dynamic.stats["drop_count"], (runtime_evictions, dynamic.stats["drop_count"])

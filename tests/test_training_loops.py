"""Training loops as users write them, beyond forward-backward-step: bf16
autocast, gradient accumulation, an evaluation under ``no_grad`` between
steps, ``backward(retain_graph=True)`` twice, and a gradient penalty
(``autograd.grad(create_graph=True)``). Under half the unmanaged peak each
must give plain PyTorch's losses and parameters bit for bit, within the
budget, with activations actually dropped and rebuilt (or, for the penalty,
whose double-backward graph is saved where no lineage is recorded, swapped),
under each lineage recorder."""
import gc

import pytest
import torch

import membudget

from models import gpt2, llama

pytestmark = [pytest.mark.requires_native, pytest.mark.usefixtures("lineage_recorder")]

STEPS = 3
MIN_TENSOR_BYTES = 16 * 1024


def _step(kind: str, model, optimizer, work) -> float:
    optimizer.zero_grad()
    if kind == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = work.loss(model, work.batch())
        loss.backward()
    elif kind == "accumulate":
        loss = 0.0
        for _ in range(2):
            part = work.loss(model, work.batch()) / 2
            part.backward()
            loss += part.item()
        optimizer.step()
        return loss
    elif kind == "evaluate_between":
        loss = work.loss(model, work.batch())
        loss.backward()
        model.eval()
        with torch.no_grad():
            work.loss(model, work.batch())
        model.train()
    elif kind == "retain_graph":
        loss = work.loss(model, work.batch())
        loss.backward(retain_graph=True)
        loss.backward()
    elif kind == "gradient_penalty":
        loss = work.loss(model, work.batch())
        params = [p for p in model.parameters() if p.requires_grad]
        grads = torch.autograd.grad(loss, params, create_graph=True)
        (loss + 0.01 * sum((g * g).sum() for g in grads)).backward()
    else:
        raise ValueError(kind)
    optimizer.step()
    return loss.item()


def _train(kind: str, work):
    torch.manual_seed(0)
    model = work.build()
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = [_step(kind, model, optimizer, work) for _ in range(STEPS)]
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


def _managed(kind: str, work, **install):
    membudget.install(min_tensor_bytes=MIN_TENSOR_BYTES, **install)
    membudget.reset_counters()
    membudget.reset_peak_stats()
    try:
        result = _train(kind, work)
        stats = membudget.memory_stats()
    finally:
        membudget.uninstall()
        gc.collect()
    # Clones made while installed: copied out of membudget's memory.
    return result[0], {k: v.clone() for k, v in result[1].items()}, stats


@pytest.mark.parametrize("kind, make_workload, actions", [
    ("autocast", llama, "recompute"),
    ("accumulate", gpt2, "recompute"),
    ("evaluate_between", gpt2, "recompute"),
    ("retain_graph", gpt2, "recompute"),
    ("gradient_penalty", gpt2, "both"),
])
def test_training_loop_under_half_the_peak_is_exact(kind, make_workload, actions):
    work = make_workload()
    reference = _train(kind, work)
    unbudgeted = _managed(kind, work)
    budget = unbudgeted[2]["reserved_bytes.all.peak"] // 2
    losses, params, stats = _managed(kind, work, budget=budget, actions=actions)
    assert losses == reference[0]
    for name, value in reference[1].items():
        assert torch.equal(value, params[name]), name
    assert stats["reserved_bytes.all.peak"] <= budget
    assert stats["num_ooms"] == 0
    if actions == "recompute":
        assert stats["recompute_count"] > 0 and stats["swap_out_bytes"] == 0
    else:
        assert stats["swap_out_bytes"] > 0

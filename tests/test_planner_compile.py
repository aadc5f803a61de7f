"""compile_backend on real models: results equal to eager, measured peak under
the budget, graph breaks planned with budget shares (issue 5 acceptance).

Peaks are measured by membudget's allocator installed with no budget (it only
counts; nothing is managed): allocated bytes over one training step, with
parameters, gradients and inputs. Budgets are fractions of the same step's
eager peak. The ``aot_eager`` executor runs the partitioned graphs op by op so
that the measured memory is the plan's; one test compiles with inductor."""
import gc
import os

import pytest
import torch

import membudget
from membudget.planner import compile_backend
from membudget.planner.workloads import workload

pytestmark = pytest.mark.requires_native

MiB = 1 << 20

# model, sizes, budget as a fraction of the eager peak, planning margin
CASES = [
    ("gpt2", dict(batch=4, seq=64), 0.80, 0.10),
    ("bert", dict(batch=4, seq=128), 0.80, 0.10),
    ("resnet", dict(batch=8, image=32), 0.85, 0.25),
    ("seq2seq", dict(batch=32, source_len=8, target_len=8, hidden=128), 0.90, 0.05),
]


def _close(actual, expected, **tolerances):
    torch.testing.assert_close(torch.from_numpy(actual), torch.from_numpy(expected), **tolerances)


_LEFTOVER = [0]


@pytest.fixture
def counting(monkeypatch):
    """membudget's allocator counting (no budget, no managed tensors, no
    lineage mode). What earlier tests left allocated through it is subtracted
    from every peak."""
    for name in list(os.environ):
        if name.startswith("MEMBUDGET_"):
            monkeypatch.delenv(name)
    membudget.install(min_tensor_bytes="1TiB", actions="swap")
    torch._dynamo.reset()
    gc.collect()
    _LEFTOVER[0] = membudget.memory_stats()["allocated_bytes.all.current"]
    yield
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # process-wide; later tests count their own graphs


def _step(model, fn, batch, steps=2):
    """Run ``steps`` steps; return the last loss, the gradients and the last
    step's peak allocated bytes. Loss and gradients are returned as numpy
    copies: numpy's memory is not torch's, so holding the reference results
    does not count in the next run's measured peak."""
    from membudget._native import load_extension

    for i in range(steps):
        model.zero_grad(set_to_none=True)
        if i == steps - 1:
            gc.collect()
            load_extension().release_cached()
            membudget.reset_peak_stats()
        loss = fn(model, batch)
        loss.backward()
        value = loss.detach().numpy().copy()
        del loss
    peak = membudget.memory_stats()["allocated_bytes.all.peak"] - _LEFTOVER[0]
    return value, [p.grad.numpy().copy() for p in model.parameters()], peak


@pytest.mark.parametrize("name,sizes,fraction,margin", CASES, ids=[c[0] for c in CASES])
def test_compiled_matches_eager_under_budget(counting, name, sizes, fraction, margin):
    w = workload(name, **sizes)
    torch.manual_seed(0)
    model = w.build()
    batch = w.batch()
    eager_loss, eager_grads, eager_peak = _step(model, w.loss, batch)
    budget = int(fraction * eager_peak)
    backend = compile_backend(budget, compiler="aot_eager", method="greedy", margin=margin)
    loss, grads, peak = _step(model, torch.compile(w.loss, backend=backend), batch)
    _close(loss, eager_loss, rtol=1e-5, atol=1e-6)
    for g, e in zip(grads, eager_grads):
        _close(g, e, rtol=1e-4, atol=1e-6)
    plans = backend.partitioner.plans
    assert sum(len(p["selection"].recompute) for p in plans) > 0
    assert peak <= budget, (f"{name}: measured {peak / MiB:.2f} MiB over budget {budget / MiB:.2f} MiB "
                            f"(eager {eager_peak / MiB:.2f}); predicted "
                            f"{[round(p['selection'].predicted_peak / MiB, 2) for p in plans]}")


class TwoStages(torch.nn.Module):
    """A wide MLP stage, a graph break, a narrow stage."""

    def __init__(self, width=256):
        super().__init__()
        self.first = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                         torch.nn.LayerNorm(4 * width), torch.nn.Linear(4 * width, width),
                                         torch.nn.GELU())
        self.second = torch.nn.Sequential(torch.nn.Linear(width, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))

    def forward(self, x):
        h = self.first(x)
        torch._dynamo.graph_break()
        return self.second(h).square().mean()


def test_graph_break_plans_each_graph_with_a_budget_share(counting):
    torch.manual_seed(0)
    model = TwoStages()
    x = torch.randn(512, 256)
    fn = lambda m, b: m(b)  # noqa: E731
    eager_loss, eager_grads, eager_peak = _step(model, fn, x)
    budget = int(0.9 * eager_peak)
    backend = compile_backend(budget, compiler="aot_eager")
    loss, grads, peak = _step(model, torch.compile(fn, backend=backend), x)
    _close(loss, eager_loss)
    for g, e in zip(grads, eager_grads):
        _close(g, e)
    plans = backend.partitioner.plans
    assert len(plans) == 2
    assert plans[0]["carried"] == 0 and plans[1]["carried"] > 0
    assert plans[1]["selection"].budget < plans[0]["selection"].budget
    assert peak <= budget, f"measured {peak / MiB:.2f} MiB over budget {budget / MiB:.2f} MiB"


def test_inductor_backend_matches_eager(counting, monkeypatch):
    # A cache hit would skip partitioning (and so our record of the plan).
    monkeypatch.setattr(torch._inductor.config, "fx_graph_cache", False)
    monkeypatch.setattr(torch._functorch.config, "enable_autograd_cache", False)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.GELU(), torch.nn.LayerNorm(256),
                                torch.nn.Linear(256, 1))
    x = torch.randn(256, 128)
    fn = lambda m, b: m(b).square().mean()  # noqa: E731
    eager_loss, eager_grads, eager_peak = _step(model, fn, x)
    backend = compile_backend("30%")
    loss, grads, peak = _step(model, torch.compile(fn, backend=backend), x)
    _close(loss, eager_loss, rtol=1e-5, atol=1e-6)
    for g, e in zip(grads, eager_grads):
        _close(g, e, rtol=1e-4, atol=1e-5)
    assert backend.partitioner.plans and backend.partitioner.plans[0]["selection"].recompute
    assert peak <= eager_peak


def test_bad_budget_is_a_clear_error():
    with pytest.raises(ValueError, match="budget"):
        compile_backend("150%")
    with pytest.raises(ValueError, match="compiler"):
        compile_backend("50%", compiler="tvm")

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
from membudget.planner.analysis import MemoryModel
from membudget.planner.workloads import workload

pytestmark = pytest.mark.requires_native

MiB = 1 << 20

# model, sizes, budget as a fraction of the eager peak, planning margin.
# The margin covers allocator rounding and the few KiB the model does not
# see (it was 5-25% before recomputed chains, tangents and _unsafe_view were
# modelled as they run; docs/planner.md "How accurate is it").
CASES = [
    ("gpt2", dict(batch=4, seq=64), 0.80, 0.02),
    ("bert", dict(batch=4, seq=128), 0.80, 0.02),
    ("resnet", dict(batch=8, image=32), 0.85, 0.02),
    ("seq2seq", dict(batch=32, source_len=8, target_len=8, hidden=128), 0.90, 0.02),
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
    _compiled_matches_eager_under_budget(name, sizes, fraction, margin)


def _compiled_matches_eager_under_budget(name, sizes, fraction, margin):
    """``name``'s step compiled under ``fraction`` of its eager peak: eager's
    loss and gradients, something recomputed, the measured peak within."""
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


class _MeasuringExecutor:
    """An ``aot_autograd`` compiler that runs each partitioned graph node by
    node (freeing values at their last use, as ``boxed_nop``'s generated code
    does) and records the peak allocated bytes while each node runs, under
    the node's name, per compiled graph."""

    def __init__(self, kind):
        self.kind = kind
        self.graphs = []  # per compile, in compile order: {node name: peak bytes}

    def __call__(self, gm, example_inputs):
        record = {}
        self.graphs.append(record)

        class Measuring(torch.fx.Interpreter):
            def run_node(self, n):
                if n.op != "call_function":
                    return super().run_node(n)
                membudget.reset_peak_stats()
                out = super().run_node(n)
                record[n.name] = max(record.get(n.name, 0), membudget.memory_stats()["allocated_bytes.all.peak"])
                return out

        def run(args):
            return Measuring(gm, garbage_collect_values=True).boxed_run(args)

        run._boxed_call = True
        return run


@pytest.mark.parametrize("name,sizes", [("gpt2", dict(batch=4, seq=64)), ("bert", dict(batch=4, seq=64))],
                         ids=["gpt2", "bert"])
def test_predicted_peak_matches_measured_per_graph(counting, name, sizes):
    """The memory model against the executed graphs, node by node: each
    graph's predicted peak (its fixed bytes included) is the highest memory
    measured while its nodes run, within 1% + 32 KiB. Before recomputed
    chains freed their links (Note [Chains inside a recompute slot]),
    tangents died at their last use and ``_unsafe_view`` was an alias, GPT-2's
    first graph was over-predicted by 1.5 MiB at its default size."""
    from torch._dynamo.backends.common import aot_autograd

    w = workload(name, **sizes)
    torch.manual_seed(0)
    model = w.build()
    batch = w.batch()
    echo = compile_backend("50%", compiler="aot_eager", method="greedy")
    fw, bw = _MeasuringExecutor("fw"), _MeasuringExecutor("bw")
    fn = torch.compile(w.loss, backend=aot_autograd(fw_compiler=fw, bw_compiler=bw,
                                                    partition_fn=echo.partitioner))
    _step(model, fn, batch)  # compiles; the first call's memory is not a training step's
    for record in fw.graphs + bw.graphs:
        record.clear()
    _step(model, fn, batch, steps=1)
    plans = echo.partitioner.plans
    assert len(fw.graphs) == len(plans) == len(bw.graphs)
    assert any(p["selection"].recompute for p in plans)
    # The first graph's forward runs before any other graph, and its
    # backward after every later graph's (backward graphs compile in the
    # order they run): both run alone, on top of what was allocated before.
    m = MemoryModel(plans[0]["graph"])
    profile = m.profile(plans[0]["selection"].recompute)
    for phase, predicted, record in (
            ("forward", int(profile.memory[:m.forward_end_slot].max()), fw.graphs[0]),
            ("backward", int(profile.memory[m.forward_end_slot:].max()), bw.graphs[-1])):
        measured = max(record.values()) - _LEFTOVER[0]
        assert abs(predicted - measured) <= 0.01 * measured + 32 * 1024, \
            f"{name} graph 0 {phase}: predicted {predicted / MiB:.3f} MiB, measured {measured / MiB:.3f} MiB"


def test_graph_break_budget_met_on_gpt2(counting):
    """GPT-2's loss is a second graph (a graph break in transformers): the
    first graph must leave it room (a reserve for later graphs, and only what
    stays resident carried). Run alone in a fresh process at 55% of the eager
    peak (2.81 MiB), the first-come plan (first graph to its own budget, then
    the loss graph over it) measured 2.98 MiB; this plan 2.79. (Inside the
    suite the eager peak it is measured against can be higher.)"""
    w = workload("gpt2", batch=4, seq=64)
    torch.manual_seed(0)
    model = w.build()
    batch = w.batch()
    eager_loss, _, eager_peak = _step(model, w.loss, batch)
    budget = int(0.55 * eager_peak)
    backend = compile_backend(budget, compiler="aot_eager", method="greedy", margin=0.02)
    loss, _, peak = _step(model, torch.compile(w.loss, backend=backend), batch)
    _close(loss, eager_loss, rtol=1e-5, atol=1e-6)
    assert peak <= budget, (f"measured {peak / MiB:.2f} MiB over budget {budget / MiB:.2f} MiB "
                            f"(eager {eager_peak / MiB:.2f})")
    plans = backend.partitioner.plans
    assert len(plans) == 2 and plans[0]["reserve_bytes"] > 0


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


def test_inductor_backend_matches_eager(counting):
    # A cache hit would skip partitioning (and so our record of the plan).
    # torch's own patch, not monkeypatch: monkeypatch's undo left
    # enable_autograd_cache deleted from functorch's config, and every later
    # inductor compile in the process failed on it.
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        _inductor_backend_matches_eager()


def _inductor_backend_matches_eager():
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


def test_the_partition_is_cut_with_older_torchs_helpers(counting, monkeypatch):
    """Note [Partitioner helpers across torch versions]: torch's partitioner
    module as torch 2.4-2.7 has it (no is_not_collective or raise_getitems;
    _extract_fwd_bwd_modules without static_lifetime_input_nodes) still gives
    eager's results under the budget."""
    from torch._functorch import partitioners as P

    for name in ("is_not_collective", "raise_getitems"):
        monkeypatch.delattr(P, name, raising=False)
    extract = P._extract_fwd_bwd_modules

    def extract_without_static_lifetimes(joint_module, saved_values, saved_sym_nodes, *, num_fwd_outputs):
        return extract(joint_module, saved_values, saved_sym_nodes=saved_sym_nodes, num_fwd_outputs=num_fwd_outputs)

    monkeypatch.setattr(P, "_extract_fwd_bwd_modules", extract_without_static_lifetimes)
    _compiled_matches_eager_under_budget(*CASES[0])


def test_inductor_without_a_custom_partitioner_is_a_clear_error(monkeypatch):
    """Inductor before torch 2.9 takes no custom partitioner: said at once,
    not as a failed first compile. (A stand-in config module: deleting from
    torch's own config objects does not undo cleanly.)"""
    import types

    monkeypatch.setattr(torch._inductor, "config", types.SimpleNamespace())
    with pytest.raises(RuntimeError, match="needs torch >= 2.9"):
        compile_backend("50%")

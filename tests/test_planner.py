"""The Echo planner: selection on hand-made graphs, plans from traces, the
compile backend on real models (exact results, measured peak under budget)."""
import gc
import json
from types import SimpleNamespace

import pytest
import torch

from membudget.planner import Plan, compile_backend, plan
from membudget.planner.analysis import MemoryModel
from membudget.planner.graph import PlanGraph, PlanOp, PlanStorage, from_trace
from membudget.planner.selection import greedy, milp, milp_available, select
from membudget.planner.workloads import workload

MiB = 1 << 20


# -- a hand-made chain: x -> a -> b -> c (forward), backward reads a, b, c ----
def _chain_graph(n=4, nbytes=MiB):
    """Forward ops f0..f{n-1} each make one MiB read by the next op and by a
    backward op (in reverse order), like a stack of layers."""
    ops, storages = [], [PlanStorage(0, nbytes, None, kind="input")]
    for i in range(n):
        storages.append(PlanStorage(i + 1, nbytes, i))
        ops.append(PlanOp(i, "aten.relu.default" if i % 2 else "aten.mm.default", "forward",
                          "pointwise" if i % 2 else "matmul", cost_s=0.001 * (1 + 9 * (i % 2 == 0)),
                          inputs=[i], outputs=[i + 1], recomputable=True, forward_index=i))
    for j in range(n):
        k = n - 1 - j
        ops.append(PlanOp(n + j, "aten.threshold_backward.default", "backward", "pointwise", 0.001,
                          inputs=[k + 1], outputs=[]))
    for s in storages:
        s.uses = sorted(op.index for op in ops if s.id in op.inputs)
    return PlanGraph(ops=ops, storages=storages, num_forward=n)


def test_profile_without_recompute_stashes_everything():
    model = MemoryModel(_chain_graph())
    assert model.profile([]).peak == 5 * MiB  # input + four stashed feature maps


def test_recompute_frees_at_peak_and_keeps_inputs_alive():
    model = MemoryModel(_chain_graph())
    # Recomputing the cheap op 1 (reads storage 1, which is stashed anyway) frees 1 MiB.
    assert model.profile([1]).peak == 4 * MiB
    # The last forward output is live when it is made, and when op 3 is
    # recomputed its input (stashed anyway) is live with it: still 4 MiB.
    assert model.profile([1, 3]).peak == 4 * MiB
    # A recomputed chain (op 2 reads op 1's dropped output): op 1 is
    # recomputed where op 2 is, so both outputs are live there together.
    slots = model.recompute_slots([1, 2])
    assert slots[1] == slots[2]
    assert model.profile([1, 2]).peak == 4 * MiB


def _three_link_chain():
    """x(input) -> a -> b -> c in forward, each 1 MiB, pointwise; only c is
    read in backward (by g0, whose output g1 reads with x): a and b are the
    links of a chain that recomputing c pulls in."""
    storages = [PlanStorage(0, MiB, None, kind="input")] + [PlanStorage(i, MiB, i - 1) for i in (1, 2, 3)]
    storages.append(PlanStorage(4, MiB, 3))
    ops = [PlanOp(i, "aten.mul.Tensor", "forward", "pointwise", 0.001, inputs=[i], outputs=[i + 1],
                  recomputable=True, forward_index=i) for i in range(3)]
    ops.append(PlanOp(3, "aten.mul.Tensor", "backward", "pointwise", 0.001, inputs=[3], outputs=[4]))
    ops.append(PlanOp(4, "aten.mul.Tensor", "backward", "pointwise", 0.001, inputs=[4, 0], outputs=[]))
    for s in storages:
        s.uses = sorted(op.index for op in ops if s.id in op.inputs)
    return PlanGraph(ops=ops, storages=storages, num_forward=3)


def test_recomputed_chain_frees_each_link_within_its_slot():
    """Note [Chains inside a recompute slot]: a, b, c recomputed one after the
    other before g0; a is freed once b is made, so at most two links are live
    together (x + 2 MiB), not all three (the over-prediction GPT-2's
    tanh-GELU chain showed, ~1 MiB)."""
    model = MemoryModel(_three_link_chain())
    slots = model.recompute_slots([0, 1, 2])
    assert slots[0] == slots[1] == slots[2]
    profile = model.profile([0, 1, 2])
    assert profile.memory[slots[2]] == 3 * MiB
    assert profile.peak == 3 * MiB  # forward: x, b, c at op 2 (and x + gradient in backward)
    assert model.profile([]).peak == 3 * MiB


def test_incremental_profile_equals_full_profile():
    """with_op re-derives only what a choice touches (intervals and the
    per-slot chain corrections); in any order it must equal profile()."""
    import itertools

    for graph in (_three_link_chain(), _chain_graph(6)):
        model = MemoryModel(graph)
        cands = [op.index for op in graph.ops[: graph.num_forward] if op.recomputable]
        for order in itertools.permutations(cands):
            current = model.profile([])
            for o in order:
                current = model.with_op(current, o)
                full = model.profile(current.recompute)
                assert (current.memory == full.memory).all(), (order, o)


def test_greedy_meets_budget_with_cheap_ops_first():
    model = MemoryModel(_chain_graph())
    chosen = greedy(model, 4 * MiB)
    assert model.profile(chosen).peak <= 4 * MiB
    assert chosen == [3] or chosen == [1]  # a cheap pointwise op, not a matmul


def test_infeasible_budget_reports_smallest_reachable_peak():
    model = MemoryModel(_chain_graph())
    selection = select(model, MiB // 2)
    assert not selection.feasible
    assert selection.min_reachable_peak is not None and selection.min_reachable_peak < 5 * MiB
    assert selection.predicted_peak == selection.min_reachable_peak


@pytest.mark.skipif(not milp_available(), reason="scipy is not installed (it is in requirements-dev.txt)")
def test_milp_matches_brute_force_on_small_graph():
    import itertools

    model = MemoryModel(_chain_graph(6))
    cands = [op.index for op in model.graph.candidates()]
    assert milp(model, 3 * MiB) is None  # below anything recomputation reaches
    for budget in (6 * MiB, 5 * MiB, 4 * MiB):
        best = min((sum(model.graph.ops[o].cost_s for o in c), c) for r in range(len(cands) + 1)
                   for c in itertools.combinations(cands, r) if model.profile(c).peak <= budget)
        exact = milp(model, budget)
        assert exact is not None and model.profile(exact).peak <= budget
        assert model.profile(exact).overhead_s == pytest.approx(best[0])


# -- a Trace built by hand, through the data model of membudget.trace ---------
def _hand_trace():
    """x(input) -> mm -> relu -> mm -> sum(loss); backward reads both mm outputs and relu's."""
    T = lambda i, b, prod, cons, saved, kind="activation": SimpleNamespace(  # noqa: E731
        id=i, bytes=b, shape=(b // 4,), dtype="float32", producer=prod, consumers=cons, saved=saved,
        dies_after=None, kind=kind)
    tensors = [T(0, MiB, None, [0], False, "input"), T(1, 64, None, [0, 2], True, "parameter"),
               T(2, MiB, 0, [1, 5], True), T(3, MiB, 1, [2, 4], True), T(4, MiB, 2, [3], True),
               T(5, 4, 3, [], False), T(6, MiB, 4, [5], False, "gradient"), T(7, MiB, 5, [], False, "gradient")]
    O = lambda i, name, phase, cat, flops, ins, outs: SimpleNamespace(  # noqa: E731
        index=i, name=name, phase=phase, category=cat, flops=flops, bytes_read=MiB, bytes_written=MiB,
        duration_s=None, inputs=ins, outputs=outs)
    ops = [O(0, "aten.mm.default", "forward", "matmul", 10**9, [0, 1], [2]),
           O(1, "aten.relu.default", "forward", "pointwise", 10**5, [2], [3]),
           O(2, "aten.mm.default", "forward", "matmul", 10**9, [3, 1], [4]),
           O(3, "aten.sum.default", "forward", "reduction", 10**5, [4], [5]),
           O(4, "aten.mm.default", "backward", "matmul", 10**9, [4, 3], [6]),
           O(5, "aten.threshold_backward.default", "backward", "pointwise", 10**5, [6, 2], [7])]
    return SimpleNamespace(ops=ops, tensors=tensors, unpack_order=[], metadata={})


def test_plan_from_trace_drops_planned_outputs():
    trace = _hand_trace()
    graph = from_trace(trace)
    assert graph.num_forward == 4
    assert MemoryModel(graph).profile([]).peak == 5 * MiB + 64
    p = plan(trace, 4 * MiB + 64)
    assert p.feasible, str(p)
    # The peak is at the first backward op, which reads the relu and second
    # mm outputs: only dropping the first mm's output (read last) helps there.
    assert [(e.forward_index, e.op_name, e.outputs) for e in p.entries] == [(0, "aten.mm.default", [0])]
    assert p.drops(0, "aten.mm.default", 0)
    assert not p.drops(0, "aten.mm.default", 1)
    assert not p.drops(0, "aten.relu.default", 0)  # index matches, name does not
    assert not p.drops(1, "aten.relu.default", 0)
    assert not p.drops(2, "aten.mm.default", 0)
    # Shifted indices: matched by name and occurrence when the runtime gives one.
    assert p.drops(7, "aten.mm.default", 0, occurrence=0)
    assert not p.drops(7, "aten.mm.default", 0, occurrence=1)
    assert not plan(trace, 3 * MiB).feasible


def test_plan_json_round_trip_and_report():
    p = plan(_hand_trace(), 4 * MiB + 64)
    q = Plan.from_json(p.to_json())
    assert q.to_json() == p.to_json()
    assert q.drops(0, "aten.mm.default", 0)
    json.loads(p.to_json())
    assert "budget" in str(p) and "<table>" in p._repr_html_()


def test_plan_of_a_model_via_joint_graph():
    w = workload("gpt2", batch=2, seq=32)
    torch.manual_seed(0)
    model = w.build()
    batch = w.batch()
    p = plan(model, "30%", example_inputs=batch, loss_fn=lambda out: out.logits.float().square().mean(),
             via="joint-graph")
    assert p.numbering == "joint-graph"
    assert p.entries and p.predicted_peak < p.baseline_peak
    assert any(e.category in ("pointwise", "norm") for e in p.entries)
    assert all(p.drops(-1, e.op_name, e.outputs[0], occurrence=e.occurrence) for e in p.entries if e.outputs)


def test_plan_drops_follows_a_shifted_numbering():
    """Ops run just before forward (drawing the batch) shift the runtime's
    indices; the plan finds the shift from the names of consecutive calls."""
    p = plan(_hand_trace(), 4 * MiB + 64)
    assert p.forward_names == ["aten.mm.default", "aten.relu.default", "aten.mm.default", "aten.sum.default"]
    p.drops(5, "aten.mm.default", 0)  # one call cannot tell a shift of 3 from 5
    assert not p.drops(6, "aten.relu.default", 0)  # now it can: 5 (relu is not planned)
    assert p.drops(5, "aten.mm.default", 0)
    assert not p.drops(7, "aten.mm.default", 0)  # the second mm is not planned

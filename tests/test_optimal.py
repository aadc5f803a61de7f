"""The optimal floor: exact on small traces, infeasible below what cannot
move, and never beaten by a simulated policy or baseline."""
import dataclasses

import pytest
import torch

import membudget
from membudget import costs
from membudget.models import gpt
from membudget.optimal import _gaps, _recompute_costs
from membudget.replay_program import managed_tensors, op_durations, replay_costs
from membudget.simulate import unbudgeted_peak

# h200 with a host link so slow that the floor must recompute rather than swap.
SLOW_LINK = dataclasses.replace(costs.device_model("h200"), name="h200-slow-link", link_bytes_per_s=1e6)

pytestmark = pytest.mark.requires_native


@pytest.fixture(scope="module")
def small_trace():
    w = gpt(batch=2, context=64, width=64, heads=2, layers=2, vocab=256)
    torch.manual_seed(0)
    return membudget.trace(lambda m: w.loss(m, w.batch(torch.device("cpu"))).backward(), fake=True,
                           setup=w.build)


def test_exact_on_a_small_trace(small_trace):
    peak = unbudgeted_peak(small_trace, "h200")
    solution = membudget.optimal(small_trace, int(0.6 * peak), "h200", min_tensor_bytes=4096)
    assert solution.feasible and solution.exact and solution.method == "milp"
    assert solution.overhead_s >= 0
    assert len(small_trace.ops) < 1000


def test_no_overhead_when_everything_fits(small_trace):
    peak = unbudgeted_peak(small_trace, "h200")
    assert membudget.optimal(small_trace, 2 * peak, "h200", min_tensor_bytes=4096).overhead_s == 0


def test_infeasible_below_what_cannot_move(small_trace):
    solution = membudget.optimal(small_trace, 1024, "h200", min_tensor_bytes=4096)
    assert not solution.feasible


def test_floor_grows_as_the_budget_shrinks(small_trace):
    peak = unbudgeted_peak(small_trace, "h200")
    floors = [membudget.optimal(small_trace, int(f * peak), "h200", min_tensor_bytes=4096)
              for f in (0.9, 0.6, 0.4)]
    values = [s.overhead_s for s in floors if s.feasible]
    assert values == sorted(values)


def test_floor_charges_no_more_than_a_replay_and_never_replays_the_unreplayable(small_trace):
    # Note [The floor's recompute costs]: per gap, at most what the simulator
    # (and the runtime's lineage) pays to replay the tensor, and no recompute
    # at all of a tensor they cannot replay (GPT's dropout masks, written in
    # place by bernoulli_).
    managed = managed_tensors(small_trace, 4096)
    durations = op_durations(small_trace, SLOW_LINK)
    gaps, _ = _gaps(small_trace, managed)
    replay = replay_costs(small_trace, durations, managed)
    charged = _recompute_costs(small_trace, durations, gaps, managed)
    assert any(c is None for c in charged)
    for (tid, _, _, _), cost in zip(gaps, charged):
        seconds = replay[tid][0]
        assert (cost is None) == (seconds == 0.0)
        if cost is not None:
            assert 0.0 < cost <= seconds * (1 + 1e-12)
    peak = unbudgeted_peak(small_trace, SLOW_LINK)
    unreplayable = {tid for tid, (seconds, _) in replay.items() if seconds == 0.0}
    for fraction in (0.5, 0.4):
        solution = membudget.optimal(small_trace, int(fraction * peak), SLOW_LINK, min_tensor_bytes=4096)
        assert solution.exact and solution.recompute  # the slow link forces recomputation
        assert not unreplayable & {tid for tid, _ in solution.recompute}


@pytest.mark.parametrize("device", ["h200", "rtx4090", SLOW_LINK])
def test_no_policy_beats_the_floor(small_trace, device):
    rows = membudget.simulate(small_trace, ["90%", "70%", "50%", "35%"], device=device, min_tensor_bytes=4096,
                              floor=True)
    checked = 0
    for r in rows:
        if r.feasible:
            assert r.floor_s is not None, r  # a feasible schedule exists, so the floor is feasible too
            assert r.step_s >= r.floor_s * (1 - 1e-9), r
            assert r.overhead_ratio >= 1 - 1e-9
            checked += 1
    assert checked > 10

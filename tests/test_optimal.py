"""The optimal floor: exact on small traces, infeasible below what cannot
move, and never beaten by a simulated policy or baseline."""
import pytest
import torch

import membudget
from membudget.models import gpt
from membudget.simulate import unbudgeted_peak

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


@pytest.mark.parametrize("device", ["h200", "rtx4090"])
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

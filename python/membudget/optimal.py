"""``membudget.optimal``: the least overhead any swap/recompute policy can reach at a budget.

Where this sits in the flow: :func:`membudget.simulate` (``floor=True``) and
the CLI report each policy's step time as a ratio to this floor. It is a
Checkmate-style integer program over the trace (scipy.optimize.milp / HiGHS),
built on the same liveness the simulator replays
(:func:`membudget.replay_program.release_points`), so that a schedule the
simulator runs is always a feasible point of the program.

Note [The floor's program] (also in docs/simulator.md). A managed tensor
(saved activation >= ``min_tensor_bytes``) must be resident from its producer
until forward is done with it, and during each backward op that unpacks it.
Between those intervals lie *gaps*. Per gap ``g`` (tensor of ``b`` bytes,
ending at a use ``u``) two binaries: ``x_g`` (dropped and recomputed) and
``w_g`` (swapped out and in), ``x_g + w_g <= 1``; the tensor counts as absent
for the whole gap when either is set. Constraints:

* memory, at every op ``t``: unmanaged live bytes + tensors that must be
  resident + sum over gaps around ``t`` of ``(1 - x_g - w_g) * b <= budget``
  (only the worst op between consecutive gap boundaries is kept: it
  dominates the others);
* host link: a swapped-in tensor must have crossed the link before its use,
  and copies in one direction are serial, so for each use ``u``:
  ``O >= sum_{w_g, use <= u} b / link - start(u)``, with ``O`` the overhead
  (recompute plus stall) and ``start(u)`` the compute time before ``u``;
  likewise for the copy out of each tensor's first swapped gap;
* ``O >= sum_g c_g x_g`` with ``c_g`` the producer op's modelled duration.

Minimise ``O``. Every simplification relaxes (a real policy keeps a tensor
for part of a gap, pays for its ancestors when recomputing, holds copies in
flight, rounds allocations), so the optimum is a lower bound on any policy's
stall plus recompute time. Up to ``max_binaries`` binaries the program is
solved exactly (or to HiGHS's proven dual bound at the time limit); beyond,
its LP relaxation is solved, and beyond ``max_constraint_terms`` only the
highest-memory constraints are kept: both are still lower bounds (the
``method`` field says which was used).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Union

import numpy as np

from . import costs
from .replay_program import managed_tensors, op_durations, release_points
from .trace import Trace

__all__ = ["OptimalSolution", "optimal"]


@dataclass
class OptimalSolution:
    """The floor at one budget: ``overhead_s`` (recompute plus stall seconds
    on top of compute) is a lower bound for every policy; ``exact`` says the
    integer program was solved to optimality. ``recompute`` / ``swap`` list
    (tensor id, use op) gaps chosen (empty for a relaxation)."""

    budget_bytes: int
    feasible: bool
    overhead_s: float
    compute_s: float
    method: str
    exact: bool
    gaps: int
    recompute: List[tuple] = field(default_factory=list)
    swap: List[tuple] = field(default_factory=list)
    message: str = ""


def _gaps(trace: Trace, managed: Sequence[int]):
    """(tensor id, first op, last op, use op) per gap, and per op the bytes of
    managed tensors that must be resident there."""
    n = len(trace.ops)
    forced = np.zeros(n + 1)
    gaps = []
    for tid in managed:
        t = trace.tensors[tid]
        p = release_points(trace, tid)
        resident = [(t.producer, p["forward_release"]), *p["uses"]]
        for a, b in resident:
            forced[a] += t.bytes
            forced[b + 1] -= t.bytes
        end_of_previous = p["forward_release"]
        for u, done in p["uses"]:
            if u > end_of_previous + 1:
                gaps.append((tid, end_of_previous + 1, u - 1, u))
            end_of_previous = max(end_of_previous, done)
    return gaps, np.cumsum(forced)[:n]


def _unmanaged_bytes(trace: Trace, managed: set) -> np.ndarray:
    n = len(trace.ops)
    delta = np.zeros(n + 1)
    for t in trace.tensors:
        if t.id in managed:
            continue
        start = 0 if t.producer is None else t.producer
        end = n - 1 if t.dies_after is None else t.dies_after
        delta[start] += t.bytes
        delta[end + 1] -= t.bytes
    return np.cumsum(delta)[:n]


def optimal(trace: Trace, budget: int, device: Union[str, costs.DeviceModel] = "h200", *,
            min_tensor_bytes: int = 1 << 20, durations: Optional[Sequence[float]] = None,
            time_limit_s: float = 60.0, max_binaries: int = 4000,
            max_constraint_terms: int = 2_000_000) -> OptimalSolution:
    """The optimal (least) recompute-plus-stall overhead of ``trace`` under
    ``budget`` bytes on ``device`` (Note [The floor's program] in the module
    doc). ``durations`` default to :func:`membudget.replay_program.op_durations`.
    Returns an :class:`OptimalSolution`; ``feasible`` is False when no
    schedule of swaps and recomputes fits the budget."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import csr_matrix

    model = costs.device_model(device) if isinstance(device, str) else device
    durations = np.asarray(durations if durations is not None else op_durations(trace, model), dtype=float)
    compute = float(durations.sum())
    managed = managed_tensors(trace, min_tensor_bytes)
    gaps, forced = _gaps(trace, managed)
    base = _unmanaged_bytes(trace, set(managed)) + forced
    start = np.concatenate([[0.0], np.cumsum(durations)])
    G = len(gaps)
    method = "milp" if 2 * G <= max_binaries else "lp"

    def solution(feasible, overhead, exact, message="", rec=(), swp=()):
        return OptimalSolution(budget, feasible, overhead, compute, method, exact, G, list(rec), list(swp), message)

    if base.max(initial=0) > budget and G == 0:
        return solution(False, float("inf"), True, "unmanaged memory alone exceeds the budget")
    # Memory rows: one per interval between gap boundaries, at its worst op.
    boundaries = sorted({0, len(trace.ops)} | {a for _, a, _, _ in gaps} | {b + 1 for _, _, b, _ in gaps})
    rows, cols, vals, upper = [], [], [], []
    intervals = []
    for lo, hi in zip(boundaries, boundaries[1:]):
        if hi <= lo:
            continue
        worst = lo + int(np.argmax(base[lo:hi]))
        intervals.append(worst)
    active = [[] for _ in intervals]
    starts = np.array(intervals)
    for g, (tid, a, b, _) in enumerate(gaps):
        lo, hi = np.searchsorted(starts, a), np.searchsorted(starts, b, side="right")
        for k in range(lo, hi):
            active[k].append(g)
    # Keep the highest-memory rows when there are too many terms (a relaxation).
    order = sorted(range(len(intervals)), key=lambda k: -(base[intervals[k]] +
                                                         sum(trace.tensors[gaps[g][0]].bytes for g in active[k])))
    terms, kept = 0, []
    for k in order:
        if terms + 2 * len(active[k]) > max_constraint_terms:
            method = "lp-coarse"
            continue
        terms += 2 * len(active[k])
        kept.append(k)
    # Variables: x_0..x_{G-1}, w_0..w_{G-1}, O.
    nv = 2 * G + 1
    r = 0
    for k in kept:
        worst = intervals[k]
        present = base[worst] + sum(trace.tensors[gaps[g][0]].bytes for g in active[k])
        if present <= budget:
            continue
        if not active[k]:
            return solution(False, float("inf"), True, f"op {worst} needs {int(base[worst])} bytes resident")
        for g in active[k]:
            size = trace.tensors[gaps[g][0]].bytes
            rows += [r, r]
            cols += [g, G + g]
            vals += [-size, -size]
        upper.append(budget - present)  # -(x+w)*b summed <= budget - all-resident bytes
        r += 1
    lower = [-np.inf] * r
    # x_g + w_g <= 1
    for g in range(G):
        rows += [r, r]
        cols += [g, G + g]
        vals += [1, 1]
        lower.append(-np.inf)
        upper.append(1)
        r += 1
    # O - sum c_g x_g >= 0
    cost = [float(durations[trace.tensors[tid].producer]) for tid, _, _, _ in gaps]
    rows += [r] * (G + 1)
    cols += [*range(G), 2 * G]
    vals += [-c for c in cost] + [1]
    lower.append(0)
    upper.append(np.inf)
    r += 1
    # Host link, H2D: O - sum_{use <= u} w_g b/link >= -start(u), one row per use point.
    link = model.link_bytes_per_s
    by_use = sorted(range(G), key=lambda g: gaps[g][3])
    for k, g in enumerate(by_use):
        if k + 1 < G and gaps[by_use[k + 1]][3] == gaps[g][3]:
            continue  # one row per distinct use op, after all gaps ending there
        members = by_use[:k + 1]
        rows += [r] * (len(members) + 1)
        cols += [G + m for m in members] + [2 * G]
        vals += [-trace.tensors[gaps[m][0]].bytes / link for m in members] + [1]
        lower.append(-start[gaps[g][3]])
        upper.append(np.inf)
        r += 1
        if len(rows) > 4 * max_constraint_terms:
            break
    c = np.zeros(nv)
    c[-1] = 1.0
    integrality = np.zeros(nv)
    if method == "milp":
        integrality[:2 * G] = 1
    constraints = LinearConstraint(csr_matrix((vals, (rows, cols)), shape=(r, nv)), lower, upper)
    result = milp(c, constraints=constraints, integrality=integrality,
                  bounds=Bounds(np.zeros(nv), np.concatenate([np.ones(2 * G), [np.inf]])),
                  options={"time_limit": time_limit_s, "disp": False})
    if result.status == 2:
        return solution(False, float("inf"), True, "no swap/recompute schedule fits the budget")
    if result.x is None:
        bound = getattr(result, "mip_dual_bound", None)
        if bound is not None and np.isfinite(bound):
            return solution(True, float(bound), False, f"time limit: dual bound ({result.message})")
        return solution(False, float("nan"), False, f"solver gave no answer: {result.message}")
    exact = method == "milp" and result.status == 0
    overhead = float(result.fun)
    if method == "milp" and result.status != 0:
        overhead = float(getattr(result, "mip_dual_bound", overhead))
    x = result.x
    rec = [(gaps[g][0], gaps[g][3]) for g in range(G) if x[g] > 0.5] if exact else []
    swp = [(gaps[g][0], gaps[g][3]) for g in range(G) if x[G + g] > 0.5] if exact else []
    return solution(True, max(0.0, overhead), exact, str(result.message), rec, swp)

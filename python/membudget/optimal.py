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
Between those intervals lie *gaps* (each ends at a use ``u``). Memory rows:
one per stretch of ops over which the set of open gaps is constant, at its
worst op ``t`` (it dominates the rest); only rows over the budget matter.
Variables, per (gap g, row k): ``s`` (absent at ``t`` by swap) and ``x``
(absent by recompute), ``s + x <= 1``; per gap ``y >= x`` (recomputed, at the
producer's modelled duration ``c``, shared among an op's managed outputs) and
``z >= s`` (swapped in); the overhead ``O`` (recompute plus stall seconds).

* memory, per row: ``sum (s + x) * bytes >= live bytes - budget``;
* copy out, per row: what is absent by swap at ``t`` has crossed the link by
  then, copies in one direction being serial:
  ``sum s * bytes / link <= start(t) + O``;
* copy in, per use ``u``: ``sum_{use <= u} z * bytes / link <= start(u) + O``;
* ``O >= sum c * y``.

Note [The floor's recompute costs]: ``c`` is what the runtime's lineage
replay of the tensor runs (:func:`membudget.replay_program.replay_closures`:
its producer plus the producers of unmanaged inputs dead by its first
unpack), each op's duration divided among the gaps whose replays contain it,
so that recomputing several tensors that share an op pays for it once; a
tensor the runtime cannot replay (written in place after its producer, as a
dropout mask) has no ``x`` or ``y``. The simulator pays the whole closure
for every replay, so this stays a lower bound; charging the producer alone,
as before, let the floor "recompute" a mask or a Llama-7B fp32 norm input
(88 ms of replay) for its producer's 0.2 ms.

Minimise ``O``. Every simplification relaxes (a recompute does not pay for
evicted ancestors, copies in flight hold no memory, allocations are not
rounded), so the optimum is a lower bound on any policy's stall plus
recompute time, the simulator's included. Up to ``max_binaries`` binaries it
is solved exactly (or to HiGHS's proven dual bound at the time limit);
beyond, as its LP relaxation, and beyond ``max_pairs`` (gap, row) pairs only
the rows with the largest deficits are kept: still lower bounds (``method``
says which: ``milp``, ``lp``, ``lp-coarse``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Union

import numpy as np

from . import costs
from .replay_program import managed_tensors, op_durations, release_points, replay_closures
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


def _recompute_costs(trace: Trace, durations, gaps, managed) -> List[Optional[float]]:
    """Per gap, the seconds the floor charges for recomputing its tensor, or
    None when the runtime cannot replay it (Note [The floor's recompute
    costs])."""
    closures = replay_closures(trace, managed)
    share: dict = {}
    for tid, _, _, _ in gaps:
        for op in (closures[tid] or ((), ()))[0]:
            share[op] = share.get(op, 0) + 1
    out: List[Optional[float]] = []
    for tid, _, _, _ in gaps:
        closure = closures[tid]
        out.append(None if closure is None else sum(float(durations[op]) / share[op] for op in closure[0]))
    return out


def optimal(trace: Trace, budget: int, device: Union[str, costs.DeviceModel] = "h200", *,
            min_tensor_bytes: int = 1 << 20, durations: Optional[Sequence[float]] = None,
            time_limit_s: float = 60.0, max_binaries: int = 4000,
            max_pairs: int = 6_000) -> OptimalSolution:
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
    method = "milp"

    def solution(feasible, overhead, exact, message="", rec=(), swp=()):
        return OptimalSolution(budget, feasible, overhead, compute, method, exact, G, list(rec), list(swp), message)

    # Memory rows: one per interval between gap boundaries, at its worst op
    # (the set of gaps around an op is constant inside an interval).
    boundaries = sorted({0, len(trace.ops)} | {a for _, a, _, _ in gaps} | {b + 1 for _, _, b, _ in gaps})
    worst = [lo + int(np.argmax(base[lo:hi])) for lo, hi in zip(boundaries, boundaries[1:]) if hi > lo]
    starts = np.array(worst)
    active: List[List[int]] = [[] for _ in worst]
    for g, (_, a, b, _) in enumerate(gaps):
        for k in range(int(np.searchsorted(starts, a)), int(np.searchsorted(starts, b, side="right"))):
            active[k].append(g)
    size = np.array([trace.tensors[tid].bytes for tid, _, _, _ in gaps], dtype=float)
    deficit = {}
    for k, t in enumerate(worst):
        need = base[t] + sum(size[g] for g in active[k]) - budget
        if need > 0:
            if not active[k]:
                return solution(False, float("inf"), True, f"op {t} needs {int(base[t])} bytes that cannot move")
            if sum(size[g] for g in active[k]) < need:
                return solution(False, float("inf"), True, f"op {t}: moving everything still exceeds the budget")
            deficit[k] = need
    # Too many (gap, row) pairs: keep the rows with the largest deficits (a relaxation).
    rows_kept = sorted(deficit, key=lambda k: -deficit[k])
    pairs, kept = 0, []
    for k in rows_kept:
        if pairs + len(active[k]) > max_pairs:
            method = "lp-coarse"
            continue
        pairs += len(active[k])
        kept.append(k)
    if method == "milp" and 2 * pairs > max_binaries:
        method = "lp"
    # Variables: per kept (gap, row) pair s (absent by swap) and x (absent by
    # recompute); per gap y (recomputed) and z (swapped in); per use point the
    # cumulative H2D seconds H; the overhead O.
    pair_index = [(g, k) for k in kept for g in active[k]]
    P, n_use = len(pair_index), 0
    uses = sorted({u for _, _, _, u in gaps})
    use_pos = {u: j for j, u in enumerate(uses)}
    n_use = len(uses)
    S, X, Y, Z, H, O = 0, P, 2 * P, 2 * P + G, 2 * P + 2 * G, 2 * P + 2 * G + n_use
    nv = O + 1
    rows, cols, vals, lower, upper = [], [], [], [], []
    r = 0

    def row(entries, lo, hi):
        nonlocal r
        for col, val in entries:
            rows.append(r)
            cols.append(col)
            vals.append(val)
        lower.append(lo)
        upper.append(hi)
        r += 1

    # Scaled units (HiGHS is slow on coefficients 1e9 apart): bytes in units
    # of the largest managed tensor, seconds in units of the compute time.
    unit_b = float(size.max()) if G else 1.0
    unit_s = compute if compute > 0 else 1.0
    size_s = size / unit_b
    link = model.link_bytes_per_s * unit_s / unit_b  # scaled bytes per scaled second
    start_s = start / unit_s
    by_row: dict = {}
    for p, (g, k) in enumerate(pair_index):
        by_row.setdefault(k, []).append((p, g))
        row([(S + p, 1), (X + p, 1)], -np.inf, 1)          # one way of being absent
        row([(Y + g, 1), (X + p, -1)], 0, np.inf)          # absent by recompute => recomputed
        row([(Z + g, 1), (S + p, -1)], 0, np.inf)          # absent by swap => swapped in
    for k, members in by_row.items():
        row([(S + p, size_s[g]) for p, g in members] + [(X + p, size_s[g]) for p, g in members],
            deficit[k] / unit_b, np.inf)
        # Copied out before the op at this row: D2H seconds <= start + O.
        row([(O, 1)] + [(S + p, -size_s[g] / link) for p, g in members], -start_s[worst[k]], np.inf)
    cost = [None if c is None else c / unit_s for c in _recompute_costs(trace, durations, gaps, managed)]
    row([(O, 1)] + [(Y + g, -cost[g]) for g in range(G) if cost[g] is not None], 0, np.inf)
    by_use: dict = {}
    for g, (_, _, _, u) in enumerate(gaps):
        by_use.setdefault(use_pos[u], []).append(g)
    for j, u in enumerate(uses):
        # H_j = H_{j-1} + swapped-in seconds needed at use u; O >= H_j - start(u).
        entries = [(H + j, 1)] + ([(H + j - 1, -1)] if j else [])
        entries += [(Z + g, -size_s[g] / link) for g in by_use.get(j, [])]
        row(entries, 0, 0)
        row([(O, 1), (H + j, -1)], -start_s[u], np.inf)
    c = np.zeros(nv)
    c[O] = 1.0
    integrality = np.zeros(nv)
    if method == "milp":
        integrality[:2 * P] = 1
    ub = np.concatenate([np.ones(2 * P + 2 * G), np.full(n_use + 1, np.inf)])
    for p, (g, _) in enumerate(pair_index):
        if cost[g] is None:  # cannot be replayed: absent only by swap
            ub[X + p] = 0.0
    for g in range(G):
        if cost[g] is None:
            ub[Y + g] = 0.0
    result = milp(c, constraints=LinearConstraint(csr_matrix((vals, (rows, cols)), shape=(r, nv)), lower, upper),
                  integrality=integrality, bounds=Bounds(np.zeros(nv), ub),
                  options={"time_limit": time_limit_s, "disp": False})
    if result.status == 2:
        return solution(False, float("inf"), True, "no swap/recompute schedule fits the budget")
    if result.x is None:
        bound = getattr(result, "mip_dual_bound", None)
        if bound is not None and np.isfinite(bound):
            return solution(True, max(0.0, float(bound)) * unit_s, False, f"time limit: dual bound ({result.message})")
        return solution(False, float("nan"), False, f"solver gave no answer: {result.message}")
    exact = method == "milp" and result.status == 0
    overhead = float(result.fun)
    if method == "milp" and result.status != 0:
        overhead = float(getattr(result, "mip_dual_bound", overhead))
    overhead *= unit_s
    x = result.x
    rec = [(gaps[g][0], gaps[g][3]) for g in range(G) if x[Y + g] > 0.5] if exact else []
    swp = [(gaps[g][0], gaps[g][3]) for g in range(G) if x[Z + g] > 0.5] if exact else []
    return solution(True, max(0.0, overhead), exact, str(result.message), rec, swp)

"""Choosing what to recompute: meet a memory budget at the least modelled overhead.

Where this sits in the flow: given a :class:`MemoryModel` (:mod:`.analysis`)
and a budget in bytes, :func:`select` returns a :class:`Selection`: the ops to
recompute, the predicted peak and overhead, and, when no choice fits, the
smallest peak the planner could reach.

Two solvers:

* ``greedy`` (Echo's): repeatedly take the op whose recomputation removes the
  most memory above the budget (bytes x time over the whole step, so that a
  plateau of equal peaks still shows progress) per second of recompute,
  re-evaluating every remaining op against the current set each round; then
  drop choices that turned out unnecessary, most expensive first.
* ``milp``: an exact integer program (``scipy.optimize.milp``) for graphs with
  few candidates: binary "recompute op o", liveness of each affected storage
  per segment of slots bounded below by the choices that keep it alive,
  memory at every slot at most the budget, minimum total recompute time. The
  linear model is exact for recompute chains of depth two; the solution is
  checked on the exact :class:`MemoryModel` and a no-good cut is added if a
  deeper chain made it wrong.

``auto`` uses ``milp`` up to :data:`MILP_MAX_CANDIDATES` candidates and keeps
the cheaper of the two plans.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import numpy as np

from .analysis import MemoryModel, Profile

__all__ = ["Selection", "select", "greedy", "milp", "milp_available", "min_peak", "MILP_MAX_CANDIDATES"]

#: Above this many candidate ops ``auto`` uses the greedy solver alone.
MILP_MAX_CANDIDATES = 120
_EPS_COST = 1e-9


@dataclass
class Selection:
    """The outcome of a selection. ``recompute`` holds op indices of the
    planning graph; peaks are bytes, fixed bytes included; ``feasible`` is
    whether ``predicted_peak <= budget``; ``min_reachable_peak`` is the lowest
    peak found when minimising the peak alone (filled when infeasible)."""

    recompute: List[int]
    budget: int
    predicted_peak: int
    baseline_peak: int
    overhead_s: float
    feasible: bool
    method: str
    min_reachable_peak: Optional[int] = None
    solve_s: float = 0.0
    notes: List[str] = field(default_factory=list)


def _candidates(model: MemoryModel) -> List[int]:
    return [op.index for op in model.graph.candidates()]


def _relevant(model: MemoryModel, candidates: Sequence[int], memory: np.ndarray, threshold: float) -> List[int]:
    """Candidates that can lower memory somewhere it exceeds ``threshold``:
    dropping an op's outputs frees memory only between their last forward use
    and their first backward use, so the others cannot help (yet)."""
    over = memory > threshold
    if not over.any():
        return []
    prefix = np.concatenate([[0], np.cumsum(over)])
    useful = []
    for o in candidates:
        for sid in model.graph.ops[o].outputs:
            lo = model.fw_end.get(sid)
            hi = model.bw_first.get(sid)
            if lo is None or hi is None:
                continue
            if prefix[hi] - prefix[lo + 1] > 0:
                useful.append(o)
                break
    return useful


def _feeders(model: MemoryModel, op_index: int, chosen: set, depth: int = 8) -> List[int]:
    """Ops that recomputing ``op_index`` would otherwise keep alive: producers
    of its inputs that autograd does not stash (read only in forward) and
    that may be recomputed, transitively up to ``depth``. Recomputing them
    with it is one move (a chain), so that its benefit is seen at once."""
    graph = model.graph
    found: List[int] = []
    frontier = [op_index]
    for _ in range(depth):
        nxt = []
        for o in frontier:
            for sid in graph.ops[o].inputs:
                producer = graph.storages[sid].producer
                if (producer is None or producer in chosen or producer in found or producer == op_index
                        or not graph.ops[producer].recomputable or model.bw_first.get(sid) is not None):
                    continue
                found.append(producer)
                nxt.append(producer)
        frontier = nxt
    return found


def _moves(model: MemoryModel, o: int, chosen: set) -> List[List[int]]:
    feeders = _feeders(model, o, chosen)
    return [[o], [o, *feeders]] if feeders else [[o]]


def _apply(model: MemoryModel, profile: Profile, move: Sequence[int]) -> Profile:
    for o in move:
        profile = model.with_op(profile, o)
    return profile


def greedy(model: MemoryModel, budget: int, candidates: Optional[Sequence[int]] = None) -> List[int]:
    """Echo's greedy: benefit (memory above budget removed) per second of
    recompute, all remaining candidates re-evaluated each round (alone, and
    with the unstashed ops feeding them), then pruned."""
    remaining = list(candidates if candidates is not None else _candidates(model))
    chosen: List[int] = []
    current = model.profile(chosen)
    while current.peak > budget and remaining:
        base_excess = current.excess(budget)
        best, best_score, best_profile = None, 0.0, None
        for o in _relevant(model, remaining, current.memory, budget):
            for move in _moves(model, o, set(chosen)):
                trial = _apply(model, current, move)
                gain = base_excess - trial.excess(budget)
                if gain <= 0:
                    continue
                score = gain / (sum(model.graph.ops[x].cost_s for x in move) + _EPS_COST)
                if score > best_score:
                    best, best_score, best_profile = move, score, trial
        if best is None:
            break
        chosen.extend(best)
        remaining = [o for o in remaining if o not in best]
        current = best_profile
    return prune(model, chosen, budget)


def prune(model: MemoryModel, chosen: List[int], budget: int) -> List[int]:
    """Drop choices not needed to meet ``budget``, the most expensive first."""
    if model.profile(chosen).peak > budget:
        return chosen
    kept = list(chosen)
    for o in sorted(chosen, key=lambda o: -model.graph.ops[o].cost_s):
        trial = [x for x in kept if x != o]
        if model.profile(trial).peak <= budget:
            kept = trial
    return kept


def min_peak(model: MemoryModel, candidates: Optional[Sequence[int]] = None) -> Profile:
    """The lowest peak the greedy search reaches when it minimises the peak
    alone (overhead ignored); ties go to the smaller memory area."""
    remaining = list(candidates if candidates is not None else _candidates(model))
    chosen: List[int] = []
    current = model.profile(chosen)
    while remaining:
        best, best_key = None, (current.peak, float(current.memory.sum()))
        for o in _relevant(model, remaining, current.memory, current.peak - 1):
            for move in _moves(model, o, set(chosen)):
                trial = _apply(model, current, move)
                key = (trial.peak, float(trial.memory.sum()))
                if key < best_key:
                    best, best_key, best_profile = move, key, trial
        if best is None:
            break
        chosen.extend(best)
        remaining = [o for o in remaining if o not in best]
        current = best_profile
    return current


def milp_available() -> bool:
    """Whether scipy (for the exact integer program) can be imported."""
    try:
        import scipy.optimize  # noqa: F401
    except ImportError:
        return False
    return True


def milp(model: MemoryModel, budget: int, candidates: Optional[Sequence[int]] = None,
         time_limit_s: float = 10.0, max_cuts: int = 5) -> Optional[List[int]]:
    """The least-overhead recompute set meeting ``budget`` by an integer
    program, or ``None`` when it has no solution (or scipy finds none in
    ``time_limit_s``)."""
    from scipy.optimize import Bounds, LinearConstraint, milp as scipy_milp
    from scipy.sparse import lil_matrix

    cands = list(candidates if candidates is not None else _candidates(model))
    if not cands:
        return [] if model.profile([]).peak <= budget else None
    var_of = {o: i for i, o in enumerate(cands)}
    touched = sorted(model.affected(cands))
    own = {o: model.own_slot(o) for o in cands}
    # Memory of the untouched storages per slot (constant, fixed bytes and workspaces included).
    base = model.profile([]).memory - model._memory_of(model._intervals(touched, frozenset(), {}))
    ops = model.graph.ops
    # Per touched storage: liveness requirements as (slot_lo, slot_hi, coefficients, constant):
    # live(slot) >= constant + sum(coef * r) for slot in [lo, hi].
    requirements: Dict[int, List[tuple]] = {}
    for sid in touched:
        nbytes = model.graph.storages[sid].bytes
        if not nbytes:
            continue
        producer = model.graph.storages[sid].producer
        p_var = var_of.get(producer)
        reqs = [(model.start[sid], model.fw_end[sid], {}, 1.0)]
        stash_end = model.end[sid]
        if stash_end > model.fw_end[sid]:
            reqs.append((model.fw_end[sid] + 1, stash_end, {p_var: -1.0} if p_var is not None else {}, 1.0))
        if p_var is not None and own[producer] is not None:
            lo = own[producer]
            hi = stash_end if model.bw_first[sid] is not None else lo
            reqs.append((lo, max(hi, lo), {p_var: 1.0}, 0.0))
        for reader in model.readers.get(sid, ()):
            if reader == producer or reader not in var_of or own[reader] is None:
                continue
            r_var = var_of[reader]
            t = own[reader]
            coef = {r_var: 1.0}
            if p_var is not None:
                coef[p_var] = -1.0
            reqs.append((model.fw_end[sid] + 1, t, coef, 0.0))
            if p_var is not None and own[producer] is not None and t < own[producer]:
                reqs.append((t, own[producer], {r_var: 1.0, p_var: 1.0}, -1.0))
        requirements[sid] = reqs
    # Segment the slots of each storage at the requirement boundaries.
    segments = []  # (sid, lo, hi)
    seg_rows = []
    for sid, reqs in requirements.items():
        cuts = sorted({lo for lo, _, _, _ in reqs} | {hi + 1 for _, hi, _, _ in reqs})
        for lo, nxt in zip(cuts, cuts[1:]):
            hi = nxt - 1
            active = [(c, k) for rl, rh, c, k in reqs if rl <= lo and hi <= rh]
            if active:
                segments.append((sid, lo, hi))
                seg_rows.append(active)
    n_r, n_l = len(cands), len(segments)
    cost = np.zeros(n_r + n_l)
    for o, i in var_of.items():
        cost[i] = ops[o].cost_s + _EPS_COST
    rows_needed = sum(len(a) for a in seg_rows)
    A_live = lil_matrix((rows_needed, n_r + n_l))
    lb_live = []
    row = 0
    for j, active in enumerate(seg_rows):
        for coef, const in active:
            A_live[row, n_r + j] = 1.0
            for var, c in coef.items():
                A_live[row, var] -= c
            lb_live.append(const)
            row += 1
    A_mem = lil_matrix((model.num_slots, n_r + n_l))
    for j, (sid, lo, hi) in enumerate(segments):
        nbytes = float(model.graph.storages[sid].bytes)
        for slot in range(lo, hi + 1):
            A_mem[slot, n_r + j] = nbytes
    mem_ub = (budget - base).astype(float)  # base includes the fixed bytes
    integrality = np.concatenate([np.ones(n_r), np.zeros(n_l)])
    bounds = Bounds(np.zeros(n_r + n_l), np.ones(n_r + n_l))
    cuts: List[List[int]] = []
    for _ in range(max_cuts + 1):
        constraints = [LinearConstraint(A_live.tocsr(), np.asarray(lb_live), np.inf),
                       LinearConstraint(A_mem.tocsr(), -np.inf, mem_ub)]
        for cut in cuts:
            a = np.zeros(n_r + n_l)
            a[[var_of[o] for o in cut]] = 1.0
            constraints.append(LinearConstraint(a, -np.inf, len(cut) - 1))
        result = scipy_milp(cost, constraints=constraints, integrality=integrality, bounds=bounds,
                            options={"time_limit": time_limit_s})
        if result.x is None:
            return None
        chosen = [o for o, i in var_of.items() if result.x[i] > 0.5]
        if model.profile(chosen).peak <= budget:
            return chosen
        cuts.append(chosen)
    return None


def select(model: MemoryModel, budget: int, method: str = "auto") -> Selection:
    """Meet ``budget`` (bytes, fixed bytes included) at the least modelled
    recompute overhead with ``method`` (``greedy``, ``milp`` or ``auto``)."""
    if method not in ("auto", "greedy", "milp"):
        raise ValueError(f"planner method {method!r}: expected 'auto', 'greedy' or 'milp'")
    began = time.perf_counter()
    baseline = model.profile([])
    cands = _candidates(model)
    notes: List[str] = []
    chosen: Optional[List[int]] = None
    used = method
    if baseline.peak <= budget:
        chosen, used = [], "none needed"
    else:
        plans = []
        if method in ("greedy", "auto"):
            plans.append(("greedy", greedy(model, budget, cands)))
        if (method == "milp" or (method == "auto" and len(cands) <= MILP_MAX_CANDIDATES)) \
                and not milp_available():
            notes.append("scipy is not installed: the exact integer program was skipped")
            if method == "milp":
                raise ImportError("planner method 'milp' needs scipy (pip install scipy; it is in "
                                  "requirements-dev.txt)")
        elif method == "milp" or (method == "auto" and len(cands) <= MILP_MAX_CANDIDATES):
            exact = milp(model, budget, cands)
            if exact is not None:
                plans.append(("milp", exact))
            elif method == "milp":
                notes.append("the integer program found no plan within the budget")
        lowest: Optional[Profile] = None
        if not any(model.profile(p).peak <= budget for _, p in plans):
            # Greedy can stall where only a pair of choices helps (an op and
            # the input it would keep alive): the peak-minimising search
            # finds those; pruned, it may still meet the budget.
            lowest = min_peak(model, cands)
            plans.append(("min-peak", prune(model, sorted(lowest.recompute), budget)))
        fitting = [(model.profile(p).overhead_s, name, p) for name, p in plans if model.profile(p).peak <= budget]
        if fitting:
            _, used, chosen = min(fitting, key=lambda x: x[0])
        else:
            # Nothing fits: hand back the lowest peak reachable, say so.
            used, chosen = "min-peak", sorted(lowest.recompute) if lowest is not None else []
            notes.append("no recompute set meets the budget; the plan is the lowest peak reachable")
    chosen = sorted(chosen or [])
    final = model.profile(chosen)
    selection = Selection(recompute=chosen, budget=int(budget), predicted_peak=final.peak,
                          baseline_peak=baseline.peak, overhead_s=final.overhead_s,
                          feasible=final.peak <= budget, method=used, notes=notes)
    if not selection.feasible:
        selection.min_reachable_peak = final.peak
    selection.solve_s = time.perf_counter() - began
    return selection

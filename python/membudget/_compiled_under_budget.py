"""``torch.compile`` under the process budget: each graph inductor compiles
is split into forward and backward so that it fits what the budget leaves it.

Where this sits in the flow: ``install()`` calls :func:`plan_compiles` when a
budget is set and ``MEMBUDGET_COMPILE`` is ``plan`` (the default), and
:func:`leave_compiles` otherwise and at ``uninstall()``.

Note [Compiled graphs planned under the budget]: a model compiled whole
saves its activations where no hook sees them until its forward ends, and
its backward unpacks them all as it starts, so the runtime has nothing to
release while they are all alive: such a model runs out of memory under a
budget below its compiled peak with "evictable 0 B"
(tests/test_compiled_under_budget.py, bench/bench_compiled_budget.py). The
only place a compiled graph's activations can be traded for recomputation is
its partition into forward and backward, where AOTAutograd decides what to
save. While installed with a budget, membudget sets inductor's
``custom_partitioner_fn`` (torch >= 2.9) to a :class:`BudgetPartitioner`,
which gives each graph a byte budget taken from the process at the moment
the graph is partitioned (the first call of a compiled region, in its
forward):

    graph budget = (budget - outside - optimizer state to come) * (1 - MARGIN)

``outside`` is what is allocated and neither an input of this graph (its
parameters and inputs, which the graph's model counts) nor evictable (saved
activations the runtime can swap or drop, eager or from an earlier graph):
the caller's tensors, gradients kept across steps, optimizer state that
exists, and what an earlier graph of the same step saved. ``optimizer state
to come`` is what the live optimizers will create at their first step for
parameters that have none yet (Adam: two tensors the size of each parameter;
:func:`pending_optimizer_state_bytes`): the first compile happens before the
first step, and a graph's partition is fixed once compiled.

Note [Inductor's partitions, judged by the planner's model]: the graph is
cut by inductor's own min-cut partitioner, first as it cuts without a budget
and then at shrinking ``activation_memory_budget`` shares (``FRACTIONS``),
until a cut's peak, as the Echo planner's memory model of the joint graph
predicts it over the whole forward and backward (``planner/analysis.py``),
fits the graph's budget; two halvings between that share and the one before
it (``REFINE_STEPS``) look for a larger share that fits, and the largest
share that fits is taken (where none fits, the lowest predicted peak, with
a warning). The planner's own recompute set (what ``compile_backend`` cuts by) is not used here because
its predictions did not hold under inductor: on transformers' GPT-2 the
backward of its cut measured 17.9 MiB against 14.1 predicted, while
min-cut's cuts measured within about 5% of the model at the shares the
bench reaches (15.4 against 16.4 at 0.5, 14.0 against 13.4 at 0.35).
``MARGIN`` covers that error. A graph that fits without a budget keeps
inductor's unconstrained cut, so a model compiled per block is partitioned
as without membudget, and membudget swaps or drops what its blocks save.

Random ops are never recomputed (:func:`_save_random_values`); what is
recomputed runs the forward's own ops again inside inductor's backward
kernels, so results equal the compiled run without membudget as closely as
two such runs equal each other (bit for bit on an MLP; GPT-2's compiled CPU
kernels already differ by about 2e-7 from run to run). A
``custom_partitioner_fn`` the user set is left alone, as is every backend
other than inductor (``aot_eager`` and others take their partition function
from their caller).
"""
from __future__ import annotations

import copy
import gc
import sys
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import fx
from torch._functorch.partitioners import min_cut_rematerialization_partition

from .planner.graph import _is_random_target
from .planner.partitioner import EchoPartitioner, _producer_ops
from .planner.selection import Selection

__all__ = ["BudgetPartitioner", "plan_compiles", "leave_compiles", "compiled_plans",
           "pending_optimizer_state_bytes", "MARGIN"]

MARGIN = 0.10  # of the graph's budget: what the op by op model of a graph does not see

# Tensors of optimizer state per parameter, the size of the parameter, that
# each optimizer creates at its first step (torch.optim's own classes; group
# options that add or remove one are read in _state_tensors_per_parameter).
# A class not named here, nor derived from one that is, counts as Adam.
# LBFGS keeps a history the user sizes (history_size): not counted.
_STATE_TENSORS = {"Adam": 2, "AdamW": 2, "NAdam": 2, "RAdam": 2, "Adamax": 2, "Adadelta": 2, "Rprop": 2,
                  "SparseAdam": 2, "Adagrad": 1, "ASGD": 1, "RMSprop": 1, "SGD": 0, "LBFGS": 0}


def _state_tensors_per_parameter(optimizer: torch.optim.Optimizer, group: Dict[str, Any]) -> int:
    name = next((c.__name__ for c in type(optimizer).__mro__ if c.__name__ in _STATE_TENSORS), "Adam")
    count = _STATE_TENSORS[name]
    if name in ("Adam", "AdamW") and group.get("amsgrad"):
        count += 1  # max_exp_avg_sq
    if name == "SGD" and group.get("momentum", 0):
        count = 1  # momentum_buffer
    if name == "RMSprop":
        count += int(bool(group.get("centered"))) + int(bool(group.get("momentum", 0)))
    return count


def pending_optimizer_state_bytes(device_type: str) -> int:
    """Bytes of optimizer state that the live ``torch.optim`` optimizers will
    create on ``device_type`` at their next step: for each parameter that
    requires grad and has no state yet, its size times the tensors its
    optimizer keeps per parameter (Adam two, SGD with momentum one, ...).
    Found by walking the garbage collector's objects (about 0.1 s with
    transformers imported), once per compiled graph."""
    total = 0
    seen = set()
    for obj in gc.get_objects():
        # type(), not isinstance(): isinstance reads __class__, which some
        # lazy objects answer with a deprecation warning.
        if not issubclass(type(obj), torch.optim.Optimizer):
            continue
        for group in obj.param_groups:
            per_parameter = _state_tensors_per_parameter(obj, group)
            if per_parameter == 0:
                continue
            for p in group["params"]:
                if id(p) in seen or not isinstance(p, torch.Tensor) or not p.requires_grad:
                    continue
                seen.add(id(p))
                if p.device.type == device_type and not obj.state.get(p):
                    total += per_parameter * p.numel() * p.element_size()
    return total


class BudgetPartitioner(EchoPartitioner):
    """Inductor's partitioner while membudget is installed with a budget:
    each graph's byte budget is read from the process when it is partitioned
    (Note [Compiled graphs planned under the budget]) and the graph is cut by
    min-cut at the least constrained share the planner's memory model says
    fits (Note [Inductor's partitions, judged by the planner's model]).
    ``plans`` lists, per graph: ``selection`` (recomputed ops of the planning
    graph, predicted peak, whether it fits), ``graph``, ``stash_bytes``,
    ``reserve_bytes``, ``activation_memory_budget`` (the share it was cut
    at), ``budget_bytes`` (the graph's share of the budget),
    ``outside_bytes`` and ``optimizer_state_bytes``."""

    def __init__(self, budget_bytes: int, device_type: str, device_model: str, log: bool = False):
        super().__init__(int(budget_bytes), device_model=device_model, margin=MARGIN)
        self.budget_bytes = int(budget_bytes)
        self.device_type = device_type
        self.log = log

    def _share(self, model) -> Dict[str, int]:
        """The graph's share of the budget (``budget_bytes``): the budget less
        what is held outside it (``outside_bytes``) and the optimizer state
        to come (``optimizer_state_bytes``), less ``MARGIN``."""
        from .stats import memory_stats

        stats = memory_stats()
        held = int(stats.get("allocated_bytes.all.current", 0))
        evictable = int(stats.get("evictable_bytes", 0))
        outside = max(0, held - evictable - int(model.fixed))
        state = pending_optimizer_state_bytes(self.device_type)
        share = self.budget_bytes - outside - state
        return {"budget_bytes": int(share * (1.0 - self.margin)), "outside_bytes": outside,
                "optimizer_state_bytes": state}

    def __call__(self, gm, joint_inputs, **kwargs):
        """Cut the joint graph ``gm`` into (forward, backward) graph modules."""
        model = self.model_of(gm, kwargs["num_fwd_outputs"])
        share = self._share(model)
        budget = share["budget_bytes"]
        # Note [Inductor's partitions, judged by the planner's model].
        trials = []
        for fraction in _fractions():
            try:
                trials.append(self._cut(gm, joint_inputs, model, fraction, **kwargs))
            except Exception as error:  # noqa: BLE001 - a failed trial must not fail the compile
                if not trials:
                    raise
                warnings.warn(f"membudget: compiled graph {len(self.plans)}: min-cut at "
                              f"activation_memory_budget={fraction:g} failed ({error!r}); the cuts tried before "
                              f"it are kept", RuntimeWarning, stacklevel=2)
                break
            if trials[-1][0].peak <= budget:
                break
        trials += self._refine(gm, joint_inputs, model, budget, trials, **kwargs)
        fitting = sorted((t for t in trials if t[0].peak <= budget), key=lambda t: -t[1])
        profile, fraction, recompute, fw, bw = fitting[0] if fitting else min(trials, key=lambda t: t[0].peak)
        selection = Selection(recompute=recompute, budget=budget, predicted_peak=profile.peak,
                              baseline_peak=model.profile([]).peak, overhead_s=profile.overhead_s,
                              feasible=profile.peak <= budget, method=f"min-cut at {fraction:g}")
        if not selection.feasible:
            selection.min_reachable_peak = profile.peak
            warnings.warn(f"membudget: compiled graph {len(self.plans)} cannot meet its share of the budget, "
                          f"{budget} bytes ({share['outside_bytes']} bytes held outside the graph, "
                          f"{share['optimizer_state_bytes']} of optimizer state to come); planned its lowest "
                          f"modelled peak, "
                          f"{profile.peak} bytes", RuntimeWarning, stacklevel=2)
        plan = {"selection": selection, "graph": model.graph, "stash_bytes": model.stashed_bytes(recompute),
                "reserve_bytes": model.reserve_bytes, "activation_memory_budget": fraction, **share}
        self.plans.append(plan)
        _note_for_out_of_memory(self.plans)
        if self.log:
            print(f"membudget: compiled graph {len(self.plans) - 1}: {plan['budget_bytes']} bytes of the budget "
                  f"({plan['outside_bytes']} held outside it, {plan['optimizer_state_bytes']} of optimizer state "
                  f"to come); min-cut at activation_memory_budget={plan['activation_memory_budget']:g} "
                  f"recomputes {len(selection.recompute)} ops, "
                  f"predicted peak {selection.predicted_peak} bytes"
                  f"{'' if selection.feasible else ' (lowest reachable)'}", file=sys.stderr)
        return fw, bw

    def _refine(self, gm, joint_inputs, model, budget: int, trials, **kwargs):
        """Between the last share that did not fit and the first that did,
        ``REFINE_STEPS`` halvings for a larger share that fits (less
        recomputed): the grid's steps are coarse."""
        if len(trials) < 2 or trials[-1][0].peak > budget:
            return []
        low, high = trials[-1][1], trials[-2][1]
        found = []
        for _ in range(REFINE_STEPS):
            middle = (low + high) / 2
            try:
                trial = self._cut(gm, joint_inputs, model, middle, **kwargs)
            except Exception:  # noqa: BLE001 - the cuts already made stand
                break
            found.append(trial)
            if trial[0].peak <= budget:
                low = middle
            else:
                high = middle
        return found

    @staticmethod
    def _cut(gm, joint_inputs, model, fraction: float, **kwargs):
        """Min-cut of a copy of ``gm`` at ``activation_memory_budget=fraction``,
        random ops saved: (predicted profile, fraction, recomputed ops, forward, backward)."""
        with warnings.catch_warnings():
            # Copying the graph's pytree specs warns of torch's own deprecations.
            warnings.simplefilter("ignore", FutureWarning)
            trial = fx.GraphModule(gm, copy.deepcopy(gm.graph))
        _save_random_values(trial)
        with torch._functorch.config.patch(activation_memory_budget=fraction):
            fw, bw = min_cut_rematerialization_partition(trial, joint_inputs, **kwargs)
        recompute = recomputed_by(model.graph, trial, fw, kwargs["num_fwd_outputs"])
        return model.profile(recompute), fraction, recompute, fw, bw

    def uuid(self) -> Any:
        """Cache key: the planner's, and this process budget."""
        return f"{super().uuid()}-{self.budget_bytes}-{self.device_type}"


def _note_for_out_of_memory(plans: List[Dict[str, Any]]) -> None:
    """Have every out-of-memory message say how the compiled graphs were cut:
    what a graph saves stays until its backward, evictable or not, so a
    failure inside one is explained by its share and its predicted peak."""
    from ._native import load_extension
    from .config import format_bytes

    shown = plans[-4:]
    first = len(plans) - len(shown)
    parts = [f"graph {first + i} cut at activation_memory_budget={plan['activation_memory_budget']:g}, "
             f"predicted peak {format_bytes(plan['selection'].predicted_peak)} of its share "
             f"{format_bytes(plan['budget_bytes'])}{'' if plan['selection'].feasible else ' (short of it)'}"
             for i, plan in enumerate(shown)]
    load_extension().set_out_of_memory_note("compiled graphs (MEMBUDGET_COMPILE=plan): " + "; ".join(parts))


def _clear_out_of_memory_note() -> None:
    from ._native import load_extension

    load_extension().set_out_of_memory_note("")


def _save_random_values(gm: fx.GraphModule) -> None:
    """Mark every random op of ``gm`` (``inductor_random`` and the seeds it
    reads, dropout) as saved, never recomputed: min-cut under a memory budget
    otherwise recomputes inductor's ``inductor_random`` in a backward kernel,
    which draws other numbers (transformers' GPT-2 with dropout trained to
    other parameters, by up to 4e-3 after two steps, with torch's own
    ``activation_memory_budget=0.5`` as with ours)."""
    from torch.utils.checkpoint import CheckpointPolicy

    for node in gm.graph.nodes:
        if node.op == "call_function" and _is_random_target(node.target) and "recompute" not in node.meta:
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE


def recomputed_by(graph, gm, fw_module, num_fwd_outputs: int) -> List[int]:
    """The forward ops of ``graph`` (the planning graph of the joint graph
    ``gm``) that a partition whose forward graph is ``fw_module`` recomputes
    in backward: those producing a value backward reads that the forward
    does not save (through the op, a view of it or one of its outputs), and,
    recursively, the unsaved forward ops those read."""
    owner = _producer_ops(gm, graph)
    by_name = {node.name: node for node in gm.graph.nodes}
    output = next(node for node in fw_module.graph.nodes if node.op == "output")
    saved = set()
    for value in list(output.args[0])[num_fwd_outputs:]:
        node = by_name.get(getattr(value, "name", None))
        if node is not None and owner.get(node) is not None:
            saved.add(owner[node])
    recomputed = set()
    todo = [s.producer for s in graph.saved_storages() if s.producer not in saved]
    while todo:
        op = todo.pop()
        if op in recomputed or op in saved:
            continue
        recomputed.add(op)
        for sid in graph.ops[op].inputs:
            producer = graph.storages[sid].producer
            if producer is not None and producer < graph.num_forward:
                todo.append(producer)
    return sorted(recomputed)


# activation_memory_budget values tried, largest first (least recomputation):
# min-cut's own knapsack over what to save, at shrinking shares of what it
# would save unconstrained.
FRACTIONS: Tuple[float, ...] = (1.0, 0.7, 0.5, 0.35, 0.25, 0.15, 0.08, 0.0)
REFINE_STEPS = 2  # halvings between the last share that did not fit and the first that did


def _fractions() -> Tuple[float, ...]:
    """FRACTIONS from the user's own activation_memory_budget down."""
    own = float(torch._functorch.config.activation_memory_budget)
    return (own,) + tuple(f for f in FRACTIONS if f < own) if own < 1.0 else FRACTIONS


_installed: Optional[BudgetPartitioner] = None


def _inductor_config():
    """Inductor's config when it has ``custom_partitioner_fn`` (torch >= 2.9), else None."""
    try:
        from torch._inductor import config
    except ImportError:  # pragma: no cover - torch without inductor
        return None
    return config if hasattr(config, "custom_partitioner_fn") else None


def plan_compiles(budget_bytes: int, device: torch.device, device_model: str, log: bool = False) -> bool:
    """Partition every inductor graph compiled from now on under
    ``budget_bytes`` (Note [Compiled graphs planned under the budget]).
    Returns False, changing nothing, where torch has no
    ``custom_partitioner_fn`` or the user set one."""
    global _installed
    _installed = None
    _clear_out_of_memory_note()
    config = _inductor_config()
    if config is None:
        return False
    current = config.custom_partitioner_fn
    if current is not None and not isinstance(current, BudgetPartitioner):
        return False  # the user's own partitioner
    _installed = BudgetPartitioner(budget_bytes, device.type, device_model, log=log)
    config.custom_partitioner_fn = _installed
    return True


def leave_compiles(forget_plans: bool = False) -> None:
    """Give inductor back its own partitioner (if ours is in place); with
    ``forget_plans``, :func:`compiled_plans` is empty from now on."""
    global _installed
    config = _inductor_config()
    if config is not None and isinstance(config.custom_partitioner_fn, BudgetPartitioner):
        config.custom_partitioner_fn = None
    if forget_plans:
        _installed = None
        _clear_out_of_memory_note()


def compiled_plans() -> List[Dict[str, Any]]:
    """What was planned for each graph compiled under the budget since the
    last ``install()``: per graph, ``selection`` (the recompute set, predicted
    peak, whether it fits), ``graph`` (the planning graph), ``budget_bytes``
    (its share of the budget), ``outside_bytes`` and
    ``optimizer_state_bytes`` (what that share left out). Kept after
    ``uninstall()``; empty after an ``install()`` with ``MEMBUDGET_COMPILE``
    ``off`` or no budget, and with torch older than 2.9."""
    return list(_installed.plans) if _installed is not None else []

"""``membudget.compile_backend``: the Echo planner as torch.compile's partitioner.

Where this sits in the flow: ``torch.compile(model, backend=compile_backend(budget="64MiB"))``
hands each captured graph to AOTAutograd, which traces the joint
forward/backward graph and asks a *partition function* which forward values
to save for backward. Ours builds a :class:`PlanGraph` of the joint graph
(:mod:`.graph`), selects the recompute set that meets the graph's budget at
the least modelled overhead (:mod:`.selection`), saves every other forward
value the backward needs and lets the backward graph recompute the rest.
PyTorch's own helpers cut the graph (``_extract_fwd_bwd_modules``) and move
each recomputation next to its first use (``reordering_to_mimic_autograd_engine``).
Random ops (dropout masks) are never recomputed, so results do not depend on
the plan.

Note [Budget shares across graph breaks]: dynamo compiles one graph per
region between breaks, in execution order on the first call, so graph ``k``
is planned before graph ``k+1`` exists. The activations an earlier graph
stashes stay alive while later graphs run forward and backward, so graph
``k`` is planned against ``budget - carried``, where ``carried`` is what
graphs ``0..k-1`` keep resident through later graphs
(:meth:`MemoryModel.carried_bytes`: their inputs and stash, less the
forward outputs their backward does not read, which the next graph counts
as its inputs; parameters shared between graphs are counted twice, which
errs towards lower memory). And graph ``k`` itself reserves room for what
comes after it: its model counts, between its forward and its backward, the
bytes that later graphs are expected to use (:meth:`MemoryModel.later_graphs_bytes`:
the gradients of its outputs, which later graphs hand back, plus one
activation as large as the outputs it hands on), so that its stash leaves
later graphs that much. The reserve is a heuristic, not a bound; a later graph that still does not fit warns and gets its lowest
reachable peak. A percentage budget applies to each graph's own activation
memory and needs no sharing.
"""
from __future__ import annotations

import hashlib
import inspect
import operator
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import torch
from torch import fx

from .. import costs
from .analysis import MemoryModel
from .graph import PlanGraph, _is_alias, from_joint_graph
from .selection import Selection, select

__all__ = ["compile_backend", "EchoPartitioner", "BudgetSpec", "partition_joint_graph"]


class BudgetSpec:
    """A budget as the user gave it: bytes (``int`` or ``"64MiB"``) for the
    whole modelled peak, fixed inputs and parameters included, or a fraction
    (``"40%"`` or a float in (0, 1]) of a graph's activation memory above its
    fixed bytes."""

    def __init__(self, spec: Union[int, float, str]):
        self.spec = spec
        self.fraction: Optional[float] = None
        self.bytes: Optional[int] = None
        if isinstance(spec, float) and 0 < spec <= 1:
            self.fraction = spec
        elif isinstance(spec, str) and spec.strip().endswith("%"):
            self.fraction = float(spec.strip()[:-1]) / 100.0
        else:
            from ..config import parse_bytes

            self.bytes = int(spec) if isinstance(spec, int) else int(parse_bytes(spec, "budget"))
        if self.fraction is not None and not 0 < self.fraction <= 1:
            raise ValueError(f"membudget planner: budget {spec!r} must be a percentage in (0, 100]")

    def resolve(self, model: MemoryModel, carried: int = 0) -> int:
        """The budget in bytes for one graph."""
        if self.fraction is not None:
            baseline = model.profile([]).peak
            return int(model.fixed + self.fraction * (baseline - model.fixed))
        return int(self.bytes) - int(carried)

    def __repr__(self) -> str:
        return f"BudgetSpec({self.spec!r})"


def _producer_ops(gm: fx.GraphModule, graph: PlanGraph) -> Dict[fx.Node, Optional[int]]:
    """For each node, the planning op that owns the storage it reads as (views
    and getitems resolve to their base's producer)."""
    op_by_name = {op.key: op.index for op in graph.ops}
    owner: Dict[fx.Node, Optional[int]] = {}
    for node in gm.graph.nodes:
        if node.name in op_by_name:
            owner[node] = op_by_name[node.name]
        elif node.op == "call_function" and node.all_input_nodes and (
                node.target is operator.getitem or _is_alias(node.target)):
            owner[node] = owner.get(node.all_input_nodes[0])
        else:
            owner[node] = None
    return owner


def partition_joint_graph(joint_module: fx.GraphModule, recompute_keys: Sequence[str], graph: PlanGraph,
                          *, num_fwd_outputs: int, static_lifetime_input_indices: Optional[List[int]] = None):
    """Cut ``joint_module`` into forward and backward graphs that save every
    forward value the backward needs except those of the ops named in
    ``recompute_keys`` (and views of them), which the backward recomputes."""
    from torch._functorch import partitioners as P
    is_sym_node = P.is_sym_node

    keys = set(recompute_keys)
    owner = _producer_ops(joint_module, graph)
    recomputed_ops = {op.index for op in graph.ops if op.key in keys}
    forward_names = {op.key for op in graph.ops[: graph.num_forward]}
    forward_names |= {n.name for n in joint_module.graph.nodes if n.op == "placeholder" and P._is_primal(n)}
    # Views and getitems in forward count as forward nodes too.
    for node in joint_module.graph.nodes:
        if owner.get(node) is not None and owner[node] < graph.num_forward:
            forward_names.add(node.name)
    saved_values: List[fx.Node] = []
    saved_sym_nodes: List[fx.Node] = []
    for node in joint_module.graph.nodes:
        if node.name not in forward_names or node.op == "output":
            continue
        if is_sym_node(node):
            saved_sym_nodes.append(node)
            continue
        if node.users and all(u.target is operator.getitem for u in node.users):
            continue  # a multi-output op: its getitems are saved instead
        if owner.get(node) in recomputed_ops:
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        backward_users = [u for u in node.users if u.name not in forward_names]
        if backward_users and all(is_sym_node(u) for u in backward_users):
            saved_sym_nodes.extend(backward_users)
            continue
        saved_values.append(node)
    primal_inputs = [n for n in joint_module.graph.nodes if n.op == "placeholder" and P._is_primal(n)]
    # Note [Partitioner helpers across torch versions]: the helpers below are
    # private to torch's partitioner and came over several releases (checked
    # against the 2.4-2.13 wheels): static_lifetime_input_nodes and
    # raise_getitems in 2.8 (OrderedSet, its type, in 2.7), is_not_collective
    # (the impurity test of dead-code elimination) in 2.10. Where one is
    # missing, the cut is made as that torch's own partitioner made it.
    extract_options = {}
    if "static_lifetime_input_nodes" in inspect.signature(P._extract_fwd_bwd_modules).parameters:
        extract_options["static_lifetime_input_nodes"] = P.OrderedSet(
            p for i, p in enumerate(primal_inputs) if i in (static_lifetime_input_indices or ()))
    fw_module, bw_module = P._extract_fwd_bwd_modules(
        joint_module, saved_values, saved_sym_nodes=list(dict.fromkeys(saved_sym_nodes)),
        num_fwd_outputs=num_fwd_outputs, **extract_options)
    impure = getattr(P, "is_not_collective", None)
    raise_getitems = getattr(P, "raise_getitems", None)
    for module in (fw_module, bw_module):
        if impure is not None:
            module.graph.eliminate_dead_code(is_impure_node=impure)
        else:
            module.graph.eliminate_dead_code()
    bw_module = P.reordering_to_mimic_autograd_engine(bw_module)
    if raise_getitems is not None:
        fw_module = raise_getitems(fw_module)
        bw_module = raise_getitems(bw_module)
    return fw_module, bw_module


def _partitioner_base():
    try:
        from torch._inductor.custom_graph_pass import CustomPartitionerFn

        return CustomPartitionerFn
    except ImportError:  # pragma: no cover - older torch
        return object


class EchoPartitioner(_partitioner_base()):
    """A partition function (AOTAutograd's and inductor's
    ``custom_partitioner_fn``) that plans each joint graph under a budget.
    ``plans`` lists, per graph in compile order, the :class:`Selection` and the
    planning graph it was made on."""

    def __init__(self, budget: Union[int, float, str], device_model: str = "cpu-host", method: str = "auto",
                 margin: float = 0.0):
        self.budget = BudgetSpec(budget)
        self.device_model = device_model
        self.method = method
        self.margin = float(margin)
        self.plans: List[Dict[str, Any]] = []
        self.carried = 0

    def __call__(self, gm: fx.GraphModule, joint_inputs: Sequence[Any], **kwargs: Any):
        num_fwd_outputs = kwargs["num_fwd_outputs"]
        static = kwargs.get("static_lifetime_input_indices")
        model = self.model_of(gm, num_fwd_outputs)
        graph, reserve = model.graph, model.reserve_bytes
        budget = int(self.budget.resolve(model, self.carried) * (1.0 - self.margin))
        selection = select(model, budget, self.method)
        keys = [graph.ops[o].key for o in selection.recompute]
        fw, bw = partition_joint_graph(gm, keys, graph, num_fwd_outputs=num_fwd_outputs,
                                       static_lifetime_input_indices=static)
        if not selection.feasible:
            warnings.warn(
                f"membudget planner: graph {len(self.plans)} cannot meet its budget of {budget} bytes "
                f"({self.carried} bytes carried from earlier graphs); planned its lowest reachable peak, "
                f"{selection.predicted_peak} bytes", RuntimeWarning, stacklevel=2)
        stash = model.stashed_bytes(selection.recompute)
        self.plans.append({"selection": selection, "graph": graph, "carried": self.carried, "stash_bytes": stash,
                           "reserve_bytes": reserve})
        if self.budget.bytes is not None:
            self.carried += model.carried_bytes(selection.recompute)
        return fw, bw

    def model_of(self, gm: fx.GraphModule, num_fwd_outputs: int) -> MemoryModel:
        """The memory model of the joint graph ``gm``, with room reserved for
        later graphs where the budget is in bytes."""
        graph = from_joint_graph(gm, num_fwd_outputs, costs.device_model(self.device_model))
        reserve = 0
        if self.budget.bytes is not None:
            reserve = MemoryModel(graph).later_graphs_bytes()
        return MemoryModel(graph, reserve_bytes=reserve)

    def __deepcopy__(self, memo: Dict[int, Any]) -> "EchoPartitioner":
        # Inductor deep-copies its config (a repro after a failed compile,
        # config snapshots): the partitioner is one object that keeps its
        # record of plans, whose planning graphs hold fake tensors, which
        # cannot be copied.
        return self

    def uuid(self) -> Any:
        """Cache key for inductor's FX graph cache: the planner's source and settings."""
        digest = hashlib.sha256()
        for path in sorted(Path(__file__).parent.glob("*.py")):
            digest.update(path.read_bytes())
        digest.update(repr((self.budget.spec, self.device_model, self.method, self.margin, self.carried)).encode())
        return digest.hexdigest()


def compile_backend(budget: Union[int, float, str], *, compiler: str = "inductor", device_model: str = "cpu-host",
                    method: str = "auto", margin: float = 0.0) -> Callable:
    """A ``torch.compile`` backend that trains under ``budget`` by recomputing
    instead of stashing what the Echo planner picks::

        model = torch.compile(model, backend=membudget.compile_backend(budget="40%"))

    ``budget``: bytes (``int`` or ``"64MiB"``) for the step's modelled peak
    including the graph's inputs and parameters (shared across graph breaks,
    see Note [Budget shares across graph breaks]), or a percentage of each
    graph's activation memory. ``compiler``: ``"inductor"`` (generated kernels)
    or ``"aot_eager"`` (the partitioned graphs run op by op: fast to compile,
    and memory follows the plan exactly). ``device_model`` names the cost
    model's device (:func:`membudget.costs.device_model`), ``method`` the solver
    (``auto``, ``greedy``, ``milp``), ``margin`` a fraction of the budget kept
    free for what the model does not see (allocator rounding, fusion buffers).
    The returned backend has a ``partitioner`` attribute whose ``plans`` list
    what was decided for each graph."""
    if compiler not in ("inductor", "aot_eager"):
        raise ValueError(f"compile_backend(compiler={compiler!r}): expected 'inductor' or 'aot_eager'")
    if compiler == "inductor":
        from torch._inductor import config as inductor_config

        if not hasattr(inductor_config, "custom_partitioner_fn"):
            raise RuntimeError(
                f"compile_backend(compiler='inductor') needs torch >= 2.9, whose inductor takes a custom "
                f"partitioner (this is torch {torch.__version__}); use compiler='aot_eager', or upgrade torch")
    partitioner = EchoPartitioner(budget, device_model=device_model, method=method, margin=margin)

    if compiler == "inductor":
        def backend(gm: fx.GraphModule, example_inputs: Sequence[Any]):
            from torch._inductor.compile_fx import compile_fx

            return compile_fx(gm, example_inputs, config_patches={"custom_partitioner_fn": partitioner})
    else:
        from torch._dynamo.backends.common import aot_autograd
        from torch._dynamo.backends.debugging import boxed_nop

        # boxed_nop frees each input (saved activations) at its last use.
        backend = aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop, partition_fn=partitioner)
    backend.partitioner = partitioner  # type: ignore[attr-defined]
    return backend

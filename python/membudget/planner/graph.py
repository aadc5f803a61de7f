"""The planning graph: one training step as ops over storages, from a joint graph or a trace.

Where this sits in the flow: the Echo planner reads a captured step in one of
two forms, an AOTAutograd joint forward/backward FX graph (what a
``torch.compile`` partitioner receives) or a :class:`membudget.trace.Trace`
(what the runtime's dispatch mode records), and turns either into a
:class:`PlanGraph`. :mod:`.analysis` computes liveness and memory over it and
:mod:`.selection` picks what to recompute; nothing below this module knows
about FX or traces.

The unit of memory is the *storage*: a view or a ``getitem`` of a multi-output
op adds no bytes and extends the life of the storage it aliases. The unit of
recomputation is the *op*: recomputing an op regenerates all its outputs.
Storages without a producer (parameters, inputs, tangents) are resident for
the whole step and count as fixed bytes.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import torch

from .. import costs

__all__ = ["PlanOp", "PlanStorage", "PlanGraph", "from_joint_graph", "from_trace", "is_random_op_name"]


@dataclass
class PlanOp:
    """One op of the step in execution order. ``index`` is its position on the
    timeline (forward ops first); ``forward_index`` its position among forward
    ops (the runtime's dispatch numbering when the graph came from a trace);
    ``cost_s`` the modelled time to run it once more; ``recomputable`` says the
    planner may drop its outputs and run it again in backward."""

    index: int
    name: str
    phase: str
    category: str
    cost_s: float
    inputs: List[int] = field(default_factory=list)
    outputs: List[int] = field(default_factory=list)
    recomputable: bool = False
    forward_index: Optional[int] = None
    workspace: int = 0  # transient bytes the op allocates internally while it runs
    layer: str = ""
    key: Any = None  # FX node name or trace op index


@dataclass
class PlanStorage:
    """One allocation: ``bytes``, its ``producer`` op (``None``: resident for the
    whole step), the ops that read it (directly or through a view), and
    ``output_index``: which output of the producer it is."""

    id: int
    bytes: int
    producer: Optional[int]
    uses: List[int] = field(default_factory=list)
    kind: str = "activation"
    name: str = ""
    output_index: int = 0
    live_to_end: bool = False
    alive_until: Optional[int] = None  # op index it must outlive (forward outputs: the last forward op)


@dataclass
class PlanGraph:
    """Ops (``ops[:num_forward]`` are the forward pass) over storages."""

    ops: List[PlanOp]
    storages: List[PlanStorage]
    num_forward: int
    source: str = ""

    @property
    def fixed_bytes(self) -> int:
        """Bytes resident the whole step: storages nobody in the graph produces."""
        return sum(s.bytes for s in self.storages if s.producer is None)

    def saved_storages(self) -> List[PlanStorage]:
        """Storages produced in forward and read in backward (what autograd stashes)."""
        return [s for s in self.storages if s.producer is not None and s.producer < self.num_forward
                and any(u >= self.num_forward for u in s.uses)]

    def candidates(self) -> List[PlanOp]:
        """Forward ops whose recomputation could free a stashed storage."""
        saved = {s.id for s in self.saved_storages()}
        return [op for op in self.ops[: self.num_forward]
                if op.recomputable and any(o in saved for o in op.outputs)]


_RANDOM_NAME_PARTS = ("dropout", "rand", "bernoulli", "normal", "uniform", "multinomial", "seed")


def is_random_op_name(name: str) -> bool:
    """Whether an op name (``aten.native_dropout.default``) draws random numbers."""
    return any(part in _base_name(name) for part in _RANDOM_NAME_PARTS)


def _base_name(name: str) -> str:
    parts = name.split(".")
    return parts[1] if parts[0] in ("aten", "prims") and len(parts) > 1 else parts[0]


def _is_random_target(target: Any) -> bool:
    tags = getattr(target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags or is_random_op_name(str(target))


#: Ops whose schema says "new tensor" but whose output shares its input's
#: storage (``_unsafe_view``: reshape of a fresh temporary, as after ``mm``).
_STORAGE_SHARING = ("_unsafe_view",)


def _is_alias(target: Any) -> bool:
    """Whether an op returns views of an input (``view``, ``split``, ``unbind``...)
    or otherwise adds no storage (``_unsafe_view``)."""
    if getattr(target, "is_view", False):
        return True
    if _base_name(str(target)) in _STORAGE_SHARING:
        return True
    schema = getattr(target, "_schema", None)
    return bool(schema is not None and schema.returns
                and all(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns))


def _is_mutating(target: Any) -> bool:
    schema = getattr(target, "_schema", None)
    return bool(schema is not None and schema.is_mutable)


def _val_bytes(val: Any) -> int:
    if isinstance(val, torch.Tensor):
        return int(val.numel()) * val.element_size()
    return 0


def _layer_of(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    if stack:
        path = list(stack.values())[-1][0]
        return str(path).replace("L['self'].", "").replace("L['self']", "model")
    return ""


def _forward_category(name: str, category: str) -> str:
    """The category of the forward op a backward op belongs to
    (``convolution_backward`` -> ``conv``), else ``category``."""
    base = _base_name(name)
    if "batch_norm" in base:
        return "batch_norm"
    if base.endswith("_backward") or "_backward_" in base:
        return costs.op_category(base.split("_backward")[0])
    return category


def workspace_bytes(category: str, bytes_read: int, bytes_written: int, name: str = "") -> int:
    """Transient memory an op allocates inside its kernel, which no graph
    shows: oneDNN convolutions reorder their operands into blocked layouts
    (a copy of what they read and write), fused attention and batch-norm
    backward keep buffers of about their output's size. A coarse model from
    this project's CPU measurements (docs/planner.md); zero for other ops.
    ``name`` (the op's) refines it: (log-)softmax and its backward, and
    PyTorch's CPU flash attention (``*_for_cpu``), allocate nothing beyond
    their outputs (measured per node on GPT-2's compiled graphs)."""
    base = _base_name(name) if name else ""
    if category == "conv":
        return bytes_read + bytes_written
    if category == "attention" and ("softmax" in base or base.endswith("_for_cpu")
                                    or "_for_cpu_backward" in base):
        return 0
    if category in ("attention", "batch_norm"):
        return bytes_written
    return 0


def _roofline(target: Any, args: Any, kwargs: Any, out: Any, device: costs.DeviceModel) -> tuple:
    category = costs.op_category(target)
    try:
        flops = costs.op_flops(target, args, kwargs, out)
    except Exception:  # noqa: BLE001
        flops = sum(t.numel() for t in costs.tensors_in(out))
    read, written = costs.op_bytes(args, kwargs, out)
    dtype = next((t.dtype for t in costs.tensors_in(out)), None)
    return category, costs.roofline_seconds(flops, read + written, device, dtype, category), \
        workspace_bytes(_forward_category(str(target), category), read, written, str(target))


def _forward_nodes(gm: torch.fx.GraphModule, num_fwd_outputs: int) -> set:
    """Nodes the forward outputs depend on (AOTAutograd's required forward set),
    or, when the graph carries partitioner tags, those tagged forward."""
    tagged = {n for n in gm.graph.nodes if n.meta.get("partitioner_tag") == "is_forward"}
    if tagged:
        return tagged
    output = next(n for n in gm.graph.nodes if n.op == "output")
    outs = list(torch.fx.node.map_arg(output.args[0], lambda n: n)) if isinstance(output.args[0], (list, tuple)) \
        else [output.args[0]]
    stack = [n for n in outs[:num_fwd_outputs] if isinstance(n, torch.fx.Node)]
    seen: set = set()
    while stack:
        node = stack.pop()
        if node in seen or (node.op == "placeholder" and "tangent" in node.name):
            continue
        seen.add(node)
        stack.extend(node.all_input_nodes)
    return seen


def from_joint_graph(gm: torch.fx.GraphModule, num_fwd_outputs: int,
                     device: Optional[costs.DeviceModel] = None) -> PlanGraph:
    """Build the planning graph of an AOTAutograd joint graph (as a partition
    function receives it). Each op's ``key`` is its FX node name."""
    device = device or costs.device_model("cpu-host")
    forward = _forward_nodes(gm, num_fwd_outputs)
    nodes = [n for n in gm.graph.nodes if n.op in ("placeholder", "call_function", "get_attr")]
    fwd_ops = [n for n in nodes if n.op == "call_function" and n in forward]
    bwd_ops = [n for n in nodes if n.op == "call_function" and n not in forward]
    storages: List[PlanStorage] = []
    root: Dict[torch.fx.Node, Optional[int]] = {}  # node -> storage id (None: not a tensor)
    op_of: Dict[torch.fx.Node, int] = {}
    ops: List[PlanOp] = []

    def new_storage(node, producer, nbytes, output_index=0, kind="activation"):
        storage = PlanStorage(len(storages), nbytes, producer, kind=kind, name=node.name, output_index=output_index)
        storages.append(storage)
        return storage.id

    tangents = []
    for node in nodes:
        if node.op in ("placeholder", "get_attr"):
            kind = "parameter" if "primals" in node.name else "input"
            root[node] = new_storage(node, None, _val_bytes(node.meta.get("val")), kind=kind)
            if "tangent" in node.name:
                tangents.append(root[node])
    for phase, group in (("forward", fwd_ops), ("backward", bwd_ops)):
        for node in group:
            target = node.target
            val = node.meta.get("val")
            if target is operator.getitem:
                parent = node.args[0]
                if parent in op_of and isinstance(val, torch.Tensor) and root.get(parent) is None:
                    sid = new_storage(node, op_of[parent], _val_bytes(val), output_index=int(node.args[1]))
                    ops[op_of[parent]].outputs.append(sid)
                    root[node] = sid
                else:
                    root[node] = root.get(parent)
                continue
            inputs = sorted({root[a] for a in node.all_input_nodes if root.get(a) is not None})
            if _is_alias(target) and node.all_input_nodes:
                # Reads through a view count as reads of its base.
                root[node] = root.get(node.all_input_nodes[0])
                continue
            args = torch.fx.node.map_arg(node.args, lambda n: n.meta.get("val"))
            kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: n.meta.get("val"))
            category, cost, workspace = _roofline(target, args, kwargs, val, device)
            index = len(ops)
            op = PlanOp(index=index, name=str(target), phase=phase, category=category, cost_s=cost,
                        workspace=workspace,
                        inputs=inputs, layer=_layer_of(node), key=node.name,
                        forward_index=index if phase == "forward" else None)
            op.recomputable = (phase == "forward" and not _is_random_target(target)
                               and not _is_mutating(target) and category != "view")
            ops.append(op)
            op_of[node] = index
            if isinstance(val, torch.Tensor):
                root[node] = new_storage(node, index, _val_bytes(val))
                op.outputs.append(root[node])
            else:
                root[node] = None
    for node, index in op_of.items():
        for a in node.all_input_nodes:
            sid = root.get(a)
            if sid is not None and index not in storages[sid].uses:
                storages[sid].uses.append(index)
    num_forward = sum(1 for op in ops if op.phase == "forward")
    # Gradients of the outputs arrive when backward starts, not before. The
    # compiled backward takes them boxed (its argument list is cleared) and
    # frees each at its last use: measured on GPT-2's first graph, whose
    # 1 MiB logits gradient is gone after the lm_head matmuls
    # (docs/planner.md, "How accurate is it").
    for sid in tangents:
        if num_forward < len(ops):
            storages[sid].producer = num_forward
    output = next(n for n in gm.graph.nodes if n.op == "output")
    flat_outputs = list(output.args[0]) if isinstance(output.args[0], (list, tuple)) else [output.args[0]]
    for position, a in enumerate(flat_outputs):
        sid = root.get(a) if isinstance(a, torch.fx.Node) else None
        if sid is not None:
            if position < num_fwd_outputs:
                # Returned to the caller, who holds it at least to the end of forward.
                storages[sid].alive_until = max(num_forward - 1, 0)
            else:
                storages[sid].live_to_end = True
            # An op whose output leaves the graph cannot be dropped.
            producer = storages[sid].producer
            if producer is not None:
                ops[producer].recomputable = False
    for s in storages:
        s.uses.sort()
    return PlanGraph(ops=ops, storages=storages, num_forward=num_forward, source="joint-graph")


def from_trace(trace: Any, device: Optional[costs.DeviceModel] = None) -> PlanGraph:
    """Build the planning graph of a :class:`membudget.trace.Trace` (or anything
    with its data model: ``ops`` with index, name, phase, category, flops,
    bytes_read, bytes_written, duration_s, inputs, outputs; ``tensors`` with id,
    bytes, producer, consumers, saved, kind). Optimizer ops are left out. An op's
    ``forward_index`` is its position among the trace's forward ops, the
    numbering the runtime's dispatch mode uses; its ``key`` the trace op index."""
    device = device or costs.device_model("cpu-host")
    trace_ops = [op for op in trace.ops if op.phase in ("forward", "backward")]
    trace_ops.sort(key=lambda op: (op.phase != "forward", op.index))
    tensors = {t.id: t for t in (trace.tensors.values() if isinstance(trace.tensors, dict) else trace.tensors)}
    position = {op.index: i for i, op in enumerate(trace_ops)}
    num_forward = sum(1 for op in trace_ops if op.phase == "forward")
    storages: List[PlanStorage] = []
    sid_of: Dict[int, int] = {}

    def storage_of(tid: int) -> int:
        if tid in sid_of:
            return sid_of[tid]
        t = tensors[tid]
        producer = position.get(t.producer) if t.producer is not None else None
        producer_op = trace_ops[producer] if producer is not None else None
        if producer_op is not None and producer_op.category == "view" and producer_op.inputs:
            base = [i for i in producer_op.inputs if i in tensors]
            if base:
                sid_of[tid] = storage_of(base[0])
                return sid_of[tid]
        if producer is not None and t.kind in ("parameter", "input"):
            producer = None
        out_index = producer_op.outputs.index(tid) if producer_op is not None and tid in producer_op.outputs else 0
        storages.append(PlanStorage(len(storages), int(t.bytes), producer, kind=t.kind, name=f"t{tid}",
                                    output_index=out_index, live_to_end=t.kind == "gradient"))
        sid_of[tid] = storages[-1].id
        return sid_of[tid]

    ops: List[PlanOp] = []
    for i, top in enumerate(trace_ops):
        category = top.category or costs.op_category(top.name)
        if top.duration_s is not None:
            cost = float(top.duration_s)
        else:
            cost = costs.roofline_seconds(int(top.flops), int(top.bytes_read) + int(top.bytes_written), device,
                                          None, category)
        op = PlanOp(index=i, name=top.name, phase=top.phase, category=category, cost_s=cost,
                    forward_index=i if top.phase == "forward" else None, key=top.index,
                    layer=str(getattr(top, "module", "") or (
                        f"block {top.block}" if getattr(top, "block", None) is not None else "")),
                    workspace=workspace_bytes(_forward_category(top.name, category), int(top.bytes_read),
                                              int(top.bytes_written), top.name))
        op.inputs = sorted({storage_of(t) for t in top.inputs if t in tensors})
        if category != "view":
            op.outputs = [storage_of(t) for t in top.outputs if t in tensors
                          and storage_of(t) not in op.inputs]
        else:
            for t in top.outputs:
                if t in tensors:
                    storage_of(t)
        op.recomputable = (top.phase == "forward" and category != "view" and not is_random_op_name(top.name)
                           and not _base_name(top.name).endswith("_"))
        ops.append(op)
    for op in ops:
        for sid in op.inputs:
            if op.index not in storages[sid].uses:
                storages[sid].uses.append(op.index)
    # An in-place op writes into an earlier op's output: re-running that op
    # would not reproduce the value, so it may not be recomputed.
    for top in trace_ops:
        if _base_name(top.name).endswith("_"):
            for tid in top.outputs:
                if tid in sid_of:
                    producer = storages[sid_of[tid]].producer
                    if producer is not None:
                        ops[producer].recomputable = False
    # When the trace says when a storage was freed, it lived at least that
    # long (a reference the ops do not show); freed after an optimizer op or
    # never: alive to the end of the step.
    for tid, t in tensors.items():
        dies = getattr(t, "dies_after", None)
        if tid not in sid_of or storages[sid_of[tid]].producer is None:
            continue
        s = storages[sid_of[tid]]
        if dies is not None:
            if dies in position:
                s.alive_until = max(s.alive_until or 0, position[dies])
            else:
                s.live_to_end = True
    # A tensor marked saved must reach backward even if the trace lists no
    # backward consumer (it is unpacked by an autograd node): keep it to the
    # first backward op at least.
    for tid, t in tensors.items():
        if getattr(t, "saved", False) and tid in sid_of:
            s = storages[sid_of[tid]]
            if s.producer is not None and not any(u >= num_forward for u in s.uses) and num_forward < len(ops):
                s.uses.append(num_forward)
    for s in storages:
        s.uses.sort()
    return PlanGraph(ops=ops, storages=storages, num_forward=num_forward, source="trace")


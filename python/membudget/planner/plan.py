"""``membudget.plan(model_or_trace, budget) -> Plan``: a static recompute plan and its report.

Where this sits in the flow: the plan is the Echo planner's result as data. The
runtime asks it at pack time whether to drop a saved tensor right away
(:meth:`Plan.drops`: planned tensors are dropped and recomputed on use,
anything the plan did not foresee is left to the dynamic policy); notebooks
show it (``_repr_html_``); it round-trips through JSON.

A plan made from a :class:`membudget.trace.Trace` numbers forward ops as the
runtime's dispatch mode does (position among the forward pass's aten ops). A
plan made from a model without a trace plans the AOTAutograd joint graph,
whose forward ops are the same aten ops after decomposition; its numbering can
differ from the runtime's, so :meth:`Plan.drops` then matches by op name and
occurrence.
"""
from __future__ import annotations

import html
import json
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from .. import costs
from .analysis import MemoryModel
from .graph import PlanGraph, from_trace
from .selection import Selection, select

__all__ = ["Plan", "PlannedOp", "plan", "plan_from_graph"]


def _fmt(nbytes: Optional[float]) -> str:
    if nbytes is None:
        return "-"
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return str(nbytes)


@dataclass
class PlannedOp:
    """One forward op the plan recomputes instead of stashing its outputs.
    ``forward_index`` is its position in the forward pass, ``occurrence`` its
    rank among forward ops of the same name, ``outputs`` the output indices
    that autograd saves (and the runtime should drop)."""

    forward_index: int
    op_name: str
    occurrence: int
    outputs: List[int]
    bytes: int
    cost_s: float
    layer: str = ""
    category: str = ""


@dataclass
class Plan:
    """What to recompute to meet ``budget``, with predicted peak and overhead.

    ``entries`` are the recomputed forward ops; ``graphs`` is more than one
    when a model compiled into several graphs (one plan, several segments);
    ``step_s`` is the modelled time of the whole step without recomputation,
    so ``overhead_s / step_s`` is the modelled slowdown. ``numbering`` is
    ``"dispatch"`` (from a trace: :meth:`drops` matches by index) or
    ``"joint-graph"`` (matches by name and occurrence)."""

    budget: int
    predicted_peak: int
    baseline_peak: int
    overhead_s: float
    step_s: float
    feasible: bool
    method: str
    entries: List[PlannedOp] = field(default_factory=list)
    min_reachable_peak: Optional[int] = None
    numbering: str = "dispatch"
    device_model: str = "cpu-host"
    graphs: int = 1
    notes: List[str] = field(default_factory=list)
    forward_names: List[str] = field(default_factory=list)

    # -- the runtime's question -----------------------------------------
    def __post_init__(self) -> None:
        self._reindex()

    def _reindex(self) -> None:
        self._by_index = {e.forward_index: e for e in self.entries}
        self._by_occurrence = {(e.op_name, e.occurrence): e for e in self.entries}
        self._offset = 0
        self._recent: List[Tuple[int, str]] = []

    # Note [Aligning op numbering]: the runtime numbers ops from the start of
    # each forward as its dispatch mode sees them, and ops the user runs just
    # before the forward (drawing the batch, building the model in the first
    # iteration) shift every index by a constant. The plan keeps the recorded
    # forward's op names and finds the shift that makes the names of the
    # recent calls agree (nearest to the last shift found); it decides only
    # once two calls agree on a shift or the index matches without one.
    _ALIGN_WINDOW = 4096
    _ALIGN_HISTORY = 6

    def _aligned(self, op_index: int, op_name: str) -> Optional[int]:
        names = self.forward_names
        if not names:
            return op_index
        if self._recent and op_index < self._recent[-1][0] // 2:
            self._recent = []  # a new forward (saves arrive slightly out of order within one)
        self._recent = (self._recent + [(op_index, op_name)])[-self._ALIGN_HISTORY:]

        def fits(shift: int) -> bool:
            return all(0 <= i - shift < len(names) and names[i - shift] == n for i, n in self._recent)

        if not fits(self._offset):
            for delta in range(1, self._ALIGN_WINDOW):
                found = next((s for s in (self._offset + delta, self._offset - delta) if fits(s)), None)
                if found is not None:
                    self._offset = found
                    break
            else:
                return None
        if self._offset != 0 and len(self._recent) < 2:
            return None
        return op_index - self._offset

    def drops(self, op_index: int, op_name: str, output_index: int, occurrence: Optional[int] = None) -> bool:
        """Whether the runtime should drop, at pack time, output ``output_index``
        of the forward op at position ``op_index`` (named ``op_name``, e.g.
        ``'aten.addmm.default'``) to recompute it on use. Matches by index and
        checks the name; when they disagree (indices shifted, or a plan made
        from a joint graph) falls back to (name, occurrence among forward ops
        of that name) when ``occurrence`` is given, and finds a constant shift of
        the numbering by itself (Note [Aligning op numbering])."""
        if self.numbering == "dispatch":
            index = self._aligned(op_index, op_name)
            entry = self._by_index.get(index) if index is not None else None
            if entry is not None and entry.op_name == op_name:
                return output_index in entry.outputs
        if occurrence is not None:
            entry = self._by_occurrence.get((op_name, occurrence))
            if entry is not None:
                return output_index in entry.outputs
        return False

    @property
    def recompute_set(self) -> List[Tuple[int, str]]:
        """(forward index, op name) of every recomputed op."""
        return [(e.forward_index, e.op_name) for e in self.entries]

    @property
    def saved_bytes_dropped(self) -> int:
        """Bytes of saved activations the plan recomputes instead of stashing."""
        return sum(e.bytes for e in self.entries)

    # -- persistence -----------------------------------------------------
    def to_json(self) -> str:
        """The plan as JSON (:meth:`from_json` reads it back)."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        """Read a plan written by :meth:`to_json`."""
        data = json.loads(text)
        data["entries"] = [PlannedOp(**e) for e in data.get("entries", [])]
        return cls(**data)

    # -- the report ------------------------------------------------------
    def layer_table(self) -> List[Dict[str, Any]]:
        """One row per layer (module path, or op category without one): ops
        recomputed, stash bytes no longer held, modelled recompute seconds."""
        rows: Dict[str, Dict[str, Any]] = {}
        for e in self.entries:
            row = rows.setdefault(e.layer or f"({e.category})",
                                  {"layer": e.layer or f"({e.category})", "ops": 0, "bytes": 0, "cost_s": 0.0,
                                   "op_names": []})
            row["ops"] += 1
            row["bytes"] += e.bytes
            row["cost_s"] += e.cost_s
            short = e.op_name.replace("aten.", "").replace(".default", "")
            if short not in row["op_names"]:
                row["op_names"].append(short)
        return sorted(rows.values(), key=lambda r: -r["bytes"])

    def _summary(self) -> str:
        slow = self.overhead_s / self.step_s if self.step_s else 0.0
        verdict = "fits" if self.feasible else "does NOT fit"
        text = (f"membudget plan ({self.method}): budget {_fmt(self.budget)} {verdict}; predicted peak "
                f"{_fmt(self.predicted_peak)} (without recomputation {_fmt(self.baseline_peak)}); "
                f"{len(self.entries)} ops recomputed, {_fmt(self.saved_bytes_dropped)} not stashed, "
                f"+{self.overhead_s * 1e3:.2f} ms per step (+{100 * slow:.1f}% modelled on {self.device_model})")
        if not self.feasible and self.min_reachable_peak is not None:
            text += f"; the smallest peak reachable by recomputation is {_fmt(self.min_reachable_peak)}"
        return text

    def __str__(self) -> str:
        lines = [self._summary()]
        table = self.layer_table()
        if table:
            lines.append(f"  {'layer':<40} {'ops':>4} {'not stashed':>12} {'recompute':>10}  ops")
            for r in table:
                lines.append(f"  {r['layer'][:40]:<40} {r['ops']:>4} {_fmt(r['bytes']):>12} "
                             f"{r['cost_s'] * 1e3:>8.3f}ms  {', '.join(r['op_names'][:6])}")
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<Plan {self._summary()}>"

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td>{html.escape(r['layer'])}</td><td>{r['ops']}</td><td>{_fmt(r['bytes'])}</td>"
            f"<td>{r['cost_s'] * 1e3:.3f} ms</td><td>{html.escape(', '.join(r['op_names']))}</td></tr>"
            for r in self.layer_table())
        return (f"<div><p>{html.escape(self._summary())}</p><table><thead><tr><th>layer</th><th>ops</th>"
                f"<th>not stashed</th><th>recompute</th><th>op names</th></tr></thead><tbody>{rows}</tbody>"
                f"</table></div>")


def plan_from_graph(graph: PlanGraph, budget: int, method: str = "auto", device_model: str = "cpu-host",
                    numbering: str = "dispatch") -> Tuple[Plan, Selection]:
    """Plan one :class:`PlanGraph` against ``budget`` bytes."""
    model = MemoryModel(graph)
    selection = select(model, budget, method)
    return _plan_of([(graph, selection)], budget, device_model, numbering), selection


def _plan_of(parts: Sequence[Tuple[PlanGraph, Selection]], budget: int, device_model: str,
             numbering: str) -> Plan:
    entries: List[PlannedOp] = []
    offset = 0
    counts: Dict[str, int] = {}
    peak = base = 0
    overhead = step = 0.0
    feasible = True
    reach: Optional[int] = None
    methods = []
    for graph, selection in parts:
        chosen = set(selection.recompute)
        saved = {s.id for s in graph.saved_storages()}
        for op in graph.ops[: graph.num_forward]:
            occurrence = counts.get(op.name, 0)
            counts[op.name] = occurrence + 1
            if op.index in chosen:
                outs = [graph.storages[s] for s in op.outputs if s in saved]
                entries.append(PlannedOp(forward_index=offset + (op.forward_index or op.index), op_name=op.name,
                                         occurrence=occurrence, outputs=sorted(s.output_index for s in outs),
                                         bytes=sum(s.bytes for s in outs), cost_s=op.cost_s, layer=op.layer,
                                         category=op.category))
        offset += graph.num_forward
        peak = max(peak, selection.predicted_peak)
        base = max(base, selection.baseline_peak)
        overhead += selection.overhead_s
        step += sum(op.cost_s for op in graph.ops)
        feasible = feasible and selection.feasible
        if selection.min_reachable_peak is not None:
            reach = max(reach or 0, selection.min_reachable_peak)
        methods.append(selection.method)
    notes = [n for _, s in parts for n in s.notes]
    forward_names = [op.name for graph, _ in parts for op in graph.ops[: graph.num_forward]]
    return Plan(budget=int(budget), predicted_peak=peak, baseline_peak=base, overhead_s=overhead, step_s=step,
                feasible=feasible, method="+".join(dict.fromkeys(methods)) or "none", entries=entries,
                min_reachable_peak=reach, numbering=numbering, device_model=device_model, graphs=len(parts),
                notes=notes, forward_names=forward_names if numbering == "dispatch" else [])


def _is_trace(obj: Any) -> bool:
    return hasattr(obj, "ops") and hasattr(obj, "tensors") and not callable(getattr(obj, "forward", None))


def _default_loss(out: Any):
    import torch

    if isinstance(out, torch.Tensor):
        return out if out.dim() == 0 else out.float().sum()
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    first = out[0] if isinstance(out, (tuple, list)) else out
    return first.float().sum()


def plan(model_or_trace: Any, budget: Union[int, float, str], *, example_inputs: Sequence[Any] = (),
         loss_fn: Optional[Callable[[Any], Any]] = None, step: Optional[Callable[[], Any]] = None,
         method: str = "auto", device_model: str = "cpu-host", via: str = "auto") -> Plan:
    """Plan what to recompute so that a training step fits ``budget`` (bytes,
    ``"64MiB"``, or ``"40%"`` of the activation memory above parameters and
    inputs), at the least modelled overhead.

    ``model_or_trace``: a :class:`membudget.trace.Trace`, or an ``nn.Module``
    run once on ``example_inputs`` (its output turned into a loss by
    ``loss_fn``, default: the output if scalar, else ``output.loss``, else the
    sum of the first output), or the training step's forward given as ``step``
    (a callable returning the loss, e.g. ``lambda: loss(model, batch)``). ``via``: ``"trace"`` records the step with
    :func:`membudget.trace` (dispatch numbering, what the runtime matches);
    ``"dispatch"`` with the planner's own minimal recorder (same numbering);
    ``"joint-graph"`` plans AOTAutograd's joint graph (report only: its
    numbering is not the runtime's); ``"auto"``: the trace when
    :mod:`membudget.trace` exists, else the recorder. Returns a :class:`Plan` (printable, and shown
    as a table in notebooks)."""
    from .partitioner import BudgetSpec, EchoPartitioner

    device = costs.device_model(device_model)
    spec = BudgetSpec(budget)
    if _is_trace(model_or_trace):
        graph = from_trace(model_or_trace, device)
        model = MemoryModel(graph)
        return plan_from_graph(graph, spec.resolve(model), method, device_model, "dispatch")[0]
    if via not in ("auto", "trace", "dispatch", "joint-graph"):
        raise ValueError(f"membudget.plan(via={via!r}): expected 'auto', 'trace', 'dispatch' or 'joint-graph'")
    loss_of = loss_fn or _default_loss

    forward = step

    def step() -> None:
        (forward() if forward is not None else loss_of(model_or_trace(*example_inputs))).backward()

    if via in ("auto", "trace", "dispatch"):
        record_trace = None
        if via != "dispatch":
            try:
                from ..tracer import trace as record_trace
            except ImportError:
                if via == "trace":
                    raise
        if record_trace is not None:
            recorded = record_trace(step)
        else:
            from .recorder import record_step

            recorded = record_step(step, list(model_or_trace.parameters()), model_or_trace)
        for p in model_or_trace.parameters():
            p.grad = None
        return plan(recorded, budget, method=method, device_model=device_model)
    import torch
    from functorch.compile import aot_function
    from torch._dynamo.backends.debugging import boxed_nop

    module = model_or_trace
    params = dict(module.named_parameters())
    buffers = dict(module.named_buffers())

    def step(params, buffers, *inputs):
        return loss_of(torch.func.functional_call(module, (params, buffers), inputs))

    partitioner = EchoPartitioner(budget, device_model=device_model, method=method)
    compiled = aot_function(step, fw_compiler=boxed_nop, bw_compiler=boxed_nop, partition_fn=partitioner)
    compiled(params, buffers, *example_inputs).backward()
    for p in model_or_trace.parameters():
        p.grad = None
    parts = [(p["graph"], p["selection"]) for p in partitioner.plans]
    budgets = [p["selection"].budget for p in partitioner.plans]
    return _plan_of(parts, budgets[0] if budgets else 0, device_model, "joint-graph")

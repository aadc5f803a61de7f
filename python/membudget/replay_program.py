"""Compiles a trace into the flat replay program the C++ driver runs.

Where this sits in the flow: :func:`membudget.simulate` compiles a
:class:`~membudget.trace.Trace` once per strategy into a :class:`Program` and
hands it to ``_C.sim.replay`` (csrc/sim/replay.h, Note [Replay programs]),
which runs it through the real allocator and residency manager over a
SimBackend. :func:`membudget.optimal` reads the same liveness
(:func:`managed_windows`), so the floor and the simulator agree on what is
alive when.

Strategies: ``manager`` (our policies: pack/release/unpack as the torch
binding does), ``none`` (everything stays resident), ``checkpoint-blocks``
(saved tensors inside each top-level block are dropped after forward and the
block's forward is re-run before its backward, as non-reentrant
``torch.utils.checkpoint``), ``swap-all`` (``save_on_cpu``: synchronous copy
out at pack, synchronous copy in at unpack) and ``offload-prefetch``
(torchtune-style: asynchronous copy out, and at each unpack the next
``window`` tensors in unpack order are brought back ahead of use).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch

from . import costs
from .trace import Trace

__all__ = ["Program", "Code", "STRATEGIES", "op_durations", "host_seconds", "backward_start_seconds",
           "managed_tensors", "release_points", "replay_closures", "replay_costs", "compile_program"]

# Replays deeper than this many unmanaged producers are not offered (as the
# runtime's lineage replay, python/membudget/replay.py, refuses deep ones).
MAX_REPLAY_DEPTH = 200

STRATEGIES = ("manager", "none", "checkpoint-blocks", "swap-all", "offload-prefetch")


class Code:
    """Instruction codes; must match ``ReplayCode`` in csrc/sim/replay.h."""

    COMPUTE, RECOMPUTE, ALLOC, FREE, PACK, RELEASE, UNPACK = 0, 1, 2, 3, 4, 5, 6
    OFFLOAD_SYNC, OFFLOAD_ASYNC, RESTORE, PREFETCH = 7, 8, 9, 10


@dataclass
class Program:
    """Parallel instruction arrays plus tensor sizes; the first
    ``prologue_length`` instructions (what existed before the step) run once."""

    tensor_bytes: List[int]
    codes: List[int] = field(default_factory=list)
    tensors: List[int] = field(default_factory=list)
    seconds: List[float] = field(default_factory=list)
    prologue_length: int = 0
    replay_seconds: List[float] = field(default_factory=list)
    replay_input_offsets: List[int] = field(default_factory=list)
    replay_inputs: List[int] = field(default_factory=list)

    def emit(self, code: int, tensor: int = -1, seconds: float = 0.0) -> None:
        """Append one instruction."""
        self.codes.append(code)
        self.tensors.append(tensor)
        self.seconds.append(seconds)


def op_durations(trace: Trace, device: costs.DeviceModel, measured: Optional[bool] = None) -> List[float]:
    """Seconds per op: the measured duration when ``measured`` (default: the
    trace has measurements and the device is ``cpu-host``, the machine they
    were taken on), else the roofline of the op on ``device``."""
    if measured is None:
        measured = device.name == "cpu-host" and all(op.duration_s is not None for op in trace.ops)
    out = []
    for op in trace.ops:
        if measured and op.duration_s is not None:
            out.append(float(op.duration_s))
            continue
        dtype = getattr(torch, op.dtype, None)
        out.append(costs.roofline_seconds(op.flops, op.bytes_read + op.bytes_written, device,
                                          dtype if isinstance(dtype, torch.dtype) else None, op.category))
    return out


def host_seconds(trace: Trace, device: costs.DeviceModel, measured: Optional[bool] = None) -> List[float]:
    """Host seconds before each op (``TraceOp.host_s``, Note [Host time
    between ops] in :mod:`membudget.tracer`) when the measured durations are
    used (``measured`` as in :func:`op_durations`), else zeros: on a device
    whose ops are modelled, the host launches ahead and its time hides
    behind the device's."""
    if measured is None:
        measured = device.name == "cpu-host" and all(op.duration_s is not None for op in trace.ops)
    return [float(op.host_s) if measured else 0.0 for op in trace.ops]


def backward_start_seconds(trace: Trace, device: costs.DeviceModel, measured: Optional[bool] = None) -> List[float]:
    """:func:`host_seconds` of the ops from forward's last pack through
    backward's first op, zeros elsewhere (Note [Backward's start]).

    Note [Backward's start]: of the host gaps the recorder measures (Note
    [Host time between ops] in :mod:`membudget.tracer`), those after
    forward's last pack are the loss returning, ``backward()`` making the
    seed gradient and the autograd engine starting the graph task: a few
    gaps, sized by the graph, that a plain or a managed run spends as well
    (from the ``backward()`` call to the first unpack: 0.25-0.29 ms on the
    CPU validation's GPT-2 with or without a budget, 0.16 ms on its CNN;
    traced, less the recorder's hooks and dispatch: 0.27 and 0.15 ms), where
    the recorder's inflation of the gaps elsewhere adds up over the step
    (21-30 ms of GPT-2's 335). On the CPU it is time a copy-out issued at
    forward's last pack has before backward's first allocation wants its
    memory: with only the ops' 0.08 ms in between, the simulation of GPT-2
    at 80% of its peak waited 0.91 ms for an 8 MiB one the real run had
    finished. A trace with no pack in forward spends backward's first op's
    gap alone; one with no backward, or no host time (fake tensors), none."""
    host = host_seconds(trace, device, measured)
    start = trace.first_backward_index()
    if start >= len(host):
        return [0.0] * len(host)
    first = max((k for k in trace.pack_ops if k <= start), default=start)
    return [h if first <= i <= start else 0.0 for i, h in enumerate(host)]


def managed_tensors(trace: Trace, min_tensor_bytes: int) -> List[int]:
    """Ids of the tensors a budget may move: saved activations of at least
    ``min_tensor_bytes`` (the runtime's rule; parameters are never managed)."""
    return [t.id for t in trace.saved_activations() if t.bytes >= min_tensor_bytes and t.producer is not None]


def release_points(trace: Trace, tid: int) -> Dict[str, object]:
    """Liveness of a managed tensor: ``pack`` (op index before which it is
    packed), ``forward_release`` (after this op only autograd holds it), and
    ``uses``: per unpack, (op before which it is unpacked, op after which the
    backward node is done with it)."""
    t = trace.tensors[tid]
    packs = [op for op, p in zip(trace.pack_ops, trace.pack_order) if p == tid]
    pack = min(packs) if packs else (t.producer or 0) + 1
    forward_uses = [c for c in t.consumers if trace.ops[c].phase == "forward"]
    forward_release = max([t.producer or 0, *forward_uses, max(packs, default=0) - 1])
    uses = []
    consumers = sorted(c for c in t.consumers if trace.ops[c].phase != "forward")
    for u, p in zip(trace.unpack_ops, trace.unpack_order):
        if p != tid:
            continue
        done = next((c for c in consumers if c >= u and trace.ops[c].category != "view"), u)
        if t.dies_after is not None:
            done = min(done, t.dies_after)
        uses.append((u, max(done, u)))
    return {"pack": pack, "forward_release": forward_release, "uses": uses}


def replay_closures(trace: Trace, managed: Sequence[int]) -> Dict[int, Optional[tuple]]:
    """Per managed tensor, what the runtime's lineage replay would run to
    rebuild it: ``(ops, managed inputs)``, the producer's op index plus,
    recursively, the producers of unmanaged inputs that are no longer alive
    at its first unpack (parameters and live tensors are available; managed
    inputs are the manager's to bring back), or None when it cannot be
    replayed: a storage an in-place op wrote after its producer (as in the
    runtime), a tensor with no producer, or a chain deeper than
    :data:`MAX_REPLAY_DEPTH`. The simulator's replay costs and the floor's
    recompute costs (:func:`membudget.optimal`) both come from here."""
    managed_set = set(managed)
    mutated = set()
    for op in trace.ops:
        base = op.name.split(".")[1] if op.name.count(".") >= 2 else op.name
        if base.endswith("_") and not base.startswith("_") and op.inputs:
            mutated.add(op.inputs[0])
    closures: Dict[int, Optional[tuple]] = {}
    for tid in managed:
        t = trace.tensors[tid]
        if tid in mutated or t.producer is None:
            closures[tid] = None
            continue
        first_use = min((u for u, p in zip(trace.unpack_ops, trace.unpack_order) if p == tid), default=len(trace.ops))
        ops, inputs, seen = [], [], set()
        stack, ok = [(t.producer, 0)], True
        while stack and ok:
            op_index, depth = stack.pop()
            if op_index in seen:
                continue
            seen.add(op_index)
            if depth > MAX_REPLAY_DEPTH:
                ok = False
                break
            ops.append(op_index)
            for u in trace.ops[op_index].inputs:
                src = trace.tensors[u]
                if u == tid or src.producer is None:
                    continue
                if u in managed_set:
                    inputs.append(u)
                elif u in mutated:
                    ok = False
                elif src.dies_after is not None and src.dies_after < first_use:
                    stack.append((src.producer, depth + 1))
        closures[tid] = (ops, sorted(set(inputs))) if ok else None
    return closures


def replay_costs(trace: Trace, durations: Sequence[float], managed: Sequence[int]):
    """Per managed tensor, ``(seconds, managed inputs)`` of its replay: the
    summed durations of its :func:`replay_closures` ops (seconds 0, no
    inputs: not recomputable)."""
    costs: Dict[int, tuple] = {}
    for tid, closure in replay_closures(trace, managed).items():
        if closure is None:
            costs[tid] = (0.0, [])
        else:
            ops, inputs = closure
            costs[tid] = (max(sum(durations[i] for i in ops), 1e-12), inputs)
    return costs


def _first_packs(trace: Trace) -> Dict[int, int]:
    """Each packed tensor's first place in ``Trace.pack_order``."""
    first: Dict[int, int] = {}
    for k, tid in enumerate(trace.pack_order):
        first.setdefault(tid, k)
    return first


def _in_pack_order(managed: Sequence[int], first_pack: Dict[int, int]) -> List[int]:
    """``managed`` in the order autograd packed them (``first_pack``,
    :func:`_first_packs`), then the never-packed ones in their given order.

    Note [Pack order]: the instructions before one op run in the order they
    were added, so the managed tensors' order is the order of their packs
    when one op saves several. The runtime packs them in autograd's order
    (``Trace.pack_order``), which is not the order the tensors were made in
    (GPT-2's attention saves its dropout's 8 MiB output before the 1 MiB
    clone made ahead of it); packed by id, the simulated manager numbered
    them (``seq``) differently from the real one, so its predicted next use
    of each, its background copy-outs and its victims differed: at GPT-2 80%
    of the CPU validation one 8 MiB copy-out per step the real run had
    finished in the background was synchronous in the simulation."""
    return sorted(managed, key=lambda tid: first_pack.get(tid, float("inf")))  # stable: ties keep their order


def _checkpoint_plan(trace: Trace, managed: Sequence[int]):
    """For checkpoint-blocks: the dropped tensors (saved, produced inside a
    block and not used outside it) and, per block, the op before which its
    forward is recomputed (its first unpack)."""
    dropped = set()
    for tid in managed:
        t = trace.tensors[tid]
        block = trace.ops[t.producer].block
        if block is None:
            continue
        outside = any(trace.ops[c].phase == "forward" and trace.ops[c].block != block for c in t.consumers)
        if not outside:
            dropped.add(tid)
    recompute_at: Dict[int, int] = {}
    for u, tid in zip(trace.unpack_ops, trace.unpack_order):
        if tid in dropped:
            block = trace.ops[trace.tensors[tid].producer].block
            recompute_at[block] = min(recompute_at.get(block, u), u)
    return dropped, recompute_at


def compile_program(trace: Trace, durations: Sequence[float], strategy: str, min_tensor_bytes: int,
                    window: int = 2, recompute: bool = True, host: Optional[Sequence[float]] = None) -> Program:
    """The replay program of ``trace`` under ``strategy`` (one of
    :data:`STRATEGIES`, module doc). ``window``: tensors prefetched ahead by
    ``offload-prefetch``; ``recompute``: declare managed tensors recomputable
    to the manager (:func:`replay_costs`); ``host``: host seconds before each
    op (:func:`host_seconds`; default none)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}: known are {', '.join(STRATEGIES)}")
    n = len(trace.ops)
    prog = Program(tensor_bytes=[t.bytes for t in trace.tensors])
    # Note [Op workspace] (membudget.tracer): an op's scratch memory is a
    # tensor of its own, allocated just before the op and freed just after.
    scratch: Dict[int, int] = {}
    for op in trace.ops:
        if op.workspace_bytes > 0:
            scratch[op.index] = len(prog.tensor_bytes)
            prog.tensor_bytes.append(int(op.workspace_bytes))
    for t in trace.tensors:
        if t.producer is None:
            prog.emit(Code.ALLOC, t.id)
    prog.prologue_length = len(prog.codes)

    first_pack = _first_packs(trace)
    managed = _in_pack_order(managed_tensors(trace, min_tensor_bytes), first_pack) if strategy != "none" else []
    points = {tid: release_points(trace, tid) for tid in managed}
    before: List[List[tuple]] = [[] for _ in range(n + 1)]   # instructions before op i
    after: List[List[tuple]] = [[] for _ in range(n)]        # instructions after op i
    dropped, recompute_at = set(), {}
    if strategy == "checkpoint-blocks":
        dropped, recompute_at = _checkpoint_plan(trace, managed)

    if strategy == "manager" and recompute:
        table = replay_costs(trace, durations, managed)
        prog.replay_input_offsets.append(0)
        for t in trace.tensors:
            seconds, inputs = table.get(t.id, (0.0, []))
            prog.replay_seconds.append(seconds)
            prog.replay_inputs.extend(inputs)
            prog.replay_input_offsets.append(len(prog.replay_inputs))
        for _ in scratch:  # never saved, never replayed
            prog.replay_seconds.append(0.0)
            prog.replay_input_offsets.append(len(prog.replay_inputs))
    pack_code = {"manager": Code.PACK, "swap-all": Code.OFFLOAD_SYNC, "offload-prefetch": Code.OFFLOAD_ASYNC}
    unpack_code = Code.UNPACK if strategy == "manager" else Code.RESTORE
    unpack_sequence = [tid for tid in trace.unpack_order if tid in points]
    position = 0
    # What autograd does as op i-1 returns, before op i: packs, in autograd's
    # order (Note [Pack order]), and the step letting go of saved tensors
    # between them (Note [Released by the step] in membudget.tracer), each
    # keyed by its place among the packs.
    returning: List[List[tuple]] = [[] for _ in range(n + 1)]
    for tid, p in points.items():
        if strategy not in pack_code:
            continue
        at = min(p["pack"], n)
        key = first_pack.get(tid, len(trace.pack_order))
        returning[at].append((key, pack_code[strategy], tid))
        t = trace.tensors[tid]
        if t.released_before is not None and t.released_before < 0:
            continue  # held through forward: referenced until backward uses it
        if t.released_before is not None and t.released_after_packs is not None:
            slot = min(max(t.released_before, at), n)
            release_key = t.released_after_packs - 0.5 if slot > at else max(t.released_after_packs - 0.5, key + 0.5)
            returning[slot].append((release_key, Code.RELEASE, tid))
        elif p["forward_release"] < p["pack"]:
            # Note [Released when packed]: saved by its producer's
            # backward node and used by no later forward op (an LSTM
            # layer's workspace, max-pool indices): only autograd holds it
            # from its pack on. Emitted after op `forward_release`, the
            # release came before the pack, found no entry, and the entry
            # the pack made stayed referenced through forward: 60 of the
            # CPU LSTM's 80 MiB of saved tensors could not be evicted
            # (infeasible at 80% of its peak in the simulator, feasible at
            # 70% in real runs), and ResNet-50's 98 MiB of indices.
            returning[at].append((key + 0.5, Code.RELEASE, tid))
        else:
            after[p["forward_release"]].append((Code.RELEASE, tid))
    if strategy in ("manager", "swap-all", "offload-prefetch"):
        for u, tid in zip(trace.unpack_ops, trace.unpack_order):
            if tid not in points:
                continue
            before[u].append((unpack_code, tid))
            if strategy == "offload-prefetch":
                ahead = unpack_sequence[position + 1: position + 1 + window]
                before[u].extend((Code.PREFETCH, a) for a in ahead)
            position += 1
            done = next(d for uu, d in points[tid]["uses"] if uu == u)
            after[done].append((Code.RELEASE, tid))

    dying: List[List[int]] = [[] for _ in range(n)]
    for t in trace.tensors:
        if t.producer is not None and t.dies_after is not None:
            dying[t.dies_after].append(t.id)
    for i in range(n):
        for block, at in recompute_at.items():
            if at == i:
                _emit_block_recompute(trace, prog, durations, block, dropped, at, scratch)
        # Note [Host time between ops] (membudget.tracer): autograd packs
        # what an op saved as soon as the op returns, and backward unpacks
        # just before the op that reads it, so the host time before op i
        # runs after its packs and before its unpacks.
        for _, code, tid in sorted(returning[i]):
            prog.emit(code, tid)
        if host is not None and host[i] > 0.0:
            prog.emit(Code.COMPUTE, -1, float(host[i]))
        for code, tid in before[i]:
            prog.emit(code, tid)
        for tid in trace.ops[i].outputs:
            prog.emit(Code.ALLOC, tid)
        _emit_with_scratch(prog, Code.COMPUTE, durations[i], scratch.get(i))
        for code, tid in after[i]:
            prog.emit(code, tid)
        for tid in trace.ops[i].outputs:
            t = trace.tensors[tid]
            if tid in dropped and trace.ops[i].phase == "forward":
                # checkpoint-blocks: freed after its last forward use, rebuilt before backward.
                last = max([i, *(c for c in t.consumers if trace.ops[c].phase == "forward")])
                if last > i:
                    after[last].append((Code.FREE, tid))
                else:
                    prog.emit(Code.FREE, tid)
        for t_id in dying[i]:
            if t_id not in dropped or trace.ops[i].phase != "forward":
                prog.emit(Code.FREE, t_id)
    # A tensor the last op makes and autograd saves with no pack recorded
    # (a step that ends in forward) is packed after that op.
    for _, code, tid in sorted(returning[n]):
        prog.emit(code, tid)
    for code, tid in before[n]:
        prog.emit(code, tid)
    for t in trace.tensors:  # what the step keeps (gradients) is rebuilt next step
        if t.producer is not None and t.dies_after is None:
            prog.emit(Code.FREE, t.id)
    return prog


def _emit_with_scratch(prog: Program, code: int, seconds: float, scratch_id: Optional[int]) -> None:
    """One op's COMPUTE (or RECOMPUTE), inside its workspace's lifetime."""
    if scratch_id is not None:
        prog.emit(Code.ALLOC, scratch_id)
    prog.emit(code, -1, seconds)
    if scratch_id is not None:
        prog.emit(Code.FREE, scratch_id)


def _emit_block_recompute(trace: Trace, prog: Program, durations: Sequence[float], block: int,
                          dropped: set, at: int, scratch: Dict[int, int]) -> None:
    """Re-run block ``block``'s forward ops before op ``at``: allocate the
    dropped saved tensors again (they then die where they originally died)
    and the temporaries that had died by ``at`` (freed after their last use
    in the block); what is still alive is not allocated twice."""
    ops = [op for op in trace.ops if op.phase == "forward" and op.block == block]
    members = {op.index for op in ops}
    temporaries: Dict[int, int] = {}  # tensor id -> op after which it is freed
    for op in ops:
        for tid in op.outputs:
            t = trace.tensors[tid]
            if tid not in dropped and t.dies_after is not None and t.dies_after < at:
                temporaries[tid] = max([op.index, *(c for c in t.consumers if c in members)])
    frees: Dict[int, List[int]] = {}
    for tid, last in temporaries.items():
        frees.setdefault(last, []).append(tid)
    for op in ops:
        for tid in op.outputs:
            if tid in dropped or tid in temporaries:
                prog.emit(Code.ALLOC, tid)
        _emit_with_scratch(prog, Code.RECOMPUTE, durations[op.index], scratch.get(op.index))
        for tid in frees.get(op.index, []):
            prog.emit(Code.FREE, tid)

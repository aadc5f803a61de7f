"""One training step as data: ops, tensors (storages), the backward unpack order.

Where this sits in the flow: :func:`membudget.trace` (:mod:`membudget.tracer`)
records a :class:`Trace` from a real or fake training step; the simulator
(:mod:`membudget.simulate`) replays it through the real C++ allocator and
residency manager over a modelled device; :func:`membudget.optimal` solves the
recompute/swap problem on it exactly; the Echo planner reads it.

A :class:`TraceTensor` is one *storage* (the unit memory is allocated in): views
share their base's storage, so an op that only makes a view has no new tensor in
its outputs. Ids are indices into :attr:`Trace.tensors`. The on-disk format
(``Trace.save``/``Trace.load``) is gzip-compressed columnar JSON, versioned and
documented in ``docs/trace_format.md``.
"""
from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

__all__ = ["TraceTensor", "TraceOp", "Trace", "FORMAT_NAME", "FORMAT_VERSION", "TENSOR_KINDS", "PHASES"]

FORMAT_NAME = "membudget-trace"
FORMAT_VERSION = 1
TENSOR_KINDS = ("activation", "parameter", "input", "gradient", "other")
PHASES = ("forward", "backward", "optimizer")


@dataclass
class TraceTensor:
    """One storage. ``producer`` is the op index that created it (``None``:
    it existed before the step, e.g. a parameter or the batch), ``consumers``
    the op indices that read it, ``saved`` whether autograd saved it for
    backward, ``dies_after`` the index of the op after which it was freed
    (``None``: alive at the end of the step). For a saved tensor,
    ``released_before``/``released_after_packs``: where in forward the step
    stopped holding it, leaving it to autograd (before that op, after that
    many packs; ``-1``: held through forward; ``None``: not recorded), Note
    [Released by the step] in :mod:`membudget.tracer`."""

    id: int
    bytes: int
    shape: tuple
    dtype: str
    producer: Optional[int] = None
    consumers: List[int] = field(default_factory=list)
    saved: bool = False
    dies_after: Optional[int] = None
    kind: str = "other"
    released_before: Optional[int] = None
    released_after_packs: Optional[int] = None


@dataclass
class TraceOp:
    """One aten op call. ``duration_s`` is measured when the trace ran on real
    tensors, else ``None`` (the simulator then uses the device model's
    roofline). ``block`` is the index of the top-level repeated block (a
    transformer layer, a residual block) a forward op ran in, or ``None``.
    ``workspace_bytes``: memory the op allocated and freed inside itself
    (a convolution's scratch buffers), measured when the trace ran on real
    tensors with an allocator that counts (Note [Op workspace] in
    :mod:`membudget.tracer`), else 0. ``host_s``: host time spent outside
    any op just before this one (Python, the autograd engine, hooks; Note
    [Host time between ops] in :mod:`membudget.tracer`), measured on real
    tensors, else 0."""

    index: int
    name: str
    phase: str
    category: str
    flops: int
    bytes_read: int
    bytes_written: int
    duration_s: Optional[float]
    inputs: List[int] = field(default_factory=list)
    outputs: List[int] = field(default_factory=list)
    dtype: str = "float32"
    block: Optional[int] = None
    workspace_bytes: int = 0
    host_s: float = 0.0


_TENSOR_COLUMNS = ("bytes", "shape", "dtype", "producer", "saved", "dies_after", "kind", "released_before",
                   "released_after_packs")
_TENSOR_DEFAULTS = {"released_before": None, "released_after_packs": None}
_OP_COLUMNS = ("name", "phase", "category", "flops", "bytes_read", "bytes_written", "duration_s",
               "inputs", "outputs", "dtype", "block", "workspace_bytes", "host_s")
# Columns added to version 1 after it was first written: optional on load
# (older files lack them), and ignored by older readers, so no version bump.
_OP_DEFAULTS = {"workspace_bytes": 0, "host_s": 0.0}


@dataclass
class Trace:
    """A recorded training step: ``ops`` in execution order, ``tensors``
    indexed by id, ``unpack_order`` (saved tensor ids in the order backward
    unpacked them; a tensor unpacked twice appears twice), ``unpack_ops`` (for
    each entry of ``unpack_order``, the index of the next op dispatched after
    the unpack), ``pack_order``/``pack_ops`` likewise for packs (a pack
    recorded with op index k happened after op k-1) and ``metadata`` (model, batch, device, torch version, fake)."""

    ops: List[TraceOp]
    tensors: List[TraceTensor]
    unpack_order: List[int] = field(default_factory=list)
    unpack_ops: List[int] = field(default_factory=list)
    pack_order: List[int] = field(default_factory=list)
    pack_ops: List[int] = field(default_factory=list)
    metadata: Dict[str, Any] = field(default_factory=dict)

    # ---- queries ---------------------------------------------------------
    def forward_ops(self) -> List[TraceOp]:
        """The ops of the forward pass, in order."""
        return [op for op in self.ops if op.phase == "forward"]

    def backward_ops(self) -> List[TraceOp]:
        """The ops of the backward pass, in order."""
        return [op for op in self.ops if op.phase == "backward"]

    def saved_tensors(self) -> List[TraceTensor]:
        """Tensors autograd saved for backward (parameters included)."""
        return [t for t in self.tensors if t.saved]

    def saved_activations(self) -> List[TraceTensor]:
        """Saved tensors produced during forward: what a budget manages."""
        return [t for t in self.tensors if t.saved and t.kind == "activation"]

    def first_backward_index(self) -> int:
        """Index of the first backward op (``len(ops)`` when there is none)."""
        return next((op.index for op in self.ops if op.phase == "backward"), len(self.ops))

    def live_bytes(self) -> List[int]:
        """Bytes of all storages alive during each op (its inputs and outputs
        included), assuming every storage is resident: the unmanaged
        footprint. Storages that existed before the step count from op 0."""
        delta = [0] * (len(self.ops) + 1)
        for t in self.tensors:
            start = 0 if t.producer is None else t.producer
            end = len(self.ops) - 1 if t.dies_after is None else t.dies_after
            delta[start] += t.bytes
            delta[end + 1] -= t.bytes
        out, running = [], 0
        for i in range(len(self.ops)):
            running += delta[i]
            out.append(running)
        return out

    def summary(self) -> str:
        """One line: ops by phase, tensors, saved activation bytes, peak."""
        phases = {p: sum(op.phase == p for op in self.ops) for p in PHASES}
        saved = sum(t.bytes for t in self.saved_activations())
        peak = max(self.live_bytes(), default=0)
        return (f"{len(self.ops)} ops ({phases['forward']} forward, {phases['backward']} backward, "
                f"{phases['optimizer']} optimizer), {len(self.tensors)} tensors, "
                f"saved activations {saved / 2**20:.1f} MiB, live peak {peak / 2**20:.1f} MiB")

    # ---- persistence -----------------------------------------------------
    def to_dict(self) -> Dict[str, Any]:
        """Columnar plain-data form (what ``save`` writes, see
        docs/trace_format.md)."""
        tensors = {c: [getattr(t, c) for t in self.tensors] for c in _TENSOR_COLUMNS}
        tensors["shape"] = [list(s) for s in tensors["shape"]]
        ops = {c: [getattr(op, c) for op in self.ops] for c in _OP_COLUMNS}
        return {"format": FORMAT_NAME, "version": FORMAT_VERSION, "metadata": self.metadata,
                "tensors": tensors, "ops": ops, "unpack_order": self.unpack_order,
                "unpack_ops": self.unpack_ops, "pack_order": self.pack_order, "pack_ops": self.pack_ops}

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "Trace":
        """Inverse of :meth:`to_dict`; consumers are rebuilt from op inputs.
        Raises ``ValueError`` for another format or a newer version."""
        if data.get("format") != FORMAT_NAME:
            raise ValueError(f"not a membudget trace (format {data.get('format')!r})")
        if data.get("version") != FORMAT_VERSION:
            raise ValueError(f"trace format version {data.get('version')} is not supported "
                             f"(this membudget reads version {FORMAT_VERSION})")
        tc, oc = data["tensors"], data["ops"]
        tensors = [TraceTensor(id=i, **{c: tc[c][i] if c in tc else _TENSOR_DEFAULTS[c] for c in _TENSOR_COLUMNS})
                   for i in range(len(tc["bytes"]))]
        for t in tensors:
            t.shape = tuple(t.shape)
        missing = [c for c in _OP_COLUMNS if c not in oc and c not in _OP_DEFAULTS]
        if missing:
            raise ValueError(f"trace is missing op columns {missing}")
        ops = [TraceOp(index=i, **{c: oc[c][i] if c in oc else _OP_DEFAULTS[c] for c in _OP_COLUMNS})
               for i in range(len(oc["name"]))]
        for op in ops:
            for tid in op.inputs:
                tensors[tid].consumers.append(op.index)
        return cls(ops=ops, tensors=tensors, unpack_order=list(data["unpack_order"]),
                   unpack_ops=list(data["unpack_ops"]), pack_order=list(data["pack_order"]),
                   pack_ops=list(data["pack_ops"]), metadata=dict(data["metadata"]))

    def save(self, path: Union[str, Path]) -> None:
        """Write the trace to ``path`` (gzip JSON, docs/trace_format.md)."""
        with gzip.open(path, "wt", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, separators=(",", ":"))

    @classmethod
    def load(cls, path: Union[str, Path]) -> "Trace":
        """Read a trace written by :meth:`save`."""
        with gzip.open(path, "rt", encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

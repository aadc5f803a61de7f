"""Records a :class:`~membudget.trace.Trace` from one training step.

Where this sits in the flow: ``membudget.trace(step_fn)`` runs the step under a
``TorchDispatchMode`` that sees every aten op (forward, the autograd engine's
backward, the optimizer), and inside ``saved_tensors_hooks`` that see what
autograd saves and the order backward unpacks it. FLOPs, bytes and categories
come from :mod:`membudget.costs`. With ``fake=True`` the step (and ``setup``,
which builds the model) runs under ``FakeTensorMode``: shapes and dtypes only,
so a model far larger than this machine traces in seconds without its memory.

Note [Storage liveness]: a trace tensor is a storage. The recorder keeps only
weak references (``StorageWeakRef``) and, before each op, polls which
storages have expired: a storage freed between op i and op i+1 has
``dies_after = i``. A weak reference keeps the StorageImpl's control block
alive, so its address (our key) cannot be reused by a new storage while we
track it. The pack hook stores a detached alias (never the tensor itself:
saving an op's own output would form a cycle through its grad_fn and delay
the free until garbage collection).

Note [Op workspace]: some kernels allocate scratch memory and free it before
they return (a CPU convolution's im2col buffer, a fused kernel's
temporaries). The dispatch mode never sees those tensors, yet they count
against the budget: without them the simulated unbudgeted peak of the
validation CNN was 50.9 MiB against 53.1 MiB measured, and under a budget the
real run had less room than the prediction (60 MiB swapped per step against
46 MiB predicted). On real tensors, when an allocator that counts is in use
(membudget installed, on the CPU or CUDA, or PyTorch's own CUDA allocator),
the recorder resets the allocated-bytes peak before each op and records
``peak - allocated before - new output storages`` as the op's
``workspace_bytes``; the simulator allocates it for the op's duration.
Differences under ``_WORKSPACE_NOISE_BYTES`` are the allocator's rounding of
each output and are dropped. Tracing therefore resets the allocator's peak
statistics.

Note [Released by the step]: the manager may evict a saved tensor only once
nothing but autograd holds it (its storage's use count); the step's Python
often holds one past its last forward use: the batch in a local for the whole
step, a residual block's input until the block returns (after the packs of
the block's last op), a layer's output until the caller rebinds its
variable. The recorder counts the storage's users after each op and before
each pack, in forward: once only its own pack aliases are left, the tensor
was released there (``released_before``: before that op,
``released_after_packs``: after that many packs); a tensor still held when
backward starts has ``released_before = -1``. Without it the simulation of
the CPU validation's CNN at 60% copied the batch and a block input out in
the background in forward, which the real run could not (both were still
held), and the real run then evicted that block input synchronously in
backward (0.2 ms per step against none simulated).

Note [Host time between ops]: between two aten ops the step runs on the host
outside any op: the model's Python, the autograd engine (its start at
``backward()`` above all), saved-tensor hooks, the optimizer's loop. An op's
``host_s`` is that time before it: from the end of the previous op's dispatch
to the start of its own, less what the recorder itself spent in its pack,
unpack and module hooks, less the smallest such gap of the step (the cost of
the recorder's dispatch into Python, which every op pays under the recorder
and no unrecorded run does). On the CPU, copies run beside it: the CPU
validation's GPT-2 at 80% issues an 8 MiB background copy-out at forward's
last pack, and the real run finished it in the 1.2 ms before backward's first
allocation needed its memory, while the simulation, with only the ops' 0.08
ms in between, waited for the whole copy. Measured on real tensors only
(``0`` on fake ones); ``simulate(..., host_time=True)`` spends it on the
compute stream when it uses the measured durations (``cpu-host``), see
:func:`membudget.replay_program.host_seconds`; by default only the gaps
at backward's start (Note [Backward's start] in
:mod:`membudget.replay_program`). Every gap is off by default: the
recorder's dispatch into Python inflates every gap, and membudget's own host
time in a managed run (most of that 1.2 ms) is not in it (docs/simulator.md).
"""
from __future__ import annotations

import time
from collections import Counter
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from . import costs
from .trace import Trace, TraceOp, TraceTensor

__all__ = ["trace"]

_WORKSPACE_NOISE_BYTES = 16 * 1024


class _WorkspaceProbe:
    """Allocated bytes around one op (Note [Op workspace])."""

    def __init__(self, current: Callable[[], int], peak: Callable[[], int], reset_peak: Callable[[], None]):
        self.current, self.peak, self.reset_peak = current, peak, reset_peak

    @classmethod
    def find(cls, fake: bool) -> Optional["_WorkspaceProbe"]:
        """The probe for this process's allocator, or ``None`` (fake tensors,
        or the CPU without membudget installed: nothing counts)."""
        if fake:
            return None
        from ._native import load_extension

        try:
            native = load_extension()
        except ImportError:  # no extension built: only PyTorch's CUDA allocator can count
            native = None
        if native is not None and native.managing():
            return cls(lambda: int(native.memory_stats()["allocated_bytes.all.current"]),
                       lambda: int(native.memory_stats()["allocated_bytes.all.peak"]), native.reset_peak_stats)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return cls(torch.cuda.memory_allocated, torch.cuda.max_memory_allocated, torch.cuda.reset_peak_memory_stats)
        return None

    def start(self) -> int:
        """Before the op: allocated bytes now (and the peak reset to them)."""
        self.reset_peak()
        return self.current()

    def workspace(self, before: int, output_bytes: int) -> int:
        """After the op: what it allocated beyond its new outputs."""
        extra = self.peak() - before - output_bytes
        return extra if extra >= _WORKSPACE_NOISE_BYTES else 0


def _storage_of(t: torch.Tensor) -> Optional[StorageWeakRef]:
    try:
        return StorageWeakRef(t.untyped_storage())
    except (NotImplementedError, RuntimeError):  # sparse, nested: no single storage
        return None


class _Recorder(TorchDispatchMode):
    """The dispatch mode that builds the op and tensor lists (see module doc)."""

    def __init__(self, measure: bool, probe: Optional[_WorkspaceProbe] = None):
        super().__init__()
        self.measure = measure
        self.probe = probe
        self.ops: List[TraceOp] = []
        self.tensors: List[TraceTensor] = []
        self.live: Dict[int, Tuple[StorageWeakRef, int]] = {}  # cdata -> (weak ref, tensor id)
        self.unpack_order: List[int] = []
        self.unpack_ops: List[int] = []
        self.pack_order: List[int] = []
        self.pack_ops: List[int] = []
        self.paused = False
        self.seen_backward = False
        self.module_stack: List[int] = []
        self.op_scopes: List[Tuple[int, ...]] = []  # module ids on the stack, per op
        self.module_class: Dict[int, str] = {}
        # Note [Host time between ops]
        self.last_exit: Optional[float] = None
        self.hook_s = 0.0
        self.raw_host_s: List[float] = []
        # Note [Released by the step]: saved storages the step may still
        # hold, with the number of aliases the recorder's packs keep of each.
        self.held: Dict[int, Tuple[StorageWeakRef, int]] = {}  # tensor id -> (weak ref, aliases)

    # ---- storages --------------------------------------------------------
    def reap(self, last_op: int) -> None:
        """Marks every tracked storage that has been freed as dying after
        ``last_op`` (Note [Storage liveness])."""
        dead = [key for key, (ref, _) in self.live.items() if ref.expired()]
        for key in dead:
            _, tid = self.live.pop(key)
            producer = self.tensors[tid].producer
            self.tensors[tid].dies_after = max(last_op, producer if producer is not None else 0)

    def note_releases(self) -> None:
        """Marks each saved storage the step no longer holds (Note [Released
        by the step]) as released here: before the next op, after the packs
        recorded so far."""
        if not self.held:
            return
        # _storage_Use_Count counts the strong reference it takes from the
        # weak one to read the count: one more than the storage's holders.
        gone = [tid for tid, (ref, aliases) in self.held.items()
                if ref.expired() or torch._C._storage_Use_Count(ref.cdata) <= aliases + 1]
        for tid in gone:
            del self.held[tid]
            self.tensors[tid].released_before = len(self.ops)
            self.tensors[tid].released_after_packs = len(self.pack_order)

    def end_forward(self) -> None:
        """At backward's first op: what the step still holds was held
        through forward (``released_before = -1``)."""
        for tid in self.held:
            self.tensors[tid].released_before = -1
        self.held.clear()

    def tensor_id(self, t: torch.Tensor, producer: Optional[int]) -> Optional[int]:
        """The id of ``t``'s storage, created (with ``producer``) when new."""
        ref = _storage_of(t)
        if ref is None:
            return None
        entry = self.live.get(ref.cdata)
        if entry is not None:
            return entry[1]
        tid = len(self.tensors)
        if producer is None:
            kind = "parameter" if (t.requires_grad and t.is_leaf) else "input"
        else:
            kind = {"forward": "activation", "backward": "other", "optimizer": "other"}[self.ops_phase()]
        nbytes = t.untyped_storage().nbytes()
        self.tensors.append(TraceTensor(id=tid, bytes=int(nbytes), shape=tuple(t.shape),
                                        dtype=str(t.dtype).replace("torch.", ""), producer=producer, kind=kind))
        self.live[ref.cdata] = (ref, tid)
        return tid

    def ops_phase(self) -> str:
        """forward, backward (inside the autograd engine), or optimizer (after it)."""
        if torch._C._current_autograd_node() is not None:
            self.seen_backward = True
            return "backward"
        return "optimizer" if self.seen_backward else "forward"

    # ---- the dispatch hook -----------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        entered = time.perf_counter()
        kwargs = kwargs or {}
        if self.paused or func.namespace == "prim":
            return func(*args, **kwargs)
        host = entered - self.last_exit - self.hook_s if self.last_exit is not None else 0.0
        index = len(self.ops)
        self.reap(index - 1)
        phase = self.ops_phase()
        if phase == "forward":
            self.note_releases()
        elif self.held:
            self.end_forward()
        inputs: List[int] = []
        for t in costs.tensors_in((args, kwargs)):
            tid = self.tensor_id(t, None)
            if tid is not None and tid not in inputs:
                inputs.append(tid)
        allocated_before = self.probe.start() if self.probe is not None else 0
        start = time.perf_counter()
        out = func(*args, **kwargs)
        duration = time.perf_counter() - start if self.measure else None
        outputs: List[int] = []
        known = set(inputs)
        for t in costs.tensors_in(out):
            ref = _storage_of(t)
            if ref is None or ref.cdata in self.live:
                continue  # a view of, or in place on, a storage we already track
            tid = self.tensor_id(t, index)
            if tid is not None and tid not in known:
                outputs.append(tid)
        workspace = 0
        if self.probe is not None:
            workspace = self.probe.workspace(allocated_before, sum(self.tensors[tid].bytes for tid in outputs))
        read, written = costs.op_bytes(args, kwargs, out)
        first = next(iter(costs.tensors_in(out)), None)
        if first is None:
            first = next(iter(costs.tensors_in(args)), None)
        self.ops.append(TraceOp(
            index=index, name=str(func), phase=phase, category=costs.op_category(func),
            flops=costs.op_flops(func, args, kwargs, out), bytes_read=read, bytes_written=written,
            duration_s=duration, inputs=inputs, outputs=outputs,
            dtype=str(first.dtype).replace("torch.", "") if first is not None else "float32",
            workspace_bytes=workspace))
        for tid in inputs:
            self.tensors[tid].consumers.append(index)
        self.op_scopes.append(tuple(self.module_stack) if phase == "forward" else ())
        self.raw_host_s.append(max(host, 0.0))
        self.hook_s = 0.0
        self.last_exit = time.perf_counter()
        return out

    # ---- saved tensor hooks ----------------------------------------------
    def pack(self, t: torch.Tensor) -> Any:
        """Marks ``t``'s storage saved; keeps a detached alias (module doc)."""
        self.paused = True
        entered = time.perf_counter()
        try:
            forward = self.ops_phase() == "forward"
            if forward:
                self.note_releases()
            tid = self.tensor_id(t, None)
            alias = t.detach()
            if tid is not None:
                self.tensors[tid].saved = True
                self.pack_order.append(tid)
                self.pack_ops.append(len(self.ops))
                if forward:
                    ref, aliases = self.held.get(tid, (StorageWeakRef(alias.untyped_storage()), 0))
                    self.held[tid] = (ref, aliases + 1)
            return (tid, alias)
        finally:
            self.paused = False
            self.hook_s += time.perf_counter() - entered

    def unpack(self, packed: Any) -> torch.Tensor:
        """Records the unpack (tensor id, next op index) and returns the alias."""
        entered = time.perf_counter()
        tid, alias = packed
        if tid is not None:
            self.unpack_order.append(tid)
            self.unpack_ops.append(len(self.ops))
        self.hook_s += time.perf_counter() - entered
        return alias

    def assign_host_time(self) -> None:
        """Sets each op's ``host_s`` (Note [Host time between ops]): the
        time since the previous op ended, less the recorder's own hooks and
        less the least any op waited (what the recorder's dispatch into
        Python costs every op, which the unrecorded run does not pay)."""
        gaps = self.raw_host_s[1:]
        floor = min(gaps) if gaps else 0.0
        for op, raw in zip(self.ops[1:], gaps):
            op.host_s = max(raw - floor, 0.0)

    # ---- module scopes (for top-level blocks) ----------------------------
    def enter_module(self, module: torch.nn.Module, *_: Any) -> None:
        """Forward pre-hook: push the module (for the block of each op)."""
        entered = time.perf_counter()
        self.module_class.setdefault(id(module), type(module).__name__)
        self.module_stack.append(id(module))
        self.hook_s += time.perf_counter() - entered

    def exit_module(self, module: torch.nn.Module, *_: Any) -> None:
        """Forward hook: pop the module."""
        entered = time.perf_counter()
        if self.module_stack and self.module_stack[-1] == id(module):
            self.module_stack.pop()
        self.hook_s += time.perf_counter() - entered

    def assign_blocks(self) -> None:
        """Marks forward ops with their top-level block: the instances of the
        most frequent module class whose instances do not nest and together
        cover at least half of the forward ops (transformer layers, residual
        blocks); what ``checkpoint-blocks`` recomputes."""
        forward = [i for i, op in enumerate(self.ops) if op.phase == "forward"]
        if not forward:
            return
        instances: Dict[str, List[int]] = {}
        for module_id, name in self.module_class.items():
            instances.setdefault(name, []).append(module_id)
        best: Optional[List[int]] = None
        for name, ids in sorted(instances.items(), key=lambda kv: -len(kv[1])):
            if len(ids) < 2:
                break
            members = set(ids)
            covered, nested = 0, False
            for i in forward:
                hits = [m for m in self.op_scopes[i] if m in members]
                nested |= len(hits) > 1
                covered += bool(hits)
            if not nested and covered * 2 >= len(forward):
                best = ids
                break
        if best is None:
            return
        order: Dict[int, int] = {}
        members = set(best)
        for i in forward:
            hit = next((m for m in self.op_scopes[i] if m in members), None)
            if hit is not None:
                self.ops[i].block = order.setdefault(hit, len(order))


def trace(step_fn: Callable[..., Any], fake: bool = False, *, setup: Optional[Callable[[], Any]] = None,
          warmup: int = 0, metadata: Optional[Dict[str, Any]] = None) -> Trace:
    """Record one training step as a :class:`~membudget.trace.Trace`.

    ``step_fn`` runs forward and backward (and, if it likes, the optimizer); it
    is called as ``step_fn(state)`` where ``state = setup()`` when ``setup`` is
    given, else as ``step_fn()``. With ``fake=True`` both run under
    ``FakeTensorMode`` (build the model in ``setup`` so that no weight is
    materialised) and op durations are left to the device model; otherwise
    each op's duration is measured. ``warmup`` steps run unrecorded first (real
    tensors: lazy initialisation would otherwise be timed). ``metadata`` is
    merged into the trace's (torch version and the fake flag are added).

    On real tensors with membudget installed (or on CUDA), each op's scratch
    memory is measured too (``TraceOp.workspace_bytes``, Note [Op workspace]);
    this resets the allocator's peak statistics."""
    fake_mode = None
    if fake:
        from torch._subclasses.fake_tensor import FakeTensorMode

        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        fake_mode.__enter__()
    try:
        state = setup() if setup is not None else None
        call = (lambda: step_fn(state)) if setup is not None else step_fn
        for _ in range(warmup):
            call()
        recorder = _Recorder(measure=not fake, probe=_WorkspaceProbe.find(fake))
        pre = torch.nn.modules.module.register_module_forward_pre_hook(recorder.enter_module)
        post = torch.nn.modules.module.register_module_forward_hook(recorder.exit_module)
        try:
            with recorder, torch.autograd.graph.saved_tensors_hooks(recorder.pack, recorder.unpack):
                call()
            # What the step freed on its way out dies after the last op; what
            # `state` still holds (parameters, gradients) lives on.
            recorder.reap(len(recorder.ops) - 1)
        finally:
            pre.remove()
            post.remove()
    finally:
        if fake_mode is not None:
            fake_mode.__exit__(None, None, None)
    for _, tid in recorder.live.values():
        t = recorder.tensors[tid]
        if t.kind == "other" and t.producer is not None and recorder.ops[t.producer].phase == "backward":
            t.kind = "gradient"  # produced in backward and kept: a .grad
    recorder.live.clear()
    recorder.assign_blocks()
    if not fake:
        recorder.assign_host_time()
    meta = {"torch": torch.__version__, "fake": bool(fake),
            "phases": dict(Counter(op.phase for op in recorder.ops))}
    meta.update(metadata or {})
    return Trace(ops=recorder.ops, tensors=recorder.tensors, unpack_order=recorder.unpack_order,
                 unpack_ops=recorder.unpack_ops, pack_order=recorder.pack_order, pack_ops=recorder.pack_ops,
                 metadata=meta)

"""Record one training step as a trace-shaped object, numbered as the runtime numbers ops.

Where this sits in the flow: :func:`membudget.plan` needs, for a plan the
runtime can follow, forward ops numbered exactly as the runtime's lineage
dispatch mode numbers them (every aten op dispatched on plain tensors while
grad is enabled and no backward runs, from the start of forward, scalar reads
excepted). :func:`membudget.trace` (issue 4) is the full recorder and the
default; this one (``plan(..., via="dispatch")``) records the minimum the
planner needs, with module paths, in the trace's data model
(``ops`` with index, name, phase, category, flops, bytes; ``tensors`` with
producer, consumers, saved, kind), and :func:`membudget.plan` uses it.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .. import costs

__all__ = ["record_step"]

# Ops the runtime's lineage mode does not record (and so does not number).
_NOT_RECORDED = frozenset({"aten::_local_scalar_dense", "aten::item", "aten::is_nonzero", "aten::equal"})


def _aliases_input(func: Any) -> bool:
    schema = getattr(func, "_schema", None)
    return bool(schema is not None and any(r.alias_info is not None for r in schema.returns))


class _StepRecorder(TorchDispatchMode):
    """Records ops and tensors; a tensor is identified by its storage's data
    pointer while alive (an op's fresh output starts a new tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: List[SimpleNamespace] = []
        self.tensors: Dict[int, SimpleNamespace] = {}
        self.by_ptr: Dict[int, int] = {}
        self.modules: List[str] = []  # the module path being run (forward pre/post hooks)

    def tensor_id(self, t: torch.Tensor, producer: Optional[int] = None, fresh: bool = False) -> int:
        ptr = t.untyped_storage().data_ptr()
        if not fresh and ptr in self.by_ptr:
            return self.by_ptr[ptr]
        tid = len(self.tensors)
        kind = "activation" if producer is not None else (
            "parameter" if t.requires_grad and t.is_leaf else "input")
        self.tensors[tid] = SimpleNamespace(
            id=tid, bytes=int(t.untyped_storage().nbytes()), shape=tuple(t.shape), dtype=str(t.dtype),
            producer=producer, consumers=[], saved=False, dies_after=None, kind=kind)
        self.by_ptr[ptr] = tid
        return tid

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if any(kind is not torch.Tensor for kind in types) or func._schema.name in _NOT_RECORDED:
            return out
        backward = torch._C._current_graph_task_id() != -1
        if not backward and not torch.is_grad_enabled():
            return out
        index = len(self.ops)
        inputs = []
        for t in costs.tensors_in((args, kwargs)):
            tid = self.tensor_id(t)
            if tid not in inputs:
                inputs.append(tid)
                self.tensors[tid].consumers.append(index)
        alias = _aliases_input(func)
        outputs = []
        for t in costs.tensors_in(out):
            tid = self.tensor_id(t, producer=index, fresh=not alias)
            outputs.append(tid)
        read, written = costs.op_bytes(args, kwargs, out)
        self.ops.append(SimpleNamespace(
            index=index, name=str(func), phase="backward" if backward else "forward",
            category=costs.op_category(func), flops=costs.op_flops(func, args, kwargs, out),
            bytes_read=read, bytes_written=written, duration_s=None, inputs=inputs, outputs=outputs,
            module=self.modules[-1] if self.modules and not backward else ""))
        return out


def record_step(step: Callable[[], Any], parameters: Any = (), model: Optional[torch.nn.Module] = None
                ) -> SimpleNamespace:
    """Run ``step()`` (forward and backward) once under the recorder and return
    a trace-shaped object. ``parameters``: their ``.grad`` tensors are marked
    as gradients (alive to the end of the step). ``model``: each forward op
    records the path of the innermost module running it (``op.module``)."""
    recorder = _StepRecorder()
    handles = []
    if model is not None:
        for path, module in model.named_modules():
            def enter(_module, _args, path=path or "model"):
                recorder.modules.append(path)

            def leave(_module, _args, _out):
                if recorder.modules:
                    recorder.modules.pop()

            handles.append(module.register_forward_pre_hook(enter))
            handles.append(module.register_forward_hook(leave))

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr in recorder.by_ptr:
            recorder.tensors[recorder.by_ptr[ptr]].saved = True
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), recorder:
            step()
    finally:
        for handle in handles:
            handle.remove()
    for p in parameters:
        if p.grad is not None:
            tid = recorder.by_ptr.get(p.grad.untyped_storage().data_ptr())
            if tid is not None and recorder.tensors[tid].producer is not None:
                recorder.tensors[tid].kind = "gradient"
    return SimpleNamespace(ops=recorder.ops, tensors=list(recorder.tensors.values()), unpack_order=[],
                           metadata={"recorder": "membudget.planner.recorder"})

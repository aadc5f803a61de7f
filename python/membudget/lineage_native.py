"""The C++ lineage recorder's Python face (``MEMBUDGET_LINEAGE=cxx``).

Where this sits in the flow: with recomputation allowed, ``install()``
(:mod:`membudget._runtime`) creates either the Python recorder
(:class:`membudget.lineage.Lineage` under a ``TorchDispatchMode``, the
reference) or this one. Forward ops are recorded by a thread-local
``at::RecordFunction`` callback on the thread that called ``install()`` (and
on threads started after it: Note [Recording on started threads]), and
the pack-time closure and the replay run in C++ too (Note [C++ lineage
recorder] in csrc/torch/lineage_recorder.cpp): what is left here is the
glue the pack hook, the unpack hook and the recompute callback need, with
the same interface as :class:`~membudget.lineage.Lineage` for them.
"""
from __future__ import annotations

import threading

import torch
from torch.utils._python_dispatch import _disable_current_modes

from .replay import RecomputeError

__all__ = ["NativeLineage"]


class NativeLineage:
    """Records forward ops in C++ for one install; see the module docstring."""

    def __init__(self, native, plan=None, device_model=None):
        self.native = native
        self.recorder = native.lineage
        self.plan = plan
        # For CUDA: a costs.DeviceModel whose roofline floors each recorded
        # op's cost (Note [Roofline floor on CUDA] in lineage_roofline.cpp).
        self.device_model = device_model
        # Per thread (threads started after install() record too): .depth is
        # the nesting of without_recording (autograd.grad inside backward hooks).
        self._suspended = threading.local()

    def start(self) -> None:
        """Starts recording on the calling thread (and on threads started
        after install(), which start their own callbacks)."""
        if self.plan is not None:
            plan, native = self.plan, self.native

            def drop_if_planned(entry_id: int, op_index: int, op_name: str, output_index: int) -> None:
                if plan.drops(op_index, op_name, output_index):
                    native.plan_drop(entry_id)

            self.recorder.set_plan(drop_if_planned)
        else:
            self.recorder.set_plan(None)
        self.recorder.set_device_model(self.device_model.to_dict() if self.device_model is not None else None)
        self.recorder.start()

    def stop(self) -> None:
        """Stops recording on the calling thread."""
        self.recorder.stop()
        self.recorder.set_plan(None)
        self.recorder.set_device_model(None)

    def without_recording(self, function, args, kwargs):
        """``function(*args, **kwargs)`` with this thread's callback off
        (``backward()``, ``autograd.grad()``; Note [Backward without the
        lineage mode] in ``_runtime.py``)."""
        depth = getattr(self._suspended, "depth", 0)
        self._suspended.depth = depth + 1
        if depth == 0:
            self.recorder.set_enabled(False)
        try:
            return function(*args, **kwargs)
        finally:
            self._suspended.depth = depth
            if depth == 0:
                self.recorder.set_enabled(True)

    def records_here(self) -> bool:
        """Whether the calling thread's forward ops are recorded: the
        install thread's, or a thread started after install() (Note
        [Recording on started threads] in lineage_recorder.cpp)."""
        return self.recorder.recording()

    @property
    def ops_recorded(self) -> int:
        """Forward ops recorded since :meth:`start` (views included, as in Python)."""
        return self.recorder.ops_recorded()

    def release_if_idle(self) -> bool:
        """:meth:`membudget.lineage.Lineage.release_if_idle` (Note [Lineage
        released between steps]): after backward, with no managed entry
        left, lets go of every recorded input. True when it released."""
        return self.recorder.release_if_idle()

    def note_unpack(self) -> None:
        """Backward has begun: the next recorded op starts a new forward."""
        self.recorder.note_backward()

    def on_pack(self, handle, tensor: torch.Tensor) -> None:
        """Declares to the manager how a newly managed storage can be rebuilt
        (:meth:`membudget.lineage.Lineage.on_pack`; in C++, possibly when the
        op that made it returns: Note [Packed before recorded])."""
        self.recorder.on_pack(handle.entry_id, tensor)

    def rebuild(self, entry_id: int, stream=None) -> torch.Tensor:
        """The recompute callback: replays a dropped entry's storage
        (:func:`membudget.replay.rebuild_entry`; same grad mode and no
        Python modes, for the same reasons). With a CUDA ``stream`` (the
        current one), managed inputs the replay reads are recorded on it."""
        packed = None if stream is None else (stream.stream_id, stream.device_index, stream.device_type)
        try:
            with torch.enable_grad(), _disable_current_modes():
                return self.recorder.rebuild(entry_id, packed)
        except self.recorder.ReplayError as error:
            raise RecomputeError(str(error)) from None

    def rebuild_on_stream(self, entry_id: int, side: "torch.cuda.Stream"):
        """Note [Recompute ahead] on CUDA, as
        :func:`membudget.replay.rebuild_entry_on_stream`: replays a dropped
        entry on the side stream ``side`` (after it waits for the compute
        stream) and returns (tensor, ``side``'s handle); the rebuilt storage
        is recorded on the compute stream, where backward uses and frees it."""
        compute = torch.cuda.current_stream(side.device)
        side.wait_stream(compute)
        with torch.cuda.stream(side):
            rebuilt = self.rebuild(entry_id, stream=side)
        rebuilt.record_stream(compute)
        return rebuilt, side.cuda_stream

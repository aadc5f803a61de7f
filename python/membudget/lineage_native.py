"""The C++ lineage recorder's Python face (``MEMBUDGET_LINEAGE=cxx``).

Where this sits in the flow: with recomputation allowed, ``install()``
(:mod:`membudget._runtime`) creates either the Python recorder
(:class:`membudget.lineage.Lineage` under a ``TorchDispatchMode``, the
reference) or this one. Forward ops are recorded by a thread-local
``at::RecordFunction`` callback on the thread that called ``install()``, and
the pack-time closure and the replay run in C++ too (Note [C++ lineage
recorder] in csrc/torch/lineage_recorder.cpp): what is left here is the
glue the pack hook, the unpack hook and the recompute callback need, with
the same interface as :class:`~membudget.lineage.Lineage` for them.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import _disable_current_modes

from .replay import RecomputeError

__all__ = ["NativeLineage"]


class NativeLineage:
    """Records forward ops in C++ for one install; see the module docstring."""

    def __init__(self, native, plan=None):
        self.native = native
        self.recorder = native.lineage
        self.plan = plan

    def start(self) -> None:
        """Starts recording on the calling thread."""
        self.recorder.start()

    def stop(self) -> None:
        """Stops recording on the calling thread."""
        self.recorder.stop()

    @property
    def ops_recorded(self) -> int:
        """Forward ops recorded since :meth:`start` (views included, as in Python)."""
        return self.recorder.ops_recorded()

    def note_unpack(self) -> None:
        """Backward has begun: the next recorded op starts a new forward."""
        self.recorder.note_backward()

    def on_pack(self, handle, tensor: torch.Tensor) -> None:
        """Declares to the manager how a newly managed storage can be rebuilt
        (:meth:`membudget.lineage.Lineage.on_pack`)."""
        entry_id = handle.entry_id
        closure = self.recorder.on_pack(entry_id, tensor)
        if closure is None:
            return
        ok, seconds, deps, producer_index, producer_name, output_index = closure
        self.native.set_recompute_info(entry_id, ok, seconds, deps)
        if ok and self.plan is not None and self.plan.drops(producer_index, _python_name(producer_name),
                                                            output_index):
            self.native.plan_drop(entry_id)

    def rebuild(self, entry_id: int) -> torch.Tensor:
        """The recompute callback: replays a dropped entry's storage
        (:func:`membudget.replay.rebuild_entry`; same grad mode and no
        Python modes, for the same reasons)."""
        try:
            with torch.enable_grad(), _disable_current_modes():
                return self.recorder.rebuild(entry_id)
        except self.recorder.ReplayError as error:
            raise RecomputeError(str(error)) from None


def _python_name(name: str) -> str:
    """``aten::addmm.default`` -> ``aten.addmm.default``, as ``str(OpOverload)``
    names it (plans match op names recorded by the Python tracer)."""
    return name.replace("::", ".", 1)

"""Makes membudget torch's CUDA allocator: the CUDA half of ``install()``.

Where it sits in the flow: ``membudget.install()`` creates the native runtime
(a CUDA backend, the budgeted device allocator, the residency manager) and then
calls :func:`install_cuda_allocator`, after which every CUDA tensor's memory
comes from that allocator through the ``extern "C"`` symbols of the extension
(``csrc/torch/cuda_symbols.cpp``).

Two paths, best first:

* **C++ hooks** (``_C.torch_cuda_hooks_compiled``, the extension was built
  against a CUDA torch): a ``CUDAPluggableAllocator`` with ``record_stream``
  and ``empty_cache`` hooks, made current from C++.
* **Python fallback**: ``torch.cuda.memory.CUDAPluggableAllocator`` over the
  same symbols. It cannot set hooks, so ``tensor.record_stream()`` is silently
  a no-op and ``torch.cuda.empty_cache()`` does nothing; a warning says so.

torch can swap its CUDA allocator only before its own caching allocator is
initialised, which happens when ``torch.cuda`` is first initialised (the first
CUDA tensor, ``torch.cuda.synchronize()``, ``torch.cuda.memory_allocated()``,
...). So the check here uses only ``torch.cuda.is_initialized()``: querying
memory statistics would itself initialise CUDA and make the swap impossible.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Tuple

import torch

# The allocator object of the Python path, kept alive for the process: torch
# holds the C++ allocator, but the ctypes library handle lives in this object.
_python_allocator = None
# "hooks" or "python" once installed in this process, else None.
_installed_path: str | None = None


def installed_cuda_allocator_path() -> str | None:
    """Return how membudget became torch's CUDA allocator in this process.

    ``"hooks"`` for the C++ path with record_stream/empty_cache hooks,
    ``"python"`` for the hook-less fallback, ``None`` when it is not installed.
    """
    return _installed_path


def check_cuda_allocator_swappable() -> None:
    """Raise RuntimeError when torch's CUDA allocator can no longer be replaced.

    It can be replaced only in a process that has not yet initialised
    ``torch.cuda``; the message names what to change. Does not itself
    initialise CUDA.
    """
    if not torch.cuda.is_available():
        raise RuntimeError(
            "membudget: no CUDA device is available to this process "
            f"(torch {torch.__version__}, built with CUDA {torch.version.cuda}); "
            "the CUDA allocator cannot be installed"
        )
    if torch.cuda.is_initialized():
        raise RuntimeError(
            "membudget: torch.cuda was already initialised in this process, so "
            "torch's CUDA caching allocator is active and cannot be replaced. "
            "Call membudget.install() before the first CUDA tensor, "
            "torch.cuda.synchronize() or torch.cuda.memory_* call, or run the "
            "script unchanged with `membudget run script.py`."
        )


def install_cuda_allocator() -> str:
    """Make membudget's budgeted allocator torch's CUDA allocator.

    Requires the native runtime to exist already (``membudget.install()``
    creates it, then calls this). Uses the C++ hooks path when the extension
    was built against a CUDA torch, else the Python ``CUDAPluggableAllocator``
    with a warning that ``record_stream`` is a no-op. Raises RuntimeError when
    there is no CUDA device, the extension has no CUDA backend, or CUDA was
    already used in this process. Calling it again after success does nothing.
    Returns the path used: ``"hooks"`` or ``"python"``.
    """
    global _installed_path, _python_allocator
    if _installed_path is not None:
        return _installed_path
    from membudget import _C

    if not getattr(_C, "cuda_backend_compiled", False):
        raise RuntimeError(
            "membudget: this build of the extension has no CUDA backend (the CUDA "
            "toolkit was not found when it was built); rebuild it with the toolkit "
            "installed (CUDA_HOME or /usr/local/cuda)"
        )
    check_cuda_allocator_swappable()

    if getattr(_C, "torch_cuda_hooks_compiled", False):
        _C.install_cuda_pluggable_with_hooks()
        _installed_path = "hooks"
        serve_torch_queries()
        return _installed_path

    warnings.warn(
        "membudget: the extension was built against a torch without CUDA, so the "
        "CUDA allocator is installed through torch.cuda.memory.CUDAPluggableAllocator "
        "without hooks: tensor.record_stream() is a no-op (memory used on a side "
        "stream may be reused too early) and torch.cuda.empty_cache() does nothing. "
        "Rebuild the extension against this CUDA torch to get the hooks.",
        RuntimeWarning,
        stacklevel=2,
    )
    symbols = _C.cuda_allocator_symbols
    allocator = torch.cuda.memory.CUDAPluggableAllocator(
        _C.extension_path(), symbols["malloc"], symbols["free"]
    )
    try:
        torch.cuda.memory.change_current_allocator(allocator)
    except RuntimeError as error:
        raise RuntimeError(
            "membudget: torch refused to replace its CUDA allocator "
            f"({error}); install membudget before any CUDA use in this process"
        ) from error
    _python_allocator = allocator
    _installed_path = "python"
    serve_torch_queries()
    return _installed_path


# Note [Memory snapshots]: torch's CUDAPluggableAllocator refuses snapshot()
# and recordHistory(), so under membudget torch.cuda.memory_snapshot(),
# torch.cuda.memory._snapshot() and _dump_snapshot() -- the file users load
# into the memory visualizer when they debug an out-of-memory -- raised, and
# so did torch.cuda.memory._record_memory_history(), the recipe's first step.
# All of them reach the allocator through functions of torch._C
# (_cuda_memorySnapshot, _cuda_record_memory_history and its _legacy form),
# looked up at each call; these are replaced (once membudget is torch's allocator,
# for the rest of the process, as the allocator is) by answers from
# membudget's own allocator: its segments and blocks now
# (membudget.memory_snapshot()), with no allocation history, which membudget
# does not record -- recording it is refused with a warning instead of an
# error. Overriding snapshot() in C++ instead would tie the hooks to one
# torch version: its signature changed across the versions supported.
_WARNED_NO_HISTORY = False


def cuda_memory_snapshot(*_args, **_kwargs) -> dict:
    """What ``torch._C._cuda_memorySnapshot`` returns, from membudget's
    allocator (Note [Memory snapshots]): ``segments`` as
    :func:`membudget.memory_snapshot`, and one empty ``device_traces`` list
    per device (no allocation history is recorded)."""
    from .stats import memory_snapshot

    devices = torch.cuda.device_count() if torch.cuda.is_available() else 1
    return {"segments": memory_snapshot(), "device_traces": [[] for _ in range(max(devices, 1))],
            "allocator_settings": {}, "external_annotations": []}


def record_no_memory_history(enabled=None, *_args, **_kwargs) -> None:
    """``torch._C._cuda_record_memory_history`` (and its ``_legacy`` form)
    under membudget (Note [Memory snapshots]): history is not recorded; the
    first call that turns it on says so."""
    global _WARNED_NO_HISTORY
    if enabled and not _WARNED_NO_HISTORY:
        _WARNED_NO_HISTORY = True
        warnings.warn(
            "membudget: allocation history is not recorded under membudget's allocator; "
            "torch.cuda.memory._snapshot() and _dump_snapshot() show its segments and blocks "
            "as they are, without stack traces or a trace of events (membudget.memory_snapshot())",
            RuntimeWarning,
            stacklevel=2,
        )


def _budget_view_of(device_memory_info: Callable[[int], Tuple[int, int]], index_of: Callable[[Any], int]):
    """``device_memory_info`` (a device index to the device's ``(free,
    total)``) answering as the budget sees it (Note [Free memory as the
    budget sees it] in ``_runtime.py``); ``index_of`` resolves the device
    argument as the wrapped torch function does. Wrapping is done once: a
    function already wrapped is returned as it is."""
    from . import _runtime

    if getattr(device_memory_info, "_membudget_wraps", None) is not None:
        return device_memory_info

    def memory_info(device=None):
        index = index_of(device)
        return _runtime.memory_info_under_budget(index, *device_memory_info(index))

    memory_info._membudget_wraps = device_memory_info
    memory_info.__doc__ = device_memory_info.__doc__
    return memory_info


def _cuda_device_index(device) -> int:
    """torch.cuda.mem_get_info's reading of its ``device`` argument: None
    or a device without an index is the current device."""
    index = torch.cuda._utils._get_device_index(device, optional=True) if device is not None else None
    return torch.cuda.current_device() if index is None or index < 0 else index


def serve_torch_queries() -> None:
    """Route torch's memory snapshot and history functions (Note [Memory
    snapshots]), its per-process memory fraction (Note [Memory fraction
    as a budget] in ``_runtime.py``) and its free-memory queries (Note [Free
    memory as the budget sees it], there too) to membudget."""
    from . import _runtime

    torch.cuda.mem_get_info = torch.cuda.memory.mem_get_info = _budget_view_of(
        torch.cuda.memory.mem_get_info, _cuda_device_index)
    if hasattr(torch._C, "_accelerator_getMemoryInfo"):  # torch >= 2.9: torch.accelerator.get_memory_info
        torch._C._accelerator_getMemoryInfo = _budget_view_of(torch._C._accelerator_getMemoryInfo,
                                                              _cuda_device_index)
    torch._C._cuda_memorySnapshot = cuda_memory_snapshot
    torch._C._cuda_record_memory_history = record_no_memory_history
    torch._C._cuda_record_memory_history_legacy = record_no_memory_history
    torch._C._cuda_setMemoryFraction = _runtime.set_memory_fraction
    torch._C._cuda_getMemoryFraction = _runtime.memory_fraction


def cuda_build_info() -> dict:
    """Return the CUDA facts ``python -m membudget.info`` prints.

    Whether the extension has a CUDA backend and the C++ hooks path, how many
    devices the backend sees, and how (if at all) the allocator was installed
    in this process. Never raises and never initialises ``torch.cuda``.
    """
    try:
        from membudget import _C
    except ImportError as error:
        return {"extension": f"not importable: {error}"}
    return {
        "cuda_backend_compiled": bool(getattr(_C, "cuda_backend_compiled", False)),
        "torch_cuda_hooks_compiled": bool(getattr(_C, "torch_cuda_hooks_compiled", False)),
        "cuda_device_count": _C.cuda_device_count() if hasattr(_C, "cuda_device_count") else 0,
        "torch_cuda": torch.version.cuda,
        "installed_cuda_allocator": _installed_path,
    }

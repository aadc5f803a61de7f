"""install() / uninstall(): where a training script meets membudget.

Where this sits in the flow: ``install()`` reads the configuration
(:mod:`membudget.config`: keyword arguments win over ``MEMBUDGET_*``), creates
the native runtime (backend, budgeted caching allocator, host tier, residency
manager), makes it the process allocator (CPU: ``c10::SetCPUAllocator``; CUDA:
a pluggable allocator) and pushes membudget's ``saved_tensors_hooks`` so that
activations autograd saves become managed handles.

Note [Hooks are per thread]: PyTorch keeps default saved-tensor hooks per
thread. ``install()`` pushes them on the calling thread, the one that runs
forward in ordinary training scripts (``membudget run`` calls it on the main
thread before the script starts). Backward may run on other threads: unpack
works from any thread. Non-reentrant ``torch.utils.checkpoint`` regions push
their own hooks, which win inside them (innermost wins); under a budget they
run as plain code instead (Note [Checkpoint regions under a budget] in
``_checkpoint_regions.py``).

Note [Threads started after install()]: a training step run on another thread
(a ``threading.Thread``, a ``ThreadPoolExecutor`` worker, a web UI's training
worker) saved its activations unmanaged, since that thread had no hooks, and
ran out of memory at any budget below its plain peak. While installed, every
``threading.Thread`` pushes the install's saved-tensor hooks as it starts, before its
``run()``, so they sit at the bottom of its hook stack and no ``with`` block of
its own can pop them (``threading.Thread._bootstrap_inner`` is wrapped; it
runs on the new thread). When install() records lineage, such a thread
pushes the same hooks as the install thread and records too, so what it
saves can be swapped or dropped and replayed: it starts the C++ recorder's
callback for itself, or enters a :class:`~membudget.lineage.LineageMode` of
its own over the install's Python recorder (Note [Recording on started
threads] in csrc/torch/lineage_recorder.cpp says how forwards from several
threads share one recorder, under either). Both stop as its ``run()`` ends.
What stays the install thread's alone: parking the Python mode around
optimizer steps (a started thread's steps pay the mode's pass-through
cost), checkpoint regions run as plain code, and compiled-graph plans.
After ``uninstall()`` the recorder a started thread still has records
nothing (the C++ recorder is off; the Python one is retired), and what it
packs from then on is swap-only; a later ``install()`` with the C++
recorder turns its callback back on, since its hooks are that recorder's
process-wide pair. Daemon threads are left unmanaged (their error says
so): torch holds the pushed hooks in the thread's C++ thread-locals, and a
daemon thread still alive as the interpreter exits (tqdm's monitor, which
transformers starts) is stopped as it next takes the GIL, and its
thread-locals are destroyed then; releasing the hooks takes the GIL again,
inside a destructor, and the process aborted ("terminate called without an
active exception", exit status 134, after every test had passed). For the
same reason a started thread empties its hook stack as its ``run()`` ends,
while it still holds the GIL: a thread's Python state goes (and ``join()``
returns) before its C++ thread-locals are destroyed, so the interpreter
could begin to exit between the two and the release abort it as above.
Threads started before ``install()`` (or through ``_thread`` directly) cannot
be reached from outside and stay unmanaged; their error says that too. The
pushed hooks stay until the thread's ``run()`` ends: after ``uninstall()``
they pack nothing (the native pack passes tensors through when no runtime
manages), and a later ``install()`` manages through them again.

When recomputation is allowed (``MEMBUDGET_ACTIONS`` ``recompute`` or
``both``), ``install()`` also enters :class:`~membudget.lineage.LineageMode`
on that thread, so forward ops are recorded and dropped activations can be
replayed (:mod:`membudget.replay`).

Note [Backward without the lineage mode]: on the CPU, autograd runs backward
on the calling thread, so every backward op would also pass through the
lineage mode (about 7-16 us each through Python, for nothing: backward is not
recorded). While the mode is installed, ``torch.autograd.backward`` and
``torch.autograd.grad`` (which ``Tensor.backward`` calls) are wrapped to take
the mode off the dispatch stack for their duration when it is on top; the
engine captures the thread's state at that point, so backward ops never see
it. ``uninstall()`` restores the originals.

Note [Lineage mode parked during optimizer steps]: ``optimizer.step()`` runs
under ``no_grad`` and records nothing, yet with the mode on the stack each of
its ops pays the Python mode's cost (about 10-20 us per op here; Adam makes
several ops per parameter). Global optimizer step hooks take the mode off the
stack before every step on the install thread and put it back after, so only
the step itself runs without it: what is recorded does not change. If a step
raises (no post-hook), or a closure-style optimizer (LBFGS) runs forward inside
``step()``, a global ``nn.Module`` forward pre-hook, registered only while
parked, re-enters the mode at the next module call with grad enabled. The mode
is re-entered only when the dispatch stack is as deep as when it was parked,
so it never lands above a mode entered later (whose ``__exit__`` would pop
ours). (A first version parked from ``backward()`` to the next module call;
it left the batch unrecorded, and the LSTM exactness test under half its
peak with a 2 MiB host tier then ran out of memory every time: not kept.)
"""
from __future__ import annotations

import atexit
import functools
import os
import sys
import threading
from typing import Callable, Iterable, Optional, Tuple, Union

import torch

from . import _checkpoint_regions, _compiled_under_budget, _func_transforms
from .config import Config, resolve_lineage, resolve_recompute_ahead
from ._native import load_extension

__all__ = ["install", "uninstall", "is_installed"]

_state_lock = threading.Lock()
_hooks_thread: Optional[int] = None  # ident of the thread our hooks were pushed on
_lineage = None                      # membudget.lineage.Lineage while recording
_lineage_mode = None                 # the entered LineageMode
_autograd_originals = None           # (backward, grad) while wrapped
# Note [Lineage mode parked during optimizer steps]
_parked_depth: Optional[int] = None  # dispatch stack depth the mode left, while parked
_rearm_hook = None                   # the module pre-hook's handle, while parked
_optimizer_hooks = None              # the global optimizer step hooks' handles, while recording
_parking_allowed = True              # whether optimizer steps park the mode (benchmarks turn it off)
_thread_bootstrap = None             # threading.Thread._bootstrap_inner as it was, while wrapped
# What a thread started after install() pushes, and how it records: None,
# "cxx" (the C++ recorder's callback) or the Python recorder's Lineage, for a
# mode of its own (Note [Threads started after install()]); set by install().
_started_thread_hooks: Optional[Tuple[Callable, Callable]] = None
_started_thread_recorder = None
_started_thread_mode = threading.local()  # .mode: a started thread's LineageMode
_native_recorder_hooks: Optional[Tuple[Callable, Callable]] = None  # made once: threads compare them by identity
_exit_pause_registered = False  # Note [Process groups torn down with the GIL held]
_managed_device: Optional[torch.device] = None  # the runtime's device, from its creation on
# Note [Memory fraction as a budget]: torch.cuda.set_per_process_memory_fraction(f)
# caps torch's caching allocator at f of the device's memory. torch's
# CUDAPluggableAllocator, through which membudget is torch's allocator,
# ignores it without a word (no memory-fraction function is set), so a script
# that caps its memory so ran uncapped under membudget: with no
# MEMBUDGET_BUDGET, with no budget at all. membudget honours it as a bound on
# its budget: the budget in force is the smaller of install()'s and f of the
# device's memory, kept membudget's way (evicting activations before an
# out-of-memory error). The fraction is the process's, as torch's is: it
# bounds later install() calls too; a fraction of 1 bounds nothing.
_memory_fraction: Optional[float] = None
_install_budget_bytes = 0  # what the last install() asked for, before the fraction bounds it


def _choose_device(native, device: Optional[Union[str, torch.device]]) -> torch.device:
    if device is None:
        return torch.device("cuda", _default_cuda_index(native)) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("membudget.install(device='cuda'): no CUDA device is visible")
        if device.index is None:
            device = torch.device("cuda", _default_cuda_index(native))
    elif device.type != "cpu":
        raise ValueError(f"membudget.install(device={str(device)!r}): supported devices are 'cpu' and 'cuda'")
    return device


def _default_cuda_index(native) -> int:
    """Note [Device chosen before torch.cuda starts]: the CUDA device that
    ``install()`` manages when none is named. torch's allocator can be
    replaced only before ``torch.cuda`` initialises, and
    ``torch.cuda.current_device()`` and ``get_device_properties()``
    initialise it: asking them made every first ``install()`` on a GPU refuse
    with "torch.cuda is already initialised". So the index and the capacity
    come from the CUDA runtime itself. A process that a launcher started as
    one of several per machine (``torchrun`` sets ``LOCAL_RANK``) manages its
    local rank's device when it sees that many, as scripts pick it with
    ``torch.cuda.set_device(local_rank)`` after ``install()`` has already run
    (``membudget run``); otherwise (one visible device per process, or no
    launcher) the runtime's current device."""
    if torch.cuda.is_initialized():
        return torch.cuda.current_device()
    local_rank = os.environ.get("LOCAL_RANK", "")
    if local_rank.isdigit() and int(local_rank) < native.cuda_device_count():
        return int(local_rank)
    return native.cuda_current_device()


def _device_capacity(native, device: torch.device) -> int:
    if device.type == "cuda":
        return int(native.cuda_total_memory(device.index))
    return int(native.device_capacity("cpu"))


def install(
    budget: Optional[Union[str, int]] = None,
    *,
    host_budget: Optional[Union[str, int]] = None,
    policy: Optional[str] = None,
    actions: Optional[str] = None,
    min_tensor_bytes: Optional[Union[str, int]] = None,
    prefetch_bytes: Optional[Union[str, int]] = None,
    high_watermark: Optional[float] = None,
    log: Optional[Union[str, Iterable[str]]] = None,
    expandable_segments: Optional[bool] = None,
    recompute_ahead: Optional[Union[str, bool]] = None,
    lineage: Optional[str] = None,
    checkpoint: Optional[str] = None,
    compile: Optional[str] = None,
    device: Optional[Union[str, torch.device]] = None,
    plan=None,
) -> Config:
    """Run this process under a device-memory budget from here on.

    Every argument left as ``None`` comes from its ``MEMBUDGET_*`` variable
    (see :mod:`membudget.config` for syntax and defaults); ``budget`` accepts
    bytes, ``"12GiB"``-style sizes or ``"60%"`` of device memory, and no budget
    at all means memory is only counted. ``device`` defaults to the current CUDA
    device when one is visible, else the CPU (whose tensors then play the
    device's part, with the same swapping machinery). Calling ``install()``
    again reconfigures the running allocator (a new budget applies to the next
    allocation); the device cannot change within a process. Install before the
    model is built: memory allocated earlier is not counted or managed. Returns
    the resolved :class:`~membudget.config.Config`.

    ``expandable_segments`` (default on) makes device memory one growing
    virtual range per pool and stream, mapped page by page, so free fragments
    go back to the budget (docs/allocator.md); it is fixed when the allocator
    is created, and asking for the other setting later raises RuntimeError.

    ``recompute_ahead`` (``"auto"``, the default, or a switch) lets the
    prefetcher replay dropped activations ahead of their use within its window
    (docs/recompute.md, "Recompute ahead"); ``"auto"`` turns it on where the
    benchmarks showed it pays (:func:`membudget.config.resolve_recompute_ahead`).
    ``lineage`` picks the recorder of forward ops when recomputation is
    allowed: ``"python"`` (a dispatch mode, the reference), ``"cxx"`` (the
    C++ recorder) or ``"auto"`` (C++ on the CPU, Python on CUDA:
    :func:`membudget.config.resolve_lineage`); default ``MEMBUDGET_LINEAGE``.

    ``checkpoint`` (``"replace"``, the default, or ``"keep"``; default
    ``MEMBUDGET_CHECKPOINT``): with ``"replace"`` and a budget, non-reentrant
    ``torch.utils.checkpoint`` regions on this thread run as plain forward
    code, so that membudget can evict their activations (Note [Checkpoint
    regions under a budget] in ``_checkpoint_regions.py``); the results are
    the same.

    ``compile`` (``"plan"``, the default, or ``"off"``; default
    ``MEMBUDGET_COMPILE``): with ``"plan"`` and a budget, each graph that
    ``torch.compile`` hands to inductor from here on is split into forward
    and backward by the Echo planner under what the budget leaves it (Note
    [Compiled graphs planned under the budget] in
    ``_compiled_under_budget.py``; torch 2.9 or newer). A graph's plan is
    fixed when it is compiled: after changing the budget, recompile
    (``torch._dynamo.reset()``). :func:`membudget.compiled_plans` lists what
    was planned.

    Saved activations are managed, and lineage recorded, on this thread and
    on every non-daemon ``threading.Thread`` started from here on (Note
    [Threads started after install()]); call :func:`uninstall` from this
    thread.

    ``plan`` (a :class:`membudget.Plan` from :func:`membudget.plan`) names
    saved tensors to drop at pack time and recompute on use; anything it did
    not foresee is still handled dynamically. It needs recomputation allowed.
    """
    global _hooks_thread, _exit_pause_registered, _managed_device, _install_budget_bytes
    config = Config.from_env(
        budget=budget,
        host_budget=host_budget,
        policy=policy,
        actions=actions,
        min_tensor_bytes=min_tensor_bytes,
        prefetch_bytes=prefetch_bytes,
        high_watermark=high_watermark,
        log=log,
        expandable_segments=expandable_segments,
        recompute_ahead=recompute_ahead,
        lineage=lineage,
        checkpoint=checkpoint,
        compile=compile,
    )
    native = load_extension()
    target = _choose_device(native, device)
    capacity = _device_capacity(native, target)
    asked_bytes = config.budget_bytes(capacity) or 0
    budget_bytes = _bounded_by_memory_fraction(asked_bytes, capacity)
    settings = {
        "budget_bytes": budget_bytes,
        "host_budget_bytes": config.host_budget_bytes,
        "policy": config.policy,
        "actions": config.actions,
        "min_tensor_bytes": config.min_tensor_bytes,
        "prefetch_bytes": config.prefetch_bytes,
        "high_watermark": config.high_watermark,
        "log_decisions": "decisions" in config.log or "evictions" in config.log,
        "expandable_segments": config.expandable_segments,
        "recompute_ahead": resolve_recompute_ahead(
            config.recompute_ahead, target.type,
            record_stream_works=bool(getattr(native, "torch_cuda_hooks_compiled", False))),
        # Note [Copies ahead where copies are free] (csrc/core/residency_manager.h).
        "copies_ahead": target.type == "cuda",
    }
    if plan is not None and not config.records_lineage:
        raise ValueError("membudget.install(plan=...) needs recomputation: use actions='recompute' or 'both'")
    with _state_lock:
        from ._cuda_install import check_cuda_allocator_swappable, install_cuda_allocator, installed_cuda_allocator_path

        # Until torch's allocator is ours, every install() tries to make it
        # so; whether the swap can still happen is checked before a runtime
        # exists. A runtime left behind by a refused swap made the next
        # install() skip the swap and report itself installed while torch's
        # own allocator served every tensor, with no budget enforced.
        first_cuda_install = target.type == "cuda" and installed_cuda_allocator_path() is None
        if first_cuda_install:
            check_cuda_allocator_swappable()
        had_runtime = native.runtime_kind() != "none"
        native.install_runtime(target.type, target.index or 0, settings)
        if not had_runtime:
            _managed_device = target
        _install_budget_bytes = asked_bytes
        if first_cuda_install:
            try:
                install_cuda_allocator()
            except BaseException:
                if not had_runtime:
                    native.uninstall_runtime()
                raise
            if not torch.cuda.is_initialized() and native.cuda_current_device() != target.index:
                # Note [Device chosen before torch.cuda starts]: the managed
                # device is the one torch allocates on by default.
                native.cuda_set_current_device(target.index)
        if _hooks_thread is not None and _hooks_thread != threading.get_ident():
            raise RuntimeError("membudget.install() again must run on the thread that called it first")
        if _hooks_thread is not None:
            _pop_hooks()
        _push_hooks(native, config, plan, target, recording=config.records_lineage and budget_bytes > 0)
        _hooks_thread = threading.get_ident()
        _manage_threads_started_from_now()
        if not _exit_pause_registered:
            atexit.register(let_collective_threads_finish)
            _exit_pause_registered = True
        if budget_bytes > 0 and config.checkpoint == "replace":
            _checkpoint_regions.replace_regions()
        else:
            _checkpoint_regions.keep_regions()
        if budget_bytes > 0 and config.compile == "plan":
            _compiled_under_budget.plan_compiles(budget_bytes, target, _cost_model_name(target),
                                                 log="decisions" in config.log)
        else:
            _compiled_under_budget.leave_compiles(forget_plans=True)
    return config


def let_collective_threads_finish() -> None:
    """Note [Process groups torn down with the GIL held]: torch destroys a
    gloo process group (when the last DDP model holding it goes) with the
    GIL held, and its destructor joins the group's worker threads. A worker
    still releasing the last collective's work needs the GIL for that when
    the work captured Python objects in its thread-local state (such as the
    saved-tensor hooks membudget keeps pushed): the two then wait for each
    other (PyTorch issue 56297). Under ``membudget run torchrun ...`` on the
    CPU, 3 of 22 two-rank runs had a worker hang at exit this way. Before the
    script's globals go, this thread lets go of the GIL for a moment so such
    workers can finish: 0 of 20 hung after (``bench/RESULTS.md``, session
    32). ``membudget run`` also does so when the script calls
    ``sys.exit()``, whose exception holds the globals until it is handled.
    ``install()`` runs this at exit too, before ``__main__``'s globals go,
    for scripts that install in code; a script that raises keeps its globals
    through the exception Python reports until after that."""
    if "torch.distributed" in sys.modules:
        import time

        time.sleep(0.05)


def _manage_threads_started_from_now() -> None:
    """Threads started from here on push membudget's hooks before their
    ``run()`` (Note [Threads started after install()])."""
    global _thread_bootstrap
    if _thread_bootstrap is not None:
        return
    original = threading.Thread._bootstrap_inner

    @functools.wraps(original)
    def bootstrap_with_hooks(thread):
        pushed = _hooks_thread is not None and _push_hooks_on_started_thread(thread)
        try:
            original(thread)
        finally:
            if pushed:
                try:
                    _stop_recording_on_ending_thread()
                finally:  # whatever happens, nothing of ours stays in the thread-locals
                    _pop_hooks_of_ending_thread()
                    _func_transforms.started_thread_ended()

    threading.Thread._bootstrap_inner = bootstrap_with_hooks
    _thread_bootstrap = original


def _push_hooks_on_started_thread(thread: threading.Thread) -> bool:
    """Pushes the native hooks on this (new) thread unless it is a daemon;
    True when pushed. A failure is reported and leaves the thread
    unmanaged, never fails it."""
    try:
        native = load_extension()
        if thread.daemon:
            native.note_thread_started_after_install(False)
            return False
        pack, unpack = _started_thread_hooks or (native.pack, native.unpack)
        recorder = _started_thread_recorder
        torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)
        native.note_thread_started_after_install(True, recorder is not None)
        _func_transforms.allow_transforms_on_started_thread(pack, unpack)
        # Note [Recording on started threads] (csrc/torch/lineage_recorder.cpp).
        if recorder == "cxx":
            native.lineage.start_on_this_thread()
        elif recorder is not None:
            from .lineage import LineageMode, track_function_forwards

            track_function_forwards(native, True, recorder)
            mode = LineageMode(recorder)
            mode.__enter__()
            _started_thread_mode.mode = mode
        return True
    except Exception as error:  # pragma: no cover - defensive: a thread must start whatever happens
        import warnings

        warnings.warn(f"membudget: thread {threading.current_thread().name!r} runs unmanaged: {error}",
                      RuntimeWarning, stacklevel=2)
        return False


def _stop_recording_on_ending_thread() -> None:
    """Stops this ending thread's recorder, while it still holds the GIL:
    the C++ callback, or the Python recorder's mode and the custom Function
    tracker, which torch keeps in C++ thread-locals too (the reason hooks
    are popped as a thread ends, below). A mode the thread's own code left
    above ours stays, as it would without membudget."""
    native = load_extension()
    native.lineage.stop_on_this_thread()  # a no-op where it did not record
    mode = getattr(_started_thread_mode, "mode", None)
    if mode is not None:
        _started_thread_mode.mode = None
        # This thread's tracker only: lineage.track_function_forwards would
        # also turn the query off for the install thread.
        native.lineage.track_function_forwards(False)
        if _mode_on_top(mode):
            mode.__exit__(None, None, None)


def _pop_hooks_of_ending_thread() -> None:
    """Empties this ending thread's hook stack while it still holds the GIL
    (Note [Threads started after install()]): left to the thread's C++
    thread-locals, the hooks were released after the thread had let go of
    the interpreter, racing its exit."""
    try:
        while _func_transforms._top_hooks() is not None:
            torch._C._autograd._pop_saved_tensors_default_hooks()
    except AttributeError:  # torch < 2.8 cannot show the top: ours, at the bottom, are what is left
        try:
            torch._C._autograd._pop_saved_tensors_default_hooks()
        except RuntimeError:  # the thread's own code popped them: nothing is left
            pass


def _leave_threads_started_from_now() -> None:
    """Threads started from here on start as torch would have them."""
    global _thread_bootstrap
    if _thread_bootstrap is not None:
        threading.Thread._bootstrap_inner = _thread_bootstrap
        _thread_bootstrap = None


def _cost_model_name(device: torch.device) -> str:
    """The cost model the planner prices recomputation with on ``device``."""
    return _cuda_device_model(device).name if device.type == "cuda" else "cpu-host"


def _cuda_device_model(device: torch.device):
    """The cost model's closest device for a CUDA device (by name)."""
    from .costs import device_model

    name = torch.cuda.get_device_name(device).lower()
    for key, model in (("h200", "h200"), ("h100", "h200"), ("a100", "a100-40gb"), ("4090", "rtx4090")):
        if key in name:
            return device_model(model)
    return device_model("a100-40gb")


def _push_hooks(native, config: Config, plan, device: torch.device, recording: bool) -> None:
    """Saved-tensor hooks, plus the lineage mode when recomputation is allowed."""
    global _lineage, _lineage_mode, _started_thread_hooks, _started_thread_recorder
    _started_thread_hooks, _started_thread_recorder = (native.pack, native.unpack), None
    # Without a budget nothing is ever evicted: recording lineage would only
    # cost time (and the unmanaged peak is measured this way).
    if not recording:
        native.set_recompute_callback(None)
        _push_saved_tensor_hooks(native.pack, native.unpack)
        _wrap_autograd_entry_points()  # Note [Backward tasks an error left queued]
        return
    from .lineage import Lineage, LineageMode, hide_from_dynamo, track_function_forwards
    from .replay import rebuild_entry, rebuild_entry_on_stream

    if resolve_lineage(config.lineage, device.type) == "cxx":
        _push_native_recorder(native, plan, device)
        return
    lineage = Lineage(native, plan, _cuda_device_model(device) if device.type == "cuda" else None)
    handle_type = native.SavedActivation
    native_pack, native_unpack = native.pack, native.unpack

    def pack(tensor):
        handle = native_pack(tensor)
        if type(handle) is handle_type:
            lineage.on_pack(handle, tensor)
        return handle

    def unpack(handle):
        lineage.note_unpack()
        return native_unpack(handle)

    recompute = _recompute_callback(device, lambda entry_id: rebuild_entry(lineage, entry_id),
                                    lambda entry_id, stream: rebuild_entry_on_stream(lineage, entry_id, stream))

    for function in (pack, unpack, recompute, _rearm, _park_for_step, _unpark_after_step, _release_lineage_at_step):
        hide_from_dynamo(function)
    native.set_recompute_callback(recompute)
    _push_saved_tensor_hooks(pack, unpack)
    track_function_forwards(native, True, lineage)
    _lineage_mode = LineageMode(lineage)
    _lineage_mode.__enter__()
    _lineage = lineage
    _started_thread_hooks, _started_thread_recorder = (pack, unpack), lineage
    _wrap_autograd_entry_points()


def _push_saved_tensor_hooks(pack, unpack) -> None:
    """Push membudget's saved-tensor hooks on this thread, and let torch.func
    transforms run beside them (Note [torch.func transforms run unmanaged] in
    ``_func_transforms.py``)."""
    torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)
    _func_transforms.allow_transforms(pack, unpack)


def _recompute_callback(device: torch.device, rebuild, rebuild_on_stream):
    """The manager's recompute callback for either recorder: ``rebuild(id)``
    on demand, ``rebuild_on_stream(id, stream)`` for a replay ahead on CUDA,
    on one side stream made on first use (Note [Recompute ahead])."""
    side_stream = []

    def recompute(entry_id, ahead=False):
        if ahead and device.type == "cuda":
            if not side_stream:
                side_stream.append(torch.cuda.Stream(device))
            return rebuild_on_stream(entry_id, side_stream[0])
        return rebuild(entry_id)

    return recompute


def _push_native_recorder(native, plan, device: torch.device) -> None:
    """The hooks with the C++ recorder (``MEMBUDGET_LINEAGE=cxx``,
    :mod:`membudget.lineage_native`). Its callback is switched off for
    ``backward()`` and ``autograd.grad()`` as the mode is popped (their ops
    are not recorded either way; off, they skip the callback's argument
    boxing). Optimizer steps are not parked: they run under ``no_grad``,
    which the callback checks first, and a step that raised would otherwise
    leave the next forward unrecorded."""
    global _lineage, _started_thread_hooks, _started_thread_recorder
    from .lineage import hide_from_dynamo
    from .lineage_native import NativeLineage

    lineage = NativeLineage(native, plan, _cuda_device_model(device) if device.type == "cuda" else None)
    pack, unpack = _hooks_for_native_recorder(native)
    recompute = _recompute_callback(device, lineage.rebuild, lineage.rebuild_on_stream)

    for function in (recompute, _release_lineage_at_step):
        hide_from_dynamo(function)
    native.set_recompute_callback(recompute)
    _push_saved_tensor_hooks(pack, unpack)
    lineage.start()
    _lineage = lineage
    _started_thread_hooks, _started_thread_recorder = (pack, unpack), "cxx"
    _wrap_autograd_entry_points()  # Note [Backward without the lineage mode]; steps need no parking


def _hooks_for_native_recorder(native) -> Tuple[Callable, Callable]:
    """The saved-tensor hooks that feed the C++ recorder: made once per
    process, since threads started under one install keep them through
    later ones and they are told apart by identity
    (:func:`membudget._func_transforms._ours_here`)."""
    global _native_recorder_hooks
    if _native_recorder_hooks is not None:
        return _native_recorder_hooks
    from .lineage import hide_from_dynamo

    handle_type = native.SavedActivation
    native_pack, native_unpack = native.pack, native.unpack
    on_pack, note_unpack = native.lineage.on_pack, native.lineage.note_backward

    def pack(tensor):
        handle = native_pack(tensor)
        if type(handle) is handle_type:
            on_pack(handle.entry_id, tensor)
        return handle

    def unpack(handle):
        note_unpack()
        return native_unpack(handle)

    hide_from_dynamo(pack)
    hide_from_dynamo(unpack)
    _native_recorder_hooks = (pack, unpack)
    return _native_recorder_hooks


def _mode_of_this_thread():
    """The Python recorder's mode on this thread: the install thread's, or
    the one a thread started after install() entered; None elsewhere."""
    if threading.get_ident() == _hooks_thread:
        return _lineage_mode
    return getattr(_started_thread_mode, "mode", None)


def _mode_on_top(mode) -> bool:
    depth = torch._C._len_torch_dispatch_stack()
    return depth > 0 and torch._C._get_dispatch_stack_at(depth - 1) is mode


def _without_lineage_mode(function):
    """``function`` run with the lineage mode popped when it tops this
    thread's dispatch stack (Note [Backward without the lineage mode])."""
    from torch.utils._python_dispatch import _pop_mode_temporarily

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        mode = _mode_of_this_thread()
        if _lineage_mode is None and _lineage is not None and _lineage.records_here():
            return _lineage.without_recording(function, args, kwargs)  # the C++ recorder
        if mode is None or not _mode_on_top(mode):
            return function(*args, **kwargs)
        with _pop_mode_temporarily():
            return function(*args, **kwargs)

    return wrapper


def _release_lineage_at_step(optimizer, args, kwargs) -> None:
    """Global optimizer step pre-hook: the step ends a training step, the
    recorder may let go of what its last forward held (Note [Lineage
    released between steps] in ``lineage.py``): on any thread that records
    (the install thread, threads started after it); it releases only once
    backward has run and autograd holds no entry, so a step on one thread
    cannot take what another thread's forward is using."""
    lineage = _lineage
    if lineage is None:
        return
    if _lineage_mode is None:
        records = lineage.records_here()  # the C++ recorder
    else:
        records = _mode_of_this_thread() is not None
    if records:
        lineage.release_if_idle()


def _park_for_step(optimizer, args, kwargs) -> None:
    """Global optimizer step pre-hook: the mode leaves the stack for the step."""
    global _parked_depth, _rearm_hook
    if (_lineage_mode is None or not _parking_allowed or _parked_depth is not None
            or threading.get_ident() != _hooks_thread or not _mode_on_top(_lineage_mode)):
        return
    _lineage_mode.__exit__(None, None, None)
    _parked_depth = torch._C._len_torch_dispatch_stack()
    _rearm_hook = torch.nn.modules.module.register_module_forward_pre_hook(_rearm)


def _unpark_after_step(optimizer, args, kwargs) -> None:
    """Global optimizer step post-hook: the mode is back for what follows."""
    if (_parked_depth is None or threading.get_ident() != _hooks_thread
            or torch._C._len_torch_dispatch_stack() != _parked_depth):
        return
    _unpark()
    _lineage_mode.__enter__()


def _unpark() -> None:
    global _parked_depth, _rearm_hook
    if _rearm_hook is not None:
        _rearm_hook.remove()
    _rearm_hook = None
    _parked_depth = None


def _rearm(module, args) -> None:
    """Module forward pre-hook while parked (a step raised, or runs forward)."""
    if (_parked_depth is None or threading.get_ident() != _hooks_thread or not torch.is_grad_enabled()
            or torch._C._current_graph_task_id() != -1 or torch._C._len_torch_dispatch_stack() != _parked_depth):
        return
    _unpark()
    _lineage_mode.__enter__()


def _draining_after_error(function, backward):
    """Note [Backward tasks an error left queued]: when a node raises in
    backward (an out-of-memory error, an unpack that failed), torch's engine
    returns as soon as the graph task holds the error, and the tasks already
    queued on this thread's ready queue stay there, each holding its node
    and through it the rest of the failed step's graph: its saved
    activations, membudget entries that still count against the budget,
    until this thread's next backward pops them. A retry (a batch-size
    finder's smaller batch) then ran its forward beside them, and
    ``uninstall()`` left them allocated: a GPT-2 run that ran out of memory
    in a recompute kept 2.9 MB and its parameters (``bench/RESULTS.md``,
    session 36). Which tasks were queued depends on where the error struck,
    so it leaked in some runs and not others. After an outermost backward
    raised, ``backward`` of one throwaway leaf on this thread pops them now:
    tasks of a graph task that is gone come first and are dropped unrun.
    (The recorder cannot let go of that forward here: the caller's frame
    still holds its loss while the error rises. It does at the next step's
    optimizer step, or at ``uninstall()``.)"""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        if torch._C._current_graph_task_id() != -1:
            return function(*args, **kwargs)  # inside a backward: the outermost one drains
        try:
            return function(*args, **kwargs)
        except BaseException:
            _drain_backward_tasks(backward)
            raise

    return wrapper


def _drain_backward_tasks(backward) -> None:
    # The leaf is made with recording off too: recorded, it was the first op
    # after backward began, and began a forward the retry's did not.
    try:
        _without_lineage_mode(_backward_of_a_throwaway_leaf)(backward)
    except Exception:  # the error being raised is the one to report (inference mode, say)
        pass


def _backward_of_a_throwaway_leaf(backward) -> None:
    backward(torch.zeros((), requires_grad=True))


def _wrap_autograd_entry_points() -> None:
    global _autograd_originals, _optimizer_hooks
    if _autograd_originals is None:
        _autograd_originals = (torch.autograd.backward, torch.autograd.grad)
        backward, grad = (_without_lineage_mode(function) for function in _autograd_originals)
        torch.autograd.backward = _draining_after_error(backward, backward)
        torch.autograd.grad = _draining_after_error(grad, backward)
    if _optimizer_hooks is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        _optimizer_hooks = (register_optimizer_step_pre_hook(_release_lineage_at_step),
                            register_optimizer_step_pre_hook(_park_for_step),
                            register_optimizer_step_post_hook(_unpark_after_step))


def _restore_autograd_entry_points() -> None:
    global _autograd_originals, _optimizer_hooks
    if _autograd_originals is not None:
        torch.autograd.backward, torch.autograd.grad = _autograd_originals
        _autograd_originals = None
    if _optimizer_hooks is not None:
        for handle in _optimizer_hooks:
            handle.remove()
        _optimizer_hooks = None


def _pop_hooks() -> None:
    global _lineage, _lineage_mode, _parking_allowed, _started_thread_hooks, _started_thread_recorder
    # Held here, the Python recorder's Lineage (and through its pack hook)
    # kept the last forward's inputs, a whole model, alive after uninstall().
    _started_thread_hooks, _started_thread_recorder = None, None
    if _lineage is not None and _lineage_mode is None:  # the C++ recorder
        _restore_autograd_entry_points()
        _lineage.stop()
        _lineage = None
    if _lineage_mode is not None:
        _lineage.retire()  # modes left on started threads pass through from now on
        _restore_autograd_entry_points()
        if _parked_depth is not None:
            _unpark()  # already off the stack
        else:
            _lineage_mode.__exit__(None, None, None)
        from .lineage import track_function_forwards

        track_function_forwards(load_extension(), False)
        _lineage_mode = None
        _lineage = None
        _parking_allowed = True
    _restore_autograd_entry_points()  # swap only, or no budget: the drain alone
    torch._C._autograd._pop_saved_tensors_default_hooks()


def uninstall() -> None:
    """Stop managing new activations and, on the CPU, give torch back its own
    allocator. Memory membudget already handed out stays valid and is freed
    through membudget as usual; saved activations already packed still unpack.
    The CUDA pluggable allocator cannot be swapped out within a process, so on
    CUDA only the saved-tensor management stops. Call from the thread that
    called :func:`install`."""
    global _hooks_thread
    native = load_extension()
    with _state_lock:
        if _hooks_thread is not None:
            if _hooks_thread != threading.get_ident():
                raise RuntimeError("membudget.uninstall() must run on the thread that called install()")
            _pop_hooks()
            _hooks_thread = None
            _leave_threads_started_from_now()
            # Only an entry autograd holds can still need a replay (Note
            # [Entries only lineage holds] in saved_activation.cpp). Kept, the callback
            # held the Python recorder's lineage, and through it the model
            # of a step that raised (out of memory) before its optimizer
            # step let go of it: 2 MiB stayed allocated after uninstall(),
            # and the next run in the process started with them. With such
            # an entry alive (uninstall() inside the step's `except`), the
            # release waits for it (Note [Lineage let go once nothing is
            # saved] in saved_activation.cpp).
            native.release_lineage_once_unsaved()
        _checkpoint_regions.keep_regions()
        _compiled_under_budget.leave_compiles()
        _func_transforms.restore()
        native.uninstall_runtime()


def _bounded_by_memory_fraction(budget_bytes: int, capacity: int) -> int:
    """``budget_bytes`` (0: none) bounded by the memory fraction set (Note
    [Memory fraction as a budget])."""
    if _memory_fraction is None or _memory_fraction >= 1.0:
        return budget_bytes
    cap = max(int(_memory_fraction * capacity), 1)  # a fraction of 0 allows nothing, as torch's does, not "no budget"
    return cap if budget_bytes == 0 else min(budget_bytes, cap)


def set_memory_fraction(fraction: float, device_index: int) -> None:
    """``torch.cuda.set_per_process_memory_fraction`` under membudget (Note
    [Memory fraction as a budget]): bounds the budget of the managed device
    from now on; another device's fraction is ignored, as membudget serves
    no other device. Set after an ``install()`` that had no budget, the
    bound is enforced by swapping: whether forward records lineage for
    recomputation was decided at ``install()``."""
    global _memory_fraction
    if not 0.0 <= float(fraction) <= 1.0:
        raise ValueError(f"membudget: memory fraction {fraction} is not between 0 and 1")
    with _state_lock:
        if _managed_device is None or device_index != managed_device_index():
            return
        _memory_fraction = float(fraction)
        native = load_extension()
        native.set_budget_bytes(_bounded_by_memory_fraction(_install_budget_bytes,
                                                            _device_capacity(native, _managed_device)))


def memory_fraction(device_index: int) -> float:
    """``torch.cuda.get_per_process_memory_fraction`` under membudget: the
    fraction set for the managed device, else 1.0 (torch's default)."""
    if _memory_fraction is None or device_index != managed_device_index():
        return 1.0
    return _memory_fraction


# Note [Free memory as the budget sees it]: torch.cuda.mem_get_info() (and
# torch.accelerator.get_memory_info()) report the device's free and total
# memory, and scripts and libraries size what they put on the device by it:
# accelerate's and transformers' device_map="auto" place weights up to the
# free memory, transformers' continuous batching sizes its KV cache by it.
# Under a budget they sized for a device membudget does not give them, and
# the first step then held nothing but weights and cache within the budget
# (out of memory, or every activation evicted). Under a budget the managed
# device answers as if the budget were the device: total is the budget (the
# device's total where that is smaller), free is the budget less what
# membudget's allocator reserves -- as the device's own free excludes what
# torch's cache holds -- or the device's free where that is smaller (other
# processes use it too). Evictable activations are not counted free: what is
# sized by this call (weights, caches) stays resident, and counting them
# would leave the budget no room for the activations it must then hold.
def memory_info_under_budget(device_index: int, device_free: int, device_total: int) -> Tuple[int, int]:
    """``(free, total)`` bytes of device ``device_index`` as a script under
    membudget should see them (Note [Free memory as the budget sees it]),
    from the device's own ``device_free`` and ``device_total``: unchanged
    without a budget, before install and for a device membudget does not
    manage."""
    if _managed_device is None or device_index != managed_device_index():
        return device_free, device_total
    stats = load_extension().memory_stats()
    budget = int(stats.get("budget_bytes", 0))
    if budget <= 0:
        return device_free, device_total
    headroom = max(budget - int(stats["reserved_bytes.all.current"]), 0)
    return min(headroom, device_free), min(budget, device_total)


def managed_device_index() -> int:
    """The index of the device the runtime manages (0 on the CPU, and before
    install)."""
    device = _managed_device
    return device.index or 0 if device is not None and device.type == "cuda" else 0


def is_installed() -> bool:
    """True while membudget manages saved activations in this process."""
    return bool(load_extension().managing())

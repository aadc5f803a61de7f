"""torch.func transforms while membudget is installed.

Where this sits in the flow: ``install()`` calls :func:`allow_transforms` with
the saved-tensor hooks it pushed; ``uninstall()`` calls :func:`restore`.

Note [torch.func transforms run unmanaged]: ``torch.func.grad``, ``vjp``,
``jacrev`` and ``hessian`` (and ``grad_and_value``, ``vmap`` over any of
them) enter ``torch.autograd.graph.disable_saved_tensors_hooks``, which raises
when any saved-tensor hooks are pushed on the thread. membudget's stay pushed
while it is installed, so a script using them (per-sample gradients,
meta-learning's inner loops, Jacobian penalties) failed under ``membudget run``
where plain PyTorch runs: "torch.func.{grad, vjp, jacrev, hessian} don't yet
support saved tensor hooks", with nothing naming membudget.

While installed, that context manager is replaced by one that, on the install
thread and when membudget's hooks top the hook stack, takes them off for the
transform and pushes them back after it. Threads started after ``install()``
push the install's hooks as they start (Note [Threads started after
install()] in ``_runtime.py``): there the same is done for that pair, and
the context manager stays replaced after ``uninstall()`` while such a thread
lives, since its hooks do. Inside a transform nothing is packed:
what it saves is held the way plain PyTorch holds it, never swapped or
dropped, and counts toward the budget like any other allocation. Outside it
everything is managed as before. The lineage recorder stays on, so that a
write inside a transform to a tensor recorded ops read is still seen (Note
[Written where nothing records] in ``lineage.py``). Where hooks other than
membudget's top the stack (a ``save_on_cpu`` region, a user's own), torch
refuses exactly as it would without membudget. torch older than 2.8 cannot
show the top of the hook stack, so there the transforms still refuse, with a
message that says why.

Why the context manager and not the transforms: they are decorated at import
(``doesnt_support_saved_tensors_hooks`` in ``torch/_functorch/vmap.py``) and
users hold them under their own names (``from torch.func import grad``); the
decorator looks the context manager up on ``torch.autograd.graph`` each time
it runs. Under ``torch.compile`` a transform used to fail while tracing (torch's
context manager refuses there too); ours is hidden from Dynamo, so the frame
that calls the transform is skipped and runs eagerly, with the same results.
"""
from __future__ import annotations

import threading
from typing import Callable, Optional, Tuple

import torch
import torch.autograd.graph as _graph

__all__ = ["allow_transforms", "allow_transforms_on_started_thread", "started_thread_ended", "restore"]

_original: Optional[Callable] = None      # torch's context manager while ours stands in
_thread: Optional[int] = None             # the install thread
_hooks: Optional[Tuple[Callable, Callable]] = None  # membudget's (pack, unpack)
_started_here = threading.local()         # .hooks: what a thread started after install() pushed
_started_alive = 0                        # how many of those threads have not ended
_lock = threading.Lock()

_OLD_TORCH = ("membudget: torch.func transforms refuse saved-tensor hooks, and this torch ({}) cannot show "
              "whether the hooks on top are membudget's; upgrade to torch >= 2.8, or call "
              "membudget.uninstall() around the transform")


def _top_hooks():
    """The (pack, unpack) pair on top of this thread's hook stack, None when
    it is empty; raises AttributeError where torch cannot tell."""
    top = torch._C._autograd._top_saved_tensors_default_hooks
    try:
        return top(True)  # ignore_is_tracing: the stack as pushed
    except TypeError:
        return top()


def _on_top(hooks: Optional[Tuple[Callable, Callable]]) -> bool:
    """Whether ``hooks`` top this thread's hook stack."""
    if hooks is None:
        return False
    try:
        top = _top_hooks()
    except AttributeError:
        raise RuntimeError(_OLD_TORCH.format(torch.__version__)) from None
    return top is not None and top[0] is hooks[0] and top[1] is hooks[1]


def _ours_here() -> Optional[Tuple[Callable, Callable]]:
    """membudget's hooks when they top this thread's stack, else None: the
    install thread's, or those a thread started after install() pushed."""
    hooks = _hooks
    if threading.get_ident() == _thread and _on_top(hooks):
        return hooks
    started = getattr(_started_here, "hooks", None)
    if started is not None and _on_top(started):
        return started
    return None


class _DisableBesideMembudget:
    """torch's ``disable_saved_tensors_hooks`` with membudget's hooks off the
    stack for its duration when they are on top (Note [torch.func transforms
    run unmanaged]). Hidden from Dynamo: a compiled transform is skipped and
    runs eagerly, as it must, since torch's own context manager cannot run
    with membudget's hooks pushed there either."""

    def __init__(self, error_message: str):
        self._error_message = error_message
        self._inner = None
        self._popped = None

    @torch.compiler.disable
    def __enter__(self):
        hooks = _ours_here()
        if hooks is not None:
            torch._C._autograd._pop_saved_tensors_default_hooks()
            self._popped = hooks
        self._inner = (_original or _graph.disable_saved_tensors_hooks)(self._error_message)
        try:
            self._inner.__enter__()
        except BaseException:
            self._push_back()
            raise
        return None

    @torch.compiler.disable
    def __exit__(self, *exc_info):
        try:
            return self._inner.__exit__(*exc_info)
        finally:
            self._push_back()

    def _push_back(self) -> None:
        if self._popped is not None:
            torch._C._autograd._push_saved_tensors_default_hooks(*self._popped)
            self._popped = None


def _stand_in() -> None:
    global _original
    if _original is None:
        _original = _graph.disable_saved_tensors_hooks
        _graph.disable_saved_tensors_hooks = _DisableBesideMembudget


def allow_transforms(pack: Callable, unpack: Callable) -> None:
    """Let torch.func transforms run on the calling thread, which has just
    pushed ``pack``/``unpack``: unmanaged inside them, managed outside."""
    global _thread, _hooks
    with _lock:
        _stand_in()
        _thread = threading.get_ident()
        _hooks = (pack, unpack)


def allow_transforms_on_started_thread(pack: Callable, unpack: Callable) -> None:
    """The same for a thread started after install(), which has just pushed
    ``pack``/``unpack``; pair with :func:`started_thread_ended`."""
    global _started_alive
    _started_here.hooks = (pack, unpack)
    with _lock:
        _stand_in()
        _started_alive += 1


def started_thread_ended() -> None:
    """A thread that called :func:`allow_transforms_on_started_thread` ends:
    once none is left and membudget is uninstalled, torch's own context
    manager is back."""
    global _started_alive
    _started_here.hooks = None
    with _lock:
        _started_alive -= 1
        if _started_alive == 0 and _thread is None:
            _restore_original()


def _restore_original() -> None:
    global _original
    if _original is not None:
        _graph.disable_saved_tensors_hooks = _original
    _original = None


def restore() -> None:
    """Give torch its own context manager back (a no-op when it has it),
    unless a thread started after install() still has membudget's hooks."""
    global _thread, _hooks
    with _lock:
        _thread = None
        _hooks = None
        if _started_alive == 0:
            _restore_original()

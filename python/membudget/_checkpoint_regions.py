"""Gradient checkpointing under a budget: checkpoint regions run as plain code.

Where this sits in the flow: ``install()`` calls :func:`replace_regions` when a
budget is set and ``MEMBUDGET_CHECKPOINT`` is ``replace`` (the default), and
:func:`keep_regions` otherwise and at ``uninstall()``.

Note [Checkpoint regions under a budget]: a non-reentrant
``torch.utils.checkpoint`` region pushes its own saved-tensor hooks, which win
over membudget's inside it (innermost wins). In backward it runs the region
again and holds every tensor it saved until backward reads it, in its own
frame, where no membudget hook sees it: nothing there can be swapped or
dropped. So a model with gradient checkpointing on could fit less under a
budget than the same model without it: transformers' GPT-2 (tests' config)
trained in 10.29 MiB with checkpointing off (72 MiB swapped, 2 replays) and ran
out of memory with it on ("evictable 0 B"). Under a budget membudget already
decides, per tensor, what to drop and replay (or swap) and only where the
budget needs it, so the region runs as plain forward code instead: its
activations are saved through membudget like any others. The results are the
same: the checkpoint would replay the very ops, under the RNG state it
restores, and forward consumes the same random numbers either way
(tests/test_checkpoint_regions.py compares losses and parameters bit for bit
against the plain checkpointed run).

Only regions with the default ``context_fn`` are replaced: a custom one
(selective activation checkpointing) chooses what to keep, which is the
user's plan, not ours. Regions whose second run differs from their first
are left as torch's too, since replacing them would change results: with
``preserve_rng_state=False`` the re-run draws new random numbers (other
dropout masks in backward, and the global generator advanced twice), and a
region that updates batch-norm running statistics updates them again when
re-run (``num_batches_tracked`` counts 2 a step). The second is detected on
what can be seen: a module (or a module's bound method) as the region, with a
batch-norm-like module in training mode inside; other side effects of a
region written as a closure are not visible here, and happen once
(``MEMBUDGET_CHECKPOINT=keep`` keeps every region as torch's). Reentrant checkpoints (``use_reentrant=True``) are left
as they are: they save their inputs through membudget's hooks and re-run the
region inside backward, where what they save is packed by membudget too; and
running one as plain code would change which gradients exist when no input
requires grad. Only the thread that called ``install()`` is affected, since
only it has membudget's hooks (Note [Hooks are per thread] in _runtime.py),
and only ``torch.utils.checkpoint.checkpoint`` (and what calls it, such as
``checkpoint_sequential``): ``torch.distributed._composable.checkpoint``
imports the generator by name, so it keeps whichever one was in place when it
was imported (ours, imported while installed, hands over to torch's once
uninstalled).
``torch.compile`` does not call the patched function: Dynamo turns a
checkpoint into its own higher-order op before it.
"""
from __future__ import annotations

import threading
from typing import Optional

import torch.utils.checkpoint as _torch_checkpoint
from torch import nn

__all__ = ["replace_regions", "keep_regions"]

_GENERATOR = "_checkpoint_without_reentrant_generator"
_original = None                    # torch's generator while ours stands in for it
_thread: Optional[int] = None       # the thread whose regions run as plain code


def _plain_region(function, preserve_rng_state, context_fn, *args, **kwargs):
    """Stands in for torch's non-reentrant checkpoint generator, which
    ``checkpoint()`` calls with these leading arguments: on the install thread
    and with the default ``context_fn`` it sets nothing up (``checkpoint()``
    then simply calls ``function``); elsewhere it is torch's."""
    original = _original
    if (original is None or threading.get_ident() != _thread or context_fn is not _torch_checkpoint.noop_context_fn
            or not preserve_rng_state or _updates_running_statistics(function)):
        original = original or getattr(_torch_checkpoint, _GENERATOR)
        yield from original(function, preserve_rng_state, context_fn, *args, **kwargs)
        return
    yield


def _updates_running_statistics(function) -> bool:
    """Whether ``function`` is a module (or a module's bound method) holding a
    batch-norm-like module that updates running statistics when run."""
    owner = function if isinstance(function, nn.Module) else getattr(function, "__self__", None)
    if not isinstance(owner, nn.Module):
        return False
    return any(module.training and getattr(module, "track_running_stats", False)
               and getattr(module, "running_mean", None) is not None for module in owner.modules())


def replace_regions() -> bool:
    """Run non-reentrant checkpoint regions on the calling thread as plain
    forward code (Note [Checkpoint regions under a budget]). Returns False,
    changing nothing, where this torch has no such generator to stand in for."""
    global _original, _thread
    if _original is None:
        original = getattr(_torch_checkpoint, _GENERATOR, None)
        if original is None:
            return False
        _original = original
        setattr(_torch_checkpoint, _GENERATOR, _plain_region)
    _thread = threading.get_ident()
    return True


def keep_regions() -> None:
    """Give torch its own checkpoint generator back (a no-op when it has it)."""
    global _original, _thread
    if _original is not None:
        setattr(_torch_checkpoint, _GENERATOR, _original)
    _original = None
    _thread = None

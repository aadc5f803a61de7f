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

Only regions with the default ``context_fn``, or with selective activation
checkpointing's (Note [Selective checkpoints as a plan]), are replaced: any
other custom one sets up what its author chose, which we cannot read.
Regions whose second run differs from their first
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

import inspect
import threading
from typing import Optional

import torch
import torch.utils.checkpoint as _torch_checkpoint
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["replace_regions", "keep_regions"]

_GENERATOR = "_checkpoint_without_reentrant_generator"
_original = None                    # torch's generator while ours stands in for it
_thread: Optional[int] = None       # the thread whose regions run as plain code


def _plain_region(function, preserve_rng_state, context_fn, *args, **kwargs):
    """Stands in for torch's non-reentrant checkpoint generator, which
    ``checkpoint()`` calls with these leading arguments: on the install thread
    and with the default ``context_fn`` it sets nothing up (``checkpoint()``
    then simply calls ``function``), with selective checkpointing's it runs
    the region under the user's policy as a plan (Note [Selective checkpoints
    as a plan]); elsewhere it is torch's."""
    original = _original
    replace = (original is not None and threading.get_ident() == _thread and preserve_rng_state
               and not _updates_running_statistics(function))
    policy = None
    if replace and context_fn is not _torch_checkpoint.noop_context_fn:
        contexts = context_fn()
        policy = _selective_policy(contexts)
        replace = policy is not None
        if not replace:  # torch's, with the contexts made once, not twice
            context_fn = lambda: contexts  # noqa: E731
    if not replace:
        original = original or getattr(_torch_checkpoint, _GENERATOR)
        yield from original(function, preserve_rng_state, context_fn, *args, **kwargs)
        return
    if policy is None:
        yield
        return
    plan = _PolicyAsPlan(policy)
    with plan:
        try:
            yield
        except BaseException:  # the region raised (thrown in by checkpoint(), or the generator closed)
            plan.forget()
            raise
    plan.drop_what_it_recomputes()


# Note [Selective checkpoints as a plan]: selective activation checkpointing
# (context_fn=partial(create_selective_checkpoint_contexts, policy)) asks the
# user's policy, op by op, whether to keep an output (MUST_SAVE, PREFER_SAVE)
# or to recompute it in backward; what it keeps is held in its own cache and
# everything else in its frame while backward re-runs the region, none of
# which membudget can evict. A model checkpointed so fitted no budget below
# 90% of its own peak ("evictable 0 B": session 40's probe,
# bench/RESULTS.md). Under a budget the region now runs as plain code, as a
# default region does, and the policy becomes a plan: the outputs of the
# ops it would recompute are planned drops once the region returns, so what
# stays resident is what the policy keeps, as under torch; the budget can
# evict more, and every drop is replayed exactly. Outputs on a
# storage one of the op's inputs has (a view, an in-place result, or an op
# that aliases without saying so: _unsafe_view after mm, unsafe_split) are
# not planned: that storage is another op's, whose own answer stands. As in
# torch's eager caching mode, every answer but MUST_SAVE and PREFER_SAVE
# (the CPU offload ones too) means recompute, and the policy is asked about
# every op torch's mode would ask about, in the same order. Swap-only
# actions plan nothing. A region nested in another plans, as it returns,
# what the outer one remembered so far too (dropped early only if nothing
# holds it any more). The policy is read from the forward context
# create_selective_checkpoint_contexts returns (its policy_fn); a context_fn
# of any other shape stays torch's.
def _selective_policy(contexts):
    """The policy of the contexts a selective checkpoint's ``context_fn``
    made, or None for contexts of any other kind."""
    caching = getattr(_torch_checkpoint, "_CachingTorchDispatchMode", None)
    forward = contexts[0] if isinstance(contexts, tuple) and len(contexts) == 2 else None
    return getattr(forward, "policy_fn", None) if caching is not None and isinstance(forward, caching) else None


class _PolicyAsPlan(TorchDispatchMode):
    """Asks a selective checkpoint's policy about each op of a region run as
    plain code, and remembers (weakly) the storages of the outputs it would
    recompute (Note [Selective checkpoints as a plan])."""

    def __init__(self, policy):
        super().__init__()
        from ._native import load_extension

        self._policy = policy
        self._native = load_extension()
        self._ignored = getattr(_torch_checkpoint, "SAC_IGNORED_OPS", set())
        self._keep = {_torch_checkpoint.CheckpointPolicy.MUST_SAVE, _torch_checkpoint.CheckpointPolicy.PREFER_SAVE}

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Off while Dynamo traces, as torch's own caching mode and
        LineageMode (Note [Compiled beside the mode] in lineage.py): a
        compiled block inside the region still compiles."""
        return True

    def drop_what_it_recomputes(self) -> int:
        """plan_drop the live entries on the remembered storages; how many."""
        return self._native.plan_drop_remembered(True)

    def forget(self) -> None:
        """The region raised: plan nothing (an enclosing region's storages
        remembered so far are forgotten too, which only plans less)."""
        self._native.plan_drop_remembered(False)


def _plan_dispatch(self, func, types, args=(), kwargs=None):
    kwargs = kwargs or {}
    out = func(*args, **kwargs)
    if func in self._ignored:
        return out
    policy = self._policy(_context_for(out), func, *args, **kwargs)
    if isinstance(policy, bool):  # the older spelling: True keeps
        policy = (_torch_checkpoint.CheckpointPolicy.PREFER_SAVE if policy
                  else _torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE)
    if policy not in self._keep:
        inputs = [leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]
        for leaf in tree_leaves(out):
            if type(leaf) is torch.Tensor:
                self._native.plan_drop_later(leaf, inputs)  # not if it aliases an input
    return out


# Unwrapped, as LineageMode's (Note [Raw dispatch handler] in lineage.py).
_PolicyAsPlan.__torch_dispatch__ = _plan_dispatch


def _context_for(out):
    """What the policy is handed, as torch's forward context builds it."""
    context = _torch_checkpoint.SelectiveCheckpointContext
    if _CONTEXT_TAKES_OUTPUT:
        return context(is_recompute=False, op_output=out)
    return context(is_recompute=False)


# torch >= 2.5 hands the policy the op's output; 2.4's context does not take it.
_CONTEXT_TAKES_OUTPUT = hasattr(_torch_checkpoint, "SelectiveCheckpointContext") and \
    "op_output" in inspect.signature(_torch_checkpoint.SelectiveCheckpointContext).parameters


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
        from .lineage import hide_from_dynamo

        hide_from_dynamo(_plan_dispatch)
    _thread = threading.get_ident()
    return True


def keep_regions() -> None:
    """Give torch its own checkpoint generator back (a no-op when it has it)."""
    global _original, _thread
    if _original is not None:
        setattr(_torch_checkpoint, _GENERATOR, _original)
    _original = None
    _thread = None

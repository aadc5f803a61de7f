"""Replay: rebuilding a dropped storage from its lineage, and what that costs.

Where this sits in the flow: :mod:`membudget.lineage` records forward ops;
at pack time :func:`closure` tells the residency manager whether a storage can
be rebuilt, what its own replay costs (the measured durations of every op that
must run again, down to inputs that will be available) and which managed
entries it reads. When backward unpacks a dropped entry, the native binding
calls :func:`rebuild_entry`, which replays the ops on detached inputs (no
autograd graph) with the recorded generator state restored, so the rebuilt bytes equal the originals.

Inputs of a replay come from, in order of preference: the managed entry of
that storage (made resident by the manager: swapped in, or already rebuilt —
the binding rebuilds dropped ancestors first, in order, Note [Dropped
ancestors rebuilt in order]), a tensor still alive that holds
that storage at the right version, a held external tensor (parameters, the
batch; its version must be unchanged), or a replay of the input's own lineage
into a temporary. Replays allocate through membudget under the same budget
and may evict.
"""
from __future__ import annotations

from typing import Dict, FrozenSet, Set, Tuple

import torch
from torch.utils._python_dispatch import _disable_current_modes

from .lineage import (ExternalLineage, Lineage, OpNode, StorageLineage, TensorRef, _func_info, at_last_version,
                      storage_address)

__all__ = ["RecomputeError", "closure", "rebuild_entry", "rebuild_entry_on_stream", "rescue_dependents_of"]

# A replay deeper than this many unmanaged producers is not worth it (and
# would approach Python's recursion limit); such storages are swap-only.
MAX_REPLAY_DEPTH = 200

# (replayable, seconds, managed input ids, external storage keys, why not,
# held inputs its own replay reads: Note [Held inputs freed under us] in
# csrc/core/residency_entry.h).
Closure = Tuple[bool, float, Set[int], FrozenSet[int], str, FrozenSet[ExternalLineage]]


# Note [Held inputs freed under us]: FSDP2 (fully_shard) frees each block's
# gathered parameters after its forward with untyped_storage().resize_(0)
# and gathers them into the same storage again for its backward. No version
# counter moves, so neither recorder sees it, and a replay that read such a
# parameter before it was gathered again failed deep in an op with torch's
# "data is not allocated yet". The manager now drops no entry whose replay
# would read such a storage while it is freed (Note [Held inputs freed under
# us] in csrc/core/residency_entry.h); a replay that meets one all the same
# (dropped while gathered, replayed where it is not) refuses with what to do.
_FREED_INPUT = ("membudget: an input of a dropped activation had its storage freed after forward (FSDP2 frees each "
                "block's gathered parameters so); it cannot be recomputed: train with MEMBUDGET_ACTIONS=swap")


class RecomputeError(RuntimeError):
    """A dropped activation could not be rebuilt exactly (an input changed
    since forward, or lineage is missing). Raised from backward's unpack."""


def closure(lineage: StorageLineage, version: int, top: bool = False, depth: int = 0) -> Closure:
    """(replayable, seconds, managed input ids, external storage keys, why
    not) of rebuilding ``lineage`` at ``version``; why not is the first
    obstacle met and the op it was met at, in the C++ recorder's words (Note
    [Why not recomputable] in csrc/core/residency_manager.cpp), or "".

    Not at the top, a managed storage at its current version is an input
    (read, not replayed): it costs nothing here (the manager adds the cost
    of inputs that are dropped) but must be replayable itself in case it is
    freed before this replay runs."""
    managed_input = not top and lineage.entry_id is not None and version == len(lineage.mutations)
    result = lineage.memo.get(version)
    if result is None:
        result = _replay_closure(lineage, version, depth)
        lineage.memo[version] = result
    if managed_input:
        return result[0], 0.0, {lineage.entry_id}, result[3], result[4], frozenset()
    return result


def _replay_closure(lineage: StorageLineage, version: int, depth: int, filled_by_reader: bool = False) -> Closure:
    if depth > MAX_REPLAY_DEPTH:
        return (False, 0.0, set(), frozenset(),
                f"its replay would run more than {MAX_REPLAY_DEPTH} ops deep at {lineage.producer.name}", frozenset())
    ok = True
    seconds = 0.0
    deps: Set[int] = set()
    externals: Set[int] = set()
    held: Set[ExternalLineage] = set()
    why = ""  # the first obstacle met, as the C++ recorder reports it
    if version == 0 and not filled_by_reader and _func_info(lineage.producer.func).undefined_contents:
        # Note [Contents nobody recorded] (csrc/torch/lineage_ops.cpp)
        return (False, 0.0, set(), frozenset(), "made by an op whose contents nobody recorded (an empty tensor "
                f"filled where nothing records) at {lineage.producer.name}", frozenset())
    nodes = [lineage.producer] + lineage.mutations[:version]
    for node in nodes:
        if not node.replayable:
            ok = False
            why = why or f"an op in its history cannot be replayed at {node.name}"
        seconds += node.seconds
        for ref in node.refs:
            source = ref.lineage
            if source is lineage:
                continue  # the storage being rebuilt, replayed in order
            if type(source) is ExternalLineage:
                if source.released():
                    ok = False
                    why = why or f"an input its replay reads was let go between steps at {node.name}"
                    continue
                if ref.scratch:
                    continue
                externals.add(source.key)
                held.add(source)
                if source.version() != ref.tensor_version:
                    ok = False
                    why = why or f"an input its replay reads was changed in place after it was read at {node.name}"
                continue
            if ref.version >= len(source.versions) or source.versions[ref.version] != ref.tensor_version:
                ok = False  # read after a write lineage did not see
                why = why or f"an input its replay reads was written where nothing records at {node.name}"
                continue
            if (ref.version == 0 and source.mutations and source.mutations[0] is node
                    and _func_info(source.producer.func).undefined_contents):
                # Note [An empty tensor its first writer fills]
                # (csrc/torch/lineage_replay.cpp): rrelu_with_noise's noise.
                sub = _replay_closure(source, 0, depth + 1, filled_by_reader=True)
            else:
                sub = closure(source, ref.version, depth=depth + 1)
            sub_ok, sub_seconds, sub_deps, sub_externals, sub_why, sub_held = sub
            if not sub_ok:
                ok = False
                why = why or sub_why
            seconds += sub_seconds
            deps |= sub_deps
            externals |= sub_externals
            held |= sub_held
    return ok, seconds, deps, frozenset(externals), why, frozenset(held)


def rescue_dependents_of(lineage: Lineage, target: torch.Tensor) -> None:
    """``target`` (not produced by a recorded op) is about to be written in
    place: the managed entries whose replays read it read a copy of it from
    now on where it is small (Note [Held inputs kept as a copy]); otherwise
    each is made resident now, while its inputs are intact, and becomes
    swap-only."""
    key = storage_address(target)
    rescued = []  # (entry id, whether it reads `key` only through tensors it holds)
    readers = []  # those held inputs on `key`
    refilled = False
    for entry_id, storage_lineage in list(lineage.by_entry.items()):
        memo = storage_lineage.memo.get(len(storage_lineage.mutations))
        if memo is None or not memo[0] or key not in memo[3]:
            continue
        on_key = [held for held in memo[5] if held.key == key]
        if not on_key:
            continue  # it reads `key` through a held input copied at an earlier write
        # Nor one whose rebuild now would read a freed input's storage before
        # the write fills it (Note [Writes that refill a freed input] in
        # csrc/core/residency_entry.h); and then no copy is taken: the held
        # inputs are shared, and a copy taken before the refill would hand
        # those entries what was in the freed storage.
        if lineage.native.entry_reads_refilled_input(entry_id):
            refilled = True
            continue
        rescued.append((entry_id, all(held.tensor is not None for held in on_key)))
        readers.extend(held for held in on_key if held.tensor is not None)
    if rescued and not refilled and _keep_copies_of(lineage, readers):
        rescued = [(entry_id, copyable) for entry_id, copyable in rescued if not copyable]
    for entry_id, _ in rescued:
        lineage.rescued(entry_id)


def _keep_copies_of(lineage: Lineage, readers) -> bool:
    """Note [Held inputs kept as a copy] (csrc/torch/saved_activation.cpp):
    every reader of the storage about to be written holds a copy of it from
    now on, made before the write; False (nothing changed) where it is not
    worth its bytes or does not fit. The readers leave this forward's map of
    held inputs, so that what reads the tensor after the write holds the
    tensor itself, and take the copy's key, so that later writes to the
    tensor no longer rescue what reads the copy."""
    if not readers:
        return True
    copy = lineage.native.copy_of_held_input(readers[0].tensor)
    if copy is None:
        return False
    moved = set()
    for held in readers:
        if id(held) in moved:
            continue
        moved.add(id(held))
        held.tensor = lineage.native.held_input_on(copy, held.tensor)
        held.key = storage_address(held.tensor)
    for tensor_id, held in list(lineage.externals.items()):
        if id(held) in moved:
            del lineage.externals[tensor_id]
    return True


def rebuild_entry(lineage: Lineage, entry_id: int, stream=None) -> torch.Tensor:
    """The native binding's recompute callback: replays the storage of a
    dropped entry and returns a tensor whose storage holds it. With a CUDA
    ``stream`` (the current one), managed inputs read by the replay are
    recorded on it so that their blocks are not reused before it has run."""
    storage_lineage = lineage.by_entry.get(entry_id)
    if storage_lineage is None:
        raise RecomputeError(f"membudget: no lineage recorded for dropped activation {entry_id}")
    was_paused = lineage.paused()
    lineage.local.paused = True
    try:
        # Grad mode as when recorded (lineage records only with grad enabled;
        # some kernels, e.g. mkldnn_rnn_layer, return a workspace only then).
        # Every input is detached, so nothing is recorded by autograd.
        # Off the dispatch-mode stack: a tensor made under a Python mode and
        # handed back to C++ stays referenced (measured on torch 2.13: the
        # rebuilt entry could never be evicted again); replays also run faster.
        with torch.enable_grad(), _disable_current_modes():
            return _Replayer(lineage, stream).rebuild(storage_lineage, len(storage_lineage.mutations))
    finally:
        lineage.local.paused = was_paused


def rebuild_entry_on_stream(lineage: Lineage, entry_id: int, side: "torch.cuda.Stream"):
    """Note [Recompute ahead] on CUDA: replays a dropped entry on the side
    stream ``side`` and returns (tensor, ``side``'s handle); the binding records
    an event there, and the unpack makes the compute stream wait for it.

    The side stream first waits for the compute stream (the replay's inputs
    may still be being written there). Managed inputs the replay reads are
    recorded on ``side``, and the rebuilt storage on the compute stream, where
    backward uses and frees it: the stream-ordered allocator then reuses no
    block before the stream that last reads it has passed that point."""
    compute = torch.cuda.current_stream(side.device)
    side.wait_stream(compute)
    with torch.cuda.stream(side):
        rebuilt = rebuild_entry(lineage, entry_id, stream=side)
    rebuilt.record_stream(compute)
    return rebuilt, side.cuda_stream


class _Replayer:
    def __init__(self, lineage: Lineage, stream=None):
        self.native = lineage.native
        self.stream = stream  # a CUDA side stream the replay runs on, or None
        # id(StorageLineage) -> [storage being rebuilt, writes applied so far]
        self.overrides: Dict[int, list] = {}

    def rebuild(self, lineage: StorageLineage, version: int) -> torch.Tensor:
        base = self.run(lineage.producer)[lineage.index]
        key = id(lineage)
        previous = self.overrides.get(key)
        rebuilding = self.overrides[key] = [base, 0]
        try:
            for node in lineage.mutations[:version]:
                self.run(node)
                rebuilding[1] += 1
        finally:
            if previous is None:
                del self.overrides[key]
            else:
                self.overrides[key] = previous
        return base

    def run(self, node: OpNode):
        if not node.replayable:
            raise RecomputeError(f"membudget: {node.name} cannot be replayed")
        args = [self.fill(a) for a in node.args]
        kwargs = {k: self.fill(v) for k, v in node.kwargs.items()}
        if node.rng is not None:
            generator, state = node.rng
            saved = generator.get_state()
            generator.set_state(state)
            try:
                out = node.func(*args, **kwargs)
            finally:
                generator.set_state(saved)
        else:
            out = node.func(*args, **kwargs)
        return out if isinstance(out, (tuple, list)) else (out,)

    def fill(self, value):
        if type(value) is TensorRef:
            return self.resolve(value)
        if isinstance(value, (list, tuple)) and any(type(v) is TensorRef for v in value):
            # Tensor lists (cat, stack) are one level deep in aten schemas.
            items = [self.fill(v) for v in value]
            return items if isinstance(value, list) else tuple(items)
        return value

    def resolve(self, ref: TensorRef) -> torch.Tensor:
        holder = self.storage_holder(ref).detach()
        view = _view(holder, ref)
        return view.clone() if ref.scratch else view

    def _resident(self, entry_id: int):
        """A live entry's whole storage, made resident (swapped in, or
        replayed), recorded on the side stream when there is one; None when
        the entry is gone."""
        resident = self.native.entry_storage(entry_id)
        if resident is not None and self.stream is not None:
            resident.record_stream(self.stream)
        return resident

    def storage_holder(self, ref: TensorRef) -> torch.Tensor:
        """A tensor whose storage holds ``ref``'s storage at ``ref.version``."""
        source = ref.lineage
        if type(source) is ExternalLineage:
            if source.released():
                raise RecomputeError("membudget: an input of a dropped activation was released with the step that "
                                     "made it (Note [Lineage released between steps]); it cannot be recomputed")
            if not ref.scratch and source.version() != ref.tensor_version:
                raise RecomputeError(
                    "membudget: an input of a dropped activation was modified in place after forward "
                    f"(version {ref.tensor_version} -> {source.version()}); it cannot be recomputed")
            if source.tensor is not None:
                held = source.tensor
                if held.numel() and held.untyped_storage().nbytes() == 0:
                    raise RecomputeError(_FREED_INPUT)
                return held
            # Held through its entry (Note [Held inputs reached through their
            # entry] in csrc/torch/lineage_recorder.cpp): swapped in if on host.
            stored = self._resident(source.handle.entry_id)
            if stored is None:
                raise RecomputeError("membudget: an input of a dropped activation was released; it cannot be "
                                     "recomputed")
            return stored
        override = self.overrides.get(id(source))
        if override is not None and override[1] == ref.version:
            # Note [Reads of a storage being rebuilt]: the storage a replay is
            # rebuilding, read at the version its writes have reached (the
            # write being replayed reads its own target). A read at another
            # version rebuilds that version apart: MBart's shift_tokens_right
            # gathers from its tokens, then writes into them twice, the second
            # time from the gather; replaying the second write rebuilt the
            # dropped gather from the tokens as the first write had left
            # them, and the decoder trained on wrong tokens, silently.
            return override[0]
        if ref.version == len(source.mutations):
            if source.entry_id is not None:
                resident = self._resident(source.entry_id)
                if resident is not None:
                    return resident
            alive = source.base()
            if alive is not None and at_last_version(source, alive._version):
                if self.stream is not None:
                    alive.record_stream(self.stream)
                return alive
        return self.rebuild(source, ref.version)


def _view(holder: torch.Tensor, ref: TensorRef) -> torch.Tensor:
    if ref.strides is None:
        return holder  # held as it is (Note [Tensors without storage] in lineage.py)
    if (holder.dtype == ref.dtype and holder.storage_offset() == ref.offset and tuple(holder.size()) == ref.sizes
            and tuple(holder.stride()) == ref.strides):
        return _with_bits(holder, ref.bits)
    return _with_bits(_geometry(holder, ref), ref.bits)


def _with_bits(view: torch.Tensor, bits: int) -> torch.Tensor:
    """``view`` with the conjugate and negative bits of the reference (Note
    [Conjugate and negative views] in lineage.py); each flip is a view."""
    if view.is_conj() != bool(bits & 1):
        view = torch._conj(view)
    if view.is_neg() != bool(bits & 2):
        view = torch._neg_view(view)
    return view


def _geometry(holder: torch.Tensor, ref: TensorRef) -> torch.Tensor:
    if holder.dtype != ref.dtype:
        holder = _as_dtype(holder, ref)
    # as_strided addresses the holder's storage directly (untyped_storage()
    # would create a Python storage object that pins it; see storage_address).
    return torch.as_strided(holder, ref.sizes, ref.strides, ref.offset)


def _as_dtype(holder: torch.Tensor, ref: TensorRef) -> torch.Tensor:
    """The holder's storage, from its start, as elements of ``ref.dtype``:
    enough of them for ``ref``'s view. A manager's storage comes as bytes; a
    live tensor (``z``, where ``z.conj().imag`` was read) in its own dtype,
    whose bytes are taken as they are (its view bits are the reference's
    business, set after)."""
    if holder.dim() != 1 or holder.storage_offset() != 0 or holder.element_size() != 1:
        holder = _with_bits(holder, 0)
        extent = 0 if 0 in ref.sizes else 1 + ref.offset + sum((n - 1) * st for n, st in zip(ref.sizes, ref.strides))
        count = -(-extent * ref.dtype.itemsize // holder.element_size())
        try:
            holder = torch.as_strided(holder, (count,), (1,), 0).view(torch.uint8)
        except RuntimeError as error:
            raise RecomputeError(f"membudget: cannot reinterpret a replay input as {ref.dtype}: {error}") from None
    return holder.view(ref.dtype)

"""Liveness and memory over the whole step for a given recompute set.

Where this sits in the flow: :mod:`.graph` gives a :class:`PlanGraph`;
:class:`MemoryModel` answers "what is the memory over time, and its peak, if
these forward ops are recomputed instead of their outputs stashed?";
:mod:`.selection` asks it many times while choosing.

Note [Slots]: the timeline has ``2N + 1`` slots for N ops. Op ``p`` runs at
slot ``2p + 1`` (its inputs and outputs are live there); slot ``2p`` is where
the backward recomputations that op ``p`` needs run, just before it (as
``reordering_to_mimic_autograd_engine`` places them, and as the runtime
recomputes on unpack). A storage is live on a closed range of slots.

Recomputing op ``o`` (Echo's net benefit, evaluated over the whole timeline):
its outputs live through forward only until their last forward use, then again
from o's recompute slot until their last backward use; its inputs must be live
at that slot: an input that autograd stashes anyway costs nothing more, one
that would have died in forward now stays alive until then (unless it is
recomputed too, in which case it is recomputed at the earlier of the two
slots). Every such interaction is re-derived from the whole recompute set, so
a choice's benefit changes as other choices are made.

Note [Chains inside a recompute slot]: the ops recomputed at one slot run one
after another (in forward order), and a link of a recomputed chain that
nothing after the slot reads is freed as soon as the last op of the slot that
reads it has run. So the memory of a recompute slot is not the sum of
everything the slot makes but the highest of its sub-steps: at sub-step ``k``
the outputs that outlive the slot made at steps ``<= k``, the outputs that do
not and are still to be read (made at or before ``k``, last read at or after
``k``), and op ``k``'s workspace. The interval arithmetic counts them all
together; a per-slot *correction* (their sum minus that highest sub-step) is
subtracted. Summing them was what made long recomputed chains (GPT-2's
tanh-GELU, eight pointwise ops) over-predicted by about a MiB.
"""
from __future__ import annotations

from typing import Dict, FrozenSet, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from .graph import PlanGraph

__all__ = ["MemoryModel", "Profile"]


class Profile:
    """Memory (bytes) per slot for one recompute set, with its peak and where."""

    def __init__(self, memory: np.ndarray, recompute: FrozenSet[int], overhead_s: float,
                 slots: Optional[Dict[int, int]] = None, corrections: Optional[Dict[int, int]] = None):
        self.memory = memory
        self.recompute = recompute
        self.overhead_s = overhead_s
        self.slots = slots if slots is not None else {}
        # Recompute slot -> bytes subtracted there (Note [Chains inside a recompute slot]).
        self.corrections = corrections if corrections is not None else {}

    @property
    def peak(self) -> int:
        """The highest memory over the step, in bytes."""
        return int(self.memory.max()) if len(self.memory) else 0

    @property
    def peak_slot(self) -> int:
        """The first slot at which memory is at its peak."""
        return int(self.memory.argmax()) if len(self.memory) else 0

    def excess(self, budget: int) -> float:
        """Bytes x slots above ``budget``: zero exactly when the peak fits."""
        return float(np.clip(self.memory - budget, 0, None).sum())


class MemoryModel:
    """Memory over time of a :class:`PlanGraph` under any recompute set. The
    profile without recomputation is computed once; a recompute set changes
    only the storages its ops produce or read, which are re-derived per call."""

    def __init__(self, graph: PlanGraph, reserve_bytes: int = 0):
        """``reserve_bytes``: memory that later graphs of the same step (after
        a graph break) will use on top of what this one keeps through its
        backward, counted at the slot between its forward and its backward
        (Note [Budget shares across graph breaks] in :mod:`.partitioner`)."""
        self.graph = graph
        self.reserve_bytes = int(reserve_bytes)
        n = len(graph.ops)
        self.num_slots = 2 * n + 1
        self.forward_end_slot = 2 * graph.num_forward  # first slot of backward
        self.fixed = graph.fixed_bytes
        self.start: Dict[int, int] = {}
        self.fw_end: Dict[int, int] = {}
        self.bw_first: Dict[int, Optional[int]] = {}
        self.end: Dict[int, int] = {}
        for s in graph.storages:
            if s.producer is None:
                continue
            start = 2 * s.producer + 1
            fw_uses = [u for u in s.uses if u < graph.num_forward]
            bw_uses = [u for u in s.uses if u >= graph.num_forward]
            self.start[s.id] = start
            self.fw_end[s.id] = 2 * max(fw_uses) + 1 if fw_uses else start
            self.bw_first[s.id] = 2 * min(bw_uses) if bw_uses else None
            end = 2 * max(s.uses) + 1 if s.uses else start
            if s.alive_until is not None:
                end = max(end, 2 * s.alive_until + 1)
            self.end[s.id] = self.num_slots - 1 if s.live_to_end else max(end, start)
        self._own_slots: Dict[int, Optional[int]] = {}
        # Forward ops that read each storage (candidates for "must stay alive").
        self.readers: Dict[int, List[int]] = {}
        for op in graph.ops[: graph.num_forward]:
            for sid in op.inputs:
                self.readers.setdefault(sid, []).append(op.index)
        self._base = self._memory_of(self._intervals(self.start.keys(), frozenset(), {})
                                     + [(2 * op.index + 1, 2 * op.index + 1, op.workspace)
                                        for op in graph.ops if op.workspace])
        if self.reserve_bytes and graph.num_forward < n:
            self._base[self.forward_end_slot] += self.reserve_bytes

    # -- recompute slots -------------------------------------------------
    def own_slot(self, op_index: int) -> Optional[int]:
        """The slot where op ``op_index`` is recomputed when nothing else
        needs it earlier: just before the first backward use of an output."""
        if op_index in self._own_slots:
            return self._own_slots[op_index]
        firsts = [self.bw_first[s] for s in self.graph.ops[op_index].outputs
                  if s in self.bw_first and self.bw_first[s] is not None]
        self._own_slots[op_index] = min(firsts) if firsts else None
        return self._own_slots[op_index]

    def recompute_slots(self, recompute: Iterable[int]) -> Dict[int, int]:
        """Slot of each recomputed op: its own slot, or earlier when a later
        recomputed op reads one of its outputs (recomputed chains)."""
        chosen = sorted(set(recompute), reverse=True)
        chosen_set = set(chosen)
        slots: Dict[int, int] = {}
        for o in chosen:
            slot = self.own_slot(o)
            for sid in self.graph.ops[o].outputs:
                for reader in self.readers.get(sid, ()):
                    if reader in chosen_set and reader != o and reader in slots:
                        slot = slots[reader] if slot is None else min(slot, slots[reader])
            slots[o] = slot if slot is not None else self.num_slots - 1
        return slots

    # -- intervals and memory ------------------------------------------
    def _intervals(self, storages: Iterable[int], recompute: FrozenSet[int],
                   slots: Dict[int, int]) -> List[Tuple[int, int, int]]:
        ops = self.graph.ops
        sizes = self.graph.storages
        out: List[Tuple[int, int, int]] = []
        for sid in storages:
            nbytes = sizes[sid].bytes
            if not nbytes:
                continue
            producer = sizes[sid].producer
            needed_until = -1
            for reader in self.readers.get(sid, ()):
                if reader in recompute and reader != producer:
                    needed_until = max(needed_until, slots[reader])
            if producer in recompute:
                out.append((self.start[sid], self.fw_end[sid], nbytes))
                bw_end = self.end[sid] if self.bw_first[sid] is not None else slots[producer]
                out.append((slots[producer], max(bw_end, needed_until, slots[producer]), nbytes))
            else:
                out.append((self.start[sid], max(self.end[sid], needed_until), nbytes))
        del ops
        return out

    def _memory_of(self, intervals: List[Tuple[int, int, int]]) -> np.ndarray:
        diff = np.zeros(self.num_slots + 1, dtype=np.int64)
        if intervals:
            arr = np.asarray(intervals, dtype=np.int64)
            np.add.at(diff, arr[:, 0], arr[:, 2])
            np.add.at(diff, arr[:, 1] + 1, -arr[:, 2])
        return np.cumsum(diff[:-1])

    def affected(self, recompute: Iterable[int]) -> set:
        """Storages whose liveness depends on ``recompute``: the recomputed
        ops' outputs and inputs."""
        touched: set = set()
        for o in recompute:
            op = self.graph.ops[o]
            touched.update(op.outputs)
            touched.update(s for s in op.inputs if s in self.start)
        return touched

    def profile(self, recompute: Iterable[int] = ()) -> Profile:
        """Memory per slot (fixed bytes included) when the ops in ``recompute``
        (op indices) are recomputed in backward instead of stashed."""
        chosen = frozenset(recompute)
        memory = self._base.copy()
        if chosen:
            touched = self.affected(chosen)
            slots = self.recompute_slots(chosen)
            memory -= self._memory_of(self._intervals(touched, frozenset(), {}))
            memory += self._memory_of(self._intervals(touched, chosen, slots)
                                      + [(slots[o], slots[o], self.graph.ops[o].workspace) for o in chosen])
            corrections = self._corrections(set(slots.values()), chosen, slots)
            for slot, nbytes in corrections.items():
                memory[slot] -= nbytes
        else:
            slots, corrections = {}, {}
        overhead = sum(self.graph.ops[o].cost_s for o in chosen)
        return Profile(memory + self.fixed, chosen, overhead, slots, corrections)

    def with_op(self, profile: Profile, op_index: int) -> Profile:
        """``profile`` with op ``op_index`` recomputed as well, derived
        incrementally: only the storages of the new op, and of the recomputed
        ops it pulls earlier (their outputs now feed it), are re-derived."""
        if op_index in profile.recompute:
            return profile
        chosen = profile.recompute | {op_index}
        ops = self.graph.ops
        slots = dict(profile.slots)
        slot = self.own_slot(op_index)
        for sid in ops[op_index].outputs:
            for reader in self.readers.get(sid, ()):
                if reader in chosen and reader != op_index:
                    slot = slots[reader] if slot is None else min(slot, slots[reader])
        slots[op_index] = slot if slot is not None else self.num_slots - 1
        changed = {op_index}
        stack = [op_index]
        while stack:
            o = stack.pop()
            for sid in ops[o].inputs:
                producer = self.graph.storages[sid].producer
                if producer in chosen and producer != o and slots[producer] > slots[o]:
                    slots[producer] = slots[o]
                    changed.add(producer)
                    stack.append(producer)
        touched = self.affected(changed)
        old = self._intervals(touched, profile.recompute, profile.slots) + [
            (profile.slots[o], profile.slots[o], ops[o].workspace) for o in changed if o in profile.recompute]
        new = self._intervals(touched, chosen, slots) + [(slots[o], slots[o], ops[o].workspace) for o in changed]
        memory = profile.memory - self._memory_of(old) + self._memory_of(new)
        # Slots whose sub-steps may have changed: those the changed ops left
        # or joined, and those of recomputed producers they read (an output
        # read at a later slot now outlives its own).
        slots_hit = {slots[o] for o in changed} | {profile.slots[o] for o in changed if o in profile.slots}
        for o in changed:
            for sid in ops[o].inputs:
                producer = self.graph.storages[sid].producer
                if producer in chosen:
                    slots_hit.add(slots[producer])
        corrections = dict(profile.corrections)
        for slot in slots_hit:
            memory[slot] += corrections.pop(slot, 0)
        for slot, nbytes in self._corrections(slots_hit, chosen, slots).items():
            memory[slot] -= nbytes
            corrections[slot] = nbytes
        return Profile(memory, chosen, profile.overhead_s + ops[op_index].cost_s, slots, corrections)

    def _corrections(self, slots_hit: Iterable[int], chosen: FrozenSet[int],
                     slots: Dict[int, int]) -> Dict[int, int]:
        """Per recompute slot in ``slots_hit``: the bytes by which summing
        everything the slot makes exceeds its highest sub-step (Note [Chains
        inside a recompute slot]); slots with nothing to correct are left out."""
        at: Dict[int, List[int]] = {}
        wanted = set(slots_hit)
        for o in chosen:
            if slots[o] in wanted:
                at.setdefault(slots[o], []).append(o)
        out: Dict[int, int] = {}
        for slot, members in at.items():
            if len(members) < 2:
                continue
            nbytes = self._slot_excess(slot, sorted(members), chosen, slots)
            if nbytes:
                out[slot] = nbytes
        return out

    def _slot_excess(self, slot: int, members: List[int], chosen: FrozenSet[int], slots: Dict[int, int]) -> int:
        ops = self.graph.ops
        storages = self.graph.storages
        step_of = {o: k for k, o in enumerate(members)}
        delta = np.zeros(len(members) + 1, dtype=np.int64)  # difference array over sub-steps
        total = 0
        for k, o in enumerate(members):
            for sid in ops[o].outputs:
                nbytes = storages[sid].bytes
                if not nbytes:
                    continue
                last_here = k
                outlives = self.bw_first[sid] is not None  # read by backward ops after the slot
                for reader in self.readers.get(sid, ()):
                    if reader in chosen and reader != o:
                        if slots[reader] > slot:
                            outlives = True
                        elif slots[reader] == slot:
                            last_here = max(last_here, step_of[reader])
                delta[k] += nbytes
                if not outlives:
                    delta[last_here + 1] -= nbytes
                total += nbytes
            ws = ops[o].workspace
            if ws:
                delta[k] += ws
                delta[k + 1] -= ws
                total += ws
        highest = int(np.cumsum(delta[:-1]).max())
        return total - highest

    def stashed_bytes(self, recompute: Iterable[int] = ()) -> int:
        """Bytes live at the end of forward, fixed bytes excluded: what the
        step stashes for backward (and the forward's outputs)."""
        p = self.profile(recompute)
        return int(p.memory[max(self.forward_end_slot - 1, 0)]) - self.fixed if len(p.memory) else 0

    def handed_on_bytes(self) -> int:
        """Bytes of the forward outputs that this graph's backward does not
        read: after a graph break the next graph takes them as inputs."""
        return sum(s.bytes for s in self.graph.storages
                   if s.producer is not None and s.producer < self.graph.num_forward
                   and s.alive_until is not None and self.bw_first.get(s.id) is None
                   and self.end.get(s.id, 0) < self.forward_end_slot)

    def later_graphs_bytes(self) -> int:
        """What the rest of the step (later graphs, after a graph break) is
        expected to use on top of what this graph carries through them: the
        gradients of this graph's outputs (tangents; later graphs make them)
        and one activation as large as the outputs handed on (what the next
        graph computes from them, e.g. a loss's log-softmax). A heuristic:
        measured on GPT-2's loss graph, which uses 3 MiB over 1 MiB of logits
        (logits gradient, log-softmax, its gradient) against 2 + 2 MiB
        reserved (logits and key/value caches)."""
        tangents = sum(s.bytes for s in self.graph.storages if s.name.startswith("tangents"))
        return tangents + self.handed_on_bytes()

    def carried_bytes(self, recompute: Iterable[int] = ()) -> int:
        """What this graph keeps allocated while later graphs of the step run
        (after a graph break): its fixed bytes and its stash, less the forward
        outputs that its backward does not read (the next graph takes them as
        inputs and counts them there) and less the gradients of its outputs
        (tangents: later graphs make them)."""
        return self.stashed_bytes(recompute) + self.fixed - self.handed_on_bytes()

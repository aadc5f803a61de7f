"""Property tests of the core CachingAllocator against a shadow model.

Hypothesis drives random sequences of allocate / deallocate / record_stream on
held virtual streams / release of streams / release_cached / set_budget through
membudget._C.core over a HostBackend, and after every step checks what the
rest of membudget relies on: live blocks never overlap and are 512-aligned,
the allocated statistic is the sum of live rounded sizes, reserved bytes stay
within the budget, the snapshot tiles every segment exactly, and a block freed
while a held stream still uses it is not handed out again before release.
The same machine runs with expandable segments (Note [Expandable segments]),
where reserved bytes are mapped pages: a request must fit whenever the pages
pinned by live blocks leave room for it, and releasing the cache leaves mapped
exactly the pages under live blocks.
"""
import torch  # noqa: F401  (loads libtorch before the extension)
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from membudget._C import core

KiB = 1024
MiB = 1024 * KiB
MIN_BLOCK = 512
SMALL_SIZE = 1 * MiB

ALLOC_STREAMS = [0, 7]
RECORD_STREAMS = [1, 2, 3, 7]

request_sizes = st.one_of(
    st.integers(1, 4 * KiB),
    st.integers(SMALL_SIZE - 2 * KiB, SMALL_SIZE + 2 * KiB),
    st.integers(1, 3 * MiB),
    st.integers(10 * MiB - 4 * KiB, 10 * MiB + 4 * KiB),
    st.integers(1, 30 * MiB),
)


def rounded(nbytes):
    return (nbytes + MIN_BLOCK - 1) // MIN_BLOCK * MIN_BLOCK


def overlaps(a_start, a_size, b_start, b_size):
    return a_start < b_start + b_size and b_start < a_start + a_size


class AllocatorMachine(RuleBasedStateMachine):
    """Shadow model: live allocations, held streams, blocks awaiting streams."""

    EXPANDABLE = False

    @initialize(budget=st.sampled_from([3 * MiB, 8 * MiB, 24 * MiB, 64 * MiB]))
    def start(self, budget):
        self.backend = core.HostBackend()
        self.allocator = core.CachingAllocator(self.backend, budget, expandable_segments=self.EXPANDABLE)
        assert self.allocator.expandable_segments == self.EXPANDABLE
        self.budget = budget
        self.reserved_ceiling = budget  # see check_reserved_within_budget
        # address -> (size, requested, stream, recorded streams). Rules pick
        # blocks by position in allocation order, never by address, so that
        # hypothesis replays a case identically although addresses differ.
        self.live = {}
        self.awaiting = {}    # address -> (size, streams still held)
        # Blocks whose streams were released: the allocator notices at its next
        # allocate, release_cached or set_budget, so until then the snapshot
        # may still show them awaiting.
        self.released_unnoticed = {}
        self.held = set()

    # ---- rules -------------------------------------------------------------

    @rule(nbytes=request_sizes, stream=st.sampled_from(ALLOC_STREAMS))
    def allocate(self, nbytes, stream):
        self.released_unnoticed.clear()
        must_fit = rounded(nbytes) <= self.reservable_without_eviction()
        try:
            address = self.allocator.allocate(nbytes, stream)
        except torch.OutOfMemoryError as error:
            assert not must_fit, f"OOM although {rounded(nbytes)} B was reservable: {error}"
            assert "budget" in str(error)
            return
        size = self.allocator.allocation_size(address)
        assert address % MIN_BLOCK == 0
        assert size >= rounded(nbytes)
        # Only a large block too small to split may carry a remainder; an
        # expandable segment splits off any remainder.
        if self.EXPANDABLE:
            assert size == rounded(nbytes)
        else:
            assert size - rounded(nbytes) <= (SMALL_SIZE if size > SMALL_SIZE else 0)
        for other, (other_size, *_rest) in self.live.items():
            assert not overlaps(address, size, other, other_size), "live blocks overlap"
        for other, (other_size, _streams) in self.awaiting.items():
            assert not overlaps(address, size, other, other_size), (
                "block reused while a held stream still uses it")
        self.live[address] = (size, nbytes, stream, set())

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def deallocate(self, data):
        address = data.draw(st.sampled_from(list(self.live)))
        size, _requested, stream, recorded = self.live.pop(address)
        self.allocator.deallocate(address)
        waiting = (recorded & self.held) - {stream}
        if waiting:
            self.awaiting[address] = (size, waiting)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), stream=st.sampled_from(RECORD_STREAMS))
    def record_stream(self, data, stream):
        address = data.draw(st.sampled_from(list(self.live)))
        self.allocator.record_stream(address, stream)
        self.live[address][3].add(stream)

    @rule(stream=st.sampled_from(RECORD_STREAMS))
    def hold_stream(self, stream):
        self.backend.hold_stream(stream)
        self.held.add(stream)

    @rule(stream=st.sampled_from(RECORD_STREAMS))
    def release_stream(self, stream):
        self.backend.release_stream(stream)
        self.held.discard(stream)
        for address in list(self.awaiting):
            size, streams = self.awaiting[address]
            streams.discard(stream)
            if not streams:
                self.released_unnoticed[address] = size
                del self.awaiting[address]

    @rule()
    def release_cached(self):
        before = self.allocator.stats()["reserved_current"]
        released = self.allocator.release_cached()
        self.released_unnoticed.clear()
        after = self.allocator.stats()["reserved_current"]
        assert before - after == released
        if self.EXPANDABLE:
            assert after == self.pinned_bytes(), "release_cached left free pages mapped"
        else:
            assert not self.whole_free_segments(), "release_cached left a free segment"

    @rule(budget=st.sampled_from([2 * MiB, 4 * MiB, 16 * MiB, 64 * MiB]))
    def set_budget(self, budget):
        self.allocator.set_budget(budget)
        self.released_unnoticed.clear()
        self.budget = budget
        assert self.allocator.budget() == budget
        reserved = self.allocator.stats()["reserved_current"]
        if reserved > budget:
            if self.EXPANDABLE:
                assert reserved == self.pinned_bytes(), "set_budget kept free pages mapped"
            else:
                assert not self.whole_free_segments(), "set_budget kept cached segments"
        self.reserved_ceiling = max(budget, reserved)

    # ---- helpers -----------------------------------------------------------

    def whole_free_segments(self):
        return [s for s in self.allocator.snapshot()
                if len(s["blocks"]) == 1 and not s["blocks"][0]["allocated"]
                and not s["blocks"][0]["awaiting_events"]]

    def page(self):
        """The page of the expandable segments: the one they have, or the one
        the next is reserved with (Note [Host pages])."""
        return self.allocator.segment_page_bytes or self.backend.segment_page_bytes(self.budget)

    def pinned_bytes(self):
        """Bytes of the pages that live and awaiting blocks touch: what must
        stay mapped in expandable segments (each in its segment's page: a
        retired segment keeps its own, Note [Host pages])."""
        segments = [(s["address"], s["size"], s["page_bytes"]) for s in self.allocator.snapshot()]
        pages = set()
        spans = [(a, v[0]) for a, v in self.live.items()] + [(a, v[0]) for a, v in self.awaiting.items()]
        for address, size in spans:
            page = next(p for start, length, p in segments if start <= address < start + length)
            pages.update((page, index) for index in range(address // page, (address + size - 1) // page + 1))
        return sum(page for page, _ in pages)

    def reservable_without_eviction(self):
        """What rung 2 or 3 must be able to reserve: the budget left plus free
        segments; with expandable segments, the budget left by pinned pages,
        less the two partial pages a request may straddle."""
        if self.EXPANDABLE:
            return max(0, self.budget - self.pinned_bytes() - 2 * self.page())
        reserved = self.allocator.stats()["reserved_current"]
        releasable = sum(s["size"] for s in self.whole_free_segments())
        return max(0, self.budget - (reserved - releasable))

    # ---- invariants --------------------------------------------------------

    @invariant()
    def snapshot_tiles_segments_and_matches_model(self):
        stats = self.allocator.stats()
        segments = self.allocator.snapshot()
        allocated, awaiting = {}, {}
        for segment in segments:
            cursor = segment["address"]
            assert cursor % MIN_BLOCK == 0
            for block in segment["blocks"]:
                assert block["address"] == cursor, "gap or overlap inside a segment"
                assert block["size"] > 0 and block["size"] % MIN_BLOCK == 0
                cursor += block["size"]
                if block["allocated"]:
                    allocated[block["address"]] = block["size"]
                if block["awaiting_events"]:
                    awaiting[block["address"]] = block["size"]
            assert cursor == segment["address"] + segment["size"]
            assert segment["expandable"] == self.EXPANDABLE
            assert segment["mapped_bytes"] <= segment["size"]
        assert sum(s["mapped_bytes"] for s in segments) == stats["reserved_current"]
        assert self.backend.device_bytes_in_use() == stats["reserved_current"]
        assert len(segments) == stats["num_segments"]
        assert allocated == {a: v[0] for a, v in self.live.items()}
        expected = {a: v[0] for a, v in self.awaiting.items()}
        unnoticed = set(awaiting.items()) - set(expected.items())
        assert set(expected.items()) <= set(awaiting.items()), "awaiting block reusable early"
        assert unnoticed <= set(self.released_unnoticed.items())

    @invariant()
    def stats_match_model(self):
        stats = self.allocator.stats()
        assert stats["allocated_current"] == sum(v[0] for v in self.live.values())
        assert stats["requested_current"] == sum(v[1] for v in self.live.values())
        assert stats["num_live_blocks"] == len(self.live)
        assert stats["allocated_peak"] >= stats["allocated_current"]
        assert stats["reserved_peak"] >= stats["reserved_current"]

    @invariant()
    def live_blocks_do_not_overlap(self):
        spans = sorted((a, v[0]) for a, v in self.live.items())
        for (a, size), (b, _) in zip(spans, spans[1:]):
            assert a + size <= b

    @invariant()
    def reserved_within_budget(self):
        # After set_budget below the reserved bytes, reserved may stay above the
        # budget (live blocks are not moved) but must never grow while it does.
        reserved = self.allocator.stats()["reserved_current"]
        assert reserved <= self.reserved_ceiling
        self.reserved_ceiling = max(self.budget, min(self.reserved_ceiling, reserved))

    def teardown(self):
        if not hasattr(self, "allocator"):
            return
        for stream in list(self.held):
            self.backend.release_stream(stream)
        for address in list(self.live):
            self.allocator.deallocate(address)
        self.allocator.release_cached()
        assert self.allocator.stats()["reserved_current"] == 0
        assert self.backend.device_bytes_in_use() == 0


class ExpandableAllocatorMachine(AllocatorMachine):
    EXPANDABLE = True


for machine in (AllocatorMachine, ExpandableAllocatorMachine):
    machine.TestCase.settings = settings(max_examples=300, stateful_step_count=50, deadline=None)
TestAllocatorProperties = AllocatorMachine.TestCase
TestExpandableAllocatorProperties = ExpandableAllocatorMachine.TestCase

"""Expandable segments (Note [Expandable segments], csrc/core/expandable_segment.h).

Fixed segments fail when free cached memory exceeds a request but no free
range is large enough and no segment is wholly free; expandable segments
unmap the free pages and back the request in the range's tail. These tests
drive membudget._C.core over a HostBackend, whose pages are real mmap pages:
every byte handed out is written, so a page left unmapped would crash.
"""
import ctypes
import random

import pytest
import torch

from membudget._C import core

KiB = 1024
MiB = 1024 * KiB


@pytest.fixture
def backend():
    return core.HostBackend()


def make(backend, budget, expandable=True):
    return core.CachingAllocator(backend, budget, expandable_segments=expandable)


def fill(address, size, byte):
    ctypes.memset(address, byte, size)
    assert ctypes.string_at(address + size - 1, 1) == bytes([byte])


def fragment(allocator):
    """A 6 MiB block freed, then 2 MiB cut from it, with a live 1.5 MiB block
    after it: 4 MiB free between two live blocks, so no segment is wholly free
    and no free range takes a 5 MiB request. Returns the two live blocks."""
    big = allocator.allocate(6 * MiB)
    neighbour = allocator.allocate(3 * MiB // 2)
    allocator.deallocate(big)
    return allocator.allocate(2 * MiB), neighbour


def test_fixed_segments_fail_where_expandable_ones_fit(backend):
    fixed = make(core.HostBackend(), 10 * MiB, expandable=False)
    fragment(fixed)
    with pytest.raises(torch.OutOfMemoryError, match="free in cache 4.00 MiB"):
        fixed.allocate(5 * MiB)

    expandable = make(backend, 10 * MiB)
    kept, neighbour = fragment(expandable)
    address = expandable.allocate(5 * MiB)
    fill(kept, 2 * MiB, 1)
    fill(neighbour, 3 * MiB // 2, 2)
    fill(address, 5 * MiB, 3)
    stats = expandable.stats()
    assert stats["reserved_current"] == 2 * MiB + 3 * MiB // 2 + 5 * MiB
    assert stats["reserved_peak"] <= 10 * MiB
    assert stats["num_segments"] == 1
    assert backend.device_bytes_in_use() == stats["reserved_current"]


def test_one_range_per_pool_and_stream_reserved_as_large_as_the_device(backend):
    allocator = make(backend, 64 * MiB)
    allocator.allocate(4 * KiB)
    allocator.allocate(3 * MiB)
    allocator.allocate(3 * MiB, stream=5)
    segments = allocator.snapshot()
    assert len(segments) == 3
    assert all(s["expandable"] and s["size"] >= backend.device_capacity() for s in segments)
    assert sum(s["mapped_bytes"] for s in segments) == allocator.stats()["reserved_current"]


def test_freed_pages_stay_cached_until_released(backend):
    allocator = make(backend, 64 * MiB)
    a = allocator.allocate(3 * MiB)
    b = allocator.allocate(3 * MiB)
    allocator.deallocate(a)
    # Reuse from the cache: the same pages, no new reservation.
    assert allocator.allocate(3 * MiB) == a
    allocator.deallocate(a)
    assert allocator.stats()["reserved_current"] == 6 * MiB
    assert allocator.release_cached() == 3 * MiB
    assert allocator.stats()["reserved_current"] == 3 * MiB
    fill(b, 3 * MiB, 7)
    # The unmapped range is mapped again on demand, and is usable.
    again = allocator.allocate(3 * MiB)
    fill(again, 3 * MiB, 8)
    assert allocator.stats()["reserved_current"] == 6 * MiB


def test_a_page_shared_with_a_live_block_stays_mapped(backend):
    allocator = make(backend, 64 * MiB)
    first = allocator.allocate(2 * MiB + 512)  # ends 512 B into a page
    second = allocator.allocate(2 * MiB)       # starts in that page
    page = allocator.segment_page_bytes
    assert page == backend.segment_page_bytes(64 * MiB) == 128 * 1024  # Note [Host pages]
    allocator.deallocate(first)
    allocator.release_cached()
    # Only the page second shares with first stays mapped of first's pages.
    assert allocator.stats()["reserved_current"] == 2 * MiB + page
    fill(second, 2 * MiB, 3)


def test_usable_range_counts_every_free_page_and_the_headroom(backend):
    allocator = make(backend, 10 * MiB)
    kept, _ = fragment(allocator)
    # For the live block: 2.5 MiB headroom, 4 MiB of free pages, its own 2 MiB.
    assert allocator.usable_range_at(kept) == 17 * MiB // 2
    # In the free fragment: headroom and free pages; a fixed segment offers
    # only the fragment itself.
    assert allocator.usable_range_at(kept + 2 * MiB) == 13 * MiB // 2
    fixed = make(core.HostBackend(), 10 * MiB, expandable=False)
    kept_fixed, _ = fragment(fixed)
    assert fixed.usable_range_at(kept_fixed + 2 * MiB) == 4 * MiB


def test_largest_free_or_reservable_can_be_allocated(backend):
    allocator = make(backend, 10 * MiB)
    fragment(allocator)
    largest = allocator.largest_free_or_reservable()
    assert largest == 13 * MiB // 2
    allocator.allocate(largest - allocator.segment_page_bytes)  # one page may be straddled


def test_out_of_memory_counts_free_pages_not_the_unmapped_tail(backend):
    allocator = make(backend, 4 * MiB)
    allocator.allocate(3 * MiB)
    with pytest.raises(torch.OutOfMemoryError, match="free in cache 0 B"):
        allocator.allocate(2 * MiB)


def test_device_refusal_maps_nothing(backend):
    small_device = core.HostBackend(8 * MiB)
    allocator = make(small_device, 64 * MiB)
    allocator.allocate(6 * MiB)
    with pytest.raises(torch.OutOfMemoryError):
        allocator.allocate(4 * MiB)
    assert allocator.stats()["reserved_current"] == small_device.device_bytes_in_use() == 6 * MiB


def test_host_tier_and_opt_out_use_fixed_segments(backend):
    host_tier = core.CachingAllocator(backend, 64 * MiB, name="host tier", kind="host",
                                      expandable_segments=True)
    assert not host_tier.expandable_segments
    assert not make(core.HostBackend(), 64 * MiB, expandable=False).expandable_segments


def test_destroying_the_allocator_unmaps_everything(backend):
    allocator = make(backend, 64 * MiB)
    allocator.allocate(3 * MiB)
    allocator.allocate(100 * KiB)
    assert backend.device_bytes_in_use() > 0
    del allocator
    assert backend.device_bytes_in_use() == 0


def test_rung_three_moves_free_pages_to_the_request(backend):
    allocator = make(backend, 10 * MiB)
    first_hole = allocator.allocate(3 * MiB)
    allocator.allocate(3 * MiB // 2)
    second_hole = allocator.allocate(3 * MiB)
    allocator.allocate(3 * MiB // 2)
    fill(first_hole, 3 * MiB, 4)
    allocator.deallocate(first_hole)
    allocator.deallocate(second_hole)
    # 4 MiB fits in neither hole: the tail needs 4 MiB of pages and the budget
    # has 1 MiB. Pages move from the holes (Note [Page recycling]): nothing is
    # unmapped or mapped anew, and reserved memory does not grow.
    address = allocator.allocate(4 * MiB)
    fill(address, 4 * MiB, 5)
    stats = allocator.stats()
    assert stats["reserved_current"] == 9 * MiB
    assert stats["moved_bytes_total"] == 4 * MiB
    assert stats["unmapped_bytes_total"] == 0
    assert backend.device_bytes_in_use() == 9 * MiB
    # A hole left with 2 MiB of pages serves 3 MiB with pages moved or mapped
    # within the budget.
    fill(allocator.allocate(3 * MiB), 3 * MiB, 6)
    assert allocator.stats()["reserved_current"] <= 10 * MiB


def test_host_pages_grow_with_the_budget():
    """Note [Host pages]: a power of two of about a 512th of the budget, from
    the kernel's page up to 2 MiB; the kernel's page without a budget (none
    below the device's memory)."""
    os_page = core.HostBackend().page_bytes()
    page_for = core.HostBackend.segment_page_for
    assert page_for(1 * MiB, 64 << 30) == os_page
    assert page_for(7 * MiB, 64 << 30) == 8 * KiB
    assert page_for(37 * MiB, 64 << 30) == 64 * KiB
    assert page_for(1 << 30, 64 << 30) == 2 * MiB
    assert page_for(63 << 30, 64 << 30) == 2 * MiB
    assert page_for(1 << 40, 64 << 30) == os_page
    assert page_for(32 * MiB, 32 * MiB) == os_page
    sizes = [page_for(budget, 64 << 30) for budget in range(MiB, 2 << 30, 7 * MiB)]
    assert all(size & (size - 1) == 0 and size % os_page == 0 for size in sizes)
    assert sizes == sorted(sizes)


def test_release_cached_gives_back_a_wholly_free_segment(backend):
    allocator = make(backend, 8 * MiB)
    assert allocator.segment_page_bytes == 0  # nothing reserved yet
    allocator.deallocate(allocator.allocate(3 * MiB))
    assert allocator.segment_page_bytes == backend.segment_page_bytes(8 * MiB) == 16 * KiB
    assert allocator.release_cached() == 3 * MiB
    stats = allocator.stats()
    assert stats["reserved_current"] == 0 and stats["num_segments"] == 0
    assert allocator.segment_page_bytes == 0 and backend.device_bytes_in_use() == 0
    fill(allocator.allocate(5 * MiB), 5 * MiB, 9)
    assert allocator.segment_page_bytes == 16 * KiB


def test_a_new_budget_reserves_with_its_page_and_retires_the_old_segments(backend):
    """Note [Host pages]: a budget that wants another page releases the
    segments with nothing live and retires the others: their live blocks
    stay where they are, new blocks go to a segment with the new page, and a
    retired segment goes whole once nothing in it lives."""
    allocator = make(backend, 64 * MiB)
    allocator.deallocate(allocator.allocate(3 * MiB))
    assert allocator.segment_page_bytes == 128 * KiB
    allocator.set_budget(8 * MiB)  # everything free: the segment goes whole
    assert allocator.segment_page_bytes == 0 and allocator.stats()["reserved_current"] == 0
    old = allocator.allocate(3 * MiB)
    fill(old, 3 * MiB, 2)
    assert allocator.segment_page_bytes == 16 * KiB
    allocator.set_budget(64 * MiB)  # a live block: its segment is retired
    assert allocator.segment_page_bytes == 0
    assert allocator.stats()["reserved_current"] == 3 * MiB  # its free tail unmapped
    new = allocator.allocate(5 * MiB)
    fill(new, 5 * MiB, 3)
    fill(old, 3 * MiB, 4)
    assert allocator.segment_page_bytes == 128 * KiB
    assert allocator.stats()["num_segments"] == 2
    allocator.deallocate(old)
    assert allocator.release_cached() == 3 * MiB
    stats = allocator.stats()
    assert stats["num_segments"] == 1 and stats["reserved_current"] == 5 * MiB
    assert backend.device_bytes_in_use() == 5 * MiB
    allocator.set_budget(1 << 50)  # no budget: the kernel's page, in a new segment
    fill(allocator.allocate(MiB + 4096), MiB + 4096, 5)
    assert allocator.segment_page_bytes == backend.page_bytes()


def kernel_mappings():
    with open("/proc/self/maps") as maps:
        return sum(1 for _ in maps)


def test_page_moves_keep_the_kernel_mappings_bounded(backend):
    """Note [Host pages]: each mremap'd page stays a kernel mapping of its
    own, so the mappings grow as moves shuffle pages, up to about two per
    page of the segment. Rounds that fill the budget with small blocks, free
    a random half and fill the holes' pages into larger blocks move pages
    again and again: the mappings stay under the 512 pages a budget is cut
    into (with the kernel's 4 KiB pages, 4096 here, they passed 1500 within
    these rounds and kept growing)."""
    budget = 16 * MiB
    allocator = make(backend, budget)
    rng = random.Random(0)
    before = kernel_mappings()
    counts = []
    for _ in range(150):
        live, used = [], 0
        for low, high in ((64, 1024), (1024, 3072)):
            while True:
                size = rng.randrange(low, high) * KiB
                if used + size > budget - 2 * MiB:
                    break
                address = allocator.allocate(size)
                fill(address, size, len(live) % 251)
                live.append((address, size))
                used += size
            if low == 64:  # free a random half: holes between live blocks
                rng.shuffle(live)
                for address, size in live[:len(live) // 2]:
                    allocator.deallocate(address)
                    used -= size
                live = live[len(live) // 2:]
        for address, _ in live:
            allocator.deallocate(address)
        counts.append(kernel_mappings() - before)
    assert allocator.stats()["moved_bytes_total"] > 100 * budget  # pages moved all along
    assert max(counts) <= 512 + 16


def test_a_fixed_segment_page_must_be_whole_backend_pages(backend):
    allocator = core.CachingAllocator(backend, 8 * MiB, expandable_segments=True, segment_page_bytes=256 * KiB)
    fill(allocator.allocate(MiB), MiB, 1)
    assert allocator.segment_page_bytes == 256 * KiB  # not the budget's 16 KiB
    with pytest.raises(ValueError, match="not a multiple of the backend's page"):
        core.CachingAllocator(backend, 8 * MiB, expandable_segments=True, segment_page_bytes=6000)


def test_a_budget_lowered_below_live_blocks_is_met_once_they_are_freed(backend):
    # Found by the allocator's property test: blocks live in segments with
    # 128 KiB pages when the budget drops to 2 MiB (their segments retire,
    # Note [Host pages]); once they are freed, a request must unmap the
    # pages over the budget too, not only its own bytes (moves between the
    # old pages and the new cannot cover it).
    allocator = make(backend, 64 * MiB)
    big = [allocator.allocate(10 * MiB - 4096, stream) for stream in (0, 7)]
    allocator.set_budget(2 * MiB)
    assert allocator.stats()["reserved_current"] == 20 * MiB
    for address in big:
        allocator.deallocate(address)
    fill(allocator.allocate(1), 1, 3)
    assert allocator.stats()["reserved_current"] <= 2 * MiB

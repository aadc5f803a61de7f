"""Behaviour of the core CachingAllocator that the rest of membudget relies on.

Each test drives membudget._C.core over a HostBackend (the simulated device)
and checks one promise of csrc/core/caching_allocator.h: PyTorch's pools,
split/merge and best fit, stream-ordered reuse, the budget with shrunk
segments near it, the OOM ladder (release cache, evictor, typed error with the
numbers a user needs), and the small API contracts.
"""
import gc

import pytest
import torch

from membudget._C import core

KiB = 1024
MiB = 1024 * KiB


@pytest.fixture
def backend():
    return core.HostBackend()


def make(backend, budget=64 * MiB, **kwargs):
    return core.CachingAllocator(backend, budget, **kwargs)


def blocks_of(allocator, address):
    """(size, allocated) of each block of the segment holding `address`."""
    for segment in allocator.snapshot():
        if segment["address"] <= address < segment["address"] + segment["size"]:
            return [(b["size"], b["allocated"]) for b in segment["blocks"]]
    raise AssertionError(f"no segment holds {address:#x}")


# ---- pools, split, merge, best fit -------------------------------------------

def test_small_request_splits_a_small_segment_and_merges_back(backend):
    allocator = make(backend)
    address = allocator.allocate(1000)
    assert allocator.allocation_size(address) == 1024
    [segment] = allocator.snapshot()
    assert segment["small_pool"] and segment["size"] == 2 * MiB
    assert blocks_of(allocator, address) == [(1024, True), (2 * MiB - 1024, False)]
    allocator.deallocate(address)
    assert blocks_of(allocator, address) == [(2 * MiB, False)]


def test_free_merges_with_both_neighbours(backend):
    allocator = make(backend)
    a, b, c = (allocator.allocate(4 * KiB) for _ in range(3))
    assert (b - a, c - b) == (4 * KiB, 4 * KiB)
    allocator.deallocate(a)
    allocator.deallocate(c)
    assert blocks_of(allocator, a) == [(4 * KiB, False), (4 * KiB, True), (2 * MiB - 8 * KiB, False)]
    allocator.deallocate(b)
    assert blocks_of(allocator, a) == [(2 * MiB, False)]


@pytest.mark.parametrize("request_bytes, pool_small, segment_bytes, block_bytes", [
    (1 * MiB, True, 2 * MiB, 1 * MiB),                    # largest small request
    (1 * MiB + 1, False, 20 * MiB, 1 * MiB + 512),        # smallest large request
    (10 * MiB, False, 10 * MiB, 10 * MiB),                # own segment, rounded to 2 MiB
    (11 * MiB, False, 12 * MiB, 12 * MiB),                # 1 MiB remainder: not split
    (12 * MiB + 512 * KiB, False, 14 * MiB, 12 * MiB + 512 * KiB),  # 1.5 MiB: split
])
def test_pool_and_segment_size_follow_pytorch(backend, request_bytes, pool_small,
                                              segment_bytes, block_bytes):
    allocator = make(backend)
    address = allocator.allocate(request_bytes)
    [segment] = allocator.snapshot()
    assert segment["small_pool"] == pool_small
    assert segment["size"] == segment_bytes
    assert allocator.allocation_size(address) == block_bytes


def test_best_fit_picks_the_smallest_free_block_that_fits(backend):
    allocator = make(backend)
    a = allocator.allocate(4 * MiB)
    allocator.allocate(2 * MiB)
    c = allocator.allocate(3 * MiB)
    allocator.allocate(2 * MiB)
    allocator.deallocate(a)
    allocator.deallocate(c)
    # Free now: 4 MiB at a, 3 MiB at c, 9 MiB at the tail of the segment.
    assert allocator.allocate(3 * MiB) == c
    assert allocator.allocate(3 * MiB + 512 * KiB) == a
    assert allocator.stats()["num_segments"] == 1


def test_small_pool_best_fit(backend):
    allocator = make(backend)
    a = allocator.allocate(8 * KiB)
    allocator.allocate(512)
    c = allocator.allocate(2 * KiB)
    allocator.allocate(512)
    allocator.deallocate(a)
    allocator.deallocate(c)
    assert allocator.allocate(1500) == c
    assert allocator.allocate(3 * KiB) == a


# ---- streams -----------------------------------------------------------------

def test_free_block_is_reused_only_on_its_stream(backend):
    allocator = make(backend)
    address = allocator.allocate(4 * KiB, stream=0)
    allocator.deallocate(address)
    other = allocator.allocate(4 * KiB, stream=5)
    assert other != address
    assert allocator.stats()["num_segments"] == 2
    assert allocator.allocate(4 * KiB, stream=0) == address


def test_record_stream_defers_reuse_until_the_stream_is_done(backend):
    allocator = make(backend)
    backend.hold_stream(5)
    address = allocator.allocate(1000)
    neighbour = allocator.allocate(1000)
    allocator.record_stream(address, 5)
    allocator.deallocate(address)
    assert allocator.allocate(1000) not in (address, neighbour)
    backend.release_stream(5)
    # The released block is the best fit again once the allocator sees the event.
    assert allocator.allocate(1000) == address


def test_record_stream_on_a_finished_stream_frees_at_once(backend):
    allocator = make(backend)
    address = allocator.allocate(1000)
    allocator.record_stream(address, 9)  # not held: its work is already done
    allocator.deallocate(address)
    assert allocator.allocate(1000) == address


# ---- budget ------------------------------------------------------------------

def test_segments_shrink_to_the_request_near_the_budget(backend):
    allocator = make(backend, budget=3 * MiB)
    large = allocator.allocate(2 * MiB + 512 * KiB)
    small = allocator.allocate(512 * KiB)
    sizes = sorted(s["size"] for s in allocator.snapshot())
    assert sizes == [512 * KiB, 2 * MiB + 512 * KiB]  # not 2 MiB and 20 MiB
    assert allocator.stats()["reserved_current"] == 3 * MiB
    with pytest.raises(torch.OutOfMemoryError):
        allocator.allocate(512)
    assert allocator.stats()["reserved_current"] == 3 * MiB
    assert {large, small} <= {s["address"] for s in allocator.snapshot()}


def test_out_of_memory_message_gives_the_numbers(backend):
    allocator = make(backend, budget=4 * MiB)
    allocator.allocate(3 * MiB)
    with pytest.raises(torch.OutOfMemoryError) as error:
        allocator.allocate(2 * MiB)
    message = str(error.value)
    for part in ("out of memory on device", "tried to allocate 2.00 MiB", "budget 4.00 MiB",
                 "reserved 3.00 MiB", "allocated 3.00 MiB", "free in cache 0 B",
                 "no evictor installed", "MEMBUDGET_BUDGET"):
        assert part in message
    assert allocator.stats()["num_ooms"] == 1


def test_out_of_memory_message_includes_the_evictor_description(backend):
    allocator = make(backend, budget=4 * MiB, name="host tier", kind="host")
    evictor = core.ListEvictor(allocator)
    allocator.set_evictor(evictor)
    allocator.allocate(3 * MiB)
    with pytest.raises(torch.OutOfMemoryError, match="out of memory on host tier") as error:
        allocator.allocate(2 * MiB)
    assert "evictable 0 B in 0 registered allocations" in str(error.value)
    assert backend.device_bytes_in_use() == 0  # the host kind uses host_alloc


def test_evictor_frees_registered_blocks_then_allocation_succeeds(backend):
    allocator = make(backend, budget=8 * MiB)
    evictor = core.ListEvictor(allocator)
    allocator.set_evictor(evictor)
    first = allocator.allocate(4 * MiB)
    second = allocator.allocate(4 * MiB)
    evictor.add(first)
    evictor.add(second)
    assert allocator.allocate(4 * MiB) == first  # the oldest victim's block
    stats = allocator.stats()
    assert evictor.evicted_count == 1
    assert allocator.owns(second)
    assert stats["num_alloc_retries"] == 1
    assert stats["num_evictor_calls"] == 1
    assert stats["num_ooms"] == 0


def test_evictor_is_not_asked_for_a_request_larger_than_the_budget(backend):
    allocator = make(backend, budget=8 * MiB)
    evictor = core.ListEvictor(allocator)
    allocator.set_evictor(evictor)
    evictor.add(allocator.allocate(4 * MiB))
    with pytest.raises(torch.OutOfMemoryError, match="evictable 4.00 MiB in 1"):
        allocator.allocate(9 * MiB)
    assert evictor.evicted_count == 0
    assert allocator.stats()["num_evictor_calls"] == 0


def test_cached_segments_are_released_before_failing(backend):
    allocator = make(backend, budget=24 * MiB)
    allocator.deallocate(allocator.allocate(1000))  # caches a 2 MiB small segment
    address = allocator.allocate(23 * MiB)  # fits only once that segment is released
    assert allocator.allocation_size(address) == 24 * MiB
    assert allocator.stats()["num_alloc_retries"] == 1
    [segment] = allocator.snapshot()
    assert not segment["small_pool"]


def test_release_cached_returns_the_released_bytes(backend):
    allocator = make(backend)
    allocator.deallocate(allocator.allocate(1000))
    allocator.deallocate(allocator.allocate(5 * MiB))
    kept = allocator.allocate(1000)
    assert allocator.release_cached() == 20 * MiB  # the small segment is in use
    allocator.deallocate(kept)
    assert allocator.release_cached() == 2 * MiB
    assert allocator.release_cached() == 0
    assert allocator.stats()["reserved_current"] == 0
    assert backend.device_bytes_in_use() == 0


def test_lowering_the_budget_releases_cached_segments(backend):
    allocator = make(backend, budget=64 * MiB)
    live = allocator.allocate(12 * MiB)
    allocator.deallocate(allocator.allocate(2 * MiB))
    allocator.set_budget(8 * MiB)
    assert allocator.budget() == 8 * MiB
    assert allocator.stats()["reserved_current"] == 12 * MiB  # live memory stays
    assert allocator.stats()["budget"] == 8 * MiB
    with pytest.raises(torch.OutOfMemoryError, match="budget 8.00 MiB, reserved 12.00 MiB"):
        allocator.allocate(1000)  # needs a new segment while over the budget
    allocator.deallocate(live)
    assert allocator.release_cached() == 12 * MiB


def test_largest_free_or_reservable_can_be_allocated(backend):
    allocator = make(backend, budget=8 * MiB)
    allocator.allocate(3 * MiB)
    largest = allocator.largest_free_or_reservable()
    assert largest == 5 * MiB
    allocator.allocate(largest)
    assert allocator.largest_free_or_reservable() == 0
    assert allocator.stats()["num_ooms"] == 0


def test_peak_stats_reset_to_current(backend):
    allocator = make(backend)
    address = allocator.allocate(3 * MiB)
    allocator.allocate(1000)
    allocator.deallocate(address)
    assert allocator.stats()["allocated_peak"] == 3 * MiB + 1024
    allocator.reset_peak_stats()
    stats = allocator.stats()
    assert stats["allocated_peak"] == stats["allocated_current"] == 1024
    assert stats["reserved_peak"] == stats["reserved_current"]


# ---- small contracts -----------------------------------------------------------

def test_allocate_zero_returns_null(backend):
    allocator = make(backend)
    assert allocator.allocate(0) == 0
    allocator.deallocate(0)  # ignored, like free(NULL)
    assert allocator.stats()["num_live_blocks"] == 0


def test_unknown_or_double_free_raises_value_error(backend):
    allocator = make(backend)
    address = allocator.allocate(1000)
    with pytest.raises(ValueError, match="not a live allocation"):
        allocator.deallocate(address + 512)
    with pytest.raises(ValueError):
        allocator.record_stream(12345, 1)
    allocator.deallocate(address)
    with pytest.raises(ValueError):
        allocator.deallocate(address)
    assert not allocator.owns(address)
    assert allocator.allocation_size(address) == 0


def test_bad_kind_is_rejected(backend):
    with pytest.raises(ValueError, match="kind must be 'device' or 'host'"):
        core.CachingAllocator(backend, MiB, kind="gpu")


def test_destroying_the_allocator_returns_its_segments(backend):
    allocator = make(backend)
    allocator.allocate(5 * MiB)
    allocator.allocate(1000)
    assert backend.device_bytes_in_use() == 22 * MiB
    del allocator
    gc.collect()
    assert backend.device_bytes_in_use() == 0

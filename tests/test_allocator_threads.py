"""Concurrency of the core CachingAllocator.

Several Python threads hammer one allocator (allocate, deallocate,
record_stream on virtual streams, release_cached) while a ListEvictor reclaims
allocations handed to it; the bindings release the GIL, so the threads really
contend on the allocator's mutex and the evictor runs concurrently with other
allocations (Note [Locking]). Afterwards every byte must be accounted for.
"""
import random
import threading

import torch

from membudget._C import core

KiB = 1024
MiB = 1024 * KiB
NUM_THREADS = 6
OPS_PER_THREAD = 400
BUDGET = 128 * MiB


def check_snapshot(allocator):
    """Blocks tile their segments and segment sizes add up to reserved bytes."""
    segments = allocator.snapshot()
    stats = allocator.stats()
    for segment in segments:
        cursor = segment["address"]
        for block in segment["blocks"]:
            assert block["address"] == cursor
            cursor += block["size"]
        assert cursor == segment["address"] + segment["size"]
    return segments, stats


def test_threads_hammering_one_allocator_leave_it_consistent():
    backend = core.HostBackend()
    allocator = core.CachingAllocator(backend, BUDGET)
    evictor = core.ListEvictor(allocator)
    allocator.set_evictor(evictor)
    backend.hold_stream(3)
    errors = []
    counts = {"ooms": 0, "allocations": 0}
    counts_lock = threading.Lock()
    start = threading.Barrier(NUM_THREADS + 1)

    def worker(seed):
        rng = random.Random(seed)
        mine = []  # (address, size) owned by this thread
        try:
            start.wait()
            for _ in range(OPS_PER_THREAD):
                op = rng.random()
                if op < 0.5 or not mine:
                    size_class = rng.random()
                    if size_class < 0.45:
                        nbytes = rng.randint(1, 64 * KiB)
                    elif size_class < 0.9:
                        nbytes = rng.randint(1, 3 * MiB)
                    else:  # around kMinLargeAlloc
                        nbytes = rng.randint(9 * MiB, 11 * MiB)
                    try:
                        address = allocator.allocate(nbytes, rng.choice([0, 0, 5]))
                    except torch.OutOfMemoryError:
                        with counts_lock:
                            counts["ooms"] += 1
                        continue
                    assert address % 512 == 0
                    backend.write_bytes(address, bytes([seed]) * 64)
                    with counts_lock:
                        counts["allocations"] += 1
                    if rng.random() < 0.5:
                        evictor.add(address)  # the evictor owns it from now on
                    else:
                        mine.append(address)
                elif op < 0.85:
                    address = mine.pop(rng.randrange(len(mine)))
                    # Nobody else may have written into a block this thread owns.
                    assert backend.read_bytes(address, 64) == bytes([seed]) * 64
                    allocator.deallocate(address)
                elif op < 0.97:
                    allocator.record_stream(rng.choice(mine), rng.choice([2, 3]))
                else:
                    allocator.release_cached()
            for address in mine:
                allocator.deallocate(address)
        except BaseException as error:  # surfaced by the main thread
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(1, NUM_THREADS + 1)]
    for thread in threads:
        thread.start()
    start.wait()
    while any(thread.is_alive() for thread in threads):
        _segments, stats = check_snapshot(allocator)
        assert stats["reserved_current"] <= BUDGET
        # Stream 3 "finishes its kernels" now and then, so deferred blocks return.
        backend.release_stream(3)
        backend.hold_stream(3)
        threads[0].join(timeout=0.005)
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert counts["allocations"] > 2 * counts["ooms"]
    assert allocator.stats()["num_evictor_calls"] > 0  # the ladder ran under contention

    evictor.evict(1 << 62)
    backend.release_stream(3)
    stats = allocator.stats()
    assert stats["allocated_current"] == 0
    assert stats["requested_current"] == 0
    assert stats["num_live_blocks"] == 0
    assert stats["reserved_peak"] <= BUDGET
    assert stats["num_ooms"] == counts["ooms"]
    assert evictor.registered_bytes == 0
    segments, stats = check_snapshot(allocator)
    assert not any(b["allocated"] for s in segments for b in s["blocks"])
    allocator.release_cached()  # also notices the released stream's events
    assert allocator.stats()["reserved_current"] == 0
    assert backend.device_bytes_in_use() == 0

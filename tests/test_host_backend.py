"""HostBackend, the simulated device: bounded "device" memory, copies on the
D2H/H2D worker threads with completion events, and held virtual streams
(Note [Virtual streams] in csrc/core/host_backend.h)."""
import threading

import pytest
import torch  # noqa: F401  (loads libtorch before the extension)

from membudget._C import core

KiB = 1024
MiB = 1024 * KiB


def test_device_memory_is_aligned_and_bounded_by_capacity():
    backend = core.HostBackend(capacity_bytes=4 * MiB)
    assert backend.device_capacity() == 4 * MiB
    first = backend.device_alloc(3 * MiB)
    assert first != 0 and first % 4096 == 0
    assert backend.device_alloc(2 * MiB) == 0  # would exceed the capacity
    assert backend.device_bytes_in_use() == 3 * MiB
    backend.device_free(first, 3 * MiB)
    second = backend.device_alloc(4 * MiB)
    assert second != 0
    backend.device_free(second, 4 * MiB)
    assert backend.device_bytes_in_use() == 0


def test_zero_capacity_means_physical_memory():
    assert core.HostBackend().device_capacity() > 64 * MiB


def test_copies_round_trip_through_host_memory():
    backend = core.HostBackend()
    payload = bytes(range(256)) * 1024
    device = backend.device_alloc(len(payload))
    host = backend.host_alloc(len(payload))
    back = backend.device_alloc(len(payload))
    backend.write_bytes(device, payload)
    backend.copy_to_host(host, device, len(payload)).wait()
    assert backend.read_bytes(host, len(payload)) == payload
    event = backend.copy_to_device(back, host, len(payload))
    event.wait()
    assert event.ready()
    assert backend.read_bytes(back, len(payload)) == payload
    assert backend.pending_copies("device_to_host") == 0
    assert backend.pending_copies("host_to_device") == 0
    for address in (device, back):
        backend.device_free(address, len(payload))
    backend.host_free(host, len(payload))


def test_copy_waits_for_the_stream_it_is_ordered_after():
    backend = core.HostBackend()
    device = backend.device_alloc(4 * KiB)
    host = backend.host_alloc(8 * KiB)
    backend.write_bytes(device, b"x" * 4 * KiB)
    backend.hold_stream(9)
    blocked = backend.copy_to_host(host, device, 4 * KiB, after=9)
    queued_behind = backend.copy_to_host(host + 4 * KiB, device, 4 * KiB)  # FIFO
    assert not blocked.ready() and not queued_behind.ready()
    assert backend.pending_copies("device_to_host") == 2
    backend.release_stream(9)
    queued_behind.wait()
    assert blocked.ready()
    assert backend.read_bytes(host, 8 * KiB) == b"x" * 8 * KiB
    assert backend.pending_copies("device_to_host") == 0
    backend.device_free(device, 4 * KiB)
    backend.host_free(host, 8 * KiB)


def test_events_on_held_streams_stay_pending_until_release():
    backend = core.HostBackend()
    assert backend.record(0).ready()
    assert backend.record(4).ready()  # a virtual stream with no work
    backend.hold_stream(4)
    event = backend.record(4)
    assert not event.ready()
    backend.release_stream(4)
    assert event.ready()
    backend.stream_wait(0, event)  # returns: the event is complete
    with pytest.raises(ValueError):
        backend.hold_stream(0)


def test_copy_timeline_records_copies_and_the_waits_on_them():
    # Note [Copy timeline]: a copy held behind a virtual stream cannot be
    # done when the main thread starts waiting for it, so that wait blocks and
    # is recorded against that copy; totals count every copy.
    backend = core.HostBackend()
    device = backend.device_alloc(64 * KiB)
    host = backend.host_alloc(64 * KiB)
    backend.write_bytes(device, b"y" * 64 * KiB)
    backend.set_copy_timeline(True)
    backend.hold_stream(5)
    blocked = backend.copy_to_host(host, device, 64 * KiB, after=5)
    releaser = threading.Timer(0.05, backend.release_stream, args=(5,))
    releaser.start()
    blocked.wait()
    releaser.join()
    backend.copy_to_device(device, host, 64 * KiB).wait()
    timeline = backend.copy_timeline()
    totals = timeline["totals"]
    assert (totals["copies.d2h"], totals["copies.h2d"]) == (1, 1)
    assert (totals["bytes.d2h"], totals["bytes.h2d"]) == (64 * KiB, 64 * KiB)
    (out, back) = sorted(timeline["copies"], key=lambda c: c[1])  # d2h, h2d
    index, direction, size, enqueued, started, finished = out
    assert (direction, size) == ("d2h", 64 * KiB) and enqueued <= started <= finished
    waited = [w for w in timeline["waits"] if w[0] == index]
    assert len(waited) == 1 and waited[0][1] <= waited[0][2]
    assert totals["waits"] >= 1
    backend.set_copy_timeline(False)  # clears the records and the totals
    assert backend.copy_timeline()["totals"]["copies.d2h"] == 0 and backend.copy_timeline()["copies"] == []
    backend.device_free(device, 64 * KiB)
    backend.host_free(host, 64 * KiB)


def test_copies_stay_exact_and_ordered_whoever_runs_them():
    # Note [Waiter runs the copy]: a thread that waits for a copy still queued
    # at the head of an idle stream runs it itself; otherwise the worker does.
    # Which one wins is a race, so this mixes synchronous copies (waited for at
    # once), copies queued behind others, and a copy ordered after a held
    # stream (which only the worker may run, after the release), and checks
    # every byte and the count of copies either way.
    backend = core.HostBackend(64 * MiB)
    page = 4 * KiB
    rounds = 200
    device = backend.device_alloc(rounds * page)
    host = backend.host_alloc(rounds * page)
    back = backend.device_alloc(rounds * page)
    payloads = [bytes([i % 251]) * page for i in range(rounds)]
    for i, payload in enumerate(payloads):
        backend.write_bytes(device + i * page, payload)
    backend.set_copy_timeline(False, True)
    backend.hold_stream(7)
    held = backend.copy_to_host(host, device, page, after=7)
    behind_held = backend.copy_to_host(host + page, device + page, page)
    assert not held.ready() and not behind_held.ready()
    releaser = threading.Timer(0.02, backend.release_stream, args=(7,))
    releaser.start()
    behind_held.wait()  # cannot run it itself: the worker holds the stream's head
    releaser.join()
    assert held.ready()
    for i in range(2, rounds):
        out = backend.copy_to_host(host + i * page, device + i * page, page, for_waiter=bool(i % 3))
        if i % 3:
            out.wait()  # synchronous: the waiter may run it
    for i in range(rounds):
        event = backend.copy_to_device(back + i * page, host + i * page, page)
        if i % 2:
            event.wait()  # it may take it, although the worker was woken for it
    event.wait()
    assert backend.read_bytes(back, rounds * page) == b"".join(payloads)
    totals = backend.copy_timeline()["totals"]
    assert totals["copies.d2h"] == rounds and totals["copies.h2d"] == rounds
    assert totals["copies_by_waiter.d2h"] <= rounds - 2 and totals["copies_by_waiter.h2d"] <= rounds // 2
    assert backend.pending_copies("device_to_host") == 0 and backend.pending_copies("host_to_device") == 0
    backend.device_free(device, rounds * page)
    backend.device_free(back, rounds * page)
    backend.host_free(host, rounds * page)


def test_a_copy_for_its_waiter_runs_on_the_waiting_thread():
    # Note [Waiter runs the copy]: on an idle stream a copy issued for a
    # waiter does not wake the worker; the wait runs it. (A spurious wake-up
    # of the worker may still take one now and then: hence not all of them.)
    backend = core.HostBackend(64 * MiB)
    page = 64 * KiB
    device = backend.device_alloc(page)
    host = backend.host_alloc(page)
    backend.write_bytes(device, b"z" * page)
    backend.set_copy_timeline(False, True)
    for _ in range(100):
        backend.copy_to_host(host, device, page, for_waiter=True).wait()
        backend.copy_to_device(device, host, page, for_waiter=True).wait()
    totals = backend.copy_timeline()["totals"]
    assert totals["copies_by_waiter.d2h"] >= 90 and totals["copies_by_waiter.h2d"] >= 90
    assert totals["waits"] == 200
    assert backend.read_bytes(device, page) == b"z" * page
    backend.device_free(device, page)
    backend.host_free(host, page)

"""Statistics: the flat counters of the allocator and the residency manager.

Where this sits in the flow: the native runtime keeps the counters;
:func:`memory_stats` returns them as a flat dict with ``torch.cuda.memory_stats``
style keys (``torch.cuda.memory_stats`` does not work with a pluggable
allocator), and :func:`stats` wraps the main ones in a dataclass that reads well
in a notebook.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Dict, List

from ._native import load_extension
from .config import format_bytes

__all__ = ["memory_stats", "memory_snapshot", "stats", "reset_peak_stats", "MemoryStats"]


def memory_stats() -> Dict[str, float]:
    """All counters as a flat dict; empty before :func:`membudget.install`.

    Keys include ``allocated_bytes.all.{current,peak}``,
    ``reserved_bytes.all.{current,peak}``, ``budget_bytes`` (0: no budget),
    ``num_alloc_retries``, ``num_ooms``, ``swap_out_bytes``, ``swap_in_bytes``,
    ``swap_out_count``, ``swap_in_count``, ``recompute_count``,
    ``recompute_bytes``, ``recomputed_ahead_count`` (replays ahead of use,
    docs/recompute.md "Recompute ahead"; with ``recompute_ahead_failed`` and
    ``recompute_ahead_wasted``), ``evicted_bytes``, ``prefetch_hits``,
    ``prefetch_misses``, ``prefetch_window_used_bytes`` (prefetches issued
    and not yet unpacked: how full the prefetch window is), ``stall_seconds``,
    ``policy_seconds`` (host time spent scoring and ranking eviction
    candidates), plus residency by state
    (``resident_bytes``, ``host_bytes``, ``evictable_bytes``, ``in_use_bytes``)
    ``live_handles``, ``expandable_segments`` (whether device memory comes in
    expandable segments, ``MEMBUDGET_EXPANDABLE_SEGMENTS``), ``segment_page_bytes``
    (their page: the device's granularity on CUDA, a 512th of the budget on
    the CPU; 0 while none is reserved), the bytes
    obtained from and given back to the device (``mapped_bytes_total`` /
    ``unmapped_bytes_total``: pages, or fixed segments) and the bytes of pages
    moved to where a request needed them (``moved_bytes_total``) since the
    last :func:`reset_counters`."""
    return dict(load_extension().memory_stats())


def memory_snapshot() -> List[Dict[str, Any]]:
    """The managed device's memory as segments and blocks, in the format of
    ``torch.cuda.memory_snapshot()``; empty before :func:`membudget.install`.

    Each segment is memory the allocator holds from the device: a fixed
    segment, or one mapped range of an expandable segment (as torch reports
    its own), with ``device`` (the managed device's index; 0 on the CPU),
    ``address``, ``total_size``, ``allocated_size``, ``active_size``,
    ``requested_size``, ``stream``, ``segment_type`` (``"small"`` or
    ``"large"`` pool), ``segment_pool_id`` (always ``(0, 0)``),
    ``is_expandable``, ``frames`` and ``blocks``. Each block has
    ``address``, ``size``, ``state`` (``"active_allocated"``,
    ``"active_awaiting_free"``: freed while a stream given to
    ``record_stream`` may still use it, or ``"inactive"``), ``frames`` and
    ``requested_size``. Not recorded by membudget, so reported as what they
    can be at most: a block's ``requested_size`` is its size, and
    ``frames`` are empty (allocation history is not recorded). The segments'
    ``total_size`` add up to ``reserved_bytes.all.current`` and the allocated
    blocks to ``allocated_bytes.all.current``.

    On CUDA, ``torch.cuda.memory_snapshot()``, ``torch.cuda.memory._snapshot()``
    and ``_dump_snapshot()`` (the file the memory visualizer reads) answer
    with this (Note [Memory snapshots] in ``_cuda_install.py``)."""
    from . import _runtime

    device = _runtime.managed_device_index()
    segments = []
    for raw in load_extension().device_snapshot():
        stream = raw["blocks"][0]["stream"] if raw["blocks"] else 0
        for address, size in raw["mapped_ranges"]:
            blocks = []
            for block in raw["blocks"]:
                start = max(block["address"], address)
                end = min(block["address"] + block["size"], address + size)
                if start >= end:
                    continue
                if block["allocated"]:
                    state = "active_allocated"
                else:
                    state = "active_awaiting_free" if block["awaiting_events"] else "inactive"
                blocks.append({"address": start, "size": end - start, "requested_size": end - start,
                               "state": state, "frames": []})
            allocated = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
            active = allocated + sum(b["size"] for b in blocks if b["state"] == "active_awaiting_free")
            segments.append({
                "device": device, "address": address, "total_size": size, "allocated_size": allocated,
                "active_size": active, "requested_size": allocated, "stream": stream,
                "segment_type": "small" if raw["small_pool"] else "large", "segment_pool_id": (0, 0),
                "is_expandable": raw["expandable"], "frames": [], "blocks": blocks,
            })
    return segments


def reset_peak_stats() -> None:
    """Restart the ``*.peak`` counters from the current values."""
    load_extension().reset_peak_stats()


def reset_counters() -> None:
    """Zero the event counters: swaps, evictions, prefetch hits and misses,
    allocation retries and OOMs (peaks are reset by :func:`reset_peak_stats`)."""
    load_extension().reset_counters()


@dataclass(frozen=True)
class MemoryStats:
    """The main counters of :func:`memory_stats`, with a readable repr."""

    budget_bytes: int = 0
    allocated_bytes: int = 0
    allocated_peak_bytes: int = 0
    reserved_bytes: int = 0
    reserved_peak_bytes: int = 0
    swap_out_bytes: int = 0
    swap_in_bytes: int = 0
    evicted_bytes: int = 0
    prefetch_hits: int = 0
    prefetch_misses: int = 0
    stall_seconds: float = 0.0
    num_alloc_retries: int = 0
    num_ooms: int = 0
    live_handles: int = 0

    def __str__(self) -> str:
        budget = format_bytes(self.budget_bytes) if self.budget_bytes else "none"
        lines = [
            f"membudget: budget {budget}",
            f"  reserved  {format_bytes(self.reserved_bytes):>12}  (peak {format_bytes(self.reserved_peak_bytes)})",
            f"  allocated {format_bytes(self.allocated_bytes):>12}  (peak {format_bytes(self.allocated_peak_bytes)})",
            f"  swapped   out {format_bytes(self.swap_out_bytes)}, in {format_bytes(self.swap_in_bytes)},"
            f" evicted {format_bytes(self.evicted_bytes)}",
            f"  prefetch  {self.prefetch_hits} hits, {self.prefetch_misses} misses,"
            f" stalled {self.stall_seconds:.3f} s",
            f"  retries {self.num_alloc_retries}, OOMs {self.num_ooms}, live handles {self.live_handles}",
        ]
        return "\n".join(lines)

    def _repr_pretty_(self, printer, cycle) -> None:  # IPython / Jupyter
        printer.text(str(self))


def stats() -> MemoryStats:
    """A :class:`MemoryStats` snapshot of the counters (all zero before install)."""
    raw = memory_stats()
    mapping = {
        "budget_bytes": "budget_bytes",
        "allocated_bytes": "allocated_bytes.all.current",
        "allocated_peak_bytes": "allocated_bytes.all.peak",
        "reserved_bytes": "reserved_bytes.all.current",
        "reserved_peak_bytes": "reserved_bytes.all.peak",
    }
    values = {}
    for field in fields(MemoryStats):
        key = mapping.get(field.name, field.name)
        if key in raw:
            values[field.name] = raw[key]
    return MemoryStats(**values)

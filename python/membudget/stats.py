"""Statistics: the flat counters of the allocator and the residency manager.

Where this sits in the flow: the native runtime keeps the counters;
:func:`memory_stats` returns them as a flat dict with ``torch.cuda.memory_stats``
style keys (``torch.cuda.memory_stats`` does not work with a pluggable
allocator), and :func:`stats` wraps the main ones in a dataclass that reads well
in a notebook.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Dict

from ._native import load_extension
from .config import format_bytes

__all__ = ["memory_stats", "stats", "reset_peak_stats", "MemoryStats"]


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

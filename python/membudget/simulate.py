"""``membudget.simulate``: replay a trace under budgets, per policy, on a modelled device.

Where this sits in the flow: a :class:`~membudget.trace.Trace` is compiled
(:mod:`membudget.replay_program`) once per strategy and replayed by the C++
driver (``_C.sim.replay``: the real CachingAllocator, ResidencyManager and
filters over a SimBackend whose clock runs op durations from
:mod:`membudget.costs` and copies at the device's link bandwidth). Each
(policy, budget) gives one :class:`SimRow`. Our policies are the manager's
filters (``delta``, ``lru``, ``largest``, and whatever the build adds); the
baselines are ``none``, ``checkpoint-blocks``, ``swap-all`` and
``offload-prefetch`` (see :mod:`membudget.replay_program`). With
``floor=True`` each budget also gets the optimal overhead of
:func:`membudget.optimal`, and ``overhead_ratio`` is the row's modelled step
time over the optimal step time (compute plus the floor's overhead).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Union

from . import costs
from .config import Percent, format_bytes, parse_bytes
from .replay_program import backward_start_seconds, compile_program, host_seconds, op_durations
from .trace import Trace

__all__ = ["SimRow", "BASELINES", "simulate", "policies", "resolve_budgets", "unbudgeted_peak"]

BASELINES = ("none", "checkpoint-blocks", "swap-all", "offload-prefetch")

#: Budgets, host tiers and reference runs use a device this large when the
#: question is "how much would it take", not "does it fit on this device".
_UNBOUNDED_BYTES = 1 << 50


@dataclass
class SimRow:
    """One simulated (policy, budget): ``feasible`` is False when the replay
    ran out of memory (then the times are up to the failure). Times are
    modelled seconds of one steady-state step; ``swap_bytes`` counts both
    directions; ``overhead_ratio`` is step time over the optimal step time
    (``floor_s``) when a floor was computed, else over the compute time.
    ``unpack_stall_s`` is the part of ``stall_s`` spent by unpacks waiting for
    swap-ins (what the runtime's ``stall_seconds`` counts; the rest is
    synchronous swap-outs on the allocation path). ``recomputed_ahead_count``
    counts replays ahead of use on the side stream (Note [Recompute ahead]);
    they are also in ``recompute_count``, and ``recompute_s`` holds only the
    share of them the compute stream lost (Note [Side stream contention]).
    ``prefetch_hits`` and ``prefetch_misses`` count unpacks that found their
    tensor brought back ahead, or had to swap it in themselves."""

    policy: str
    budget_bytes: int
    feasible: bool
    peak_reserved_bytes: int
    compute_s: float
    stall_s: float
    recompute_s: float
    swap_bytes: int
    overhead_ratio: float
    step_s: float = 0.0
    floor_s: Optional[float] = None
    unpack_stall_s: float = 0.0
    recompute_count: int = 0
    recomputed_ahead_count: int = 0
    prefetch_hits: int = 0
    prefetch_misses: int = 0
    error: str = ""

    def to_dict(self) -> Dict[str, object]:
        """Plain data (for ``--json``; an infeasible row's ratio is None)."""
        data = dataclasses.asdict(self)
        if not math.isfinite(self.overhead_ratio):
            data["overhead_ratio"] = None
        return data


def policies() -> List[str]:
    """The manager's eviction policies in this build (``delta`` first)."""
    from ._native import load_extension

    return list(load_extension().sim.policies())


def _replay(trace: Trace, durations, strategy: str, policy: str, budget: int, capacity: int,
            device: costs.DeviceModel, min_tensor_bytes: int, prefetch_bytes: int, high_watermark: float,
            window: int, actions: str = "swap", expandable_segments: bool = True,
            recompute_ahead: bool = False, side_stream_overlap: float = 0.25,
            record_timeline: bool = False, iterations: int = 2,
            host: Optional[Sequence[float]] = None) -> Dict[str, object]:
    from ._native import load_extension

    program = compile_program(trace, durations, strategy, min_tensor_bytes, window=window,
                              recompute=actions != "swap", host=host)
    return load_extension().sim.replay(
        program.tensor_bytes, program.codes, program.tensors, program.seconds, program.prologue_length,
        budget, capacity, device.link_bytes_per_s, strategy == "manager",
        policy if strategy == "manager" else "delta", prefetch_bytes,
        high_watermark, iterations, actions, program.replay_seconds, program.replay_input_offsets, program.replay_inputs,
        log_decisions=_log_decisions(), expandable_segments=expandable_segments,
        recompute_ahead=recompute_ahead, side_stream_overlap=side_stream_overlap, record_timeline=record_timeline,
        link_duplex_share=device.link_duplex_share, link_compute_share=device.link_compute_share,
        link_latency_s=device.link_latency_s, page_bytes=_segment_page(device, budget, capacity),
        copies_ahead=device.copies_ahead,
        link_rate_by_size=[(float(size), float(rate)) for size, rate in device.link_rate_by_size],
        compute_copy_share=device.compute_copy_share)


def _segment_page(device: costs.DeviceModel, budget: int, capacity: int) -> int:
    """The page of the modelled expandable segments: the device model's, or
    (``page_bytes`` 0, the ``cpu-host`` model) the host backend's for this
    budget (Note [Host pages])."""
    if device.page_bytes:
        return device.page_bytes
    from ._native import load_extension

    return int(load_extension().core.HostBackend.segment_page_for(budget, capacity))


def _log_decisions() -> bool:
    """``MEMBUDGET_LOG=decisions`` (or ``evictions``): the simulated manager
    prints every eviction decision on stderr, as the runtime's does."""
    from .config import Config

    log = Config.from_env().log
    return "decisions" in log or "evictions" in log


def unbudgeted_peak(trace: Trace, device: Union[str, costs.DeviceModel] = "h200") -> int:
    """Peak reserved bytes of the step with nothing managed and no budget:
    what percentage budgets are fractions of."""
    model = costs.device_model(device) if isinstance(device, str) else device
    result = _replay(trace, op_durations(trace, model), "none", "delta", _UNBOUNDED_BYTES, _UNBOUNDED_BYTES,
                     model, 1 << 62, 0, 1.0, 0)
    return int(result["peak_reserved_bytes"])


def resolve_budgets(budgets: Sequence[Union[int, str]], reference_peak: int) -> List[int]:
    """Budgets in bytes: ints as given, strings as sizes (``12GiB``) or
    percentages of ``reference_peak`` (``60%``)."""
    out = []
    for budget in budgets:
        if isinstance(budget, int):
            out.append(budget)
            continue
        value = parse_bytes(str(budget), "budget", percent_of="the unbudgeted peak")
        out.append(value.of(reference_peak) if isinstance(value, Percent) else int(value))
    return out


def simulate(trace: Trace, budgets: Sequence[Union[int, str]], policies: Optional[Sequence[str]] = None,
             device: Union[str, costs.DeviceModel] = "h200", *, baselines: Sequence[str] = BASELINES,
             min_tensor_bytes: int = 1 << 20, prefetch_bytes: int = 256 << 20, high_watermark: float = 0.8,
             actions: str = "both", expandable_segments: bool = True,
             recompute_ahead: bool = False, side_stream_overlap: float = 0.25,
             offload_window: int = 2, iterations: int = 2, floor: bool = False, floor_time_limit_s: float = 60.0,
             host_time: Union[bool, str] = "backward",
             measured: Optional[bool] = None, device_capacity: Optional[int] = None,
             progress: Optional[Callable[[int, int, str], None]] = None) -> List[SimRow]:
    """Simulate ``trace`` at each budget (bytes, ``"12GiB"`` or ``"60%"`` of
    the unbudgeted peak) under each policy (default: all of the build's
    filters) and each baseline, on ``device`` (a name from
    :data:`membudget.costs.DEVICES` or a :class:`~membudget.costs.DeviceModel`).

    ``min_tensor_bytes``, ``prefetch_bytes``, ``high_watermark`` and
    ``actions`` (``swap``, ``recompute``, ``both``) and ``expandable_segments``
    (the simulated allocator's segments; docs/allocator.md) and
    ``recompute_ahead`` are the runtime's
    settings of the same names (with recompute allowed, a dropped tensor's replay
    costs its modelled producer ops, see
    :func:`membudget.replay_program.replay_costs`); ``side_stream_overlap`` is
    the share of a replay ahead that runs hidden behind backward on the side
    stream (an assumption, docs/simulator.md); ``offload_window`` is the number of
    tensors ``offload-prefetch`` brings back ahead. ``iterations`` is how many
    times the step runs (at least 2); the last is measured, predicted from
    the one before it. The first runs without a prediction and tends to
    replay more, so with 2 the measured step's prediction comes from that
    odd one (docs/simulator.md). ``measured`` picks measured
    op durations over the roofline (default: when the trace has them and the
    device is ``cpu-host``). ``device_capacity`` overrides the device's memory
    (default: the model's; a budget above it is infeasible, as on the device).
    ``host_time`` spends traced host time (``TraceOp.host_s``, Note [Host
    time between ops]) on the compute stream when the measured durations are
    used: ``True`` each op's, ``"backward"`` (the default) only the gap
    before backward's first op (Note [Backward's start] in
    :mod:`membudget.replay_program`), ``False`` none (docs/simulator.md says
    why not every gap by default).
    ``progress(done, total, label)`` is called after each replay. Returns one
    :class:`SimRow` per (policy or baseline, budget), budgets in the given
    order."""
    if iterations < 2:
        raise ValueError(f"iterations must be at least 2 (the manager predicts from the previous one), got {iterations}")
    model = costs.device_model(device) if isinstance(device, str) else device
    durations = op_durations(trace, model, measured)
    # Note [Host time between ops]: every gap only when asked (docs/simulator.md);
    # Note [Backward's start]: the engine's start by default.
    if host_time not in (True, False, "backward"):
        raise ValueError(f"host_time must be True, False or 'backward', got {host_time!r}")
    if host_time == "backward":
        host = backward_start_seconds(trace, model, measured)
    elif host_time:
        host = host_seconds(trace, model, measured)
    else:
        host = [0.0] * len(trace.ops)
    reference = unbudgeted_peak(trace, model) if any(isinstance(b, str) for b in budgets) else 0
    budget_bytes = resolve_budgets(budgets, reference)
    names = list(policies) if policies is not None else globals()["policies"]()
    capacity = device_capacity if device_capacity is not None else model.memory_bytes
    compute_total = sum(durations) + sum(host)
    floors: Dict[int, Optional[float]] = {}
    jobs = [(name, b) for b in budget_bytes for name in [*names, *baselines]]
    total = len(jobs) + (len(budget_bytes) if floor else 0)
    done = 0
    if floor:
        from .optimal import optimal

        for b in budget_bytes:
            # The device's memory caps a budget above it, in the floor as in the replay.
            solution = optimal(trace, min(b, capacity), model, min_tensor_bytes=min_tensor_bytes,
                               durations=durations, time_limit_s=floor_time_limit_s)
            floors[b] = compute_total + solution.overhead_s if solution.feasible else None
            done += 1
            if progress:
                progress(done, total, f"floor at {format_bytes(b)}")
    rows = []
    for name, b in jobs:
        strategy = "manager" if name not in BASELINES else name
        r = _replay(trace, durations, strategy, name, b, capacity, model, min_tensor_bytes, prefetch_bytes,
                    high_watermark, offload_window, actions, expandable_segments,
                    recompute_ahead and strategy == "manager", side_stream_overlap, iterations=iterations,
                    host=host)
        step = float(r["total_s"])
        base = floors.get(b) or compute_total
        rows.append(SimRow(
            policy=name, budget_bytes=b, feasible=bool(r["feasible"]),
            peak_reserved_bytes=int(r["peak_reserved_bytes"]), compute_s=float(r["compute_s"]),
            stall_s=float(r["stall_s"]), recompute_s=float(r["recompute_s"]),
            swap_bytes=int(r["swap_out_bytes"]) + int(r["swap_in_bytes"]),
            overhead_ratio=(step / base if base > 0 else 1.0) if r["feasible"] else math.inf,
            unpack_stall_s=float(r["unpack_stall_s"]), recompute_count=int(r["recompute_count"]),
            recomputed_ahead_count=int(r["recomputed_ahead_count"]), step_s=step, floor_s=floors.get(b),
            prefetch_hits=int(r["prefetch_hits"]), prefetch_misses=int(r["prefetch_misses"]),
            error=str(r["error"]).splitlines()[0] if r["error"] else ""))
        done += 1
        if progress:
            progress(done, total, f"{name} at {format_bytes(b)}")
    return rows

"""Per-op cost model: FLOPs, bytes moved, and a roofline time on a device model.

Where this sits in the flow: three consumers ask "how long does this op take?"
without running it on the device in question:

* the runtime's recompute decisions (:mod:`membudget.lineage`) when forward did
  not measure an op (the measured duration wins when there is one);
* the simulator (:mod:`membudget.simulate`), which replays traces on modelled
  GPUs far larger than this machine;
* the Echo planner, which needs a layer-specific estimate (a pointwise op is
  memory-bound and nearly free to recompute, a matmul is not) rather than one
  constant per op.

An op's modelled time is ``launch_s + max(flops / flop_rate(dtype), bytes /
memory_bandwidth)``: the roofline of its arithmetic and its memory traffic
plus a fixed launch overhead. FLOPs follow ``torch.utils.flop_counter``'s
formulas (matmul, convolution, attention); every other op counts one FLOP per
output element, which only matters for ops that are memory-bound anyway.

Device models are data (:data:`DEVICES`); ``cpu-host`` is calibrated on first
use by a short micro-benchmark of this machine (matmul rate and copy bandwidth).
"""
from __future__ import annotations

import dataclasses
import functools
import mmap
import statistics
import time
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

import torch

__all__ = [
    "DeviceModel",
    "DEVICES",
    "calibrate_cpu_host",
    "device_model",
    "op_category",
    "op_flops",
    "op_bytes",
    "roofline_seconds",
    "tensors_in",
]

GB = 10**9
TFLOP = 10**12


@dataclass(frozen=True)
class DeviceModel:
    """A device as the cost model sees it. Rates are sustained, not peak-sheet,
    where a measurement exists. ``flops_per_s`` maps a dtype class
    (``"fp32"``, ``"bf16"``, ``"fp16"``, ``"fp64"``, ``"int"``) to FLOP/s;
    ``link_bytes_per_s`` is one direction of the host link (swap copies),
    alone and with the compute stream idle; ``link_duplex_share`` and
    ``link_compute_share`` say how it slows when the other direction or the
    compute stream runs beside it."""

    name: str
    memory_bytes: int
    flops_per_s: Mapping[str, float]
    memory_bytes_per_s: float
    link_bytes_per_s: float
    launch_s: float
    note: str = ""
    #: Note [Modelled link] (csrc/core/sim_link.h): the fraction of
    #: ``link_bytes_per_s`` each direction keeps while the other also copies
    #: (1.0: a full-duplex PCIe link; 0.5: memcpy threads sharing one memory bus).
    link_duplex_share: float = 1.0
    #: Fraction of the link rate a copy gets while the compute stream runs
    #: (1.0: copy engines independent of the kernels, as on a GPU).
    link_compute_share: float = 1.0
    #: Seconds from issuing a copy to its earliest start (the host backend's
    #: hand-off to its copy thread and back; kept 0 for the GPUs, whose copy
    #: launch costs microseconds against milliseconds of copying).
    link_latency_s: float = 0.0
    #: Note [Rate by copy size] (csrc/core/sim_link.h): ``(bytes, bytes/s)``
    #: points, a copy's rate alone by its size, interpolated in log bytes and
    #: clamped at the ends; empty (the GPUs): every copy at ``link_bytes_per_s``.
    #: The host backend's memcpy is faster while the caches hold its buffers.
    link_rate_by_size: Tuple[Tuple[int, float], ...] = ()
    #: Note [Compute beside a copy] (csrc/core/sim_link.h): the fraction of its
    #: rate compute keeps while a copy runs. 1.0 for the GPUs, whose DMA engines
    #: leave the kernels alone; on the host a memcpy thread takes memory
    #: bandwidth (and a core of two) from the compute thread.
    compute_copy_share: float = 1.0
    #: The granularity of expandable segments' pages: a GPU's physical
    #: allocation granularity; 0 for the host backend's, which depends on the
    #: budget (Note [Host pages] in csrc/core/host_backend.h).
    page_bytes: int = 2 << 20
    #: Whether the runtime copies to host ahead of need on this device (Note
    #: [Copies ahead where copies are free]): on a GPU's copy engines, not
    #: with the host backend's memcpy threads, as ``install()`` decides.
    copies_ahead: bool = True

    def flop_rate(self, dtype: Optional[torch.dtype]) -> float:
        """FLOP/s for arithmetic in ``dtype`` (fp32 when unknown)."""
        key = _dtype_class(dtype)
        return float(self.flops_per_s.get(key, self.flops_per_s["fp32"]))

    def to_dict(self) -> Dict[str, Any]:
        """Plain-data form (for traces, JSON output and reports)."""
        data = dataclasses.asdict(self)
        data["flops_per_s"] = dict(self.flops_per_s)
        return data


def _dtype_class(dtype: Optional[torch.dtype]) -> str:
    if dtype in (torch.bfloat16,):
        return "bf16"
    if dtype in (torch.float16,):
        return "fp16"
    if dtype in (torch.float64,):
        return "fp64"
    if dtype is not None and not dtype.is_floating_point and not dtype.is_complex:
        return "int"
    return "fp32"


# Published dense rates; H200 bf16 and HBM as measured on one (issue 4), the
# fp32 rates are TF32-free CUDA-core rates since PyTorch keeps TF32 off for
# matmul by default.
_STATIC_DEVICES: Dict[str, DeviceModel] = {
    "h200": DeviceModel(
        name="h200", memory_bytes=141 * GB,
        flops_per_s={"bf16": 790 * TFLOP, "fp16": 790 * TFLOP, "fp32": 67 * TFLOP, "fp64": 34 * TFLOP,
                     "int": 67 * TFLOP},
        memory_bytes_per_s=4.3e12, link_bytes_per_s=55 * GB, launch_s=5e-6,
        note="NVIDIA H200 SXM: bf16 and HBM measured, host link PCIe 5 (55 GB/s per direction)"),
    "a100-40gb": DeviceModel(
        name="a100-40gb", memory_bytes=40 * (1 << 30),
        flops_per_s={"bf16": 312 * TFLOP, "fp16": 312 * TFLOP, "fp32": 19.5 * TFLOP, "fp64": 9.7 * TFLOP,
                     "int": 19.5 * TFLOP},
        memory_bytes_per_s=1.555e12, link_bytes_per_s=25 * GB, launch_s=5e-6,
        note="NVIDIA A100 40GB SXM: data-sheet dense rates, PCIe 4 host link"),
    "rtx4090": DeviceModel(
        name="rtx4090", memory_bytes=24 * (1 << 30),
        flops_per_s={"bf16": 165 * TFLOP, "fp16": 165 * TFLOP, "fp32": 82.6 * TFLOP, "fp64": 1.3 * TFLOP,
                     "int": 82.6 * TFLOP},
        memory_bytes_per_s=1.008e12, link_bytes_per_s=25 * GB, launch_s=5e-6,
        note="NVIDIA RTX 4090: data-sheet dense rates (fp32 accumulate), PCIe 4 host link"),
}


@functools.lru_cache(maxsize=1)
def _calibrated_cpu_host() -> DeviceModel:
    """:func:`calibrate_cpu_host`, once per process."""
    return calibrate_cpu_host()


def calibrate_cpu_host() -> DeviceModel:
    """Measure this machine now: fp32 matmul rate, memory bandwidth, the
    per-op dispatch overhead, and the host backend's copy "link"
    (:func:`_calibrate_host_link`). Takes about half a second. On a machine
    shared with other work the link figures move with its load: a comparison
    with real runs calibrates beside them (bench/bench_simulate.py validate)."""
    threads = torch.get_num_threads()
    n = 512
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    reps = 8
    start = time.perf_counter()
    for _ in range(reps):
        torch.mm(a, b)
    flop_rate = 2 * n**3 * reps / (time.perf_counter() - start)

    src = torch.empty(32 << 20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start = time.perf_counter()
    for _ in range(4):
        dst.copy_(src)
    # A copy reads and writes every byte; the bandwidth figure is bytes moved.
    copy_rate = 4 * src.numel() / (time.perf_counter() - start)

    tiny = torch.ones(4)
    start = time.perf_counter()
    for _ in range(200):
        torch.add(tiny, tiny)
    launch = (time.perf_counter() - start) / 200

    from .config import physical_memory_bytes

    link = _calibrate_host_link()
    link_rate = link["bytes_per_s"] if link else copy_rate
    note = (f"this machine, calibrated with {threads} torch threads (matmul, memcpy, tiny-op dispatch; "
            + (f"host backend copies {link_rate / 1e9:.1f} GB/s alone, {link['both_bytes_per_s'] / 1e9:.1f} GB/s "
               f"both directions together, x{link['compute_share']:.2f} beside compute, "
               f"{link['latency_s'] * 1e6:.0f} us hand-off; {describe_rate_by_size(link['rate_by_size'])}; "
               f"compute x{link['compute_copy_share']:.2f} beside a copy)"
               if link else
               "no native build: link = torch copy rate)"))
    return DeviceModel(
        name="cpu-host", memory_bytes=int(physical_memory_bytes()),
        flops_per_s={"fp32": flop_rate, "bf16": flop_rate / 4, "fp16": flop_rate / 4,
                     "fp64": flop_rate / 2, "int": flop_rate / 2},
        memory_bytes_per_s=2 * copy_rate, link_bytes_per_s=link_rate, launch_s=launch, note=note,
        link_duplex_share=link["duplex_share"] if link else 1.0, page_bytes=0,
        link_latency_s=link["latency_s"] if link else 0.0,
        link_compute_share=link["compute_share"] if link else 1.0, copies_ahead=False,
        link_rate_by_size=link["rate_by_size"] if link else (),
        compute_copy_share=link["compute_copy_share"] if link else 1.0)


def describe_rate_by_size(points: Iterable[Tuple[int, float]]) -> str:
    """``link_rate_by_size`` in words, e.g. ``by copy size 256 KiB 23.0, 1024
    KiB 29.8 GB/s`` (Note [Rate by copy size])."""
    return "by copy size " + ", ".join(f"{size >> 10} KiB {rate / 1e9:.1f}" for size, rate in points) + " GB/s"


#: Copies of this size calibrate the host link: what the benches swap (saved
#: activations of 1-8 MiB), over more buffers than the last-level cache holds.
_LINK_COPY_BYTES = 4 << 20
_LINK_BUFFERS = 8
#: Note [Rate by copy size]: the sizes the rate alone is also measured at,
#: over the same buffers, warm (a 256 KiB copy's eight buffers stay in the
#: caches, an 8 MiB one's do not).
_LINK_RATE_SIZES = (256 << 10, 1 << 20, _LINK_COPY_BYTES, 8 << 20)
#: Note [Compute beside a copy]: copies of ``_LINK_COPY_BYTES`` queued while
#: compute is timed beside them (128 MiB: several ops' worth at 10 GB/s).
_COMPUTE_BESIDE_COPIES = 32


def _calibrate_host_link(trials: int = 5) -> Optional[Dict[str, float]]:
    """The host backend's copy rates, measured through its own copy threads
    (memcpy between pre-touched buffers, timed by the copy timeline, Note
    [Copy timeline]): one direction alone; both directions at once
    (``duplex_share``: each one's rate then, over its rate alone); one
    direction while this thread runs compute (``compute_share``: that rate over
    the rate alone); ``latency_s``, the median time a synchronous copy of
    one page takes beyond its memcpy (the hand-off to the copy thread and the
    wake-up of the waiter); ``rate_by_size``, one direction alone at each
    of ``_LINK_RATE_SIZES`` (Note [Rate by copy size]); and
    ``compute_copy_share``, the compute rate while a copy runs over the rate
    alone (Note [Compute beside a copy]: the same ops timed one by one
    beside a stream of copy-outs, then with the copy threads idle). Each the median of ``trials`` rounds: other
    processes on the machine take cores from the copy threads or from the
    compute thread at random, which moves single rounds either way. None
    without the native extension."""
    try:
        from ._native import load_extension

        core = load_extension().core
    except Exception:  # noqa: BLE001 - no native build: the caller falls back to torch's copy rate
        return None
    backend = core.HostBackend(0)
    largest = max(_LINK_COPY_BYTES, *_LINK_RATE_SIZES)
    device = [backend.device_alloc(largest) for _ in range(_LINK_BUFFERS)]
    host = [backend.host_alloc(largest) for _ in range(_LINK_BUFFERS)]
    fill = b"\x01" * largest
    for address in device + host:
        backend.write_bytes(address, fill)
    # Compute that, like a training step's, streams through memory as well as
    # multiplying: a matmul and a pointwise op over a few MiB.
    a, w, x = torch.randn(1024, 256), torch.randn(256, 512), torch.randn(1024, 1024)

    def compute_op() -> float:
        start = time.perf_counter()
        torch.mm(a, w)
        torch.nn.functional.gelu(x)
        return time.perf_counter() - start

    def rates(directions: Tuple[str, ...], computing: bool, size: int = _LINK_COPY_BYTES) -> Dict[str, float]:
        backend.set_copy_timeline(False, True)
        events = []
        for _ in range(2):
            for i in range(_LINK_BUFFERS):
                if "d2h" in directions:
                    events.append(backend.copy_to_host(host[i], device[i], size))
                if "h2d" in directions:
                    events.append(backend.copy_to_device(device[(i + 1) % _LINK_BUFFERS],
                                                         host[(i + 3) % _LINK_BUFFERS], size))
        while computing and not events[-1].ready():
            compute_op()
        for event in events:
            event.wait()
        totals = backend.copy_timeline()["totals"]
        return {lane: totals[f"bytes.{lane}"] / totals[f"busy_seconds.{lane}"]
                for lane in directions if totals[f"busy_seconds.{lane}"] > 0}

    def warm_rate(size: int) -> float:
        # Note [Rate by copy size]: a copy-out reads an activation that compute
        # has just written, so the buffers are copied once untimed first: they
        # then stay in the caches as far as the caches hold them.
        rates(("d2h",), False, size)
        return rates(("d2h",), False, size)["d2h"]

    def latency() -> float:
        backend.set_copy_timeline(False, True)
        overheads = []
        for _ in range(16):
            torch.mm(a[:256], w)  # the copy thread has gone back to sleep, as between two unpacks
            start = time.perf_counter()
            backend.copy_to_host(host[0], device[0], mmap.PAGESIZE).wait()
            overheads.append(time.perf_counter() - start)
        busy = backend.copy_timeline()["totals"]["busy_seconds.d2h"] / len(overheads)
        return max(0.0, sorted(overheads)[len(overheads) // 2] - busy)

    def compute_share_beside_copy() -> float:
        # Note [Compute beside a copy]: the ops that ran wholly beside a
        # stream of copy-outs (long enough for several), then as many with
        # the copy threads idle; the ratio of their total times (a throughput:
        # an op the copy thread preempts counts, as it does in a step).
        events = [backend.copy_to_host(host[i % _LINK_BUFFERS], device[i % _LINK_BUFFERS], _LINK_COPY_BYTES)
                  for i in range(_COMPUTE_BESIDE_COPIES)]
        beside: List[float] = []
        while not events[-1].ready():
            seconds = compute_op()
            if not events[-1].ready():
                beside.append(seconds)
        for event in events:
            event.wait()
        if not beside:  # the copies ended within one op: nothing to compare
            return 1.0
        return sum(compute_op() for _ in beside) / sum(beside)

    try:
        rounds = [(rates(("d2h",), False)["d2h"], sum(rates(("d2h", "h2d"), False).values()),
                   rates(("d2h",), True)["d2h"], compute_share_beside_copy(), latency(),
                   *(warm_rate(size) for size in _LINK_RATE_SIZES)) for _ in range(trials)]
        alone, both, beside, compute_beside, hand_off, *by_size = (statistics.median(values)
                                                                   for values in zip(*rounds))
    finally:
        for address in device:
            backend.device_free(address, largest)
        for address in host:
            backend.host_free(address, largest)
    return {"bytes_per_s": alone, "both_bytes_per_s": both, "duplex_share": min(1.0, both / (2 * alone)),
            "compute_share": max(0.05, min(1.0, beside / alone)), "latency_s": hand_off,
            "compute_copy_share": max(0.05, min(1.0, compute_beside)),
            "rate_by_size": tuple(zip(_LINK_RATE_SIZES, by_size))}


DEVICES: Tuple[str, ...] = ("cpu-host", *_STATIC_DEVICES)


def device_model(name: str) -> DeviceModel:
    """The device model called ``name`` (one of :data:`DEVICES`); ``cpu-host``
    is measured on first use. Raises ``ValueError`` listing the known names."""
    if name == "cpu-host":
        return _calibrated_cpu_host()
    if name not in _STATIC_DEVICES:
        raise ValueError(f"unknown device model {name!r}: known are {', '.join(DEVICES)}")
    return _STATIC_DEVICES[name]


# Echo's point: recompute cost is layer-specific. These categories are what
# the planner and the director reason about; unknown ops are "other".
_CATEGORY_BY_NAME = {
    "matmul": ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_scaled_mm", "addbmm", "einsum"),
    "conv": ("convolution", "_convolution", "conv1d", "conv2d", "conv3d", "mkldnn_convolution",
             "cudnn_convolution", "conv_transpose2d"),
    "attention": ("_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
                  "_scaled_dot_product_flash_attention_for_cpu", "scaled_dot_product_attention",
                  "_scaled_dot_product_cudnn_attention", "_flash_attention_forward",
                  "_efficient_attention_forward", "_softmax", "softmax", "_log_softmax"),
    "norm": ("native_layer_norm", "native_batch_norm", "_native_batch_norm_legit",
             "_native_batch_norm_legit_no_training", "native_group_norm", "_fused_rms_norm",
             "layer_norm", "batch_norm", "group_norm", "rms_norm"),
    "rnn": ("mkldnn_rnn_layer", "_cudnn_rnn", "lstm", "gru", "_thnn_fused_lstm_cell"),
    "view": ("view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "slice",
             "select", "unsqueeze", "squeeze", "as_strided", "alias", "split", "split_with_sizes",
             "chunk", "unbind", "detach", "_reshape_alias", "view_as", "narrow", "diagonal"),
    "reduction": ("sum", "mean", "amax", "max", "min", "var_mean", "var", "std", "norm",
                  "nll_loss_forward", "cross_entropy_loss"),
}
_CATEGORY = {op: category for category, ops in _CATEGORY_BY_NAME.items() for op in ops}


def op_category(func: Any) -> str:
    """Coarse class of an aten op (overload or packet): ``matmul``, ``conv``,
    ``attention``, ``norm``, ``rnn``, ``view``, ``reduction``, or ``pointwise``
    for the rest (elementwise ops, copies, embedding lookups)."""
    name = _op_base_name(func)
    return _CATEGORY.get(name, "pointwise")


def _op_base_name(func: Any) -> str:
    packet = getattr(func, "overloadpacket", func)
    name = getattr(packet, "__name__", str(packet))
    return name.split(".")[-1]


def tensors_in(tree: Any) -> Iterable[torch.Tensor]:
    """Every tensor in a nested structure of args/kwargs/outputs."""
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for item in tree:
            yield from tensors_in(item)
    elif isinstance(tree, dict):
        for item in tree.values():
            yield from tensors_in(item)


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def op_bytes(args: Any, kwargs: Any, out: Any) -> Tuple[int, int]:
    """(bytes read, bytes written): the sizes of the tensor inputs and outputs.
    Works on fake and meta tensors (shapes only)."""
    read = sum(_tensor_bytes(t) for t in tensors_in((args, kwargs)))
    written = sum(_tensor_bytes(t) for t in tensors_in(out))
    return read, written


def op_flops(func: Any, args: Any, kwargs: Any, out: Any) -> int:
    """FLOPs of one op call by ``torch.utils.flop_counter``'s formulas (matmul,
    convolution, attention and their backward); one FLOP per output element for
    ops it has no formula for (views: zero)."""
    from torch.utils.flop_counter import flop_registry

    packet = getattr(func, "overloadpacket", func)
    formula = flop_registry.get(packet)
    if formula is not None:
        try:
            return int(formula(*args, **(kwargs or {}), out_val=out))
        except Exception:  # noqa: BLE001 - an odd signature falls back to the element count
            pass
    if op_category(func) == "view":
        return 0
    return sum(t.numel() for t in tensors_in(out))


def roofline_seconds(flops: int, bytes_moved: int, device: DeviceModel,
                     dtype: Optional[torch.dtype] = None, category: str = "pointwise") -> float:
    """Modelled duration of one op on ``device``: launch overhead plus the
    larger of its compute time and its memory time. Views cost nothing (they
    launch no kernel)."""
    if category == "view":
        return 0.0
    compute = flops / device.flop_rate(dtype)
    memory = bytes_moved / device.memory_bytes_per_s
    return device.launch_s + max(compute, memory)

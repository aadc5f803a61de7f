"""Run-time configuration: every ``MEMBUDGET_*`` environment variable, parsed here.

Where this sits in the flow: ``membudget.install()`` (and ``membudget run``,
which validates its flags here first) calls :meth:`Config.from_env` once; the
resulting frozen :class:`Config` is what the native allocator, the residency
manager and the hooks are configured from. No other module reads ``MEMBUDGET_*``
run-time variables. A bad value is a :class:`ConfigError` that names the
variable, the value and what is accepted.

Variables
---------
``MEMBUDGET_BUDGET``
    Device-memory budget: reserved bytes never exceed it. Unset means no budget
    (unbounded: membudget then only counts). Accepts plain bytes
    (``123456789``), a size with a unit (``512MB``, ``512MiB``, ``12GiB``,
    ``1.5G``, ``64K``, ``2T``) or a percentage of the device's memory (``60%``,
    above 0 and at most 100). Units: ``KB``/``MB``/``GB``/``TB`` are decimal SI
    (10^3, 10^6, 10^9, 10^12 bytes); ``KiB``/``MiB``/``GiB``/``TiB`` *and the
    bare letters* ``K``/``M``/``G``/``T`` are binary (2^10, 2^20, 2^30, 2^40),
    as in PyTorch's and most tools' usage. ``B`` means bytes. Case and spaces
    do not matter (``1.5 gib`` is ``1.5GiB``). Fractions are allowed with a
    unit and rounded down to whole bytes; a size must come to at least 1 byte.
``MEMBUDGET_HOST_BUDGET``
    Host (pinned CPU) memory that swapped-out activations may occupy. Same
    syntax; a percentage is of physical RAM. Default: half of physical RAM.
``MEMBUDGET_POLICY``
    Which eviction filter scores victims: ``delta`` (default; bytes freed
    per second of the stall the director's action would cost, weighted by
    the distance to the predicted next use from the last iteration), ``dtr`` (Dynamic Tensor
    Rematerialization: (cost + evicted-neighbourhood cost) / (size x
    staleness), smallest first), ``msps`` (Capuchin: memory saved per second
    of the cost to bring it back), ``lru`` (least recently used) or
    ``largest`` (largest first).
``MEMBUDGET_ACTIONS``
    What may be done with a victim: ``swap`` (copy to host), ``recompute``
    (drop it and replay the ops that made it when it is needed) or ``both``
    (default; the director picks per victim the smaller expected stall).
    With ``recompute`` or ``both``, forward ops are recorded (lineage) on the
    thread that called ``install()`` and on non-daemon threads started after
    it; ``swap`` records nothing.
``MEMBUDGET_LINEAGE``
    Which recorder keeps those forward ops: ``python`` (a
    ``TorchDispatchMode``, the reference), ``cxx`` (a thread-local
    ``at::RecordFunction`` callback recording in C++, with the pack-time
    closure and the replay in C++ too; the same lineage at a fraction of the
    per-op cost, docs/recompute.md) or ``auto`` (default: ``cxx`` on the
    CPU, ``python`` on CUDA, Note [Lineage recorder by default];
    :func:`resolve_lineage`).
``MEMBUDGET_MIN_TENSOR_BYTES``
    Saved tensors smaller than this are left alone. Size syntax without a
    percentage; default 1 MiB; ``0`` manages every saved tensor.
``MEMBUDGET_PREFETCH_BYTES``
    Byte window of swap-ins issued ahead of use in backward (a swap-in that
    would arrive late even if issued now may go past it). Size syntax
    without a percentage; default 256 MiB; ``0`` disables prefetch.
``MEMBUDGET_HIGH_WATERMARK``
    Fraction of the budget (of the device's memory when that is smaller)
    above which background swap-out starts, a number above 0 and at most 1;
    default 0.8.
``MEMBUDGET_LOG``
    Comma-separated log channels: ``decisions``, ``evictions``, ``prefetch``,
    ``summary``. Default: none.
``MEMBUDGET_EXPANDABLE_SEGMENTS``
    ``1`` (default) or ``0`` (also ``true``/``false``, ``on``/``off``,
    ``yes``/``no``). With it, device memory comes in one growing virtual
    range per pool and stream whose pages are mapped on demand (CUDA's
    virtual memory API; mmap on the CPU), so free fragments go back to the
    budget and a large request fits wherever the budget has room. Without it,
    fixed segments as in PyTorch's default allocator, where free memory split
    across segments can make a request fail. Fixed when the allocator is
    created (the first ``install()``); a device without virtual memory
    management uses fixed segments.
``MEMBUDGET_RECOMPUTE_AHEAD``
    ``auto`` (default), or a switch as above. With it, the prefetcher also
    replays dropped activations ahead of their use in backward, within the
    prefetch window (CUDA: on a side stream, the compute stream waits only on
    its event; CPU: only while backward would wait for a swap-in). ``auto``
    is on where the benchmarks showed it pays: see
    :func:`resolve_recompute_ahead`.

``MEMBUDGET_CHECKPOINT``
    ``replace`` (default) or ``keep``. With ``replace``, while a budget is set,
    non-reentrant ``torch.utils.checkpoint`` regions (the default mode, and
    transformers' ``gradient_checkpointing_enable()``) with the default
    ``context_fn`` run as plain forward code on the thread that called
    ``install()``: their activations are saved through membudget, which
    swaps or drops them as the budget requires, instead of being held by the
    checkpoint where nothing can evict them. Selective activation
    checkpointing's regions run so too, their policy's recomputed outputs
    planned as drops. Results are the same (the
    checkpoint would replay the same ops under the same RNG state). ``keep``
    leaves every checkpoint as PyTorch runs it (docs/recompute.md,
    "Gradient checkpointing under a budget").

``MEMBUDGET_COMPILE``
    ``plan`` (default) or ``off``. With ``plan``, while a budget is set,
    every graph ``torch.compile`` hands to inductor is split into forward and
    backward by the Echo planner against what the budget leaves that graph
    (what else is allocated and cannot be evicted, and the state the live
    optimizers will create), recomputing in backward instead of saving where
    the graph's own activations would not fit; graphs that fit are split as
    before. Needs torch 2.9 or newer (inductor's ``custom_partitioner_fn``);
    a partitioner the user set there is kept. ``off`` leaves inductor's own
    partitioner (docs/planner.md, "Compiled graphs under the budget").

``MEMBUDGET_BUILD_DIR``, ``MEMBUDGET_BUILD_JOBS`` and ``MEMBUDGET_WITH_CUDA``
are build-time variables read by ``setup.py`` (which cannot import this
package); they are listed in :data:`BUILD_VARIABLES` only so that they are not
reported as unknown. Any other ``MEMBUDGET_*`` variable draws a warning that
names the closest known one, since a misspelt variable silently does nothing.
"""
from __future__ import annotations

import difflib
import math
import os
import re
import warnings
from dataclasses import dataclass, field as dataclass_field
from decimal import Decimal, InvalidOperation
from typing import Callable, Dict, FrozenSet, Iterable, Mapping, Optional, Tuple, Union

__all__ = [
    "ACTIONS",
    "BUILD_VARIABLES",
    "Config",
    "ConfigError",
    "LOG_CHANNELS",
    "POLICIES",
    "Percent",
    "VARIABLES",
    "Variable",
    "describe",
    "env_table_markdown",
    "format_bytes",
    "parse_bytes",
    "parse_value",
    "physical_memory_bytes",
    "resolve_budget",
    "resolve_recompute_ahead",
    "resolve_lineage",
]

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

POLICIES: Tuple[str, ...] = ("delta", "dtr", "msps", "lru", "largest")
ACTIONS: Tuple[str, ...] = ("swap", "recompute", "both")
LOG_CHANNELS: Tuple[str, ...] = ("decisions", "evictions", "prefetch", "summary")
RECORDERS: Tuple[str, ...] = ("auto", "python", "cxx")
CHECKPOINT_MODES: Tuple[str, ...] = ("replace", "keep")
COMPILE_MODES: Tuple[str, ...] = ("plan", "off")
BUILD_VARIABLES: Tuple[str, ...] = (
    "MEMBUDGET_BUILD_DIR",
    "MEMBUDGET_BUILD_JOBS",
    "MEMBUDGET_WITH_CUDA",
)

DEFAULT_POLICY = "delta"
DEFAULT_ACTIONS = "both"
DEFAULT_LINEAGE = "auto"
DEFAULT_MIN_TENSOR_BYTES = 1 * MiB
DEFAULT_PREFETCH_BYTES = 256 * MiB
DEFAULT_HIGH_WATERMARK = 0.8
DEFAULT_HOST_BUDGET_FRACTION = 0.5

# Lower-case unit -> bytes. Bare letters are binary on purpose: "12G" in a
# PyTorch context almost always means GiB; the SI spellings stay exact SI.
_UNITS: Dict[str, int] = {
    "": 1, "b": 1,
    "k": KiB, "ki": KiB, "kib": KiB, "kb": 10**3,
    "m": MiB, "mi": MiB, "mib": MiB, "mb": 10**6,
    "g": GiB, "gi": GiB, "gib": GiB, "gb": 10**9,
    "t": 1 << 40, "ti": 1 << 40, "tib": 1 << 40, "tb": 10**12,
}
_SIZE_PATTERN = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z%]*)\s*$", re.IGNORECASE)


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names the variable
    (or keyword), the value as given and what is accepted."""


@dataclass(frozen=True)
class Percent:
    """A size given as a percentage (above 0, at most 100) of some total that is
    only known later, such as the device's memory; :meth:`of` turns it into
    bytes once the total is known."""

    value: Decimal

    def of(self, total_bytes: int) -> int:
        """Return this percentage of ``total_bytes`` as whole bytes (rounded
        down), the form the allocator takes a budget in."""
        return int(Decimal(total_bytes) * self.value / 100)

    def __str__(self) -> str:
        return f"{self.value.normalize():f}%"


def _size_forms(percent_of: Optional[str]) -> str:
    forms = "bytes (123456789), units (512MB, 12GiB, 1.5G)"
    if percent_of is None:
        return forms.replace(", units", " or units")
    return f"{forms} or a percentage of {percent_of} (60%)"


def parse_bytes(
    text: Union[str, int],
    variable: str,
    *,
    percent_of: Optional[str] = None,
    allow_zero: bool = False,
) -> Union[int, Percent]:
    """Parse a size such as ``123456789``, ``512MB``, ``12GiB``, ``1.5G`` or (when
    ``percent_of`` names what it is a percentage of, e.g. ``"device memory"``)
    ``60%``, and return whole bytes as an ``int`` or a :class:`Percent`. KB, MB,
    GB, TB are decimal; KiB, MiB, GiB, TiB and bare K, M, G, T are binary; case
    and spaces are ignored. Zero is refused unless ``allow_zero``; empty,
    negative, nan/inf, unknown units, fractions of a byte and percentages
    outside (0, 100] raise :class:`ConfigError` naming ``variable`` and the
    value. An ``int`` is accepted as a byte count, for keyword overrides."""
    forms = _size_forms(percent_of)

    def fail(reason: str = "") -> ConfigError:
        detail = f"{reason}; use " if reason else "use "
        return ConfigError(f"{variable}={text!r} is not a size: {detail}{forms}")

    if isinstance(text, bool):
        raise fail()
    if isinstance(text, int):
        number, unit = Decimal(text), ""
    elif isinstance(text, str):
        match = _SIZE_PATTERN.match(text)
        if match is None:
            stripped = text.strip()
            if not stripped:
                raise fail("it is empty")
            if stripped.startswith("-"):
                raise fail("it is negative")
            raise fail()
        try:
            number = Decimal(match.group(1))
        except InvalidOperation:  # pragma: no cover - the pattern admits only decimals
            raise fail() from None
        unit = match.group(2).lower()
    else:
        raise fail()

    if number < 0:
        raise fail("it is negative")
    if unit == "%":
        if percent_of is None:
            raise fail("a percentage is not accepted here")
        if not 0 < number <= 100:
            raise fail("a percentage must be above 0 and at most 100")
        return Percent(number)
    if unit not in _UNITS:
        raise fail()
    exact = number * _UNITS[unit]
    if exact == 0:
        if allow_zero:
            return 0
        raise fail("it must be more than 0 bytes")
    if exact < 1:
        raise fail("it comes to less than 1 byte")
    if unit in ("", "b") and exact != exact.to_integral_value():
        raise fail("a byte count must be a whole number")
    return int(exact)


def physical_memory_bytes() -> int:
    """Return this machine's physical RAM in bytes (page size times page count),
    the total that a ``MEMBUDGET_HOST_BUDGET`` percentage and the default host
    budget are taken of."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def resolve_budget(spec: Optional[Union[str, int]], device_capacity_bytes: Optional[int]) -> Optional[int]:
    """Turn a ``MEMBUDGET_BUDGET`` spec (``"12GiB"``, ``"60%"``, ``123456789``)
    into bytes for a device of ``device_capacity_bytes``, which is only needed
    for a percentage. ``None`` (no budget) resolves to ``None``, meaning
    unbounded. Raises :class:`ConfigError` for a bad spec, for a percentage
    without a known capacity, or when the percentage comes to less than 1 byte."""
    if spec is None:
        return None
    variable = "MEMBUDGET_BUDGET"
    size = parse_bytes(spec, variable, percent_of="device memory")
    if isinstance(size, int):
        return size
    if not device_capacity_bytes or device_capacity_bytes <= 0:
        raise ConfigError(
            f"{variable}={spec!r} is a percentage of device memory, but the device's "
            f"capacity is not known ({device_capacity_bytes!r}); give the budget in bytes "
            "or units instead (512MB, 12GiB)"
        )
    resolved = size.of(device_capacity_bytes)
    if resolved < 1:
        raise ConfigError(f"{variable}={spec!r} comes to less than 1 byte of a {device_capacity_bytes}-byte device")
    return resolved


def _parse_budget(value: Union[str, int], label: str) -> str:
    parse_bytes(value, label, percent_of="device memory")
    return value.strip() if isinstance(value, str) else str(value)


def _parse_host_budget(value: Union[str, int], label: str) -> int:
    size = parse_bytes(value, label, percent_of="physical RAM")
    if isinstance(size, Percent):
        resolved = size.of(physical_memory_bytes())
        if resolved < 1:
            raise ConfigError(f"{label}={value!r} comes to less than 1 byte of physical RAM")
        return resolved
    return size


def _parse_unsigned_size(value: Union[str, int], label: str) -> int:
    size = parse_bytes(value, label, allow_zero=True)
    assert isinstance(size, int)
    return size


def _parse_policy(value: str, label: str) -> str:
    policy = str(value).strip().lower()
    if policy in POLICIES:
        return policy
    accepted = ", ".join(POLICIES)
    raise ConfigError(f"{label}={value!r} is not a policy: use one of {accepted}")


def _parse_actions(value: str, label: str) -> str:
    actions = str(value).strip().lower()
    if actions in ACTIONS:
        return actions
    raise ConfigError(f"{label}={value!r} is not an action: use swap, recompute or both")


def _parse_lineage(value: str, label: str) -> str:
    recorder = str(value).strip().lower()
    if recorder in RECORDERS:
        return recorder
    raise ConfigError(f"{label}={value!r} is not a lineage recorder: use auto, python or cxx")


def _parse_high_watermark(value: Union[str, float], label: str) -> float:
    message = f"{label}={value!r} is not a fraction: use a number above 0 and at most 1 (e.g. 0.8)"
    if isinstance(value, bool):
        raise ConfigError(message)
    try:
        fraction = float(value.strip() if isinstance(value, str) else value)
    except (TypeError, ValueError):
        raise ConfigError(message) from None
    if not math.isfinite(fraction) or not 0 < fraction <= 1:
        raise ConfigError(message)
    return fraction


_FLAG_WORDS = {"1": True, "true": True, "on": True, "yes": True,
               "0": False, "false": False, "off": False, "no": False}


def _parse_flag(value: Union[str, bool, int], label: str) -> bool:
    if isinstance(value, bool):
        return value
    word = str(value).strip().lower()
    if word not in _FLAG_WORDS:
        raise ConfigError(f"{label}={value!r} is not a switch: use 1 or 0 (true/false, on/off, yes/no)")
    return _FLAG_WORDS[word]


def _parse_recompute_ahead(value: Union[str, bool, int], label: str) -> str:
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    try:
        return "on" if _parse_flag(value, label) else "off"
    except ConfigError:
        raise ConfigError(f"{label}={value!r} is not a setting: use auto, 1 or 0 (true/false, on/off, yes/no)") from None


# Note [Recompute ahead by default]: where "auto" turns it on, from
# bench/RESULTS.md "Recompute ahead (issue 3 part 7)".
RECOMPUTE_AHEAD_AUTO: Dict[str, bool] = {"cuda": True, "cpu": False}


def resolve_recompute_ahead(setting: str, device_type: str, record_stream_works: bool = True) -> bool:
    """Whether recompute-ahead is on for ``setting`` (``"auto"``, ``"on"``,
    ``"off"``) on a device of ``device_type`` (``"cpu"``, ``"cuda"``).

    Note [Recompute ahead needs record_stream]: on CUDA a replay ahead of use
    runs on a side stream and its result is read and freed on the compute
    stream; ``record_stream`` is what keeps the side stream from reusing the
    block while the compute stream still reads it. Where membudget is
    installed without its C++ hooks (``record_stream_works`` False: the
    extension was built against a torch without CUDA) ``record_stream`` is a
    no-op, so recompute-ahead stays off there, with a warning when it was
    asked for."""
    if device_type == "cuda" and not record_stream_works:
        if setting == "on":
            warnings.warn(
                "membudget: recompute ahead is off: without the C++ hooks (this extension was built "
                "against a torch without CUDA) tensor.record_stream() is a no-op, and a side-stream "
                "replay's memory could be reused while backward still reads it. Rebuild the extension "
                "against this CUDA torch to use it.",
                RuntimeWarning,
                stacklevel=3,
            )
        return False
    if setting == "auto":
        return RECOMPUTE_AHEAD_AUTO.get(device_type, False)
    return setting == "on"


# Note [Lineage recorder by default]: the C++ recorder costs 2.9-8.8 us per
# recorded op against the Python mode's 26-43 (bench/RESULTS.md, "C++ lineage
# recorder on a quiet machine") and passes the whole suite as the default on
# the CPU. It was the default once and was reverted: recompute-only CNN runs
# ran out of memory under it, its activations swap-only from the third step
# (batch norm's running statistics read through lineage whose writer nodes
# had been released; Note [Held scratch and long-lived storages] in
# csrc/torch/lineage_recorder.cpp); fixed, with tests under both recorders.
# On CUDA it now has the Python recorder's roofline floor on replay costs and
# its side-stream replay ahead, but neither has run on a GPU: Python there
# until a GPU run of tests/test_cuda.py under both recorders says otherwise
# (then this table is the one line to change).
LINEAGE_AUTO: Dict[str, str] = {"cpu": "cxx", "cuda": "python"}


def resolve_lineage(setting: str, device_type: str) -> str:
    """The recorder (``"python"`` or ``"cxx"``) that ``setting`` (``"auto"``,
    ``"python"``, ``"cxx"``) means on a device of ``device_type``."""
    if setting == "auto":
        return LINEAGE_AUTO.get(device_type, "python")
    return setting


def _parse_checkpoint(value: str, label: str) -> str:
    mode = str(value).strip().lower()
    if mode not in CHECKPOINT_MODES:
        raise ConfigError(f"{label}={value!r} is not a checkpoint mode: use {' or '.join(CHECKPOINT_MODES)}")
    return mode


def _parse_compile(value: str, label: str) -> str:
    mode = str(value).strip().lower()
    if mode not in COMPILE_MODES:
        raise ConfigError(f"{label}={value!r} is not a compile mode: use {' or '.join(COMPILE_MODES)}")
    return mode


def _parse_log(value: Union[str, Iterable[str]], label: str) -> FrozenSet[str]:
    items = value.split(",") if isinstance(value, str) else list(value)
    channels = {str(item).strip().lower() for item in items} - {""}
    unknown = sorted(channels - set(LOG_CHANNELS))
    if unknown:
        raise ConfigError(
            f"{label}={value!r} names unknown log channel(s) {', '.join(unknown)}: "
            f"use a comma list of {', '.join(LOG_CHANNELS)}"
        )
    return frozenset(channels)


@dataclass(frozen=True)
class Variable:
    """One documented environment variable: its name, the :class:`Config` field
    it sets, its default and accepted values as shown to users, and what it
    means. :data:`VARIABLES` lists them; the docs table is generated from it."""

    name: str
    field: str
    default: str
    accepted: str
    meaning: str
    parse: Callable[..., object]


VARIABLES: Tuple[Variable, ...] = (
    Variable(
        "MEMBUDGET_BUDGET", "budget", "unset (no budget: only count)",
        "bytes (`123456789`), units (`512MB`, `512MiB`, `12GiB`, `1.5G`, `64K`, `2T`) or `60%` of "
        "device memory (0 < p <= 100). KB/MB/GB/TB are decimal (10^3...); KiB/MiB/GiB/TiB and bare "
        "K/M/G/T are binary (2^10...). Case and spaces ignored.",
        "Device-memory budget: reserved bytes never exceed it.",
        _parse_budget,
    ),
    Variable(
        "MEMBUDGET_HOST_BUDGET", "host_budget_bytes", "50% of physical RAM",
        "same as `MEMBUDGET_BUDGET`; a percentage is of physical RAM",
        "Host memory that swapped-out activations may occupy.",
        _parse_host_budget,
    ),
    Variable(
        "MEMBUDGET_POLICY", "policy", DEFAULT_POLICY,
        "`delta`, `dtr`, `msps`, `lru`, `largest`",
        "Eviction filter that picks which saved activations to release.",
        _parse_policy,
    ),
    Variable(
        "MEMBUDGET_ACTIONS", "actions", DEFAULT_ACTIONS,
        "`swap`, `recompute`, `both`",
        "What may be done with a victim: swap to host and/or drop and recompute (the director picks).",
        _parse_actions,
    ),
    Variable(
        "MEMBUDGET_LINEAGE", "lineage", DEFAULT_LINEAGE,
        "`auto`, `python`, `cxx`",
        "Which recorder keeps forward ops for recomputation: the Python dispatch mode (the reference) or "
        "the C++ RecordFunction recorder (cheaper per op; docs/recompute.md); `auto`: C++ on the CPU, "
        "Python on CUDA.",
        _parse_lineage,
    ),
    Variable(
        "MEMBUDGET_MIN_TENSOR_BYTES", "min_tensor_bytes", "1MiB",
        "size in bytes or units (no %); `0` manages every saved tensor",
        "Saved tensors smaller than this are left alone.",
        _parse_unsigned_size,
    ),
    Variable(
        "MEMBUDGET_PREFETCH_BYTES", "prefetch_bytes", "256MiB",
        "size in bytes or units (no %); `0` disables prefetch",
        "Byte window of swap-ins issued ahead of use in backward (a swap-in that would arrive late "
        "even if issued now may go past it).",
        _parse_unsigned_size,
    ),
    Variable(
        "MEMBUDGET_HIGH_WATERMARK", "high_watermark", str(DEFAULT_HIGH_WATERMARK),
        "a number above 0 and at most 1",
        "Fraction of the budget (of the device's memory when that is smaller) above which background "
        "swap-out starts.",
        _parse_high_watermark,
    ),
    Variable(
        "MEMBUDGET_LOG", "log", "empty (no logging)",
        "comma list of `decisions`, `evictions`, `prefetch`, `summary`",
        "Log channels to enable.",
        _parse_log,
    ),
    Variable(
        "MEMBUDGET_EXPANDABLE_SEGMENTS", "expandable_segments", "1",
        "`1` or `0` (`true`/`false`, `on`/`off`, `yes`/`no`)",
        "Device memory in growing virtual ranges mapped page by page, so free fragments return to the "
        "budget; `0`: fixed segments. Fixed at the first `install()`.",
        _parse_flag,
    ),
    Variable(
        "MEMBUDGET_RECOMPUTE_AHEAD", "recompute_ahead", "auto",
        "`auto`, or `1` / `0` (`true`/`false`, `on`/`off`, `yes`/`no`)",
        "The prefetcher also replays dropped activations ahead of their use in backward, within the "
        "prefetch window; `auto`: on for CUDA, off on the CPU (where the bench showed no gain).",
        _parse_recompute_ahead,
    ),
    Variable(
        "MEMBUDGET_CHECKPOINT", "checkpoint", "replace",
        "`replace`, `keep`",
        "`replace`: while a budget is set, non-reentrant `torch.utils.checkpoint` regions (default "
        "`context_fn`, or selective checkpointing's, whose policy becomes a plan of drops) run as plain "
        "forward code, so membudget can swap or drop their activations; "
        "`keep`: checkpoints run as PyTorch does them.",
        _parse_checkpoint,
    ),
    Variable(
        "MEMBUDGET_COMPILE", "compile", "plan",
        "`plan`, `off`",
        "`plan`: while a budget is set, each graph `torch.compile` hands to inductor (torch >= 2.9) is split "
        "into forward and backward by the Echo planner under what the budget leaves it, recomputing where its "
        "activations would not fit; `off`: inductor's own partitioner.",
        _parse_compile,
    ),
)
_BY_NAME: Dict[str, Variable] = {variable.name: variable for variable in VARIABLES}
_BY_FIELD: Dict[str, Variable] = {variable.field: variable for variable in VARIABLES}
# Keyword overrides may also use the shorter "host_budget".
_OVERRIDE_ALIASES = {"host_budget": "host_budget_bytes"}


def parse_value(name: str, value: object, label: Optional[str] = None) -> object:
    """Parse and validate one value for the variable ``name`` (e.g.
    ``"MEMBUDGET_BUDGET"``) or its :class:`Config` field (``"budget"``), exactly
    as :meth:`Config.from_env` would, and return the typed value. ``label`` is
    the name used in the error message (default: the variable's name); the CLI
    passes ``"--budget"`` so errors name the flag the user typed."""
    field = _OVERRIDE_ALIASES.get(name, name)
    variable = _BY_NAME.get(name) or _BY_FIELD.get(field)
    if variable is None:
        raise KeyError(f"no membudget setting named {name!r}")
    return variable.parse(value, label or variable.name)


def _warn_unknown_variables(environ: Mapping[str, str]) -> None:
    known = [variable.name for variable in VARIABLES] + list(BUILD_VARIABLES)
    for name in sorted(environ):
        if not name.startswith("MEMBUDGET_") or name in known:
            continue
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"; did you mean {close[0]}?" if close else f"; known variables: {', '.join(known)}"
        # Attributed to this line (default stacklevel) so that the warning is
        # shown once per process however often the environment is read.
        warnings.warn(f"unknown environment variable {name} is ignored{hint}")


@dataclass(frozen=True)
class Config:
    """The run-time settings of membudget, read once by ``install()``. ``budget``
    is the raw ``MEMBUDGET_BUDGET`` spec (or ``None``: unbounded) because a
    percentage can only be resolved once the device is known: use
    :meth:`budget_bytes`. Every other field is already in its final unit."""

    budget: Optional[str] = None
    host_budget_bytes: int = dataclass_field(
        default_factory=lambda: int(physical_memory_bytes() * DEFAULT_HOST_BUDGET_FRACTION))
    policy: str = DEFAULT_POLICY
    actions: str = DEFAULT_ACTIONS
    lineage: str = DEFAULT_LINEAGE
    min_tensor_bytes: int = DEFAULT_MIN_TENSOR_BYTES
    prefetch_bytes: int = DEFAULT_PREFETCH_BYTES
    high_watermark: float = DEFAULT_HIGH_WATERMARK
    log: FrozenSet[str] = frozenset()
    expandable_segments: bool = True
    recompute_ahead: str = "auto"
    checkpoint: str = "replace"
    compile: str = "plan"

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None, **overrides: object) -> "Config":
        """Build a :class:`Config` from ``environ`` (default ``os.environ``), where
        each keyword override that is not ``None`` wins over its variable.
        Override keywords are the field names (``budget``, ``host_budget_bytes``
        or ``host_budget``, ``policy``, ``actions``, ``lineage``, ``min_tensor_bytes``,
        ``prefetch_bytes``, ``high_watermark``, ``log``,
        ``expandable_segments``, ``recompute_ahead``, ``checkpoint``, ``compile``) and take the same
        strings as the variables, or ints / floats / channel iterables. Unknown
        ``MEMBUDGET_*`` variables draw a warning; a bad value raises
        :class:`ConfigError` naming the variable (or keyword) and the value."""
        environ = os.environ if environ is None else environ
        given: Dict[str, Tuple[str, object]] = {}
        for key, value in overrides.items():
            field = _OVERRIDE_ALIASES.get(key, key)
            if field not in _BY_FIELD:
                raise TypeError(f"Config.from_env() got an unexpected keyword {key!r}")
            if value is not None:
                given[field] = (key, value)
        _warn_unknown_variables(environ)

        values: Dict[str, object] = {}
        for variable in VARIABLES:
            if variable.field in given:
                key, raw = given[variable.field]
                values[variable.field] = variable.parse(raw, key)
            elif variable.name in environ:
                values[variable.field] = variable.parse(environ[variable.name], variable.name)
        return cls(**values)

    @property
    def records_lineage(self) -> bool:
        """Whether forward ops are recorded (recomputation is allowed)."""
        return self.actions in ("recompute", "both")

    def budget_bytes(self, device_capacity_bytes: Optional[int]) -> Optional[int]:
        """Return the budget in bytes for a device of ``device_capacity_bytes``
        (see :func:`resolve_budget`), or ``None`` when no budget is set."""
        return resolve_budget(self.budget, device_capacity_bytes)


def format_bytes(count: int) -> str:
    """Format a byte count for people: ``512 B``, ``1 MiB``, ``1.50 GiB`` (binary
    units, two decimals unless exact), as used by :func:`describe`."""
    for unit, size in (("TiB", 1 << 40), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if count >= size:
            whole, rest = divmod(count, size)
            return f"{whole} {unit}" if rest == 0 else f"{count / size:.2f} {unit}"
    return f"{count} B"


def describe(config: Config) -> str:
    """Return a multi-line, human-readable summary of ``config`` with the
    variable each line comes from, as printed by ``python -m membudget.info``."""
    if config.budget is None:
        budget = "unbounded (MEMBUDGET_BUDGET unset: membudget only counts)"
    else:
        try:
            size = parse_bytes(config.budget, "MEMBUDGET_BUDGET", percent_of="device memory")
            if isinstance(size, Percent):
                budget = f"{size} of device memory (resolved at install)"
            else:
                budget = f"{config.budget} ({format_bytes(size)})"
        except ConfigError as error:
            budget = f"invalid: {error}"
    actions = config.actions
    rows = [
        ("budget", budget, "MEMBUDGET_BUDGET"),
        ("host budget", format_bytes(config.host_budget_bytes), "MEMBUDGET_HOST_BUDGET"),
        ("policy", config.policy, "MEMBUDGET_POLICY"),
        ("actions", actions, "MEMBUDGET_ACTIONS"),
        ("lineage recorder", config.lineage if config.lineage != "auto"
         else "auto (" + ", ".join(f"{d} {r}" for d, r in LINEAGE_AUTO.items()) + ")", "MEMBUDGET_LINEAGE"),
        ("min tensor bytes", format_bytes(config.min_tensor_bytes), "MEMBUDGET_MIN_TENSOR_BYTES"),
        ("prefetch bytes",
         format_bytes(config.prefetch_bytes) if config.prefetch_bytes else "0 (prefetch disabled)",
         "MEMBUDGET_PREFETCH_BYTES"),
        ("high watermark", f"{config.high_watermark:g} of the budget", "MEMBUDGET_HIGH_WATERMARK"),
        ("log", ", ".join(sorted(config.log)) or "(none)", "MEMBUDGET_LOG"),
        ("expandable segments", "on" if config.expandable_segments else "off (fixed segments)",
         "MEMBUDGET_EXPANDABLE_SEGMENTS"),
        ("recompute ahead", config.recompute_ahead if config.recompute_ahead != "auto"
         else "auto (" + ", ".join(f"{d} {'on' if v else 'off'}" for d, v in RECOMPUTE_AHEAD_AUTO.items()) + ")",
         "MEMBUDGET_RECOMPUTE_AHEAD"),
        ("checkpoint regions", "replaced by plain forward code while a budget is set"
         if config.checkpoint == "replace" else "kept (torch.utils.checkpoint as PyTorch runs it)",
         "MEMBUDGET_CHECKPOINT"),
        ("compiled graphs", "planned under the budget (torch >= 2.9, inductor)" if config.compile == "plan"
         else "inductor's own partitioner", "MEMBUDGET_COMPILE"),
    ]
    width = max(len(label) for label, _, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}  [{name}]" for label, value, name in rows)


def env_table_markdown() -> str:
    """Return a markdown table (variable | default | accepted values | meaning)
    of every ``MEMBUDGET_*`` run-time variable, generated from
    :data:`VARIABLES` so the README cannot drift from the parser."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    lines = [
        "| Variable | Default | Accepted values | Meaning |",
        "|---|---|---|---|",
    ]
    for variable in VARIABLES:
        lines.append(
            f"| `{variable.name}` | {cell(variable.default)} | {cell(variable.accepted)} | {cell(variable.meaning)} |"
        )
    return "\n".join(lines) + "\n"

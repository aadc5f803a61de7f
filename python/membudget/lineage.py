"""Lineage: how every saved activation was computed, so that it can be dropped
and rebuilt instead of stashed (DESIGN.md "The binding to PyTorch").

Where this sits in the flow: while membudget is installed with recomputation
allowed, :class:`LineageMode` (a ``TorchDispatchMode``, below autograd) sees
every aten op the forward pass runs on the thread that called ``install()``
(and, through a mode of their own, on threads started after it).
For each op it keeps an :class:`OpNode`: the op overload, its arguments with
tensors replaced by :class:`TensorRef` (which storage, at which version, with
which view geometry), the measured duration, and the generator state for
random ops (dropout replays bit-exactly). No tensor memory is held, except
strong references to tensors that no recorded op produced (parameters, the
batch), which the step keeps alive anyway, and only until the step's
optimizer step (Note [Lineage released between steps]).

Note [Storage lineage]: residency is per storage (a saved tensor and its views
share one entry), so lineage is too. A :class:`StorageLineage` says how a
storage came to be: the op that allocated it (``producer``, output ``index``)
followed by the in-place ops that wrote into it (``mutations``; its *version*
is how many of them have happened). Views do not make storages: a view's
output shares its input's lineage, and each TensorRef keeps the geometry.
``ReLU(inplace=True)`` and ``x += y`` are mutations, replayed in order.

When a saved tensor is packed, :meth:`Lineage.on_pack` computes whether its
storage can be rebuilt and at what cost (:mod:`membudget.replay`), and tells
the residency manager, whose director may then drop it. Unpacking a dropped
entry calls back into :func:`membudget.replay.rebuild_entry`.

Unrecomputable (they can still be swapped): outputs of ops outside the
``aten``/``prims`` namespaces or with side effects, ops whose mutated
arguments are not replayable, anything downstream of a tensor mutated in
place that lineage did not see, and anything read from a storage an empty
op made before a recorded op wrote it (Note [Contents nobody recorded] in
csrc/torch/lineage_ops.cpp). Backward, replays and ``no_grad`` work are not
recorded, except the forward of a custom ``autograd.Function``, which runs
with grad off (Note [Custom Function forwards] in
csrc/torch/function_forwards.cpp); during ``optimizer.step()`` the mode is not
even on the stack (Note [Lineage mode parked during optimizer steps] in
``_runtime.py``).

Note [Recording fast path]: what the handler does per op is kept to what the
op's schema says matters, computed once per overload (:class:`_FuncInfo`,
keyed by ``id``: ``OpOverload.__hash__`` is Python): only the argument
positions typed as tensors are looked at, each becomes a :class:`TensorRef`
built by one ``tuple.__new__`` call, and the op's C++ callable is called
directly. Scanning every argument (``tensor_args = None``, kept for ops
outside aten/prims) is the reference it is tested against
(tests/test_lineage_recording.py). Views build no node at all: their outputs
share their sources' lineages, and a view's node would never be replayed.
The Python ``TorchDispatchMode`` itself costs more per op than the 10 us
target (``bench/bench_lineage.py``); the C++ recorder
(``MEMBUDGET_LINEAGE=cxx``, :mod:`membudget.lineage_native`, Note [C++
lineage recorder] in csrc/torch/lineage_recorder.cpp) keeps the same data in
C++ and is tested against this one.
"""
from __future__ import annotations

import functools
import operator
import threading
import time
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["Lineage", "LineageMode", "OpNode", "StorageLineage", "ExternalLineage", "TensorRef", "storage_address",
           "hide_from_dynamo", "track_function_forwards"]

# Note [Lineage beside the tensor]: which StorageLineage a tensor object
# carries is kept here, keyed by the object's id and checked through a weak
# reference to it, not in the tensor's ``__dict__``. The lifetime is the same
# (the entry goes when the Python object dies), but a tensor then carries
# nothing of membudget's: ``torch.save`` and ``pickle`` keep a tensor's
# ``__dict__``, and a lineage there made ``torch.save(model.state_dict())``
# fail ("cannot pickle 'weakref.ReferenceType' object") for every model built
# or stepped after ``install()`` under this recorder (the default on CUDA),
# and ``copy.deepcopy`` of such a tensor fail too. Each reference carries its
# key and lineage in slots; its callback removes the entry, unless the id was
# since given to another tensor.
_attached: Dict[int, "_Attached"] = {}


class _Attached(weakref.ref):
    """A weak reference to a tensor, with the tensor's lineage and its key in
    :data:`_attached`."""

    __slots__ = ("key", "lineage")


def _on_tensor_death(ref: "_Attached") -> None:
    if _attached.get(ref.key) is ref:
        del _attached[ref.key]


def lineage_of(tensor: torch.Tensor) -> Optional["StorageLineage"]:
    """The lineage ``tensor`` (this Python object) carries, if any."""
    ref = _attached.get(id(tensor))
    return ref.lineage if ref is not None and ref() is tensor else None


def _attach(tensor: torch.Tensor, lineage: "StorageLineage") -> None:
    key = id(tensor)
    ref = _attached.get(key)
    if ref is not None and ref() is tensor:
        ref.lineage = lineage
        return
    ref = _Attached(tensor, _on_tensor_death)
    ref.key = key
    ref.lineage = lineage
    _attached[key] = ref


def _forget_lineage_of(tensor: torch.Tensor) -> None:
    key = id(tensor)
    ref = _attached.get(key)
    if ref is not None and ref() is tensor:
        del _attached[key]


_REPLAYABLE_NAMESPACES = frozenset({"aten", "prims"})
# Mutated arguments whose new value no output depends on: batch norm's running
# statistics in training mode. A replay gives such an op scratch copies, so
# the real buffers are not updated twice.
_SCRATCH_ARGUMENTS = frozenset({"running_mean", "running_var"})
# Mutated arguments read as they were when the op started: copied then, and
# a replay runs on a scratch copy of that copy (Note [Arguments snapshotted
# before the op] in csrc/torch/lineage_ops.cpp, whose table this is): QAT's
# fused observer, whose output depends on the running statistics it updates.
_SNAPSHOT_ARGUMENTS: Dict[str, frozenset] = {
    "aten::_fused_moving_avg_obs_fq_helper": frozenset({"running_min", "running_max", "scale", "zero_point"}),
}
_SNAPSHOT = object()  # a tensor_args entry's third field for a snapshot argument
# Ops that never need replaying and whose outputs are not tensors worth a node.
_NOT_RECORDED = frozenset({"aten::_local_scalar_dense", "aten::item", "aten::is_nonzero", "aten::equal"})
# Ops whose output's contents are whatever writes it next: not replayable as
# read before a recorded write (Note [Contents nobody recorded] in
# csrc/torch/lineage_ops.cpp, whose list this is).
_EMPTY_OPS = frozenset({"aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty",
                        "aten::new_empty_strided", "aten::empty_permuted"})
_NO_KWARGS: Dict[str, Any] = {}  # shared by every node without keyword arguments: never mutated
# Bumped each time Lineage.release_if_idle() lets go of what it held (Note
# [Lineage released between steps]); a StorageLineage records the one it was
# made in. Module-level: one recorder per process.
_generation = 0
# Weak references to the lineages made since the last release, which severs
# them (Note [Released lineage severed]); pruned of dead ones as each forward
# begins.
#
# Note [Lineages made on several threads]: the list is only ever changed in
# place. Threads that record lineage (Note [Threads started after install()]
# in _runtime.py) append to it lock-free (one list operation, atomic) while
# another thread prunes or severs it; rebinding the name to a pruned copy would drop an
# append made while the copy was built, and the lineage it named would never
# be severed: its forward's whole graph kept alive by a kept loss. Pruning
# and severing take `_made_lock` between themselves and replace only the
# prefix they read, in one slice assignment, so appends behind it stay.
_made: List["weakref.ref[StorageLineage]"] = []
_made_lock = threading.Lock()


class StorageLineage:
    """How one storage was computed (Note [Storage lineage])."""

    __slots__ = ("producer", "index", "mutations", "base", "entry_id", "versions", "memo", "generation",
                 "unbumped", "__weakref__")

    def __init__(self, producer: "OpNode", index: int, base: torch.Tensor):
        self.producer = producer
        # Note [Lineage released between steps]: lineages of an older
        # generation are read as held inputs, never replayed through.
        self.generation = _generation
        self.index = index
        self.mutations: List[OpNode] = []
        self.base = weakref.ref(base)
        self.entry_id: Optional[int] = None  # set when the storage is packed and managed
        # The tensor version counter after the producer and after each
        # recorded write: a reader whose version is not among these saw a
        # write lineage missed (no_grad, another thread) and is unreplayable.
        self.versions: List[int] = [base._version]
        # The version before the last recorded write while nothing has read
        # the version after it (Note [Writes that bump no version]).
        self.unbumped: Optional[int] = None
        self.memo: Dict[int, tuple] = {}     # version -> closure (see replay.closure)
        _made.append(_weak(self))


_weak = weakref.ref


def _sever_released_lineages() -> None:
    """Note [Released lineage severed]: a lineage hangs on its tensor (and on
    the tensors sharing its storage: ``loss.detach()``), and through its
    producer and their inputs' lineages reaches every node of its forward:
    their arguments, RNG states and held inputs. A loop that keeps each
    step's detached loss kept each step's whole graph of nodes: 38 nodes and
    lineages a step for an 8-layer MLP, 5 KiB of CPU generator state a step
    on the CPU, never freed. Once released, nothing of an older generation
    is replayed (it reads as a held input), so its links are cut."""
    with _made_lock:
        severed = _made[:]
        del _made[:len(severed)]  # Note [Lineages made on several threads]
    for ref in severed:
        lineage = ref()
        if lineage is not None:
            lineage.producer = None
            lineage.mutations = []
            lineage.memo = {}


def _prune_made() -> None:
    """Drops the references to lineages that died (each forward's start),
    keeping any another thread appends meanwhile (Note [Lineages made on
    several threads])."""
    with _made_lock:
        read = len(_made)
        _made[:read] = [ref for ref in _made[:read] if ref() is not None]


def at_last_version(lineage: StorageLineage, version: int) -> bool:
    """Whether a tensor of ``lineage`` whose version counter reads
    ``version`` is at the version the last recorded write left it at.

    Note [Writes that bump no version]: the mode runs below autograd's
    ADInplaceOrView kernel, which bumps a written tensor's version counter
    once the op returns, so a write is recorded as leaving the version one
    more. Not every write bumps: rrelu_with_noise fills its noise (declared
    written, ``Tensor(b!)``) and the counter stays. Read after such a write,
    the tensor is at the version before it; nothing else can have written it
    meanwhile (every write the recorder misses bumps the counter, never
    lowers it), so the version after the write is that one. Without it the
    noise read as written where nothing records, and was swap-only. The C++
    recorder reads the version once the op has returned.

    Only writes of ops without an ADInplaceOrView kernel are left open so
    (``_FuncInfo.bumps``), and the next write the mode sees settles it
    before it runs (``rescue_before_writes``): a write under ``no_grad``
    after ``rrelu_with_noise``'s would otherwise bump the counter to what
    the recorded write was taken to leave, and a replay rebuilt the noise
    without it (wrong gradients, silently, in a probe that called the op
    with a noise of its own)."""
    last = lineage.versions[-1]
    if version == last:
        lineage.unbumped = None
        return True
    if lineage.unbumped is not None and version == lineage.unbumped:
        lineage.versions[-1] = version
        lineage.unbumped = None
        return True
    return False


def _has_inplace_or_view_kernel(schema) -> bool:
    name = schema.name + (f".{schema.overload_name}" if schema.overload_name else "")
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(name, "ADInplaceOrView")
    except (AttributeError, RuntimeError):  # not registered with the dispatcher (a Python-only op)
        return False


def _version_of(tensor: torch.Tensor) -> int:
    """A held input's version counter; 0 for an inference tensor, which has
    none (and cannot be written outside inference mode)."""
    return 0 if tensor.is_inference() else tensor._version


class ExternalLineage:
    """A tensor no recorded op produced (a parameter, the batch): held, not rebuilt.

    Once its storage is a managed entry, the entry is held instead, through a
    handle (Note [Held inputs reached through their entry] in
    csrc/torch/lineage_recorder.cpp): ``tensor`` is then None, ``handle``
    reads the tensor's version counter and keeps the entry alive, and
    ``weak`` tells whether the id keying :attr:`Lineage.externals` is still
    this tensor's. Unless it is an inference tensor, the tensor is held as
    its data under the same version counter, without its autograd metadata,
    which can gain a graph after the read, so that a forward that raised
    leaves nothing allocated; and as the data it had when read, so that a
    replay reads that data after ``p.data = ...``. ``weak`` then returns the
    tensor read: weakly, or for a parameter strongly (Note [Held without
    their graph] in csrc/torch/lineage_recorder.cpp)."""

    __slots__ = ("tensor", "key", "handle", "weak", "__weakref__")

    def __init__(self, tensor: torch.Tensor, without_graph=None):
        self.handle = None
        self.tensor = tensor if without_graph is None else without_graph(tensor)
        if self.tensor is tensor:
            self.weak = None
        elif tensor.is_leaf and tensor.requires_grad:
            # A parameter holds no graph, and torch.utils.swap_tensors
            # refuses a tensor with a weak reference (module.to() under
            # swap_module_params_on_conversion): held strongly.
            self.weak = functools.partial(_same, tensor)
        else:
            self.weak = weakref.ref(tensor)
        # Its storage address when first read in this forward (externals are
        # renewed every forward): what replay.rescue_dependents_of matches
        # writes against, computed once instead of at every pack that reads it.
        self.key = storage_address(tensor)

    def hold_through(self, handle) -> None:
        """Holds ``handle``'s entry instead of the tensor (see the class)."""
        if self.weak is None:
            self.weak = weakref.ref(self.tensor)
        self.handle = handle
        self.tensor = None

    def released(self) -> bool:
        """True once the recorder let go of it (Note [Lineage released
        between steps])."""
        return self.tensor is None and self.handle is None

    def held(self) -> Optional[torch.Tensor]:
        """The tensor, while held or alive; None once released or dead."""
        return self.tensor if self.weak is None else self.weak()

    def version(self) -> int:
        """The tensor's version counter now."""
        return _version_of(self.tensor) if self.handle is None else self.handle.version


class TensorRef(tuple):
    """A tensor argument of a recorded op: its storage's lineage, the storage
    version it was read at, and the view geometry to rebuild it from the
    storage.

    A tuple with named fields (like a namedtuple): recording builds one per
    tensor argument with ``tuple.__new__`` (:func:`_new_ref`), a single C call
    with no Python frame, and fields read through C getters."""

    __slots__ = ()
    _fields = ("lineage", "version", "tensor_version", "sizes", "strides", "offset", "dtype", "scratch", "bits")

    def __new__(cls, lineage, version: int, tensor: torch.Tensor, scratch: bool = False):
        return _new_ref(lineage, version, tensor, scratch)

    def __repr__(self) -> str:
        return "TensorRef(" + ", ".join(f"{name}={value!r}" for name, value in zip(self._fields, self)) + ")"


for _position, _field in enumerate(TensorRef._fields):
    setattr(TensorRef, _field, property(operator.itemgetter(_position), doc=f"Field {_position}: {_field}."))
_tuple_new = tuple.__new__


def _new_ref(lineage, version: int, tensor: torch.Tensor, scratch: bool = False) -> TensorRef:
    """A :class:`TensorRef` to ``tensor`` read through ``lineage`` at ``version``.

    Note [Conjugate and negative views]: ``z.conj()`` is a view that differs
    from ``z`` by a bit, not by its geometry (the values are conjugated when
    read), as is the negative view ``z.conj().imag`` gives. A replay rebuilt
    such an input from sizes and strides alone, as ``z``, and a complex model
    trained recompute-only got wrong gradients, silently. So a reference
    keeps the bits too (1: conjugate, 2: negative) and the replay sets them."""
    return _tuple_new(TensorRef, (lineage, version, tensor._version, tensor.size(), tensor.stride(),
                                  tensor.storage_offset(), tensor.dtype, scratch,
                                  tensor.is_conj() + 2 * tensor.is_neg()))


class OpNode:
    """One recorded op call: enough to run it again."""

    __slots__ = ("func", "args", "kwargs", "seconds", "rng", "replayable", "index", "refs", "__weakref__")

    def __init__(self, func, args, kwargs, refs, index: int, replayable: bool = True):
        self.func = func
        self.args = args
        self.kwargs = kwargs        # never mutated: an empty one is shared (_NO_KWARGS)
        self.refs: List[TensorRef] = refs
        self.index = index          # position among this forward's recorded ops
        self.seconds = 0.0
        self.rng: Optional[Tuple[torch.Generator, torch.Tensor]] = None
        self.replayable = replayable

    @property
    def name(self) -> str:
        """The overload's name, e.g. ``aten.addmm.default``."""
        return str(self.func)


# Ends a lineage's history (Note [Writes behind a counter]): an unreplayable
# write, at a version no tensor has.
_ENDED = OpNode(None, (), _NO_KWARGS, [], -1, replayable=False)


class _FuncInfo:
    """What the schema says about an op, computed once per overload."""

    __slots__ = ("aliases", "writes", "scratch", "scratch_positions", "random", "replayable", "recorded", "simple",
                 "func", "op", "tensor_args", "view", "undefined_contents", "undeclared_aliases", "bumps")

    def __init__(self, func):
        schema = func._schema
        arg_sets = {}
        self.writes: List[Tuple[int, str]] = []  # (position, name) of mutated arguments
        self.scratch = set()
        snapshot = _SNAPSHOT_ARGUMENTS.get(schema.name, frozenset())
        for position, arg in enumerate(schema.arguments):
            if arg.name in _SCRATCH_ARGUMENTS or arg.name in snapshot:
                # Written or not by the schema: native_batch_norm (the CPU's)
                # and cudnn_batch_norm update their running statistics without
                # declaring it, and replays updated the real buffers again
                # (one BatchNorm1d's running mean 3.4x plain's after backward
                # with every activation dropped).
                self.scratch.add(arg.name)
            info = arg.alias_info
            if info is None:
                continue
            for alias in info.before_set:
                arg_sets.setdefault(alias, (position, arg.name))
            if info.is_write:
                self.writes.append((position, arg.name))
        # Output i aliases which argument (views and in-place/out= results).
        self.aliases: List[Optional[Tuple[int, str]]] = []
        for ret in schema.returns:
            info = ret.alias_info
            target = None
            if info is not None:
                for alias in info.before_set:
                    if alias in arg_sets:
                        target = arg_sets[alias]
                if target is None and not info.before_set:
                    # Tensor(a)[] (split, chunk, unbind): Python shows the
                    # list's alias info but not its elements' set; what they
                    # alias is the argument declared (a -> *). Read as fresh
                    # storages, their lineages replayed the split to rebuild
                    # the storage it splits: endless recursion (unbind).
                    wild = [(position, arg.name) for position, arg in enumerate(schema.arguments)
                            if arg.alias_info is not None and "*" in arg.alias_info.after_set]
                    target = wild[0] if len(wild) == 1 else None
            self.aliases.append(target)
        namespace = schema.name.split("::")[0]
        unreplayable_writes = [name for _, name in self.writes if name not in self.scratch]
        self.random = torch.Tag.nondeterministic_seeded in func.tags
        # A write to anything but the storage being rebuilt is a side effect;
        # those are replayed only on their own lineage (as mutations).
        self.replayable = namespace in _REPLAYABLE_NAMESPACES and len(unreplayable_writes) <= 1
        self.undefined_contents = schema.name in _EMPTY_OPS
        # Whether its writes bump their tensors' version counters for sure:
        # an ADInplaceOrView kernel does, above this mode (Note [Writes that
        # bump no version]). Without one (rrelu_with_noise) autograd's kernel
        # may bump them (the foreach ops) or nothing may.
        self.bumps = bool(self.writes) and _has_inplace_or_view_kernel(schema)
        # Several outputs and no alias declared for any: they may still share
        # one storage (unsafe_chunk; Note [One history per storage]).
        several = len(schema.returns) > 1 or (len(schema.returns) == 1 and str(schema.returns[0].type) != "Tensor")
        self.undeclared_aliases = several and all(r.alias_info is None for r in schema.returns)
        # Profiler markers (torch.autograd.profiler.record_function, around
        # every optimizer step) compute nothing; recorded, the step's marker
        # began a forward between backward and the step (Note [Lineage
        # released between steps]).
        self.recorded = schema.name not in _NOT_RECORDED and namespace != "profiler"
        self.scratch_positions = frozenset(
            i for i, arg in enumerate(schema.arguments) if arg.name in self.scratch)
        # The common case, handled without loops: one fresh tensor out, no writes.
        self.simple = (not self.writes and len(schema.returns) == 1 and self.aliases[0] is None
                       and str(schema.returns[0].type) == "Tensor")
        # Every output aliases an input and nothing is written: the outputs
        # share their sources' lineages and no node of this op is ever
        # replayed, so none is built (Note [Recording fast path]).
        self.view = (not self.writes and bool(self.aliases) and all(a is not None for a in self.aliases)
                     and namespace in _REPLAYABLE_NAMESPACES)
        self.func = func     # keeps the overload (and so its id, the key in _infos) alive
        self.op = func._op   # the C++ callable, without OpOverload.__call__'s Python frame
        # Which positional arguments can hold tensors, from the schema:
        # (position, is a list, is scratch). Ops outside aten/prims may hide
        # tensors in untyped arguments: every argument of theirs is scanned.
        self.tensor_args: Optional[Tuple[Tuple[int, bool, bool], ...]] = None
        if namespace in _REPLAYABLE_NAMESPACES:
            self.tensor_args = tuple(
                (position, isinstance(arg.type, torch._C.ListType),
                 _SNAPSHOT if arg.name in snapshot else arg.name in self.scratch)
                for position, arg in enumerate(schema.arguments)
                if not arg.kwarg_only and "Tensor" in str(arg.type))


# Keyed by id(overload): OpOverload.__hash__ is a Python method (a frame per
# lookup); the info holds the overload, so its id is never reused.
_infos: Dict[int, _FuncInfo] = {}


def _func_info(func) -> _FuncInfo:
    info = _infos.get(id(func))
    if info is None:
        info = _infos[id(func)] = _FuncInfo(func)
    return info


class Lineage:
    """The recorder behind :class:`LineageMode` and the pack hook: one per
    install, fed from the threads that run forward: the install thread and
    threads started after it, each with a mode of its own (Note [Recording
    on started threads] in csrc/torch/lineage_recorder.cpp, whose rule for
    who begins a forward this follows)."""

    def __init__(self, native, plan=None, device_model=None):
        self.native = native
        # Note [Held without their graph] (csrc/torch/lineage_recorder.cpp).
        self._without_graph = native.lineage.held_without_graph if native is not None else None
        # Note [A forward that ran out of memory] (there too): True once after
        # an out-of-memory error (bool() is False).
        self.took_out_of_memory = native.lineage.take_out_of_memory if native is not None else bool
        self.plan = plan
        # For CUDA: a costs.DeviceModel whose roofline stands in for kernel
        # time (the CPU timer only sees launches; event sampling is not built).
        self.device_model = device_model
        self.local = threading.local()      # .paused while replaying
        self.op_index = 0                   # recorded ops in this forward
        self.externals: Dict[int, ExternalLineage] = {}
        self.by_entry: Dict[int, StorageLineage] = {}
        # Lineages of outputs that share a storage with another output of
        # the same op or with an input, and those inputs' (Note [One history
        # per storage]).
        self.ambiguous: "weakref.WeakSet[StorageLineage]" = weakref.WeakSet()
        # Such an output's lineage -> the input's it shares a storage with,
        # and back (Note [Writes behind a counter]).
        self.whole_of: "weakref.WeakKeyDictionary[StorageLineage, StorageLineage]" = weakref.WeakKeyDictionary()
        self.parts_of: "weakref.WeakKeyDictionary[StorageLineage, weakref.WeakSet]" = weakref.WeakKeyDictionary()
        self.in_backward = False
        # Whether the forward being recorded has packed an activation yet
        # (Note [Lineage released between steps]).
        self.packed_in_forward = False
        # Every held input made since the last release, however it left
        # ``externals`` (Note [Every held input released]).
        self.held_inputs: "weakref.WeakSet[ExternalLineage]" = weakref.WeakSet()
        self.ops_recorded = 0
        # (ops recorded when packed, lineage, weak handle) of entries packed
        # before their first write (Note [Packed before its first write]).
        self.unwritten: List[tuple] = []
        # Per thread: writes made inside custom Function forwards still open,
        # and packs waiting for them (Note [Marked dirty by a Function] in
        # csrc/torch/lineage_recorder.cpp).
        self.function_writes: Dict[int, List[tuple]] = {}
        self.function_packs: Dict[int, List[tuple]] = {}
        # The thread that packed last: the one training (Note [Recording on
        # started threads]); None before the first pack.
        self.packer: Optional[int] = None
        # Set by uninstall(): modes left on started threads pass ops through
        # and their packs declare nothing (a later install's recompute
        # callback could not rebuild what this lineage declared).
        self.retired = False

    # -- iteration bookkeeping ------------------------------------------------
    def note_unpack(self) -> None:
        """Backward has begun: the next recorded op starts a new forward."""
        self.in_backward = True
        if self.unwritten:
            self.declare_unwritten(every=True)  # Note [Packed before its first write]

    def retire(self) -> None:
        """uninstall(): from now on modes left on started threads pass ops
        through and packs declare nothing. Those modes keep this object alive
        with their threads, so it lets go of what only recording needed: the
        held inputs of the last forward (a whole model, in a test that
        deleted it) and the lineage of entries no longer alive. Live entries
        keep theirs, for their replays."""
        self.retired = True
        live = set(self.native.live_entry_ids())
        self.by_entry = {k: v for k, v in self.by_entry.items() if k in live}
        self.externals = {}
        self.unwritten = []
        self.function_writes = {}
        self.function_packs = {}

    def may_begin_forward(self) -> bool:
        """Whether an op recorded on this thread after an unpack begins a
        forward: on the thread that packed last, or once autograd holds no
        entry (Note [Recording on started threads])."""
        packer = self.packer
        return packer is None or packer == _get_ident() or not self.native.any_entry_saved_for_backward()

    def _begin_forward(self) -> None:
        # Note [Released as a forward begins]: the optimizer step's release
        # (below) needs a torch.optim step; a loop that updates its
        # parameters by hand, or with an optimizer of its own, never made
        # one, and every loss it kept kept its forward's graph and inputs.
        # A forward that begins with no entry left saved for backward
        # releases the same, in both recorders.
        if not self.native.any_entry_saved_for_backward():
            self._release()  # lets go of everything below, and more
        else:
            _prune_made()
            self.externals = {}
            self.unwritten = []
            live = set(self.native.live_entry_ids())
            self.by_entry = {k: v for k, v in self.by_entry.items() if k in live}
        self.in_backward = False
        self.packed_in_forward = False
        self.op_index = 0

    def release_if_idle(self) -> bool:
        """Note [Lineage released between steps]: once backward has run and
        no managed entry is left, nothing recorded can be replayed again, yet
        the last forward's nodes still hold its inputs (parameters and their
        gradients, the batch) for as long as any tensor it made lives (the
        loss a training loop keeps): ``del model`` in a notebook freed
        nothing until the next forward or ``uninstall()``. Lets go of them;
        tensors made before are read as held inputs from then on. Called at
        every optimizer step (``_runtime.py``). True when it released.

        An op recorded between ``backward()`` and the step (``loss.detach()``
        for the loop's history) began a forward that packed nothing, and the
        release waited for a backward that never came: ``del model`` left
        16 MiB allocated. So it releases whenever the forward being recorded
        has packed nothing yet, and the next op begins a fresh forward (its
        ops numbered from 0 again, as plans count them)."""
        # Entries only the recorder holds ask for no replay (Note [Entries
        # only lineage holds] in csrc/torch/saved_activation.cpp).
        if (self.packed_in_forward and not self.in_backward) or self.native.any_entry_saved_for_backward():
            return False
        self._release()
        return True

    def _release(self) -> None:
        """Lets go of everything recorded (release_if_idle, _begin_forward);
        the next recorded op begins a forward."""
        global _generation
        # Note [Every held input released]: ``externals`` is keyed by id(),
        # and an id is reused once its tensor dies (the transposed weight
        # each linear makes): the newer tensor's held input replaced the
        # older one in the map while the older one's node, reached from a
        # tensor the loop kept, still held the weight. Whether an id came
        # back depended on when the garbage collector ran: 4 MiB stayed
        # after ``del model`` in about 1 run of 8 (CI, session 30).
        # ``held_inputs`` sees them all.
        for held in list(self.held_inputs):
            held.tensor = held.handle = held.weak = None
        self.held_inputs = weakref.WeakSet()
        self.externals = {}
        self.unwritten = []
        self.by_entry = {}
        self.in_backward = True
        self.packed_in_forward = False
        _sever_released_lineages()
        _generation += 1

    def paused(self) -> bool:
        """True on this thread while a replay runs (its ops are not recorded)."""
        return getattr(self.local, "paused", False)

    # -- recording ------------------------------------------------------------
    def _ref(self, tensor: torch.Tensor, scratch: bool = False) -> TensorRef:
        lineage = lineage_of(tensor)
        if lineage is not None:
            if lineage.generation == _generation and (tensor._version == lineage.versions[-1]
                                                      or at_last_version(lineage, tensor._version)):
                try:
                    return _new_ref(lineage, len(lineage.mutations), tensor, scratch)
                except RuntimeError:
                    if tensor.layout is torch.strided:
                        raise
                    # Note [Tensors without storage]: read as held inputs.
            # Written where lineage could not see (no_grad code such as weight
            # init, another thread), or made before the recorder let go of
            # what it held (Note [Lineage released between steps]): from here
            # on it is an input we hold, like a parameter. Such tensors are
            # long-lived buffers in practice.
            _forget_lineage_of(tensor)
        held = self.externals.get(id(tensor))
        # A new storage under the same tensor (``p.data = ...``, which no
        # mode sees) is a new input (Note [Held without their graph]).
        if held is None or held.held() is not tensor or held.key != storage_address(tensor):
            held = self.externals[id(tensor)] = ExternalLineage(tensor, self._without_graph)
            self.held_inputs.add(held)
            if not scratch and self.native is not None and tensor.layout is torch.strided:
                handle = self.native.entry_handle(tensor)  # packed before this read
                if handle is not None:
                    held.hold_through(handle)
        try:
            return _new_ref(held, 0, tensor, scratch)
        except RuntimeError:
            if tensor.is_inference():
                # No version counter, and not writable outside inference mode
                # (a teacher's outputs made under torch.inference_mode): read
                # at version 0 (_version_of).
                return _tuple_new(TensorRef, (held, 0, 0, tensor.size(), tensor.stride(), tensor.storage_offset(),
                                              tensor.dtype, scratch, tensor.is_conj() + 2 * tensor.is_neg()))
            if tensor.layout is torch.strided:
                raise
            # Note [Tensors without storage]: a sparse (or other non-strided)
            # tensor has no strides nor storage offset to rebuild a view
            # from; it is held and handed to the replay as it is (its geometry
            # fields are None). The op reading it is recorded as usual
            # (torch.sparse.mm(adjacency, x) replays with the held adjacency).
            return _tuple_new(TensorRef, (held, 0, tensor._version, tensor.size(), None, 0, tensor.dtype, scratch, 0))

    def _template(self, value, refs: List[TensorRef], scratch: bool = False):
        if isinstance(value, _PLAIN_TENSOR):
            ref = self._ref(value, scratch)
            refs.append(ref)
            return ref
        kind = type(value)
        if (kind is list or kind is tuple) and value and any(isinstance(v, _PLAIN_TENSOR) for v in value):
            items = [self._template(v, refs) for v in value]
            return items if kind is list else tuple(items)
        return value

    def before(self, func, info: _FuncInfo, args, kwargs) -> OpNode:
        """Builds the node from the arguments as they are before the op runs
        (versions must predate its own writes)."""
        if (self.in_backward and self.may_begin_forward()) or self.took_out_of_memory():
            self._begin_forward()
        if self.unwritten:
            self.declare_unwritten()  # Note [Packed before its first write]
        refs: List[TensorRef] = []
        tensor_args = info.tensor_args
        if tensor_args is not None:
            # Only the positions the schema types as tensors are looked at.
            arg_template = None
            count = len(args)
            ref = self._ref
            for position, is_list, scratch in tensor_args:
                if position >= count:
                    break
                value = args[position]
                if is_list:
                    if not value:
                        continue
                    value = self._template(value, refs)
                elif isinstance(value, _PLAIN_TENSOR):
                    # A snapshot is copied as the op starts (below the mode:
                    # not recorded) and held as a scratch input.
                    value = ref(value.clone(), True) if scratch is _SNAPSHOT else ref(value, scratch)
                    refs.append(value)
                else:
                    continue
                if arg_template is None:
                    arg_template = list(args)
                arg_template[position] = value
            arg_template = args if arg_template is None else tuple(arg_template)
        elif info.scratch_positions:
            scratch_positions = info.scratch_positions
            arg_template = tuple(self._template(a, refs, i in scratch_positions) for i, a in enumerate(args))
        else:
            arg_template = tuple([self._template(a, refs) for a in args])
        kwarg_template = {k: self._template(v, refs, k in info.scratch)
                          for k, v in kwargs.items()} if kwargs else _NO_KWARGS
        node = OpNode(func, arg_template, kwarg_template, refs, self.op_index, info.replayable)
        self.op_index += 1
        self.ops_recorded += 1
        if info.random:
            node.rng = _capture_generator(args, kwargs)
        self.rescue_before_writes(info, args, kwargs)
        return node

    def rescue_before_writes(self, info: _FuncInfo, args, kwargs) -> None:
        """``info``'s op is about to write its arguments in place: what reads
        a written tensor that no recorded op produced (a held input) is
        rescued first (Note [Rescue before the write]), and a tensor of a
        lineage whose last recorded write may not have bumped its counter
        has that settled (Note [Writes that bump no version]). Called for
        recorded ops, and for unrecorded ones (grad off) outside backward (Note
        [Written where nothing records] in csrc/torch/lineage_recorder.cpp:
        ``with torch.no_grad(): p.data.mul_(0.5)`` between forward and
        backward replayed dropped activations with the new weight,
        silently). Storages this recorder knows the lineage of keep it: a
        write under no_grad moves the written tensor's counter, and every
        tensor object on them holds its own lineage."""
        for position, name in info.writes:
            if name in info.scratch:
                continue
            target = args[position] if position < len(args) else kwargs.get(name)
            if isinstance(target, torch.Tensor):
                lineage = lineage_of(target)
                if lineage is None:
                    if self.by_entry:
                        self._rescue_before_write(target)
                elif lineage.unbumped is not None:
                    # Note [Writes that bump no version]: whether the last
                    # recorded write bumped is settled before this one moves
                    # the counter, or the two would read as the recorded one.
                    at_last_version(lineage, target._version)

    def _rescue_before_write(self, target: torch.Tensor) -> None:
        # Note [Rescue before the write]: a write to a tensor lineage did not
        # produce: whatever was recorded from its old value can no longer be
        # replayed. Entries that depend on it and are dropped right now are
        # rebuilt here, before the op runs. (After it, as this was done
        # before, the data is already written while autograd, above this
        # mode, has not bumped the version counter yet, so the replay's
        # version check passed and it rebuilt from the new values: wrong
        # gradients, silently; test_input_written_in_place_after_forward_is_rescued
        # with actions="recompute".) The C++ recorder rescues from the op's
        # start callback, before it runs, too.
        from .replay import rescue_dependents_of

        rescue_dependents_of(self, target)

    def after(self, node: OpNode, info: _FuncInfo, args, kwargs, out) -> None:
        """Attaches lineages to the outputs and records writes."""
        if info.simple:
            if type(out) is _PLAIN_TENSOR:
                _attach(out, StorageLineage(node, 0, out))
            return
        for position, name in info.writes:
            if name in info.scratch:
                continue
            target = args[position] if position < len(args) else kwargs.get(name)
            if isinstance(target, torch.Tensor):
                self._record_write(node, info, target)
        # One entry per return: a tuple for several returns, the list itself
        # for one Tensor[] return. `index` numbers tensors as the replay's
        # run() returns them (the tuple's or the list's positions).
        outputs = out if type(out) is tuple else (out,)
        by_storage: Optional[Dict[int, StorageLineage]] = None
        inputs_by_storage: Dict[int, StorageLineage] = {}
        if info.undeclared_aliases:
            by_storage = {}
            for arg in args:
                source = lineage_of(arg) if isinstance(arg, torch.Tensor) else None
                if source is not None:
                    inputs_by_storage[storage_address(arg)] = source
        index = 0
        for position, output in enumerate(outputs):
            alias = info.aliases[position] if position < len(info.aliases) else None
            if alias is not None:
                source_position, name = alias
                source = args[source_position] if source_position < len(args) else kwargs.get(name)
                self._share_lineage(output, source)
                index += len(output) if type(output) is list else 1
                continue
            for item in (output if type(output) is list and type(out) is not tuple else (output,)):
                if type(item) is torch.Tensor and node is not None:
                    lineage = StorageLineage(node, index, item)
                    _attach(item, lineage)
                    if by_storage is not None:
                        address = storage_address(item)
                        other = by_storage.setdefault(address, lineage)
                        if other is not lineage:
                            self.ambiguous.add(other)
                            self.ambiguous.add(lineage)
                        whole = inputs_by_storage.get(address)
                        if whole is not None:  # Note [Writes behind a counter]
                            self.whole_of[lineage] = whole
                            self.parts_of.setdefault(whole, weakref.WeakSet()).add(lineage)
                            self.ambiguous.add(whole)
                            self.ambiguous.add(lineage)
                index += 1

    def _share_lineage(self, output, source) -> None:
        # A view (or in-place result) shares its source's storage lineage.
        sources = source if isinstance(source, (list, tuple)) else (source,)
        outputs = output if isinstance(output, (list, tuple)) else (output,)
        lineage = lineage_of(sources[0]) if sources and isinstance(sources[0], torch.Tensor) else None
        for item in outputs:
            if isinstance(item, torch.Tensor) and item is not sources[0] and lineage is not None:
                _attach(item, lineage)

    def _record_write(self, node: OpNode, info: _FuncInfo, target: torch.Tensor) -> None:
        lineage = lineage_of(target)
        if lineage is not None:
            lineage.mutations.append(node)
            # Autograd's ADInplaceOrView kernel, above this mode, bumps the
            # version once the op returns: the version after it is one more,
            # unless the op has no such kernel (Note [Writes that bump no
            # version]).
            lineage.versions.append(target._version + 1)
            lineage.unbumped = None if info.bumps else target._version
            lineage.memo.clear()
            if info.bumps and _in_function_forward() and self.native is not None:
                self._remember_function_write(lineage, target)
            if self.whole_of:
                # Note [Writes behind a counter]: unsafe_chunk's outputs share
                # their input's storage, each with a version counter of its
                # own. A write through one of them changes the input's bytes
                # behind the input's counter, and a write through the input
                # theirs: the input's history (or theirs) ends here, so later
                # reads hold the tensor and earlier ones replay what they
                # read. Without it, a read of the input after a write through
                # a chunk replayed the input without the write: wrong
                # gradients, silently (the C++ recorder's Note [Parts of a
                # storage] is the same rule).
                whole = self.whole_of.get(lineage)
                if whole is not None:
                    self._end_history(whole)
                for part in list(self.parts_of.get(lineage, ())):
                    self._end_history(part)
        # Otherwise a write to a tensor lineage did not produce: its
        # dependents were rescued before the op ran (Note [Rescue before the
        # write]), and replay.py refuses any later replay that reads it (it
        # checks the version of every external input).

    def _remember_function_write(self, lineage: StorageLineage, target: torch.Tensor) -> None:
        """A write inside a custom Function's forward: its version may be
        bumped once more as the Function returns (Note [Marked dirty by a
        Function] in csrc/torch/lineage_recorder.cpp)."""
        depth = self.native.lineage.function_forward_depth()
        self.function_writes.setdefault(_get_ident(), []).append((depth, lineage, target, lineage.versions[-1]))
        self.native.lineage.settle_at_function_end()

    def settle_function_writes(self, depth: int, sequence_nr: int) -> bool:
        """Called by the native tracker as a custom Function's record closes,
        with ``depth`` Function forwards still open on this thread and the
        record's ``sequence_nr``: a write its forward made whose tensor
        autograd has since bumped exactly once and rebased onto this
        Function's node (``ctx.mark_dirty``) takes that version as its own;
        the packs that waited for it are declared, those waiting for an
        outer forward's write wait on. Returns whether writes of outer
        forwards still wait (Note [Marked dirty by a Function] in
        csrc/torch/lineage_recorder.cpp)."""
        ident = _get_ident()
        waiting, settled = [], []
        for write in self.function_writes.pop(ident, ()):
            (waiting if write[0] <= depth else settled).append(write)
        rebased = self.native.lineage.rebased_onto_function
        for _, lineage, target, version in settled:
            if lineage.versions[-1] == version and target._version == version + 1 and rebased(target, sequence_nr):
                lineage.versions[-1] = version + 1
        if waiting:
            self.function_writes[ident] = waiting
        packs, still = self.function_packs.pop(ident, ()), []
        for lineage, handle_ref in packs:
            if self._waits_for_function(lineage):  # on an outer forward's write
                still.append((lineage, handle_ref))
                continue
            handle = handle_ref()  # None: the entry is gone
            if handle is not None and lineage.entry_id is None and at_last_version(lineage, handle.version):
                lineage.entry_id = handle.entry_id
                self.by_entry[handle.entry_id] = lineage
                self._declare(handle.entry_id, lineage)
        if still:
            self.function_packs[ident] = still
        return bool(waiting)

    def _waits_for_function(self, lineage: StorageLineage) -> bool:
        """Whether ``lineage`` was written inside a custom Function's forward
        still open on this thread (Note [Marked dirty by a Function])."""
        writes = self.function_writes.get(_get_ident())
        return writes is not None and any(write[1] is lineage for write in writes)

    def _end_history(self, lineage: StorageLineage) -> None:
        lineage.mutations.append(_ENDED)
        lineage.versions.append(-1)  # no tensor's version: read from now on as a held input
        lineage.unbumped = None
        lineage.memo.clear()
        if lineage.entry_id is not None:
            self.rescued(lineage.entry_id)  # its bytes changed behind the version it was declared at

    def rescued(self, entry_id: int) -> None:
        """An entry whose replay would read a tensor about to be overwritten:
        made resident now and declared unrecomputable."""
        self.native.entry_storage(entry_id)
        self.native.set_recompute_info(entry_id, False, 0.0, [], _RESCUED)

    # -- pack -----------------------------------------------------------------
    def on_pack(self, handle, tensor: torch.Tensor) -> None:
        """Declares to the manager how a newly managed storage can be rebuilt."""
        if self.retired:
            return
        if self.unwritten:
            self.declare_unwritten()
        if _graph_task_id() == -1:
            self.packer = _get_ident()
            self.packed_in_forward = True
        lineage = lineage_of(tensor)
        if lineage is None or lineage.entry_id is not None or lineage.generation != _generation:
            held = self.externals.get(id(tensor))
            if held is not None and held.handle is None and held.held() is tensor:
                # Read before this pack. A handle of its own: autograd's
                # would count as saved for backward (Note [Entries only
                # lineage holds] in csrc/torch/saved_activation.cpp).
                own = self.native.entry_handle(tensor)
                if own is not None:
                    held.hold_through(own)
            return
        declared = self.by_entry.get(handle.entry_id)
        if declared is not None and (lineage in self.ambiguous or declared in self.ambiguous):
            # Note [One history per storage]: residency is per storage, and
            # an op whose outputs share one storage without being declared
            # views (unsafe_chunk, unsafe_split: a CPU GRU cell's gates)
            # gives each output a lineage of its own, with its own version
            # counter, and each is written in place through itself. Rebuilt
            # from one of those histories, the storage would lack the others'
            # writes: a GRU trained recompute-only got wrong gradients,
            # silently. A storage packed under two such lineages is swap-only;
            # what reads it can still be replayed, reading it as a managed
            # input (Note [Storage lineage]). Declared views (split, chunk)
            # share one version counter: a write through one is seen by all.
            lineage.entry_id = handle.entry_id
            self.native.set_recompute_info(handle.entry_id, False, 0.0, [],
                                           f"{_SEVERAL_HISTORIES} at {lineage.producer.name}")
            return
        base = lineage.base()
        if base is not None and base is not tensor and storage_address(base) != storage_address(tensor):
            return  # set_() or similar moved the tensor to another storage
        if not at_last_version(lineage, tensor._version):
            if self.function_writes and self._waits_for_function(lineage):
                # Saved by ctx.save_for_backward after mark_dirty's bump:
                # declared as the Function returns (Note [Marked dirty by a Function]).
                self.function_packs.setdefault(_get_ident(), []).append((lineage, weakref.ref(handle)))
            return  # written by something lineage did not see
        entry_id = handle.entry_id
        lineage.entry_id = entry_id
        self.by_entry[entry_id] = lineage
        if not lineage.mutations and _func_info(lineage.producer.func).undefined_contents:
            # Note [Packed before its first write]: autograd saves an op's
            # inputs before the op runs, and RReLU's noise is an empty
            # tensor the op it is saved for fills (Note [An empty tensor its
            # first writer fills] in csrc/torch/lineage_replay.cpp).
            # Declared now it could only be swapped: nothing recorded its
            # contents yet. It is declared once that op has returned; until
            # then, or if a pack on another thread replaces the list as it
            # is appended to, the manager holds it as not recomputable
            # (swap-only, as before).
            # The handle, weakly, reads the version then: the tensor may be
            # gone (rrelu's noise is a temporary of torch.rrelu), and held it
            # stayed allocated after a forward that raised before then.
            self.unwritten.append((self.ops_recorded, lineage, weakref.ref(handle)))
            return
        self._declare(entry_id, lineage)

    def declare_unwritten(self, every: bool = False) -> None:
        """Declares the entries packed empty (Note [Packed before its first
        write]) whose op has returned since: those packed before the last
        recorded op began, or ``every`` one (backward has begun)."""
        waiting = []
        for packed_at, lineage, handle_ref in self.unwritten:
            if not every and packed_at >= self.ops_recorded:
                waiting.append((packed_at, lineage, handle_ref))
                continue
            handle = handle_ref()  # None: the entry is gone
            if handle is not None and self.by_entry.get(handle.entry_id) is lineage \
                    and at_last_version(lineage, handle.version):
                self._declare(handle.entry_id, lineage)
        self.unwritten = waiting

    def _declare(self, entry_id: int, lineage: StorageLineage) -> None:
        # A function-level import costs microseconds per call (the package
        # relative import runs importlib's Python code): bound once.
        closure = _replay_closure or _bind_replay_closure()
        ok, seconds, deps, _, why, held = closure(lineage, len(lineage.mutations), top=True)
        # Held inputs whose storage may be freed under the entry (Note [Held
        # inputs freed under us] in csrc/core/residency_entry.h); those held
        # through their entry are managed.
        held_tensors = [source.tensor for source in held if source.tensor is not None] if ok else ()
        self.native.set_recompute_info(entry_id, ok, seconds, sorted(deps) if len(deps) > 1 else list(deps),
                                       why, held_tensors)
        if ok and self.plan is not None:
            producer = lineage.producer
            if self.plan.drops(producer.index, producer.name, lineage.index):
                self.native.plan_drop(entry_id)


_replay_closure = None  # membudget.replay.closure, bound at the first pack (replay imports this module)

# Why an entry cannot be replayed, for out-of-memory messages (Note [Why not
# recomputable] in csrc/core/residency_manager.cpp; the C++ recorder's words).
_RESCUED = "an input its replay reads was about to be written in place (rescued: made resident)"
_SEVERAL_HISTORIES = ("its storage has several histories (outputs of unsafe_split or unsafe_chunk written in "
                      "place)")  # Note [One history per storage]


def _bind_replay_closure():
    global _replay_closure
    from .replay import closure

    _replay_closure = closure
    return closure


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def storage_address(tensor: torch.Tensor) -> int:
    """Start address of the tensor's storage. Computed from the data pointer
    because ``untyped_storage()`` creates a Python storage object that keeps
    the storage referenced (and thus never evictable) for as long as it lives.
    0 for a tensor without one (sparse: Note [Tensors without storage])."""
    try:
        return tensor.data_ptr() - tensor.storage_offset() * tensor.element_size()
    except RuntimeError:
        if tensor.layout is torch.strided:
            raise
        return 0


def _capture_generator(args, kwargs) -> Optional[Tuple[torch.Generator, torch.Tensor]]:
    generator = kwargs.get("generator") if kwargs else None
    if generator is None:
        device = None
        for value in args:
            if isinstance(value, torch.Tensor):
                device = value.device
                break
        if device is not None and device.type == "cuda":
            generator = torch.cuda.default_generators[device.index or 0]
        else:
            generator = torch.default_generator
    return generator, generator.get_state()


def _modelled_seconds(func, args, kwargs, out, device) -> float:
    from .costs import op_bytes, op_category, op_flops, roofline_seconds

    read, written = op_bytes(args, kwargs, out)
    dtype = out.dtype if isinstance(out, torch.Tensor) else None
    return roofline_seconds(op_flops(func, args, kwargs, out), read + written, device, dtype, op_category(func))


def track_function_forwards(native, on: bool, lineage: Optional["Lineage"] = None) -> None:
    """Turns on (or off) the native tracker of custom Function forwards on
    this thread, which the mode asks when grad is off (Note [Custom Function
    forwards] in csrc/torch/function_forwards.cpp); ``lineage`` settles the
    writes its forwards made as each Function returns (Note [Marked dirty
    by a Function] in csrc/torch/lineage_recorder.cpp)."""
    global _in_function_forward
    native.lineage.track_function_forwards(on, lineage.settle_function_writes if on and lineage is not None else None)
    _in_function_forward = native.lineage.in_function_forward if on else bool


class LineageMode(TorchDispatchMode):
    """Records forward ops into a :class:`Lineage` (see the module docstring).

    Note [Raw dispatch handler]: ``TorchDispatchMode`` wraps a subclass's
    ``__torch_dispatch__`` in ``torch._disable_dynamo``, which costs about
    100 us per op here (measured: 112 us vs 8 us for a passthrough handler on
    ``torch.add``). The handler is therefore assigned after the class is made,
    unwrapped. Dynamo does not run our handler while tracing (it traces under
    its own fake mode; fake tensors are passed through unrecorded).
    """

    def __init__(self, lineage: Lineage):
        super().__init__()
        self.lineage = lineage

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Note [Compiled beside the mode]: Dynamo compiles nothing while a
        dispatch mode is on the stack unless the mode says it ignores
        compile internals (torch 2.9 on; older torch never asks). So under
        this recorder a ``torch.compile``d model ran eagerly: other numbers
        than the user's compiled run, at eager speed. Saying so, the mode is
        off while Dynamo traces and on while the compiled code runs; the ops
        a compiled region still dispatches are not recorded (Note [Compiled
        regions are not recorded] in csrc/torch/function_forwards.cpp), so
        what it saves is swap-only, as under the C++ recorder, which is no
        mode and never stopped compilation."""
        return True


def _lineage_dispatch(self, func, types, args=(), kwargs=None):
    info = _infos.get(id(func)) or _func_info(func)
    if kwargs is None:
        kwargs = _NO_KWARGS
    # Replays run with the mode off the stack (replay.rebuild_entry), and
    # backward normally does too (Note [Backward without the lineage mode]);
    # the graph task check covers backward entered some other way. Grad is
    # off in a custom Function's forward, which is recorded all the same
    # (Note [Custom Function forwards] in csrc/torch/function_forwards.cpp).
    if not info.recorded or _graph_task_id() != -1 or not (_grad_enabled() or _in_function_forward()):
        if info.writes and _graph_task_id() == -1:
            self.lineage.rescue_before_writes(info, args, kwargs)
        return info.op(*args, **kwargs)
    for kind in types:  # tensor subclasses (fake, functional, user wrappers): not ours
        if kind is not _PLAIN_TENSOR:
            return info.op(*args, **kwargs)
    lineage = self.lineage
    if lineage.retired:  # a started thread's mode after uninstall()
        return info.op(*args, **kwargs)
    if info.view:
        if (lineage.in_backward and lineage.may_begin_forward()) or lineage.took_out_of_memory():
            lineage._begin_forward()
        lineage.op_index += 1  # numbered all the same: plans count every forward op
        lineage.ops_recorded += 1
        out = info.op(*args, **kwargs)
        lineage.after(None, info, args, kwargs, out)
        return out
    node = lineage.before(func, info, args, kwargs)
    start = _clock()
    out = info.op(*args, **kwargs)
    node.seconds = _clock() - start
    if lineage.device_model is not None:
        # Asynchronous device: the timer saw the launch only.
        node.seconds = max(node.seconds, _modelled_seconds(func, args, kwargs, out, lineage.device_model))
    if info.simple:
        if type(out) is _PLAIN_TENSOR:
            _attach(out, StorageLineage(node, 0, out))
    else:
        lineage.after(node, info, args, kwargs, out)
    return out


_graph_task_id = torch._C._current_graph_task_id
_get_ident = threading.get_ident
_grad_enabled = torch.is_grad_enabled
_in_function_forward = bool  # the native tracker's query once LineageMode is made (bool() is False)
_clock = time.perf_counter
_PLAIN_TENSOR = torch.Tensor
LineageMode.__torch_dispatch__ = _lineage_dispatch  # Note [Raw dispatch handler]


def hide_from_dynamo(function):
    """Marks ``function``'s code, and everything it calls, as never to be
    compiled by Dynamo: the per-code-object equivalent of
    ``torch._dynamo.disable`` without its per-call wrapper (Note [Raw
    dispatch handler]). Without it, a ``torch.compile``d model calling into
    lineage makes Dynamo try (and fail, recompiling) to trace our code. On a
    torch without this hook it does nothing."""
    try:
        from torch._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy
    except ImportError:  # pragma: no cover - older torch
        return function
    set_code_exec_strategy(function.__code__, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))
    return function


hide_from_dynamo(_lineage_dispatch)

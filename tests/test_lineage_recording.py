"""Lineage recording's fast paths against their references: the schema-typed
argument positions record the same nodes as scanning every argument (and
replay to the same bytes), and the mode is off the stack during optimizer
steps without losing any recorded op (Note [Lineage mode parked during
optimizer steps] in membudget/_runtime.py)."""
import gc

import pytest
import torch
from torch import nn

import membudget
from membudget import _runtime, lineage
from membudget._native import load_extension
from membudget.lineage import ExternalLineage, Lineage, LineageMode, StorageLineage, TensorRef

pytestmark = [pytest.mark.requires_native, pytest.mark.usefixtures("python_lineage")]

ROOMY_BUDGET = "4GiB"  # lineage is recorded only under a budget; this one evicts nothing


class _Mixed(nn.Module):
    """Ops whose tensors sit in every kind of argument: lists (cat, stack),
    optional tensors (layer norm's weight and bias), batch norm's running
    statistics (scratch), indices (List[Optional[Tensor]]), random ops,
    in-place writes, views, embedding and an LSTM (weight lists)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.lstm = nn.LSTM(16, 16, batch_first=True)
        self.norm = nn.LayerNorm(16)
        self.bn = nn.BatchNorm1d(16)
        self.linear = nn.Linear(32, 16)
        self.drop = nn.Dropout(0.2)

    def forward(self, tokens):
        h = self.embed(tokens)
        h, _ = self.lstm(h)
        h = self.norm(h).transpose(1, 2)
        h = self.bn(h).transpose(1, 2).contiguous()
        h = torch.cat([h, torch.stack([h[:, :, 0]] * 16, dim=-1)], dim=-1)
        h = self.drop(self.linear(h))
        h.relu_()
        h = h[:, torch.tensor([0, 2, 3])]
        h += 1.0
        return h.square().mean()


class _RecordingLineage(Lineage):
    """A Lineage that keeps every node it records, in order."""

    def __init__(self):
        super().__init__(native=None)
        self.nodes = []
        self.in_backward = False

    def before(self, func, info, args, kwargs):
        node = super().before(func, info, args, kwargs)
        self.nodes.append(node)
        return node


def _describe(value, names):
    """A node argument with every lineage replaced by its order of first appearance."""
    if type(value) is TensorRef:
        source = names.setdefault(id(value.lineage), (len(names), type(value.lineage).__name__))
        return ("ref", source, value.version, value.tensor_version, tuple(value.sizes), tuple(value.strides),
                value.offset, value.dtype, value.scratch)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_describe(v, names) for v in value))
    return value


def _record(scan_every_argument: bool):
    saved = dict(lineage._infos)
    lineage._infos.clear()
    if scan_every_argument:
        # The reference: no schema positions, every argument looked at.
        original = lineage._FuncInfo.__init__

        def scanning_init(self, func):
            original(self, func)
            self.tensor_args = None

        lineage._FuncInfo.__init__ = scanning_init
    try:
        torch.manual_seed(0)
        model = _Mixed().train()
        tokens = torch.randint(0, 32, (4, 8))
        recorder = _RecordingLineage()
        with LineageMode(recorder):
            model(tokens)
        names = {}
        return [(str(n.func), _describe(n.args, names), _describe(tuple(sorted(n.kwargs.items())), names),
                 n.replayable, n.rng is not None, len(n.refs)) for n in recorder.nodes]
    finally:
        if scan_every_argument:
            lineage._FuncInfo.__init__ = original
        lineage._infos.clear()
        lineage._infos.update(saved)


def test_schema_positions_record_the_same_nodes_as_scanning_every_argument():
    fast = _record(scan_every_argument=False)
    reference = _record(scan_every_argument=True)
    assert len(fast) > 20
    assert fast == reference
    names = {name for name, *_ in fast}
    for expected in ("aten.cat.default", "aten.stack.default", "aten.index.Tensor", "aten.relu_.default"):
        assert expected in names


def test_tensor_ref_fields():
    t = torch.randn(3, 4)[:, 1:]
    owner = ExternalLineage(t)
    ref = TensorRef(owner, 2, t, True)
    assert type(ref) is TensorRef
    assert (ref.lineage, ref.version, ref.tensor_version, ref.sizes, ref.strides, ref.offset, ref.dtype,
            ref.scratch) == (owner, 2, t._version, t.size(), t.stride(), 1, t.dtype, True)
    assert "version=2" in repr(ref)


def _mode_on_top() -> bool:
    return _runtime._lineage_mode is not None and _runtime._mode_on_top(_runtime._lineage_mode)


def _train(steps: int, evict: bool, functional: bool = False, scan_every_argument: bool = False,
           failing_step: bool = False, **install):
    """Adam steps; returns (losses, parameters, ops recorded per step, whether the mode was on the
    stack (during each optimizer step, after it), recompute count)."""
    if install:
        membudget.install(min_tensor_bytes=0, **install)
        membudget.reset_counters()
    saved_infos = dict(lineage._infos)
    original_init = lineage._FuncInfo.__init__
    if scan_every_argument:
        lineage._infos.clear()

        def scanning_init(self, func):
            original_init(self, func)
            self.tensor_args = None

        lineage._FuncInfo.__init__ = scanning_init
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 64), nn.Dropout(0.1), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 64))
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        during = []
        optimizer.register_step_pre_hook(lambda *_: during.append(_mode_on_top()))  # runs after the global hooks
        weights = [p for p in model.parameters()]
        losses, recorded, on_stack = [], [], []
        for step in range(steps):
            before = _runtime._lineage.ops_recorded if _runtime._lineage else 0
            torch.manual_seed(100 + step)
            x = torch.randn(16, 64)
            if functional:  # no nn.Module call: nothing to re-arm the mode
                h = torch.tanh(x @ weights[0].t() + weights[1])
                loss = (h @ weights[-2].t()).square().mean()
            else:
                loss = model(x).square().mean()
            recorded.append((_runtime._lineage.ops_recorded if _runtime._lineage else 0) - before)
            if evict:
                load_extension().evict_all()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if failing_step and step == 1:
                def fail(*_):
                    raise RuntimeError("step failed")

                handle = optimizer.register_step_pre_hook(fail)
                with pytest.raises(RuntimeError, match="step failed"):
                    optimizer.step()  # parked, never unparked by the post-hook
                handle.remove()
                on_stack.append((during[-1], _mode_on_top()))
                losses.append(loss.item())
                continue
            optimizer.step()
            on_stack.append((during[-1], _mode_on_top()))
            losses.append(loss.item())
        stats = membudget.memory_stats() if install else {}
        return losses, [p.detach().clone() for p in model.parameters()], recorded, on_stack, \
            stats.get("recompute_count", 0)
    finally:
        lineage._FuncInfo.__init__ = original_init
        if scan_every_argument:
            lineage._infos.clear()
            lineage._infos.update(saved_infos)
        if install:
            membudget.uninstall()


def _assert_same_training(plain, managed):
    assert plain[0] == managed[0]
    for a, b in zip(plain[1], managed[1]):
        assert torch.equal(a, b)


def test_mode_is_off_the_stack_during_optimizer_steps_and_every_forward_is_recorded():
    plain = _train(4, evict=False)
    managed = _train(4, evict=True, budget=ROOMY_BUDGET, actions="recompute")
    _assert_same_training(plain, managed)
    losses, _, recorded, on_stack, recomputes = managed
    assert on_stack == [(False, True)] * 4   # off for each step, back after it
    assert recorded[0] > 0 and len(set(recorded)) == 1, recorded
    assert recomputes >= 4


def test_a_failing_step_leaves_the_mode_to_the_next_module_call():
    _, _, recorded, on_stack, _ = _train(4, evict=True, failing_step=True, budget=ROOMY_BUDGET,
                                         actions="recompute")
    # Step 1's step raised: no post-hook, the mode stays parked until the
    # next module call (step 2's model(x)) re-enters it.
    assert on_stack[1] == (False, False)
    assert on_stack[2] == on_stack[3] == (False, True)
    assert recorded[0] > 0 and recorded[3] == recorded[0]
    assert 0 < recorded[2] < recorded[0]  # step 2's randn ran before the module call: not recorded


def test_forward_without_modules_is_recorded_every_step():
    plain = _train(4, evict=False, functional=True)
    managed = _train(4, evict=True, functional=True, budget=ROOMY_BUDGET, actions="recompute")
    _assert_same_training(plain, managed)
    _, _, recorded, on_stack, recomputes = managed
    assert on_stack == [(False, True)] * 4
    assert recorded[0] > 0 and len(set(recorded)) == 1, recorded
    assert recomputes >= 4


def test_autograd_grad_leaves_the_mode_in_place():
    membudget.install(budget=ROOMY_BUDGET, actions="both", min_tensor_bytes=0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    loss = model(torch.randn(4, 8)).sum()
    torch.autograd.grad(loss, list(model.parameters()))
    assert _runtime._mode_on_top(_runtime._lineage_mode)


def test_schema_positions_and_full_scan_replay_identically():
    fast = _train(3, evict=True, budget=ROOMY_BUDGET, actions="recompute")
    reference = _train(3, evict=True, scan_every_argument=True, budget=ROOMY_BUDGET, actions="recompute")
    _assert_same_training(fast, reference)
    assert fast[4] > 0 and reference[4] == fast[4]


def test_op_observer_probe_sees_top_level_ops_only():
    # The C++ probe (Note [Op observer probe]) counts the ops user code calls
    # with grad on: linear once (not its t/addmm), nothing of backward.
    native = load_extension()
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)
    native.observe_ops_start()
    try:
        loss = torch.nn.functional.linear(x, w).tanh().sum()
        with torch.no_grad():
            torch.tanh(x)
    finally:
        counts = native.observe_ops_stop()
    assert counts["ops"] == 3                      # linear, tanh, sum
    assert counts["tensors"] == 3 + 2 + 2          # inputs and outputs of each
    loss.backward()
    with pytest.raises(RuntimeError, match="not on"):
        native.observe_ops_stop()


def test_a_held_input_replaced_in_the_map_is_released_all_the_same():
    """Note [Every held input released]: held inputs are keyed by id(), and
    once a held tensor dies its id can come back (a forward's transposed
    weights): the newer tensor's held input replaced the older one in the
    map, and the release at the step never reached the older one, which a
    node still referenced, holding the weight (4 MiB after ``del model`` in
    some CI runs). The id coming back is made here by moving the older
    one's key, the only thing id reuse changes."""
    membudget.install(budget=ROOMY_BUDGET, actions="both", min_tensor_bytes=0)
    recorder = _runtime._lineage
    weight = nn.Parameter(torch.randn(64, 64))
    first = weight.t()  # made by an autograd op: held without its graph, weakly
    older = recorder._ref(first).lineage
    second = weight.t()
    recorder.externals[id(second)] = recorder.externals.pop(id(first))
    del first
    newer = recorder._ref(second).lineage
    assert newer is not older and recorder.externals[id(second)] is newer
    assert recorder.release_if_idle()
    assert older.released() and newer.released()


def test_kept_losses_keep_no_recorded_graph():
    """Note [Released lineage severed]: a kept loss's lineage reached, through
    its producer, every node of its forward (arguments, RNG states, held
    inputs): a loop keeping its losses kept every step's graph of nodes on
    the host, 38 objects a step for an 8-layer MLP. After the release only
    the kept losses' own lineages stay, and nothing reachable from them."""
    def alive() -> int:
        gc.collect()
        return sum(1 for o in gc.get_objects() if type(o) in (lineage.OpNode, StorageLineage))

    membudget.install(budget="256MiB", actions="recompute", min_tensor_bytes=64 * 1024)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.Dropout(0.1), nn.Tanh()) for _ in range(8)])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    history = []
    counts = []
    for _ in range(12):
        optimizer.zero_grad()
        loss = model(torch.randn(64, 256)).square().mean()
        loss.backward()
        optimizer.step()
        history.append(loss.detach())
        counts.append(alive())
    # One severed lineage per kept loss: what grows per step is that alone.
    assert counts[-1] - counts[1] <= 10, counts

"""What a user sees when things go wrong: a budget below the working set is a
torch.OutOfMemoryError with the numbers, a full host tier says so, and an
exception in the middle of forward leaks no handles and no memory."""
import gc
import re
import weakref

import pytest
import torch
from torch import nn

import membudget
from membudget._native import load_extension
from membudget.models import ResidualMLP

from training import entry_holders, ops_recorded

pytestmark = pytest.mark.requires_native

MiB = 1 << 20


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.ReLU()) for _ in range(8)])


def test_budget_below_working_set_raises_torch_oom_with_numbers():
    membudget.install(budget=2 * MiB, min_tensor_bytes=64 * 1024)
    with pytest.raises(torch.OutOfMemoryError) as info:
        model = _mlp()  # 8 x 1 MiB of weights: more than the whole budget
        model(torch.randn(256, 512)).sum().backward()
    message = str(info.value)
    assert "budget 2.00 MiB" in message
    for word in ("reserved", "allocated", "evictable", "MEMBUDGET_BUDGET"):
        assert word in message, message
    assert membudget.memory_stats()["num_ooms"] >= 1


def test_exception_mid_forward_leaves_no_handles_and_no_memory():
    membudget.install(budget=64 * MiB, min_tensor_bytes=64 * 1024)
    model = _mlp()
    x = torch.randn(256, 512)
    gc.collect()
    native = load_extension()
    before = membudget.memory_stats()["allocated_bytes.all.current"]
    handles_before = native.live_handles()

    class Boom(RuntimeError):
        pass

    def forward_that_fails():
        h = x
        for i, layer in enumerate(model):
            h = layer(h)
            if i == 5:
                assert native.live_handles() > handles_before  # activations were managed
                raise Boom("failure in the middle of forward")
        return h

    with pytest.raises(Boom):
        forward_that_fails()
    gc.collect()
    assert native.live_handles() == handles_before
    assert membudget.memory_stats()["allocated_bytes.all.current"] == before


class _CompiledThenEager(nn.Module):
    """A compiled block whose output eager code reads (the recorders hold
    such an output: no recorded op made it), then eager layers."""

    def __init__(self):
        super().__init__()
        self.block = ResidualMLP(256, 1024)  # (Dynamo compiles no nn.Sequential as a whole: torch's own frames are skipped)
        self.block.compile(backend="aot_eager")
        self.tail = nn.Sequential(nn.LayerNorm(256), nn.Tanh(), nn.Linear(256, 256))

    def forward(self, x):
        return self.tail(self.block(x))


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_step_that_raises_after_a_compiled_region_leaves_no_memory(lineage_recorder, where):
    # Note [Held without their graph]: the recorders held the compiled
    # block's output, and with it its grad_fn and the graph behind it. Once
    # the step raised, that graph was nobody else's, yet its saved
    # activations stayed live entries and the recorder never let go: a
    # per-block aot_eager model kept 28 MB of a 31 MB budget allocated after
    # every failed step, and retries ran out of memory.
    import torch._dynamo

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(_CompiledThenEager(), _CompiledThenEager())
    x = torch.randn(512, 256)
    # The block's 512 KiB output is below min_tensor_bytes: held as a tensor,
    # not through an entry (Note [Held inputs reached through their entry]).
    membudget.install(budget=256 * MiB, min_tensor_bytes=MiB, actions="both")

    class Boom(RuntimeError):
        pass

    outputs = []
    model[1].block.register_forward_hook(lambda m, i, out: outputs.append(weakref.ref(out)))
    failing = [False]

    def fail_in_forward(module, inputs, out):
        if failing[0] and where == "forward":
            raise Boom("failure in the middle of forward")

    model[1].tail[1].register_forward_hook(fail_in_forward)

    def fail_in_backward(grad):
        raise Boom("failure in backward")

    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step():
        h = model(x)
        if failing[0] and where == "backward":
            h.register_hook(fail_in_backward)
        h.square().mean().backward()
        optimizer.step()  # the recorder lets go of the step here (Note [Lineage released between steps])
        optimizer.zero_grad(set_to_none=True)

    step()
    step()  # compiled, and the lineage of the first step released
    gc.collect()
    native = load_extension()
    before = membudget.memory_stats()["allocated_bytes.all.current"]
    handles_before = native.live_handles()
    failing[0] = True
    outputs.clear()
    with pytest.raises(Boom):
        step()
    gc.collect()
    assert outputs and outputs[0]() is None  # the compiled block's output, and its graph, are gone
    assert native.live_handles() == handles_before
    # What the recorder holds of that forward (the blocks' outputs, without
    # their graph) goes when the next forward begins: the retry fits as the
    # first steps did and leaves what they left.
    failing[0] = False
    step()
    gc.collect()
    assert native.live_handles() == handles_before
    assert membudget.memory_stats()["allocated_bytes.all.current"] == before


class _Marker:
    pass


class _RaisesInBackward(torch.autograd.Function):
    """Identity whose backward raises, as an out-of-memory error in a node's
    backward (or in the recompute an unpack runs) does."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise torch.OutOfMemoryError("out of memory in backward")


class _Tagged(torch.autograd.Function):
    """Identity whose node carries a marker: the marker lives as long as the
    node does."""

    @staticmethod
    def forward(ctx, x, markers):
        ctx.marker = _Marker()
        markers.append(weakref.ref(ctx.marker))
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


@pytest.mark.parametrize("budget, actions", [(None, "swap"), (256 * MiB, "swap"), (256 * MiB, "both"),
                                             (256 * MiB, "recompute")])
def test_a_backward_that_raises_leaves_no_graph_queued(lineage_recorder, budget, actions):
    # Note [Backward tasks an error left queued] (_runtime.py): two branches
    # meet at the loss, so when one raises in backward the other's node is
    # already queued on this thread; torch's engine left it there, and with
    # it the whole graph and every saved activation, until this thread's
    # next backward. A GPT-2 run that ran out of memory in a recompute kept
    # its parameters and 2.9 MB past uninstall() so.
    torch.manual_seed(0)
    trunk, left, right = nn.Linear(256, 256), nn.Linear(256, 256), nn.Linear(256, 256)
    x = torch.randn(128, 256)
    membudget.install(budget=budget, actions=actions, min_tensor_bytes=4096)
    native = load_extension()
    markers = []

    def loss():
        hidden = _Tagged.apply(trunk(x).tanh(), markers)
        return left(hidden).tanh().sum() + _RaisesInBackward.apply(right(hidden).tanh()).sum()

    gc.collect()
    handles_before = native.live_handles()
    failing = loss()
    recorded = ops_recorded()
    with pytest.raises(torch.OutOfMemoryError, match="in backward"):
        failing.backward()
    # The drain's own leaf is not recorded: as the first op after backward
    # began, it began a forward (the retry's ops numbered from 1, its
    # out-of-memory flag taken; the review of session 37).
    assert ops_recorded() == recorded
    del failing
    gc.collect()
    assert markers and markers[0]() is None  # the failed graph is gone
    assert native.live_handles() == handles_before, entry_holders()  # and its saved activations with it
    left(trunk(x)).sum().backward()  # the next backward as usual
    assert left.weight.grad is not None
    membudget.uninstall()


def _scripted_blocks() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[torch.jit.script(nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Dropout(0.1)))
                           for _ in range(3)])


@pytest.mark.parametrize("actions", ["recompute", "both"])
def test_a_scripted_model_that_failed_in_backward_leaves_no_entry(lineage_recorder, actions):
    # Note [Held without their graph]: TorchScript's differentiable graphs
    # attach the autograd history after their ops ran, so inputs the
    # recorders held without a grad_fn had one by the end of the forward.
    # After a backward that raised (first seen as an out-of-memory error in
    # a recompute at half the model's peak; injected here), that input held
    # the graph, the graph its saved activations, and their entries' lineage
    # the input: 8 entries stayed alive after uninstall(), either recorder.
    model = _scripted_blocks()
    x = torch.randn(1024, 256)
    membudget.install(budget=64 * MiB, min_tensor_bytes=64 * 1024, actions=actions)
    native = load_extension()
    for _ in range(3):  # TorchScript's profiling runs, then its differentiable graphs
        model(x).square().mean().backward()
    gc.collect()
    assert not native.live_entry_ids()

    def out_of_memory(grad):
        raise torch.OutOfMemoryError("injected: out of memory in backward")

    failing = model(x)
    failing.register_hook(out_of_memory)
    assert native.live_entry_ids()
    with pytest.raises(torch.OutOfMemoryError, match="injected"):
        failing.square().mean().backward()
    del failing
    membudget.uninstall()
    gc.collect()
    assert not native.live_entry_ids(), entry_holders()
    assert not native.any_entry_saved_for_backward()


def test_retries_after_out_of_memory_do_not_pile_up_held_inputs(lineage_recorder):
    # Note [A forward that ran out of memory]: a forward began only once
    # backward had run, so a batch-size finder's retries were recorded as
    # one forward, and the recorder held every failed attempt's batch.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh())
    membudget.install(budget=64 * MiB, min_tensor_bytes=64 * 1024, actions="both")
    too_big = [True]

    def out_of_memory_while_too_big(module, inputs, out):
        if too_big[0]:
            torch.empty(128 * MiB, dtype=torch.uint8)  # a real out-of-memory error from the allocator

    model[2].register_forward_hook(out_of_memory_while_too_big)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def attempt(batch):
        x = torch.randn(batch, 256)  # a new batch each time, as a finder makes
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    too_big[0] = False
    attempt(512)
    gc.collect()
    before = membudget.memory_stats()["allocated_bytes.all.current"]
    too_big[0] = True
    held = []
    for batch in (4096, 2048, 1024):
        with pytest.raises(torch.OutOfMemoryError):
            attempt(batch)
        gc.collect()
        held.append(membudget.memory_stats()["allocated_bytes.all.current"] - before)
    # Each failed attempt leaves at most its own batch held until the next begins.
    assert held == sorted(held, reverse=True) and held[-1] <= 1024 * 256 * 4, held
    too_big[0] = False
    attempt(512)
    gc.collect()
    assert membudget.memory_stats()["allocated_bytes.all.current"] == before


def test_host_tier_full_is_named_in_the_error():
    # The device budget forces eviction, and the host tier cannot take it
    # (swap only: with recomputation allowed the director would drop instead).
    membudget.install(budget=24 * MiB, host_budget=1 * MiB, min_tensor_bytes=64 * 1024, actions="swap")
    model = _mlp()
    with pytest.raises(torch.OutOfMemoryError) as info:
        h = torch.randn(1024, 512)
        for _ in range(3):
            h = model(h)
        h.sum().backward()
    # Its 2 MiB entries are larger than the whole 1 MiB tier: said as such,
    # not as "host tier 0 B of 1.00 MiB; the host tier is full".
    assert "host tier cannot take what is left on the device: 1.00 MiB free, the smallest entry 2.00 MiB" \
        in str(info.value), str(info.value)
    assert "MEMBUDGET_HOST_BUDGET" in str(info.value)
    assert membudget.memory_stats()["host_tier_full"] > 0
    del model


def test_install_rejects_bad_arguments_clearly():
    with pytest.raises(membudget.ConfigError, match="budget"):
        membudget.install(budget="12 potatoes")
    with pytest.raises(membudget.ConfigError, match="policy"):
        membudget.install(budget="1GiB", policy="fifo")
    with pytest.raises(membudget.ConfigError, match="swap, recompute or both"):
        membudget.install(budget="1GiB", actions="drop")
    with pytest.raises(ValueError, match="needs recomputation"):
        membudget.install(budget="1GiB", actions="swap", plan=object())
    assert not membudget.is_installed()


def test_reinstall_reconfigures_budget_and_stats_report_it():
    membudget.install(budget="64MiB")
    assert membudget.memory_stats()["budget_bytes"] == 64 * MiB
    membudget.install(budget="32MiB")
    assert membudget.memory_stats()["budget_bytes"] == 32 * MiB
    text = str(membudget.stats())
    assert "budget 32 MiB" in text


def test_parameters_and_their_views_are_not_managed():
    # Linear saves its input (a leaf here) and weight.t(), a view of a
    # parameter: neither storage could ever be released, so neither is managed.
    native = load_extension()
    membudget.install(budget="1GiB", min_tensor_bytes=0)
    before = native.live_handles()
    layer = torch.nn.Linear(256, 256)
    x = torch.randn(64, 256, requires_grad=True)
    y = layer(x).sum()
    assert native.live_handles() == before
    h = torch.tanh(layer(x))          # a fresh activation is managed
    assert native.live_handles() > before
    (y + h.sum()).backward()


def test_expandable_segments_cannot_change_after_the_allocator_exists():
    import membudget

    membudget.install()
    try:
        assert membudget.memory_stats()["expandable_segments"] is True
        with pytest.raises(RuntimeError, match="expandable segments on; MEMBUDGET_EXPANDABLE_SEGMENTS cannot change"):
            membudget.install(expandable_segments=False)
    finally:
        membudget.uninstall()


def _gradient_penalty_step() -> None:
    """A step whose second backward reads a graph saved during the first
    (``create_graph=True``): no lineage is recorded in backward, so those
    saved tensors cannot be recomputed, only swapped."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.Tanh()) for _ in range(6)])
    loss = model(torch.randn(512, 512)).square().sum()
    grads = torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
    sum((g * g).sum() for g in grads).backward()


def test_oom_under_recompute_only_names_what_it_cannot_release():
    """An OOM while resident saved tensors could not be replayed must not read
    as membudget failing to evict them: the message says how many of the
    evictable bytes MEMBUDGET_ACTIONS=recompute cannot release, and allowing
    swap at the same budget runs."""
    budget = 32 * MiB
    membudget.install(budget=budget, actions="recompute", min_tensor_bytes=64 * 1024)
    with pytest.raises(torch.OutOfMemoryError) as info:
        _gradient_penalty_step()
    message = str(info.value)
    match = re.search(r"evictable (\S+ \S+) \(.*?; (\S+ \S+) of it not recomputable, which "
                      r"MEMBUDGET_ACTIONS=recompute cannot release: allow swap \[(.*?)\]\)", message)
    assert match, message
    assert match.group(2) != "0 B" and match.group(1) == match.group(2), message
    # Why (Note [Why not recomputable]): saved during backward, where nothing records.
    assert match.group(3) == f"{match.group(2)}: no lineage reached it (saved in backward, under no_grad, in a " \
                             "compiled region, on a thread that does not record, or written where nothing records)"
    del info
    membudget.uninstall()
    gc.collect()

    membudget.install(budget=budget, actions="both", min_tensor_bytes=64 * 1024)
    membudget.reset_peak_stats()
    _gradient_penalty_step()
    stats = membudget.memory_stats()
    assert stats["reserved_bytes.all.peak"] <= budget
    assert stats["swap_out_bytes"] > 0


def test_oom_under_recompute_only_tells_unrecomputable_bytes_apart_by_reason():
    """The reasons the recorders give with each entry they cannot replay
    (Note [Why not recomputable]) are summed by reason, largest first."""
    native = load_extension()
    membudget.install(budget=8 * MiB, actions="recompute", min_tensor_bytes=64 * 1024)
    try:
        handles = []
        for reason in ("reason A", "reason A", "reason B", ""):
            tensor = torch.ones(MiB // 4)  # 1 MiB, held by its handle alone
            handles.append(native.pack(tensor))
            del tensor
            native.set_recompute_info(handles[-1].entry_id, False, 0.0, [], reason)
        with pytest.raises(torch.OutOfMemoryError) as info:
            torch.empty(6 * MiB, dtype=torch.uint8)
        message = str(info.value)
        assert "4.00 MiB of it not recomputable" in message, message
        reasons = re.search(r"allow swap \[(.*?)\]\)", message).group(1).split("; ")
        assert reasons[0] == "2.00 MiB: reason A", message
        assert sorted(reasons[1:]) == ["1.00 MiB: no lineage reached it (saved in backward, under no_grad, in a "
                                       "compiled region, on a thread that does not record, or written where "
                                       "nothing records)", "1.00 MiB: reason B"], message
        del info, handles
    finally:
        membudget.uninstall()
    gc.collect()


def _out_of_memory_after_a_rescue(**install) -> str:
    """The out-of-memory message of a request for the whole budget after a
    weight is written under no_grad between forward and backward (a rescue
    of what reads it, under ``install``'s settings)."""
    membudget.install(budget=24 * MiB, min_tensor_bytes=64 * 1024, **install)
    try:
        torch.manual_seed(0)
        # The weight (1 MiB) is larger than a copy is kept for (Note [Held
        # inputs kept as a copy]): the write rescues what reads it.
        model = nn.Sequential(nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 512), nn.Sigmoid())
        loss = model(torch.randn(1024, 512)).square().mean()
        with torch.no_grad():
            model[0].weight.mul_(0.5)
        with pytest.raises(torch.OutOfMemoryError) as info:
            torch.empty(24 * MiB, dtype=torch.uint8)
        message = str(info.value)
        del info, loss, model
        return message
    finally:
        membudget.uninstall()
        gc.collect()


@pytest.mark.parametrize("lineage", ["python", "cxx"])
def test_oom_under_recompute_only_names_a_rescue_as_the_reason(lineage):
    """A weight written under no_grad between forward and backward makes
    what its replay would read swap-only (a rescue); the out-of-memory
    message that follows says so, under either recorder."""
    message = _out_of_memory_after_a_rescue(actions="recompute", lineage=lineage)
    assert "MiB: an input its replay reads was about to be written in place (rescued: made resident)" \
        in message, message


def test_oom_with_the_host_tier_full_names_what_cannot_be_recomputed():
    """With both actions allowed and the host tier too small, what is left
    on the device can only be dropped: the message says how much cannot
    be, and why (here a rescue, as above), beside the host tier's advice."""
    message = _out_of_memory_after_a_rescue(actions="both", host_budget=64 * 1024)
    assert "of it not recomputable, which only the host tier could take [" in message, message
    assert "MiB: an input its replay reads was about to be written in place (rescued: made resident)" \
        in message, message
    assert "MEMBUDGET_HOST_BUDGET" in message, message


@pytest.mark.parametrize("lineage", ["python", "cxx"])
def test_oom_under_recompute_only_names_the_obstacle_and_its_op(lineage):
    """A weight written under no_grad after a matmul read it, before
    anything saved was packed: what exp saves can be rebuilt only through
    that matmul, which would read the new weight. Both recorders name the
    obstacle and the op it was met at; the Python recorder named the op
    that made the saved tensor instead ("its lineage cannot be replayed at
    aten.exp.default")."""
    weight = torch.randn(256, 256, requires_grad=True)  # made before install(): a held input
    membudget.install(budget=8 * MiB, actions="recompute", lineage=lineage, min_tensor_bytes=64 * 1024)
    try:
        product = torch.randn(1024, 256) @ weight
        with torch.no_grad():
            weight.mul_(0.5)
        loss = product.exp().sum()
        del product
        with pytest.raises(torch.OutOfMemoryError) as info:
            torch.empty(8 * MiB, dtype=torch.uint8)
        reasons = re.search(r"allow swap \[(.*?)\]\)", str(info.value)).group(1)
        assert re.fullmatch(r"1\.00 MiB: an input its replay reads was changed in place after it was read "
                            r"at aten(::|\.)mm\.default", reasons), reasons
        del info, loss
    finally:
        membudget.uninstall()
    gc.collect()


@pytest.mark.parametrize("lineage", ["python", "cxx"])
def test_oom_under_recompute_only_names_a_split_storage_as_the_reason(lineage):
    """A CPU GRU cell splits its gates with unsafe_split and writes them in
    place: such storages are swap-only (Note [One history per storage]), and
    recompute-only runs out of memory saying so, with the op."""
    membudget.install(budget=6 * MiB, actions="recompute", lineage=lineage, min_tensor_bytes=16 * 1024)
    try:
        torch.manual_seed(0)
        cell = nn.GRUCell(128, 128)
        hidden = torch.zeros(256, 128)
        with pytest.raises(torch.OutOfMemoryError) as info:
            for _ in range(40):
                hidden = cell(torch.randn(256, 128), hidden)
            hidden.sum().backward()
        message = str(info.value)
        assert re.search(r"MiB: its storage has several histories \(outputs of unsafe_split or unsafe_chunk "
                         r"written in place\) at aten(::|\.)\w+", message), message
        del info, hidden, cell
    finally:
        membudget.uninstall()
    gc.collect()


@pytest.mark.parametrize("budget, actions", [(None, "swap"), (256 * MiB, "both"), (256 * MiB, "recompute")])
@pytest.mark.parametrize("size", [8, 512])  # unmanaged (below min_tensor_bytes) and managed
def test_a_saved_tensor_modified_in_place_raises_autograd_error(budget, actions, size):
    # Note [Saved versions checked]: autograd does not check versions through
    # saved-tensor hooks; membudget's unpack does, so this raises as in plain
    # PyTorch instead of returning twice the gradient.
    membudget.install(budget=budget, actions=actions, min_tensor_bytes=64 * 1024)
    try:
        w = torch.randn(size, size, requires_grad=True)
        y = (w * 1.0).exp()  # exp saves its output
        y.mul_(2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation.*is at version 1; expected version 0"):
            y.sum().backward()
        # Unmodified, the same graph shape trains.
        w.grad = None
        z = (w * 1.0).exp()
        z.sum().backward()
        assert torch.equal(w.grad, z.detach())
    finally:
        membudget.uninstall()


class _ReadsAVector(nn.Module):
    """Two branches from the input: the first's four layers add the vector
    ``v`` (their saved activations' replays read it), the second's six do
    not. ``write()`` writes ``v`` in place (with its values unchanged), in
    forward after both branches or between forward and backward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.reading = nn.ModuleList(nn.Linear(256, 256) for _ in range(4))
        self.other = nn.ModuleList(nn.Linear(256, 256) for _ in range(6))
        # As large as an activation: too large to be kept as a copy (Note
        # [Held inputs kept as a copy]), so the write rescues.
        self.register_buffer("v", torch.zeros(512, 256))
        self.write_in_forward = True

    def write(self):
        self.v.mul_(1.0)

    def forward(self, x):
        a = b = x
        for layer in self.reading:
            a = torch.tanh(layer(a) + self.v)
        for layer in self.other:
            b = torch.tanh(layer(b))
        if self.write_in_forward:
            self.write()
        return a + b


@pytest.mark.parametrize("where", ["in forward", "under no_grad before backward"])
def test_a_rescue_that_fails_loses_the_activation_with_its_reason(lineage_recorder, where, monkeypatch, capfd):
    """Note [A rescue that failed] (csrc/torch/lineage_replay.cpp): the
    dropped activations whose replay reads ``v`` are rebuilt before ``v`` is
    written, and that rebuild fails here (an out-of-memory, injected). The
    C++ recorder rescues in a RecordFunction callback, whose errors torch
    only printed while the write went ahead: now the activation is lost and
    its use raises the rebuild's error with the write that needed it. The
    Python recorder's rescue stops the op itself."""
    from membudget import _runtime

    failing = {"now": False}
    made = _runtime._recompute_callback

    def injecting(*args):
        recompute = made(*args)

        def rebuild(entry_id, ahead=False):
            if failing["now"]:
                raise torch.OutOfMemoryError("injected: no room to rebuild")
            return recompute(entry_id, ahead)
        return rebuild

    monkeypatch.setattr(_runtime, "_recompute_callback", injecting)
    model = _ReadsAVector()  # before install: v is an input no recorded op made
    model.write_in_forward = where == "in forward"
    model.write = lambda write=model.write: (failing.update(now=True), write(), failing.update(now=False))
    membudget.install(budget=4 * MiB, actions="recompute", policy="lru", min_tensor_bytes=0, recompute_ahead=False)
    try:
        with pytest.raises(torch.OutOfMemoryError) as info:
            loss = model(torch.randn(512, 256)).square().mean()
            if where != "in forward":
                with torch.no_grad():
                    model.write()
            loss.backward()
        message = str(info.value)
        assert membudget.memory_stats()["drop_count"] > 0, message
        if lineage_recorder == "cxx":
            assert "is lost: it had to be rebuilt because an input its replay reads was about to be written in place" \
                in message and "by aten::mul_" in message and "injected: no room to rebuild" in message, message
        else:
            assert "injected" in message, message
        del info
    finally:
        failing["now"] = False
        membudget.uninstall()
    gc.collect()
    assert "Exception in RecordFunction callback" not in capfd.readouterr().err


def test_a_forward_that_raises_after_rrelu_keeps_no_noise(lineage_recorder):
    # Note [Packed before its first write] (lineage.py): RReLU's noise is
    # packed before rrelu_with_noise fills it, and the Python recorder
    # declares it once that op has returned. The first version held the
    # noise tensor until then, so a forward that raised in between (a
    # forward hook's NaN check) left it allocated: 64 KiB here (the review
    # of session 37). The noise's replay is checked in test_recompute_cases.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.RReLU(), nn.Linear(256, 256))
    x = torch.randn(64, 256)
    membudget.install(budget=256 * MiB, actions="both", min_tensor_bytes=0)
    failing = [False]

    def check(module, inputs, out):
        if failing[0]:
            raise ValueError("a NaN check")

    model[1].register_forward_hook(check)
    model(x).sum().backward()  # what a step leaves allocated (gradients)
    gc.collect()
    failing[0] = True
    before = membudget.memory_stats()["allocated_bytes.all.current"]
    with pytest.raises(ValueError, match="NaN check"):
        model(x).sum().backward()
    gc.collect()
    left = membudget.memory_stats()["allocated_bytes.all.current"] - before
    assert left < 64 * 256 * 4, left  # less than the noise
    failing[0] = False
    model(x).sum().backward()
    membudget.uninstall()


def test_parameters_swap_while_a_forward_is_held_python_recorder(python_lineage):
    # Note [Held without their graph]: the Python recorder holds a parameter
    # it copied strongly, with no weak reference, which
    # torch.utils.swap_tensors refuses: module.to() under
    # swap_module_params_on_conversion works after a forward whose inputs
    # are still held. The C++ recorder's weak reference to the parameter's
    # TensorImpl is refused too; that is open.
    model = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256))
    membudget.install(budget=64 * MiB, min_tensor_bytes=4096, actions="recompute")
    model(torch.randn(512, 256)).square().mean()  # forward only: its inputs stay held
    swapping = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.double()
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swapping)
        membudget.uninstall()
    assert all(p.dtype == torch.float64 for p in model.parameters())

"""What the lineage recorders hold, and for how long (Note [Lineage released
between steps] in python/membudget/lineage.py): once a training step's
backward has run and its optimizer steps, nothing recorded can be replayed,
so nothing of that step may stay alive because of them; and a tensor made
before that point and read by a later forward is an input like any other,
with exact gradients."""
import gc

import pytest
import torch
from torch import nn

import membudget
from membudget._native import load_extension
from membudget.models import ResidualMLP

from training import assert_identical, run_managed, run_plain

pytestmark = [pytest.mark.requires_native, pytest.mark.usefixtures("lineage_recorder")]

MiB = 1 << 20


def _left_by_earlier_tests() -> int:
    """Bytes allocated through membudget before the test began, which it
    cannot free: torch's own state made while an earlier test was installed
    (a transformers GPT-2 compiled whole under membudget leaves 3 KiB per run,
    with or without a budget; not traced)."""
    gc.collect()
    return load_extension().memory_stats()["allocated_bytes.all.current"]


def _sixteen_mib_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(1024, 1024), nn.Tanh()) for _ in range(4)])


def _train_keeping_losses(model: nn.Module, micro_batches: int = 1, kept_before_step: bool = False) -> list:
    """Three Adam steps that keep each detached loss, as GPU loops do (no
    .item(): no device sync); returns them."""
    optimizer = torch.optim.Adam(model.parameters())
    history = []
    for _ in range(3):
        optimizer.zero_grad()
        for _ in range(micro_batches):
            loss = model(torch.randn(256, 1024)).square().mean()
            loss.backward()
            if kept_before_step:
                history.append(loss.detach())
        optimizer.step()
        if not kept_before_step:
            history.append(loss.detach())
    return history


def test_deleting_the_model_after_training_frees_its_memory():
    """The detached loss a loop keeps shares the loss's storage, whose
    recorded lineage reached every parameter. The model's 16 MiB of
    parameters stayed allocated after ``del model`` until the next forward or
    uninstall()."""
    membudget.install(budget="256MiB", actions="both", min_tensor_bytes=64 * 1024)
    model = _sixteen_mib_mlp()
    history = _train_keeping_losses(model)
    assert membudget.memory_stats()["allocated_bytes.all.current"] > 16 * MiB
    del model
    gc.collect()
    assert membudget.memory_stats()["allocated_bytes.all.current"] < MiB
    assert len(history) == 3


def test_compiled_outputs_held_through_their_entries_are_let_go_at_the_step():
    """Eager code reads each compiled block's output, a managed entry the
    recorders hold through the entry (Note [Held inputs reached through their
    entry]). Those entries counted as live, so the release at the optimizer
    step never came: 4 entries and 2 MB stayed between steps (Note [Entries
    only lineage holds])."""
    import torch._dynamo

    torch._dynamo.reset()
    membudget.install(budget="256MiB", actions="both", min_tensor_bytes=64 * 1024)
    earlier = _left_by_earlier_tests()
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        block = ResidualMLP(256, 1024)
        block.compile(backend="aot_eager")
        layers += [block, nn.LayerNorm(256), nn.Tanh()]
    model = nn.Sequential(*layers)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    native = load_extension()
    parameter_bytes = sum(p.untyped_storage().nbytes() for p in model.parameters())
    for _ in range(3):
        model(torch.randn(512, 256)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        gc.collect()
        assert native.live_handles() == 0
        # Between steps only the parameters are left (plain SGD keeps no state).
        assert membudget.memory_stats()["allocated_bytes.all.current"] - earlier == parameter_bytes


class _ScaledOnce(nn.Module):
    """Builds a scale tensor in its first forward (a recorded op, grad on)
    and multiplies by it in every forward after: a storage made before a
    step's release, read and saved (by the multiply) in later steps."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(256, 256) for _ in range(3))
        self.scale = None

    def forward(self, x):
        if self.scale is None:
            self.scale = torch.full((128, 256), 0.5).add(x.detach()[:128] * 0)
        for layer in self.layers:
            x = torch.tanh(layer(x)) * self.scale
        return x


def _step(model, optimizer, managed: bool) -> float:
    optimizer.zero_grad()
    loss = model(torch.randn(128, 256)).square().sum()
    if managed:
        load_extension().evict_all()  # every recomputable activation dropped, rebuilt in backward
    loss.backward()
    optimizer.step()
    return loss.item()


def test_tensor_made_before_a_step_is_read_as_an_input_after_it():
    reference = run_plain(_ScaledOnce, None, None, 3, step_fn=lambda m, o: _step(m, o, managed=False))
    managed = run_managed(_ScaledOnce, None, None, 3, budget="256MiB", actions="recompute",
                          min_tensor_bytes=64 * 1024, step_fn=lambda m, o: _step(m, o, managed=True))
    assert_identical(reference, managed)
    assert managed.stats["recompute_count"] > 0


def test_recording_a_gru_keeps_no_step_memory_alive(lineage_recorder):
    # A CPU GRU cell's gates share one storage under several version
    # counters (Note [One history per storage]). The C++ recorder held what
    # it could not match as inputs, keeping the GRU's input projection alive
    # for the whole step: 1.1 MiB above the peak without lineage.
    def build():
        return nn.Sequential(nn.GRU(64, 128, batch_first=True))

    def loss(model, inputs):
        return model(inputs[0])[0].square().mean()

    def batch():
        return (torch.randn(16, 48, 64),)

    def peak(actions):
        run = run_managed(build, batch, loss, 2, budget=1 << 30, actions=actions, min_tensor_bytes=1 << 30)
        return max(step["allocated_bytes.all.peak"] for step in run.per_step)

    # Nothing is managed (min_tensor_bytes), nothing evicted: the peaks can
    # differ only by what lineage keeps alive.
    assert peak("both") - peak("swap") < 64 * 1024


def test_a_step_that_raised_leaves_nothing_allocated_after_uninstall():
    """A step that raises after its forward (out of memory in backward, a bad
    batch) never reaches the optimizer step that lets lineage go of what it
    held. The recompute callback kept the Python recorder's lineage, and so
    the model, alive after uninstall(): the next run in the process started
    with its memory allocated."""
    membudget.install(budget="256MiB", actions="recompute", min_tensor_bytes=0)
    earlier = _left_by_earlier_tests()
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 512))
        loss = model(torch.randn(64, 512)).square().mean()
        assert membudget.memory_stats()["allocated_bytes.all.current"] > MiB
        del model, loss  # as an exception unwinding the step would
    finally:
        membudget.uninstall()
    gc.collect()
    # Memory membudget handed out is still accounted after uninstall().
    assert load_extension().memory_stats()["allocated_bytes.all.current"] == earlier




class _BackwardFailed(Exception):
    pass


def _raise_in_backward(grad):
    raise _BackwardFailed("as an out-of-memory error in backward would")


def test_uninstall_inside_the_except_of_a_failed_backward_lets_go_once_the_graph_goes():
    """Note [Lineage let go once nothing is saved]: uninstall() in the
    `except` of a step whose backward raised runs while the exception's frames
    still hold the loss, its graph and the handles it saved, which may yet ask
    for a replay; what the recorders held for them (the model's parameters,
    the dropout RNG states) stayed allocated after the model was deleted,
    until the next install(). It goes once the graph does."""
    torch.manual_seed(0)
    membudget.install(budget="256MiB", actions="recompute", min_tensor_bytes=0)
    earlier = _left_by_earlier_tests()
    model = nn.Sequential(nn.Linear(512, 512), nn.Dropout(0.1), nn.Tanh(), nn.Linear(512, 512))

    def step():
        hidden = model[:3](torch.randn(64, 512))
        hidden.register_hook(_raise_in_backward)  # after the last layer's backward
        loss = model[3](hidden).square().mean()
        loss.backward()

    try:
        step()
    except _BackwardFailed:
        assert load_extension().any_entry_saved_for_backward(), "the graph must still be alive here"
        membudget.uninstall()
    del model
    # The first collection frees the exception's frames (in a cycle with
    # them), and their graph's last handle queues the release; the release
    # runs at the loop's next turn and leaves the Python recorder's lineage
    # to the second.
    for _ in range(2):
        gc.collect()
    assert not load_extension().any_entry_saved_for_backward()
    # Memory membudget handed out is still accounted after uninstall().
    assert load_extension().memory_stats()["allocated_bytes.all.current"] == earlier


@pytest.mark.parametrize("micro_batches", [1, 2], ids=["one-batch-a-step", "accumulated"])
def test_ops_between_backward_and_the_step_do_not_keep_the_model(lineage_recorder, micro_batches):
    """An op recorded between backward() and the step (the loop's
    ``loss.detach()``, kept in its history, or the next micro-batch's
    forward) began a forward that packed nothing, and the release at the
    step waited for a backward that never came: ``del model`` left all
    16 MiB allocated, under both recorders (Note [Lineage released between
    steps])."""
    membudget.install(budget="256MiB", actions="both", min_tensor_bytes=64 * 1024)
    model = _sixteen_mib_mlp()
    history = _train_keeping_losses(model, micro_batches, kept_before_step=True)
    assert membudget.memory_stats()["allocated_bytes.all.current"] > 16 * MiB
    del model
    gc.collect()
    assert membudget.memory_stats()["allocated_bytes.all.current"] < MiB
    assert len(history) == 3 * micro_batches


def test_a_loop_without_an_optimizer_lets_go_as_the_next_forward_begins(lineage_recorder):
    """Note [Released as a forward begins] (lineage.py): the release at the
    optimizer step needs a torch.optim step. A loop that updates its
    parameters by hand kept, through each kept loss, its forward's graph and
    inputs: ``del model`` left all 16 MiB allocated even after another
    model's forward. A forward that begins with no entry saved for backward
    releases the same."""
    membudget.install(budget="256MiB", actions="both", min_tensor_bytes=64 * 1024)
    earlier = _left_by_earlier_tests()
    model = _sixteen_mib_mlp()
    history = []
    for _ in range(3):
        loss = model(torch.randn(256, 1024)).square().mean()
        loss.backward()
        with torch.no_grad():
            for parameter in model.parameters():
                parameter -= 0.01 * parameter.grad
                parameter.grad = None
        history.append(loss.detach())
    del model, loss
    small = nn.Linear(64, 64)
    small(torch.randn(8, 64)).sum().backward()
    gc.collect()
    assert membudget.memory_stats()["allocated_bytes.all.current"] - earlier < 64 * 1024
    assert len(history) == 3

"""Gradient checkpointing under a budget (Note [Checkpoint regions under a
budget] in python/membudget/_checkpoint_regions.py): a model with
transformers' gradient checkpointing on must train under half its own peak,
bit for bit as the plain checkpointed run, where keeping torch's checkpoint
runs out of memory; and only the regions membudget can stand in for are
replaced, only while a budget is set."""
import contextlib
import threading

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint

import membudget

from models import gpt2
from membudget._native import load_extension
from training import assert_identical, run_managed, run_plain

pytestmark = pytest.mark.requires_native

STEPS = 3
MIN_TENSOR_BYTES = 16 * 1024
TORCH_GENERATOR = torch_checkpoint._checkpoint_without_reentrant_generator


def _checkpointed_gpt2(**checkpoint_kwargs):
    work = gpt2()

    def build():
        model = work.build()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False,
                                                                           **checkpoint_kwargs})
        return model

    return work, build


@pytest.mark.usefixtures("lineage_recorder")
@pytest.mark.parametrize("selective", [False, True], ids=["whole_blocks", "selective"])
def test_checkpointed_model_trains_under_half_its_peak(selective):
    # selective: transformers hands context_fn to torch.utils.checkpoint, a
    # policy keeping matrix products (Note [Selective checkpoints as a plan]).
    work, build = _checkpointed_gpt2(**({"context_fn": _save_matmuls} if selective else {}))
    reference = run_plain(build, work.batch, work.loss, STEPS)
    unbudgeted = run_managed(build, work.batch, work.loss, STEPS, budget=None, min_tensor_bytes=MIN_TENSOR_BYTES)
    budget = unbudgeted.stats["reserved_bytes.all.peak"] // 2

    # What the checkpoint holds in its own frame cannot be evicted.
    with pytest.raises(torch.OutOfMemoryError, match="evictable"):
        try:
            run_managed(build, work.batch, work.loss, STEPS, budget=budget, min_tensor_bytes=MIN_TENSOR_BYTES,
                        checkpoint="keep")
        finally:
            membudget.uninstall()

    managed = run_managed(build, work.batch, work.loss, STEPS, budget=budget, min_tensor_bytes=MIN_TENSOR_BYTES)
    assert_identical(reference, managed)
    assert managed.stats["reserved_bytes.all.peak"] <= budget
    assert managed.stats["swap_out_bytes"] > 0 or managed.stats["recompute_count"] > 0
    assert managed.stats["planned_drops"] > 0 if selective else managed.stats["planned_drops"] == 0
    assert torch_checkpoint._checkpoint_without_reentrant_generator is TORCH_GENERATOR


def test_regions_are_replaced_only_while_a_budget_is_set():
    def replaced():
        return torch_checkpoint._checkpoint_without_reentrant_generator is not TORCH_GENERATOR

    try:
        membudget.install(budget=None)
        assert not replaced()  # without a budget the checkpoint is the only thing saving memory
        membudget.install(budget="1GiB")
        assert replaced()
        membudget.install(budget="1GiB", checkpoint="keep")
        assert not replaced()
        membudget.install(budget="1GiB")
        assert replaced()
    finally:
        membudget.uninstall()
    assert not replaced()


def test_bad_checkpoint_mode_is_refused():
    with pytest.raises(membudget.ConfigError, match="MEMBUDGET_CHECKPOINT='later'.*replace or keep"):
        membudget.Config.from_env({"MEMBUDGET_CHECKPOINT": "later"})


class _CountedRegion(torch.nn.Module):
    """A checkpointed region that counts how often its forward runs: once
    when it runs as plain code, twice when the checkpoint replays it."""

    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256))
        self.runs = 0

    def body(self, x):
        self.runs += 1
        return self.inner(x)


def _region_runs(**checkpoint_args) -> int:
    torch.manual_seed(0)
    region = _CountedRegion()
    x = torch.randn(64, 256, requires_grad=True)
    torch_checkpoint.checkpoint(region.body, x, **checkpoint_args).square().sum().backward()
    assert x.grad is not None and region.inner[0].weight.grad is not None
    return region.runs


def _selective_context():
    return contextlib.nullcontext(), contextlib.nullcontext()


def _matmuls_saved(ctx, op, *args, **kwargs):
    """A selective checkpointing policy: keep matrix products, recompute the rest."""
    keep = op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)
    return torch_checkpoint.CheckpointPolicy.MUST_SAVE if keep else torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE


def _save_matmuls():
    return torch_checkpoint.create_selective_checkpoint_contexts(_matmuls_saved)


def test_only_default_non_reentrant_regions_on_the_install_thread_run_plain():
    membudget.install(budget="1GiB", min_tensor_bytes=0)
    try:
        assert _region_runs(use_reentrant=False) == 1
        # Selective checkpointing's context: its policy becomes a plan.
        assert _region_runs(use_reentrant=False, context_fn=_save_matmuls) == 1
        # Any other custom context_fn sets up what we cannot read.
        assert _region_runs(use_reentrant=False, context_fn=_selective_context) == 2
        assert _region_runs(use_reentrant=True) == 2
        # Another thread has none of membudget's hooks: its regions stay checkpoints.
        runs = []
        thread = threading.Thread(target=lambda: runs.append(_region_runs(use_reentrant=False)))
        thread.start()
        thread.join()
        assert runs == [2]
    finally:
        membudget.uninstall()
    assert _region_runs(use_reentrant=False) == 2


class _NormedRegion(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64), torch.nn.Dropout(0.5))

    def forward(self, x):
        return self.inner(x)


def _checkpointed_step(managed, **checkpoint_args):
    if managed:
        membudget.install(budget="1GiB", min_tensor_bytes=0)
    try:
        torch.manual_seed(0)
        region = _NormedRegion()
        x = torch.randn(32, 64, requires_grad=True)
        torch_checkpoint.checkpoint(region, x, use_reentrant=False, **checkpoint_args).square().sum().backward()
        state = {name: value.clone() for name, value in region.state_dict().items()}
        state.update({name + ".grad": p.grad.clone() for name, p in region.named_parameters()})
        state["rng"] = torch.get_rng_state()
        return state
    finally:
        if managed:
            membudget.uninstall()


@pytest.mark.parametrize("preserve_rng_state", [True, False])
def test_regions_whose_rerun_differs_stay_torchs(preserve_rng_state):
    # The region updates batch norm's running statistics (again when
    # re-run: num_batches_tracked counts 2), and without preserve_rng_state
    # its re-run draws other dropout masks: run once, both differed.
    plain = _checkpointed_step(False, preserve_rng_state=preserve_rng_state)
    managed = _checkpointed_step(True, preserve_rng_state=preserve_rng_state)
    assert plain["inner.1.num_batches_tracked"].item() == 2
    for name in plain:
        assert torch.equal(plain[name], managed[name]), name


class _SelectivelyCheckpointed(torch.nn.Module):
    """Blocks under selective activation checkpointing that keeps matrix
    products; activations outweigh parameters."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(256, 64), torch.nn.Tanh()) for _ in range(4))

    def forward(self, x):
        for block in self.blocks:
            x = x + torch_checkpoint.checkpoint(block, x, use_reentrant=False, context_fn=_save_matmuls)
        return x


def _selective_batch():
    return (torch.randn(2048, 64),)


def _selective_loss(model, inputs):
    return model(inputs[0]).square().mean()


@pytest.mark.usefixtures("lineage_recorder")
def test_selective_checkpoints_train_under_a_budget_their_own_regions_could_not_meet():
    # Note [Selective checkpoints as a plan] (_checkpoint_regions.py): kept
    # as torch's, what the policy saves and the region's frame holds cannot
    # be evicted; run as plain code under the policy as a plan, the same
    # model trains in 60% of the selective checkpoint's own peak, bit for bit.
    build = _SelectivelyCheckpointed
    reference = run_plain(build, _selective_batch, _selective_loss, STEPS)
    unbudgeted = run_managed(build, _selective_batch, _selective_loss, STEPS, budget=None, min_tensor_bytes=0)
    budget = int(unbudgeted.stats["reserved_bytes.all.peak"] * 0.6)
    with pytest.raises(torch.OutOfMemoryError, match="evictable"):
        try:
            run_managed(build, _selective_batch, _selective_loss, STEPS, budget=budget, min_tensor_bytes=0,
                        checkpoint="keep")
        finally:
            membudget.uninstall()
    for actions in ("both", "recompute"):
        managed = run_managed(build, _selective_batch, _selective_loss, STEPS, budget=budget, min_tensor_bytes=0,
                              actions=actions)
        assert_identical(reference, managed)
        assert managed.stats["reserved_bytes.all.peak"] <= budget
        assert managed.stats["planned_drops"] > 0 and managed.stats["recompute_count"] > 0


@pytest.mark.usefixtures("lineage_recorder")
def test_a_selective_policy_decides_what_is_dropped_under_a_roomy_budget():
    # What the policy would recompute and nothing else holds is dropped as
    # the region returns, with no pack after it; what it keeps stays.
    membudget.install(budget="1GiB", min_tensor_bytes=0, actions="both")
    try:
        native = load_extension()
        torch.manual_seed(0)
        block = _SelectivelyCheckpointed().blocks[0]
        x = torch.randn(2048, 64)
        before = membudget.memory_stats()["planned_drops"]
        out = torch_checkpoint.checkpoint(block, x, use_reentrant=False, context_fn=_save_matmuls)
        loss = out.square().mean()  # a pack after the region: planned drops happen at packs
        dropped = sorted(e["bytes"] for e in native.entries() if e["state"] == "dropped")
        resident = sorted(e["bytes"] for e in native.entries() if e["state"] == "resident")
        planned = membudget.memory_stats()["planned_drops"] - before
        loss.backward()
    finally:
        membudget.uninstall()
    hidden = 2048 * 256 * 4
    # GELU's output and the dropout's are dropped; addmm's output (GELU's
    # saved input) stays, as do the input and the region's output, alive.
    assert planned == 2 and dropped == [hidden, hidden], (planned, dropped, resident)
    assert resident.count(hidden) == 1, resident


def test_a_selective_policy_keeps_products_an_aliasing_op_returns():
    # A linear layer without bias on a 3-D input runs mm and then
    # _unsafe_view, which returns mm's storage without declaring an alias:
    # asked about _unsafe_view, the policy says recompute, yet the storage
    # is mm's, which it keeps. Planned, GELU's saved input (that storage)
    # was dropped and replayed each step.
    membudget.install(budget="1GiB", min_tensor_bytes=0, actions="both")
    try:
        native = load_extension()
        torch.manual_seed(0)
        block = torch.nn.Sequential(torch.nn.Linear(64, 256, bias=False), torch.nn.GELU(), torch.nn.Linear(256, 64))
        x = torch.randn(8, 256, 64)
        out = torch_checkpoint.checkpoint(block, x, use_reentrant=False, context_fn=_save_matmuls)
        loss = out.square().mean()
        # GELU's saved input (mm's storage) and its output (the second linear's input).
        states = sorted(e["state"] for e in native.entries() if e["bytes"] == 8 * 256 * 256 * 4)
        loss.backward()
    finally:
        membudget.uninstall()
    assert states == ["dropped", "resident"], states


class _NestedRegion(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Dropout(0.1),
                                         torch.nn.Linear(256, 64))

    def forward(self, x):
        return x + torch_checkpoint.checkpoint(self.inner, x, use_reentrant=False, context_fn=_save_matmuls)


class _NestedSelective(torch.nn.Module):
    """Selective checkpoint regions inside selective checkpoint regions."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), _NestedRegion(), _NestedRegion())
            for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = x + torch_checkpoint.checkpoint(block, x, use_reentrant=False, context_fn=_save_matmuls)
        return x


@pytest.mark.usefixtures("lineage_recorder")
@pytest.mark.parametrize("actions", ["both", "recompute"])
def test_nested_selective_checkpoints_train_exactly_under_half_their_peak(actions):
    # An inner region plans, as it returns, what the outer one remembered so
    # far too (Note [Selective checkpoints as a plan]).
    reference = run_plain(_NestedSelective, _selective_batch, _selective_loss, STEPS)
    unbudgeted = run_managed(_NestedSelective, _selective_batch, _selective_loss, STEPS, budget=None,
                             min_tensor_bytes=0)
    budget = unbudgeted.stats["reserved_bytes.all.peak"] // 2
    managed = run_managed(_NestedSelective, _selective_batch, _selective_loss, STEPS, budget=budget,
                          min_tensor_bytes=0, actions=actions)
    assert_identical(reference, managed)
    assert managed.stats["reserved_bytes.all.peak"] <= budget
    assert managed.stats["planned_drops"] > 0 and managed.stats["recompute_count"] > 0

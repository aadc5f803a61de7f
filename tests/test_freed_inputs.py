"""Held inputs whose storage is freed under the runtime, as FSDP2 does it, in
one process (tests/test_distributed.py runs FSDP2 itself over two ranks).

Each block frees its weights' storage after its forward
(``untyped_storage().resize_(0)``), leaves NaN where they were, and gathers
them back before its backward (resize, then a ``copy_`` under
``_unsafe_preserve_version_counter``): no version counter moves, as under
FSDP2. A replay that read a freed weight, or the freed memory before the
gather filled it, would fail or give NaN. The manager drops no activation
whose replay would read a freed storage (Note [Held inputs freed under us]
in csrc/core/residency_entry.h) and rebuilds none first when the gather
writes one (Note [Writes that refill a freed input])."""
import pytest
import torch
import torch.nn as nn

import membudget
from training import assert_identical, run_managed, run_plain

pytestmark = pytest.mark.requires_native

WIDTH, BATCH, BLOCKS, STEPS = 256, 1024, 6, 3
MIN_TENSOR_BYTES = 16 * 1024


class FreeingBlock(nn.Module):
    """A residual MLP block that frees its weights after its forward and
    gathers them back for its backward, as FSDP2's fully_shard does."""

    keeps_shard = False  # whether the copy gathered from stays (FSDP2 keeps each rank's shard)

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)
        self.drop = nn.Dropout(0.1)
        self.gathered = {}

    def weights(self):
        return [self.up.weight, self.down.weight]

    def forward(self, x):
        y = x + self.drop(self.down(nn.functional.gelu(self.up(x))))
        if torch.is_grad_enabled():
            for weight in self.weights():
                self.gathered[weight] = weight.detach().clone()
                weight.untyped_storage().resize_(0)
            # What a freed block's memory holds next: anything.
            litter = [torch.full((weight.numel(),), float("nan")) for weight in self.weights()]
            del litter
            y.register_hook(self.gather)
        return y

    def gather(self, grad):
        for weight in self.weights():
            weight.untyped_storage().resize_(weight.numel() * weight.element_size())
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(weight):
                weight.copy_(self.gathered[weight] if self.keeps_shard else self.gathered.pop(weight))
        return grad


class ShardKeepingBlock(FreeingBlock):
    """FSDP2 on one rank: the shard gathered from (here the whole weight)
    stays allocated beside the gathered weight."""

    keeps_shard = True


def build(block=FreeingBlock):
    torch.manual_seed(0)
    return nn.Sequential(*[block() for _ in range(BLOCKS)], nn.Linear(WIDTH, 1))


def build_keeping_shards():
    return build(ShardKeepingBlock)


def batch():
    return torch.randn(BATCH, WIDTH)


def loss(model, x):
    return model(x).sum()


def _reference_and_peak(builder):
    """Plain PyTorch's run of `builder`'s model, and its unbudgeted peak under membudget."""
    reference = run_plain(builder, batch, loss, STEPS)
    unbudgeted = run_managed(builder, batch, loss, STEPS, budget=None, min_tensor_bytes=MIN_TENSOR_BYTES)
    return reference, unbudgeted.stats["reserved_bytes.all.peak"]


@pytest.fixture(scope="module")
def reference_and_peak():
    return _reference_and_peak(build)


@pytest.mark.parametrize("lineage", ["python", "cxx"])
@pytest.mark.parametrize("actions, fraction, host_tier", [("recompute", 0.75, None), ("both", 0.7, 4 << 20)])
def test_blocks_that_free_their_weights_train_exactly(reference_and_peak, lineage, actions, fraction, host_tier):
    reference, peak = reference_and_peak
    budget = int(peak * fraction)
    managed = run_managed(build, batch, loss, STEPS, budget=budget, actions=actions, lineage=lineage,
                          min_tensor_bytes=MIN_TENSOR_BYTES, **({"host_budget": host_tier} if host_tier else {}))
    assert_identical(reference, managed)
    assert managed.stats["recompute_count"] > 0
    assert managed.stats["reserved_bytes.all.peak"] <= budget
    if actions == "both":
        assert managed.stats["swap_out_bytes"] > 0


@pytest.mark.parametrize("lineage", ["python", "cxx"])
def test_recompute_alone_names_the_freed_inputs_when_it_cannot_fit(reference_and_peak, lineage):
    # At 60% recomputing alone needs to drop what finished blocks saved, whose
    # replays read freed weights: an out-of-memory error that says so, not a
    # replay of a freed weight in backward.
    _, peak = reference_and_peak
    with pytest.raises(torch.OutOfMemoryError, match="has no storage now"):
        try:
            run_managed(build, batch, loss, STEPS, budget=int(peak * 0.6), actions="recompute", lineage=lineage,
                        min_tensor_bytes=MIN_TENSOR_BYTES)
        finally:
            if membudget.is_installed():
                membudget.uninstall()


@pytest.fixture(scope="module")
def shard_keeping_reference_and_peak():
    return _reference_and_peak(build_keeping_shards)


@pytest.mark.parametrize("lineage", ["python", "cxx"])
def test_resident_activations_stay_droppable_when_the_gather_refills_their_weights(
        shard_keeping_reference_and_peak, lineage):
    """Note [Writes that refill a freed input] for resident entries: the
    gather's write made every resident activation reading the block's weights
    (directly, or through a resident input that reads them) swap-only under
    the C++ recorder, which sees the write (the Python recorder does not):
    20 MiB that recompute-only could not drop, an out-of-memory error at 70%
    and 68% of the peak before. Now the write is taken as the refill it is."""
    reference, peak = shard_keeping_reference_and_peak
    budget = int(peak * 0.68)
    managed = run_managed(build_keeping_shards, batch, loss, STEPS, budget=budget, actions="recompute",
                          lineage=lineage, min_tensor_bytes=MIN_TENSOR_BYTES)
    assert_identical(reference, managed)
    assert managed.stats["recompute_count"] > 0
    assert managed.stats["reserved_bytes.all.peak"] <= budget

"""Models that reach autograd through more than plain modules: full backward
hooks on blocks (torch wraps each block's inputs and outputs in a
BackwardHookFunction), a hook on an activation that rescales its gradient,
weight-normed layers (parametrizations recompute the weight in every
forward), multi-head attention with a causal mask and its weights returned,
one block applied six times, two forwards alive with the second's backward
first, a custom Function that writes its input in place (``mark_dirty``),
an LSTM over packed sequences, and blocks under the reentrant
``torch.utils.checkpoint``. Under a budget that forces eviction each trains
as plain PyTorch does, bit for bit, within the budget, under each lineage
recorder. Where the model leaves nothing to replay (the reentrant
checkpoint rebuilds its blocks inside backward, where nothing records),
recompute-only says so in its out-of-memory error. None of these was
covered before session 38's probe, which found them all exact."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from training import assert_budget_kept, assert_identical, run_managed, run_plain

pytestmark = [pytest.mark.requires_native, pytest.mark.usefixtures("lineage_recorder")]

STEPS = 3
MIN_TENSOR_BYTES = 4096
ROWS, WIDTH = 2048, 256


def _mlp_block(activation: nn.Module) -> nn.Sequential:
    return nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), activation, nn.Dropout(0.1), nn.Linear(2 * WIDTH, WIDTH))


class BlocksWithBackwardHooks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(_mlp_block(nn.GELU()) for _ in range(4))
        for block in self.blocks:
            block.register_full_backward_hook(lambda module, grad_input, grad_output: None)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


class RescaledGradient(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x):
        hidden = F.silu(self.a(x))
        hidden.register_hook(lambda grad: grad * 0.5)
        return self.c(F.silu(self.b(hidden)))


class WeightNormed(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.utils.parametrizations.weight_norm(nn.Linear(WIDTH, WIDTH)) for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x)) + x
        return x


class CausalAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = nn.ModuleList(nn.MultiheadAttention(64, 4, dropout=0.1, batch_first=True) for _ in range(3))
        self.norms = nn.ModuleList(nn.LayerNorm(64) for _ in range(3))

    def forward(self, x):
        x = x[:256].reshape(16, 64, 64)
        mask = torch.triu(torch.ones(64, 64, dtype=torch.bool), 1)
        for attention, norm in zip(self.attention, self.norms):
            normed = norm(x)
            out, weights = attention(normed, normed, normed, attn_mask=mask, need_weights=True)
            x = x + out + weights.mean()
        return x


class ReentrantCheckpoint(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(_mlp_block(nn.ReLU()) for _ in range(4))

    def forward(self, x):
        for block in self.blocks:
            x = x + checkpoint(block, x, use_reentrant=True)
        return x


class SharedBlock(nn.Module):
    """One block applied six times (ALBERT-like): one parameter set read by
    every replay of every use."""

    def __init__(self):
        super().__init__()
        self.block = _mlp_block(nn.GELU())
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, x):
        for _ in range(6):
            x = self.norm(x + self.block(x))
        return x


class _ScaleInPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.mark_dirty(x)
        ctx.save_for_backward(scale)
        return x.mul_(scale)

    @staticmethod
    def backward(ctx, grad):
        (scale,) = ctx.saved_tensors
        return grad * scale, None


class DirtiedByAFunction(nn.Module):
    """A custom Function that writes its input in place (``mark_dirty``)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x):
        hidden = F.gelu(self.a(x))
        scale = torch.sigmoid(hidden.detach().mean(0))
        return self.b(F.silu(_ScaleInPlace.apply(hidden * 1.0, scale)))


class PackedLSTM(nn.Module):
    """An LSTM over packed, variable-length sequences."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(64, 64)
        self.lstm = nn.LSTM(64, 128, num_layers=2, batch_first=True, dropout=0.1)

    def forward(self, x):
        x = self.proj(x[:, :64].reshape(32, 64, 64))
        lengths = torch.arange(64, 0, -2)
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True)
        out, _ = self.lstm(packed)
        return nn.utils.rnn.pad_packed_sequence(out, batch_first=True)[0]


def _batch():
    # The reentrant checkpoint computes no gradient unless an input needs one.
    return (torch.randn(ROWS, WIDTH).requires_grad_(),)


def _loss(model, inputs):
    return model(inputs[0]).square().mean()


def _two_graphs_backward_in_reverse(model, optimizer) -> float:
    """Two forwards alive at once; the second's backward runs first."""
    optimizer.zero_grad(set_to_none=True)
    first = model(_batch()[0]).square().mean()
    second = model(_batch()[0]).abs().mean()
    second.backward()
    first.backward()
    optimizer.step()
    return first.item() + second.item()


# name: (model, share of the unbudgeted peak, actions, step or None). The
# attention, weight-norm and shared-block models' peaks are mostly
# activations; the others keep more that no eviction releases (gradients of
# large intermediates in backward). The LSTM's gates are swap-only (their
# storage has several histories), so recompute-only is not asked of it; a
# Function's in-place output was too, until Note [Marked dirty by a
# Function] (csrc/torch/lineage_recorder.cpp).
# Each share lies at least 0.1 above one that fitted alone: the Function's
# model at 0.6 (0.05 above its last fit) ran out of memory in the full
# suite, where its unbudgeted peak came out 29.0 MiB against 30.9 alone.
CASES = {
    "full_backward_hooks": (BlocksWithBackwardHooks, 0.6, ("recompute", "both"), None),
    "rescaled_gradient": (RescaledGradient, 0.7, ("recompute", "both"), None),
    "weight_norm": (WeightNormed, 0.6, ("recompute", "both"), None),
    "causal_attention": (CausalAttention, 0.5, ("recompute", "both"), None),
    "shared_block": (SharedBlock, 0.6, ("recompute", "both"), None),
    "two_graphs_in_reverse": (RescaledGradient, 0.6, ("recompute", "both"), _two_graphs_backward_in_reverse),
    "dirtied_by_a_function": (DirtiedByAFunction, 0.75, ("recompute", "both"), None),
    "packed_lstm": (PackedLSTM, 0.6, ("both",), None),
    "reentrant_checkpoint": (ReentrantCheckpoint, 0.8, ("swap", "both"), None),
}


def _budget(build, share: float, step=None) -> int:
    unbudgeted = run_managed(build, _batch, _loss, STEPS, budget=None, step_fn=step,
                             min_tensor_bytes=MIN_TENSOR_BYTES)
    return int(unbudgeted.stats["reserved_bytes.all.peak"] * share)


@pytest.mark.parametrize("case, actions", [(name, actions) for name, case in CASES.items() for actions in case[2]])
def test_hooked_and_parametrized_models_train_exactly_under_a_budget(case, actions):
    build, share, _, step = CASES[case]
    reference = run_plain(build, _batch, _loss, STEPS, step_fn=step)
    budget = _budget(build, share, step)
    managed = run_managed(build, _batch, _loss, STEPS, budget=budget, step_fn=step,
                          min_tensor_bytes=MIN_TENSOR_BYTES, actions=actions)
    assert_identical(reference, managed)
    stats = managed.stats
    assert_budget_kept(stats, budget, actions)
    if actions == "swap":
        assert stats["swap_out_count"] > 0 and stats["recompute_count"] == 0
    elif actions == "both":
        assert stats["recompute_count"] + stats["swap_out_count"] > 0


def test_reentrant_checkpoint_recompute_only_says_what_it_cannot_replay():
    # What the checkpoint saves is made inside its Function's forward under
    # no_grad and rebuilt inside backward: no lineage reaches it, and at 60%
    # of the peak recompute-only cannot release it (it fitted at 80%; at 70%
    # it ran out of memory so too). conftest's membudget_clean_state
    # uninstalls what the failed run left installed.
    build = CASES["reentrant_checkpoint"][0]
    budget = _budget(build, 0.6)
    with pytest.raises(torch.OutOfMemoryError, match="not recomputable.*no lineage reached it"):
        run_managed(build, _batch, _loss, STEPS, budget=budget, min_tensor_bytes=MIN_TENSOR_BYTES,
                    actions="recompute")

"""Built-in models for the demo and the benchmarks: nothing to download.

Where this sits in the flow: nothing in the runtime uses this module. It gives
``membudget demo`` (:mod:`membudget.demo`) and ``bench/`` two small training
workloads whose memory is dominated by saved activations, the case membudget is
for: a GPT-style decoder transformer and a ResNet-style CNN. Each comes as a
:class:`Workload`: a model builder, a seeded batch maker and a loss, so that
the same steps can be run plain and under a budget and compared bit for bit.
The sizes keep a training step well under a second on two CPU cores.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Tuple

import torch
from torch import nn
from torch.nn import functional as F

__all__ = [
    "Workload",
    "CausalSelfAttention",
    "DecoderBlock",
    "GPT",
    "ResidualBlock",
    "ResidualMLP",
    "ResNet",
    "gpt",
    "cnn",
    "WORKLOADS",
]


@dataclass
class Workload:
    """One training workload: ``build()`` makes the model (on the CPU; the
    caller moves it), ``batch(device)`` draws the next batch from torch's global
    generator (on the CPU first, so a seeded run sees the same data on every
    device) and ``loss(model, batch)`` returns the scalar to backpropagate."""

    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[torch.device], Tuple[torch.Tensor, ...]]
    loss: Callable[[nn.Module, Tuple[torch.Tensor, ...]], torch.Tensor]


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through ``F.scaled_dot_product_attention``,
    with attention dropout while training and a residual-path dropout."""

    def __init__(self, width: int, heads: int, dropout: float):
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not divisible by heads {heads}")
        self.heads = heads
        self.dropout = dropout
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attend over ``x`` of shape (batch, time, width), each position to
        itself and the positions before it."""
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                           is_causal=True)
        return self.resid_dropout(self.proj(y.transpose(1, 2).reshape(b, t, c)))


class DecoderBlock(nn.Module):
    """A pre-norm transformer block: LayerNorm, causal self-attention, residual;
    LayerNorm, MLP (4x wide, GELU, dropout), residual."""

    def __init__(self, width: int, heads: int, dropout: float):
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads, dropout)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width),
                                 nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block to ``x`` of shape (batch, time, width)."""
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """A GPT-style decoder-only language model in plain torch: token and
    position embeddings with dropout, ``layers`` :class:`DecoderBlock` s, a final
    LayerNorm and a linear LM head over the vocabulary."""

    def __init__(self, vocab: int, width: int, heads: int, layers: int, context: int, dropout: float = 0.1):
        super().__init__()
        self.context = context
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(context, width)
        self.embed_dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(DecoderBlock(width, heads, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Return next-token logits of shape (batch, time, vocab) for token ids
        ``idx`` of shape (batch, time), time at most ``context``."""
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.embed_dropout(self.tokens(idx) + self.positions(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class ResidualBlock(nn.Module):
    """A ResNet basic block: two 3x3 conv-BatchNorm stages with ReLU and an
    identity shortcut, or a strided 1x1 conv-BatchNorm shortcut when the
    block changes resolution or width."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                                          nn.BatchNorm2d(out_channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block to ``x`` of shape (batch, channels, height, width)."""
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + self.shortcut(x))


class ResidualMLP(nn.Module):
    """``x + Linear(GELU(Linear(x)))``, widening ``width`` to ``hidden`` and
    back: the unit the benchmarks and tests compile per block, with eager
    code between the blocks reading their outputs."""

    def __init__(self, width: int = 256, hidden: int = 1024):
        super().__init__()
        self.a = nn.Linear(width, hidden)
        self.b = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block to ``x`` of shape (..., width)."""
        return x + self.b(F.gelu(self.a(x)))


class ResNet(nn.Module):
    """A small ResNet-style classifier: a 3x3 conv-BN-ReLU stem, one stage of
    ``blocks_per_stage`` :class:`ResidualBlock` s per entry of ``widths`` (each
    stage after the first halves the resolution), global average pooling and a
    linear classifier."""

    def __init__(self, widths: Tuple[int, ...] = (32, 64, 128), blocks_per_stage: int = 2, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, padding=1, bias=False), nn.BatchNorm2d(widths[0]),
                                  nn.ReLU())
        stages = []
        in_channels = widths[0]
        for index, width in enumerate(widths):
            for block in range(blocks_per_stage):
                stride = 2 if index > 0 and block == 0 else 1
                stages.append(ResidualBlock(in_channels, width, stride))
                in_channels = width
        self.stages = nn.Sequential(*stages)
        self.classifier = nn.Linear(in_channels, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Return class logits of shape (batch, classes) for ``images`` of
        shape (batch, 3, height, width)."""
        x = self.stages(self.stem(images))
        return self.classifier(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def gpt(batch: int = 8, context: int = 256, width: int = 128, heads: int = 4, layers: int = 4,
        vocab: int = 1024, dropout: float = 0.1) -> Workload:
    """The GPT workload: next-token prediction (cross-entropy) on random token
    sequences of ``context + 1`` tokens. The defaults keep about 5 MiB of
    parameters (20 MiB with gradients and Adam state) against well over 100 MiB
    of saved activations."""

    def make_batch(device: torch.device) -> Tuple[torch.Tensor, ...]:
        return (torch.randint(0, vocab, (batch, context + 1)).to(device),)

    def loss(model: nn.Module, data: Tuple[torch.Tensor, ...]) -> torch.Tensor:
        tokens = data[0]
        logits = model(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))

    return Workload("gpt", lambda: GPT(vocab, width, heads, layers, context, dropout), make_batch, loss)


def cnn(batch: int = 16, image_size: int = 32, widths: Tuple[int, ...] = (32, 64, 128), blocks_per_stage: int = 2,
        classes: int = 10) -> Workload:
    """The CNN workload: :class:`ResNet` classifying random images
    (standard normal pixels) into random labels with cross-entropy. The
    defaults keep about 3 MiB of parameters against tens of MiB of saved
    activations."""

    def make_batch(device: torch.device) -> Tuple[torch.Tensor, ...]:
        images = torch.randn(batch, 3, image_size, image_size)
        labels = torch.randint(0, classes, (batch,))
        return images.to(device), labels.to(device)

    def loss(model: nn.Module, data: Tuple[torch.Tensor, ...]) -> torch.Tensor:
        images, labels = data
        return F.cross_entropy(model(images), labels)

    return Workload("cnn", lambda: ResNet(widths, blocks_per_stage, classes), make_batch, loss)


def _quick_gpt() -> Workload:
    return gpt(batch=4, context=128, width=64, heads=4, layers=2, vocab=512)


def _quick_cnn() -> Workload:
    return cnn(batch=16, image_size=32, widths=(16, 32), blocks_per_stage=1)


#: Workloads by name and size: ``WORKLOADS[name]["default" | "quick"]()``.
#: ``quick`` is a tiny version (a step in milliseconds) for tests.
WORKLOADS: Dict[str, Dict[str, Callable[[], Workload]]] = {
    "gpt": {"default": gpt, "quick": _quick_gpt},
    "cnn": {"default": cnn, "quick": _quick_cnn},
}

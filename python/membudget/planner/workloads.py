"""Small training workloads for the planner's tests and ``bench/bench_planner.py``.

Where this sits in the flow: nothing in the planner uses this module. It gives
four models on which Echo-style planning is judged: GPT-2 and BERT from
transformers (small configs, no weights downloaded), a ResNet
(:class:`membudget.models.ResNet`) and Echo's O-shaped case, an LSTM
encoder-decoder with attention, whose encoder states stay alive across the
whole decoder. Each is a :class:`PlannerWorkload`: a builder, a seeded batch
and a loss function ``loss(model, batch)`` written so that dynamo can compile
it. Dropout is off so that compiled and eager runs are comparable.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Tuple

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["PlannerWorkload", "Seq2SeqAttention", "WORKLOADS", "workload"]


@dataclass
class PlannerWorkload:
    """``build()`` the model, ``batch()`` a seeded batch, ``loss(model, batch)``."""

    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[], Tuple[torch.Tensor, ...]]
    loss: Callable[[nn.Module, Tuple[torch.Tensor, ...]], torch.Tensor]


class Seq2SeqAttention(nn.Module):
    """An LSTM encoder-decoder with Luong (dot) attention, unrolled over
    ``nn.LSTMCell`` so that dynamo captures it as one graph: the encoder
    states are read by every decoder step (Echo's O-shaped memory)."""

    def __init__(self, vocab: int = 256, hidden: int = 96):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.encoder = nn.LSTMCell(hidden, hidden)
        self.decoder = nn.LSTMCell(2 * hidden, hidden)
        self.combine = nn.Linear(2 * hidden, hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Logits (batch, target_len, vocab) for teacher-forced ``target``."""
        b = source.shape[0]
        h = source.new_zeros((b, self.encoder.hidden_size), dtype=torch.float32)
        c = torch.zeros_like(h)
        src = self.embed(source)
        states = []
        for t in range(source.shape[1]):
            h, c = self.encoder(src[:, t], (h, c))
            states.append(h)
        memory = torch.stack(states, dim=1)  # (b, s, h)
        tgt = self.embed(target)
        context = torch.zeros_like(h)
        outputs = []
        for t in range(target.shape[1]):
            h, c = self.decoder(torch.cat([tgt[:, t], context], dim=1), (h, c))
            scores = torch.bmm(memory, h.unsqueeze(2)).squeeze(2)  # (b, s)
            weights = torch.softmax(scores, dim=1)
            context = torch.bmm(weights.unsqueeze(1), memory).squeeze(1)
            outputs.append(torch.tanh(self.combine(torch.cat([h, context], dim=1))))
        return self.head(torch.stack(outputs, dim=1))


def _tokens(vocab: int, *shape: int) -> Callable[[], Tuple[torch.Tensor, ...]]:
    return lambda: (torch.randint(0, vocab, shape),)


def gpt2(batch: int = 8, seq: int = 128, layers: int = 2, width: int = 64) -> PlannerWorkload:
    """transformers' GPT2LMHeadModel, causal LM loss."""
    def build():
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(vocab_size=256, n_positions=seq, n_embd=width, n_layer=layers, n_head=4,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, loss_type="ForCausalLM",
                            bos_token_id=0, eos_token_id=0)
        return GPT2LMHeadModel(config)

    return PlannerWorkload("gpt2", build, _tokens(256, batch, seq),
                           lambda model, b: model(input_ids=b[0], labels=b[0]).loss)


def bert(batch: int = 8, seq: int = 128, layers: int = 2, width: int = 64) -> PlannerWorkload:
    """transformers' BertForMaskedLM, MLM loss on every token."""
    def build():
        from transformers import BertConfig, BertForMaskedLM

        config = BertConfig(vocab_size=256, hidden_size=width, num_hidden_layers=layers, num_attention_heads=4,
                            intermediate_size=4 * width, max_position_embeddings=seq, hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=0.0, loss_type="ForMaskedLM")
        return BertForMaskedLM(config)

    return PlannerWorkload("bert", build, _tokens(256, batch, seq),
                           lambda model, b: model(input_ids=b[0], labels=b[0]).loss)


def resnet(batch: int = 16, image: int = 32, widths: Tuple[int, ...] = (16, 32, 64)) -> PlannerWorkload:
    """:class:`membudget.models.ResNet`, cross-entropy on random labels."""
    from ..models import ResNet

    def make_batch():
        return torch.randn(batch, 3, image, image), torch.randint(0, 10, (batch,))

    return PlannerWorkload("resnet", lambda: ResNet(widths, 1, 10), make_batch,
                           lambda model, b: F.cross_entropy(model(b[0]), b[1]))


def seq2seq(batch: int = 32, source_len: int = 16, target_len: int = 16, hidden: int = 128) -> PlannerWorkload:
    """:class:`Seq2SeqAttention`, next-token cross-entropy."""
    vocab = 256

    def make_batch():
        return torch.randint(0, vocab, (batch, source_len)), torch.randint(0, vocab, (batch, target_len + 1))

    def loss(model, b):
        logits = model(b[0], b[1][:, :-1])
        return F.cross_entropy(logits.reshape(-1, vocab), b[1][:, 1:].reshape(-1))

    return PlannerWorkload("seq2seq", lambda: Seq2SeqAttention(vocab, hidden), make_batch, loss)


#: Workloads by name: ``WORKLOADS[name]()`` builds the default size.
WORKLOADS: Dict[str, Callable[[], PlannerWorkload]] = {
    "gpt2": gpt2, "bert": bert, "resnet": resnet, "seq2seq": seq2seq,
}


def workload(name: str, **sizes) -> PlannerWorkload:
    """The workload called ``name`` with optional size overrides."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown planner workload {name!r}: known are {', '.join(WORKLOADS)}")
    return WORKLOADS[name](**sizes)

"""Models nobody here wrote (transformers GPT-2, BERT, Llama, T5, ViT,
Mixtral, Mamba and DeBERTa-v2 from small configs, no weights downloaded) and
an nn.LSTM language model, each with a seeded batch maker and a loss
function, sized so that activations dominate memory."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn


@dataclass
class Workload:
    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[], tuple]
    loss: Callable[[nn.Module, tuple], torch.Tensor]


def _token_batch(vocab: int, batch: int, seq: int) -> Callable[[], tuple]:
    return lambda: (torch.randint(0, vocab, (batch, seq)),)


def _language_model(name: str, build: Callable[[], nn.Module], batch: int, seq: int) -> Workload:
    """A transformers model trained on its own random tokens (vocabulary 256)
    as labels: the loss its head computes."""
    return Workload(name, build, _token_batch(256, batch, seq),
                    lambda model, b: model(input_ids=b[0], labels=b[0]).loss)


def gpt2(batch: int = 8, seq: int = 128, layers: int = 2, dropout: float = 0.1) -> Workload:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=256, n_positions=seq, n_embd=64, n_layer=layers, n_head=4,
                        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
    return _language_model("gpt2", lambda: GPT2LMHeadModel(config), batch, seq)


def bert(batch: int = 8, seq: int = 128, layers: int = 2, dropout: float = 0.1) -> Workload:
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(vocab_size=256, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                        intermediate_size=256, max_position_embeddings=seq,
                        hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    return _language_model("bert", lambda: BertForMaskedLM(config), batch, seq)


class LstmLanguageModel(nn.Module):
    """Embedding, a stacked nn.LSTM and a vocabulary projection."""

    def __init__(self, vocab: int = 512, hidden: int = 128, layers: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.lstm = nn.LSTM(hidden, hidden, num_layers=layers, batch_first=True, dropout=0.1)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.lstm(self.embed(tokens))
        return self.head(hidden)


def lstm(batch: int = 16, seq: int = 64) -> Workload:
    vocab = 512

    def loss(model, b):
        logits = model(b[0][:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, vocab), b[0][:, 1:].reshape(-1))

    return Workload("lstm", lambda: LstmLanguageModel(vocab), _token_batch(vocab, batch, seq), loss)


def llama(batch: int = 8, seq: int = 128, layers: int = 2, dropout: float = 0.1) -> Workload:
    """A decoder as current LLMs build it: rotary positions, grouped-query
    attention (2 key/value heads for 4 query heads), RMSNorm, a SiLU-gated MLP."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=256, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq,
                         attention_dropout=dropout)
    return _language_model("llama", lambda: LlamaForCausalLM(config), batch, seq)


def t5(batch: int = 8, seq: int = 128, layers: int = 2, dropout: float = 0.1) -> Workload:
    """An encoder-decoder: relative position bias, cross-attention, and
    activations the decoder reads from the encoder."""
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=256, d_model=64, d_kv=16, d_ff=256, num_layers=layers, num_heads=4,
                      dropout_rate=dropout, decoder_start_token_id=0)
    return _language_model("t5", lambda: T5ForConditionalGeneration(config), batch, seq)


def mixtral(batch: int = 8, seq: int = 128, layers: int = 2, dropout: float = 0.1) -> Workload:
    """A sparse mixture of experts: top-2 of 4 experts per token, rows picked
    by the router (index_add_ of the experts' outputs), and the router's
    auxiliary loss."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=seq, attention_dropout=dropout, output_router_logits=True)
    return _language_model("mixtral", lambda: MixtralForCausalLM(config), batch, seq)


def mamba(batch: int = 8, seq: int = 128, layers: int = 2) -> Workload:
    """A state-space model on transformers' reference path (no fused
    kernels here): a causal depthwise convolution, then a selective scan
    that loops over the sequence, one small step per token."""
    from transformers import MambaConfig, MambaForCausalLM

    config = MambaConfig(vocab_size=256, hidden_size=64, state_size=8, num_hidden_layers=layers, expand=2)
    return _language_model("mamba", lambda: MambaForCausalLM(config), batch, seq)


def deberta(batch: int = 8, seq: int = 128, layers: int = 2, dropout: float = 0.1) -> Workload:
    """DeBERTa-v2: disentangled attention (content-to-position and
    position-to-content scores gathered from relative positions)."""
    from transformers import DebertaV2Config, DebertaV2ForMaskedLM

    config = DebertaV2Config(vocab_size=256, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                             intermediate_size=256, max_position_embeddings=seq, relative_attention=True,
                             pos_att_type=["p2c", "c2p"], hidden_dropout_prob=dropout,
                             attention_probs_dropout_prob=dropout)
    return _language_model("deberta", lambda: DebertaV2ForMaskedLM(config), batch, seq)


def vit(batch: int = 16, image: int = 64, layers: int = 2, dropout: float = 0.1) -> Workload:
    """A vision transformer: a convolutional patch embedding, then attention."""
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(image_size=image, patch_size=8, hidden_size=64, num_hidden_layers=layers,
                       num_attention_heads=4, intermediate_size=256, num_labels=10,
                       hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    return Workload(
        "vit",
        lambda: ViTForImageClassification(config),
        lambda: (torch.randn(batch, 3, image, image), torch.randint(0, 10, (batch,))),
        lambda model, b: model(pixel_values=b[0], labels=b[1]).loss,
    )

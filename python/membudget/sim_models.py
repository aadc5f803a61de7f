"""Models the simulator's command line can trace by name, at any size.

Where this sits in the flow: ``membudget simulate --model NAME`` (and
``bench/bench_simulate.py``) build one of these under ``FakeTensorMode`` and
record a trace with :func:`membudget.trace`; nothing is downloaded and no
weight is materialised. Transformer configurations are the published ones
(GPT-2 small, BERT base, Llama-2-7B); ResNet-50 is the torchvision layout
written out here (torchvision is not a dependency); ``lstm-nmt`` is a GNMT-style
encoder-decoder (4+4 LSTM layers of 1024, an 8k joint BPE vocabulary).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Tuple

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["SimModel", "SIM_MODELS", "build_step", "trace_model"]


@dataclass(frozen=True)
class SimModel:
    """A traceable model: ``setup(batch, seq, dtype)`` returns the state
    ``step(state)`` trains on (forward, loss, backward). ``seq`` is the
    sequence length, or the image size for images."""

    name: str
    default_batch: int
    default_seq: int
    default_dtype: torch.dtype
    setup: Callable[[int, int, torch.dtype], Any]
    step: Callable[[Any], None]


def _with_dtype(dtype: torch.dtype, build: Callable[[], nn.Module]) -> nn.Module:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = build()
    finally:
        torch.set_default_dtype(previous)
    model.train()
    return model


def _lm_setup(config_fn: Callable[[], Any], model_cls_name: str, vocab: int):
    def setup(batch: int, seq: int, dtype: torch.dtype):
        import transformers

        config = config_fn()
        config._attn_implementation = "sdpa"
        model = _with_dtype(dtype, lambda: getattr(transformers, model_cls_name)(config))
        return model, torch.randint(0, vocab, (batch, seq))
    return setup


def _lm_step(state) -> None:
    model, ids = state
    model(input_ids=ids, labels=ids).loss.backward()


def _gpt2_config():
    from transformers import GPT2Config

    return GPT2Config(n_positions=2048)


def _bert_config():
    from transformers import BertConfig

    return BertConfig(max_position_embeddings=2048)


def _llama7b_config():
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096)


class Bottleneck(nn.Module):
    """ResNet-50's bottleneck: 1x1 reduce, 3x3 (strided), 1x1 expand (x4),
    BatchNorm after each, ReLU, projection shortcut when the shape changes."""

    def __init__(self, inplanes: int, planes: int, stride: int):
        super().__init__()
        width, out = planes, planes * 4
        self.conv1, self.bn1 = nn.Conv2d(inplanes, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width)
        self.conv3, self.bn3 = nn.Conv2d(width, out, 1, bias=False), nn.BatchNorm2d(out)
        self.down = (nn.Sequential(nn.Conv2d(inplanes, out, 1, stride, bias=False), nn.BatchNorm2d(out))
                     if stride != 1 or inplanes != out else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block to ``x`` (batch, channels, height, width)."""
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        return F.relu(self.bn3(self.conv3(y)) + self.down(x))


class ResNet50(nn.Module):
    """torchvision's resnet50 layout: 7x7 stem, max pool, 3-4-6-3 bottlenecks
    of 64-128-256-512 planes, average pool, 1000-way classifier."""

    def __init__(self, classes: int = 1000):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        blocks, inplanes = [], 64
        for planes, count, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            for i in range(count):
                blocks.append(Bottleneck(inplanes, planes, stride if i == 0 else 1))
                inplanes = planes * 4
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(inplanes, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Class logits for ``images`` (batch, 3, height, width)."""
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.blocks(self.stem(images)), 1), 1))


class LstmNmt(nn.Module):
    """A GNMT-style translation model: embeddings, a 4-layer LSTM encoder and a
    4-layer LSTM decoder (1024 wide) started from the encoder's state, with
    dot-product attention over the encoder outputs and a vocabulary head."""

    def __init__(self, vocab: int = 8000, width: int = 1024, layers: int = 4):
        super().__init__()
        self.embed_src, self.embed_tgt = nn.Embedding(vocab, width), nn.Embedding(vocab, width)
        self.encoder = nn.LSTM(width, width, layers, batch_first=True)
        self.decoder = nn.LSTM(width, width, layers, batch_first=True)
        self.head = nn.Linear(2 * width, vocab)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        """Next-token logits (batch, tgt_len, vocab)."""
        memory, state = self.encoder(self.embed_src(src))
        out, _ = self.decoder(self.embed_tgt(tgt), state)
        context = torch.softmax(out @ memory.transpose(1, 2), dim=-1) @ memory
        return self.head(torch.cat([out, context], dim=-1))


def _resnet_setup(batch: int, seq: int, dtype: torch.dtype):
    model = _with_dtype(dtype, ResNet50)
    return model, torch.randn(batch, 3, seq, seq, dtype=dtype), torch.randint(0, 1000, (batch,))


def _resnet_step(state) -> None:
    model, images, labels = state
    F.cross_entropy(model(images), labels).backward()


def _lstm_setup(batch: int, seq: int, dtype: torch.dtype):
    model = _with_dtype(dtype, LstmNmt)
    return model, torch.randint(0, 8000, (batch, seq)), torch.randint(0, 8000, (batch, seq + 1))


def _lstm_step(state) -> None:
    model, src, tgt = state
    logits = model(src, tgt[:, :-1])
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt[:, 1:].reshape(-1)).backward()


SIM_MODELS: Dict[str, SimModel] = {
    "gpt2": SimModel("gpt2", 8, 1024, torch.float32, _lm_setup(_gpt2_config, "GPT2LMHeadModel", 50257), _lm_step),
    "bert": SimModel("bert", 32, 512, torch.float32, _lm_setup(_bert_config, "BertForMaskedLM", 30522), _lm_step),
    "resnet50": SimModel("resnet50", 64, 224, torch.float32, _resnet_setup, _resnet_step),
    "llama-7b": SimModel("llama-7b", 8, 4096, torch.bfloat16,
                         _lm_setup(_llama7b_config, "LlamaForCausalLM", 32000), _lm_step),
    "lstm-nmt": SimModel("lstm-nmt", 64, 100, torch.float32, _lstm_setup, _lstm_step),
}


def build_step(name: str, batch: int, seq: int, dtype: torch.dtype) -> Tuple[Callable[[], Any], Callable]:
    """(setup, step) for :func:`membudget.trace` of model ``name`` at this
    batch, sequence length (image size) and dtype."""
    model = SIM_MODELS[name]
    return (lambda: model.setup(batch, seq, dtype)), model.step


def trace_model(name: str, batch: int = None, seq: int = None, dtype: torch.dtype = None, fake: bool = True):
    """Trace one training step of model ``name`` (defaults: its batch,
    sequence and dtype); fake tensors unless ``fake=False``."""
    from .tracer import trace

    if name not in SIM_MODELS:
        raise ValueError(f"unknown model {name!r}: known are {', '.join(SIM_MODELS)}")
    model = SIM_MODELS[name]
    batch, seq, dtype = batch or model.default_batch, seq or model.default_seq, dtype or model.default_dtype
    setup, step = build_step(name, batch, seq, dtype)
    return trace(step, fake=fake, setup=setup, warmup=0 if fake else 1,
                 metadata={"model": name, "batch": batch, "seq": seq, "dtype": str(dtype).replace("torch.", "")})

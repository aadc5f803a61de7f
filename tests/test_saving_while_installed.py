"""Checkpoints and copies made while membudget records lineage: the tensors a
training loop saves (the model's state dict, the optimizer's, the loss, an
activation) or deep-copies (an EMA model) carry nothing of membudget's, so
they save, load with ``weights_only=True`` in a process that never imported
membudget, and copy, exactly as under plain PyTorch (Note [Lineage beside the
tensor] in lineage.py: the Python recorder once kept each tensor's lineage in
its ``__dict__``, which ``torch.save`` and ``copy.deepcopy`` carry along)."""
import copy
import io
import pickle

import pytest
import torch
from torch import nn

import membudget

pytestmark = pytest.mark.requires_native


def _mlp_with_batch_norm() -> nn.Module:
    return nn.Sequential(nn.Linear(256, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Dropout(0.1),
                         nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 8))


def _state_after_two_steps():
    """Two Adam steps under a budget that records lineage (both actions
    allowed); returns the model, optimizer, last loss and an activation."""
    torch.manual_seed(0)
    model = _mlp_with_batch_norm()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(2):
        optimizer.zero_grad(set_to_none=True)
        hidden = model[:3](torch.randn(64, 256))
        loss = model[3:](hidden).square().mean()
        loss.backward()
        optimizer.step()
    return model, optimizer, loss, hidden


def test_a_checkpoint_saved_while_installed_loads_anywhere(lineage_recorder):
    membudget.install(budget=256 << 20, actions="both", min_tensor_bytes=1024)
    model, optimizer, loss, hidden = _state_after_two_steps()
    checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                  "loss": loss.detach(), "activation": hidden.detach()}
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    data = buffer.getvalue()
    # Nothing of membudget's in the file: it loads where membudget is not.
    assert b"membudget" not in data
    loaded = torch.load(io.BytesIO(data), weights_only=True)
    for name, value in checkpoint["model"].items():
        assert torch.equal(loaded["model"][name], value), name
    assert torch.equal(loaded["loss"], checkpoint["loss"])
    assert torch.equal(loaded["activation"], checkpoint["activation"])
    assert loaded["optimizer"]["state"].keys() == checkpoint["optimizer"]["state"].keys()
    # Tensors made by recorded ops pickle as plain tensors too.
    restored = pickle.loads(pickle.dumps(hidden.detach() * 2))
    assert torch.equal(restored, hidden.detach() * 2)
    assert not restored.__dict__ and not hidden.__dict__ and not loss.__dict__


def test_a_deep_copy_made_while_installed_is_a_plain_copy(lineage_recorder):
    membudget.install(budget=256 << 20, actions="both", min_tensor_bytes=1024)
    model, _, _, hidden = _state_after_two_steps()
    ema = copy.deepcopy(model)
    for (name, original), (_, copied) in zip(model.state_dict().items(), ema.state_dict().items()):
        assert torch.equal(original, copied) and copied.data_ptr() != original.data_ptr(), name
        assert not copied.__dict__, name
    activation = copy.deepcopy(hidden.detach())
    assert torch.equal(activation, hidden) and not activation.__dict__

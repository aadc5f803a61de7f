"""The residency manager under several threads: two training loops run at the
same time on their own threads (saved-tensor hooks are per thread, so each
pushes membudget's hooks), sharing one budget that forces eviction, and each
must produce exactly what it produces alone."""
import threading

import pytest
import torch
from torch import nn

import membudget
from membudget._native import load_extension

pytestmark = pytest.mark.requires_native

MiB = 1 << 20


def _train(seed: int, steps: int = 3):
    gen = torch.Generator().manual_seed(seed)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.Tanh()) for _ in range(6)])
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        x = torch.randn(1024, 256, generator=gen)
        optimizer.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


def test_two_training_threads_share_a_budget_and_stay_exact():
    torch.set_num_threads(1)  # identical kernels alone and concurrently
    reference = {seed: _train(seed) for seed in (1, 2)}
    native = load_extension()
    membudget.install(budget=16 * MiB, min_tensor_bytes=64 * 1024)
    results, errors = {}, []

    def worker(seed):
        try:
            with torch.autograd.graph.saved_tensors_hooks(native.pack, native.unpack):
                results[seed] = _train(seed)
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, [str(e) for e in errors]
    stats = membudget.memory_stats()
    assert stats["swap_out_bytes"] > 0
    assert stats["reserved_bytes.all.peak"] <= 16 * MiB
    for seed in (1, 2):
        losses, params = results[seed]
        assert losses == reference[seed][0]
        for a, b in zip(params, reference[seed][1]):
            assert torch.equal(a, b)

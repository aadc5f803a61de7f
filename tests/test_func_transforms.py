"""torch.func transforms in a training step under membudget (Note [torch.func
transforms run unmanaged] in python/membudget/_func_transforms.py).

They used to refuse to run at all while membudget was installed. Now what a
transform saves is unmanaged and everything outside it is managed: under a
budget that forces both swapping and recomputation, per-sample gradients
(``vmap`` over ``grad``), a second-order inner step (``grad`` through which
the outer loss is differentiated), ``jacrev`` and ``vjp`` must give plain
PyTorch's losses and parameters bit for bit, under each lineage recorder."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, jacrev, vjp, vmap

import membudget
from membudget import _func_transforms
from training import assert_identical, run_managed, run_plain

pytestmark = pytest.mark.requires_native

STEPS = 3
ROWS = 2048  # 4 MiB activations per hidden layer


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 512), nn.GELU(), nn.Dropout(0.1), nn.Linear(512, 512), nn.Tanh(),
                         nn.Dropout(0.1), nn.Linear(512, 10))


def _batch():
    return torch.randn(ROWS, 64), torch.randint(0, 10, (ROWS,))


def _loss(model, batch):
    return F.cross_entropy(model(batch[0]), batch[1])


def _per_sample_step(model, optimizer) -> float:
    """An ordinary forward and backward, plus per-sample gradients of four
    rows (with their own dropout masks) added to the gradients."""
    x, y = _batch()
    params = {name: p.detach() for name, p in model.named_parameters()}

    def one_row(p, row, label):
        return F.cross_entropy(functional_call(model, p, (row[None],)), label[None])

    per_sample = vmap(grad(one_row), in_dims=(None, 0, 0), randomness="different")(params, x[:4], y[:4])
    loss = _loss(model, (x, y))
    loss.backward()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.grad.add_(per_sample[name].mean(0))
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def _meta_step(model, optimizer) -> float:
    """A MAML-style step: an inner gradient step through ``grad`` that the
    outer loss differentiates (second order), with a Jacobian penalty
    (``jacrev``) and an input-gradient penalty (``vjp``)."""
    x, y = _batch()
    params = dict(model.named_parameters())

    def loss_with(p, rows, labels):
        return F.cross_entropy(functional_call(model, p, (rows,)), labels)

    inner = grad(loss_with)(params, x[:256], y[:256])
    adapted = {name: p - 0.1 * inner[name] for name, p in params.items()}
    loss = loss_with(adapted, x, y)
    jacobian = jacrev(lambda rows: functional_call(model, params, (rows,)).sum(0))(x[:4])
    _, pullback = vjp(lambda rows: functional_call(model, params, (rows,)), x[:8].clone())
    (input_grad,) = pullback(torch.ones(8, 10))
    total = loss + 1e-3 * jacobian.pow(2).sum() + 1e-3 * input_grad.pow(2).sum()
    total.backward()
    optimizer.step()
    optimizer.zero_grad()
    return total.item()


@pytest.mark.parametrize("step_fn, fraction", [(_per_sample_step, 0.65), (_meta_step, 0.7)],
                         ids=["per_sample_gradients", "meta_step"])
def test_transforms_in_a_step_under_a_budget_are_exact(lineage_recorder, step_fn, fraction):
    reference = run_plain(_mlp, _batch, _loss, STEPS, step_fn=step_fn)
    unbudgeted = run_managed(_mlp, _batch, _loss, STEPS, budget=None, step_fn=step_fn)
    budget = int(unbudgeted.stats["reserved_bytes.all.peak"] * fraction)
    # A host tier too small for every victim: the director must drop some.
    managed = run_managed(_mlp, _batch, _loss, STEPS, budget=budget, step_fn=step_fn, actions="both",
                          host_budget=8 << 20)
    assert_identical(reference, managed)
    stats = managed.stats
    assert stats["reserved_bytes.all.peak"] <= budget
    assert stats["num_ooms"] == 0
    assert stats["recompute_count"] > 0 and stats["swap_out_bytes"] > 0


def test_transform_under_other_hooks_refuses_as_torch_does():
    """Hooks above membudget's (here ``save_on_cpu``) make the transform
    refuse exactly as plain PyTorch does; membudget's hooks stay in place."""
    membudget.install(budget="1GiB")
    try:
        with torch.autograd.graph.save_on_cpu():
            with pytest.raises(RuntimeError, match="don't yet support saved tensor hooks"):
                grad(lambda t: t.sin().sum())(torch.randn(8))
        assert _func_transforms._ours_here() is not None
    finally:
        membudget.uninstall()


def test_hooks_come_back_after_a_transform_that_raised():
    membudget.install(budget="1GiB")
    try:
        with pytest.raises(ValueError, match="inside the transform"):
            grad(lambda t: (_ for _ in ()).throw(ValueError("inside the transform")))(torch.randn(8))
        assert _func_transforms._ours_here() is not None
        # Saved activations are managed again: a budget-sized pack makes a handle.
        handles = membudget.memory_stats()["live_handles"]
        y = torch.randn(1024, 1024, requires_grad=True).exp()
        assert membudget.memory_stats()["live_handles"] == handles + 1
        del y
    finally:
        membudget.uninstall()


def test_uninstall_gives_torch_its_context_manager_back():
    before = torch.autograd.graph.disable_saved_tensors_hooks
    membudget.install(budget="1GiB")
    try:
        assert torch.autograd.graph.disable_saved_tensors_hooks is not before
    finally:
        membudget.uninstall()
    assert torch.autograd.graph.disable_saved_tensors_hooks is before
    # And torch's own refusal is back: no hooks of ours, yet a user's refuse.
    with torch.autograd.graph.save_on_cpu():
        with pytest.raises(RuntimeError, match="don't yet support saved tensor hooks"):
            grad(lambda t: t.sin().sum())(torch.randn(8))


def test_out_of_memory_inside_a_transform_says_so():
    """What a transform allocates is not managed; an out-of-memory error
    there names the transform rather than blaming the thread."""
    model = nn.Linear(1024, 1024)
    params = {name: p.detach() for name, p in model.named_parameters()}
    rows = torch.randn(64, 1024)

    def one_row(p, row):
        return functional_call(model, p, (row[None],)).pow(2).sum()

    membudget.install(budget="24MiB")
    try:
        # 64 per-sample weight gradients are 256 MiB.
        with pytest.raises(torch.OutOfMemoryError, match="inside a torch.func transform"):
            vmap(grad(one_row), in_dims=(None, 0))(params, rows)
    finally:
        membudget.uninstall()


def test_a_compiled_transform_runs_with_the_same_result():
    """Under ``torch.compile`` the transform used to fail while Dynamo traced
    it; now its frame is skipped and runs eagerly."""
    def input_gradient(x):
        return grad(lambda t: (t.sin() * t).sum())(x)

    x = torch.randn(16)
    expected = input_gradient(x)
    torch._dynamo.reset()
    membudget.install(budget="1GiB", actions="both")
    try:
        assert torch.equal(torch.compile(input_gradient, backend="aot_eager")(x), expected)
    finally:
        membudget.uninstall()
        torch._dynamo.reset()

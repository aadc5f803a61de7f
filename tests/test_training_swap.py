"""Real models trained under a budget well below their unmanaged peak: the
losses and parameters must equal plain PyTorch's bit for bit, the peak must
stay within the budget, and activations must actually be swapped and
prefetched back."""
import gc

import pytest
import torch

import membudget

from models import bert, gpt2, lstm
from training import assert_identical, run_managed, run_plain

pytestmark = pytest.mark.requires_native

STEPS = 3
MIN_TENSOR_BYTES = 16 * 1024


@pytest.mark.parametrize("make_workload", [gpt2, bert, lstm], ids=["gpt2", "bert", "lstm"])
def test_training_under_half_the_unmanaged_peak_is_exact(make_workload):
    work = make_workload()
    reference = run_plain(work.build, work.batch, work.loss, STEPS)
    unbudgeted = run_managed(work.build, work.batch, work.loss, STEPS, budget=None,
                             min_tensor_bytes=MIN_TENSOR_BYTES)
    assert_identical(reference, unbudgeted)
    peak = unbudgeted.stats["reserved_bytes.all.peak"]
    assert unbudgeted.stats["swap_out_bytes"] == 0

    budget = peak // 2
    # Swap only: with both actions the director's choice follows measured
    # replay times and link rates (kept across installs in one process), and
    # what it drops is not prefetched (recompute ahead is off on the CPU): a
    # likely cause of the CI run where both transformers prefetched nothing
    # in three steps. Mixed runs are tested in test_training_recompute.py.
    managed = run_managed(work.build, work.batch, work.loss, STEPS, budget=budget, actions="swap",
                          min_tensor_bytes=MIN_TENSOR_BYTES)
    assert_identical(reference, managed)
    stats = managed.stats
    assert stats["budget_bytes"] == budget
    assert stats["reserved_bytes.all.peak"] <= budget
    assert stats["swap_out_bytes"] > 0
    assert stats["num_ooms"] == 0
    # The first step records the unpack order; from the second, prefetch hits.
    # Not for the LSTM: at half its peak the fused LSTM op's working set
    # leaves room for a prefetch only once background copy-outs have finished
    # and been reaped, so whether any swap-in goes ahead depends on how fast
    # the copy thread ran (0 to 3 hits per step on a loaded 2-core machine,
    # the same run). Its exactness, budget and swapping are checked above;
    # prefetching is checked on the two transformers.
    if work.name != "lstm":
        first, last = managed.per_step[0], managed.per_step[-1]
        assert last["prefetch_hits"] > first["prefetch_hits"], [
            {k: step[k] for k in step if k.startswith(("prefetch", "swap", "recompute", "num_"))}
            for step in managed.per_step]


def test_a_forward_without_backward_before_install_leaves_prefetch_working():
    """Note [Iterations] across installs: a run that ended after a forward
    with no backward must not leave its pack numbering to the next run, or
    that run's second step predicts pack numbers no entry has and prefetches
    nothing."""
    work = gpt2()
    unbudgeted = run_managed(work.build, work.batch, work.loss, 1, budget=None, min_tensor_bytes=MIN_TENSOR_BYTES)
    budget = unbudgeted.stats["reserved_bytes.all.peak"] // 2

    membudget.install(min_tensor_bytes=MIN_TENSOR_BYTES)
    try:
        torch.manual_seed(1)
        model = work.build()
        loss = work.loss(model, work.batch())  # packs, never unpacked
        assert membudget.memory_stats()["live_handles"] > 0
        del loss, model
    finally:
        membudget.uninstall()

    managed = run_managed(work.build, work.batch, work.loss, 2, budget=budget, actions="swap",
                          min_tensor_bytes=MIN_TENSOR_BYTES)
    assert managed.stats["swap_out_bytes"] > 0
    assert managed.per_step[1]["prefetch_hits"] > 0, managed.per_step


def test_a_forward_without_backward_frees_its_saved_activations():
    """Note [Pack without a cycle] (csrc/torch/saved_activation.cpp): a small
    output saved by its own node was packed as itself, a reference cycle
    through its grad_fn that kept a graph never backpropagated, and every
    managed activation in it, alive."""
    from membudget.models import cnn

    work = cnn()
    membudget.install(min_tensor_bytes=MIN_TENSOR_BYTES, actions="swap")
    try:
        model = work.build()
        loss = work.loss(model, work.batch(torch.device("cpu")))
        assert membudget.memory_stats()["live_handles"] > 0
        del loss
        gc.collect()
        assert membudget.memory_stats()["live_handles"] == 0
    finally:
        membudget.uninstall()

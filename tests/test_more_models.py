"""Six more architectures nobody here wrote, beyond GPT-2 and BERT: a
current decoder (Llama: rotary positions, grouped-query attention, RMSNorm,
SiLU-gated MLP), an encoder-decoder (T5: relative position bias,
cross-attention), a vision transformer (ViT: a convolutional patch
embedding), a sparse mixture of experts (Mixtral: top-2 routing), a
state-space model (Mamba: a selective scan looping over the sequence) and
disentangled attention (DeBERTa-v2), dropout 0.1 where they have it. Under
half their unmanaged peak, swapping only and recomputing only (under each
lineage recorder), training must give plain PyTorch's losses and parameters
bit for bit within the budget, and the action must actually have been taken.
Their ops, views and random ops are what the lineage recorder and the
replays have to get right."""
import pytest

from models import deberta, llama, mamba, mixtral, t5, vit
from training import assert_identical, reference_and_half_peak, run_managed

pytestmark = pytest.mark.requires_native

STEPS = 3
MIN_TENSOR_BYTES = 16 * 1024
WORKLOADS = [llama, t5, vit, mixtral, mamba, deberta]
IDS = ["llama", "t5", "vit", "mixtral", "mamba", "deberta"]


def _under_half_the_peak(make_workload, actions: str):
    """Trains the workload plain and under half its unmanaged peak with
    ``actions``; checks the run is exact and within the budget; returns it."""
    work = make_workload()
    reference, budget = reference_and_half_peak(work, STEPS, MIN_TENSOR_BYTES)
    managed = run_managed(work.build, work.batch, work.loss, STEPS, budget=budget, actions=actions,
                          min_tensor_bytes=MIN_TENSOR_BYTES)
    assert_identical(reference, managed)
    assert managed.stats["reserved_bytes.all.peak"] <= budget
    assert managed.stats["num_ooms"] == 0
    return managed


@pytest.mark.parametrize("make_workload", WORKLOADS, ids=IDS)
def test_swap_only_under_half_the_peak_is_exact(make_workload):
    managed = _under_half_the_peak(make_workload, "swap")
    assert managed.stats["swap_out_bytes"] > 0
    assert managed.stats["recompute_count"] == 0


@pytest.mark.parametrize("make_workload", WORKLOADS, ids=IDS)
def test_recompute_only_under_half_the_peak_is_exact(make_workload, lineage_recorder):
    managed = _under_half_the_peak(make_workload, "recompute")
    assert managed.stats["recompute_count"] > 0 and managed.stats["drop_count"] > 0
    assert managed.stats["swap_out_bytes"] == 0

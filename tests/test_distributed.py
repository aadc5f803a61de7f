"""Data-parallel training under a budget: each rank installs membudget with a
budget of its own (DESIGN.md "Beyond one machine"), and training must give
plain PyTorch's losses and parameters bit for bit on every rank, under
DistributedDataParallel, FSDP2 (``fully_shard``) and FSDP1
(``FullyShardedDataParallel`` with ``use_orig_params``).

Two ranks over gloo on the CPU, a transformers GPT-2 with dropout 0.1. DDP
adds what a single process does not have: a parameter broadcast from rank 0
when the model is wrapped, gradient hooks that all-reduce buckets during
backward (while dropped activations are rebuilt and swapped ones brought
back), and each rank's own dropout stream. FSDP2 all-gathers each block's
parameters before its forward and frees them after it, then gathers them
again for its backward. Each rank runs plain first, then each managed
configuration in turn, in one spawned process per rank; the comparison is
made in the rank and its verdict is asserted here.

FSDP2 frees the gathered parameters' storage (``untyped_storage().resize_(0)``)
after each block's forward, which no version counter shows: the manager
drops no activation whose replay would read a freed parameter (Note [Held
inputs freed under us] in csrc/core/residency_entry.h). Without that, the
director with a small host tier dropped such activations and backward
failed (bit-identical now, with both actions used); recomputing alone needs
a larger budget there, since what the finished blocks saved can then only
stay (docs/recompute.md, "What is supported")."""
import json
import os

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.requires_native

WORLD = 2
STEPS = 3
MIN_TENSOR_BYTES = 16 * 1024
HOST_TIER = 2 * 1024 * 1024  # small enough that the director must also drop
# (actions, lineage recorder, budget as a fraction of the unbudgeted peak,
# host tier bytes or None): swapping alone, recomputing alone under each
# recorder, and the director choosing.
CONFIGS = {"ddp": [("swap", "cxx", 0.5, None), ("recompute", "python", 0.5, None), ("recompute", "cxx", 0.5, None),
                   ("both", "python", 0.5, None)],
           "fsdp2": [("swap", "cxx", 0.5, None), ("swap", "python", 0.5, None),
                     ("both", "python", 0.7, HOST_TIER), ("both", "cxx", 0.7, HOST_TIER),
                     ("recompute", "python", 0.8, None), ("recompute", "cxx", 0.8, None)],
           # FSDP1 with use_orig_params: parameters pointed at views of the
           # gathered flat parameter by set_data, which no recorder sees.
           "fsdp1": [("swap", "cxx", 0.6, None), ("recompute", "cxx", 0.7, None),
                     ("recompute", "python", 0.7, None)]}


def _name(actions: str, lineage: str, fraction: float, host_tier) -> str:
    return f"{actions} under the {lineage} recorder at {fraction:.0%} of the peak" + (
        f" with a {host_tier >> 20} MiB host tier" if host_tier else "")


def _wrap(wrapper: str, model: torch.nn.Module) -> torch.nn.Module:
    if wrapper == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    if wrapper == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({GPT2Block}), use_orig_params=True,
                                        device_id=torch.device("cpu"))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _rank(rank: int, wrapper: str, init_file: str, out_dir: str) -> None:
    """One rank: plain, then under a fraction of its unbudgeted peak for each
    configuration; writes its verdicts to ``out_dir/rank<N>.json``."""
    import torch.distributed as dist

    from models import gpt2
    from training import assert_identical, run_managed, run_plain

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    work = gpt2(batch=4, seq=64)
    build = lambda: _wrap(wrapper, work.build())  # noqa: E731
    # Each rank its own batches and dropout (the initial parameters are rank
    # 0's, broadcast as DDP wraps the model).
    seed = 1000 + rank
    reference = run_plain(build, work.batch, work.loss, STEPS, seed=seed)
    unbudgeted = run_managed(build, work.batch, work.loss, STEPS, budget=None, seed=seed,
                             min_tensor_bytes=MIN_TENSOR_BYTES)
    verdicts = {"losses": reference.losses}
    for actions, lineage, fraction, host_tier in CONFIGS[wrapper]:
        budget = int(unbudgeted.stats["reserved_bytes.all.peak"] * fraction)
        managed = run_managed(build, work.batch, work.loss, STEPS, budget=budget, seed=seed, actions=actions,
                              lineage=lineage, min_tensor_bytes=MIN_TENSOR_BYTES,
                              **({"host_budget": host_tier} if host_tier else {}))
        try:
            assert_identical(reference, managed)
            difference = ""
        except AssertionError as error:
            difference = str(error)[:500]
        verdicts[_name(actions, lineage, fraction, host_tier)] = {
            "difference": difference,
            "budget": budget,
            **{key: managed.stats[key] for key in ("reserved_bytes.all.peak", "num_ooms", "swap_out_bytes",
                                                   "drop_count", "recompute_count")},
        }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as handle:
        json.dump(verdicts, handle)
    # Gloo's teardown aborts a rank now and then, without membudget too (seen
    # in CI under plain torchrun); it is not under test here, so the ranks
    # meet and leave without it once their verdicts are written.
    dist.barrier()
    os._exit(0)


@pytest.mark.parametrize("wrapper", sorted(CONFIGS))
def test_ranks_train_exactly_under_a_budget(tmp_path, wrapper):
    if wrapper == "fsdp2":
        fsdp = pytest.importorskip("torch.distributed.fsdp")
        if not hasattr(fsdp, "fully_shard"):
            pytest.skip("FSDP2 (torch.distributed.fsdp.fully_shard) needs torch 2.6 or newer")
    mp.spawn(_rank, args=(wrapper, str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD)
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(WORLD)]
    # The ranks saw different batches: one rank's losses are not the other's.
    assert ranks[0]["losses"] != ranks[1]["losses"]
    for rank, verdicts in enumerate(ranks):
        for config in CONFIGS[wrapper]:
            actions = config[0]
            verdict = verdicts[_name(*config)]
            where = f"rank {rank}, {_name(*config)}: {verdict}"
            assert verdict["difference"] == "", where
            assert verdict["reserved_bytes.all.peak"] <= verdict["budget"], where
            assert verdict["num_ooms"] == 0, where
            if actions == "swap":
                assert verdict["swap_out_bytes"] > 0 and verdict["recompute_count"] == 0, where
            if actions == "recompute":
                assert verdict["recompute_count"] > 0 and verdict["swap_out_bytes"] == 0, where
            if actions == "both" and config[3]:
                # The small host tier makes the director drop as well.
                assert verdict["recompute_count"] > 0 and verdict["swap_out_bytes"] > 0, where

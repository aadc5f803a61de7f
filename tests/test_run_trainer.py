"""The promise of ``membudget run``: an unmodified training script built on
transformers' ``Trainer`` (gradient accumulation, gradient clipping, an
evaluation every two steps, Adam) runs under a budget well below its
unmanaged peak with the losses and parameters of the plain run, bit for bit,
within the budget, its activations actually swapped; and so does the same
script with gradient checkpointing on (Note [Checkpoint regions under a
budget])."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import membudget

pytestmark = pytest.mark.requires_native

PYTHON_DIR = Path(membudget.__file__).resolve().parent.parent

# Nothing of membudget in it: the script a user already has.
TRAIN_SCRIPT = textwrap.dedent(
    """
    import hashlib, json, sys
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=128, n_embd=64, n_layer=2, n_head=4))

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return 48

        def __getitem__(self, i):
            ids = torch.randint(0, 256, (128,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}

    args = TrainingArguments(output_dir=sys.argv[1], per_device_train_batch_size=8, num_train_epochs=1,
                             gradient_accumulation_steps=2, max_grad_norm=1.0, logging_steps=1, report_to=[],
                             save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True, eval_strategy="steps",
                             eval_steps=2, per_device_eval_batch_size=8,
                             gradient_checkpointing=sys.argv[2:] == ["checkpointing"])
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), eval_dataset=Tokens())
    trainer.train()
    digest = hashlib.sha256()
    for name, value in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(value.detach().numpy().tobytes())
    result = {"losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
              "eval_losses": [entry["eval_loss"] for entry in trainer.state.log_history if "eval_loss" in entry],
              "params": digest.hexdigest()}
    if "membudget" in sys.modules:
        result["stats"] = sys.modules["membudget"].memory_stats()
    print("RESULT " + json.dumps(result))
    """
)


def _train(tmp_path: Path, *prefix: str, budget: str = "", checkpointing: bool = False, log: str = "") -> dict:
    script = tmp_path / "train.py"
    script.write_text(TRAIN_SCRIPT)
    env = {key: value for key, value in os.environ.items() if not key.startswith("MEMBUDGET_")}
    # One intra-op thread for every process compared: with torch's two
    # threads here, plain PyTorch itself gave other gradients from the first
    # backward on in about 1 process of 20 (aten.tanh of GPT-2's tanh GELU,
    # which MKL_CBWR=AVX2 also steadies); with one thread, 80 of 80 processes
    # agreed (bench/RESULTS.md, session 38).
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PYTHON_DIR), os.environ.get("PYTHONPATH")]))
    if budget:
        env["MEMBUDGET_BUDGET"] = budget
    if log:
        env["MEMBUDGET_LOG"] = log
    script_args = [str(tmp_path / "out")] + (["checkpointing"] if checkpointing else [])
    proc = subprocess.run([sys.executable, *prefix, str(script), *script_args], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [row for row in proc.stdout.splitlines() if row.startswith("RESULT ")][-1]
    result = json.loads(line[len("RESULT "):])
    result["log"] = proc.stderr if log else ""
    return result


def _evictions(result: dict) -> str:
    """What the run evicted, and why, for a failure's message."""
    return "\n".join(row for row in result["log"].splitlines() if " evict " in row or "recompute" in row)


def test_unmodified_trainer_script_under_membudget_run_is_exact(tmp_path):
    pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate (requirements-dev.txt)")
    plain = _train(tmp_path)
    unbudgeted = _train(tmp_path, "-m", "membudget", "run")
    assert unbudgeted["stats"]["swap_out_bytes"] == 0
    assert (unbudgeted["losses"], unbudgeted["params"]) == (plain["losses"], plain["params"])

    budget = int(unbudgeted["stats"]["reserved_bytes.all.peak"] * 0.45)
    # Its evictions are logged, for a failure's message to say what went.
    managed = _train(tmp_path, "-m", "membudget", "run", budget=str(budget), log="decisions,evictions")
    assert managed["losses"] == plain["losses"], _evictions(managed)
    assert managed["eval_losses"] == plain["eval_losses"], _evictions(managed)
    assert managed["params"] == plain["params"], _evictions(managed)
    stats = managed["stats"]
    assert stats["budget_bytes"] == budget
    assert stats["reserved_bytes.all.peak"] <= budget
    assert stats["swap_out_bytes"] > 0
    assert stats["num_ooms"] == 0


def test_trainer_script_with_gradient_checkpointing_under_membudget_run_is_exact(tmp_path):
    # The checkpoint's own frame would hold what it rebuilds where nothing
    # can evict it (tests/test_checkpoint_regions.py); under a budget its
    # regions run as plain code and membudget evicts what the budget needs.
    # 60% of the checkpointed run's own peak: with --checkpoint keep it runs
    # out of memory there (measured: a 1 MiB request, 12.56 MiB budget); at
    # 45% it does either way. This model's saved tensors are small, hence
    # the lower size floor.
    pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate (requirements-dev.txt)")
    run = ("-m", "membudget", "run", "--min-tensor-bytes", "16KiB")
    plain = _train(tmp_path, checkpointing=True)
    unbudgeted = _train(tmp_path, *run, checkpointing=True)
    budget = int(unbudgeted["stats"]["reserved_bytes.all.peak"] * 0.6)
    managed = _train(tmp_path, *run, budget=str(budget), checkpointing=True)
    assert (managed["losses"], managed["eval_losses"]) == (plain["losses"], plain["eval_losses"])
    assert managed["params"] == plain["params"]
    stats = managed["stats"]
    assert stats["reserved_bytes.all.peak"] <= budget
    assert stats["swap_out_bytes"] > 0 or stats["recompute_count"] > 0
    assert stats["num_ooms"] == 0

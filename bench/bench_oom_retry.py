"""A batch-size finder under a budget, in one process, against the same
batches each tried in a fresh process.

Finders (accelerate's ``find_executable_batch_size``, Lightning's batch-size
tuner) catch ``torch.OutOfMemoryError``, halve the batch and retry in the
same process. Whatever a failed attempt leaves allocated is memory the retry
does not have, so the finder settles on a smaller batch than fits, or fails.
This bench runs such a finder on a model compiled per block (eager layers
between the blocks read their outputs: the case of Note [Held without their
graph] and Note [A forward that ran out of memory] in
``csrc/torch/lineage_recorder.cpp``), or with ``--model gpt2`` on an eager
transformers GPT-2 (64 wide, 2 layers, sequence 64) whose failures strike in
backward, in a recompute (Note [Backward tasks an error left queued] in
``_runtime.py``: try ``--budget 16232448 --start 32``), and prints, per
lineage recorder:

* after each failed attempt, the bytes still allocated and the saved-tensor
  handles still live, once the exception is gone and ``gc.collect()`` ran,
  beside what was allocated before the first attempt;
* the batch the finder settled on, and the largest batch that fits when
  each is tried alone in a fresh process (they should be equal).

    PYTHONPATH=python python bench/bench_oom_retry.py [--backend aot_eager|inductor]
        [--recorders cxx,python] [--budget 40MiB] [--start 8192] [--actions recompute]
        [--model mlp|gpt2]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))

MiB = 1 << 20


def _model(backend: str):
    import torch
    from torch import nn

    from membudget.models import ResidualMLP

    torch.manual_seed(0)
    layers = []
    for _ in range(6):
        block = ResidualMLP(256, 1024)
        block.compile(backend=backend)
        layers += [block, nn.LayerNorm(256), nn.Tanh(), nn.Linear(256, 256)]
    return nn.Sequential(*layers)


def _gpt2():
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4)
    return GPT2LMHeadModel(config)


def _loss(args, model, batch: int):
    """Forward of one batch: the loss to run backward from."""
    import torch

    if args.model == "gpt2":
        tokens = torch.randint(0, 256, (batch, 64))
        return model(input_ids=tokens, labels=tokens).loss
    return model(torch.randn(batch, 256)).square().mean()


def _attempts(args, batches):
    """Installs, then tries each batch in order until one fits; returns a row per attempt."""
    import torch

    import membudget
    from membudget._native import load_extension

    if args.model == "gpt2":
        membudget.install(budget=args.budget, actions=args.actions)  # the model under the budget too
        model = _gpt2()
    else:
        model = _model(args.backend)
        membudget.install(budget=args.budget, actions=args.actions)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    gc.collect()
    before = membudget.memory_stats()["allocated_bytes.all.current"]
    rows = []
    for batch in batches:
        failed_in = ""
        try:
            failed_in = "forward"
            loss = _loss(args, model, batch)
            failed_in = "backward"
            loss.backward()
            failed_in = "step"
            optimizer.step()
            failed_in = ""
        except torch.OutOfMemoryError:
            pass
        loss = None
        fitted = not failed_in
        optimizer.zero_grad(set_to_none=True)
        gc.collect()
        rows.append({"batch": batch, "fitted": fitted, "failed_in": failed_in,
                     "left_bytes": membudget.memory_stats()["allocated_bytes.all.current"] - before,
                     "handles": load_extension().live_handles()})
        if fitted:
            break
    membudget.uninstall()
    return rows


def _worker(args) -> int:
    batches = [int(b) for b in args.worker.split(",")]
    print(json.dumps(_attempts(args, batches)))
    return 0


def _spawn(args, recorder: str, batches) -> list:
    env = dict(os.environ, MEMBUDGET_LINEAGE=recorder, PYTHONPATH=str(ROOT / "python"))
    command = [sys.executable, __file__, "--worker", ",".join(map(str, batches)), "--backend", args.backend,
               "--budget", args.budget, "--actions", args.actions, "--model", args.model]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"worker failed ({recorder}, {batches}):\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="aot_eager", help="torch.compile backend of the blocks")
    parser.add_argument("--recorders", default="cxx,python")
    parser.add_argument("--budget", default="40MiB")
    parser.add_argument("--actions", default="recompute")
    parser.add_argument("--start", type=int, default=8192, help="the finder's first batch (halved on each failure)")
    parser.add_argument("--model", choices=("mlp", "gpt2"), default="mlp",
                        help="mlp: blocks compiled with --backend; gpt2: transformers GPT-2, eager")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return _worker(args)
    batches = []
    batch = args.start
    while batch >= 8:
        batches.append(batch)
        batch //= 2
    model = "GPT-2, eager" if args.model == "gpt2" else f"blocks compiled with {args.backend}"
    print(f"finder: batches {batches}, budget {args.budget}, actions {args.actions}, {model}", flush=True)
    for recorder in args.recorders.split(","):
        finder = _spawn(args, recorder, batches)
        print(f"\n[{recorder}] one process, halving on each out-of-memory error:")
        print(f"  {'batch':>6}  {'fitted':>10}  {'left allocated':>14}  {'live handles':>12}")
        for row in finder:
            fitted = "yes" if row["fitted"] else f"no ({row['failed_in']})"
            print(f"  {row['batch']:>6}  {fitted:>10}  "
                  f"{row['left_bytes'] / MiB:>11.2f} MiB  {row['handles']:>12}")
        alone = None
        for candidate in batches:  # the largest batch that fits in a fresh process
            print(f"  fresh process, batch {candidate}...", flush=True)
            if _spawn(args, recorder, [candidate])[0]["fitted"]:
                alone = candidate
                break
        found = next((row["batch"] for row in finder if row["fitted"]), None)
        print(f"[{recorder}] finder settled on {found}; largest batch fitting alone: {alone}; "
              f"{'same' if found == alone else 'DIFFERENT'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

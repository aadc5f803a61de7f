"""Models compiled whole (``torch.compile(model)``) trained under a budget,
side by side in one process: with membudget's partition of each compiled
graph (``MEMBUDGET_COMPILE=plan``, the default), without it
(``MEMBUDGET_COMPILE=off``), and the same model run eagerly under membudget's
runtime at the same budget, against the plain compiled and plain eager runs.

Budgets are fractions of the compiled step's peak reserved bytes, measured by
membudget's allocator with no budget. Each run is a fresh process: after a
compiled model and ``torch._dynamo.reset()``, a second compile in the same
process kept the first step's outputs (logits, key/value caches) alive through
the whole run (untraced, with or without membudget's partitioner), which a
budgeted run then lacked. Each row: whether the run fits, its
peak reserved bytes, its median step time over the timed steps and that
median over the plain compiled run's; for ``plan`` rows, the
``activation_memory_budget`` share each graph was cut at. Adam, two warm-up
steps (the first compiles), then the timed steps.

    PYTHONPATH=python python bench/bench_compiled_budget.py [--models mlp,gpt2]
        [--fractions 0.8,0.6,0.5] [--steps 6]
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))

import torch  # noqa: E402
import torch._dynamo  # noqa: E402
from torch import nn  # noqa: E402

import membudget  # noqa: E402
from membudget._native import load_extension  # noqa: E402

MiB = 1 << 20
WARMUP = 2


def _mlp():
    from membudget.models import ResidualMLP

    model = nn.Sequential(*[ResidualMLP(256, 1024) for _ in range(8)], nn.Linear(256, 1))
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(4096, 256, generator=generator), torch.randn(4096, 1, generator=generator)
    return model, lambda m: nn.functional.mse_loss(m(x), y)


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    config = GPT2Config(vocab_size=512, n_positions=256, n_embd=128, n_layer=4, n_head=4,
                        resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    tokens = torch.randint(0, 512, (8, 256), generator=torch.Generator().manual_seed(1))
    return model, lambda m: m(input_ids=tokens, labels=tokens).loss


MODELS = {"mlp": _mlp, "gpt2": _gpt2}


def timed_steps(model, loss_fn, optimizer, warmup: int, steps: int):
    """``warmup`` then ``steps`` training steps: (every loss, the timed
    steps' seconds). An out-of-memory error propagates."""
    losses, times = [], []
    for step in range(warmup + steps):
        began = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if step >= warmup:
            times.append(time.perf_counter() - began)
        del loss
    return losses, times


def _run(name: str, compiled: bool, steps: int, budget=None, **install):
    """One training run; returns (fits, peak reserved bytes, median step seconds, plans)."""
    torch._dynamo.reset()
    gc.collect()
    managed = budget is not None or install.get("count", False)
    install.pop("count", None)
    if managed:
        membudget.install(budget=budget, **install)
        load_extension().release_cached()
        membudget.reset_peak_stats()
    torch.manual_seed(0)
    model, loss_fn = MODELS[name]()
    if compiled:
        model = torch.compile(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    times = []
    fits = True
    try:
        _, times = timed_steps(model, loss_fn, optimizer, WARMUP, steps)
    except torch.OutOfMemoryError:
        fits = False
    peak = membudget.memory_stats().get("reserved_bytes.all.peak", 0) if managed else 0
    plans = [plan["activation_memory_budget"] for plan in membudget.compiled_plans()] if managed else []
    del model, optimizer
    gc.collect()
    if managed:
        membudget.uninstall()
        gc.collect()
    return fits, peak, statistics.median(times) if times else float("nan"), plans


def _fresh(name: str, compiled: bool, steps: int, budget=None, **install):
    """``_run`` in a fresh process."""
    spec = json.dumps({"name": name, "compiled": compiled, "steps": steps, "budget": budget, "install": install})
    done = subprocess.run([sys.executable, __file__, "--one", spec], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="mlp,gpt2")
    parser.add_argument("--fractions", default="0.8,0.6,0.5")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    # Every compile plans afresh: a cache hit skips the partition.
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    if args.one:
        spec = json.loads(args.one)
        print(json.dumps(_run(spec["name"], spec["compiled"], spec["steps"], spec["budget"], **spec["install"])))
        return
    fractions = [float(f) for f in args.fractions.split(",")]
    print("| model | budget | variant | fits | peak reserved | median step | vs plain compiled | cut at |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        print(f"[{name}] plain runs and the compiled peak ...", file=sys.stderr, flush=True)
        _, _, compiled_s, _ = _fresh(name, True, args.steps)
        _, _, eager_s, _ = _fresh(name, False, args.steps)
        _, compiled_peak, _, _ = _fresh(name, True, 1, count=True)
        _, eager_peak, _, _ = _fresh(name, False, 1, count=True)
        print(f"| {name} | - | plain compiled | yes | {compiled_peak / MiB:.1f} MiB | "
              f"{compiled_s * 1e3:.0f} ms | 1.00 | |")
        print(f"| {name} | - | plain eager | yes | {eager_peak / MiB:.1f} MiB | {eager_s * 1e3:.0f} ms | "
              f"{eager_s / compiled_s:.2f} | |")
        for fraction in fractions:
            budget = int(compiled_peak * fraction)
            label = f"{fraction:.0%} ({budget / MiB:.1f} MiB)"
            for variant, compiled, install in (("compiled, plan", True, {"compile": "plan"}),
                                               ("compiled, off", True, {"compile": "off"}),
                                               ("eager, runtime", False, {})):
                print(f"[{name}] {label} {variant} ...", file=sys.stderr, flush=True)
                fits, peak, median, plans = _fresh(name, compiled, args.steps, budget=budget, **install)
                timing = f"{median * 1e3:.0f} ms | {median / compiled_s:.2f}" if fits else "- | -"
                cuts = ", ".join(f"{p:g}" for p in plans)
                print(f"| {name} | {label} | {variant} | {'yes' if fits else 'OOM'} | {peak / MiB:.1f} MiB | "
                      f"{timing} | {cuts} |", flush=True)


if __name__ == "__main__":
    main()

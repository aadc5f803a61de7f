"""The smallest budget each action choice trains in, per model and lineage
recorder: what recording lineage costs or saves in memory, measured where it
decides whether a run fits at all. ``both`` should never need more than
``swap`` alone (lineage must not keep alive what swapping would free), and
``recompute`` shows how much of the model can be dropped and replayed.

Models are the shapes the lineage fixes of session 23 were about, beside a
plain one (bench/RESULTS.md, "Lead, session 23"):

* ``functions``: six custom ``autograd.Function``s built from aten ops, each
  saving a tensor its forward computed (Note [Custom Function forwards]);
* ``dirtied``: six ``Linear`` layers, each output scaled in place by a
  custom Function that calls ``ctx.mark_dirty`` and saved by a ``gelu``
  (Note [Marked dirty by a Function]; session 40);
* ``gru``: a 2-layer ``nn.GRU`` (width 256, batch 32 x 64 tokens), whose CPU
  cells split their gates with ``unsafe_chunk`` (Note [One history per
  storage]);
* ``mlp``: a plain stack of linear layers with dropout, for reference;
* ``scripted``: the same stack with each Linear-GELU-Dropout block compiled
  by ``torch.jit.script`` (TorchScript's differentiable graphs save and
  unpack a block's activations together; session 41);
* ``rnncell``: an ``nn.RNNCell`` (width 256, batch 32) unrolled 128 steps: a
  chain of 128 hidden states, each read by the replay of the next (Note
  [Dropped ancestors rebuilt in order]; session 25);
* ``rrelu``: six ``Linear(256, 256)`` + ``RReLU`` blocks, whose noise is an
  empty tensor the op it is saved for fills (Note [An empty tensor its first
  writer fills], Note [Packed before its first write]; session 37);
* ``gpt2``, ``llama``, ``t5``, ``vit``, ``mixtral``, ``mamba``, ``deberta``:
  transformers models from the tests' small configs (``tests/models.py``,
  dropout 0.1 where they have it; not in the default list: each takes
  minutes to bisect).

Each probe (model, recorder, action, budget) runs 3 seeded training steps in
a fresh process and reports whether it fitted and whether its losses and
parameters are bit-identical to plain PyTorch's; a bisection on the budget
(to 64 KiB) finds the smallest that fits. A run that raises (a replay that
cannot be done) counts as not fitting, and the first such error is printed.

    PYTHONPATH=python python bench/bench_min_budget.py [--models functions,gru,mlp,rnncell]
        [--recorders cxx,python] [--actions swap,both,recompute]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))

RESOLUTION = 64 * 1024
STEPS = 3
MIN_TENSOR_BYTES = 16 * 1024


def _models():
    import torch
    from torch import nn

    class TanhMatmul(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            y = x @ w
            ctx.save_for_backward(x, w, y)
            return y.tanh()

        @staticmethod
        def backward(ctx, grad):
            x, w, y = ctx.saved_tensors
            grad_y = grad * (1 - y.tanh() ** 2)
            return grad_y @ w.t(), x.t() @ grad_y

    class Functions(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(256, 256) / 16)
            self.out = nn.Linear(256, 10)

        def forward(self, x):
            for _ in range(6):
                x = TanhMatmul.apply(x, self.w)
            return self.out(x)

    class Dirtied(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(256, 256) for _ in range(6))
            self.scale = nn.Parameter(torch.ones(256), requires_grad=False)
            self.out = nn.Linear(256, 10)
            # The tests' Function that scales its input in place (ctx.mark_dirty).
            if str(ROOT / "tests") not in sys.path:
                sys.path.insert(0, str(ROOT / "tests"))
            from test_hooks_and_parametrizations import _ScaleInPlace

            self.scale_in_place = _ScaleInPlace

        def forward(self, x):
            for layer in self.layers:
                x = nn.functional.gelu(self.scale_in_place.apply(layer(x).mul(1.0), self.scale))
            return self.out(x)

    class Gru(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(500, 64)
            self.gru = nn.GRU(64, 256, num_layers=2, batch_first=True, dropout=0.1)
            self.out = nn.Linear(256, 50)

        def forward(self, x):
            return self.out(self.gru(self.embed(x))[0])

    class RnnCell(nn.Module):
        def __init__(self):
            super().__init__()
            self.cell = nn.RNNCell(64, 256)
            self.out = nn.Linear(256, 10)

        def forward(self, x):
            h = x.new_zeros(x.shape[0], 256)
            for t in range(x.shape[1]):
                h = self.cell(x[:, t], h)
            return self.out(h)

    def mlp():
        layers = []
        for _ in range(6):
            layers += [nn.Linear(256, 256), nn.GELU(), nn.Dropout(0.1)]
        return nn.Sequential(*layers, nn.Linear(256, 10))

    def scripted():
        blocks = [torch.jit.script(nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Dropout(0.1))) for _ in range(6)]
        return nn.Sequential(*blocks, nn.Linear(256, 10))

    def classify(model, inputs):
        x, y = inputs
        return nn.functional.cross_entropy(model(x), y)

    def rrelu():
        layers = []
        for _ in range(6):
            layers += [nn.Linear(256, 256), nn.RReLU()]
        return nn.Sequential(*layers, nn.Linear(256, 10))

    def transformers_model(name):
        # The tests' workloads: models nobody here wrote.
        sys.path.insert(0, str(ROOT / "tests"))
        import models

        workload = getattr(models, name)()
        return workload.build, workload.batch, workload.loss

    return {
        "gpt2": lambda: transformers_model("gpt2"),
        "llama": lambda: transformers_model("llama"),
        "t5": lambda: transformers_model("t5"),
        "vit": lambda: transformers_model("vit"),
        "mixtral": lambda: transformers_model("mixtral"),
        "mamba": lambda: transformers_model("mamba"),
        "deberta": lambda: transformers_model("deberta"),
        "rrelu": lambda: (rrelu, lambda: (torch.randn(512, 256), torch.randint(0, 10, (512,))), classify),
        "functions": lambda: (Functions, lambda: (torch.randn(512, 256), torch.randint(0, 10, (512,))), classify),
        "dirtied": lambda: (Dirtied, lambda: (torch.randn(512, 256), torch.randint(0, 10, (512,))), classify),
        "gru": lambda: (Gru, lambda: (torch.randint(0, 500, (32, 64)),), lambda m, i: m(i[0]).square().mean()),
        "mlp": lambda: (mlp, lambda: (torch.randn(512, 256), torch.randint(0, 10, (512,))), classify),
        "scripted": lambda: (scripted, lambda: (torch.randn(512, 256), torch.randint(0, 10, (512,))), classify),
        "rnncell": lambda: (RnnCell, lambda: (torch.randn(32, 128, 64), torch.randint(0, 10, (32,))), classify),
    }


def probe(model: str, action: str, budget: int) -> dict:
    """One run in this process: 3 steps; budget 0 = plain PyTorch, -1 = unbudgeted."""
    import torch

    import membudget
    from membudget.harness import parameter_digest

    build, batch, loss_fn = _models()[model]()  # each entry builds its workload when asked
    if budget != 0:
        membudget.install(budget=budget if budget > 0 else None, actions=action, min_tensor_bytes=MIN_TENSOR_BYTES)
    torch.manual_seed(0)
    net = build()
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
    losses = []
    try:
        for _ in range(STEPS):
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(net, batch())
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    except torch.OutOfMemoryError:
        return {"fits": False}
    except (RuntimeError, RecursionError) as error:  # RecomputeError is a RuntimeError
        return {"fits": False, "error": f"{type(error).__name__}: {str(error)[:200]}"}
    result = {"fits": True, "losses": losses, "digest": parameter_digest(net)}
    if budget != 0:
        result["peak"] = membudget.memory_stats()["reserved_bytes.all.peak"]
    return result


def _spawn(model: str, recorder: str, action: str, budget: int) -> dict:
    env = dict(os.environ, MEMBUDGET_LINEAGE=recorder, PYTHONPATH=str(ROOT / "python"))
    # Probes are compared across processes: with two threads plain PyTorch's
    # tanh (GPT-2's GELU) differs between processes (bench/RESULTS.md, session 38).
    env.setdefault("OMP_NUM_THREADS", "1")
    out = subprocess.run([sys.executable, __file__, "--probe", model, action, str(budget)], env=env,
                         capture_output=True, text=True, timeout=600)
    for line in out.stdout.splitlines():
        if line.startswith("PROBE "):
            return json.loads(line[len("PROBE "):])
    raise RuntimeError(f"probe {model} {recorder} {action} {budget} failed:\n{out.stderr[-2000:]}")


def smallest_budget(model: str, recorder: str, action: str, reference: dict, high: int) -> tuple:
    """(smallest fitting budget, whether that run was identical to plain)."""
    low, best, reported = 0, None, False
    while high - low > RESOLUTION:
        middle = (low + high) // 2
        run = _spawn(model, recorder, action, middle)
        if "error" in run and not reported:
            print(f"# {model} {recorder} {action} at {middle / 2**20:.2f} MiB: {run['error']}", flush=True)
            reported = True
        if run["fits"]:
            high, best = middle, run
        else:
            low = middle
    if best is None:
        best = _spawn(model, recorder, action, high)
        if not best["fits"]:
            return None, False  # not even at the unmanaged peak (plus the margin)
    same = best["losses"] == reference["losses"] and best["digest"] == reference["digest"]
    return high, same


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="functions,gru,mlp,rnncell")
    parser.add_argument("--recorders", default="cxx,python")
    parser.add_argument("--actions", default="swap,both,recompute")
    parser.add_argument("--probe", nargs=3, metavar=("MODEL", "ACTION", "BUDGET"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        model, action, budget = args.probe
        print("PROBE " + json.dumps(probe(model, action, int(budget))), flush=True)
        return 0
    known = _models()
    models = [m for m in args.models.split(",") if m]
    for name in models:
        if name not in known:
            raise SystemExit(f"unknown model {name!r}: known are {', '.join(known)}")
    print(f"# {STEPS} steps per probe, budgets bisected to {RESOLUTION // 1024} KiB; MiB = 2^20 bytes")
    print("| model | recorder | unmanaged peak | action | smallest budget | of swap's | identical |")
    print("|---|---|---|---|---|---|---|")
    start = time.time()
    for name in models:
        reference = _spawn(name, "cxx", "swap", 0)
        peak = _spawn(name, "cxx", "swap", -1)["peak"]
        for recorder in [r for r in args.recorders.split(",") if r]:
            swap_budget = None
            for action in [a for a in args.actions.split(",") if a]:
                budget, same = smallest_budget(name, recorder, action, reference, peak + 8 * RESOLUTION)
                if budget is None:
                    print(f"| {name} | {recorder} | {peak / 2**20:.2f} MiB | {action} | above the peak | | |", flush=True)
                    continue
                swap_budget = budget if action == "swap" else swap_budget
                ratio = f"{budget / swap_budget:.3f}" if swap_budget else ""
                print(f"| {name} | {recorder} | {peak / 2**20:.2f} MiB | {action} | {budget / 2**20:.2f} MiB | {ratio} | "
                      f"{'yes' if same else 'NO'} |", flush=True)
        print(f"# {name} done after {time.time() - start:.0f} s", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

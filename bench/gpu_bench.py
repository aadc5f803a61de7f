"""GPU benchmark: a small GPT trained unmanaged, then under 70% and 50% of its
unmanaged peak reserved memory with membudget.

Each run is its own subprocess, because membudget's CUDA allocator is
process-wide and must be installed before CUDA is first used. The parent prints
one table: peak reserved bytes, step time and its ratio to the unmanaged run,
bytes swapped out and in, prefetch hits/misses, recomputations, and how far the
last loss is from the unmanaged one.

    python bench/gpu_bench.py [--steps 6] [--fractions 0.7,0.5] [--timeout 90]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20

# Model size: about 4-5 GiB of peak reserved memory unmanaged in fp32, small
# enough for a short run on any recent data-centre GPU.
GPT_CONFIG = dict(vocab=8192, width=768, heads=12, layers=8, context=512, batch=16)


def build_gpt(vocab, width, heads, layers, context):
    """A decoder-only transformer in plain torch (pre-norm, causal SDPA, GELU MLP)."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1 = nn.LayerNorm(width)
            self.qkv = nn.Linear(width, 3 * width)
            self.proj = nn.Linear(width, width)
            self.norm2 = nn.LayerNorm(width)
            self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = self.qkv(self.norm1(x)).split(c, dim=2)
            q, k, v = (z.view(b, t, heads, c // heads).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
            return x + self.mlp(self.norm2(x))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tokens = nn.Embedding(vocab, width)
            self.positions = nn.Embedding(context, width)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.norm = nn.LayerNorm(width)
            self.head = nn.Linear(width, vocab, bias=False)

        def forward(self, idx):
            x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1], device=idx.device))
            for block in self.blocks:
                x = block(x)
            return self.head(self.norm(x))

    return GPT()


def child(args) -> dict:
    """One run in this process; returns its measurements."""
    import torch

    if args.budget:
        import membudget

        membudget.install(budget=args.budget)
    torch.manual_seed(0)
    cfg = GPT_CONFIG
    model = build_gpt(cfg["vocab"], cfg["width"], cfg["heads"], cfg["layers"], cfg["context"]).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["context"] + 1), device="cuda")
    inputs, targets = data[:, :-1], data[:, 1:]
    losses, times = [], []
    for _ in range(args.steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        logits = model(inputs)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, cfg["vocab"]), targets.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())  # synchronises
        times.append(time.perf_counter() - start)
    warm = times[2:] if len(times) > 2 else times
    result = {"losses": losses, "step_s": sorted(warm)[len(warm) // 2]}
    if args.budget:
        stats = membudget.memory_stats()
        result.update(
            peak=stats.get("reserved_bytes.all.peak"),
            budget=stats.get("budget_bytes"),
            swap_out=stats.get("swap_out_bytes", 0),
            swap_in=stats.get("swap_in_bytes", 0),
            prefetch_hits=stats.get("prefetch_hits", 0),
            prefetch_misses=stats.get("prefetch_misses", 0),
            recomputes=stats.get("recompute_count", 0),
        )
    else:
        result.update(peak=torch.cuda.max_memory_reserved(), budget=None)
    return result


def run_child(args, budget: str | None) -> dict:
    cmd = [sys.executable, __file__, "--child", "--steps", str(args.steps)]
    if budget:
        cmd += ["--budget", budget]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "python"), env.get("PYTHONPATH")]))
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout}s"}
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"error": f"exit {proc.returncode}: {tail[0][:120]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def gib(n):
    return "-" if n is None else f"{n / (1 << 30):.2f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--budget", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--fractions", default="0.7,0.5")
    parser.add_argument("--timeout", type=float, default=90.0, help="seconds per run")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return 0

    import torch

    if not torch.cuda.is_available():
        print("gpu_bench: no CUDA device; nothing to measure")
        return 0
    rows = [("unmanaged", run_child(args, None))]
    base = rows[0][1]
    if "error" in base:
        print(f"gpu_bench: unmanaged run failed: {base['error']}")
        return 1
    for fraction in (float(f) for f in args.fractions.split(",")):
        budget_mib = int(base["peak"] * fraction) // MiB
        rows.append((f"{fraction:.0%} budget", run_child(args, f"{budget_mib}MiB")))

    header = f"{'run':<12} {'budget':>7} {'peak':>7} {'step s':>7} {'ratio':>6} {'out GiB':>8} {'in GiB':>7} {'pf hit':>6} {'pf miss':>7} {'recomp':>6} {'dloss':>8}"
    print(f"\nGPT {GPT_CONFIG} on {torch.cuda.get_device_name(0)}; GiB unless noted")
    print(header)
    print("-" * len(header))
    failures = 0
    for name, row in rows:
        if "error" in row:
            failures += 1
            print(f"{name:<12} FAILED  {row['error']}")
            continue
        dloss = abs(row["losses"][-1] - base["losses"][-1]) / max(abs(base["losses"][-1]), 1e-12)
        print(
            f"{name:<12} {gib(row.get('budget')):>7} {gib(row['peak']):>7} {row['step_s']:>7.3f} "
            f"{row['step_s'] / base['step_s']:>6.2f} {gib(row.get('swap_out')) if row.get('budget') else '-':>8} "
            f"{gib(row.get('swap_in')) if row.get('budget') else '-':>7} {row.get('prefetch_hits', '-'):>6} "
            f"{row.get('prefetch_misses', '-'):>7} {row.get('recomputes', '-'):>6} {dloss:>8.1e}"
        )
        if row.get("budget") and row["peak"] is not None and row["peak"] > row["budget"]:
            print(f"{'':<12} peak reserved above budget")
            failures += 1
        if not all(math.isfinite(x) for x in row["losses"]):
            print(f"{'':<12} non-finite loss")
            failures += 1
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

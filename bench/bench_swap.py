"""Swap benchmark: step time and memory of training under a budget, next to plain PyTorch.

Models: transformers GPT-2 and BERT from small configs (no weights
downloaded), an nn.LSTM language model and membudget's built-in ResNet-style
CNN (:mod:`membudget.models`). For each model the unmanaged peak is measured
first (membudget installed with no budget); then the model is trained at 100%,
70% and 50% of that peak with the ``delta`` policy, and at 50% with ``lru`` and
``largest``. Every configuration is a fresh process of this script
(``--worker``), and plain-PyTorch runs alternate with the budgeted ones
(plain, managed, plain, managed, ..., plain) so that each managed step time is
divided by the mean of the plain runs just before and after it, which cancels
most of the drift of a shared machine. Step time is the median over the steps
after ``--warmup`` warm-up steps.

    python bench/bench_swap.py [--quick] [--steps 10] [--models gpt2,bert,lstm,cnn]
                               [--markdown bench/RESULTS.md]

Columns: peak reserved (MiB; for the plain row, the unmanaged peak in
parentheses), step-time ratio to plain PyTorch (for the plain row, its median
step time), MiB swapped out/in, prefetch hit rate (hits / (hits + misses)), seconds stalled
waiting for swap-ins, and whether losses and parameters are bit-identical to
the plain run.
"""
from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "python") not in sys.path:
    sys.path.insert(0, str(ROOT / "python"))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from membudget import models as builtin  # noqa: E402
from membudget.harness import RunSpec, identical, spawn_worker, worker_main  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_tables import render_table  # noqa: E402

MiB = 1 << 20
WORKER_COMMAND = [sys.executable, str(Path(__file__).resolve())]

# (fraction of the unmanaged peak, policy), in the order they run.
CONFIGURATIONS: Tuple[Tuple[float, str], ...] = (
    (1.0, "delta"), (0.7, "delta"), (0.5, "delta"), (0.5, "lru"), (0.5, "largest"),
)


# --- Workloads: transformers and LSTM configs as in tests/models.py ---------------

def _token_batch(vocab: int, batch: int, seq: int) -> Callable[[torch.device], tuple]:
    return lambda device: (torch.randint(0, vocab, (batch, seq)).to(device),)


def gpt2(batch: int = 8, seq: int = 128, layers: int = 2, dropout: float = 0.1) -> builtin.Workload:
    """transformers GPT2LMHeadModel, 2 layers of width 64, vocabulary 256."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=256, n_positions=seq, n_embd=64, n_layer=layers, n_head=4,
                        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
    return builtin.Workload("gpt2", lambda: GPT2LMHeadModel(config), _token_batch(256, batch, seq),
                            lambda model, b: model(input_ids=b[0], labels=b[0]).loss)


def bert(batch: int = 8, seq: int = 128, layers: int = 2, dropout: float = 0.1) -> builtin.Workload:
    """transformers BertForMaskedLM, 2 layers of width 64, vocabulary 256."""
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(vocab_size=256, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                        intermediate_size=256, max_position_embeddings=seq,
                        hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    return builtin.Workload("bert", lambda: BertForMaskedLM(config), _token_batch(256, batch, seq),
                            lambda model, b: model(input_ids=b[0], labels=b[0]).loss)


class LstmLanguageModel(nn.Module):
    """Embedding, a 2-layer nn.LSTM and a vocabulary projection."""

    def __init__(self, vocab: int = 512, hidden: int = 128):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.lstm = nn.LSTM(hidden, hidden, num_layers=2, batch_first=True, dropout=0.1)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.lstm(self.embed(tokens))
        return self.head(hidden)


def lstm(batch: int = 16, seq: int = 64) -> builtin.Workload:
    """The LSTM language model: next-token cross-entropy on random tokens."""
    vocab = 512

    def loss(model, b):
        logits = model(b[0][:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, vocab), b[0][:, 1:].reshape(-1))

    return builtin.Workload("lstm", lambda: LstmLanguageModel(vocab), _token_batch(vocab, batch, seq), loss)


WORKLOADS: Dict[str, Dict[str, Callable[[], builtin.Workload]]] = {
    # quick: the sizes of tests/models.py; default: larger batches and
    # sequences so that a step takes 0.1-0.3 s on one CPU thread.
    "gpt2": {"default": lambda: gpt2(batch=16, seq=256), "quick": gpt2},
    "bert": {"default": lambda: bert(batch=16, seq=256), "quick": bert},
    "lstm": {"default": lambda: lstm(batch=32, seq=128), "quick": lstm},
    "cnn": builtin.WORKLOADS["cnn"],
}


# --- Measurement ------------------------------------------------------------------

def step_seconds(result: Dict[str, Any], warmup: int) -> float:
    """Median step time after ``warmup`` steps."""
    return statistics.median(result["step_seconds"][warmup:])


def bench_model(model: str, args) -> List[Dict[str, Any]]:
    """All configurations of one model; one row per configuration."""
    base = dict(model=model, steps=args.steps, size="quick" if args.quick else "default", device=args.device,
                threads=args.threads or None)
    print(f"[{model}] unmanaged peak ...", flush=True)
    unbudgeted = spawn_worker(WORKER_COMMAND, RunSpec(mode="unbudgeted", **base), timeout=args.timeout)
    if "error" in unbudgeted:
        return [{"model": model, "error": f"unbudgeted run: {unbudgeted['error']}"}]
    peak = int(unbudgeted["stats"]["reserved_bytes.all.peak"])
    print(f"[{model}] unmanaged peak {peak / MiB:.1f} MiB", flush=True)

    def plain_run() -> Dict[str, Any]:
        result = spawn_worker(WORKER_COMMAND, RunSpec(mode="plain", **base), timeout=args.timeout)
        if "error" in result:
            raise RuntimeError(f"plain run of {model}: {result['error']}")
        return result

    try:
        plains = [plain_run()]
    except RuntimeError as error:
        return [{"model": model, "error": str(error)}]
    reference = plains[0]
    rows = [{"model": model, "fraction": None, "policy": "plain", "peak": None, "ratio": 1.0,
             "step_s": step_seconds(reference, args.warmup), "identical": True,
             "unbudgeted_identical": identical(reference, unbudgeted), "unmanaged_peak": peak}]
    for fraction, policy in CONFIGURATIONS:
        budget = int(peak * fraction)
        managed = spawn_worker(WORKER_COMMAND, RunSpec(mode="managed", budget=budget, policy=policy, **base),
                               timeout=args.timeout)
        try:
            plains.append(plain_run())
        except RuntimeError as error:
            rows.append({"model": model, "fraction": fraction, "policy": policy, "error": str(error)})
            break
        row: Dict[str, Any] = {"model": model, "fraction": fraction, "policy": policy, "budget": budget}
        if "error" in managed:
            row["error"] = managed["error"]
        else:
            stats = managed["stats"]
            plain_s = (step_seconds(plains[-2], args.warmup) + step_seconds(plains[-1], args.warmup)) / 2
            hits, misses = int(stats["prefetch_hits"]), int(stats["prefetch_misses"])
            row.update(
                peak=int(stats["reserved_bytes.all.peak"]),
                step_s=step_seconds(managed, args.warmup),
                plain_step_s=plain_s,
                ratio=step_seconds(managed, args.warmup) / plain_s,
                swap_out=int(stats["swap_out_bytes"]),
                swap_in=int(stats["swap_in_bytes"]),
                hit_rate=hits / (hits + misses) if hits + misses else None,
                stall_s=float(stats["stall_seconds"]),
                num_ooms=int(stats["num_ooms"]),
                identical=identical(reference, managed),
            )
        rows.append(row)
        status = row.get("error") or (f"peak {row['peak'] / MiB:.1f} MiB, ratio {row['ratio']:.2f}x, "
                                      f"identical {'yes' if row['identical'] else 'NO'}")
        print(f"[{model}] {fraction:.0%} {policy}: {status}", flush=True)
    # Every plain run should equal the first: if not, the machine (not membudget) is nondeterministic.
    rows[0]["plain_runs_identical"] = all(identical(reference, other) for other in plains[1:])
    rows[0]["plain_step_spread"] = [round(step_seconds(p, args.warmup), 4) for p in plains]
    return rows


def format_rows(rows: List[Dict[str, Any]], markdown: bool) -> str:
    """The results table, as text columns or as a markdown table."""
    header = ["model", "budget %", "policy", "peak MiB", "step ratio", "swap out/in MiB", "prefetch hit",
              "stall s", "identical"]
    body = []
    for row in rows:
        if "error" in row:
            fraction = "-" if row.get("fraction") is None else f"{row['fraction']:.0%}"
            body.append([row["model"], fraction, row.get("policy", "-"), "FAILED (see below)"]
                        + [""] * (len(header) - 4))
            continue
        if row["policy"] == "plain":
            body.append([row["model"], "plain", "-", f"({row['unmanaged_peak'] / MiB:.1f})",
                         f"{row['step_s'] * 1e3:.0f} ms", "-", "-", "-",
                         "ref" + ("" if row["unbudgeted_identical"] else " (unbudgeted run differs!)")])
            continue
        hit = "-" if row["hit_rate"] is None else f"{row['hit_rate']:.0%}"
        peak = f"{row['peak'] / MiB:.1f}" + ("" if row["peak"] <= row["budget"] else " > budget!")
        body.append([row["model"], f"{row['fraction']:.0%}", row["policy"], peak, f"{row['ratio']:.2f}x",
                     f"{row['swap_out'] / MiB:.0f}/{row['swap_in'] / MiB:.0f}", hit, f"{row['stall_s']:.3f}",
                     "yes" if row["identical"] else "NO"])
    errors = [f"{row['model']} {row.get('fraction') or 0:.0%} {row.get('policy', '')}: {row['error']}"
              for row in rows if "error" in row]
    return render_table(header, body, errors, markdown, left_columns=3)


def machine_line(device: str, threads: int) -> str:
    """One line naming the machine and versions the numbers come from."""
    return (f"{os.cpu_count()}-core {platform.machine()} CPU, torch {torch.__version__}, "
            f"{threads or torch.get_num_threads()} torch thread(s) per run, Python {platform.python_version()}, "
            f"device {device}")


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        return worker_main(argv, WORKLOADS)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller models and fewer steps")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default 10; 5 with --quick)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="steps left out of the median (default 2; 1 with --quick)")
    parser.add_argument("--models", default=",".join(WORKLOADS), help="comma-separated subset of "
                        + ",".join(WORKLOADS))
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads per run (default on cpu: 1; 0: torch's default)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    parser.add_argument("--markdown", metavar="FILE", help="append the table and the command to FILE")
    args = parser.parse_args(argv)
    args.steps = args.steps or (5 if args.quick else 10)
    if args.threads is None:
        # With torch's default of one thread per core, a step on a CPU shared
        # with other work waits for whichever thread is descheduled (20 ms
        # steps measured at ~1 s at random): one thread keeps ratios meaningful.
        args.threads = 1 if args.device == "cpu" else 0
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    if args.steps <= args.warmup:
        parser.error("--steps must exceed --warmup")
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in WORKLOADS]
    if unknown:
        parser.error(f"unknown models {unknown}; known: {', '.join(WORKLOADS)}")

    started = time.perf_counter()
    rows: List[Dict[str, Any]] = []
    for model in models:
        rows.extend(bench_model(model, args))
    elapsed = time.perf_counter() - started
    command = "python " + " ".join(shlex.quote(a) for a in ["bench/bench_swap.py", *argv])
    print(f"\n{command}\n{machine_line(args.device, args.threads)}; {args.steps} steps per run, median after "
          f"{args.warmup} warm-up; {elapsed:.0f} s in all")
    print(format_rows(rows, markdown=False))
    for row in rows:
        if row.get("policy") == "plain":
            print(f"{row['model']}: plain step medians across runs {row['plain_step_spread']} s; "
                  f"plain runs identical to each other: {row['plain_runs_identical']}")
    if args.markdown:
        with open(args.markdown, "a") as out:
            out.write(f"\n```\n{command}\n```\n\n{machine_line(args.device, args.threads)}; {args.steps} steps per run, "
                      f"median step time after {args.warmup} warm-up steps; {elapsed:.0f} s in all.\n\n")
            out.write(format_rows(rows, markdown=True) + "\n")
            for row in rows:
                if row.get("policy") == "plain":
                    out.write(f"\n{row['model']}: plain step-time medians of the alternating plain runs: "
                              f"{row['plain_step_spread']} s.")
            out.write("\n")
    failed = any("error" in r or not r.get("identical", False)
                 or (r.get("peak") is not None and r.get("budget") is not None and r["peak"] > r["budget"])
                 for r in rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""A training step on another thread under a budget, side by side in one
process (Note [Threads started after install()] in
python/membudget/_runtime.py): the same seeded run on the thread that called
``install()``, on a ``threading.Thread`` and on a ``ThreadPoolExecutor``
worker started after it, swap-only and recompute-only under either recorder
(both record on started threads: Note [Recording on started threads]), and
on a thread started before it (unmanaged: expected to run out of memory).

The budget is a fraction of the peak reserved bytes of an unbudgeted managed
run. Each row: whether the run fits, its peak reserved bytes, the bytes it
swapped out, its replays, its median step time over the timed steps and that
median over the first row's (plain PyTorch on this thread; the next two are
plain PyTorch on started threads, what the thread itself costs). Adam, one
warm-up step, then the timed steps; the losses of every run that fits are
checked equal to plain PyTorch's.

    PYTHONPATH=python python bench/bench_threads.py [--models mlp,gpt2]
        [--fraction 0.5] [--steps 5]
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

import membudget  # noqa: E402
from bench_compiled_budget import MODELS, timed_steps  # noqa: E402
from membudget._native import load_extension  # noqa: E402

MiB = 1 << 20
WARMUP = 1


def _train(name: str, steps: int):
    """(losses, step seconds) of a seeded run; OutOfMemoryError propagates."""
    torch.manual_seed(0)
    model, loss_fn = MODELS[name]()
    return timed_steps(model, loss_fn, torch.optim.Adam(model.parameters(), lr=1e-3), WARMUP, steps)


def _here(run):
    return run()


class _WaitingThread:
    """A ``threading.Thread`` started now that runs the job it is given
    later, once: made before ``install()``, an unmanaged thread; made
    after it, a managed one."""

    def __init__(self, daemon: bool = False):
        self.job, self.outcome = None, {}
        self.go = threading.Event()
        self.thread = threading.Thread(target=self._body, daemon=daemon)
        self.thread.start()

    def _body(self):
        self.go.wait()
        try:
            self.outcome["result"] = self.job()
        except BaseException as error:  # re-raised on the calling thread
            self.outcome["error"] = error

    def __call__(self, run):
        self.job = run
        self.go.set()
        self.thread.join()
        # Taken out, not kept: an error's traceback holds the frames of the
        # run that raised (the model, its activations), which stayed
        # allocated into the next model's unbudgeted run and inflated its peak.
        if "error" in self.outcome:
            raise self.outcome.pop("error")
        return self.outcome.pop("result")


def _started_thread(run):
    return _WaitingThread()(run)


def _pool_worker(run):
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(run).result()


def _plain(name: str, steps: int, runner):
    """The run with nothing of membudget installed: what the thread itself costs."""
    gc.collect()
    losses, times = runner(lambda: _train(name, steps))
    return {"fits": True, "losses": losses, "peak": float("nan"), "swapped": 0, "replays": 0,
            "step": statistics.median(times)}


def _measure(name: str, steps: int, budget, runner, **install):
    gc.collect()
    membudget.install(budget=budget, **install)
    load_extension().release_cached()
    membudget.reset_counters()
    membudget.reset_peak_stats()
    try:
        losses, times = runner(lambda: _train(name, steps))
        fits = True
    except torch.OutOfMemoryError:
        losses, times, fits = None, [], False
    stats = membudget.memory_stats()
    membudget.uninstall()
    gc.collect()
    return {"fits": fits, "losses": losses, "peak": stats["reserved_bytes.all.peak"],
            "swapped": stats["swap_out_bytes"], "replays": stats["recompute_count"],
            "step": statistics.median(times) if times else float("nan")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="mlp,gpt2")
    parser.add_argument("--fraction", type=float, default=0.5)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    print(f"torch {torch.__version__}; budget {args.fraction:.0%} of each model's unbudgeted managed peak")
    print(f"{'model':6} {'where':44} {'fits':5} {'peak MiB':>9} {'budget':>8} {'swapped MiB':>12} "
          f"{'replays':>8} {'step ms':>8} {'ratio':>6}")
    for name in args.models.split(","):
        early = _WaitingThread(daemon=True)  # started before this model's installs; never holds up exit
        peak = _measure(name, 1, None, _here)["peak"]
        budget = int(peak * args.fraction)
        swap, recompute = {"actions": "swap"}, {"actions": "recompute", "lineage": "cxx"}
        rows = [("install thread, swap", _here, swap),
                ("threading.Thread started after, swap", _started_thread, swap),
                ("ThreadPoolExecutor worker after, swap", _pool_worker, swap),
                ("install thread, recompute", _here, recompute),
                ("threading.Thread started after, recompute", _started_thread, recompute),
                ("ThreadPoolExecutor worker after, recompute", _pool_worker, recompute),
                ("install thread, recompute, Python", _here, {"actions": "recompute", "lineage": "python"}),
                ("threading.Thread after, recompute, Python", _started_thread,
                 {"actions": "recompute", "lineage": "python"}),
                ("thread started before install()", early, {})]
        reference = None
        measured = [("plain, this thread", _plain(name, args.steps, _here)),
                    ("plain, threading.Thread", _plain(name, args.steps, _started_thread)),
                    ("plain, ThreadPoolExecutor worker", _plain(name, args.steps, _pool_worker))]
        measured += [(where, _measure(name, args.steps, budget, runner, min_tensor_bytes=64 * 1024, **install))
                     for where, runner, install in rows]
        for where, row in measured:
            reference = reference or row
            if row["fits"] and row["losses"] != reference["losses"]:
                raise SystemExit(f"{name} {where}: losses differ from plain PyTorch's")
            ratio = row["step"] / reference["step"] if row["fits"] else float("nan")
            print(f"{name:6} {where:44} {str(row['fits']):5} {row['peak'] / MiB:9.1f} {budget / MiB:8.1f} "
                  f"{row['swapped'] / MiB:12.1f} {row['replays']:8d} {row['step'] * 1e3:8.1f} {ratio:6.3f}",
                  flush=True)


if __name__ == "__main__":
    main()

"""Stress test of the C++ lineage recorder's lock order (Note [Recorder lock
and the GIL] in csrc/torch/lineage_recorder.cpp); not a benchmark.

The main thread trains a step whose saved activation reads an input that is
then written in place (so the recorder rescues the entry from inside the
write's RecordFunction callback), while a second Python thread keeps calling
into the recorder with the GIL held. Before the fix the rescue took the GIL
under the recorder's lock and the two threads deadlocked; a watchdog then
prints both stacks and exits with a non-zero status.

    PYTHONPATH=python python bench/stress_recorder_lock.py [--rounds 1500] [--watchdog 150]
"""
import argparse
import faulthandler
import threading

import torch

import membudget
from membudget._native import load_extension


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1500)
    parser.add_argument("--watchdog", type=int, default=150, help="seconds before stacks are dumped and it exits")
    args = parser.parse_args()
    faulthandler.dump_traceback_later(args.watchdog, exit=True)
    membudget.install(budget="4GiB", actions="recompute", lineage="cxx", min_tensor_bytes=0)
    native = load_extension()
    recorder = native.lineage
    stop = threading.Event()
    calls = [0]

    def call_into_the_recorder() -> None:
        while not stop.is_set():
            recorder.ops_recorded()  # the GIL held, then the recorder's lock
            calls[0] += 1

    other = threading.Thread(target=call_into_the_recorder, daemon=True)
    other.start()
    weight = torch.randn(256, 256, requires_grad=True)
    for _ in range(args.rounds):
        with torch.no_grad():
            x = torch.randn(64, 256)  # no recorded op made it: a held input
        loss = torch.tanh(x @ weight).sum()  # tanh's saved output: its replay reads x
        native.evict_all()
        x.add_(1.0)  # a recorded write to x: the dropped output is rescued first
        loss.backward()
        weight.grad = None
    stop.set()
    other.join()
    stats = membudget.memory_stats()
    membudget.uninstall()
    print(f"finished {args.rounds} rounds; {calls[0]} calls from the other thread; "
          f"recompute_count {stats['recompute_count']}")


if __name__ == "__main__":
    main()

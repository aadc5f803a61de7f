"""Note [Replay inputs] (csrc/core/residency_manager.h): an iteration that
replays what the previous one did not still prefetches by the previous
iteration's prediction, because the inputs a replay materializes are not
positions of the unpack order.

Were they positions, such an iteration would run ahead of the order predicted
from the last one, and the prefetch cursor, which starts at the current
position, would jump over an entry still to come (an earlier build looked 32
positions back for such entries, Note [Prefetch lookback]; this test was
written for it and now fails without Note [Replay inputs] instead). A
hand-built program, replayed through the real allocator and residency manager
in the simulator (Note [Replay programs]), makes it happen:

* Forward saves X (90 MB) and B (100 MB); a 250 MB temporary under a 300 MB
  budget sends both to host (neither is recomputable). Then I1 and I2 (10 MB
  each), U (50 MB, replayed from I1 and I2 in 10 ms) and W1..W3 (10 MB each).
  Only X, B and U are released to autograd, so only they can be evicted.
* Backward unpacks W3, W2, W1; a 160 MB temporary T2 follows; then U, B (a
  100 ms op), X, I2, I1. Link 1 GB/s, prefetch window 50 MB, no background
  copies and no copies ahead (a watermark at the budget; copies_ahead off as
  on the CPU, or Note [Link behind] would issue X past the window at
  backward's first unpack, and nothing would hold it back).
* Iteration 1 has no prediction, prefetches nothing, and T2 fits beside I1,
  I2 and U (230 MB): nothing is replayed, and its unpack order
  W3 W2 W1 U B X I2 I1 predicts B at position 4 and X at 5.
* Iteration 2 (measured) prefetches B at W3's unpack; B alone overfills the
  window, so X is held back and the cursor waits at X's position (5). With B
  on the device T2 no longer fits: U, the one victim not just prefetched, is
  dropped (a 10 ms replay against a 100 ms swap). U's unpack replays it and
  materializes I1 and I2. Counted as positions they would make B's unpack
  position 6, two ahead of its prediction, and the cursor would move on from
  there, past X's predicted 5: X never prefetched, its unpack waiting for the
  whole 90 ms copy. Not counted, B's unpack is position 4 and frees the
  window, and the cursor, still at 5, issues X's copy-in, which arrives
  during B's 100 ms op.
"""
import pytest

from membudget.replay_program import Code, Program

pytestmark = pytest.mark.requires_native

MB = 1_000_000
LINK = 1e9            # bytes/s: 1 ms per MB
BUDGET = 300 * MB
WINDOW = 50 * MB      # prefetch bytes; B (100 MB) alone fills it
OP = 0.05             # seconds of every op but B's use and U's replay
B_USE = 0.1           # B's op: long enough to hide X's 90 ms copy-in
U_REPLAY = 0.01

X, B, T1, I1, I2, U, W1, W2, W3, T2 = range(10)
SIZES_MB = {X: 90, B: 100, T1: 250, I1: 10, I2: 10, U: 50, W1: 10, W2: 10, W3: 10, T2: 160}


def _save(prog, t, release):
    """Forward makes ``t`` and autograd saves it; released, only autograd
    references it (evictable); not released, forward still holds it."""
    prog.emit(Code.ALLOC, t)
    prog.emit(Code.COMPUTE, -1, OP)
    prog.emit(Code.PACK, t)
    if release:
        prog.emit(Code.RELEASE, t)


def _use(prog, t, seconds=OP):
    """Backward unpacks ``t``, computes for ``seconds`` and frees it."""
    prog.emit(Code.UNPACK, t)
    prog.emit(Code.COMPUTE, -1, seconds)
    prog.emit(Code.FREE, t)


def _temporary(prog, t):
    """A temporary ``t`` alive for one op."""
    prog.emit(Code.ALLOC, t)
    prog.emit(Code.COMPUTE, -1, OP)
    prog.emit(Code.FREE, t)


def _program():
    prog = Program(tensor_bytes=[SIZES_MB[t] * MB for t in range(len(SIZES_MB))])
    prog.replay_seconds = [U_REPLAY if t == U else 0.0 for t in range(len(SIZES_MB))]
    prog.replay_input_offsets = [0 if t <= U else 2 for t in range(len(SIZES_MB) + 1)]
    prog.replay_inputs = [I1, I2]  # U's replay materializes both (no positions: Note [Replay inputs])
    _save(prog, X, release=True)
    _save(prog, B, release=True)
    _temporary(prog, T1)
    for t in (I1, I2):
        _save(prog, t, release=False)
    _save(prog, U, release=True)
    for t in (W1, W2, W3):
        _save(prog, t, release=False)
    for t in (W3, W2, W1):
        _use(prog, t)
    _temporary(prog, T2)
    _use(prog, U)
    _use(prog, B, B_USE)
    for t in (X, I2, I1):
        _use(prog, t)
    return prog


def _replay(iterations):
    from membudget._native import load_extension

    prog = _program()
    return load_extension().sim.replay(
        prog.tensor_bytes, prog.codes, prog.tensors, prog.seconds, 0, BUDGET, 1 << 40, LINK, True, "delta", WINDOW,
        1.0, iterations, "both", prog.replay_seconds, prog.replay_input_offsets, prog.replay_inputs,
        record_timeline=True, copies_ahead=False)


def test_the_first_iteration_replays_nothing():
    # The prediction the measured iteration runs ahead of: no replay in it,
    # so no input materializations among its positions.
    r = _replay(iterations=1)
    assert r["feasible"] and r["eviction_count"] == 2 and r["swap_out_bytes"] == (90 + 100) * MB
    assert r["recompute_count"] == 0


def test_an_iteration_that_replays_more_still_prefetches_in_time():
    r = _replay(iterations=2)
    assert r["feasible"], r["error"]
    # U dropped and replayed (X and B swapped): what the prediction lacks.
    assert r["eviction_count"] == 3 and r["drop_count"] == 1 and r["recompute_count"] == 1
    assert r["swap_in_bytes"] == (90 + 100) * MB
    # X prefetched as well as B: no miss, and no unpack waits.
    assert (r["prefetch_hits"], r["prefetch_misses"]) == (2, 0), f"X's unpack stalled {r['unpack_stall_s']} s"
    assert r["unpack_stall_s"] == pytest.approx(0.0, abs=1e-9)
    # X's copy-in was issued at B's unpack, when B freed the window: not
    # earlier (the window was full) nor at X's unpack (a miss): from B's
    # copy-in, issued at W3's unpack, three W ops, T2's op, U's replay and
    # U's op.
    copies_in = {c[2]: c for c in r["timeline"]["copies"] if c[1] == "h2d"}
    assert sorted(copies_in) == [90 * MB, 100 * MB]
    issued_x, issued_b = copies_in[90 * MB][3], copies_in[100 * MB][3]
    assert issued_x - issued_b == pytest.approx(3 * OP + OP + U_REPLAY + OP)

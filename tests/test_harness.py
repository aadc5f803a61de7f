"""The bench harness's runs (membudget.harness): policies in turn in one
process (Note [Policies in one process] in bench/bench_in_process.py)."""
import json
import os
import subprocess
import sys

import pytest

from membudget import harness

WORKER = [sys.executable, "-m", "membudget.demo"]
BASE = dict(model="cnn", size="quick", device="cpu", threads=1, steps=6)


def run_logged(spec):
    """The worker's result and its stderr with MEMBUDGET_LOG=decisions."""
    env = dict(os.environ, MEMBUDGET_LOG="decisions",
               PYTHONPATH=os.pathsep.join(filter(None, [harness._package_root(), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([*WORKER, "--worker", spec.to_json()], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith(harness._RESULT_PREFIX))
    return json.loads(line[len(harness._RESULT_PREFIX):]), proc.stderr


def test_policies_take_turns_in_one_process_and_stay_exact():
    peak = harness.spawn_worker(WORKER, harness.RunSpec(mode="unbudgeted", actions="swap", **BASE))
    plain = harness.spawn_worker(WORKER, harness.RunSpec(mode="plain", **BASE))
    budget = int(peak["stats"]["reserved_bytes.all.peak"] * 0.5)
    spec = harness.RunSpec(mode="managed", budget=budget, actions="both", alternate_policies=["dtr", "delta"],
                           alternate_steps=2, **BASE)
    result, log = run_logged(spec)
    assert result["step_policies"] == ["dtr", "dtr", "delta", "delta", "dtr", "dtr"]
    assert harness.identical(plain, result)
    assert result["stats"]["reserved_bytes.all.peak"] <= budget
    # The manager's decisions name the filter that ranked them: both ran.
    evictions = [line for line in log.splitlines() if "membudget: evict " in line]
    assert any("policy=dtr" in line for line in evictions)
    assert any("policy=delta" in line for line in evictions)


def test_alternating_needs_a_managed_run_and_a_block_length():
    with pytest.raises(ValueError, match="alternate_policies"):
        harness.RunSpec.from_json(harness.RunSpec(mode="managed", budget=1 << 20, alternate_policies=["delta"],
                                                  **BASE).to_json())
    with pytest.raises(ValueError, match="alternate_policies"):
        harness.RunSpec.from_json(harness.RunSpec(mode="plain", alternate_policies=["delta"], alternate_steps=2,
                                                  **BASE).to_json())


def test_neighbouring_blocks_cancel_a_drift_the_process_medians_keep():
    # Note [Neighbouring blocks] in bench/bench_in_process.py. Two policies
    # that cost the same, in blocks of 4 steps (the first 2 of each left out),
    # on a machine that slows by 1% a step: each policy's median over the
    # process favours whichever ran earlier, the ratio to the neighbouring
    # blocks does not. A delta 2% slower throughout shows as 1.02.
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    import bench_in_process

    order = ["delta", "dtr"] * 3
    policies = [p for p in order for _ in range(4)]
    for cost, expected in ((1.0, 1.0), (1.02, 1.02)):
        seconds = [0.1 * (1 + 0.01 * step) * (cost if policy == "delta" else 1.0)
                   for step, policy in enumerate(policies)]
        result = {"step_policies": policies, "step_seconds": seconds}
        ratios = bench_in_process.block_ratios(result, warmup=0, block_steps=4, settle=2)
        assert len(ratios) == 3
        assert all(r == pytest.approx(expected, abs=0.002) for r in ratios[1:]), ratios  # dtr on both sides
        # The first delta block has dtr after it only: the drift shows there.
        assert ratios[0] < expected
        medians = {p: sorted(s for s, q in zip(seconds, policies) if q == p) for p in ("delta", "dtr")}
        process_ratio = medians["delta"][len(medians["delta"]) // 2] / medians["dtr"][len(medians["dtr"]) // 2]
        assert process_ratio < expected - 0.02

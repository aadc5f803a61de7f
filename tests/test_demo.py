"""`membudget demo --quick` end to end: every model must train bit-identically
to plain PyTorch under half its unmanaged peak, and the managed peak must stay
within the budget. No timing is asserted."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.requires_native

ROOT = Path(__file__).resolve().parents[1]


def run_demo(*extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "python"), env.get("PYTHONPATH")]))
    # Default settings: the runtime caps the prefetch window at a quarter of
    # the budget and lets in-flight prefetches finish before declaring OOM.
    return subprocess.run([sys.executable, "-m", "membudget", "demo", "--quick", "--device", "cpu", "--json",
                           *extra], env=env, capture_output=True, text=True,
                          timeout=600)


def test_quick_demo_is_identical_and_within_budget():
    proc = run_demo()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["ok"] is True
    assert [row["model"] for row in summary["rows"]] == ["gpt", "cnn"]
    for row in summary["rows"]:
        assert row["identical"] is True, row
        assert row["unbudgeted_identical"] is True, row
        assert row["managed_peak"] <= row["budget"], row
        assert row["budget"] == int(row["unmanaged_peak"] * 0.5)
        assert row["swap_out_bytes"] > 0, row  # the budget really forced swapping
        # num_ooms is not checked: it also counts prefetches that found no
        # room, which the prefetcher catches (a real OOM fails the run).
    # The human-readable table says the same.
    table_rows = [line.split() for line in proc.stdout.splitlines() if line.split()[:1] in (["gpt"], ["cnn"])]
    assert len(table_rows) == 2 and all(cells[-1] == "yes" for cells in table_rows), proc.stdout


def test_demo_rejects_a_bad_fraction():
    proc = run_demo("--fraction", "1.5")
    assert proc.returncode == 2
    assert "--fraction" in proc.stderr

"""membudget.memory_snapshot(), and torch's snapshot functions answered from
membudget's allocator on CUDA (Note [Memory snapshots] in
python/membudget/_cuda_install.py). torch's own checks of the format
(torch.cuda._memory_viz.segsum asserts that every segment's blocks add up
to it, and the segments to what is reserved) run on the CPU runtime's
snapshot, which has the same structure as a CUDA one."""
import os
import pickle
import subprocess
import sys
import warnings

import pytest
import torch
from torch.cuda import _memory_viz

import membudget
from membudget import _cuda_install
from membudget._native import load_extension

pytestmark = pytest.mark.requires_native

MiB = 1 << 20


@pytest.fixture
def installed_with_holes():
    """Installed under 32 MiB; tensors of several sizes, some freed (free
    blocks between allocated ones), and an 8-layer MLP's activations swapped
    out by a backward under the budget. Segments are expandable (the
    default) unless the process's first install said otherwise: the
    allocator keeps its kind for the process; the fixed kind is covered by
    test_fixed_segments_are_snapshotted_too in a process of its own."""
    membudget.install(budget="32MiB", min_tensor_bytes=0, actions="swap")
    try:
        torch.manual_seed(0)
        kept = [torch.randn(n, 1024) for n in (256, 64, 512, 8, 1024)]
        del kept[1], kept[2]
        model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Tanh())
                                      for _ in range(8)])
        model(torch.randn(1024, 512)).sum().backward()
        yield bool(membudget.memory_stats()["expandable_segments"]), kept
    finally:
        membudget.uninstall()


def test_the_snapshot_accounts_for_every_reserved_and_allocated_byte(installed_with_holes):
    expandable, _kept = installed_with_holes
    segments = membudget.memory_snapshot()
    stats = membudget.memory_stats()
    assert stats["swap_out_bytes"] > 0, "the budget must have made the manager swap"
    assert sum(s["total_size"] for s in segments) == stats["reserved_bytes.all.current"]
    assert sum(s["allocated_size"] for s in segments) == stats["allocated_bytes.all.current"]
    assert all(s["is_expandable"] == expandable for s in segments)
    if os.environ.get("MEMBUDGET_EXPANDABLE_SEGMENTS") == "0":
        assert not expandable
    for segment in segments:
        address = segment["address"]
        for block in segment["blocks"]:  # in address order, covering the segment without gaps
            assert block["address"] == address and block["size"] > 0
            assert block["state"] in ("active_allocated", "inactive", "active_awaiting_free")
            address += block["size"]
        assert address == segment["address"] + segment["total_size"]
    states = {b["state"] for s in segments for b in s["blocks"]}
    assert {"active_allocated", "inactive"} <= states
    report = _memory_viz.segsum({"segments": segments, "device_traces": [[]]})
    assert f"segments: {len(segments)}" in report


def test_torch_snapshot_functions_answer_from_membudget(installed_with_holes, tmp_path, monkeypatch):
    """What _cuda_install.serve_memory_snapshots() routes torch's functions
    to, called through torch's own Python functions (which exist in a CPU
    torch too): the memory visualizer's recipe, record history, run, dump a
    snapshot, works, with a warning that no history is recorded."""
    monkeypatch.setattr(torch._C, "_cuda_memorySnapshot", None, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_record_memory_history", None, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_record_memory_history_legacy", None, raising=False)
    monkeypatch.setattr(_cuda_install, "_WARNED_NO_HISTORY", False)
    _cuda_install.serve_memory_snapshots()
    with pytest.warns(RuntimeWarning, match="allocation history is not recorded"):
        torch.cuda.memory._record_memory_history()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.cuda.memory._record_memory_history(enabled=None)  # turning it off says nothing
    path = tmp_path / "snapshot.pickle"
    torch.cuda.memory._dump_snapshot(str(path))
    with open(path, "rb") as f:
        dumped = pickle.load(f)
    assert dumped["segments"] == membudget.memory_snapshot()
    assert dumped["device_traces"] and all(trace == [] for trace in dumped["device_traces"])
    assert "total_reserved" in _memory_viz.segsum(dumped)


def test_fixed_segments_are_snapshotted_too():
    """The checks above in a process whose allocator has fixed segments."""
    script = (
        "import sys, pytest\n"
        "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', %r, '-k', 'every_reserved or torch_snapshot']))\n"
        % __file__
    )
    env = dict(os.environ, MEMBUDGET_EXPANDABLE_SEGMENTS="0")
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "2 passed" in result.stdout


def test_the_snapshot_is_empty_before_install():
    if load_extension().runtime_kind() != "none":
        pytest.skip("a runtime exists in this process already (runtimes live until exit)")
    assert membudget.memory_snapshot() == []

"""membudget.memory_snapshot(), and torch's snapshot functions answered from
membudget's allocator on CUDA (Note [Memory snapshots] in
python/membudget/_cuda_install.py); torch's per-process memory fraction as a
bound on the budget (Note [Memory fraction as a budget] in _runtime.py). torch's own checks of the format
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


def _route_torch_queries(monkeypatch, device_memory_info=lambda index: (0, 0)):
    """_cuda_install.serve_torch_queries(), as a CUDA install runs it, with
    torch._C's functions (and the warned-once flag) restored afterwards.
    ``device_memory_info`` (device index to ``(free, total)``) stands for
    the device's own answer to torch.cuda.mem_get_info, which a CPU torch
    cannot give."""
    for name in ("_cuda_memorySnapshot", "_cuda_record_memory_history", "_cuda_record_memory_history_legacy",
                 "_cuda_setMemoryFraction", "_cuda_getMemoryFraction", "_accelerator_getMemoryInfo"):
        monkeypatch.setattr(torch._C, name, device_memory_info if name == "_accelerator_getMemoryInfo" else None,
                            raising=False)

    def device_mem_get_info(device=None):
        return device_memory_info(torch.cuda._utils._get_device_index(device))

    monkeypatch.setattr(torch.cuda, "mem_get_info", device_mem_get_info)
    monkeypatch.setattr(torch.cuda.memory, "mem_get_info", device_mem_get_info)
    monkeypatch.setattr(_cuda_install, "_WARNED_NO_HISTORY", False)
    _cuda_install.serve_torch_queries()


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
    """What _cuda_install.serve_torch_queries() routes torch's functions
    to, called through torch's own Python functions (which exist in a CPU
    torch too): the memory visualizer's recipe, record history, run, dump a
    snapshot, works, with a warning that no history is recorded."""
    _route_torch_queries(monkeypatch)
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
        "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', %r, '-k', 'every_reserved or torch_snapshot_functions']))\n"
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


@pytest.fixture
def torch_fraction_routed(monkeypatch):
    """torch._C's memory-fraction functions routed to membudget, as a CUDA
    install routes them; the process's fraction reset afterwards."""
    from membudget import _runtime

    monkeypatch.setattr(_runtime, "_memory_fraction", None)
    _route_torch_queries(monkeypatch)
    yield _runtime
    membudget.uninstall()


def _train_mlp():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Tanh())
                                  for _ in range(8)])
    model(torch.randn(1024, 512)).sum().backward()


def test_a_memory_fraction_bounds_the_budget(torch_fraction_routed):
    """Note [Memory fraction as a budget]: what
    torch.cuda.set_per_process_memory_fraction(f) calls, f of the device's
    memory becomes the budget where install() set none, the smaller of the
    two where it set one, and later install() calls keep the bound."""
    capacity = load_extension().device_capacity("cpu")
    membudget.install(budget=None, min_tensor_bytes=0, actions="swap")
    assert membudget.memory_stats()["budget_bytes"] == 0
    fraction = (24 * MiB) / capacity
    torch._C._cuda_setMemoryFraction(fraction, 0)
    assert torch._C._cuda_getMemoryFraction(0) == fraction
    assert membudget.memory_stats()["budget_bytes"] == int(fraction * capacity)
    membudget.reset_peak_stats()
    _train_mlp()  # 8 saved activations of 2 MiB plus the batch and weights: more than 24 MiB unmanaged
    stats = membudget.memory_stats()
    assert stats["swap_out_bytes"] > 0
    assert stats["reserved_bytes.all.peak"] <= int(fraction * capacity)
    membudget.install(budget="16MiB", min_tensor_bytes=0, actions="swap")
    assert membudget.memory_stats()["budget_bytes"] == 16 * MiB  # the smaller
    membudget.install(budget="64MiB", min_tensor_bytes=0, actions="swap")
    assert membudget.memory_stats()["budget_bytes"] == int(fraction * capacity)  # bounded by the fraction
    torch._C._cuda_setMemoryFraction(1.0, 0)
    assert membudget.memory_stats()["budget_bytes"] == 64 * MiB  # a fraction of 1 bounds nothing
    torch._C._cuda_setMemoryFraction(0.0, 0)
    assert membudget.memory_stats()["budget_bytes"] == 1  # 0 allows nothing (0 bytes would mean no budget)
    torch._C._cuda_setMemoryFraction(1.0, 0)


def test_a_memory_fraction_out_of_range_or_for_another_device(torch_fraction_routed):
    membudget.install(budget="32MiB", min_tensor_bytes=0, actions="swap")
    with pytest.raises(ValueError, match="between 0 and 1"):
        torch._C._cuda_setMemoryFraction(1.5, 0)
    torch._C._cuda_setMemoryFraction(0.000001, 1)  # not the managed device: membudget serves none other
    assert membudget.memory_stats()["budget_bytes"] == 32 * MiB
    assert torch._C._cuda_getMemoryFraction(1) == 1.0


def test_free_memory_is_what_the_budget_leaves(monkeypatch):
    """Note [Free memory as the budget sees it]: under a budget,
    torch.cuda.mem_get_info() and torch.accelerator.get_memory_info() -- by
    which device_map="auto" places weights -- answer for the managed device
    as if the budget were the device; the device's own answer stands for
    another device, where the device has less free, and without a budget."""
    device = {"free": 900 * MiB, "total": 1024 * MiB}
    _route_torch_queries(monkeypatch, lambda index: (device["free"] - index, device["total"] - index))
    queries = [lambda: torch.cuda.mem_get_info(0), lambda: torch.cuda.mem_get_info("cuda:0"),
               lambda: torch.cuda.memory.mem_get_info(torch.device("cuda", 0))]
    if hasattr(torch, "accelerator") and hasattr(torch.accelerator, "get_memory_info"):
        queries.append(lambda: torch.accelerator.get_memory_info(0))
    membudget.install(budget="32MiB", min_tensor_bytes=0, actions="swap")
    try:
        kept = torch.randn(3 * MiB // 4)  # 3 MiB reserved through membudget's allocator
        reserved = membudget.memory_stats()["reserved_bytes.all.current"]
        assert 3 * MiB <= reserved < 32 * MiB
        for query in queries:
            assert query() == (32 * MiB - reserved, 32 * MiB)
        assert torch.cuda.mem_get_info(1) == (900 * MiB - 1, 1024 * MiB - 1)  # not the managed device
        device["free"] = 2 * MiB  # others use the device: its own free is the smaller
        assert torch.cuda.mem_get_info(0) == (2 * MiB, 32 * MiB)
        device["free"] = 900 * MiB
        membudget.install(budget=None, min_tensor_bytes=0, actions="swap")
        assert torch.cuda.mem_get_info(0) == (900 * MiB, 1024 * MiB)
        del kept
    finally:
        membudget.uninstall()
    _cuda_install.serve_torch_queries()  # once more, as a second install would: wrapped once, not twice
    assert torch.cuda.mem_get_info._membudget_wraps.__name__ == "device_mem_get_info"

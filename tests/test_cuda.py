"""CUDA backend and CUDA install: what a user of a GPU relies on.

The first tests run everywhere (the extension is built with the CUDA toolkit
here and in CI); the rest need a device and skip without one. Tests that
install membudget as torch's CUDA allocator run in a subprocess each, because
the allocator is process-wide and can be set only before CUDA is first used.
"""
import ctypes
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from membudget import _C

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PYTHON_DIR = Path(__file__).resolve().parents[1] / "python"
MiB = 1 << 20


def run_python(code: str, timeout: float = 120, env: dict = None) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter that imports membudget from this tree
    (in ``env``, default this process's environment)."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PYTHON_DIR), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env, capture_output=True, text=True, timeout=timeout,
    )


def last_json_line(result: subprocess.CompletedProcess) -> dict:
    assert result.returncode == 0, f"subprocess failed:\n{result.stdout}\n{result.stderr}"
    return json.loads(result.stdout.strip().splitlines()[-1])


# ---- everywhere -------------------------------------------------------------

def test_extension_reports_the_cuda_build():
    assert _C.cuda_backend_compiled is True
    count = _C.cuda_device_count()
    assert isinstance(count, int) and count >= 0
    if not torch.cuda.is_available():
        assert count == 0
    # The hooks path exists exactly when the extension was built against a CUDA torch.
    assert hasattr(_C, "install_cuda_pluggable_with_hooks") == bool(_C.torch_cuda_hooks_compiled)


def test_pluggable_symbols_are_exported_from_the_extension():
    library = ctypes.CDLL(_C.extension_path())
    for name in _C.cuda_allocator_symbols.values():
        assert getattr(library, name) is not None


def test_cuda_build_info_does_not_initialise_cuda():
    from membudget._cuda_install import cuda_build_info

    initialised_before = torch.cuda.is_initialized()
    info = cuda_build_info()
    assert torch.cuda.is_initialized() == initialised_before
    assert info["cuda_backend_compiled"] is True
    assert info["cuda_device_count"] == _C.cuda_device_count()
    assert info["installed_cuda_allocator"] is None


# The sources with code built only against a CUDA torch (MEMBUDGET_TORCH_CUDA).
TORCH_CUDA_SOURCES = ["cuda_pluggable_hooks.cpp", "runtime.cpp", "cuda_symbols.cpp", "module.cpp"]


@pytest.mark.parametrize("source", TORCH_CUDA_SOURCES)
def test_the_torch_cuda_hooks_compile_against_this_torch(tmp_path, source):
    """csrc/torch/cuda_pluggable_hooks.cpp, and the branches of other sources
    under MEMBUDGET_TORCH_CUDA, are built only against a CUDA torch (the GPU
    machine's), so CPU builds and CI never compiled them. Here each is
    compiled, syntax only, against this torch's headers: a CPU wheel ships
    the CUDA allocator headers but not the one generated macro header, which
    a stand-in provides."""
    from torch.utils import cpp_extension

    if torch.version.cuda is not None:
        pytest.skip("this torch has CUDA: the build itself compiles the hooks")
    cuda_include = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "include"
    compiler = os.environ.get("CXX", "g++")
    if not (cuda_include / "cuda_runtime_api.h").exists() or shutil.which(compiler) is None:
        pytest.skip("needs the CUDA toolkit's headers and a C++ compiler")
    stub = tmp_path / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True)
    (stub / "cuda_cmake_macros.h").write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    import sysconfig

    root = Path(__file__).resolve().parents[1]
    command = [compiler, "-std=c++17", "-fsyntax-only", "-Wall", "-Wextra", "-Werror=overloaded-virtual",
               "-DMEMBUDGET_TORCH_CUDA=1", "-DMEMBUDGET_WITH_CUDA=1", "-DUSE_CUDA=1",
               # What CMakeLists.txt defines for the extension (module.cpp reads them).
               "-DTORCH_EXTENSION_NAME=_C", '-DMEMBUDGET_VERSION="0"', '-DMEMBUDGET_COMPILER="c++"',
               '-DMEMBUDGET_TORCH_VERSION="0"',
               f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}",
               f"-I{tmp_path}", f"-I{sysconfig.get_paths()['include']}", f"-I{cuda_include}", f"-I{root / 'csrc'}"]
    command += [f"-isystem{path}" for path in cpp_extension.include_paths()]
    result = subprocess.run(command + [str(root / "csrc" / "torch" / source)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without a CUDA device")
def test_install_without_a_device_is_a_clear_error():
    from membudget._cuda_install import install_cuda_allocator

    with pytest.raises(RuntimeError, match="no CUDA device"):
        install_cuda_allocator()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without a CUDA device")
def test_backend_without_a_device_is_a_clear_error():
    with pytest.raises(RuntimeError, match="no CUDA device cuda:0"):
        _C._CudaTestBackend(0)


# ---- on a CUDA device: the backend --------------------------------------------

@requires_cuda
def test_backend_selftest_round_trips_bytes():
    result = _C.cuda_backend_selftest(0, 8 * MiB + 3)
    assert result["round_trip_ok"]
    assert result["ready_after_wait"]
    assert result["pending_after_wait"] == 0
    assert result["device_capacity"] == torch.cuda.get_device_properties(0).total_memory


@requires_cuda
def test_copies_are_ordered_after_the_compute_stream():
    """A D2H copy reads what compute queued before it, an H2D copy is visible
    to compute queued after stream_wait (Note [Copy ordering])."""
    backend = _C._CudaTestBackend(0)
    n = 64 * MiB
    compute = torch.cuda.current_stream()
    data = torch.zeros(n, dtype=torch.uint8, device="cuda")
    host = backend.host_alloc(n)
    try:
        a = torch.randn(4096, 4096, device="cuda")
        for _ in range(10):  # keep the stream busy so an unordered copy would read zeros
            a = torch.tanh(a @ a)
        data.fill_(7)
        down = backend.copy_to_host(host, data.data_ptr(), n, compute.cuda_stream)
        down.wait()
        assert ctypes.string_at(host, 64) == b"\x07" * 64
        assert ctypes.string_at(host + n - 64, 64) == b"\x07" * 64
        assert backend.pending_copies("d2h") == 0

        ctypes.memset(host, 9, n)
        target = torch.zeros(n, dtype=torch.uint8, device="cuda")
        up = backend.copy_to_device(target.data_ptr(), host, n, compute.cuda_stream)
        backend.stream_wait(compute.cuda_stream, up)
        assert int((target == 9).sum().item()) == n  # queued on compute after the wait
        assert backend.pending_copies("h2d") == 0
    finally:
        torch.cuda.synchronize()
        backend.host_free(host, n)


@requires_cuda
def test_copy_overlaps_compute():
    """A D2H copy on the backend's copy stream runs while a long matmul loop
    runs on the compute stream: it completes before the compute does."""
    backend = _C._CudaTestBackend(0)
    n = 256 * MiB
    source = torch.full((n,), 3, dtype=torch.uint8, device="cuda")
    a = torch.randn(8192, 8192, device="cuda")
    out = torch.empty_like(a)
    idle = torch.cuda.Stream()  # nothing queued: the copy may start at once
    host = backend.host_alloc(n)
    torch.cuda.synchronize()
    try:
        compute_started, compute_done = torch.cuda.Event(), torch.cuda.Event()
        compute_started.record()
        for _ in range(40):
            torch.mm(a, a, out=out)
        compute_done.record()
        copy_done = backend.copy_to_host(host, source.data_ptr(), n, idle.cuda_stream)
        copy_done.wait()
        compute_finished_first = compute_done.query()
        torch.cuda.synchronize()
        assert compute_started.query()
        assert not compute_finished_first, "the copy waited for the compute stream"
        assert ctypes.string_at(host, 64) == b"\x03" * 64
    finally:
        torch.cuda.synchronize()
        backend.host_free(host, n)


# ---- on a CUDA device: install in a fresh process -------------------------------

@requires_cuda
def test_install_after_cuda_use_is_a_clear_error():
    result = run_python("""
        import torch
        from membudget._cuda_install import install_cuda_allocator
        torch.zeros(1, device="cuda")
        try:
            install_cuda_allocator()
        except RuntimeError as error:
            print("refused:", error)
        else:
            print("installed")
    """)
    assert result.returncode == 0, result.stderr
    assert "refused:" in result.stdout and "already initialised" in result.stdout


TRAIN_STEP = """
    import json, sys, torch
    import membudget
    budget = sys.argv[1] if len(sys.argv) > 1 else None
    if budget:
        membudget.install(budget=budget)
    torch.manual_seed(0)
    layers = []
    for _ in range(16):
        layers += [torch.nn.Linear(1024, 1024), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(32768, 1024, device="cuda")
    losses = []
    for _ in range(2):
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    torch.cuda.synchronize()
    if budget:
        stats = membudget.memory_stats()
        peak = stats["reserved_bytes.all.peak"]
        budget_bytes = stats["budget_bytes"]
        swapped = stats.get("swap_out_bytes", 0) + stats.get("recompute_count", 0)
    else:
        peak, budget_bytes, swapped = torch.cuda.max_memory_reserved(), 0, 0
    print(json.dumps({"losses": losses, "peak": peak, "budget": budget_bytes, "swapped": swapped}))
"""


@requires_cuda
def test_training_under_a_budget_matches_unmanaged_run():
    """17 saved activations of 128 MiB (about 2.5 GiB peak unmanaged) trained
    under 1.5 GiB, where the working set of one layer's backward (the input,
    weights, gradients and a few 128 MiB temporaries, under 1 GiB) fits: the
    peak reserved bytes stay within the budget and the losses match."""
    def run(*args):
        code = "import sys; sys.argv[1:] = %r\n" % (list(args),) + textwrap.dedent(TRAIN_STEP)
        return last_json_line(run_python(code, timeout=300))

    unmanaged = run()
    managed = run("1536MiB")
    assert unmanaged["peak"] > 1536 * MiB, "the model must not fit the budget unmanaged"
    assert managed["budget"] == 1536 * MiB
    assert managed["peak"] <= managed["budget"]
    assert managed["swapped"] > 0
    assert managed["losses"] == pytest.approx(unmanaged["losses"], rel=1e-5)

# The rest of a script runs on a side stream, after what the default stream did.
SIDE_STREAM_FROM_HERE = """side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
torch.cuda.set_stream(side)
"""


@requires_cuda
def test_training_on_a_side_stream_swaps_after_that_stream():
    """Note [Copies ordered after the entry's stream]: the same model trained
    inside `with torch.cuda.stream(side)`. Swap-outs must wait for the side
    stream's kernels that made each activation, not for the legacy default
    stream (idle here), or a copy reads an activation before its producer
    ran; 16 layers of 32768x1024 matmuls keep the side stream well behind
    the host. Swapping is exact: the losses are bit-identical."""
    def run(*args):
        code = "import sys; sys.argv[1:] = %r\n" % (list(args),) + textwrap.dedent(TRAIN_STEP)
        made = 'x = torch.randn(32768, 1024, device="cuda")\n'
        assert made in code
        code = code.replace(made, made + SIDE_STREAM_FROM_HERE)
        return last_json_line(run_python(code, timeout=300))

    unmanaged = run()
    managed = run("1536MiB")
    assert managed["peak"] <= managed["budget"] == 1536 * MiB
    assert managed["swapped"] > 0
    assert managed["losses"] == unmanaged["losses"]


@requires_cuda
def test_a_refused_install_leaves_nothing_installed():
    """install() after CUDA was used raises, and leaves no runtime that a
    second install() would take for a working one."""
    result = run_python("""
        import json, torch, membudget
        torch.zeros(1, device="cuda")
        errors = []
        for _ in range(2):
            try:
                membudget.install(budget="1GiB")
            except RuntimeError as error:
                errors.append(str(error))
        print(json.dumps({"errors": errors, "installed": membudget.is_installed()}))
    """)
    out = last_json_line(result)
    assert len(out["errors"]) == 2 and all("already initialised" in error for error in out["errors"])
    assert out["installed"] is False


@requires_cuda
@pytest.mark.parametrize("local_rank", [None, "last", "99"])
def test_install_picks_its_device_without_starting_torch_cuda(local_rank):
    """Note [Device chosen before torch.cuda starts]: install() with no device
    named leaves torch.cuda uninitialised until swapped, manages the local
    rank's device under a launcher (the runtime's current one when the rank
    is beyond the visible devices), and the first tensor lands there."""
    environment = dict(os.environ)
    environment.pop("LOCAL_RANK", None)
    last = torch.cuda.device_count() - 1  # counts without initialising torch.cuda here
    if local_rank is not None:
        environment["LOCAL_RANK"] = str(last) if local_rank == "last" else local_rank
    result = run_python("""
        import json, torch, membudget
        config = membudget.install(budget="50%")
        from membudget._cuda_install import installed_cuda_allocator_path
        x = torch.ones(1 << 20, device="cuda")
        stats = membudget.memory_stats()
        print(json.dumps({"path": installed_cuda_allocator_path(), "device": x.device.index,
                          "current": torch.cuda.current_device(), "allocated": stats["allocated_bytes.all.current"],
                          "budget": stats["budget_bytes"],
                          "half": torch.cuda.get_device_properties(x.device.index).total_memory // 2}))
    """, env=environment)
    out = last_json_line(result)
    expected = last if local_rank == "last" else 0
    assert out["path"] == "hooks"
    assert out["device"] == out["current"] == expected
    assert out["allocated"] >= 4 << 20
    assert out["budget"] == out["half"]


@requires_cuda
def test_record_stream_and_empty_cache_reach_membudget():
    result = run_python("""
        import json, torch, membudget
        membudget.install(budget="2GiB")
        from membudget._cuda_install import installed_cuda_allocator_path
        side = torch.cuda.Stream()
        x = torch.ones(4 << 20, device="cuda")
        with torch.cuda.stream(side):
            y = x * 2
        x.record_stream(side)
        del x
        side.synchronize()
        torch.cuda.empty_cache()
        print(json.dumps({"path": installed_cuda_allocator_path(), "y": y[0].item()}))
    """)
    out = last_json_line(result)
    assert out["path"] == "hooks"
    assert out["y"] == 2.0


@requires_cuda
def test_torch_memory_snapshots_answer_from_membudget():
    """Note [Memory snapshots]: torch.cuda.memory_snapshot() and the memory
    visualizer's recipe work under membudget's allocator, with its own
    segments."""
    result = run_python("""
        import json, pickle, tempfile, warnings, torch, membudget
        from torch.cuda import _memory_viz
        membudget.install(budget="1GiB")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.memory._record_memory_history()
        kept = [torch.ones(n << 20, device="cuda") for n in (1, 7, 3)]
        del kept[1]
        segments = torch.cuda.memory_snapshot()
        with tempfile.NamedTemporaryFile(suffix=".pickle") as f:
            torch.cuda.memory._dump_snapshot(f.name)
            dumped = pickle.load(open(f.name, "rb"))
        _memory_viz.segsum(dumped)
        print(json.dumps({"warned": any("history is not recorded" in str(w.message) for w in caught),
                          "same": segments == membudget.memory_snapshot() == dumped["segments"],
                          "reserved": sum(s["total_size"] for s in segments),
                          "torch_reserved": torch.cuda.memory_reserved(),
                          "allocated": sum(s["allocated_size"] for s in segments),
                          "torch_allocated": torch.cuda.memory_allocated()}))
    """)
    out = last_json_line(result)
    assert out["warned"] and out["same"]
    assert out["reserved"] == out["torch_reserved"] and out["allocated"] == out["torch_allocated"] >= 4 << 22


@requires_cuda
def test_set_per_process_memory_fraction_bounds_the_budget():
    """Note [Memory fraction as a budget]: torch's pluggable allocator ignores
    the fraction; under membudget it bounds the budget, read back by torch."""
    result = run_python("""
        import json, torch, membudget
        membudget.install()
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(0.25)
        print(json.dumps({"budget": membudget.memory_stats()["budget_bytes"], "quarter": int(0.25 * total),
                          "read": torch._C._cuda_getMemoryFraction(0)}))
    """)
    out = last_json_line(result)
    assert out["budget"] == out["quarter"] and out["read"] == 0.25


@requires_cuda
def test_free_memory_queries_answer_for_the_budget():
    """Note [Free memory as the budget sees it]: torch.cuda.mem_get_info()
    gives the budget as total and its headroom as free."""
    result = run_python("""
        import json, torch, membudget
        membudget.install(budget="1GiB")
        kept = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        free, total = torch.cuda.mem_get_info()
        print(json.dumps({"free": free, "total": total,
                          "reserved": membudget.memory_stats()["reserved_bytes.all.current"]}))
    """)
    out = last_json_line(result)
    assert out["total"] == 1 << 30 and out["free"] == (1 << 30) - out["reserved"] and out["reserved"] >= 256 << 20


FRAGMENTED_CUDA = """
    import json, sys, torch, membudget
    membudget.install(budget="64MiB", expandable_segments=sys.argv[1] == "1")
    MiB = 1 << 20
    a = torch.full((24 * MiB,), 1, dtype=torch.uint8, device="cuda")
    b = torch.full((6 * MiB,), 2, dtype=torch.uint8, device="cuda")
    del a
    c = torch.full((8 * MiB,), 3, dtype=torch.uint8, device="cuda")  # cut from a's free block
    try:
        d = torch.full((40 * MiB,), 4, dtype=torch.uint8, device="cuda")
        sums = [int(t.sum(dtype=torch.int64)) for t in (b, c, d)]
        error = None
    except torch.OutOfMemoryError as oom:
        sums, error = None, str(oom)
    stats = membudget.memory_stats()
    print(json.dumps({"sums": sums, "error": error, "peak": stats["reserved_bytes.all.peak"],
                      "expandable": stats["expandable_segments"]}))
"""


@requires_cuda
def test_expandable_segments_fit_what_fixed_segments_cannot():
    """16 MiB free in a's segment, pinned by c, and a 40 MiB request: fixed
    segments cannot release the partly used segment and fail; expandable ones
    unmap its free pages (after the device finished with them) and back the
    request in the range's tail, with every byte written and read back."""
    def run(flag):
        code = "import sys; sys.argv[1:] = [%r]\n" % flag + textwrap.dedent(FRAGMENTED_CUDA)
        return last_json_line(run_python(code))

    fixed, expandable = run("0"), run("1")
    assert not fixed["expandable"] and "out of memory" in fixed["error"]
    assert expandable["expandable"] and expandable["error"] is None
    assert expandable["sums"] == [2 * 6 * MiB, 3 * 8 * MiB, 4 * 40 * MiB]
    assert expandable["peak"] <= 64 * MiB


DROPOUT_RECOMPUTE_AHEAD = """
    import hashlib, json, os, sys, torch
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True, warn_only=True)
    import membudget
    mode = sys.argv[1]  # plain | off | ahead
    if mode != "plain":
        membudget.install(budget="768MiB", actions="recompute", recompute_ahead=mode == "ahead",
                          min_tensor_bytes="1MiB")
    torch.manual_seed(0)
    layers = []
    for _ in range(12):
        layers += [torch.nn.Linear(1024, 1024), torch.nn.GELU(), torch.nn.Dropout(0.1)]
    model = torch.nn.Sequential(*layers).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(16384, 1024, device="cuda")  # 64 MiB per saved activation
    losses = []
    for _ in range(3):
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    torch.cuda.synchronize()
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().cpu().numpy().tobytes())
    out = {"losses": losses, "params": digest.hexdigest()}
    if mode != "plain":
        stats = membudget.memory_stats()
        out.update(peak=stats["reserved_bytes.all.peak"], budget=stats["budget_bytes"],
                   recomputes=stats["recompute_count"], ahead=stats["recomputed_ahead_count"],
                   ooms=stats["num_ooms"])
    else:
        out.update(peak=torch.cuda.max_memory_reserved())
    print(json.dumps(out))
"""


@requires_cuda
def test_recompute_ahead_on_a_side_stream_is_exact(lineage_recorder):
    """Note [Recompute ahead] on CUDA: 36 saved activations of 16-64 MiB
    (dropout included) trained under 768 MiB with recompute only. With
    recompute-ahead on, dropped activations are replayed on a side stream
    ahead of their use and backward waits on the replay's event: losses and
    parameters are bit-identical to the unmanaged run (deterministic
    kernels), replays ahead happened, and the peak stays within the budget."""
    def run(mode):
        code = "import sys; sys.argv[1:] = [%r]\n" % mode + textwrap.dedent(DROPOUT_RECOMPUTE_AHEAD)
        return last_json_line(run_python(code, timeout=300))

    plain, off, ahead = run("plain"), run("off"), run("ahead")
    assert plain["peak"] > 768 * MiB, "the model must not fit the budget unmanaged"
    for managed in (off, ahead):
        assert managed["losses"] == plain["losses"]
        assert managed["params"] == plain["params"]
        assert managed["peak"] <= managed["budget"] == 768 * MiB
        assert managed["recomputes"] > 0 and managed["ooms"] == 0
    assert off["ahead"] == 0
    assert ahead["ahead"] > 0, "nothing was recomputed ahead on the side stream"


SELECTIVE_AND_DIRTIED = """
    import functools, hashlib, json, os, sys, torch
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True, warn_only=True)
    import torch.utils.checkpoint as tc
    import membudget
    mode = sys.argv[1]  # plain | managed
    if mode == "managed":
        membudget.install(budget=int(sys.argv[2]), actions="recompute", min_tensor_bytes="1MiB")

    class ScaleInPlace(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, scale):
            ctx.mark_dirty(x)
            ctx.save_for_backward(scale)
            return x.mul_(scale)

        @staticmethod
        def backward(ctx, grad):
            (scale,) = ctx.saved_tensors
            return grad * scale, None

    def keep_matmuls(ctx, op, *args, **kwargs):
        keep = op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
        return tc.CheckpointPolicy.MUST_SAVE if keep else tc.CheckpointPolicy.PREFER_RECOMPUTE

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = torch.nn.Linear(1024, 2048), torch.nn.Linear(2048, 1024)
            self.drop = torch.nn.Dropout(0.1)
            self.register_buffer("scale", torch.full((2048,), 0.9))

        def forward(self, x, dirtied):
            h = torch.nn.functional.gelu(self.up(x)) * 1.0
            if dirtied:
                h = ScaleInPlace.apply(h, self.scale)
            return self.down(self.drop(h))

    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(Block() for _ in range(6)).cuda()
    optimizer = torch.optim.SGD(blocks.parameters(), lr=1e-3)
    context = functools.partial(tc.create_selective_checkpoint_contexts, keep_matmuls)
    x = torch.randn(16384, 1024, device="cuda")  # 64 MiB; a block's hidden 128 MiB
    losses = []
    for _ in range(3):
        h = x
        for i, block in enumerate(blocks):
            if i % 2 == 0:  # selective checkpointing (Note [Selective checkpoints as a plan])
                h = h + tc.checkpoint(block, h, False, use_reentrant=False, context_fn=context)
            else:  # a Function writing in place (Note [Marked dirty by a Function])
                h = h + block(h, True)
        loss = h.square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    torch.cuda.synchronize()
    digest = hashlib.sha256()
    for p in blocks.parameters():
        digest.update(p.detach().cpu().numpy().tobytes())
    out = {"losses": losses, "params": digest.hexdigest()}
    if mode == "managed":
        stats = membudget.memory_stats()
        out.update(peak=stats["reserved_bytes.all.peak"], budget=stats["budget_bytes"],
                   recomputes=stats["recompute_count"], planned=stats["planned_drops"], ooms=stats["num_ooms"])
    else:
        out.update(peak=torch.cuda.max_memory_reserved())
    print(json.dumps(out))
"""


@requires_cuda
def test_selective_checkpoints_and_dirtied_outputs_recompute_exactly(lineage_recorder):
    """Session 40's two rules on CUDA, recompute-only at 70% of the plain
    run's peak: selective checkpoint regions run under their policy as a
    plan (planned drops), and a Function's in-place output (ctx.mark_dirty)
    is replayed; losses and parameters are bit-identical to plain PyTorch's
    run of the same model with torch's own selective checkpoint."""
    def run(*args):
        code = "import sys; sys.argv[1:] = %r\n" % (list(args),) + textwrap.dedent(SELECTIVE_AND_DIRTIED)
        return last_json_line(run_python(code, timeout=300))

    plain = run("plain")
    budget = int(plain["peak"] * 0.7)
    managed = run("managed", str(budget))
    assert managed["losses"] == plain["losses"]
    assert managed["params"] == plain["params"]
    assert managed["peak"] <= managed["budget"] == budget
    assert managed["planned"] > 0 and managed["recomputes"] > 0 and managed["ooms"] == 0

"""Trace recording: op and tensor counts derivable by hand, fake == real
structure, the on-disk format, and the fake Llama-7B trace's time and memory."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import membudget
from membudget.trace import FORMAT_VERSION, Trace


def _tiny_setup():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _tiny_step(model):
    model(torch.randn(2, 8)).sum().backward()


@pytest.fixture(scope="module")
def tiny():
    return membudget.trace(_tiny_step, setup=_tiny_setup)


def test_tiny_model_ops_by_hand(tiny):
    # Forward: the input, then per Linear a transpose (view) of the weight and
    # addmm, ReLU between them, the sum, and autograd's ones_like grad seed.
    forward = [op.name for op in tiny.forward_ops()]
    assert forward == ["aten.randn.default", "aten.t.default", "aten.addmm.default", "aten.relu.default",
                       "aten.t.default", "aten.addmm.default", "aten.sum.default", "aten.ones_like.default"]
    # Backward: two mm per Linear but one for the first (its input needs no
    # grad), threshold_backward for ReLU, a bias-grad sum per Linear.
    backward = [op.name for op in tiny.backward_ops() if op.category != "view"]
    assert sorted(backward) == sorted(["aten.mm.default"] * 3 + ["aten.threshold_backward.default"] +
                                      ["aten.sum.dim_IntList"] * 2)
    assert tiny.metadata["fake"] is False
    assert all(op.duration_s is not None and op.duration_s >= 0 for op in tiny.ops)


def test_tiny_model_tensors_by_hand(tiny):
    params = [t for t in tiny.tensors if t.kind == "parameter"]
    assert sorted(t.bytes for t in params) == sorted([16 * 8 * 4, 16 * 4, 4 * 16 * 4, 4 * 4])
    # Saved activations: the input x (for W1's grad) and ReLU's output (for
    # its own backward and W2's grad); the first addmm's output is not saved.
    saved = tiny.saved_activations()
    assert sorted(t.bytes for t in saved) == [2 * 8 * 4, 2 * 16 * 4]
    relu = next(op for op in tiny.ops if op.name == "aten.relu.default")
    pre_relu = tiny.tensors[relu.inputs[0]]
    assert not pre_relu.saved and pre_relu.dies_after == relu.index
    relu_out = tiny.tensors[relu.outputs[0]]
    assert relu_out.saved and relu_out.kind == "activation"
    # Unpack order: backward of the last Linear (ReLU output, W2), then ReLU's
    # (its output), then the first Linear's (x).
    x = saved[0] if saved[0].bytes == 64 else saved[1]
    w2 = next(t for t in params if t.bytes == 4 * 16 * 4)
    assert tiny.unpack_order == [relu_out.id, w2.id, relu_out.id, x.id]
    grads = [t for t in tiny.tensors if t.kind == "gradient"]
    assert sorted(t.bytes for t in grads) == sorted(t.bytes for t in params)


def test_flops_follow_flop_counter(tiny):
    addmm = [op for op in tiny.ops if op.name == "aten.addmm.default"]
    assert [op.flops for op in addmm] == [2 * 2 * 8 * 16, 2 * 2 * 16 * 4]
    assert all(op.category == "matmul" for op in addmm)


def test_fake_trace_has_the_same_structure(tiny):
    fake = membudget.trace(_tiny_step, fake=True, setup=_tiny_setup)
    assert fake.metadata["fake"] is True
    assert [op.name for op in fake.ops] == [op.name for op in tiny.ops]
    assert [t.bytes for t in fake.tensors] == [t.bytes for t in tiny.tensors]
    assert fake.unpack_order == tiny.unpack_order
    assert all(op.duration_s is None for op in fake.ops)


def test_save_load_round_trip(tiny, tmp_path):
    path = tmp_path / "tiny.trace.gz"
    tiny.save(path)
    loaded = Trace.load(path)
    assert loaded.ops == tiny.ops
    assert loaded.tensors == tiny.tensors
    assert loaded.unpack_order == tiny.unpack_order and loaded.pack_ops == tiny.pack_ops
    assert loaded.metadata == tiny.metadata


def test_load_refuses_another_version(tiny):
    data = tiny.to_dict()
    data["version"] = FORMAT_VERSION + 1
    with pytest.raises(ValueError, match="version"):
        Trace.from_dict(json.loads(json.dumps(data)))


def _conv_setup():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.ReLU(),
                               torch.nn.Conv2d(16, 16, 3, padding=1))


def _conv_step(model):
    model(torch.randn(4, 8, 32, 32)).square().mean().backward()


@pytest.mark.requires_native
def test_op_workspace_is_measured_and_simulated(tiny):
    # Note [Op workspace]: a CPU convolution allocates scratch buffers
    # (im2col) that no dispatched op returns. With membudget installed the
    # trace measures them, the simulator allocates them for the op's
    # duration, and a file without the column (written before it existed)
    # still loads.
    from membudget.replay_program import Code, compile_program
    from membudget.simulate import unbudgeted_peak

    assert all(op.workspace_bytes == 0 for op in tiny.ops)  # plain CPU: nothing counts
    membudget.install(budget=None)
    trace = membudget.trace(_conv_step, setup=_conv_setup)
    membudget.uninstall()
    with_scratch = {op.name for op in trace.ops if op.workspace_bytes > 0}
    assert "aten.convolution_backward.default" in with_scratch
    elementwise = [op for op in trace.ops if op.name in ("aten.relu.default", "aten.threshold_backward.default")]
    assert len(elementwise) == 2 and all(op.workspace_bytes == 0 for op in elementwise)
    peak = unbudgeted_peak(trace, "cpu-host")
    data = trace.to_dict()
    del data["ops"]["workspace_bytes"]
    older = Trace.from_dict(json.loads(json.dumps(data)))
    assert all(op.workspace_bytes == 0 for op in older.ops)
    assert unbudgeted_peak(older, "cpu-host") <= peak
    # Each scratch buffer is a tensor of its own, alive exactly around its op.
    program = compile_program(trace, [1e-6] * len(trace.ops), "none", 1 << 62)
    scratch = program.tensor_bytes[len(trace.tensors):]
    assert scratch == [op.workspace_bytes for op in trace.ops if op.workspace_bytes > 0]
    computes = [k for k, code in enumerate(program.codes) if code == Code.COMPUTE]
    for tid in range(len(trace.tensors), len(program.tensor_bytes)):
        at = program.tensors.index(tid)
        assert program.codes[at] == Code.ALLOC and program.codes[at + 1] == Code.COMPUTE
        assert program.codes[at + 2] == Code.FREE and program.tensors[at + 2] == tid
    assert len(computes) == len(trace.ops)
    assert Trace.from_dict(json.loads(json.dumps(trace.to_dict()))).ops == trace.ops


def test_blocks_are_the_repeated_layers():
    from membudget.models import gpt

    w = gpt(batch=2, context=16, width=32, heads=2, layers=3, vocab=64)
    trace = membudget.trace(lambda m: w.loss(m, w.batch(torch.device("cpu"))).backward(), fake=True, setup=w.build)
    assert sorted({op.block for op in trace.ops if op.block is not None}) == [0, 1, 2]


def test_llama_7b_fake_trace_fits_this_machine():
    """Acceptance: Llama-7B, batch 8, sequence 4096, traced on fake tensors in
    well under 2 minutes and 4 GB of RAM (a fresh process, so RSS is its own)."""
    script = textwrap.dedent("""
        import resource, time
        from membudget.sim_models import trace_model
        start = time.perf_counter()
        trace = trace_model("llama-7b", 8, 4096)
        seconds = time.perf_counter() - start
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        print(seconds, rss, len(trace.ops), sum(t.bytes for t in trace.saved_activations()))
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    seconds, rss, ops, saved = out.stdout.split()[-4:]
    assert float(seconds) < 120 and int(rss) < 4e9
    assert int(ops) > 5000
    assert int(saved) > 100 * 2**30  # ~190 GiB of bf16 activations: far beyond this machine


def test_a_saved_tensor_is_released_where_the_step_lets_it_go():
    # Note [Released by the step] (membudget.tracer): the manager may evict a
    # saved tensor only once the step no longer holds it, which can be long
    # after its last forward use (a local kept alive) or never in forward.
    def setup():
        torch.manual_seed(0)
        return torch.randn(32, 32, requires_grad=True), torch.randn(32, 32, requires_grad=True)

    def step(weights):
        w1, w2 = weights
        x = torch.randn(32, 32)
        y = (x @ w1).relu()
        z = (y @ w2).tanh()
        del y  # held past its last forward use (the second mm)
        z.sum().backward()

    trace = membudget.trace(step, setup=setup)
    forward = [op for op in trace.ops if op.phase == "forward"]
    names = [op.name for op in forward]
    relu = forward[names.index("aten.relu.default")]
    y = relu.outputs[0]
    second_mm = max(c for c in trace.tensors[y].consumers if trace.ops[c].phase == "forward")
    summed = next(op.index for op in forward if op.name.startswith("aten.sum"))
    assert trace.tensors[y].saved
    assert second_mm < summed - 1
    # Let go by `del y` after tanh, before the sum: not after its last use.
    assert trace.tensors[y].released_before == summed, (trace.tensors[y].released_before, second_mm, summed)
    assert trace.tensors[y].released_after_packs == sum(1 for k in trace.pack_ops if k <= summed)
    x = forward[names.index("aten.randn.default")].outputs[0]
    assert trace.tensors[x].saved and trace.tensors[x].released_before == -1  # the local x outlives forward


def test_host_time_between_ops_is_recorded():
    # Note [Host time between ops] (membudget.tracer): Python between two
    # ops is recorded as the later op's host_s (at least the sleep: a lower
    # bound only), and none on fake tensors.
    import time

    def step(model):
        y = model(torch.randn(2, 8))
        time.sleep(0.02)
        y.sum().backward()

    trace = membudget.trace(step, setup=_tiny_setup)
    after_sleep = next(op for op in trace.ops if op.name.startswith("aten.sum"))
    assert after_sleep.host_s >= 0.02
    assert all(op.host_s >= 0.0 for op in trace.ops)
    fake = membudget.trace(step, fake=True, setup=_tiny_setup)
    assert all(op.host_s == 0.0 for op in fake.ops)

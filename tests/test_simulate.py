"""The simulator: SimBackend time by hand, the real allocator's budget at every
feasible point, baselines, and the CLI."""
import json
import math

import pytest
import torch

import membudget
from membudget import costs
from membudget.replay_program import Code, Program
from membudget.simulate import BASELINES, policies, unbudgeted_peak

pytestmark = pytest.mark.requires_native

MiB = 1 << 20



def _replay(program, budget, link=1e9, use_manager=False, policy="delta", **link_model):
    from membudget._native import load_extension

    return load_extension().sim.replay(program.tensor_bytes, program.codes, program.tensors, program.seconds,
                                       program.prologue_length, budget, 1 << 40, link, use_manager, policy,
                                       0, 1.0, 1, record_timeline=True, **link_model)


def _save(prog, t, seconds):
    """Forward makes tensor ``t`` in ``seconds`` and autograd saves it."""
    prog.emit(Code.ALLOC, t)
    prog.emit(Code.COMPUTE, -1, seconds)
    prog.emit(Code.PACK, t)
    prog.emit(Code.RELEASE, t)


def _use(prog, t, seconds):
    """Backward unpacks ``t``, computes for ``seconds`` and frees it."""
    prog.emit(Code.UNPACK, t)
    prog.emit(Code.COMPUTE, -1, seconds)
    prog.emit(Code.FREE, t)


def _temporary(prog, t, seconds):
    """A temporary ``t`` alive for one op of ``seconds``."""
    prog.emit(Code.ALLOC, t)
    prog.emit(Code.COMPUTE, -1, seconds)
    prog.emit(Code.FREE, t)


def test_sim_backend_time_by_hand():
    # One 100 MB tensor: 1 s of compute, a synchronous copy out at 1 GB/s
    # (0.1 s of stall), 2 s of compute, a copy back in (0.1 s), 0.5 s.
    prog = Program(tensor_bytes=[100_000_000])
    prog.emit(Code.ALLOC, 0)
    prog.emit(Code.COMPUTE, -1, 1.0)
    prog.emit(Code.OFFLOAD_SYNC, 0)
    prog.emit(Code.RELEASE, 0)
    prog.emit(Code.COMPUTE, -1, 2.0)
    prog.emit(Code.RESTORE, 0)
    prog.emit(Code.COMPUTE, -1, 0.5)
    prog.emit(Code.FREE, 0)
    r = _replay(prog, budget=1 << 30)
    assert r["feasible"]
    assert r["compute_s"] == pytest.approx(3.5)
    assert r["stall_s"] == pytest.approx(0.2)
    assert r["total_s"] == pytest.approx(3.7)
    assert r["swap_out_bytes"] == r["swap_in_bytes"] == 100_000_000


def test_async_copy_overlaps_compute():
    prog = Program(tensor_bytes=[100_000_000])
    prog.emit(Code.ALLOC, 0)
    prog.emit(Code.OFFLOAD_ASYNC, 0)   # 0.1 s on the D2H stream ...
    prog.emit(Code.COMPUTE, -1, 1.0)   # ... hidden under 1 s of compute
    prog.emit(Code.RELEASE, 0)
    prog.emit(Code.PREFETCH, 0)
    prog.emit(Code.COMPUTE, -1, 0.05)  # half of the 0.1 s copy back is hidden
    prog.emit(Code.RESTORE, 0)
    prog.emit(Code.FREE, 0)
    r = _replay(prog, budget=1 << 30)
    assert r["stall_s"] == pytest.approx(0.05)


def _two_way_program():
    # A goes out and comes back while B goes out: both copy streams busy at once.
    prog = Program(tensor_bytes=[100_000_000, 100_000_000])
    prog.emit(Code.ALLOC, 0)
    prog.emit(Code.ALLOC, 1)
    prog.emit(Code.OFFLOAD_SYNC, 0)    # alone: 0.1 s at 1 GB/s
    prog.emit(Code.RELEASE, 0)
    prog.emit(Code.OFFLOAD_ASYNC, 1)   # D2H ...
    prog.emit(Code.PREFETCH, 0)        # ... and H2D together
    prog.emit(Code.RESTORE, 0)
    prog.emit(Code.FREE, 0)
    prog.emit(Code.FREE, 1)
    return prog


def test_full_duplex_link_runs_both_directions_at_full_rate():
    r = _replay(_two_way_program(), budget=1 << 30)
    assert r["stall_s"] == pytest.approx(0.2)  # 0.1 out, then 0.1 for the restore (B's copy ends with it)


def test_shared_link_splits_its_rate_between_directions():
    # Note [Modelled link]: with both streams busy each gets 0.5 GB/s, so the
    # restore waits 0.2 s; B's copy ends with it.
    r = _replay(_two_way_program(), budget=1 << 30, link_duplex_share=0.5)
    assert r["stall_s"] == pytest.approx(0.3)
    copies = r["timeline"]["copies"]
    assert [c[1] for c in copies] == ["d2h", "d2h", "h2d"]
    assert [c[5] for c in copies] == pytest.approx([0.1, 0.3, 0.3])
    assert sum(w[2] - w[1] for w in r["timeline"]["waits"]) == pytest.approx(r["stall_s"])


def test_copy_beside_compute_runs_at_the_compute_share():
    # 100 MB out at 1 GB/s, half of it while 0.1 s of compute runs (0.5 GB/s
    # beside compute): the other 50 MB take 0.05 s of stall at the idle rate.
    prog = Program(tensor_bytes=[100_000_000])
    prog.emit(Code.ALLOC, 0)
    prog.emit(Code.OFFLOAD_ASYNC, 0)
    prog.emit(Code.COMPUTE, -1, 0.1)
    prog.emit(Code.FREE, 0)            # a copy cannot outlive its source: waits
    r = _replay(prog, budget=1 << 30, link_compute_share=0.5)
    assert r["stall_s"] == pytest.approx(0.05)
    assert r["total_s"] == pytest.approx(0.15)
    (copy,) = r["timeline"]["copies"]
    assert copy[1:3] == ("d2h", 100_000_000) and copy[5] == pytest.approx(0.15)
    assert r["timeline"]["waits"][0][0] == copy[0]  # the wait names the copy it waited for


def test_replay_reports_oom_as_infeasible():
    prog = Program(tensor_bytes=[64 * MiB, 64 * MiB])
    prog.emit(Code.ALLOC, 0)
    prog.emit(Code.ALLOC, 1)
    r = _replay(prog, budget=100 * MiB)
    assert not r["feasible"] and "out of memory" in r["error"]


def test_peak_never_exceeds_budget_when_feasible(gpt_trace):
    rows = membudget.simulate(gpt_trace, ["100%", "80%", "60%", "45%", "30%", "10%"], device="h200",
                              min_tensor_bytes=16 * 1024)
    assert {r.policy for r in rows} == {*policies(), *BASELINES}
    assert any(r.feasible for r in rows) and any(not r.feasible for r in rows)
    for r in rows:
        if r.feasible:
            assert r.peak_reserved_bytes <= r.budget_bytes, r
            assert r.step_s == pytest.approx(r.compute_s + r.stall_s + r.recompute_s, rel=1e-6)
        else:
            assert r.error and math.isinf(r.overhead_ratio)


def test_unbudgeted_run_needs_no_management(gpt_trace):
    peak = unbudgeted_peak(gpt_trace, "h200")
    rows = membudget.simulate(gpt_trace, [peak], ["delta"], "h200", baselines=("none",), high_watermark=1.0)
    assert all(r.feasible and r.stall_s == 0 and r.swap_bytes == 0 for r in rows)
    compute = sum(costs.roofline_seconds(op.flops, op.bytes_read + op.bytes_written, costs.device_model("h200"),
                                         getattr(torch, op.dtype), op.category) for op in gpt_trace.ops)
    assert rows[0].compute_s == pytest.approx(compute)


def test_a_saved_output_no_forward_op_reads_is_released_once_packed():
    # Note [Released when packed] (membudget.replay_program): max-pool
    # indices are saved by the pool's backward node and read by no later
    # forward op. Their release must follow their pack, or the pack's entry
    # stays referenced (unevictable) through forward.
    from membudget.replay_program import compile_program, op_durations

    def setup():
        return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.MaxPool2d(2),
                                   torch.nn.Flatten(), torch.nn.Linear(8 * 16 * 16, 4))

    trace = membudget.trace(lambda model: model(torch.randn(16, 3, 32, 32)).sum().backward(), setup=setup)
    pool = next(op for op in trace.ops if op.name.startswith("aten.max_pool2d_with_indices"))
    indices = pool.outputs[1]
    assert trace.tensors[indices].saved
    assert not [c for c in trace.tensors[indices].consumers if trace.ops[c].phase == "forward"]
    prog = compile_program(trace, op_durations(trace, costs.device_model("h200")), "manager", min_tensor_bytes=1)
    codes = [code for code, tid in zip(prog.codes, prog.tensors) if tid == indices]
    assert Code.PACK in codes and Code.RELEASE in codes
    assert codes.index(Code.PACK) < codes.index(Code.RELEASE), codes


def test_a_tensor_saved_by_the_last_op_is_packed():
    # The last op's saved output, with no pack recorded, is packed after that
    # op (instructions placed after the last op were once dropped).
    from membudget.replay_program import compile_program
    from membudget.trace import Trace, TraceOp, TraceTensor

    op = TraceOp(index=0, name="aten.relu.default", phase="forward", category="elementwise", flops=0,
                 bytes_read=4 * MiB, bytes_written=4 * MiB, duration_s=1e-3, outputs=[0])
    out = TraceTensor(id=0, bytes=4 * MiB, shape=(MiB,), dtype="float32", producer=0, saved=True, kind="activation")
    prog = compile_program(Trace(ops=[op], tensors=[out]), [1e-3], "manager", min_tensor_bytes=1)
    codes = [code for code, tid in zip(prog.codes, prog.tensors) if tid == 0]
    assert codes == [Code.ALLOC, Code.PACK, Code.RELEASE, Code.FREE], codes


def test_packs_before_one_op_follow_autograd_order():
    # Note [Pack order] (membudget.replay_program): autograd packed tensor 1
    # before tensor 0 (made first) ahead of the same op; the simulated
    # manager must number them as the runtime does, or its predicted next
    # uses, background copies and victims differ from the real run's.
    from membudget.replay_program import compile_program
    from membudget.trace import Trace, TraceOp, TraceTensor

    ops = [TraceOp(index=0, name="aten.native_dropout.default", phase="forward", category="elementwise", flops=0,
                   bytes_read=MiB, bytes_written=2 * MiB, duration_s=1e-3, outputs=[0, 1]),
           TraceOp(index=1, name="aten.sum.default", phase="forward", category="reduction", flops=0,
                   bytes_read=MiB, bytes_written=4, duration_s=1e-3, inputs=[1]),
           TraceOp(index=2, name="aten.mul.Tensor", phase="backward", category="elementwise", flops=0,
                   bytes_read=2 * MiB, bytes_written=MiB, duration_s=1e-3, inputs=[1, 0])]
    tensors = [TraceTensor(id=t, bytes=MiB, shape=(MiB // 4,), dtype="float32", producer=0, consumers=[2], saved=True,
                           dies_after=2, kind="activation") for t in (0, 1)]
    trace = Trace(ops=ops, tensors=tensors, pack_order=[1, 0], pack_ops=[1, 1], unpack_order=[0, 1],
                  unpack_ops=[2, 2])
    prog = compile_program(trace, [1e-3] * 3, "manager", min_tensor_bytes=1)
    packs = [tid for code, tid in zip(prog.codes, prog.tensors) if code == Code.PACK]
    assert packs == [1, 0], packs


def test_a_saved_tensor_is_released_where_the_step_let_it_go():
    # Note [Released by the step] (membudget.tracer): tensor 0 was let go
    # after the pack of tensor 1 (ahead of op 2), not after its last forward
    # use (op 1); tensor 2 (the batch, say) was held through forward, so
    # nothing releases it before backward unpacks it.
    from membudget.replay_program import compile_program
    from membudget.trace import Trace, TraceOp, TraceTensor

    def op(index, phase, inputs, outputs):
        return TraceOp(index=index, name="aten.mul.Tensor", phase=phase, category="elementwise", flops=0,
                       bytes_read=MiB, bytes_written=MiB, duration_s=1e-3, inputs=inputs, outputs=outputs)

    ops = [op(0, "forward", [], [2]), op(1, "forward", [2], [0]), op(2, "forward", [0], [1]),
           op(3, "forward", [1], [3]), op(4, "backward", [0, 1, 2], [4])]
    tensors = [TraceTensor(id=t, bytes=MiB, shape=(MiB // 4,), dtype="float32", producer=p, saved=s, dies_after=d,
                           kind="activation", released_before=rb, released_after_packs=ra)
               for t, p, s, d, rb, ra in [(0, 1, True, 4, 3, 3), (1, 2, True, 4, 3, 3), (2, 0, True, 4, -1, None),
                                          (3, 3, False, 3, None, None), (4, 4, False, 4, None, None)]]
    for t in tensors:
        t.consumers = [o.index for o in ops if t.id in o.inputs]
    trace = Trace(ops=ops, tensors=tensors, pack_order=[2, 0, 1], pack_ops=[1, 2, 3], unpack_order=[0, 1, 2],
                  unpack_ops=[4, 4, 4])
    prog = compile_program(trace, [1e-3] * 5, "manager", min_tensor_bytes=1)
    events = [(code, tid) for code, tid in zip(prog.codes, prog.tensors)
              if code in (Code.PACK, Code.RELEASE, Code.UNPACK, Code.COMPUTE)]
    computes = [i for i, (code, _) in enumerate(events) if code == Code.COMPUTE]
    # Before op 3 (the fourth compute): tensor 1's pack, then tensor 0's release.
    between = events[computes[2] + 1:computes[3]]
    assert between == [(Code.PACK, 1), (Code.RELEASE, 0), (Code.RELEASE, 1)], between
    # Tensor 2: no release before its unpack in backward.
    first_unpack = events.index((Code.UNPACK, 2))
    assert (Code.RELEASE, 2) not in events[:first_unpack], events


def test_host_time_runs_after_the_packs_and_before_the_unpacks():
    # Note [Host time between ops] (membudget.tracer): on the measured
    # durations, an op's host time goes on the compute stream after the
    # packs of what the previous op saved (a background copy-out runs
    # beside it) and before the op's unpacks; simulate() spends it only
    # when asked.
    from membudget.replay_program import compile_program, host_seconds
    from membudget.trace import Trace, TraceOp, TraceTensor

    def op(index, phase, inputs, outputs, host_s=0.0):
        return TraceOp(index=index, name="aten.mul.Tensor", phase=phase, category="elementwise", flops=0,
                       bytes_read=MiB, bytes_written=MiB, duration_s=1e-3, inputs=inputs, outputs=outputs,
                       host_s=host_s)

    ops = [op(0, "forward", [], [0]), op(1, "forward", [0], [1], host_s=0.5), op(2, "backward", [0, 1], [2], 0.25)]
    tensors = [TraceTensor(id=0, bytes=MiB, shape=(MiB // 4,), dtype="float32", producer=0, saved=True, dies_after=2,
                           kind="activation"),
               TraceTensor(id=1, bytes=MiB, shape=(MiB // 4,), dtype="float32", producer=1, dies_after=2,
                           kind="activation"),
               TraceTensor(id=2, bytes=MiB, shape=(MiB // 4,), dtype="float32", producer=2, dies_after=2,
                           kind="other")]
    for t in tensors:
        t.consumers = [o.index for o in ops if t.id in o.inputs]
    trace = Trace(ops=ops, tensors=tensors, pack_order=[0], pack_ops=[1], unpack_order=[0], unpack_ops=[2])
    host = host_seconds(trace, costs.device_model("h200"), measured=True)
    assert host == [0.0, 0.5, 0.25]
    assert host_seconds(trace, costs.device_model("h200")) == [0.0, 0.0, 0.0]  # roofline durations: no host time
    prog = compile_program(trace, [1e-3] * 3, "manager", min_tensor_bytes=1, host=host)
    events = [(code, tid, sec) for code, tid, sec in zip(prog.codes, prog.tensors, prog.seconds)
              if code in (Code.PACK, Code.UNPACK, Code.COMPUTE)]
    assert events == [(Code.COMPUTE, -1, 1e-3), (Code.PACK, 0, 0.0), (Code.COMPUTE, -1, 0.5), (Code.COMPUTE, -1, 1e-3),
                      (Code.COMPUTE, -1, 0.25), (Code.UNPACK, 0, 0.0), (Code.COMPUTE, -1, 1e-3)], events
    rows = {flag: membudget.simulate(trace, [1 << 30], ["delta"], "h200", baselines=(), min_tensor_bytes=1,
                                     measured=True, host_time=flag)[0] for flag in (False, True)}
    assert rows[True].compute_s == pytest.approx(rows[False].compute_s + 0.75)  # the measured iteration's


def test_backward_start_host_time_is_spent_by_default():
    # Note [Backward's start] (membudget.replay_program): of the traced host
    # gaps, only those from forward's last pack through backward's first op
    # (the loss returning, backward()'s seed gradient, the engine's start)
    # are spent by default; every gap with host_time=True, none with False.
    from membudget.replay_program import backward_start_seconds
    from membudget.trace import Trace, TraceOp, TraceTensor

    def op(index, phase, inputs, outputs, host_s):
        return TraceOp(index=index, name="aten.mul.Tensor", phase=phase, category="elementwise", flops=0,
                       bytes_read=MiB, bytes_written=MiB, duration_s=1e-3, inputs=inputs, outputs=outputs,
                       host_s=host_s)

    # op 1 (the loss) saves tensor 0, packed after it returns (pack op index 2); op 2 makes the seed
    # gradient, op 3 is backward's first; op 4 runs in backward after it.
    ops = [op(0, "forward", [], [0], 0.5), op(1, "forward", [0], [1], 0.25), op(2, "forward", [], [2], 0.125),
           op(3, "backward", [2], [3], 0.0625), op(4, "backward", [0, 3], [4], 2.0)]
    tensors = [TraceTensor(id=i, bytes=MiB, shape=(MiB // 4,), dtype="float32", producer=i, saved=(i == 0),
                           dies_after=4, kind="activation" if i < 2 else "other") for i in range(5)]
    for t in tensors:
        t.consumers = [o.index for o in ops if t.id in o.inputs]
    trace = Trace(ops=ops, tensors=tensors, pack_order=[0], pack_ops=[2], unpack_order=[0], unpack_ops=[4])
    assert backward_start_seconds(trace, costs.device_model("h200"), measured=True) == [0.0, 0.0, 0.125, 0.0625, 0.0]
    assert backward_start_seconds(trace, costs.device_model("h200")) == [0.0] * 5  # roofline durations: none
    no_pack = Trace(ops=ops, tensors=tensors, pack_order=[], pack_ops=[], unpack_order=[], unpack_ops=[])
    assert backward_start_seconds(no_pack, costs.device_model("h200"), measured=True) == [0.0, 0.0, 0.0, 0.0625, 0.0]
    rows = {flag: membudget.simulate(trace, [1 << 30], ["delta"], "h200", baselines=(), min_tensor_bytes=1,
                                     measured=True, **({} if flag == "default" else {"host_time": flag}))[0]
            for flag in (False, "default", True)}
    assert rows["default"].compute_s == pytest.approx(rows[False].compute_s + 0.1875)
    assert rows[True].compute_s == pytest.approx(rows[False].compute_s + 2.9375)
    with pytest.raises(ValueError, match="host_time"):
        membudget.simulate(trace, [1 << 30], ["delta"], "h200", baselines=(), host_time="forward")


def test_swapping_policies_swap_and_baselines_behave(gpt_trace):
    rows = {r.policy: r for r in membudget.simulate(gpt_trace, ["50%"], device="h200",
                                                    min_tensor_bytes=16 * 1024)}
    assert not rows["none"].feasible
    assert rows["swap-all"].recompute_s == 0 and rows["swap-all"].swap_bytes > 0
    assert rows["checkpoint-blocks"].recompute_s > 0 and rows["checkpoint-blocks"].swap_bytes == 0
    assert rows["delta"].feasible and rows["delta"].swap_bytes > 0
    # Prefetching ahead stalls less than copying back on demand.
    assert rows["offload-prefetch"].stall_s <= rows["swap-all"].stall_s


def test_decision_log_names_each_eviction(gpt_trace, monkeypatch, capfd):
    # MEMBUDGET_LOG=decisions: the simulated manager prints its decisions as
    # the runtime's does (docs/simulator.md); without it, nothing.
    rows = membudget.simulate(gpt_trace, ["50%"], ["delta"], "h200", baselines=(), min_tensor_bytes=16 * 1024)
    assert rows[0].feasible and "membudget: evict" not in capfd.readouterr().err
    monkeypatch.setenv("MEMBUDGET_LOG", "decisions")
    membudget.simulate(gpt_trace, ["50%"], ["delta"], "h200", baselines=(), min_tensor_bytes=16 * 1024)
    err = capfd.readouterr().err
    assert "membudget: evict" in err and "policy=delta" in err and "action=" in err


def test_cli_json_and_plot(gpt_trace, tmp_path, capsys):
    from membudget.cli import main

    path = tmp_path / "gpt.trace.gz"
    gpt_trace.save(path)
    png = tmp_path / "out.png"
    assert main(["simulate", str(path), "--budgets", "90%,50%", "--json", "--min-tensor-bytes", "16KiB",
                 "--plot", str(png)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["trace"]["model"] == "gpt-quick"
    assert len(data["rows"]) == 2 * (len(policies()) + len(BASELINES))
    assert {"policy", "budget_bytes", "feasible", "peak_reserved_bytes", "compute_s", "stall_s", "recompute_s",
            "swap_bytes", "overhead_ratio"} <= set(data["rows"][0])
    assert png.stat().st_size > 1000


def test_cli_table_and_bad_input(gpt_trace, tmp_path, capsys):
    from membudget.cli import main

    path = tmp_path / "gpt.trace.gz"
    gpt_trace.save(path)
    assert main(["simulate", str(path), "--budgets", "60%", "--no-floor", "--policies", "delta"]) == 0
    out = capsys.readouterr()
    assert "delta" in out.out and "checkpoint-blocks" in out.out and "24/" not in out.out
    assert main(["simulate", "--budgets", "60%"]) == 2
    assert main(["simulate", str(path), "--budgets", "lots"]) == 2
    assert main(["simulate", str(path), "--budgets", "60%", "--no-floor", "--iterations", "1"]) == 2
    assert "iterations must be at least 2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["simulate", str(path), "--actions", "evict"])


def test_cli_actions_and_iterations_reach_the_simulation(gpt_trace, tmp_path, capsys):
    from membudget.cli import main

    path = tmp_path / "gpt.trace.gz"
    gpt_trace.save(path)
    # At 80% of its peak this model fits with either action alone (at 50%
    # recompute-only runs out of memory).
    args = ["simulate", str(path), "--budgets", "80%", "--no-floor", "--policies", "delta", "--baselines", "",
            "--min-tensor-bytes", "16KiB", "--json"]
    results = {}
    for actions in ("swap", "recompute", "both"):
        for iterations in ("2", "4"):
            assert main(args + ["--actions", actions, "--iterations", iterations]) == 0
            data = json.loads(capsys.readouterr().out)
            assert data["actions"] == actions and data["iterations"] == int(iterations)
            (row,) = data["rows"]
            expected = membudget.simulate(gpt_trace, ["80%"], ["delta"], "h200", baselines=(),
                                          min_tensor_bytes=16 * 1024, actions=actions,
                                          iterations=int(iterations))[0].to_dict()
            assert row == expected
            results[actions, iterations] = row
    assert results["swap", "2"]["recompute_count"] == 0 < results["swap", "2"]["swap_bytes"]
    assert results["recompute", "2"]["swap_bytes"] == 0 < results["recompute", "2"]["recompute_count"]
    # The fourth step differs from the second here (it copies 1 MiB more), so
    # an --iterations that did not reach simulate would fail the equality above.
    assert results["swap", "2"] != results["swap", "4"]


def test_simulated_allocator_takes_the_segment_setting(gpt_trace):
    """expandable_segments reaches the simulated allocator: fixed segments (2
    and 20 MiB) and 2 MiB pages mapped on demand reserve differently, and both
    stay within every feasible budget."""
    budgets = ["100%", "80%", "60%"]
    expandable = membudget.simulate(gpt_trace, budgets, ["delta"], "h200", baselines=(), min_tensor_bytes=16 * 1024)
    fixed = membudget.simulate(gpt_trace, budgets, ["delta"], "h200", baselines=(), min_tensor_bytes=16 * 1024,
                               expandable_segments=False)
    assert [r.peak_reserved_bytes for r in expandable] != [r.peak_reserved_bytes for r in fixed]
    for r in expandable + fixed:
        assert not r.feasible or r.peak_reserved_bytes <= r.budget_bytes


def test_a_budget_above_the_device_acts_as_the_device():
    # Note [Budget above the device]: the watermark and the prefetch window
    # are fractions of the device's memory when the budget exceeds it, so a
    # budget of twice the device gives the very same step as one of the device.
    from membudget._native import load_extension

    size, n = 100_000_000, 10
    prog = Program(tensor_bytes=[size] * n)
    for i in range(n):
        _save(prog, i, 0.15)
    for i in reversed(range(n)):
        _use(prog, i, 0.3)
    capacity = 6 * size
    results = [load_extension().sim.replay(prog.tensor_bytes, prog.codes, prog.tensors, prog.seconds, 0, budget,
                                           capacity, 1e9, True, "delta", 0, 0.8, 2)
               for budget in (capacity, 2 * capacity)]
    keys = ("feasible", "total_s", "stall_s", "swap_out_bytes", "swap_in_bytes", "eviction_count")
    assert results[0]["feasible"] and results[0]["swap_out_bytes"] > 0
    assert {k: results[1][k] for k in keys} == {k: results[0][k] for k in keys}


def test_a_late_swap_in_is_not_held_back_by_the_prefetch_window():
    # Note [Due prefetches]. Forward saves B (300 MB), then S1 and S2 (50 MB
    # each); a 700 MB temporary sends all three to host. Backward uses S2,
    # S1, B, 0.1 s apart, over a 1 GB/s link. S2 is the first unpack, with
    # nothing prefetched yet: its 50 ms copy is a stall. Then S1 and B are
    # prefetched at once although B exceeds what the 100 MB window has left
    # beside S1: issued later it would only arrive later. S1 is ready 50 ms later, in time; B 350 ms later, used
    # 200 ms later: 150 ms of stall. Held back until S1's use (the window
    # alone) B would stall 200 ms.
    size_mb = [300, 50, 50, 700]
    prog = Program(tensor_bytes=[s * 1_000_000 for s in size_mb])
    for i in range(3):
        _save(prog, i, 0.5)
    _temporary(prog, 3, 0.5)
    for i in (2, 1, 0):
        _use(prog, i, 0.1)
    r = _manager_replay(prog, 800_000_000, prefetch_bytes=100_000_000)
    assert r["feasible"] and r["swap_in_bytes"] == 400_000_000
    assert r["unpack_stall_s"] == pytest.approx(0.05 + 0.15)


@pytest.mark.parametrize("compute_share, stall", [(1.0, 0.09), (0.5, 0.095)])
def test_copy_starts_a_latency_after_it_is_issued(compute_share, stall):
    # 10 ms of hand-off (the copy worker's wake-up) before a 0.1 s copy issued
    # ahead: it starts at 10 ms, and moves at the compute share's rate while
    # the 20 ms of compute run beside it, at the full rate once the free waits.
    prog = Program(tensor_bytes=[100_000_000])
    prog.emit(Code.ALLOC, 0)
    prog.emit(Code.OFFLOAD_ASYNC, 0)
    prog.emit(Code.COMPUTE, -1, 0.02)
    prog.emit(Code.FREE, 0)
    r = _replay(prog, budget=1 << 30, link_latency_s=0.01, link_compute_share=compute_share)
    assert r["stall_s"] == pytest.approx(stall)
    (copy,) = r["timeline"]["copies"]
    assert copy[3:] == pytest.approx((0.0, 0.01, 0.02 + stall))
    assert r["timeline"]["totals"]["copies_by_waiter.d2h"] == 0


def _one_sync_copy(size):
    """A ``size``-byte tensor copied to host synchronously, then freed."""
    prog = Program(tensor_bytes=[size])
    prog.emit(Code.ALLOC, 0)
    prog.emit(Code.OFFLOAD_SYNC, 0)
    prog.emit(Code.FREE, 0)
    return prog


def test_waiter_runs_a_copy_still_waiting_for_its_hand_off():
    # Note [Waiter runs the copy]: a synchronous copy is waited for at once;
    # the waiter takes it from the idle stream's queue and no hand-off is paid.
    r = _replay(_one_sync_copy(100_000_000), budget=1 << 30, link_latency_s=0.01, link_compute_share=0.5)
    assert r["stall_s"] == pytest.approx(0.1)
    (copy,) = r["timeline"]["copies"]
    assert copy[3:] == pytest.approx((0.0, 0.0, 0.1))
    assert r["timeline"]["totals"]["copies_by_waiter.d2h"] == 1


def test_a_copy_behind_a_running_one_pays_no_hand_off():
    # The worker is awake while its stream has work: a copy issued at 10.5 ms
    # behind one running from 10 ms to 11 ms starts at 11 ms, not 10 ms after
    # it was issued.
    prog = Program(tensor_bytes=[1_000_000, 1_000_000])
    prog.emit(Code.ALLOC, 0)
    prog.emit(Code.ALLOC, 1)
    prog.emit(Code.OFFLOAD_ASYNC, 0)
    prog.emit(Code.COMPUTE, -1, 0.0105)
    prog.emit(Code.OFFLOAD_ASYNC, 1)
    prog.emit(Code.COMPUTE, -1, 0.1)
    prog.emit(Code.FREE, 0)
    prog.emit(Code.FREE, 1)
    r = _replay(prog, budget=1 << 30, link_latency_s=0.01, link_compute_share=0.999)
    first, second = r["timeline"]["copies"]
    assert first[3:] == pytest.approx((0.0, 0.01, 0.011), rel=1e-3)
    assert second[3:] == pytest.approx((0.0105, 0.011, 0.012), rel=2e-3)


def _manager_replay(prog, budget, capacity=1 << 40, prefetch_bytes=0, link=1e9, high_watermark=0.8, **link_model):
    from membudget._native import load_extension

    return load_extension().sim.replay(prog.tensor_bytes, prog.codes, prog.tensors, prog.seconds, 0, budget,
                                       capacity, link, True, "delta", prefetch_bytes, high_watermark, 2,
                                       **link_model)


def test_eviction_rewinds_the_prefetch_cursor():
    # Note [Prefetch cursor]. Forward saves X, A, B (100 MB each). At
    # backward's first unpack (B) everything is resident, so the prefetcher
    # walks its cursor past every predicted use. Then a 300 MB temporary
    # sends X (used last) to host. Its use lies behind the cursor: unless the
    # eviction brings the cursor back, X is never prefetched, and its unpack
    # waits for the whole copy (0.1 s at 1 GB/s). With the rewind, the unpack
    # of A, 0.5 s before X's, issues X's copy-in and X arrives in time.
    size = 100_000_000
    prog = Program(tensor_bytes=[size, size, size, 3 * size])
    for t in (0, 1, 2):  # X, A, B
        _save(prog, t, 0.1)
    _use(prog, 2, 0.1)
    _temporary(prog, 3, 0.1)
    for t in (1, 0):
        _use(prog, t, 0.5)
    r = _manager_replay(prog, budget=450_000_000, prefetch_bytes=200_000_000)
    assert r["feasible"] and r["eviction_count"] == 1 and r["swap_in_bytes"] == size
    assert r["prefetch_misses"] == 0 and r["prefetch_hits"] == 1
    assert r["unpack_stall_s"] == pytest.approx(0.0, abs=1e-9)


def test_a_prefetch_waits_for_room_until_due():
    # Note [Prefetch waits to evict]. Forward saves X, A1, A2, A3 (100 MB
    # each); a 100 MB temporary sends X, needed after them, to host (450 MB
    # budget, 1 GB/s link); then R is saved. Backward unpacks A3, A2, A1, X,
    # R, 0.1 s apart. At A3's unpack X's copy-in (0.1 s) has no room but
    # would take R's, needed after it: evicting R then costs a 0.1 s copy out
    # on the allocation path. X's copy is not due before A2's unpack, when
    # A3's memory is free: waiting evicts nothing and X still arrives in time.
    size = 100_000_000
    x, a1, a2, a3, temporary, r = range(6)
    prog = Program(tensor_bytes=[size] * 6)
    for t in (x, a1, a2, a3):
        _save(prog, t, 0.1)
    _temporary(prog, temporary, 0.1)
    _save(prog, r, 0.1)
    for t in (a3, a2, a1, x, r):
        _use(prog, t, 0.1)
    result = _manager_replay(prog, budget=450_000_000, prefetch_bytes=400_000_000, high_watermark=1.0)
    assert result["feasible"] and result["eviction_count"] == 1
    assert result["swap_out_bytes"] == result["swap_in_bytes"] == size
    assert result["prefetch_hits"] == 1 and result["prefetch_misses"] == 0
    assert result["stall_s"] == pytest.approx(0.0, abs=1e-9)


def test_a_large_request_finds_address_room_without_evicting():
    # Note [Address headroom]. Nine 100 MB tensors fill the device's 1 GB
    # range up to 900 MB; the odd ones are temporaries, freed, leaving
    # 100 MB holes between the saved even ones. A 400 MB request then fits
    # the 950 MB budget once the holes' pages are released (500 + 400 MB),
    # but no 400 MB stretch of a device-sized address range is free: it would
    # have to evict saved tensors until one is. With an address range larger
    # than the device, it is backed in the never-used tail.
    size = 100_000_000
    prog = Program(tensor_bytes=[size] * 9 + [4 * size])
    for t in range(9):
        prog.emit(Code.ALLOC, t)
        prog.emit(Code.COMPUTE, -1, 0.01)
        if t % 2 == 0:
            prog.emit(Code.PACK, t)
            prog.emit(Code.RELEASE, t)
    for t in range(1, 9, 2):
        prog.emit(Code.FREE, t)
    _temporary(prog, 9, 0.01)
    for t in range(8, -1, -2):
        _use(prog, t, 0.01)
    # (No background copies: the watermark is the budget.)
    r = _manager_replay(prog, budget=950_000_000, capacity=1_000_000_000, high_watermark=1.0)
    assert r["feasible"] and r["peak_reserved_bytes"] <= 950_000_000
    assert r["eviction_count"] == 0 and r["swap_out_bytes"] == 0


def test_forward_copies_ahead_make_a_later_eviction_free():
    # Note [Copies ahead]. Forward saves X (100 MB), then a small Y, then
    # computes for 1 s while the link is idle, then a 100 MB temporary
    # needs X's memory (budget 150 MB). Backward uses Y, then X 0.5 s later.
    # The first iteration copies X out on the allocation path: 0.1 s of
    # stall at 1 GB/s. The measured (second) iteration, having seen that
    # eviction, copies X to host at Y's pack, during the idle second, so the
    # eviction only drops the device copy; X's copy-in, issued at Y's
    # unpack, arrives within the 0.5 s. (No background swap-out: the
    # watermark is the budget.)
    prog = Program(tensor_bytes=[100_000_000, 10_000_000, 100_000_000])
    for t, seconds in ((0, 0.1), (1, 0.1)):
        _save(prog, t, seconds)
    prog.emit(Code.COMPUTE, -1, 1.0)
    _temporary(prog, 2, 0.1)
    for t, seconds in ((1, 0.5), (0, 0.1)):
        _use(prog, t, seconds)
    r = _manager_replay(prog, budget=150_000_000, prefetch_bytes=200_000_000, high_watermark=1.0)
    assert r["feasible"] and r["eviction_count"] == 1
    assert r["swap_out_bytes"] == r["swap_in_bytes"] == 100_000_000
    assert r["stall_s"] == pytest.approx(0.0, abs=1e-9)
    assert r["prefetch_hits"] == 1
    # Note [Copies ahead where copies are free]: a device model that says
    # the runtime does not copy ahead there (cpu-host, as install() decides
    # on the CPU) is replayed without, whatever its link's compute share:
    # the copy out is on the allocation path again.
    off = _manager_replay(prog, budget=150_000_000, prefetch_bytes=200_000_000, high_watermark=1.0,
                          copies_ahead=False)
    assert off["feasible"] and off["swap_out_bytes"] == 100_000_000
    assert off["stall_s"] == pytest.approx(0.1, rel=1e-6)


def test_the_calibrated_host_model_never_copies_ahead():
    # install() copies ahead on CUDA only; a quiet machine calibrates a copy
    # beside compute at full rate, which must not turn copies ahead on in the
    # simulator (issue 4's validation swapped 111 MiB where the real CNN at
    # 60% swapped 39).
    assert costs.device_model("cpu-host").copies_ahead is False
    assert costs.device_model("h200").copies_ahead is True


def test_the_calibrated_host_model_has_a_rate_per_copy_size():
    # Note [Rate by copy size]: the host link is measured at each calibrated
    # size; the GPUs' links have one rate.
    cpu = costs.device_model("cpu-host")
    assert [size for size, _ in cpu.link_rate_by_size] == list(costs._LINK_RATE_SIZES)
    assert all(rate > 0 for _, rate in cpu.link_rate_by_size)
    assert costs.device_model("h200").link_rate_by_size == ()


def _pace_replay(unpack_x_after_v: bool):
    """Forward saves V (100 MB, replayable in 0.15 s), W (10 MB), A (100 MB)
    and, if ``unpack_x_after_v``, X (10 MB); backward unpacks A, W, V (then X)
    0.02 s apart, and a 100 MB temporary at A's unpack must evict V (budget
    250 MB, 1 GB/s link, no prefetch). Two iterations, the second measured."""
    size = 100_000_000
    prog = Program(tensor_bytes=[size, 10_000_000, size, size, 10_000_000])  # V, W, A, temporary, X
    prog.replay_seconds = [0.15, 0.0, 0.0, 0.0, 0.0]
    prog.replay_input_offsets = [0] * 6
    saved = ((0, 0.1), (1, 0.05), (2, 0.05)) + (((4, 0.05),) if unpack_x_after_v else ())
    for t, seconds in saved:
        _save(prog, t, seconds)
    prog.emit(Code.UNPACK, 2)
    _temporary(prog, 3, 0.02)
    prog.emit(Code.FREE, 2)
    for t in (1, 0, 4) if unpack_x_after_v else (1, 0):
        _use(prog, t, 0.02)
    from membudget._native import load_extension

    return load_extension().sim.replay(prog.tensor_bytes, prog.codes, prog.tensors, prog.seconds, 0, 250_000_000,
                                       1 << 40, 1e9, True, "delta", 0, 1.0, 2, "both", prog.replay_seconds,
                                       prog.replay_input_offsets, prog.replay_inputs)


def test_backward_pace_does_not_count_the_forward():
    # Note [Unpack pace]. V is needed one unpack after the eviction, 0.02 s
    # at backward's pace: swapping costs its 0.1 s copy out plus the 0.08 s
    # of its 0.1 s copy in that the 0.02 s cannot hide, more than the 0.15 s
    # replay, so it is dropped. Were the gap from the last backward's last
    # unpack to this one's first (0.22 s, a whole forward) taken as a sample
    # of the pace, it would read 0.07 s, the swap would look like 0.13 s and
    # win, and cost more than the replay.
    r = _pace_replay(unpack_x_after_v=False)
    assert r["feasible"] and r["eviction_count"] == 1
    assert r["recompute_count"] == 1 and r["swap_in_bytes"] == 0


def test_backward_pace_leaves_out_replays():
    # Note [Pace of backward's own ops]. As above, but X is unpacked after V,
    # so the first iteration's 0.15 s replay of V falls between two of its
    # unpacks (0.02 s of backward's own work apart). Taken as a sample of the
    # pace, it made V's use one unpack away look 0.06 s off in the second
    # iteration: the 0.1 s copy-in then looked 0.04 s short of hidden, the
    # swap 0.14 s, below the 0.15 s replay, and V was swapped: a 0.1 s copy
    # out and, with no prefetch, a 0.1 s copy in at its unpack. At backward's
    # own pace (0.02 s) the swap costs 0.18 s and V is dropped again.
    r = _pace_replay(unpack_x_after_v=True)
    assert r["feasible"] and r["eviction_count"] == 1
    assert r["recompute_count"] == 1 and r["swap_in_bytes"] == 0


def _lineage_replay(prog, budget, actions, iterations=2, policy="delta", **options):
    """``iterations`` through the manager with ``prog``'s replays declared and
    ``actions`` allowed (1 GB/s link, no prefetch, no watermark), measuring
    the last; ``options`` go to sim.replay as they are."""
    from membudget._native import load_extension

    return load_extension().sim.replay(prog.tensor_bytes, prog.codes, prog.tensors, prog.seconds, 0, budget,
                                       1 << 40, 1e9, True, policy, 0, 1.0, iterations, actions, prog.replay_seconds,
                                       prog.replay_input_offsets, prog.replay_inputs, **options)


def _recompute_only_replay(prog, budget, policy="delta"):
    """Two iterations through the manager with recompute only (no copies,
    no background swap-outs), measuring the second."""
    return _lineage_replay(prog, budget, "recompute", policy=policy)


def _last_eviction_program(tensor_bytes, replay_seconds):
    """Forward saves tensors 0 and 1 (replayable in `replay_seconds`) and a
    small 2; backward unpacks 2, then temporary 3 forces the step's last
    eviction, then 1 and 0 are unpacked."""
    prog = Program(tensor_bytes=tensor_bytes)
    prog.replay_seconds = [*replay_seconds, 0.0, 0.0]
    prog.replay_input_offsets = [0] * 5
    for t in (0, 1, 2):
        _save(prog, t, 0.1)
    _use(prog, 2, 0.1)
    _temporary(prog, 3, 0.1)
    for t in (1, 0):
        _use(prog, t, 0.1)
    return prog


def test_delta_values_no_memory_past_backwards_last_eviction():
    # Note [Pressure horizon]. Forward saves B and A (100 MiB each; B
    # replays in 0.03 s, A in 0.01 s) and a small W. Backward unpacks W,
    # then a 100 MiB temporary needs room under a 250 MiB budget: A or B
    # goes. A is needed next, B after it, and nothing is evicted later in
    # backward (nor was in the previous iteration), so memory held free past
    # this point serves nothing: the cheaper replay, A's, should go. Valued
    # in byte-seconds up to each one's next use, B, needed later, would go:
    # 0.03 s of replay instead of 0.01 s.
    prog = _last_eviction_program([100 * MiB, 100 * MiB, 10 * MiB, 100 * MiB], [0.03, 0.01])  # B, A, W, temporary
    r = _recompute_only_replay(prog, 250 * MiB)
    assert r["feasible"] and r["eviction_count"] == 1 and r["recompute_count"] == 1
    assert r["recompute_s"] == pytest.approx(0.01)


def _replay_overhead_program(w_bytes):
    """Forward saves U (50 MB), V (100 MB, replayed from U in 0.01 s) and W
    (``w_bytes``, not recomputable); W's allocation must evict, and V, a
    cheap replay, is dropped. Backward uses V (replayed: its allocation may
    have to evict W), then W and U."""
    prog = Program(tensor_bytes=[50_000_000, 100_000_000, w_bytes])
    prog.replay_seconds = [0.0, 0.01, 0.0]
    prog.replay_input_offsets = [0, 0, 1, 1]
    prog.replay_inputs = [0]
    for t in (0, 1, 2):
        _save(prog, t, 0.1)
    for t in (1, 2, 0):
        _use(prog, t, 0.1)
    return prog


def test_a_replay_dearer_than_its_estimate_is_learned():
    # Note [Replay overhead]. Each replay takes 1 s beyond its 0.01 s of ops
    # (the runtime's replay path on the CPU costs more than forward's ops).
    # The first iteration drops V and times its replay; from then on V costs
    # 0.01 s plus what was learned (0.25 s after one sample), more than
    # swapping it (0.25 s): the measured iteration swaps and replays nothing.
    # Priced by its ops alone, V would be dropped again: 1 s more a step.
    r = _lineage_replay(_replay_overhead_program(400_000_000), 500_000_000, "both", replay_overhead_s=1.0)
    assert r["feasible"] and r["eviction_count"] == 2
    assert (r["drop_count"], r["recompute_count"]) == (0, 0)


def test_waits_inside_a_replay_are_not_replay_overhead():
    # Note [Replay overhead]. V's replay must evict W (800 MB) first: a 0.8 s
    # synchronous copy-out inside the replay, which W's eviction costs with
    # or without it. The replay itself costs what it was estimated at, so V
    # stays a drop through the third iteration. Counted as the replay's, the
    # wait would price V at 0.36 s by then, over its 0.25 s swap, and the
    # step would pay the swap (2.45 s against 2.21).
    r = _lineage_replay(_replay_overhead_program(800_000_000), 900_000_000, "both", iterations=3)
    assert r["feasible"]
    assert (r["drop_count"], r["recompute_count"]) == (1, 1)
    assert r["total_s"] == pytest.approx(2.21)


def test_an_eviction_that_fits_in_one_victim_moves_where_pressure_ends():
    # Note [Pressure end without a mark], the allocator-aware first pass.
    # Forward saves C, B, A (100 MiB each; replays in 0.03, 0.02, 0.01 s)
    # and a small W. Backward unpacks W; a 100 MiB temporary (E1) must drop
    # one; then A is unpacked and a 200 MiB temporary (E2) needs room; then
    # B and C. Both requests are served by one victim whose block fits them
    # (the first pass), and such an eviction is pressure like any other: the
    # first iteration moves the end of pressure to E2, so at the second
    # one's E1 memory is known to stay short until E2, and delta drops B
    # (needed after E2), which leaves room for E2: one replay, 0.02 s.
    # Without it backward would look free of pressure from E1 on: delta
    # would drop A, the cheapest, needed at once, and E2 would drop B too:
    # 0.03 s.
    prog = Program(tensor_bytes=[100 * MiB, 100 * MiB, 100 * MiB, 10 * MiB, 100 * MiB, 200 * MiB])
    # C, B, A, W, E1's temporary, E2's temporary
    prog.replay_seconds = [0.03, 0.02, 0.01, 0.0, 0.0, 0.0]
    prog.replay_input_offsets = [0] * 7
    for t in (0, 1, 2, 3):
        _save(prog, t, 0.1)
    _use(prog, 3, 0.1)
    _temporary(prog, 4, 0.1)
    _use(prog, 2, 0.1)
    _temporary(prog, 5, 0.1)
    for t in (1, 0):
        _use(prog, t, 0.1)
    r = _recompute_only_replay(prog, 320 * MiB)
    assert r["feasible"]
    assert (r["eviction_count"], r["recompute_count"]) == (1, 1)
    assert r["recompute_s"] == pytest.approx(0.02)


def test_delta_weighs_only_the_bytes_a_request_misses():
    # Note [Bytes a request needs]. Forward saves L (100 MiB, replays in
    # 0.02 s), S (40 MiB, 0.01 s) and a small W. Backward unpacks W, then a
    # 30 MiB temporary needs room under a 160 MiB budget, the last eviction
    # of backward: either victim frees the 30 MiB. Per second of replay L
    # frees more bytes (5000 MiB/s against 4000), but 70 of its 100 MiB
    # serve nothing; of what the request misses, S frees twice as much per
    # second of replay. L would cost 0.02 s of replay, S costs 0.01 s.
    prog = _last_eviction_program([100 * MiB, 40 * MiB, 10 * MiB, 30 * MiB], [0.02, 0.01])  # L, S, W, temporary
    r = _recompute_only_replay(prog, 160 * MiB)
    assert r["feasible"] and r["eviction_count"] == 1 and r["recompute_count"] == 1
    assert r["recompute_s"] == pytest.approx(0.01)


def test_delta_counts_ancestors_a_replay_only_moves():
    # Note [Pressure horizon], ancestors. Forward saves A (100 MiB, replays
    # in 0.01 s) and X (100 MiB, replayed from A in 0.01 s); a 100 MiB
    # temporary under a 250 MiB budget drops A (needed last). Then Y (100
    # MiB, 0.025 s) and a small W. Backward unpacks W; a 100 MiB temporary
    # must drop X or Y, the last eviction of backward; Y is needed next, then
    # X, then A. Replaying X rebuilds A too, but A, dropped, is replayed
    # anyway: rebuilt with X it only comes back earlier, and stays, since no
    # eviction follows. X adds 0.01 s (A counted once more as X's dropped
    # neighbour, as in DTR: 0.02 s), less than Y's 0.025 s. Priced with A's
    # replay in X's as well (0.03 s), Y would go: 0.035 s of replay in all
    # instead of 0.02 s.
    prog = Program(tensor_bytes=[100 * MiB, 100 * MiB, 100 * MiB, 100 * MiB, 10 * MiB, 100 * MiB])
    # A, X, forward temporary, Y, W, backward temporary
    prog.replay_seconds = [0.01, 0.01, 0.0, 0.025, 0.0, 0.0]
    prog.replay_input_offsets = [0, 0, 1, 1, 1, 1, 1]
    prog.replay_inputs = [0]  # X is replayed from A
    for t in (0, 1):
        _save(prog, t, 0.1)
    _temporary(prog, 2, 0.1)
    for t in (3, 4):
        _save(prog, t, 0.1)
    _use(prog, 4, 0.1)
    _temporary(prog, 5, 0.1)
    for t in (3, 1, 0):
        _use(prog, t, 0.1)
    r = _recompute_only_replay(prog, 250 * MiB)
    assert r["feasible"] and r["eviction_count"] == 2 and r["recompute_count"] == 2
    assert r["recompute_s"] == pytest.approx(0.02)


def test_a_late_backlog_keeps_the_link_busy_past_the_window():
    # Note [Link behind]. Forward saves E1..E4 (100 MB each); a 500 MB
    # temporary under a 550 MB budget sends them to host; then twelve small
    # tensors. Backward unpacks the small ones 0.05 s apart, then E4..E1 back
    # to back, 0.05 s apart, over a 1 GB/s link (0.1 s a copy) with a 100 MB
    # prefetch window. One by one each copy-in is due only shortly before its
    # use (Note [Due prefetches]): held back by the window until then, E3,
    # E2 and E1 are issued as each falls due, queue behind one another and
    # arrive late (0.15 s of stall). Together they leave the link less than
    # 32 unpacks of slack, so all four are issued at backward's first
    # unpack and arrive in time.
    prog = Program(tensor_bytes=[100_000_000] * 4 + [500_000_000] + [1_000_000] * 12)
    for t in range(4):
        _save(prog, t, 0.05)
    _temporary(prog, 4, 0.05)
    for t in range(5, 17):
        _save(prog, t, 0.05)
    for t in [*range(16, 4, -1), 3, 2, 1, 0]:
        _use(prog, t, 0.05)
    r = _manager_replay(prog, 550_000_000, prefetch_bytes=100_000_000)
    assert r["feasible"] and r["swap_in_bytes"] == 400_000_000
    assert r["prefetch_hits"] == 4 and r["prefetch_misses"] == 0
    assert r["unpack_stall_s"] == pytest.approx(0.0, abs=1e-9)


def test_simulate_needs_two_iterations(gpt_trace):
    with pytest.raises(ValueError, match="iterations must be at least 2"):
        membudget.simulate(gpt_trace, ["50%"], ["delta"], "cpu-host", baselines=(), iterations=1)


def test_backward_evicts_only_what_a_request_misses():
    # Note [Request fits]. Forward saves A, B, C, D (60 MiB each, replayable)
    # and a small W under a 300 MiB budget: 50 MiB stay free. Backward
    # unpacks W, then a 150 MiB temporary asks the manager for its whole
    # size. No single victim frees enough with the free 50 MiB (110), so
    # victims go one by one, but two (120 + 50) make it fit: a third would
    # be replayed for nothing.
    prog = Program(tensor_bytes=[60 * MiB] * 4 + [10 * MiB, 150 * MiB])  # A, B, C, D, W, temporary
    prog.replay_seconds = [0.01] * 4 + [0.0, 0.0]
    prog.replay_input_offsets = [0] * 7
    for t in range(5):
        _save(prog, t, 0.1)
    _use(prog, 4, 0.1)
    _temporary(prog, 5, 0.1)
    for t in (3, 2, 1, 0):
        _use(prog, t, 0.1)
    for policy in ("delta", "dtr"):
        r = _recompute_only_replay(prog, 300 * MiB, policy)
        assert r["feasible"] and r["eviction_count"] == 2 and r["recompute_count"] == 2, (policy, r)


def test_background_copies_cover_the_largest_forward_request():
    # Note [Background target]. Forward saves five 18 MB tensors under a
    # 100 MB budget (watermark 80 MB), computes for 1 s while the link is
    # idle, then a 40 MB temporary asks eviction for its whole size. Copying
    # only the 10 MB above the watermark ahead leaves one host-backed victim
    # (18 MB): two more go out on the allocation path, 36 ms at 1 GB/s. Once
    # a forward has asked for 40 MB, the measured (second) iteration copies
    # three victims during the idle second and the eviction waits for none
    # (backward uses them 0.1 s apart: each copy ends well before its use).
    # The link is the CPU's (copies beside compute at half rate), where no
    # copies ahead (Note [Copies ahead]) would hide the first shortfall.
    size = 18_000_000
    prog = Program(tensor_bytes=[size] * 5 + [40_000_000])
    for t in range(5):
        _save(prog, t, 0.01)
    prog.emit(Code.COMPUTE, -1, 1.0)
    _temporary(prog, 5, 0.01)
    for t in range(4, -1, -1):
        _use(prog, t, 0.1)
    r = _manager_replay(prog, budget=100_000_000, link_compute_share=0.5, copies_ahead=False)
    assert r["feasible"] and r["peak_reserved_bytes"] <= 100_000_000
    assert r["swap_out_bytes"] >= 3 * size
    assert r["stall_s"] - r["unpack_stall_s"] == pytest.approx(0.0, abs=1e-9), r


def _both_actions_without_copies_ahead(prog):
    """``prog`` through the delta manager with both actions: a 150 MB budget,
    a 200 MB prefetch window, a 20% watermark, 1 GB/s, no copies ahead."""
    from membudget._native import load_extension

    return load_extension().sim.replay(prog.tensor_bytes, prog.codes, prog.tensors, prog.seconds, 0, 150_000_000,
                                       1 << 40, 1e9, True, "delta", 200_000_000, 0.2, 2, "both", prog.replay_seconds,
                                       prog.replay_input_offsets, prog.replay_inputs, copies_ahead=False)


def test_delta_releases_a_host_backed_victim_before_dropping_another():
    # Note [Host-backed victims]. Forward saves D (100 MB, replays in 0.03 s)
    # and R (20 MB, 0.01 s); a 100 MB temporary drops D (the only victim
    # that fits). Then H (20 MB, replayed from D in 0.05 s: the director
    # swaps it) and a small S, whose pack starts H's background copy-out
    # (watermark 20%); a second of compute completes it. A 120 MB temporary
    # needs one more victim: H, host-backed (its copy-in hides behind S's
    # and R's uses), or R. Priced with its dropped neighbour D's replay (DTR's
    # neighbourhood), H ranked below R and R was dropped: 0.04 s of replay
    # in all instead of D's 0.03 s.
    MB = 1_000_000
    prog = Program(tensor_bytes=[100 * MB, 20 * MB, 100 * MB, 20 * MB, 120 * MB, MB])  # D, R, T1, H, T2, S
    prog.replay_seconds = [0.03, 0.01, 0.0, 0.05, 0.0, 0.0]
    prog.replay_input_offsets = [0, 0, 0, 0, 1, 1, 1]
    prog.replay_inputs = [0]  # H is replayed from D
    for t in (0, 1):
        _save(prog, t, 0.1)
    _temporary(prog, 2, 0.1)
    for t, seconds in ((3, 0.1), (5, 0.01)):
        _save(prog, t, seconds)
    prog.emit(Code.COMPUTE, -1, 1.0)
    _temporary(prog, 4, 0.1)
    for t in (5, 1, 3, 0):
        _use(prog, t, 0.1)
    # No copies ahead: they would copy R and D to host too.
    r = _both_actions_without_copies_ahead(prog)
    assert r["feasible"] and r["eviction_count"] == 2, r
    assert r["recompute_count"] == 1 and r["recompute_s"] == pytest.approx(0.03), r
    assert r["swap_in_bytes"] == 20 * MB and r["stall_s"] == pytest.approx(0.0, abs=1e-9), r


def test_a_replays_inputs_are_not_positions_of_the_prediction(capfd):
    # Note [Replay inputs]. Forward saves ten 1 MiB inputs I0..I9, R (100
    # MiB, replayed from them) and X (100 MiB); a 200 MiB temporary under a
    # 250 MiB budget drops R and X. Backward unpacks R (its replay reads
    # I0..I9), then I9..I0, then X: backward's own unpacks put X at position
    # 11. Counting the replay's ten input materializations as unpacks placed
    # X at 21 in the next iteration's prediction, so every use after a
    # replay looked further away than it is (by backward's end at Llama-7B
    # 60% on h200, simulated: about 100 unpacks, 150 ms) and the prefetcher
    # and the director planned against slack that was not there.
    k = 10
    inputs, r, x, temporary = list(range(k)), k, k + 1, k + 2
    prog = Program(tensor_bytes=[MiB] * k + [100 * MiB, 100 * MiB, 200 * MiB])
    prog.replay_seconds = [0.0] * k + [0.01, 0.02, 0.0]
    prog.replay_input_offsets = [0] * (k + 1) + [k, k, k]
    prog.replay_inputs = inputs
    for t in [*inputs, r, x]:
        _save(prog, t, 0.01)
    _temporary(prog, temporary, 0.01)
    for t in [r, *reversed(inputs), x]:
        _use(prog, t, 0.01)
    from membudget._native import load_extension

    result = load_extension().sim.replay(prog.tensor_bytes, prog.codes, prog.tensors, prog.seconds, 0, 250 * MiB,
                                         1 << 40, 1e9, True, "delta", 0, 1.0, 2, "recompute", prog.replay_seconds,
                                         prog.replay_input_offsets, prog.replay_inputs, log_decisions=True)
    assert result["feasible"] and result["eviction_count"] == 2 and result["recompute_count"] == 2
    # The measured iteration's forward prices X against the last backward's order.
    logged = [line for line in capfd.readouterr().err.splitlines() if "iteration=1 phase=forward seq=11 " in line]
    assert len(logged) == 1 and "next_use=11 " in logged[0], logged


def test_a_copy_in_is_priced_at_the_faster_of_two_paces():
    # Note [Copy-in pace]. Forward saves eleven small W, R (20 MB, replays
    # in 0.5 ms), H (100 MB, 0.5 s: the director swaps it), S and two small
    # Y; S's pack starts H's background copy-out (watermark 20%), a second
    # of compute completes it. Backward unpacks S and the W 5 ms apart, but
    # one op takes 0.5 s: right after it the moving average of the pace is
    # about 0.13 s per unpack, the last backward's mean about 0.04 s. Then a
    # 40 MB temporary needs one victim: H, host-backed, needed two unpacks
    # later (its 0.1 s copy-in hidden at the average, 20 ms late at the
    # mean), or R. Priced at the average, H was released and its copy-in
    # came 90 ms late (the Y take 10 ms); at the faster pace R is dropped
    # and replayed in 0.5 ms.
    MB = 1_000_000
    w = list(range(11))
    r_, h, s, y1, y2, t = 11, 12, 13, 14, 15, 16
    prog = Program(tensor_bytes=[MB] * 11 + [20 * MB, 100 * MB, MB, MB, MB, 40 * MB])
    prog.replay_seconds = [0.0] * 11 + [0.0005, 0.5, 0.0, 0.0, 0.0, 0.0]
    prog.replay_input_offsets = [0] * 18
    for k in w + [r_, h, s, y1, y2]:
        _save(prog, k, 0.01)
    prog.emit(Code.COMPUTE, -1, 1.0)
    _use(prog, s, 0.005)
    for k in w[:9]:
        _use(prog, k, 0.005)
    _use(prog, w[9], 0.5)
    _use(prog, w[10], 0.005)
    _temporary(prog, t, 0.005)
    for k in (y1, y2, h, r_):
        _use(prog, k, 0.005)
    # No copies ahead: they would copy R to host too.
    r = _both_actions_without_copies_ahead(prog)
    assert r["feasible"] and r["eviction_count"] == 1, r
    assert r["recompute_count"] == 1 and r["recompute_s"] == pytest.approx(0.0005), r
    assert r["stall_s"] == pytest.approx(0.0, abs=1e-9), r


def test_a_copy_runs_at_the_rate_for_its_size():
    # Note [Rate by copy size]: 1 MB at 2 GB/s, 100 MB at 1 GB/s, and 10 MB
    # half-way between them in log size (1.5 GB/s); each copied synchronously.
    sizes = [1_000_000, 10_000_000, 100_000_000]
    points = [(1e6, 2e9), (1e8, 1e9)]
    for compute_share in (1.0, 0.5):  # the closed form and the piecewise path
        for size in sizes:
            r = _replay(_one_sync_copy(size), budget=1 << 30, link_compute_share=compute_share,
                        link_rate_by_size=points)
            rate = {1_000_000: 2e9, 10_000_000: 1.5e9, 100_000_000: 1e9}[size]
            assert r["stall_s"] == pytest.approx(size / rate), (size, compute_share)
    # Beyond the points the rate is the nearest point's; a rate must be positive.
    prog = _one_sync_copy(1000)
    assert _replay(prog, budget=1 << 30, link_rate_by_size=points)["stall_s"] == pytest.approx(1000 / 2e9)
    with pytest.raises(ValueError, match="rate_by_size"):
        _replay(prog, budget=1 << 30, link_rate_by_size=[(1e6, 0.0)])


def test_background_copies_stop_after_the_last_request_to_come():
    # Note [Requests to come]. Forward saves three 25 MB tensors under a
    # 100 MB budget (watermark 80 MB); a 40 MB temporary then evicts two of
    # them on the allocation path; two 28 MB tensors saved after it take
    # allocated to 81 MB, above the watermark, and no request comes after.
    # Covering the 40 MB request again from there copied out two more (53 MB
    # per step) for no eviction; the previous iteration says none is to come,
    # so only the 1 MB above the watermark is covered: one copy (25 MB). The
    # first iteration's record, made without a prediction, is read too: the
    # second iteration copies no more than the third (before, it covered the
    # largest forward request from every pack on).
    from membudget._native import load_extension

    small, large = 25_000_000, 28_000_000
    prog = Program(tensor_bytes=[small] * 3 + [40_000_000] + [large] * 2)
    for t in range(3):
        _save(prog, t, 0.01)
    _temporary(prog, 3, 0.01)
    for t in (4, 5):
        _save(prog, t, 0.01)
    prog.emit(Code.COMPUTE, -1, 1.0)
    for t in (5, 4, 2, 1, 0):
        _use(prog, t, 0.1)
    for iterations in (2, 3):
        r = load_extension().sim.replay(prog.tensor_bytes, prog.codes, prog.tensors, prog.seconds, 0, 100_000_000,
                                        1 << 40, 1e9, True, "delta", 0, 0.8, iterations, copies_ahead=False)
        assert r["feasible"] and r["peak_reserved_bytes"] <= 100_000_000
        assert r["eviction_count"] == 2, (iterations, r)
        # the two evicted and one copy (the third 25 MB tensor)
        assert r["swap_out_bytes"] == 3 * small, (iterations, r)


def _background_program(saved, temporaries):
    """Forward saves tensors of ``saved`` bytes, computes for 1 s while the
    link is idle, then allocates temporaries of ``temporaries`` bytes at
    once (no pack between them), each alive until all are made; backward
    uses the saved tensors 0.1 s apart, last saved first."""
    prog = Program(tensor_bytes=list(saved) + list(temporaries))
    first_temporary = len(saved)
    for t in range(first_temporary):
        _save(prog, t, 0.01)
    prog.emit(Code.COMPUTE, -1, 1.0)
    for t in range(first_temporary, len(prog.tensor_bytes)):
        prog.emit(Code.ALLOC, t)
        prog.emit(Code.COMPUTE, -1, 0.01)
    for t in range(first_temporary, len(prog.tensor_bytes)):
        prog.emit(Code.FREE, t)
    for t in reversed(range(first_temporary)):
        _use(prog, t, 0.1)
    return prog


def _measured_third_iteration(prog, budget):
    from membudget._native import load_extension

    return load_extension().sim.replay(prog.tensor_bytes, prog.codes, prog.tensors, prog.seconds, 0, budget,
                                       1 << 40, 1e9, True, "delta", 0, 0.8, 3, copies_ahead=False)


def test_background_copies_cover_a_request_below_the_watermark():
    # Note [Requests that will not fit]. Forward saves 40, 10 and 10 MB
    # under a 100 MB budget: 60 MB allocated, below the 80 MB watermark. A
    # 50 MB temporary then needs eviction. Below the watermark nothing was
    # copied ahead, and the eviction copied the 40 MB tensor out on the
    # allocation path (40 ms at 1 GB/s) though the link idled for a second
    # before it; the previous iteration said the request would come and not
    # fit, so the copies now run in that second and the eviction waits for
    # none.
    prog = _background_program([40_000_000, 10_000_000, 10_000_000], [50_000_000])
    r = _measured_third_iteration(prog, 100_000_000)
    assert r["feasible"] and r["peak_reserved_bytes"] <= 100_000_000 and r["eviction_count"] >= 1, r
    assert r["swap_out_bytes"] >= 50_000_000, r
    assert r["stall_s"] - r["unpack_stall_s"] == pytest.approx(0.0, abs=1e-9), r


def test_background_copies_cover_every_request_between_two_packs():
    # Note [Requests between two packs]. Forward saves six 15 MB tensors
    # under a 100 MB budget (90 MB, above the 80 MB watermark); two 30 MB
    # temporaries then come one after the other with no pack between, and
    # each needs 30 MB evicted. Covering the larger request alone (30 MB)
    # left the second to copy two tensors out on the allocation path (30 ms
    # at 1 GB/s); the previous iteration's evictions at that pack released
    # 60 MB, and that much is now copied during the idle second.
    prog = _background_program([15_000_000] * 6, [30_000_000, 30_000_000])
    r = _measured_third_iteration(prog, 100_000_000)
    assert r["feasible"] and r["peak_reserved_bytes"] <= 100_000_000, r
    assert r["swap_out_bytes"] >= 60_000_000, r
    assert r["stall_s"] - r["unpack_stall_s"] == pytest.approx(0.0, abs=1e-9), r


def test_background_copies_cover_every_eviction_still_to_come():
    # Note [Evictions still to come]. Forward saves six 15 MB tensors under
    # a 100 MB budget (90 MB, above the 80 MB watermark) and computes for 1 s
    # while the link idles. A 20 MB temporary then evicts two of them; one
    # small tensor is saved 10 ms later, and a second 20 MB temporary, the
    # first still alive, evicts two more. Covering one pack's evictions at a
    # time, the copies for the second were issued at the small tensor's pack
    # and the second request waited 20 ms for them (30 MB at 1 GB/s); all the
    # evictions still to come are now covered in the idle second.
    prog = Program(tensor_bytes=[15_000_000] * 6 + [20_000_000, 1_000_000, 20_000_000])
    for t in range(6):
        _save(prog, t, 0.01)
    prog.emit(Code.COMPUTE, -1, 1.0)
    prog.emit(Code.ALLOC, 6)
    prog.emit(Code.COMPUTE, -1, 0.01)
    _save(prog, 7, 0.01)
    prog.emit(Code.ALLOC, 8)
    prog.emit(Code.COMPUTE, -1, 0.01)
    prog.emit(Code.FREE, 6)
    prog.emit(Code.FREE, 8)
    for t in (7, 5, 4, 3, 2, 1, 0):
        _use(prog, t, 0.1)
    r = _measured_third_iteration(prog, 100_000_000)
    assert r["feasible"] and r["peak_reserved_bytes"] <= 100_000_000 and r["eviction_count"] >= 3, r
    assert r["stall_s"] - r["unpack_stall_s"] == pytest.approx(0.0, abs=1e-9), r


def test_backward_passes_over_one_fitting_victim_that_costs_more():
    # Note [One victim that costs more]. Forward saves H1, H2, H3 (10 MB
    # each, used last), B (30 MB, used first) and a small S under an 80 MB
    # budget, then computes for 1 s, in which all four are copied out in the
    # background. Backward unpacks S, then a 30 MB temporary finds 19 MB
    # free. Only B fits alone, and the allocator-aware pass released it: its
    # copy back in, needed at once, was a 30 ms stall (1 GB/s). The H ranked
    # first cost nothing to release, and with expandable segments two of
    # them make the request fit as well; their copies back in (no prefetch
    # here) take 10 ms each.
    MB = 1_000_000
    prog = Program(tensor_bytes=[10 * MB] * 3 + [30 * MB, MB, 30 * MB])  # H1, H2, H3, B, S, temporary
    for t in range(5):
        _save(prog, t, 0.01)
    prog.emit(Code.COMPUTE, -1, 1.0)
    _use(prog, 4, 0.01)
    _temporary(prog, 5, 0.01)
    for t in (3, 2, 1, 0):
        _use(prog, t, 0.1)
    r = _measured_third_iteration(prog, 80 * MB)
    assert r["feasible"] and r["peak_reserved_bytes"] <= 80 * MB, r
    assert r["eviction_count"] == 2 and r["stall_s"] == pytest.approx(0.02), r


def _forward_fit_program(b_replay_seconds):
    """Forward saves H1, H2, H3 (11 MB each, replayable in 1 ms), B (30 MB,
    replayable in ``b_replay_seconds``; 0: not at all) and a small S under
    an 80 MB budget; then a 30 MB temporary finds 16 MB free,
    and only B fits it alone. Backward uses S, B, then the H."""
    MB = 1_000_000
    prog = Program(tensor_bytes=[11 * MB] * 3 + [30 * MB, MB, 30 * MB])  # H1, H2, H3, B, S, temporary
    prog.replay_seconds = [0.001] * 3 + [b_replay_seconds, 0.0, 0.0]
    prog.replay_input_offsets = [0] * 7
    for t in range(5):
        _save(prog, t, 0.01)
    _temporary(prog, 5, 0.01)
    for t in (4, 3, 2, 1, 0):
        _use(prog, t, 0.1)
    return prog


@pytest.mark.parametrize("b_replay_seconds", [0.0, 0.002])
def test_forward_passes_over_one_fitting_victim_it_must_copy_out(b_replay_seconds):
    # Note [A copy on the allocation path]. B is the only victim that fits
    # the temporary alone. Not recomputable, releasing it meant a 30 ms
    # copy-out on the allocation path (1 GB/s) where dropping the three H
    # costs 3 ms of replay: they go instead, and nothing waits. A B that
    # replays in 2 ms is dropped, not copied, and is still the one taken:
    # only victims that must be copied out are passed over.
    MB = 1_000_000
    r = _lineage_replay(_forward_fit_program(b_replay_seconds), 80 * MB, "both", copies_ahead=False)
    assert r["feasible"] and r["peak_reserved_bytes"] <= 80 * MB, r
    assert r["stall_s"] == pytest.approx(0.0, abs=1e-9) and r["swap_out_bytes"] == 0, r
    if b_replay_seconds == 0.0:
        assert r["recompute_count"] == 3 and r["recompute_s"] == pytest.approx(0.003), r
    else:
        assert r["recompute_count"] == 1 and r["recompute_s"] == pytest.approx(0.002), r


def test_a_drop_that_became_a_copy_is_ranked_again():
    # Note [A drop that became a copy]. Forward saves X (10 MB, replays in
    # 4 ms), D (10 MB, replayed from X in 9 ms), E (10 MB, 6 ms) and a small
    # S; backward uses S, E, D, X. A 19 MB temporary needs two victims: X
    # ranks first (needed last), then D, then E. Once X is dropped, D's
    # replay rebuilds X too (13 ms) and the director copies D out instead: a
    # 10 ms wait on the allocation path (1 GB/s) that the order, priced
    # before X went, never saw. Priced again, D falls below E, which is
    # dropped: no wait, 10 ms of replays.
    MB = 1_000_000
    prog = Program(tensor_bytes=[10 * MB] * 3 + [MB, 19 * MB])  # X, D, E, S, temporary
    prog.replay_seconds = [0.004, 0.009, 0.006, 0.0, 0.0]
    prog.replay_input_offsets = [0, 0, 1, 1, 1, 1]
    prog.replay_inputs = [0]  # D is replayed from X
    for t in range(4):
        _save(prog, t, 0.01)
    _temporary(prog, 4, 0.01)
    for t in (3, 2, 1, 0):
        _use(prog, t, 0.01)
    r = _lineage_replay(prog, 40 * MB, "both", copies_ahead=False)
    assert r["feasible"] and r["peak_reserved_bytes"] <= 40 * MB, r
    assert r["stall_s"] == pytest.approx(0.0, abs=1e-9) and r["swap_out_bytes"] == 0, r
    assert r["recompute_count"] == 2 and r["recompute_s"] == pytest.approx(0.010), r


def test_decision_log_names_each_wait_for_a_copy(capfd):
    # MEMBUDGET_LOG=decisions names every copy an eviction waited for, so
    # that a step's stall outside the unpacks can be read off the log: with
    # swap only, the temporary copies B out on the allocation path (30 ms at
    # 1 GB/s, both iterations); the waits logged are the stall measured.
    MB = 1_000_000
    r = _lineage_replay(_forward_fit_program(0.0), 80 * MB, "swap", copies_ahead=False, log_decisions=True)
    waits = [float(line.split()[2].removesuffix("ms")) / 1e3 for line in capfd.readouterr().err.splitlines()
             if line.startswith("membudget: waited ")]
    assert r["feasible"] and r["stall_s"] - r["unpack_stall_s"] > 0.0, r
    assert len(waits) == 2 and waits[-1] == pytest.approx(r["stall_s"] - r["unpack_stall_s"], abs=1e-6), (waits, r)


@pytest.mark.parametrize("compute_copy_share, total", [(1.0, 0.1), (0.5, 0.15), (0.25, 0.175)])
def test_compute_beside_a_copy_runs_at_the_compute_copy_share(compute_copy_share, total):
    # Note [Compute beside a copy]. 100 MB out at 1 GB/s (0.1 s, the copy's
    # rate untouched by compute here) beside 0.1 s of compute: at share s the
    # compute does 0.1 * s of its work while the copy runs, the rest at full
    # rate once it is done. The copy ends before compute, so nothing stalls.
    prog = Program(tensor_bytes=[100_000_000])
    prog.emit(Code.ALLOC, 0)
    prog.emit(Code.OFFLOAD_ASYNC, 0)
    prog.emit(Code.COMPUTE, -1, 0.1)
    prog.emit(Code.FREE, 0)
    r = _replay(prog, budget=1 << 30, compute_copy_share=compute_copy_share)
    assert r["stall_s"] == pytest.approx(0.0, abs=1e-12)
    assert r["total_s"] == pytest.approx(total)
    assert r["compute_s"] == pytest.approx(0.1)  # the work, not the time it took
    (copy,) = r["timeline"]["copies"]
    assert copy[5] == pytest.approx(0.1)


def test_compute_and_copy_slow_each_other():
    # Both ways at half rate: over 0.2 s the copy moves 100 MB at 0.5 GB/s
    # and the compute does its 0.1 s of work at half speed; without a copy
    # the same compute takes 0.1 s.
    prog = Program(tensor_bytes=[100_000_000])
    prog.emit(Code.ALLOC, 0)
    prog.emit(Code.OFFLOAD_ASYNC, 0)
    prog.emit(Code.COMPUTE, -1, 0.1)
    prog.emit(Code.FREE, 0)
    r = _replay(prog, budget=1 << 30, link_compute_share=0.5, compute_copy_share=0.5)
    assert r["total_s"] == pytest.approx(0.2) and r["stall_s"] == pytest.approx(0.0, abs=1e-9)
    alone = Program(tensor_bytes=[100_000_000])
    alone.emit(Code.ALLOC, 0)
    alone.emit(Code.COMPUTE, -1, 0.1)
    alone.emit(Code.FREE, 0)
    assert _replay(alone, budget=1 << 30, compute_copy_share=0.5)["total_s"] == pytest.approx(0.1)


def test_the_calibrated_host_model_measures_compute_beside_a_copy():
    # Note [Compute beside a copy]: measured on the host, 1.0 on the GPUs.
    cpu = costs.device_model("cpu-host")
    assert 0.05 <= cpu.compute_copy_share <= 1.0
    assert "beside a copy" in cpu.note
    assert costs.device_model("h200").compute_copy_share == 1.0

// membudget._C.sim: the simulator's replay driver (csrc/sim/replay.h) bound
// for membudget/simulate.py. The program crosses as lists; the replay runs
// with the GIL released (it never calls Python).
#include <pybind11/stl.h>

#include "core/policy/filters.h"
#include "sim/replay.h"
#include "torch/bindings.h"

namespace py = pybind11;

namespace membudget {

namespace {

py::dict to_dict(const ReplayResult& r) {
  py::dict d;
  d["feasible"] = r.feasible;
  d["error"] = r.error;
  d["failed_instruction"] = r.failed_instruction;
  d["peak_reserved_bytes"] = r.peak_reserved_bytes;
  d["peak_allocated_bytes"] = r.peak_allocated_bytes;
  d["compute_s"] = r.compute_s;
  d["recompute_s"] = r.recompute_s;
  d["stall_s"] = r.stall_s;
  d["unpack_stall_s"] = r.unpack_stall_s;
  d["total_s"] = r.total_s;
  d["swap_out_bytes"] = r.swap_out_bytes;
  d["swap_in_bytes"] = r.swap_in_bytes;
  d["eviction_count"] = r.eviction_count;
  d["drop_count"] = r.drop_count;
  d["recompute_count"] = r.recompute_count;
  d["prefetch_hits"] = r.prefetch_hits;
  d["prefetch_misses"] = r.prefetch_misses;
  d["recomputed_ahead_count"] = r.recomputed_ahead_count;
  d["recompute_ahead_wasted"] = r.recompute_ahead_wasted;
  d["recompute_ahead_failed"] = r.recompute_ahead_failed;
  d["recompute_ahead_s"] = r.recompute_ahead_s;
  d["timeline"] = timeline_dict(r.copy_totals, r.copies, r.waits);
  return d;
}

}  // namespace

void bind_sim(py::module_& m) {
  py::module_ sim = m.def_submodule("sim", "trace replay over a modelled device (SimBackend)");
  sim.def(
      "replay",
      [](std::vector<uint64_t> tensor_bytes, std::vector<uint8_t> codes, std::vector<int64_t> tensors,
         std::vector<double> seconds, size_t prologue_length, size_t budget_bytes, size_t capacity_bytes,
         double link_bytes_per_s, bool use_manager, const std::string& policy, size_t prefetch_bytes,
         double high_watermark, int iterations, const std::string& actions, std::vector<double> replay_seconds,
         std::vector<int64_t> replay_input_offsets, std::vector<int64_t> replay_inputs, bool expandable_segments,
         bool log_decisions, bool recompute_ahead, double side_stream_overlap, bool record_timeline,
         double link_duplex_share, double link_compute_share, double link_latency_s, size_t page_bytes,
         bool copies_ahead, std::vector<std::pair<double, double>> link_rate_by_size, double compute_copy_share,
         double replay_overhead_s) {
        ReplayProgram program{std::move(tensor_bytes), std::move(codes), std::move(tensors), std::move(seconds),
                              prologue_length, std::move(replay_seconds), std::move(replay_input_offsets),
                              std::move(replay_inputs)};
        ReplayConfig config;
        config.budget_bytes = budget_bytes;
        config.capacity_bytes = capacity_bytes;
        config.link_bytes_per_s = link_bytes_per_s;
        config.use_manager = use_manager;
        config.manager.policy = policy;
        config.manager.prefetch_bytes = prefetch_bytes;
        config.manager.high_watermark = high_watermark;
        config.manager.actions = actions;
        config.manager.link_bytes_per_s = link_bytes_per_s;
        config.manager.log_decisions = log_decisions;
        config.manager.recompute_ahead = recompute_ahead;
        // Note [Copies ahead where copies are free]: as the runtime decides
        // per device, the modelled device decides here (DeviceModel.copies_ahead),
        // not the link's compute share.
        config.manager.copies_ahead = copies_ahead;
        config.side_stream_overlap = side_stream_overlap;
        config.iterations = iterations;
        config.expandable_segments = expandable_segments;
        config.record_timeline = record_timeline;
        config.link_duplex_share = link_duplex_share;
        config.page_bytes = page_bytes;
        config.link_latency_s = link_latency_s;
        config.link_compute_share = link_compute_share;
        config.replay_overhead_s = replay_overhead_s;
        config.link_rate_by_size = std::move(link_rate_by_size);
        config.compute_copy_share = compute_copy_share;
        ReplayResult result;
        {
          py::gil_scoped_release release;
          result = replay(program, config);
        }
        return to_dict(result);
      },
      py::arg("tensor_bytes"), py::arg("codes"), py::arg("tensors"), py::arg("seconds"),
      py::arg("prologue_length"), py::arg("budget_bytes"), py::arg("capacity_bytes"),
      py::arg("link_bytes_per_s"), py::arg("use_manager"), py::arg("policy"), py::arg("prefetch_bytes"),
      py::arg("high_watermark"), py::arg("iterations") = 2, py::arg("actions") = "swap",
      py::arg("replay_seconds") = std::vector<double>{}, py::arg("replay_input_offsets") = std::vector<int64_t>{},
      py::arg("replay_inputs") = std::vector<int64_t>{}, py::arg("expandable_segments") = true,
      py::arg("log_decisions") = false, py::arg("recompute_ahead") = false, py::arg("side_stream_overlap") = 0.25,
      py::arg("record_timeline") = false, py::arg("link_duplex_share") = 1.0, py::arg("link_compute_share") = 1.0,
      py::arg("link_latency_s") = 0.0, py::arg("page_bytes") = 0, py::arg("copies_ahead") = true,
      py::arg("link_rate_by_size") = std::vector<std::pair<double, double>>{},
      py::arg("compute_copy_share") = 1.0, py::arg("replay_overhead_s") = 0.0,
      "Replays a compiled program (membudget/simulate.py) through the real allocator and residency "
      "manager over a SimBackend; returns the measured iteration's numbers as a dict.");
  sim.def("policies", &filter_names, "Eviction policies (filters) the manager accepts.");
}

}  // namespace membudget

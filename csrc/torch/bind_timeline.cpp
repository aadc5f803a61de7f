// Note [Copy timeline] bound for Python: the installed runtime's HostBackend
// timeline (membudget._C.copy_timeline) and the conversion bind_sim.cpp uses
// for a replay's. A diagnostic: bench/bench_simulate.py `diagnose` compares
// the two.
#include <pybind11/stl.h>

#include <stdexcept>

#include "core/host_backend.h"
#include "torch/bindings.h"
#include "torch/runtime.h"

namespace py = pybind11;

namespace membudget {

py::dict timeline_dict(const CopyTotals& t, const std::vector<CopyRecord>& copy_records,
                       const std::vector<WaitRecord>& wait_records) {
  py::dict totals;
  const char* lanes[2] = {"d2h", "h2d"};
  for (int lane = 0; lane < 2; ++lane) {
    totals[py::str(std::string("copies.") + lanes[lane])] = t.copies[lane];
    totals[py::str(std::string("bytes.") + lanes[lane])] = t.bytes[lane];
    totals[py::str(std::string("busy_seconds.") + lanes[lane])] = t.busy_seconds[lane];
    totals[py::str(std::string("queued_seconds.") + lanes[lane])] = t.queued_seconds[lane];
    totals[py::str(std::string("copies_by_waiter.") + lanes[lane])] = t.copies_by_waiter[lane];
  }
  totals["waits"] = t.waits;
  totals["wait_seconds"] = t.wait_seconds;
  totals["recompute_wait_seconds"] = t.section_wait_seconds;
  py::list copies;
  for (const CopyRecord& c : copy_records) {
    copies.append(py::make_tuple(c.index, c.direction == CopyDirection::device_to_host ? "d2h" : "h2d", c.bytes,
                                 c.enqueued_s, c.started_s, c.finished_s));
  }
  py::list waits;
  for (const WaitRecord& w : wait_records) waits.append(py::make_tuple(w.copy, w.started_s, w.ended_s));
  py::dict d;
  d["totals"] = totals;
  d["copies"] = copies;
  d["waits"] = waits;
  return d;
}

py::dict timeline_dict(const CopyTimeline& timeline) {
  return timeline_dict(timeline.totals(), timeline.copies(), timeline.waits());
}

namespace {

CopyTimeline& runtime_timeline() {
  Runtime* runtime = Runtime::get();
  auto* host = runtime != nullptr ? dynamic_cast<HostBackend*>(&runtime->backend()) : nullptr;
  if (host == nullptr) throw std::runtime_error("copy_timeline: membudget is not installed on the cpu (HostBackend)");
  return host->copy_timeline();
}

}  // namespace

void bind_timeline(py::module_& m) {
  m.def(
      "copy_timeline", []() { return timeline_dict(runtime_timeline()); },
      "The installed HostBackend's copy timeline: totals (copies, bytes, busy and queued seconds per "
      "direction; blocking waits), and while recording, one (index, direction, bytes, enqueued_s, started_s, "
      "finished_s) per copy and one (copy index, started_s, ended_s) per blocking wait.");
  m.def(
      "set_copy_timeline",
      [](bool record, bool clear) {
        CopyTimeline& timeline = runtime_timeline();
        if (clear) timeline.clear();
        timeline.set_enabled(record);
      },
      py::arg("record"), py::arg("clear") = true,
      "Start (record=True) or stop keeping per-copy and per-wait records; clear=True forgets what was kept.");
}

}  // namespace membudget

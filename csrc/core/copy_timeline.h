// CopyTimeline: what a backend's copy streams did and how long the compute
// stream waited for them, so that a real run (HostBackend, wall-clock time)
// and its simulation (SimBackend, modelled time) can be compared copy by
// copy and wait by wait.
//
// Note [Copy timeline]: totals are always kept (a few additions under a
// mutex per copy, never on a path without a copy). The per-copy and per-wait
// records are kept only while enabled (a diagnostic: bench/bench_simulate.py
// `diagnose`). A copy has three times: enqueued (the manager asked for it),
// started (its copy stream reached it: the previous copies on that stream
// are done, on HostBackend the worker thread also had to be scheduled) and
// finished. A wait is a thread blocking on a copy's event that was not yet
// complete: on SimBackend exactly what SimClock::stall_seconds counts; on
// HostBackend any thread but a copy worker (the compute thread, or autograd's
// backward thread). Each wait names the copy it waited for, so a stall can be
// split into "the copy had not started" (queued behind others, or issued
// late) and "the copy was running" (the link's rate).
#pragma once
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <vector>

#include "core/backend.h"

namespace membudget {

struct CopyRecord {
  int64_t index = -1;  // set by add_copy: numbers every copy, never restarts
  CopyDirection direction = CopyDirection::device_to_host;
  size_t bytes = 0;
  double enqueued_s = 0.0;
  double started_s = 0.0;
  double finished_s = 0.0;
  bool by_waiter = false;  // run by the thread that waited for it (Note [Waiter runs the copy])
};

struct WaitRecord {
  int64_t copy = -1;  // CopyRecord::index of the copy waited for, -1 when not recorded
  double started_s = 0.0;
  double ended_s = 0.0;
};

// Sums over every copy and every blocking wait since the last clear().
struct CopyTotals {
  size_t copies[2] = {0, 0};          // indexed by CopyDirection
  size_t bytes[2] = {0, 0};
  double busy_seconds[2] = {0.0, 0.0};   // started -> finished
  double queued_seconds[2] = {0.0, 0.0}; // enqueued -> started
  size_t copies_by_waiter[2] = {0, 0};   // of copies, those their waiter ran
  size_t waits = 0;
  double wait_seconds = 0.0;
  // Of wait_seconds, the waits made by a thread inside a marked section (the
  // torch binding marks the replay of a dropped activation, whose own wall
  // time is counted as recompute).
  double section_wait_seconds = 0.0;
};

class CopyTimeline {
 public:
  // Records per copy and per wait from now on (or stops); totals are kept either way.
  void set_enabled(bool enabled);
  bool enabled() const;
  // Returns the copy's index (for WaitRecord::copy), -1 when records are off.
  // Indices keep counting across clear(), so that a wait on a copy issued
  // before the clear never names a later one.
  int64_t add_copy(const CopyRecord& record);
  void add_wait(const WaitRecord& record);
  CopyTotals totals() const;
  std::vector<CopyRecord> copies() const;
  std::vector<WaitRecord> waits() const;
  // Marks the calling thread as inside a section until leave_section()
  // (nestable; per thread, whichever timeline its waits go to).
  static void enter_section();
  static void leave_section();
  // Forgets records and totals.
  void clear();

 private:
  mutable std::mutex mutex_;
  bool enabled_ = false;
  int64_t next_index_ = 0;
  CopyTotals totals_;
  std::vector<CopyRecord> copies_;
  std::vector<WaitRecord> waits_;
};

}  // namespace membudget

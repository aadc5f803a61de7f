// SimLink: the copy streams of SimBackend and the link they share, on
// modelled time. See Note [Modelled time] in sim_backend.h.
//
// Note [Modelled link]: a GPU copies over a full-duplex link with DMA engines
// that run beside its kernels, so each direction is a FIFO served at the
// link's rate whatever else runs (LinkModel's defaults; a copy's end is known
// when it is issued). The host backend's "link" is memcpy on a worker thread
// per direction, sharing two CPU cores and one memory bus with the compute
// thread. Measured (bench/diagnose_stall.py, costs.py's calibration): with
// both directions copying at once each runs at a fraction of its rate alone
// (`duplex_share`: 0.5 would be one shared bus, 1.0 a full-duplex link), and
// a copy beside a busy compute thread runs at a fraction of its idle rate
// (`compute_share`); and a copy starts `latency_s` after it is issued at the
// earliest (the worker thread's wake-up: a synchronous swap-in of a small
// tensor on the host costs about as much in hand-offs as in memcpy), except
// that a copy waited for while it is still queued at the head of an idle
// stream starts at once (the waiter runs it itself: Note [Waiter runs the
// copy] in host_backend.cpp).
//
// Note [Compute beside a copy]: the contention goes both ways on the host.
// A memcpy thread takes memory bandwidth (and, on two cores, time) from the
// compute thread, so compute beside a running copy is slower too: an op runs
// at `compute_copy_share` of its modelled rate while either direction is
// moving bytes, at its full rate otherwise (calibrated by costs.py as the
// compute rate beside a copy over the rate alone). A background copy-out
// nobody needs is therefore not free on this device. A GPU's DMA engines
// leave its kernels alone: the share is 1.0 there.
//
// Note [Rate by copy size]: memcpy on the host is faster for copies whose
// buffers the caches still hold: HostBackend's copies of 0.25, 1, 4 and 8 MiB
// over 8 rotating buffers, warm, ran at 22, 30, 13 and 12 GB/s on this
// machine (32 MiB L3; costs.py's calibration, bench/RESULTS.md). The benches swap 0.5-2 MiB activations on the CNN and 4-8 MiB
// on GPT-2, so one calibrated rate cannot serve both (issue 4's validation:
// with the 4 MiB rate the CNN's copy waits came out 3x the measured). The
// cpu-host model therefore carries the rate at several sizes, and a copy runs
// at the rate interpolated for its size (linear in log bytes, clamped at the
// ends); the GPUs' links have one rate. Then a copy's rate changes whenever the other direction
// starts or ends, or the compute stream stalls (waiting for a copy frees the
// compute thread's core and bandwidth), so copies are advanced piecewise as the
// clock moves, and an event's end time is known only once its copy is done.
#pragma once
#include <cstddef>
#include <cstdint>
#include <deque>
#include <limits>
#include <memory>
#include <utility>
#include <vector>

#include "backend.h"
#include "copy_timeline.h"

namespace membudget {

// The shared clock of one simulated device; events point at it.
struct SimClock {
  double now = 0.0;           // seconds since the simulation started
  double stall_seconds = 0.0; // time the compute stream spent waiting for copies
  CopyTimeline timeline;      // Note [Copy timeline], on modelled time
};

// Note [Modelled link] as data (costs.py's DeviceModel carries the same fields).
struct LinkModel {
  double bytes_per_s = 1e10;   // one direction, alone, compute stream idle
  double duplex_share = 1.0;   // fraction of the rate each direction gets while both copy
  double compute_share = 1.0;  // fraction of the rate a copy gets while compute runs
  double latency_s = 0.0;      // from issue to the earliest start of a copy
  // Note [Rate by copy size]: (bytes, bytes per second) points, by bytes;
  // empty: every copy at `bytes_per_s`.
  std::vector<std::pair<double, double>> rate_by_size;
  // Note [Compute beside a copy]: fraction of its rate compute keeps while a
  // copy moves bytes.
  double compute_copy_share = 1.0;
  // One copy's rate, alone with the compute stream idle.
  double rate_for(size_t bytes) const;
  // The GPU case: each direction independent of everything else, no
  // hand-off, compute never slowed (the closed form knows each copy's end
  // when it is issued).
  bool independent() const {
    return duplex_share >= 1.0 && compute_share >= 1.0 && latency_s <= 0.0 && compute_copy_share >= 1.0;
  }
};

// One copy on a modelled copy stream.
struct SimCopy {
  CopyDirection direction = CopyDirection::device_to_host;
  size_t bytes = 0;
  double remaining = 0.0;   // bytes still to move (piecewise path)
  double rate = 0.0;        // LinkModel::rate_for(bytes)
  double enqueued_s = 0.0;
  double ready_s = 0.0;     // enqueued_s + the link's latency: it cannot start before
  double started_s = -1.0;  // when it reached the head of its stream (and was ready)
  double done_at = std::numeric_limits<double>::infinity();
  int64_t index = -1;       // its CopyRecord::index once recorded
  bool by_waiter = false;   // Note [Waiter runs the copy]
};

class SimLink {
 public:
  SimLink(std::shared_ptr<SimClock> clock, const LinkModel& model);

  // Queues a copy behind the stream's earlier ones.
  std::shared_ptr<SimCopy> enqueue(CopyDirection direction, size_t bytes);
  // The compute stream runs `seconds` of work (its modelled time alone);
  // copies progress beside it, and slow it (Note [Compute beside a copy]).
  void run_compute(double seconds);
  // The compute stream waits until `copy` is done (counted as stall).
  void wait_for(const SimCopy& copy);
  // The compute stream waits until `until` for work off the link (a replay on
  // the side stream, Note [Side stream contention]); counted as stall, and
  // copies progress as they do while it waits for one of them.
  void wait_until(double until);
  // Copies queued on `direction` and not done by now.
  size_t pending(CopyDirection direction);
  // Seconds one copy of `bytes` takes alone with the compute stream idle.
  double copy_seconds(size_t bytes) const;
  const LinkModel& model() const { return model_; }

 private:
  // Moves the clock to `until` (or until `stop` is done, or the compute
  // work `*compute_left` is done, when given), copies progressing at the
  // rates of Note [Modelled link] and compute at Note [Compute beside a copy].
  void advance(double until, bool computing, const SimCopy* stop, double* compute_left = nullptr);
  void finish_head(int lane);

  std::shared_ptr<SimClock> clock_;
  const LinkModel model_;
  std::deque<std::shared_ptr<SimCopy>> lanes_[2];  // indexed by CopyDirection
  double lane_free_at_[2] = {0.0, 0.0};           // independent path: end of the last copy
};

}  // namespace membudget

#include "sim_link.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace membudget {

double LinkModel::rate_for(size_t bytes) const {
  if (rate_by_size.empty()) return bytes_per_s;
  const double size = std::max(1.0, static_cast<double>(bytes));
  if (size <= rate_by_size.front().first) return rate_by_size.front().second;
  if (size >= rate_by_size.back().first) return rate_by_size.back().second;
  for (size_t i = 1; i < rate_by_size.size(); ++i) {
    const auto& [hi_bytes, hi_rate] = rate_by_size[i];
    if (size > hi_bytes) continue;
    const auto& [lo_bytes, lo_rate] = rate_by_size[i - 1];
    const double t = std::log(size / lo_bytes) / std::log(hi_bytes / lo_bytes);
    return lo_rate + t * (hi_rate - lo_rate);
  }
  return rate_by_size.back().second;
}

namespace {

// The model with its rate points in order of size; refuses points that
// cannot be a rate.
LinkModel checked(LinkModel model) {
  if (!(model.compute_copy_share > 0.0 && model.compute_copy_share <= 1.0)) {
    throw std::invalid_argument("LinkModel: compute_copy_share must be in (0, 1]");
  }
  std::sort(model.rate_by_size.begin(), model.rate_by_size.end());
  for (const auto& [bytes, rate] : model.rate_by_size) {
    if (!(bytes > 0.0) || !(rate > 0.0)) {
      throw std::invalid_argument("LinkModel: rate_by_size needs positive sizes and rates");
    }
  }
  return model;
}

}  // namespace

SimLink::SimLink(std::shared_ptr<SimClock> clock, const LinkModel& model)
    : clock_(std::move(clock)), model_(checked(model)) {}

double SimLink::copy_seconds(size_t bytes) const { return static_cast<double>(bytes) / model_.rate_for(bytes); }

std::shared_ptr<SimCopy> SimLink::enqueue(CopyDirection direction, size_t bytes) {
  const int lane = static_cast<int>(direction);
  auto copy = std::make_shared<SimCopy>();
  copy->direction = direction;
  copy->bytes = bytes;
  copy->remaining = static_cast<double>(bytes);
  copy->rate = model_.rate_for(bytes);
  copy->enqueued_s = clock_->now;
  // The hand-off is the worker's wake-up: behind a queued copy the worker is
  // awake and takes this one as soon as the one before it is done.
  const bool worker_awake = pending(direction) > 0;
  copy->ready_s = clock_->now + (worker_awake ? 0.0 : model_.latency_s);
  if (model_.independent()) {
    // Closed form: a FIFO at a fixed rate (Note [Modelled time]).
    const double start = std::max(copy->ready_s, lane_free_at_[lane]);
    copy->started_s = start;
    copy->done_at = start + static_cast<double>(bytes) / copy->rate;
    lane_free_at_[lane] = copy->done_at;
    copy->index = clock_->timeline.add_copy(CopyRecord{-1, direction, bytes, clock_->now, start, copy->done_at});
  } else if (lanes_[lane].empty()) {
    copy->started_s = copy->ready_s;
  }
  lanes_[lane].push_back(copy);
  return copy;
}

void SimLink::run_compute(double seconds) {
  if (model_.independent()) {
    clock_->now += std::max(0.0, seconds);
    return;
  }
  if (model_.compute_copy_share >= 1.0) {  // compute's end is known now
    advance(clock_->now + std::max(0.0, seconds), /*computing=*/true, nullptr);
    return;
  }
  double left = std::max(0.0, seconds);
  advance(std::numeric_limits<double>::infinity(), /*computing=*/true, nullptr, &left);
}

void SimLink::wait_for(const SimCopy& copy) {
  if (copy.done_at <= clock_->now) return;
  const double start = clock_->now;
  if (model_.independent()) {
    clock_->now = copy.done_at;
  } else {
    // Note [Waiter runs the copy]: still waiting out its hand-off at the head
    // of its stream, it starts now.
    auto& lane = lanes_[static_cast<int>(copy.direction)];
    if (!lane.empty() && lane.front().get() == &copy && copy.ready_s > clock_->now) {
      lane.front()->ready_s = clock_->now;
      lane.front()->started_s = clock_->now;
      lane.front()->by_waiter = true;
    }
    advance(std::numeric_limits<double>::infinity(), /*computing=*/false, &copy);
  }
  clock_->timeline.add_wait(WaitRecord{copy.index, start, clock_->now});
  clock_->stall_seconds += clock_->now - start;
}

void SimLink::wait_until(double until) {
  if (until <= clock_->now) return;
  const double start = clock_->now;
  if (model_.independent()) {
    clock_->now = until;
  } else {
    advance(until, /*computing=*/false, nullptr);
  }
  clock_->stall_seconds += clock_->now - start;
}

size_t SimLink::pending(CopyDirection direction) {
  auto& lane = lanes_[static_cast<int>(direction)];
  // Ends are increasing within one stream: drop the finished front.
  while (!lane.empty() && lane.front()->done_at <= clock_->now) lane.pop_front();
  return lane.size();
}

void SimLink::finish_head(int lane) {
  std::shared_ptr<SimCopy> copy = lanes_[lane].front();
  lanes_[lane].pop_front();
  copy->remaining = 0.0;
  copy->done_at = clock_->now;
  copy->index = clock_->timeline.add_copy(
      CopyRecord{-1, copy->direction, copy->bytes, copy->enqueued_s, copy->started_s, copy->done_at, copy->by_waiter});
  if (!lanes_[lane].empty()) {
    SimCopy& next = *lanes_[lane].front();
    next.started_s = std::max(clock_->now, next.ready_s);
  }
}

void SimLink::advance(double until, bool computing, const SimCopy* stop, double* compute_left) {
  constexpr double kNever = std::numeric_limits<double>::infinity();
  for (;;) {
    if (stop != nullptr && stop->done_at <= clock_->now) return;
    if (compute_left != nullptr && *compute_left <= 0.0) return;
    // A lane moves bytes once its head copy is ready (Note [Modelled link]).
    bool active[2];
    double next_ready = kNever;
    for (int lane = 0; lane < 2; ++lane) {
      active[lane] = !lanes_[lane].empty() && lanes_[lane].front()->ready_s <= clock_->now;
      if (!lanes_[lane].empty() && !active[lane]) next_ready = std::min(next_ready, lanes_[lane].front()->ready_s);
    }
    double share = computing ? model_.compute_share : 1.0;
    if (active[0] && active[1]) share *= model_.duplex_share;
    double rate[2] = {0.0, 0.0};
    for (int lane = 0; lane < 2; ++lane) {
      if (active[lane]) rate[lane] = lanes_[lane].front()->rate * share;
    }
    // Rates are constant until a head copy finishes or a waiting one becomes
    // ready, or the compute work runs out.
    double step = next_ready - clock_->now;
    for (int lane = 0; lane < 2; ++lane) {
      if (active[lane]) step = std::min(step, lanes_[lane].front()->remaining / rate[lane]);
    }
    // Note [Compute beside a copy]: work done per second of the clock.
    const double compute_rate = active[0] || active[1] ? model_.compute_copy_share : 1.0;
    const double compute_step = compute_left != nullptr ? *compute_left / compute_rate : kNever;
    step = std::min(step, compute_step);
    if (step == kNever) {  // nothing queued
      if (until != kNever) clock_->now = std::max(clock_->now, until);
      return;
    }
    if (clock_->now + step > until) {
      for (int lane = 0; lane < 2; ++lane) {
        if (active[lane]) lanes_[lane].front()->remaining -= rate[lane] * (until - clock_->now);
      }
      if (compute_left != nullptr) *compute_left -= compute_rate * (until - clock_->now);
      clock_->now = until;
      return;
    }
    for (int lane = 0; lane < 2; ++lane) {
      if (active[lane]) lanes_[lane].front()->remaining -= rate[lane] * step;
    }
    if (compute_left != nullptr) *compute_left = step >= compute_step ? 0.0 : *compute_left - compute_rate * step;
    clock_->now += step;
    for (int lane = 0; lane < 2; ++lane) {
      // The head(s) that set `step` are done; rounding leaves at most a few
      // bytes' worth of residue on them.
      const SimCopy* head = active[lane] ? lanes_[lane].front().get() : nullptr;
      if (head != nullptr && head->remaining <= 1e-6 * static_cast<double>(head->bytes) + 1e-3) finish_head(lane);
    }
  }
}

}  // namespace membudget

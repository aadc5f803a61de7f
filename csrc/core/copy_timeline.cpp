#include "core/copy_timeline.h"

namespace membudget {

namespace {
thread_local int section_depth = 0;
}  // namespace

void CopyTimeline::enter_section() { ++section_depth; }

void CopyTimeline::leave_section() { --section_depth; }

void CopyTimeline::set_enabled(bool enabled) {
  std::lock_guard<std::mutex> lock(mutex_);
  enabled_ = enabled;
}

bool CopyTimeline::enabled() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return enabled_;
}

int64_t CopyTimeline::add_copy(const CopyRecord& record) {
  std::lock_guard<std::mutex> lock(mutex_);
  const int lane = static_cast<int>(record.direction);
  ++totals_.copies[lane];
  totals_.bytes[lane] += record.bytes;
  totals_.busy_seconds[lane] += record.finished_s - record.started_s;
  totals_.queued_seconds[lane] += record.started_s - record.enqueued_s;
  if (record.by_waiter) ++totals_.copies_by_waiter[lane];
  if (!enabled_) return -1;
  copies_.push_back(record);
  copies_.back().index = next_index_;
  return next_index_++;
}

void CopyTimeline::add_wait(const WaitRecord& record) {
  std::lock_guard<std::mutex> lock(mutex_);
  ++totals_.waits;
  totals_.wait_seconds += record.ended_s - record.started_s;
  if (section_depth > 0) totals_.section_wait_seconds += record.ended_s - record.started_s;
  if (enabled_) waits_.push_back(record);
}

CopyTotals CopyTimeline::totals() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return totals_;
}

std::vector<CopyRecord> CopyTimeline::copies() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return copies_;
}

std::vector<WaitRecord> CopyTimeline::waits() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return waits_;
}

void CopyTimeline::clear() {
  std::lock_guard<std::mutex> lock(mutex_);
  totals_ = CopyTotals{};
  copies_.clear();
  waits_.clear();
}

}  // namespace membudget

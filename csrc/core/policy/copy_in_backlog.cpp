#include "core/policy/copy_in_backlog.h"

#include <algorithm>
#include <limits>

namespace membudget {
namespace {
constexpr double kNone = -std::numeric_limits<double>::infinity();
}  // namespace

CopyInBacklog::CopyInBacklog(size_t queued_bytes, double link_bytes_per_s)
    : queued_bytes_(static_cast<double>(queued_bytes)), link_bytes_per_s_(std::max(link_bytes_per_s, 1.0)) {}

void CopyInBacklog::add(double seconds_available, size_t bytes) {
  needs_.push_back(Need{std::max(seconds_available, 0.0), static_cast<double>(bytes)});
}

void CopyInBacklog::seal() {
  std::stable_sort(needs_.begin(), needs_.end(), [](const Need& a, const Need& b) { return a.available < b.available; });
  const size_t n = needs_.size();
  bytes_before_.assign(n + 1, queued_bytes_);
  late_prefix_.assign(n + 1, kNone);
  late_suffix_.assign(n + 1, kNone);
  for (size_t i = 0; i < n; ++i) {
    bytes_before_[i + 1] = bytes_before_[i] + needs_[i].bytes;
  }
  // Lateness of need i: its arrival (bytes up to and including it) minus its deadline.
  for (size_t i = 0; i < n; ++i) {
    const double late = bytes_before_[i + 1] / link_bytes_per_s_ - needs_[i].available;
    late_prefix_[i + 1] = std::max(late_prefix_[i], late);
  }
  for (size_t i = n; i-- > 0;) {
    const double late = bytes_before_[i + 1] / link_bytes_per_s_ - needs_[i].available;
    late_suffix_[i] = std::max(late_suffix_[i + 1], late);
  }
}

double CopyInBacklog::stall_seconds() const {
  return std::max(late_prefix_.empty() ? kNone : late_prefix_.back(), 0.0);
}

double CopyInBacklog::max_lateness_seconds() const { return late_prefix_.empty() ? kNone : late_prefix_.back(); }

double CopyInBacklog::added_stall_seconds(double seconds_available, size_t bytes) const {
  const double available = std::max(seconds_available, 0.0);
  const double extra = static_cast<double>(bytes);
  // Needs at the same time go first (ties keep their place, as in seal()).
  const size_t k = static_cast<size_t>(
      std::upper_bound(needs_.begin(), needs_.end(), available,
                       [](double a, const Need& need) { return a < need.available; }) -
      needs_.begin());
  const double before = late_prefix_.empty() ? kNone : late_prefix_[k];
  const double own = ((late_prefix_.empty() ? queued_bytes_ : bytes_before_[k]) + extra) / link_bytes_per_s_ - available;
  const double after = late_suffix_.empty() ? kNone : late_suffix_[k] + extra / link_bytes_per_s_;
  const double with = std::max({before, own, after, 0.0});
  return std::max(with - stall_seconds(), 0.0);
}

}  // namespace membudget

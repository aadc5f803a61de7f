// Byte units and the allocator's size constants, named once with their units.
#pragma once
#include <cstddef>
#include <string>

namespace membudget {

constexpr size_t kKiB = 1024;
constexpr size_t kMiB = 1024 * kKiB;
constexpr size_t kGiB = 1024 * kMiB;

// Every block size is a multiple of this; it is also the pointer alignment.
constexpr size_t kMinBlockSize = 512;
// Requests up to this size are served from the small pool.
constexpr size_t kSmallSize = 1 * kMiB;
// Segment size requested for the small pool.
constexpr size_t kSmallBuffer = 2 * kMiB;
// Segment size requested for large requests below kMinLargeAlloc.
constexpr size_t kLargeBuffer = 20 * kMiB;
// Large requests at or above this get a segment of their own (rounded up).
constexpr size_t kMinLargeAlloc = 10 * kMiB;
// Rounding of segments for large requests.
constexpr size_t kRoundLarge = 2 * kMiB;

// "1.50 GiB", "512 B": for error messages and reprs.
std::string format_bytes(size_t bytes);

}  // namespace membudget

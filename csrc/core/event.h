// Completion events shared by the backends, the allocator and the residency
// manager. An event marks a point in a stream's queue of work.
#pragma once
#include <memory>

namespace membudget {

// A stream handle as the device knows it: cudaStream_t for CUDA, and for the
// host backend nullptr (the compute stream, i.e. the calling thread).
using Stream = void*;

class Event {
 public:
  virtual ~Event() = default;
  // True once all work before the event has finished. Never blocks.
  virtual bool ready() = 0;
  // Blocks the calling host thread until ready().
  virtual void wait() = 0;
};

using EventPtr = std::shared_ptr<Event>;

// An event that is complete from the start: work already done.
class CompletedEvent final : public Event {
 public:
  bool ready() override { return true; }
  void wait() override {}
};

}  // namespace membudget

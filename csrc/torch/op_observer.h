// A probe for the C++ lineage fast path (issue 3): what observing forward ops
// from C++ costs per op, before any recording. See Note [Op observer probe].
#pragma once
#include <cstdint>

#include <torch/extension.h>

namespace membudget {

// Totals since observe_ops_start(): ops seen at depth 0 on the observing
// thread with grad mode on, and tensors captured from their inputs/outputs.
struct ObservedOpCounts {
  int64_t ops = 0;
  int64_t tensors = 0;
};

// Registers the thread-local RecordFunction callback on the calling thread.
// Throws if it is already registered.
void observe_ops_start();
// Removes it; returns what it saw. Throws if it is not registered.
ObservedOpCounts observe_ops_stop();

// Binds both (observe_ops_start / observe_ops_stop). Declared here rather
// than in bindings.h, which every binding file includes.
void bind_op_observer(pybind11::module_& m);

}  // namespace membudget

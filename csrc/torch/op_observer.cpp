// Note [Op observer probe]: the Python lineage recorder is a TorchDispatchMode,
// and a Python mode costs 5-15 us per op on this machine before it records
// anything (bench/bench_lineage.py, noop-mode) -- above the 10 us target by
// itself. The C++ alternative the issue names is a thread-local
// at::RecordFunction callback that asks for inputs and outputs and records
// the ops at depth 0 (the ops the user's code called; nested ones run inside
// them). This probe is that callback with the recording replaced by the
// capture a recorder needs at least -- per tensor: storage, version, sizes,
// strides, offset, dtype -- into a reused buffer, so that bench_lineage can
// measure the floor of such a recorder side by side with the Python mode.
// It is not a recorder: no lineage is kept, nothing is replayed.
//
// The recorder built on this callback is lineage_recorder.cpp (Note [C++
// lineage recorder]); unlike this probe's depth-0 rule it looks through
// CompositeImplicitAutograd ops (Note [Recorded granularity]), so that it
// records what the Python mode records.
#include "torch/op_observer.h"

#include <ATen/record_function.h>
#include <c10/core/GradMode.h>

#include <optional>
#include <stdexcept>
#include <vector>

namespace membudget {
namespace {

struct CapturedTensor {
  const void* storage = nullptr;
  uint32_t version = 0;
  c10::SmallVector<int64_t, 5> sizes;
  c10::SmallVector<int64_t, 5> strides;
  int64_t offset = 0;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
};

// Everything below is touched by the observing thread only.
constexpr size_t kCaptureBufferTensors = 4096;  // reused: the probe keeps nothing
thread_local std::optional<at::CallbackHandle> observer_handle;
thread_local int observer_depth = 0;
thread_local ObservedOpCounts observed;
thread_local std::vector<CapturedTensor> capture_buffer;

void capture(const c10::IValue& value) {
  if (!value.isTensor()) {
    return;  // tensor lists would be walked the same way; the probe skips them
  }
  const at::Tensor& tensor = value.toTensor();
  if (!tensor.defined() || !tensor.has_storage()) {
    return;
  }
  if (capture_buffer.size() >= kCaptureBufferTensors) {
    capture_buffer.clear();
  }
  CapturedTensor& slot = capture_buffer.emplace_back();
  slot.storage = tensor.storage().unsafeGetStorageImpl();
  slot.version = tensor._version();
  slot.sizes.assign(tensor.sizes().begin(), tensor.sizes().end());
  slot.strides.assign(tensor.strides().begin(), tensor.strides().end());
  slot.offset = tensor.storage_offset();
  slot.dtype = tensor.scalar_type();
  ++observed.tensors;
}

std::unique_ptr<at::ObserverContext> on_op_start(const at::RecordFunction& fn) {
  if (observer_depth++ == 0 && c10::GradMode::is_enabled()) {
    ++observed.ops;
    for (const c10::IValue& input : fn.inputs()) {
      capture(input);
    }
  }
  return nullptr;
}

void on_op_end(const at::RecordFunction& fn, at::ObserverContext* /*context*/) {
  if (--observer_depth == 0 && c10::GradMode::is_enabled()) {
    for (const c10::IValue& output : fn.outputs()) {
      capture(output);
    }
  }
}

}  // namespace

void observe_ops_start() {
  if (observer_handle) {
    throw std::runtime_error("membudget: the op observer probe is already on for this thread");
  }
  observed = ObservedOpCounts{};
  observer_depth = 0;
  capture_buffer.reserve(kCaptureBufferTensors);
  observer_handle = at::addThreadLocalCallback(at::RecordFunctionCallback(on_op_start, on_op_end)
                                                   .needsInputs(true)
                                                   .needsOutputs(true)
                                                   .scopes({at::RecordScope::FUNCTION}));
}

ObservedOpCounts observe_ops_stop() {
  if (!observer_handle) {
    throw std::runtime_error("membudget: the op observer probe is not on for this thread");
  }
  at::removeCallback(*observer_handle);
  observer_handle.reset();
  capture_buffer.clear();
  return observed;
}

void bind_op_observer(pybind11::module_& m) {
  m.def("observe_ops_start", &observe_ops_start,
        "Probe (Note [Op observer probe]): observe this thread's top-level ops from C++ until "
        "observe_ops_stop().");
  m.def(
      "observe_ops_stop",
      [] {
        ObservedOpCounts counts = observe_ops_stop();
        pybind11::dict result;
        result["ops"] = counts.ops;
        result["tensors"] = counts.tensors;
        return result;
      },
      "Stops the probe; returns {'ops': top-level ops seen with grad on, 'tensors': tensors captured}.");
}

}  // namespace membudget

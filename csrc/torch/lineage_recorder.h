// The C++ lineage recorder (issue 3): records forward ops for recomputation
// from a thread-local at::RecordFunction callback instead of a Python
// TorchDispatchMode. See Note [C++ lineage recorder] in lineage_recorder.cpp.
#pragma once
#include <ATen/record_function.h>
#include <torch/extension.h>

#include <cstdint>
#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "torch/lineage_graph.h"

namespace membudget {
namespace lineage {

// A device model's rates (python/membudget/costs.py's DeviceModel), for the
// roofline floor on recorded costs (Note [Roofline floor on CUDA]).
struct RooflineModel {
  double fp32_flops_per_s = 1.0;
  double bf16_flops_per_s = 1.0;
  double fp16_flops_per_s = 1.0;
  double fp64_flops_per_s = 1.0;
  double int_flops_per_s = 1.0;
  double memory_bytes_per_s = 1.0;
  double launch_s = 0.0;
  double flop_rate(at::ScalarType dtype) const;
};

// Modelled seconds of one op call on `model` (lineage_roofline.cpp).
double roofline_seconds(const RooflineModel& model, const OpInfo& info, const std::vector<c10::IValue>& inputs,
                        const std::vector<c10::IValue>& outputs);

// Everything the recorder knows; one per process. Recording happens on the
// thread that called start() and on threads started after install() (Note
// [Recording on started threads]); pack, unpack and replays may come from
// other threads (CUDA backward), so public entry points take mutex.
struct RecorderState {
  std::recursive_mutex mutex;
  int64_t forward = 0;        // generation of the forward being recorded
  bool in_backward = true;    // the next recorded op begins a forward
  // The recording thread that last packed an activation, whose forward the
  // generations follow (Note [Recording on started threads]); none yet: id().
  // Atomic: every pack sets it, without the lock.
  std::atomic<std::thread::id> packer{std::thread::id()};
  // Whether the forward being recorded has packed an activation yet (Note
  // [Lineage released between steps] in python/membudget/lineage.py); set
  // with packer, without the lock.
  std::atomic<bool> packed_in_forward{false};
  int64_t op_index = 0;       // ops of this forward (views included)
  int64_t ops_recorded = 0;   // since start()
  uint64_t epoch = 1;         // closures memoised before a sweep are stale
  struct Recorded {
    c10::weak_intrusive_ptr<c10::StorageImpl> storage;  // pins the address: no reuse while mapped
    std::shared_ptr<StorageLineage> lineage;
  };
  std::unordered_map<const c10::StorageImpl*, Recorded> by_storage;
  std::unordered_map<const c10::TensorImpl*, std::shared_ptr<External>> externals;  // this forward's
  std::unordered_map<uint64_t, std::shared_ptr<StorageLineage>> by_entry;
  // Nodes that wrote into a storage, per forward (Note [Lineage ownership]).
  std::vector<std::pair<int64_t, std::vector<std::shared_ptr<OpNode>>>> writers;
  // Writers a sweep is releasing, kept until the entries that need them are
  // rescued (Note [Rescued before a sweep]); closures count them as gone.
  std::unordered_map<const OpNode*, std::shared_ptr<OpNode>> releasing;
  // Addresses of storages read as held inputs while entries live (Note [Held
  // under another counter]).
  std::unordered_set<uintptr_t> held_storages;
  // Entries no history may rebuild (Note [Parts of a storage]).
  std::unordered_set<uint64_t> swap_only_entries;
  // Dropped entries whose rescue failed, with why (Note [A rescue that
  // failed] in lineage_replay.cpp).
  struct Lost {
    std::string message;
    bool out_of_memory;
  };
  std::unordered_map<uint64_t, Lost> lost;
  // Parts of storages' lineages, per forward (Note [Lineage ownership]).
  std::vector<std::pair<int64_t, std::vector<std::shared_ptr<StorageLineage>>>> parts;
  // plan(entry_id, producer index, producer name, output index): a static
  // plan's pack-time drop (Python; called with the GIL), or null.
  std::unique_ptr<pybind11::object> plan;
  // Set on CUDA: a recorded op costs at least its roofline (Note [Roofline floor on CUDA]).
  std::optional<RooflineModel> roofline;
  bool tracing = false;             // tests: keep the name of every recorded node
  std::vector<std::string> trace;
};

RecorderState& state();

// A static plan's question about one recomputable pack (RecorderState::plan).
struct PlanQuery {
  uint64_t entry_id = 0;
  int64_t op_index = 0;
  std::string op_name;
  int64_t output_index = 0;
};

// Work found under the recorder's lock that must wait until it is released
// (Note [Recorder lock and the GIL]): rescues and plan queries take the GIL,
// and dropping what the recorder held may release the last C++ reference to
// a tensor with a Python object, whose destruction takes the GIL too.
// Declare it before the lock guard; call run() after the guard's scope.
struct Deferred {
  std::vector<uintptr_t> rescues;        // external storages about to be written
  const char* writer = nullptr;          // by this op (its name), for messages
  std::vector<uint64_t> swap_only;       // entries to make resident and swap-only (listed in swap_only_entries)
  std::vector<uint64_t> swap_only_released;  // the same, as a sweep released writers their replay needs
  std::vector<PlanQuery> plan_queries;
  std::vector<std::shared_ptr<void>> released;
  bool sweep = false;  // RecorderState::releasing is let go once the rescues ran
  // Runs the rescues, swap-only entries and plan queries and lets go of what was released. The
  // calling thread must not hold the recorder's lock.
  void run(RecorderState& s);
};

// The recorder's decision for the operator a RecordFunction is about
// (lineage_ops.cpp), or null when it is not an operator call. Recording
// thread only.
const OpInfo* lookup_info(const at::RecordFunction& fn);

// A tensor's version counter; 0 for inference tensors, which have none and
// cannot be written outside inference mode (a teacher's outputs made under
// torch.inference_mode and read by the loss: reading the counter threw from
// the callback, once per op, printed with a C++ backtrace).
inline int64_t version_of(const at::Tensor& tensor) {
  return tensor.is_inference() ? 0 : static_cast<int64_t>(tensor._version());
}
// A storage's data address (0 without storage): held inputs' keys.
uintptr_t storage_address(const at::Tensor& t);
// Holds `held`'s entry instead of its tensor (Note [Held inputs reached
// through their entry]); the tensor goes to deferred->released when given.
void hold_through_entry(External& held, std::shared_ptr<StorageResidency> entry, Deferred* deferred);
// A held input's version counter, whether held as a tensor or through its entry.
int64_t external_version(const External& held);
// `tensor` without its autograd metadata when it has a grad_fn, `held`
// keeping its TensorImpl weakly (Note [Held without their graph]).
at::Tensor held_without_graph(const at::Tensor& tensor, External* held);
// Whether a writer in lineage's history was released (or is being: Note
// [Rescued before a sweep]).
bool history_released(const RecorderState& s, const StorageLineage& lineage);
// The writer, or null when it was released or is being released.
std::shared_ptr<OpNode> kept_writer(const RecorderState& s, const std::weak_ptr<OpNode>& writer);
// The bytes t covers in its storage, [begin, end).
std::pair<int64_t, int64_t> byte_range(const at::Tensor& t);
// The innermost part of a lineage whose bytes hold all of t's, or null
// (Note [Parts of a storage] in lineage_recorder.cpp).
std::shared_ptr<StorageLineage> part_holding(const StorageLineage& lineage, const at::Tensor& t);

// Closure of rebuilding `lineage` at `version` (lineage_replay.cpp).
std::shared_ptr<const Closure> closure(RecorderState& s, const std::shared_ptr<StorageLineage>& lineage,
                                       int64_t version, bool top, int depth);
// A storage was packed as entry_id: declares to the manager whether and at
// what cost its lineage can rebuild it (lineage.py's Lineage.on_pack); the
// plan, if any, is asked later (deferred). Holds the lock.
void declare_packed(RecorderState& s, uint64_t entry_id, const at::Tensor& tensor, Deferred& deferred);
// The external storage `key` is about to be written by `writer`: the managed
// entries whose replays read it read a copy from now on where it is small
// (Note [Held inputs kept as a copy] in saved_activation.cpp), or else are
// made resident and swap-only (replay.py's rescue_dependents_of). Takes the
// lock, then the GIL once the lock is released: call it without the lock.
void rescue_dependents_of(RecorderState& s, uintptr_t key, const char* writer);
// Makes each entry resident, then swap-only, for `reason` (Note [Why not
// recomputable] in csrc/core/residency_manager.cpp); an entry that cannot be
// made resident is lost (Note [A rescue that failed]). Never throws: it runs
// inside RecordFunction callbacks. Call it without the lock.
void make_swap_only(RecorderState& s, const std::vector<uint64_t>& entry_ids, const char* reason,
                    const char* writer = nullptr);
// Re-declares every managed entry's closure after a sweep truncated lineages.
void redeclare_entries(RecorderState& s);
// Pauses recording on this thread while alive (replays).
class PauseRecording {
 public:
  PauseRecording();
  ~PauseRecording();

 private:
  bool previous_;
};

// An out-of-memory error was raised to torch: the forward being recorded,
// if any, is over (Note [A forward that ran out of memory]). Lock-free: the
// allocator calls it.
void note_out_of_memory();
// Whether one was raised since the last call (each recorder asks before an op).
bool take_out_of_memory();

// A stopped recorder forgets all it kept for the entries live at stop() (their
// held inputs, RNG states, nodes); nothing when recording. GIL held.
void release_stopped_recorder();
void bind_lineage(pybind11::module_& m);
// lineage_replay.cpp's part of the bindings (on_pack, rebuild).
void bind_lineage_replay(pybind11::module_& m);

}  // namespace lineage
}  // namespace membudget

// Note [C++ lineage recorder]: python/membudget/lineage.py records forward
// ops with a Python TorchDispatchMode, whose floor alone (an empty mode) is
// above issue 3's 10 us per op. This recorder keeps the same lineage (the
// data of lineage_graph.h mirrors lineage.py's objects) from a thread-local
// at::RecordFunction callback, so recording a forward op runs no Python; the
// pack-time closure and the replay are C++ too (lineage_replay.cpp), and
// Python sees a tensor only when a dropped entry is rebuilt. Chosen with
// MEMBUDGET_LINEAGE=cxx (python/membudget/lineage_native.py).
//
// Note [Recorded granularity]: the Python mode sits below autograd: it sees
// the ops autograd saves for, after CompositeImplicitAutograd ops (linear,
// dropout, matmul, layer_norm) have decomposed, and not the ops a kernel calls
// inside itself (the mode is off its stack while its handler runs). A
// RecordFunction callback fires at every Dispatcher::call instead (never at
// redispatch), so the same set is taken as: an op is recorded unless it is
// CompositeImplicitAutograd (then its children are candidates) or it runs
// nested inside an op that was recorded, counted as a view, or skipped
// (those ran in a kernel, below autograd). The decision per operator is made
// once, from its registration and schema (OpInfo), and cached by the address
// of its schema's name, which RecordFunction hands over without a copy.
// tests/test_lineage_native.py checks the recorded op sequence against the
// Python mode's on the test models.
//
// Note [Silenced children]: the ops a blocking op's kernel calls (the
// empties, _convolution and mkldnn_convolution inside convolution; about
// three per recorded op on the CNN, two on GPT-2) are never recorded, yet
// with the callback on each one costs a RecordFunction whose arguments and
// outputs are boxed into IValues (int lists become heap-allocated lists)
// and a push and pop of a frame. So once an op blocks its children, this
// thread's callback is disabled until the op's end callback, which the
// RecordFunction still runs (it holds the callbacks it started with), turns
// it back on -- unless set_enabled(false) asked for it off meanwhile. Only
// this callback is switched off: a profiler's callbacks still see every
// nested op. The frame counting (t_blocking) stays as it was, for children
// that run while the callback is on anyway (set_enabled(true) inside an op).
// Measured: bench/RESULTS.md, "Lineage recording cost on the CNN" (branch cnnrec).
//
// Note [Lineage ownership]: Python's recorder leans on the garbage collector
// for the cycles that in-place ops make (x.add_(f(x)): x's lineage holds the
// add_ node, which reads f's output, whose producer reads x's lineage).
// Here every strong edge points back in time -- a lineage holds its producer,
// a node holds the lineages it read -- and a lineage holds the nodes that
// wrote into it weakly; those nodes are owned by the forward that recorded
// them (RecorderState::writers) and released two forwards later. A lineage
// whose writer is gone is truncated: its later versions are not replayable
// (closure says so; the manager is told again for live entries), and a
// later read of the storage holds it instead (Note [Held scratch and
// long-lived storages]).
//
// Note [Recorder lock and the GIL]: the GIL is taken before the recorder's
// lock, never after. Every binding (on_pack, rebuild, ops_recorded, ...) is
// entered with the GIL held and then takes the lock; a thread that held the
// lock and then waited for the GIL would deadlock against it. That happened:
// the recording thread (in an op's callback, without the GIL) rescued the
// entries reading an input about to be written in place, taking the GIL
// under the lock, while another thread held the GIL and waited in a binding
// for the lock (bench/stress_recorder_lock.py hung within seconds; a CUDA
// backward thread replaying an entry is that other thread in practice). So
// the callbacks collect under the lock what needs the GIL -- rescues, a
// static plan's queries, and the references they drop (the last C++
// reference to a tensor with a Python object takes the GIL when released) --
// in a Deferred, and run it once the lock is released; and a replay holds
// the lock only to read what recording may still change (Replayer in
// lineage_replay.cpp), since materialising its inputs releases and retakes
// the GIL.
//
// Storage lineage is keyed by StorageImpl (residency is per storage, and a
// view shares its base's storage, so views need no bookkeeping at all). The
// map holds a weak reference to each StorageImpl, which keeps its address
// from being reused while mapped; the tensor's version counter, compared
// with the lineage's last recorded version, catches writes lineage did not
// see, as in Python.
#include "torch/lineage_recorder.h"

#include <ATen/record_function.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/graph_task.h>

#include <algorithm>
#include <chrono>
#include <optional>
#include <stdexcept>
#include <unordered_set>

#include "torch/function_forwards.h"
#include "torch/saved_activation.h"

namespace py = pybind11;

namespace membudget {
namespace lineage {
namespace {

using Clock = std::chrono::steady_clock;

// Forwards whose writer nodes are kept (Note [Lineage ownership]): this one
// and the previous, whose saved tensors backward may still hold.
constexpr int64_t kForwardsKept = 2;

// One RecordFunction on this thread's stack.
struct Frame {
  bool blocks_children = false;
  bool silenced = false;  // this callback is off for the op's children (Note [Silenced children])
  bool function_forward = false;  // a custom Function's forward (Note [Custom Function forwards])
  std::shared_ptr<OpNode> node;  // set while recording this op
  const OpInfo* info = nullptr;
  Clock::time_point start;
  // Written storages with lineage, and the tensors written (for their version after).
  c10::SmallVector<std::pair<std::shared_ptr<StorageLineage>, at::Tensor>, 2> writes;
  // Outputs autograd saved before the op returned (Note [Packed before recorded]).
  std::vector<std::pair<uint64_t, at::Tensor>> packed;
  // The arguments, kept for the roofline (Note [Roofline floor on CUDA]) when
  // it is on: a boxed call's RecordFunction inputs view its stack, which
  // holds the outputs by the time the op ends.
  std::vector<c10::IValue> inputs;
};

thread_local std::optional<at::CallbackHandle> t_handle;
thread_local std::vector<Frame> t_frames;
thread_local int t_blocking = 0;  // frames on the stack that block their children
thread_local bool t_paused = false;
// Whether this is the thread that called start(): at::ThreadLocalState
// carries the callback to threads that run work for it (the autograd
// engine's device threads, intra-op pools), which record nothing.
thread_local bool t_recording = false;
// What set_enabled() last asked for: a silenced op's end turns the callback
// back on only if it is still wanted (Note [Silenced children]).
thread_local bool t_enabled = true;

bool is_plain(const at::Tensor& t) {
  return !t.key_set().has_any(c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot,
                                                    c10::DispatchKey::Functionalize}));
}

bool all_plain(c10::ArrayRef<const c10::IValue> inputs) {
  for (const c10::IValue& value : inputs) {
    if (value.isTensor()) {
      if (!is_plain(value.toTensor())) return false;
    } else if (value.isTensorList()) {
      for (const at::Tensor& t : value.toTensorList().vec()) {
        if (t.defined() && !is_plain(t)) return false;
      }
    }
  }
  return true;
}

uintptr_t storage_address(const at::Tensor& t) {
  if (!t.has_storage()) return 0;
  return reinterpret_cast<uintptr_t>(t.storage().data());
}

void begin_forward(RecorderState& s, Deferred& deferred) {
  s.in_backward = false;
  s.op_index = 0;
  s.forward += 1;
  for (auto& [impl, external] : s.externals) deferred.released.push_back(std::move(external));
  s.externals.clear();
  for (auto it = s.by_storage.begin(); it != s.by_storage.end();) {
    if (!it->second.storage.expired()) {
      ++it;
      continue;
    }
    deferred.released.push_back(std::move(it->second.lineage));
    it = s.by_storage.erase(it);
  }
  std::vector<uint64_t> live = live_entry_ids();
  std::unordered_set<uint64_t> live_set(live.begin(), live.end());
  for (auto it = s.by_entry.begin(); it != s.by_entry.end();) {
    if (live_set.count(it->first) != 0) {
      ++it;
      continue;
    }
    deferred.released.push_back(std::move(it->second));
    it = s.by_entry.erase(it);
  }
  bool truncated = false;
  while (!s.writers.empty() && s.writers.front().first <= s.forward - kForwardsKept) {
    truncated = truncated || !s.writers.front().second.empty();
    for (std::shared_ptr<OpNode>& writer : s.writers.front().second) deferred.released.push_back(std::move(writer));
    s.writers.erase(s.writers.begin());
  }
  if (truncated) {
    ++s.epoch;
    redeclare_entries(s);
  }
}

// Note [Held scratch and long-lived storages]: a storage that outlives the
// forward that made it (batch norm's running statistics, a mask built once
// with an in-place fill) keeps its lineage, but the writer nodes of that
// forward are released two forwards later (Note [Lineage ownership]); read
// through its lineage after that, it makes every closure that reaches it
// unreplayable, and so every activation downstream swap-only. (Batch norm's
// kernels update the running statistics without bumping their version
// counter, so the version check never turns them into inputs held like
// parameters, as other writes lineage does not see do; recompute-only CNN
// runs then ran out of memory with most of their activations swap-only.) A
// storage whose history is released is therefore read as a held input from
// then on, its version checked at replay like any held input; and scratch
// arguments are always held: a replay reads only a copy of their current
// value, which no output depends on, so their history is never needed.
bool history_released(const StorageLineage& lineage) {
  for (const std::weak_ptr<OpNode>& writer : lineage.mutations) {
    if (writer.expired()) return true;
  }
  return false;
}

TensorRef make_ref(RecorderState& s, const at::Tensor& tensor, bool scratch) {
  TensorRef ref;
  ref.tensor_version = tensor.has_storage() ? static_cast<int64_t>(tensor._version()) : 0;
  ref.sizes.assign(tensor.sizes().begin(), tensor.sizes().end());
  ref.strides.assign(tensor.strides().begin(), tensor.strides().end());
  ref.offset = tensor.storage_offset();
  ref.dtype = tensor.scalar_type();
  ref.scratch = scratch;
  ref.conj = tensor.is_conj();
  ref.neg = tensor.is_neg();
  if (tensor.has_storage() && !scratch) {
    auto it = s.by_storage.find(tensor.storage().unsafeGetStorageImpl());
    if (it != s.by_storage.end() && (it->second.lineage->ambiguous ||
                                     (ref.tensor_version == it->second.lineage->versions.back() &&
                                      !history_released(*it->second.lineage)))) {
      // An ambiguous storage's outputs keep version counters of their own,
      // so its reads rarely match its versions; held as inputs, they kept
      // it alive for the whole step (a CPU GRU's input projection: 1.1 MiB
      // of 13.6 at its peak). Referenced instead: its readers are
      // unreplayable (Note [One history per storage] in lineage.py).
      ref.lineage = it->second.lineage;
      ref.version = static_cast<int64_t>(ref.lineage->mutations.size());
      return ref;
    }
    // Not seen, written where lineage could not see (no_grad code such as
    // weight init, another thread), or its history released: an input held
    // like a parameter. Scratch arguments are always held (Note [Held
    // scratch and long-lived storages]).
  }
  std::shared_ptr<External>& held = s.externals[tensor.unsafeGetTensorImpl()];
  if (held == nullptr) {
    held = std::make_shared<External>();
    held->tensor = tensor;
    held->key = storage_address(tensor);
  }
  ref.external = held;
  return ref;
}

void capture_arguments(RecorderState& s, const OpInfo& info, c10::ArrayRef<const c10::IValue> inputs, OpNode& node) {
  node.args.resize(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    const c10::IValue& value = inputs[i];
    ArgSlot& slot = node.args[i];
    const bool scratch = i < info.scratch.size() && info.scratch[i];
    if (value.isTensor()) {
      const at::Tensor& t = value.toTensor();
      if (!t.defined()) {
        slot.plain = value;
        continue;
      }
      slot.kind = ArgSlot::kTensor;
      slot.refs.push_back(static_cast<int32_t>(node.refs.size()));
      node.refs.push_back(make_ref(s, t, scratch));
    } else if (value.isTensorList()) {
      slot.kind = ArgSlot::kTensorList;
      for (const at::Tensor& t : value.toTensorList().vec()) {
        slot.refs.push_back(static_cast<int32_t>(node.refs.size()));
        node.refs.push_back(make_ref(s, t, false));
      }
    } else if (value.isList()) {
      // Tensor?[] (index.Tensor's indices): a generic list holding tensors
      // (plain Tensor[] is a TensorList, above); other lists are values.
      bool tensors = false;
      for (const c10::IValue& item : value.toListRef()) tensors = tensors || item.isTensor();
      if (!tensors) {
        slot.plain = value;
        continue;
      }
      slot.kind = ArgSlot::kOptionalTensorList;
      for (const c10::IValue& item : value.toListRef()) {
        if (item.isTensor() && item.toTensor().defined()) {
          slot.refs.push_back(static_cast<int32_t>(node.refs.size()));
          node.refs.push_back(make_ref(s, item.toTensor(), false));
        } else {
          slot.refs.push_back(-1);
        }
      }
    } else {
      slot.plain = value;
    }
  }
}

void capture_generator(const OpInfo& info, c10::ArrayRef<const c10::IValue> inputs, OpNode& node) {
  std::optional<at::Generator> generator;
  std::optional<c10::Device> device;
  for (const c10::IValue& value : inputs) {
    if (value.isGenerator()) generator = value.toGenerator();
    if (!device && value.isTensor() && value.toTensor().defined()) device = value.toTensor().device();
  }
  (void)info;
  if (!generator) {
    const c10::Device where = device.value_or(c10::Device(c10::kCPU));
    generator = at::globalContext().defaultGenerator(where.is_cuda() ? where : c10::Device(c10::kCPU));
  }
  std::lock_guard<std::mutex> lock(generator->mutex());
  node.generator_state = generator->get_state();
  node.generator = std::move(generator);
}

void begin_op(const at::RecordFunction& fn, size_t slot);

std::unique_ptr<at::ObserverContext> on_op_start(const at::RecordFunction& fn) {
  // By index, not reference: what runs below (a rescue's replay, the
  // generator's state tensor) may call ops, whose frames can move this one.
  const size_t slot = t_frames.size();
  t_frames.emplace_back();
  begin_op(fn, slot);
  if (t_frames[slot].blocks_children && t_handle) {
    // Last, after any replay a rescue ran: those ops are paused anyway.
    at::disableCallback(*t_handle);
    t_frames[slot].silenced = true;
  }
  return nullptr;
}

void begin_op(const at::RecordFunction& fn, size_t slot) {
  if (t_blocking > 0 || t_paused || !t_recording ||
      c10::impl::tls_is_dispatch_key_excluded(c10::DispatchKey::Python)) {
    // Nested in an op that ran whole (Note [Recorded granularity]), a replay,
    // or code that hides its ops from dispatch modes (torch.tensor(data)).
    return;
  }
  const OpInfo* info = lookup_info(fn);
  if (info == nullptr) {
    if (starts_function_forward(fn)) {
      t_frames[slot].function_forward = true;
      enter_function_forward();
    }
    return;
  }
  if (info->kind == OpKind::kDecomposed) return;
  t_frames[slot].blocks_children = true;
  ++t_blocking;
  if (info->kind == OpKind::kSkip || (!c10::GradMode::is_enabled() && !in_function_forward()) ||
      torch::autograd::get_current_graph_task_id() != -1) {
    return;  // backward, no_grad and optimizer steps are not recorded
  }
  c10::ArrayRef<const c10::IValue> inputs = fn.inputs();
  if (!all_plain(inputs)) return;  // tensor subclasses (fake, functional): not ours
  RecorderState& s = state();
  Deferred deferred;  // Note [Recorder lock and the GIL]
  {
    std::lock_guard<std::recursive_mutex> lock(s.mutex);
    if (s.in_backward) begin_forward(s, deferred);
    ++s.op_index;
    ++s.ops_recorded;
    if (info->kind == OpKind::kView) {
      if (s.tracing) s.trace.push_back("view " + info->name);
    } else {
      auto node = std::make_shared<OpNode>();
      node->info = info;
      node->index = s.op_index - 1;
      node->replayable = info->replayable;
      capture_arguments(s, *info, inputs, *node);
      if (s.tracing) s.trace.push_back(info->name);
      if (info->random) capture_generator(*info, inputs, *node);
      for (size_t position : info->writes) {
        if (position >= node->args.size() || node->args[position].kind != ArgSlot::kTensor) continue;
        const TensorRef& ref = node->refs[node->args[position].refs[0]];
        if (ref.lineage != nullptr) {
          t_frames[slot].writes.emplace_back(ref.lineage, inputs[position].toTensor());
        } else {
          // A write to a tensor lineage did not produce: entries whose replay
          // reads it are made resident, before the write lands (below).
          deferred.rescues.push_back(ref.external->key);
        }
      }
      Frame& frame = t_frames[slot];
      frame.node = std::move(node);
      frame.info = info;
      if (s.roofline) frame.inputs.assign(inputs.begin(), inputs.end());
    }
  }
  deferred.run(s);
  // After the rescues (which may replay): they are not this op's time.
  t_frames[slot].start = Clock::now();
}

// Gives t's storage the lineage (node, index). `attached` lists the storages
// this op's earlier outputs were given: one given twice has several
// histories (Note [One history per storage] in lineage.py), each output
// written in place through itself under its own version counter, which a
// storage keyed lineage cannot tell apart; it is marked unreplayable.
void attach_output(RecorderState& s, const std::shared_ptr<OpNode>& node, int64_t index, const at::Tensor& t,
                   Deferred& deferred, c10::SmallVector<c10::StorageImpl*, 4>& attached) {
  if (!t.defined() || !t.has_storage() || !is_plain(t)) return;
  c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
  const bool again = std::find(attached.begin(), attached.end(), impl) != attached.end();
  attached.push_back(impl);
  c10::weak_intrusive_ptr<c10::StorageImpl> weak(c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(impl));
  RecorderState::Recorded recorded{std::move(weak), std::make_shared<StorageLineage>(node, index, t, s.forward)};
  auto [it, inserted] = s.by_storage.try_emplace(impl, std::move(recorded));
  if (!inserted) {
    deferred.released.push_back(std::move(it->second.lineage));
    it->second = std::move(recorded);
  }
  it->second.lineage->ambiguous = again;
}

void record_op_end(RecorderState& s, const at::RecordFunction& fn, Frame& frame, double seconds, Deferred& deferred);

void on_op_end(const at::RecordFunction& fn, at::ObserverContext* /*context*/) {
  if (t_frames.empty()) return;  // started before the callback was added
  Frame frame = std::move(t_frames.back());
  t_frames.pop_back();
  if (frame.blocks_children) --t_blocking;
  if (frame.function_forward) leave_function_forward();
  if (frame.silenced && t_enabled && t_handle) at::reenableCallback(*t_handle);
  if (frame.node == nullptr) return;
  const double seconds = std::chrono::duration<double>(Clock::now() - frame.start).count();
  RecorderState& s = state();
  Deferred deferred;  // Note [Recorder lock and the GIL]
  record_op_end(s, fn, frame, seconds, deferred);
  deferred.run(s);
}

void record_op_end(RecorderState& s, const at::RecordFunction& fn, Frame& frame, double seconds, Deferred& deferred) {
  std::lock_guard<std::recursive_mutex> lock(s.mutex);
  const OpInfo& info = *frame.info;
  if (s.roofline) {
    // Asynchronous device: the timer saw the launch only.
    seconds = std::max(seconds, roofline_seconds(*s.roofline, info, frame.inputs, fn.outputs()));
  }
  frame.node->seconds = seconds;
  if (!frame.writes.empty()) {
    if (s.writers.empty() || s.writers.back().first != s.forward) {
      s.writers.push_back({s.forward, {}});
    }
    s.writers.back().second.push_back(frame.node);
    for (auto& [target, tensor] : frame.writes) {
      target->mutations.push_back(frame.node);
      // The ADInplaceOrView kernel ran inside this call: the bump is done.
      target->versions.push_back(static_cast<int64_t>(tensor._version()));
      target->memo.clear();
    }
  }
  const c10::FunctionSchema& schema = info.op.schema();
  const std::vector<c10::IValue>& outputs = fn.outputs();
  c10::SmallVector<c10::StorageImpl*, 4> attached;
  int64_t index = 0;
  for (size_t r = 0; r < outputs.size(); ++r) {
    const bool aliased = r < schema.returns().size() && schema.returns()[r].alias_info() != nullptr;
    const c10::IValue& value = outputs[r];
    if (value.isTensor()) {
      if (!aliased) attach_output(s, frame.node, index, value.toTensor(), deferred, attached);
      ++index;
    } else if (value.isTensorList()) {
      for (const at::Tensor& t : value.toTensorList().vec()) {
        if (!aliased) attach_output(s, frame.node, index, t, deferred, attached);
        ++index;
      }
    } else {
      ++index;
    }
  }
  for (const auto& [entry_id, tensor] : frame.packed) declare_packed(s, entry_id, tensor, deferred);
}

// Note [Packed before recorded]: autograd saves an op's outputs (softmax's,
// mkldnn_rnn_layer's) inside the op's call, so the pack hook sees them before
// the RecordFunction end callback has given them a lineage (the Python mode
// gives it below autograd, before they are saved). Such a pack is held by the
// op's frame and declared when the op ends.
void on_pack(uint64_t entry_id, const at::Tensor& tensor) {
  if (!tensor.defined() || !tensor.has_storage()) return;
  RecorderState& s = state();
  Deferred deferred;
  {
    std::lock_guard<std::recursive_mutex> lock(s.mutex);
    if (s.by_storage.count(tensor.storage().unsafeGetStorageImpl()) == 0) {
      for (auto frame = t_frames.rbegin(); frame != t_frames.rend(); ++frame) {
        if (frame->node != nullptr) {
          frame->packed.emplace_back(entry_id, tensor);
          return;
        }
      }
      return;
    }
    declare_packed(s, entry_id, tensor, deferred);
  }
  deferred.run(s);
}

}  // namespace

RecorderState& state() {
  static auto* recorder = new RecorderState();  // leaked: ops may run during interpreter exit
  return *recorder;
}

PauseRecording::PauseRecording() : previous_(t_paused) { t_paused = true; }
PauseRecording::~PauseRecording() { t_paused = previous_; }

namespace {

// Forgets what no live entry needs: after stop() only replays of entries
// packed before it can still be asked for (saved activations outlive
// uninstall()), and a stopped recorder must not keep the inputs it held
// (parameters of a model long gone) alive. What it held goes to `released`,
// for the caller to drop once the lock is released (Note [Recorder lock and
// the GIL]).
void forget_unneeded(RecorderState& s, std::vector<std::shared_ptr<void>>& released) {
  for (auto& [impl, recorded] : s.by_storage) released.push_back(std::move(recorded.lineage));
  s.by_storage.clear();
  for (auto& [impl, external] : s.externals) released.push_back(std::move(external));
  s.externals.clear();
  std::vector<uint64_t> live = live_entry_ids();
  std::unordered_set<uint64_t> live_set(live.begin(), live.end());
  for (auto it = s.by_entry.begin(); it != s.by_entry.end();) {
    if (live_set.count(it->first) != 0) {
      ++it;
      continue;
    }
    released.push_back(std::move(it->second));
    it = s.by_entry.erase(it);
  }
  if (s.by_entry.empty()) {
    for (auto& [forward, writers] : s.writers) {
      for (std::shared_ptr<OpNode>& writer : writers) released.push_back(std::move(writer));
    }
    s.writers.clear();
  }
  s.in_backward = true;
}

void start_recording() {
  if (t_handle) throw std::runtime_error("membudget: the C++ lineage recorder is already on for this thread");
  RecorderState& s = state();
  std::vector<std::shared_ptr<void>> released;  // dropped after the lock
  {
    std::lock_guard<std::recursive_mutex> lock(s.mutex);
    forget_unneeded(s, released);
    s.ops_recorded = 0;
  }
  t_frames.clear();
  t_blocking = 0;
  reset_function_forwards();
  t_recording = true;
  t_enabled = true;
  t_handle = at::addThreadLocalCallback(at::RecordFunctionCallback(on_op_start, on_op_end)
                                            .needsInputs(true)
                                            .needsOutputs(true)
                                            .scopes({at::RecordScope::FUNCTION}));
}

void stop_recording() {
  if (!t_handle) return;
  at::removeCallback(*t_handle);
  t_handle.reset();
  t_frames.clear();
  t_blocking = 0;
  reset_function_forwards();
  t_recording = false;
  RecorderState& s = state();
  std::vector<std::shared_ptr<void>> released;  // dropped after the lock
  std::lock_guard<std::recursive_mutex> lock(s.mutex);
  forget_unneeded(s, released);
}

}  // namespace

void bind_lineage(pybind11::module_& m) {
  pybind11::module_ sub = m.def_submodule("lineage", "The C++ lineage recorder (Note [C++ lineage recorder])");
  sub.def("start", &start_recording,
          "Record this thread's forward ops from C++ until stop() (Note [C++ lineage recorder]).");
  sub.def("stop", &stop_recording, "Stop recording on this thread and forget unmanaged lineage.");
  sub.def("recording", [] { return t_handle.has_value(); }, "Whether this thread records.");
  bind_function_forwards(sub);
  sub.def("set_enabled", [](bool enabled) {
    t_enabled = enabled;
    if (!t_handle) return;
    if (enabled) {
      at::reenableCallback(*t_handle);
    } else {
      at::disableCallback(*t_handle);
    }
  }, "Turn this thread's callback off (backward, optimizer steps) or back on; what is recorded is unchanged.");
  sub.def("ops_recorded", [] {
    RecorderState& s = state();
    std::lock_guard<std::recursive_mutex> lock(s.mutex);
    return s.ops_recorded;
  }, "Forward ops recorded (views included) since start().");
  sub.def("note_backward", [] {
    RecorderState& s = state();
    std::lock_guard<std::recursive_mutex> lock(s.mutex);
    s.in_backward = true;
  }, "Backward has begun: the next recorded op starts a new forward.");
  sub.def("release_if_idle", [] {
    // Note [Lineage released between steps] (python/membudget/lineage.py):
    // once backward has run and no managed entry is left, nothing recorded
    // can be replayed, yet the nodes of the last forward hold its inputs
    // (parameters, their gradients, the batch) for as long as a storage it
    // made lives (the loss a loop keeps). The GIL is let go while the lock
    // is held (Note [Recorder lock and the GIL]); what was held is dropped
    // once both are back as they were.
    RecorderState& s = state();
    std::vector<std::shared_ptr<void>> released;
    {
      py::gil_scoped_release no_gil;
      std::lock_guard<std::recursive_mutex> lock(s.mutex);
      if (!s.in_backward || !live_entry_ids().empty()) return false;
      forget_unneeded(s, released);  // with no entry live: everything
      ++s.epoch;
    }
    return true;
  }, "After backward, with no managed entry left: let go of every recorded input and lineage "
     "(Note [Lineage released between steps]). True when it released.");
  sub.def("trace", [](bool on) {
    RecorderState& s = state();
    std::lock_guard<std::recursive_mutex> lock(s.mutex);
    std::vector<std::string> names = std::move(s.trace);
    s.trace.clear();
    s.tracing = on;
    return names;
  }, py::arg("on"), "Names of the ops that got a node since the last call (while tracing); tracing on or off.");
  sub.def("on_pack", &on_pack, py::arg("entry_id"), py::arg("tensor"),
          "A storage was packed as entry_id: declares its lineage to the manager (now, or when the op that "
          "made it returns).");
  sub.def("set_device_model", [](py::object model) {
    RecorderState& s = state();
    std::optional<RooflineModel> roofline;
    if (!model.is_none()) {
      py::dict rates = model["flops_per_s"];
      RooflineModel m;
      m.fp32_flops_per_s = rates["fp32"].cast<double>();
      auto rate = [&](const char* key) { return rates.contains(key) ? rates[key].cast<double>() : m.fp32_flops_per_s; };
      m.bf16_flops_per_s = rate("bf16");
      m.fp16_flops_per_s = rate("fp16");
      m.fp64_flops_per_s = rate("fp64");
      m.int_flops_per_s = rate("int");
      m.memory_bytes_per_s = model["memory_bytes_per_s"].cast<double>();
      m.launch_s = model["launch_s"].cast<double>();
      roofline = m;
    }
    std::lock_guard<std::recursive_mutex> lock(s.mutex);
    s.roofline = roofline;
  }, py::arg("model"), "A costs.DeviceModel.to_dict() whose roofline floors every recorded op's cost "
     "(Note [Roofline floor on CUDA]), or None.");
  sub.def("set_plan", [](py::object plan) {
    RecorderState& s = state();
    std::lock_guard<std::recursive_mutex> lock(s.mutex);
    s.plan = plan.is_none() ? nullptr : std::make_unique<py::object>(std::move(plan));
  }, py::arg("plan"), "plan(entry_id, op index, op name, output index), called for recomputable packs; or None.");
  bind_lineage_replay(sub);
}

}  // namespace lineage
}  // namespace membudget

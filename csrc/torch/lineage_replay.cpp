// The C++ recorder's pack-time closure and replay: python/membudget/replay.py
// over lineage_graph.h's data (Note [C++ lineage recorder]). The rules are
// replay.py's, in the same order; see its module docstring for why.
#include <ATen/ATen.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>

#include "core/out_of_memory.h"
#include "torch/lineage_recorder.h"
#include "torch/saved_activation.h"

namespace py = pybind11;

namespace membudget {

namespace {
// Note [Held inputs freed under us] (replay.py): the same words as there.
constexpr const char* kFreedInput =
    "membudget: an input of a dropped activation had its storage freed after forward (FSDP2 frees each "
    "block's gathered parameters so); it cannot be recomputed: train with MEMBUDGET_ACTIONS=swap";
}  // namespace

namespace lineage {
namespace {

// A replay deeper than this many unmanaged producers is not worth it
// (replay.py's MAX_REPLAY_DEPTH).
constexpr int kMaxReplayDepth = 200;

// A dropped entry could not be rebuilt exactly; membudget.lineage_native
// turns it into membudget.replay.RecomputeError.
class ReplayError : public std::runtime_error {
  using std::runtime_error::runtime_error;
};

template <typename T>
void merge_into(std::vector<T>& into, const std::vector<T>& more) {
  if (more.empty()) return;
  into.insert(into.end(), more.begin(), more.end());
}

// Note [Why not recomputable] (csrc/core/residency_manager.cpp).
// Note [Parts of a storage] in lineage_recorder.cpp.
constexpr const char* kSeveralHistories =
    "its storage has several histories (outputs of unsafe_split or unsafe_chunk written in place)";

std::string reason_at(const char* why, const OpInfo* info) {
  std::string text = why != nullptr ? why : "its lineage cannot be replayed";
  if (info != nullptr) text += " at " + info->name;
  return text;
}

std::string reason_of(const Closure& closure) {
  return closure.ok ? std::string() : reason_at(closure.why, closure.blame);
}

// The probes of the held inputs a declared replay reads, one per held input
// shared by every entry that reads it (Note [Held inputs freed under us] in
// core/residency_entry.h). Under the recorder's lock.
HeldInputs held_probes(const Closure& closure) {
  HeldInputs probes;
  if (!closure.ok) return probes;
  for (const auto& external : closure.held) {
    if (!external->tensor.defined()) continue;  // held through its entry: managed
    if (external->probe == nullptr) external->probe = held_storage(external->tensor);
    if (external->probe != nullptr) probes.push_back(external->probe);
  }
  return probes;
}

template <typename T>
void sort_unique(std::vector<T>& values) {
  std::sort(values.begin(), values.end());
  values.erase(std::unique(values.begin(), values.end()), values.end());
}

std::shared_ptr<const Closure> compute_closure(RecorderState& s, const std::shared_ptr<StorageLineage>& lineage,
                                               int64_t version, int depth, bool filled_by_reader = false) {
  auto result = std::make_shared<Closure>();
  // The first obstacle is the one reported (Note [Why not recomputable]).
  auto blocked = [&result](const char* why, const OpNode& at) {
    if (result->why == nullptr) {
      result->why = why;
      result->blame = at.info;
    }
  };
  if (depth > kMaxReplayDepth) {
    blocked("its replay would run more than 200 ops deep", *lineage->producer);
    return result;
  }
  if (version > static_cast<int64_t>(lineage->mutations.size())) {
    blocked("written where nothing records", *lineage->producer);
    return result;
  }
  bool ok = true;
  double seconds = 0.0;
  // Note [Contents nobody recorded] (lineage_ops.cpp).
  if (version == 0 && !filled_by_reader && lineage->producer->info != nullptr &&
      lineage->producer->info->undefined_contents) {
    blocked("made by an op whose contents nobody recorded (an empty tensor filled where nothing records)",
            *lineage->producer);
    return result;
  }
  std::vector<std::shared_ptr<OpNode>> nodes{lineage->producer};
  for (int64_t i = 0; i < version; ++i) {
    std::shared_ptr<OpNode> writer = kept_writer(s, lineage->mutations[i]);
    if (writer == nullptr) {  // truncated (Note [Lineage ownership])
      blocked("an in-place write in its history was released (two forwards back)", *lineage->producer);
      return result;
    }
    nodes.push_back(std::move(writer));
  }
  for (const auto& node : nodes) {
    if (!node->replayable) blocked("an op in its history cannot be replayed", *node);
    ok = ok && node->replayable;
    seconds += node->seconds;
    for (const TensorRef& ref : node->refs) {
      if (ref.lineage == lineage) continue;  // the storage being rebuilt, replayed in order
      if (ref.external != nullptr) {
        if (ref.scratch) continue;
        result->externals.push_back(ref.external->key);
        result->held.push_back(ref.external);
        if (external_version(*ref.external) != ref.tensor_version) {
          blocked("an input its replay reads was changed in place after it was read", *node);
          ok = false;
        }
        continue;
      }
      const StorageLineage& source = *ref.lineage;
      if (ref.version >= static_cast<int64_t>(source.versions.size()) ||
          source.versions[ref.version] != ref.tensor_version) {
        blocked("an input its replay reads was written where nothing records", *node);
        ok = false;  // read after a write lineage did not see
        continue;
      }
      // Note [An empty tensor its first writer fills]: rrelu_with_noise
      // writes its `noise` argument, an empty_like made just before it, and
      // reads none of what was there; so does any op handed an empty tensor
      // it fills before reading (what a correct program reads of an empty
      // tensor, it wrote). Replayed, it gets a fresh empty tensor and fills
      // it again, with the RNG state it first ran under. Only this first
      // writer: any other reader of the empty contents stays unreplayable
      // (Note [Contents nobody recorded]), and its memo is not this one.
      const bool filled_by_reader = ref.version == 0 && !source.mutations.empty() &&
                                    source.mutations.front().lock() == node && source.producer->info != nullptr &&
                                    source.producer->info->undefined_contents;
      std::shared_ptr<const Closure> sub = filled_by_reader
                                               ? compute_closure(s, ref.lineage, 0, depth + 1, true)
                                               : closure(s, ref.lineage, ref.version, false, depth + 1);
      if (!sub->ok && result->why == nullptr) {
        result->why = sub->why;
        result->blame = sub->blame;
      }
      ok = ok && sub->ok;
      seconds += sub->seconds;
      merge_into(result->deps, sub->deps);
      merge_into(result->externals, sub->externals);
      merge_into(result->held, sub->held);
    }
  }
  sort_unique(result->deps);
  sort_unique(result->externals);
  sort_unique(result->held);
  result->ok = ok;
  result->seconds = seconds;
  return result;
}

// Replays without the recorder's lock (Note [Recorder lock and the GIL]): a
// replay materialises its managed inputs, which releases and retakes the
// GIL. What the recording thread may still change (a lineage's mutations,
// versions and entry id) is read under the lock; the rest (producers, nodes'
// arguments, held inputs) does not change once published.
class Replayer {
 public:
  // record_on: a CUDA side stream the replay runs on (Note [Recompute
  // ahead]): inputs it reads from managed entries and live tensors are
  // recorded on it, so that their blocks are not reused before it has run.
  Replayer(RecorderState& s, std::optional<c10::Stream> record_on) : s_(s), record_on_(record_on) {}

  at::Tensor rebuild(const std::shared_ptr<StorageLineage>& lineage, int64_t version) {
    std::vector<std::shared_ptr<OpNode>> writers;
    {
      std::lock_guard<std::recursive_mutex> lock(s_.mutex);
      if (version > static_cast<int64_t>(lineage->mutations.size())) {
        throw ReplayError("membudget: the lineage of a dropped activation was released; it cannot be recomputed");
      }
      for (int64_t i = 0; i < version; ++i) {
        writers.push_back(lineage->mutations[i].lock());
        if (writers.back() == nullptr) {
          throw ReplayError("membudget: an in-place op in the lineage of a dropped activation was released");
        }
      }
    }
    std::vector<at::Tensor> outputs = run(*lineage->producer);
    if (lineage->index >= static_cast<int64_t>(outputs.size()) || !outputs[lineage->index].defined()) {
      throw ReplayError("membudget: " + lineage->producer->info->name + " did not return the recorded output");
    }
    at::Tensor base = outputs[lineage->index];
    StorageLineage* key = lineage.get();
    auto previous = overrides_.find(key);
    std::optional<Rebuilding> saved;
    if (previous != overrides_.end()) saved = previous->second;
    overrides_[key] = Rebuilding{base, 0};
    for (const std::shared_ptr<OpNode>& writer : writers) {
      if (writer->info != nullptr) run(*writer);  // null: a write behind the counter (Note [Parts of a storage])
      ++overrides_[key].version;  // the map may have rehashed while the writer ran
    }
    if (saved) {
      overrides_[key] = *saved;
    } else {
      overrides_.erase(key);
    }
    return base;
  }

 private:
  std::vector<at::Tensor> run(const OpNode& node) {
    if (!node.replayable) throw ReplayError("membudget: " + node.info->name + " cannot be replayed");
    torch::jit::Stack stack;
    stack.reserve(node.args.size());
    for (const ArgSlot& slot : node.args) {
      switch (slot.kind) {
        case ArgSlot::kPlain:
          stack.push_back(slot.plain);
          break;
        case ArgSlot::kTensor:
          stack.emplace_back(resolve(node.refs[slot.refs[0]]));
          break;
        case ArgSlot::kTensorList: {
          c10::List<at::Tensor> list;
          for (int32_t r : slot.refs) list.push_back(resolve(node.refs[r]));
          stack.emplace_back(std::move(list));
          break;
        }
        case ArgSlot::kOptionalTensorList: {
          c10::List<std::optional<at::Tensor>> list;
          for (int32_t r : slot.refs) {
            list.push_back(r < 0 ? std::optional<at::Tensor>() : std::optional<at::Tensor>(resolve(node.refs[r])));
          }
          stack.emplace_back(std::move(list));
          break;
        }
      }
    }
    if (node.generator) {
      at::Generator generator = *node.generator;
      at::Tensor saved;
      {
        std::lock_guard<std::mutex> lock(generator.mutex());
        saved = generator.get_state();
        generator.set_state(node.generator_state);
      }
      try {
        node.info->op.callBoxed(stack);
      } catch (...) {
        std::lock_guard<std::mutex> lock(generator.mutex());
        generator.set_state(saved);
        throw;
      }
      std::lock_guard<std::mutex> lock(generator.mutex());
      generator.set_state(saved);
    } else {
      node.info->op.callBoxed(stack);
    }
    std::vector<at::Tensor> outputs;
    for (const c10::IValue& value : stack) {
      if (value.isTensor()) {
        outputs.push_back(value.toTensor());
      } else if (value.isTensorList()) {
        for (const at::Tensor& t : value.toTensorList().vec()) outputs.push_back(t);
      } else {
        outputs.emplace_back();
      }
    }
    return outputs;
  }

  at::Tensor resolve(const TensorRef& ref) {
    at::Tensor holder = storage_holder(ref).detach();
    at::Tensor view = as_recorded(holder, ref);
    return ref.scratch ? view.clone() : view;
  }

  // A tensor whose storage holds ref's storage at ref.version.
  at::Tensor storage_holder(const TensorRef& ref) {
    if (ref.external != nullptr) {
      const External& held = *ref.external;
      const int64_t version = external_version(held);
      if (!ref.scratch && version != ref.tensor_version) {
        throw ReplayError("membudget: an input of a dropped activation was modified in place after forward (version " +
                          std::to_string(ref.tensor_version) + " -> " + std::to_string(version) +
                          "); it cannot be recomputed");
      }
      if (held.tensor.defined()) {
        // Note [Held inputs freed under us] (replay.py).
        if (held.tensor.has_storage() && held.tensor.numel() > 0 && held.tensor.storage().nbytes() == 0) {
          throw ReplayError(kFreedInput);
        }
        return held.tensor;
      }
      // Held through its entry (Note [Held inputs reached through their
      // entry]): swapped in if it is on host.
      at::Tensor stored = entry_storage(held.entry->id());
      if (!stored.defined()) {
        throw ReplayError("membudget: an input of a dropped activation was released; it cannot be recomputed");
      }
      return recorded_on_side_stream(stored);
    }
    const std::shared_ptr<StorageLineage>& source = ref.lineage;
    auto override_it = overrides_.find(source.get());
    // Note [Reads of a storage being rebuilt] in replay.py: only at the
    // version its writes have reached; another version is rebuilt apart.
    if (override_it != overrides_.end() && override_it->second.version == ref.version) {
      return override_it->second.tensor;
    }
    bool current = false;
    uint64_t entry_id = 0;
    int64_t last_version = 0;
    {
      std::lock_guard<std::recursive_mutex> lock(s_.mutex);
      current = ref.version == static_cast<int64_t>(source->mutations.size());
      entry_id = source->entry_id;
      last_version = source->versions.back();
    }
    if (current) {
      if (entry_id != 0) {
        at::Tensor resident = entry_storage(entry_id);
        if (resident.defined()) return recorded_on_side_stream(resident);
      }
      c10::intrusive_ptr<c10::TensorImpl> alive = source->base.lock();
      if (alive) {
        at::Tensor tensor(std::move(alive));
        if (static_cast<int64_t>(tensor._version()) == last_version) return recorded_on_side_stream(tensor);
      }
    }
    return rebuild(source, ref.version);
  }

  static at::Tensor as_recorded(at::Tensor holder, const TensorRef& ref) {
    if (holder.scalar_type() == ref.dtype && holder.storage_offset() == ref.offset &&
        holder.sizes().equals(ref.sizes) && holder.strides().equals(ref.strides)) {
      return with_bits(std::move(holder), ref.conj, ref.neg);
    }
    if (holder.scalar_type() != ref.dtype) holder = as_dtype(std::move(holder), ref);
    return with_bits(holder.as_strided(ref.sizes, ref.strides, ref.offset), ref.conj, ref.neg);
  }

  // The holder's storage, from its start, as elements of ref.dtype: enough
  // of them for ref's view. A manager's storage comes as bytes; a live
  // tensor (z, where z.conj().imag was read) in its own dtype, whose bytes
  // are taken as they are (replay.py's _as_dtype).
  static at::Tensor as_dtype(at::Tensor holder, const TensorRef& ref) {
    if (holder.dim() != 1 || holder.storage_offset() != 0 || holder.element_size() != 1) {
      holder = with_bits(std::move(holder), false, false);
      int64_t extent = 1 + ref.offset;
      for (size_t d = 0; d < ref.sizes.size(); ++d) {
        if (ref.sizes[d] == 0) extent = 0;
        if (extent != 0) extent += (ref.sizes[d] - 1) * ref.strides[d];
      }
      const int64_t bytes = extent * static_cast<int64_t>(c10::elementSize(ref.dtype));
      const int64_t item = static_cast<int64_t>(holder.element_size());
      try {
        holder = holder.as_strided({(bytes + item - 1) / item}, {1}, 0).view(at::kByte);
      } catch (const c10::Error& error) {
        throw ReplayError(std::string("membudget: cannot reinterpret a replay input as another dtype: ") +
                          error.what_without_backtrace());
      }
    }
    return holder.view(ref.dtype);
  }

  // The view with these conjugate and negative bits (as recorded: Note
  // [Conjugate and negative views] in lineage.py); each flip is a view.
  static at::Tensor with_bits(at::Tensor view, bool conj, bool neg) {
    if (view.is_conj() != conj) view = at::_conj(view);
    if (view.is_neg() != neg) view = at::_neg_view(view);
    return view;
  }

  at::Tensor recorded_on_side_stream(at::Tensor tensor) const {
    if (record_on_ && tensor.device().type() == record_on_->device_type()) tensor.record_stream(*record_on_);
    return tensor;
  }

  RecorderState& s_;
  std::optional<c10::Stream> record_on_;
  struct Rebuilding {
    at::Tensor tensor;
    int64_t version = 0;  // writes applied so far
  };
  std::unordered_map<const StorageLineage*, Rebuilding> overrides_;  // storages being rebuilt
};

at::Tensor rebuild_entry(uint64_t entry_id, std::optional<std::tuple<int64_t, int64_t, int64_t>> stream) {
  RecorderState& s = state();
  std::shared_ptr<StorageLineage> lineage;
  int64_t version = 0;
  {
    std::lock_guard<std::recursive_mutex> lock(s.mutex);
    auto it = s.by_entry.find(entry_id);
    if (it == s.by_entry.end()) {
      throw ReplayError("membudget: no lineage recorded for dropped activation " + std::to_string(entry_id));
    }
    lineage = it->second;
    version = static_cast<int64_t>(lineage->mutations.size());
    auto lost = s.lost.find(entry_id);  // Note [A rescue that failed]
    if (lost != s.lost.end()) {
      if (lost->second.out_of_memory) throw OutOfMemory(lost->second.message, 0);
      throw ReplayError(lost->second.message);
    }
  }
  std::optional<c10::Stream> record_on;
  if (stream) {
    const auto& [stream_id, device_index, device_type] = *stream;
    record_on = c10::Stream::unpack3(stream_id, static_cast<c10::DeviceIndex>(device_index),
                                     static_cast<c10::DeviceType>(device_type));
  }
  PauseRecording paused;
  return Replayer(s, record_on).rebuild(lineage, version);
}

}  // namespace

std::shared_ptr<const Closure> closure(RecorderState& s, const std::shared_ptr<StorageLineage>& lineage,
                                       int64_t version, bool top, int depth) {
  const bool managed_input =
      !top && lineage->entry_id != 0 && version == static_cast<int64_t>(lineage->mutations.size());
  if (lineage->memo_epoch != s.epoch) {
    lineage->memo.clear();
    lineage->memo_epoch = s.epoch;
  }
  std::shared_ptr<const Closure> result;
  if (version < static_cast<int64_t>(lineage->memo.size())) result = lineage->memo[version];
  if (result == nullptr) {
    result = compute_closure(s, lineage, version, depth);
    if (static_cast<int64_t>(lineage->memo.size()) <= version) lineage->memo.resize(version + 1);
    lineage->memo[version] = result;
  }
  if (managed_input) {
    // Read, not replayed: the manager adds its cost when it is dropped.
    auto input = std::make_shared<Closure>();
    input->ok = result->ok;
    input->why = result->why;
    input->blame = result->blame;
    input->deps = {lineage->entry_id};
    input->externals = result->externals;
    return input;
  }
  return result;
}

// Which history rebuilds a storage with parts, packed as entry_id through
// tensor (Note [Parts of a storage] in lineage_recorder.cpp): the storage's,
// while its history is kept and no write through a part has left bytes of it
// dirty (written behind its own counter); else the part tensor lies in,
// if that part covers every byte of the storage (_unsafe_view's output). No
// single history, or two packs through different ones: swap-only (Note [One
// history per storage] in lineage.py), and null. The part packed, current,
// is read from the entry by its readers' replays.
std::shared_ptr<StorageLineage> declaring_lineage(RecorderState& s, uint64_t entry_id, const at::Tensor& tensor,
                                                  const RecorderState::Recorded& recorded) {
  const std::shared_ptr<StorageLineage>& whole = recorded.lineage;
  std::shared_ptr<StorageLineage> part = part_holding(*whole, tensor);
  const int64_t version = static_cast<int64_t>(tensor._version());
  const bool part_current = part != nullptr && version == part->versions.back() && !history_released(s, *part) &&
                            part->dirty.empty();
  if (part_current && part->entry_id == 0) part->entry_id = entry_id;
  std::shared_ptr<StorageLineage> declaring;
  if (!history_released(s, *whole) && whole->dirty.empty() &&
      (part != nullptr ? part_current : version == whole->versions.back())) {
    declaring = whole;
  } else if (part_current && part->begin_byte == 0 &&
             part->end_byte >= static_cast<int64_t>(tensor.storage().nbytes())) {
    declaring = part;
  }
  auto known = s.by_entry.find(entry_id);
  if (known != s.by_entry.end()) {
    if (known->second != declaring && s.swap_only_entries.insert(entry_id).second) {
      set_entry_recompute_info(entry_id, false, 0.0, {}, kSeveralHistories);  // being packed: resident
    }
    return nullptr;
  }
  if (declaring == nullptr || declaring->entry_id != 0) {
    s.by_entry[entry_id] = whole;
    s.swap_only_entries.insert(entry_id);
    set_entry_recompute_info(entry_id, false, 0.0, {}, reason_at(kSeveralHistories, whole->producer->info));
    return nullptr;
  }
  return declaring;
}

void declare_packed(RecorderState& s, uint64_t entry_id, const at::Tensor& tensor, Deferred& deferred) {
  const uintptr_t key = storage_address(tensor);
  if (s.held_storages.count(key) != 0) {  // Note [Held inputs reached through their entry]
    std::shared_ptr<StorageResidency> entry;
    for (auto& [impl, held] : s.externals) {
      if (held->key != key || !held->tensor.defined() || !held->tensor.has_storage() ||
          !held->tensor.storage().is_alias_of(tensor.storage())) {
        continue;
      }
      if (entry == nullptr) entry = entry_of_storage(tensor.storage());
      if (entry == nullptr) break;
      hold_through_entry(*held, entry, &deferred);
    }
  }
  auto it = s.by_storage.find(tensor.storage().unsafeGetStorageImpl());
  if (it == s.by_storage.end()) return;
  std::shared_ptr<StorageLineage> lineage = it->second.lineage;
  if (!lineage->parts.empty()) {
    lineage = declaring_lineage(s, entry_id, tensor, it->second);
    if (lineage == nullptr) return;
  } else if (lineage->entry_id != 0 || static_cast<int64_t>(tensor._version()) != lineage->versions.back()) {
    return;  // declared already, or written by something lineage did not see
  }
  std::shared_ptr<const Closure> result =
      closure(s, lineage, static_cast<int64_t>(lineage->mutations.size()), true, 0);
  lineage->entry_id = entry_id;
  s.by_entry[entry_id] = lineage;
  set_entry_recompute_info(entry_id, result->ok, result->seconds, result->deps, reason_of(*result),
                           held_probes(*result));
  if (result->ok && s.plan != nullptr) {
    std::string name = lineage->producer->info->name;
    name.replace(name.find("::"), 2, ".");  // as str(OpOverload) spells it, which plans use
    deferred.plan_queries.push_back({entry_id, lineage->producer->index, std::move(name), lineage->index});
  }
}

bool keep_copies_of(RecorderState& s, const std::vector<std::shared_ptr<External>>& readers);  // below

void rescue_dependents_of(RecorderState& s, uintptr_t key, const char* writer) {
  // Each entry whose replay reads `key`, the held inputs on `key` it reads,
  // and whether it reads it only through tensors it holds (copyable: Note
  // [Held inputs kept as a copy]) rather than through an entry.
  struct Dependent {
    uint64_t entry_id;
    bool copyable = true;
    std::vector<std::shared_ptr<External>> readers;
  };
  std::vector<Dependent> dependents;
  {
    std::lock_guard<std::recursive_mutex> lock(s.mutex);
    for (const auto& [entry_id, lineage] : s.by_entry) {
      const size_t version = lineage->mutations.size();
      if (lineage->memo_epoch != s.epoch || version >= lineage->memo.size() || !lineage->memo[version]) continue;
      const Closure& memo = *lineage->memo[version];
      if (!memo.ok || !std::binary_search(memo.externals.begin(), memo.externals.end(), key)) continue;
      Dependent dependent{entry_id};
      bool reads = false;
      for (const std::shared_ptr<External>& held : memo.held) {
        if (held->key != key) continue;
        reads = true;
        dependent.copyable = dependent.copyable && held->tensor.defined();
        if (held->tensor.defined()) dependent.readers.push_back(held);
      }
      // None: it read `key` through a held input copied at an earlier write.
      if (reads) dependents.push_back(std::move(dependent));
    }
  }
  // Note [Writes that refill a freed input] (core/residency_entry.h): a
  // rebuild now would read a freed input's storage before the write fills
  // it. Nor is it copied then: the held inputs are shared, and a copy taken
  // before the refill would hand those entries what was in the freed storage.
  const size_t before = dependents.size();
  dependents.erase(std::remove_if(dependents.begin(), dependents.end(),
                                  [](const Dependent& d) { return entry_reads_refilled_input(d.entry_id); }),
                   dependents.end());
  std::vector<std::shared_ptr<External>> readers;
  for (const Dependent& dependent : dependents) {
    readers.insert(readers.end(), dependent.readers.begin(), dependent.readers.end());
  }
  if (!dependents.empty() && dependents.size() == before && keep_copies_of(s, readers)) {
    dependents.erase(std::remove_if(dependents.begin(), dependents.end(), [](const Dependent& d) { return d.copyable; }),
                     dependents.end());
  }
  std::vector<uint64_t> rescued;
  for (const Dependent& dependent : dependents) rescued.push_back(dependent.entry_id);
  make_swap_only(s, rescued, "an input its replay reads was about to be written in place (rescued: made resident)",
                 writer);
}

// Note [Held inputs kept as a copy] (saved_activation.cpp): every reader of
// the storage about to be written holds a copy of it from now on, made
// before the write; false (nothing changed) where it is not worth its bytes
// or does not fit. The readers leave the recorder's map of this forward's
// held inputs, so that what reads the tensor after the write holds the tensor
// itself; their key becomes the copy's, so that later writes to the tensor
// no longer rescue what reads the copy.
bool keep_copies_of(RecorderState& s, const std::vector<std::shared_ptr<External>>& readers) {
  if (readers.empty()) return true;
  at::Tensor storage_copy;
  {
    PauseRecording paused;
    storage_copy = copy_of_held_input(readers.front()->tensor);
  }
  if (!storage_copy.defined()) return false;
  const c10::Storage& copied = storage_copy.storage();
  std::lock_guard<std::recursive_mutex> lock(s.mutex);
  for (const std::shared_ptr<External>& held : readers) {
    if (!held->tensor.defined() || held->tensor.storage().data() == copied.data()) continue;  // listed twice
    held->tensor = held_input_on(copied, held->tensor);
    held->key = storage_address(held->tensor);
    held->probe.reset();
  }
  for (auto it = s.externals.begin(); it != s.externals.end();) {
    if (std::find(readers.begin(), readers.end(), it->second) != readers.end()) {
      it = s.externals.erase(it);
    } else {
      ++it;
    }
  }
  return true;
}

// Note [A rescue that failed]: an entry is rescued (made resident) before
// something its replay needs goes: an input written in place, a writer a
// sweep releases. A dropped entry is rebuilt for it, under the budget, and
// that can run out of memory. The rescues run from the RecordFunction
// callbacks, which torch runs under a catch-all: the error was printed as a
// warning ("Exception in RecordFunction callback"), the op ran and wrote
// anyway, and the entries after the failed one in the list were never made
// swap-only: replayed later, they read the written input (the version check
// caught it, as a RecomputeError that named the write and not the cause;
// found with spectral_norm layers called twice in one forward, whose power
// iteration writes its vector in place). Now every entry is declared
// swap-only whatever happens to the others, and one that could not be
// rebuilt is lost: its replay raises what the rebuild raised (an
// out-of-memory as torch.OutOfMemoryError), with the write that made it
// needed, when and only when the activation is used. The Python recorder
// rescues inside its dispatch mode, where the error stops the op instead.
void make_swap_only(RecorderState& s, const std::vector<uint64_t>& entry_ids, const char* reason,
                    const char* writer) {
  if (entry_ids.empty()) return;
  py::gil_scoped_acquire gil;  // entry_storage may call the Python recompute callback
  for (uint64_t entry_id : entry_ids) {
    std::string error;
    bool out_of_memory = false;
    try {
      entry_storage(entry_id);
    } catch (py::error_already_set& raised) {
      static const py::object* torch_oom = new py::object(py::module_::import("torch").attr("OutOfMemoryError"));
      out_of_memory = raised.matches(*torch_oom);
      error = raised.what();
    } catch (const OutOfMemory& raised) {
      out_of_memory = true;
      error = raised.what();
    } catch (const c10::OutOfMemoryError& raised) {
      out_of_memory = true;
      error = raised.what_without_backtrace();
    } catch (const std::exception& raised) {
      error = raised.what();
    }
    if (!error.empty()) {
      std::string message = "membudget: dropped activation " + std::to_string(entry_id) +
                            " is lost: it had to be rebuilt because " + reason;
      if (writer != nullptr) message += std::string(" by ") + writer;
      message += ", and rebuilding it then failed: " + error +
                 (out_of_memory ? " -- raise the budget, or allow swapping (MEMBUDGET_ACTIONS=both), which keeps "
                                  "such activations on the host"
                                : "");
      std::lock_guard<std::recursive_mutex> lock(s.mutex);
      s.lost[entry_id] = RecorderState::Lost{std::move(message), out_of_memory};
    }
    set_entry_recompute_info(entry_id, false, 0.0, {}, reason);
  }
}

void Deferred::run(RecorderState& s) {
  for (uintptr_t key : rescues) rescue_dependents_of(s, key, writer);
  rescues.clear();
  make_swap_only(s, swap_only, kSeveralHistories);
  swap_only.clear();
  make_swap_only(s, swap_only_released,
                 "an in-place write in its history was released (two forwards back; rescued: made resident)");
  swap_only_released.clear();
  if (!plan_queries.empty()) {
    py::gil_scoped_acquire gil;
    py::object plan;
    {
      std::lock_guard<std::recursive_mutex> lock(s.mutex);  // GIL, then the lock: the order of every binding
      if (s.plan != nullptr) plan = *s.plan;
    }
    if (plan) {
      for (const PlanQuery& query : plan_queries) {
        plan(query.entry_id, query.op_index, query.op_name, query.output_index);
      }
    }
    plan_queries.clear();
  }
  released.clear();
  if (sweep) {
    // After the rescues, which replayed through these writers.
    std::unordered_map<const OpNode*, std::shared_ptr<OpNode>> writers;
    {
      std::lock_guard<std::recursive_mutex> lock(s.mutex);
      writers.swap(s.releasing);
    }
    sweep = false;
  }  // released here, without the lock
}

void redeclare_entries(RecorderState& s) {
  for (const auto& [entry_id, lineage] : s.by_entry) {
    if (s.swap_only_entries.count(entry_id) != 0) continue;  // Note [Parts of a storage]
    std::shared_ptr<const Closure> result =
        closure(s, lineage, static_cast<int64_t>(lineage->mutations.size()), true, 0);
    set_entry_recompute_info(entry_id, result->ok, result->seconds, result->deps, reason_of(*result),
                             held_probes(*result));
  }
}

void bind_lineage_replay(py::module_& m) {
  py::register_exception<ReplayError>(m, "ReplayError", PyExc_RuntimeError);
  m.def("describe", [](const at::Tensor& tensor) -> py::object {
    RecorderState& s = state();
    std::lock_guard<std::recursive_mutex> lock(s.mutex);
    if (!tensor.has_storage()) return py::none();
    auto it = s.by_storage.find(tensor.storage().unsafeGetStorageImpl());
    if (it == s.by_storage.end()) return py::none();
    const StorageLineage& lineage = *it->second.lineage;
    return py::make_tuple(lineage.producer->info->name, lineage.producer->index, lineage.index, lineage.versions,
                          static_cast<int64_t>(tensor._version()), lineage.entry_id, lineage.mutations.size(),
                          lineage.producer->seconds);
  }, py::arg("tensor"), "(producer, index, output, versions, tensor version, entry id, mutations, producer "
     "seconds) of a tensor's storage lineage, or None (tests and debugging).");
  m.def("rebuild", &rebuild_entry, py::arg("entry_id"), py::arg("stream") = py::none(),
        "Replays a dropped entry's storage; returns a tensor on the rebuilt storage (ReplayError if it cannot). "
        "stream: (stream_id, device_index, device_type) of the side stream a replay ahead runs on, whose "
        "inputs are recorded on it; or None.");
}

}  // namespace lineage
}  // namespace membudget

// Saved activations as handles: what the saved_tensors_hooks pack function
// returns in place of a tensor, and what unpack turns back into one.
//
// Note [Storage-level residency]: residency is managed per storage, not per
// tensor. Several saved tensors may be views of one storage (x and x.t()),
// and all of them share one StorageResidency; each SavedActivation keeps the
// view's geometry (sizes, strides, offset, dtype) and rebuilds its view on
// unpack. A storage is evictable only while its use count is 1, i.e. only the
// StorageResidency holds it.
#pragma once
#include <torch/extension.h>

#include <memory>

#include "core/residency_entry.h"

namespace membudget {

class StorageResidency final : public ResidencyEntry {
 public:
  explicit StorageResidency(c10::Storage storage);
  ~StorageResidency() override;

  bool externally_referenced() const override;
  void* device_data() const override;
  void drop_device_copy() override;
  void attach_device_copy(void* ptr) override;

  // The storage while resident (valid after materialize(), before unpin()).
  const c10::Storage& storage() const { return storage_; }
  const c10::Device& device() const { return device_; }
  // Takes a replayed storage as the new device copy (Note [Recompute]);
  // throws if its size, device or allocator do not match.
  void adopt_recomputed(c10::Storage storage);

 private:
  c10::Storage storage_;
  c10::Device device_;
};

class SavedActivation {
 public:
  // saved_for_backward: a handle autograd holds (pack), not one a lineage
  // recorder holds to read the entry (Note [Entries only lineage holds]).
  SavedActivation(std::shared_ptr<StorageResidency> residency, const at::Tensor& view, bool saved_for_backward = true);
  SavedActivation(const SavedActivation& other);
  SavedActivation& operator=(const SavedActivation&) = delete;
  SavedActivation& operator=(SavedActivation&&) = delete;
  ~SavedActivation();
  // Materialises the storage (swap-in if needed) and rebuilds the view.
  at::Tensor unpack() const;
  size_t storage_bytes() const { return residency_->bytes(); }
  uint64_t entry_id() const { return residency_->id(); }
  StorageResidency& residency() const { return *residency_; }
  std::string state() const;
  // The saved tensor's version counter now (0 when it has none).
  int64_t current_tensor_version() const;

 private:
  std::shared_ptr<StorageResidency> residency_;
  std::vector<int64_t> sizes_;
  std::vector<int64_t> strides_;
  int64_t storage_offset_;
  at::ScalarType dtype_;
  c10::Device device_;
  // The saved tensor's version counter (shared, not the tensor) and its
  // value when packed (Note [Saved versions checked]).
  c10::VariableVersion version_counter_;
  uint32_t saved_version_ = 0;
  bool saved_for_backward_ = true;
};

// The pack hook: returns a SavedActivation for managed activations, and for
// everything else (parameters, small tensors, tensors whose memory is not
// ours, subclasses) a tuple of the tensor detached (Note [Pack without a
// cycle]) and its version (Note [Saved versions checked]). Called with the
// GIL held.
pybind11::object pack_saved_tensor(const at::Tensor& tensor);
// The unpack hook: the inverse of pack_saved_tensor.
pybind11::object unpack_saved_tensor(const pybind11::object& packed);
// The whole storage of a live entry, made resident (swapped in or replayed)
// and viewed as 1-D uint8; None when no live entry has that id. The lineage
// reads a replay's managed inputs through this.
pybind11::object entry_storage_tensor(uint64_t entry_id);
// The same as a tensor (undefined when no live entry has that id), for the
// C++ lineage recorder's replays. Called with the GIL held.
at::Tensor entry_storage(uint64_t entry_id);
// `held` (an input a recorded op is about to write) on a copy of its
// storage, at its version, or undefined where the copy is not worth its
// bytes or does not fit (Note [Held inputs kept as a copy]).
at::Tensor copy_of_held_input(const at::Tensor& held);
// A tensor on `storage` with the geometry, dtype and version of `like` (a
// held input on the storage that copy_of_held_input copied).
at::Tensor held_input_on(const c10::Storage& storage, const at::Tensor& like);
// The live managed entry whose storage is `storage`, or null (Note [Held
// inputs reached through their entry] in lineage_recorder.cpp).
std::shared_ptr<StorageResidency> entry_of_storage(const c10::Storage& storage);
// Whether any live entry has a handle autograd holds (Note [Entries only lineage holds]).
bool any_entry_saved_for_backward();
// Ids of the live managed entries.
std::vector<uint64_t> live_entry_ids();
// A storage a replay reads that no entry manages, held weakly: present while
// it lives and has bytes (Note [Held inputs freed under us] in
// core/residency_entry.h). Null for a tensor without elements or storage.
std::shared_ptr<const HeldInput> held_storage(const at::Tensor& tensor);
// Declares whether and at what cost an entry can be replayed, and which
// entries its replay reads (ResidencyManager::set_recompute_info by id).
// `reason`: why it cannot be replayed (Note [Why not recomputable]); `held`:
// the storages it reads that no entry manages.
void set_entry_recompute_info(uint64_t entry_id, bool recomputable, double replay_seconds,
                              const std::vector<uint64_t>& input_ids, std::string reason = {},
                              HeldInputs held = {});
// Whether a write to a held input should leave this entry as it is rather
// than rebuild it first (ResidencyManager::reads_refilled_input).
bool entry_reads_refilled_input(uint64_t entry_id);
// Live SavedActivation storages (for leak checks in tests).
size_t live_storage_residencies();
void bind_saved_activation(pybind11::module_& m);

}  // namespace membudget

#include "torch/saved_activation.h"

#include <mutex>
#include <unordered_map>

#include "core/residency_manager.h"
#include "torch/runtime.h"

namespace py = pybind11;

namespace membudget {
namespace {

// Storage -> residency, so views of one storage packed separately share an
// entry. Weak: the entry dies with its last SavedActivation.
std::mutex g_registry_mutex;
std::unordered_map<const c10::StorageImpl*, std::weak_ptr<StorageResidency>> g_registry;

void registry_erase(const c10::StorageImpl* impl, const StorageResidency* owner) {
  std::lock_guard<std::mutex> lock(g_registry_mutex);
  auto it = g_registry.find(impl);
  if (it == g_registry.end()) return;
  auto current = it->second.lock();
  if (current == nullptr || current.get() == owner) g_registry.erase(it);
}

void delete_managed_storage_memory(void* ptr) { free_device_for_torch(ptr); }

bool is_managed_candidate(const at::Tensor& t, Runtime& runtime) {
  if (!t.defined() || t.layout() != c10::kStrided || t.is_nested() || !t.has_storage()) return false;
  if (t.key_set().has(c10::DispatchKey::Python) || t.is_conj() || t.is_neg()) return false;
  // Parameters (and other leaves that require grad) stay where they are.
  if (t.is_leaf() && t.requires_grad()) return false;
  const c10::Storage& storage = t.storage();
  if (storage.nbytes() < runtime.config().min_tensor_bytes || storage.nbytes() == 0) return false;
  const void* data = storage.data_ptr().get();
  // Only memory from our own allocator is worth releasing (a storage made
  // before install, from numpy, or a copy-on-write one is left alone).
  // allocation_size is 0 for pointers that are not a live block of ours.
  return data != nullptr && runtime.device_allocator().allocation_size(data) >= storage.nbytes();
}

}  // namespace

StorageResidency::StorageResidency(c10::Storage storage)
    : ResidencyEntry(storage.nbytes()), storage_(std::move(storage)), device_(storage_.device()) {}

StorageResidency::~StorageResidency() {
  if (Runtime* runtime = Runtime::get()) runtime->manager().unregister_entry(this);
  if (storage_) registry_erase(storage_.unsafeGetStorageImpl(), this);
  storage_ = c10::Storage();
}

bool StorageResidency::externally_referenced() const {
  return storage_ && storage_.use_count() > 1;
}

void* StorageResidency::device_data() const {
  return storage_ ? const_cast<void*>(storage_.data_ptr().get()) : nullptr;
}

void StorageResidency::drop_device_copy() {
  registry_erase(storage_.unsafeGetStorageImpl(), this);
  storage_ = c10::Storage();  // last reference: the DataPtr's deleter frees the block
}

void StorageResidency::attach_device_copy(void* ptr) {
  c10::DataPtr data(ptr, ptr, &delete_managed_storage_memory, device_);
  storage_ = c10::Storage(c10::Storage::use_byte_size_t(), bytes(), std::move(data),
                          /*allocator=*/nullptr, /*resizable=*/false);
}

SavedActivation::SavedActivation(std::shared_ptr<StorageResidency> residency, const at::Tensor& view)
    : residency_(std::move(residency)),
      sizes_(view.sizes().vec()),
      strides_(view.strides().vec()),
      storage_offset_(view.storage_offset()),
      dtype_(view.scalar_type()),
      device_(view.device()) {}

at::Tensor SavedActivation::unpack() const {
  Runtime* runtime = Runtime::get();
  TORCH_CHECK(runtime != nullptr, "membudget: a saved activation outlived the runtime");
  c10::Storage storage;
  {
    py::gil_scoped_release no_gil;  // a swap-in may block on a copy
    runtime->manager().materialize(residency_.get(), nullptr);
    storage = residency_->storage();
    runtime->manager().unpin(residency_.get());
  }
  at::Tensor tensor = at::empty({0}, at::TensorOptions().dtype(dtype_).device(device_));
  tensor.set_(storage, storage_offset_, sizes_, strides_);
  return tensor;
}

std::string SavedActivation::state() const {
  // For reprs only; racy by nature.
  return residency_->device_data() != nullptr ? "device" : "host";
}

py::object pack_saved_tensor(const at::Tensor& tensor) {
  Runtime* runtime = Runtime::get();
  if (runtime == nullptr || !runtime->managing() || !is_managed_candidate(tensor, *runtime)) {
    return py::cast(tensor);
  }
  const c10::StorageImpl* impl = tensor.storage().unsafeGetStorageImpl();
  std::shared_ptr<StorageResidency> residency;
  bool is_new = false;
  {
    std::lock_guard<std::mutex> lock(g_registry_mutex);
    auto it = g_registry.find(impl);
    if (it != g_registry.end()) residency = it->second.lock();
    if (residency == nullptr) {
      residency = std::make_shared<StorageResidency>(tensor.storage());
      g_registry[impl] = residency;
      is_new = true;
    }
  }
  if (is_new) {
    runtime->manager().register_entry(residency.get());
  } else {
    runtime->manager().touch(residency.get());
  }
  return py::cast(SavedActivation(std::move(residency), tensor));
}

py::object unpack_saved_tensor(const py::object& packed) {
  if (py::isinstance<SavedActivation>(packed)) {
    return py::cast(packed.cast<const SavedActivation&>().unpack());
  }
  return packed;
}

size_t live_storage_residencies() {
  Runtime* runtime = Runtime::get();
  return runtime != nullptr ? runtime->manager().stats().live_entries : 0;
}

void bind_saved_activation(py::module_& m) {
  py::class_<SavedActivation>(m, "SavedActivation",
                              "A saved activation under membudget's residency management.")
      .def_property_readonly("storage_bytes", &SavedActivation::storage_bytes)
      .def("__repr__", [](const SavedActivation& s) {
        return "<membudget.SavedActivation " + std::to_string(s.storage_bytes()) + " bytes on " + s.state() + ">";
      });
  m.def("pack", &pack_saved_tensor, "saved_tensors_hooks pack function");
  m.def("unpack", &unpack_saved_tensor, "saved_tensors_hooks unpack function");
  m.def("live_handles", &live_storage_residencies, "number of live managed storages");
}

}  // namespace membudget

// The pluggable-allocator symbols (see Note [Pluggable allocator symbols] in
// cuda_symbols.h) and bind_cuda: what Python's CUDA install path and the CUDA
// tests need. Compiled always; the CUDA backend parts only with
// MEMBUDGET_WITH_CUDA, the C++ hooks install only with MEMBUDGET_TORCH_CUDA.
#include "torch/cuda_symbols.h"

#include <dlfcn.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>
#include <vector>

#include "torch/bindings.h"
#include "torch/runtime.h"
#ifdef MEMBUDGET_WITH_CUDA
#include "core/cuda_backend.h"
#endif

namespace py = pybind11;

namespace {

membudget::Runtime& runtime_or_throw(const char* what) {
  membudget::Runtime* runtime = membudget::Runtime::get();
  TORCH_CHECK(runtime != nullptr, "membudget: ", what,
              " was called but no membudget runtime exists; the CUDA allocator "
              "must be installed through membudget.install()");
  return *runtime;
}

}  // namespace

extern "C" {

void* membudget_cuda_malloc(size_t size, int device, void* stream) {
#ifdef MEMBUDGET_WITH_CUDA
  // One runtime serves one device (one per rank, DESIGN.md "Beyond one
  // machine"); memory of another device handed to torch would fault later.
  auto* cuda = dynamic_cast<membudget::CudaBackend*>(
      &runtime_or_throw("the CUDA allocator").backend());
  TORCH_CHECK(cuda == nullptr || cuda->device() == device,
              "membudget: allocation requested on cuda:", device,
              " but the runtime manages cuda:", cuda ? cuda->device() : -1,
              "; membudget budgets one device per process (use one process per "
              "device, as torch.distributed does)");
#else
  (void)device;
#endif
  return membudget::allocate_device_for_torch(size, stream);
}

void membudget_cuda_free(void* ptr, size_t /*size*/, int /*device*/, void* /*stream*/) {
  if (ptr == nullptr) return;
  try {
    membudget::free_device_for_torch(ptr);
  } catch (const std::exception& error) {
    std::fprintf(stderr, "membudget: freeing CUDA memory at %p failed: %s\n", ptr,
                 error.what());
  } catch (...) {
    std::fprintf(stderr, "membudget: freeing CUDA memory at %p failed\n", ptr);
  }
}

void membudget_cuda_record_stream(void* ptr, void* stream) {
  if (ptr == nullptr) return;
  membudget::CachingAllocator& allocator = runtime_or_throw("record_stream").device_allocator();
  // Memory another allocator handed out (a CUDA tensor received from another
  // process, one imported through DLPack) is not ours to defer: torch's own
  // allocator skips such tensors too, where this raised "not live".
  if (!allocator.owns(ptr)) return;
  allocator.record_stream(ptr, stream);
}

void membudget_cuda_empty_cache() {
  if (membudget::Runtime* runtime = membudget::Runtime::get()) {
    runtime->device_allocator().release_cached();
  }
}

}  // extern "C"

namespace membudget {

std::unique_ptr<Backend> make_cuda_backend_or_throw(int device) {
#ifdef MEMBUDGET_WITH_CUDA
  return make_cuda_backend(device);
#else
  (void)device;
  throw std::runtime_error(
      "membudget: this build has no CUDA backend (the CUDA toolkit was not found "
      "when the extension was built); rebuild with the toolkit installed");
#endif
}

namespace {

// Path of the shared object holding this code: what
// torch.cuda.memory.CUDAPluggableAllocator(path, ...) loads with ctypes.
std::string extension_path() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&membudget_cuda_malloc), &info) == 0 ||
      info.dli_fname == nullptr) {
    throw std::runtime_error("membudget: dladdr could not locate the extension module");
  }
  return info.dli_fname;
}

#ifdef MEMBUDGET_WITH_CUDA

// A completion event handed to Python. Wrapped rather than binding Event
// itself, which bind_core may register for the host backend.
struct CudaTestEvent {
  EventPtr event;
};

// A standalone CudaBackend with integer addresses, for tests/test_cuda.py. It
// is not the runtime's backend and never touches the installed allocator.
struct CudaTestBackend {
  explicit CudaTestBackend(int device) : backend(device) {}
  CudaBackend backend;
};

CopyDirection parse_direction(const std::string& name) {
  if (name == "d2h") return CopyDirection::device_to_host;
  if (name == "h2d") return CopyDirection::host_to_device;
  throw std::invalid_argument("membudget: copy direction must be 'd2h' or 'h2d', got '" +
                              name + "'");
}

void* as_pointer(uintptr_t address) { return reinterpret_cast<void*>(address); }

// One H2D then D2H round trip through pinned memory on `device`, ordered
// through the legacy default stream; returns what a test or
// `python -m membudget.info` checks.
py::dict cuda_backend_selftest(int device, size_t bytes) {
  bool round_trip_ok = false;
  size_t pending_after_wait = 0;
  bool ready_after_wait = false;
  std::string name;
  size_t capacity = 0;
  {
    py::gil_scoped_release no_gil;
    CudaBackend backend(device);
    name = backend.name();
    capacity = backend.device_capacity();
    auto* source = static_cast<unsigned char*>(backend.host_alloc(bytes));
    auto* target = static_cast<unsigned char*>(backend.host_alloc(bytes));
    void* on_device = backend.device_alloc(bytes);
    std::string error;
    if (source == nullptr || target == nullptr || on_device == nullptr) {
      error = "membudget: selftest could not allocate " + std::to_string(bytes) + " bytes";
    } else {
      try {
        for (size_t i = 0; i < bytes; ++i) source[i] = static_cast<unsigned char>(i * 131 + 7);
        std::memset(target, 0, bytes);
        EventPtr uploaded = backend.copy_to_device(on_device, source, bytes, nullptr);
        backend.stream_wait(nullptr, uploaded);
        EventPtr downloaded = backend.copy_to_host(target, on_device, bytes, nullptr);
        downloaded->wait();
        ready_after_wait = downloaded->ready();
        pending_after_wait = backend.pending_copies(CopyDirection::device_to_host);
        round_trip_ok = std::memcmp(source, target, bytes) == 0;
      } catch (const std::exception& e) {
        error = e.what();
      }
    }
    backend.device_free(on_device, bytes);
    backend.host_free(target, bytes);
    backend.host_free(source, bytes);
    if (!error.empty()) throw std::runtime_error(error);
  }
  py::dict result;
  result["name"] = name;
  result["device_capacity"] = capacity;
  result["bytes"] = bytes;
  result["round_trip_ok"] = round_trip_ok;
  result["ready_after_wait"] = ready_after_wait;
  result["pending_after_wait"] = pending_after_wait;
  return result;
}

void bind_cuda_test_surface(py::module_& m) {
  py::class_<CudaTestEvent>(m, "_CudaTestEvent")
      .def("ready", [](CudaTestEvent& self) { return self.event->ready(); })
      .def("wait", [](CudaTestEvent& self) { self.event->wait(); },
           py::call_guard<py::gil_scoped_release>());

  py::class_<CudaTestBackend>(m, "_CudaTestBackend",
                              "A standalone CudaBackend over integer addresses, for tests.")
      .def(py::init<int>(), py::arg("device"))
      .def_property_readonly("name", [](CudaTestBackend& self) { return self.backend.name(); })
      .def("device_capacity", [](CudaTestBackend& self) { return self.backend.device_capacity(); })
      .def("device_alloc", [](CudaTestBackend& self, size_t bytes) {
        return reinterpret_cast<uintptr_t>(self.backend.device_alloc(bytes));
      })
      .def("device_free", [](CudaTestBackend& self, uintptr_t ptr, size_t bytes) {
        self.backend.device_free(as_pointer(ptr), bytes);
      })
      .def("host_alloc", [](CudaTestBackend& self, size_t bytes) {
        return reinterpret_cast<uintptr_t>(self.backend.host_alloc(bytes));
      })
      .def("host_free", [](CudaTestBackend& self, uintptr_t ptr, size_t bytes) {
        self.backend.host_free(as_pointer(ptr), bytes);
      })
      .def("record", [](CudaTestBackend& self, uintptr_t stream) {
        return CudaTestEvent{self.backend.record(as_pointer(stream))};
      })
      .def("stream_wait", [](CudaTestBackend& self, uintptr_t stream, CudaTestEvent& event) {
        self.backend.stream_wait(as_pointer(stream), event.event);
      })
      .def("copy_to_host",
           [](CudaTestBackend& self, uintptr_t dst, uintptr_t src, size_t bytes,
              uintptr_t after) {
             return CudaTestEvent{self.backend.copy_to_host(as_pointer(dst), as_pointer(src),
                                                            bytes, as_pointer(after))};
           },
           py::arg("host_dst"), py::arg("device_src"), py::arg("bytes"), py::arg("after"))
      .def("copy_to_device",
           [](CudaTestBackend& self, uintptr_t dst, uintptr_t src, size_t bytes,
              uintptr_t after) {
             return CudaTestEvent{self.backend.copy_to_device(as_pointer(dst), as_pointer(src),
                                                              bytes, as_pointer(after))};
           },
           py::arg("device_dst"), py::arg("host_src"), py::arg("bytes"), py::arg("after"))
      .def("pending_copies", [](CudaTestBackend& self, const std::string& direction) {
        return self.backend.pending_copies(parse_direction(direction));
      });

  m.def("cuda_backend_selftest", &cuda_backend_selftest, py::arg("device") = 0,
        py::arg("bytes") = size_t{4} << 20,
        "Round-trips `bytes` through pinned host memory and device `device` with a "
        "standalone CudaBackend; returns a dict (round_trip_ok, pending_after_wait, ...).");
}

#endif  // MEMBUDGET_WITH_CUDA

}  // namespace

void bind_cuda(py::module_& m) {
  m.def("cuda_device_count",
        []() {
#ifdef MEMBUDGET_WITH_CUDA
          return cuda_device_count();
#else
          return 0;
#endif
        },
        "Number of CUDA devices membudget's backend sees; 0 without driver, device "
        "or CUDA backend. Never raises, and does not initialise torch.cuda.");
  m.def("cuda_current_device",
        []() {
#ifdef MEMBUDGET_WITH_CUDA
          return cuda_current_device();
#else
          return 0;
#endif
        },
        "The CUDA runtime's current device on this thread (0 unless set), read without "
        "initialising torch.cuda.");
  m.def("cuda_set_current_device",
        [](int device) {
#ifdef MEMBUDGET_WITH_CUDA
          cuda_set_current_device(device);
#else
          (void)device;
          throw std::runtime_error("membudget: this build of the extension has no CUDA backend");
#endif
        },
        py::arg("device"),
        "Make `device` the CUDA runtime's current device on this thread (what "
        "torch.cuda.current_device() reads), without initialising torch.cuda.");
  m.def("cuda_total_memory",
        [](int device) -> size_t {
#ifdef MEMBUDGET_WITH_CUDA
          return cuda_total_memory(device);
#else
          (void)device;
          return 0;
#endif
        },
        py::arg("device"),
        "Total memory of CUDA device `device` in bytes (as torch's total_memory), read "
        "without initialising torch.cuda; 0 without a CUDA backend.");
  m.def("extension_path", &extension_path,
        "Path of this extension module, for CUDAPluggableAllocator(path, ...).");
  py::dict symbols;
  symbols["malloc"] = "membudget_cuda_malloc";
  symbols["free"] = "membudget_cuda_free";
  symbols["record_stream"] = "membudget_cuda_record_stream";
  symbols["empty_cache"] = "membudget_cuda_empty_cache";
  m.attr("cuda_allocator_symbols") = symbols;
#ifdef MEMBUDGET_WITH_CUDA
  bind_cuda_test_surface(m);
#endif
#ifdef MEMBUDGET_TORCH_CUDA
  m.def("install_cuda_pluggable_with_hooks", &install_cuda_pluggable_with_hooks,
        "Makes membudget torch's CUDA allocator, with record_stream and empty_cache "
        "hooks. Must run before torch.cuda is initialised.");
#endif
}

}  // namespace membudget

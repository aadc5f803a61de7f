// The extension module membudget._C: build information plus each binding
// file's registration function (see bindings.h).
#include "torch/bindings.h"
#include "torch/lineage_recorder.h"
#include "torch/op_observer.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "membudget native core: budgeted caching allocator and residency manager";
  m.attr("__version__") = MEMBUDGET_VERSION;
  m.attr("compiler") = MEMBUDGET_COMPILER;
  m.attr("torch_version_built") = MEMBUDGET_TORCH_VERSION;
#ifdef MEMBUDGET_WITH_CUDA
  m.attr("cuda_backend_compiled") = true;
#else
  m.attr("cuda_backend_compiled") = false;
#endif
#ifdef MEMBUDGET_TORCH_CUDA
  m.attr("torch_cuda_hooks_compiled") = true;
#else
  m.attr("torch_cuda_hooks_compiled") = false;
#endif
  membudget::bind_core(m);
  membudget::bind_runtime(m);
  membudget::bind_cuda(m);
  membudget::bind_sim(m);
  membudget::bind_timeline(m);
  membudget::bind_op_observer(m);
  membudget::lineage::bind_lineage(m);
}

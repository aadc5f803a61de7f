#include "torch/bindings.h"
namespace membudget { void bind_runtime(pybind11::module_&) {} }

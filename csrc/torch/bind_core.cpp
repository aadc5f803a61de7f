#include "torch/bindings.h"
namespace membudget { void bind_core(pybind11::module_&) {} }

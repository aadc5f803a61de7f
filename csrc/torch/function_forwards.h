// Which ops run inside the forward of a custom torch.autograd.Function: see
// Note [Custom Function forwards] in function_forwards.cpp.
#pragma once

#include <ATen/record_function.h>
#include <torch/extension.h>

namespace membudget {
namespace lineage {

// Whether `fn` is the RecordFunction that Function.apply opens around a
// custom Function's forward, called with grad mode on outside backward.
// Recording thread only.
bool starts_function_forward(const at::RecordFunction& fn);
// Whether that Function is a torch.compile'd region (Note [Compiled regions
// are not recorded]).
bool is_compiled_region(const at::RecordFunction& fn);
// The calling thread entered / left such a forward.
void enter_function_forward(bool compiled);
void leave_function_forward(bool compiled);
// Whether the calling thread is inside one, and not inside a compiled
// region (grad mode is off there).
bool in_function_forward();
// Resets this thread's count (a recorder starting or stopping).
void reset_function_forwards();
// Whether autograd has rebased `tensor`'s history onto the node of the
// custom Function whose record has sequence number `sequence_nr` (what
// ctx.mark_dirty does as apply returns): its grad_fn is that node, or, for
// a view, its base's CopySlices wraps it (Note [Marked dirty by a Function]
// in lineage_recorder.cpp).
bool rebased_onto_function(const at::Tensor& tensor, int64_t sequence_nr);

// Binds track_function_forwards(on) and in_function_forward() into the
// lineage submodule, for the Python recorder, which sees ops from a
// TorchDispatchMode and not Function.apply's RecordFunction.
void bind_function_forwards(pybind11::module_& lineage_module);

}  // namespace lineage
}  // namespace membudget

// Note [Custom Function forwards]: torch.autograd.Function.apply runs the
// forward of a custom Function with grad mode off, and both recorders skip
// ops that run with grad mode off (no_grad work saves nothing). So the
// tensors such a forward computes and saves with ctx.save_for_backward had
// no lineage: they could only be swapped, and the one a later recorded op
// read was held by the recorder as an input (a parameter, the batch) for
// the rest of the step, where swapping its saved copy freed nothing
// (bench/bench_min_budget.py, a stack of six such Functions: swap-only fit
// in 3.83 MiB, both actions needed 4.34 MiB and recompute-only 8.60 MiB of
// an 8.75 MiB peak; now all three fit in 3.83 MiB).
// Yet grad was on when the Function was called, and its forward is part of
// the forward being recorded. THPFunction_apply opens a RecordFunction named
// after the Function's class around the whole call, before grad mode is
// turned off: a FUNCTION-scope record that is not an operator call. Opened
// with grad mode on and outside backward, it marks the ops under it as
// recordable on this thread until it closes. Other non-operator records
// under grad mode (TorchScript calls) run their ops with grad on anyway,
// so marking them changes nothing. The ops recorded this way are replayed
// like any others; Note [Contents nobody recorded] (lineage_ops.cpp and
// lineage.py) keeps a kernel's raw writes, which such forwards often make
// into an empty tensor, from being "replayed" as an empty tensor.
#include "torch/function_forwards.h"

#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/functions/tensor.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>

#include <cstring>
#include <optional>
#include <unordered_set>

namespace membudget {
namespace lineage {
namespace {

thread_local int t_function_forwards = 0;
thread_local int t_compiled_regions = 0;
// The Python recorder's callback on this thread (track_function_forwards).
thread_local std::optional<at::CallbackHandle> t_tracker;
// What the Python recorder asked to be called with as a Function's record
// closes, and whether it wants the call (Note [Marked dirty by a Function]
// in lineage_recorder.cpp). An owned reference, given back when tracking
// stops; a thread that exits tracking leaks it rather than decref without
// the GIL.
thread_local PyObject* t_settle = nullptr;
thread_local bool t_settle_armed = false;

// Note [Record names are not keys]: an operator's record names it with its
// schema's name, a string that lives as long as the operator's registration,
// so its address can key a cache (lineage_ops.cpp's lookup_info does). Any
// other record -- a custom Function's apply, a profiler label -- keeps its
// name in a std::string inside the record: on the stack for a short name,
// on the heap for a longer one, freed when the record closes and handed to
// the next record's name. Both answers below were cached by that address.
// The heap string of a "CompiledFunction" record (16 characters) was often
// the next Function's name when that name was 16 to 23 characters long:
// that Function's forward then counted as a compiled region and went
// unrecorded, what it saved was swap-only (9 and 26 calls in 100 under the
// Python and C++ recorders, tests/test_recompute_cases.py), and its output
// read later was held as an input, with its entry: a failed backward then
// left that entry alive (2 runs in 400 of a probe of
// test_a_backward_that_raises_leaves_no_graph_queued, the CI failure of
// session 38). Which address came back depended on the whole process's
// history. Now only "is an operator" is cached (schema names do not move);
// non-operator records, one per Function call, are asked each time.
bool names_an_operator(const at::RecordFunction& fn) {
  thread_local std::unordered_set<const void*> operators;
  const void* key = fn.name();
  if (operators.count(key) != 0) return true;
  // Two string copies for an operator, once; none for any other record.
  if (!fn.operator_name().has_value()) return false;
  operators.insert(key);
  return true;
}

// Something non-null for the records that opened a forward: what the end
// callback receives back, so no stack of its own is kept.
struct OpenedForward final : at::ObserverContext {
  explicit OpenedForward(bool compiled_region) : compiled(compiled_region) {}
  bool compiled;
};

std::unique_ptr<at::ObserverContext> on_record_start(const at::RecordFunction& fn) {
  if (!starts_function_forward(fn)) return nullptr;
  const bool compiled = is_compiled_region(fn);
  enter_function_forward(compiled);
  return std::make_unique<OpenedForward>(compiled);
}

void on_record_end(const at::RecordFunction& fn, at::ObserverContext* opened) {
  if (opened == nullptr) return;
  leave_function_forward(static_cast<OpenedForward*>(opened)->compiled);
  if (!t_settle_armed || t_settle == nullptr) return;
  // Function.apply holds the GIL here; acquiring is a check then.
  t_settle_armed = false;
  pybind11::gil_scoped_acquire gil;
  // A forward that raised returns through here with its exception set:
  // kept aside for the call and restored, so the caller still sees it
  // (called with it set, the callback's result turned it into a SystemError).
  pybind11::error_scope raised;
  try {
    // settle(depth after this forward, its sequence number) -> whether
    // writes of outer forwards still wait.
    t_settle_armed = pybind11::handle(t_settle)(t_function_forwards, fn.seqNr()).cast<bool>();
  } catch (pybind11::error_already_set& error) {
    error.discard_as_unraisable("membudget: settling a custom Function's in-place writes");
  }
}

}  // namespace

bool starts_function_forward(const at::RecordFunction& fn) {
  return fn.scope() == at::RecordScope::FUNCTION && c10::GradMode::is_enabled() &&
         torch::autograd::get_current_graph_task_id() == -1 && !names_an_operator(fn);
}

// Note [Compiled regions are not recorded]: AOTAutograd runs a compiled
// graph as the forward of a Function named CompiledFunction, so its ops were
// recorded like a custom Function's. Under inductor few of them are
// operators (extern matmuls, among them), and what they read are buffers
// its kernels allocated and filled behind the dispatcher: inputs no
// recorded op produced, held by the recorder for the rest of the step. The
// held buffers kept the compiled blocks' saved activations from ever being
// evicted: a regionally compiled GPT-2 with both actions ran out of memory
// at 75% of its peak where swap-only fitted (session 25). Inside a compiled
// region nothing is recorded now: what it saves is swap-only, as the
// recorders' replays could not rebuild a kernel's output anyway; what it
// writes in place loses its lineage (Note [Written where nothing records]).
// Planned recomputation inside compiled graphs is the Echo planner's
// compile_backend.
bool is_compiled_region(const at::RecordFunction& fn) {
  return std::strcmp(fn.name(), "CompiledFunction") == 0;  // Note [Record names are not keys]
}

void enter_function_forward(bool compiled) {
  ++t_function_forwards;
  if (compiled) ++t_compiled_regions;
}
void leave_function_forward(bool compiled) {
  if (t_function_forwards > 0) --t_function_forwards;
  if (compiled && t_compiled_regions > 0) --t_compiled_regions;
}
bool in_function_forward() { return t_function_forwards > 0 && t_compiled_regions == 0; }
void reset_function_forwards() {
  t_function_forwards = 0;
  t_compiled_regions = 0;
}

bool rebased_onto_function(const at::Tensor& tensor, int64_t sequence_nr) {
  if (sequence_nr < 0 || !tensor.defined()) return false;
  const torch::autograd::Node* node = nullptr;
  torch::autograd::DifferentiableViewMeta* view = torch::autograd::impl::get_view_autograd_meta(tensor);
  if (view != nullptr && view->has_bw_view()) {
    // rebase_history wraps the Function's node in a CopySlices on the base.
    const auto* copy = dynamic_cast<const torch::autograd::CopySlices*>(
        torch::autograd::impl::grad_fn_unsafe(view->get_backward_view().base_));
    node = copy != nullptr ? copy->fn.get() : nullptr;
  } else {
    node = torch::autograd::impl::grad_fn_unsafe(tensor);
  }
  return node != nullptr && node->sequence_nr() == static_cast<uint64_t>(sequence_nr);
}

void bind_function_forwards(pybind11::module_& lineage_module) {
  lineage_module.def("track_function_forwards", [](bool on, pybind11::object settle) {
    Py_XDECREF(t_settle);
    t_settle = nullptr;
    t_settle_armed = false;
    if (on && !settle.is_none()) t_settle = settle.release().ptr();
    if (on == t_tracker.has_value()) return;
    reset_function_forwards();
    if (on) {
      t_tracker = at::addThreadLocalCallback(at::RecordFunctionCallback(on_record_start, on_record_end)
                                                 .scopes({at::RecordScope::FUNCTION}));
    } else {
      at::removeCallback(*t_tracker);
      t_tracker.reset();
    }
  }, pybind11::arg("on"), pybind11::arg("settle") = pybind11::none(),
     "Track, on this thread, which ops run inside a custom autograd.Function's forward "
     "(Note [Custom Function forwards]); for the Python recorder. settle(depth, sequence_nr), when "
     "armed by settle_at_function_end(), is called as a Function's record closes, with the depth of "
     "Function forwards left open and the record's sequence number; it returns whether to stay armed "
     "(Note [Marked dirty by a Function]).");
  lineage_module.def("rebased_onto_function", &rebased_onto_function, pybind11::arg("tensor"),
                     pybind11::arg("sequence_nr"),
                     "Whether autograd rebased tensor's history onto the custom Function whose record had this "
                     "sequence number (ctx.mark_dirty; Note [Marked dirty by a Function]).");
  lineage_module.def("settle_at_function_end", [] { t_settle_armed = true; },
                     "Call this thread's settle callback as the next custom Function's record closes.");
  lineage_module.def("function_forward_depth", [] { return t_function_forwards; },
                     "How many custom Function forwards are open on this thread.");
  lineage_module.def("in_function_forward", &in_function_forward,
                     "Whether this thread is inside a custom autograd.Function's forward called with grad on.");
}

}  // namespace lineage
}  // namespace membudget

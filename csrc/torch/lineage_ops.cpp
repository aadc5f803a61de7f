// Which ops the C++ recorder records, decided once per operator from its
// registration and schema (Note [Recorded granularity] in lineage_recorder.cpp).
#include <ATen/record_function.h>

#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>

#include "torch/lineage_recorder.h"

namespace membudget {
namespace lineage {
namespace {

// lineage.py's _NOT_RECORDED, plus ops whose autograd kernel (VariableTypeManual)
// never redispatches, so a dispatch mode never sees them: they change no data.
const std::unordered_set<std::string>& not_recorded() {
  static const std::unordered_set<std::string> names{"aten::_local_scalar_dense", "aten::item", "aten::is_nonzero",
                                                     "aten::equal", "aten::detach_", "aten::requires_grad_",
                                                     "aten::retain_grad", "aten::set_data"};
  return names;
}

bool is_scratch_argument(const std::string& name) { return name == "running_mean" || name == "running_var"; }

// Note [Arguments snapshotted before the op]: QAT's default fake quantizer
// (FusedMovingAvgObsFakeQuantize, what get_default_qat_qconfig gives) runs
// aten::_fused_moving_avg_obs_fq_helper, which updates its observer's
// running min and max, scale and zero point in place, and computes its
// output from the values it updated. Written arguments other than the
// result made it a side effect, so everything after a fake quantizer was
// swap-only: recompute-only ran out of memory at 75% of the peak where swap
// fitted (4-12 MiB not recomputable, session 27's helper). Scratch copies of
// the current values, as for batch norm's running statistics, would be
// wrong here: the output depends on what they were before the op, and the
// next step has moved them on. So the recorders copy these (small: a value,
// or one per channel) as the op starts, and a replay runs on a scratch copy
// of that snapshot: it rebuilds the same output and leaves the buffers
// alone. lineage.py's _SNAPSHOT_ARGUMENTS is the same table.
bool is_snapshot_argument(const std::string& op, const std::string& name) {
  return op == "aten::_fused_moving_avg_obs_fq_helper" &&
         (name == "running_min" || name == "running_max" || name == "scale" || name == "zero_point");
}

// Note [Contents nobody recorded]: an empty tensor's contents are whatever
// writes it next. Written by recorded ops, they are its mutations and are
// replayed after it; but a kernel that is not an operator (a pybind11
// extension function, often inside a custom Function's forward: Note
// [Custom Function forwards]) allocates its output through aten::empty and
// fills it through a raw pointer, which neither a recorder nor the version
// counter sees. Replayed, such a tensor would come back as an empty one:
// garbage, silently. So a storage an empty op made is not replayable at
// version 0 (as read before any recorded write), and it is swapped instead;
// lineage.py's _EMPTY_OPS is the same list. A raw write after a recorded
// one is still not seen (as for any tensor: writes through data_ptr() do not
// bump the version counter).
bool makes_empty_tensor(const std::string& qualified) {
  static const std::unordered_set<std::string> names{"aten::empty",     "aten::empty_like",  "aten::empty_strided",
                                                     "aten::new_empty", "aten::new_empty_strided",
                                                     "aten::empty_permuted"};
  return names.count(qualified) != 0;
}

bool decomposes_above_autograd(const c10::OperatorHandle& op) {
  using c10::DispatchKey;
  if (!op.hasKernelForDispatchKey(DispatchKey::CompositeImplicitAutograd)) return false;
  // A kernel of its own for a backend means the composite is not what runs
  // for dense tensors (OperatorEntry::computeDispatchTableEntry, 2.3). An
  // Autograd kernel does not: linear and matmul have one (VariableType) that
  // still runs the decomposition above the dispatch modes' key.
  for (DispatchKey key : {DispatchKey::CompositeExplicitAutograd, DispatchKey::CompositeExplicitAutogradNonFunctional,
                          DispatchKey::CPU, DispatchKey::CUDA}) {
    if (op.hasKernelForDispatchKey(key)) return false;
  }
  return true;
}

std::unique_ptr<OpInfo> make_info(const c10::OperatorHandle& op) {
  auto info = std::make_unique<OpInfo>(op);
  const c10::FunctionSchema& schema = op.schema();
  info->name = schema.name() + (schema.overload_name().empty() ? ".default" : "." + schema.overload_name());
  const std::string& qualified = schema.name();
  const std::string ns = qualified.substr(0, qualified.find("::"));
  const bool aten = ns == "aten" || ns == "prims";
  info->num_arguments = schema.arguments().size();
  info->scratch.assign(info->num_arguments, false);
  info->snapshot.assign(info->num_arguments, false);
  size_t unreplayable_writes = 0;
  bool any_write = false;
  for (size_t i = 0; i < schema.arguments().size(); ++i) {
    const c10::Argument& arg = schema.arguments()[i];
    // Written or not by the schema: native_batch_norm and cudnn_batch_norm
    // update their running statistics without declaring it (lineage.py's
    // _FuncInfo says what replays did to the real buffers).
    if (is_scratch_argument(arg.name())) info->scratch[i] = true;
    if (is_snapshot_argument(qualified, arg.name())) info->scratch[i] = info->snapshot[i] = true;
    const c10::AliasInfo* alias = arg.alias_info();
    if (alias == nullptr || !alias->isWrite()) continue;
    any_write = true;
    if (!info->scratch[i]) {
      info->writes.push_back(i);
      ++unreplayable_writes;
    }
  }
  bool all_alias = !schema.returns().empty();
  for (const c10::Argument& ret : schema.returns()) {
    const c10::AliasInfo* alias = ret.alias_info();
    bool aliases_argument = false;
    if (alias != nullptr) {
      // Tensor(a)[] (split, chunk, unbind): the set is on the list's elements.
      std::vector<const c10::AliasInfo*> infos{alias};
      for (const c10::AliasInfo& contained : alias->containedTypes()) infos.push_back(&contained);
      for (const c10::Argument& arg : schema.arguments()) {
        const c10::AliasInfo* arg_alias = arg.alias_info();
        if (arg_alias == nullptr) continue;
        for (const c10::AliasInfo* info : infos) {
          for (const auto& set : info->beforeSets()) {
            if (arg_alias->beforeSets().count(set) != 0) aliases_argument = true;
          }
        }
      }
    }
    all_alias = all_alias && aliases_argument;
  }
  info->random = op.hasTag(at::Tag::nondeterministic_seeded);
  info->replayable = aten && unreplayable_writes <= 1;
  info->undefined_contents = makes_empty_tensor(qualified);
  info->copies_input = qualified == "aten::clone";
  info->simple = !any_write && schema.returns().size() == 1 && schema.returns()[0].alias_info() == nullptr &&
                 schema.returns()[0].type()->kind() == c10::TypeKind::TensorType;
  if (not_recorded().count(qualified) != 0) {
    info->kind = OpKind::kSkip;
  } else if (decomposes_above_autograd(op)) {
    info->kind = OpKind::kDecomposed;
  } else if (!any_write && all_alias && aten) {
    info->kind = OpKind::kView;
  } else {
    info->kind = OpKind::kRecord;
  }
  return info;
}

// Per-operator decisions, keyed by the address of the schema's name string
// (stable while the operator is registered); infos are never freed (nodes
// point at them). Every recording thread looks them up (Note [Recording on
// started threads] in lineage_recorder.cpp): the shared map is locked, and
// each thread keeps a copy of what it found, so the lock is taken once per
// operator per thread. (It was one unlocked map while one thread recorded;
// a second thread's first op could rehash it under the first's lookup.)
struct SharedInfos {
  std::mutex mutex;
  std::unordered_map<const void*, OpInfo*> infos;
};

SharedInfos& shared_infos() {
  static auto* shared = new SharedInfos();  // leaked: ops may run during interpreter exit
  return *shared;
}

}  // namespace

const OpInfo* lookup_info(const at::RecordFunction& fn) {
  const char* key = fn.name();
  thread_local std::unordered_map<const void*, const OpInfo*> seen_here;
  auto it = seen_here.find(key);
  if (it != seen_here.end()) return it->second;
  std::optional<c10::OperatorName> name = fn.operator_name();
  if (!name) return nullptr;  // a RecordFunction that is not an operator call
  const OpInfo* info = nullptr;
  {
    SharedInfos& shared = shared_infos();
    std::lock_guard<std::mutex> lock(shared.mutex);  // make_info runs no op and takes no GIL
    auto found = shared.infos.find(key);
    if (found != shared.infos.end()) {
      info = found->second;
    } else {
      std::optional<c10::OperatorHandle> op = c10::Dispatcher::singleton().findOp(*name);
      if (!op) return nullptr;
      OpInfo* made = make_info(*op).release();
      shared.infos.emplace(key, made);
      info = made;
    }
  }
  seen_here.emplace(key, info);
  return info;
}

}  // namespace lineage
}  // namespace membudget

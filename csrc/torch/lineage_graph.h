// The C++ lineage recorder's data: what python/membudget/lineage.py keeps as
// Python objects (OpNode, StorageLineage, ExternalLineage, TensorRef), kept
// here as plain C++ so that recording a forward op runs no Python.
// See Note [C++ lineage recorder] in lineage_recorder.cpp.
#pragma once
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/Generator.h>
#include <torch/extension.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/residency_entry.h"

namespace membudget {
class StorageResidency;  // saved_activation.h
namespace lineage {

// What the recorder does with one operator, decided once from its
// registration and schema (Note [Recorded granularity]).
enum class OpKind : uint8_t {
  kRecord,      // a node is recorded; ops nested inside it are not looked at
  kView,        // outputs alias inputs: counted, no node (storage lineage is shared)
  kSkip,        // never recorded (item, equal, ...) nor anything nested in it
  kDecomposed,  // CompositeImplicitAutograd: not recorded, its children are
};

struct OpInfo {
  explicit OpInfo(c10::OperatorHandle handle) : op(std::move(handle)) {}
  c10::OperatorHandle op;
  std::string name;                   // "aten::addmm.default"-style, for errors and plans
  OpKind kind = OpKind::kRecord;
  bool replayable = true;             // aten/prims and at most one non-scratch write
  bool random = false;                // tagged nondeterministic_seeded
  bool simple = false;                // one fresh Tensor out, no writes
  bool undefined_contents = false;    // an empty tensor (Note [Contents nobody recorded])
  bool copies_input = false;          // aten::clone (Note [Originals of in-place ops])
  std::vector<bool> scratch;          // per argument: batch norm's running stats
  std::vector<bool> snapshot;         // per argument: read as it was before the op (Note [Arguments snapshotted before the op])
  std::vector<size_t> writes;         // positions of written non-scratch arguments
  size_t num_arguments = 0;
};

struct StorageLineage;

// A tensor no recorded op produced (a parameter, the batch): held, not rebuilt.
struct External {
  // The tensor's data without its autograd metadata, or the tensor itself
  // (an inference tensor, a subclass without a grad_fn: Note [Held without
  // their graph] in lineage_recorder.cpp); undefined once held through its
  // entry.
  at::Tensor tensor;
  uintptr_t key = 0;  // storage address when first read this forward
  // Note [Held inputs reached through their entry] (lineage_recorder.cpp):
  // once the tensor's storage is a managed entry, the entry is held instead
  // of the tensor, with the tensor's version counter. `impl` holds the
  // original TensorImpl weakly whenever `tensor` is not it (held without its
  // graph, or through its entry), so that its address, the key of
  // RecorderState::externals, is not reused while this is mapped.
  std::shared_ptr<StorageResidency> entry;
  c10::VariableVersion version;
  std::optional<c10::weak_intrusive_ptr<c10::TensorImpl>> impl;
  // Whether its storage has data now, made at the first declaration that
  // reads it (Note [Held inputs freed under us] in core/residency_entry.h).
  std::shared_ptr<const HeldInput> probe;
};

// A tensor argument of a recorded op (lineage.py's TensorRef).
struct TensorRef {
  std::shared_ptr<StorageLineage> lineage;  // set, or external is
  std::shared_ptr<External> external;
  int64_t version = 0;          // mutations of lineage applied when read
  int64_t tensor_version = 0;   // the tensor's version counter when read
  c10::SmallVector<int64_t, 5> sizes;
  c10::SmallVector<int64_t, 5> strides;
  int64_t offset = 0;
  at::ScalarType dtype = at::ScalarType::Undefined;
  bool scratch = false;
  // Conjugate and negative bits (Note [Conjugate and negative views] in lineage.py).
  bool conj = false;
  bool neg = false;
};

// One argument position of a recorded op: a plain value, or where its
// tensors' refs are (-1: None inside an optional tensor list).
struct ArgSlot {
  enum Kind : uint8_t { kPlain, kTensor, kTensorList, kOptionalTensorList } kind = kPlain;
  c10::IValue plain;
  std::vector<int32_t> refs;
};

struct OpNode {
  const OpInfo* info = nullptr;
  std::vector<ArgSlot> args;
  std::vector<TensorRef> refs;
  int64_t index = 0;            // position among the forward's ops (views included)
  double seconds = 0.0;
  bool replayable = true;
  std::optional<at::Generator> generator;  // random ops: the generator and its state
  at::Tensor generator_state;
};

// Result of the pack-time closure (replay.py's Closure).
struct Closure {
  bool ok = false;
  double seconds = 0.0;
  // When not ok: the first obstacle found and the op it was found at (Note
  // [Why not recomputable] in csrc/core/residency_manager.cpp); static text.
  const char* why = nullptr;
  const OpInfo* blame = nullptr;
  std::vector<uint64_t> deps;        // managed entries read (sorted)
  std::vector<uintptr_t> externals;  // external storages read (sorted)
  // Held inputs its own replay reads (not those of the managed entries it
  // reads), for Note [Held inputs freed under us] (core/residency_entry.h).
  std::vector<std::shared_ptr<External>> held;
};

// How one storage was computed (Note [Storage lineage] in lineage.py).
// Mutation nodes are held weakly: the forward that recorded them owns them
// (Note [Lineage ownership]).
struct StorageLineage {
  std::shared_ptr<OpNode> producer;
  int64_t index = 0;                            // output position of producer
  std::vector<std::weak_ptr<OpNode>> mutations;
  std::vector<int64_t> versions;                // after producer, after each write
  c10::weak_intrusive_ptr<c10::TensorImpl> base;
  // Outputs made on this storage without being declared views (unsafe_chunk,
  // unsafe_split), each with a history and version counter of its own: read
  // by whatever reads within that output's bytes (Note [Parts of a storage]
  // in lineage_recorder.cpp; held weakly: Note [Lineage ownership]).
  std::vector<std::weak_ptr<StorageLineage>> parts;
  int64_t begin_byte = 0;  // a part's bytes in the storage: [begin_byte, end_byte)
  int64_t end_byte = 0;
  // Bytes written behind this lineage's counter (through another part):
  // reads overlapping them are held (Note [Parts of a storage]).
  std::vector<std::pair<int64_t, int64_t>> dirty;
  int64_t generation = 0;
  uint64_t entry_id = 0;                        // 0: not managed
  // version -> closure, valid while memo_epoch equals the recorder's epoch
  std::vector<std::shared_ptr<const Closure>> memo;
  uint64_t memo_epoch = 0;

  StorageLineage(std::shared_ptr<OpNode> producer_node, int64_t output, const at::Tensor& tensor,
                 int64_t forward)
      : producer(std::move(producer_node)),
        index(output),
        versions{static_cast<int64_t>(tensor._version())},
        base(c10::weak_intrusive_ptr<c10::TensorImpl>(tensor.getIntrusivePtr())),
        generation(forward) {}
};

}  // namespace lineage
}  // namespace membudget

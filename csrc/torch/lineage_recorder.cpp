// Note [C++ lineage recorder]: python/membudget/lineage.py records forward
// ops with a Python TorchDispatchMode, whose floor alone (an empty mode) is
// above issue 3's 10 us per op. This recorder keeps the same lineage (the
// data of lineage_graph.h mirrors lineage.py's objects) from a thread-local
// at::RecordFunction callback, so recording a forward op runs no Python; the
// pack-time closure and the replay are C++ too (lineage_replay.cpp), and
// Python sees a tensor only when a dropped entry is rebuilt. Chosen with
// MEMBUDGET_LINEAGE=cxx (python/membudget/lineage_native.py).
//
// Note [Recorded granularity]: the Python mode sits below autograd: it sees
// the ops autograd saves for, after CompositeImplicitAutograd ops (linear,
// dropout, matmul, layer_norm) have decomposed, and not the ops a kernel calls
// inside itself (the mode is off its stack while its handler runs). A
// RecordFunction callback fires at every Dispatcher::call instead (never at
// redispatch), so the same set is taken as: an op is recorded unless it is
// CompositeImplicitAutograd (then its children are candidates) or it runs
// nested inside an op that was recorded, counted as a view, or skipped
// (those ran in a kernel, below autograd). The decision per operator is made
// once, from its registration and schema (OpInfo), and cached by the address
// of its schema's name, which RecordFunction hands over without a copy.
// tests/test_lineage_native.py checks the recorded op sequence against the
// Python mode's on the test models.
//
// Note [Silenced children]: the ops a blocking op's kernel calls (the
// empties, _convolution and mkldnn_convolution inside convolution; about
// three per recorded op on the CNN, two on GPT-2) are never recorded, yet
// with the callback on each one costs a RecordFunction whose arguments and
// outputs are boxed into IValues (int lists become heap-allocated lists)
// and a push and pop of a frame. So once an op blocks its children, this
// thread's callback is disabled until the op's end callback, which the
// RecordFunction still runs (it holds the callbacks it started with), turns
// it back on -- unless set_enabled(false) asked for it off meanwhile. Only
// this callback is switched off: a profiler's callbacks still see every
// nested op. The frame counting (t_blocking) stays as it was, for children
// that run while the callback is on anyway (set_enabled(true) inside an op).
// Measured: bench/RESULTS.md, "Lineage recording cost on the CNN" (branch cnnrec).
//
// Note [Lineage ownership]: Python's recorder leans on the garbage collector
// for the cycles that in-place ops make (x.add_(f(x)): x's lineage holds the
// add_ node, which reads f's output, whose producer reads x's lineage).
// Here every strong edge points back in time -- a lineage holds its producer,
// a node holds the lineages it read -- and a lineage holds the nodes that
// wrote into it weakly; those nodes are owned by the forward that recorded
// them (RecorderState::writers) and released two forwards later. A lineage
// whose writer is gone is truncated: its later versions are not replayable
// (closure says so; the manager is told again for live entries), and a
// later read of the storage holds it instead (Note [Held scratch and
// long-lived storages]). Parts (Note [Parts of a storage]) point forward in
// time the same way (an unsafe_split output is a part of the lineage its
// producer read): a lineage holds its parts weakly, and the forward that
// made them owns them (RecorderState::parts) for as long as its writers.
//
// Note [Recorder lock and the GIL]: the GIL is taken before the recorder's
// lock, never after. Every binding (on_pack, rebuild, ops_recorded, ...) is
// entered with the GIL held and then takes the lock; a thread that held the
// lock and then waited for the GIL would deadlock against it. That happened:
// the recording thread (in an op's callback, without the GIL) rescued the
// entries reading an input about to be written in place, taking the GIL
// under the lock, while another thread held the GIL and waited in a binding
// for the lock (bench/stress_recorder_lock.py hung within seconds; a CUDA
// backward thread replaying an entry is that other thread in practice). So
// the callbacks collect under the lock what needs the GIL -- rescues, a
// static plan's queries, and the references they drop (the last C++
// reference to a tensor with a Python object takes the GIL when released) --
// in a Deferred, and run it once the lock is released; and a replay holds
// the lock only to read what recording may still change (Replayer in
// lineage_replay.cpp), since materialising its inputs releases and retakes
// the GIL.
//
// Storage lineage is keyed by StorageImpl (residency is per storage, and a
// view shares its base's storage, so views need no bookkeeping at all). The
// map holds a weak reference to each StorageImpl, which keeps its address
// from being reused while mapped; the tensor's version counter, compared
// with the lineage's last recorded version, catches writes lineage did not
// see, as in Python.
#include "torch/lineage_recorder.h"

#include <ATen/record_function.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <iterator>
#include <optional>
#include <stdexcept>
#include <unordered_set>
#include <utility>

#include "torch/function_forwards.h"
#include "torch/saved_activation.h"

namespace py = pybind11;

namespace membudget {
namespace lineage {
namespace {

using Clock = std::chrono::steady_clock;

// Note [A forward that ran out of memory]: a forward begins at the first
// op recorded after backward began (RecorderState::in_backward); that is
// when the last forward's held inputs are let go. A forward that ran out of
// memory never reaches backward, so a batch-size finder's retry was
// recorded as more of the same forward: every failed attempt's held inputs
// (its batch, a compiled block's outputs) stayed allocated through the
// retries, 2 MB more after each (a per-block compiled model, either
// recorder). An out-of-memory error ends the forward instead: the next
// recorded op begins one. Training code that catches the error and goes on
// with the same forward (rare) only splits it in two, which lets go of the
// map of held inputs (they stay held by the nodes that read them) and
// releases in-place writers one forward sooner (Note [Rescued before a sweep]
// makes what needed them resident). Other exceptions are not seen: their
// held inputs go at the next backward's forward, one forward later.
std::atomic<bool> g_out_of_memory{false};

// Note [Recording on started threads]: a training step on a thread started
// after install() (Note [Threads started after install()] in _runtime.py)
// records too: that thread starts its own callback (start_on_this_thread),
// into the one RecorderState. Before this its activations were swap-only,
// and recompute-only runs out of memory. The graph itself does not care
// which thread made a node: nodes point at the storages they read, and a
// replay is exact whichever thread recorded what it runs. What is per
// forward is the bookkeeping: a forward begins at the first op recorded
// after an unpack (in_backward), and two forwards back its in-place writers
// are released. With two threads, a thread's op could begin a forward in the
// middle of another's backward (an unpack sets in_backward, a data thread's
// torch.stack follows); every such extra boundary releases writers a
// forward sooner and rescues (makes resident and swap-only) what still
// needed them, so a thread that makes batches beside the training thread
// would have turned the training thread's activations swap-only. So only
// the thread that packed last (RecorderState::packer: the one training) may
// begin a forward, or any thread once no entry autograd holds is left, when
// an extra boundary releases nothing anyone needs. Other threads' ops are
// recorded into the forward under way, which only lengthens what it holds
// until the next one begins. Two threads that train at once do split each
// other's forwards; results stay exact, and what a rescue made swap-only
// costs memory (recompute-only may then run out: the tests train one thread
// at a time). uninstall() stops the callback of the thread that called
// install(); a started thread's callback stays until its run() ends, so
// g_active (set by start(), cleared by stop()) is what it records under.
// The Python recorder does the same with a mode per started thread over one
// Lineage (lineage.py's packer and may_begin_forward; retired at uninstall).
std::atomic<bool> g_active{false};

// Forwards whose writer nodes are kept (Note [Lineage ownership]): this one
// and the previous, whose saved tensors backward may still hold.
constexpr int64_t kForwardsKept = 2;

// Note [Marked dirty by a Function]: a custom Function whose forward writes
// its input in place calls ctx.mark_dirty(x), and Function.apply, after the
// forward returns, bumps x's version counter once more (_mark_dirty, in
// python_function.cpp) as it rebases x's history onto the Function's node:
// x._version reads 1 after the forward's x.mul_(s), which the recorder
// recorded, and 2 once apply returns. That bump matched no recorded write,
// so every later read of x held it, and what saved it (the next op's input,
// or the Function's own save_for_backward) was swap-only. The bump happens
// inside the RecordFunction that apply opens around the whole call, after
// the forward and before the record closes, where nothing else runs that
// can write. So each write recorded inside the forward is remembered by the
// Function's frame; as the record closes, a storage whose lineage still ends
// at that write, whose tensor reads exactly one version more and whose
// history autograd rebased onto this very Function's node (its grad_fn, or
// for a view its base's CopySlices, carries the record's sequence number:
// rebased_onto_function) takes that version as the write's. A grad_fn that
// merely changed proved nothing: a write with grad on inside the forward
// changes it, and a view's grad_fn is remade whenever its version moves.
// Anything else -- no bump, two, a tensor not marked dirty -- keeps the
// recorded version, and an unseen write is still caught. A Function applied
// inside another's forward, where grad is off, is bumped but not rebased:
// its in-place output stays swap-only. Packs
// made by apply after the forward (ctx.save_for_backward of x) wait for the
// record's end too, like Note [Packed before recorded]. The Python recorder
// does the same from the tracker's end callback (lineage.py's
// Lineage.settle_function_writes).
struct ForwardWrite {
  std::shared_ptr<StorageLineage> lineage;
  at::Tensor tensor;
  int64_t version;  // after the recorded write
};

// One RecordFunction on this thread's stack.
struct Frame {
  bool blocks_children = false;
  bool silenced = false;  // this callback is off for the op's children (Note [Silenced children])
  bool function_forward = false;  // a custom Function's forward (Note [Custom Function forwards])
  bool compiled_region = false;   // ... that runs a compiled graph (Note [Compiled regions are not recorded])
  int64_t sequence_nr = -1;       // ... whose record carries this sequence number (Note [Marked dirty by a Function])
  std::shared_ptr<OpNode> node;  // set while recording this op
  const OpInfo* info = nullptr;
  Clock::time_point start;
  // Written storages with lineage, and the tensors written (for their version after).
  c10::SmallVector<std::pair<std::shared_ptr<StorageLineage>, at::Tensor>, 2> writes;
  // Outputs autograd saved before the op returned (Note [Packed before recorded]).
  std::vector<std::pair<uint64_t, at::Tensor>> packed;
  // A custom Function's forward: what its ops wrote (Note [Marked dirty by a Function]).
  std::vector<ForwardWrite> forward_writes;
  // The arguments, kept for the roofline (Note [Roofline floor on CUDA]) when
  // it is on: a boxed call's RecordFunction inputs view its stack, which
  // holds the outputs by the time the op ends.
  std::vector<c10::IValue> inputs;
};

thread_local std::optional<at::CallbackHandle> t_handle;
thread_local std::vector<Frame> t_frames;
thread_local int t_blocking = 0;  // frames on the stack that block their children
thread_local bool t_paused = false;
// Whether this is the thread that called start(): at::ThreadLocalState
// carries the callback to threads that run work for it (the autograd
// engine's device threads, intra-op pools), which record nothing.
thread_local bool t_recording = false;
// What set_enabled() last asked for: a silenced op's end turns the callback
// back on only if it is still wanted (Note [Silenced children]).
thread_local bool t_enabled = true;

bool is_plain(const at::Tensor& t) {
  return !t.key_set().has_any(c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot,
                                                    c10::DispatchKey::Functionalize}));
}

bool all_plain(c10::ArrayRef<const c10::IValue> inputs) {
  for (const c10::IValue& value : inputs) {
    if (value.isTensor()) {
      if (!is_plain(value.toTensor())) return false;
    } else if (value.isTensorList()) {
      for (const at::Tensor& t : value.toTensorList().vec()) {
        if (t.defined() && !is_plain(t)) return false;
      }
    }
  }
  return true;
}

}  // namespace

void note_out_of_memory() { g_out_of_memory.store(true); }
bool take_out_of_memory() {
  return g_out_of_memory.load(std::memory_order_relaxed) && g_out_of_memory.exchange(false);
}

uintptr_t storage_address(const at::Tensor& t) {
  if (!t.has_storage()) return 0;
  return reinterpret_cast<uintptr_t>(t.storage().data());
}

namespace {

void forget_unneeded(RecorderState& s, std::vector<std::shared_ptr<void>>& released);  // below

// Lets go of the lineage of every entry no longer alive and, once none is
// left, of the storages only their closures could read (Note [Held under
// another counter]).
void forget_dead_entries(RecorderState& s, std::vector<std::shared_ptr<void>>& released) {
  std::vector<uint64_t> live = live_entry_ids();
  std::unordered_set<uint64_t> live_set(live.begin(), live.end());
  for (auto it = s.by_entry.begin(); it != s.by_entry.end();) {
    if (live_set.count(it->first) != 0) {
      ++it;
      continue;
    }
    s.swap_only_entries.erase(it->first);
    s.lost.erase(it->first);
    released.push_back(std::move(it->second));
    it = s.by_entry.erase(it);
  }
  if (s.by_entry.empty()) s.held_storages.clear();
}

// As a forward begins while entries live: the last forward's held inputs,
// the lineage of storages that died, and dead entries go.
void prune_dead(RecorderState& s, std::vector<std::shared_ptr<void>>& released) {
  for (auto& [impl, external] : s.externals) released.push_back(std::move(external));
  s.externals.clear();
  for (auto it = s.by_storage.begin(); it != s.by_storage.end();) {
    if (!it->second.storage.expired()) {
      ++it;
      continue;
    }
    released.push_back(std::move(it->second.lineage));
    it = s.by_storage.erase(it);
  }
  forget_dead_entries(s, released);
}

// Note [Rescued before a sweep]: the sweep below releases the writers of
// the forward two before this one. An entry still alive whose replay runs
// one of them (a generator's graph kept while a discriminator takes two
// steps, create_graph used twice) cannot be rebuilt afterwards. The sweep
// moved the writers to Deferred::released and re-declared the live entries
// while that still held them, so every closure still found its writers:
// such entries stayed recomputable, were dropped, and their unpack raised
// RecomputeError ("an in-place op in the lineage of a dropped activation was
// released"); the Python recorder, whose lineage the garbage collector
// keeps, replayed them. Now the writers being released wait in
// RecorderState::releasing, which closures count as gone; an entry
// replayable before the sweep and not after is rescued like one whose held
// input is about to be written (made resident, by a replay through the
// writers if dropped, then swap-only), and only then are the writers let go
// (Deferred::run). Keeping the writers for as long as such entries lived was
// tried and reverted in session 24: a held input with a graph of its own
// then kept the entries, and so the writers, alive for good.
void begin_forward(RecorderState& s, Deferred& deferred) {
  // Note [Released as a forward begins] (python/membudget/lineage.py).
  // With no entry saved for backward, forget_unneeded lets go of all that
  // the pruning below would (and asks for the live entries once, not twice).
  const bool released_all = !any_entry_saved_for_backward();
  if (released_all) {
    forget_unneeded(s, deferred.released);
    ++s.epoch;
  }
  s.in_backward = false;
  s.packed_in_forward.store(false);
  s.op_index = 0;
  s.forward += 1;
  if (!released_all) prune_dead(s, deferred.released);
  bool truncated = false;
  for (const auto& [generation, nodes] : s.writers) {
    truncated = truncated || (generation <= s.forward - kForwardsKept && !nodes.empty());
  }
  // Note [Rescued before a sweep]: entries a replay can rebuild now.
  std::vector<uint64_t> replayable;
  if (truncated) {
    for (const auto& [entry_id, lineage] : s.by_entry) {
      if (s.swap_only_entries.count(entry_id) != 0) continue;
      if (closure(s, lineage, static_cast<int64_t>(lineage->mutations.size()), true, 0)->ok) {
        replayable.push_back(entry_id);
      }
    }
  }
  while (!s.writers.empty() && s.writers.front().first <= s.forward - kForwardsKept) {
    for (std::shared_ptr<OpNode>& writer : s.writers.front().second) {
      const OpNode* key = writer.get();
      s.releasing.emplace(key, std::move(writer));
    }
    s.writers.erase(s.writers.begin());
  }
  while (!s.parts.empty() && s.parts.front().first <= s.forward - kForwardsKept) {
    for (std::shared_ptr<StorageLineage>& part : s.parts.front().second) deferred.released.push_back(std::move(part));
    s.parts.erase(s.parts.begin());
  }
  if (truncated) {
    ++s.epoch;
    for (uint64_t entry_id : replayable) {
      const std::shared_ptr<StorageLineage>& lineage = s.by_entry.at(entry_id);
      if (!closure(s, lineage, static_cast<int64_t>(lineage->mutations.size()), true, 0)->ok) {
        s.swap_only_entries.insert(entry_id);
        deferred.swap_only_released.push_back(entry_id);
      }
    }
    redeclare_entries(s);
    deferred.sweep = true;
  }
}

}  // namespace

// Note [Parts of a storage]: lineage is keyed by storage, but an op can
// return tensors on a storage that already has a lineage without declaring
// them views (unsafe_chunk, unsafe_split: a CPU GRU cell splits its input
// projection and its gates so), each with a version counter of its own and
// written in place through it (Note [One history per storage] in
// lineage.py). Each such output is a part of the storage's lineage, with its
// bytes: a read that lies within one part's bytes follows that part's
// history (its producer's replay, then its own writes); any other read
// follows the storage's. Taking the storage's lineage over instead, as the
// recorder did, left no history for the rest of its bytes: every later read
// of the GRU's input projection was unreplayable (recompute-only needed
// 2.09x swap's budget where the Python recorder, whose lineage is per
// tensor, needed 1.67x). The innermost part holding a read is its history
// (a chunk of an _unsafe_view output lies in both). Versions still decide
// which reads are replayable, but a write through a part does not bump the
// storage's counter, nor one through the storage a part's: a write marks the
// bytes it covers dirty in every other history they belong to (its own
// part's siblings excepted: their elements are disjoint), and reads of dirty
// bytes are held like any unseen write; earlier reads replay what they read
// then (mark_written_behind). A packed storage with parts is rebuilt from
// its own history while no write went behind it, else from the part that
// covers all of it (an _unsafe_view output), else never: swap-only (one
// entry, several histories: lineage.py's rule; declaring_lineage).
std::pair<int64_t, int64_t> byte_range(const at::Tensor& t) {
  int64_t extent = t.numel() == 0 ? 0 : 1;
  for (int64_t d = 0; d < t.dim() && extent != 0; ++d) extent += (t.size(d) - 1) * t.stride(d);
  const int64_t item = static_cast<int64_t>(t.element_size());
  const int64_t begin = t.storage_offset() * item;
  return {begin, begin + extent * item};
}

// The innermost part of a lineage whose bytes hold all of t's, or null.
std::shared_ptr<StorageLineage> part_holding(const StorageLineage& lineage, const at::Tensor& t) {
  const auto [begin, end] = byte_range(t);
  std::shared_ptr<StorageLineage> found;
  bool tied = false;
  for (const std::weak_ptr<StorageLineage>& weak : lineage.parts) {
    std::shared_ptr<StorageLineage> part = weak.lock();
    if (part == nullptr || part->begin_byte > begin || end > part->end_byte || begin >= part->end_byte) continue;
    // The innermost: a chunk of an _unsafe_view output lies in both.
    const int64_t size = part->end_byte - part->begin_byte;
    const int64_t best = found == nullptr ? INT64_MAX : found->end_byte - found->begin_byte;
    if (size < best) {
      found = std::move(part);
      tied = false;
    } else if (size == best) {
      tied = true;  // same bytes, two histories (a view inside two interleaved chunks)
    }
  }
  return tied ? nullptr : found;
}

namespace {

bool overlaps(const std::vector<std::pair<int64_t, int64_t>>& ranges, std::pair<int64_t, int64_t> range) {
  for (const auto& [begin, end] : ranges) {
    if (begin < range.second && range.first < end) return true;
  }
  return false;
}

// A write into a storage with parts, through a tensor covering `range`,
// taken by `written`'s history (null: by none). Every other history on the
// storage whose bytes it may have changed behind their counters -- the
// storage's, and the parts overlapping the range, except the written part's
// siblings, whose elements are disjoint from it -- gets the range marked
// dirty and a write that replays as nothing: later reads of the dirty range
// are held (make_ref), earlier reads are no longer current and replay what
// they read. An entry such a history declared, or whose bytes its readers
// read, keeps bytes no history has: swap-only from now (resident: the
// storage is being written). (Note [Parts of a storage].)
void mark_written_behind(RecorderState& s, StorageLineage& whole, const StorageLineage* written,
                         std::pair<int64_t, int64_t> range, Deferred& deferred) {
  static const auto behind = std::make_shared<OpNode>();  // info null: replays as nothing
  auto mark = [&](StorageLineage& lineage) {
    lineage.mutations.push_back(behind);
    lineage.versions.push_back(lineage.versions.back());
    lineage.dirty.push_back(range);
    lineage.memo.clear();
    if (lineage.entry_id != 0 && s.swap_only_entries.insert(lineage.entry_id).second) {
      deferred.swap_only.push_back(lineage.entry_id);
    }
  };
  if (&whole != written) mark(whole);
  const OpNode* siblings = nullptr;
  for (const std::weak_ptr<StorageLineage>& weak : whole.parts) {
    std::shared_ptr<StorageLineage> part = weak.lock();
    if (part != nullptr && part.get() == written) siblings = part->producer.get();
  }
  for (const std::weak_ptr<StorageLineage>& weak : whole.parts) {
    std::shared_ptr<StorageLineage> part = weak.lock();
    if (part == nullptr || part.get() == written || part->producer.get() == siblings) continue;
    if (part->begin_byte < range.second && range.first < part->end_byte) mark(*part);
  }
}

// Note [Held scratch and long-lived storages]: a storage that outlives the
// forward that made it (batch norm's running statistics, a mask built once
// with an in-place fill) keeps its lineage, but the writer nodes of that
// forward are released two forwards later (Note [Lineage ownership]); read
// through its lineage after that, it makes every closure that reaches it
// unreplayable, and so every activation downstream swap-only. (Batch norm's
// kernels update the running statistics without bumping their version
// counter, so the version check never turns them into inputs held like
// parameters, as other writes lineage does not see do; recompute-only CNN
// runs then ran out of memory with most of their activations swap-only.) A
// storage whose history is released is therefore read as a held input from
// then on, its version checked at replay like any held input; and scratch
// arguments are always held: a replay reads only a copy of their current
// value, which no output depends on, so their history is never needed.
}  // namespace

std::shared_ptr<OpNode> kept_writer(const RecorderState& s, const std::weak_ptr<OpNode>& writer) {
  std::shared_ptr<OpNode> node = writer.lock();
  if (node != nullptr && !s.releasing.empty() && s.releasing.count(node.get()) != 0) return nullptr;
  return node;
}

bool history_released(const RecorderState& s, const StorageLineage& lineage) {
  for (const std::weak_ptr<OpNode>& writer : lineage.mutations) {
    if (kept_writer(s, writer) == nullptr) return true;
  }
  return false;
}

// Note [Held inputs reached through their entry]: a tensor no recorded op
// produced is held for replays (External), which kept its storage
// referenced, so that if it was also saved for backward its entry could
// never be evicted. Such tensors are often nobody else's: the gradients
// create_graph returns, read by a gradient penalty (torch.autograd.functional.vjp
// with create_graph=True in the loss of a 6-layer MLP ran out of memory with
// actions both at 60% of its peak where swap fitted: 1 MiB of gradients held
// through backward), a compiled region's outputs read by eager code. Once the
// storage is a managed entry (packed before the read, or at its pack after
// it), the entry is held instead: it can be swapped like any other (it has
// no lineage, so it is never dropped), a replay reads it through
// entry_storage, and the tensor's version counter, kept apart from the
// tensor, still catches a write lineage did not see. The TensorImpl is held
// weakly, so that its address, the key of RecorderState::externals, is not
// reused by another tensor while the External is mapped. Inference tensors
// (no version counter) stay held as they are.
void hold_through_entry(External& held, std::shared_ptr<StorageResidency> entry, Deferred* deferred) {
  if (!held.tensor.defined() || held.tensor.is_inference()) return;
  held.version = torch::autograd::impl::version_counter(held.tensor);
  if (!held.impl.has_value()) held.impl.emplace(held.tensor.getIntrusivePtr());  // else held without its graph
  held.entry = std::move(entry);
  if (deferred != nullptr) {
    // The last reference to a tensor with a Python object takes the GIL when
    // released: not under the lock (Note [Recorder lock and the GIL]).
    deferred->released.push_back(std::make_shared<at::Tensor>(std::move(held.tensor)));
  }
  held.tensor = at::Tensor();
}

// Note [Held without their graph]: an External held the tensor itself, and
// a tensor an autograd op made (a compiled region's output, read by eager
// code) holds its grad_fn, and through it every node and saved activation
// of the forward up to it. When that forward raised (an out-of-memory error,
// a shape error in the loss), nothing else was left to free that graph: its
// saved activations stayed live entries, so the recorder never let go
// (Note [Lineage released between steps]), and the failed step's memory
// stayed allocated across the retries a batch-size finder makes (a per-block
// aot_eager model: 28 MB of a 31 MB budget, after every failed step, with
// either recorder). A replay reads only the data: such a tensor is held as
// tensor_data(), the same storage, geometry and version counter without its
// autograd metadata (detach() would dispatch, inside the op being recorded),
// and the original TensorImpl weakly, so that its address, the key of
// RecorderState::externals, is not reused while the External is mapped.
//
// Every tensor is held so, not only those with a grad_fn when first read: a
// graph can be attached to a TensorImpl after the op that read it.
// TorchScript's differentiable graphs run their ops without grad and attach
// the history afterwards: of the seven tensors a scripted Linear-GELU-Dropout
// block's ops held, none required grad when held, and by uninstall() all
// but the batch did and three had a grad_fn. A scripted model whose
// backward raised kept 8 of its entries alive after uninstall() (either
// recorder): held input -> its new grad_fn -> saved activations -> their
// entries -> the lineage holding that input.
//
// Parameters too: held as their data when read, a replay reads what the
// forward read after `p.data = ...` (which neither recorder sees: set_data
// reaches no RecordFunction and no dispatch mode), and a read after such a
// swap finds another storage under the same TensorImpl and holds it anew
// (make_ref). Held as themselves, a weight swapped between two reads and
// restored before backward replayed the restored data, so a recompute-only
// run differed from the same run without replays, silently (the Python
// recorder with the old rule patched in, from step 2; the C++ recorder held
// parameters the same way; found by session 41's review). The Python
// recorder holds a parameter it copied strongly, not weakly:
// torch.utils.swap_tensors refuses a tensor with a weak reference
// (module.to() under set_swap_module_params_on_conversion). The C++
// recorder's weak TensorImpl reference it refuses too (open).
//
// Held as they are: inference tensors (no autograd metadata, no version
// counter), and tensor subclasses without a grad_fn, whose tensor_data()
// calls their Python detach. A subclass with a grad_fn is still copied
// through it, which a dispatch mode on the stack intercepts (open).
// A plain tensor's copy must not reach Python: with a TorchDispatchMode on
// the stack, shallow_copy_and_detach asks the mode's detach unless the
// Python key is excluded. Without the exclusion, a first version of this
// change failed inside selective checkpoint regions (whose mode is on the
// stack as their ops run): "detach returned invalid type float" in the C++
// recorder's op callback, the op's record lost, and a GPT-2 under a
// selective policy out of memory at half its peak.
at::Tensor held_without_graph(const at::Tensor& tensor, External* held) {
  if (!tensor.defined() || tensor.is_inference()) return tensor;
  const bool subclass = tensor.unsafeGetTensorImpl()->is_python_dispatch();
  if (subclass && tensor.grad_fn() == nullptr) return tensor;
  if (held != nullptr) held->impl.emplace(tensor.getIntrusivePtr());
  if (subclass) return tensor.tensor_data();
  c10::impl::ExcludeDispatchKeyGuard no_python(c10::DispatchKey::Python);
  return tensor.tensor_data();
}

int64_t external_version(const External& held) {
  return held.tensor.defined() ? version_of(held.tensor) : static_cast<int64_t>(held.version.current_version());
}

namespace {

TensorRef make_ref(RecorderState& s, const at::Tensor& tensor, bool scratch) {
  TensorRef ref;
  ref.tensor_version = tensor.has_storage() ? version_of(tensor) : 0;
  ref.sizes.assign(tensor.sizes().begin(), tensor.sizes().end());
  ref.strides.assign(tensor.strides().begin(), tensor.strides().end());
  ref.offset = tensor.storage_offset();
  ref.dtype = tensor.scalar_type();
  ref.scratch = scratch;
  ref.conj = tensor.is_conj();
  ref.neg = tensor.is_neg();
  if (tensor.has_storage() && !scratch) {
    auto it = s.by_storage.find(tensor.storage().unsafeGetStorageImpl());
    std::shared_ptr<StorageLineage> lineage = it == s.by_storage.end() ? nullptr : it->second.lineage;
    if (lineage != nullptr && !lineage->parts.empty()) {  // Note [Parts of a storage]
      std::shared_ptr<StorageLineage> part = part_holding(*lineage, tensor);
      if (part != nullptr) lineage = std::move(part);
      if (overlaps(lineage->dirty, byte_range(tensor))) lineage = nullptr;  // written behind its counter: held
    }
    if (lineage != nullptr && ref.tensor_version == lineage->versions.back() && !history_released(s, *lineage)) {
      ref.lineage = std::move(lineage);
      ref.version = static_cast<int64_t>(ref.lineage->mutations.size());
      return ref;
    }
    // Not seen, written where lineage could not see (no_grad code such as
    // weight init, another thread), or its history released: an input held
    // like a parameter. Scratch arguments are always held (Note [Held
    // scratch and long-lived storages]).
  }
  std::shared_ptr<External>& held = s.externals[tensor.unsafeGetTensorImpl()];
  // Another storage under the same tensor since it was first read (`p.data =
  // ...`): a new input; what read the old one keeps it (Note [Held without
  // their graph]).
  if (held != nullptr && held->key != storage_address(tensor)) held = nullptr;
  if (held == nullptr) {
    held = std::make_shared<External>();
    held->tensor = held_without_graph(tensor, held.get());  // Note [Held without their graph]
    held->key = storage_address(tensor);
    s.held_storages.insert(held->key);
    if (tensor.has_storage() && !scratch) {
      if (std::shared_ptr<StorageResidency> entry = entry_of_storage(tensor.storage())) {
        hold_through_entry(*held, std::move(entry), nullptr);
      }
    }
  }
  ref.external = held;
  return ref;
}

// What a snapshot argument was as the op starts (Note [Arguments
// snapshotted before the op] in lineage_ops.cpp): a copy nothing records.
at::Tensor snapshot_of(const at::Tensor& t) {
  PauseRecording paused;
  at::NoGradGuard no_grad;
  return t.clone();
}

void capture_arguments(RecorderState& s, const OpInfo& info, c10::ArrayRef<const c10::IValue> inputs, OpNode& node) {
  node.args.resize(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    const c10::IValue& value = inputs[i];
    ArgSlot& slot = node.args[i];
    const bool scratch = i < info.scratch.size() && info.scratch[i];
    if (value.isTensor()) {
      const at::Tensor& t = value.toTensor();
      if (!t.defined()) {
        slot.plain = value;
        continue;
      }
      slot.kind = ArgSlot::kTensor;
      slot.refs.push_back(static_cast<int32_t>(node.refs.size()));
      const bool snapshot = i < info.snapshot.size() && info.snapshot[i];
      node.refs.push_back(make_ref(s, snapshot ? snapshot_of(t) : t, scratch));
    } else if (value.isTensorList()) {
      slot.kind = ArgSlot::kTensorList;
      for (const at::Tensor& t : value.toTensorList().vec()) {
        slot.refs.push_back(static_cast<int32_t>(node.refs.size()));
        node.refs.push_back(make_ref(s, t, false));
      }
    } else if (value.isList()) {
      // Tensor?[] (index.Tensor's indices): a generic list holding tensors
      // (plain Tensor[] is a TensorList, above); other lists are values.
      bool tensors = false;
      for (const c10::IValue& item : value.toListRef()) tensors = tensors || item.isTensor();
      if (!tensors) {
        slot.plain = value;
        continue;
      }
      slot.kind = ArgSlot::kOptionalTensorList;
      for (const c10::IValue& item : value.toListRef()) {
        if (item.isTensor() && item.toTensor().defined()) {
          slot.refs.push_back(static_cast<int32_t>(node.refs.size()));
          node.refs.push_back(make_ref(s, item.toTensor(), false));
        } else {
          slot.refs.push_back(-1);
        }
      }
    } else {
      slot.plain = value;
    }
  }
}

void capture_generator(const OpInfo& info, c10::ArrayRef<const c10::IValue> inputs, OpNode& node) {
  std::optional<at::Generator> generator;
  std::optional<c10::Device> device;
  for (const c10::IValue& value : inputs) {
    if (value.isGenerator()) generator = value.toGenerator();
    if (!device && value.isTensor() && value.toTensor().defined()) device = value.toTensor().device();
  }
  (void)info;
  if (!generator) {
    const c10::Device where = device.value_or(c10::Device(c10::kCPU));
    generator = at::globalContext().defaultGenerator(where.is_cuda() ? where : c10::Device(c10::kCPU));
  }
  std::lock_guard<std::mutex> lock(generator->mutex());
  node.generator_state = generator->get_state();
  node.generator = std::move(generator);
}

void begin_op(const at::RecordFunction& fn, size_t slot);

// Note [Originals of in-place ops]: autograd's kernel for an in-place op
// whose backward needs the input as it was (mul_, div_, addcmul_ when the
// other operand requires grad) saves a clone of it, taken inside the op's
// call: the Python mode, below autograd, records that clone; this callback,
// whose ops nested in a recorded op are not looked at, left the saved copy
// without lineage, swap-only (half the saved tensors of a CPU GRU cell). So
// the callback stays on for the children of an in-place op being recorded,
// and a clone directly inside one is recorded like any op: it reads the
// input at its version before the write. Everything else nested in it is
// still not recorded; the in-place ops are few, so the callback's cost on
// their children is small.
bool copies_its_input(const Frame& frame) {
  return frame.node != nullptr && !frame.info->writes.empty();
}

std::unique_ptr<at::ObserverContext> on_op_start(const at::RecordFunction& fn) {
  // By index, not reference: what runs below (a rescue's replay, the
  // generator's state tensor) may call ops, whose frames can move this one.
  const size_t slot = t_frames.size();
  t_frames.emplace_back();
  begin_op(fn, slot);
  if (t_frames[slot].blocks_children && t_handle && !copies_its_input(t_frames[slot])) {
    // Last, after any replay a rescue ran: those ops are paused anyway.
    at::disableCallback(*t_handle);
    t_frames[slot].silenced = true;
  }
  return nullptr;
}

// Note [Written where nothing records]: an in-place write under no_grad is
// not recorded; the written tensor's counter moves past its lineage, so
// reads through that counter are held. But p.data is a new counter at 0 on
// the same storage, which still matched the lineage: copy.deepcopy of a
// parameter clones p.data, so the layers nn.TransformerEncoder copies from
// its prototype were recorded as clones of torch.empty's output (their
// initialisation, under no_grad, unseen): unreplayable, and every
// activation reading them swap-only (a 3-layer encoder, recompute-only, ran
// out of memory at 60% of its peak; the Python recorder, whose p.data is a
// new object and so held, fitted). A storage written where nothing records
// loses its lineage: whatever reads it from then on holds it, through any
// counter. What already read it keeps the lineage it read. And a storage
// read as a held input is about to change: what reads it is rescued first
// (Note [Held under another counter]), as for a recorded write; `with
// torch.no_grad(): p.data.mul_(0.5)` between forward and backward went
// unseen by both recorders, and the dropped activations that read p were
// replayed with the new weight: wrong gradients, silently.
void forget_written_storages(const OpInfo& info, c10::ArrayRef<const c10::IValue> inputs) {
  RecorderState& s = state();
  Deferred deferred;  // Note [Recorder lock and the GIL]
  {
    std::lock_guard<std::recursive_mutex> lock(s.mutex);
    for (size_t position : info.writes) {
      if (position >= inputs.size() || !inputs[position].isTensor()) continue;
      const at::Tensor& target = inputs[position].toTensor();
      if (!target.defined() || !target.has_storage()) continue;
      const uintptr_t key = storage_address(target);
      if (s.held_storages.count(key) != 0) {
        deferred.rescues.push_back(key);
        deferred.writer = info.name.c_str();
      }
      auto found = s.by_storage.find(target.storage().unsafeGetStorageImpl());
      if (found == s.by_storage.end()) continue;
      deferred.released.push_back(std::move(found->second.lineage));
      s.by_storage.erase(found);
    }
  }
  deferred.run(s);
}

// Whether an op recorded on this thread after an unpack may begin a forward
// (Note [Recording on started threads]). Holds the lock.
bool may_begin_forward(const RecorderState& s) {
  const std::thread::id packer = s.packer.load();
  return packer == std::thread::id() || packer == std::this_thread::get_id() || !any_entry_saved_for_backward();
}

void begin_op(const at::RecordFunction& fn, size_t slot) {
  const bool in_copier = t_blocking == 1 && slot > 0 && copies_its_input(t_frames[slot - 1]);
  if ((t_blocking > 0 && !in_copier) || t_paused || !t_recording || !g_active.load(std::memory_order_relaxed) ||
      c10::impl::tls_is_dispatch_key_excluded(c10::DispatchKey::Python)) {
    // Nested in an op that ran whole (Note [Recorded granularity]), a replay,
    // or code that hides its ops from dispatch modes (torch.tensor(data)).
    return;
  }
  const OpInfo* info = lookup_info(fn);
  if (in_copier && (info == nullptr || !info->copies_input)) return;  // Note [Originals of in-place ops]
  if (info == nullptr) {
    if (starts_function_forward(fn)) {
      t_frames[slot].function_forward = true;
      t_frames[slot].compiled_region = is_compiled_region(fn);
      t_frames[slot].sequence_nr = fn.seqNr();
      enter_function_forward(t_frames[slot].compiled_region);
    }
    return;
  }
  if (info->kind == OpKind::kDecomposed) return;
  t_frames[slot].blocks_children = true;
  ++t_blocking;
  if (info->kind == OpKind::kSkip || (!c10::GradMode::is_enabled() && !in_function_forward()) ||
      torch::autograd::get_current_graph_task_id() != -1) {
    if (!info->writes.empty() && info->kind != OpKind::kSkip && torch::autograd::get_current_graph_task_id() == -1) {
      forget_written_storages(*info, fn.inputs());  // Note [Written where nothing records]
    }
    return;  // backward, no_grad and optimizer steps are not recorded
  }
  c10::ArrayRef<const c10::IValue> inputs = fn.inputs();
  if (!all_plain(inputs)) return;  // tensor subclasses (fake, functional): not ours
  RecorderState& s = state();
  Deferred deferred;  // Note [Recorder lock and the GIL]
  {
    std::lock_guard<std::recursive_mutex> lock(s.mutex);
    // Note [A forward that ran out of memory]; Note [Recording on started threads].
    if (take_out_of_memory() || (s.in_backward && may_begin_forward(s))) begin_forward(s, deferred);
    ++s.op_index;
    ++s.ops_recorded;
    if (info->kind == OpKind::kView) {
      if (s.tracing) s.trace.push_back("view " + info->name);
    } else {
      auto node = std::make_shared<OpNode>();
      node->info = info;
      node->index = s.op_index - 1;
      node->replayable = info->replayable;
      capture_arguments(s, *info, inputs, *node);
      if (s.tracing) s.trace.push_back(info->name);
      if (info->random) capture_generator(*info, inputs, *node);
      for (size_t position : info->writes) {
        if (position >= node->args.size() || node->args[position].kind != ArgSlot::kTensor) continue;
        const TensorRef& ref = node->refs[node->args[position].refs[0]];
        const at::Tensor& target = inputs[position].toTensor();
        if (target.has_storage()) {
          auto found = s.by_storage.find(target.storage().unsafeGetStorageImpl());
          if (found != s.by_storage.end() && !found->second.lineage->parts.empty()) {
            mark_written_behind(s, *found->second.lineage, ref.lineage.get(), byte_range(target),
                                deferred);  // Note [Parts of a storage]
          }
        }
        if (ref.lineage != nullptr) {
          t_frames[slot].writes.emplace_back(ref.lineage, inputs[position].toTensor());
          // Note [Held under another counter]: a storage with a lineage may
          // also have been read as a held input, through a tensor whose
          // version counter it does not share. A parameter made after
          // install() has torch.empty's lineage, which its initialisation
          // (under no_grad) left behind, so reads of the parameter hold it;
          // `p.data` is a new counter at 0 that still matches that lineage,
          // and a write through it between forward and backward (weight
          // clipping, an EMA swap) went down as a mutation of the lineage,
          // with no rescue: dropped activations replayed with the new
          // weight, silently. Rescued like any write to a held input.
          const uintptr_t key = storage_address(target);
          if (s.held_storages.count(key) != 0) deferred.rescues.push_back(key);
        } else {
          // A write to a tensor lineage did not produce: entries whose replay
          // reads it are made resident, before the write lands (below).
          deferred.rescues.push_back(ref.external->key);
        }
        deferred.writer = info->name.c_str();
      }
      Frame& frame = t_frames[slot];
      frame.node = std::move(node);
      frame.info = info;
      if (s.roofline) frame.inputs.assign(inputs.begin(), inputs.end());
    }
  }
  deferred.run(s);
  // After the rescues (which may replay): they are not this op's time.
  t_frames[slot].start = Clock::now();
}

// Gives t's storage the lineage (node, index); on a storage that has one (an
// output aliasing an input or an earlier output without being declared a
// view), t's lineage becomes one of its parts (Note [Parts of a storage]).
void attach_output(RecorderState& s, const std::shared_ptr<OpNode>& node, int64_t index, const at::Tensor& t) {
  if (!t.defined() || !t.has_storage() || !is_plain(t)) return;
  c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
  auto lineage = std::make_shared<StorageLineage>(node, index, t, s.forward);
  auto it = s.by_storage.find(impl);
  if (it == s.by_storage.end()) {
    c10::weak_intrusive_ptr<c10::StorageImpl> weak(c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(impl));
    s.by_storage.emplace(impl, RecorderState::Recorded{std::move(weak), std::move(lineage)});
    return;
  }
  StorageLineage& whole = *it->second.lineage;
  std::tie(lineage->begin_byte, lineage->end_byte) = byte_range(t);
  whole.parts.push_back(lineage);
  if (s.parts.empty() || s.parts.back().first != s.forward) s.parts.push_back({s.forward, {}});
  s.parts.back().second.push_back(std::move(lineage));  // Note [Lineage ownership]
}

void record_op_end(RecorderState& s, const at::RecordFunction& fn, Frame& frame, double seconds, Deferred& deferred);

// The innermost custom Function forward open on this thread, or null.
Frame* enclosing_function_forward() {
  for (auto frame = t_frames.rbegin(); frame != t_frames.rend(); ++frame) {
    if (frame->function_forward) return frame->compiled_region ? nullptr : &*frame;
  }
  return nullptr;
}

// A custom Function's record closes (Note [Marked dirty by a Function]).
void end_function_forward(Frame& frame) {
  // A forward that raised closes its record with its Python exception set;
  // a plan query below (Python) must neither see nor clobber it.
  std::optional<py::error_scope> raised;
  if (PyGILState_Check() != 0) raised.emplace();
  RecorderState& s = state();
  Deferred deferred;  // Note [Recorder lock and the GIL]
  {
    std::lock_guard<std::recursive_mutex> lock(s.mutex);
    for (ForwardWrite& write : frame.forward_writes) {
      if (write.lineage->versions.back() == write.version && version_of(write.tensor) == write.version + 1 &&
          rebased_onto_function(write.tensor, frame.sequence_nr)) {
        write.lineage->versions.back() = write.version + 1;
      }
    }
    for (const auto& [entry_id, tensor] : frame.packed) {
      if (s.by_storage.count(tensor.storage().unsafeGetStorageImpl()) != 0) declare_packed(s, entry_id, tensor, deferred);
    }
  }
  deferred.run(s);
}

void on_op_end(const at::RecordFunction& fn, at::ObserverContext* /*context*/) {
  if (t_frames.empty()) return;  // started before the callback was added
  Frame frame = std::move(t_frames.back());
  t_frames.pop_back();
  if (frame.blocks_children) --t_blocking;
  if (frame.function_forward) {
    leave_function_forward(frame.compiled_region);
    if (!frame.forward_writes.empty() || !frame.packed.empty()) end_function_forward(frame);
  }
  if (frame.silenced && t_enabled && t_handle) at::reenableCallback(*t_handle);
  if (frame.node == nullptr) return;
  const double seconds = std::chrono::duration<double>(Clock::now() - frame.start).count();
  RecorderState& s = state();
  Deferred deferred;  // Note [Recorder lock and the GIL]
  record_op_end(s, fn, frame, seconds, deferred);
  deferred.run(s);
}

void record_op_end(RecorderState& s, const at::RecordFunction& fn, Frame& frame, double seconds, Deferred& deferred) {
  std::lock_guard<std::recursive_mutex> lock(s.mutex);
  const OpInfo& info = *frame.info;
  if (s.roofline) {
    // Asynchronous device: the timer saw the launch only.
    seconds = std::max(seconds, roofline_seconds(*s.roofline, info, frame.inputs, fn.outputs()));
  }
  frame.node->seconds = seconds;
  if (!frame.writes.empty()) {
    if (s.writers.empty() || s.writers.back().first != s.forward) {
      s.writers.push_back({s.forward, {}});
    }
    s.writers.back().second.push_back(frame.node);
    Frame* function = enclosing_function_forward();
    for (auto& [target, tensor] : frame.writes) {
      target->mutations.push_back(frame.node);
      // The ADInplaceOrView kernel ran inside this call: the bump is done.
      target->versions.push_back(static_cast<int64_t>(tensor._version()));
      target->memo.clear();
      if (function != nullptr) {  // Note [Marked dirty by a Function]
        function->forward_writes.push_back({target, tensor, target->versions.back()});
      }
    }
  }
  const c10::FunctionSchema& schema = info.op.schema();
  const std::vector<c10::IValue>& outputs = fn.outputs();
  int64_t index = 0;
  for (size_t r = 0; r < outputs.size(); ++r) {
    const bool aliased = r < schema.returns().size() && schema.returns()[r].alias_info() != nullptr;
    const c10::IValue& value = outputs[r];
    if (value.isTensor()) {
      if (!aliased) attach_output(s, frame.node, index, value.toTensor());
      ++index;
    } else if (value.isTensorList()) {
      for (const at::Tensor& t : value.toTensorList().vec()) {
        if (!aliased) attach_output(s, frame.node, index, t);
        ++index;
      }
    } else {
      ++index;
    }
  }
  for (const auto& [entry_id, tensor] : frame.packed) declare_packed(s, entry_id, tensor, deferred);
}

// Note [Packed before recorded]: autograd saves an op's outputs (softmax's,
// mkldnn_rnn_layer's) inside the op's call, so the pack hook sees them before
// the RecordFunction end callback has given them a lineage (the Python mode
// gives it below autograd, before they are saved); and an in-place op's
// result (relu_'s, tanh_'s) after the write has bumped its version but
// before the end callback has recorded the write: declared then, its version
// matched no history and it was swap-only (the saved gates of a CPU GRU
// cell, and every ReLU(inplace=True) output). A pack made while an op is
// being recorded is therefore held by the op's frame and declared when the
// op ends, after its writes and outputs are recorded.
void on_pack(uint64_t entry_id, const at::Tensor& tensor) {
  if (!tensor.defined() || !tensor.has_storage()) return;
  if (t_recording && torch::autograd::get_current_graph_task_id() == -1) {
    state().packer.store(std::this_thread::get_id());  // Note [Recording on started threads]
    state().packed_in_forward.store(true);
  }
  for (auto frame = t_frames.rbegin(); frame != t_frames.rend(); ++frame) {
    // A Function that wrote in its forward may yet have the write's version
    // bumped (Note [Marked dirty by a Function]).
    if (frame->node != nullptr || !frame->forward_writes.empty()) {
      frame->packed.emplace_back(entry_id, tensor);
      return;
    }
  }
  RecorderState& s = state();
  Deferred deferred;
  {
    std::lock_guard<std::recursive_mutex> lock(s.mutex);
    if (s.by_storage.count(tensor.storage().unsafeGetStorageImpl()) == 0) return;
    declare_packed(s, entry_id, tensor, deferred);
  }
  deferred.run(s);
}

}  // namespace

RecorderState& state() {
  static auto* recorder = new RecorderState();  // leaked: ops may run during interpreter exit
  return *recorder;
}

PauseRecording::PauseRecording() : previous_(t_paused) { t_paused = true; }
PauseRecording::~PauseRecording() { t_paused = previous_; }

namespace {

// Forgets what no live entry needs: after stop() only replays of entries
// packed before it can still be asked for (saved activations outlive
// uninstall()), and a stopped recorder must not keep the inputs it held
// (parameters of a model long gone) alive. What it held goes to `released`,
// for the caller to drop once the lock is released (Note [Recorder lock and
// the GIL]).
void forget_unneeded(RecorderState& s, std::vector<std::shared_ptr<void>>& released) {
  for (auto& [impl, recorded] : s.by_storage) released.push_back(std::move(recorded.lineage));
  s.by_storage.clear();
  for (auto& [impl, external] : s.externals) released.push_back(std::move(external));
  s.externals.clear();
  forget_dead_entries(s, released);
  if (s.by_entry.empty()) {
    for (auto& [forward, writers] : s.writers) {
      for (std::shared_ptr<OpNode>& writer : writers) released.push_back(std::move(writer));
    }
    s.writers.clear();
  }
  // Only recording reads parts through their storage; replays hold theirs.
  for (auto& [forward, parts] : s.parts) {
    for (std::shared_ptr<StorageLineage>& part : parts) released.push_back(std::move(part));
  }
  s.parts.clear();
  // The next op begins a fresh forward, which has packed nothing yet.
  s.in_backward = true;
  s.packed_in_forward.store(false);
}

// This thread's callback on (its frames and flags fresh); what is recorded
// is unchanged.
void start_on_this_thread() {
  if (t_handle) throw std::runtime_error("membudget: the C++ lineage recorder is already on for this thread");
  t_frames.clear();
  t_blocking = 0;
  reset_function_forwards();
  t_recording = true;
  t_enabled = true;
  t_handle = at::addThreadLocalCallback(at::RecordFunctionCallback(on_op_start, on_op_end)
                                            .needsInputs(true)
                                            .needsOutputs(true)
                                            .scopes({at::RecordScope::FUNCTION}));
}

void start_recording() {
  start_on_this_thread();
  RecorderState& s = state();
  std::vector<std::shared_ptr<void>> released;  // dropped after the lock
  {
    std::lock_guard<std::recursive_mutex> lock(s.mutex);
    forget_unneeded(s, released);
    s.ops_recorded = 0;
    s.packer.store(std::thread::id());
  }
  g_active.store(true);
}

// This thread's callback off; what is recorded is unchanged.
void stop_on_this_thread() {
  if (!t_handle) return;
  at::removeCallback(*t_handle);
  t_handle.reset();
  t_frames.clear();
  t_blocking = 0;
  reset_function_forwards();
  t_recording = false;
}

void stop_recording() {
  if (!t_handle) return;
  stop_on_this_thread();
  g_active.store(false);
  RecorderState& s = state();
  std::vector<std::shared_ptr<void>> released;  // dropped after the lock
  std::lock_guard<std::recursive_mutex> lock(s.mutex);
  forget_unneeded(s, released);
}

}  // namespace

void release_stopped_recorder() {
  // Note [Lineage let go once nothing is saved] (saved_activation.cpp).
  if (g_active.load()) return;  // installed again: its own release applies
  RecorderState& s = state();
  std::vector<std::shared_ptr<void>> released;  // dropped after the lock
  std::lock_guard<std::recursive_mutex> lock(s.mutex);
  forget_unneeded(s, released);
  ++s.epoch;
}

void bind_lineage(pybind11::module_& m) {
  pybind11::module_ sub = m.def_submodule("lineage", "The C++ lineage recorder (Note [C++ lineage recorder])");
  sub.def("start", &start_recording,
          "Record this thread's forward ops from C++ until stop() (Note [C++ lineage recorder]).");
  sub.def("stop", &stop_recording, "Stop recording on this thread and forget unmanaged lineage.");
  sub.def("start_on_this_thread", &start_on_this_thread,
          "Record this thread's forward ops too, while the recorder is started (a thread started after "
          "install(): Note [Recording on started threads]).");
  sub.def("stop_on_this_thread", &stop_on_this_thread,
          "Stop recording on this thread (a started thread's end); what was recorded is kept.");
  sub.def("recording", [] { return t_handle.has_value(); }, "Whether this thread records.");
  bind_function_forwards(sub);
  sub.def("set_enabled", [](bool enabled) {
    t_enabled = enabled;
    if (!t_handle) return;
    if (enabled) {
      at::reenableCallback(*t_handle);
    } else {
      at::disableCallback(*t_handle);
    }
  }, "Turn this thread's callback off (backward, optimizer steps) or back on; what is recorded is unchanged.");
  sub.def("held_inputs", [] {
    RecorderState& s = state();
    std::lock_guard<std::recursive_mutex> lock(s.mutex);
    py::list out;
    for (const auto& [impl, held] : s.externals) {
      if (held->tensor.defined() && held->tensor.has_storage()) {
        out.append(py::make_tuple(held->tensor.sizes().vec(), held->tensor.storage().nbytes()));
      }
    }
    return out;
  }, "(sizes, storage bytes) of each input this forward holds (tests and debugging).");
  sub.def("take_out_of_memory", &take_out_of_memory,
          "Whether an out-of-memory error was raised to torch since the last call: the Python recorder then "
          "begins a forward at its next op (Note [A forward that ran out of memory]).");
  sub.def("held_without_graph", [](const at::Tensor& tensor) { return held_without_graph(tensor, nullptr); },
          py::arg("tensor"), "What the Python recorder holds of an input no recorded op made: its data and version counter "
          "without its autograd metadata, or the tensor itself for an inference tensor or a subclass without a "
          "grad_fn (Note [Held without their graph]).");
  sub.def("ops_recorded", [] {
    RecorderState& s = state();
    std::lock_guard<std::recursive_mutex> lock(s.mutex);
    return s.ops_recorded;
  }, "Forward ops recorded (views included) since start().");
  sub.def("forwards", [] {
    RecorderState& s = state();
    std::lock_guard<std::recursive_mutex> lock(s.mutex);
    return s.forward;
  }, "Forwards begun since the process started (tests: Note [Recording on started threads]).");
  sub.def("note_backward", [] {
    RecorderState& s = state();
    std::lock_guard<std::recursive_mutex> lock(s.mutex);
    s.in_backward = true;
  }, "Backward has begun: the next recorded op starts a new forward.");
  sub.def("release_if_idle", [] {
    // Note [Lineage released between steps] (python/membudget/lineage.py):
    // once backward has run and no managed entry is left, nothing recorded
    // can be replayed, yet the nodes of the last forward hold its inputs
    // (parameters, their gradients, the batch) for as long as a storage it
    // made lives (the loss a loop keeps). The GIL is let go while the lock
    // is held (Note [Recorder lock and the GIL]); what was held is dropped
    // once both are back as they were.
    RecorderState& s = state();
    std::vector<std::shared_ptr<void>> released;
    {
      py::gil_scoped_release no_gil;
      std::lock_guard<std::recursive_mutex> lock(s.mutex);
      // Entries only the recorder holds ask for no replay (Note [Entries only lineage holds]).
      // A forward that packed nothing (begun by loss.detach() between
      // backward and the step) does not hold the release back, and the next
      // op begins a fresh one: lineage.py's release_if_idle says why.
      if ((s.packed_in_forward.load() && !s.in_backward) || any_entry_saved_for_backward()) return false;
      forget_unneeded(s, released);  // with no entry live: everything (and in_backward: the next op begins one)
      ++s.epoch;
    }
    return true;
  }, "After backward, with no managed entry left: let go of every recorded input and lineage "
     "(Note [Lineage released between steps]). True when it released.");
  sub.def("trace", [](bool on) {
    RecorderState& s = state();
    std::lock_guard<std::recursive_mutex> lock(s.mutex);
    std::vector<std::string> names = std::move(s.trace);
    s.trace.clear();
    s.tracing = on;
    return names;
  }, py::arg("on"), "Names of the ops that got a node since the last call (while tracing); tracing on or off.");
  sub.def("on_pack", &on_pack, py::arg("entry_id"), py::arg("tensor"),
          "A storage was packed as entry_id: declares its lineage to the manager (now, or when the op that "
          "made it returns).");
  sub.def("set_device_model", [](py::object model) {
    RecorderState& s = state();
    std::optional<RooflineModel> roofline;
    if (!model.is_none()) {
      py::dict rates = model["flops_per_s"];
      RooflineModel m;
      m.fp32_flops_per_s = rates["fp32"].cast<double>();
      auto rate = [&](const char* key) { return rates.contains(key) ? rates[key].cast<double>() : m.fp32_flops_per_s; };
      m.bf16_flops_per_s = rate("bf16");
      m.fp16_flops_per_s = rate("fp16");
      m.fp64_flops_per_s = rate("fp64");
      m.int_flops_per_s = rate("int");
      m.memory_bytes_per_s = model["memory_bytes_per_s"].cast<double>();
      m.launch_s = model["launch_s"].cast<double>();
      roofline = m;
    }
    std::lock_guard<std::recursive_mutex> lock(s.mutex);
    s.roofline = roofline;
  }, py::arg("model"), "A costs.DeviceModel.to_dict() whose roofline floors every recorded op's cost "
     "(Note [Roofline floor on CUDA]), or None.");
  sub.def("set_plan", [](py::object plan) {
    RecorderState& s = state();
    std::lock_guard<std::recursive_mutex> lock(s.mutex);
    s.plan = plan.is_none() ? nullptr : std::make_unique<py::object>(std::move(plan));
  }, py::arg("plan"), "plan(entry_id, op index, op name, output index), called for recomputable packs; or None.");
  bind_lineage_replay(sub);
}

}  // namespace lineage
}  // namespace membudget

// ResidencyEntry: one managed storage (a saved activation's memory) as the
// residency manager sees it. The torch binding subclasses it around a
// c10::Storage; the core never sees torch types.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "event.h"

namespace membudget {

// resident -> swapping_out -> resident+host copy -> host -> swapping_in -> resident,
// or resident -> dropped -> recomputing -> resident (Note [Recompute]); an entry
// recomputed ahead of use stays recomputing, with a copy_event_, until its
// replay on a side stream completes (Note [Recompute ahead]).
// Note [Host copies]: a storage is only copied to host while nothing but the
// manager references it, so nobody can write it afterwards; a host copy once
// complete therefore stays valid for the entry's life, and evicting an entry
// that has one only frees its device memory.
//
// Note [Recompute]: a dropped entry has no copy anywhere; the torch binding
// rebuilds it by replaying the ops that produced it (python/membudget/lineage.py).
// The manager never calls that code itself: materialize() of a dropped entry
// marks it recomputing and returns nullptr, the binding replays the ops
// without any manager lock held (the replay allocates, and may evict), then
// attaches the new storage and calls complete_recompute(). An entry is
// droppable only after the binding declared it recomputable
// (set_recompute_info), with its replay cost and the entries it reads.
//
// Note [Recompute ahead]: after the prefetcher has issued its swap-ins (and
// only if none of them was refused for lack of room: copies overlap for free,
// a replay costs compute), it walks the next few predicted unpacks
// (kMaxAheadUnpacks) within its window; a dropped entry whose managed inputs
// are all resident is queued for replay ahead of its use (when the config
// asks for it) if free memory (no eviction) holds it: the entry becomes
// recomputing and pinned, and the binding takes the queue
// (take_recompute_ahead), replays each entry (on CUDA on a side stream)
// between begin_recompute_ahead and complete_recompute_ahead, and hands back
// the event the consumer must wait for. The replay's allocations evict
// nothing: a speculative replay that does not fit in free memory is given up
// (dropped again, Note [Speculative allocations]), since one that makes room
// drops entries that then need replays of their own. An entry still queued
// when backward unpacks it is replayed on demand as any dropped entry; one
// whose replay is still running on a side stream is waited for as a swap-in
// is. The prefetch window counts it from queueing to its unpack.
// Note [Held inputs freed under us]: a replay also reads inputs the manager
// does not manage (parameters, small tensors). Their data can go while an
// entry that reads them is resident: FSDP2 (fully_shard) frees each block's
// gathered parameters after the block's forward (storage resize_(0)) and
// gathers them into the same storage again for its backward; no version
// counter moves. A drop then would be a replay that cannot run (or reads
// nothing). The binding declares such inputs with the entry; the manager
// asks each one whether its data is there before it drops the entry, or
// any entry whose replay rebuilds it (ResidencyManager::replayable_now),
// and swaps instead. Entries of the block that is running, whose parameters
// are gathered, are dropped as usual, and replayed in its backward, where
// they are gathered again.
//
// Note [Writes that refill a freed input]: an entry dropped while its held
// inputs were there (its block running) stays dropped when FSDP2 frees them
// after the block; its backward gathers them again by resizing the storage
// and writing the same values into it. A write to a held input makes the
// recorders rebuild what reads it first (Note [Rescue before the write] in
// python/membudget/lineage.py), which would then read the storage before the
// write fills it. So the manager watches a dropped entry's probes at each
// pack and unpack; once one finds its storage freed, a write to it leaves
// the entry dropped, and its replay reads the storage as filled again
// (autograd reads a saved parameter so too). Learning from the last
// iteration whether a freed input is back for an entry's unpack, and
// dropping it then, was tried: an FSDP-like run that ran out of memory at
// 60% of its peak recompute-only still did, in its first step, where there
// is nothing to learn from (bench/RESULTS.md, session 33).
// A resident entry is the same: its data is whole, and its replay, should it
// be dropped after the gather, reads the storage filled again; made
// swap-only by the write, it cost an FSDP-like run recompute-only at 70% of
// its peak 20 MiB it could not drop (session 34). So resident entries'
// probes are watched too, from the first time the manager finds any held
// input freed (an eviction candidate whose replay could not run now, or a
// watched drop): until then no run pays for the watch. A write leaves an
// entry as it is when the entry, or any managed input its rebuild may come
// to replay (resident ones too: the recorders rescue an entry for a write
// it reaches only through one), had a held input freed. Per entry, not per
// input: a write to another of its held inputs, never freed, is taken for
// a refill too, which only a run whose held inputs are freed can meet.
//
// Note [Copies ordered after the entry's stream]: a swap-out reads the
// entry's device memory on a copy stream, so it is ordered after the stream
// the entry's tensor was made and read on: torch's current stream when it
// was packed (CUDA), which the binding hands to register_entry(). The
// stream that asks for memory is not that one: an allocation on FSDP2's
// all-gather stream, NCCL's, or the compute stream while the model runs
// under `torch.cuda.stream(s)`, would order a copy after work that never
// wrote the entry, and the copy could read it before its producer's kernel
// ran. The host then waits for the copy before the freed block goes to the
// requesting stream, so no order is owed to that stream. On the host and
// simulated backends every entry's stream is nullptr, as before.
class HeldInput {
 public:
  virtual ~HeldInput() = default;
  // Its data is there to read now. Called under the manager's lock: it must
  // not allocate, free, or take another lock.
  virtual bool present() const = 0;
};
using HeldInputs = std::vector<std::shared_ptr<const HeldInput>>;

enum class Residency : uint8_t { resident, swapping_out, host, swapping_in, dropped, recomputing };

const char* residency_name(Residency state);

class ResidencyEntry {
 public:
  explicit ResidencyEntry(size_t bytes);
  virtual ~ResidencyEntry() = default;
  ResidencyEntry(const ResidencyEntry&) = delete;
  ResidencyEntry& operator=(const ResidencyEntry&) = delete;

  size_t bytes() const { return bytes_; }
  // Process-unique id (never reused): how the binding's lineage names it.
  uint64_t id() const { return id_; }

  // True while anything besides the manager holds the storage: a tensor of the
  // forward pass, an op that is using it. Such an entry is never evicted.
  virtual bool externally_referenced() const = 0;
  // Device address of the data; valid while resident or swapping_out.
  virtual void* device_data() const = 0;
  // Releases the device memory (through the allocator's free).
  virtual void drop_device_copy() = 0;
  // Takes ownership of `ptr` (from the device allocator, `bytes()` long) as
  // the new device memory of the storage.
  virtual void attach_device_copy(void* ptr) = 0;

 private:
  friend class ResidencyManager;
  const size_t bytes_;
  const uint64_t id_;
  // Everything below is guarded by the manager's mutex.
  Residency state_ = Residency::resident;
  bool registered_ = false;
  bool prefetched_ = false;   // a swap-in (or replay) was issued by the prefetcher
  // Read by a replay that is still running (Note [Rebuilt inputs let go once
  // read] in csrc/torch/saved_activation.cpp): evicted only after all else.
  bool replay_input_ = false;
  // Note [Recompute ahead]
  bool ahead_queued_ = false;      // queued for a replay ahead of use, not begun
  bool recomputed_ahead_ = false;  // rebuilt ahead of use, not unpacked since
  // A held input's storage was seen freed while it was dropped, or resident
  // (Note [Writes that refill a freed input]).
  bool held_lost_ = false;
  bool held_watched_ = false;  // listed in the manager's watched_resident_ once
  int pins_ = 0;              // >0 while the manager itself is working on it
  Stream stream_ = nullptr;   // made and read on (Note [Copies ordered after the entry's stream])
  void* host_copy_ = nullptr; // host tier block, bytes() long
  bool host_valid_ = false;   // host copy complete (Note [Host copies])
  EventPtr copy_event_;       // in-flight swap-out, swap-in or replay ahead
  uint64_t last_access_ = 0;  // logical clock
  uint64_t iteration_ = 0;
  uint64_t pack_seq_ = 0;     // order of first pack within its iteration
  // Recompute (Note [Recompute]); set by set_recompute_info.
  bool recomputable_ = false;
  // Why not, as the binding put it (Note [Why not recomputable]); empty
  // while nothing was declared: no lineage reached it.
  std::string unrecomputable_reason_;
  double replay_seconds_ = 0.0;         // its own replay, down to live or managed inputs
  std::vector<uint64_t> inputs_;        // ids of managed entries the replay reads
  HeldInputs held_inputs_;              // unmanaged inputs it reads (Note [Held inputs freed under us])
  std::vector<uint64_t> dependents_;    // ids of entries whose replay reads this one
  // Note [Replay overhead]: set when a replay on demand begins: its estimate
  // (without the learned overhead), how many replays it comprises (0: none
  // begun) and the manager's blocked seconds then.
  double replay_estimate_s_ = 0.0;
  int replay_chain_ = 0;
  double replay_blocked_start_s_ = 0.0;
};

}  // namespace membudget

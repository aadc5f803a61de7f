// Registration functions of the extension module, one per binding file, so
// that each file binds what it implements and module.cpp only lists them.
#pragma once
#include <torch/extension.h>

#include <vector>

#include "core/caching_allocator.h"
#include "core/copy_timeline.h"

namespace membudget {

// bind_core.cpp: standalone CachingAllocator / HostBackend objects, for the
// allocator's property and concurrency tests.
void bind_core(pybind11::module_& m);
// runtime.cpp + saved_activation.cpp: install, stats, pack/unpack hooks.
void bind_runtime(pybind11::module_& m);
// cuda_symbols.cpp: CUDA backend availability and the pluggable symbols.
void bind_cuda(pybind11::module_& m);
// bind_sim.cpp: the simulator's replay driver over SimBackend.
void bind_sim(pybind11::module_& m);
// bind_timeline.cpp: Note [Copy timeline] of the installed HostBackend.
void bind_timeline(pybind11::module_& m);

// Note [Copy timeline] as a dict of totals, copies and waits (bind_timeline.cpp).
pybind11::dict timeline_dict(const CopyTotals& totals, const std::vector<CopyRecord>& copies,
                             const std::vector<WaitRecord>& waits);
pybind11::dict timeline_dict(const CopyTimeline& timeline);

// A CachingAllocator::snapshot() as a list of dicts (bind_core.cpp): each
// segment's address, size, mapped_bytes, mapped_ranges, expandable,
// page_bytes, retired, small_pool and blocks (address, size, allocated,
// stream, awaiting_events).
pybind11::list snapshot_list(const std::vector<SegmentInfo>& segments);

}  // namespace membudget

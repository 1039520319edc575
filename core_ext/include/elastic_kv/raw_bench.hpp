// The raw driver loop, for benchmarking only: what growing and shrinking by `count` handles of `page_size`
// bytes costs when nothing but the driver calls run (no zero page, no bookkeeping, no Python). The
// benchmark compares SpaceGroup.map/unmap with this floor in the same process, through the same backend
// object (the same dlopen'd driver).
//
//   grow   = per handle: [create] + map + set_access     (create only when not pooled)
//   shrink = per handle: unmap + [release]               (release only when not pooled)
//
// Pooled handles are created before and released after the timed loops. Every call is timed on its own
// (steady_clock, ~25 ns of overhead per call). On any failure everything is undone and the error rethrown.
#pragma once

#include <cstddef>
#include <memory>

#include "elastic_kv/backend.hpp"

namespace elastic_kv {

struct RawLoopTimes {
  double grow_s = 0;  // wall time of the grow loop
  double shrink_s = 0;
  double create_s = 0;  // summed time inside each kind of call
  double map_s = 0;
  double set_access_s = 0;
  double unmap_s = 0;
  double release_s = 0;
};

RawLoopTimes raw_driver_loop(const std::shared_ptr<Backend>& backend, std::size_t page_size,
                             std::size_t count, bool pooled);

}  // namespace elastic_kv

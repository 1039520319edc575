#include "elastic_kv/raw_bench.hpp"

#include <chrono>
#include <vector>

namespace elastic_kv {

namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

}  // namespace

RawLoopTimes raw_driver_loop(const std::shared_ptr<Backend>& backend, std::size_t page_size,
                             std::size_t count, bool pooled) {
  if (count == 0) throw InvalidArgument("count must be positive");
  RawLoopTimes t;
  const VAddr va = backend->reserve(page_size * count, page_size & (~page_size + 1));
  std::vector<PhysicalHandle> handles(count);
  std::size_t first_mapped = 0;  // handles [first_mapped, end_mapped) are mapped
  std::size_t end_mapped = 0;
  try {
    if (pooled) {
      for (auto& h : handles) h = PhysicalHandle::create(backend, page_size);
    }
    const auto grow0 = Clock::now();
    for (std::size_t i = 0; i < count; ++i) {
      const VAddr at = va + i * page_size;
      if (!pooled) {
        const auto c0 = Clock::now();
        handles[i] = PhysicalHandle::create(backend, page_size);
        t.create_s += since(c0);
      }
      const auto m0 = Clock::now();
      backend->map(at, page_size, handles[i].id());
      t.map_s += since(m0);
      end_mapped = i + 1;
      const auto a0 = Clock::now();
      backend->set_access(at, page_size);
      t.set_access_s += since(a0);
    }
    t.grow_s = since(grow0);
    const auto shrink0 = Clock::now();
    for (std::size_t i = 0; i < count; ++i) {
      const auto u0 = Clock::now();
      backend->unmap(va + i * page_size, page_size);
      t.unmap_s += since(u0);
      first_mapped = i + 1;
      if (!pooled) {
        const auto r0 = Clock::now();
        handles[i].release();
        t.release_s += since(r0);
      }
    }
    t.shrink_s = since(shrink0);
  } catch (...) {
    for (std::size_t i = first_mapped; i < end_mapped; ++i) {
      try {
        backend->unmap(va + i * page_size, page_size);
      } catch (...) {
        backend->note_cleanup_failure();
      }
    }
    handles.clear();
    try {
      backend->free_va(va, page_size * count);
    } catch (...) {
      backend->note_cleanup_failure();
    }
    throw;
  }
  handles.clear();
  backend->free_va(va, page_size * count);
  return t;
}

}  // namespace elastic_kv

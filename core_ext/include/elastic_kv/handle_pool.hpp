// HandlePool: physical handles kept after unmap and reused by the next map of the same size.
//
// Problem: on the H200 cuMemCreate costs 10-12 us and cuMemRelease 10 us per handle -- about a quarter of the
// cost of growing by one 2 MiB page. KV caches shrink and grow all the time (requests come and go), so a
// handle released on unmap is very likely wanted again soon. The pool keeps up to `max_cached_bytes` of
// created, unmapped handles, keyed by size, and hands them out before creating new ones.
//
// Trade-offs:
//   * Cached handles are real physical memory that nobody uses. The cap bounds that; trim() returns memory to
//     the driver when the owner (the ledger, a limit change, another engine's pressure) asks for it. When a
//     create fails with OutOfMemory while the pool caches handles of other sizes, the pool trims itself and
//     retries once, so cached memory never causes an OOM by itself.
//   * A reused handle still holds its previous contents (exactly like a fresh cuMemCreate, which is not
//     zeroed either). The ledger only hands out blocks it will overwrite.
//   * A handle whose release fails (give_back over the cap, trim) is kept in a separate list, never handed
//   out
//     again, counted (failed_releases) and retried by trim() and the destructor.
//
// Invariant: backend.live_handles == handles held by groups + cached_handles + failed_releases + zero pages.
// Thread safety: one mutex (a leaf lock) guards the cache; backend calls run outside it.
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "elastic_kv/backend.hpp"

namespace elastic_kv {

class HandlePool {
 public:
  HandlePool(std::shared_ptr<Backend> backend, std::size_t max_cached_bytes);
  ~HandlePool();
  HandlePool(const HandlePool&) = delete;
  HandlePool& operator=(const HandlePool&) = delete;

  // A handle of `size` bytes: a cached one (hit) or a new one (miss). Throws OutOfMemory or DriverError.
  PhysicalHandle acquire(std::size_t size);
  // Takes an unmapped handle back: cached if the cap allows, else released. Never throws.
  void give_back(PhysicalHandle handle) noexcept;
  // Releases cached handles until at most `keep_bytes` stay cached; returns the bytes released. Also retries
  // handles whose release failed earlier. Never throws (failures are kept and counted).
  std::size_t trim(std::size_t keep_bytes) noexcept;

  const std::shared_ptr<Backend>& backend() const noexcept { return backend_; }
  std::size_t max_cached_bytes() const noexcept { return max_cached_bytes_; }
  void set_max_cached_bytes(std::size_t bytes) noexcept;
  std::size_t cached_handles() const;
  std::size_t cached_bytes() const;
  std::size_t hits() const;
  std::size_t misses() const;
  std::size_t failed_releases() const;

 private:
  // Releases `handles`, moving any that fail into failed_; returns the bytes released.
  std::size_t release_all(std::vector<PhysicalHandle> handles) noexcept;

  std::shared_ptr<Backend> backend_;
  mutable std::mutex mu_;
  std::size_t max_cached_bytes_;
  std::map<std::size_t, std::vector<PhysicalHandle>> cached_;  // size -> handles (LIFO: warmest first)
  std::size_t cached_bytes_ = 0;
  std::size_t cached_count_ = 0;
  std::size_t hits_ = 0;
  std::size_t misses_ = 0;
  std::vector<PhysicalHandle> failed_;  // release failed; never reused
};

}  // namespace elastic_kv

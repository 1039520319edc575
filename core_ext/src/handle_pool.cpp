#include "elastic_kv/handle_pool.hpp"

#include <utility>

#include "locked.hpp"

namespace elastic_kv {

HandlePool::HandlePool(std::shared_ptr<Backend> backend, std::size_t max_cached_bytes)
    : backend_(std::move(backend)), max_cached_bytes_(max_cached_bytes) {
  if (!backend_) throw InvalidArgument("HandlePool needs a backend");
}

HandlePool::~HandlePool() { trim(0); }

PhysicalHandle HandlePool::acquire(std::size_t size) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = cached_.find(size);
    if (it != cached_.end() && !it->second.empty()) {
      PhysicalHandle h = std::move(it->second.back());
      it->second.pop_back();
      cached_bytes_ -= size;
      --cached_count_;
      ++hits_;
      return h;
    }
    ++misses_;
  }
  try {
    return PhysicalHandle::create(backend_, size);
  } catch (const OutOfMemory&) {
    // Cached handles of other sizes are memory nobody uses: give them back and try once more.
    if (trim(0) == 0) throw;
  }
  return PhysicalHandle::create(backend_, size);
}

void HandlePool::give_back(PhysicalHandle handle) noexcept {
  if (!handle) return;
  std::vector<PhysicalHandle> to_release;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const std::size_t size = handle.size();
    if (cached_bytes_ + size <= max_cached_bytes_) {
      try {
        cached_[size].push_back(std::move(handle));
        cached_bytes_ += size;
        ++cached_count_;
        return;
      } catch (...) {
        // push_back could not allocate: release the handle instead of caching it.
      }
    }
  }
  if (handle) {
    try {
      handle.release();
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu_);
      try {
        failed_.push_back(std::move(handle));
      } catch (...) {
        // Cannot even remember it: its destructor retries the release and counts the failure.
      }
    }
  }
}

std::size_t HandlePool::release_all(std::vector<PhysicalHandle> handles) noexcept {
  std::size_t released = 0;
  for (auto& h : handles) {
    const std::size_t size = h.size();
    try {
      h.release();
      released += size;
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu_);
      try {
        failed_.push_back(std::move(h));
      } catch (...) {
      }
    }
  }
  return released;
}

std::size_t HandlePool::trim(std::size_t keep_bytes) noexcept {
  std::vector<PhysicalHandle> victims;
  {
    std::lock_guard<std::mutex> lock(mu_);
    try {
      victims.swap(failed_);
      // Largest sizes first: fewest driver calls per byte returned.
      for (auto it = cached_.rbegin(); it != cached_.rend() && cached_bytes_ > keep_bytes; ++it) {
        auto& list = it->second;
        while (!list.empty() && cached_bytes_ > keep_bytes) {
          cached_bytes_ -= list.back().size();
          --cached_count_;
          victims.push_back(std::move(list.back()));
          list.pop_back();
        }
      }
    } catch (...) {
      // Out of host memory for the victim list: release what was collected so far.
    }
  }
  return release_all(std::move(victims));
}

void HandlePool::set_max_cached_bytes(std::size_t bytes) noexcept {
  {
    std::lock_guard<std::mutex> lock(mu_);
    max_cached_bytes_ = bytes;
  }
  trim(bytes);
}

std::size_t HandlePool::cached_handles() const { return read_locked(mu_, cached_count_); }

std::size_t HandlePool::cached_bytes() const { return read_locked(mu_, cached_bytes_); }

std::size_t HandlePool::hits() const { return read_locked(mu_, hits_); }

std::size_t HandlePool::misses() const { return read_locked(mu_, misses_); }

std::size_t HandlePool::failed_releases() const {
  std::lock_guard<std::mutex> lock(mu_);
  return failed_.size();
}

}  // namespace elastic_kv

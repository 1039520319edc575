#include "elastic_kv/host_backend.hpp"

#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

#include "locked.hpp"

namespace elastic_kv {

namespace {

std::size_t os_page_size() noexcept { return static_cast<std::size_t>(sysconf(_SC_PAGESIZE)); }

std::string errno_text(int err) {
  return std::string(std::strerror(err)) + " (errno " + std::to_string(err) + ")";
}

void* as_ptr(VAddr va) noexcept { return reinterpret_cast<void*>(static_cast<std::uintptr_t>(va)); }

// Turns [va, va+size) back into a bare PROT_NONE reservation.
int remap_reserved(VAddr va, std::size_t size) noexcept {
  void* p = mmap(as_ptr(va), size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
  return p == MAP_FAILED ? errno : 0;
}

// On EMFILE, raises the soft descriptor limit to the hard limit (once per call); true if it went up.
bool raise_fd_limit() noexcept {
  rlimit lim{};
  if (getrlimit(RLIMIT_NOFILE, &lim) != 0 || lim.rlim_cur >= lim.rlim_max) return false;
  lim.rlim_cur = lim.rlim_max;
  return setrlimit(RLIMIT_NOFILE, &lim) == 0;
}

}  // namespace

HostBackend::HostBackend(std::size_t granularity, std::size_t physical_budget, bool multi_unmap)
    : granularity_(granularity == 0 ? os_page_size() : granularity),
      budget_(physical_budget),
      multi_unmap_(multi_unmap) {
  if (granularity_ % os_page_size() != 0) {
    throw InvalidArgument("host granularity " + std::to_string(granularity) +
                          " is not a multiple of the OS page size " + std::to_string(os_page_size()));
  }
}

HostBackend::~HostBackend() {
  // Everything should have been returned by the spaces, pools and zero pages that hold a reference to this
  // backend; whatever is left was leaked by a caller. Give it back to the OS without throwing.
  for (auto& [id, rec] : handles_) {
    if (!rec.released) close(rec.fd);
  }
  for (auto& [va, size] : reservations_) munmap(as_ptr(va), size);
}

void HostBackend::reject(const char* op, const std::string& why) {
  throw DriverError(op, EINVAL, std::string("host backend: ") + op + ": " + why);
}

std::size_t HostBackend::resident_bytes() const { return read_locked(mu_, resident_); }

std::map<VAddr, std::size_t>::const_iterator HostBackend::find_reservation(VAddr va, std::size_t size) const {
  auto it = reservations_.upper_bound(va);
  if (it == reservations_.begin()) return reservations_.end();
  --it;
  if (va >= it->first && va + size <= it->first + it->second) return it;
  return reservations_.end();
}

std::vector<std::map<VAddr, HostBackend::MappingRecord>::iterator> HostBackend::tiling(const char* op,
                                                                                       VAddr va,
                                                                                       std::size_t size) {
  std::vector<std::map<VAddr, MappingRecord>::iterator> out;
  VAddr cursor = va;
  auto it = mappings_.find(va);
  while (cursor < va + size) {
    if (it == mappings_.end() || it->first != cursor) {
      reject(op, "range [" + std::to_string(va) + ", +" + std::to_string(size) +
                     ") does not consist of whole mappings (a sub-range of a mapping, or a hole)");
    }
    out.push_back(it);
    cursor += it->second.size;
    ++it;
  }
  if (cursor != va + size) reject(op, "range ends inside a mapping");
  return out;
}

VAddr HostBackend::do_reserve(std::size_t size, std::size_t alignment) {
  const std::size_t align = alignment < granularity_ ? granularity_ : alignment;
  if (align % os_page_size() != 0) reject("reserve", "alignment is not a multiple of the OS page size");
  const std::size_t span = size + align;
  void* p = mmap(nullptr, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    throw OutOfMemory("reserve", err,
                      "host backend: cannot reserve " + std::to_string(size) +
                          " bytes of address space: " + errno_text(err));
  }
  const auto raw = reinterpret_cast<std::uintptr_t>(p);
  const std::uintptr_t start = (raw + align - 1) / align * align;
  if (start > raw) munmap(p, start - raw);
  if (raw + span > start + size) munmap(as_ptr(start + size), raw + span - (start + size));
  std::lock_guard<std::mutex> lock(mu_);
  reservations_[start] = size;
  return start;
}

void HostBackend::do_free_va(VAddr va, std::size_t size) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = reservations_.find(va);
  if (it == reservations_.end() || it->second != size)
    reject("free_va", "not a reservation made by reserve()");
  auto m = mappings_.lower_bound(va);
  if (m != mappings_.end() && m->first < va + size) reject("free_va", "the reservation still holds mappings");
  if (munmap(as_ptr(va), size) != 0) {
    const int err = errno;
    throw DriverError("free_va", err, "host backend: munmap failed: " + errno_text(err));
  }
  reservations_.erase(it);
}

HandleId HostBackend::do_create(std::size_t size) {
  std::lock_guard<std::mutex> lock(mu_);
  if (budget_ != 0 && resident_ + size > budget_) {
    throw OutOfMemory("create", ENOMEM,
                      "host backend: physical budget exhausted (" + std::to_string(resident_) + " of " +
                          std::to_string(budget_) + " bytes in use, " + std::to_string(size) + " requested)");
  }
  int fd = memfd_create("elastic-kv", MFD_CLOEXEC);
  if (fd < 0 && errno == EMFILE && raise_fd_limit()) fd = memfd_create("elastic-kv", MFD_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    throw OutOfMemory("create", err, "host backend: memfd_create failed: " + errno_text(err));
  }
  if (ftruncate(fd, static_cast<off_t>(size)) != 0) {
    const int err = errno;
    close(fd);
    throw OutOfMemory("create", err, "host backend: ftruncate failed: " + errno_text(err));
  }
  const HandleId id = next_handle_++;
  handles_.emplace(id, HandleRecord{fd, size, false, 0});
  resident_ += size;
  return id;
}

void HostBackend::drop_handle_if_unused(std::unordered_map<HandleId, HandleRecord>::iterator it) {
  if (it->second.released && it->second.mappings == 0) {
    resident_ -= it->second.size;
    handles_.erase(it);
  }
}

void HostBackend::do_release(HandleId handle, std::size_t size) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = handles_.find(handle);
  if (it == handles_.end() || it->second.released) reject("release", "unknown or already released handle");
  if (it->second.size != size) reject("release", "size does not match the handle");
  close(it->second.fd);  // the mappings keep the memory alive, as with cuMemRelease
  it->second.released = true;
  drop_handle_if_unused(it);
}

void HostBackend::do_map(VAddr va, std::size_t size, HandleId handle) {
  std::lock_guard<std::mutex> lock(mu_);
  auto h = handles_.find(handle);
  if (h == handles_.end() || h->second.released) reject("map", "unknown or released handle");
  if (h->second.size != size) reject("map", "a handle is mapped whole at offset 0; size does not match");
  if (va % granularity_ != 0) reject("map", "address is not aligned to the granularity");
  if (find_reservation(va, size) == reservations_.end()) reject("map", "range is not inside one reservation");
  auto next = mappings_.lower_bound(va);
  if (next != mappings_.end() && next->first < va + size) reject("map", "range overlaps an existing mapping");
  if (next != mappings_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second.size > va) reject("map", "range overlaps an existing mapping");
  }
  void* p = mmap(as_ptr(va), size, PROT_NONE, MAP_SHARED | MAP_FIXED, h->second.fd, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    if (err == ENOMEM) throw OutOfMemory("map", err, "host backend: mmap failed: " + errno_text(err));
    throw DriverError("map", err, "host backend: mmap failed: " + errno_text(err));
  }
  mappings_.emplace(va, MappingRecord{size, handle, false});
  ++h->second.mappings;
}

void HostBackend::do_unmap(VAddr va, std::size_t size) {
  std::lock_guard<std::mutex> lock(mu_);
  auto tiles = tiling("unmap", va, size);
  if (!multi_unmap_ && tiles.size() > 1) reject("unmap", "several mappings in one call (multi_unmap is off)");
  if (const int err = remap_reserved(va, size)) {
    throw DriverError("unmap", err, "host backend: remapping the reservation failed: " + errno_text(err));
  }
  for (auto& m : tiles) {
    auto h = handles_.find(m->second.handle);
    --h->second.mappings;
    drop_handle_if_unused(h);
    mappings_.erase(m);
  }
}

void HostBackend::do_set_access(VAddr va, std::size_t size) {
  std::lock_guard<std::mutex> lock(mu_);
  auto tiles = tiling("set_access", va, size);
  if (mprotect(as_ptr(va), size, PROT_READ | PROT_WRITE) != 0) {
    const int err = errno;
    throw DriverError("set_access", err, "host backend: mprotect failed: " + errno_text(err));
  }
  for (auto& m : tiles) m->second.accessible = true;
}

void HostBackend::do_fill_zero(VAddr va, std::size_t size) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& m : tiling("fill_zero", va, size)) {
      if (!m->second.accessible) reject("fill_zero", "range is not accessible");
    }
  }
  std::memset(as_ptr(va), 0, size);
}

MemInfo HostBackend::do_mem_info() {
  if (budget_ != 0) {
    std::lock_guard<std::mutex> lock(mu_);
    return {budget_ - resident_, budget_};
  }
  const auto page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  return {static_cast<std::size_t>(sysconf(_SC_AVPHYS_PAGES)) * page,
          static_cast<std::size_t>(sysconf(_SC_PHYS_PAGES)) * page};
}

void HostBackend::do_synchronize() {
  // Host memory is coherent; a fence orders this thread's earlier writes before whatever the caller does
  // next.
  std::atomic_thread_fence(std::memory_order_seq_cst);
}

}  // namespace elastic_kv

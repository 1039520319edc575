// HipBackend: the HIP virtual memory API (ROCm), loaded at run time -- the CudaBackend's twin.
//
// UNTESTED ON AMD HARDWARE: there is no ROCm device where this project runs. It compiles everywhere (no HIP
// headers: the few types and enum values are declared in hip_backend.cpp from the HIP ABI) and is unit-tested
// against a fake libamdhip64 built by the tests (tests/dataplane/fake_driver), which checks the call
// sequence, sizes and error mapping, not the hardware.
//
// Entry points come from dlsym (HIP exports every versioned symbol under its plain name). VMM support is
// detected by hipMemGetAllocationGranularity: hipErrorNotSupported means no VMM on this device/runtime.
// hipErrorOutOfMemory from hipMemCreate or hipMemMap becomes OutOfMemory. Device-bound calls (memset,
// synchronize, mem_info) run with the backend's device made current for the call and restored afterwards.
//
// Known ROCm behaviour (torch_memory_saver #83, vLLM #37533): ROCm 7.2 does not return memory on
// hipMemUnmap + hipMemRelease while the VA reservation is held; elastic shrinking may not free memory there.
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "elastic_kv/backend.hpp"
#include "elastic_kv/dynlib.hpp"

namespace elastic_kv {

class HipBackend final : public Backend {
 public:
  HipBackend(int device, const std::string& library, std::optional<bool> multi_unmap);
  ~HipBackend() override;

  std::string name() const override { return "hip"; }
  Device device() const noexcept override { return {DeviceType::kROCM, device_}; }
  std::size_t granularity() const noexcept override { return granularity_; }
  bool multi_unmap() const noexcept override { return multi_unmap_; }

  struct Api;

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
  class DeviceScope;
  void check(int result, const char* op, const char* what) const;
  std::string error_name(int result) const;

  SharedLibrary lib_;
  std::unique_ptr<Api> api_;
  int device_;
  std::size_t granularity_ = 0;
  bool multi_unmap_ = false;
};

}  // namespace elastic_kv

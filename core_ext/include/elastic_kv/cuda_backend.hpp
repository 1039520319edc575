// CudaBackend: the CUDA driver's virtual memory API, loaded at run time.
//
// Problem: linking libcuda (or the CUDA runtime) ties a build to a toolkit and makes the module unimportable
// on machines without a driver -- including the CPU machines where every test runs. So the backend dlopen()s
// "libcuda.so.1" and resolves each entry point with cuGetProcAddress, asking for the ABI of CUDA 12.0 (or of
// the driver, if older), so that versioned symbols (cuMemGetInfo_v2, cuCtxPushCurrent_v2, ...) resolve to the
// signatures declared in cuda_backend.cpp. No cuda.h is needed: the few types and enum values used are
// declared there by hand from the driver ABI.
//
// Errors: a missing library, entry point, device or VMM support is a ConfigurationError at construction.
// CUDA_ERROR_OUT_OF_MEMORY from cuMemCreate *or* cuMemMap becomes OutOfMemory; any other code becomes a
// DriverError naming the call and the CUDA error name. Nothing aborts.
//
// Context: each call runs with the device's primary context current (pushed only if another context is
// current on the calling thread, and popped afterwards), so calls work from any thread, including the
// pre-mapping worker, without disturbing torch's current context.
//
// Cost model (H200, driver 580, per 2 MiB handle): create 10-12 us, map 1 us, set_access 27-29 us, unmap
// 16-18 us, release 10 us; per handle, not per byte. multi_unmap: one cuMemUnmap over several adjacent whole
// mappings, probed once at construction (the documentation only promises that a mapping cannot be split);
// when the probe fails the data plane unmaps one mapping per call.
//
// The library is never unloaded (see dynlib.hpp); the primary context is released in the destructor.
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "elastic_kv/backend.hpp"
#include "elastic_kv/dynlib.hpp"

namespace elastic_kv {

class CudaBackend final : public Backend {
 public:
  // `multi_unmap`: nullopt = probe the driver; true/false = force.
  CudaBackend(int device, const std::string& library, std::optional<bool> multi_unmap);
  ~CudaBackend() override;

  std::string name() const override { return "cuda"; }
  Device device() const noexcept override { return {DeviceType::kCUDA, device_}; }
  std::size_t granularity() const noexcept override { return granularity_; }
  bool multi_unmap() const noexcept override { return multi_unmap_; }
  int driver_version() const noexcept { return driver_version_; }

  struct Api;  // resolved entry points (defined in cuda_backend.cpp)

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
  class ContextScope;
  // Throws OutOfMemory/DriverError for a failed call `what` of backend operation `op`.
  void check(int result, const char* op, const char* what) const;
  std::string error_name(int result) const;
  bool probe_multi_unmap() noexcept;

  SharedLibrary lib_;
  std::unique_ptr<Api> api_;
  int device_;
  int cu_device_ = 0;
  void* context_ = nullptr;
  std::size_t granularity_ = 0;
  bool multi_unmap_ = false;
  int driver_version_ = 0;
};

}  // namespace elastic_kv

// CudaBackend: the CUDA driver's virtual memory API, loaded at run time.
//
// Problem: linking libcuda (or the CUDA runtime) ties a build to a toolkit and makes the module unimportable
// on machines without a driver -- including the CPU machines where every test runs. So the backend dlopen()s
// "libcuda.so.1" and resolves each entry point with cuGetProcAddress, asking for the ABI of CUDA 12.0 (or of
// the driver, if older), so that versioned symbols (cuMemGetInfo_v2, cuCtxPushCurrent_v2, ...) resolve to the
// signatures declared in cuda_backend.cpp and src/driver_vmm.hpp. No cuda.h is needed: the few types and enum
// values used are declared there by hand from the driver ABI. The backend operations are DriverBackend's
// (driver_backend.hpp), shared with HipBackend; this class loads and sets up the driver.
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

#include <optional>
#include <string>

#include "elastic_kv/driver_backend.hpp"

namespace elastic_kv {

struct CudaDriver;  // the resolved entry points and the primary context (defined in cuda_backend.cpp)
extern template class DriverBackend<CudaDriver>;

class CudaBackend final : public DriverBackend<CudaDriver> {
 public:
  // `multi_unmap`: nullopt = probe the driver; true/false = force.
  CudaBackend(int device, const std::string& library, std::optional<bool> multi_unmap);
  ~CudaBackend() override;

  std::string name() const override { return "cuda"; }
  int driver_version() const noexcept { return driver_version_; }

 private:
  bool probe_multi_unmap() noexcept;

  int driver_version_ = 0;
};

}  // namespace elastic_kv

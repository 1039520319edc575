// HipBackend: the HIP virtual memory API (ROCm), loaded at run time -- the CudaBackend's twin.
//
// UNTESTED ON AMD HARDWARE: there is no ROCm device where this project runs. It compiles everywhere (no HIP
// headers: the few types and enum values are declared in hip_backend.cpp and src/driver_vmm.hpp from the HIP
// ABI) and is unit-tested against a fake libamdhip64 built by the tests (tests/dataplane/fake_driver), which
// checks the call sequence, sizes and error mapping, not the hardware. The backend operations are
// DriverBackend's (driver_backend.hpp), the same code that drives CUDA; this class loads and sets up HIP.
//
// Entry points come from dlsym (HIP exports every versioned symbol under its plain name). VMM support is
// detected by hipMemGetAllocationGranularity: hipErrorNotSupported means no VMM on this device/runtime.
// hipErrorOutOfMemory from hipMemCreate or hipMemMap becomes OutOfMemory. Device-bound calls (memset,
// synchronize, mem_info) run with the backend's device made current for the call and restored afterwards.
//
// Known ROCm behaviour (torch_memory_saver #83, vLLM #37533): ROCm 7.2 does not return memory on
// hipMemUnmap + hipMemRelease while the VA reservation is held; elastic shrinking may not free memory there.
#pragma once

#include <optional>
#include <string>

#include "elastic_kv/driver_backend.hpp"

namespace elastic_kv {

struct HipDriver;  // the resolved entry points (defined in hip_backend.cpp)
extern template class DriverBackend<HipDriver>;

class HipBackend final : public DriverBackend<HipDriver> {
 public:
  HipBackend(int device, const std::string& library, std::optional<bool> multi_unmap);
  ~HipBackend() override;

  std::string name() const override { return "hip"; }
};

}  // namespace elastic_kv

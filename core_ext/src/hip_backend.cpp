#include "elastic_kv/hip_backend.hpp"

#include <string>

#include "driver_vmm.hpp"

namespace elastic_kv {

namespace {

// The HIP ABI this backend uses beyond driver_vmm.hpp (hip_runtime_api.h, ROCm 5.x-7.x).
using hipError_t = int;
using hipMemGenericAllocationHandle_t = void*;

constexpr hipError_t hipErrorNotSupported = 801;

}  // namespace

struct HipDriver : vmm::VmmEntryPoints<void*, hipMemGenericAllocationHandle_t> {
  vmm::EntryPoint<hipError_t(unsigned)> hipInit;
  vmm::EntryPoint<hipError_t(int*)> hipGetDeviceCount;
  vmm::EntryPoint<hipError_t(int*)> hipGetDevice;
  vmm::EntryPoint<hipError_t(int)> hipSetDevice;
  vmm::EntryPoint<const char*(hipError_t)> hipGetErrorName;

  int device = 0;  // the backend's device

  class Scope;
  std::string error_name(int result) const;
};

// For calls that run work on the device, makes the backend's device current for the scope and restores the
// caller's device afterwards. The VMM table calls need no current device (they name it, or need none).
class HipDriver::Scope {
 public:
  Scope(const HipDriver& driver, const char* op, vmm::Calls calls) : driver_(driver) {
    if (calls != vmm::Calls::kDeviceWork) return;
    vmm::call(driver_, op, driver_.hipGetDevice, &previous_);
    if (previous_ != driver_.device) {
      vmm::call(driver_, op, driver_.hipSetDevice, driver_.device);
      switched_ = true;
    }
  }
  ~Scope() {
    if (switched_) driver_.hipSetDevice(previous_);
  }
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  const HipDriver& driver_;
  int previous_ = 0;
  bool switched_ = false;
};

std::string HipDriver::error_name(int result) const {
  const char* name = hipGetErrorName.fn != nullptr ? hipGetErrorName(result) : nullptr;
  return std::string(name != nullptr ? name : "hipError") + " (" + std::to_string(result) + ")";
}

template class DriverBackend<HipDriver>;

HipBackend::HipBackend(int device, const std::string& library, std::optional<bool> multi_unmap)
    : DriverBackend(DeviceType::kROCM, device, library) {
  HipDriver& d = *driver_;
  auto resolve = [&](auto& entry, const std::string& symbol) {
    entry.name = symbol;
    entry.fn = reinterpret_cast<decltype(entry.fn)>(lib_.require(symbol.c_str()));
  };
  resolve(d.hipInit, "hipInit");
  resolve(d.hipGetDeviceCount, "hipGetDeviceCount");
  resolve(d.hipGetDevice, "hipGetDevice");
  resolve(d.hipSetDevice, "hipSetDevice");
  d.resolve_vmm("hip", "hipDeviceSynchronize", resolve);
  resolve(d.hipGetErrorName, "hipGetErrorName");

  require(d.hipInit(0), "hipInit (is there a usable AMD GPU?)");
  int count = 0;
  require(d.hipGetDeviceCount(&count), "hipGetDeviceCount");
  if (device >= count) {
    throw ConfigurationError("HIP device " + std::to_string(device) + " does not exist (" +
                             std::to_string(count) + " devices)");
  }
  d.device = device;
  d.allocate_on(device);
  const hipError_t r = d.mem_get_allocation_granularity(&granularity_, &d.prop, vmm::kGranularityMinimum);
  if (r == hipErrorNotSupported) {
    throw ConfigurationError("HIP device " + std::to_string(device) +
                             " does not support virtual memory management");
  }
  require(r, "hipMemGetAllocationGranularity");
  if (granularity_ == 0) throw ConfigurationError("the HIP runtime reports a granularity of 0");
  // Unlike CUDA, multi-mapping unmap is not probed on HIP (no hardware to validate the probe): off by
  // default.
  multi_unmap_ = multi_unmap.value_or(false);
}

HipBackend::~HipBackend() = default;

}  // namespace elastic_kv

#include "elastic_kv/cuda_backend.hpp"

#include <algorithm>
#include <string>

#include "driver_vmm.hpp"

namespace elastic_kv {

namespace {

// The CUDA driver ABI this backend uses beyond driver_vmm.hpp (layouts and values from the driver API).
using CUresult = int;
using CUdevice = int;
using CUcontext = void*;
using CUdeviceptr = unsigned long long;
using CUmemGenericAllocationHandle = unsigned long long;

constexpr int CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102;
constexpr int kAbiVersion = 12000;  // request the CUDA 12.0 ABI of every entry point

using GetProcAddressV2 = CUresult (*)(const char*, void**, int, unsigned long long, int*);
using GetProcAddressV1 = CUresult (*)(const char*, void**, int, unsigned long long);

}  // namespace

struct CudaDriver : vmm::VmmEntryPoints<CUdeviceptr, CUmemGenericAllocationHandle> {
  vmm::EntryPoint<CUresult(unsigned)> cuInit;
  vmm::EntryPoint<CUresult(CUdevice*, int)> cuDeviceGet;
  vmm::EntryPoint<CUresult(int*, int, CUdevice)> cuDeviceGetAttribute;
  vmm::EntryPoint<CUresult(CUcontext*, CUdevice)> cuDevicePrimaryCtxRetain;
  vmm::EntryPoint<CUresult(CUdevice)> cuDevicePrimaryCtxRelease;
  vmm::EntryPoint<CUresult(CUcontext*)> cuCtxGetCurrent;
  vmm::EntryPoint<CUresult(CUcontext)> cuCtxPushCurrent;
  vmm::EntryPoint<CUresult(CUcontext*)> cuCtxPopCurrent;
  vmm::EntryPoint<CUresult(CUresult, const char**)> cuGetErrorName;

  CUdevice cu_device = 0;
  CUcontext context = nullptr;  // the device's primary context, once retained

  class Scope;
  std::string error_name(int result) const;
};

// Makes the device's primary context current for the scope if another (or no) context is current. Every
// CUDA call needs it, whatever it does.
class CudaDriver::Scope {
 public:
  Scope(const CudaDriver& driver, const char* op, vmm::Calls /*calls*/) : driver_(driver) {
    CUcontext current = nullptr;
    vmm::call(driver_, op, driver_.cuCtxGetCurrent, &current);
    if (current != driver_.context) {
      vmm::call(driver_, op, driver_.cuCtxPushCurrent, driver_.context);
      pushed_ = true;
    }
  }
  ~Scope() {
    if (pushed_) {
      CUcontext popped = nullptr;
      driver_.cuCtxPopCurrent(&popped);
    }
  }
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  const CudaDriver& driver_;
  bool pushed_ = false;
};

std::string CudaDriver::error_name(int result) const {
  const char* name = nullptr;
  if (cuGetErrorName.fn != nullptr && cuGetErrorName(result, &name) == vmm::kSuccess && name != nullptr) {
    return std::string(name) + " (" + std::to_string(result) + ")";
  }
  return "CUDA error " + std::to_string(result);
}

template class DriverBackend<CudaDriver>;

CudaBackend::CudaBackend(int device, const std::string& library, std::optional<bool> multi_unmap)
    : DriverBackend(DeviceType::kCUDA, device, library) {
  auto version_fn = reinterpret_cast<CUresult (*)(int*)>(lib_.require("cuDriverGetVersion"));
  if (version_fn(&driver_version_) != vmm::kSuccess) throw ConfigurationError("cuDriverGetVersion failed");
  const int abi = std::min(driver_version_, kAbiVersion);

  auto v2 = reinterpret_cast<GetProcAddressV2>(lib_.find("cuGetProcAddress_v2"));
  auto v1 = reinterpret_cast<GetProcAddressV1>(lib_.find("cuGetProcAddress"));
  if (v2 == nullptr && v1 == nullptr) {
    throw ConfigurationError(library + " has no cuGetProcAddress: the CUDA driver is older than 11.3");
  }
  auto resolve = [&](auto& entry, const std::string& symbol) {
    void* p = nullptr;
    int status = 0;
    const CUresult r =
        v2 != nullptr ? v2(symbol.c_str(), &p, abi, 0, &status) : v1(symbol.c_str(), &p, abi, 0);
    if (r != vmm::kSuccess || p == nullptr) {
      throw ConfigurationError("the CUDA driver " + std::to_string(driver_version_) + " does not provide " +
                               symbol);
    }
    entry.name = symbol;
    entry.fn = reinterpret_cast<decltype(entry.fn)>(p);
  };
  CudaDriver& d = *driver_;
  resolve(d.cuInit, "cuInit");
  resolve(d.cuDeviceGet, "cuDeviceGet");
  resolve(d.cuDeviceGetAttribute, "cuDeviceGetAttribute");
  resolve(d.cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
  resolve(d.cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease");
  resolve(d.cuCtxGetCurrent, "cuCtxGetCurrent");
  resolve(d.cuCtxPushCurrent, "cuCtxPushCurrent");
  resolve(d.cuCtxPopCurrent, "cuCtxPopCurrent");
  d.resolve_vmm("cu", "cuCtxSynchronize", resolve);
  resolve(d.cuGetErrorName, "cuGetErrorName");

  require(d.cuInit(0), "cuInit (is there a usable NVIDIA GPU?)");
  require(d.cuDeviceGet(&d.cu_device, device), "cuDeviceGet(" + std::to_string(device) + ")");
  int supported = 0;
  require(d.cuDeviceGetAttribute(&supported, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                                 d.cu_device),
          "cuDeviceGetAttribute(VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)");
  if (supported == 0) {
    throw ConfigurationError("CUDA device " + std::to_string(device) +
                             " does not support virtual memory management (cuMemCreate/cuMemMap)");
  }
  d.allocate_on(d.cu_device);
  require(d.mem_get_allocation_granularity(&granularity_, &d.prop, vmm::kGranularityMinimum),
          "cuMemGetAllocationGranularity");
  if (granularity_ == 0) throw ConfigurationError("the CUDA driver reports a granularity of 0");
  require(d.cuDevicePrimaryCtxRetain(&d.context, d.cu_device), "cuDevicePrimaryCtxRetain");
  multi_unmap_ = multi_unmap.has_value() ? *multi_unmap : probe_multi_unmap();
}

CudaBackend::~CudaBackend() {
  if (driver_->context != nullptr)
    driver_->cuDevicePrimaryCtxRelease(driver_->cu_device);  // may be DEINITIALIZED at exit: ignore
}

bool CudaBackend::probe_multi_unmap() noexcept {
  // Two adjacent mappings, one cuMemUnmap over both; then prove both ranges are free by mapping them again
  // crosswise. Raw driver calls: the probe must not show up in the counters.
  try {
    const CudaDriver& a = *driver_;
    const CudaDriver::Scope scope(a, "probe", vmm::Calls::kTables);
    const std::size_t g = granularity_;
    CUdeviceptr va = 0;
    if (a.mem_address_reserve(&va, 2 * g, g, 0, 0) != vmm::kSuccess) return false;
    CUmemGenericAllocationHandle h[2] = {0, 0};
    bool ok = a.mem_create(&h[0], g, &a.prop, 0) == vmm::kSuccess &&
              a.mem_create(&h[1], g, &a.prop, 0) == vmm::kSuccess;
    bool mapped[2] = {false, false};
    if (ok) {
      mapped[0] = a.mem_map(va, g, 0, h[0], 0) == vmm::kSuccess;
      mapped[1] = a.mem_map(va + g, g, 0, h[1], 0) == vmm::kSuccess;
      ok = mapped[0] && mapped[1] && a.mem_unmap(va, 2 * g) == vmm::kSuccess;
      if (ok) {
        mapped[1] = a.mem_map(va + g, g, 0, h[0], 0) == vmm::kSuccess;
        mapped[0] = a.mem_map(va, g, 0, h[1], 0) == vmm::kSuccess;
        ok = mapped[0] && mapped[1];
      }
    }
    for (int i = 0; i < 2; ++i) {
      if (mapped[i]) a.mem_unmap(va + i * g, g);
    }
    for (auto handle : h) {
      if (handle != 0) a.mem_release(handle);
    }
    a.mem_address_free(va, 2 * g);
    return ok;
  } catch (...) {
    return false;
  }
}

}  // namespace elastic_kv

#include "elastic_kv/cuda_backend.hpp"

#include <algorithm>
#include <string>
#include <type_traits>

namespace elastic_kv {

namespace {

// The subset of the CUDA driver ABI this backend uses (layouts and values from the driver API, CUDA 11.2+).
using CUresult = int;
using CUdevice = int;
using CUcontext = void*;
using CUdeviceptr = unsigned long long;
using CUmemGenericAllocationHandle = unsigned long long;

struct CUmemLocation {
  int type;
  int id;
};
struct CUmemAllocationProp {
  int type;
  int requestedHandleTypes;
  CUmemLocation location;
  void* win32HandleMetaData;
  struct {
    unsigned char compressionType;
    unsigned char gpuDirectRDMACapable;
    unsigned short usage;
    unsigned char reserved[4];
  } allocFlags;
};
struct CUmemAccessDesc {
  CUmemLocation location;
  int flags;
};

constexpr CUresult CUDA_SUCCESS = 0;
constexpr CUresult CUDA_ERROR_OUT_OF_MEMORY = 2;
constexpr int CU_MEM_ALLOCATION_TYPE_PINNED = 1;
constexpr int CU_MEM_LOCATION_TYPE_DEVICE = 1;
constexpr int CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3;
constexpr int CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0;
constexpr int CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102;
constexpr int kAbiVersion = 12000;  // request the CUDA 12.0 ABI of every entry point

using GetProcAddressV2 = CUresult (*)(const char*, void**, int, unsigned long long, int*);
using GetProcAddressV1 = CUresult (*)(const char*, void**, int, unsigned long long);

}  // namespace

struct CudaBackend::Api {
  CUresult (*cuInit)(unsigned) = nullptr;
  CUresult (*cuDeviceGet)(CUdevice*, int) = nullptr;
  CUresult (*cuDeviceGetAttribute)(int*, int, CUdevice) = nullptr;
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice) = nullptr;
  CUresult (*cuDevicePrimaryCtxRelease)(CUdevice) = nullptr;
  CUresult (*cuCtxGetCurrent)(CUcontext*) = nullptr;
  CUresult (*cuCtxPushCurrent)(CUcontext) = nullptr;
  CUresult (*cuCtxPopCurrent)(CUcontext*) = nullptr;
  CUresult (*cuCtxSynchronize)() = nullptr;
  CUresult (*cuMemGetInfo)(std::size_t*, std::size_t*) = nullptr;
  CUresult (*cuMemGetAllocationGranularity)(std::size_t*, const CUmemAllocationProp*, int) = nullptr;
  CUresult (*cuMemAddressReserve)(CUdeviceptr*, std::size_t, std::size_t, CUdeviceptr,
                                  unsigned long long) = nullptr;
  CUresult (*cuMemAddressFree)(CUdeviceptr, std::size_t) = nullptr;
  CUresult (*cuMemCreate)(CUmemGenericAllocationHandle*, std::size_t, const CUmemAllocationProp*,
                          unsigned long long) = nullptr;
  CUresult (*cuMemRelease)(CUmemGenericAllocationHandle) = nullptr;
  CUresult (*cuMemMap)(CUdeviceptr, std::size_t, std::size_t, CUmemGenericAllocationHandle,
                       unsigned long long) = nullptr;
  CUresult (*cuMemUnmap)(CUdeviceptr, std::size_t) = nullptr;
  CUresult (*cuMemSetAccess)(CUdeviceptr, std::size_t, const CUmemAccessDesc*, std::size_t) = nullptr;
  CUresult (*cuMemsetD8)(CUdeviceptr, unsigned char, std::size_t) = nullptr;
  CUresult (*cuGetErrorName)(CUresult, const char**) = nullptr;

  CUmemAllocationProp prop{};
  CUmemAccessDesc access{};
};

// Makes the device's primary context current for the scope if another (or no) context is current.
class CudaBackend::ContextScope {
 public:
  ContextScope(const CudaBackend& backend, const char* op) : api_(*backend.api_) {
    CUcontext current = nullptr;
    backend.check(api_.cuCtxGetCurrent(&current), op, "cuCtxGetCurrent");
    if (current != backend.context_) {
      backend.check(api_.cuCtxPushCurrent(backend.context_), op, "cuCtxPushCurrent");
      pushed_ = true;
    }
  }
  ~ContextScope() {
    if (pushed_) {
      CUcontext popped = nullptr;
      api_.cuCtxPopCurrent(&popped);
    }
  }
  ContextScope(const ContextScope&) = delete;
  ContextScope& operator=(const ContextScope&) = delete;

 private:
  const Api& api_;
  bool pushed_ = false;
};

CudaBackend::CudaBackend(int device, const std::string& library, std::optional<bool> multi_unmap)
    : lib_(library), api_(std::make_unique<Api>()), device_(device) {
  if (device < 0) throw InvalidArgument("device must be non-negative");
  auto version_fn = reinterpret_cast<CUresult (*)(int*)>(lib_.require("cuDriverGetVersion"));
  if (version_fn(&driver_version_) != CUDA_SUCCESS) throw ConfigurationError("cuDriverGetVersion failed");
  const int abi = std::min(driver_version_, kAbiVersion);

  auto v2 = reinterpret_cast<GetProcAddressV2>(lib_.find("cuGetProcAddress_v2"));
  auto v1 = reinterpret_cast<GetProcAddressV1>(lib_.find("cuGetProcAddress"));
  if (v2 == nullptr && v1 == nullptr) {
    throw ConfigurationError(library + " has no cuGetProcAddress: the CUDA driver is older than 11.3");
  }
  auto resolve = [&](const char* symbol, auto& fn) {
    void* p = nullptr;
    int status = 0;
    const CUresult r = v2 != nullptr ? v2(symbol, &p, abi, 0, &status) : v1(symbol, &p, abi, 0);
    if (r != CUDA_SUCCESS || p == nullptr) {
      throw ConfigurationError("the CUDA driver " + std::to_string(driver_version_) + " does not provide " +
                               symbol);
    }
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(p);
  };
  Api& a = *api_;
  resolve("cuInit", a.cuInit);
  resolve("cuDeviceGet", a.cuDeviceGet);
  resolve("cuDeviceGetAttribute", a.cuDeviceGetAttribute);
  resolve("cuDevicePrimaryCtxRetain", a.cuDevicePrimaryCtxRetain);
  resolve("cuDevicePrimaryCtxRelease", a.cuDevicePrimaryCtxRelease);
  resolve("cuCtxGetCurrent", a.cuCtxGetCurrent);
  resolve("cuCtxPushCurrent", a.cuCtxPushCurrent);
  resolve("cuCtxPopCurrent", a.cuCtxPopCurrent);
  resolve("cuCtxSynchronize", a.cuCtxSynchronize);
  resolve("cuMemGetInfo", a.cuMemGetInfo);
  resolve("cuMemGetAllocationGranularity", a.cuMemGetAllocationGranularity);
  resolve("cuMemAddressReserve", a.cuMemAddressReserve);
  resolve("cuMemAddressFree", a.cuMemAddressFree);
  resolve("cuMemCreate", a.cuMemCreate);
  resolve("cuMemRelease", a.cuMemRelease);
  resolve("cuMemMap", a.cuMemMap);
  resolve("cuMemUnmap", a.cuMemUnmap);
  resolve("cuMemSetAccess", a.cuMemSetAccess);
  resolve("cuMemsetD8", a.cuMemsetD8);
  resolve("cuGetErrorName", a.cuGetErrorName);

  auto config_check = [&](CUresult r, const std::string& what) {
    if (r != CUDA_SUCCESS) throw ConfigurationError(what + " failed: " + error_name(r));
  };
  config_check(a.cuInit(0), "cuInit (is there a usable NVIDIA GPU?)");
  config_check(a.cuDeviceGet(&cu_device_, device), "cuDeviceGet(" + std::to_string(device) + ")");
  int vmm = 0;
  config_check(
      a.cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, cu_device_),
      "cuDeviceGetAttribute(VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)");
  if (vmm == 0) {
    throw ConfigurationError("CUDA device " + std::to_string(device) +
                             " does not support virtual memory management (cuMemCreate/cuMemMap)");
  }
  a.prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  a.prop.location = {CU_MEM_LOCATION_TYPE_DEVICE, cu_device_};
  a.access.location = a.prop.location;
  a.access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  config_check(a.cuMemGetAllocationGranularity(&granularity_, &a.prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
               "cuMemGetAllocationGranularity");
  if (granularity_ == 0) throw ConfigurationError("the CUDA driver reports a granularity of 0");
  config_check(a.cuDevicePrimaryCtxRetain(&context_, cu_device_), "cuDevicePrimaryCtxRetain");
  multi_unmap_ = multi_unmap.has_value() ? *multi_unmap : probe_multi_unmap();
}

CudaBackend::~CudaBackend() {
  if (context_ != nullptr)
    api_->cuDevicePrimaryCtxRelease(cu_device_);  // may be DEINITIALIZED at exit: ignore
}

std::string CudaBackend::error_name(int result) const {
  const char* name = nullptr;
  if (api_->cuGetErrorName != nullptr && api_->cuGetErrorName(result, &name) == CUDA_SUCCESS &&
      name != nullptr) {
    return std::string(name) + " (" + std::to_string(result) + ")";
  }
  return "CUDA error " + std::to_string(result);
}

void CudaBackend::check(int result, const char* op, const char* what) const {
  if (result == CUDA_SUCCESS) return;
  const std::string msg = std::string(what) + " failed: " + error_name(result);
  if (result == CUDA_ERROR_OUT_OF_MEMORY) throw OutOfMemory(op, result, msg);
  throw DriverError(op, result, msg);
}

bool CudaBackend::probe_multi_unmap() noexcept {
  // Two adjacent mappings, one cuMemUnmap over both; then prove both ranges are free by mapping them again
  // crosswise. Raw driver calls: the probe must not show up in the counters.
  try {
    ContextScope scope(*this, "probe");
    const Api& a = *api_;
    const std::size_t g = granularity_;
    CUdeviceptr va = 0;
    if (a.cuMemAddressReserve(&va, 2 * g, g, 0, 0) != CUDA_SUCCESS) return false;
    CUmemGenericAllocationHandle h[2] = {0, 0};
    bool ok = a.cuMemCreate(&h[0], g, &a.prop, 0) == CUDA_SUCCESS &&
              a.cuMemCreate(&h[1], g, &a.prop, 0) == CUDA_SUCCESS;
    bool mapped[2] = {false, false};
    if (ok) {
      mapped[0] = a.cuMemMap(va, g, 0, h[0], 0) == CUDA_SUCCESS;
      mapped[1] = a.cuMemMap(va + g, g, 0, h[1], 0) == CUDA_SUCCESS;
      ok = mapped[0] && mapped[1] && a.cuMemUnmap(va, 2 * g) == CUDA_SUCCESS;
      if (ok) {
        mapped[1] = a.cuMemMap(va + g, g, 0, h[0], 0) == CUDA_SUCCESS;
        mapped[0] = a.cuMemMap(va, g, 0, h[1], 0) == CUDA_SUCCESS;
        ok = mapped[0] && mapped[1];
      }
    }
    for (int i = 0; i < 2; ++i) {
      if (mapped[i]) a.cuMemUnmap(va + i * g, g);
    }
    for (auto handle : h) {
      if (handle != 0) a.cuMemRelease(handle);
    }
    a.cuMemAddressFree(va, 2 * g);
    return ok;
  } catch (...) {
    return false;
  }
}

VAddr CudaBackend::do_reserve(std::size_t size, std::size_t alignment) {
  ContextScope scope(*this, "reserve");
  CUdeviceptr va = 0;
  check(api_->cuMemAddressReserve(&va, size, alignment, 0, 0), "reserve", "cuMemAddressReserve");
  return va;
}

void CudaBackend::do_free_va(VAddr va, std::size_t size) {
  ContextScope scope(*this, "free_va");
  check(api_->cuMemAddressFree(va, size), "free_va", "cuMemAddressFree");
}

HandleId CudaBackend::do_create(std::size_t size) {
  ContextScope scope(*this, "create");
  CUmemGenericAllocationHandle h = 0;
  check(api_->cuMemCreate(&h, size, &api_->prop, 0), "create", "cuMemCreate");
  return h;
}

void CudaBackend::do_release(HandleId handle, std::size_t /*size*/) {
  ContextScope scope(*this, "release");
  check(api_->cuMemRelease(handle), "release", "cuMemRelease");
}

void CudaBackend::do_map(VAddr va, std::size_t size, HandleId handle) {
  ContextScope scope(*this, "map");
  check(api_->cuMemMap(va, size, 0, handle, 0), "map", "cuMemMap");
}

void CudaBackend::do_unmap(VAddr va, std::size_t size) {
  ContextScope scope(*this, "unmap");
  check(api_->cuMemUnmap(va, size), "unmap", "cuMemUnmap");
}

void CudaBackend::do_set_access(VAddr va, std::size_t size) {
  ContextScope scope(*this, "set_access");
  check(api_->cuMemSetAccess(va, size, &api_->access, 1), "set_access", "cuMemSetAccess");
}

void CudaBackend::do_fill_zero(VAddr va, std::size_t size) {
  ContextScope scope(*this, "fill_zero");
  check(api_->cuMemsetD8(va, 0, size), "fill_zero", "cuMemsetD8");
  check(api_->cuCtxSynchronize(), "fill_zero", "cuCtxSynchronize");
}

MemInfo CudaBackend::do_mem_info() {
  ContextScope scope(*this, "mem_info");
  std::size_t free = 0;
  std::size_t total = 0;
  check(api_->cuMemGetInfo(&free, &total), "mem_info", "cuMemGetInfo");
  return {free, total};
}

void CudaBackend::do_synchronize() {
  ContextScope scope(*this, "synchronize");
  check(api_->cuCtxSynchronize(), "synchronize", "cuCtxSynchronize");
}

}  // namespace elastic_kv

#include "elastic_kv/hip_backend.hpp"

#include <string>
#include <type_traits>

namespace elastic_kv {

namespace {

// The subset of the HIP ABI this backend uses (hip_runtime_api.h, ROCm 5.x-7.x).
using hipError_t = int;
using hipMemGenericAllocationHandle_t = void*;

struct hipMemLocation {
  int type;
  int id;
};
struct hipMemAllocationProp {
  int type;
  int requestedHandleType;
  hipMemLocation location;
  void* win32HandleMetaData;
  struct {
    unsigned char compressionType;
    unsigned char gpuDirectRDMACapable;
    unsigned short usage;
    unsigned char reserved[4];  // padding beyond HIP's struct: zero, never read by the runtime
  } allocFlags;
};
struct hipMemAccessDesc {
  hipMemLocation location;
  int flags;
};

constexpr hipError_t hipSuccess = 0;
constexpr hipError_t hipErrorOutOfMemory = 2;
constexpr hipError_t hipErrorNotSupported = 801;
constexpr int hipMemAllocationTypePinned = 1;
constexpr int hipMemLocationTypeDevice = 1;
constexpr int hipMemAccessFlagsProtReadWrite = 3;
constexpr int hipMemAllocationGranularityMinimum = 0;

void* as_ptr(VAddr va) { return reinterpret_cast<void*>(static_cast<std::uintptr_t>(va)); }

}  // namespace

struct HipBackend::Api {
  hipError_t (*hipInit)(unsigned) = nullptr;
  hipError_t (*hipGetDeviceCount)(int*) = nullptr;
  hipError_t (*hipGetDevice)(int*) = nullptr;
  hipError_t (*hipSetDevice)(int) = nullptr;
  hipError_t (*hipDeviceSynchronize)() = nullptr;
  hipError_t (*hipMemGetInfo)(std::size_t*, std::size_t*) = nullptr;
  hipError_t (*hipMemGetAllocationGranularity)(std::size_t*, const hipMemAllocationProp*, int) = nullptr;
  hipError_t (*hipMemAddressReserve)(void**, std::size_t, std::size_t, void*, unsigned long long) = nullptr;
  hipError_t (*hipMemAddressFree)(void*, std::size_t) = nullptr;
  hipError_t (*hipMemCreate)(hipMemGenericAllocationHandle_t*, std::size_t, const hipMemAllocationProp*,
                             unsigned long long) = nullptr;
  hipError_t (*hipMemRelease)(hipMemGenericAllocationHandle_t) = nullptr;
  hipError_t (*hipMemMap)(void*, std::size_t, std::size_t, hipMemGenericAllocationHandle_t,
                          unsigned long long) = nullptr;
  hipError_t (*hipMemUnmap)(void*, std::size_t) = nullptr;
  hipError_t (*hipMemSetAccess)(void*, std::size_t, const hipMemAccessDesc*, std::size_t) = nullptr;
  hipError_t (*hipMemsetD8)(void*, unsigned char, std::size_t) = nullptr;
  const char* (*hipGetErrorName)(hipError_t) = nullptr;

  hipMemAllocationProp prop{};
  hipMemAccessDesc access{};
};

// Makes the backend's device current for the scope and restores the caller's device afterwards.
class HipBackend::DeviceScope {
 public:
  DeviceScope(const HipBackend& backend, const char* op) : api_(*backend.api_) {
    backend.check(api_.hipGetDevice(&previous_), op, "hipGetDevice");
    if (previous_ != backend.device_) {
      backend.check(api_.hipSetDevice(backend.device_), op, "hipSetDevice");
      switched_ = true;
    }
  }
  ~DeviceScope() {
    if (switched_) api_.hipSetDevice(previous_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  const Api& api_;
  int previous_ = 0;
  bool switched_ = false;
};

HipBackend::HipBackend(int device, const std::string& library, std::optional<bool> multi_unmap)
    : lib_(library), api_(std::make_unique<Api>()), device_(device) {
  if (device < 0) throw InvalidArgument("device must be non-negative");
  Api& a = *api_;
  auto resolve = [&](const char* symbol, auto& fn) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(lib_.require(symbol));
  };
  resolve("hipInit", a.hipInit);
  resolve("hipGetDeviceCount", a.hipGetDeviceCount);
  resolve("hipGetDevice", a.hipGetDevice);
  resolve("hipSetDevice", a.hipSetDevice);
  resolve("hipDeviceSynchronize", a.hipDeviceSynchronize);
  resolve("hipMemGetInfo", a.hipMemGetInfo);
  resolve("hipMemGetAllocationGranularity", a.hipMemGetAllocationGranularity);
  resolve("hipMemAddressReserve", a.hipMemAddressReserve);
  resolve("hipMemAddressFree", a.hipMemAddressFree);
  resolve("hipMemCreate", a.hipMemCreate);
  resolve("hipMemRelease", a.hipMemRelease);
  resolve("hipMemMap", a.hipMemMap);
  resolve("hipMemUnmap", a.hipMemUnmap);
  resolve("hipMemSetAccess", a.hipMemSetAccess);
  resolve("hipMemsetD8", a.hipMemsetD8);
  resolve("hipGetErrorName", a.hipGetErrorName);

  auto config_check = [&](hipError_t r, const std::string& what) {
    if (r != hipSuccess) throw ConfigurationError(what + " failed: " + error_name(r));
  };
  config_check(a.hipInit(0), "hipInit (is there a usable AMD GPU?)");
  int count = 0;
  config_check(a.hipGetDeviceCount(&count), "hipGetDeviceCount");
  if (device >= count) {
    throw ConfigurationError("HIP device " + std::to_string(device) + " does not exist (" +
                             std::to_string(count) + " devices)");
  }
  a.prop.type = hipMemAllocationTypePinned;
  a.prop.location = {hipMemLocationTypeDevice, device};
  a.access.location = a.prop.location;
  a.access.flags = hipMemAccessFlagsProtReadWrite;
  const hipError_t r =
      a.hipMemGetAllocationGranularity(&granularity_, &a.prop, hipMemAllocationGranularityMinimum);
  if (r == hipErrorNotSupported) {
    throw ConfigurationError("HIP device " + std::to_string(device) +
                             " does not support virtual memory management");
  }
  config_check(r, "hipMemGetAllocationGranularity");
  if (granularity_ == 0) throw ConfigurationError("the HIP runtime reports a granularity of 0");
  // Unlike CUDA, multi-mapping unmap is not probed on HIP (no hardware to validate the probe): off by
  // default.
  multi_unmap_ = multi_unmap.value_or(false);
}

HipBackend::~HipBackend() = default;

std::string HipBackend::error_name(int result) const {
  const char* name = api_->hipGetErrorName != nullptr ? api_->hipGetErrorName(result) : nullptr;
  return std::string(name != nullptr ? name : "hipError") + " (" + std::to_string(result) + ")";
}

void HipBackend::check(int result, const char* op, const char* what) const {
  if (result == hipSuccess) return;
  const std::string msg = std::string(what) + " failed: " + error_name(result);
  if (result == hipErrorOutOfMemory) throw OutOfMemory(op, result, msg);
  throw DriverError(op, result, msg);
}

VAddr HipBackend::do_reserve(std::size_t size, std::size_t alignment) {
  void* p = nullptr;
  check(api_->hipMemAddressReserve(&p, size, alignment, nullptr, 0), "reserve", "hipMemAddressReserve");
  return reinterpret_cast<std::uintptr_t>(p);
}

void HipBackend::do_free_va(VAddr va, std::size_t size) {
  check(api_->hipMemAddressFree(as_ptr(va), size), "free_va", "hipMemAddressFree");
}

HandleId HipBackend::do_create(std::size_t size) {
  hipMemGenericAllocationHandle_t h = nullptr;
  check(api_->hipMemCreate(&h, size, &api_->prop, 0), "create", "hipMemCreate");
  return reinterpret_cast<std::uintptr_t>(h);
}

void HipBackend::do_release(HandleId handle, std::size_t /*size*/) {
  check(api_->hipMemRelease(
            reinterpret_cast<hipMemGenericAllocationHandle_t>(static_cast<std::uintptr_t>(handle))),
        "release", "hipMemRelease");
}

void HipBackend::do_map(VAddr va, std::size_t size, HandleId handle) {
  check(api_->hipMemMap(
            as_ptr(va), size, 0,
            reinterpret_cast<hipMemGenericAllocationHandle_t>(static_cast<std::uintptr_t>(handle)), 0),
        "map", "hipMemMap");
}

void HipBackend::do_unmap(VAddr va, std::size_t size) {
  check(api_->hipMemUnmap(as_ptr(va), size), "unmap", "hipMemUnmap");
}

void HipBackend::do_set_access(VAddr va, std::size_t size) {
  check(api_->hipMemSetAccess(as_ptr(va), size, &api_->access, 1), "set_access", "hipMemSetAccess");
}

void HipBackend::do_fill_zero(VAddr va, std::size_t size) {
  DeviceScope scope(*this, "fill_zero");
  check(api_->hipMemsetD8(as_ptr(va), 0, size), "fill_zero", "hipMemsetD8");
  check(api_->hipDeviceSynchronize(), "fill_zero", "hipDeviceSynchronize");
}

MemInfo HipBackend::do_mem_info() {
  DeviceScope scope(*this, "mem_info");
  std::size_t free = 0;
  std::size_t total = 0;
  check(api_->hipMemGetInfo(&free, &total), "mem_info", "hipMemGetInfo");
  return {free, total};
}

void HipBackend::do_synchronize() {
  DeviceScope scope(*this, "synchronize");
  check(api_->hipDeviceSynchronize(), "synchronize", "hipDeviceSynchronize");
}

}  // namespace elastic_kv

// The virtual memory API that the CUDA driver and HIP share, and DriverBackend's operations over it.
//
// Private to cuda_backend.cpp and hip_backend.cpp (see driver_backend.hpp for the design). The types and
// values below are the subset of the driver ABI the backends use, declared by hand so that no cuda.h or
// hip_runtime_api.h is needed: CUDA's cuda.h (11.2+) and HIP's hip_runtime_api.h (ROCm 5.x-7.x) declare them
// alike under their own names.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>

#include "elastic_kv/driver_backend.hpp"

namespace elastic_kv {

namespace vmm {

struct MemLocation {
  int type;
  int id;
};
struct MemAllocationProp {
  int type;
  int requestedHandleTypes;
  MemLocation location;
  void* win32HandleMetaData;
  struct {
    unsigned char compressionType;
    unsigned char gpuDirectRDMACapable;
    unsigned short usage;
    unsigned char reserved[4];  // CUDA's; HIP's struct ends before them (zero, never read by HIP)
  } allocFlags;
};
struct MemAccessDesc {
  MemLocation location;
  int flags;
};

// The values, as CUDA names them (HIP's names say the same: hipSuccess, hipErrorOutOfMemory, ...).
constexpr int kSuccess = 0;             // CUDA_SUCCESS
constexpr int kErrorOutOfMemory = 2;    // CUDA_ERROR_OUT_OF_MEMORY
constexpr int kAllocationPinned = 1;    // CU_MEM_ALLOCATION_TYPE_PINNED
constexpr int kLocationDevice = 1;      // CU_MEM_LOCATION_TYPE_DEVICE
constexpr int kAccessReadWrite = 3;     // CU_MEM_ACCESS_FLAGS_PROT_READWRITE
constexpr int kGranularityMinimum = 0;  // CU_MEM_ALLOC_GRANULARITY_MINIMUM

// One resolved entry point of a driver: its name (for error messages) and its address, of type `Fn`.
template <class Fn>
struct EntryPoint {
  std::string name;
  Fn* fn = nullptr;

  template <class... Args>
  auto operator()(Args... args) const {
    return fn(args...);
  }
};

// VAddr and HandleId are 64-bit integers; the drivers' addresses and handles are integers (CUDA) or pointers
// (HIP) of the same width.
template <class T>
T to_driver(std::uint64_t value) noexcept {
  if constexpr (std::is_pointer_v<T>) {
    return reinterpret_cast<T>(static_cast<std::uintptr_t>(value));
  } else {
    return static_cast<T>(value);
  }
}
template <class T>
std::uint64_t from_driver(T value) noexcept {
  if constexpr (std::is_pointer_v<T>) {
    return reinterpret_cast<std::uintptr_t>(value);
  } else {
    return static_cast<std::uint64_t>(value);
  }
}

// Whether the calls of an operation run work on the device (memset, synchronize, memory info) or only edit
// the VMM tables; a driver's Scope decides what binding each needs.
enum class Calls { kTables, kDeviceWork };

// The VMM entry points of both drivers under one set of names, with the driver's address type `Ptr`
// (CUdeviceptr, void*) and handle type `Handle` (CUmemGenericAllocationHandle, a pointer on HIP). A driver's
// table derives from it, adds its own entry points, and provides
//
//   Scope(const Driver&, const char* op, Calls)  RAII: binds the calls of operation `op` to the device as the
//                                                driver needs for `calls`; throws DriverError when it cannot
//   std::string error_name(int result) const     the driver's name of an error code, for messages
template <class PtrType, class HandleType>
struct VmmEntryPoints {
  using Ptr = PtrType;
  using Handle = HandleType;

  EntryPoint<int()> synchronize;  // of the device (cuCtxSynchronize on the primary context)
  EntryPoint<int(std::size_t*, std::size_t*)> mem_get_info;
  EntryPoint<int(std::size_t*, const MemAllocationProp*, int)> mem_get_allocation_granularity;
  EntryPoint<int(Ptr*, std::size_t, std::size_t, Ptr, unsigned long long)> mem_address_reserve;
  EntryPoint<int(Ptr, std::size_t)> mem_address_free;
  EntryPoint<int(Handle*, std::size_t, const MemAllocationProp*, unsigned long long)> mem_create;
  EntryPoint<int(Handle)> mem_release;
  EntryPoint<int(Ptr, std::size_t, std::size_t, Handle, unsigned long long)> mem_map;
  EntryPoint<int(Ptr, std::size_t)> mem_unmap;
  EntryPoint<int(Ptr, std::size_t, const MemAccessDesc*, std::size_t)> mem_set_access;
  EntryPoint<int(Ptr, unsigned char, std::size_t)> memset_d8;

  // What every handle is created with and what set_access grants: see allocate_on().
  MemAllocationProp prop{};
  MemAccessDesc access{};

  // Resolves the entries above with `resolve(entry, name)`, in this order. HIP names the VMM entry points as
  // CUDA does with "hip" for "cu" (cuMemCreate, hipMemCreate): the name is `prefix` followed by the common
  // stem; only the device-wide synchronize is named differently (`synchronize_name`).
  template <class Resolve>
  void resolve_vmm(const std::string& prefix, const char* synchronize_name, Resolve&& resolve) {
    resolve(synchronize, synchronize_name);
    resolve(mem_get_info, prefix + "MemGetInfo");
    resolve(mem_get_allocation_granularity, prefix + "MemGetAllocationGranularity");
    resolve(mem_address_reserve, prefix + "MemAddressReserve");
    resolve(mem_address_free, prefix + "MemAddressFree");
    resolve(mem_create, prefix + "MemCreate");
    resolve(mem_release, prefix + "MemRelease");
    resolve(mem_map, prefix + "MemMap");
    resolve(mem_unmap, prefix + "MemUnmap");
    resolve(mem_set_access, prefix + "MemSetAccess");
    resolve(memset_d8, prefix + "MemsetD8");
  }

  static Ptr to_ptr(VAddr va) noexcept { return to_driver<Ptr>(va); }
  static Handle to_handle(HandleId handle) noexcept { return to_driver<Handle>(handle); }

  // Handles become pinned memory on device `id`, read-write for that device.
  void allocate_on(int id) noexcept {
    prop.type = kAllocationPinned;
    prop.location = {kLocationDevice, id};
    access.location = prop.location;
    access.flags = kAccessReadWrite;
  }
};

// Returns when `result` is success; otherwise throws OutOfMemory or DriverError for operation `op`, naming
// the entry point `what` and the driver's name of the code.
template <class Driver>
void check(const Driver& driver, int result, const char* op, const std::string& what) {
  if (result == kSuccess) return;
  const std::string msg = what + " failed: " + driver.error_name(result);
  if (result == kErrorOutOfMemory) throw OutOfMemory(op, result, msg);
  throw DriverError(op, result, msg);
}

// Calls `entry` with `args` for operation `op`; throws as check() does.
template <class Driver, class Fn, class... Args>
void call(const Driver& driver, const char* op, const EntryPoint<Fn>& entry, Args... args) {
  check(driver, entry(args...), op, entry.name);
}

// The same, for an operation of one call: the call runs under the driver's Scope for `calls`.
template <class Driver, class Fn, class... Args>
void scoped_call(const Driver& driver, const char* op, Calls calls, const EntryPoint<Fn>& entry,
                 Args... args) {
  const typename Driver::Scope scope(driver, op, calls);
  call(driver, op, entry, args...);
}

}  // namespace vmm

template <class Driver>
DriverBackend<Driver>::DriverBackend(DeviceType device_type, int device, const std::string& library)
    : lib_(library), driver_(std::make_unique<Driver>()), device_(device), device_type_(device_type) {
  if (device < 0) throw InvalidArgument("device must be non-negative");
}

template <class Driver>
DriverBackend<Driver>::~DriverBackend() = default;

template <class Driver>
void DriverBackend<Driver>::require(int result, const std::string& what) const {
  if (result != vmm::kSuccess) throw ConfigurationError(what + " failed: " + driver_->error_name(result));
}

template <class Driver>
VAddr DriverBackend<Driver>::do_reserve(std::size_t size, std::size_t alignment) {
  using Ptr = typename Driver::Ptr;
  Ptr va{};
  vmm::scoped_call(*driver_, "reserve", vmm::Calls::kTables, driver_->mem_address_reserve, &va, size,
                   alignment, Ptr{}, 0);
  return vmm::from_driver(va);
}

template <class Driver>
void DriverBackend<Driver>::do_free_va(VAddr va, std::size_t size) {
  vmm::scoped_call(*driver_, "free_va", vmm::Calls::kTables, driver_->mem_address_free, Driver::to_ptr(va),
                   size);
}

template <class Driver>
HandleId DriverBackend<Driver>::do_create(std::size_t size) {
  typename Driver::Handle h{};
  vmm::scoped_call(*driver_, "create", vmm::Calls::kTables, driver_->mem_create, &h, size, &driver_->prop, 0);
  return vmm::from_driver(h);
}

template <class Driver>
void DriverBackend<Driver>::do_release(HandleId handle, std::size_t /*size*/) {
  vmm::scoped_call(*driver_, "release", vmm::Calls::kTables, driver_->mem_release, Driver::to_handle(handle));
}

template <class Driver>
void DriverBackend<Driver>::do_map(VAddr va, std::size_t size, HandleId handle) {
  vmm::scoped_call(*driver_, "map", vmm::Calls::kTables, driver_->mem_map, Driver::to_ptr(va), size, 0,
                   Driver::to_handle(handle), 0);
}

template <class Driver>
void DriverBackend<Driver>::do_unmap(VAddr va, std::size_t size) {
  vmm::scoped_call(*driver_, "unmap", vmm::Calls::kTables, driver_->mem_unmap, Driver::to_ptr(va), size);
}

template <class Driver>
void DriverBackend<Driver>::do_set_access(VAddr va, std::size_t size) {
  vmm::scoped_call(*driver_, "set_access", vmm::Calls::kTables, driver_->mem_set_access, Driver::to_ptr(va),
                   size, &driver_->access, 1);
}

template <class Driver>
void DriverBackend<Driver>::do_fill_zero(VAddr va, std::size_t size) {
  const Driver& d = *driver_;
  const typename Driver::Scope scope(d, "fill_zero", vmm::Calls::kDeviceWork);  // one scope, both calls
  vmm::call(d, "fill_zero", d.memset_d8, Driver::to_ptr(va), 0, size);
  vmm::call(d, "fill_zero", d.synchronize);
}

template <class Driver>
MemInfo DriverBackend<Driver>::do_mem_info() {
  std::size_t free = 0;
  std::size_t total = 0;
  vmm::scoped_call(*driver_, "mem_info", vmm::Calls::kDeviceWork, driver_->mem_get_info, &free, &total);
  return {free, total};
}

template <class Driver>
void DriverBackend<Driver>::do_synchronize() {
  vmm::scoped_call(*driver_, "synchronize", vmm::Calls::kDeviceWork, driver_->synchronize);
}

}  // namespace elastic_kv

// DriverBackend: the backend operations of CudaBackend and HipBackend, written once over their VMM API.
//
// Problem: CUDA's driver API and HIP have the same virtual memory API under other names (cuMemCreate /
// hipMemCreate, ...): the same arguments, the same structures, the same codes for success (0) and out of
// memory (2). Only three things differ: the address and handle types (CUdeviceptr / void*), how a call is
// bound to the device (CUDA: the primary context, for every call; HIP: the current device, for the calls that
// run work on it), and how the library is loaded and initialised. So the ten do_* operations live here, once,
// and a driver backend supplies only what differs.
//
// `Driver` is the driver's table of resolved entry points (CudaDriver, HipDriver: defined in cuda_backend.cpp
// and hip_backend.cpp from the driver ABI, no driver header needed). It derives from VmmEntryPoints (the
// shared API under one set of names, src/driver_vmm.hpp) and adds the driver's own entry points, its Scope
// (the device binding above) and error_name(). The member definitions are in src/driver_vmm.hpp and
// are instantiated once per driver, in the driver's .cpp (hence the extern template in each driver header).
//
// Errors: code 2 (CUDA_ERROR_OUT_OF_MEMORY, hipErrorOutOfMemory) from any call -- in practice create and map
// -- becomes OutOfMemory; any other failure becomes a DriverError naming the entry point and the driver's
// error name. A failure while the driver is set up is a ConfigurationError. Nothing aborts.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "elastic_kv/backend.hpp"
#include "elastic_kv/dynlib.hpp"

namespace elastic_kv {

template <class Driver>
class DriverBackend : public Backend {
 public:
  ~DriverBackend() override;

  Device device() const noexcept final { return {device_type_, device_}; }
  std::size_t granularity() const noexcept final { return granularity_; }
  bool multi_unmap() const noexcept final { return multi_unmap_; }

 protected:
  // Loads `library` (ConfigurationError if it cannot be loaded), then rejects a negative `device`. The driver
  // backend's constructor resolves the entry points into driver_ and sets granularity_ and multi_unmap_.
  DriverBackend(DeviceType device_type, int device, const std::string& library);

  VAddr do_reserve(std::size_t size, std::size_t alignment) final;
  void do_free_va(VAddr va, std::size_t size) final;
  HandleId do_create(std::size_t size) final;
  void do_release(HandleId handle, std::size_t size) final;
  void do_map(VAddr va, std::size_t size, HandleId handle) final;
  void do_unmap(VAddr va, std::size_t size) final;
  void do_set_access(VAddr va, std::size_t size) final;
  void do_fill_zero(VAddr va, std::size_t size) final;
  MemInfo do_mem_info() final;
  void do_synchronize() final;

  // Throws ConfigurationError("`what` failed: <error name>") unless `result` is success (set-up calls).
  void require(int result, const std::string& what) const;

  SharedLibrary lib_;
  std::unique_ptr<Driver> driver_;
  const int device_;
  std::size_t granularity_ = 0;
  bool multi_unmap_ = false;

 private:
  const DeviceType device_type_;
};

}  // namespace elastic_kv

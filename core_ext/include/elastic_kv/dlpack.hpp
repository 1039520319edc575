// The DLPack ABI (v0.8 "legacy" DLManagedTensor), declared here so that the module needs neither dlpack.h
// nor torch at build time.
//
// A TensorSpace leaves C++ as a PyCapsule named "dltensor" holding a DLManagedTensor: a flat uint8 tensor
// over the whole reserved range, on the backend's device. torch.from_dlpack (every torch from 1.10 to 2.14)
// consumes it, renames the capsule "used_dltensor" and calls `deleter` when the tensor dies. manager_ctx owns
// a shared_ptr to the space, so the reservation (and therefore every address the tensor can reach) outlives
// the tensor; the base address never moves because a space never re-reserves.
//
// Layout rules we rely on: the struct layouts and enum values below are fixed by the DLPack ABI and must not
// be reordered.
#pragma once

#include <cstdint>

namespace elastic_kv::dlpack {

struct DLDevice {
  std::int32_t device_type;  // kDLCPU = 1, kDLCUDA = 2, kDLROCM = 10
  std::int32_t device_id;
};

struct DLDataType {
  std::uint8_t code;  // kDLUInt = 1
  std::uint8_t bits;
  std::uint16_t lanes;
};

struct DLTensor {
  void* data;
  DLDevice device;
  std::int32_t ndim;
  DLDataType dtype;
  std::int64_t* shape;
  std::int64_t* strides;  // may be null for a compact row-major tensor
  std::uint64_t byte_offset;
};

struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor* self);
};

constexpr std::uint8_t kDLUInt = 1;

}  // namespace elastic_kv::dlpack

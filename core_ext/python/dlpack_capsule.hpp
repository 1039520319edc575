// TensorSpace -> DLPack capsule (see elastic_kv/dlpack.hpp for the ABI and the lifetime rule).
#pragma once

#include <pybind11/pybind11.h>

#include <memory>

#include "elastic_kv/tensor_space.hpp"

namespace elastic_kv {

// Implements TensorSpace.__dlpack__(stream=None, max_version=None, dl_device=None): a legacy "dltensor"
// capsule holding a 1-D uint8 tensor over the whole space. `stream` is accepted and ignored: the data plane
// never enqueues work (map/set_access are synchronous), so there is nothing for the consumer to wait for.
// `max_version` is ignored (torch accepts the legacy capsule whatever it asks for). A `dl_device` other than
// the space's own device raises BufferError. A caller passing `copy` gets a TypeError, which makes
// torch.from_dlpack retry without it and copy on its own side.
pybind11::object make_dlpack_capsule(const std::shared_ptr<TensorSpace>& space,
                                     const pybind11::object& stream, const pybind11::object& max_version,
                                     const pybind11::object& dl_device);

}  // namespace elastic_kv

#include "dlpack_capsule.hpp"

#include <memory>

#include "elastic_kv/dlpack.hpp"

namespace py = pybind11;

namespace elastic_kv {

namespace {

constexpr const char* kCapsuleName = "dltensor";

// Owns everything the DLManagedTensor points to. The shared_ptr keeps the space (and its reservation) alive
// for as long as any consumer holds the tensor.
struct ExportContext {
  std::shared_ptr<TensorSpace> space;
  std::int64_t shape[1];
  std::int64_t strides[1];
  dlpack::DLManagedTensor managed;
};

void delete_managed(dlpack::DLManagedTensor* self) {
  // Called by the consumer (possibly without the GIL): only C++ state is touched here.
  std::unique_ptr<ExportContext> owner(static_cast<ExportContext*>(self->manager_ctx));
}

void capsule_destructor(PyObject* capsule) {
  // A consumed capsule is renamed "used_dltensor" and its tensor belongs to the consumer; only an unconsumed
  // capsule still owns the DLManagedTensor.
  if (PyCapsule_IsValid(capsule, kCapsuleName) == 0) return;
  auto* managed = static_cast<dlpack::DLManagedTensor*>(PyCapsule_GetPointer(capsule, kCapsuleName));
  if (managed != nullptr && managed->deleter != nullptr) managed->deleter(managed);
}

}  // namespace

py::object make_dlpack_capsule(const std::shared_ptr<TensorSpace>& space, const py::object& /*stream*/,
                               const py::object& /*max_version*/, const py::object& dl_device) {
  const Device device = space->backend()->device();
  if (!dl_device.is_none()) {
    const auto want = dl_device.cast<std::pair<int, int>>();
    if (want.first != static_cast<int>(device.type) || want.second != device.id) {
      PyErr_SetString(PyExc_BufferError, "TensorSpace can only be exported on its own device");
      throw py::error_already_set();
    }
  }
  auto ctx = std::make_unique<ExportContext>();
  ctx->space = space;
  ctx->shape[0] = static_cast<std::int64_t>(space->size());
  ctx->strides[0] = 1;
  dlpack::DLTensor& t = ctx->managed.dl_tensor;
  t.data = reinterpret_cast<void*>(static_cast<std::uintptr_t>(space->base()));
  t.device = {static_cast<std::int32_t>(device.type), device.id};
  t.ndim = 1;
  t.dtype = {dlpack::kDLUInt, 8, 1};
  t.shape = ctx->shape;
  t.strides = ctx->strides;
  t.byte_offset = 0;
  ctx->managed.manager_ctx = ctx.get();
  ctx->managed.deleter = &delete_managed;
  PyObject* capsule = PyCapsule_New(&ctx->managed, kCapsuleName, &capsule_destructor);
  if (capsule == nullptr) throw py::error_already_set();
  ctx.release();  // now owned by the capsule (or, once consumed, by the consumer through the deleter)
  return py::reinterpret_steal<py::object>(capsule);
}

}  // namespace elastic_kv

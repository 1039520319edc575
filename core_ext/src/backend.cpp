#include "elastic_kv/backend.hpp"

#include <string>

namespace elastic_kv {

namespace {
constexpr const char* kOpNames[] = {"reserve", "free_va", "create",     "release",
                                    "map",     "unmap",   "set_access", "synchronize"};
static_assert(sizeof(kOpNames) / sizeof(kOpNames[0]) == static_cast<int>(Op::kCount), "one name per Op");
}  // namespace

const char* op_name(Op op) noexcept {
  const int i = static_cast<int>(op);
  return (i >= 0 && i < static_cast<int>(Op::kCount)) ? kOpNames[i] : "?";
}

Op op_from_name(const std::string& name) {
  for (int i = 0; i < static_cast<int>(Op::kCount); ++i) {
    if (name == kOpNames[i]) return static_cast<Op>(i);
  }
  throw InvalidArgument(
      "unknown backend operation '" + name +
      "' (expected reserve, free_va, create, release, map, unmap, set_access or synchronize)");
}

void Backend::check_granular(std::size_t value, const char* what) const {
  const std::size_t g = granularity();
  if (value == 0 || value % g != 0) {
    throw InvalidArgument(std::string(what) + " " + std::to_string(value) +
                          " is not a positive multiple of the granularity " + std::to_string(g));
  }
}

VAddr Backend::reserve(std::size_t size, std::size_t alignment) {
  check_granular(size, "reservation size");
  count(Op::kReserve);
  const VAddr va = do_reserve(size, alignment);
  live_reservations_.fetch_add(1);
  return va;
}

void Backend::free_va(VAddr va, std::size_t size) {
  count(Op::kFreeVa);
  do_free_va(va, size);
  live_reservations_.fetch_sub(1);
}

HandleId Backend::create(std::size_t size) {
  check_granular(size, "handle size");
  count(Op::kCreate);
  const HandleId h = do_create(size);
  live_handles_.fetch_add(1);
  live_bytes_.fetch_add(size);
  return h;
}

void Backend::release(HandleId handle, std::size_t size) {
  count(Op::kRelease);
  do_release(handle, size);
  live_handles_.fetch_sub(1);
  live_bytes_.fetch_sub(size);
}

void Backend::map(VAddr va, std::size_t size, HandleId handle) {
  count(Op::kMap);
  do_map(va, size, handle);
}

void Backend::unmap(VAddr va, std::size_t size) {
  count(Op::kUnmap);
  do_unmap(va, size);
}

void Backend::set_access(VAddr va, std::size_t size) {
  count(Op::kSetAccess);
  do_set_access(va, size);
}

void Backend::fill_zero(VAddr va, std::size_t size) { do_fill_zero(va, size); }

MemInfo Backend::mem_info() { return do_mem_info(); }

void Backend::synchronize() {
  count(Op::kSynchronize);
  do_synchronize();
}

std::shared_ptr<ZeroPage> Backend::zero_page(std::size_t size) {
  std::lock_guard<std::mutex> lock(zero_mu_);
  auto& slot = zero_pages_[size];
  if (auto page = slot.lock()) return page;
  auto page = std::make_shared<ZeroPage>(shared_from_this(), size);
  slot = page;
  return page;
}

PhysicalHandle& PhysicalHandle::operator=(PhysicalHandle&& other) noexcept {
  if (this != &other) {
    reset();
    backend_ = std::move(other.backend_);
    id_ = other.id_;
    size_ = other.size_;
    other.backend_.reset();
  }
  return *this;
}

PhysicalHandle PhysicalHandle::create(const std::shared_ptr<Backend>& backend, std::size_t size) {
  const HandleId id = backend->create(size);
  return PhysicalHandle(backend, id, size);
}

void PhysicalHandle::release() {
  if (!backend_) return;
  backend_->release(id_, size_);
  backend_.reset();
}

void PhysicalHandle::reset() noexcept {
  if (!backend_) return;
  try {
    backend_->release(id_, size_);
  } catch (...) {
    backend_->note_cleanup_failure();
  }
  backend_.reset();
}

ZeroPage::ZeroPage(const std::shared_ptr<Backend>& backend, std::size_t size)
    : handle_(PhysicalHandle::create(backend, size)) {
  if (backend->creates_zeroed()) return;
  // Device memory from create() holds whatever was there before; zero it through a temporary mapping so that
  // unbacked slots really read zeros. (On failure the handle_ member releases the handle.)
  const VAddr va = backend->reserve(size, backend->granularity());
  bool mapped = false;
  try {
    backend->map(va, size, handle_.id());
    mapped = true;
    backend->set_access(va, size);
    backend->fill_zero(va, size);
    backend->unmap(va, size);
    mapped = false;
  } catch (...) {
    if (mapped) {
      try {
        backend->unmap(va, size);
      } catch (...) {
        backend->note_cleanup_failure();
      }
    }
    try {
      backend->free_va(va, size);
    } catch (...) {
      backend->note_cleanup_failure();
    }
    throw;
  }
  backend->free_va(va, size);
}

}  // namespace elastic_kv

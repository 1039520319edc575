#include "elastic_kv/fault_backend.hpp"

#include <chrono>
#include <string>
#include <thread>

namespace elastic_kv {

namespace {
constexpr int kInjectedCode = -1;  // the "driver code" of an injected failure
}

FaultInjectingBackend::FaultInjectingBackend(std::shared_ptr<Backend> inner) : inner_(std::move(inner)) {
  if (!inner_) throw InvalidArgument("FaultInjectingBackend needs an inner backend");
}

void FaultInjectingBackend::arm(Op op, long nth, long times, bool oom) {
  if (nth < 1) throw InvalidArgument("nth must be >= 1");
  if (times == 0) throw InvalidArgument("times must be >= 1, or negative for 'every call from nth on'");
  std::lock_guard<std::mutex> lock(mu_);
  const int i = static_cast<int>(op);
  Plan plan;
  plan.first = seen_[i] + nth;
  plan.last = times < 0 ? -1 : plan.first + times - 1;
  plan.oom = oom;
  plans_[i] = plan;
}

void FaultInjectingBackend::set_delay(Op op, long microseconds) {
  if (microseconds < 0) throw InvalidArgument("a delay must be non-negative");
  std::lock_guard<std::mutex> lock(mu_);
  delay_us_[static_cast<int>(op)] = microseconds;
}

void FaultInjectingBackend::disarm() noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  plans_.fill(Plan{});
  delay_us_.fill(0);
}

std::size_t FaultInjectingBackend::injected(Op op) const {
  std::lock_guard<std::mutex> lock(mu_);
  return injected_[static_cast<int>(op)];
}

void FaultInjectingBackend::maybe_fail(Op op) {
  bool oom = false;
  long delay = 0;
  bool fail = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const int i = static_cast<int>(op);
    const long n = ++seen_[i];
    delay = delay_us_[i];
    const Plan& plan = plans_[i];
    fail = plan.first != 0 && n >= plan.first && (plan.last < 0 || n <= plan.last);
    if (fail) ++injected_[i];
    oom = plan.oom;
  }
  if (delay > 0) std::this_thread::sleep_for(std::chrono::microseconds(delay));
  if (!fail) return;
  const std::string what = std::string("injected failure of ") + op_name(op) + " (FaultInjectingBackend)";
  if (oom) throw OutOfMemory(op_name(op), kInjectedCode, what + ": out of memory");
  throw DriverError(op_name(op), kInjectedCode, what);
}

VAddr FaultInjectingBackend::do_reserve(std::size_t size, std::size_t alignment) {
  maybe_fail(Op::kReserve);
  return inner_->reserve(size, alignment);
}

void FaultInjectingBackend::do_free_va(VAddr va, std::size_t size) {
  maybe_fail(Op::kFreeVa);
  inner_->free_va(va, size);
}

HandleId FaultInjectingBackend::do_create(std::size_t size) {
  maybe_fail(Op::kCreate);
  return inner_->create(size);
}

void FaultInjectingBackend::do_release(HandleId handle, std::size_t size) {
  maybe_fail(Op::kRelease);
  inner_->release(handle, size);
}

void FaultInjectingBackend::do_map(VAddr va, std::size_t size, HandleId handle) {
  maybe_fail(Op::kMap);
  inner_->map(va, size, handle);
}

void FaultInjectingBackend::do_unmap(VAddr va, std::size_t size) {
  maybe_fail(Op::kUnmap);
  inner_->unmap(va, size);
}

void FaultInjectingBackend::do_set_access(VAddr va, std::size_t size) {
  maybe_fail(Op::kSetAccess);
  inner_->set_access(va, size);
}

void FaultInjectingBackend::do_fill_zero(VAddr va, std::size_t size) { inner_->fill_zero(va, size); }

MemInfo FaultInjectingBackend::do_mem_info() { return inner_->mem_info(); }

void FaultInjectingBackend::do_synchronize() {
  maybe_fail(Op::kSynchronize);
  inner_->synchronize();
}

}  // namespace elastic_kv

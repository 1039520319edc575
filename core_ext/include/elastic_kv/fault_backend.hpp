// FaultInjectingBackend: makes the Nth call of a chosen backend operation fail, for tests.
//
// Problem: the rollback paths of the data plane (and the quarantine that follows a failed rollback) only run
// when the driver fails, which a real driver does rarely and never on demand. This wrapper forwards every
// call to an inner backend and, when armed, throws instead of forwarding -- before the inner call, so the
// inner backend's state is untouched, exactly like a driver call that failed its validation.
//
//   arm(op, nth, times, oom): the nth call of `op` from now fails, and so do the following times-1 calls
//                             (times < 0: every call from the nth on, until disarm()). `oom` selects
//                             OutOfMemory (what cuMemCreate/cuMemMap report) over a generic DriverError.
//
//   delay(op, us):            every call of `op` first sleeps `us` microseconds (a slow driver), so that
//   tests
//                             can observe work in flight (pending pre-mapping, interleaved threads).
//
// Tests enumerate injection points by counting calls per operation in an uninjected run (calls(op)) and then
// arming each position 1..N in a fresh setup; injected(op) proves that the armed failure actually fired.
// Thread safety: the counters and the armed plan share one mutex; the inner call runs outside it.
#pragma once

#include <array>
#include <memory>
#include <mutex>

#include "elastic_kv/backend.hpp"

namespace elastic_kv {

class FaultInjectingBackend final : public Backend {
 public:
  explicit FaultInjectingBackend(std::shared_ptr<Backend> inner);

  // Arms a failure (see the header comment). Replaces an earlier plan for the same op. nth >= 1, times != 0.
  void arm(Op op, long nth, long times, bool oom);
  // Every later call of `op` sleeps `microseconds` first (0 = no delay).
  void set_delay(Op op, long microseconds);
  // Disarms every op and removes every delay.
  void disarm() noexcept;
  // Failures injected so far for `op` (since construction).
  std::size_t injected(Op op) const;

  const std::shared_ptr<Backend>& inner() const noexcept { return inner_; }
  std::string name() const override { return "fault(" + inner_->name() + ")"; }
  Device device() const noexcept override { return inner_->device(); }
  std::size_t granularity() const noexcept override { return inner_->granularity(); }
  bool multi_unmap() const noexcept override { return inner_->multi_unmap(); }
  bool creates_zeroed() const noexcept override { return inner_->creates_zeroed(); }

 protected:
  VAddr do_reserve(std::size_t size, std::size_t alignment) override;
  void do_free_va(VAddr va, std::size_t size) override;
  HandleId do_create(std::size_t size) override;
  void do_release(HandleId handle, std::size_t size) override;
  void do_map(VAddr va, std::size_t size, HandleId handle) override;
  void do_unmap(VAddr va, std::size_t size) override;
  void do_set_access(VAddr va, std::size_t size) override;
  void do_fill_zero(VAddr va, std::size_t size) override;
  MemInfo do_mem_info() override;
  void do_synchronize() override;

 private:
  struct Plan {
    long first = 0;  // absolute call number (1-based) of the first failing call; 0 = not armed
    long last = 0;   // absolute call number of the last failing call; < 0 = no end
    bool oom = false;
  };
  // Counts a call of `op` and throws if the plan says this call fails.
  void maybe_fail(Op op);

  std::shared_ptr<Backend> inner_;
  mutable std::mutex mu_;
  std::array<long, static_cast<int>(Op::kCount)> seen_{};
  std::array<std::size_t, static_cast<int>(Op::kCount)> injected_{};
  std::array<Plan, static_cast<int>(Op::kCount)> plans_{};
  std::array<long, static_cast<int>(Op::kCount)> delay_us_{};
};

}  // namespace elastic_kv

// SpaceGroup: background pre-mapping and shutdown (see space_group.hpp for the design).
#include <string>
#include <thread>
#include <utility>

#include "elastic_kv/space_group.hpp"

namespace elastic_kv {

std::uint64_t SpaceGroup::map_async(const std::vector<std::int64_t>& pages) {
  std::lock_guard<std::mutex> lock(mu_);
  check_usable();
  auto ps = validate(pages, PageState::kUnmapped, "map_async");
  const std::uint64_t ticket = ++next_ticket_;
  queue_.push_back(Request{ticket, ps});
  try {
    if (!worker_.joinable()) worker_ = std::thread(&SpaceGroup::worker_main, this);
  } catch (...) {
    queue_.pop_back();
    throw;
  }
  for (std::uint32_t p : ps) pages_[p] = PageState::kPending;
  work_cv_.notify_one();
  return ticket;
}

void SpaceGroup::worker_main() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    work_cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
    if (stop_) return;  // close() resolves what is still queued
    Request request = std::move(queue_.front());
    queue_.pop_front();
    busy_ = true;
    run_request(lock, request);
    busy_ = false;
    idle_cv_.notify_all();
  }
}

void SpaceGroup::run_request(std::unique_lock<std::mutex>& lock, const Request& request) {
  std::vector<std::uint32_t> done;
  std::optional<std::string> error;
  for (std::uint32_t p : request.pages) {
    if (stop_ || cancelling_.load(std::memory_order_relaxed)) {
      error = "Cancelled: the SpaceGroup was closed";
      break;
    }
    if (!consistent_) {
      error = "StateConsistencyError: " + error_;
      break;
    }
    try {
      map_locked({p});
      done.push_back(p);
    } catch (const OutOfMemory& e) {
      error = std::string("PoolExhausted: ") + e.what();
    } catch (const StateInconsistent& e) {
      error = std::string("StateConsistencyError: ") + e.what();
    } catch (const DriverError& e) {
      error = std::string("BackendError: ") + e.what();
    } catch (const std::exception& e) {
      error = std::string("RuntimeError: ") + e.what();
    }
    if (error) break;
    // One page per lock hold: a foreground map/unmap waits for at most one page of background work.
    lock.unlock();
    std::this_thread::yield();
    lock.lock();
  }
  bool rolled_back = true;
  if (error && !done.empty()) {
    try {
      if (!consistent_) throw StateInconsistent(error_);
      prepare_locked(done);
      commit_locked(done);
    } catch (const std::exception& e) {
      rolled_back = false;
      mark_inconsistent(std::string("rolling back a failed map_async failed: ") + e.what());
      error = "StateConsistencyError: rolling back the pages mapped so far failed (" + std::string(e.what()) +
              ") after " + *error;
    }
  }
  if (!error) {
    for (std::uint32_t p : request.pages) pages_[p] = PageState::kMapped;
    num_mapped_ += request.pages.size();
  } else {
    for (std::uint32_t p : request.pages) pages_[p] = PageState::kUnmapped;
    if (!rolled_back) {  // the pages mapped so far still hold their references: report them as mapped
      for (std::uint32_t p : done) pages_[p] = PageState::kMapped;
      num_mapped_ += done.size();
    }
  }
  std::vector<std::int64_t> pages(request.pages.begin(), request.pages.end());
  std::lock_guard<std::mutex> results_lock(results_mu_);
  results_.push_back(AsyncResult{request.ticket, std::move(pages), std::move(error)});
}

std::vector<AsyncResult> SpaceGroup::collect(bool wait) {
  if (wait) {
    std::unique_lock<std::mutex> lock(mu_);
    idle_cv_.wait(lock, [this] { return stop_ || (queue_.empty() && !busy_); });
  }
  std::lock_guard<std::mutex> lock(results_mu_);
  std::vector<AsyncResult> out;
  out.swap(results_);
  return out;
}

void SpaceGroup::close() noexcept {
  cancelling_.store(true, std::memory_order_relaxed);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_ || stop_) return;
    stop_ = true;
  }
  work_cv_.notify_all();
  idle_cv_.notify_all();
  if (worker_.joinable()) worker_.join();

  std::lock_guard<std::mutex> lock(mu_);
  closed_ = true;
  try {
    for (const Request& r : queue_) {
      for (std::uint32_t p : r.pages) pages_[p] = PageState::kUnmapped;
      std::lock_guard<std::mutex> results_lock(results_mu_);
      results_.push_back(AsyncResult{r.ticket, std::vector<std::int64_t>(r.pages.begin(), r.pages.end()),
                                     std::string("Cancelled: the SpaceGroup was closed")});
    }
  } catch (...) {
    // Out of host memory: the cancelled requests go unreported; their pages are still released below.
  }
  queue_.clear();

  // Every backed unit returns to its zero page, so that tensors still viewing the spaces stay readable.
  for (std::size_t sp = 0; sp < spaces_.size(); ++sp) {
    try {
      std::vector<TensorSpace::UnitSpan> spans;
      for (const Unit& u : units_) {
        if (u.space == sp && u.mapped_refs > 0) spans.push_back({u.start, u.nslots});
      }
      bool done = false;
      if (consistent_ && spaces_[sp]->consistent()) {
        try {
          spaces_[sp]->unback(spans);
          done = true;
        } catch (...) {
        }
      }
      if (!done) spaces_[sp]->unback_best_effort(spans);
    } catch (...) {
      spaces_[sp]->backend()->note_cleanup_failure();
    }
  }
  // Handles go back to the pool only when everything is known to be in order; otherwise straight to the
  // driver.
  for (Unit& u : units_) {
    if (!u.handle) continue;
    if (consistent_ && !spaces_[u.space]->unit_quarantined(u.start, nullptr)) {
      pool_->give_back(std::move(u.handle));
    } else {
      u.handle.reset();
    }
    u.mapped_refs = 0;
    u.prepared_refs = 0;
  }
  for (auto& h : quarantine_) h.reset();
  quarantine_.clear();
  prepared_.clear();
  for (auto& p : pages_) p = PageState::kUnmapped;
  num_mapped_ = 0;
  mapped_bytes_ = 0;
  for (auto& space : spaces_) space->detach(this);
}

}  // namespace elastic_kv

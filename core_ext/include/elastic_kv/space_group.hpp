// SpaceGroup: the spaces of one KV pool, mapped and unmapped together by logical page.
//
// Problem: the ledger thinks in logical pages ("page 17 is in use"), but a page's bytes are spread over many
// spaces (per-layer K/V buffers) or strided through one big buffer (vLLM's layer_stride/block_stride layout).
// The group translates pages into the mapping units of its spaces and makes every change all-or-nothing.
//
// Geometry. An extent (space, base, step, length) gives logical page p the bytes
// [base + p*step, base + p*step + length) of that space. The slots a page touches are derived from its
// extents. Slots touched by several pages (a block straddling a slot boundary, a layer not starting on a slot
// boundary) are reference-counted: backed while any page touching them is mapped, so misalignment never loses
// capacity. An extent whose base, step and length are multiples of the page size, whose pages do not overlap
// and whose slots no other extent touches becomes *compound*: one handle of `length` bytes per page instead
// of one per slot (driver cost is per handle, not per byte). Every other touched slot is a one-slot unit.
//
// Unit state. mapped_refs counts mapped pages touching the unit; prepared_refs counts pages of prepared
// transactions. A unit is physically backed iff mapped_refs > 0, and holds a handle iff mapped_refs +
// prepared_refs > 0 -- so abort() can always restore a prepared page from the handles it retained, even when
// a neighbouring page sharing a unit was unmapped meanwhile, without allocating.
//
// Operations (each all-or-nothing; a ValueError-class problem is detected before any state changes):
//   map(pages)              acquire handles from the HandlePool, back the units; OutOfMemory after a full
//   rollback prepare(tx, pages)      unback the units, keep the handles in the transaction commit(tx) give
//   the handles back to the pool (cannot fail; a failed release is quarantined) abort(tx) re-back the units
//   with the retained handles; on failure the tx stays prepared unmap(pages)            prepare + commit
//   under an internal transaction
// Outcomes of finished transactions are kept in a bounded history: commit/abort are idempotent, commit of an
// aborted tx (or abort of a committed one) is refused, abort of an unknown tx records it as aborted (presumed
// abort), so a prepare that arrives after its abort is refused.
//
// Failure. When a rollback fails, the affected handles are quarantined (never reused), the group is marked
// inconsistent and every later operation throws StateInconsistent; close() still cleans up best effort.
//
// Background pre-mapping. map_async(pages) queues a request that a C++ worker thread maps page by page
// (re-taking the group mutex between pages so that foreground calls interleave); the request is
// all-or-nothing and its pages are "pending" (not mappable, not unmappable) until it finishes. collect()
// returns the results. The worker never calls into Python. close()/the destructor stop and join it.
//
// Locking order: SpaceGroup::mu_ -> TensorSpace::mu_ -> HandlePool::mu_ -> Backend internals. Every public
// method takes mu_ for its whole duration (driver calls included: the driver serializes anyway, and one lock
// keeps the bookkeeping trivially consistent). results_mu_ is a leaf lock.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "elastic_kv/handle_pool.hpp"
#include "elastic_kv/tensor_space.hpp"

namespace elastic_kv {

struct ExtentSpec {
  std::size_t space;
  std::uint64_t base;
  std::uint64_t step;
  std::uint64_t length;
};

enum class PageState : std::uint8_t { kUnmapped, kMapped, kPending, kPrepared };

struct AsyncResult {
  std::uint64_t ticket;
  std::vector<std::int64_t> pages;
  std::optional<std::string> error;  // "<ErrorType>: message", or nothing on success
};

struct UnitInfo {
  std::size_t space;
  std::uint32_t start_slot;
  std::uint32_t nslots;
};

class SpaceGroup {
 public:
  SpaceGroup(std::vector<std::shared_ptr<TensorSpace>> spaces, const std::vector<ExtentSpec>& extents,
             std::size_t num_pages, std::shared_ptr<HandlePool> pool, std::size_t history);
  ~SpaceGroup();
  SpaceGroup(const SpaceGroup&) = delete;
  SpaceGroup& operator=(const SpaceGroup&) = delete;

  void map(const std::vector<std::int64_t>& pages);
  void unmap(const std::vector<std::int64_t>& pages);
  void prepare(std::int64_t tx, const std::vector<std::int64_t>& pages);
  void commit(std::int64_t tx);
  void abort(std::int64_t tx);
  std::optional<std::string> tx_state(std::int64_t tx) const;

  std::uint64_t map_async(const std::vector<std::int64_t>& pages);
  // Finished background requests since the last collect(); with `wait`, first waits until none is queued.
  std::vector<AsyncResult> collect(bool wait);

  // Stops the worker, returns every unit to its zero page and every handle to the pool (released directly if
  // the group is inconsistent). Idempotent; later operations throw InvalidArgument.
  void close() noexcept;

  bool is_mapped(std::int64_t page) const;
  PageState page_state(std::int64_t page) const;
  std::vector<std::int64_t> mapped_pages() const;
  std::size_t num_mapped() const;
  std::size_t mapped_bytes() const;
  std::size_t held_handles() const;
  std::size_t quarantined_handles() const;
  std::size_t num_pages() const noexcept { return pages_.size(); }
  std::size_t num_units() const noexcept { return units_.size(); }
  std::vector<UnitInfo> page_units(std::int64_t page) const;
  bool consistent() const;
  std::string error() const;
  bool closed() const;
  const std::vector<std::shared_ptr<TensorSpace>>& spaces() const noexcept { return spaces_; }
  const std::shared_ptr<HandlePool>& pool() const noexcept { return pool_; }

 private:
  struct Extent {
    std::uint32_t space;
    std::uint64_t base;
    std::uint64_t step;
    std::uint64_t length;
  };
  struct Unit {
    std::uint32_t space;
    std::uint32_t start;
    std::uint32_t nslots;
    std::uint32_t mapped_refs = 0;
    std::uint32_t prepared_refs = 0;
    PhysicalHandle handle;
  };
  struct Request {
    std::uint64_t ticket;
    std::vector<std::uint32_t> pages;
  };
  enum class Outcome : std::uint8_t { kCommitted, kAborted };
  // Per-unit multiplicity of a set of pages (units in ascending index order).
  struct Delta {
    std::vector<std::uint32_t> units;
    std::vector<std::uint32_t> counts;
  };

  void build_units(const std::vector<ExtentSpec>& extents);
  std::size_t unit_bytes(const Unit& u) const noexcept;
  void check_usable() const;
  std::vector<std::uint32_t> validate(const std::vector<std::int64_t>& pages, PageState required,
                                      const char* op) const;
  void append_units(std::uint32_t page, std::vector<std::uint32_t>* out) const;
  Delta delta_of(const std::vector<std::uint32_t>& pages) const;
  void mark_inconsistent(const std::string& why) noexcept;
  void record_outcome(std::int64_t tx, Outcome outcome);

  // Physical steps over a list of unit indices, per space, all-or-nothing across spaces.
  void back_units(const std::vector<std::uint32_t>& units, const std::vector<HandleId>& ids) {
    swap_units(units, &ids);
  }
  void unback_units(const std::vector<std::uint32_t>& units) { swap_units(units, nullptr); }
  // The body of both: backs units with `ids` (one per unit), or unbacks them (nullptr).
  void swap_units(const std::vector<std::uint32_t>& units, const std::vector<HandleId>* ids);
  // Moves handles of quarantined units into quarantine_ after a failed rollback.
  void collect_quarantined(const std::vector<std::uint32_t>& units,
                           std::vector<std::pair<std::uint32_t, PhysicalHandle>>* loose) noexcept;

  // The bodies of map/prepare/commit/abort; callers hold mu_ and validated the pages.
  void map_locked(const std::vector<std::uint32_t>& pages);
  void prepare_locked(const std::vector<std::uint32_t>& pages);
  void commit_locked(const std::vector<std::uint32_t>& pages) noexcept;
  void abort_locked(const std::vector<std::uint32_t>& pages);

  void worker_main();
  void run_request(std::unique_lock<std::mutex>& lock, const Request& request);

  std::vector<std::shared_ptr<TensorSpace>> spaces_;
  std::shared_ptr<HandlePool> pool_;
  std::vector<Extent> extents_;
  std::vector<Unit> units_;
  std::vector<std::vector<std::int32_t>> unit_of_slot_;  // per space: slot -> unit index, -1 = untouched
  std::size_t history_cap_;

  mutable std::mutex mu_;
  std::vector<PageState> pages_;
  std::size_t num_mapped_ = 0;
  std::size_t mapped_bytes_ = 0;
  std::size_t held_handles_ = 0;
  std::unordered_map<std::int64_t, std::vector<std::uint32_t>> prepared_;
  std::unordered_map<std::int64_t, Outcome> history_;
  std::deque<std::int64_t> history_order_;
  std::vector<PhysicalHandle> quarantine_;
  bool consistent_ = true;
  std::string error_;
  bool closed_ = false;

  // Background pre-mapping (guarded by mu_ except results_, which has results_mu_).
  std::thread worker_;
  std::condition_variable work_cv_;
  std::condition_variable idle_cv_;
  std::deque<Request> queue_;
  bool busy_ = false;
  bool stop_ = false;
  // Set by close() before it takes mu_: the worker, which holds mu_ while it maps a page and re-takes it
  // at once after, sees it at its next page even when close() has not got the mutex yet.
  std::atomic<bool> cancelling_{false};
  std::uint64_t next_ticket_ = 0;
  std::mutex results_mu_;
  std::vector<AsyncResult> results_;
};

}  // namespace elastic_kv

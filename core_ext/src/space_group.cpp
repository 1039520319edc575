// One file over 400 lines on purpose: one class, whose map/prepare/commit/abort transactions and their
// rollbacks share the unit reference counts and must be read together (the contract is space_group.hpp's).

#include "elastic_kv/space_group.hpp"

#include <algorithm>
#include <limits>
#include <string>
#include <utility>

#include "locked.hpp"

namespace elastic_kv {

namespace {

const char* state_phrase(PageState s) {
  switch (s) {
    case PageState::kUnmapped:
      return "is not mapped";
    case PageState::kMapped:
      return "is already mapped";
    case PageState::kPending:
      return "is being mapped in the background (map_async)";
    case PageState::kPrepared:
      return "belongs to a prepared transaction";
  }
  return "is in an unknown state";
}

}  // namespace

SpaceGroup::SpaceGroup(std::vector<std::shared_ptr<TensorSpace>> spaces,
                       const std::vector<ExtentSpec>& extents, std::size_t num_pages,
                       std::shared_ptr<HandlePool> pool, std::size_t history)
    : spaces_(std::move(spaces)), pool_(std::move(pool)), history_cap_(history) {
  if (spaces_.empty()) throw InvalidArgument("a SpaceGroup needs at least one TensorSpace");
  if (!pool_) throw InvalidArgument("a SpaceGroup needs a HandlePool");
  if (history == 0) throw InvalidArgument("history must be at least 1");
  if (num_pages == 0 || num_pages >= std::numeric_limits<std::uint32_t>::max()) {
    throw InvalidArgument("num_pages must be in [1, 2^32 - 1)");
  }
  if (extents.empty()) throw InvalidArgument("a SpaceGroup needs at least one extent");
  for (std::size_t i = 0; i < spaces_.size(); ++i) {
    if (!spaces_[i]) throw InvalidArgument("space " + std::to_string(i) + " is None");
    if (spaces_[i]->backend() != pool_->backend()) {
      throw InvalidArgument("every space and the HandlePool must use the same backend object");
    }
    for (std::size_t j = 0; j < i; ++j) {
      if (spaces_[j] == spaces_[i]) throw InvalidArgument("the same TensorSpace is listed twice");
    }
  }
  pages_.assign(num_pages, PageState::kUnmapped);
  build_units(extents);

  std::size_t attached = 0;
  try {
    for (; attached < spaces_.size(); ++attached) spaces_[attached]->attach(this);
    std::vector<std::vector<TensorSpace::UnitSpan>> spans(spaces_.size());
    for (const Unit& u : units_) spans[u.space].push_back({u.start, u.nslots});
    for (std::size_t s = 0; s < spaces_.size(); ++s) spaces_[s]->tile_zero(spans[s]);
  } catch (...) {
    for (std::size_t s = 0; s < attached; ++s) spaces_[s]->detach(this);
    throw;
  }
}

SpaceGroup::~SpaceGroup() { close(); }

void SpaceGroup::build_units(const std::vector<ExtentSpec>& specs) {
  const std::uint64_t last_page = pages_.size() - 1;
  for (std::size_t i = 0; i < specs.size(); ++i) {
    const ExtentSpec& e = specs[i];
    const std::string name = "extent " + std::to_string(i);
    if (e.space >= spaces_.size()) throw InvalidArgument(name + ": space index out of range");
    if (e.length == 0) throw InvalidArgument(name + ": length must be positive");
    const std::uint64_t limit = spaces_[e.space]->size();
    // base + last_page*step + length <= size, without overflow.
    if (e.base > limit || e.length > limit - e.base ||
        (last_page > 0 && e.step > (limit - e.base - e.length) / last_page)) {
      throw InvalidArgument(name + ": page " + std::to_string(last_page) + " ends beyond the space (" +
                            std::to_string(limit) + " bytes)");
    }
    extents_.push_back({static_cast<std::uint32_t>(e.space), e.base, e.step, e.length});
  }

  // How many (extent, page) pairs touch each slot.
  std::vector<std::vector<std::uint32_t>> touch(spaces_.size());
  for (std::size_t s = 0; s < spaces_.size(); ++s) touch[s].assign(spaces_[s]->num_slots(), 0);
  for (const Extent& e : extents_) {
    const std::uint64_t ps = spaces_[e.space]->page_size();
    for (std::uint64_t p = 0; p <= last_page; ++p) {
      const std::uint64_t lo = e.base + p * e.step;
      for (std::uint64_t s = lo / ps; s <= (lo + e.length - 1) / ps; ++s) ++touch[e.space][s];
    }
  }
  // Compound extents: aligned, non-overlapping pages whose slots nobody else touches.
  std::vector<std::vector<std::uint32_t>> compound_len(spaces_.size());
  for (std::size_t s = 0; s < spaces_.size(); ++s) compound_len[s].assign(spaces_[s]->num_slots(), 0);
  for (const Extent& e : extents_) {
    const std::uint64_t ps = spaces_[e.space]->page_size();
    const bool aligned = e.base % ps == 0 && e.step % ps == 0 && e.length % ps == 0 && e.length / ps >= 2;
    if (!aligned || (last_page > 0 && e.step < e.length)) continue;
    bool exclusive = true;
    for (std::uint64_t p = 0; p <= last_page && exclusive; ++p) {
      const std::uint64_t s0 = (e.base + p * e.step) / ps;
      for (std::uint64_t s = s0; s < s0 + e.length / ps; ++s) exclusive = exclusive && touch[e.space][s] == 1;
    }
    if (!exclusive) continue;
    for (std::uint64_t p = 0; p <= last_page; ++p) {
      compound_len[e.space][(e.base + p * e.step) / ps] = static_cast<std::uint32_t>(e.length / ps);
    }
  }
  // Units in (space, start) order, so that unit indices sort like addresses.
  unit_of_slot_.resize(spaces_.size());
  for (std::size_t sp = 0; sp < spaces_.size(); ++sp) {
    const std::uint32_t n = static_cast<std::uint32_t>(spaces_[sp]->num_slots());
    unit_of_slot_[sp].assign(n, -1);
    for (std::uint32_t s = 0; s < n;) {
      const std::uint32_t len = compound_len[sp][s] != 0 ? compound_len[sp][s] : (touch[sp][s] != 0 ? 1 : 0);
      if (len == 0) {
        ++s;
        continue;
      }
      if (units_.size() >= static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max())) {
        throw InvalidArgument("too many mapping units");
      }
      const auto index = static_cast<std::int32_t>(units_.size());
      units_.push_back(Unit{static_cast<std::uint32_t>(sp), s, len, 0, 0, PhysicalHandle()});
      for (std::uint32_t t = s; t < s + len; ++t) unit_of_slot_[sp][t] = index;
      s += len;
    }
  }
}

std::size_t SpaceGroup::unit_bytes(const Unit& u) const noexcept {
  return static_cast<std::size_t>(u.nslots) * spaces_[u.space]->page_size();
}

void SpaceGroup::check_usable() const {
  if (closed_) throw InvalidArgument("the SpaceGroup is closed");
  if (!consistent_) throw StateInconsistent("the SpaceGroup is inconsistent and refuses work: " + error_);
}

void SpaceGroup::mark_inconsistent(const std::string& why) noexcept {
  if (!consistent_) return;
  consistent_ = false;
  try {
    error_ = why;
  } catch (...) {
  }
}

std::vector<std::uint32_t> SpaceGroup::validate(const std::vector<std::int64_t>& pages, PageState required,
                                                const char* op) const {
  std::vector<std::uint32_t> out;
  out.reserve(pages.size());
  for (std::int64_t p : pages) {
    if (p < 0 || static_cast<std::uint64_t>(p) >= pages_.size()) {
      throw InvalidArgument(std::string(op) + ": page " + std::to_string(p) + " out of range [0, " +
                            std::to_string(pages_.size()) + ")");
    }
    out.push_back(static_cast<std::uint32_t>(p));
  }
  std::vector<std::uint32_t> sorted = out;
  std::sort(sorted.begin(), sorted.end());
  const auto dup = std::adjacent_find(sorted.begin(), sorted.end());
  if (dup != sorted.end())
    throw InvalidArgument(std::string(op) + ": page " + std::to_string(*dup) + " listed twice");
  for (std::uint32_t p : out) {
    if (pages_[p] != required) {
      throw InvalidArgument(std::string(op) + ": page " + std::to_string(p) + " " + state_phrase(pages_[p]));
    }
  }
  return out;
}

void SpaceGroup::append_units(std::uint32_t page, std::vector<std::uint32_t>* out) const {
  const std::size_t first = out->size();
  for (const Extent& e : extents_) {
    const std::uint64_t ps = spaces_[e.space]->page_size();
    const std::uint64_t lo = e.base + page * e.step;
    const auto& slots = unit_of_slot_[e.space];
    for (std::uint64_t s = lo / ps; s <= (lo + e.length - 1) / ps; ++s) {
      const auto u = static_cast<std::uint32_t>(slots[s]);
      if (out->size() == first || out->back() != u) out->push_back(u);
    }
  }
  std::sort(out->begin() + static_cast<std::ptrdiff_t>(first), out->end());
  out->erase(std::unique(out->begin() + static_cast<std::ptrdiff_t>(first), out->end()), out->end());
}

SpaceGroup::Delta SpaceGroup::delta_of(const std::vector<std::uint32_t>& pages) const {
  std::vector<std::uint32_t> all;
  for (std::uint32_t p : pages) append_units(p, &all);
  std::sort(all.begin(), all.end());
  Delta d;
  for (std::size_t i = 0; i < all.size();) {
    std::size_t j = i;
    while (j < all.size() && all[j] == all[i]) ++j;
    d.units.push_back(all[i]);
    d.counts.push_back(static_cast<std::uint32_t>(j - i));
    i = j;
  }
  return d;
}

void SpaceGroup::swap_units(const std::vector<std::uint32_t>& units, const std::vector<HandleId>* ids) {
  // One batch per run of units in the same space: their spans and handles (the new ones when backing, the
  // current ones when unbacking, so that a rollback can back them again).
  struct Batch {
    std::uint32_t space;
    std::vector<TensorSpace::UnitSpan> spans;
    std::vector<HandleId> ids;
  };
  const bool backing = ids != nullptr;
  std::vector<Batch> done;
  for (std::size_t i = 0; i < units.size();) {
    Batch batch{units_[units[i]].space, {}, {}};
    for (; i < units.size() && units_[units[i]].space == batch.space; ++i) {
      const Unit& u = units_[units[i]];
      batch.spans.push_back({u.start, u.nslots});
      batch.ids.push_back(backing ? (*ids)[i] : u.handle.id());
    }
    TensorSpace& space = *spaces_[batch.space];
    try {
      if (backing) {
        space.back(batch.spans, batch.ids);
      } else {
        space.unback(batch.spans);
      }
    } catch (...) {
      const auto original = std::current_exception();
      if (!space.consistent())
        mark_inconsistent("space " + std::to_string(batch.space) + ": " + space.error());
      for (auto it = done.rbegin(); it != done.rend(); ++it) {
        try {
          if (backing) {
            spaces_[it->space]->unback(it->spans);
          } else {
            spaces_[it->space]->back(it->spans, it->ids);
          }
        } catch (const std::exception& e) {
          mark_inconsistent(std::string(backing ? "rolling back a partial map failed: "
                                                : "rolling back a partial unmap failed: ") +
                            e.what());
        }
      }
      if (!consistent_) throw StateInconsistent("the SpaceGroup is inconsistent: " + error_);
      std::rethrow_exception(original);
    }
    done.push_back(std::move(batch));
  }
}

void SpaceGroup::map_locked(const std::vector<std::uint32_t>& pages) {
  const Delta d = delta_of(pages);
  std::vector<std::uint32_t> fresh;  // units that become backed
  for (std::uint32_t u : d.units) {
    if (units_[u].mapped_refs == 0) fresh.push_back(u);
  }
  // 1. Handles: retained ones (a prepared page shares the unit) or from the pool. Nothing is mapped yet, so
  //    an OutOfMemory here needs no rollback beyond returning what was acquired.
  std::vector<PhysicalHandle> acquired(fresh.size());
  std::vector<HandleId> ids(fresh.size());
  try {
    for (std::size_t k = 0; k < fresh.size(); ++k) {
      Unit& u = units_[fresh[k]];
      if (!u.handle) acquired[k] = pool_->acquire(unit_bytes(u));
      ids[k] = u.handle ? u.handle.id() : acquired[k].id();
    }
  } catch (...) {
    for (auto& h : acquired) pool_->give_back(std::move(h));
    throw;
  }
  // 2. Back the units, all or nothing.
  try {
    back_units(fresh, ids);
  } catch (...) {
    for (auto& h : acquired) {
      if (!h) continue;
      // After a failed rollback nobody can vouch for these handles: never hand them out again.
      if (consistent_) {
        pool_->give_back(std::move(h));
      } else {
        quarantine_.push_back(std::move(h));
      }
    }
    throw;
  }
  // 3. Commit the bookkeeping (cannot fail).
  for (std::size_t k = 0; k < fresh.size(); ++k) {
    Unit& u = units_[fresh[k]];
    if (!u.handle) u.handle = std::move(acquired[k]);
    mapped_bytes_ += unit_bytes(u);
  }
  for (std::size_t i = 0; i < d.units.size(); ++i) units_[d.units[i]].mapped_refs += d.counts[i];
}

void SpaceGroup::prepare_locked(const std::vector<std::uint32_t>& pages) {
  const Delta d = delta_of(pages);
  std::vector<std::uint32_t> gone;  // units whose last mapped page leaves
  for (std::size_t i = 0; i < d.units.size(); ++i) {
    if (units_[d.units[i]].mapped_refs == d.counts[i]) gone.push_back(d.units[i]);
  }
  unback_units(gone);
  for (std::size_t i = 0; i < d.units.size(); ++i) {
    units_[d.units[i]].mapped_refs -= d.counts[i];
    units_[d.units[i]].prepared_refs += d.counts[i];
  }
  for (std::uint32_t u : gone) mapped_bytes_ -= unit_bytes(units_[u]);
}

void SpaceGroup::commit_locked(const std::vector<std::uint32_t>& pages) noexcept {
  std::vector<std::uint32_t> all;
  try {
    const Delta d = delta_of(pages);
    for (std::size_t i = 0; i < d.units.size(); ++i) {
      Unit& u = units_[d.units[i]];
      u.prepared_refs -= d.counts[i];
      if (u.mapped_refs == 0 && u.prepared_refs == 0 && u.handle) pool_->give_back(std::move(u.handle));
    }
  } catch (...) {
    // delta_of could not allocate: the handles stay with their units (a leak into this group, not a lie).
    mark_inconsistent("out of host memory while committing");
  }
}

void SpaceGroup::abort_locked(const std::vector<std::uint32_t>& pages) {
  const Delta d = delta_of(pages);
  std::vector<std::uint32_t> revive;
  std::vector<HandleId> ids;
  for (std::uint32_t u : d.units) {
    if (units_[u].mapped_refs == 0) {
      revive.push_back(u);
      ids.push_back(units_[u].handle.id());
    }
  }
  back_units(revive, ids);
  for (std::size_t i = 0; i < d.units.size(); ++i) {
    units_[d.units[i]].prepared_refs -= d.counts[i];
    units_[d.units[i]].mapped_refs += d.counts[i];
  }
  for (std::uint32_t u : revive) mapped_bytes_ += unit_bytes(units_[u]);
}

void SpaceGroup::record_outcome(std::int64_t tx, Outcome outcome) {
  history_[tx] = outcome;
  history_order_.push_back(tx);
  while (history_order_.size() > history_cap_) {
    history_.erase(history_order_.front());
    history_order_.pop_front();
  }
}

void SpaceGroup::map(const std::vector<std::int64_t>& pages) {
  std::lock_guard<std::mutex> lock(mu_);
  check_usable();
  const auto ps = validate(pages, PageState::kUnmapped, "map");
  if (ps.empty()) return;
  map_locked(ps);
  for (std::uint32_t p : ps) pages_[p] = PageState::kMapped;
  num_mapped_ += ps.size();
}

void SpaceGroup::unmap(const std::vector<std::int64_t>& pages) {
  std::lock_guard<std::mutex> lock(mu_);
  check_usable();
  const auto ps = validate(pages, PageState::kMapped, "unmap");
  if (ps.empty()) return;
  prepare_locked(ps);
  commit_locked(ps);
  for (std::uint32_t p : ps) pages_[p] = PageState::kUnmapped;
  num_mapped_ -= ps.size();
}

void SpaceGroup::prepare(std::int64_t tx, const std::vector<std::int64_t>& pages) {
  std::lock_guard<std::mutex> lock(mu_);
  check_usable();
  if (tx < 0) throw InvalidArgument("prepare: transaction ids are non-negative");
  if (prepared_.count(tx) != 0)
    throw InvalidArgument("prepare: tx " + std::to_string(tx) + " is already prepared");
  const auto h = history_.find(tx);
  if (h != history_.end()) {
    throw InvalidArgument("prepare: tx " + std::to_string(tx) +
                          (h->second == Outcome::kAborted ? " was aborted (a late prepare is refused)"
                                                          : " was already committed"));
  }
  const auto ps = validate(pages, PageState::kMapped, "prepare");
  auto& entry = prepared_[tx];  // reserve the slot first: nothing below may fail after the driver work
  try {
    prepare_locked(ps);
  } catch (...) {
    prepared_.erase(tx);
    throw;
  }
  entry = ps;
  for (std::uint32_t p : ps) pages_[p] = PageState::kPrepared;
  num_mapped_ -= ps.size();
}

void SpaceGroup::commit(std::int64_t tx) {
  std::lock_guard<std::mutex> lock(mu_);
  check_usable();
  auto it = prepared_.find(tx);
  if (it == prepared_.end()) {
    const auto h = history_.find(tx);
    if (h != history_.end() && h->second == Outcome::kCommitted) return;  // idempotent
    if (h != history_.end()) throw InvalidArgument("commit: tx " + std::to_string(tx) + " was aborted");
    throw InvalidArgument("commit: unknown tx " + std::to_string(tx));
  }
  record_outcome(tx, Outcome::kCommitted);  // may allocate: before the irreversible part
  commit_locked(it->second);
  for (std::uint32_t p : it->second) pages_[p] = PageState::kUnmapped;
  prepared_.erase(it);
}

void SpaceGroup::abort(std::int64_t tx) {
  std::lock_guard<std::mutex> lock(mu_);
  check_usable();
  if (tx < 0) throw InvalidArgument("abort: transaction ids are non-negative");
  auto it = prepared_.find(tx);
  if (it == prepared_.end()) {
    const auto h = history_.find(tx);
    if (h != history_.end() && h->second == Outcome::kAborted) return;  // idempotent
    if (h != history_.end())
      throw InvalidArgument("abort: tx " + std::to_string(tx) + " was already committed");
    record_outcome(tx, Outcome::kAborted);  // presumed abort: a later prepare of this tx is refused
    return;
  }
  abort_locked(it->second);  // on failure the tx stays prepared
  for (std::uint32_t p : it->second) pages_[p] = PageState::kMapped;
  num_mapped_ += it->second.size();
  prepared_.erase(it);
  record_outcome(tx, Outcome::kAborted);
}

std::optional<std::string> SpaceGroup::tx_state(std::int64_t tx) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (prepared_.count(tx) != 0) return std::string("prepared");
  const auto h = history_.find(tx);
  if (h == history_.end()) return std::nullopt;
  return std::string(h->second == Outcome::kCommitted ? "committed" : "aborted");
}

bool SpaceGroup::is_mapped(std::int64_t page) const { return page_state(page) == PageState::kMapped; }

PageState SpaceGroup::page_state(std::int64_t page) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (page < 0 || static_cast<std::uint64_t>(page) >= pages_.size()) {
    throw InvalidArgument("page " + std::to_string(page) + " out of range [0, " +
                          std::to_string(pages_.size()) + ")");
  }
  return pages_[static_cast<std::size_t>(page)];
}

std::vector<std::int64_t> SpaceGroup::mapped_pages() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::int64_t> out;
  for (std::size_t p = 0; p < pages_.size(); ++p) {
    if (pages_[p] == PageState::kMapped) out.push_back(static_cast<std::int64_t>(p));
  }
  return out;
}

std::size_t SpaceGroup::num_mapped() const { return read_locked(mu_, num_mapped_); }

std::size_t SpaceGroup::mapped_bytes() const { return read_locked(mu_, mapped_bytes_); }

std::size_t SpaceGroup::held_handles() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::size_t n = 0;
  for (const Unit& u : units_) n += u.handle ? 1 : 0;
  return n;
}

std::size_t SpaceGroup::quarantined_handles() const {
  std::lock_guard<std::mutex> lock(mu_);
  return quarantine_.size();
}

std::vector<UnitInfo> SpaceGroup::page_units(std::int64_t page) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (page < 0 || static_cast<std::uint64_t>(page) >= pages_.size()) {
    throw InvalidArgument("page " + std::to_string(page) + " out of range");
  }
  std::vector<std::uint32_t> units;
  append_units(static_cast<std::uint32_t>(page), &units);
  std::vector<UnitInfo> out;
  for (std::uint32_t u : units) out.push_back({units_[u].space, units_[u].start, units_[u].nslots});
  return out;
}

bool SpaceGroup::consistent() const { return read_locked(mu_, consistent_); }

std::string SpaceGroup::error() const { return read_locked(mu_, error_); }

bool SpaceGroup::closed() const { return read_locked(mu_, closed_); }

}  // namespace elastic_kv

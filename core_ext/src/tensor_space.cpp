// One file over 400 lines on purpose: one class, whose back/unback and their rollbacks share the slot
// table and the quarantine and must be read together (the contract is tensor_space.hpp's).

#include "elastic_kv/tensor_space.hpp"

#include <limits>
#include <string>
#include <utility>

#include "locked.hpp"

namespace elastic_kv {

namespace {

std::string what_of(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& ex) {
    return ex.what();
  } catch (...) {
    return "unknown error";
  }
}

}  // namespace

TensorSpace::TensorSpace(std::shared_ptr<Backend> backend, std::size_t size, std::size_t page_size)
    : backend_(std::move(backend)), page_size_(page_size), num_slots_(0), size_(0) {
  if (!backend_) throw InvalidArgument("TensorSpace needs a backend");
  const std::size_t g = backend_->granularity();
  if (page_size == 0 || page_size % g != 0) {
    throw InvalidArgument("page_size " + std::to_string(page_size) +
                          " is not a positive multiple of the backend granularity " + std::to_string(g));
  }
  if (size == 0) throw InvalidArgument("TensorSpace size must be positive");
  num_slots_ = size / page_size + (size % page_size != 0 ? 1 : 0);
  if (num_slots_ >= std::numeric_limits<std::uint32_t>::max()) throw InvalidArgument("too many slots");
  size_ = num_slots_ * page_size;
  // The largest power of two dividing page_size: a valid (power-of-two) alignment that keeps every slot
  // aligned to its own size when page_size is itself a power of two.
  const std::size_t alignment = page_size & (~page_size + 1);

  slot_zero_ = backend_->zero_page(page_size);
  base_ = backend_->reserve(size_, alignment);
  head_.resize(num_slots_);
  maps_.resize(num_slots_);
  for (std::uint32_t s = 0; s < num_slots_; ++s) {
    head_[s] = s;
    maps_[s].zero = slot_zero_;  // kHole until mapped below
  }
  try {
    for (std::uint32_t s = 0; s < num_slots_; ++s) hole_to_zero(s);
  } catch (...) {
    release_everything();
    throw;
  }
}

TensorSpace::~TensorSpace() { release_everything(); }

void TensorSpace::release_everything() noexcept {
  if (base_ == 0) return;
  // Unmap in as few calls as the backend allows: runs of adjacent known mappings, or one by one.
  std::uint32_t s = 0;
  while (s < num_slots_) {
    const Mapping& m = maps_[s];
    if (m.kind == Kind::kHole) {
      s += m.nslots;
      continue;
    }
    std::uint32_t end = s + m.nslots;
    if (backend_->multi_unmap() && m.kind != Kind::kQuarantined) {
      while (end < num_slots_ && (maps_[end].kind == Kind::kZero || maps_[end].kind == Kind::kHandle)) {
        end += maps_[end].nslots;
      }
    }
    try {
      backend_->unmap(addr(s), bytes(end - s));
    } catch (...) {
      // A quarantined unit may hold nothing at all; anything else is a real cleanup failure.
      if (m.kind != Kind::kQuarantined) backend_->note_cleanup_failure();
      if (end - s > m.nslots) {  // retry the run one mapping at a time
        for (std::uint32_t t = s; t < end; t += maps_[t].nslots) {
          try {
            backend_->unmap(addr(t), bytes(maps_[t].nslots));
          } catch (...) {
            backend_->note_cleanup_failure();
          }
        }
      }
    }
    for (std::uint32_t t = s; t < end; t += maps_[t].nslots) maps_[t].kind = Kind::kHole;
    s = end;
  }
  try {
    backend_->free_va(base_, size_);
  } catch (...) {
    backend_->note_cleanup_failure();
  }
  base_ = 0;
}

SlotState TensorSpace::slot_state(std::size_t slot) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (slot >= num_slots_) {
    throw InvalidArgument("slot " + std::to_string(slot) + " out of range [0, " + std::to_string(num_slots_) +
                          ")");
  }
  switch (maps_[head_[slot]].kind) {
    case Kind::kZero:
      return SlotState::kZero;
    case Kind::kHandle:
      return SlotState::kMapped;
    default:
      return SlotState::kQuarantined;
  }
}

bool TensorSpace::consistent() const { return read_locked(mu_, consistent_); }

std::string TensorSpace::error() const { return read_locked(mu_, error_); }

std::size_t TensorSpace::quarantined_units() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::size_t n = 0;
  for (std::uint32_t s = 0; s < num_slots_; s += maps_[s].nslots) n += maps_[s].kind == Kind::kQuarantined;
  return n;
}

void TensorSpace::attach(const void* owner) {
  std::lock_guard<std::mutex> lock(mu_);
  if (owner_ != nullptr && owner_ != owner)
    throw InvalidArgument("the TensorSpace already belongs to a SpaceGroup");
  owner_ = owner;
}

void TensorSpace::detach(const void* owner) noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  if (owner_ == owner) owner_ = nullptr;
}

void TensorSpace::check_usable() const {
  if (!consistent_) throw StateInconsistent("TensorSpace is inconsistent: " + error_);
}

void TensorSpace::mark_inconsistent(const std::string& why) {
  if (consistent_) {
    consistent_ = false;
    error_ = why;
  }
}

void TensorSpace::quarantine(std::uint32_t start, const std::string& why) noexcept {
  maps_[start].kind = Kind::kQuarantined;
  try {
    mark_inconsistent("unit at slot " + std::to_string(start) + " quarantined: " + why);
  } catch (...) {
    consistent_ = false;
  }
}

void TensorSpace::rethrow_after_rollback(const std::exception_ptr& original) const {
  if (consistent_) std::rethrow_exception(original);
  throw StateInconsistent("rollback failed after '" + what_of(original) + "'; the space is inconsistent (" +
                          error_ + ")");
}

void TensorSpace::set_head(std::uint32_t start, std::uint32_t nslots, Mapping m) {
  for (std::uint32_t s = start; s < start + nslots; ++s) head_[s] = start;
  m.nslots = nslots;
  maps_[start] = std::move(m);
}

std::vector<std::pair<std::size_t, std::size_t>> TensorSpace::runs(const std::vector<UnitSpan>& units) const {
  std::vector<std::pair<std::size_t, std::size_t>> out;
  const bool coalesce = backend_->multi_unmap();
  for (std::size_t i = 0; i < units.size(); ++i) {
    if (coalesce && !out.empty() &&
        units[out.back().second].start + units[out.back().second].nslots == units[i].start) {
      out.back().second = i;
    } else {
      out.emplace_back(i, i);
    }
  }
  return out;
}

void TensorSpace::unmap_run(const std::vector<UnitSpan>& units, std::size_t first, std::size_t last) {
  const std::uint32_t start = units[first].start;
  const std::uint32_t end = units[last].start + units[last].nslots;
  backend_->unmap(addr(start), bytes(end - start));
  for (std::size_t i = first; i <= last; ++i) maps_[units[i].start].kind = Kind::kHole;
}

void TensorSpace::map_accessible(std::uint32_t start, HandleId handle, const char* what) {
  const VAddr va = addr(start);
  const std::size_t n = bytes(maps_[start].nslots);
  backend_->map(va, n, handle);
  try {
    backend_->set_access(va, n);
  } catch (...) {
    const auto original = std::current_exception();
    try {
      backend_->unmap(va, n);
    } catch (...) {
      quarantine(start, std::string(what) + " mapped but set_access and the undoing unmap failed");
    }
    std::rethrow_exception(original);
  }
}

void TensorSpace::hole_to_zero(std::uint32_t start) {
  Mapping& m = maps_[start];
  map_accessible(start, m.zero->id(), "zero page");
  m.kind = Kind::kZero;
}

void TensorSpace::hole_to_handle(std::uint32_t start, HandleId handle) {
  Mapping& m = maps_[start];
  m.handle = handle;  // from here on a failure may leave this handle mapped: remember it
  map_accessible(start, handle, "handle");
  m.kind = Kind::kHandle;
}

bool TensorSpace::restore(std::uint32_t start, Kind kind) noexcept {
  Mapping& m = maps_[start];
  if (m.kind == kind) return true;
  if (m.kind != Kind::kHole) return false;
  try {
    if (kind == Kind::kZero) {
      hole_to_zero(start);
    } else {
      hole_to_handle(start, m.handle);
    }
    return true;
  } catch (...) {
    if (m.kind == Kind::kHole) {
      quarantine(start, kind == Kind::kZero ? "could not restore the zero page (the slot is unmapped)"
                                            : "could not restore the handle (the slot is unmapped)");
    }
    return false;
  }
}

void TensorSpace::remap(const UnitSpan& u, Kind kind, const char* why) noexcept {
  try {
    backend_->unmap(addr(u.start), bytes(u.nslots));
    maps_[u.start].kind = Kind::kHole;
  } catch (...) {
    quarantine(u.start, why);
    return;
  }
  restore(u.start, kind);
}

void TensorSpace::tile_zero(const std::vector<UnitSpan>& units) {
  std::lock_guard<std::mutex> lock(mu_);
  check_usable();
  for (const UnitSpan& u : units) {
    if (u.nslots == 0 || static_cast<std::size_t>(u.start) + u.nslots > num_slots_) {
      throw InvalidArgument("unit out of range of the space");
    }
  }
  for (const UnitSpan& u : units) {
    const std::uint32_t first = head_[u.start];
    const Mapping& cur = maps_[first];
    if (first == u.start && cur.nslots == u.nslots && cur.kind == Kind::kZero) continue;
    const std::uint32_t last_head = head_[u.start + u.nslots - 1];
    const std::uint32_t end = last_head + maps_[last_head].nslots;
    std::vector<std::uint32_t> old_heads;
    for (std::uint32_t s = first; s < end; s += maps_[s].nslots) {
      if (maps_[s].kind != Kind::kZero) throw InvalidArgument("tile_zero: a unit overlaps a backed slot");
      old_heads.push_back(s);
    }
    std::shared_ptr<ZeroPage> unit_zero = backend_->zero_page(bytes(u.nslots));

    // 1. Unmap the zero mappings that overlap the unit (one call when the backend allows).
    if (backend_->multi_unmap() || old_heads.size() == 1) {
      backend_->unmap(addr(first), bytes(end - first));
    } else {
      for (std::size_t i = 0; i < old_heads.size(); ++i) {
        const std::uint32_t h = old_heads[i];
        try {
          backend_->unmap(addr(h), bytes(maps_[h].nslots));
        } catch (...) {
          const auto original = std::current_exception();
          for (std::size_t j = 0; j < i; ++j) restore(old_heads[j], Kind::kZero);
          rethrow_after_rollback(original);
        }
        maps_[h].kind = Kind::kHole;
      }
    }
    // 2. New layout: single slots before and after the unit, one mapping for the unit; all holes for now.
    std::vector<std::uint32_t> new_heads;
    for (std::uint32_t s = first; s < end;) {
      Mapping m;
      m.kind = Kind::kHole;
      if (s == u.start) {
        m.zero = unit_zero;
        set_head(s, u.nslots, std::move(m));
        new_heads.push_back(s);
        s += u.nslots;
      } else {
        m.zero = slot_zero_;
        set_head(s, 1, std::move(m));
        new_heads.push_back(s);
        s += 1;
      }
    }
    // 3. Map the zero pages.
    for (std::size_t i = 0; i < new_heads.size(); ++i) {
      try {
        hole_to_zero(new_heads[i]);
      } catch (...) {
        const auto original = std::current_exception();
        for (std::size_t j = i; j < new_heads.size(); ++j) restore(new_heads[j], Kind::kZero);
        rethrow_after_rollback(original);
      }
    }
  }
}

void TensorSpace::check_units(const std::vector<UnitSpan>& units, Kind expected, const char* op) const {
  const char* what = expected == Kind::kZero ? "an unbacked" : "a backed";
  for (std::size_t i = 0; i < units.size(); ++i) {
    const UnitSpan& u = units[i];
    if (static_cast<std::size_t>(u.start) + u.nslots > num_slots_ || head_[u.start] != u.start ||
        maps_[u.start].nslots != u.nslots || maps_[u.start].kind != expected) {
      throw InvalidArgument(std::string(op) + ": unit at slot " + std::to_string(u.start) + " is not " + what +
                            " unit");
    }
    if (i > 0 && units[i - 1].start >= u.start) throw InvalidArgument(std::string(op) + ": units must be sorted");
  }
}

void TensorSpace::swap_units(const std::vector<UnitSpan>& units, const std::vector<HandleId>* handles) {
  // handles != nullptr: zero -> handle (back); nullptr: handle -> zero (unback). Each run of adjacent units is
  // unmapped in one call where the backend allows it, then every unit of the run is refilled; any failure
  // restores the run's remaining holes and undoes the units already swapped, so the call is all or nothing.
  const bool backing = handles != nullptr;
  const Kind before = backing ? Kind::kZero : Kind::kHandle;
  std::vector<std::size_t> done;
  done.reserve(units.size());
  const auto undo = [&]() noexcept {  // the units already swapped return to `before`, last first
    const char* why =
        backing ? "rollback could not unmap the handle" : "rollback could not unmap the zero page";
    for (auto it = done.rbegin(); it != done.rend(); ++it) remap(units[*it], before, why);
  };
  for (const auto& [first, last] : runs(units)) {
    try {
      unmap_run(units, first, last);
    } catch (...) {
      const auto original = std::current_exception();
      undo();
      rethrow_after_rollback(original);
    }
    for (std::size_t i = first; i <= last; ++i) {
      try {
        if (backing) {
          hole_to_handle(units[i].start, (*handles)[i]);
        } else {
          hole_to_zero(units[i].start);
        }
      } catch (...) {
        const auto original = std::current_exception();
        for (std::size_t j = i; j <= last; ++j) restore(units[j].start, before);
        undo();
        rethrow_after_rollback(original);
      }
      done.push_back(i);
    }
  }
}

void TensorSpace::back(const std::vector<UnitSpan>& units, const std::vector<HandleId>& handles) {
  std::lock_guard<std::mutex> lock(mu_);
  check_usable();
  if (units.size() != handles.size()) throw InvalidArgument("back: one handle per unit");
  check_units(units, Kind::kZero, "back");
  swap_units(units, &handles);
}

void TensorSpace::unback(const std::vector<UnitSpan>& units) {
  std::lock_guard<std::mutex> lock(mu_);
  check_usable();
  check_units(units, Kind::kHandle, "unback");
  swap_units(units, nullptr);
}

bool TensorSpace::unit_quarantined(std::uint32_t start, HandleId* handle) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (start >= num_slots_ || head_[start] != start || maps_[start].kind != Kind::kQuarantined) return false;
  if (handle != nullptr) *handle = maps_[start].handle;
  return true;
}

void TensorSpace::unback_best_effort(const std::vector<UnitSpan>& units) noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  for (const UnitSpan& u : units) {
    if (static_cast<std::size_t>(u.start) + u.nslots > num_slots_ || head_[u.start] != u.start ||
        maps_[u.start].kind != Kind::kHandle) {
      continue;
    }
    remap(u, Kind::kZero, "shutdown could not unmap the handle");
  }
}

}  // namespace elastic_kv

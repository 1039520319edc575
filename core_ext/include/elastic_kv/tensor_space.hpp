// TensorSpace: one reserved virtual range, cut into page slots, whose unbacked slots alias a zero page.
//
// Problem: an engine's KV buffer must live at one address forever (kernels, CUDA graphs and views hold raw
// pointers into it), yet only the pages in use should cost physical memory. A TensorSpace reserves the whole
// range once and swaps, slot by slot, between "backed by a physical handle" and "aliasing the shared zero
// page". The address of a slot never changes; only what is behind it does.
//
// Why a zero page and not a hole: on CUDA an access to an unmapped address is a sticky error that poisons the
// whole context (every later call fails; the process must exit). Padded batches, CUDA-graph replays and null
// block ids do touch unbacked pages, so every unbacked slot is mapped to a zero-filled handle: reads return
// zeros; a stray write lands in the shared zero page (see backend.hpp for what that means).
//
// Mapping units. A physical handle always backs a whole *unit*: a run of slots mapped by one handle (cuMemMap
// cannot map at an offset into a handle, and cuMemUnmap cannot split a mapping). The owning SpaceGroup
// decides the units (one slot, or a compound run of slots for aligned extents) and tile_zero() gives each
// unit one zero mapping of its own size, so that backing a unit costs one unmap + one map + one set_access
// regardless of its size. The price is one zero page per distinct unit size (a 64 MiB compound unit needs a
// 64 MiB zero page).
//
// Costs per unit (H200, 2 MiB): back = unmap(zero) 17 us + map 1 us + set_access 28 us; unback = unmap 17 us
// + map(zero) 1 us + set_access(zero) 28 us. When the backend can unmap several adjacent mappings in one call
// (Backend::multi_unmap), back() and unback() coalesce the unmaps of adjacent units into one call.
//
// Failure handling. back() and unback() are all-or-nothing: when a driver call fails they restore every unit
// they touched and rethrow. If a restoring call fails too, that unit is *quarantined* (its physical state is
// unknown), the space is marked inconsistent and StateInconsistent is thrown; the owner must never reuse the
// quarantined unit's handle. Quarantined units are unmapped (best effort) when the space is destroyed.
//
// Thread safety: every method locks the space's mutex. Lock order: SpaceGroup::mu_ -> TensorSpace::mu_ ->
// (HandlePool::mu_, Backend internals). Only the owning group mutates slots (attach()/detach()).
#pragma once

#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "elastic_kv/backend.hpp"

namespace elastic_kv {

enum class SlotState : std::uint8_t { kZero, kMapped, kQuarantined };

class TensorSpace {
 public:
  // A run of slots backed by one handle (or aliasing one zero mapping of the same size).
  struct UnitSpan {
    std::uint32_t start;
    std::uint32_t nslots;
  };

  // Reserves `size` rounded up to `page_size` and maps a zero page into every slot. `page_size` must be a
  // positive multiple of the backend's granularity (InvalidArgument otherwise). Throws OutOfMemory or
  // DriverError after undoing everything when a driver call fails.
  TensorSpace(std::shared_ptr<Backend> backend, std::size_t size, std::size_t page_size);
  ~TensorSpace();
  TensorSpace(const TensorSpace&) = delete;
  TensorSpace& operator=(const TensorSpace&) = delete;

  const std::shared_ptr<Backend>& backend() const noexcept { return backend_; }
  VAddr base() const noexcept { return base_; }
  std::size_t size() const noexcept { return size_; }
  std::size_t page_size() const noexcept { return page_size_; }
  std::size_t num_slots() const noexcept { return num_slots_; }

  SlotState slot_state(std::size_t slot) const;  // InvalidArgument if out of range
  bool consistent() const;
  std::string error() const;
  std::size_t quarantined_units() const;

  // ---- Used by the owning SpaceGroup (callers hold the group's mutex) ----
  // Claims the space for `owner`; InvalidArgument if another owner holds it.
  void attach(const void* owner);
  void detach(const void* owner) noexcept;
  // Makes each unit exactly one zero mapping of its size (splitting or merging existing zero mappings). The
  // units must not be backed. A failure may leave the space inconsistent (StateInconsistent).
  void tile_zero(const std::vector<UnitSpan>& units);
  // Backs units[i] with handles[i] (sizes must match the unit). Units must be zero-mapped units made by
  // tile_zero() and sorted by start. All or nothing (see the header comment).
  void back(const std::vector<UnitSpan>& units, const std::vector<HandleId>& handles);
  // Returns backed units to their zero mappings. All or nothing; the handles stay owned by the caller.
  void unback(const std::vector<UnitSpan>& units);
  // True if the unit at `start` is quarantined; its handle id (if one may still be mapped) goes to *handle.
  bool unit_quarantined(std::uint32_t start, HandleId* handle) const;
  // Best-effort return of backed units to zero during shutdown: never throws; failures quarantine the unit.
  void unback_best_effort(const std::vector<UnitSpan>& units) noexcept;

 private:
  enum class Kind : std::uint8_t { kZero, kHandle, kHole, kQuarantined };
  struct Mapping {  // valid at the head slot of each mapping
    std::uint32_t nslots = 1;
    Kind kind = Kind::kHole;
    HandleId handle = 0;             // kHandle; otherwise the handle last mapped here (rollback, quarantine)
    std::shared_ptr<ZeroPage> zero;  // the zero page this unit aliases when unbacked
  };

  VAddr addr(std::uint32_t slot) const noexcept { return base_ + static_cast<VAddr>(slot) * page_size_; }
  std::size_t bytes(std::uint32_t nslots) const noexcept {
    return static_cast<std::size_t>(nslots) * page_size_;
  }
  void set_head(std::uint32_t start, std::uint32_t nslots, Mapping m);
  void check_usable() const;
  void mark_inconsistent(const std::string& why);
  // Groups sorted units into runs of adjacent units (of length 1 unless the backend can multi-unmap).
  std::vector<std::pair<std::size_t, std::size_t>> runs(const std::vector<UnitSpan>& units) const;

  // Single-unit transitions. Each either succeeds, or throws leaving the unit in its previous state, or (when
  // its own undo fails) quarantines the unit and throws.
  void unmap_run(const std::vector<UnitSpan>& units, std::size_t first, std::size_t last);  // -> kHole
  // InvalidArgument unless every unit is a sorted, whole unit in state `expected` (op names the caller).
  void check_units(const std::vector<UnitSpan>& units, Kind expected, const char* op) const;
  // The body of back() (handles given) and unback() (nullptr); the caller holds mu_.
  void swap_units(const std::vector<UnitSpan>& units, const std::vector<HandleId>* handles);
  void hole_to_zero(std::uint32_t start);
  void hole_to_handle(std::uint32_t start, HandleId handle);
  // Maps `handle` over the hole at `start` and grants access; if access fails, unmaps it again (quarantining
  // the unit, named by `what` in the reason, when that fails too) and rethrows.
  void map_accessible(std::uint32_t start, HandleId handle, const char* what);
  // Rollback helpers: never throw; a failure quarantines the unit (and restore() returns false).
  // Refills the hole at `start` with `kind`: kZero its zero page, kHandle the handle last mapped there.
  bool restore(std::uint32_t start, Kind kind) noexcept;
  // Unmaps the unit `u`, then restores it to `kind`; a failed unmap quarantines it, `why` the reason.
  void remap(const UnitSpan& u, Kind kind, const char* why) noexcept;
  void quarantine(std::uint32_t start, const std::string& why) noexcept;
  // Rethrows `original` if the space is still consistent, else throws StateInconsistent naming both.
  [[noreturn]] void rethrow_after_rollback(const std::exception_ptr& original) const;
  // Unmaps every mapping and frees the reservation; never throws (failures are counted by the backend).
  void release_everything() noexcept;

  std::shared_ptr<Backend> backend_;
  std::size_t page_size_;
  std::size_t num_slots_;
  std::size_t size_;
  VAddr base_ = 0;

  mutable std::mutex mu_;
  std::vector<std::uint32_t> head_;      // slot -> head slot of the mapping covering it
  std::vector<Mapping> maps_;            // indexed by head slot
  std::shared_ptr<ZeroPage> slot_zero_;  // the page_size zero page (kept so that re-tiling cannot fail on it)
  const void* owner_ = nullptr;
  bool consistent_ = true;
  std::string error_;
};

}  // namespace elastic_kv

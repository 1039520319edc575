// Error types of the elastic-kv data plane.
//
// Problem: the data plane sits between a driver that reports failure as integer codes and Python callers that
// must decide what to do from the *type* of an error alone (retry later, give up on the pool, fix the
// config). Every failure therefore leaves C++ as exactly one of the types below, and the Python binding maps
// each type to one Python exception (see python/bindings.cpp):
//
//   InvalidArgument     -> ValueError                           bad argument; nothing changed
//   OutOfMemory         -> elastic_kv.errors.PoolExhausted      physical memory short; fully rolled back
//   StateInconsistent   -> elastic_kv.errors.StateConsistencyError   a rollback failed; the group refuses
//   work ConfigurationError  -> elastic_kv.errors.ConfigError        driver/library/layout cannot be served
//   DriverError         -> elastic_kv._vmm.BackendError          a driver call failed (not memory); rolled
//   back
//
// Invariant: no code path calls abort()/exit(); a failure that cannot be rolled back becomes
// StateInconsistent.
#pragma once

#include <stdexcept>
#include <string>

namespace elastic_kv {

// Base of every error thrown on purpose by the data plane.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A caller passed an argument that is out of range, misaligned or contradicts the current state (double map,
// unmap of an unmapped page, unknown transaction). Thrown before any state changes.
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

// The driver library, the device or the requested layout cannot be served (no libcuda, no VMM support,
// a page size that is not a multiple of the granularity the driver demands).
class ConfigurationError : public Error {
 public:
  using Error::Error;
};

// A driver call failed. `op` names the backend operation ("map", "create", ...), `code` the driver's code.
// The operation that issued the call has been rolled back when this reaches the caller.
class DriverError : public Error {
 public:
  DriverError(std::string op, int code, const std::string& what)
      : Error(what), op_(std::move(op)), code_(code) {}
  const std::string& op() const noexcept { return op_; }
  int code() const noexcept { return code_; }

 private:
  std::string op_;
  int code_;
};

// Physical memory could not be provided (driver OOM on create or map, or the host backend's budget).
class OutOfMemory : public DriverError {
 public:
  using DriverError::DriverError;
};

// A rollback failed: what the data plane believes and what the device holds may differ. The owning
// space/group is marked inconsistent and refuses further work; the process keeps running.
class StateInconsistent : public Error {
 public:
  using Error::Error;
};

}  // namespace elastic_kv

// A fake GPU driver for the CudaBackend and HipBackend tests: one shared library exporting the CUDA driver
// entry points the backend resolves (cuDriverGetVersion, cuGetProcAddress[_v2] and what it hands out) and the
// HIP runtime entry points (hip*), emulated on host memory (memfd + mmap), with the drivers' rules enforced:
//
//   * a handle is mapped whole at offset 0 (a non-zero offset is INVALID_VALUE, as on the real driver);
//   * mapping over a mapping, unmapping part of a mapping, freeing a reservation that holds mappings fail;
//   * a fresh mapping is inaccessible until SetAccess; fresh memory is filled with 0xAB (device memory is
//     not zeroed), so a zero page that was not explicitly zeroed reads garbage;
//   * CUDA calls fail with CUDA_ERROR_INVALID_CONTEXT unless the primary context is current on the thread;
//   * a budget makes cuMemCreate/hipMemCreate return OUT_OF_MEMORY; fake_fail() fails the nth call of any
//     entry point with a chosen code.
//
// Tests drive it through ctypes (fake_* functions). This is test code: simple, strict, single mutex.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace {

constexpr int kOk = 0;
constexpr int kInvalidValue = 1;
constexpr int kOutOfMemory = 2;
constexpr int kNoDevice = 100;
constexpr int kInvalidDevice = 101;
constexpr int kInvalidContext = 201;
constexpr int kNotFound = 500;
constexpr int kNotSupported = 801;

struct Handle {
  int fd;
  std::size_t size;
  int mappings;
  bool released;
};
struct Mapping {
  std::size_t size;
  std::uint64_t handle;
  bool accessible;
};
struct FailPlan {
  long at = 0;  // absolute call number that fails (0 = none)
  int code = 0;
};

struct State {
  std::mutex mu;
  int devices = 1;
  bool vmm = true;
  bool multi_unmap = true;
  std::size_t granularity = 2u << 20;
  std::size_t budget = 0;  // 0 = unlimited
  std::size_t resident = 0;
  std::uint64_t next_handle = 0x1000;
  std::map<std::uint64_t, std::size_t> reservations;
  std::map<std::uint64_t, Mapping> mappings;
  std::map<std::uint64_t, Handle> handles;
  std::map<std::string, long> calls;
  std::map<std::string, FailPlan> plans;
  int last_requested_version = 0;
  int hip_current_device = 0;
};

State& state() {
  static State s;
  return s;
}

int primary_context_tag = 0;
void* const kPrimary = &primary_context_tag;
thread_local std::vector<void*> context_stack;

// Counts a call and returns the injected code, if any (0 = proceed).
int enter(State& s, const char* name) {
  const long n = ++s.calls[name];
  auto it = s.plans.find(name);
  if (it != s.plans.end() && it->second.at == n) return it->second.code;
  return kOk;
}

bool context_ok() { return !context_stack.empty() && context_stack.back() == kPrimary; }

int reserve(State& s, std::uint64_t* out, std::size_t size, std::size_t align) {
  if (size == 0 || size % s.granularity != 0) return kInvalidValue;
  if (align < s.granularity) align = s.granularity;
  void* p = mmap(nullptr, size + align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return kOutOfMemory;
  const auto raw = reinterpret_cast<std::uintptr_t>(p);
  const std::uintptr_t start = (raw + align - 1) / align * align;
  if (start > raw) munmap(p, start - raw);
  if (raw + size + align > start + size) munmap(reinterpret_cast<void*>(start + size), raw + align - start);
  s.reservations[start] = size;
  *out = start;
  return kOk;
}

int free_va(State& s, std::uint64_t va, std::size_t size) {
  auto it = s.reservations.find(va);
  if (it == s.reservations.end() || it->second != size) return kInvalidValue;
  auto m = s.mappings.lower_bound(va);
  if (m != s.mappings.end() && m->first < va + size) return kInvalidValue;
  munmap(reinterpret_cast<void*>(va), size);
  s.reservations.erase(it);
  return kOk;
}

int create(State& s, std::uint64_t* out, std::size_t size) {
  if (size == 0 || size % s.granularity != 0) return kInvalidValue;
  if (s.budget != 0 && s.resident + size > s.budget) return kOutOfMemory;
  const int fd = memfd_create("fake-gpu", MFD_CLOEXEC);
  if (fd < 0 || ftruncate(fd, static_cast<off_t>(size)) != 0) return kOutOfMemory;
  // Device memory is not zeroed: make that visible.
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  std::memset(p, 0xAB, size);
  munmap(p, size);
  const std::uint64_t id = s.next_handle++;
  s.handles[id] = Handle{fd, size, 0, false};
  s.resident += size;
  *out = id;
  return kOk;
}

void drop_if_unused(State& s, std::map<std::uint64_t, Handle>::iterator it) {
  if (it->second.released && it->second.mappings == 0) {
    s.resident -= it->second.size;
    s.handles.erase(it);
  }
}

int release(State& s, std::uint64_t id) {
  auto it = s.handles.find(id);
  if (it == s.handles.end() || it->second.released) return kInvalidValue;
  close(it->second.fd);
  it->second.released = true;
  drop_if_unused(s, it);
  return kOk;
}

int map(State& s, std::uint64_t va, std::size_t size, std::size_t offset, std::uint64_t id) {
  if (offset != 0) return kInvalidValue;  // the real driver does not map at an offset into a handle either
  auto h = s.handles.find(id);
  if (h == s.handles.end() || h->second.released || h->second.size != size) return kInvalidValue;
  auto r = s.reservations.upper_bound(va);
  if (r == s.reservations.begin()) return kInvalidValue;
  --r;
  if (va + size > r->first + r->second) return kInvalidValue;
  auto next = s.mappings.lower_bound(va);
  if (next != s.mappings.end() && next->first < va + size) return kInvalidValue;
  if (next != s.mappings.begin() && std::prev(next)->first + std::prev(next)->second.size > va)
    return kInvalidValue;
  if (mmap(reinterpret_cast<void*>(va), size, PROT_NONE, MAP_SHARED | MAP_FIXED, h->second.fd, 0) ==
      MAP_FAILED) {
    return kOutOfMemory;
  }
  s.mappings[va] = Mapping{size, id, false};
  ++h->second.mappings;
  return kOk;
}

// The mappings exactly tiling [va, va+size), or empty.
std::vector<std::map<std::uint64_t, Mapping>::iterator> tiles(State& s, std::uint64_t va, std::size_t size) {
  std::vector<std::map<std::uint64_t, Mapping>::iterator> out;
  std::uint64_t cursor = va;
  auto it = s.mappings.find(va);
  while (cursor < va + size) {
    if (it == s.mappings.end() || it->first != cursor) return {};
    out.push_back(it);
    cursor += it->second.size;
    ++it;
  }
  if (cursor != va + size) return {};
  return out;
}

int unmap(State& s, std::uint64_t va, std::size_t size) {
  auto t = tiles(s, va, size);
  if (t.empty() || (!s.multi_unmap && t.size() > 1)) return kInvalidValue;
  mmap(reinterpret_cast<void*>(va), size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE,
       -1, 0);
  for (auto& m : t) {
    auto h = s.handles.find(m->second.handle);
    --h->second.mappings;
    drop_if_unused(s, h);
    s.mappings.erase(m);
  }
  return kOk;
}

int set_access(State& s, std::uint64_t va, std::size_t size, int location_id, int flags) {
  auto t = tiles(s, va, size);
  if (t.empty() || location_id != 0 || flags != 3) return kInvalidValue;
  mprotect(reinterpret_cast<void*>(va), size, PROT_READ | PROT_WRITE);
  for (auto& m : t) m->second.accessible = true;
  return kOk;
}

int memset8(State& s, std::uint64_t va, unsigned char value, std::size_t size) {
  auto t = tiles(s, va, size);
  if (t.empty()) return kInvalidValue;
  for (auto& m : t) {
    if (!m->second.accessible) return kInvalidValue;
  }
  std::memset(reinterpret_cast<void*>(va), value, size);
  return kOk;
}

struct Location {
  int type;
  int id;
};
struct AllocationProp {
  int type;
  int handle_types;
  Location location;
  void* win32;
  unsigned char flags[8];
};
struct AccessDesc {
  Location location;
  int flags;
};

#define GUARD(name)                       \
  State& s = state();                     \
  std::lock_guard<std::mutex> lock(s.mu); \
  if (const int injected = enter(s, name)) return injected

#define NEEDS_CONTEXT() \
  if (!context_ok()) return kInvalidContext

// ---- CUDA entry points (handed out by cuGetProcAddress only) ----
int fake_cuInit(unsigned) {
  GUARD("cuInit");
  return s.devices > 0 ? kOk : kNoDevice;
}
int fake_cuDeviceGet(int* dev, int ordinal) {
  GUARD("cuDeviceGet");
  if (ordinal < 0 || ordinal >= s.devices) return kInvalidDevice;
  *dev = ordinal;
  return kOk;
}
int fake_cuDeviceGetAttribute(int* value, int attribute, int) {
  GUARD("cuDeviceGetAttribute");
  *value = attribute == 102 ? (s.vmm ? 1 : 0) : 0;
  return kOk;
}
int fake_cuDevicePrimaryCtxRetain(void** ctx, int) {
  GUARD("cuDevicePrimaryCtxRetain");
  *ctx = kPrimary;
  return kOk;
}
int fake_cuDevicePrimaryCtxRelease(int) {
  GUARD("cuDevicePrimaryCtxRelease");
  return kOk;
}
int fake_cuCtxGetCurrent(void** ctx) {
  *ctx = context_stack.empty() ? nullptr : context_stack.back();
  return kOk;
}
int fake_cuCtxPushCurrent(void* ctx) {
  context_stack.push_back(ctx);
  return kOk;
}
int fake_cuCtxPopCurrent(void** ctx) {
  if (context_stack.empty()) return kInvalidContext;
  if (ctx != nullptr) *ctx = context_stack.back();
  context_stack.pop_back();
  return kOk;
}
int fake_cuCtxSynchronize() {
  GUARD("cuCtxSynchronize");
  NEEDS_CONTEXT();
  return kOk;
}
int fake_cuMemGetInfo(std::size_t* free, std::size_t* total) {
  GUARD("cuMemGetInfo");
  NEEDS_CONTEXT();
  *total = s.budget != 0 ? s.budget : (std::size_t{80} << 30);
  *free = *total - s.resident;
  return kOk;
}
int fake_cuMemGetAllocationGranularity(std::size_t* g, const AllocationProp* prop, int) {
  GUARD("cuMemGetAllocationGranularity");
  if (prop->type != 1 || prop->location.type != 1) return kInvalidValue;
  *g = s.granularity;
  return kOk;
}
int fake_cuMemAddressReserve(std::uint64_t* ptr, std::size_t size, std::size_t align, std::uint64_t,
                             unsigned long long) {
  GUARD("cuMemAddressReserve");
  NEEDS_CONTEXT();
  return reserve(s, ptr, size, align);
}
int fake_cuMemAddressFree(std::uint64_t ptr, std::size_t size) {
  GUARD("cuMemAddressFree");
  NEEDS_CONTEXT();
  return free_va(s, ptr, size);
}
int fake_cuMemCreate(std::uint64_t* h, std::size_t size, const AllocationProp* prop, unsigned long long) {
  GUARD("cuMemCreate");
  NEEDS_CONTEXT();
  if (prop->type != 1 || prop->location.type != 1 || prop->location.id != 0) return kInvalidValue;
  return create(s, h, size);
}
int fake_cuMemRelease(std::uint64_t h) {
  GUARD("cuMemRelease");
  NEEDS_CONTEXT();
  return release(s, h);
}
int fake_cuMemMap(std::uint64_t va, std::size_t size, std::size_t offset, std::uint64_t h,
                  unsigned long long) {
  GUARD("cuMemMap");
  NEEDS_CONTEXT();
  return map(s, va, size, offset, h);
}
int fake_cuMemUnmap(std::uint64_t va, std::size_t size) {
  GUARD("cuMemUnmap");
  NEEDS_CONTEXT();
  return unmap(s, va, size);
}
int fake_cuMemSetAccess(std::uint64_t va, std::size_t size, const AccessDesc* desc, std::size_t count) {
  GUARD("cuMemSetAccess");
  NEEDS_CONTEXT();
  if (count != 1 || desc->location.type != 1) return kInvalidValue;
  return set_access(s, va, size, desc->location.id, desc->flags);
}
int fake_cuMemsetD8(std::uint64_t va, unsigned char value, std::size_t size) {
  GUARD("cuMemsetD8");
  NEEDS_CONTEXT();
  return memset8(s, va, value, size);
}
int fake_cuGetErrorName(int code, const char** name) {
  switch (code) {
    case kOk:
      *name = "CUDA_SUCCESS";
      break;
    case kInvalidValue:
      *name = "CUDA_ERROR_INVALID_VALUE";
      break;
    case kOutOfMemory:
      *name = "CUDA_ERROR_OUT_OF_MEMORY";
      break;
    case kNoDevice:
      *name = "CUDA_ERROR_NO_DEVICE";
      break;
    case kInvalidDevice:
      *name = "CUDA_ERROR_INVALID_DEVICE";
      break;
    case kInvalidContext:
      *name = "CUDA_ERROR_INVALID_CONTEXT";
      break;
    default:
      *name = "CUDA_ERROR_UNKNOWN";
      break;
  }
  return kOk;
}

struct Entry {
  const char* name;
  void* fn;
};
const Entry kCudaEntries[] = {
    {"cuInit", reinterpret_cast<void*>(&fake_cuInit)},
    {"cuDeviceGet", reinterpret_cast<void*>(&fake_cuDeviceGet)},
    {"cuDeviceGetAttribute", reinterpret_cast<void*>(&fake_cuDeviceGetAttribute)},
    {"cuDevicePrimaryCtxRetain", reinterpret_cast<void*>(&fake_cuDevicePrimaryCtxRetain)},
    {"cuDevicePrimaryCtxRelease", reinterpret_cast<void*>(&fake_cuDevicePrimaryCtxRelease)},
    {"cuCtxGetCurrent", reinterpret_cast<void*>(&fake_cuCtxGetCurrent)},
    {"cuCtxPushCurrent", reinterpret_cast<void*>(&fake_cuCtxPushCurrent)},
    {"cuCtxPopCurrent", reinterpret_cast<void*>(&fake_cuCtxPopCurrent)},
    {"cuCtxSynchronize", reinterpret_cast<void*>(&fake_cuCtxSynchronize)},
    {"cuMemGetInfo", reinterpret_cast<void*>(&fake_cuMemGetInfo)},
    {"cuMemGetAllocationGranularity", reinterpret_cast<void*>(&fake_cuMemGetAllocationGranularity)},
    {"cuMemAddressReserve", reinterpret_cast<void*>(&fake_cuMemAddressReserve)},
    {"cuMemAddressFree", reinterpret_cast<void*>(&fake_cuMemAddressFree)},
    {"cuMemCreate", reinterpret_cast<void*>(&fake_cuMemCreate)},
    {"cuMemRelease", reinterpret_cast<void*>(&fake_cuMemRelease)},
    {"cuMemMap", reinterpret_cast<void*>(&fake_cuMemMap)},
    {"cuMemUnmap", reinterpret_cast<void*>(&fake_cuMemUnmap)},
    {"cuMemSetAccess", reinterpret_cast<void*>(&fake_cuMemSetAccess)},
    {"cuMemsetD8", reinterpret_cast<void*>(&fake_cuMemsetD8)},
    {"cuGetErrorName", reinterpret_cast<void*>(&fake_cuGetErrorName)},
};

int lookup(const char* symbol, void** pfn, int version) {
  {
    State& s = state();
    std::lock_guard<std::mutex> lock(s.mu);
    s.last_requested_version = version;
    if (const int injected = enter(s, symbol)) {  // lets a test make one entry point "missing"
      *pfn = nullptr;
      return injected;
    }
  }
  for (const Entry& e : kCudaEntries) {
    if (std::strcmp(e.name, symbol) == 0) {
      *pfn = e.fn;
      return kOk;
    }
  }
  *pfn = nullptr;
  return kNotFound;
}

}  // namespace

extern "C" {

// ---- control interface for the tests (ctypes) ----
void fake_configure(int devices, int vmm, int multi_unmap, std::size_t granularity, std::size_t budget) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.devices = devices;
  s.vmm = vmm != 0;
  s.multi_unmap = multi_unmap != 0;
  s.granularity = granularity;
  s.budget = budget;
  s.plans.clear();
}
void fake_fail(const char* name, long nth, int code) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.plans[name] = FailPlan{s.calls[name] + nth, code};
}
long fake_calls(const char* name) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.calls[name];
}
long fake_live_handles() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  long n = 0;
  for (auto& [id, h] : s.handles) n += h.released ? 0 : 1;
  return n;
}
long fake_live_mappings() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return static_cast<long>(s.mappings.size());
}
long fake_live_reservations() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return static_cast<long>(s.reservations.size());
}
int fake_last_requested_version() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.last_requested_version;
}
int fake_push_foreign_context() {  // what torch on another device would leave current on this thread
  static int foreign = 0;
  context_stack.push_back(&foreign);
  return 0;
}
int fake_current_is_foreign() { return !context_stack.empty() && context_stack.back() != kPrimary; }
void fake_pop_context() {
  if (!context_stack.empty()) context_stack.pop_back();
}

// ---- CUDA driver exports ----
int cuDriverGetVersion(int* version) {
  *version = 12080;
  return kOk;
}
int cuGetProcAddress_v2(const char* symbol, void** pfn, int version, unsigned long long, int* status) {
  const int r = lookup(symbol, pfn, version);
  if (status != nullptr) *status = r == kOk ? 0 : 1;
  return r;
}
int cuGetProcAddress(const char* symbol, void** pfn, int version, unsigned long long) {
  return lookup(symbol, pfn, version);
}

// ---- HIP runtime exports ----
int hipInit(unsigned) {
  GUARD("hipInit");
  return s.devices > 0 ? kOk : kNoDevice;
}
int hipGetDeviceCount(int* count) {
  GUARD("hipGetDeviceCount");
  *count = s.devices;
  return kOk;
}
int hipGetDevice(int* device) {
  GUARD("hipGetDevice");
  *device = s.hip_current_device;
  return kOk;
}
int hipSetDevice(int device) {
  GUARD("hipSetDevice");
  if (device < 0 || device >= s.devices) return kInvalidDevice;
  s.hip_current_device = device;
  return kOk;
}
int hipDeviceSynchronize() {
  GUARD("hipDeviceSynchronize");
  return kOk;
}
int hipMemGetInfo(std::size_t* free, std::size_t* total) {
  GUARD("hipMemGetInfo");
  *total = s.budget != 0 ? s.budget : (std::size_t{64} << 30);
  *free = *total - s.resident;
  return kOk;
}
int hipMemGetAllocationGranularity(std::size_t* g, const AllocationProp* prop, int) {
  GUARD("hipMemGetAllocationGranularity");
  if (!s.vmm) return kNotSupported;
  if (prop->type != 1 || prop->location.type != 1) return kInvalidValue;
  *g = s.granularity;
  return kOk;
}
int hipMemAddressReserve(void** ptr, std::size_t size, std::size_t align, void*, unsigned long long) {
  GUARD("hipMemAddressReserve");
  std::uint64_t va = 0;
  const int r = reserve(s, &va, size, align);
  *ptr = reinterpret_cast<void*>(va);
  return r;
}
int hipMemAddressFree(void* ptr, std::size_t size) {
  GUARD("hipMemAddressFree");
  return free_va(s, reinterpret_cast<std::uintptr_t>(ptr), size);
}
int hipMemCreate(void** h, std::size_t size, const AllocationProp* prop, unsigned long long) {
  GUARD("hipMemCreate");
  if (prop->type != 1 || prop->location.type != 1) return kInvalidValue;
  std::uint64_t id = 0;
  const int r = create(s, &id, size);
  *h = reinterpret_cast<void*>(id);
  return r;
}
int hipMemRelease(void* h) {
  GUARD("hipMemRelease");
  return release(s, reinterpret_cast<std::uintptr_t>(h));
}
int hipMemMap(void* ptr, std::size_t size, std::size_t offset, void* h, unsigned long long) {
  GUARD("hipMemMap");
  return map(s, reinterpret_cast<std::uintptr_t>(ptr), size, offset, reinterpret_cast<std::uintptr_t>(h));
}
int hipMemUnmap(void* ptr, std::size_t size) {
  GUARD("hipMemUnmap");
  return unmap(s, reinterpret_cast<std::uintptr_t>(ptr), size);
}
int hipMemSetAccess(void* ptr, std::size_t size, const AccessDesc* desc, std::size_t count) {
  GUARD("hipMemSetAccess");
  if (count != 1 || desc->location.type != 1) return kInvalidValue;
  return set_access(s, reinterpret_cast<std::uintptr_t>(ptr), size, desc->location.id, desc->flags);
}
int hipMemsetD8(void* ptr, unsigned char value, std::size_t size) {
  GUARD("hipMemsetD8");
  return memset8(s, reinterpret_cast<std::uintptr_t>(ptr), value, size);
}
const char* hipGetErrorName(int code) {
  switch (code) {
    case kOk:
      return "hipSuccess";
    case kOutOfMemory:
      return "hipErrorOutOfMemory";
    case kNotSupported:
      return "hipErrorNotSupported";
    case kInvalidDevice:
      return "hipErrorInvalidDevice";
    default:
      return "hipErrorInvalidValue";
  }
}

}  // extern "C"

// Multi-threaded stress driver of the data plane, for the sanitizer builds (core_ext/tests/sanitize.sh).
//
// Workload: two groups share one HandlePool on a FaultInjectingBackend over a HostBackend. Four workers map,
// unmap, prepare/commit/abort and pre-map (map_async + collect) their own pages and write/verify page data
// through raw pointers; neighbouring pages of different workers share slots (3 MiB pages over 2 MiB slots).
// An injector thread keeps arming single failures (create/map/set_access/unmap/release, OOM or error), which
// the data plane must roll back while the other threads keep working. It arms the next failure only after
// the previous one fired and every worker has finished the operation it was in (its rollback included), so
// that two failures never meet in one rollback (that case -- a failed rollback -- is the fault-injection
// suite's business). An observer thread reads every statistic concurrently. At the end every group must be
// consistent, every mapped page must hold its last write, and closing everything must return the backend to
// zero handles and reservations.
//
// Exit status 0 = all invariants held; 1 = an invariant failed (message on stderr). Under -fsanitize=thread
// or -fsanitize=address the sanitizer reports (and fails) on races and memory errors.
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "elastic_kv/fault_backend.hpp"
#include "elastic_kv/handle_pool.hpp"
#include "elastic_kv/host_backend.hpp"
#include "elastic_kv/space_group.hpp"
#include "elastic_kv/tensor_space.hpp"

using namespace elastic_kv;  // NOLINT(build/namespaces): a test driver

namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;
constexpr int kWorkers = 4;
constexpr int kPagesPerWorker = 6;
constexpr int kPages = kWorkers * kPagesPerWorker;

[[noreturn]] void fail(const std::string& what) { throw std::runtime_error(what); }

struct Pool {
  std::shared_ptr<SpaceGroup> group;
  std::shared_ptr<TensorSpace> space;
  std::uint64_t step;
  std::uint64_t length;

  unsigned char* page_bytes(int page) const {
    return reinterpret_cast<unsigned char*>(static_cast<std::uintptr_t>(space->base() + page * step));
  }
  void write(int page, unsigned char value) const { std::memset(page_bytes(page), value, length); }
  bool holds(int page, unsigned char value) const {
    const unsigned char* p = page_bytes(page);
    for (std::uint64_t i = 0; i < length; i += 4093) {
      if (p[i] != value) return false;
    }
    return p[length - 1] == value;
  }
};

Pool make_pool(const std::shared_ptr<Backend>& backend, const std::shared_ptr<HandlePool>& pool,
               std::uint64_t length) {
  auto space = std::make_shared<TensorSpace>(backend, kPages * length, 2 * kMiB);
  auto group =
      std::make_shared<SpaceGroup>(std::vector<std::shared_ptr<TensorSpace>>{space},
                                   std::vector<ExtentSpec>{{0, 0, length, length}}, kPages, pool, 64);
  return Pool{group, space, length, length};
}

struct Progress {
  std::atomic<std::uint64_t> rounds[kWorkers] = {};
  std::atomic<bool> finished[kWorkers] = {};
};

// One worker's pages and what it last wrote there (0 = not mapped as far as the worker knows).
void worker(const Pool& pool, int id, int rounds, std::atomic<bool>* failed, std::string* error,
            Progress* progress) {
  std::mt19937 rng(static_cast<unsigned>(id) * 7919u + 1u);
  std::vector<unsigned char> value(kPages, 0);
  const int first = (id % kWorkers) * kPagesPerWorker;
  std::int64_t next_tx = static_cast<std::int64_t>(id) * 1000000;
  try {
    for (int round = 0; round < rounds && !failed->load(); ++round, progress->rounds[id].fetch_add(1)) {
      const int page = first + static_cast<int>(rng() % kPagesPerWorker);
      const auto roll = static_cast<unsigned>(rng() % 100);
      const auto v = static_cast<unsigned char>(1 + (round + id) % 250);
      try {
        if (value[page] == 0) {
          if (roll < 30) {
            pool.group->map_async({page});
            pool.group->collect(true);
            if (!pool.group->is_mapped(page)) continue;  // the request failed (injected): all or nothing
          } else {
            pool.group->map({page});
          }
          pool.write(page, v);
          value[page] = v;
        } else if (roll < 40) {
          const std::int64_t tx = next_tx++;
          pool.group->prepare(tx, {page});
          if (roll < 20) {
            pool.group->commit(tx);
            value[page] = 0;
          } else {
            for (int attempt = 0;; ++attempt) {  // an injected failure leaves the tx prepared: retry
              try {
                pool.group->abort(tx);
                break;
              } catch (const DriverError&) {
                if (attempt > 100) throw;
              }
            }
            if (!pool.holds(page, value[page])) fail("page lost its data across prepare/abort");
          }
        } else {
          if (!pool.holds(page, value[page])) fail("mapped page lost its data");
          pool.group->unmap({page});
          value[page] = 0;
        }
      } catch (const DriverError&) {
        // Injected (OutOfMemory is a DriverError too): the operation was rolled back, nothing changed.
        if (value[page] != 0 && !pool.holds(page, value[page])) fail("a rolled-back operation changed data");
      }
    }
    for (int p = first; p < first + kPagesPerWorker; ++p) {
      if (value[p] != 0 && !pool.holds(p, value[p])) fail("final check: page lost its data");
    }
  } catch (const std::exception& e) {
    failed->store(true);
    *error = "worker " + std::to_string(id) + ": " + e.what();
  }
  progress->finished[id].store(true);
}

}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 400;
  auto host = std::make_shared<HostBackend>(2 * kMiB, 0, true);
  auto fault = std::make_shared<FaultInjectingBackend>(host);
  std::atomic<bool> failed{false};
  std::vector<std::string> errors(kWorkers + 2);
  {
    auto handles = std::make_shared<HandlePool>(fault, 16 * kMiB);
    // Group a: 3 MiB pages (shared slots); group b: 4 MiB pages (compound units). Shared pool and backend.
    const Pool a = make_pool(fault, handles, 3 * kMiB);
    const Pool b = make_pool(fault, handles, 4 * kMiB);
    std::atomic<bool> done{false};
    Progress progress;

    std::vector<std::thread> threads;
    for (int w = 0; w < kWorkers; ++w) {
      threads.emplace_back(worker, std::cref(w < 3 ? a : b), w, rounds, &failed, &errors[w], &progress);
    }
    std::thread injector([&] {
      std::mt19937 rng(42);
      const Op ops[] = {Op::kCreate, Op::kMap, Op::kSetAccess, Op::kUnmap, Op::kRelease};
      while (!done.load()) {
        const Op op = ops[rng() % 5];
        const std::size_t fired = fault->injected(op);
        fault->arm(op, 1 + static_cast<long>(rng() % 20), 1, rng() % 2 == 0);
        while (!done.load() && fault->injected(op) == fired)
          std::this_thread::sleep_for(std::chrono::microseconds(20));
        // Quiescence: every worker has completed the round it was in when the failure fired.
        std::uint64_t seen[kWorkers];
        for (int w = 0; w < kWorkers; ++w) seen[w] = progress.rounds[w].load();
        for (int w = 0; w < kWorkers; ++w) {
          while (!done.load() && !progress.finished[w].load() && progress.rounds[w].load() == seen[w]) {
            std::this_thread::sleep_for(std::chrono::microseconds(20));
          }
        }
      }
      fault->disarm();
    });
    std::thread observer([&] {
      std::size_t sink = 0;
      while (!done.load()) {
        for (const Pool* p : {&a, &b}) {
          sink += p->group->mapped_bytes() + p->group->num_mapped() + p->group->held_handles();
          sink += p->group->mapped_pages().size() + static_cast<std::size_t>(p->group->consistent());
          sink += static_cast<std::size_t>(p->space->slot_state(sink % p->space->num_slots()));
        }
        sink += handles->cached_bytes() + handles->hits() + fault->live_handles();
        std::this_thread::sleep_for(std::chrono::microseconds(20));
      }
      std::printf("observer: %zu\n", sink % 2);
    });
    for (auto& t : threads) t.join();
    done.store(true);
    injector.join();
    observer.join();

    for (const Pool* p : {&a, &b}) {
      if (!p->group->consistent()) {
        failed.store(true);
        errors[kWorkers] = "a group became inconsistent: " + p->group->error();
      }
      p->group->close();
    }
    std::printf(
        "pool: hits %zu misses %zu cached %zu; injected create %zu map %zu set_access %zu unmap %zu "
        "release %zu\n",
        handles->hits(), handles->misses(), handles->cached_handles(), fault->injected(Op::kCreate),
        fault->injected(Op::kMap), fault->injected(Op::kSetAccess), fault->injected(Op::kUnmap),
        fault->injected(Op::kRelease));
  }
  if (fault->live_handles() != 0 || fault->live_reservations() != 0) {
    failed.store(true);
    errors[kWorkers + 1] = "leak: " + std::to_string(fault->live_handles()) + " handles, " +
                           std::to_string(fault->live_reservations()) + " reservations";
  }
  for (const auto& e : errors) {
    if (!e.empty()) std::fprintf(stderr, "FAIL %s\n", e.c_str());
  }
  std::printf("%s\n", failed.load() ? "stress: FAILED" : "stress: OK");
  return failed.load() ? 1 : 0;
}

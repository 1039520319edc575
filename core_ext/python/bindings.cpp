// elastic_kv._vmm: the pybind11 face of the data plane.
//
// Contract (docs/ARCHITECTURE.md, "Data plane"): every call that may reach the driver releases the GIL; C++
// exception types map one-to-one onto Python types (errors.hpp); tensors leave as DLPack capsules, so the
// module links neither torch nor libcuda. Background threads of the data plane never call into Python.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "dlpack_capsule.hpp"
#include "elastic_kv/backend.hpp"
#include "elastic_kv/cuda_backend.hpp"
#include "elastic_kv/fault_backend.hpp"
#include "elastic_kv/handle_pool.hpp"
#include "elastic_kv/hip_backend.hpp"
#include "elastic_kv/host_backend.hpp"
#include "elastic_kv/raw_bench.hpp"
#include "elastic_kv/space_group.hpp"
#include "elastic_kv/tensor_space.hpp"

namespace py = pybind11;
using namespace elastic_kv;  // NOLINT(build/namespaces): binding code names every type of the library

namespace {

using Release = py::call_guard<py::gil_scoped_release>;

// A getter that drops the GIL while it waits for an object's mutex: a group's mutex can be held for a whole
// driver batch by another thread (which never needs the GIL), and other Python threads must not stall on us.
template <class T, class R>
auto unlocked(R (T::*getter)() const) {
  return [getter](const T& self) {
    py::gil_scoped_release release;
    return (self.*getter)();
  };
}

// Python exception classes, looked up once at import (they live as long as the interpreter).
struct ErrorTypes {
  PyObject* pool_exhausted = nullptr;
  PyObject* state_consistency = nullptr;
  PyObject* config = nullptr;
  PyObject* backend = nullptr;
};

ErrorTypes& error_types() {
  static ErrorTypes types;  // filled once by init_errors() under the GIL; read-only afterwards
  return types;
}

void translate(std::exception_ptr p) {
  const ErrorTypes& t = error_types();
  try {
    if (p) std::rethrow_exception(p);
  } catch (const InvalidArgument& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
  } catch (const OutOfMemory& e) {
    PyErr_SetString(t.pool_exhausted, e.what());
  } catch (const StateInconsistent& e) {
    PyErr_SetString(t.state_consistency, e.what());
  } catch (const ConfigurationError& e) {
    PyErr_SetString(t.config, e.what());
  } catch (const DriverError& e) {
    PyErr_SetString(t.backend, e.what());
  }
}

void init_errors(py::module_& m) {
  py::module_ errors = py::module_::import("elastic_kv.errors");
  ErrorTypes& t = error_types();
  t.pool_exhausted = py::object(errors.attr("PoolExhausted")).release().ptr();
  t.state_consistency = py::object(errors.attr("StateConsistencyError")).release().ptr();
  t.config = py::object(errors.attr("ConfigError")).release().ptr();
  t.backend = PyErr_NewExceptionWithDoc("elastic_kv._vmm.BackendError",
                                        "A driver call failed for a reason other than memory; the operation "
                                        "was rolled back and state is unchanged.",
                                        PyExc_RuntimeError, nullptr);
  if (t.backend == nullptr) throw py::error_already_set();
  m.attr("BackendError") =
      py::handle(t.backend);  // the module keeps its own reference; ours is never dropped
  py::handle(t.backend).inc_ref();
  py::register_exception_translator(&translate);
}

py::tuple device_tuple(const Device& d) {
  const char* kind = d.type == DeviceType::kCUDA ? "cuda" : d.type == DeviceType::kROCM ? "rocm" : "cpu";
  return py::make_tuple(kind, d.id);
}

const char* slot_state_name(SlotState s) {
  switch (s) {
    case SlotState::kZero:
      return "zero";
    case SlotState::kMapped:
      return "mapped";
    default:
      return "quarantined";
  }
}

const char* page_state_name(PageState s) {
  switch (s) {
    case PageState::kUnmapped:
      return "unmapped";
    case PageState::kMapped:
      return "mapped";
    case PageState::kPending:
      return "pending";
    default:
      return "prepared";
  }
}

std::vector<ExtentSpec> to_extents(
    const std::vector<std::tuple<std::int64_t, std::int64_t, std::int64_t, std::int64_t>>& raw) {
  std::vector<ExtentSpec> out;
  for (const auto& [space, base, step, length] : raw) {
    if (space < 0 || base < 0 || step < 0 || length < 0) {
      throw InvalidArgument("extent fields (space, base, step, length) must be non-negative");
    }
    out.push_back({static_cast<std::size_t>(space), static_cast<std::uint64_t>(base),
                   static_cast<std::uint64_t>(step), static_cast<std::uint64_t>(length)});
  }
  return out;
}

std::size_t non_negative(std::int64_t v, const char* what) {
  if (v < 0) throw InvalidArgument(std::string(what) + " must be non-negative");
  return static_cast<std::size_t>(v);
}

void bind_backends(py::module_& m) {
  py::class_<Backend, std::shared_ptr<Backend>>(
      m, "Backend", "A virtual-memory backend (see HostBackend, CudaBackend, ...).")
      .def_property_readonly("name", &Backend::name)
      .def_property_readonly("device", [](const Backend& b) { return device_tuple(b.device()); })
      .def_property_readonly("granularity", &Backend::granularity)
      .def_property_readonly("multi_unmap", &Backend::multi_unmap)
      .def_property_readonly("live_handles", &Backend::live_handles)
      .def_property_readonly("live_bytes", &Backend::live_bytes)
      .def_property_readonly("live_reservations", &Backend::live_reservations)
      .def_property_readonly("cleanup_failures", &Backend::cleanup_failures)
      .def(
          "calls", [](const Backend& b, const std::string& op) { return b.calls(op_from_name(op)); },
          py::arg("op"))
      .def(
          "mem_info",
          [](Backend& b) {
            const MemInfo info = b.mem_info();
            return std::make_pair(info.free, info.total);
          },
          Release())
      .def("synchronize", &Backend::synchronize, Release())
      .def("__repr__", [](const Backend& b) {
        return "<elastic_kv._vmm." + b.name() + " backend, granularity " + std::to_string(b.granularity()) +
               ">";
      });

  py::class_<HostBackend, Backend, std::shared_ptr<HostBackend>>(m, "HostBackend")
      .def(py::init([](std::int64_t granularity, std::int64_t physical_budget, bool multi_unmap) {
             return std::make_shared<HostBackend>(non_negative(granularity, "granularity"),
                                                  non_negative(physical_budget, "physical_budget"),
                                                  multi_unmap);
           }),
           py::arg("granularity") = 0, py::arg("physical_budget") = 0, py::arg("multi_unmap") = true)
      .def_property_readonly("physical_budget", &HostBackend::physical_budget)
      .def_property_readonly("resident_bytes", &HostBackend::resident_bytes);

  py::class_<CudaBackend, Backend, std::shared_ptr<CudaBackend>>(m, "CudaBackend")
      .def(py::init([](int device, const std::string& library, std::optional<bool> multi_unmap) {
             return std::make_shared<CudaBackend>(device, library, multi_unmap);
           }),
           py::arg("device") = 0, py::arg("library") = "libcuda.so.1", py::arg("multi_unmap") = py::none(),
           Release())
      .def_property_readonly("driver_version", &CudaBackend::driver_version);

  py::class_<HipBackend, Backend, std::shared_ptr<HipBackend>>(m, "HipBackend")
      .def(py::init([](int device, const std::string& library, std::optional<bool> multi_unmap) {
             return std::make_shared<HipBackend>(device, library, multi_unmap);
           }),
           py::arg("device") = 0, py::arg("library") = "libamdhip64.so", py::arg("multi_unmap") = py::none(),
           Release());

  py::class_<FaultInjectingBackend, Backend, std::shared_ptr<FaultInjectingBackend>>(m,
                                                                                     "FaultInjectingBackend")
      .def(py::init<std::shared_ptr<Backend>>(), py::arg("inner"))
      .def_property_readonly("inner", &FaultInjectingBackend::inner)
      .def(
          "fail",
          [](FaultInjectingBackend& b, const std::string& op, long nth, long times,
             const std::string& error) {
            if (error != "oom" && error != "error") throw InvalidArgument("error must be 'oom' or 'error'");
            b.arm(op_from_name(op), nth, times, error == "oom");
          },
          py::arg("op"), py::arg("nth") = 1, py::arg("times") = 1, py::arg("error") = "oom")
      .def(
          "delay",
          [](FaultInjectingBackend& b, const std::string& op, double seconds) {
            if (!(seconds >= 0)) throw InvalidArgument("a delay must be non-negative");
            b.set_delay(op_from_name(op), static_cast<long>(seconds * 1e6));
          },
          py::arg("op"), py::arg("seconds"))
      .def("clear", &FaultInjectingBackend::disarm)
      .def(
          "injected",
          [](const FaultInjectingBackend& b, const std::string& op) { return b.injected(op_from_name(op)); },
          py::arg("op"));
}

void bind_pool(py::module_& m) {
  py::class_<HandlePool, std::shared_ptr<HandlePool>>(m, "HandlePool")
      .def(py::init([](std::shared_ptr<Backend> backend, std::int64_t max_cached_bytes) {
             return std::make_shared<HandlePool>(std::move(backend),
                                                 non_negative(max_cached_bytes, "max_cached_bytes"));
           }),
           py::arg("backend"), py::arg("max_cached_bytes"))
      .def_property_readonly("backend", &HandlePool::backend)
      .def_property("max_cached_bytes", &HandlePool::max_cached_bytes,
                    [](HandlePool& p, std::int64_t v) {
                      const std::size_t bytes = non_negative(v, "max_cached_bytes");
                      py::gil_scoped_release release;
                      p.set_max_cached_bytes(bytes);
                    })
      .def_property_readonly("cached_handles", &HandlePool::cached_handles)
      .def_property_readonly("cached_bytes", &HandlePool::cached_bytes)
      .def_property_readonly("hits", &HandlePool::hits)
      .def_property_readonly("misses", &HandlePool::misses)
      .def_property_readonly("failed_releases", &HandlePool::failed_releases)
      .def(
          "trim",
          [](HandlePool& p, std::int64_t keep_bytes) {
            const std::size_t keep = non_negative(keep_bytes, "keep_bytes");
            py::gil_scoped_release release;
            return p.trim(keep);
          },
          py::arg("keep_bytes") = 0);
}

void bind_space(py::module_& m) {
  py::class_<TensorSpace, std::shared_ptr<TensorSpace>>(m, "TensorSpace")
      .def(py::init([](std::shared_ptr<Backend> backend, std::int64_t size, std::int64_t page_size) {
             const std::size_t s = non_negative(size, "size");
             const std::size_t ps = non_negative(page_size, "page_size");
             py::gil_scoped_release release;
             return std::make_shared<TensorSpace>(std::move(backend), s, ps);
           }),
           py::arg("backend"), py::arg("size"), py::arg("page_size"))
      .def_property_readonly("backend", &TensorSpace::backend)
      .def_property_readonly("base", &TensorSpace::base)
      .def_property_readonly("size", &TensorSpace::size)
      .def_property_readonly("page_size", &TensorSpace::page_size)
      .def_property_readonly("num_slots", &TensorSpace::num_slots)
      .def_property_readonly("consistent", unlocked(&TensorSpace::consistent))
      .def_property_readonly("error", unlocked(&TensorSpace::error))
      .def_property_readonly("quarantined_units", unlocked(&TensorSpace::quarantined_units))
      .def(
          "slot_state",
          [](const TensorSpace& s, std::int64_t slot) {
            if (slot < 0) throw InvalidArgument("slot must be non-negative");
            py::gil_scoped_release release;
            return slot_state_name(s.slot_state(static_cast<std::size_t>(slot)));
          },
          py::arg("slot"))
      .def("__dlpack__", &make_dlpack_capsule, py::arg("stream") = py::none(),
           py::arg("max_version") = py::none(), py::arg("dl_device") = py::none())
      .def("__dlpack_device__",
           [](const TensorSpace& s) {
             const Device d = s.backend()->device();
             return py::make_tuple(static_cast<int>(d.type), d.id);
           })
      .def("__repr__", [](const TensorSpace& s) {
        return "<TensorSpace base=0x" + py::str("{:x}").format(s.base()).cast<std::string>() +
               " size=" + std::to_string(s.size()) + " page_size=" + std::to_string(s.page_size()) + ">";
      });
}

py::list results_to_python(std::vector<AsyncResult> results) {
  py::list out;
  for (auto& r : results) {
    py::object err = r.error ? py::object(py::str(*r.error)) : py::object(py::none());
    out.append(py::make_tuple(r.ticket, py::cast(r.pages), err));
  }
  return out;
}

void bind_group(py::module_& m) {
  using Pages = std::vector<std::int64_t>;
  using RawExtents = std::vector<std::tuple<std::int64_t, std::int64_t, std::int64_t, std::int64_t>>;
  py::class_<SpaceGroup, std::shared_ptr<SpaceGroup>>(m, "SpaceGroup")
      .def(py::init([](std::vector<std::shared_ptr<TensorSpace>> spaces, const RawExtents& extents,
                       std::int64_t num_pages, std::shared_ptr<HandlePool> pool, std::int64_t history) {
             const auto specs = to_extents(extents);
             const std::size_t n = non_negative(num_pages, "num_pages");
             const std::size_t h = non_negative(history, "history");
             py::gil_scoped_release release;
             return std::make_shared<SpaceGroup>(std::move(spaces), specs, n, std::move(pool), h);
           }),
           py::arg("spaces"), py::arg("extents"), py::arg("num_pages"), py::arg("pool"),
           py::arg("history") = 1024)
      .def("map", &SpaceGroup::map, py::arg("pages"), Release())
      .def("unmap", &SpaceGroup::unmap, py::arg("pages"), Release())
      .def("prepare", &SpaceGroup::prepare, py::arg("tx"), py::arg("pages"), Release())
      .def("commit", &SpaceGroup::commit, py::arg("tx"), Release())
      .def("abort", &SpaceGroup::abort, py::arg("tx"), Release())
      .def("tx_state", &SpaceGroup::tx_state, py::arg("tx"), Release())
      .def("map_async", &SpaceGroup::map_async, py::arg("pages"), Release())
      .def(
          "collect",
          [](SpaceGroup& g, bool wait) {
            std::vector<AsyncResult> results;
            {
              py::gil_scoped_release release;
              results = g.collect(wait);
            }
            return results_to_python(std::move(results));
          },
          py::arg("wait") = false)
      .def("close", &SpaceGroup::close, Release())
      .def("__enter__", [](std::shared_ptr<SpaceGroup> g) { return g; })
      .def("__exit__",
           [](SpaceGroup& g, const py::args&) {
             py::gil_scoped_release release;
             g.close();
           })
      .def("is_mapped", &SpaceGroup::is_mapped, py::arg("page"), Release())
      .def(
          "page_state",
          [](const SpaceGroup& g, std::int64_t page) {
            py::gil_scoped_release release;
            return page_state_name(g.page_state(page));
          },
          py::arg("page"))
      .def("mapped_pages", &SpaceGroup::mapped_pages, Release())
      .def(
          "page_units",
          [](const SpaceGroup& g, std::int64_t page) {
            std::vector<UnitInfo> units;
            {
              py::gil_scoped_release release;
              units = g.page_units(page);
            }
            py::list out;
            for (const UnitInfo& u : units) out.append(py::make_tuple(u.space, u.start_slot, u.nslots));
            return out;
          },
          py::arg("page"))
      .def_property_readonly("num_pages", &SpaceGroup::num_pages)
      .def_property_readonly("num_units", &SpaceGroup::num_units)
      .def_property_readonly("num_mapped", unlocked(&SpaceGroup::num_mapped))
      .def_property_readonly("mapped_bytes", unlocked(&SpaceGroup::mapped_bytes))
      .def_property_readonly("held_handles", unlocked(&SpaceGroup::held_handles))
      .def_property_readonly("quarantined_handles", unlocked(&SpaceGroup::quarantined_handles))
      .def_property_readonly("consistent", unlocked(&SpaceGroup::consistent))
      .def_property_readonly("error", unlocked(&SpaceGroup::error))
      .def_property_readonly("closed", unlocked(&SpaceGroup::closed))
      .def_property_readonly("spaces", &SpaceGroup::spaces)
      .def_property_readonly("pool", &SpaceGroup::pool);
}

}  // namespace

PYBIND11_MODULE(_vmm, m) {
  m.doc() = "elastic-kv data plane: virtual-memory backends, TensorSpace, SpaceGroup, HandlePool (C++17).";
  init_errors(m);
  bind_backends(m);
  bind_pool(m);
  bind_space(m);
  bind_group(m);
  m.def(
      "raw_driver_loop",
      [](std::shared_ptr<Backend> backend, std::int64_t page_size, std::int64_t count, bool pooled) {
        const std::size_t ps = non_negative(page_size, "page_size");
        const std::size_t n = non_negative(count, "count");
        RawLoopTimes t;
        {
          py::gil_scoped_release release;
          t = raw_driver_loop(backend, ps, n, pooled);
        }
        py::dict d;
        d["grow_s"] = t.grow_s;
        d["shrink_s"] = t.shrink_s;
        d["create_s"] = t.create_s;
        d["map_s"] = t.map_s;
        d["set_access_s"] = t.set_access_s;
        d["unmap_s"] = t.unmap_s;
        d["release_s"] = t.release_s;
        return d;
      },
      py::arg("backend"), py::arg("page_size"), py::arg("count"), py::arg("pooled"),
      "Benchmark only: times the bare driver loop (see raw_bench.hpp); returns seconds per phase and per "
      "call kind.");
}

// tide._C: the torch-facing extension. Each bind_* lives beside what it binds.
#include <c10/util/Exception.h>
#include <torch/csrc/utils/pybind.h>

#include "tide/error.hpp"
#ifdef TIDE_WITH_CUDA
#include "cuda/NcclOneSided.hpp"
#include "tide/cuda/probe.hpp"
#endif

namespace tide::py {
void bind_plan(pybind11::module_& m);
void bind_backend(pybind11::module_& m);
}

PYBIND11_MODULE(_C, m) {
  m.doc() = "TIDE: zero-copy collectives for PyTorch FSDP2 (native part)";
  // A dead, hung or failed peer is torch.distributed.DistBackendError, as with the
  // built-in backends (tide::TimeoutError from the core, c10::DistBackendError from the
  // backend); argument errors stay RuntimeError.
  pybind11::register_local_exception_translator([](std::exception_ptr p) {
    auto raise = [](const char* what) {
      pybind11::object type = pybind11::module_::import("torch.distributed").attr("DistBackendError");
      PyErr_SetString(type.ptr(), what);
    };
    try {
      if (p) std::rethrow_exception(p);
    } catch (const tide::TimeoutError& e) {
      raise(e.what());
    } catch (const c10::DistBackendError& e) {
      raise(e.what_without_backtrace());
    }
  });
  tide::py::bind_plan(m);
  tide::py::bind_backend(m);
#ifdef TIDE_WITH_CUDA
  m.attr("has_cuda") = true;  // FSDP2's TIDE-AG / TIDE-RS on CUDA tensors (src/torch/cuda)
  // What the node offers (tide.doctor): the probe, and the all-gather path for `ranks`
  // processes spread over the devices round robin (several per device when there are fewer).
  m.def("cuda_capabilities", [](int ranks) {
    namespace py = pybind11;
    const tide::cuda::Capabilities c = tide::cuda::probe();
    py::dict out;
    out["device_count"] = c.device_count;
    out["driver_version"] = c.driver_version;
    out["runtime_version"] = c.runtime_version;
    out["nccl_version"] = c.nccl_version;
    out["error"] = c.error;
    py::list devices;
    for (const auto& d : c.devices) {
      py::dict x;
      x["ordinal"] = d.ordinal;
      x["name"] = d.name;
      x["compute_capability"] = std::to_string(d.cc_major) + "." + std::to_string(d.cc_minor);
      x["sm_count"] = d.sm_count;
      x["copy_engines"] = d.copy_engines;
      x["total_memory"] = d.total_memory;
      x["vmm_posix_fd"] = d.vmm && d.posix_fd_handles;
      x["multicast"] = d.multicast;
      x["ipc"] = d.ipc;
      x["stream_mem_ops"] = d.stream_mem_ops;
      devices.append(x);
    }
    out["devices"] = devices;
    out["peer_access"] = c.peer_access;
    std::vector<int> on;
    for (int r = 0; r < ranks; ++r) on.push_back(c.device_count ? r % c.device_count : 0);
    const tide::cuda::PathChoice pc = tide::cuda::choose_allgather_path(c, on);
    out["allgather_path"] = std::string(tide::cuda::path_name(pc.path));
    out["allgather_reason"] = pc.reason;
    return out;
  }, pybind11::arg("ranks") = 2, "The CUDA probe and the all-gather path for `ranks` processes (tide.doctor).");
  m.def("nccl_one_sided", [] {
    const auto [version, missing] = tide::torch_backend::NcclOneSided::entry_points();
    pybind11::dict out;
    out["version"] = version;
    out["missing"] = missing;
    return out;
  }, "The loaded NCCL's version code and the one-sided entry points it lacks (found with dlsym, as TIDE-AG "
     "across nodes does).");
#else
  m.attr("has_cuda") = false;
#endif
}

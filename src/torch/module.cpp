// tide._C: the torch-facing extension. Each bind_* lives beside what it binds.
#include <torch/extension.h>

#include "tide/error.hpp"

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
#else
  m.attr("has_cuda") = false;
#endif
}

// Python bindings of ProcessGroupTide. python/tide/_backend.py registers it with
// torch.distributed as the "tide" backend.
#include <pybind11/chrono.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/utils/pybind.h>

#include "ProcessGroupTide.hpp"

namespace tide::py {

void bind_backend(pybind11::module_& m) {
  namespace py = pybind11;
  using tide::torch_backend::ProcessGroupTide;
  // c10d::Backend's Python type lives in torch._C._distributed_c10d.
  py::module_::import("torch.distributed");
  py::class_<ProcessGroupTide, c10d::Backend, c10::intrusive_ptr<ProcessGroupTide>>(
      m, "ProcessGroupTide", "The tide c10d backend (host shared-memory transport).")
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       std::chrono::milliseconds timeout, const std::string& group_name) {
             return c10::make_intrusive<ProcessGroupTide>(store, rank, size, timeout, group_name);
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout"),
           py::arg("group_name") = "", py::call_guard<py::gil_scoped_release>());
}

}  // namespace tide::py

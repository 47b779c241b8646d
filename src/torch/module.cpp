// tide._C: the torch-facing extension. Each bind_* lives beside what it binds.
#include <torch/extension.h>

namespace tide::py {
void bind_plan(pybind11::module_& m);
void bind_backend(pybind11::module_& m);
}

PYBIND11_MODULE(_C, m) {
  m.doc() = "TIDE: zero-copy collectives for PyTorch FSDP2 (native part)";
  tide::py::bind_plan(m);
  tide::py::bind_backend(m);
#ifdef TIDE_WITH_CUDA
  m.attr("has_cuda") = true;  // FSDP2's TIDE-AG / TIDE-RS on CUDA tensors (src/torch/cuda)
#else
  m.attr("has_cuda") = false;
#endif
}

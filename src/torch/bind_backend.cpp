// Python bindings of ProcessGroupTide. python/tide/_backend.py registers it with
// torch.distributed as the "tide" backend; python/tide/fsdp.py uses the param_* methods.
#include <cstring>

#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/utils/pybind.h>

#include "../core/env.hpp"
#include "ProcessGroupTide.hpp"
#ifdef TIDE_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

namespace tide::py {

namespace {
c10::Device device_of(const SymmetricBuffer& buf) {
  return buf.device() < 0 ? c10::Device(c10::kCPU)
                          : c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(buf.device()));
}

// A tensor over part of this rank's symmetric memory (on the memory's device); the memory
// stays mapped while the tensor (or any view of it) lives.
at::Tensor symmetric_tensor(const std::shared_ptr<SymmetricBuffer>& buf, int rank, size_t offset,
                            int64_t numel, at::ScalarType dtype) {
  const size_t bytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
  TORCH_CHECK(numel >= 0 && offset + bytes <= buf->bytes(rank), "tide: a tensor of ", numel,
              " elements at offset ", offset, " does not fit this rank's ", buf->bytes(rank),
              " bytes of symmetric memory");
  auto keep = buf;
  return at::from_blob(
      buf->peer(rank) + offset, {numel}, [keep](void*) mutable { keep.reset(); },
      at::TensorOptions().dtype(dtype).device(device_of(*buf)));
}
// Moves a CPU tensor's whole storage into this rank's part of `buf` at `offset`: the bytes
// are copied and the storage's data pointer swapped, so every tensor sharing the storage
// (FSDP2's padded shard, the DTensor's local tensor, detached copies a state_dict holds)
// follows, and the old memory is freed.
void move_storage(const at::Tensor& t, const std::shared_ptr<SymmetricBuffer>& buf, int rank,
                  size_t offset) {
  const c10::Device device = device_of(*buf);
  TORCH_CHECK(t.device() == device, "tide: move_storage: a tensor on ", t.device(),
              " cannot move into symmetric memory on ", device);
  c10::Storage storage = t.storage();
  const size_t nbytes = storage.nbytes();
  TORCH_CHECK(offset + nbytes <= buf->bytes(rank), "tide: a storage of ", nbytes,
              " bytes at offset ", offset, " does not fit this rank's ", buf->bytes(rank),
              " bytes of symmetric memory");
  std::byte* dst = buf->peer(rank) + offset;
  if (nbytes && device.is_cpu()) std::memcpy(dst, storage.data(), nbytes);
#ifdef TIDE_WITH_CUDA
  if (nbytes && device.is_cuda()) {
    // After the work already queued on the current stream (which may still write the
    // parameter), and finished before the old memory goes back to the caching allocator.
    c10::cuda::CUDAGuard guard(device.index());
    cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
    C10_CUDA_CHECK(cudaMemcpyAsync(dst, storage.data(), nbytes, cudaMemcpyDeviceToDevice, stream));
    C10_CUDA_CHECK(cudaStreamSynchronize(stream));
  }
#endif
  auto* keep = new std::shared_ptr<SymmetricBuffer>(buf);
  storage.unsafeGetStorageImpl()->set_data_ptr_noswap(c10::DataPtr(
      dst, keep, [](void* ctx) { delete static_cast<std::shared_ptr<SymmetricBuffer>*>(ctx); },
      device));
}

// Points a tensor's storage (every alias follows) at `nbytes` of `rank`'s part of `buf` at
// `offset`, or, with nbytes 0, leaves it empty: FSDP2's unsharded storage, allocated from
// and freed to python/tide/_pool.py instead of the caching allocator. Nothing is copied; the
// memory stays mapped while the storage points there.
void point_storage(const at::Tensor& t, const std::shared_ptr<SymmetricBuffer>& buf, int rank, size_t offset,
                   size_t nbytes) {
  const c10::Device device = device_of(*buf);
  TORCH_CHECK(t.device() == device, "tide: point_storage: a tensor on ", t.device(),
              " cannot point into symmetric memory on ", device);
  auto* impl = t.storage().unsafeGetStorageImpl();
  if (nbytes == 0) {
    impl->set_data_ptr_noswap(c10::DataPtr(nullptr, device));
    impl->set_nbytes(0);
    return;
  }
  TORCH_CHECK(offset + nbytes <= buf->bytes(rank), "tide: point_storage: ", nbytes, " bytes at offset ", offset,
              " do not fit rank ", rank, "'s ", buf->bytes(rank), " bytes of symmetric memory");
  auto* keep = new std::shared_ptr<SymmetricBuffer>(buf);
  impl->set_data_ptr_noswap(c10::DataPtr(
      buf->peer(rank) + offset, keep, [](void* ctx) { delete static_cast<std::shared_ptr<SymmetricBuffer>*>(ctx); },
      device));
  impl->set_nbytes(nbytes);
}
}  // namespace

void bind_backend(pybind11::module_& m) {
  namespace py = pybind11;
  using tide::torch_backend::ProcessGroupTide;
  // c10d::Backend's Python type lives in torch._C._distributed_c10d.
  py::module_::import("torch.distributed");

  py::class_<SymmetricBuffer, std::shared_ptr<SymmetricBuffer>>(
      m, "SymmetricMemory", "Shared memory every rank of a tide group maps (one part per rank).")
      .def("tensor", &symmetric_tensor, py::arg("rank"), py::arg("offset"), py::arg("numel"),
           py::arg("dtype"), "A 1-D tensor over `rank`'s part (normally this rank's own), on the memory's device, "
           "starting `offset` bytes in.")
      .def("release", &SymmetricBuffer::release, py::arg("offset"), py::arg("bytes"),
           "Returns the pages of a range of this rank's part to the OS (reads as zeros after).")
      .def("nbytes", &SymmetricBuffer::bytes, py::arg("rank"))
      .def_property_readonly("device", [](const SymmetricBuffer& b) { return device_of(b).str(); },
                             "'cpu' (host shared memory) or 'cuda:N' (CUDA device memory).");

  m.def("move_storage", &move_storage, py::arg("tensor"), py::arg("buffer"), py::arg("rank"),
        py::arg("offset"));
  m.def("env_bytes", &tide::env::get_bytes, py::arg("name"), py::arg("fallback"),
        "A byte count from the environment (K/M/G suffixes), as the C++ side reads its own.");
  m.def("point_storage", &point_storage, py::arg("tensor"), py::arg("buffer"), py::arg("rank"),
        py::arg("offset"), py::arg("nbytes"));

  py::class_<StagingReport>(m, "StagingReport")
      .def_readonly("slot_bytes", &StagingReport::slot_bytes)
      .def_readonly("num_slots", &StagingReport::num_slots)
      .def_readonly("reused_slots", &StagingReport::reused_slots)
      .def_readonly("fallback_bytes", &StagingReport::fallback_bytes)
      .def_readonly("partial_bytes", &StagingReport::partial_bytes)
      .def_readonly("direct_bytes", &StagingReport::direct_bytes);

  py::class_<ProcessGroupTide, c10d::Backend, c10::intrusive_ptr<ProcessGroupTide>>(
      m, "ProcessGroupTide", "The tide c10d backend (host shared-memory transport).")
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       std::chrono::milliseconds timeout, const std::string& group_name, int job_rank) {
             return c10::make_intrusive<ProcessGroupTide>(store, rank, size, timeout, group_name, job_rank);
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout"),
           py::arg("group_name") = "", py::arg("job_rank") = -1, py::call_guard<py::gil_scoped_release>())
      .def("allocate_symmetric", &ProcessGroupTide::allocate_symmetric, py::arg("bytes"),
           py::arg("device") = -1, py::call_guard<py::gil_scoped_release>(),
           "Collective: symmetric memory, host shared memory (device -1) or on cuda:device.")
      .def("param_all_gather", &ProcessGroupTide::param_all_gather, py::arg("layout"),
           py::arg("shards"), py::arg("shard_offsets"), py::arg("shard_dtype"),
           py::arg("storages"), py::call_guard<py::gil_scoped_release>())
      .def("param_reduce_scatter", &ProcessGroupTide::param_reduce_scatter, py::arg("layout"),
           py::arg("grads"), py::arg("out"), py::arg("out_offsets"), py::arg("op"),
           py::arg("reuse") = nullptr, py::arg("reuse_regions") = std::vector<std::pair<int64_t, int64_t>>{},
           py::call_guard<py::gil_scoped_release>())
      .def("defer_param_all_gather", &ProcessGroupTide::defer_param_all_gather, py::arg("layout"),
           py::arg("shards"), py::arg("shard_offsets"), py::arg("shard_dtype"), py::arg("storages"),
           "param_all_gather, checked and kept for this thread's next all_gather_into_tensor of "
           "zero-element tensors on this group (which runs it, visible as c10d::_allgather_base_).")
      .def("defer_param_reduce_scatter", &ProcessGroupTide::defer_param_reduce_scatter, py::arg("layout"),
           py::arg("grads"), py::arg("out"), py::arg("out_offsets"), py::arg("op"), py::arg("reuse") = nullptr,
           py::arg("reuse_regions") = std::vector<std::pair<int64_t, int64_t>>{},
           "param_reduce_scatter, kept for this thread's next reduce_scatter_tensor of zero-element "
           "tensors on this group (visible as c10d::_reduce_scatter_base_).")
      .def("drop_deferred", &ProcessGroupTide::drop_deferred, "Drops this thread's deferred call, if any.")
      .def("last_staging_report", &ProcessGroupTide::last_staging_report)
      .def("host_allgather_algorithm", &ProcessGroupTide::host_allgather_algorithm,
           "How TIDE-AG moves shards on the host: 'direct' or 'doubling' (TIDE_HOST_ALLGATHER).")
      .def("cuda_staging_geometry", &ProcessGroupTide::cuda_staging_geometry, py::arg("device"),
           py::call_guard<py::gil_scoped_release>(),
           "(slot_bytes, num_slots) of TIDE-RS's staging on cuda:device (collective at the first CUDA call).")
      .def("cuda_path_choice", &ProcessGroupTide::cuda_path_choice, py::arg("device"),
           py::call_guard<py::gil_scoped_release>(),
           "(path, reason): 'copy engines' or 'nccl' (no peer access) on cuda:device.")
      .def("set_cuda_delegate", &ProcessGroupTide::set_cuda_delegate, py::arg("backend"))
      .def("why_not_across_nodes", &ProcessGroupTide::why_not_across_nodes, py::arg("device") = -1,
           "'' where TIDE-AG runs across this group's nodes for tensors on `device` (-1: CPU), else why not.")
      .def("inter_node_engine", &ProcessGroupTide::inter_node_engine, py::arg("device") = -1,
           py::call_guard<py::gil_scoped_release>(),
           "What moves TIDE's bytes between nodes for tensors on `device` (-1: CPU): 'gloo', 'nccl send-recv'.")
      .def("inter_node_bytes_sent", &ProcessGroupTide::inter_node_bytes_sent,
           "Bytes this rank sent through the inter-node engine (TIDE's own collectives).")
      .def("num_nodes", &ProcessGroupTide::num_nodes,
           "Nodes the group spans (hosts, or TIDE_LOCAL_WORLD_SIZE pseudo-nodes); 1: the host transport.")
      .def("set_cpu_delegate", &ProcessGroupTide::set_cpu_delegate, py::arg("backend"),
           "The gloo backend that runs CPU collectives of a group over several nodes.");
}

}  // namespace tide::py

// tide._C.plan: the layout planner (include/tide/plan.hpp) for Python. Structs are exposed
// with read-only fields; vectors come back as lists.
#include <pybind11/operators.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "tide/error.hpp"
#include "tide/plan.hpp"

namespace tide::py {

void bind_plan(pybind11::module_& parent) {
  using namespace tide::plan;
  pybind11::module_ m = parent.def_submodule("plan", "TIDE's layout planner (tide/plan.hpp)");

  pybind11::class_<Param>(m, "Param")
      .def(pybind11::init([](std::vector<int64_t> shape, int64_t elem_size, int64_t shard_dim) {
             return Param{std::move(shape), elem_size, shard_dim};
           }),
           pybind11::arg("shape"), pybind11::arg("elem_size") = 4, pybind11::arg("shard_dim") = 0)
      .def_readonly("shape", &Param::shape)
      .def_readonly("elem_size", &Param::elem_size)
      .def_readonly("shard_dim", &Param::shard_dim);

  pybind11::class_<Strided>(m, "Strided")
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t>(), pybind11::arg("offset"),
           pybind11::arg("run"), pybind11::arg("count"), pybind11::arg("stride"))
      .def_readonly("offset", &Strided::offset)
      .def_readonly("run", &Strided::run)
      .def_readonly("count", &Strided::count)
      .def_readonly("stride", &Strided::stride)
      .def("numel", &Strided::numel)
      .def("in_bytes", &Strided::in_bytes, pybind11::arg("elem_size"))
      .def(pybind11::self == pybind11::self)
      .def("__repr__", [](const Strided& s) {
        return "Strided(offset=" + std::to_string(s.offset) + ", run=" + std::to_string(s.run) +
               ", count=" + std::to_string(s.count) + ", stride=" + std::to_string(s.stride) + ")";
      });

  pybind11::class_<Shard>(m, "Shard")
      .def_readonly("sharded_size", &Shard::sharded_size)
      .def_readonly("padded_sharded_size", &Shard::padded_sharded_size)
      .def_readonly("begin", &Shard::begin)
      .def_readonly("numel", &Shard::numel)
      .def_readonly("padded_numel", &Shard::padded_numel)
      .def_readonly("placement", &Shard::placement);

  pybind11::class_<ParamLayout>(m, "ParamLayout")
      .def_readonly("shape", &ParamLayout::shape)
      .def_readonly("elem_size", &ParamLayout::elem_size)
      .def_readonly("shard_dim", &ParamLayout::shard_dim)
      .def_readonly("numel", &ParamLayout::numel)
      .def_readonly("chunk", &ParamLayout::chunk)
      .def_readonly("padded_shard_numel", &ParamLayout::padded_shard_numel)
      .def_readonly("storage_numel", &ParamLayout::storage_numel)
      .def_readonly("shards", &ParamLayout::shards)
      .def("storage_bytes", &ParamLayout::storage_bytes);

  pybind11::class_<GroupLayout>(m, "GroupLayout")
      .def_readonly("world_size", &GroupLayout::world_size)
      .def_readonly("params", &GroupLayout::params);

  m.def("plan_group", &plan_group, pybind11::arg("params"), pybind11::arg("world_size"),
        "FSDP2's sharding of a parameter group (raises RuntimeError where FSDP2 refuses)");

  pybind11::class_<AllGatherCopy>(m, "AllGatherCopy")
      .def_readonly("src_rank", &AllGatherCopy::src_rank)
      .def_readonly("param", &AllGatherCopy::param)
      .def_readonly("numel", &AllGatherCopy::numel)
      .def_readonly("dst", &AllGatherCopy::dst);
  m.def("allgather_copies", &allgather_copies, pybind11::arg("layout"));

  pybind11::class_<ReduceScatterSlice>(m, "ReduceScatterSlice")
      .def_readonly("param", &ReduceScatterSlice::param)
      .def_readonly("dst_rank", &ReduceScatterSlice::dst_rank)
      .def_readonly("numel", &ReduceScatterSlice::numel)
      .def_readonly("src", &ReduceScatterSlice::src);
  m.def("reduce_scatter_slices", &reduce_scatter_slices, pybind11::arg("layout"));

  pybind11::class_<Transfer>(m, "Transfer")
      .def_readonly("src_rank", &Transfer::src_rank)
      .def_readonly("dst_rank", &Transfer::dst_rank)
      .def_readonly("owner_rank", &Transfer::owner_rank)
      .def_readonly("param", &Transfer::param)
      .def_readonly("shard_begin", &Transfer::shard_begin)
      .def_readonly("shard_end", &Transfer::shard_end)
      .def_readonly("storage", &Transfer::storage);
  pybind11::class_<Round>(m, "Round").def_readonly("transfers", &Round::transfers);
  pybind11::class_<Step>(m, "Step")
      .def_readonly("distance", &Step::distance)
      .def_readonly("rounds", &Step::rounds);
  pybind11::class_<AllGatherSchedule>(m, "AllGatherSchedule")
      .def_readonly("world_size", &AllGatherSchedule::world_size)
      .def_readonly("pace_bytes", &AllGatherSchedule::pace_bytes)
      .def_readonly("steps", &AllGatherSchedule::steps);
  m.def("allgather_schedule", &allgather_schedule, pybind11::arg("layout"),
        pybind11::arg("pace_bytes"));

  pybind11::class_<Topology>(m, "Topology")
      .def(pybind11::init([](int world_size, int local_size) {
             TIDE_CHECK(local_size >= 1 && world_size % local_size == 0, "Topology: ", world_size,
                        " ranks do not split into nodes of ", local_size);
             return Topology{world_size, local_size, world_size / local_size};
           }),
           pybind11::arg("world_size"), pybind11::arg("local_size"))
      .def_readonly("world_size", &Topology::world_size)
      .def_readonly("local_size", &Topology::local_size)
      .def_readonly("num_nodes", &Topology::num_nodes)
      .def("node_of", &Topology::node_of)
      .def("local_rank", &Topology::local_rank);
  pybind11::class_<NodeLocalCopy>(m, "NodeLocalCopy")
      .def_readonly("block", &NodeLocalCopy::block)
      .def_readonly("after_step", &NodeLocalCopy::after_step);
  pybind11::class_<NodeAllGatherSchedule>(m, "NodeAllGatherSchedule")
      .def_readonly("topology", &NodeAllGatherSchedule::topology)
      .def_readonly("inter_node", &NodeAllGatherSchedule::inter_node)
      .def_readonly("node_local", &NodeAllGatherSchedule::node_local);
  m.def("node_allgather_schedule", &node_allgather_schedule, pybind11::arg("layout"), pybind11::arg("topology"),
        pybind11::arg("pace_bytes"));

  pybind11::class_<RsPiece>(m, "RsPiece")
      .def_readonly("param", &RsPiece::param)
      .def_readonly("dst_rank", &RsPiece::dst_rank)
      .def_readonly("shard_begin", &RsPiece::shard_begin)
      .def_readonly("shard_end", &RsPiece::shard_end)
      .def_readonly("staging_offset", &RsPiece::staging_offset)
      .def_readonly("grad", &RsPiece::grad);
  pybind11::class_<RsChunk>(m, "RsChunk")
      .def_readonly("id", &RsChunk::id)
      .def_readonly("slot", &RsChunk::slot)
      .def_readonly("begin", &RsChunk::begin)
      .def_readonly("end", &RsChunk::end)
      .def_readonly("pieces", &RsChunk::pieces);
  pybind11::class_<RsPipeline>(m, "RsPipeline")
      .def_readonly("chunk_elems", &RsPipeline::chunk_elems)
      .def_readonly("slot_bytes", &RsPipeline::slot_bytes)
      .def_readonly("num_slots", &RsPipeline::num_slots)
      .def_readonly("chunks", &RsPipeline::chunks)
      .def("staging_bytes", &RsPipeline::staging_bytes);
  m.def(
      "rs_pipeline",
      [](const GroupLayout& layout, int64_t chunk_bytes, int max_inflight,
         int64_t staging_elem_size) {
        return rs_pipeline(layout, {chunk_bytes, max_inflight, staging_elem_size});
      },
      pybind11::arg("layout"), pybind11::arg("chunk_bytes"), pybind11::arg("max_inflight") = 2,
      pybind11::arg("staging_elem_size") = 4);

  pybind11::class_<Region>(m, "Region")
      .def(pybind11::init<int64_t, int64_t, int64_t>(), pybind11::arg("base_id"),
           pybind11::arg("offset"), pybind11::arg("bytes"))
      .def_readonly("base_id", &Region::base_id)
      .def_readonly("offset", &Region::offset)
      .def_readonly("bytes", &Region::bytes);
  pybind11::class_<SlotHome>(m, "SlotHome")
      .def_readonly("reused", &SlotHome::reused)
      .def_readonly("base_id", &SlotHome::base_id)
      .def_readonly("offset", &SlotHome::offset);
  pybind11::class_<SlotReuse>(m, "SlotReuse")
      .def_readonly("slots", &SlotReuse::slots)
      .def_readonly("fallback_bytes", &SlotReuse::fallback_bytes);
  m.def("storage_regions", &storage_regions, pybind11::arg("layout"));
  m.def("assign_staging_slots", &assign_staging_slots, pybind11::arg("vacated"),
        pybind11::arg("slot_bytes"), pybind11::arg("num_slots"), pybind11::arg("alignment") = 256);

  pybind11::class_<BufferBytes>(m, "BufferBytes")
      .def_readonly("param_storage", &BufferBytes::param_storage)
      .def_readonly("ag_input", &BufferBytes::ag_input)
      .def_readonly("ag_output", &BufferBytes::ag_output)
      .def_readonly("rs_input", &BufferBytes::rs_input)
      .def_readonly("rs_output", &BufferBytes::rs_output)
      .def_readonly("staging", &BufferBytes::staging)
      .def("collective", &BufferBytes::collective);
  m.def(
      "stock_fsdp2_bytes",
      [](const GroupLayout& layout, int64_t reduce_elem_size, int64_t orig_elem_size) {
        return stock_fsdp2_bytes(layout, {reduce_elem_size, orig_elem_size});
      },
      pybind11::arg("layout"), pybind11::arg("reduce_elem_size") = 4,
      pybind11::arg("orig_elem_size") = 0);
  m.def(
      "tide_bytes",
      [](const GroupLayout& layout, int rank, int64_t staging_bytes, int64_t reduce_elem_size,
         int64_t orig_elem_size) {
        return tide_bytes(layout, {reduce_elem_size, orig_elem_size}, rank, staging_bytes);
      },
      pybind11::arg("layout"), pybind11::arg("rank"), pybind11::arg("staging_bytes"),
      pybind11::arg("reduce_elem_size") = 4, pybind11::arg("orig_elem_size") = 0);
}

}  // namespace tide::py

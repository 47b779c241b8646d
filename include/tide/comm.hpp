// A communicator: one process group's ranks on one host, the collectives over them.
// This is the whole surface the torch adapter (ProcessGroupTide) uses. Every call is
// blocking and collective (all ranks call it in the same order with matching arguments;
// send/recv are between two ranks). Calls on one Comm come from one thread at a time.
//
// Failures: mismatched arguments across ranks raise tide::Error on every rank, naming the
// collective, the ranks and the sizes. A dead or silent peer raises tide::TimeoutError on
// every survivor within `timeout`. After either, the Comm is unusable (every later call
// raises), like a NCCL communicator after an async error.
#pragma once
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "tide/dtype.hpp"
#include "tide/store.hpp"

namespace tide {

struct CommOptions {
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};
  int num_threads = 0;        // copy/reduce threads per rank; 0: TIDE_NUM_THREADS or a default
  size_t staging_bytes = 0;   // shared-memory staging per rank; 0: TIDE_SHM_STAGING_BYTES or default
};

struct ReduceArgs {
  ReduceOp op = ReduceOp::sum;
  double premul_factor = 1.0;  // used by ReduceOp::premul_sum only
};

class Comm {
 public:
  virtual ~Comm() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;

  // outs[r] receives rank r's `count` elements of `in`. outs.size() == world_size.
  virtual void all_gather(const void* in, std::span<void* const> outs, size_t count, DType dtype) = 0;

  // out = reduction over ranks r of ins_r[rank], `count` elements; ins.size() == world_size
  // (this rank's inputs, one per destination rank). in_dtype may be bf16/f16 with
  // out_dtype f32 (mixed-precision reduce-scatter); otherwise the two are equal.
  // Accumulation is in fp32 for bf16/f16 and in rank order 0..world_size-1, so results are
  // bitwise identical on every rank and run to run.
  virtual void reduce_scatter(std::span<const void* const> ins, void* out, size_t count,
                              DType in_dtype, DType out_dtype, ReduceArgs op) = 0;

  virtual void all_reduce(void* inout, size_t count, DType dtype, ReduceArgs op) = 0;
  // Only root's `inout` receives the result; others' buffers are left unchanged.
  virtual void reduce(void* inout, size_t count, DType dtype, ReduceArgs op, int root) = 0;
  virtual void broadcast(void* buf, size_t bytes, int root) = 0;
  // On root, outs.size() == world_size; elsewhere outs is empty.
  virtual void gather(const void* in, std::span<void* const> outs, size_t bytes, int root) = 0;
  // On root, ins.size() == world_size; elsewhere ins is empty.
  virtual void scatter(std::span<const void* const> ins, void* out, size_t bytes, int root) = 0;
  // Byte counts and offsets, one per peer (MPI_Alltoallv, in bytes).
  virtual void all_to_all(const void* in, std::span<const size_t> send_bytes,
                          std::span<const size_t> send_offsets, void* out,
                          std::span<const size_t> recv_bytes, std::span<const size_t> recv_offsets) = 0;
  virtual void barrier() = 0;
  // Point to point: matched in call order per (sender, receiver) pair; tags must match.
  virtual void send(const void* buf, size_t bytes, int peer, int tag) = 0;
  virtual void recv(void* buf, size_t bytes, int peer, int tag) = 0;
};

// Ranks of one host over POSIX shared memory. `ns` names the group (distinct per
// process group); all ranks rendezvous through `store`. Shared-memory names are unlinked
// as soon as every rank has mapped them, so nothing survives the processes.
std::unique_ptr<Comm> make_host_comm(Store& store, const std::string& ns, int rank, int world_size,
                                     CommOptions options = {});

}  // namespace tide

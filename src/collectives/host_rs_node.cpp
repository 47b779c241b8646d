// The host's RsNode: a node's ranks on one host communicator (tide::Transport), the
// pipeline's windows as its steps (Ctx::begin_step: a slot is reused once every peer posted
// done for its previous window), staging in its slots, the reduce engine's ordered sums.
#include <cstring>

#include "algorithms.hpp"
#include "tide/rs_node.hpp"

namespace tide::algo {
namespace {

class HostRsNode final : public RsNode {
 public:
  explicit HostRsNode(Ctx& c) : c_(c), t_(c.t) {}
  int local_rank() const override { return c_.rank(); }
  int local_size() const override { return c_.ws(); }
  size_t slot_bytes() const override { return t_.slot_bytes(); }
  int num_slots() const override { return t_.num_slots(); }
  size_t piece_align() const override { return 64; }
  uint64_t next_step() const override { return c_.step + 1; }
  uint64_t begin_window() override {
    c_.begin_step();
    return c_.step;
  }
  std::byte* slot(int local, int index) override { return t_.peer(local, index); }
  void stage(std::span<const StridedCopy> copies, DType dtype) override { t_.convert(copies, dtype, dtype); }
  void ready(uint64_t step) override { t_.post(Flag::ready(), step); }
  void await_ready(uint64_t step) override { wait_peers(Flag::ready(), step); }
  void accumulate(void* dst, DType dst_dtype, std::span<const void* const> srcs, DType src_dtype, size_t count,
                  ReduceArgs op) override {
    t_.reduce(dst, dst_dtype, srcs, src_dtype, count, op);
  }
  void end_window(uint64_t step) override { t_.post(Flag::done(), step); }
  void release(uint64_t step) override { wait_peers(Flag::done(), step); }
  void zero(void* dst, size_t bytes) override { std::memset(dst, 0, bytes); }
  std::shared_ptr<std::byte> scratch(size_t bytes) override {
    return std::shared_ptr<std::byte>(new std::byte[bytes], std::default_delete<std::byte[]>());
  }
  // One buffer per communicator, zeroed when it is made and reused while it is large enough
  // and nothing else holds it (an engine that abandoned an exchange keeps its buffer alive).
  std::shared_ptr<std::byte> partials(size_t bytes) override {
    if (!c_.partials || c_.partial_bytes < bytes || c_.partials.use_count() > 1) {
      c_.partials.reset();
      c_.partials = std::shared_ptr<std::byte>(new std::byte[bytes](), std::default_delete<std::byte[]>());
      c_.partial_bytes = bytes;
    }
    return c_.partials;
  }

 private:
  void wait_peers(Flag flag, uint64_t step) {
    for (int r = 0; r < c_.ws(); ++r)
      if (r != c_.rank()) t_.wait(r, flag, step);
  }
  Ctx& c_;
  Transport& t_;
};

}  // namespace

std::unique_ptr<RsNode> host_rs_node(Ctx& c) { return std::make_unique<HostRsNode>(c); }

}  // namespace tide::algo

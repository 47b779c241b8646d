// What the benchmark's TIDE-RS phase-2 run launches, from the planner (C++20, compiled apart:
// nvcc builds the benchmark itself as C++17). Plain data only.
#pragma once
#include <cstdint>
#include <vector>

namespace tide::bench {

struct Phase2Launch {
  int64_t staging_offset;  // elements into each source's slot
  int64_t out_offset;      // elements into the fp32 output (FSDP2's reduce_output layout)
  int64_t count;
};
struct Phase2Plan {
  int ranks = 0;            // staged sources per launch
  int64_t piece_elems = 0;  // each source's slot, bf16 elements
  int64_t out_numel = 0;
  std::vector<Phase2Launch> launches;  // destination 0's pieces, in pipeline order
};

// A Qwen2-7B block's twelve bf16 parameters (its q/k/v biases make the padded shards of
// the later parameters start off 16-byte boundaries) at 6 ranks, TIDE-RS's pipeline as the
// CUDA executor plans it (a piece of 32 MiB / 2 slots / 6 ranks), parts aligned to
// align_bytes in staging (0: back to back, as in the flat output).
Phase2Plan qwen2_block_phase2(int64_t align_bytes);

}  // namespace tide::bench

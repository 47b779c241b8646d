// Element-wise reduction and conversion kernels of the host engines (and of any transport
// that reduces on the CPU). Sources are combined strictly in the order given, bf16/f16 in
// fp32 and rounded once (round-to-nearest-even), so the same inputs give the same bits.
#pragma once
#include <cstddef>
#include <cstdint>

#include "tide/comm.hpp"
#include "tide/dtype.hpp"

namespace tide {

// Throws tide::Error ("tide <collective>: ...") unless `op` can reduce src into dst:
// src == dst, or src bf16/f16 with dst f32; avg/premul_sum need a non-bool type.
void check_reduce(const char* collective, int rank, DType src, DType dst, ReduceOp op);

// dst[i] = op(srcs[0][i], ..., srcs[n-1][i]) for i < count. avg divides by n (or by
// args.avg_divisor); premul_sum multiplies each source by args.premul_factor first. dst may
// alias a source (the same elements), never overlap it partially. Besides the pairs
// check_reduce accepts, f32 sources reduce into bf16/f16 (rounded once).
void reduce_kernel(void* dst, DType dst_dtype, const void* const* srcs, size_t n, DType src_dtype,
                   size_t count, ReduceArgs args);

// Scalar conversions, exposed for tests and the torch adapter.
float bf16_to_float(uint16_t h);
uint16_t float_to_bf16(float f);
float f16_to_float(uint16_t h);
uint16_t float_to_f16(float f);

}  // namespace tide

// Element conversion kernels (host): equal dtypes copy; f32 -> bf16/f16 round to nearest
// even exactly like the reduce kernels' stores; bf16/f16 -> f32 widen exactly.
#pragma once
#include <cstddef>

#include "tide/dtype.hpp"

namespace tide {

// Whether convert_kernel handles src -> dst.
bool can_convert(DType src, DType dst);
// dst[i] = src[i] converted, i < count. Throws tide::Error for unsupported pairs.
void convert_kernel(void* dst, DType dst_dtype, const void* src, DType src_dtype, size_t count);

}  // namespace tide

// Element types and reduction operators the core understands. No torch here: the torch
// adapter maps at::ScalarType / c10d::ReduceOp onto these.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace tide {

enum class DType : uint8_t { f32, f64, bf16, f16, i8, u8, i16, i32, i64, boolean };

enum class ReduceOp : uint8_t {
  sum,
  avg,         // sum, then divided by the number of contributors (integer: truncating)
  max,
  min,
  product,
  premul_sum,  // sum of (factor * x_r); the factor comes with the call
  band,        // bitwise and, or, xor: integer and bool types only (bool: logical)
  bor,
  bxor,
};

size_t dtype_size(DType t);
const char* dtype_name(DType t);
const char* reduce_op_name(ReduceOp op);
bool is_floating(DType t);

}  // namespace tide

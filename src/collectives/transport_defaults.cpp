// Defaults of the optional Transport engines: serial conversion on the calling thread, and
// no symmetric memory.
#include "../core/convert.hpp"
#include "tide/transport.hpp"

namespace tide {

void Transport::convert(std::span<const StridedCopy> ops, DType dst_dtype, DType src_dtype) {
  const size_t des = dtype_size(dst_dtype), ses = dtype_size(src_dtype);
  for (const StridedCopy& op : ops)
    for (size_t k = 0; k < op.count; ++k)
      convert_kernel(static_cast<std::byte*>(op.dst) + k * op.dst_stride * des, dst_dtype,
                     static_cast<const std::byte*>(op.src) + k * op.src_stride * ses, src_dtype, op.run);
}

std::shared_ptr<SymmetricBuffer> Transport::allocate_symmetric(size_t) {
  throw Error(detail::concat("tide allocate_symmetric: the ", name(), " transport has no symmetric memory"));
}

}  // namespace tide

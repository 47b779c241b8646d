// Copy-engine submission shared by TIDE-AG and TIDE-RS (internal to tide_cuda).
// Contiguous copies are collected and submitted with cudaMemcpyBatchAsync (CUDA >= 12.8;
// hint: prefer copy engines, overlap with compute), strided ones go out at once as
// cudaMemcpy2DAsync. Nothing here launches a kernel.
#pragma once
#include <cstddef>
#include <vector>

#include <cuda_runtime_api.h>

namespace tide::cuda::detail {

class CopyBatch {
 public:
  CopyBatch(cudaStream_t stream, int device) : stream_(stream), device_(device) {}
  // `height` rows of `width` bytes, rows `dst_pitch` / `src_pitch` bytes apart.
  void add(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width, size_t height);
  void add(void* dst, const void* src, size_t bytes) { add(dst, bytes, src, bytes, bytes, 1); }
  void flush();  // submits the collected contiguous copies

 private:
  cudaStream_t stream_;
  int device_;
  std::vector<void*> dst_;
  std::vector<const void*> src_;
  std::vector<size_t> size_;
};

}  // namespace tide::cuda::detail

#include "copies.hpp"

#include <atomic>
#include <cstdint>

#include "../../core/env.hpp"
#include "tide/cuda/check.hpp"
#include "tide/cuda/group.hpp"

namespace tide::cuda::detail {
namespace {
std::atomic<bool> g_batch_ok{CUDART_VERSION >= 12080};
constexpr size_t kMaxPitch = size_t(1) << 30;  // well under cudaDevAttrMaxPitch
constexpr size_t kBatchMax = 1024;
}  // namespace

void CopyBatch::add(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width, size_t height) {
  if (width == 0 || height == 0) return;
  if (height == 1 || (dst_pitch == width && src_pitch == width)) {
    dst_.push_back(dst);
    src_.push_back(src);
    size_.push_back(width * height);
    if (dst_.size() >= kBatchMax) flush();
    return;
  }
  if (dst_pitch <= kMaxPitch && src_pitch <= kMaxPitch) {
    TIDE_CUDA_CHECK(cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, height, cudaMemcpyDeviceToDevice, stream_));
    return;
  }
  for (size_t r = 0; r < height; ++r)
    TIDE_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(dst) + r * dst_pitch,
                                    static_cast<const char*>(src) + r * src_pitch, width, cudaMemcpyDeviceToDevice,
                                    stream_));
}

void CopyBatch::flush() {
  if (dst_.empty()) return;
  bool done = false;
#if CUDART_VERSION >= 12080
  if (dst_.size() > 1 && batched_copies()) {
    cudaMemcpyAttributes attr{};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    attr.srcLocHint.type = cudaMemLocationTypeDevice;
    attr.srcLocHint.id = device_;
    attr.dstLocHint.type = cudaMemLocationTypeDevice;
    attr.dstLocHint.id = device_;
    attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
    size_t idx = 0;
#if CUDART_VERSION >= 13000
    cudaError_t e = cudaMemcpyBatchAsync(dst_.data(), src_.data(), size_.data(), dst_.size(), &attr, &idx, 1, stream_);
#else
    size_t fail_idx = 0;
    cudaError_t e = cudaMemcpyBatchAsync(dst_.data(), const_cast<void**>(src_.data()), size_.data(), dst_.size(), &attr,
                                         &idx, 1, &fail_idx, stream_);
#endif
    if (e == cudaSuccess) {
      done = true;
    } else if (e == cudaErrorNotSupported || e == cudaErrorInvalidValue) {
      (void)cudaGetLastError();
      g_batch_ok.store(false);
      env::log(::tide::detail::concat("cuda: cudaMemcpyBatchAsync refused (", cudaGetErrorString(e),
                              "): one cudaMemcpyAsync per copy from now on"));
    } else {
      TIDE_CUDA_CHECK(e);
    }
  }
#endif
  if (!done)
    for (size_t i = 0; i < dst_.size(); ++i)
      TIDE_CUDA_CHECK(cudaMemcpyAsync(dst_[i], src_[i], size_[i], cudaMemcpyDeviceToDevice, stream_));
  dst_.clear();
  src_.clear();
  size_.clear();
}

}  // namespace tide::cuda::detail

namespace tide::cuda {
bool batched_copies() { return detail::g_batch_ok.load(std::memory_order_relaxed); }
}  // namespace tide::cuda

// How kernels/*.cu launch: cudaLaunchKernelEx, whose return value is this launch's own result.
// A launch checked with cudaGetLastError() would report whatever an earlier call left as the
// thread's last error (a poll's cudaErrorNotReady, say) as its own failure.
#pragma once
#include <cuda_runtime.h>

#include <utility>

namespace tide::cuda {
void detail_count_launch();  // kernels/cast.cu: kernel_launch_count()

template <typename... Params, typename... Args>
cudaError_t launch_kernel(void (*kernel)(Params...), int grid, int block, cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(grid));
  config.blockDim = dim3(static_cast<unsigned>(block));
  config.stream = stream;
  const cudaError_t e = cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
  if (e == cudaSuccess) {
    detail_count_launch();
  } else {
    (void)cudaGetLastError();  // returned to the caller: leave nothing behind for the next check
  }
  return e;
}
}  // namespace tide::cuda

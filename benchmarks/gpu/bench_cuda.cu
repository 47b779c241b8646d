// TIDE's CUDA micro-benchmarks on one GPU (standalone: nvcc, cuBLAS, no GoogleTest):
//   (a) accumulate: TIDE-RS's bf16 -> fp32 accumulate kernel (4 sources) against a
//       device-to-device cudaMemcpy in the same run (bytes read + written per second);
//   (b) copy-engine all-gather: 4 shards copied with cudaMemcpyAsync into one storage;
//       one process, so the "peers" are other allocations on the same GPU (HBM-bound);
//   (c) a single-wave bf16 GEMM (cuBLAS; 11 x 12 output tiles of 128 x 256 = 132 tiles =
//       one wave on 132 SMs) timed alone, with a concurrent TIDE-RS proxy (copy-engine
//       phase 1 + launch_accumulate_f32 with TIDE_RS_CTAS CTAs), and with a concurrent SM
//       baseline: an in-house ring-style reduce kernel (bf16 in, bf16 out, 4 inputs) launched
//       with NCCL's default CTA count for an AG/RS ring on Hopper (16 CTAs x 512 threads, see
//       docs/model.md). NCCL itself cannot run 2 ranks on one GPU, so this is a proxy with
//       the same memory traffic and SM footprint, not ncclReduceScatter.
// Writes JSON with docs/model.md's --calibrate keys to argv[1] (default stdout).
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <functional>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "phase2_plan.hpp"
#include "tide/cuda/kernels.hpp"

#define CK(x)                                                                                 \
  do {                                                                                        \
    cudaError_t e_ = (x);                                                                     \
    if (e_ != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "bench: %s failed: %s (%s:%d)\n", #x, cudaGetErrorString(e_), __FILE__, __LINE__); \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)
#define CB(x)                                                                          \
  do {                                                                                 \
    cublasStatus_t s_ = (x);                                                           \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                                 \
      std::fprintf(stderr, "bench: %s failed: cublas status %d\n", #x, int(s_));       \
      std::exit(1);                                                                    \
    }                                                                                  \
  } while (0)

namespace {

__global__ void fill_bf16(__nv_bfloat16* p, size_t n, unsigned seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    unsigned h = (unsigned(i) * 2654435761u) ^ seed;
    h ^= h >> 13;
    p[i] = __float2bfloat16(float(int(h & 0xFFFF) - 32768) / 32768.f);
  }
}

// Ring-style reduce proxy: out = in0 + in1 + ... (bf16 in, fp32 math, bf16 out), grid-stride.
__global__ void ring_reduce_proxy(__nv_bfloat16* out, const __nv_bfloat16* const* in, int nin, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    float acc = 0.f;
    for (int k = 0; k < nin; ++k) acc += __bfloat162float(in[k][i]);
    out[i] = __float2bfloat16(acc);
  }
}

struct Timer {
  cudaEvent_t a, b;
  Timer() { CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b)); }
  void start(cudaStream_t s) { CK(cudaEventRecord(a, s)); }
  float stop_ms(cudaStream_t s) {
    CK(cudaEventRecord(b, s));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    return ms;
  }
};

__nv_bfloat16* bf16_buf(size_t n, unsigned seed) {
  __nv_bfloat16* p = nullptr;
  CK(cudaMalloc(&p, n * 2));
  fill_bf16<<<1024, 256>>>(p, n, seed);
  CK(cudaGetLastError());
  return p;
}

}  // namespace

int main(int argc, char** argv) {
  int dev = 0;
  CK(cudaSetDevice(dev));
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, dev));
  const int sms = prop.multiProcessorCount;
  const int rs_ctas = tide::cuda::accumulate_ctas();  // TIDE_RS_CTAS, else from the device
  const int nccl_ctas = std::getenv("NCCL_CTAS") ? std::atoi(std::getenv("NCCL_CTAS")) : 16;
  std::fprintf(stderr, "bench: %s, %d SMs, %d copy engines\n", prop.name, sms, prop.asyncEngineCount);
  cudaStream_t s0, s1, s2;
  CK(cudaStreamCreateWithFlags(&s0, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  Timer t;

  // (a) D2D copy vs accumulate.
  const size_t copy_bytes = size_t(1) << 30;
  void *ca = nullptr, *cb = nullptr;
  CK(cudaMalloc(&ca, copy_bytes));
  CK(cudaMalloc(&cb, copy_bytes));
  CK(cudaMemset(ca, 1, copy_bytes));
  for (int w = 0; w < 2; ++w) CK(cudaMemcpyAsync(cb, ca, copy_bytes, cudaMemcpyDeviceToDevice, s0));
  const int reps = 10;
  t.start(s0);
  for (int i = 0; i < reps; ++i) CK(cudaMemcpyAsync(cb, ca, copy_bytes, cudaMemcpyDeviceToDevice, s0));
  const double hbm_copy_GBps = 2.0 * copy_bytes * reps / (t.stop_ms(s0) * 1e-3) / 1e9;
  CK(cudaFree(ca));
  CK(cudaFree(cb));

  const int nsrc = 4;
  const size_t acc_n = size_t(64) << 20;  // 64 Mi elements: 4 x 128 MiB bf16 in, 256 MiB fp32 out
  std::vector<__nv_bfloat16*> src(nsrc);
  for (int k = 0; k < nsrc; ++k) src[k] = bf16_buf(acc_n, 17u * (k + 1));
  float* acc_out = nullptr;
  CK(cudaMalloc(&acc_out, acc_n * 4));
  tide::cuda::AccumulateSources as{};
  as.count = nsrc;
  for (int k = 0; k < nsrc; ++k) as.ptr[k] = src[k];
  const double acc_bytes = double(acc_n) * (2 * nsrc + 4);
  std::string by_ctas;
  double best_acc = 0, acc_at_rs_ctas = 0;
  int best_ctas = 0;
  for (int ctas : {rs_ctas, 16, 32, 66, sms, 2 * sms, 4 * sms}) {
    CK(tide::cuda::launch_accumulate_f32(acc_out, as, tide::DType::bf16, acc_n, 1.f, false, ctas, s0));
    t.start(s0);
    for (int i = 0; i < reps; ++i)
      CK(tide::cuda::launch_accumulate_f32(acc_out, as, tide::DType::bf16, acc_n, 1.f, false, ctas, s0));
    const double gbps = acc_bytes * reps / (t.stop_ms(s0) * 1e-3) / 1e9;
    by_ctas += (by_ctas.empty() ? "" : ", ") + std::string("\"") + std::to_string(ctas) + "\": " + std::to_string(gbps);
    if (ctas == rs_ctas) acc_at_rs_ctas = gbps;
    if (gbps > best_acc) best_acc = gbps, best_ctas = ctas;
  }
  std::fprintf(stderr, "bench: copy %.0f GB/s, accumulate best %.0f GB/s (%d CTAs, %.0f%%), at %d CTAs %.0f GB/s\n",
               hbm_copy_GBps, best_acc, best_ctas, 100 * best_acc / hbm_copy_GBps, rs_ctas, acc_at_rs_ctas);

  // (a2) Phase 2 as the executors launch it: a Qwen2-7B block's bf16 gradients at 6 ranks
  // (benchmarks/gpu/phase2_plan.cpp), destination 0's pieces reduced from 6 staged sources
  // (one GPU: the ranks' slots are 6 buffers) into an fp32 output laid out as FSDP2's
  // reduce_output. Reported: the fraction of source bytes read with vector loads
  // (accumulate_reads) with the CUDA executors' 16-byte-aligned plan and with a plan
  // without the alignment, and the bandwidth of each.
  auto phase2 = [&](int64_t align, double* gbps) {
    const tide::bench::Phase2Plan plan = tide::bench::qwen2_block_phase2(align);
    std::vector<__nv_bfloat16*> slots(size_t(plan.ranks));
    for (int r = 0; r < plan.ranks; ++r) slots[size_t(r)] = bf16_buf(size_t(plan.piece_elems), 31u * (r + 1));
    float* out = nullptr;
    CK(cudaMalloc(&out, size_t(plan.out_numel) * 4));
    auto pass = [&] {
      double bytes = 0;
      for (const auto& l : plan.launches) {
        tide::cuda::AccumulateSources srcs{};
        srcs.count = plan.ranks;
        for (int r = 0; r < plan.ranks; ++r) srcs.ptr[r] = slots[size_t(r)] + l.staging_offset;
        CK(tide::cuda::launch_accumulate_f32(out + l.out_offset, srcs, tide::DType::bf16, size_t(l.count), 1.f, false,
                                             rs_ctas, s0));
        bytes += double(l.count) * (2 * plan.ranks + 4);
      }
      return bytes;
    };
    pass();  // warm
    const tide::cuda::AccumulateReads before = tide::cuda::accumulate_reads();
    t.start(s0);
    const double bytes = pass();
    *gbps = bytes / (t.stop_ms(s0) * 1e-3) / 1e9;
    const tide::cuda::AccumulateReads after = tide::cuda::accumulate_reads();
    for (auto* p : slots) CK(cudaFree(p));
    CK(cudaFree(out));
    const double vec = double(after.vector_bytes - before.vector_bytes);
    return vec / (vec + double(after.scalar_bytes - before.scalar_bytes));
  };
  double phase2_GBps = 0, phase2_unaligned_GBps = 0;
  const double phase2_vectorized = phase2(tide::cuda::kAccumulateAlign, &phase2_GBps);
  const double phase2_vectorized_unaligned = phase2(0, &phase2_unaligned_GBps);
  std::fprintf(stderr, "bench: phase 2 of a Qwen2-7B block at 6 ranks: %.0f%% of source bytes vectorized, %.0f GB/s "
               "(plan without alignment: %.0f%%, %.0f GB/s)\n", 100 * phase2_vectorized, phase2_GBps,
               100 * phase2_vectorized_unaligned, phase2_unaligned_GBps);

  // (b) copy-engine all-gather: 3 peers' shards + own, 64 MiB each, into one storage.
  const size_t shard = size_t(64) << 20;
  const int ws = 4;
  std::vector<void*> shards(ws);
  for (auto& p : shards) { CK(cudaMalloc(&p, shard)); CK(cudaMemset(p, 3, shard)); }
  char* storage = nullptr;
  CK(cudaMalloc(&storage, shard * ws));
  auto ag = [&] {
    for (int r = 0; r < ws; ++r)
      CK(cudaMemcpyAsync(storage + r * shard, shards[r], shard, cudaMemcpyDeviceToDevice, s0));
  };
  ag();
  t.start(s0);
  for (int i = 0; i < reps; ++i) ag();
  const double allgather_ce_GBps = double(shard) * ws * reps / (t.stop_ms(s0) * 1e-3) / 1e9;
  std::fprintf(stderr, "bench: copy-engine all-gather %.0f GB/s delivered\n", allgather_ce_GBps);

  // (c) GEMMs.
  cublasHandle_t h;
  CB(cublasCreate(&h));
  CB(cublasSetStream(h, s0));
  auto gemm_time = [&](int m, int n, int k, int iters, __nv_bfloat16* A, __nv_bfloat16* B, __nv_bfloat16* C) {
    const float one = 1.f, zero = 0.f;
    auto run = [&] {
      CB(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, &one, A, CUDA_R_16BF, m, B, CUDA_R_16BF, k, &zero, C,
                      CUDA_R_16BF, m, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    };
    run();
    t.start(s0);
    for (int i = 0; i < iters; ++i) run();
    return t.stop_ms(s0) / iters;
  };
  const int L = 8192;
  __nv_bfloat16 *A = bf16_buf(size_t(L) * L, 1), *B = bf16_buf(size_t(L) * L, 2), *C = bf16_buf(size_t(L) * L, 3);
  CK(cudaDeviceSynchronize());
  const double big_ms = gemm_time(L, L, L, 10, A, B, C);
  const double gemm_bf16_TFLOPs = 2.0 * L * L * L / (big_ms * 1e-3) / 1e12;
  const int m = 128 * 11, n = 256 * (sms / 11 > 0 ? sms / 11 : 12), k = 8192;
  const int wave_iters = 50;
  const double alone_ms = gemm_time(m, n, k, wave_iters, A, B, C);

  // Background work sized to outlast the GEMM loop.
  const size_t rs_n = size_t(8) << 20;  // elements per RS chunk
  std::vector<__nv_bfloat16*> stage(nsrc);
  for (auto& p : stage) CK(cudaMalloc(&p, rs_n * 2));
  tide::cuda::AccumulateSources rs{};
  rs.count = nsrc;
  for (int k2 = 0; k2 < nsrc; ++k2) rs.ptr[k2] = stage[k2];
  cudaEvent_t staged;
  CK(cudaEventCreateWithFlags(&staged, cudaEventDisableTiming));
  auto tide_rs = [&](int chunks) {
    for (int c = 0; c < chunks; ++c) {
      for (int k2 = 0; k2 < nsrc; ++k2)
        CK(cudaMemcpyAsync(stage[k2], src[k2] + (c % 4) * rs_n, rs_n * 2, cudaMemcpyDeviceToDevice, s1));
      CK(cudaEventRecord(staged, s1));
      CK(cudaStreamWaitEvent(s2, staged, 0));
      CK(tide::cuda::launch_accumulate_f32(acc_out, rs, tide::DType::bf16, rs_n, 1.f, true, rs_ctas, s2));
    }
  };
  __nv_bfloat16** dev_in = nullptr;
  CK(cudaMalloc(&dev_in, sizeof(void*) * nsrc));
  CK(cudaMemcpy(dev_in, src.data(), sizeof(void*) * nsrc, cudaMemcpyHostToDevice));
  __nv_bfloat16* ring_out = bf16_buf(acc_n, 9);
  auto baseline = [&](int chunks) {
    for (int c = 0; c < chunks; ++c) {
      ring_reduce_proxy<<<nccl_ctas, 512, 0, s2>>>(ring_out, dev_in, nsrc, acc_n / 4);
      CK(cudaGetLastError());
    }
  };
  auto with_background = [&](const std::function<void(int)>& bg, int chunks) {
    CK(cudaDeviceSynchronize());
    bg(chunks);
    const double ms = gemm_time(m, n, k, wave_iters, A, B, C);
    const bool still_running = cudaStreamQuery(s2) == cudaErrorNotReady;
    CK(cudaDeviceSynchronize());
    if (!still_running) std::fprintf(stderr, "bench: warning: background work ended before the GEMM loop\n");
    return ms;
  };
  const double tide_ms = with_background(tide_rs, 40);
  const double base_ms = with_background(baseline, 40);
  std::fprintf(stderr, "bench: single-wave GEMM %dx%dx%d: alone %.1f us, + TIDE-RS (%d CTAs) %.1f us (+%.1f%%), + SM ring proxy (%d CTAs) %.1f us (+%.1f%%)\n",
               m, n, k, alone_ms * 1e3, rs_ctas, tide_ms * 1e3, 100 * (tide_ms / alone_ms - 1), nccl_ctas,
               base_ms * 1e3, 100 * (base_ms / alone_ms - 1));

  char json[4096];
  std::snprintf(json, sizeof json,
                "{\n  \"device\": \"%s\",\n  \"sm_count\": %d,\n  \"copy_engines\": %d,\n  \"hbm_copy_GBps\": %.1f,\n"
                "  \"accumulate_GBps\": %.1f,\n  \"accumulate_best_ctas\": %d,\n  \"accumulate_vs_copy\": %.3f,\n"
                "  \"accumulate_GBps_at_rs_ctas\": %.1f,\n  \"rs_ctas\": %d,\n  \"accumulate_GBps_by_ctas\": {%s},\n"
                "  \"rs_phase2_vectorized_fraction\": %.4f,\n  \"rs_phase2_GBps\": %.1f,\n"
                "  \"rs_phase2_vectorized_fraction_unaligned_plan\": %.4f,\n  \"rs_phase2_GBps_unaligned_plan\": %.1f,\n"
                "  \"allgather_ce_GBps\": %.1f,\n  \"gemm_bf16_TFLOPs\": %.1f,\n"
                "  \"gemm_single_wave\": {\"m\": %d, \"n\": %d, \"k\": %d},\n  \"gemm_single_wave_us\": %.2f,\n"
                "  \"gemm_with_tide_rs_us\": %.2f,\n  \"gemm_slowdown_tide_rs\": %.4f,\n"
                "  \"gemm_with_sm_ring_proxy_us\": %.2f,\n  \"gemm_slowdown_sm_ring_proxy\": %.4f,\n  \"nccl_ctas\": %d,\n"
                "  \"baseline\": \"in-house ring-style bf16 reduce kernel, %d CTAs x 512 threads, 4 inputs (one process; not ncclReduceScatter)\"\n}\n",
                prop.name, sms, prop.asyncEngineCount, hbm_copy_GBps, best_acc, best_ctas, best_acc / hbm_copy_GBps,
                acc_at_rs_ctas, rs_ctas, by_ctas.c_str(), phase2_vectorized, phase2_GBps, phase2_vectorized_unaligned,
                phase2_unaligned_GBps, allgather_ce_GBps, gemm_bf16_TFLOPs, m, n, k, alone_ms * 1e3,
                tide_ms * 1e3, tide_ms / alone_ms - 1, base_ms * 1e3, base_ms / alone_ms - 1, nccl_ctas, nccl_ctas);
  if (argc > 1) {
    FILE* f = std::fopen(argv[1], "w");
    if (!f) { std::perror(argv[1]); return 1; }
    std::fputs(json, f);
    std::fclose(f);
  }
  std::fputs(json, stdout);
  return 0;
}

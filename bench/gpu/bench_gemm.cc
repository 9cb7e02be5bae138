// GEMM throughput at the GPT block's shapes, through Strata's cuBLAS wrapper
// (gpu/cuda/cuda_gemm.h) against a direct cublasGemmEx call with cuBLAS' default
// algorithm (CUBLAS_GEMM_DEFAULT) on its own handle, and against the fastest of the
// algorithms cublasLt's heuristic proposes (the best configuration we can find).
//
//   BM_StrataGemm/<model>/<shape>/<dtype>     cuda::Gemm on a gpu::Stream
//   BM_CublasDefault/<model>/<shape>/<dtype>  cublasGemmEx, default algorithm
//   BM_CublasLtBest/<model>/<shape>/<dtype>   cublasLtMatmul, best of up to 8 algorithms
//
// <model>: 0 = gpt2-1.5b (C = 1600), 1 = gpt-7b (C = 4096); tokens per micro-batch
// B*T = 8192 for both. <shape>, row-major (M, K) x (K, N):
//   0 = QKV projection (B*T, C) x (C, 3C);  1 = MLP up (B*T, C) x (C, 4C);
//   2 = MLP down (B*T, 4C) x (4C, C).
// <dtype>: 1 = fp16, 2 = bf16 (DType values); inputs and output in that dtype, fp32
// accumulation. TFLOP/s = 2*M*N*K per GEMM over the time between CUDA events around 10
// GEMMs (manual time); medians of 5 repetitions.
//   bench_gemm --benchmark_out=gemm.json --benchmark_out_format=json
#include <benchmark/benchmark.h>
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "base/dtype.h"
#include "bench/gpu/bench_common.h"
#include "gpu/cuda/cuda_gemm.h"
#include "gpu/cuda/cuda_native.h"

namespace strata::gpu::bench {
namespace {

constexpr int kGemmsPerIteration = 10;
constexpr int64_t kTokens = 8192;

struct Shape {
  int64_t M, N, K;
};

Shape ShapeOf(int model, int which) {
  const int64_t C = model == 0 ? 1600 : 4096;
  switch (which) {
    case 0:
      return {kTokens, 3 * C, C};
    case 1:
      return {kTokens, 4 * C, C};
    default:
      return {kTokens, C, 4 * C};
  }
}

// Device buffers of one case, filled with small values (random bits could be NaN/inf,
// which some GPUs handle at a different speed).
struct Buffers {
  std::unique_ptr<DeviceArena> arena;
  DeviceSpan a, b, c;
  bool ok = false;
};

Buffers Setup(Device& dev, Stream& stream, const Shape& s, DType t) {
  Buffers buf;
  const size_t es = SizeOf(t);
  auto arena = dev.CreateArena((s.M * s.K + s.K * s.N + s.M * s.N) * es + 4096);
  if (!arena.ok()) return buf;
  buf.arena = std::move(*arena);
  buf.a = *buf.arena->Carve(s.M * s.K * es, "A");
  buf.b = *buf.arena->Carve(s.K * s.N * es, "B");
  buf.c = *buf.arena->Carve(s.M * s.N * es, "C");
  const uint16_t one_eighth = t == DType::kF16 ? FloatToHalf(0.125f) : FloatToBf16(0.125f);
  // cudaMemset sets bytes: the low and the high byte of every 16-bit element are set by
  // two strided 2D memsets (pitch 2 bytes, width 1 byte).
  cudaStream_t st = NativeStream(stream);
  for (DeviceSpan span : {buf.a, buf.b}) {
    if (cudaMemset2DAsync(span.data, 2, one_eighth & 0xff, 1, span.size_bytes / 2, st) !=
            cudaSuccess ||
        cudaMemset2DAsync(span.data + 1, 2, one_eighth >> 8, 1, span.size_bytes / 2, st) !=
            cudaSuccess) {
      return buf;
    }
  }
  buf.ok = stream.Synchronize().ok();
  return buf;
}

void Report(benchmark::State& state, const Shape& s) {
  const double flops = 2.0 * s.M * s.N * s.K * kGemmsPerIteration;
  state.counters["TFLOP/s"] = benchmark::Counter(
      flops * 1e-12 * static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
  state.counters["M"] = static_cast<double>(s.M);
  state.counters["N"] = static_cast<double>(s.N);
  state.counters["K"] = static_cast<double>(s.K);
}

// Times kGemmsPerIteration calls of `gemm` between two events on `st`.
template <typename F>
void TimedLoop(benchmark::State& state, cudaStream_t st, F&& gemm) {
  cudaEvent_t start = nullptr, stop = nullptr;
  if (cudaEventCreate(&start) != cudaSuccess || cudaEventCreate(&stop) != cudaSuccess) {
    state.SkipWithError("cudaEventCreate failed");
    return;
  }
  for (int i = 0; i < 3; ++i) gemm();  // warm-up (cuBLAS kernel selection, clocks)
  cudaStreamSynchronize(st);
  for (auto _ : state) {
    cudaEventRecord(start, st);
    for (int i = 0; i < kGemmsPerIteration; ++i) {
      if (!gemm()) {
        state.SkipWithError("GEMM failed");
        break;
      }
    }
    cudaEventRecord(stop, st);
    float ms = 0;
    if (cudaEventSynchronize(stop) != cudaSuccess ||
        cudaEventElapsedTime(&ms, start, stop) != cudaSuccess) {
      state.SkipWithError("timing failed");
      break;
    }
    state.SetIterationTime(ms * 1e-3);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
}

void BM_StrataGemm(benchmark::State& state) {
  GpuContext& gpu = Gpu();
  if (!gpu.device) {
    state.SkipWithError(gpu.why_not.c_str());
    return;
  }
  const Shape s = ShapeOf(static_cast<int>(state.range(0)), static_cast<int>(state.range(1)));
  const DType t = static_cast<DType>(state.range(2));
  auto stream = gpu.device->CreateStream("gemm");
  if (!stream.ok()) {
    state.SkipWithError(stream.status().ToString().c_str());
    return;
  }
  Buffers buf = Setup(*gpu.device, **stream, s, t);
  if (!buf.ok) {
    state.SkipWithError("could not set up the GEMM buffers");
    return;
  }
  // Row-major (M, K) x (K, N) with dense rows.
  TimedLoop(state, NativeStream(**stream), [&] {
    return cuda::Gemm(**stream, false, false, s.M, s.N, s.K, 1.0f, buf.a.data, s.K, buf.b.data, s.N,
                      0.0f, buf.c.data, s.N, t, t)
        .ok();
  });
  Report(state, s);
}

void BM_CublasDefault(benchmark::State& state) {
  GpuContext& gpu = Gpu();
  if (!gpu.device) {
    state.SkipWithError(gpu.why_not.c_str());
    return;
  }
  const Shape s = ShapeOf(static_cast<int>(state.range(0)), static_cast<int>(state.range(1)));
  const DType t = static_cast<DType>(state.range(2));
  auto stream = gpu.device->CreateStream("cublas");
  if (!stream.ok()) {
    state.SkipWithError(stream.status().ToString().c_str());
    return;
  }
  Buffers buf = Setup(*gpu.device, **stream, s, t);
  cublasHandle_t handle = nullptr;
  if (!buf.ok || cublasCreate(&handle) != CUBLAS_STATUS_SUCCESS) {
    state.SkipWithError("could not set up the GEMM buffers or the cuBLAS handle");
    return;
  }
  cudaStream_t st = NativeStream(**stream);
  cublasSetStream(handle, st);
  const cudaDataType_t dt = t == DType::kF16 ? CUDA_R_16F : CUDA_R_16BF;
  const float alpha = 1.0f, beta = 0.0f;
  // Column-major view of the row-major product: C^T = B^T A^T.
  TimedLoop(state, st, [&] {
    return cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(s.N),
                        static_cast<int>(s.M), static_cast<int>(s.K), &alpha, buf.b.data, dt,
                        static_cast<int>(s.N), buf.a.data, dt, static_cast<int>(s.K), &beta,
                        buf.c.data, dt, static_cast<int>(s.N), CUBLAS_COMPUTE_32F,
                        CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS;
  });
  cublasDestroy(handle);
  Report(state, s);
}

// The best cuBLAS configuration we can find: cublasLt's heuristic proposes up to 8
// algorithms (32 MiB workspace); each is timed over 5 GEMMs and the fastest is measured.
void BM_CublasLtBest(benchmark::State& state) {
  GpuContext& gpu = Gpu();
  if (!gpu.device) {
    state.SkipWithError(gpu.why_not.c_str());
    return;
  }
  const Shape s = ShapeOf(static_cast<int>(state.range(0)), static_cast<int>(state.range(1)));
  const DType t = static_cast<DType>(state.range(2));
  auto stream = gpu.device->CreateStream("cublaslt");
  if (!stream.ok()) {
    state.SkipWithError(stream.status().ToString().c_str());
    return;
  }
  Buffers buf = Setup(*gpu.device, **stream, s, t);
  constexpr size_t kWorkspaceBytes = size_t{32} << 20;
  auto ws_arena = gpu.device->CreateArena(kWorkspaceBytes);
  if (!buf.ok || !ws_arena.ok()) {
    state.SkipWithError("could not set up the GEMM buffers");
    return;
  }
  void* workspace = (*ws_arena)->Carve(kWorkspaceBytes, "workspace")->data;
  cudaStream_t st = NativeStream(**stream);
  const cudaDataType_t dt = t == DType::kF16 ? CUDA_R_16F : CUDA_R_16BF;
  cublasLtHandle_t lt = nullptr;
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t lb = nullptr, la = nullptr, lc = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  cublasLtMatmulHeuristicResult_t results[8] = {};
  int found = 0;
  const cublasOperation_t no_trans = CUBLAS_OP_N;
  // Column-major view: C^T (N, M) = B^T (N, K) * A^T (K, M).
  bool ok =
      cublasLtCreate(&lt) == CUBLAS_STATUS_SUCCESS &&
      cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F) == CUBLAS_STATUS_SUCCESS &&
      cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &no_trans, sizeof no_trans) ==
          CUBLAS_STATUS_SUCCESS &&
      cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &no_trans, sizeof no_trans) ==
          CUBLAS_STATUS_SUCCESS &&
      cublasLtMatrixLayoutCreate(&lb, dt, s.N, s.K, s.N) == CUBLAS_STATUS_SUCCESS &&
      cublasLtMatrixLayoutCreate(&la, dt, s.K, s.M, s.K) == CUBLAS_STATUS_SUCCESS &&
      cublasLtMatrixLayoutCreate(&lc, dt, s.N, s.M, s.N) == CUBLAS_STATUS_SUCCESS &&
      cublasLtMatmulPreferenceCreate(&pref) == CUBLAS_STATUS_SUCCESS &&
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                           &kWorkspaceBytes,
                                           sizeof kWorkspaceBytes) == CUBLAS_STATUS_SUCCESS &&
      cublasLtMatmulAlgoGetHeuristic(lt, op, lb, la, lc, lc, pref, 8, results, &found) ==
          CUBLAS_STATUS_SUCCESS &&
      found > 0;
  const float alpha = 1.0f, beta = 0.0f;
  auto run = [&](const cublasLtMatmulAlgo_t* algo) {
    return cublasLtMatmul(lt, op, &alpha, buf.b.data, lb, buf.a.data, la, &beta, buf.c.data, lc,
                          buf.c.data, lc, algo, workspace, kWorkspaceBytes,
                          st) == CUBLAS_STATUS_SUCCESS;
  };
  int best = -1;
  if (ok) {
    float best_ms = 0;
    cudaEvent_t start = nullptr, stop = nullptr;
    cudaEventCreate(&start);
    cudaEventCreate(&stop);
    for (int i = 0; i < found; ++i) {
      if (!run(&results[i].algo)) continue;  // warm-up; an algorithm may refuse the shape
      cudaEventRecord(start, st);
      bool all = true;
      for (int r = 0; r < 5; ++r) all = all && run(&results[i].algo);
      cudaEventRecord(stop, st);
      float ms = 0;
      if (all && cudaEventSynchronize(stop) == cudaSuccess &&
          cudaEventElapsedTime(&ms, start, stop) == cudaSuccess && (best < 0 || ms < best_ms)) {
        best = i;
        best_ms = ms;
      }
    }
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
  }
  if (best < 0) {
    state.SkipWithError("cublasLt found no algorithm for this GEMM");
  } else {
    TimedLoop(state, st, [&] { return run(&results[best].algo); });
    Report(state, s);
    state.counters["algorithms_tried"] = found;
  }
  if (pref) cublasLtMatmulPreferenceDestroy(pref);
  if (lc) cublasLtMatrixLayoutDestroy(lc);
  if (la) cublasLtMatrixLayoutDestroy(la);
  if (lb) cublasLtMatrixLayoutDestroy(lb);
  if (op) cublasLtMatmulDescDestroy(op);
  if (lt) cublasLtDestroy(lt);
}

void GemmArgs(benchmark::internal::Benchmark* b) {
  for (int model : {0, 1}) {
    for (int shape : {0, 1, 2}) {
      for (int dtype : {1, 2}) b->Args({model, shape, dtype});
    }
  }
  b->ArgNames({"model", "shape", "dtype"})
      ->UseManualTime()
      ->Repetitions(5)
      ->ReportAggregatesOnly(true);
}

BENCHMARK(BM_StrataGemm)->Apply(GemmArgs);
BENCHMARK(BM_CublasDefault)->Apply(GemmArgs);
BENCHMARK(BM_CublasLtBest)->Apply(GemmArgs);

}  // namespace
}  // namespace strata::gpu::bench

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  strata::gpu::bench::Gpu();  // context lines before the first result
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

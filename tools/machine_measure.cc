#include "tools/machine_measure.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "base/dtype.h"
#include "cpu_optim/any_optimizer.h"
#include "tools/optimizer_flags.h"
#include "tools/train_command.h"

#ifdef STRATA_HAVE_CUDA
#include <cuda_runtime.h>

#include "base/units.h"
#include "gpu/cuda/cuda_device.h"
#include "gpu/cuda/cuda_gemm.h"
#include "tools/pinned_bandwidth.h"
#endif

namespace strata::tools {
namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// bf16 bits of a float (round to nearest even; the values here are finite).
uint16_t Bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

}  // namespace

StatusOr<std::map<std::string, double>> MeasureCpuOptimizers(double seconds, int64_t num_params) {
  if (num_params < 1) {
    return InvalidArgumentError(
        fmt::format("measuring the CPU optimizer needs 1 parameter or more, got {}", num_params));
  }
  const size_t n = static_cast<size_t>(num_params);
  std::vector<float> master(n), s0(n), s1(n);
  std::vector<uint16_t> grad(n), copy_out(n);
  for (size_t i = 0; i < n; ++i) {
    // Weights near GPT-2's init scale and gradients of varied magnitude, all finite.
    master[i] = 0.02f * std::sin(0.001f * static_cast<float>(i));
    grad[i] = Bf16(1e-3f * std::cos(0.0007f * static_cast<float>(i)) + 1e-5f);
  }
  std::map<std::string, double> rates;
  for (const char* kind : kProfiledOptimizers) {
    TrainFlags flags;
    flags.optimizer = kind;
    STRATA_ASSIGN_OR_RETURN(cpu_optim::AnyOptimizer opt, BuildOptimizer(flags));
    std::vector<std::span<float>> state;
    std::vector<float>* buffers[] = {&s0, &s1};
    const int num_state = cpu_optim::NumState(opt);
    if (num_state > 2) {
      return InternalError(
          fmt::format("--optimizer {} keeps {} state buffers, 2 measured", kind, num_state));
    }
    for (int k = 0; k < num_state; ++k) {
      std::fill(buffers[k]->begin(), buffers[k]->end(), cpu_optim::InitialStateValue(opt, k));
      state.emplace_back(*buffers[k]);
    }
    const cpu_optim::GradView g{grad.data(), DType::kBF16};
    const cpu_optim::CopyOut out{copy_out.data(), DType::kBF16};
    int64_t step = 1;
    STRATA_RETURN_IF_ERROR(cpu_optim::Update(opt, cpu_optim::OptimStep{step++, 1.0f}, master, state,
                                             g, out));  // untimed: first touch
    const auto t0 = Clock::now();
    int passes = 0;
    do {
      STRATA_RETURN_IF_ERROR(
          cpu_optim::Update(opt, cpu_optim::OptimStep{step++, 1.0f}, master, state, g, out));
      ++passes;
    } while (Since(t0) < seconds);
    rates[kind] = static_cast<double>(n) * passes / Since(t0);
  }
  return rates;
}

#ifdef STRATA_HAVE_CUDA
namespace {

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t k = v.size();
  return k % 2 ? v[k / 2] : 0.5 * (v[k / 2 - 1] + v[k / 2]);
}

// Median seconds of `op` (enqueued on `stream`, then synchronized) over repetitions that fill
// about `seconds`, after one untimed run; at least 3 repetitions.
template <typename Op>
StatusOr<double> TimeOp(gpu::Stream& stream, double seconds, Op op) {
  STRATA_RETURN_IF_ERROR(op());
  STRATA_RETURN_IF_ERROR(stream.Synchronize());
  std::vector<double> t;
  const auto start = Clock::now();
  while (t.size() < 3 || (Since(start) < seconds && t.size() < 1000)) {
    const auto t0 = Clock::now();
    STRATA_RETURN_IF_ERROR(op());
    STRATA_RETURN_IF_ERROR(stream.Synchronize());
    t.push_back(Since(t0));
  }
  return Median(t);
}

StatusOr<GpuMeasurement> MeasureCudaGpu(double seconds) {
  GpuMeasurement m;
  cudaDeviceProp prop{};
  if (cudaError_t e = cudaGetDeviceProperties(&prop, 0); e != cudaSuccess) {
    return UnavailableError(fmt::format("cudaGetDeviceProperties: {}", cudaGetErrorString(e)));
  }
  constexpr size_t kCopyBytes = size_t{256} << 20;
  gpu::CudaDeviceOptions o;
  o.pinned_budget_bytes = 2 * kCopyBytes;
  STRATA_ASSIGN_OR_RETURN(auto device, gpu::CreateCudaDevice(o));
  STRATA_ASSIGN_OR_RETURN(PinnedBandwidth bw, MeasurePinnedBandwidth(*device, kCopyBytes, 5));
  m.pcie =
      engine::MachineProfile::Pcie{bw.h2d_bytes_per_second / 1e9, bw.d2h_bytes_per_second / 1e9};

  constexpr int64_t kDim = 8192;
  constexpr int64_t kConvertElems = int64_t{256} << 20;  // 512 MiB of bf16 -> 1 GiB of fp32
  const size_t matrix_bytes = static_cast<size_t>(kDim * kDim * 2);
  STRATA_ASSIGN_OR_RETURN(auto arena,
                          device->CreateArena(3 * matrix_bytes + 6 * kConvertElems + 4096));
  STRATA_ASSIGN_OR_RETURN(gpu::DeviceSpan a, arena->Carve(matrix_bytes, "profile gemm A"));
  STRATA_ASSIGN_OR_RETURN(gpu::DeviceSpan b, arena->Carve(matrix_bytes, "profile gemm B"));
  STRATA_ASSIGN_OR_RETURN(gpu::DeviceSpan c, arena->Carve(matrix_bytes, "profile gemm C"));
  STRATA_ASSIGN_OR_RETURN(gpu::DeviceSpan src, arena->Carve(2 * kConvertElems, "profile src"));
  STRATA_ASSIGN_OR_RETURN(gpu::DeviceSpan dst, arena->Carve(4 * kConvertElems, "profile dst"));
  STRATA_ASSIGN_OR_RETURN(auto stream, device->CreateStream("profile"));
  // Defined inputs (zeros: the GEMM's speed does not depend on the values, NaNs aside).
  for (const gpu::DeviceSpan& span : {a, b, src}) {
    if (cudaError_t e = cudaMemset(span.data, 0, span.size_bytes); e != cudaSuccess) {
      return InternalError(fmt::format("cudaMemset: {}", cudaGetErrorString(e)));
    }
  }
  STRATA_ASSIGN_OR_RETURN(const double t_gemm, TimeOp(*stream, seconds, [&] {
                            return gpu::cuda::Gemm(*stream, false, false, kDim, kDim, kDim, 1.0f,
                                                   a.data, kDim, b.data, kDim, 0.0f, c.data, kDim,
                                                   DType::kBF16, DType::kBF16);
                          }));
  STRATA_ASSIGN_OR_RETURN(const double t_convert, TimeOp(*stream, seconds, [&] {
                            return stream->Convert(dst, DType::kF32, src, DType::kBF16,
                                                   kConvertElems);
                          }));
  const double gemm_flops = 2.0 * kDim * kDim * kDim / t_gemm;
  m.device = engine::MachineProfile::Device{
      prop.name, static_cast<double>(prop.totalGlobalMem) / static_cast<double>(kGiB),
      0.75 * gemm_flops / 1e12, 6.0 * static_cast<double>(kConvertElems) / t_convert / 1e9};
  return m;
}

}  // namespace
#endif

GpuMeasurement MeasureGpu(double seconds) {
#ifdef STRATA_HAVE_CUDA
  const StatusOr<int> count = gpu::CudaDeviceCount();
  if (!count.ok()) return GpuMeasurement{{}, {}, count.status().message()};
  if (*count == 0) return GpuMeasurement{{}, {}, "no CUDA GPU is visible"};
  StatusOr<GpuMeasurement> m = MeasureCudaGpu(seconds);
  if (!m.ok()) return GpuMeasurement{{}, {}, m.status().message()};
  return *m;
#else
  (void)seconds;
  return GpuMeasurement{{}, {}, "this build has no CUDA backend"};
#endif
}

}  // namespace strata::tools

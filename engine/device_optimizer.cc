#include "engine/device_optimizer.h"

#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <string>
#include <utility>

#include "cpu_optim/kernels.h"

#if defined(STRATA_HAVE_CUDA)
#include "engine/cuda/device_optimizer_kernels.h"
#include "gpu/cuda/cuda_native.h"
#endif

namespace strata::engine {
namespace {

namespace co = cpu_optim;
namespace ci = cpu_optim::internal;

// The record of EnqueueDeviceGradStats: this header, then num_sums fp64 partial sums (the leaves
// of cpu_optim's order on the CUDA backend; the whole sum, one entry, on the host backend).
struct StatsHeader {
  int64_t num_elems;
  int64_t num_sums;
};
static_assert(sizeof(StatsHeader) == kDeviceGradStatsHeaderBytes);  // DeviceGradStatsBytes

int64_t NumLeaves(int64_t num_elems) {
  return num_elems <= 0 ? 0 : (num_elems + ci::kStatsLeafElems - 1) / ci::kStatsLeafElems;
}

size_t ElemBytes(DType dtype) { return dtype == DType::kF32 ? 4 : 2; }

// dtype is one of fp32, fp16, bf16.
Status CheckDType(const char* fn, const char* what, DType dtype) {
  if (ci::IsValidDType(dtype)) return Status::Ok();
  return InvalidArgumentError(
      fmt::format("{}: {} has unknown dtype {}", fn, what, static_cast<int>(dtype)));
}

// span holds num_elems elements of elem_bytes each, is not null when num_elems > 0 and is aligned
// to elem_bytes (or to `align` when given).
Status CheckSpan(const char* fn, const char* what, gpu::DeviceSpan span, int64_t num_elems,
                 size_t elem_bytes, size_t align = 0) {
  const size_t need = static_cast<size_t>(num_elems) * elem_bytes;
  if (num_elems > 0 && span.data == nullptr) {
    return InvalidArgumentError(
        fmt::format("{}: {} is null with num_elems {}", fn, what, num_elems));
  }
  if (span.size_bytes < need) {
    return InvalidArgumentError(fmt::format("{}: {} holds {} bytes, {} elements need {}", fn, what,
                                            span.size_bytes, num_elems, need));
  }
  if (align == 0) align = elem_bytes;
  if (reinterpret_cast<uintptr_t>(span.data) % align != 0) {
    return InvalidArgumentError(fmt::format("{}: {} is not {}-byte aligned", fn, what, align));
  }
  return Status::Ok();
}

struct NamedRange {
  const std::byte* data;
  size_t size_bytes;
  std::string name;
};

Status CheckNoOverlap(const char* fn, const std::vector<NamedRange>& ranges) {
  for (size_t i = 0; i < ranges.size(); ++i) {
    for (size_t j = i + 1; j < ranges.size(); ++j) {
      if (ci::Overlaps(ranges[i].data, ranges[i].size_bytes, ranges[j].data,
                       ranges[j].size_bytes)) {
        return InvalidArgumentError(
            fmt::format("{}: {} and {} overlap", fn, ranges[i].name, ranges[j].name));
      }
    }
  }
  return Status::Ok();
}

// The kind's hyper-parameters and the step, as cpu_optim checks them.
Status CheckStepParams(const co::AnyOptimizer& o, const co::OptimStep& step) {
  switch (o.kind) {
    case co::OptimizerKind::kAdamW:
    case co::OptimizerKind::kAdam:
      return ci::ValidateAdamWParams(o.adamw(), step);
    case co::OptimizerKind::kAdagrad:
      return ci::ValidateAdagradParams(std::get<co::AdagradConfig>(o.config), step);
    case co::OptimizerKind::kLion:
      return ci::ValidateLionParams(std::get<co::LionConfig>(o.config), step);
    case co::OptimizerKind::kSgd:
      return ci::ValidateSgdParams(std::get<co::SgdConfig>(o.config), step);
    case co::OptimizerKind::kAdamW8bit:
    case co::OptimizerKind::kAdafactor:
      break;
  }
  return CheckDeviceOptimizer(o);
}

Status CheckUpdate(const co::AnyOptimizer& optimizer, const co::OptimStep& step,
                   const DeviceUpdateBuffers& b) {
  constexpr const char* kFn = "EnqueueDeviceUpdate";
  STRATA_RETURN_IF_ERROR(CheckDeviceOptimizer(optimizer));
  STRATA_RETURN_IF_ERROR(CheckStepParams(optimizer, step));
  const int64_t n = b.num_elems;
  if (n < 0) return InvalidArgumentError(fmt::format("{}: num_elems must be >= 0, got {}", kFn, n));
  const std::vector<int64_t> shape = {n};
  const std::vector<co::StateSpec> layout = co::StateLayout(optimizer, std::span(&shape, 1));
  if (b.state.size() != layout.size()) {
    std::string names;
    for (const co::StateSpec& s : layout) names += (names.empty() ? "" : ", ") + s.name;
    return InvalidArgumentError(fmt::format("{}: {} takes {} state sections ({}), got {}", kFn,
                                            co::OptimizerKindName(optimizer.kind), layout.size(),
                                            names.empty() ? "none" : names, b.state.size()));
  }
  std::vector<NamedRange> ranges;
  STRATA_RETURN_IF_ERROR(CheckSpan(kFn, "master", b.master, n, 4));
  ranges.push_back({b.master.data, static_cast<size_t>(n) * 4, "master"});
  for (size_t i = 0; i < layout.size(); ++i) {
    const co::StateSpec& spec = layout[i];
    const std::string what = "state section " + spec.name;
    if (spec.dtype != co::StateDType::kF32 || spec.num_elems != n) {
      return InvalidArgumentError(
          fmt::format("{}: {} is not one fp32 value per element", kFn, what));
    }
    STRATA_RETURN_IF_ERROR(CheckSpan(kFn, what.c_str(), b.state[i], n, 4));
    ranges.push_back({b.state[i].data, spec.size_bytes(), what});
  }
  STRATA_RETURN_IF_ERROR(CheckDType(kFn, "grad", b.grad_dtype));
  STRATA_RETURN_IF_ERROR(CheckSpan(kFn, "grad", b.grad, n, ElemBytes(b.grad_dtype)));
  ranges.push_back({b.grad.data, static_cast<size_t>(n) * ElemBytes(b.grad_dtype), "grad"});
  if (b.working.data != nullptr) {
    STRATA_RETURN_IF_ERROR(CheckDType(kFn, "working", b.working_dtype));
    STRATA_RETURN_IF_ERROR(CheckSpan(kFn, "working", b.working, n, ElemBytes(b.working_dtype)));
    ranges.push_back(
        {b.working.data, static_cast<size_t>(n) * ElemBytes(b.working_dtype), "working"});
  }
  STRATA_RETURN_IF_ERROR(co::CheckNoDecayRanges(kFn, b.no_decay, n));
  return CheckNoOverlap(kFn, ranges);
}

std::string NoCudaBackend(const char* fn) {
  return std::string(fn) + ": a CUDA stream, but this build has no CUDA backend (STRATA_CUDA=OFF)";
}

#if defined(STRATA_HAVE_CUDA)
// One kernel over all of b's elements with one config (b.no_decay is not read).
Status LaunchCudaUpdateRun(gpu::Stream& stream, const co::AnyOptimizer& o,
                           const co::OptimStep& step, const DeviceUpdateBuffers& b) {
  const cudaStream_t cs = gpu::NativeStream(stream);
  const int64_t n = b.num_elems;
  float* master = b.master.as<float>();
  const void* grad = b.grad.data;
  void* out = b.working.data;
  auto state = [&](size_t i) { return i < b.state.size() ? b.state[i].as<float>() : nullptr; };
  switch (o.kind) {
    case co::OptimizerKind::kAdamW:
    case co::OptimizerKind::kAdam: {
      const ci::AdamWScalars s = ci::PrepareAdamW(o.adamw(), step);
      const ci::AdamWBuffers buf{
          master,       state(0), state(1),        grad,
          b.grad_dtype, out,      b.working_dtype, s.amsgrad ? state(2) : nullptr};
      return cuda::LaunchAdamWUpdate(cs, s, buf, n);
    }
    case co::OptimizerKind::kAdagrad:
      return cuda::LaunchAdagradUpdate(
          cs, ci::PrepareAdagrad(std::get<co::AdagradConfig>(o.config), step),
          {master, state(0), grad, b.grad_dtype, out, b.working_dtype}, n);
    case co::OptimizerKind::kLion:
      return cuda::LaunchLionUpdate(cs, ci::PrepareLion(std::get<co::LionConfig>(o.config), step),
                                    {master, state(0), grad, b.grad_dtype, out, b.working_dtype},
                                    n);
    case co::OptimizerKind::kSgd:
      return cuda::LaunchSgdUpdate(cs, ci::PrepareSgd(std::get<co::SgdConfig>(o.config), step),
                                   {master, state(0), grad, b.grad_dtype, out, b.working_dtype}, n);
    case co::OptimizerKind::kAdamW8bit:
    case co::OptimizerKind::kAdafactor:
      break;
  }
  return CheckDeviceOptimizer(o);
}

// One launch per run of elements of one weight decay group (the buffers' pointers moved to the
// run's first element; the launcher takes the four-element path where they stay aligned).
Status LaunchCudaUpdate(gpu::Stream& stream, const co::AnyOptimizer& o, const co::OptimStep& step,
                        const DeviceUpdateBuffers& b) {
  if (b.no_decay.empty()) return LaunchCudaUpdateRun(stream, o, step, b);
  const co::AnyOptimizer undecayed = co::WithoutWeightDecay(o);
  auto launch = [&](int64_t begin, int64_t end, bool decayed) {
    DeviceUpdateBuffers run;
    run.num_elems = end - begin;
    auto part = [&](const gpu::DeviceSpan& span, size_t elem_bytes) {
      if (span.data == nullptr) return span;
      return gpu::DeviceSpan{span.data + static_cast<size_t>(begin) * elem_bytes,
                             static_cast<size_t>(end - begin) * elem_bytes};
    };
    run.master = part(b.master, 4);
    for (const gpu::DeviceSpan& st : b.state) run.state.push_back(part(st, 4));
    run.grad = part(b.grad, ElemBytes(b.grad_dtype));
    run.grad_dtype = b.grad_dtype;
    run.working = part(b.working, ElemBytes(b.working_dtype));
    run.working_dtype = b.working_dtype;
    return LaunchCudaUpdateRun(stream, decayed ? o : undecayed, step, run);
  };
  for (const co::DecayRun& r : co::DecayRuns(b.no_decay, b.num_elems)) {
    STRATA_RETURN_IF_ERROR(launch(r.begin, r.end, r.decayed));
  }
  return Status::Ok();
}
#endif

}  // namespace

Status EnqueueDeviceUpdate(gpu::Stream& stream, const co::AnyOptimizer& optimizer,
                           const co::OptimStep& step, const DeviceUpdateBuffers& buffers) {
  STRATA_RETURN_IF_ERROR(CheckUpdate(optimizer, step, buffers));
  if (buffers.num_elems == 0) return Status::Ok();
  if (stream.device_kind() == gpu::DeviceKind::kCuda) {
#if defined(STRATA_HAVE_CUDA)
    return LaunchCudaUpdate(stream, optimizer, step, buffers);
#else
    return FailedPreconditionError(NoCudaBackend("EnqueueDeviceUpdate"));
#endif
  }
  // Host backend: device memory is host memory; cpu_optim runs the update on the stream's thread.
  const size_t n = static_cast<size_t>(buffers.num_elems);
  std::vector<std::span<std::byte>> state;
  for (const gpu::DeviceSpan& s : buffers.state) state.emplace_back(s.data, n * 4);
  co::CopyOut copy_out;
  if (buffers.working.data != nullptr) copy_out = {buffers.working.data, buffers.working_dtype};
  return stream.LaunchHost([optimizer, step, master = buffers.master.as<float>(), n,
                            state = std::move(state),
                            grad = co::GradView{buffers.grad.data, buffers.grad_dtype}, copy_out,
                            no_decay = buffers.no_decay]() {
    const std::vector<int64_t> shape = {static_cast<int64_t>(n)};
    return co::UpdateState(optimizer, step, std::span(&shape, 1), std::span(master, n), state, grad,
                           copy_out, no_decay);
  });
}

Status EnqueueDeviceGradStats(gpu::Stream& stream, gpu::DeviceSpan grad, DType dtype,
                              int64_t num_elems, float scale, gpu::DeviceSpan stats) {
  constexpr const char* kFn = "EnqueueDeviceGradStats";
  if (num_elems < 0) {
    return InvalidArgumentError(fmt::format("{}: num_elems must be >= 0, got {}", kFn, num_elems));
  }
  STRATA_RETURN_IF_ERROR(CheckDType(kFn, "grad", dtype));
  STRATA_RETURN_IF_ERROR(CheckSpan(kFn, "grad", grad, num_elems, ElemBytes(dtype)));
  if (!std::isfinite(scale)) {
    return InvalidArgumentError(fmt::format("{}: scale must be finite, got {}", kFn, scale));
  }
  const size_t record_bytes = DeviceGradStatsBytes(num_elems);
  if (stats.data == nullptr) return InvalidArgumentError(fmt::format("{}: stats is null", kFn));
  STRATA_RETURN_IF_ERROR(CheckSpan(kFn, "stats", stats, 1, record_bytes, 8));
  STRATA_RETURN_IF_ERROR(
      CheckNoOverlap(kFn, {{grad.data, static_cast<size_t>(num_elems) * ElemBytes(dtype), "grad"},
                           {stats.data, record_bytes, "stats"}}));
  if (stream.device_kind() == gpu::DeviceKind::kCuda) {
#if defined(STRATA_HAVE_CUDA)
    return cuda::LaunchGradStats(gpu::NativeStream(stream), grad.data, dtype, num_elems, scale,
                                 stats.data);
#else
    return FailedPreconditionError(NoCudaBackend(kFn));
#endif
  }
  return stream.LaunchHost([grad = grad.data, dtype, num_elems, scale, record = stats.data]() {
    STRATA_ASSIGN_OR_RETURN(const co::GradStats s,
                            co::ComputeGradStats({grad, dtype}, num_elems, scale));
    const StatsHeader header{num_elems, num_elems > 0 ? 1 : 0};
    std::memcpy(record, &header, sizeof(header));
    if (num_elems > 0) std::memcpy(record + sizeof(header), &s.sum_squares, sizeof(double));
    return Status::Ok();
  });
}

namespace {
// cpu_optim's PairwiseLeafSum (cpu_optim/parallel.h) over sums[first, last), without the tasks.
double PairwiseSum(const double* sums, int64_t first, int64_t last) {
  if (last - first == 1) return sums[first];
  const int64_t mid = first + (last - first) / 2;
  return PairwiseSum(sums, first, mid) + PairwiseSum(sums, mid, last);
}
}  // namespace

StatusOr<co::GradStats> DecodeDeviceGradStats(std::span<const std::byte> record) {
  StatsHeader header;
  if (record.size() < sizeof(header)) {
    return DataLossError(
        fmt::format("device gradient statistics: a record of {} bytes is shorter "
                    "than its {}-byte header",
                    record.size(), sizeof(header)));
  }
  std::memcpy(&header, record.data(), sizeof(header));
  const int64_t leaves = NumLeaves(header.num_elems);
  if (header.num_elems < 0 || header.num_sums < 0 || header.num_sums > leaves ||
      (header.num_sums == 0) != (header.num_elems == 0)) {
    return DataLossError(fmt::format(
        "device gradient statistics: inconsistent header ({} elements, {} partial sums)",
        header.num_elems, header.num_sums));
  }
  const size_t need = sizeof(header) + sizeof(double) * static_cast<size_t>(header.num_sums);
  if (record.size() < need) {
    return DataLossError(
        fmt::format("device gradient statistics: the record holds {} bytes, its "
                    "header says {}",
                    record.size(), need));
  }
  std::vector<double> sums(static_cast<size_t>(header.num_sums));
  if (!sums.empty())
    std::memcpy(sums.data(), record.data() + sizeof(header), need - sizeof(header));
  co::GradStats stats;
  stats.num_elems = header.num_elems;
  stats.sum_squares = sums.empty() ? 0.0 : PairwiseSum(sums.data(), 0, header.num_sums);
  stats.nonfinite = !std::isfinite(stats.sum_squares);
  return stats;
}

Status EnqueueDeviceGradAccumulate(gpu::Stream& stream, gpu::DeviceSpan acc, gpu::DeviceSpan grad,
                                   DType dtype, int64_t num_elems, bool overwrite) {
  constexpr const char* kFn = "EnqueueDeviceGradAccumulate";
  if (num_elems < 0) {
    return InvalidArgumentError(fmt::format("{}: num_elems must be >= 0, got {}", kFn, num_elems));
  }
  STRATA_RETURN_IF_ERROR(CheckDType(kFn, "grad", dtype));
  STRATA_RETURN_IF_ERROR(CheckSpan(kFn, "acc", acc, num_elems, 4));
  STRATA_RETURN_IF_ERROR(CheckSpan(kFn, "grad", grad, num_elems, ElemBytes(dtype)));
  const size_t n = static_cast<size_t>(num_elems);
  STRATA_RETURN_IF_ERROR(
      CheckNoOverlap(kFn, {{acc.data, n * 4, "acc"}, {grad.data, n * ElemBytes(dtype), "grad"}}));
  if (num_elems == 0) return Status::Ok();
  if (stream.device_kind() == gpu::DeviceKind::kCuda) {
#if defined(STRATA_HAVE_CUDA)
    return cuda::LaunchGradAccumulate(gpu::NativeStream(stream), acc.as<float>(), grad.data, dtype,
                                      num_elems, overwrite);
#else
    return FailedPreconditionError(NoCudaBackend(kFn));
#endif
  }
  return stream.LaunchHost([acc = acc.as<float>(), g = grad.data, dtype, n, overwrite]() {
    return co::AccumulateGrad(std::span(acc, n), {g, dtype}, overwrite, /*want_stats=*/false)
        .status();
  });
}

}  // namespace strata::engine

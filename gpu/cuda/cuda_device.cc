// The CUDA backend of gpu::Device; see cuda_device.h for the contract.
#include "gpu/cuda/cuda_device.h"

#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <cstring>
#include <mutex>

#include "base/logging.h"
#include "base/thread_annotations.h"
#include "base/units.h"
#include "gpu/cuda/cublas_loader.h"
#include "gpu/cuda/cuda_kernels.cuh"
#include "gpu/cuda/cuda_native.h"
#include "gpu/cuda/cuda_status.h"

namespace strata::gpu {
namespace {

constexpr size_t kCublasWorkspaceBytes = size_t{32} << 20;  // cuBLAS' recommendation for Hopper

// The sticky error of one stream, shared with the events it recorded (an event may
// outlive the stream) and with its in-flight host functions.
struct StickyError {
  std::mutex mu;
  Status error STRATA_GUARDED_BY(mu);

  Status Get() {
    std::lock_guard<std::mutex> lock(mu);
    return error;
  }
  void Set(const Status& s) {
    std::lock_guard<std::mutex> lock(mu);
    if (error.ok()) error = s;
  }
};

class CudaEvent final : public Event {
 public:
  CudaEvent(int ordinal, cudaEvent_t event) : ordinal_(ordinal), event_(event) {}
  ~CudaEvent() override {
    if (cudaSetDevice(ordinal_) == cudaSuccess) cudaEventDestroy(event_);
    cudaGetLastError();
  }

  Status Synchronize() override {
    STRATA_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(event_));
    std::shared_ptr<StickyError> recorder;
    {
      std::lock_guard<std::mutex> lock(mu_);
      recorder = recorder_;
    }
    return recorder ? recorder->Get() : Status::Ok();
  }

  bool Query() override {
    const cudaError_t e = cudaEventQuery(event_);
    if (e == cudaErrorNotReady) return false;
    cudaGetLastError();  // any other error: completed as far as waiting goes; Synchronize says why
    return true;
  }

  cudaEvent_t native() const { return event_; }
  void set_recorder(std::shared_ptr<StickyError> recorder) {
    std::lock_guard<std::mutex> lock(mu_);
    recorder_ = std::move(recorder);
  }

 private:
  const int ordinal_;
  const cudaEvent_t event_;
  std::mutex mu_;
  std::shared_ptr<StickyError> recorder_ STRATA_GUARDED_BY(mu_);
};

class CudaStream final : public Stream {
 public:
  CudaStream(std::string name, int ordinal, cudaStream_t stream, trace::TraceRecorder* trace,
             std::atomic<uint64_t>* h2d, std::atomic<uint64_t>* d2h)
      : name_(std::move(name)),
        ordinal_(ordinal),
        stream_(stream),
        trace_(trace),
        track_(trace ? trace->RegisterTrack(name_) : 0),
        h2d_(h2d),
        d2h_(d2h) {}

  ~CudaStream() override {
    if (cudaSetDevice(ordinal_) == cudaSuccess) {
      cudaStreamSynchronize(stream_);  // no copy, kernel or host function outlives it
      if (cublas_) cuda::Cublas().value()->Destroy(cublas_);  // loaded: it made cublas_
      if (cublas_workspace_) cudaFree(cublas_workspace_);
      cudaStreamDestroy(stream_);
    }
    cudaGetLastError();
  }

  std::string_view name() const override { return name_; }
  DeviceKind device_kind() const override { return DeviceKind::kCuda; }

  Status CopyH2D(DeviceSpan dst, PinnedSpan src) override {
    if (dst.size_bytes < src.size_bytes || (src.size_bytes && (!dst.data || !src.data))) {
      return InvalidArgumentError(fmt::format("{}: H2D copy of {} bytes into a {}-byte device span",
                                              name_, src.size_bytes, dst.size_bytes));
    }
    if (src.size_bytes == 0) return Status::Ok();
    STRATA_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(dst.data, src.data, src.size_bytes, cudaMemcpyHostToDevice, stream_));
    *h2d_ += src.size_bytes;
    return Status::Ok();
  }

  Status CopyD2H(PinnedSpan dst, DeviceSpan src) override {
    if (dst.size_bytes < src.size_bytes || (src.size_bytes && (!dst.data || !src.data))) {
      return InvalidArgumentError(fmt::format("{}: D2H copy of {} bytes into a {}-byte pinned span",
                                              name_, src.size_bytes, dst.size_bytes));
    }
    if (src.size_bytes == 0) return Status::Ok();
    STRATA_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(dst.data, src.data, src.size_bytes, cudaMemcpyDeviceToHost, stream_));
    *d2h_ += src.size_bytes;
    return Status::Ok();
  }

  Status Convert(DeviceSpan dst, DType dst_dtype, DeviceSpan src, DType src_dtype, int64_t n,
                 float scale) override;

  Status LaunchHost(std::function<Status()> fn) override {
    auto* task = new HostTask{std::move(fn), sticky_, trace_, track_, name_};
    const cudaError_t e = cudaLaunchHostFunc(stream_, &RunHostTask, task);
    if (e != cudaSuccess) {
      delete task;
      return cuda::CudaStatus(e, "cudaLaunchHostFunc");
    }
    return Status::Ok();
  }

  Status Record(Event& event) override {
    auto& e = static_cast<CudaEvent&>(event);
    STRATA_CUDA_RETURN_IF_ERROR(cudaEventRecord(e.native(), stream_));
    e.set_recorder(sticky_);
    return Status::Ok();
  }

  Status Wait(Event& event) override {
    STRATA_CUDA_RETURN_IF_ERROR(
        cudaStreamWaitEvent(stream_, static_cast<CudaEvent&>(event).native(), 0));
    return Status::Ok();
  }

  Status Synchronize() override {
    STRATA_RETURN_IF_ERROR(cuda::CudaStatus(cudaStreamSynchronize(stream_), "cudaStreamSynchronize")
                               .WithContext(fmt::format("stream '{}'", name_)));
    return sticky_->Get();
  }

  cudaStream_t native() const { return stream_; }

  // Creates the handle on first use; no CUDA call runs under the lock (a racing
  // second creator destroys its own handle and uses the first). cuBLAS itself is
  // loaded here, on the first handle of the process (cublas_loader.h).
  StatusOr<cublasHandle_t> cublas() {
    STRATA_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal_));  // cuBLAS calls follow on this thread
    {
      std::lock_guard<std::mutex> lock(cublas_mu_);
      if (cublas_) return cublas_;
    }
    STRATA_ASSIGN_OR_RETURN(const cuda::CublasApi* blas, cuda::Cublas());
    void* workspace = nullptr;
    const cudaError_t e = cudaMalloc(&workspace, kCublasWorkspaceBytes);
    if (e != cudaSuccess) {
      return cuda::CudaStatus(e, "cudaMalloc")
          .WithContext(fmt::format("stream '{}': the {} cuBLAS workspace", name_,
                                   FormatBytes(kCublasWorkspaceBytes)));
    }
    cublasHandle_t handle = nullptr;
    Status s = cuda::CublasStatus(blas->Create(&handle), "cublasCreate");
    if (s.ok()) s = cuda::CublasStatus(blas->SetStream(handle, stream_), "cublasSetStream");
    if (s.ok()) {
      s = cuda::CublasStatus(blas->SetWorkspace(handle, workspace, kCublasWorkspaceBytes),
                             "cublasSetWorkspace");
    }
    if (s.ok()) {
      s = cuda::CublasStatus(blas->SetPointerMode(handle, CUBLAS_POINTER_MODE_HOST),
                             "cublasSetPointerMode");
    }
    if (s.ok()) {
      s = cuda::CublasStatus(blas->SetMathMode(handle, CUBLAS_DEFAULT_MATH), "cublasSetMathMode");
    }
    bool installed = false;
    if (s.ok()) {
      std::lock_guard<std::mutex> lock(cublas_mu_);
      if (!cublas_) {
        cublas_ = handle;
        cublas_workspace_ = workspace;
        installed = true;
      }
    }
    if (!installed) {
      if (handle) blas->Destroy(handle);
      cudaFree(workspace);
      if (!s.ok()) return s;
    }
    std::lock_guard<std::mutex> lock(cublas_mu_);
    return cublas_;
  }

 private:
  struct HostTask {
    std::function<Status()> fn;
    std::shared_ptr<StickyError> sticky;
    trace::TraceRecorder* trace;
    int track;
    std::string stream_name;
  };

  // Runs on a CUDA runtime thread, in stream order. Must not call the CUDA API.
  static void CUDART_CB RunHostTask(void* arg) {
    std::unique_ptr<HostTask> task(static_cast<HostTask*>(arg));
    if (!task->sticky->Get().ok()) return;  // an earlier host function failed: skip
    const int64_t begin_ns = task->trace ? task->trace->NowNs() : 0;
    Status s = task->fn();
    if (task->trace) {
      task->trace->Record(task->track, "kernel", trace::Category::kCompute, begin_ns,
                          task->trace->NowNs());
    }
    if (!s.ok()) task->sticky->Set(s.WithContext(fmt::format("stream '{}'", task->stream_name)));
  }

  const std::string name_;
  const int ordinal_;
  const cudaStream_t stream_;
  trace::TraceRecorder* const trace_;
  const int track_;
  std::atomic<uint64_t>* h2d_;
  std::atomic<uint64_t>* d2h_;
  const std::shared_ptr<StickyError> sticky_ = std::make_shared<StickyError>();
  std::mutex cublas_mu_;
  cublasHandle_t cublas_ STRATA_GUARDED_BY(cublas_mu_) = nullptr;
  void* cublas_workspace_ STRATA_GUARDED_BY(cublas_mu_) = nullptr;
};

Status CudaStream::Convert(DeviceSpan dst, DType dst_dtype, DeviceSpan src, DType src_dtype,
                           int64_t n, float scale) {
  if (n < 0 || src.size_bytes < static_cast<uint64_t>(n) * SizeOf(src_dtype) ||
      dst.size_bytes < static_cast<uint64_t>(n) * SizeOf(dst_dtype)) {
    return InvalidArgumentError(fmt::format(
        "{}: convert of {} elements ({} -> {}) out of the bounds of a {}-byte source or "
        "{}-byte destination",
        name_, n, DTypeName(src_dtype), DTypeName(dst_dtype), src.size_bytes, dst.size_bytes));
  }
  STRATA_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal_));
  return cuda::LaunchConvert(stream_, dst.data, dst_dtype, src.data, src_dtype, n, scale)
      .WithContext(fmt::format("stream '{}'", name_));
}

class CudaArena final : public DeviceArena {
 public:
  CudaArena(int ordinal, std::byte* base, size_t size)
      : DeviceArena(base, size), ordinal_(ordinal), base_(base) {}
  ~CudaArena() override {
    if (cudaSetDevice(ordinal_) == cudaSuccess) cudaFree(base_);
    cudaGetLastError();
  }

 private:
  const int ordinal_;
  std::byte* const base_;
};

std::string VersionString(int v) { return fmt::format("{}.{}", v / 1000, (v % 1000) / 10); }

class CudaDevice final : public Device {
 public:
  CudaDevice(const CudaDeviceOptions& o, std::string description)
      : Device(o.pinned_budget_bytes), options_(o), description_(std::move(description)) {}

  DeviceKind kind() const override { return DeviceKind::kCuda; }
  std::string description() const override { return description_; }

  StatusOr<std::unique_ptr<DeviceArena>> CreateArena(size_t size_bytes) override {
    STRATA_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device_ordinal));
    const size_t size = AlignUp(std::max<size_t>(size_bytes, 1), DeviceArena::kAlignment);
    void* p = nullptr;
    const cudaError_t e = cudaMalloc(&p, size);
    if (e != cudaSuccess) {
      const Status why = cuda::CudaStatus(e, "cudaMalloc");
      size_t free_bytes = 0, total_bytes = 0;
      if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) cudaGetLastError();
      return ResourceExhaustedError(fmt::format(
          "could not take {} of GPU memory for the device arena ({} of {} is free on GPU {}): {}; "
          "lower the device memory budget or free the GPU",
          FormatBytes(size), FormatBytes(free_bytes), FormatBytes(total_bytes),
          options_.device_ordinal, why.message()));
    }
    Status s = cuda::CudaStatus(cudaMemset(p, 0, size), "cudaMemset");
    if (s.ok()) s = cuda::CudaStatus(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    if (!s.ok()) {
      cudaFree(p);
      return s.WithContext("zero-filling the device arena");
    }
    return std::unique_ptr<DeviceArena>(
        new CudaArena(options_.device_ordinal, static_cast<std::byte*>(p), size_bytes));
  }

  StatusOr<std::unique_ptr<Stream>> CreateStream(std::string name) override {
    STRATA_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device_ordinal));
    cudaStream_t stream = nullptr;
    STRATA_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    return std::unique_ptr<Stream>(new CudaStream(std::move(name), options_.device_ordinal, stream,
                                                  options_.trace, &bytes_h2d_, &bytes_d2h_));
  }

  StatusOr<std::unique_ptr<Event>> CreateEvent() override {
    STRATA_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device_ordinal));
    cudaEvent_t event = nullptr;
    STRATA_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    return std::unique_ptr<Event>(new CudaEvent(options_.device_ordinal, event));
  }

 protected:
  StatusOr<std::byte*> PinnedAlloc(size_t size_bytes) override {
    STRATA_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device_ordinal));
    void* p = nullptr;
    const cudaError_t e = cudaHostAlloc(&p, size_bytes, cudaHostAllocPortable);
    if (e != cudaSuccess) {
      return ResourceExhaustedError(fmt::format(
          "could not pin {} of host memory: {}; free host memory or the locked-memory limit "
          "(ulimit -l) is too small: lower the pinned budget or raise the limit",
          FormatBytes(size_bytes), cuda::CudaStatus(e, "cudaHostAlloc").message()));
    }
    if (reinterpret_cast<uintptr_t>(p) % 4096 != 0) {  // cudaHostAlloc returns whole pages
      cudaFreeHost(p);
      return InternalError("cudaHostAlloc returned memory that is not 4 KiB-aligned");
    }
    std::memset(p, 0, size_bytes);
    return static_cast<std::byte*>(p);
  }

  void PinnedFree(std::byte* data, size_t) override {
    const cudaError_t e = cudaFreeHost(data);
    if (e != cudaSuccess) {
      STRATA_LOG_WARNING("cudaFreeHost failed: {}", cudaGetErrorName(e));
      cudaGetLastError();
    }
  }

 private:
  const CudaDeviceOptions options_;
  const std::string description_;
};

CudaStream& AsCudaStream(Stream& stream) {
  auto* s = dynamic_cast<CudaStream*>(&stream);
  STRATA_CHECK_MSG(s != nullptr, "a stream of the CUDA device is needed here, not " +
                                     std::string(stream.name()) + " of another backend");
  return *s;
}

}  // namespace

StatusOr<int> CudaDeviceCount() {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver) {
    cudaGetLastError();
    return 0;
  }
  STRATA_CUDA_RETURN_IF_ERROR(e);
  return count;
}

StatusOr<std::unique_ptr<Device>> CreateCudaDevice(const CudaDeviceOptions& options) {
  if (options.device_ordinal < 0) {
    return InvalidArgumentError(
        fmt::format("CUDA device ordinal {} is negative", options.device_ordinal));
  }
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver) {
    return UnavailableError(
        fmt::format("no usable CUDA GPU: {} ({}); check nvidia-smi, the driver version and "
                    "CUDA_VISIBLE_DEVICES, or use the host device",
                    cudaGetErrorName(e), cudaGetErrorString(e)));
  }
  STRATA_CUDA_RETURN_IF_ERROR(e);
  if (count == 0) {
    return UnavailableError(
        "no CUDA GPU is visible; check nvidia-smi and CUDA_VISIBLE_DEVICES, or use the host "
        "device");
  }
  if (options.device_ordinal >= count) {
    return InvalidArgumentError(fmt::format("CUDA device {} does not exist: {} GPU{} visible",
                                            options.device_ordinal, count,
                                            count == 1 ? " is" : "s are"));
  }
  STRATA_CUDA_RETURN_IF_ERROR(cudaSetDevice(options.device_ordinal));
  cudaDeviceProp prop{};
  STRATA_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, options.device_ordinal));
  int driver = 0, runtime = 0;
  STRATA_CUDA_RETURN_IF_ERROR(cudaDriverGetVersion(&driver));
  STRATA_CUDA_RETURN_IF_ERROR(cudaRuntimeGetVersion(&runtime));
  std::string description = fmt::format(
      "cuda:{} {} (compute capability {}.{}, {} memory, {} SMs, driver {}, runtime {})",
      options.device_ordinal, prop.name, prop.major, prop.minor, FormatBytes(prop.totalGlobalMem),
      prop.multiProcessorCount, VersionString(driver), VersionString(runtime));
  return std::unique_ptr<Device>(new CudaDevice(options, std::move(description)));
}

cudaStream_t NativeStream(Stream& stream) { return AsCudaStream(stream).native(); }

StatusOr<cublasHandle_t> CublasHandle(Stream& stream) { return AsCudaStream(stream).cublas(); }

}  // namespace strata::gpu

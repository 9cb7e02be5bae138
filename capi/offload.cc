// strata_offload: the C face of strata::engine::OffloadOptimizer (offload/offload_optimizer.h has
// the contract). This file checks the C arguments (NULL pointers, enum values, struct sizes,
// indices) with messages that name the call and the C field, converts the C structs, and
// prefixes the engine's own errors with the call's name; the engine does the rest.
#include <fmt/format.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "base/cpu_info.h"
#include "capi/capi_internal.h"
#include "capi/cuda_event.h"
#include "capi/optimizer_configs.h"
#include "cpu_optim/any_optimizer.h"
#include "engine/plan/plan_choice.h"
#include "io/io_backend.h"
#include "offload/offload_optimizer.h"
#include "strata/strata.h"

// The handle. Member order matters: the optimizer (whose destructor waits for the folds that
// may still call the CUDA waiter) is destroyed before the waiter.
struct strata_offload {
  // Loaded at the first submit_grad with a cuda_event; kept for the handle's life.
  std::unique_ptr<strata::capi::CudaEventWaiter> cuda;
  std::unique_ptr<strata::engine::OffloadOptimizer> optimizer;
  // The strings strata_offload_tensor_name hands out, interned so that each stays valid (and
  // at one address) for the handle's life. Guarded by names_mu: the call is on a const handle.
  mutable std::mutex names_mu;
  mutable std::set<std::string, std::less<>> names;
};

namespace strata::capi {
namespace {

Status NullHandle(const char* call) {
  return InvalidArgumentError(fmt::format("{}: offload is NULL", call));
}

Status CheckGroup(const char* call, const engine::OffloadOptimizer& o, int group) {
  if (group < 0 || group >= o.num_groups()) {
    return InvalidArgumentError(
        fmt::format("{}: unknown group {} (the optimizer has {})", call, group, o.num_groups()));
  }
  return Status::Ok();
}

Status CheckBucket(const char* call, const engine::OffloadOptimizer& o, int bucket) {
  if (bucket < 0 || bucket >= o.num_buckets()) {
    return InvalidArgumentError(
        fmt::format("{}: unknown bucket {} (the optimizer has {})", call, bucket, o.num_buckets()));
  }
  return Status::Ok();
}

bool ValidBucket(const strata_offload* offload, int bucket) {
  return offload != nullptr && bucket >= 0 && bucket < offload->optimizer->num_buckets();
}

// The state tensors (sections) of a bucket besides the master weights.
int NumState(const engine::OffloadOptimizer& o, int bucket) {
  return static_cast<int>(o.bucket_state_layout(bucket).size());
}

// Elements of tensor t (0 master, 1 + i section i) of a valid bucket and tensor.
int64_t TensorElems(const engine::OffloadOptimizer& o, int bucket, int tensor) {
  return tensor == 0 ? o.bucket_num_elems(bucket)
                     : o.bucket_state_layout(bucket)[tensor - 1].num_elems;
}
int64_t TensorBytes(const engine::OffloadOptimizer& o, int bucket, int tensor) {
  return tensor == 0 ? o.bucket_num_elems(bucket) * 4
                     : static_cast<int64_t>(o.bucket_state_layout(bucket)[tensor - 1].size_bytes());
}

Status CheckTensor(const char* call, const engine::OffloadOptimizer& o, int bucket, int tensor) {
  const int num_state = NumState(o, bucket);
  if (tensor < 0 || tensor > num_state) {
    return InvalidArgumentError(
        fmt::format("{}: unknown tensor {} of bucket {} (0 = master, 1..{} = the {} state)", call,
                    tensor, bucket, num_state,
                    cpu_optim::OptimizerKindName(o.group_optimizer(o.bucket_group(bucket)).kind)));
  }
  return Status::Ok();
}

// A byte-level state transfer of tensor `tensor` of `bucket`: bucket, tensor and size checked.
Status CheckStateBytes(const char* call, const engine::OffloadOptimizer& o, int bucket, int tensor,
                       const void* data, int64_t size_bytes) {
  if (data == nullptr) return InvalidArgumentError(fmt::format("{}: the buffer is NULL", call));
  STRATA_RETURN_IF_ERROR(CheckBucket(call, o, bucket));
  STRATA_RETURN_IF_ERROR(CheckTensor(call, o, bucket, tensor));
  if (size_bytes != TensorBytes(o, bucket, tensor)) {
    return InvalidArgumentError(fmt::format("{}: size_bytes is {}, tensor {} of bucket {} has {}",
                                            call, size_bytes, tensor, bucket,
                                            TensorBytes(o, bucket, tensor)));
  }
  return Status::Ok();
}

Status CheckStateBuffer(const char* call, const engine::OffloadOptimizer& o, int bucket, int tensor,
                        const void* data, int64_t num_elems) {
  if (data == nullptr) return InvalidArgumentError(fmt::format("{}: buffer is NULL", call));
  if (tensor > 0 && o.bucket_state_layout(bucket)[tensor - 1].dtype == cpu_optim::StateDType::kU8) {
    return InvalidArgumentError(
        fmt::format("{}: tensor {} of bucket {} ('{}') holds 8-bit codes, not fp32 values: use "
                    "strata_offload_read_state_bytes / strata_offload_write_state_bytes",
                    call, tensor, bucket, o.bucket_state_layout(bucket)[tensor - 1].name));
  }
  const int64_t want = TensorElems(o, bucket, tensor);
  if (num_elems != want) {
    return InvalidArgumentError(
        fmt::format("{}: num_elems is {}, tensor {} of bucket {} has {} elements (the "
                    "masters: strata_offload_bucket_num_elems; a section: "
                    "strata_offload_state_section)",
                    call, num_elems, tensor, bucket, want));
  }
  return Status::Ok();
}

// "auto" (or NULL), "uring", "posix".
StatusOr<io::BackendKind> ParseIoBackend(const char* text) {
  if (text == nullptr) return io::BackendKind::kAuto;
  const std::string_view s(text);
  if (s == "auto") return io::BackendKind::kAuto;
  if (s == "uring") return io::BackendKind::kUring;
  if (s == "posix") return io::BackendKind::kPosix;
  return InvalidArgumentError(fmt::format(
      "strata_offload_create: unknown io_backend \"{}\" (use \"auto\", \"uring\" or \"posix\")",
      s));
}

StatusOr<engine::OffloadOptimizerOptions> ToOptions(const strata_offload_options& c) {
  constexpr const char* kCall = "strata_offload_create";
  engine::OffloadOptimizerOptions o;
  switch (c.device) {
    case STRATA_OFFLOAD_CPU:
      o.home = engine::OffloadOptimizerOptions::Home::kHost;
      break;
    case STRATA_OFFLOAD_NVME:
      o.home = engine::OffloadOptimizerOptions::Home::kNvme;
      if (c.num_nvme_paths <= 0 || c.nvme_paths == nullptr) {
        return InvalidArgumentError(fmt::format(
            "{}: device STRATA_OFFLOAD_NVME needs nvme_paths (num_nvme_paths >= 1), got "
            "num_nvme_paths {} and nvme_paths {}",
            kCall, c.num_nvme_paths, c.nvme_paths == nullptr ? "NULL" : "set"));
      }
      for (int i = 0; i < c.num_nvme_paths; ++i) {
        if (c.nvme_paths[i] == nullptr || c.nvme_paths[i][0] == '\0') {
          return InvalidArgumentError(fmt::format("{}: nvme_paths[{}] is NULL or empty", kCall, i));
        }
        o.nvme_paths.emplace_back(c.nvme_paths[i]);
      }
      break;
    default:
      return InvalidArgumentError(
          fmt::format("{}: unknown device {} (use STRATA_OFFLOAD_CPU or STRATA_OFFLOAD_NVME)",
                      kCall, static_cast<int>(c.device)));
  }
  if (c.num_threads < 0) {
    return InvalidArgumentError(
        fmt::format("{}: num_threads must be >= 0 (0 = all CPUs), got {}", kCall, c.num_threads));
  }
  if (c.buffer_count < 2) {
    return InvalidArgumentError(
        fmt::format("{}: buffer_count must be >= 2, got {}", kCall, c.buffer_count));
  }
  if (c.staging_buffers < 1) {
    return InvalidArgumentError(
        fmt::format("{}: staging_buffers must be >= 1, got {}", kCall, c.staging_buffers));
  }
  STRATA_ASSIGN_OR_RETURN(o.io.kind, ParseIoBackend(c.io_backend));
  o.num_threads = c.num_threads;
  o.buffer_count = c.buffer_count;
  o.staging_buffers = c.staging_buffers;
  o.pin_memory = c.pin_memory != 0;
  return o;
}

}  // namespace

// strata_offload_add_bucket(_shaped); kCall names the C function in messages.
strata_status AddBucket(const char* kCall, strata_offload* offload, int group,
                        strata_dtype param_dtype, void* const* segments,
                        const int64_t* segment_num_elems, const int64_t* const* segment_shapes,
                        const int* segment_ndims, int num_segments, int* bucket);

}  // namespace strata::capi

extern "C" {

void strata_offload_options_init(strata_offload_options* options) {
  if (options == nullptr) return;
  *options = strata_offload_options{};
  options->struct_size = sizeof(strata_offload_options);
  options->device = STRATA_OFFLOAD_CPU;
  options->nvme_paths = nullptr;
  options->num_nvme_paths = 0;
  options->num_threads = 0;
  options->buffer_count = 4;
  options->staging_buffers = 4;
  options->pin_memory = 1;
  options->io_backend = nullptr;
}

void strata_offload_step_options_init(strata_offload_step_options* options) {
  if (options == nullptr) return;
  *options = strata_offload_step_options{};
  options->struct_size = sizeof(strata_offload_step_options);
  options->max_grad_norm = 0.0;
  options->loss_scale = 1.0f;
}

strata_status strata_offload_choose_device(uint64_t state_bytes, int nvme_paths_given,
                                           strata_offload_device* device) {
  using namespace strata;
  using namespace strata::capi;
  constexpr const char* kCall = "strata_offload_choose_device";
  return Guard([&]() -> Status {
    if (device == nullptr) return InvalidArgumentError(fmt::format("{}: device is NULL", kCall));
    engine::OffloadHomeRequest request;
    request.state_bytes = state_bytes;
    request.nvme_paths_given = nvme_paths_given != 0;
    if (auto cpu = DetectCpuInfo(); cpu.ok())
      request.host_available_bytes = cpu->mem_available_bytes;
    auto choice = engine::ChooseOffloadHome(request);
    if (!choice.ok()) return choice.status().WithContext(kCall);
    *device =
        choice->home == engine::OptimizerHome::kNvme ? STRATA_OFFLOAD_NVME : STRATA_OFFLOAD_CPU;
    return Status::Ok();
  });
}

strata_status strata_offload_create(const strata_offload_options* options, strata_offload** out) {
  using namespace strata;
  using namespace strata::capi;
  constexpr const char* kCall = "strata_offload_create";
  if (out != nullptr) *out = nullptr;
  return Guard([&]() -> Status {
    if (out == nullptr) return InvalidArgumentError(fmt::format("{}: out is NULL", kCall));
    strata_offload_options opts;
    strata_offload_options_init(&opts);
    if (options != nullptr) {
      if (options->struct_size != sizeof(strata_offload_options)) {
        return InvalidArgumentError(
            fmt::format("{}: options->struct_size is {}, expected {}: initialize options with "
                        "strata_offload_options_init",
                        kCall, options->struct_size, sizeof(strata_offload_options)));
      }
      opts = *options;
    }
    STRATA_ASSIGN_OR_RETURN(engine::OffloadOptimizerOptions cpp_options, ToOptions(opts));
    auto handle = std::make_unique<strata_offload>();
    auto optimizer = engine::OffloadOptimizer::Create(std::move(cpp_options));
    if (!optimizer.ok()) return optimizer.status().WithContext(kCall);
    handle->optimizer = std::move(optimizer).value();
    *out = handle.release();
    return Status::Ok();
  });
}

// The engine's destructor waits for the work in flight and drops its errors.
void strata_offload_destroy(strata_offload* offload) { delete offload; }

strata_status strata_offload_add_group(strata_offload* offload, strata_optimizer_kind kind,
                                       const void* config, int* group) {
  using namespace strata;
  using namespace strata::capi;
  constexpr const char* kCall = "strata_offload_add_group";
  return Guard([&]() -> Status {
    if (offload == nullptr) return NullHandle(kCall);
    if (group == nullptr) return InvalidArgumentError(fmt::format("{}: group is NULL", kCall));
    const auto cpp_kind = ToOptimizerKind(kind);
    if (!cpp_kind) return BadOptimizerKind(kCall, kind);
    auto parsed = ParseOptimizerConfig(*cpp_kind, config);
    if (!parsed.ok()) return parsed.status().WithContext(kCall);
    auto index = offload->optimizer->AddGroup(*parsed);
    if (!index.ok()) return index.status().WithContext(kCall);
    *group = *index;
    return Status::Ok();
  });
}

strata_status strata_offload_set_group_config(strata_offload* offload, int group,
                                              const void* config) {
  using namespace strata;
  using namespace strata::capi;
  constexpr const char* kCall = "strata_offload_set_group_config";
  return Guard([&]() -> Status {
    if (offload == nullptr) return NullHandle(kCall);
    engine::OffloadOptimizer& o = *offload->optimizer;
    STRATA_RETURN_IF_ERROR(CheckGroup(kCall, o, group));
    auto parsed = ParseOptimizerConfig(o.group_optimizer(group).kind, config);
    if (!parsed.ok()) return parsed.status().WithContext(kCall);
    return o.SetGroupOptimizer(group, *parsed).WithContext(kCall);
  });
}

strata_status strata_offload_get_group_step(const strata_offload* offload, int group,
                                            int64_t* step) {
  using namespace strata;
  using namespace strata::capi;
  constexpr const char* kCall = "strata_offload_get_group_step";
  return Guard([&]() -> Status {
    if (offload == nullptr) return NullHandle(kCall);
    if (step == nullptr) return InvalidArgumentError(fmt::format("{}: step is NULL", kCall));
    STRATA_RETURN_IF_ERROR(CheckGroup(kCall, *offload->optimizer, group));
    *step = offload->optimizer->group_step(group);
    return Status::Ok();
  });
}

strata_status strata_offload_set_group_step(strata_offload* offload, int group, int64_t step) {
  using namespace strata;
  using namespace strata::capi;
  constexpr const char* kCall = "strata_offload_set_group_step";
  return Guard([&]() -> Status {
    if (offload == nullptr) return NullHandle(kCall);
    STRATA_RETURN_IF_ERROR(CheckGroup(kCall, *offload->optimizer, group));
    if (step < 0) {
      return InvalidArgumentError(fmt::format("{}: step must be >= 0, got {}", kCall, step));
    }
    return offload->optimizer->SetGroupStep(group, step).WithContext(kCall);
  });
}

strata_status strata_offload_add_bucket(strata_offload* offload, int group,
                                        strata_dtype param_dtype, void* const* segments,
                                        const int64_t* segment_num_elems, int num_segments,
                                        int* bucket) {
  return strata::capi::AddBucket("strata_offload_add_bucket", offload, group, param_dtype, segments,
                                 segment_num_elems, nullptr, nullptr, num_segments, bucket);
}

strata_status strata_offload_add_bucket_shaped(strata_offload* offload, int group,
                                               strata_dtype param_dtype, void* const* segments,
                                               const int64_t* segment_num_elems,
                                               const int64_t* const* segment_shapes,
                                               const int* segment_ndims, int num_segments,
                                               int* bucket) {
  return strata::capi::AddBucket("strata_offload_add_bucket_shaped", offload, group, param_dtype,
                                 segments, segment_num_elems, segment_shapes, segment_ndims,
                                 num_segments, bucket);
}

}  // extern "C"

namespace strata::capi {

strata_status AddBucket(const char* kCall, strata_offload* offload, int group,
                        strata_dtype param_dtype, void* const* segments,
                        const int64_t* segment_num_elems, const int64_t* const* segment_shapes,
                        const int* segment_ndims, int num_segments, int* bucket) {
  return Guard([&]() -> Status {
    if (offload == nullptr) return NullHandle(kCall);
    if (bucket == nullptr) return InvalidArgumentError(fmt::format("{}: bucket is NULL", kCall));
    STRATA_RETURN_IF_ERROR(CheckGroup(kCall, *offload->optimizer, group));
    const auto dtype = ToDType(param_dtype);
    if (!dtype) return BadDType("strata_offload_add_bucket param_dtype", param_dtype);
    if (num_segments <= 0 || segments == nullptr || segment_num_elems == nullptr) {
      return InvalidArgumentError(fmt::format(
          "{}: a bucket needs num_segments >= 1 segments with their lengths, got num_segments {}, "
          "segments {}, segment_num_elems {}",
          kCall, num_segments, segments == nullptr ? "NULL" : "set",
          segment_num_elems == nullptr ? "NULL" : "set"));
    }
    std::vector<engine::OffloadSegment> list(static_cast<size_t>(num_segments));
    for (int i = 0; i < num_segments; ++i) {
      if (segments[i] == nullptr || segment_num_elems[i] <= 0) {
        return InvalidArgumentError(fmt::format(
            "{}: segment {} must be a non-NULL buffer of num_elems > 0, got {} with {} elements",
            kCall, i, segments[i] == nullptr ? "NULL" : "a buffer", segment_num_elems[i]));
      }
      list[i] = engine::OffloadSegment{
          .data = segments[i], .num_elems = segment_num_elems[i], .shape = {}};
      if (segment_shapes != nullptr) {
        if (segment_ndims == nullptr || segment_ndims[i] < 0 ||
            (segment_ndims[i] > 0 && segment_shapes[i] == nullptr)) {
          return InvalidArgumentError(
              fmt::format("{}: segment {}'s shape must be segment_ndims[{}] >= 0 dimensions at "
                          "segment_shapes[{}] (segment_ndims {})",
                          kCall, i, i, i, segment_ndims == nullptr ? "NULL" : "set"));
        }
        list[i].shape.assign(segment_shapes[i], segment_shapes[i] + segment_ndims[i]);
      }
    }
    auto index = offload->optimizer->AddBucket(group, *dtype, list);
    if (!index.ok()) return index.status().WithContext(kCall);
    *bucket = *index;
    return Status::Ok();
  });
}

}  // namespace strata::capi

extern "C" {

int64_t strata_offload_bucket_num_elems(const strata_offload* offload, int bucket) {
  if (!strata::capi::ValidBucket(offload, bucket)) return -1;
  return offload->optimizer->bucket_num_elems(bucket);
}

strata_status strata_offload_acquire_staging(strata_offload* offload, int bucket,
                                             strata_dtype grad_dtype, void** data) {
  using namespace strata;
  using namespace strata::capi;
  constexpr const char* kCall = "strata_offload_acquire_staging";
  if (data != nullptr) *data = nullptr;
  return Guard([&]() -> Status {
    if (offload == nullptr) return NullHandle(kCall);
    if (data == nullptr) return InvalidArgumentError(fmt::format("{}: data is NULL", kCall));
    STRATA_RETURN_IF_ERROR(CheckBucket(kCall, *offload->optimizer, bucket));
    const auto dtype = ToDType(grad_dtype);
    if (!dtype) return BadDType("strata_offload_acquire_staging grad_dtype", grad_dtype);
    auto buffer = offload->optimizer->AcquireStaging(bucket, *dtype);
    if (!buffer.ok()) return buffer.status().WithContext(kCall);
    *data = buffer->data();
    return Status::Ok();
  });
}

strata_status strata_offload_submit_grad(strata_offload* offload, int bucket, int segment,
                                         const void* grad, strata_dtype grad_dtype,
                                         int64_t num_elems, void* cuda_event) {
  using namespace strata;
  using namespace strata::capi;
  constexpr const char* kCall = "strata_offload_submit_grad";
  return Guard([&]() -> Status {
    if (offload == nullptr) return NullHandle(kCall);
    engine::OffloadOptimizer& o = *offload->optimizer;
    STRATA_RETURN_IF_ERROR(CheckBucket(kCall, o, bucket));
    const int num_segments = static_cast<int>(o.bucket_segments(bucket).size());
    if (segment < -1 || segment >= num_segments) {
      return InvalidArgumentError(
          fmt::format("{}: unknown segment {} of bucket {} (it has {}; -1 = the whole bucket)",
                      kCall, segment, bucket, num_segments));
    }
    if (grad == nullptr) return InvalidArgumentError(fmt::format("{}: grad is NULL", kCall));
    const auto dtype = ToDType(grad_dtype);
    if (!dtype) return BadDType("strata_offload_submit_grad grad_dtype", grad_dtype);
    const int64_t expected =
        segment < 0 ? o.bucket_num_elems(bucket) : o.bucket_segments(bucket)[segment].num_elems;
    if (num_elems != expected) {
      return InvalidArgumentError(
          fmt::format("{}: num_elems is {}, {} of bucket {} has {} elements", kCall, num_elems,
                      segment < 0 ? std::string("the whole") : fmt::format("segment {}", segment),
                      bucket, expected));
    }
    std::function<Status()> ready;
    if (cuda_event != nullptr) {
      if (offload->cuda == nullptr) {
        STRATA_ASSIGN_OR_RETURN(offload->cuda, CudaEventWaiter::Load(kCall));
      }
      const CudaEventWaiter* waiter = offload->cuda.get();
      ready = [waiter, cuda_event]() -> Status {
        return waiter->Wait(cuda_event).WithContext("strata_offload_submit_grad cuda_event");
      };
    }
    return o.SubmitGradient(bucket, segment, grad, *dtype, num_elems, std::move(ready))
        .WithContext(kCall);
  });
}

strata_status strata_offload_wait_grads(strata_offload* offload) {
  using namespace strata;
  using namespace strata::capi;
  constexpr const char* kCall = "strata_offload_wait_grads";
  return Guard([&]() -> Status {
    if (offload == nullptr) return NullHandle(kCall);
    return offload->optimizer->WaitGradients().WithContext(kCall);
  });
}

strata_status strata_offload_discard_grads(strata_offload* offload) {
  using namespace strata;
  using namespace strata::capi;
  constexpr const char* kCall = "strata_offload_discard_grads";
  return Guard([&]() -> Status {
    if (offload == nullptr) return NullHandle(kCall);
    return offload->optimizer->DiscardGradients().WithContext(kCall);
  });
}

strata_status strata_offload_step(strata_offload* offload,
                                  const strata_offload_step_options* options,
                                  strata_offload_step_result* result) {
  using namespace strata;
  using namespace strata::capi;
  constexpr const char* kCall = "strata_offload_step";
  return Guard([&]() -> Status {
    if (offload == nullptr) return NullHandle(kCall);
    strata_offload_step_options opts;
    strata_offload_step_options_init(&opts);
    if (options != nullptr) {
      if (options->struct_size != sizeof(strata_offload_step_options)) {
        return InvalidArgumentError(
            fmt::format("{}: options->struct_size is {}, expected {}: initialize options with "
                        "strata_offload_step_options_init",
                        kCall, options->struct_size, sizeof(strata_offload_step_options)));
      }
      opts = *options;
    }
    if (!std::isfinite(opts.max_grad_norm) || opts.max_grad_norm < 0) {
      return InvalidArgumentError(
          fmt::format("{}: max_grad_norm must be finite and >= 0 (0 = no clipping), got {}", kCall,
                      opts.max_grad_norm));
    }
    if (!std::isfinite(opts.loss_scale) || opts.loss_scale <= 0) {
      return InvalidArgumentError(
          fmt::format("{}: loss_scale must be finite and > 0, got {}", kCall, opts.loss_scale));
    }
    engine::OffloadStepResult r;
    STRATA_RETURN_IF_ERROR(
        offload->optimizer
            ->Step(engine::OffloadStepOptions{.max_grad_norm = opts.max_grad_norm,
                                              .loss_scale = opts.loss_scale},
                   &r)
            .WithContext(kCall));
    if (result != nullptr) {
      *result = strata_offload_step_result{
          .grad_norm = r.grad_norm, .skipped = r.skipped ? 1 : 0, .micro_batches = r.micro_batches};
    }
    return Status::Ok();
  });
}

strata_status strata_offload_wait_bucket(strata_offload* offload, int bucket) {
  using namespace strata;
  using namespace strata::capi;
  constexpr const char* kCall = "strata_offload_wait_bucket";
  return Guard([&]() -> Status {
    if (offload == nullptr) return NullHandle(kCall);
    // No CheckBucket: this call may run concurrently with the others, and the engine checks
    // the index itself without touching what they change.
    return offload->optimizer->WaitBucket(bucket).WithContext(kCall);
  });
}

strata_status strata_offload_synchronize(strata_offload* offload) {
  using namespace strata;
  using namespace strata::capi;
  constexpr const char* kCall = "strata_offload_synchronize";
  return Guard([&]() -> Status {
    if (offload == nullptr) return NullHandle(kCall);
    return offload->optimizer->Synchronize().WithContext(kCall);
  });
}

int strata_offload_bucket_num_state(const strata_offload* offload, int bucket) {
  if (!strata::capi::ValidBucket(offload, bucket)) return -1;
  return strata::capi::NumState(*offload->optimizer, bucket);
}

const char* strata_offload_tensor_name(const strata_offload* offload, int bucket, int tensor) {
  using namespace strata;
  if (!capi::ValidBucket(offload, bucket)) return nullptr;
  const engine::OffloadOptimizer& o = *offload->optimizer;
  if (tensor < 0 || tensor > capi::NumState(o, bucket)) return nullptr;
  const std::string_view name =
      tensor == 0 ? std::string_view("master") : o.bucket_state_layout(bucket)[tensor - 1].name;
  try {
    std::lock_guard<std::mutex> lock(offload->names_mu);
    auto it = offload->names.find(name);
    if (it == offload->names.end()) it = offload->names.emplace(name).first;
    return it->c_str();
  } catch (...) {
    return nullptr;  // no memory for the name
  }
}

strata_status strata_offload_read_state(strata_offload* offload, int bucket, int tensor, float* out,
                                        int64_t num_elems) {
  using namespace strata;
  using namespace strata::capi;
  constexpr const char* kCall = "strata_offload_read_state";
  return Guard([&]() -> Status {
    if (offload == nullptr) return NullHandle(kCall);
    engine::OffloadOptimizer& o = *offload->optimizer;
    STRATA_RETURN_IF_ERROR(CheckBucket(kCall, o, bucket));
    STRATA_RETURN_IF_ERROR(CheckTensor(kCall, o, bucket, tensor));
    STRATA_RETURN_IF_ERROR(CheckStateBuffer(kCall, o, bucket, tensor, out, num_elems));
    return o.ReadState(bucket, tensor, std::span<float>(out, static_cast<size_t>(num_elems)))
        .WithContext(kCall);
  });
}

strata_status strata_offload_write_state(strata_offload* offload, int bucket, int tensor,
                                         const float* in, int64_t num_elems) {
  using namespace strata;
  using namespace strata::capi;
  constexpr const char* kCall = "strata_offload_write_state";
  return Guard([&]() -> Status {
    if (offload == nullptr) return NullHandle(kCall);
    engine::OffloadOptimizer& o = *offload->optimizer;
    STRATA_RETURN_IF_ERROR(CheckBucket(kCall, o, bucket));
    STRATA_RETURN_IF_ERROR(CheckTensor(kCall, o, bucket, tensor));
    STRATA_RETURN_IF_ERROR(CheckStateBuffer(kCall, o, bucket, tensor, in, num_elems));
    return o.WriteState(bucket, tensor, std::span<const float>(in, static_cast<size_t>(num_elems)))
        .WithContext(kCall);
  });
}

strata_status strata_offload_reload_masters(strata_offload* offload, int bucket) {
  using namespace strata;
  using namespace strata::capi;
  constexpr const char* kCall = "strata_offload_reload_masters";
  return Guard([&]() -> Status {
    if (offload == nullptr) return NullHandle(kCall);
    STRATA_RETURN_IF_ERROR(CheckBucket(kCall, *offload->optimizer, bucket));
    return offload->optimizer->ReloadMasters(bucket).WithContext(kCall);
  });
}

strata_status strata_offload_save(strata_offload* offload, const char* dir) {
  using namespace strata;
  using namespace strata::capi;
  constexpr const char* kCall = "strata_offload_save";
  return Guard([&]() -> Status {
    if (offload == nullptr) return NullHandle(kCall);
    if (dir == nullptr || dir[0] == '\0') {
      return InvalidArgumentError(fmt::format("{}: dir is NULL or empty", kCall));
    }
    return offload->optimizer->Save(dir).WithContext(kCall);
  });
}

strata_status strata_offload_load(strata_offload* offload, const char* dir) {
  using namespace strata;
  using namespace strata::capi;
  constexpr const char* kCall = "strata_offload_load";
  return Guard([&]() -> Status {
    if (offload == nullptr) return NullHandle(kCall);
    if (dir == nullptr || dir[0] == '\0') {
      return InvalidArgumentError(fmt::format("{}: dir is NULL or empty", kCall));
    }
    return offload->optimizer->Load(dir).WithContext(kCall);
  });
}

strata_status strata_offload_get_stats(const strata_offload* offload, strata_offload_stats* stats) {
  using namespace strata;
  using namespace strata::capi;
  constexpr const char* kCall = "strata_offload_get_stats";
  return Guard([&]() -> Status {
    if (offload == nullptr) return NullHandle(kCall);
    if (stats == nullptr) return InvalidArgumentError(fmt::format("{}: stats is NULL", kCall));
    const engine::OffloadCounters c = offload->optimizer->counters();
    *stats = strata_offload_stats{.steps = c.steps,
                                  .skipped_steps = c.skipped_steps,
                                  .nvme_bytes_read = c.nvme_bytes_read,
                                  .nvme_bytes_written = c.nvme_bytes_written,
                                  .update_seconds = c.update_seconds,
                                  .wait_seconds = c.wait_seconds,
                                  .host_state_bytes = c.host_state_bytes};
    return Status::Ok();
  });
}

strata_status strata_offload_state_section(const strata_offload* offload, int bucket, int tensor,
                                           strata_state_section* out) {
  using namespace strata;
  using namespace strata::capi;
  constexpr const char* kCall = "strata_offload_state_section";
  return Guard([&]() -> Status {
    if (offload == nullptr) return NullHandle(kCall);
    if (out == nullptr) return InvalidArgumentError(fmt::format("{}: out is NULL", kCall));
    const engine::OffloadOptimizer& o = *offload->optimizer;
    STRATA_RETURN_IF_ERROR(CheckBucket(kCall, o, bucket));
    STRATA_RETURN_IF_ERROR(CheckTensor(kCall, o, bucket, tensor));
    if (tensor == 0) {
      *out = ToCSection(cpu_optim::StateSpec{.name = "master",
                                             .dtype = cpu_optim::StateDType::kF32,
                                             .num_elems = o.bucket_num_elems(bucket)});
    } else {
      *out = ToCSection(o.bucket_state_layout(bucket)[tensor - 1]);
    }
    return Status::Ok();
  });
}

strata_status strata_offload_segment_state_range(const strata_offload* offload, int bucket,
                                                 int segment, int tensor, int64_t* offset_elems,
                                                 int64_t* num_elems) {
  using namespace strata;
  using namespace strata::capi;
  constexpr const char* kCall = "strata_offload_segment_state_range";
  return Guard([&]() -> Status {
    if (offload == nullptr) return NullHandle(kCall);
    if (offset_elems == nullptr || num_elems == nullptr) {
      return InvalidArgumentError(fmt::format("{}: offset_elems or num_elems is NULL", kCall));
    }
    const engine::OffloadOptimizer& o = *offload->optimizer;
    STRATA_RETURN_IF_ERROR(CheckBucket(kCall, o, bucket));
    auto range = o.SegmentStateRange(bucket, segment, tensor);
    if (!range.ok()) return range.status().WithContext(kCall);
    *offset_elems = range->offset_elems;
    *num_elems = range->num_elems;
    return Status::Ok();
  });
}

strata_status strata_offload_read_state_bytes(strata_offload* offload, int bucket, int tensor,
                                              void* out, int64_t size_bytes) {
  using namespace strata;
  using namespace strata::capi;
  constexpr const char* kCall = "strata_offload_read_state_bytes";
  return Guard([&]() -> Status {
    if (offload == nullptr) return NullHandle(kCall);
    engine::OffloadOptimizer& o = *offload->optimizer;
    STRATA_RETURN_IF_ERROR(CheckStateBytes(kCall, o, bucket, tensor, out, size_bytes));
    return o
        .ReadStateBytes(bucket, tensor,
                        std::span(static_cast<std::byte*>(out), static_cast<size_t>(size_bytes)))
        .WithContext(kCall);
  });
}

strata_status strata_offload_write_state_bytes(strata_offload* offload, int bucket, int tensor,
                                               const void* in, int64_t size_bytes) {
  using namespace strata;
  using namespace strata::capi;
  constexpr const char* kCall = "strata_offload_write_state_bytes";
  return Guard([&]() -> Status {
    if (offload == nullptr) return NullHandle(kCall);
    engine::OffloadOptimizer& o = *offload->optimizer;
    STRATA_RETURN_IF_ERROR(CheckStateBytes(kCall, o, bucket, tensor, in, size_bytes));
    return o
        .WriteStateBytes(
            bucket, tensor,
            std::span(static_cast<const std::byte*>(in), static_cast<size_t>(size_bytes)))
        .WithContext(kCall);
  });
}

}  // extern "C"

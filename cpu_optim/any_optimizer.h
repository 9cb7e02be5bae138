// One optimizer of any kind behind one interface: the kind, its hyper-parameters and its state
// buffers, for code that holds optimizers chosen at run time (the offload optimizer's parameter
// groups, the C API's strata_optimizer handle).
//
// Kinds and their state buffers, in this order (the names are torch.optim's state keys):
//   kAdamW, kAdam  exp_avg, exp_avg_sq (+ max_exp_avg_sq with amsgrad)     adamw.h
//   kAdagrad       sum (starts at initial_accumulator_value)                 adagrad.h
//   kLion          exp_avg                                                   lion.h
//   kSgd           momentum_buffer when momentum != 0, none otherwise        sgd.h
// Every state buffer starts at InitialStateValue (0 except Adagrad's sum).
// Two kinds keep state that is not one fp32 value per parameter, and only the state layout API
// below serves them (NumState is 0, Update refuses them):
//   kAdamW8bit     exp_avg, exp_avg_sq: 8-bit codes; exp_avg.absmax,
//                  exp_avg_sq.absmax: fp32 per block of kQuantBlockElems    adamw8bit.h
//   kAdafactor     exp_avg_sq_row, exp_avg_sq_col (factored tensors' rows and
//                  columns, tensor after tensor), exp_avg_sq (the other
//                  tensors' elements), exp_avg when beta1 > 0                adafactor.h
//
// Update() is the kind's XxxUpdate (same numerics, threading and errors: optimizer.h); the kind
// decides how many state spans it takes (NumState). Thread-safety: a const AnyOptimizer may be
// used from several threads at once.
//
// The state layout API (StateLayout, InitializeState, UpdateState) serves every kind, including
// those whose state is not one fp32 value per parameter: it describes a buffer's state as named
// sections of fp32 values or 8-bit codes whose sizes may depend on the shapes of the tensors the
// buffer holds. Code that stores state for any kind (the engine's blocks, checkpoints) uses it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "base/status.h"
#include "cpu_optim/adafactor.h"
#include "cpu_optim/adagrad.h"
#include "cpu_optim/adamw.h"
#include "cpu_optim/adamw8bit.h"
#include "cpu_optim/lion.h"
#include "cpu_optim/optimizer.h"
#include "cpu_optim/sgd.h"

namespace strata::cpu_optim {

// Values are those of the C API's strata_optimizer_kind (include/strata/strata.h).
enum class OptimizerKind : int {
  kAdamW = 1,
  kAdam = 2,
  kAdagrad = 3,
  kLion = 4,
  kSgd = 5,
  kAdamW8bit = 6,
  kAdafactor = 7,
};

using OptimizerConfig =
    std::variant<AdamWConfig, AdagradConfig, LionConfig, SgdConfig, AdafactorConfig>;

struct AnyOptimizer {
  OptimizerKind kind = OptimizerKind::kAdamW;
  // The kind's config: AdamWConfig for kAdamW (decoupled_weight_decay true) and kAdam (false)
  // and kAdamW8bit (either: AdamW or Adam with 8-bit state), AdagradConfig, LionConfig,
  // SgdConfig, AdafactorConfig.
  OptimizerConfig config = AdamWConfig{};

  // The AdamWConfig of kAdamW, kAdam and kAdamW8bit (std::bad_variant_access for other configs).
  AdamWConfig& adamw() { return std::get<AdamWConfig>(config); }
  const AdamWConfig& adamw() const { return std::get<AdamWConfig>(config); }
};

// "AdamW", "Adam", "Adagrad", "Lion", "SGD", "AdamW8bit", "Adafactor"; "unknown" for a value
// outside the enum.
std::string_view OptimizerKindName(OptimizerKind kind);

// kInvalidArgument when the config alternative does not belong to the kind, or a
// hyper-parameter is one that torch.optim rejects (the message names it).
Status Validate(const AnyOptimizer& optimizer);

// The number of per-element fp32 state buffers (0..3; 0 for kAdamW8bit and kAdafactor, whose
// state only StateLayout describes) and their names (torch.optim's state keys).
int NumState(const AnyOptimizer& optimizer);
std::string_view StateName(const AnyOptimizer& optimizer, int index);
// The value every element of state buffer `index` starts at.
float InitialStateValue(const AnyOptimizer& optimizer, int index);

// One step over master.size() elements: state holds NumState(optimizer) spans of that length
// (kInvalidArgument otherwise, and for kAdamW8bit and kAdafactor: use UpdateState). As the
// kind's XxxUpdate (optimizer.h).
Status Update(const AnyOptimizer& optimizer, const OptimStep& step, std::span<float> master,
              std::span<const std::span<float>> state, GradView grad, CopyOut copy_out = {});

// ---- State layout: any kind, any state representation ----

enum class StateDType : uint8_t { kF32, kU8 };

// One section of a buffer's optimizer state.
struct StateSpec {
  std::string name;  // torch.optim's state key where there is one: "exp_avg", "exp_avg_sq", ...
  StateDType dtype = StateDType::kF32;
  int64_t num_elems = 0;
  float initial_value = 0.0f;  // kF32: the value every element starts at
  uint8_t initial_code = 0;    // kU8: the code every element starts at
  size_t size_bytes() const {
    return static_cast<size_t>(num_elems) * (dtype == StateDType::kF32 ? 4 : 1);
  }
};

// The state of one parameter buffer for `optimizer`: the buffer holds the tensors of `shapes`,
// in order, back to back (each shape's product is its element count; they sum to the buffer's
// length; {n} for a flat buffer). Every kind whose state is per element (all but Adafactor)
// ignores the shapes beyond their total. Sections of 0 elements are left out. Sizes are element
// counts (size_bytes() in bytes). Pure; thread-safe; no errors (a config that does not belong to
// its kind gives the kind's per-element layout, or none: Validate first).
std::vector<StateSpec> StateLayout(const AnyOptimizer& optimizer,
                                   std::span<const std::vector<int64_t>> shapes);

// Writes a section's initial value into `bytes` (spec.size_bytes() bytes, 4-byte aligned for
// kF32; the caller owns them). Thread-safe for distinct buffers.
void InitializeState(const StateSpec& spec, std::span<std::byte> bytes);

// Elements [begin, end) of a buffer (element counts, not bytes).
struct ElemRange {
  int64_t begin = 0;
  int64_t end = 0;
  friend bool operator==(const ElemRange&, const ElemRange&) = default;
};

// One step over the buffer `master` made of the tensors of `shapes`: state holds one byte span
// per section of StateLayout(optimizer, shapes), in that order, each of its size, fp32 sections
// 4-byte aligned (kInvalidArgument otherwise, naming the section; kU8 codes need no alignment).
// Numerics, threading and errors are the kind's XxxUpdate's (optimizer.h).
//
// Weight decay groups: the elements of `no_decay` (ranges sorted, disjoint, non-empty, within
// the buffer; kInvalidArgument otherwise) are stepped with weight_decay 0, as torch.optim steps a
// second parameter group that differs only in weight_decay=0 (transformers' Trainer puts biases
// and norm weights there: get_decay_parameter_names). The result equals, element by element and
// bit for bit, this call without ranges for the other elements and this call with weight_decay 0
// for those of the ranges; AdamW8bit's moments stay quantized per block of the whole buffer (a
// block that straddles a range's edge is quantized once, from both groups' new moments, through
// 16 KiB of fp32 scratch the call allocates); each
// range must cover whole tensors of `shapes` for Adafactor, whose step is per tensor. The
// arguments are checked for the whole buffer before anything is written.
Status UpdateState(const AnyOptimizer& optimizer, const OptimStep& step,
                   std::span<const std::vector<int64_t>> shapes, std::span<float> master,
                   std::span<const std::span<std::byte>> state, GradView grad,
                   CopyOut copy_out = {}, std::span<const ElemRange> no_decay = {});

// OK when `no_decay` is sorted, disjoint, non-empty ranges within [0, num_elems); otherwise
// kInvalidArgument prefixed with `who`, naming the first bad range. Pure; thread-safe.
Status CheckNoDecayRanges(std::string_view who, std::span<const ElemRange> no_decay,
                          int64_t num_elems);

// [0, num_elems) cut at the edges of `no_decay` (checked ranges) into runs of consecutive
// elements of one group, in order. Pure; thread-safe.
struct DecayRun {
  int64_t begin = 0, end = 0;
  bool decayed = true;  // false: a no-decay range
};
std::vector<DecayRun> DecayRuns(std::span<const ElemRange> no_decay, int64_t num_elems);

// `optimizer` with weight_decay 0 (every kind has the hyper-parameter): the config that steps a
// no-decay group. Pure.
AnyOptimizer WithoutWeightDecay(const AnyOptimizer& optimizer);

// The learning rate of any kind's config, and setting it (the caller serializes writes).
float LearningRate(const AnyOptimizer& optimizer);
void SetLearningRate(AnyOptimizer& optimizer, float lr);

}  // namespace strata::cpu_optim

#include "cpu_optim/any_optimizer.h"

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <numeric>
#include <string>

#include "cpu_optim/kernels.h"

namespace strata::cpu_optim {

std::string_view OptimizerKindName(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::kAdamW:
      return "AdamW";
    case OptimizerKind::kAdam:
      return "Adam";
    case OptimizerKind::kAdagrad:
      return "Adagrad";
    case OptimizerKind::kLion:
      return "Lion";
    case OptimizerKind::kSgd:
      return "SGD";
    case OptimizerKind::kAdamW8bit:
      return "AdamW8bit";
    case OptimizerKind::kAdafactor:
      return "Adafactor";
  }
  return "unknown";
}

namespace {

bool ConfigMatchesKind(const AnyOptimizer& o) {
  switch (o.kind) {
    case OptimizerKind::kAdamW:
      return std::holds_alternative<AdamWConfig>(o.config) &&
             std::get<AdamWConfig>(o.config).decoupled_weight_decay;
    case OptimizerKind::kAdam:
      return std::holds_alternative<AdamWConfig>(o.config) &&
             !std::get<AdamWConfig>(o.config).decoupled_weight_decay;
    case OptimizerKind::kAdagrad:
      return std::holds_alternative<AdagradConfig>(o.config);
    case OptimizerKind::kLion:
      return std::holds_alternative<LionConfig>(o.config);
    case OptimizerKind::kSgd:
      return std::holds_alternative<SgdConfig>(o.config);
    case OptimizerKind::kAdamW8bit:
      return std::holds_alternative<AdamWConfig>(o.config);
    case OptimizerKind::kAdafactor:
      return std::holds_alternative<AdafactorConfig>(o.config);
  }
  return false;
}

}  // namespace

Status Validate(const AnyOptimizer& o) {
  if (!ConfigMatchesKind(o)) {
    return InvalidArgumentError(
        std::string("optimizer config does not belong to its kind ") +
        std::string(OptimizerKindName(o.kind)) +
        " (AdamW and Adam take an AdamWConfig with decoupled_weight_decay true / false)");
  }
  // An empty update checks the hyper-parameters with the kind's own rules and touches nothing.
  switch (o.kind) {
    case OptimizerKind::kAdamW8bit:
      return AdamW8bitUpdate(o.adamw(), OptimStep{}, {}, {}, {}, GradView{nullptr, DType::kF32});
    case OptimizerKind::kAdafactor: {
      const int64_t empty[1] = {0};
      return AdafactorUpdate(std::get<AdafactorConfig>(o.config), OptimStep{}, empty, {}, {},
                             GradView{nullptr, DType::kF32});
    }
    default:
      return Update(o, OptimStep{}, {}, {}, GradView{nullptr, DType::kF32});
  }
}

int NumState(const AnyOptimizer& o) {
  switch (o.kind) {
    case OptimizerKind::kAdamW:
    case OptimizerKind::kAdam:
      return std::get<AdamWConfig>(o.config).amsgrad ? 3 : 2;
    case OptimizerKind::kAdagrad:
    case OptimizerKind::kLion:
      return 1;
    case OptimizerKind::kSgd:
      return std::get<SgdConfig>(o.config).momentum != 0.0f ? 1 : 0;
    case OptimizerKind::kAdamW8bit:
    case OptimizerKind::kAdafactor:
      return 0;
  }
  return 0;
}

std::string_view StateName(const AnyOptimizer& o, int index) {
  switch (o.kind) {
    case OptimizerKind::kAdamW:
    case OptimizerKind::kAdam:
      return index == 0 ? "exp_avg" : index == 1 ? "exp_avg_sq" : "max_exp_avg_sq";
    case OptimizerKind::kAdagrad:
      return "sum";
    case OptimizerKind::kLion:
      return "exp_avg";
    case OptimizerKind::kSgd:
      return "momentum_buffer";
    case OptimizerKind::kAdamW8bit:
    case OptimizerKind::kAdafactor:
      break;
  }
  return "unknown";
}

float InitialStateValue(const AnyOptimizer& o, int index) {
  if (o.kind == OptimizerKind::kAdagrad) {
    return std::get<AdagradConfig>(o.config).initial_accumulator_value;
  }
  return 0.0f;
}

Status Update(const AnyOptimizer& o, const OptimStep& step, std::span<float> master,
              std::span<const std::span<float>> state, GradView grad, CopyOut copy_out) {
  if (!ConfigMatchesKind(o)) return Validate(o);
  const int want = NumState(o);
  // Validate() passes no state: every kind then checks its hyper-parameters on empty spans.
  const bool empty_check = master.empty() && state.empty();
  if (!empty_check && static_cast<int>(state.size()) != want) {
    return InvalidArgumentError(std::string(OptimizerKindName(o.kind)) + ": " +
                                std::to_string(state.size()) + " state buffers given, expected " +
                                std::to_string(want));
  }
  auto s = [&](int i) { return empty_check ? std::span<float>() : state[i]; };
  switch (o.kind) {
    case OptimizerKind::kAdamW:
    case OptimizerKind::kAdam: {
      const auto& c = std::get<AdamWConfig>(o.config);
      return AdamWUpdate(c, step, master, s(0), s(1), grad, copy_out,
                         c.amsgrad ? s(2) : std::span<float>());
    }
    case OptimizerKind::kAdagrad:
      return AdagradUpdate(std::get<AdagradConfig>(o.config), step, master, s(0), grad, copy_out);
    case OptimizerKind::kLion:
      return LionUpdate(std::get<LionConfig>(o.config), step, master, s(0), grad, copy_out);
    case OptimizerKind::kSgd:
      return SgdUpdate(std::get<SgdConfig>(o.config), step, master,
                       want ? s(0) : std::span<float>(), grad, copy_out);
    case OptimizerKind::kAdamW8bit:
    case OptimizerKind::kAdafactor:
      return InvalidArgumentError(std::string(OptimizerKindName(o.kind)) +
                                  " state is not one fp32 value per parameter: use UpdateState");
  }
  return InvalidArgumentError("unknown optimizer kind " + std::to_string(static_cast<int>(o.kind)));
}

namespace {

int64_t NumElems(const std::vector<int64_t>& shape) {
  return std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<>());
}

int64_t TotalElems(std::span<const std::vector<int64_t>> shapes) {
  int64_t n = 0;
  for (const auto& shape : shapes) n += NumElems(shape);
  return n;
}

// Adafactor's sections: the rows and columns of the factored tensors and the elements of the
// others, summed over the tensors in order.
struct AdafactorSections {
  int64_t rows = 0, cols = 0, unfactored = 0;
};
AdafactorSections AdafactorSectionSizes(std::span<const std::vector<int64_t>> shapes) {
  AdafactorSections f;
  for (const auto& shape : shapes) {
    if (AdafactorFactored(shape)) {
      f.rows += NumElems(shape) / std::max<int64_t>(1, shape.back());
      f.cols += shape.back();
    } else {
      f.unfactored += NumElems(shape);
    }
  }
  return f;
}

// Element `offset` of a buffer of `dtype`.
const void* Offset(const void* p, DType dtype, int64_t offset) {
  return static_cast<const std::byte*>(p) + offset * static_cast<int64_t>(SizeOf(dtype));
}

// Adafactor over the tensors of `shapes`, one after the other, each with its slices of the
// sections (in StateLayout's order).
// decayed[k]: whether tensor k of `shapes` takes weight decay (empty: every tensor does).
Status AdafactorUpdateTensors(const AdafactorConfig& c, const OptimStep& step,
                              std::span<const std::vector<int64_t>> shapes, std::span<float> master,
                              std::span<const std::span<float>> sections, GradView grad,
                              CopyOut copy_out, const std::vector<bool>& decayed) {
  AdafactorConfig no_decay = c;
  no_decay.weight_decay = 0.0f;
  const AdafactorSections sizes = AdafactorSectionSizes(shapes);
  // The sections present, in order: row, col, unfactored, exp_avg (zero-sized ones left out).
  size_t next = 0;
  auto take = [&](int64_t elems) { return elems > 0 ? sections[next++] : std::span<float>(); };
  std::span<float> row = take(sizes.rows), col = take(sizes.cols),
                   unfactored = take(sizes.unfactored);
  std::span<float> exp_avg =
      c.beta1 > 0 ? take(static_cast<int64_t>(master.size())) : std::span<float>();
  int64_t offset = 0, row_at = 0, col_at = 0, unfactored_at = 0;
  for (size_t k = 0; k < shapes.size(); ++k) {
    const std::vector<int64_t>& shape = shapes[k];
    const int64_t n = NumElems(shape);
    AdafactorState state;
    if (AdafactorFactored(shape)) {
      const int64_t cols = shape.back(), rows = n / std::max<int64_t>(1, cols);
      state.exp_avg_sq_row = row.subspan(row_at, rows);
      state.exp_avg_sq_col = col.subspan(col_at, cols);
      row_at += rows;
      col_at += cols;
    } else {
      state.exp_avg_sq = unfactored.subspan(unfactored_at, n);
      unfactored_at += n;
    }
    if (!exp_avg.empty()) state.exp_avg = exp_avg.subspan(offset, n);
    CopyOut out = copy_out;
    if (out.data) out.data = const_cast<void*>(Offset(out.data, out.dtype, offset));
    STRATA_RETURN_IF_ERROR(AdafactorUpdate(
        decayed.empty() || decayed[k] ? c : no_decay, step, shape, master.subspan(offset, n), state,
        GradView{Offset(grad.data, grad.dtype, offset), grad.dtype}, out));
    offset += n;
  }
  return Status::Ok();
}

// Element `offset` of a gradient or a copy-out.
GradView GradAt(GradView g, int64_t offset) { return {Offset(g.data, g.dtype, offset), g.dtype}; }
CopyOut CopyOutAt(CopyOut out, int64_t offset) {
  if (out.data != nullptr) out.data = const_cast<void*>(Offset(out.data, out.dtype, offset));
  return out;
}

// Whether each tensor of `shapes` takes weight decay; kInvalidArgument when a range cuts one.
StatusOr<std::vector<bool>> TensorsDecayed(const AnyOptimizer& o,
                                           std::span<const std::vector<int64_t>> shapes,
                                           std::span<const ElemRange> no_decay) {
  std::vector<bool> decayed;
  const std::vector<DecayRun> runs = DecayRuns(no_decay, TotalElems(shapes));
  size_t run = 0;
  int64_t offset = 0;
  for (const auto& shape : shapes) {
    const int64_t n = NumElems(shape);
    while (run < runs.size() && runs[run].end <= offset) ++run;
    if (n > 0 && runs[run].end < offset + n) {
      return InvalidArgumentError(std::string(OptimizerKindName(o.kind)) +
                                  ": the no-decay ranges cut tensor " +
                                  std::to_string(decayed.size()) + " [" + std::to_string(offset) +
                                  ", " + std::to_string(offset + n) +
                                  ") (its step is per tensor: a range must cover whole tensors)");
    }
    decayed.push_back(n == 0 || runs[run].decayed);
    offset += n;
  }
  return decayed;
}

// A per-element kind over runs: each run one call with its group's config, after the checks of
// the whole buffer.
Status UpdateRuns(const AnyOptimizer& o, const OptimStep& step, std::span<float> master,
                  std::span<const std::span<float>> state, GradView grad, CopyOut copy_out,
                  std::span<const ElemRange> no_decay) {
  STRATA_RETURN_IF_ERROR(Update(o, step, {}, {}, grad, {}));  // hyper-parameters and step
  std::vector<std::string> names;
  std::vector<internal::NamedState> named;
  for (size_t i = 0; i < state.size(); ++i) names.emplace_back(StateName(o, static_cast<int>(i)));
  for (size_t i = 0; i < state.size(); ++i) named.push_back({state[i], names[i].c_str()});
  STRATA_RETURN_IF_ERROR(
      internal::ValidateBuffers(OptimizerKindName(o.kind), master, named, grad, copy_out));
  const AnyOptimizer undecayed = WithoutWeightDecay(o);
  std::vector<std::span<float>> part(state.size());
  for (const DecayRun& r : DecayRuns(no_decay, static_cast<int64_t>(master.size()))) {
    const size_t len = static_cast<size_t>(r.end - r.begin);
    for (size_t i = 0; i < state.size(); ++i) part[i] = state[i].subspan(r.begin, len);
    STRATA_RETURN_IF_ERROR(Update(r.decayed ? o : undecayed, step, master.subspan(r.begin, len),
                                  part, GradAt(grad, r.begin), CopyOutAt(copy_out, r.begin)));
  }
  return Status::Ok();
}

// AdamW8bit over runs. Whole quantization blocks inside one run go to AdamW8bitUpdate in groups;
// a block that straddles runs is dequantized, stepped in fp32 per run (AdamWUpdate: the same
// formulas and operation order as the 8-bit update's), and quantized once (QuantizeBlockwise:
// the 8-bit update's own re-quantization).
Status AdamW8bitUpdateRuns(const AdamWConfig& c, const OptimStep& step, std::span<float> master,
                           QuantizedState m, QuantizedState v, GradView grad, CopyOut copy_out,
                           std::span<const ElemRange> no_decay) {
  STRATA_RETURN_IF_ERROR(internal::ValidateAdamW8bit(c, step, master, m, v, grad, copy_out));
  AdamWConfig undecayed = c;
  undecayed.weight_decay = 0.0f;
  const int64_t n = static_cast<int64_t>(master.size());
  constexpr int64_t kB = kQuantBlockElems;
  const std::vector<DecayRun> runs = DecayRuns(no_decay, n);
  auto sub = [&](QuantizedState q, int64_t begin, int64_t end) {
    return QuantizedState{q.codes.subspan(begin, end - begin),
                          q.absmax.subspan(begin / kB, QuantizedAbsmaxCount(end - begin))};
  };
  std::vector<float> m32, v32;
  size_t run = 0;
  for (int64_t block = 0; block < n;) {
    const int64_t block_end = std::min(n, block + kB);
    while (runs[run].end <= block) ++run;
    if (runs[run].end >= block_end) {
      // Whole blocks of this run, up to the last one it covers entirely (or the buffer's end).
      const int64_t end = runs[run].end == n ? n : runs[run].end / kB * kB;
      const size_t len = static_cast<size_t>(end - block);
      STRATA_RETURN_IF_ERROR(AdamW8bitUpdate(
          runs[run].decayed ? c : undecayed, step, master.subspan(block, len), sub(m, block, end),
          sub(v, block, end), GradAt(grad, block), CopyOutAt(copy_out, block)));
      block = end;
      continue;
    }
    const size_t len = static_cast<size_t>(block_end - block);
    m32.resize(len);
    v32.resize(len);
    STRATA_RETURN_IF_ERROR(DequantizeBlockwise(sub(m, block, block_end), true, m32));
    STRATA_RETURN_IF_ERROR(DequantizeBlockwise(sub(v, block, block_end), false, v32));
    for (size_t r = run; r < runs.size() && runs[r].begin < block_end; ++r) {
      const int64_t begin = std::max(runs[r].begin, block), end = std::min(runs[r].end, block_end);
      const auto at = static_cast<size_t>(begin - block), count = static_cast<size_t>(end - begin);
      STRATA_RETURN_IF_ERROR(
          AdamWUpdate(runs[r].decayed ? c : undecayed, step, master.subspan(begin, count),
                      std::span(m32).subspan(at, count), std::span(v32).subspan(at, count),
                      GradAt(grad, begin), CopyOutAt(copy_out, begin)));
    }
    STRATA_RETURN_IF_ERROR(QuantizeBlockwise(m32, true, sub(m, block, block_end)));
    STRATA_RETURN_IF_ERROR(QuantizeBlockwise(v32, false, sub(v, block, block_end)));
    block = block_end;
  }
  return Status::Ok();
}

}  // namespace

Status CheckNoDecayRanges(std::string_view who, std::span<const ElemRange> no_decay,
                          int64_t num_elems) {
  int64_t at = 0;
  for (size_t i = 0; i < no_decay.size(); ++i) {
    const ElemRange& r = no_decay[i];
    if (r.begin < at || r.end <= r.begin || r.end > num_elems) {
      return InvalidArgumentError(std::string(who) + ": no-decay range " + std::to_string(i) +
                                  " [" + std::to_string(r.begin) + ", " + std::to_string(r.end) +
                                  ") must be non-empty, after the one before it and within the " +
                                  std::to_string(num_elems) + " elements");
    }
    at = r.end;
  }
  return Status::Ok();
}

std::vector<DecayRun> DecayRuns(std::span<const ElemRange> no_decay, int64_t num_elems) {
  std::vector<DecayRun> runs;
  int64_t at = 0;
  for (const ElemRange& r : no_decay) {
    if (r.begin > at) runs.push_back({at, r.begin, true});
    runs.push_back({r.begin, r.end, false});
    at = r.end;
  }
  if (at < num_elems) runs.push_back({at, num_elems, true});
  return runs;
}

AnyOptimizer WithoutWeightDecay(const AnyOptimizer& optimizer) {
  AnyOptimizer o = optimizer;
  std::visit([](auto& c) { c.weight_decay = 0.0f; }, o.config);
  return o;
}

std::vector<StateSpec> StateLayout(const AnyOptimizer& o,
                                   std::span<const std::vector<int64_t>> shapes) {
  std::vector<StateSpec> specs;
  const int64_t n = TotalElems(shapes);
  if (n == 0) return specs;
  auto add = [&](std::string name, StateDType dtype, int64_t elems, uint8_t code = 0) {
    if (elems > 0) specs.push_back({std::move(name), dtype, elems, 0.0f, code});
  };
  if (o.kind == OptimizerKind::kAdamW8bit) {
    const int64_t blocks = QuantizedAbsmaxCount(n);
    add("exp_avg", StateDType::kU8, n, QuantizedZeroCode(/*is_signed=*/true));
    add("exp_avg.absmax", StateDType::kF32, blocks);
    add("exp_avg_sq", StateDType::kU8, n, QuantizedZeroCode(/*is_signed=*/false));
    add("exp_avg_sq.absmax", StateDType::kF32, blocks);
    return specs;
  }
  if (o.kind == OptimizerKind::kAdafactor) {
    const AdafactorSections f = AdafactorSectionSizes(shapes);
    add("exp_avg_sq_row", StateDType::kF32, f.rows);
    add("exp_avg_sq_col", StateDType::kF32, f.cols);
    add("exp_avg_sq", StateDType::kF32, f.unfactored);
    const auto* c = std::get_if<AdafactorConfig>(&o.config);
    if (c != nullptr && c->beta1 > 0) add("exp_avg", StateDType::kF32, n);
    return specs;
  }
  for (int i = 0; i < NumState(o); ++i) {
    specs.push_back({std::string(StateName(o, i)), StateDType::kF32, n, InitialStateValue(o, i)});
  }
  return specs;
}

void InitializeState(const StateSpec& spec, std::span<std::byte> bytes) {
  if (spec.dtype == StateDType::kU8) {
    std::memset(bytes.data(), spec.initial_code, bytes.size());
    return;
  }
  auto* f = reinterpret_cast<float*>(bytes.data());
  std::fill(f, f + bytes.size() / sizeof(float), spec.initial_value);
}

Status UpdateState(const AnyOptimizer& o, const OptimStep& step,
                   std::span<const std::vector<int64_t>> shapes, std::span<float> master,
                   std::span<const std::span<std::byte>> state, GradView grad, CopyOut copy_out,
                   std::span<const ElemRange> no_decay) {
  if (!ConfigMatchesKind(o)) return Validate(o);
  if (TotalElems(shapes) != static_cast<int64_t>(master.size())) {
    return InvalidArgumentError(std::string(OptimizerKindName(o.kind)) +
                                ": the tensor shapes cover " + std::to_string(TotalElems(shapes)) +
                                " elements, the buffer has " + std::to_string(master.size()));
  }
  const std::vector<StateSpec> specs = StateLayout(o, shapes);
  if (state.size() != specs.size()) {
    return InvalidArgumentError(std::string(OptimizerKindName(o.kind)) + ": " +
                                std::to_string(state.size()) + " state sections given, expected " +
                                std::to_string(specs.size()));
  }
  for (size_t i = 0; i < specs.size(); ++i) {
    if (state[i].size() != specs[i].size_bytes()) {
      return InvalidArgumentError(std::string(OptimizerKindName(o.kind)) + ": state section '" +
                                  specs[i].name + "' must be " +
                                  std::to_string(specs[i].size_bytes()) + " bytes; got " +
                                  std::to_string(state[i].size()));
    }
    // fp32 sections are read as floats; 8-bit codes need no alignment.
    if (specs[i].dtype == StateDType::kF32 &&
        reinterpret_cast<uintptr_t>(state[i].data()) % alignof(float) != 0) {
      return InvalidArgumentError(std::string(OptimizerKindName(o.kind)) +
                                  ": the buffer of fp32 state section '" + specs[i].name +
                                  "' is not 4-byte aligned");
    }
  }
  STRATA_RETURN_IF_ERROR(
      CheckNoDecayRanges(OptimizerKindName(o.kind), no_decay, static_cast<int64_t>(master.size())));
  std::vector<std::span<float>> f32;
  for (const auto& s : state) {
    f32.emplace_back(reinterpret_cast<float*>(s.data()), s.size() / sizeof(float));
  }
  if (o.kind == OptimizerKind::kAdamW8bit) {
    auto codes = [&](size_t i) {
      return std::span<uint8_t>(reinterpret_cast<uint8_t*>(state[i].data()), state[i].size());
    };
    const QuantizedState m{codes(0), f32[1]}, v{codes(2), f32[3]};
    if (no_decay.empty()) return AdamW8bitUpdate(o.adamw(), step, master, m, v, grad, copy_out);
    return AdamW8bitUpdateRuns(o.adamw(), step, master, m, v, grad, copy_out, no_decay);
  }
  if (o.kind == OptimizerKind::kAdafactor) {
    std::vector<bool> decayed;
    if (!no_decay.empty()) {
      STRATA_ASSIGN_OR_RETURN(decayed, TensorsDecayed(o, shapes, no_decay));
    }
    return AdafactorUpdateTensors(std::get<AdafactorConfig>(o.config), step, shapes, master, f32,
                                  grad, copy_out, decayed);
  }
  if (no_decay.empty()) return Update(o, step, master, f32, grad, copy_out);
  return UpdateRuns(o, step, master, f32, grad, copy_out, no_decay);
}

float LearningRate(const AnyOptimizer& o) {
  return std::visit([](const auto& c) { return c.lr; }, o.config);
}

void SetLearningRate(AnyOptimizer& o, float lr) {
  std::visit([lr](auto& c) { c.lr = lr; }, o.config);
}

}  // namespace strata::cpu_optim

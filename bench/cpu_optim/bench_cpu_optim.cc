// CPU optimizer step throughput against the memory traffic that bounds it.
//
//   BM_AdamW/<isa>/params/grad/threads         AdamW step with the <isa> kernel variant
//   BM_AdamWTraffic/<isa>/params/grad/threads  the same bytes read and written, no
//                                              arithmetic (the memory-only limit)
//   BM_AdamWCopyOut/<isa>/params/grad/out/threads  AdamW with 16-bit gradients and copy-out
//                                              in each of fp16 and bf16 (out: DType value)
//   BM_AdamWReference/params/grad              the scalar reference (one thread)
//   BM_AdamW8bit/<isa>/params/grad/threads     AdamW with 8-bit block-wise m, v (adamw8bit.h)
//   BM_AdamW8bitTraffic/<isa>/params/grad/threads  its bytes with bit moves only
//   BM_Adagrad, BM_Lion, BM_Sgd/params/grad/threads  the other optimizers (best variant)
//   BM_Triad/params/threads                    STREAM triad a = b + s * c over fp32 arrays
//   BM_Adafactor/<isa>/params/grad/threads/factored  Adafactor step (beta1 = 0, bf16
//                                              copy-out): factored 1 = a (params / 4096,
//                                              4096) matrix, 0 = a vector
//
//   BM_UpdateStateDecayGroups/kind/groups/threads  UpdateState (the engine's call) over one
//                                              GPT-2 1.5B block (30.7M parameters, bf16 gradients,
//                                              bf16 copy-out): kind 1 = AdamW, 6 = AdamW8bit
//                                              (OptimizerKind values); groups 0 = every element
//                                              decayed (one call), 1 = its biases and norm weights
//                                              exempt (the default since weight decay groups: 6
//                                              no-decay runs between 4 matrices, 10 calls; with
//                                              AdamW8bit the blocks a run boundary cuts are stepped
//                                              in fp32 and quantized once). The pair is the cost of
//                                              the groups, in the same run.
//
// <isa> is every variant this CPU runs (avx512, avx2, generic). grad: 0 = fp32,
// 1 = fp16, 2 = bf16 (DType values). Copy-out is bf16 but in BM_AdamWCopyOut, so bf16
// gradients are the engine's case and the headline. Bytes per parameter (bytes_per_second):
// AdamW reads p32, m, v (12 B) + the gradient (4 or 2 B) and writes p32, m, v (12 B) + the
// 16-bit copy-out (2 B): 28 B with 16-bit gradients, 30 B with fp32. Adagrad, Lion and
// SGD with momentum move one fp32 state instead of two: 20 B (22 B with fp32).
// Adafactor reads the gradient three times when factored (row/column sums,
// RMS(update), the update) and moves p32 and the copy-out: 3 * grad + 10 B (16 B with
// bf16 gradients); as a vector it reads the gradient twice and v twice and writes v:
// 2 * grad + 22 B (26 B).
// AdamW8bit reads p32 (4 B), the m and v codes (2 B) and the gradient, and writes
// p32, the codes and the bf16 copy-out: 16 B with 16-bit gradients, 18 B with fp32,
// plus 16 B of absmax per 2048 parameters (counted).
// items_per_second (and the params_per_second counter) is parameters per second.
// Times are wall-clock (the work runs on oneTBB workers).
//
// Sizes: 10M parameters for every variant, gradient dtype and thread count; 100M
// for every variant with bf16 gradients (and the best variant with fp32/fp16);
// 500M (~8 GB of state) for the best variant with bf16 gradients. BM_AdamWCopyOut: 10M for
// every variant, 100M for every variant but the generic one. A full run takes
// 5-10 minutes on a 2-core VM:
//   bench_cpu_optim --benchmark_repetitions=3 --benchmark_out=cpu_optim.json
//       --benchmark_out_format=json   (one command line)
//   python3 bench/cpu_optim/summarize.py cpu_optim.json
// Skip the big cases with --benchmark_filter='params:10000000/'.
#include <benchmark/benchmark.h>
#include <fmt/format.h>
#include <tbb/blocked_range.h>
#include <tbb/info.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>
#include <tbb/version.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "base/aligned_buffer.h"
#include "base/dtype.h"
#include "cpu_optim/adafactor.h"
#include "cpu_optim/adagrad.h"
#include "cpu_optim/adamw.h"
#include "cpu_optim/adamw8bit.h"
#include "cpu_optim/any_optimizer.h"
#include "cpu_optim/kernels.h"
#include "cpu_optim/lion.h"
#include "cpu_optim/sgd.h"

namespace strata::cpu_optim {
namespace {

constexpr int64_t kTile = internal::kAdamWTileElems;

// The optimizer state of one benchmark, allocated 4 KiB-aligned and first touched
// in parallel (as the engine's pinned buffers would be).
struct Buffers {
  AlignedBuffer p, m, v, grad, out;
  int64_t n = 0;
  DType grad_dtype = DType::kBF16;

  static std::unique_ptr<Buffers> Make(int64_t n, DType grad_dtype) {
    auto b = std::make_unique<Buffers>();
    b->n = n;
    b->grad_dtype = grad_dtype;
    auto alloc = [](size_t bytes) {
      StatusOr<AlignedBuffer> buf = AlignedBuffer::Allocate(bytes);
      return buf.ok() ? std::move(buf).value() : AlignedBuffer();
    };
    b->p = alloc(n * 4);
    b->m = alloc(n * 4);
    b->v = alloc(n * 4);
    b->grad = alloc(n * SizeOf(grad_dtype));
    b->out = alloc(n * 2);
    if (!b->p.data() || !b->m.data() || !b->v.data() || !b->grad.data() || !b->out.data()) {
      return nullptr;
    }
    float* p = b->p.as<float>();
    void* g = b->grad.data();
    tbb::parallel_for(tbb::blocked_range<int64_t>(0, n, kTile), [&](const auto& r) {
      for (int64_t i = r.begin(); i < r.end(); ++i) {
        p[i] = 0.02f * static_cast<float>(static_cast<int>(i % 201) - 100) / 100.0f;
        const float gi = 1e-3f * static_cast<float>(static_cast<int>(i % 97) - 48) / 48.0f + 1e-5f;
        if (grad_dtype == DType::kF32) {
          static_cast<float*>(g)[i] = gi;
        } else if (grad_dtype == DType::kF16) {
          static_cast<uint16_t*>(g)[i] = FloatToHalf(gi);
        } else {
          static_cast<uint16_t*>(g)[i] = FloatToBf16(gi);
        }
      }
    });
    return b;
  }
  // AdamW's bytes; optimizers with one state buffer move 8 B less.
  size_t bytes_per_param(int num_states = 2) const {
    return 4 * (1 + num_states) * 2 + SizeOf(grad_dtype) + 2;
  }
  std::span<float> span(AlignedBuffer& buf) const {
    return {buf.as<float>(), static_cast<size_t>(n)};
  }
};

void SetCounters(benchmark::State& state, const Buffers& b, int num_states = 2) {
  const auto bytes = static_cast<int64_t>(b.bytes_per_param(num_states));
  state.SetItemsProcessed(state.iterations() * b.n);
  state.SetBytesProcessed(state.iterations() * b.n * bytes);
  state.counters["bytes_per_param"] = static_cast<double>(bytes);
  state.counters["params_per_second"] = benchmark::Counter(
      static_cast<double>(state.iterations() * b.n), benchmark::Counter::kIsRate);
}

// AdamW over params parameters with grad_dtype gradients and an out_dtype (16-bit) copy-out.
void RunAdamWWith(benchmark::State& state, const internal::KernelTable& kernels, int64_t params,
                  DType grad_dtype, DType out_dtype, int threads) {
  const auto b = Buffers::Make(params, grad_dtype);
  if (!b) return state.SkipWithError("allocation failed");
  AdamWConfig config;
  config.weight_decay = 0.01f;
  tbb::task_arena arena(threads);
  int64_t t = 0;
  for (auto _ : state) {
    Status s;
    arena.execute([&] {
      s = internal::AdamWUpdateWith(kernels, config, {.step = ++t, .grad_scale = 0.5f},
                                    {b->p.as<float>(), static_cast<size_t>(b->n)},
                                    {b->m.as<float>(), static_cast<size_t>(b->n)},
                                    {b->v.as<float>(), static_cast<size_t>(b->n)},
                                    GradView{b->grad.data(), b->grad_dtype},
                                    CopyOut{b->out.data(), out_dtype});
    });
    if (!s.ok()) return state.SkipWithError(s.ToString().c_str());
  }
  SetCounters(state, *b);
}

// Arguments params, grad, threads; bf16 copy-out.
void RunAdamW(benchmark::State& state, const internal::KernelTable& kernels) {
  RunAdamWWith(state, kernels, state.range(0), static_cast<DType>(state.range(1)), DType::kBF16,
               static_cast<int>(state.range(2)));
}

// Arguments params, grad, out, threads.
void RunAdamWCopyOut(benchmark::State& state, const internal::KernelTable& kernels) {
  RunAdamWWith(state, kernels, state.range(0), static_cast<DType>(state.range(1)),
               static_cast<DType>(state.range(2)), static_cast<int>(state.range(3)));
}

// The same bytes as BM_AdamW with bit moves only, compiled for the same ISA
// variant as the AdamW kernel (internal::KernelTable::adamw_traffic).
void RunAdamWTraffic(benchmark::State& state, const internal::KernelTable& kernels) {
  const auto b = Buffers::Make(state.range(0), static_cast<DType>(state.range(1)));
  if (!b) return state.SkipWithError("allocation failed");
  const internal::AdamWBuffers bufs{.master = b->p.as<float>(),
                                    .m = b->m.as<float>(),
                                    .v = b->v.as<float>(),
                                    .grad = b->grad.data(),
                                    .grad_dtype = b->grad_dtype,
                                    .out = b->out.data(),
                                    .out_dtype = DType::kBF16};
  tbb::task_arena arena(static_cast<int>(state.range(2)));
  const int64_t num_tiles = (b->n + kTile - 1) / kTile;
  for (auto _ : state) {
    arena.execute([&] {
      tbb::parallel_for(tbb::blocked_range<int64_t>(0, num_tiles), [&](const auto& r) {
        kernels.adamw_traffic(bufs, r.begin() * kTile, std::min(b->n, r.end() * kTile));
      });
    });
    benchmark::ClobberMemory();
  }
  SetCounters(state, *b);
}

// The 8-bit state of one benchmark: p32, m and v codes with their absmax, the
// gradient and a bf16 copy-out; the moments start quantized from small values.
struct Buffers8bit {
  AlignedBuffer p, m_codes, v_codes, m_absmax, v_absmax, grad, out;
  int64_t n = 0, blocks = 0;
  DType grad_dtype = DType::kBF16;

  static std::unique_ptr<Buffers8bit> Make(int64_t n, DType grad_dtype) {
    const std::unique_ptr<Buffers> f = Buffers::Make(n, grad_dtype);
    if (!f) return nullptr;
    auto b = std::make_unique<Buffers8bit>();
    b->n = n;
    b->blocks = QuantizedAbsmaxCount(n);
    b->grad_dtype = grad_dtype;
    auto alloc = [](size_t bytes) {
      StatusOr<AlignedBuffer> buf = AlignedBuffer::Allocate(bytes);
      return buf.ok() ? std::move(buf).value() : AlignedBuffer();
    };
    b->p = std::move(f->p);
    b->grad = std::move(f->grad);
    b->out = std::move(f->out);
    b->m_codes = alloc(n);
    b->v_codes = alloc(n);
    b->m_absmax = alloc(b->blocks * 4);
    b->v_absmax = alloc(b->blocks * 4);
    if (!b->m_codes.data() || !b->v_codes.data() || !b->m_absmax.data() || !b->v_absmax.data()) {
      return nullptr;
    }
    // Moments as after a few steps: m ~ 1e-4 with a spread, v ~ 1e-8.
    float* m = f->m.as<float>();
    float* v = f->v.as<float>();
    tbb::parallel_for(tbb::blocked_range<int64_t>(0, n, kTile), [&](const auto& r) {
      for (int64_t i = r.begin(); i < r.end(); ++i) {
        m[i] = 1e-4f * static_cast<float>(static_cast<int>(i % 89) - 44) / 44.0f;
        v[i] = 1e-8f * static_cast<float>(1 + i % 53);
      }
    });
    if (!QuantizeBlockwise({m, static_cast<size_t>(n)}, true, b->m_state()).ok() ||
        !QuantizeBlockwise({v, static_cast<size_t>(n)}, false, b->v_state()).ok()) {
      return nullptr;
    }
    return b;
  }
  QuantizedState m_state() {
    return {{m_codes.as<uint8_t>(), static_cast<size_t>(n)},
            {m_absmax.as<float>(), static_cast<size_t>(blocks)}};
  }
  QuantizedState v_state() {
    return {{v_codes.as<uint8_t>(), static_cast<size_t>(n)},
            {v_absmax.as<float>(), static_cast<size_t>(blocks)}};
  }
};

void SetCounters8bit(benchmark::State& state, const Buffers8bit& b) {
  const int64_t bytes =
      b.n * static_cast<int64_t>(2 * (4 + 2) + SizeOf(b.grad_dtype) + 2) + b.blocks * 2 * (4 + 4);
  state.SetItemsProcessed(state.iterations() * b.n);
  state.SetBytesProcessed(state.iterations() * bytes);
  state.counters["bytes_per_param"] = static_cast<double>(bytes) / static_cast<double>(b.n);
  state.counters["params_per_second"] = benchmark::Counter(
      static_cast<double>(state.iterations() * b.n), benchmark::Counter::kIsRate);
}

void RunAdamW8bit(benchmark::State& state, const internal::KernelTable& kernels) {
  const auto b = Buffers8bit::Make(state.range(0), static_cast<DType>(state.range(1)));
  if (!b) return state.SkipWithError("allocation failed");
  AdamWConfig config;
  config.weight_decay = 0.01f;
  tbb::task_arena arena(static_cast<int>(state.range(2)));
  int64_t t = 10;
  for (auto _ : state) {
    Status s;
    arena.execute([&] {
      s = internal::AdamW8bitUpdateWith(kernels, config, {.step = ++t, .grad_scale = 0.5f},
                                        {b->p.as<float>(), static_cast<size_t>(b->n)}, b->m_state(),
                                        b->v_state(), GradView{b->grad.data(), b->grad_dtype},
                                        CopyOut{b->out.data(), DType::kBF16});
    });
    if (!s.ok()) return state.SkipWithError(s.ToString().c_str());
  }
  SetCounters8bit(state, *b);
}

// The same bytes as BM_AdamW8bit with bit moves only, the same ISA variant and tiles.
void RunAdamW8bitTraffic(benchmark::State& state, const internal::KernelTable& kernels) {
  const auto b = Buffers8bit::Make(state.range(0), static_cast<DType>(state.range(1)));
  if (!b) return state.SkipWithError("allocation failed");
  const internal::AdamW8bitBuffers bufs{.master = b->p.as<float>(),
                                        .m_codes = b->m_codes.as<uint8_t>(),
                                        .m_absmax = b->m_absmax.as<float>(),
                                        .v_codes = b->v_codes.as<uint8_t>(),
                                        .v_absmax = b->v_absmax.as<float>(),
                                        .grad = b->grad.data(),
                                        .grad_dtype = b->grad_dtype,
                                        .out = b->out.data(),
                                        .out_dtype = DType::kBF16,
                                        .m_map = {},
                                        .v_map = {}};
  tbb::task_arena arena(static_cast<int>(state.range(2)));
  const int64_t num_tiles = (b->n + kTile - 1) / kTile;
  for (auto _ : state) {
    arena.execute([&] {
      tbb::parallel_for(tbb::blocked_range<int64_t>(0, num_tiles), [&](const auto& r) {
        kernels.adamw8bit_traffic(bufs, r.begin() * kTile, std::min(b->n, r.end() * kTile));
      });
    });
    benchmark::ClobberMemory();
  }
  SetCounters8bit(state, *b);
}

void BM_AdamWReference(benchmark::State& state) {
  const auto b = Buffers::Make(state.range(0), static_cast<DType>(state.range(1)));
  if (!b) return state.SkipWithError("allocation failed");
  AdamWConfig config;
  config.weight_decay = 0.01f;
  int64_t t = 0;
  for (auto _ : state) {
    const Status s = AdamWUpdateReference(
        config, {.step = ++t, .grad_scale = 0.5f}, {b->p.as<float>(), static_cast<size_t>(b->n)},
        {b->m.as<float>(), static_cast<size_t>(b->n)},
        {b->v.as<float>(), static_cast<size_t>(b->n)}, GradView{b->grad.data(), b->grad_dtype},
        CopyOut{b->out.data(), DType::kBF16});
    if (!s.ok()) return state.SkipWithError(s.ToString().c_str());
  }
  SetCounters(state, *b);
}

// Adagrad, Lion or SGD (momentum 0.9, Nesterov) with the best variant: one fp32
// state buffer, bf16 copy-out.
template <typename Update>
void RunOneStateOptimizer(benchmark::State& state, const Update& update) {
  const auto b = Buffers::Make(state.range(0), static_cast<DType>(state.range(1)));
  if (!b) return state.SkipWithError("allocation failed");
  tbb::task_arena arena(static_cast<int>(state.range(2)));
  int64_t t = 0;
  for (auto _ : state) {
    Status s;
    const OptimStep step{.step = ++t, .grad_scale = 0.5f};
    arena.execute([&] {
      s = update(step, b->span(b->p), b->span(b->m), GradView{b->grad.data(), b->grad_dtype},
                 CopyOut{b->out.data(), DType::kBF16});
    });
    if (!s.ok()) return state.SkipWithError(s.ToString().c_str());
  }
  SetCounters(state, *b, 1);
}

void BM_Adagrad(benchmark::State& state) {
  const AdagradConfig config{.lr = 1e-2f, .weight_decay = 0.01f};
  RunOneStateOptimizer(state, [&](const OptimStep& st, auto p, auto s, GradView g, CopyOut o) {
    return AdagradUpdate(config, st, p, s, g, o);
  });
}

void BM_Lion(benchmark::State& state) {
  const LionConfig config{.lr = 1e-4f, .weight_decay = 0.1f};
  RunOneStateOptimizer(state, [&](const OptimStep& st, auto p, auto s, GradView g, CopyOut o) {
    return LionUpdate(config, st, p, s, g, o);
  });
}

void BM_Sgd(benchmark::State& state) {
  const SgdConfig config{.lr = 1e-2f, .momentum = 0.9f, .weight_decay = 0.01f, .nesterov = true};
  RunOneStateOptimizer(state, [&](const OptimStep& st, auto p, auto s, GradView g, CopyOut o) {
    return SgdUpdate(config, st, p, s, g, o);
  });
}

// STREAM triad over three fp32 arrays of params elements: 12 B per element
// (write-allocate traffic not counted, as STREAM).
void BM_Triad(benchmark::State& state) {
  const int64_t n = state.range(0);
  StatusOr<AlignedBuffer> a = AlignedBuffer::Allocate(n * 4), bb = AlignedBuffer::Allocate(n * 4),
                          c = AlignedBuffer::Allocate(n * 4);
  if (!a.ok() || !bb.ok() || !c.ok()) return state.SkipWithError("allocation failed");
  float* x = a->as<float>();
  const float* y = bb->as<float>();
  const float* z = c->as<float>();
  tbb::task_arena arena(static_cast<int>(state.range(1)));
  const int64_t num_tiles = (n + kTile - 1) / kTile;
  for (auto _ : state) {
    arena.execute([&] {
      tbb::parallel_for(tbb::blocked_range<int64_t>(0, num_tiles), [&](const auto& r) {
        const int64_t end = std::min(n, r.end() * kTile);
        for (int64_t i = r.begin() * kTile; i < end; ++i) x[i] = y[i] + 3.0f * z[i];
      });
    });
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * n);
  state.SetBytesProcessed(state.iterations() * n * 12);
}

// Adafactor with the given variant: state zeroed once, then steps on it.
void RunAdafactor(benchmark::State& state, const internal::KernelTable& kernels) {
  const auto b = Buffers::Make(state.range(0), static_cast<DType>(state.range(1)));
  if (!b) return state.SkipWithError("allocation failed");
  const bool factored = state.range(3) != 0;
  constexpr int64_t kCols = 4096;
  const std::vector<int64_t> shape =
      factored ? std::vector<int64_t>{b->n / kCols, kCols} : std::vector<int64_t>{b->n};
  if (factored && b->n % kCols != 0) return state.SkipWithError("params not a multiple of 4096");
  // Factored state lives in the first rows + cols floats of m; v is the vector's.
  std::fill_n(b->m.as<float>(), factored ? b->n / kCols + kCols : 0, 0.0f);
  std::fill_n(b->v.as<float>(), b->n, 0.0f);
  const std::span<float> m = b->span(b->m);
  const AdafactorState st =
      factored ? AdafactorState{.exp_avg_sq_row = m.first(static_cast<size_t>(b->n / kCols)),
                                .exp_avg_sq_col = m.subspan(static_cast<size_t>(b->n / kCols),
                                                            static_cast<size_t>(kCols))}
               : AdafactorState{.exp_avg_sq = b->span(b->v)};
  const AdafactorConfig config{.lr = 1e-3f, .weight_decay = 0.01f};
  tbb::task_arena arena(static_cast<int>(state.range(2)));
  int64_t t = 0;
  for (auto _ : state) {
    Status s;
    arena.execute([&] {
      s = internal::AdafactorUpdateWith(kernels, config, {.step = ++t, .grad_scale = 0.5f}, shape,
                                        b->span(b->p), st, GradView{b->grad.data(), b->grad_dtype},
                                        CopyOut{b->out.data(), DType::kBF16});
    });
    if (!s.ok()) return state.SkipWithError(s.ToString().c_str());
  }
  const int64_t g = static_cast<int64_t>(SizeOf(b->grad_dtype));
  const int64_t bytes = factored ? 3 * g + 10 : 2 * g + 22;
  state.SetItemsProcessed(state.iterations() * b->n);
  state.SetBytesProcessed(state.iterations() * b->n * bytes);
  state.counters["bytes_per_param"] = static_cast<double>(bytes);
  state.counters["params_per_second"] = benchmark::Counter(
      static_cast<double>(state.iterations() * b->n), benchmark::Counter::kIsRate);
}

// One GPT-2 1.5B block (d = 1600) in transformers' order: the shapes, and its 1-D tensors
// (biases, LayerNorm weights) as element ranges.
struct Gpt2Block {
  std::vector<std::vector<int64_t>> shapes;
  std::vector<ElemRange> no_decay;
  int64_t n = 0;

  Gpt2Block() {
    constexpr int64_t d = 1600;
    shapes = {{d}, {d}, {3 * d, d}, {3 * d}, {d, d},     {d},
              {d}, {d}, {4 * d, d}, {4 * d}, {d, 4 * d}, {d}};
    for (const std::vector<int64_t>& s : shapes) {
      const int64_t size = s.size() == 1 ? s[0] : s[0] * s[1];
      if (s.size() == 1) {
        if (!no_decay.empty() && no_decay.back().end == n) {
          no_decay.back().end += size;
        } else {
          no_decay.push_back({n, n + size});
        }
      }
      n += size;
    }
  }
};

// UpdateState over one block with the given optimizer kind, with and without the no-decay runs.
void BM_UpdateStateDecayGroups(benchmark::State& state) {
  const Gpt2Block block;
  AnyOptimizer optimizer{.kind = static_cast<OptimizerKind>(state.range(0))};
  optimizer.adamw().weight_decay = 0.1f;
  optimizer.adamw().decoupled_weight_decay = true;
  const bool groups = state.range(1) != 0;
  const auto b = Buffers::Make(block.n, DType::kBF16);
  if (!b) return state.SkipWithError("allocation failed");
  const std::vector<StateSpec> layout = StateLayout(optimizer, block.shapes);
  std::vector<AlignedBuffer> sections;
  std::vector<std::span<std::byte>> views;
  for (const StateSpec& spec : layout) {
    StatusOr<AlignedBuffer> buf = AlignedBuffer::Allocate(spec.size_bytes());
    if (!buf.ok()) return state.SkipWithError("allocation failed");
    sections.push_back(std::move(buf).value());
    views.emplace_back(static_cast<std::byte*>(sections.back().data()), spec.size_bytes());
    InitializeState(spec, views.back());
  }
  const std::span<const ElemRange> no_decay =
      groups ? std::span<const ElemRange>(block.no_decay) : std::span<const ElemRange>();
  tbb::task_arena arena(static_cast<int>(state.range(2)));
  int64_t t = 0;
  for (auto _ : state) {
    Status s;
    arena.execute([&] {
      s = UpdateState(optimizer, {.step = ++t, .grad_scale = 0.5f}, block.shapes, b->span(b->p),
                      views, GradView{b->grad.data(), b->grad_dtype},
                      CopyOut{b->out.data(), DType::kBF16}, no_decay);
    });
    if (!s.ok()) return state.SkipWithError(s.ToString().c_str());
  }
  state.SetItemsProcessed(state.iterations() * block.n);
  state.counters["runs"] = static_cast<double>(groups ? DecayRuns(no_decay, block.n).size() : 1);
  state.counters["params_per_second"] = benchmark::Counter(
      static_cast<double>(state.iterations() * block.n), benchmark::Counter::kIsRate);
}

// One thread and all threads (oneTBB's default concurrency).
std::vector<int64_t> ThreadCounts() {
  std::vector<int64_t> t = {1};
  const int all = tbb::info::default_concurrency();
  if (all > 1) t.push_back(all);
  return t;
}

void Register() {
  constexpr int64_t k10M = 10'000'000, k100M = 100'000'000, k500M = 500'000'000;
  const auto f32 = static_cast<int64_t>(DType::kF32), f16 = static_cast<int64_t>(DType::kF16),
             bf16 = static_cast<int64_t>(DType::kBF16);
  const std::vector<int64_t> threads = ThreadCounts();
  // 10M: a time budget; bigger sizes: fixed iterations (one 500M step moves 14 GB).
  auto sized = [](benchmark::internal::Benchmark* b, int64_t params) {
    b->UseRealTime()->Unit(benchmark::kMillisecond)->ReportAggregatesOnly(true);
    if (params <= k10M) {
      b->MinTime(0.3);
    } else {
      b->Iterations(params >= k500M ? 1 : 3);
    }
    return b;
  };
  const internal::KernelTable& best = internal::BestKernelTable();
  for (const internal::KernelTable* kernels : internal::SupportedKernelTables()) {
    const bool is_best = kernels == &best;
    struct Case {
      int64_t params;
      std::vector<int64_t> grads;
    };
    std::vector<Case> cases = {{k10M, {f32, f16, bf16}}};
    cases.push_back({k100M, is_best ? std::vector<int64_t>{f32, f16, bf16} : std::vector{bf16}});
    if (is_best) cases.push_back({k500M, {bf16}});
    for (const Case& c : cases) {
      const std::string isa = kernels->name;
      sized(benchmark::RegisterBenchmark(
                ("BM_AdamW/" + isa).c_str(),
                [kernels](benchmark::State& state) { RunAdamW(state, *kernels); })
                ->ArgNames({"params", "grad", "threads"})
                ->ArgsProduct({{c.params}, c.grads, threads}),
            c.params);
      sized(benchmark::RegisterBenchmark(
                ("BM_AdamWTraffic/" + isa).c_str(),
                [kernels](benchmark::State& state) { RunAdamWTraffic(state, *kernels); })
                ->ArgNames({"params", "grad", "threads"})
                ->ArgsProduct({{c.params}, c.grads, threads}),
            c.params);
    }
    // fp16 against bf16, in the gradient and in the copy-out.
    const std::string_view isa = kernels->name;
    for (int64_t params : {k10M, k100M}) {
      if (params == k100M && isa == "generic") continue;
      sized(benchmark::RegisterBenchmark(
                ("BM_AdamWCopyOut/" + std::string(isa)).c_str(),
                [kernels](benchmark::State& state) { RunAdamWCopyOut(state, *kernels); })
                ->ArgNames({"params", "grad", "out", "threads"})
                ->ArgsProduct({{params}, {bf16, f16}, {bf16, f16}, threads}),
            params);
    }
  }
  for (const internal::KernelTable* kernels : internal::SupportedKernelTables()) {
    sized(benchmark::RegisterBenchmark(
              (std::string("BM_Adafactor/") + kernels->name).c_str(),
              [kernels](benchmark::State& state) { RunAdafactor(state, *kernels); })
              ->ArgNames({"params", "grad", "threads", "factored"})
              ->ArgsProduct({{k10M / 4096 * 4096}, {bf16}, threads, {0, 1}}),
          k10M);
  }
  // 8-bit AdamW next to its traffic kernel: every variant at 10M (bf16; the best also
  // fp32 and fp16 gradients) and the best at 100M, bf16.
  for (const internal::KernelTable* kernels : internal::SupportedKernelTables()) {
    const bool is_best = kernels == &best;
    std::vector<std::pair<int64_t, std::vector<int64_t>>> cases = {
        {k10M, is_best ? std::vector<int64_t>{f32, f16, bf16} : std::vector{bf16}}};
    if (is_best) cases.push_back({k100M, {bf16}});
    for (const auto& [params, grads] : cases) {
      const std::string isa = kernels->name;
      sized(benchmark::RegisterBenchmark(
                ("BM_AdamW8bit/" + isa).c_str(),
                [kernels](benchmark::State& state) { RunAdamW8bit(state, *kernels); })
                ->ArgNames({"params", "grad", "threads"})
                ->ArgsProduct({{params}, grads, threads}),
            params);
      sized(benchmark::RegisterBenchmark(
                ("BM_AdamW8bitTraffic/" + isa).c_str(),
                [kernels](benchmark::State& state) { RunAdamW8bitTraffic(state, *kernels); })
                ->ArgNames({"params", "grad", "threads"})
                ->ArgsProduct({{params}, grads, threads}),
            params);
    }
  }
  // The scalar reference is single-threaded: compare with the best variant at 1 thread.
  sized(benchmark::RegisterBenchmark("BM_AdamWReference", BM_AdamWReference)
            ->ArgNames({"params", "grad"})
            ->Args({k10M, bf16}),
        k10M);
  for (auto [name, fn] : {std::pair{"BM_Adagrad", &BM_Adagrad}, std::pair{"BM_Lion", &BM_Lion},
                          std::pair{"BM_Sgd", &BM_Sgd}}) {
    sized(benchmark::RegisterBenchmark(name, fn)
              ->ArgNames({"params", "grad", "threads"})
              ->ArgsProduct({{k100M}, {bf16}, threads}),
          k100M);
  }
  sized(benchmark::RegisterBenchmark("BM_UpdateStateDecayGroups", BM_UpdateStateDecayGroups)
            ->ArgNames({"kind", "groups", "threads"})
            ->ArgsProduct({{static_cast<int64_t>(OptimizerKind::kAdamW),
                            static_cast<int64_t>(OptimizerKind::kAdamW8bit)},
                           {0, 1},
                           threads}),
        k10M);
  sized(benchmark::RegisterBenchmark("BM_Triad", BM_Triad)
            ->ArgNames({"params", "threads"})
            ->ArgsProduct({{k100M}, threads}),
        k100M);
}

}  // namespace
}  // namespace strata::cpu_optim

int main(int argc, char** argv) {
  using strata::cpu_optim::ActiveKernelName;
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  std::string variants;
  for (const auto* t : strata::cpu_optim::internal::SupportedKernelTables()) {
    variants += variants.empty() ? t->name : std::string(",") + t->name;
  }
  benchmark::AddCustomContext("cpu_optim_kernel", std::string(ActiveKernelName()));
  benchmark::AddCustomContext("cpu_optim_supported_kernels", variants);
  benchmark::AddCustomContext("tbb_version",
                              fmt::format("{}.{} (runtime interface {})", TBB_VERSION_MAJOR,
                                          TBB_VERSION_MINOR, TBB_runtime_interface_version()));
  benchmark::AddCustomContext("tbb_default_concurrency",
                              std::to_string(tbb::info::default_concurrency()));
  benchmark::AddCustomContext("hardware_threads",
                              std::to_string(std::thread::hardware_concurrency()));
#if defined(__VERSION__)
  benchmark::AddCustomContext("compiler", __VERSION__);
#endif
#if defined(NDEBUG)
  benchmark::AddCustomContext("assertions", "off (NDEBUG)");
#else
  benchmark::AddCustomContext("assertions", "on: not a release build");
#endif
  strata::cpu_optim::Register();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

#include "models/lora.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>

#include "base/dtype.h"
#include "models/init.h"
#include "models/ops/matmul.h"
#include "models/ops/parallel.h"

namespace strata::models {

StatusOr<std::vector<std::string>> LoraTargetNames(std::span<const std::string> targets,
                                                   std::span<const LoraModule> modules,
                                                   std::string_view family_name,
                                                   std::string_view what) {
  std::vector<std::string> names;  // the family's, each once, in its module order
  for (const LoraModule& m : modules) {
    if (std::find(names.begin(), names.end(), m.name) == names.end()) names.push_back(m.name);
  }
  std::vector<std::string> selected_names;
  for (const std::string& t : targets) {
    const auto selects = [&](const LoraModule& m) {
      return m.name == t || m.path == t ||
             (m.path.size() > t.size() && m.path.ends_with(t) &&
              m.path[m.path.size() - t.size() - 1] == '.');
    };
    bool any = false;
    for (const LoraModule& m : modules) {
      if (!selects(m)) continue;
      any = true;
      for (const LoraModule& other : modules) {
        if (other.name == m.name && !selects(other)) {
          return InvalidArgumentError(fmt::format(
              "{}: '{}' selects {} but not {}; Strata adapts every module named {} or none", what,
              t, m.path, other.path, m.name));
        }
      }
      if (std::find(selected_names.begin(), selected_names.end(), m.name) == selected_names.end()) {
        selected_names.push_back(m.name);
      }
    }
    if (!any) {
      return InvalidArgumentError(fmt::format("{}: {} has no module '{}'; its modules are {}", what,
                                              family_name, t, fmt::join(names, ",")));
    }
  }
  return selected_names;
}

StatusOr<LoraLayout> MakeLoraLayout(const LoraConfig& config, std::span<const LoraModule> modules,
                                    std::string_view family_name) {
  std::string names;
  for (const LoraModule& m : modules) {
    if (names.find(m.name) == std::string::npos) names += (names.empty() ? "" : ",") + m.name;
  }
  if (config.rank < 1) {
    return InvalidArgumentError(fmt::format("--lora-rank {} must be at least 1", config.rank));
  }
  if (!(config.dropout >= 0 && config.dropout < 1)) {
    return InvalidArgumentError(fmt::format("--lora-dropout {} is not in [0, 1)", config.dropout));
  }
  // As PEFT's adapter_config.json and strata.lora.alpha: a negative alpha flips the adapters'
  // sign and 0 switches them off, neither what a user asking for LoRA means.
  if (!(config.alpha > 0 && config.alpha <= std::numeric_limits<float>::max())) {
    return InvalidArgumentError(fmt::format(
        "--lora-alpha {} is not a positive number that fits fp32 (the adapters' output is "
        "scaled by alpha / rank)",
        config.alpha));
  }
  if (config.targets.empty()) {
    return InvalidArgumentError(
        fmt::format("--lora-targets is empty; {} modules are {}", family_name, names));
  }
  STRATA_ASSIGN_OR_RETURN(const std::vector<std::string> targets,
                          LoraTargetNames(config.targets, modules, family_name, "--lora-targets"));
  LoraLayout l;
  l.rank = config.rank;
  l.scaling = static_cast<float>(config.alpha / config.rank);
  l.dropout = static_cast<float>(config.dropout);
  for (const LoraModule& m : modules) {
    if (std::find(targets.begin(), targets.end(), m.name) == targets.end()) {
      continue;
    }
    LoraSite s{m, l.layer_params, l.layer_params + config.rank * m.in};
    l.layer_params = s.b_offset + m.out * config.rank;
    l.sites.push_back(s);
  }
  return l;
}

void InitLoraLayer(const LoraLayout& layout, int layer, uint64_t seed, float* params) {
  // Per layer its own stream, tagged apart from the base model's streams.
  std::mt19937_64 rng(init::SplitMix64(seed ^ init::SplitMix64(0x4C6F5241ull + layer)));
  for (const LoraSite& s : layout.sites) {
    const double bound = 1.0 / std::sqrt(static_cast<double>(s.module.in));
    for (int64_t i = 0; i < layout.rank * s.module.in; ++i) {
      // 53-bit uniform in [0, 1), mapped to [-bound, bound).
      const double u = static_cast<double>(rng() >> 11) * 0x1.0p-53;
      params[s.a_offset + i] = static_cast<float>((2 * u - 1) * bound);
    }
    std::fill_n(params + s.b_offset, s.module.out * layout.rank, 0.0f);
  }
}

void MergeLoraLayer(const LoraLayout& layout, const float* adapters, float* base) {
  for (const LoraSite& s : layout.sites) {
    const int64_t in = s.module.in, r = layout.rank;
    for (int64_t o = 0; o < s.module.out; ++o) {
      for (int64_t i = 0; i < in; ++i) {
        double ba = 0;  // in double, rounded to fp32 once with the weight
        for (int64_t k = 0; k < r; ++k) {
          ba += static_cast<double>(adapters[s.b_offset + o * r + k]) *
                adapters[s.a_offset + k * in + i];
        }
        // W[col + o][i] (out, in) or W[i][col + o] (in, product_out).
        float& w = base[s.module.weight_offset + (s.module.in_out
                                                      ? i * s.module.product_out + s.module.col + o
                                                      : (s.module.col + o) * in + i)];
        w = static_cast<float>(w + layout.scaling * ba);
      }
    }
  }
}

uint64_t LoraDropoutStream(uint64_t seed, int layer, int site) {
  return init::SplitMix64(seed +
                          0x9E3779B97F4A7C15ull * (static_cast<uint64_t>(layer) * 4096 + site + 1));
}

float LoraDropoutUniform(uint64_t seed, int layer, int site, uint64_t index) {
  return LoraStreamUniform(LoraDropoutStream(seed, layer, site), index);
}

double LoraKeepScale(float p) { return 1.0 / (1.0 - static_cast<double>(p)); }

template <typename S>
LoraScratch<S> CarveLoraScratch(const LoraLayout& l, int64_t rows, void* base) {
  int64_t in = 0, out = 0;
  for (const LoraSite& s : l.sites) {
    in = std::max(in, s.module.in);
    out = std::max(out, s.module.out);
  }
  ops::Carver k(base);
  LoraScratch<S> sc;
  sc.xd = k.Take<S>(rows * in);
  sc.u = k.Take<S>(rows * l.rank);
  sc.v = k.Take<S>(rows * out);
  sc.g = k.Take<S>(rows * l.rank);
  sc.t = k.Take<S>(rows * in);
  sc.family = k.Take<S>(rows * in);
  sc.size_bytes = k.size_bytes();
  return sc;
}

namespace {

using ops::WeightLayout;

// x_d = dropout(x) into xd (rows, in), or x itself without dropout.
template <typename S>
const S* Dropout(const LoraLayerArgs<S>& a, int site, const S* x, int64_t rows, int64_t in, S* xd) {
  const float p = a.layout->dropout;
  if (p == 0 || a.dropout_seed == 0) return x;
  using F = ComputeType<S>;
  const F keep_scale = static_cast<F>(LoraKeepScale(p));
  const uint64_t stream = LoraDropoutStream(a.dropout_seed, a.layer, site);
  ops::ParallelRows(rows, in, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t j = 0; j < in; ++j) {
        const uint64_t i = static_cast<uint64_t>(r * in + j);
        const bool keep = LoraStreamUniform(stream, i) >= p;
        xd[i] = keep ? FromFloat<S>(ToFloat(x[i]) * keep_scale) : FromFloat<S>(F{0});
      }
    }
  });
  return xd;
}

// Site k's input after dropout (sc.xd, or x itself) and u = S(x_d A^T) into sc.u: what the
// forward computes first and the backward recomputes.
template <typename S>
const S* SiteInput(const LoraLayerArgs<S>& a, int k, const S* x, int64_t rows,
                   const LoraScratch<S>& sc) {
  const LoraSite& site = a.layout->sites[k];
  const S* xd = Dropout(a, k, x, rows, site.module.in, sc.xd);
  ops::MatmulForward<S>(xd, a.adapters + site.a_offset, WeightLayout::kOutIn, nullptr, sc.u, rows,
                        site.module.in, a.layout->rank);
  return xd;
}

}  // namespace

template <typename S>
int64_t LoraScratchBytes(const LoraLayout& layout, int64_t rows) {
  return CarveLoraScratch<S>(layout, rows, nullptr).size_bytes;
}

template <typename S>
S* LoraGradBuffer(const LoraLayerArgs<S>& a, int64_t rows) {
  return CarveLoraScratch<S>(*a.layout, rows, a.scratch).family;
}

bool LoraTargets(const LoraLayout& layout, int product) {
  return std::any_of(layout.sites.begin(), layout.sites.end(),
                     [&](const LoraSite& s) { return s.module.product == product; });
}

template <typename S>
void LoraForward(const LoraLayerArgs<S>& a, int product, const S* x, int64_t rows, S* y,
                 int64_t ld) {
  if (!a.active()) return;
  using F = ComputeType<S>;
  const LoraLayout& l = *a.layout;
  const LoraScratch<S> sc = CarveLoraScratch<S>(l, rows, a.scratch);
  const F s = static_cast<F>(l.scaling);
  for (size_t k = 0; k < l.sites.size(); ++k) {
    const LoraSite& site = l.sites[k];
    const LoraModule& m = site.module;
    if (m.product != product) continue;
    SiteInput(a, static_cast<int>(k), x, rows, sc);
    ops::MatmulForward<S>(sc.u, a.adapters + site.b_offset, WeightLayout::kOutIn, nullptr, sc.v,
                          rows, l.rank, m.out);
    ops::ParallelRows(rows, m.out, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        S* yr = y + r * ld + m.col;
        const S* vr = sc.v + r * m.out;
        for (int64_t c = 0; c < m.out; ++c)
          yr[c] = FromFloat<S>(ToFloat(yr[c]) + s * ToFloat(vr[c]));
      }
    });
  }
}

template <typename S>
void LoraBackward(const LoraLayerArgs<S>& a, int product, const S* x, const S* dy, int64_t rows,
                  int64_t ld, S* dx) {
  if (!a.active()) return;
  using F = ComputeType<S>;
  const LoraLayout& l = *a.layout;
  const LoraScratch<S> sc = CarveLoraScratch<S>(l, rows, a.scratch);
  const F s = static_cast<F>(l.scaling);
  const float p = l.dropout;
  const bool dropout = p > 0 && a.dropout_seed != 0;
  const F keep_scale = static_cast<F>(dropout ? LoraKeepScale(p) : 1.0);
  for (size_t k = 0; k < l.sites.size(); ++k) {
    const LoraSite& site = l.sites[k];
    const LoraModule& m = site.module;
    if (m.product != product) continue;
    const S* xd = SiteInput(a, static_cast<int>(k), x, rows, sc);
    const uint64_t stream = LoraDropoutStream(a.dropout_seed, a.layer, static_cast<int>(k));
    // dys = S(s dy[:, cols]) into v.
    ops::ParallelRows(rows, m.out, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const S* dyr = dy + r * ld + m.col;
        S* vr = sc.v + r * m.out;
        for (int64_t c = 0; c < m.out; ++c) vr[c] = FromFloat<S>(s * ToFloat(dyr[c]));
      }
    });
    // v = u B^T: g = S(dys B) (rows, r) and dB = S(dys^T u) (out, r).
    ops::MatmulBackward<S>(sc.u, a.adapters + site.b_offset, WeightLayout::kOutIn, sc.v, sc.g,
                           a.dadapters + site.b_offset, nullptr, rows, l.rank, m.out);
    // u = x_d A^T: t = S(g A) (rows, in) and dA = S(g^T x_d) (r, in).
    ops::MatmulBackward<S>(xd, a.adapters + site.a_offset, WeightLayout::kOutIn, sc.g, sc.t,
                           a.dadapters + site.a_offset, nullptr, rows, m.in, l.rank);
    // dx += dropout'(t): the kept elements scaled by 1 / (1 - p), the dropped ones zero.
    ops::ParallelRows(rows, m.in, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t j = 0; j < m.in; ++j) {
          const uint64_t i = static_cast<uint64_t>(r * m.in + j);
          const bool keep = !dropout || LoraStreamUniform(stream, i) >= p;
          if (keep) dx[i] = FromFloat<S>(ToFloat(dx[i]) + keep_scale * ToFloat(sc.t[i]));
        }
      }
    });
  }
}

#define STRATA_INSTANTIATE_LORA(S)                                                            \
  template int64_t LoraScratchBytes<S>(const LoraLayout&, int64_t);                           \
  template LoraScratch<S> CarveLoraScratch<S>(const LoraLayout&, int64_t, void*);             \
  template S* LoraGradBuffer<S>(const LoraLayerArgs<S>&, int64_t);                            \
  template void LoraForward<S>(const LoraLayerArgs<S>&, int, const S*, int64_t, S*, int64_t); \
  template void LoraBackward<S>(const LoraLayerArgs<S>&, int, const S*, const S*, int64_t,    \
                                int64_t, S*);
STRATA_INSTANTIATE_LORA(float)
STRATA_INSTANTIATE_LORA(double)
STRATA_INSTANTIATE_LORA(Bf16)
STRATA_INSTANTIATE_LORA(Fp16)
#undef STRATA_INSTANTIATE_LORA

}  // namespace strata::models

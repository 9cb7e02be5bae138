#include "tools/sampling.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <unordered_set>

#include "base/untrusted_text.h"

namespace strata::tools {

std::string SamplingSettings::Describe() const {
  if (greedy) {
    return repetition_penalty != 1.0
               ? fmt::format("greedy, repetition penalty {:g}", repetition_penalty)
               : std::string("greedy");
  }
  std::string s = fmt::format("temperature {:g}, top-k {}, top-p {:g}", temperature, top_k, top_p);
  if (repetition_penalty != 1.0) s += fmt::format(", repetition penalty {:g}", repetition_penalty);
  return s;
}

StatusOr<GenerationConfigSampling> ParseGenerationConfigSampling(std::string_view text,
                                                                 const std::string& path) {
  auto parsed = ParseJsonBounded(text);
  if (!parsed.ok()) {
    return InvalidArgumentError(fmt::format("{}: {}", path, parsed.status().message()));
  }
  return ParseGenerationConfigSampling(*parsed, path);
}

StatusOr<GenerationConfigSampling> ParseGenerationConfigSampling(const nlohmann::json& j,
                                                                 const std::string& path) {
  if (!j.is_object()) return InvalidArgumentError(fmt::format("{}: not a JSON object", path));
  auto bad = [&](std::string_view key, std::string_view what) {
    return InvalidArgumentError(fmt::format("{}: {} {}", path, key, what));
  };
  // A number (or null: the default) within [lo, hi]; `open_lo`: lo itself excluded.
  auto number = [&](const char* key, double fallback, double lo, double hi,
                    bool open_lo) -> StatusOr<double> {
    const auto it = j.find(key);
    if (it == j.end() || it->is_null()) return fallback;
    if (!it->is_number()) {
      return bad(key, fmt::format("is {}, not a number", JsonExcerpt(*it, 40)));
    }
    const double v = it->get<double>();
    if (!std::isfinite(v) || v < lo || (open_lo && v == lo) || v > hi) {
      return bad(key, fmt::format("= {} is outside {}{:g}, {:g}]", JsonExcerpt(*it, 40),
                                  open_lo ? "(" : "[", lo, hi));
    }
    return v;
  };
  GenerationConfigSampling out;
  SamplingSettings& s = out.settings;
  bool do_sample = false;
  if (const auto it = j.find("do_sample"); it != j.end() && !it->is_null()) {
    if (!it->is_boolean()) return bad("do_sample", "is not true or false");
    do_sample = it->get<bool>();
  }
  s.greedy = !do_sample;
  STRATA_ASSIGN_OR_RETURN(s.temperature, number("temperature", 1.0, 0, 1e6, false));
  if (do_sample && s.temperature == 0) {
    return bad("temperature", "= 0 with do_sample true: sampling needs a positive temperature");
  }
  if (s.greedy) s.temperature = 1.0;  // not used
  STRATA_ASSIGN_OR_RETURN(const double top_k, number("top_k", 50, 0, 1e9, false));
  if (top_k != std::floor(top_k)) return bad("top_k", "is not a whole number");
  s.top_k = static_cast<int>(top_k);
  STRATA_ASSIGN_OR_RETURN(s.top_p, number("top_p", 1.0, 0, 1, false));
  STRATA_ASSIGN_OR_RETURN(s.repetition_penalty,
                          number("repetition_penalty", 1.0, 0, 1e6, /*open_lo=*/true));
  // What generate() would do beyond these: said, not applied.
  auto note_if = [&](const char* key, auto applies, std::string_view what) {
    const auto it = j.find(key);
    if (it == j.end() || it->is_null() || !it->is_number() || !applies(it->get<double>())) return;
    out.notes.push_back(
        fmt::format("{}: {} {} is not applied ({})", path, key, JsonExcerpt(*it, 40), what));
  };
  note_if(
      "num_beams", [](double v) { return v > 1; }, "strata generate does not beam-search");
  note_if(
      "min_p", [](double v) { return v > 0; }, "no min-p warper");
  note_if(
      "typical_p", [](double v) { return v < 1; }, "no typical-p warper");
  note_if(
      "no_repeat_ngram_size", [](double v) { return v > 0; }, "no n-gram blocking");
  return out;
}

std::vector<TokenProbability> NextTokenDistribution(std::span<const float> logits,
                                                    const SamplingSettings& settings,
                                                    int64_t vocab_limit,
                                                    std::span<const int32_t> previous) {
  const int64_t n = std::min<int64_t>(static_cast<int64_t>(logits.size()), vocab_limit);
  std::vector<double> score(logits.begin(), logits.begin() + n);
  // A NaN logit (a diverged model) is never drawn and keeps the sort a strict weak order.
  for (double& x : score) {
    if (std::isnan(x)) x = -std::numeric_limits<double>::infinity();
  }
  if (settings.repetition_penalty != 1.0) {
    std::unordered_set<int32_t> seen(previous.begin(), previous.end());
    for (const int32_t id : seen) {
      if (id < 0 || id >= n) continue;
      double& x = score[static_cast<size_t>(id)];
      x = x < 0 ? x * settings.repetition_penalty : x / settings.repetition_penalty;
    }
  }
  std::vector<int32_t> order(static_cast<size_t>(n));
  for (int64_t v = 0; v < n; ++v) order[static_cast<size_t>(v)] = static_cast<int32_t>(v);
  // Descending score, ties in id order (torch.argmax takes the first of equal maxima).
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return score[a] > score[b]; });
  if (order.empty()) return {};
  // Greedy, or nothing finite to weigh: the most likely token.
  if (settings.greedy || !std::isfinite(score[order[0]])) return {{order[0], 1.0}};
  for (double& x : score) x /= settings.temperature;
  size_t kept = order.size();
  if (settings.top_k > 0 && static_cast<size_t>(settings.top_k) < kept) {
    const double kth = score[order[static_cast<size_t>(settings.top_k) - 1]];
    kept = static_cast<size_t>(settings.top_k);
    while (kept < order.size() && score[order[kept]] >= kth) ++kept;  // ties with the k-th stay
  }
  std::vector<TokenProbability> out(kept);
  const double top = score[order[0]];
  double z = 0;
  for (size_t j = 0; j < kept; ++j) {
    out[j].id = order[j];
    z += out[j].p = std::exp(score[order[j]] - top);
  }
  for (TokenProbability& t : out) t.p /= z;
  if (settings.top_p < 1.0) {
    // TopPLogitsWarper: a token stays while the tokens more likely than it hold less than top_p.
    double before = 0;
    size_t j = 0;
    while (j < out.size() && (j == 0 || before < settings.top_p)) before += out[j++].p;
    out.resize(j);
    for (TokenProbability& t : out) t.p /= before;
  }
  return out;
}

int32_t SampleNextToken(std::span<const float> logits, const SamplingSettings& settings,
                        int64_t vocab_limit, std::span<const int32_t> previous,
                        std::mt19937_64& rng) {
  const std::vector<TokenProbability> d =
      NextTokenDistribution(logits, settings, vocab_limit, previous);
  double r = std::uniform_real_distribution<double>(0.0, 1.0)(rng);
  size_t j = 0;
  while (j + 1 < d.size() && r >= d[j].p) r -= d[j++].p;
  return d.empty() ? 0 : d[j].id;
}

}  // namespace strata::tools

// The next token of `strata generate`, as transformers' generate() picks it: its logits
// processors and warpers in generate()'s order over one position's logits, then greedy or a
// draw. Sources: transformers' generation/logits_process.py (RepetitionPenaltyLogitsProcessor,
// TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper) and generation/configuration_utils
// (GenerationConfig's keys and defaults).
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "base/status.h"

namespace strata::tools {

struct SamplingSettings {
  bool greedy = false;       // the most likely token (lowest id among equal logits)
  double temperature = 0.8;  // > 0 when sampling
  int top_k = 40;            // 0: every token
  double top_p = 1.0;        // in (0, 1]; 1: every token
  // RepetitionPenaltyLogitsProcessor: every logit of a token already in the sequence divided by
  // it (positive) or multiplied by it (negative); 1: none. > 0.
  double repetition_penalty = 1.0;
  std::string Describe() const;  // "greedy" or "temperature 0.8, top-k 40, top-p 1"
};

// What generation_config.json says of sampling (transformers' GenerationConfig: do_sample false,
// temperature 1, top_k 50, top_p 1, repetition_penalty 1 where a key is absent or null), and the
// keys it sets that `strata generate` does not apply (num_beams > 1, min_p, typical_p < 1,
// no_repeat_ngram_size > 0: beam search and the other warpers), one note each. `path` names the
// file in errors: kInvalidArgument naming the key for a value of the wrong type or out of range,
// or for text that is not a JSON object. Pure; thread-safe.
struct GenerationConfigSampling {
  SamplingSettings settings;
  std::vector<std::string> notes;
};
StatusOr<GenerationConfigSampling> ParseGenerationConfigSampling(std::string_view text,
                                                                 const std::string& path);
// The same from the file's JSON value, parsed already (`strata generate` reads the file once for
// its sampling and its eos_token_id).
StatusOr<GenerationConfigSampling> ParseGenerationConfigSampling(const nlohmann::json& j,
                                                                 const std::string& path);

// The probabilities of the tokens the settings keep, in descending order of probability (ties in
// id order), summing to 1 (greedy: the one most likely token with 1). `logits` is one position's
// (the model's vocabulary); ids at or past `vocab_limit` (the tokenizer's vocabulary: padded
// embedding rows it cannot decode) are never kept; `previous` is the sequence so far (prompt and
// generated, for the repetition penalty). Order, as generate() applies them: the repetition
// penalty, then temperature, top-k (every token whose logit is at least the k-th largest: ties
// with it stay), top-p (the most likely tokens until their probability reaches top_p, at least
// one), then a softmax over what is left. In double precision. Pure; thread-safe.
struct TokenProbability {
  int32_t id = 0;
  double p = 0;
};
std::vector<TokenProbability> NextTokenDistribution(std::span<const float> logits,
                                                    const SamplingSettings& settings,
                                                    int64_t vocab_limit,
                                                    std::span<const int32_t> previous);

// One draw from NextTokenDistribution with `rng` (one uniform double per call, also greedy): a
// token id below min(logits.size(), vocab_limit). Advances `rng`: not thread-safe for a shared
// rng, thread-safe otherwise.
int32_t SampleNextToken(std::span<const float> logits, const SamplingSettings& settings,
                        int64_t vocab_limit, std::span<const int32_t> previous,
                        std::mt19937_64& rng);

}  // namespace strata::tools

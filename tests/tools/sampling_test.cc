// strata generate's next-token choice (tools/sampling.h) against the distribution transformers'
// processors and warpers define (generation/logits_process.py), computed here in long double
// from their formulas: RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper
// (scores < the k-th largest removed: ties with it stay), TopPLogitsWarper (ascending cumulative
// probability <= 1 - top_p removed, the most likely kept), then softmax.
#include "tools/sampling.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>

namespace strata::tools {
namespace {

using ::testing::HasSubstr;

// The reference: ids and probabilities of the kept tokens, from the formulas above.
std::map<int32_t, long double> Reference(const std::vector<float>& logits, SamplingSettings s,
                                         int64_t vocab_limit, const std::vector<int32_t>& seen) {
  const size_t n = std::min<size_t>(logits.size(), static_cast<size_t>(vocab_limit));
  std::vector<long double> x(logits.begin(), logits.begin() + static_cast<std::ptrdiff_t>(n));
  for (size_t v = 0; v < n; ++v) {
    if (std::find(seen.begin(), seen.end(), static_cast<int32_t>(v)) == seen.end()) continue;
    x[v] = x[v] < 0 ? x[v] * s.repetition_penalty : x[v] / s.repetition_penalty;
  }
  std::map<int32_t, long double> out;
  if (s.greedy) {
    out[static_cast<int32_t>(std::max_element(x.begin(), x.end()) - x.begin())] = 1;
    return out;
  }
  for (auto& v : x) v /= s.temperature;
  std::vector<bool> keep(n, true);
  if (s.top_k > 0 && static_cast<size_t>(s.top_k) < n) {
    std::vector<long double> sorted = x;
    std::sort(sorted.rbegin(), sorted.rend());
    const long double kth = sorted[static_cast<size_t>(s.top_k) - 1];
    for (size_t v = 0; v < n; ++v) keep[v] = x[v] >= kth;
  }
  auto softmax = [&](const std::vector<bool>& k) {
    std::vector<long double> p(n, 0);
    long double z = 0;
    for (size_t v = 0; v < n; ++v) {
      if (k[v]) z += p[v] = std::exp(x[v]);
    }
    for (auto& q : p) q /= z;
    return p;
  };
  std::vector<long double> p = softmax(keep);
  if (s.top_p < 1) {
    std::vector<size_t> ascending(n);
    std::iota(ascending.begin(), ascending.end(), 0);
    // Ascending probability; among equals the higher id first, so the lower id is more likely
    // kept (descending order with ties in id order, as the engine breaks them).
    std::stable_sort(ascending.begin(), ascending.end(),
                     [&](size_t a, size_t b) { return p[a] < p[b] || (p[a] == p[b] && a > b); });
    long double cumulative = 0;
    for (size_t j = 0; j + 1 < n; ++j) {
      cumulative += p[ascending[j]];
      if (cumulative <= 1 - static_cast<long double>(s.top_p)) keep[ascending[j]] = false;
    }
    p = softmax(keep);
  }
  for (size_t v = 0; v < n; ++v) {
    if (keep[v] && p[v] > 0) out[static_cast<int32_t>(v)] = p[v];
  }
  return out;
}

void ExpectMatches(const std::vector<float>& logits, SamplingSettings s, int64_t vocab_limit,
                   const std::vector<int32_t>& seen) {
  const std::map<int32_t, long double> want = Reference(logits, s, vocab_limit, seen);
  const std::vector<TokenProbability> got = NextTokenDistribution(logits, s, vocab_limit, seen);
  ASSERT_EQ(got.size(), want.size()) << s.Describe();
  double sum = 0;
  for (size_t j = 0; j < got.size(); ++j) {
    ASSERT_TRUE(want.contains(got[j].id)) << "id " << got[j].id << " " << s.Describe();
    // Double against long double over a few exps and one division: a few ulps.
    EXPECT_NEAR(got[j].p, static_cast<double>(want.at(got[j].id)), 1e-14) << got[j].id;
    if (j > 0) EXPECT_GE(got[j - 1].p, got[j].p);  // descending
    sum += got[j].p;
  }
  EXPECT_NEAR(sum, 1.0, 1e-14);
}

const std::vector<float> kLogits = {2.0f, -1.5f, 5.0f, 5.0f, 0.25f, 5.0f, -3.0f, 1.0f, 4.5f, 0.0f};

TEST(Sampling, MatchesTransformersWarpersInTheirOrder) {
  for (const bool greedy : {true, false}) {
    for (const double temperature : {0.3, 1.0, 2.5}) {
      for (const int top_k : {0, 1, 2, 3, 4, 9, 50}) {
        for (const double top_p : {1.0, 0.95, 0.5, 0.1, 0.0}) {
          for (const double penalty : {1.0, 1.3, 0.7}) {
            SamplingSettings s{greedy, temperature, top_k, top_p, penalty};
            ExpectMatches(kLogits, s, 1 << 20, {2, 6, 6, 0});
          }
        }
      }
    }
  }
}

TEST(Sampling, TopKKeepsTheTokensTiedWithTheKth) {
  // Ids 2, 3 and 5 share the largest logit: top-k 2 keeps all three, each 1/3 at any temperature.
  SamplingSettings s{false, 1.0, 2, 1.0, 1.0};
  const std::vector<TokenProbability> d = NextTokenDistribution(kLogits, s, 1 << 20, {});
  ASSERT_EQ(d.size(), 3u);
  EXPECT_EQ(d[0].id, 2);
  EXPECT_EQ(d[1].id, 3);
  EXPECT_EQ(d[2].id, 5);
  for (const TokenProbability& t : d) EXPECT_NEAR(t.p, 1.0 / 3, 1e-15);
  // Greedy takes the lowest id among the most likely, as torch.argmax.
  s.greedy = true;
  std::mt19937_64 rng(1);
  EXPECT_EQ(SampleNextToken(kLogits, s, 1 << 20, {}, rng), 2);
}

TEST(Sampling, IdsPastTheTokenizersVocabularyAreNeverKept) {
  const std::vector<float> padded = {0.0f, 1.0f, 9.0f, 9.5f};  // 2 and 3 beyond a vocabulary of 2
  for (const bool greedy : {true, false}) {
    SamplingSettings s{greedy, 1.0, 0, 1.0, 1.0};
    ExpectMatches(padded, s, 2, {});
    for (const TokenProbability& t : NextTokenDistribution(padded, s, 2, {})) EXPECT_LT(t.id, 2);
  }
}

TEST(Sampling, DrawsFollowTheDistribution) {
  SamplingSettings s{false, 1.5, 5, 0.9, 1.1};
  const std::vector<int32_t> seen = {8};
  const std::vector<TokenProbability> d = NextTokenDistribution(kLogits, s, 1 << 20, seen);
  std::mt19937_64 rng(42);
  std::map<int32_t, int> count;
  constexpr int kDraws = 40000;
  for (int i = 0; i < kDraws; ++i) ++count[SampleNextToken(kLogits, s, 1 << 20, seen, rng)];
  int total = 0;
  for (const TokenProbability& t : d) {
    // Binomial: within 5 standard deviations.
    const double sd = std::sqrt(kDraws * t.p * (1 - t.p));
    EXPECT_NEAR(count[t.id], kDraws * t.p, 5 * sd + 1) << t.id;
    total += count[t.id];
  }
  EXPECT_EQ(total, kDraws);  // nothing outside the kept tokens
}

TEST(Sampling, GenerationConfigKeysAndDefaultsAreTransformers) {
  auto g = ParseGenerationConfigSampling(R"({"eos_token_id": 2})", "g.json");
  ASSERT_TRUE(g.ok()) << g.status().ToString();
  EXPECT_TRUE(g->settings.greedy);  // GenerationConfig's do_sample is false
  g = ParseGenerationConfigSampling(
      R"({"do_sample": true, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
          "repetition_penalty": 1.05, "num_beams": 1, "min_p": null})",
      "g.json");
  ASSERT_TRUE(g.ok()) << g.status().ToString();
  EXPECT_FALSE(g->settings.greedy);
  EXPECT_EQ(g->settings.temperature, 0.7);
  EXPECT_EQ(g->settings.top_k, 20);
  EXPECT_EQ(g->settings.top_p, 0.8);
  EXPECT_EQ(g->settings.repetition_penalty, 1.05);
  EXPECT_TRUE(g->notes.empty());
  g = ParseGenerationConfigSampling(R"({"do_sample": true})", "g.json");
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(g->settings.temperature, 1.0);
  EXPECT_EQ(g->settings.top_k, 50);
  EXPECT_EQ(g->settings.top_p, 1.0);
  // What is not applied is said.
  g = ParseGenerationConfigSampling(R"({"num_beams": 4, "min_p": 0.05, "typical_p": 1.0})",
                                    "g.json");
  ASSERT_TRUE(g.ok());
  ASSERT_EQ(g->notes.size(), 2u);
  EXPECT_THAT(g->notes[0], HasSubstr("g.json: num_beams 4 is not applied"));
  EXPECT_THAT(g->notes[1], HasSubstr("min_p 0.05"));
  // Bad values: one line naming the file and key.
  for (const auto& [text, key] : std::vector<std::pair<std::string, std::string>>{
           {R"({"do_sample": "yes"})", "do_sample"},
           {R"({"temperature": "hot"})", "temperature"},
           {R"({"do_sample": true, "temperature": 0})", "temperature"},
           {R"({"top_k": 2.5})", "top_k"},
           {R"({"top_p": 1.5})", "top_p"},
           {R"({"repetition_penalty": 0})", "repetition_penalty"},
           {"[1]", "not a JSON object"},
           {"{", "g.json"}}) {
    g = ParseGenerationConfigSampling(text, "g.json");
    ASSERT_FALSE(g.ok()) << text;
    EXPECT_THAT(g.status().message(), HasSubstr("g.json")) << text;
    EXPECT_THAT(g.status().message(), HasSubstr(key)) << text;
    EXPECT_EQ(g.status().message().find('\n'), std::string::npos) << text;
  }
}

}  // namespace
}  // namespace strata::tools

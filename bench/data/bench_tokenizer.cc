// Tokenizer encode throughput on tinyshakespeare (1.1 MB of English), single-threaded: a
// Hugging Face byte-level tokenizer.json (GPT-2's pre-tokenization pattern; 2000 BPE merges the
// benchmark learns from the same text, then written as a GPT-2-style file) against a
// SentencePiece BPE model trained on the text with libsentencepiece's trainer (vocabulary 2256,
// about the same). Bytes processed are text bytes, so the rate reads as MB/s of text (Google
// Benchmark prints binary units: "M/s" = MiB/s). Also TokenizeTextFile with the tokenizer.json:
// the file read in 1 MiB blocks and cut at safe points; EncodeWithOffsets with both; and the same
// text as instruction data: its paragraphs as conversations of user and assistant turns (JSON
// lines), tokenized by TokenizeInstructionFile with a ChatML model template (no generation
// blocks: the loss from prefix renders, three renders per assistant turn) and with the built-in
// chatml (generation blocks), against Encode of the text: bytes processed are the contents' bytes,
// so the MB/s of the three compare directly (issue 44: at least 80 % of Encode's rate).
#include <benchmark/benchmark.h>
#include <fmt/format.h>
#include <sentencepiece_trainer.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <unordered_map>
#include <vector>

#include "data/chat_format.h"
#include "data/hf_text.h"
#include "data/hf_tokenizer_json.h"
#include "data/instruction_data.h"
#include "data/tokenizer.h"

namespace strata::data {
namespace {

namespace fs = std::filesystem;
constexpr int kMerges = 2000;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Byte-pair merges (Sennrich et al. 2016) of the pre-tokens' bytes, most frequent pair first;
// the pair counts are updated only for the words a merge changes.
std::vector<std::pair<std::string, std::string>> LearnMerges(
    const std::unordered_map<std::string, int>& pre_tokens, int n) {
  std::vector<std::string> names;
  std::unordered_map<std::string, int> index;
  auto id_of = [&](const std::string& s) {
    auto [it, added] = index.emplace(s, static_cast<int>(names.size()));
    if (added) names.push_back(s);
    return it->second;
  };
  std::vector<std::vector<int>> words;
  std::vector<long> counts;
  for (const auto& [w, c] : pre_tokens) {
    words.emplace_back();
    for (char b : w) words.back().push_back(id_of(std::string(1, b)));
    counts.push_back(c);
  }
  auto key = [](int a, int b) { return (uint64_t(a) << 32) | uint32_t(b); };
  std::map<uint64_t, long> pairs;
  auto count = [&](const std::vector<int>& w, long c) {
    for (size_t i = 0; i + 1 < w.size(); ++i) pairs[key(w[i], w[i + 1])] += c;
  };
  for (size_t k = 0; k < words.size(); ++k) count(words[k], counts[k]);
  std::vector<std::pair<std::string, std::string>> merges;
  while (static_cast<int>(merges.size()) < n) {
    auto best = pairs.begin();
    for (auto it = pairs.begin(); it != pairs.end(); ++it) {
      if (it->second > best->second) best = it;
    }
    if (best == pairs.end() || best->second < 2) break;
    const int a = int(best->first >> 32), b = int(best->first & 0xFFFFFFFF);
    merges.push_back({names[a], names[b]});
    const int merged = id_of(names[a] + names[b]);
    for (size_t k = 0; k < words.size(); ++k) {
      std::vector<int>& w = words[k];
      bool has = false;
      for (size_t i = 0; i + 1 < w.size() && !has; ++i) has = w[i] == a && w[i + 1] == b;
      if (!has) continue;
      count(w, -counts[k]);
      std::vector<int> out;
      for (size_t i = 0; i < w.size(); ++i) {
        const bool hit = i + 1 < w.size() && w[i] == a && w[i + 1] == b;
        out.push_back(hit ? merged : w[i]);
        i += hit ? 1 : 0;
      }
      w = std::move(out);
      count(w, counts[k]);
    }
    std::erase_if(pairs, [](const auto& p) { return p.second == 0; });
  }
  return merges;
}

std::string Chars(std::string_view bytes) {
  std::string out;
  for (unsigned char b : bytes) out += hf::ByteToChar()[b];
  return out;
}

// A GPT-2-style tokenizer.json of merges learned from `text`.
StatusOr<std::string> ByteLevelJson(const std::string& text) {
  STRATA_ASSIGN_OR_RETURN(auto re, hf::Regex::Create(hf::kGpt2Pattern));
  std::vector<hf::Span> spans;
  re->FindAll(text, &spans);
  std::unordered_map<std::string, int> pre_tokens;
  for (const hf::Span& s : spans) ++pre_tokens[text.substr(s.begin, s.end - s.begin)];
  nlohmann::json vocab = nlohmann::json::object(), merges = nlohmann::json::array();
  int next = 0;
  for (int b = 0; b < 256; ++b) vocab[hf::ByteToChar()[b]] = next++;
  for (const auto& [a, b] : LearnMerges(pre_tokens, kMerges)) {
    merges.push_back(Chars(a) + " " + Chars(b));
    vocab[Chars(a + b)] = next++;
  }
  const nlohmann::json byte_level = {{"type", "ByteLevel"},
                                     {"add_prefix_space", false},
                                     {"trim_offsets", true},
                                     {"use_regex", true}};
  nlohmann::json j = {{"version", "1.0"},
                      {"truncation", nullptr},
                      {"padding", nullptr},
                      {"added_tokens",
                       {{{"id", next}, {"content", "<|endoftext|>"}, {"special", true}},
                        {{"id", next + 1}, {"content", "<|im_start|>"}, {"special", true}},
                        {{"id", next + 2}, {"content", "<|im_end|>"}, {"special", true}}}},
                      {"normalizer", nullptr},
                      {"pre_tokenizer", byte_level},
                      {"post_processor", byte_level},
                      {"decoder", byte_level},
                      {"model",
                       {{"type", "BPE"},
                        {"dropout", nullptr},
                        {"unk_token", nullptr},
                        {"fuse_unk", false},
                        {"byte_fallback", false},
                        {"vocab", vocab},
                        {"merges", merges}}}};
  return j.dump();
}

// A ChatML model template as Qwen2.5 writes its own (a generation prompt, no generation blocks).
constexpr std::string_view kModelTemplate =
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' "
    "}}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

// The text and both tokenizers, made once in main; the text's paragraphs as instruction data.
struct Fixture {
  std::string text_path, text;
  std::unique_ptr<Tokenizer> hf, sp;
  std::string jsonl_path;
  int64_t content_bytes = 0;
  ChatFormat model_template, builtin;
};

// Conversations of four paragraphs (user, assistant, user, assistant) as JSON lines; returns the
// contents' bytes.
int64_t WriteInstructionData(const std::string& text, const std::string& path) {
  std::vector<std::string> paragraphs;
  for (size_t at = 0; at < text.size();) {
    size_t end = text.find("\n\n", at);
    if (end == std::string::npos) end = text.size();
    if (end > at) paragraphs.push_back(text.substr(at, end - at));
    at = end + 2;
  }
  std::ofstream out(path, std::ios::binary);
  int64_t bytes = 0;
  for (size_t i = 0; i + 4 <= paragraphs.size(); i += 4) {
    nlohmann::json messages = nlohmann::json::array();
    for (size_t k = 0; k < 4; ++k) {
      messages.push_back(
          {{"role", k % 2 == 0 ? "user" : "assistant"}, {"content", paragraphs[i + k]}});
      bytes += static_cast<int64_t>(paragraphs[i + k].size());
    }
    out << nlohmann::json{{"messages", messages}}.dump() << "\n";
  }
  return bytes;
}
const Fixture* fixture = nullptr;

StatusOr<Fixture> MakeFixture(const fs::path& dir) {
  Fixture f;
  f.text_path = STRATA_TINYSHAKESPEARE;
  f.text = ReadFile(f.text_path);
  if (f.text.empty()) return NotFoundError(fmt::format("cannot read '{}'", f.text_path));
  STRATA_ASSIGN_OR_RETURN(std::string json, ByteLevelJson(f.text));
  std::ofstream((dir / "tokenizer.json").string(), std::ios::binary) << json;
  STRATA_ASSIGN_OR_RETURN(f.hf, Tokenizer::Load((dir / "tokenizer.json").string()));
  const auto status = sentencepiece::SentencePieceTrainer::Train(fmt::format(
      "--input={} --model_prefix={} --vocab_size={} --model_type=bpe --character_coverage=1.0 "
      "--byte_fallback=true --num_threads=1 --minloglevel=2",
      f.text_path, (dir / "sp").string(), 256 + kMerges));
  if (!status.ok()) return InternalError("SentencePiece training failed: " + status.ToString());
  STRATA_ASSIGN_OR_RETURN(f.sp, Tokenizer::Load((dir / "sp.model").string()));
  f.jsonl_path = (dir / "sft.jsonl").string();
  f.content_bytes = WriteInstructionData(f.text, f.jsonl_path);
  std::ofstream((dir / "model.jinja").string(), std::ios::binary) << kModelTemplate;
  const std::string tokenizer = (dir / "tokenizer.json").string();
  STRATA_ASSIGN_OR_RETURN(f.model_template,
                          ResolveChatFormat((dir / "model.jinja").string(), tokenizer));
  STRATA_ASSIGN_OR_RETURN(f.builtin, ResolveChatFormat("chatml", tokenizer));
  return f;
}

void BM_Encode(benchmark::State& state, bool hf) {
  const Tokenizer& t = hf ? *fixture->hf : *fixture->sp;
  size_t tokens = 0;
  for (auto _ : state) {
    auto ids = t.Encode(fixture->text);
    if (!ids.ok()) {
      state.SkipWithError(ids.status().ToString().c_str());
      return;
    }
    tokens = ids->size();
    benchmark::DoNotOptimize(ids->data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * fixture->text.size()));
  state.counters["tokens"] = static_cast<double>(tokens);
  state.counters["vocab"] = t.vocab_size();
}

// EncodeWithOffsets: the ids and each token's bytes of the text (the instruction-data path).
void BM_EncodeWithOffsets(benchmark::State& state, bool hf) {
  const Tokenizer& t = hf ? *fixture->hf : *fixture->sp;
  size_t tokens = 0;
  for (auto _ : state) {
    auto enc = t.EncodeWithOffsets(fixture->text);
    if (!enc.ok()) {
      state.SkipWithError(enc.status().ToString().c_str());
      return;
    }
    tokens = enc->ids.size();
    benchmark::DoNotOptimize(enc->spans.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * fixture->text.size()));
  state.counters["tokens"] = static_cast<double>(tokens);
}

void BM_TokenizeTextFile(benchmark::State& state) {
  for (auto _ : state) {
    auto ids = TokenizeTextFile(*fixture->hf, fixture->text_path);
    if (!ids.ok()) {
      state.SkipWithError(ids.status().ToString().c_str());
      return;
    }
    benchmark::DoNotOptimize(ids->data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * fixture->text.size()));
}

// The text's paragraphs as instruction data, tokenized with a template; bytes: the contents'.
// threads: TokenizeInstructionFile's (1: one core, the same work as Encode's; 0: every core).
void BM_TokenizeInstructionFile(benchmark::State& state, bool model_template, int threads) {
  const ChatFormat& format = model_template ? fixture->model_template : fixture->builtin;
  int64_t tokens = 0, in_loss = 0;
  for (auto _ : state) {
    auto r = TokenizeInstructionFile(*fixture->hf, format, fixture->jsonl_path, threads);
    if (!r.ok()) {
      state.SkipWithError(r.status().ToString().c_str());
      return;
    }
    tokens = static_cast<int64_t>(r->tokens.size());
    in_loss = r->tokens_in_loss;
    benchmark::DoNotOptimize(r->tokens.data());
  }
  state.SetBytesProcessed(state.iterations() * fixture->content_bytes);
  state.counters["tokens"] = static_cast<double>(tokens);
  state.counters["in_loss"] = static_cast<double>(in_loss);
}

BENCHMARK_CAPTURE(BM_Encode, HfByteLevelJson, true)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_TokenizeInstructionFile, ModelTemplatePrefixRenders1Thread, true, 1)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_CAPTURE(BM_TokenizeInstructionFile, BuiltinChatmlGenerationBlocks1Thread, false, 1)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_CAPTURE(BM_TokenizeInstructionFile, ModelTemplatePrefixRendersAllCores, true, 0)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_CAPTURE(BM_Encode, SentencePieceBpe, false)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_EncodeWithOffsets, HfByteLevelJson, true)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_CAPTURE(BM_EncodeWithOffsets, SentencePieceBpe, false)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_TokenizeTextFile)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
}  // namespace strata::data

int main(int argc, char** argv) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / fmt::format("strata_bench_tok_{}", ::getpid());
  fs::create_directories(dir);
  auto f = strata::data::MakeFixture(dir);
  if (!f.ok()) {
    std::fprintf(stderr, "bench_tokenizer: %s\n", f.status().ToString().c_str());
    fs::remove_all(dir);
    return 1;
  }
  strata::data::fixture = &*f;
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::AddCustomContext("text", fmt::format("tinyshakespeare, {} bytes", f->text.size()));
  benchmark::AddCustomContext(
      "tokenizers", fmt::format("tokenizer.json byte-level BPE ({} merges, GPT-2 pattern, PCRE2); "
                                "SentencePiece BPE (vocabulary {})",
                                strata::data::kMerges, f->sp->vocab_size()));
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  fs::remove_all(dir);
  return 0;
}

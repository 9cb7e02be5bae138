// Peak-RSS probe of the streamed Hugging Face import (not a unit test; built, not registered in
// ctest). Two modes, so that the import runs in a fresh process whose peak RSS is its own:
//
//   hf_import_rss create DIR   writes DIR/config.json and DIR/model.safetensors: an fp32 Llama
//                              (vocab 8192, hidden 1024, intermediate 2816, 24 layers, 16 heads,
//                              8 kv heads): 299,943,936 parameters, 1.117 GiB
//                              (1,199,775,744 bytes) of weights
//   hf_import_rss import DIR   opens DIR with HfCheckpoint and reads every block into one reused
//                              buffer of the largest block; prints sizes and a checksum
//
// Measure: /usr/bin/time -v hf_import_rss import DIR  ("Maximum resident set size"); the
// import's own cost is that peak minus the block buffer and the program's baseline.
#include <fmt/format.h>

#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "formats/safetensors.h"
#include "models/hf_checkpoint.h"

namespace {

using strata::Status;
using strata::models::HfCheckpoint;
using strata::models::HfModelConfig;

constexpr char kConfig[] = R"({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
  "vocab_size": 8192, "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 24,
  "num_attention_heads": 16, "num_key_value_heads": 8, "max_position_embeddings": 2048,
  "rms_norm_eps": 1e-05, "tie_word_embeddings": false, "torch_dtype": "float32"})";

int Fail(const Status& s) {
  std::fprintf(stderr, "error: %s\n", s.ToString().c_str());
  return 1;
}

int Create(const std::string& dir) {
  std::filesystem::create_directories(dir);
  {
    std::FILE* f = std::fopen((dir + "/config.json").c_str(), "w");
    if (f == nullptr || std::fputs(kConfig, f) < 0 || std::fclose(f) != 0) {
      std::fprintf(stderr, "error: writing %s/config.json\n", dir.c_str());
      return 1;
    }
  }
  auto config = strata::models::ParseHfConfig(kConfig, "config.json");
  if (!config.ok()) return Fail(config.status());
  std::vector<strata::formats::SafetensorsWriter::TensorSpec> specs;
  for (int b = 0; b < strata::models::HfNumBlocks(*config); ++b) {
    for (const auto& t : strata::models::HfBlockTensors(*config, b)) {
      specs.push_back({t.name, strata::DType::kF32, t.shape});
    }
  }
  auto w = strata::formats::SafetensorsWriter::Create(dir + "/model.safetensors", std::move(specs),
                                                      {{"format", "pt"}});
  if (!w.ok()) return Fail(w.status());
  // Deterministic pseudo-random values, written 4 MiB at a time.
  std::vector<float> piece(1 << 20);
  uint64_t state = 0x9e3779b97f4a7c15ull, total = 0;
  for (int b = 0; b < strata::models::HfNumBlocks(*config); ++b) {
    int64_t left = strata::models::HfBlockNumParams(*config, b);
    while (left > 0) {
      const int64_t n = std::min<int64_t>(left, static_cast<int64_t>(piece.size()));
      for (int64_t i = 0; i < n; ++i) {
        state = state * 6364136223846793005ull + 1442695040888963407ull;
        piece[i] = static_cast<float>(static_cast<int32_t>(state >> 32)) * 1e-11f;
      }
      Status s = w->Append(std::as_bytes(std::span(piece.data(), static_cast<size_t>(n))));
      if (!s.ok()) return Fail(s);
      left -= n;
      total += static_cast<uint64_t>(n) * 4;
    }
  }
  auto r = w->Finish();
  if (!r.ok()) return Fail(r.status());
  std::printf("wrote %s/model.safetensors: %.3f GiB of fp32 weights, file %llu bytes\n",
              dir.c_str(), total / double(1 << 30), static_cast<unsigned long long>(r->size_bytes));
  return 0;
}

int Import(const std::string& dir) {
  auto ck = HfCheckpoint::Open(dir);
  if (!ck.ok()) return Fail(ck.status());
  int64_t largest = 0, total = 0;
  for (int b = 0; b < (*ck)->num_blocks(); ++b) {
    largest = std::max(largest, (*ck)->block_num_params(b));
    total += (*ck)->block_num_params(b);
  }
  std::vector<float> block(static_cast<size_t>(largest));
  double checksum = 0;
  for (int b = 0; b < (*ck)->num_blocks(); ++b) {
    const std::span<float> out(block.data(), static_cast<size_t>((*ck)->block_num_params(b)));
    Status s = (*ck)->ReadBlock(b, out);
    if (!s.ok()) return Fail(s);
    for (float v : out) checksum += v;
  }
  std::printf(
      "imported %d blocks, %.3f GiB of fp32 weights; block buffer %.1f MiB; checksum %.9g\n",
      (*ck)->num_blocks(), total * 4.0 / (1 << 30), largest * 4.0 / (1 << 20), checksum);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 3 && std::string(argv[1]) == "create") return Create(argv[2]);
  if (argc == 3 && std::string(argv[1]) == "import") return Import(argv[2]);
  std::fprintf(stderr, "usage: %s (create|import) DIR\n", argv[0]);
  return 2;
}

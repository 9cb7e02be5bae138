// Tiny Hugging Face model directories for the hf_* tests, written by hand (safetensors header
// JSON and little-endian data) so that the tests do not read back what the code under test wrote.
// The tensor lists here restate the Hugging Face layouts independently of models/hf_config.cc.
#pragma once

#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "base/dtype.h"

namespace strata::models::testing {

// A tensor of a test model: Hugging Face name and shape, the engine block it belongs to, and
// whether the block's chunk holds its transpose (the GPT-2 untied lm_head).
struct TestTensor {
  TestTensor(std::string n, std::vector<int64_t> s, int b, bool t = false)
      : name(std::move(n)), shape(std::move(s)), block(b), transposed(t) {}
  std::string name;
  std::vector<int64_t> shape;
  int block = 0;
  bool transposed = false;
  std::string dtype = "F32";  // safetensors spelling; "U8" (byte values), "I64" for bad input
  std::vector<float> values;  // exactly representable in dtype
  int64_t num_elems() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
};

struct LlamaTestShape {
  int V = 37, C = 16, I = 24, L = 2, H = 4, Hkv = 2, hs = 4, max_pos = 32;
  bool tied = false;
};

inline std::string LlamaConfigText(const LlamaTestShape& s, const std::string& extra = "") {
  return fmt::format(
      R"({{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": {},
  "hidden_size": {}, "intermediate_size": {}, "num_hidden_layers": {},
  "num_attention_heads": {}, "num_key_value_heads": {}, "head_dim": {},
  "max_position_embeddings": {}, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
  "tie_word_embeddings": {}, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2{}}})",
      s.V, s.C, s.I, s.L, s.H, s.Hkv, s.hs, s.max_pos, s.tied ? "true" : "false", extra);
}

inline std::vector<TestTensor> LlamaTestTensors(const LlamaTestShape& s) {
  std::vector<TestTensor> t;
  t.push_back({"model.embed_tokens.weight", {s.V, s.C}, 0});
  for (int i = 0; i < s.L; ++i) {
    const std::string p = fmt::format("model.layers.{}.", i);
    const int b = 1 + i;
    t.push_back({p + "input_layernorm.weight", {s.C}, b});
    t.push_back({p + "self_attn.q_proj.weight", {s.H * s.hs, s.C}, b});
    t.push_back({p + "self_attn.k_proj.weight", {s.Hkv * s.hs, s.C}, b});
    t.push_back({p + "self_attn.v_proj.weight", {s.Hkv * s.hs, s.C}, b});
    t.push_back({p + "self_attn.o_proj.weight", {s.C, s.H * s.hs}, b});
    t.push_back({p + "post_attention_layernorm.weight", {s.C}, b});
    t.push_back({p + "mlp.gate_proj.weight", {s.I, s.C}, b});
    t.push_back({p + "mlp.up_proj.weight", {s.I, s.C}, b});
    t.push_back({p + "mlp.down_proj.weight", {s.C, s.I}, b});
  }
  t.push_back({"model.norm.weight", {s.C}, s.L + 1});
  if (!s.tied) t.push_back({"lm_head.weight", {s.V, s.C}, s.L + 1});
  return t;
}

struct Gpt2TestShape {
  int V = 41, C = 12, H = 3, L = 2, max_pos = 20;
  bool tied = true;
};

inline std::string Gpt2ConfigText(const Gpt2TestShape& s, const std::string& extra = "") {
  return fmt::format(
      R"({{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": {},
  "n_embd": {}, "n_layer": {}, "n_head": {}, "n_positions": {}, "n_ctx": {},
  "layer_norm_epsilon": 1e-05, "activation_function": "gelu_new", "n_inner": null,
  "tie_word_embeddings": {}{}}})",
      s.V, s.C, s.L, s.H, s.max_pos, s.max_pos, s.tied ? "true" : "false", extra);
}

// GPT2LMHeadModel's names; `prefix` is "transformer." or "" (the original gpt2 upload).
inline std::vector<TestTensor> Gpt2TestTensors(const Gpt2TestShape& s,
                                               const std::string& prefix = "transformer.") {
  std::vector<TestTensor> t;
  const int64_t C = s.C;
  t.push_back({prefix + "wte.weight", {s.V, C}, 0});
  t.push_back({prefix + "wpe.weight", {s.max_pos, C}, 0});
  for (int i = 0; i < s.L; ++i) {
    const std::string p = fmt::format("{}h.{}.", prefix, i);
    const int b = 1 + i;
    for (auto [n, shape] : std::vector<std::pair<std::string, std::vector<int64_t>>>{
             {"ln_1.weight", {C}},
             {"ln_1.bias", {C}},
             {"attn.c_attn.weight", {C, 3 * C}},
             {"attn.c_attn.bias", {3 * C}},
             {"attn.c_proj.weight", {C, C}},
             {"attn.c_proj.bias", {C}},
             {"ln_2.weight", {C}},
             {"ln_2.bias", {C}},
             {"mlp.c_fc.weight", {C, 4 * C}},
             {"mlp.c_fc.bias", {4 * C}},
             {"mlp.c_proj.weight", {4 * C, C}},
             {"mlp.c_proj.bias", {C}}}) {
      t.push_back({p + n, shape, b});
    }
  }
  t.push_back({prefix + "ln_f.weight", {C}, s.L + 1});
  t.push_back({prefix + "ln_f.bias", {C}, s.L + 1});
  if (!s.tied) t.push_back({"lm_head.weight", {s.V, C}, s.L + 1, /*transposed=*/true});
  return t;
}

// Random values (normal, with a few large and tiny magnitudes) rounded to `dtype`.
inline void FillRandom(std::vector<TestTensor>& tensors, const std::string& dtype, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (TestTensor& t : tensors) {
    t.dtype = dtype;
    t.values.resize(static_cast<size_t>(t.num_elems()));
    for (size_t i = 0; i < t.values.size(); ++i) {
      float v = normal(rng);
      if (i % 97 == 5) v *= 1e4f;
      if (i % 89 == 7) v *= 1e-6f;
      if (dtype == "F16") v = HalfToFloat(FloatToHalf(v));
      if (dtype == "BF16") v = Bf16ToFloat(FloatToBf16(v));
      t.values[i] = v;
    }
  }
}

inline void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(f.good()) << path;
}

inline std::string ReadFileBytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

// Writes a safetensors file by hand: header with the tensors in the given order, then the data.
inline void WriteSafetensors(const std::string& path, const std::vector<const TestTensor*>& ts) {
  nlohmann::json header = {{"__metadata__", {{"format", "pt"}}}};
  std::string data;
  for (const TestTensor* t : ts) {
    const size_t begin = data.size();
    for (float v : t->values) {
      if (t->dtype == "F32") {
        uint32_t u;
        std::memcpy(&u, &v, 4);
        for (int i = 0; i < 4; ++i) data.push_back(static_cast<char>(u >> (8 * i)));
      } else if (t->dtype == "F16" || t->dtype == "BF16") {
        const uint16_t u = t->dtype == "F16" ? FloatToHalf(v) : FloatToBf16(v);
        data.push_back(static_cast<char>(u & 0xff));
        data.push_back(static_cast<char>(u >> 8));
      } else if (t->dtype == "U8") {  // a byte per value (bitsandbytes' 4-bit parts)
        data.push_back(static_cast<char>(static_cast<uint8_t>(v)));
      } else {  // I64
        const int64_t x = static_cast<int64_t>(v);
        for (int i = 0; i < 8; ++i) data.push_back(static_cast<char>(uint64_t(x) >> (8 * i)));
      }
    }
    header[t->name] = {
        {"dtype", t->dtype}, {"shape", t->shape}, {"data_offsets", {begin, data.size()}}};
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>(uint64_t(text.size()) >> (8 * i));
  WriteFile(path, bytes + text + data);
}

// Writes config.json and the tensors: one model.safetensors (num_shards == 0), or num_shards
// files "w-{k}.safetensors" (tensor i in shard i % num_shards) with an index.
inline void WriteModelDir(const std::string& dir, const std::string& config_text,
                          const std::vector<TestTensor>& tensors, int num_shards = 0) {
  std::filesystem::create_directories(dir);
  WriteFile(dir + "/config.json", config_text);
  if (num_shards == 0) {
    std::vector<const TestTensor*> all;
    for (const auto& t : tensors) all.push_back(&t);
    WriteSafetensors(dir + "/model.safetensors", all);
    return;
  }
  nlohmann::json index = {{"metadata", {{"total_size", 0}}},
                          {"weight_map", nlohmann::json::object()}};
  for (int k = 0; k < num_shards; ++k) {
    std::vector<const TestTensor*> part;
    const std::string name = fmt::format("w-{}.safetensors", k);
    for (size_t i = k; i < tensors.size(); i += num_shards) {
      part.push_back(&tensors[i]);
      index["weight_map"][tensors[i].name] = name;
    }
    WriteSafetensors(dir + "/" + name, part);
  }
  WriteFile(dir + "/model.safetensors.index.json", index.dump(2));
}

// The fp32 chunk of `block`: the block's tensors in list order, transposed where flagged.
inline std::vector<float> ExpectedChunk(const std::vector<TestTensor>& tensors, int block) {
  std::vector<float> chunk;
  for (const TestTensor& t : tensors) {
    if (t.block != block) continue;
    if (!t.transposed) {
      chunk.insert(chunk.end(), t.values.begin(), t.values.end());
      continue;
    }
    const int64_t R = t.shape[0], K = t.shape[1];
    for (int64_t k = 0; k < K; ++k) {
      for (int64_t r = 0; r < R; ++r) chunk.push_back(t.values[r * K + k]);
    }
  }
  return chunk;
}

// A fresh directory under the test temp dir, removed by the destructor.
class TempDir {
 public:
  TempDir() {
    std::string templ = ::testing::TempDir() + "hf_test_XXXXXX";
    EXPECT_NE(::mkdtemp(templ.data()), nullptr);
    path_ = templ;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

}  // namespace strata::models::testing

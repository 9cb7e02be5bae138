// LlamaModel (models/llama.h) through engine::Model on the host device, with typed BlockBuffers
// laid out as the engine lays them out (one arena; each block's params and gradient chunk; the
// tied head given the embedding chunk as tied_params and its own tied_grads; one scratch of the
// largest scratch_bytes; every byte not uploaded poisoned with 0xff):
//   - the whole model runs the block functions of llama_kernels.h bit for bit (fp32, bf16, fp16;
//     tied and untied);
//   - Forward and Backward refuse wrong buffers with kInvalidArgument naming the buffer;
//   - presets, parameter counts, description, tied_block, and InitParams with and without a
//     weight source.
#include <gtest/gtest.h>

#include <cctype>
#include <cstring>
#include <memory>
#include <regex>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "engine/plan/model.h"
#include "gpu/device.h"
#include "models/llama.h"
#include "models/llama_kernels.h"
#include "tests/models/llama_test_model.h"

namespace strata::models {
namespace {

using llama_test::CastBlocks;
using llama_test::RandomLlama;
using llama_test::RandomTokens;
using llama_test::Runner;

struct HostDevice {
  std::unique_ptr<gpu::Device> device;
  std::unique_ptr<gpu::Stream> stream;
};
HostDevice MakeHostDevice() {
  auto device = gpu::CreateHostDevice({});
  STRATA_CHECK_MSG(device.ok(), device.status().ToString());
  auto stream = (*device)->CreateStream("compute");
  STRATA_CHECK_MSG(stream.ok(), stream.status().ToString());
  return {std::move(*device), std::move(*stream)};
}

std::unique_ptr<LlamaModel> MakeModel(const LlamaConfig& c,
                                      std::shared_ptr<const WeightSource> w = nullptr) {
  auto model = LlamaModel::Create(c, std::move(w));
  STRATA_CHECK_MSG(model.ok(), model.status().ToString());
  return std::move(*model);
}

// One micro-batch through every block's Forward and Backward, in one arena span.
template <typename S>
class ModelRun {
 public:
  ModelRun(engine::Model& model, gpu::Device& device, engine::MicroBatchShape shape)
      : model_(model), shape_(shape), n_(model.num_blocks()) {
    const size_t act = static_cast<size_t>(model.activation_elems(shape)) * sizeof(S);
    int64_t scratch = 0;
    for (int b = 0; b < n_; ++b) {
      const size_t chunk = static_cast<size_t>(model.block_num_params(b)) * sizeof(S);
      params_.push_back(Add(chunk));
      grads_.push_back(Add(chunk));
      tied_grads_.push_back(model.tied_block(b) >= 0 ? Add(chunk_bytes(model.tied_block(b)))
                                                     : Region{});
      scratch = std::max(scratch, model.scratch_bytes(b, shape, DTypeOf<S>()));
    }
    for (int b = 0; b + 1 < n_; ++b) acts_.push_back(Add(act));
    dx_[0] = Add(act);
    dx_[1] = Add(act);
    tokens_ = Add(shape.tokens() * sizeof(int32_t));
    targets_ = Add(shape.tokens() * sizeof(int32_t));
    logits_ = Add(model.logits_elems(shape) * sizeof(S));
    loss_ = Add(sizeof(float));
    scratch_ = Add(static_cast<size_t>(scratch));
    size_ = (size_ + gpu::DeviceArena::kAlignment - 1) / gpu::DeviceArena::kAlignment *
            gpu::DeviceArena::kAlignment;  // Carve rounds up to the alignment
    auto arena = device.CreateArena(size_);
    STRATA_CHECK(arena.ok());
    arena_ = std::move(*arena);
    auto all = arena_->Carve(size_, "llama run");
    STRATA_CHECK_MSG(all.ok(), all.status().ToString());
    all_ = *all;
    auto image = device.AllocatePinned(size_, "llama run");
    STRATA_CHECK(image.ok());
    image_ = std::move(*image);
  }

  engine::BlockBuffers ForwardBuffers(int b) const {
    engine::BlockBuffers buf = Common(b);
    if (b > 0) buf.x_in = Typed(acts_[b - 1], model_.activation_elems(shape_));
    if (b < n_ - 1) {
      buf.x_out = Typed(acts_[b], model_.activation_elems(shape_));
    } else {
      buf.targets = Span(targets_).template as<const int32_t>();
      buf.logits = Typed(logits_, model_.logits_elems(shape_));
      buf.loss = Span(loss_).template as<float>();
    }
    return buf;
  }
  engine::BlockBuffers BackwardBuffers(int b) const {
    engine::BlockBuffers buf = Common(b);
    buf.grads = Typed(grads_[b], model_.block_num_params(b));
    if (model_.tied_block(b) >= 0) {
      buf.tied_grads = Typed(tied_grads_[b], model_.block_num_params(model_.tied_block(b)));
    }
    const int64_t act = model_.activation_elems(shape_);
    if (b > 0) {
      buf.x_in = Typed(acts_[b - 1], act);
      buf.dx_in = Typed(dx_[b % 2], act);
    }
    if (b < n_ - 1) {
      buf.dx_out = Typed(dx_[(b + 1) % 2], act);
    } else {
      buf.targets = Span(targets_).template as<const int32_t>();
      buf.dloss = 1.0f;
    }
    return buf;
  }

  struct Result {
    float loss = 0;
    std::vector<std::vector<S>> grads;
    std::vector<S> tied;  // the head's tied_grads (tied models)
    std::vector<S> logits;
  };

  StatusOr<Result> ForwardBackward(gpu::Stream& stream, const std::vector<std::vector<S>>& params,
                                   const std::vector<int32_t>& tokens,
                                   const std::vector<int32_t>& targets) {
    std::memset(image_.data(), 0xff, size_);
    for (int b = 0; b < n_; ++b) Put(params_[b], params[b]);
    Put(tokens_, tokens);
    Put(targets_, targets);
    STRATA_RETURN_IF_ERROR(stream.CopyH2D(all_, image_.span().subspan(0, size_)));
    for (int b = 0; b < n_; ++b)
      STRATA_RETURN_IF_ERROR(model_.Forward(b, ForwardBuffers(b), stream));
    for (int b = n_ - 1; b >= 0; --b) {
      STRATA_RETURN_IF_ERROR(model_.Backward(b, BackwardBuffers(b), stream));
    }
    STRATA_RETURN_IF_ERROR(stream.CopyD2H(image_.span().subspan(0, size_), all_));
    STRATA_RETURN_IF_ERROR(stream.Synchronize());
    Result r;
    std::memcpy(&r.loss, image_.data() + loss_.offset, sizeof(float));
    for (int b = 0; b < n_; ++b) r.grads.push_back(Get(grads_[b]));
    if (model_.tied_block(n_ - 1) >= 0) r.tied = Get(tied_grads_[n_ - 1]);
    r.logits = Get(logits_);
    return r;
  }

 private:
  struct Region {
    size_t offset = 0, size_bytes = 0;
  };
  size_t chunk_bytes(int b) const { return model_.block_num_params(b) * sizeof(S); }
  Region Add(size_t size_bytes) {
    const size_t a = gpu::DeviceArena::kAlignment;
    const Region r{(size_ + a - 1) / a * a, size_bytes};
    size_ = r.offset + std::max<size_t>(size_bytes, 1);
    return r;
  }
  gpu::DeviceSpan Span(const Region& r) const { return all_.subspan(r.offset, r.size_bytes); }
  engine::TensorRef Typed(const Region& r, int64_t n) const {
    return {Span(r).data, DTypeOf<S>(), n};
  }
  engine::BlockBuffers Common(int b) const {
    engine::BlockBuffers buf;
    buf.precision = DTypeOf<S>();
    buf.params = Typed(params_[b], model_.block_num_params(b));
    const int t = model_.tied_block(b);
    if (t >= 0) buf.tied_params = Typed(params_[t], model_.block_num_params(t));
    buf.shape = shape_;
    buf.scratch = Span(scratch_);
    if (b == 0) buf.tokens = Span(tokens_).template as<const int32_t>();
    return buf;
  }
  template <typename T>
  void Put(const Region& r, const std::vector<T>& v) {
    STRATA_CHECK(v.size() * sizeof(T) == r.size_bytes);
    std::memcpy(image_.data() + r.offset, v.data(), r.size_bytes);
  }
  std::vector<S> Get(const Region& r) const {
    std::vector<S> v(r.size_bytes / sizeof(S));
    std::memcpy(v.data(), image_.data() + r.offset, r.size_bytes);
    return v;
  }

  engine::Model& model_;
  engine::MicroBatchShape shape_;
  int n_;
  size_t size_ = 0;
  std::vector<Region> params_, grads_, tied_grads_, acts_;
  Region dx_[2], tokens_, targets_, logits_, loss_, scratch_;
  std::unique_ptr<gpu::DeviceArena> arena_;
  gpu::DeviceSpan all_;
  gpu::PinnedBuffer image_;
};

template <typename T>
bool SameBits(const std::vector<T>& a, const std::vector<T>& b) {
  // memcmp of two empty vectors would pass null pointers.
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

LlamaConfig SmallConfig(bool tied) {
  LlamaConfig c = *LlamaPreset("llama-tiny");
  c.vocab_size = 53;
  c.hidden_size = 24;
  c.intermediate_size = 37;
  c.head_dim = 6;  // 4 heads of 6 = 24, 2 kv heads
  c.tie_embeddings = tied;
  c.rope_llama3 = tied;  // both settings covered
  c.rope_original_max_position = 16;
  return c;
}

template <typename S>
class LlamaModelHostTest : public ::testing::Test {};
using StorageTypes = ::testing::Types<float, Bf16, Fp16>;
TYPED_TEST_SUITE(LlamaModelHostTest, StorageTypes);

TYPED_TEST(LlamaModelHostTest, WholeModelRunsTheBlockFunctionsBitForBit) {
  using S = TypeParam;
  for (bool tied : {false, true}) {
    SCOPED_TRACE(tied ? "tied" : "untied");
    const LlamaConfig c = SmallConfig(tied);
    const int B = 3, T = 11;
    const auto params = CastBlocks<S>(RandomLlama(c, 61));
    const std::vector<int32_t> tokens = RandomTokens(B * T, c.vocab_size, 62);
    const std::vector<int32_t> targets = RandomTokens(B * T, c.vocab_size, 63);

    Runner<S> runner(c, B, T);
    std::vector<std::vector<S>> want_grads;
    std::vector<S> want_tied;
    const float want_loss = runner.Backward(params, tokens, targets, &want_grads, &want_tied);
    runner.Loss(params, tokens, targets.data());
    const std::vector<S> want_logits = runner.logits();

    HostDevice host = MakeHostDevice();
    auto model = MakeModel(c);
    ModelRun<S> run(*model, *host.device, {B, T});
    auto got = run.ForwardBackward(*host.stream, params, tokens, targets);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_EQ(std::memcmp(&got->loss, &want_loss, sizeof(float)), 0)
        << got->loss << " vs " << want_loss;
    EXPECT_TRUE(SameBits(got->logits, want_logits));
    ASSERT_EQ(got->grads.size(), want_grads.size());
    for (size_t b = 0; b < want_grads.size(); ++b) {
      EXPECT_TRUE(SameBits(got->grads[b], want_grads[b])) << model->block_name(b);
    }
    EXPECT_TRUE(SameBits(got->tied, want_tied));
    EXPECT_EQ(tied, !got->tied.empty());
  }
}

class LlamaModelBuffersTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = MakeModel(SmallConfig(/*tied=*/true));
    run_ = std::make_unique<ModelRun<float>>(*model_, *host_.device, engine::MicroBatchShape{2, 7});
  }
  void ExpectRefused(const Status& st, const std::vector<std::string>& words) {
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
    for (const std::string& w : words) {
      EXPECT_NE(st.message().find(w), std::string::npos) << st.ToString() << " lacks " << w;
    }
  }
  int head() const { return model_->num_blocks() - 1; }

  HostDevice host_ = MakeHostDevice();
  std::unique_ptr<LlamaModel> model_;
  std::unique_ptr<ModelRun<float>> run_;
};

TEST_F(LlamaModelBuffersTest, TheEngineLayoutIsAccepted) {
  for (int b = 0; b <= head(); ++b) {
    EXPECT_TRUE(model_->Forward(b, run_->ForwardBuffers(b), *host_.stream).ok()) << b;
  }
  for (int b = head(); b >= 0; --b) {
    EXPECT_TRUE(model_->Backward(b, run_->BackwardBuffers(b), *host_.stream).ok()) << b;
  }
  EXPECT_TRUE(host_.stream->Synchronize().ok());
}

TEST_F(LlamaModelBuffersTest, TiedHeadWithoutTheEmbeddingChunkOrItsGradientIsRefused) {
  engine::BlockBuffers f = run_->ForwardBuffers(head());
  f.tied_params = {};
  ExpectRefused(model_->Forward(head(), f, *host_.stream), {"tied_params", "missing"});
  engine::BlockBuffers b = run_->BackwardBuffers(head());
  b.tied_grads.num_elems -= 1;
  ExpectRefused(model_->Backward(head(), b, *host_.stream), {"tied_grads", "elements"});
}

TEST_F(LlamaModelBuffersTest, WrongDtypesTooSmallScratchAndMissingGradientsAreRefused) {
  engine::BlockBuffers b = run_->ForwardBuffers(1);
  b.x_in.dtype = DType::kBF16;
  ExpectRefused(model_->Forward(1, b, *host_.stream), {"x_in", "bf16", "fp32"});
  b = run_->BackwardBuffers(1);
  b.grads = {};
  ExpectRefused(model_->Backward(1, b, *host_.stream), {"grads", "missing"});
  for (int block = 0; block <= head(); ++block) {
    const int64_t need = model_->scratch_bytes(block, {2, 7}, DType::kF32);
    engine::BlockBuffers f = run_->ForwardBuffers(block);
    f.scratch = f.scratch.subspan(0, static_cast<size_t>(need) - 1);
    ExpectRefused(model_->Forward(block, f, *host_.stream), {"scratch", std::to_string(need)});
  }
  b = run_->ForwardBuffers(1);
  b.shape.seq_len = model_->max_seq_len() + 1;
  ExpectRefused(model_->Forward(1, b, *host_.stream), {"context"});
}

TEST(LlamaModel, PresetsHaveThePublishedParameterCounts) {
  struct Want {
    const char* name;
    int64_t params;
  };
  // TinyLlama-1.1B, Llama-2-7b, Llama-2-13b, Meta-Llama-3-70B, Mistral-7B-v0.1, Qwen2.5-0.5B
  // (tied), Qwen2.5-7B, Qwen3-0.6B (tied), Qwen3-8B, Phi-4, Gemma 2 2B and 9B and Gemma 3 1B as
  // Hugging Face counts them (q/k/v biases, q/k norms included).
  for (const Want& w :
       {Want{"llama-1b", 1100048384}, Want{"llama-7b", 6738415616}, Want{"llama-13b", 13015864320},
        Want{"llama-70b", 70553706496}, Want{"mistral-7b", 7241732096},
        Want{"qwen2.5-0.5b", 494032768}, Want{"qwen2.5-7b", 7615616512},
        Want{"qwen3-0.6b", 596049920}, Want{"qwen3-8b", 8190735360}, Want{"phi4", 14659507200},
        Want{"gemma2-2b", 2614341888}, Want{"gemma2-9b", 9241705984},
        Want{"gemma3-1b", 999885952}}) {
    auto c = LlamaPreset(w.name);
    ASSERT_TRUE(c.ok()) << w.name;
    EXPECT_EQ(MakeModel(*c)->num_params(), w.params) << w.name;
  }
  EXPECT_EQ(LlamaPresetNames(),
            (std::vector<std::string>{"llama-tiny", "llama-1b", "llama-7b", "llama-13b",
                                      "llama-70b", "mistral-7b", "qwen2.5-0.5b", "qwen2.5-7b",
                                      "qwen3-0.6b", "qwen3-8b", "phi4", "gemma2-2b", "gemma2-9b",
                                      "gemma3-1b", "gemma3-27b"}));
  const auto bad = LlamaPreset("llama-65b");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("llama-13b"), std::string::npos);
}

TEST(LlamaModel, DescriptionNamesTheShape) {
  const auto m = MakeModel(*LlamaPreset("llama-1b"));
  const std::string d = m->description();
  EXPECT_NE(d.find("22 layers, 32 heads (4 key/value), 2048 channels"), std::string::npos) << d;
  EXPECT_EQ(m->num_blocks(), 24);
  EXPECT_EQ(m->block_name(0), "embedding");
  EXPECT_EQ(m->block_name(5), "layer4");
  EXPECT_EQ(m->block_name(23), "head");
}

TEST(LlamaModel, OnlyATiedHeadTiesTheEmbeddingChunk) {
  const auto untied = MakeModel(SmallConfig(false));
  const auto tied = MakeModel(SmallConfig(true));
  for (int b = 0; b < untied->num_blocks(); ++b) EXPECT_EQ(untied->tied_block(b), -1);
  for (int b = 0; b + 1 < tied->num_blocks(); ++b) EXPECT_EQ(tied->tied_block(b), -1);
  EXPECT_EQ(tied->tied_block(tied->num_blocks() - 1), 0);
  EXPECT_EQ(tied->block_num_params(tied->num_blocks() - 1), 24);
}

TEST(LlamaModel, InvalidConfigIsRefused) {
  LlamaConfig c = SmallConfig(false);
  c.num_kv_heads = 3;
  const auto m = LlamaModel::Create(c);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), StatusCode::kInvalidArgument);
}

// A weight source that writes block b's chunk as b + i / 1e6, or fails for one block.
class FakeSource : public WeightSource {
 public:
  explicit FakeSource(int failing_block) : failing_block_(failing_block) {}
  Status ReadBlock(int block, std::span<float> out) const override {
    if (block == failing_block_) return DataLossError("shard-2.safetensors is short");
    for (size_t i = 0; i < out.size(); ++i) out[i] = block + static_cast<float>(i) * 1e-6f;
    return Status::Ok();
  }

 private:
  int failing_block_;
};

TEST(LlamaModel, InitParamsReadsTheWeightSourceAndPassesItsErrorsOn) {
  const LlamaConfig c = SmallConfig(false);
  const auto m = MakeModel(c, std::make_shared<FakeSource>(2));
  std::vector<float> chunk(m->block_num_params(1));
  ASSERT_TRUE(m->InitParams(1, 5, chunk).ok());
  EXPECT_EQ(chunk[0], 1.0f);
  EXPECT_EQ(chunk[10], 1.0f + 10e-6f);
  std::vector<float> layer1(m->block_num_params(2));
  const Status st = m->InitParams(2, 5, layer1);
  EXPECT_EQ(st.code(), StatusCode::kDataLoss);
  EXPECT_NE(st.message().find("shard-2"), std::string::npos);
}

TEST(LlamaModel, RandomInitParamsAreTheKernelInitsPerBlock) {
  const LlamaConfig c = SmallConfig(true);
  const auto m = MakeModel(c);
  for (int b = 0; b < m->num_blocks(); ++b) {
    std::vector<float> got(m->block_num_params(b)), want(got.size());
    ASSERT_TRUE(m->InitParams(b, 9, got).ok());
    if (b == 0) {
      InitLlamaEmbeddingParams(c, 9, want.data());
    } else if (b == m->num_blocks() - 1) {
      InitLlamaHeadParams(c, 9, want.data());
    } else {
      InitLlamaLayerParams(c, b - 1, 9, want.data());
    }
    EXPECT_EQ(got, want) << b;
  }
}

// transformers' Trainer leaves out of weight decay every parameter of an nn.LayerNorm and every
// parameter whose name matches one of get_decay_parameter_names' forbidden patterns
// (trainer_pt_utils.py / trainer.py: "bias", "layernorm", "rmsnorm", "(?:^|\.)norm(?:$|\.)",
// "_norm(?:$|\.)", on the lower-cased name). The families' own no-decay ranges must be exactly
// those tensors, for every family's Hugging Face names.
TEST(LlamaModel, NoDecayRangesAreTheTensorsTransformersLeavesUndecayed) {
  const std::regex forbidden("bias|layernorm|rmsnorm|(?:^|\\.)norm(?:$|\\.)|_norm(?:$|\\.)");
  for (const char* preset : {"llama-tiny", "mistral-7b", "qwen2.5-0.5b", "qwen3-0.6b", "phi4",
                             "gemma2-2b", "gemma3-1b"}) {
    SCOPED_TRACE(preset);
    const LlamaConfig c = *LlamaPreset(preset);
    const auto model = MakeModel(c);
    int64_t exempt = 0;
    for (int b = 0; b < model->num_blocks(); ++b) {
      std::vector<cpu_optim::ElemRange> want;
      for (const LlamaTensor& t : llama_test::BlockTensors(c, b)) {
        std::string name = t.name;
        for (char& ch : name) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
        if (!std::regex_search(name, forbidden)) continue;
        if (!want.empty() && want.back().end == t.offset) {
          want.back().end += t.num_elems;
        } else {
          want.push_back({t.offset, t.offset + t.num_elems});
        }
        exempt += t.num_elems;
      }
      EXPECT_EQ(model->block_no_decay_ranges(b), want) << "block " << b;
    }
    // Every layer has at least its norms; Qwen2's q/k/v biases and Qwen3's q/k norms are in.
    EXPECT_GE(exempt, int64_t{2} * c.num_layers * c.hidden_size);
  }
  // LoRA's adapters are all decayed matrices; the frozen base has no state.
  LlamaConfig c = *LlamaPreset("llama-tiny");
  auto lora = MakeModel(c);
  ASSERT_TRUE(lora->EnableLora({.rank = 2, .alpha = 4, .targets = {"q_proj", "v_proj"}}).ok());
  for (int b = 0; b < lora->num_blocks(); ++b) EXPECT_TRUE(lora->block_no_decay_ranges(b).empty());
}

}  // namespace
}  // namespace strata::models

// LoRA on the CUDA backend (models/cuda/lora_cuda.cuh) against the host backend, through the
// whole model with the engine's buffers (tests/models/gpt_model_run.h: the base as each block's
// frozen chunk, the adapters as the layers' trained chunks): for Llama and GPT-2, tied and
// untied, in fp32, bf16 and fp16, with dropout off and on (a fixed micro-batch seed), every
// targeted module of the family adapted:
//   - the loss, the last-position logits, every adapter gradient (lora_A and lora_B of every
//     site of every layer) and the embedding output's gradient, element by element;
//   - the frozen head and layers compute no weight gradient: the ModelRun has no gradient buffer
//     for the embedding and the head (a CUDA block that wrote one would fault or be refused).
// The host backend is checked against a float64 PyTorch reference of the same LoRA forward in
// hf_gradients and lora_test; this test holds CUDA to the host within the sum of both runs'
// error bounds (see Bound below). Dropout: the CUDA kernels draw each element's mask from the
// same LoraDropoutStream/LoraStreamUniform as the host, so the runs drop the same elements; a
// mask that differed in one element of a (rows x in) input moves the gradients by the size of
// that element's term, far outside the bound (the dropout cases would fail).
// Label gpu: without a GPU every case skips with the reason.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "gpu/device.h"
#include "models/gpt.h"
#include "models/llama.h"
#include "models/lora.h"
#include "tests/gpu/cuda_test_util.h"
#include "tests/models/gpt_model_run.h"
#include "tests/models/gpt_test_model.h"
#include "tests/models/llama_op_test_util.h"
#include "tests/models/llama_test_model.h"

namespace strata::models {
namespace {

using op_test::Eps;
using op_test::ExpectWithinBound;
using test_model::ToDoubles;

template <typename S>
class LoraCudaTest : public gpu::testing::CudaTest {};

using StorageTypes = ::testing::Types<float, Bf16, Fp16>;
TYPED_TEST_SUITE(LoraCudaTest, StorageTypes);

// Random adapters for every layer: A uniform in +-1/sqrt(in) (PEFT's range), B uniform in
// +-0.25 (not zero, so that every gradient, dA included, is nonzero).
std::vector<std::vector<double>> RandomAdapters(const engine::Model& m, const LoraLayout& l,
                                                uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::vector<double>> blocks(m.num_blocks());
  for (int b = 0; b < m.num_blocks(); ++b) {
    blocks[b].resize(m.block_num_params(b));
    if (blocks[b].empty()) continue;
    for (const LoraSite& s : l.sites) {
      const double a = 1 / std::sqrt(static_cast<double>(s.module.in));
      std::uniform_real_distribution<double> ua(-a, a), ub(-0.25, 0.25);
      for (int64_t i = 0; i < l.rank * s.module.in; ++i) blocks[b][s.a_offset + i] = ua(rng);
      for (int64_t i = 0; i < s.module.out * l.rank; ++i) blocks[b][s.b_offset + i] = ub(rng);
    }
  }
  return blocks;
}

// The error bound of a whole-model run (gpt_model_run.h WholeModelBound, the families' own
// counts of roundings) with the adapters' roundings added per layer: in a forward 3 per adapted
// product (u, v and the add into the output; dropout's scaling a 4th), in a backward those of the
// recomputed forward and 5 more (the scaled output gradient, g, t, dA or dB, the add into dx).
// Four adapted products per layer in both families: + 16 per layer on the loss path, + 36 per
// layer on a gradient's; CUDA against the host is held to the sum of both runs' bounds, twice.
struct Bound {
  double eps, loss_k, grad_k;
};
Bound WithAdapters(double eps, double loss_k, double grad_k, int layers) {
  return {eps, 2 * (loss_k + 16.0 * layers), 2 * (grad_k + 36.0 * layers)};
}

struct Case {
  bool tied;
  double dropout;
  int B, T;
};
std::string Name(const Case& c) {
  return std::string(c.tied ? "tied" : "untied") + " dropout=" + std::to_string(c.dropout) +
         " B=" + std::to_string(c.B) + " T=" + std::to_string(c.T);
}
// T >= 2: with one key (T = 1) the gradients of q and k are zero in exact arithmetic and the
// runs' values are rounding noise (llama_cuda_test bounds them by the attention's cancelling
// terms); the GPT case adds T = 1, its fused c_attn adapter's gradient dominated by v's.
std::vector<Case> Cases() {
  return {{false, 0, 3, 11}, {true, 0, 2, 40}, {false, 0.25, 3, 11}, {true, 0.25, 2, 7}};
}

// Runs `model` (LoRA on) on the CUDA device and on the host device with the same inputs and holds
// the results to `bound`.
template <typename S>
void ExpectCudaMatchesHost(engine::Model& model, const LoraLayout& layout,
                           const std::vector<std::vector<double>>& base, int vocab, const Case& c,
                           const Bound& bound, gpu::Device& cuda_device, gpu::Stream& cuda_stream) {
  test_model::Model<S> adapters;
  for (const auto& b : RandomAdapters(model, layout, 17)) {
    adapters.blocks.push_back(test_model::CastVector<S>(b));
  }
  std::vector<std::vector<S>> frozen;
  for (const auto& b : base) frozen.push_back(test_model::CastVector<S>(b));
  const std::vector<int32_t> tokens = llama_test::RandomTokens(c.B * c.T, vocab, 92);
  const std::vector<int32_t> targets = llama_test::RandomTokens(c.B * c.T, vocab, 93);

  auto host_device = gpu::CreateHostDevice({});
  ASSERT_TRUE(host_device.ok()) << host_device.status().ToString();
  auto host_stream = (*host_device)->CreateStream("host compute");
  ASSERT_TRUE(host_stream.ok()) << host_stream.status().ToString();
  auto on_cuda = test_model::ModelRun<S>::Create(model, cuda_device, {c.B, c.T});
  ASSERT_TRUE(on_cuda.ok()) << on_cuda.status().ToString();
  auto on_host = test_model::ModelRun<S>::Create(model, **host_device, {c.B, c.T});
  ASSERT_TRUE(on_host.ok()) << on_host.status().ToString();
  const uint64_t seed = c.dropout > 0 ? 0x5eed : 0;
  (*on_cuda)->set_dropout_seed(seed);
  (*on_host)->set_dropout_seed(seed);
  const auto r_cuda = (*on_cuda)->ForwardBackward(cuda_stream, adapters, tokens, targets, &frozen);
  ASSERT_TRUE(r_cuda.ok()) << "CUDA: " << r_cuda.status().ToString();
  const auto r_host =
      (*on_host)->ForwardBackward(**host_stream, adapters, tokens, targets, &frozen);
  ASSERT_TRUE(r_host.ok()) << "host: " << r_host.status().ToString();

  ExpectWithinBound("loss", {r_cuda->loss}, {r_host->loss}, bound.loss_k, bound.eps);
  ExpectWithinBound("logits", ToDoubles(r_cuda->logits), ToDoubles(r_host->logits), bound.loss_k,
                    bound.eps);
  for (int b = 1; b + 1 < model.num_blocks(); ++b) {
    const std::vector<double> g = ToDoubles(r_cuda->grads[b]), gh = ToDoubles(r_host->grads[b]);
    for (const LoraSite& s : layout.sites) {
      const auto slice = [&](const std::vector<double>& v, int64_t off, int64_t n) {
        return std::vector<double>(v.begin() + off, v.begin() + off + n);
      };
      const int64_t na = layout.rank * s.module.in, nb = s.module.out * layout.rank;
      const std::string at = "layer " + std::to_string(b - 1) + " " + s.module.name;
      ExpectWithinBound(at + ".lora_A grad", slice(g, s.a_offset, na), slice(gh, s.a_offset, na),
                        bound.grad_k, bound.eps);
      ExpectWithinBound(at + ".lora_B grad", slice(g, s.b_offset, nb), slice(gh, s.b_offset, nb),
                        bound.grad_k, bound.eps);
    }
  }
  ExpectWithinBound("d(embedding output)", ToDoubles(r_cuda->dx0), ToDoubles(r_host->dx0),
                    bound.grad_k, bound.eps);
}

LoraConfig AllModules(std::vector<std::string> targets, double dropout) {
  return {.rank = 4, .alpha = 8, .targets = std::move(targets), .dropout = dropout};
}

TYPED_TEST(LoraCudaTest, LlamaAdaptersMatchTheHostBackend) {
  using S = TypeParam;
  for (const Case& c : Cases()) {
    SCOPED_TRACE(Name(c));
    LlamaConfig cfg = *LlamaPreset("llama-tiny");
    cfg.vocab_size = 53;
    cfg.hidden_size = 48;
    cfg.intermediate_size = 37;
    cfg.num_heads = 4;
    cfg.num_kv_heads = 2;
    cfg.head_dim = 12;
    cfg.num_layers = 2;
    cfg.tie_embeddings = c.tied;
    auto model = LlamaModel::Create(cfg);
    ASSERT_TRUE(model.ok()) << model.status().ToString();
    const LoraConfig lc = AllModules(
        {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}, c.dropout);
    ASSERT_TRUE((*model)->EnableLora(lc).ok());
    auto layout = MakeLoraLayout(lc, LlamaLoraModules(cfg), "the Llama model");
    ASSERT_TRUE(layout.ok()) << layout.status().ToString();
    // The llama_cuda_test whole-model bound (its comment derives it), eps over the longest sum.
    const double K = std::max<double>({static_cast<double>(c.B * c.T), 2.0 * cfg.intermediate_size,
                                       static_cast<double>(cfg.vocab_size), 2.0 * c.T});
    const int L = cfg.num_layers;
    const Bound bound = WithAdapters(Eps<S>(K), 8 + 20.0 * L, 10 + 40.0 * (L + 1), L);
    ExpectCudaMatchesHost<S>(**model, *layout, llama_test::RandomLlama(cfg, 91), cfg.vocab_size, c,
                             bound, *this->device_, *this->stream_);
  }
}

TYPED_TEST(LoraCudaTest, GptAdaptersMatchTheHostBackendWithTheGeluUnfused) {
  using S = TypeParam;
  std::vector<Case> cases = Cases();
  cases.push_back({true, 0.25, 1, 1});
  for (const Case& c : cases) {
    SCOPED_TRACE(Name(c));
    GptShape shape{256, 72, 2, 3, 48};
    shape.tie_embeddings = c.tied;
    auto model = GptModel::Create(shape);
    ASSERT_TRUE(model.ok()) << model.status().ToString();
    // c_proj adapts both the attention's and the MLP's projection (PEFT's name match), c_fc the
    // pre-activation of the GELU: every CUDA path of the GPT layer with adapters.
    const LoraConfig lc = AllModules({"c_attn", "c_proj", "c_fc"}, c.dropout);
    ASSERT_TRUE((*model)->EnableLora(lc).ok());
    auto layout = MakeLoraLayout(lc, GptLoraModules(shape), "the GPT model");
    ASSERT_TRUE(layout.ok()) << layout.status().ToString();
    const test_model::WholeModelBound w = test_model::WholeModelBoundFor<S>(shape, c.B, c.T);
    const Bound bound = WithAdapters(w.eps, w.loss_k, w.grad_k, shape.num_layers);
    ExpectCudaMatchesHost<S>(**model, *layout, test_model::RandomModel(shape, 81).blocks,
                             shape.vocab_size, c, bound, *this->device_, *this->stream_);
  }
}

}  // namespace
}  // namespace strata::models

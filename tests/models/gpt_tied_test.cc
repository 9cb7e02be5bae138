// The GPT with tied embeddings (GptShape::tie_embeddings, Hugging Face GPT2LMHeadModel): the head
// chunk is lnf only, the logits are lnf wte^T with wte read from the embedding chunk, and the
// head's gradient contribution to that chunk goes to BlockBuffers::tied_grads.
//   - the kernels (double) against central differences of the loss for every parameter, with
//     the two contributions to wte added as the engine folds them;
//   - GptModel on the host device runs the kernels bit for bit in fp32, bf16 and fp16, and is
//     within the whole-model bound of double;
//   - the model's tensor tables, tied_block and buffer checks.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "engine/plan/model.h"
#include "gpu/device.h"
#include "models/gpt.h"
#include "models/gpt_kernels.h"
#include "tests/models/gpt_model_run.h"
#include "tests/models/gpt_test_model.h"

namespace strata::models {
namespace {

using test_model::BlockName;
using test_model::BlockTensors;
using test_model::CastModel;
using test_model::Model;
using test_model::ModelRun;
using test_model::ModelRunResult;
using test_model::RandomModel;
using test_model::RandomTokens;
using test_model::RoundedModel;
using test_model::Runner;
using test_model::ToDoubles;

GptShape TiedShape(int V, int max_T, int L, int H, int C) {
  GptShape s{V, max_T, L, H, C};
  s.tie_embeddings = true;
  return s;
}

TEST(GptTied, TheHeadChunkIsTheFinalLayerNormOnlyAndTheHeadTiesTheEmbedding) {
  const GptShape s = TiedShape(17, 8, 2, 2, 8);
  ASSERT_TRUE(ValidateShape(s).ok());
  const std::vector<TensorInfo> head = HeadTensors(s);
  ASSERT_EQ(head.size(), 2u);
  EXPECT_EQ(head[0].name, "lnf_w");
  EXPECT_EQ(head[1].name, "lnf_b");
  EXPECT_EQ(HeadNumParams(s), 2 * 8);
  auto model = GptModel::Create(s);
  ASSERT_TRUE(model.ok());
  const int head_block = (*model)->num_blocks() - 1;
  EXPECT_EQ((*model)->tied_block(head_block), 0);
  for (int b = 0; b < head_block; ++b) EXPECT_EQ((*model)->tied_block(b), -1) << b;
  GptShape untied = s;
  untied.tie_embeddings = false;
  auto untied_model = GptModel::Create(untied);
  ASSERT_TRUE(untied_model.ok());
  EXPECT_EQ((*untied_model)->tied_block(head_block), -1);
  // Init writes exactly the 2 C elements: LayerNorm weight 1, bias 0.
  std::vector<float> chunk(2 * 8 + 1, -7.0f);
  InitGptHeadParams(s, 3, chunk.data());
  for (int i = 0; i < 8; ++i) EXPECT_EQ(chunk[i], 1.0f);
  for (int i = 8; i < 16; ++i) EXPECT_EQ(chunk[i], 0.0f);
  EXPECT_EQ(chunk[16], -7.0f);
}

TEST(GptTied, ANonPositiveLayerNormEpsIsRefused) {
  GptShape s = TiedShape(17, 8, 2, 2, 8);
  s.layer_norm_eps = 0;
  EXPECT_EQ(ValidateShape(s).code(), StatusCode::kInvalidArgument);
  s.layer_norm_eps = NAN;
  EXPECT_EQ(ValidateShape(s).code(), StatusCode::kInvalidArgument);
}

TEST(GptTied, TheLayerNormEpsIsUsedByTheModel) {
  GptShape s = TiedShape(17, 8, 2, 2, 8);
  const Model<double> m = RandomModel(s, 11);
  const std::vector<int32_t> tokens = RandomTokens(10, s.vocab_size, 12);
  Runner<double> a(s, 2, 5);
  const double loss_default = a.Loss(m, tokens, tokens.data());
  s.layer_norm_eps = 0.25;
  Runner<double> b(s, 2, 5);
  EXPECT_NE(b.Loss(m, tokens, tokens.data()), loss_default);
}

// Central differences of the double loss against the analytic gradient, every parameter: wte's
// gradient is the embedding's own plus the head's contribution (tied_grads), as the engine
// folds them; the head contributes exact zeros to wpe. Also with a LayerNorm eps other than
// 1e-5 (it is used by every LayerNorm, or the differences would disagree).
void CheckTiedGradientAgainstFiniteDifferences(double layer_norm_eps) {
  GptShape s = TiedShape(17, 8, 2, 2, 8);
  s.layer_norm_eps = layer_norm_eps;
  const int B = 2, T = 5;
  Model<double> m = RandomModel(s, 4321);
  const std::vector<int32_t> tokens = RandomTokens(B * T, s.vocab_size, 1);
  const std::vector<int32_t> targets = RandomTokens(B * T, s.vocab_size, 2);
  Runner<double> run(s, B, T);
  std::vector<std::vector<double>> grads;
  std::vector<double> dx0;
  const double loss = run.Backward(m, tokens, targets, &grads, &dx0);
  ASSERT_TRUE(std::isfinite(loss));
  const std::vector<double>& tied = run.head_tied_grads();
  ASSERT_EQ(tied.size(), grads[0].size());
  const int64_t wte_elems = int64_t{s.vocab_size} * s.channels;
  for (size_t i = wte_elems; i < tied.size(); ++i) ASSERT_EQ(tied[i], 0.0) << "wpe " << i;
  bool head_reads_wte = false;
  for (int64_t i = 0; i < wte_elems; ++i) head_reads_wte |= tied[i] != 0.0;
  EXPECT_TRUE(head_reads_wte);

  constexpr double kEps = 1e-5;
  int failures = 0;
  for (size_t b = 0; b < m.blocks.size(); ++b) {
    for (const TensorInfo& t : BlockTensors(s, b)) {
      for (int64_t i = 0; i < t.num_elems; ++i) {
        double& p = m.blocks[b][t.offset + i];
        const double saved = p;
        p = saved + kEps;
        const double up = run.Loss(m, tokens, targets.data());
        p = saved - kEps;
        const double down = run.Loss(m, tokens, targets.data());
        p = saved;
        const double numeric = (up - down) / (2 * kEps);
        double analytic = grads[b][t.offset + i];
        if (b == 0) analytic += tied[t.offset + i];
        if (!(std::abs(analytic - numeric) <= 1e-9 + 1e-6 * std::abs(numeric)) &&
            ++failures <= 10) {
          ADD_FAILURE() << BlockName(s, b) << "." << t.name << "[" << i << "]: analytic "
                        << analytic << " numeric " << numeric;
        }
      }
    }
  }
  EXPECT_EQ(failures, 0);
}

TEST(GptTied, GradientOfEveryParameterMatchesCentralDifferences) {
  CheckTiedGradientAgainstFiniteDifferences(1e-5);
}

TEST(GptTied, GradientMatchesCentralDifferencesWithAnotherLayerNormEps) {
  CheckTiedGradientAgainstFiniteDifferences(0.25);
}

// A host device with one stream.
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

template <typename T>
bool SameBits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

// |got - ref| <= k eps (|ref| + rms(ref)) element by element (gpt_model_test.cc's bound).
void ExpectWithinBound(const std::string& what, const std::vector<double>& got,
                       const std::vector<double>& ref, double k, double eps) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  double sum = 0;
  for (double x : ref) sum += x * x;
  const double rms = ref.empty() ? 0 : std::sqrt(sum / static_cast<double>(ref.size()));
  int failures = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double bound = k * eps * (std::abs(ref[i]) + rms);
    if (!(std::abs(got[i] - ref[i]) <= bound) && ++failures <= 5) {
      ADD_FAILURE() << what << "[" << i << "]: got " << got[i] << " reference " << ref[i]
                    << " bound " << bound;
    }
  }
  EXPECT_EQ(failures, 0) << what;
}

template <typename S>
class GptTiedHostTest : public ::testing::Test {};
using StorageTypes = ::testing::Types<float, Bf16, Fp16>;
TYPED_TEST_SUITE(GptTiedHostTest, StorageTypes);

struct TiedCase {
  GptShape shape;
  int B, T;
};
std::vector<TiedCase> TiedCases() {
  return {{TiedShape(256, 16, 2, 2, 16), 3, 16}, {TiedShape(97, 72, 3, 3, 48), 2, 67}};
}

// The engine's buffers (tied_params = the embedding chunk, tied_grads a separate region)
// through GptModel on the host device give the kernels' numbers bit for bit.
TYPED_TEST(GptTiedHostTest, WholeModelRunsTheTiedHostKernelsBitForBit) {
  using S = TypeParam;
  HostDevice host = MakeHostDevice();
  for (const TiedCase& c : TiedCases()) {
    SCOPED_TRACE("C=" + std::to_string(c.shape.channels) + " T=" + std::to_string(c.T));
    const Model<S> m = CastModel<S>(RandomModel(c.shape, 71));
    const std::vector<int32_t> tokens = RandomTokens(c.B * c.T, c.shape.vocab_size, 72);
    const std::vector<int32_t> targets = RandomTokens(c.B * c.T, c.shape.vocab_size, 73);
    Runner<S> kernels(c.shape, c.B, c.T);
    std::vector<std::vector<S>> grads;
    std::vector<S> dx0;
    const float loss = kernels.Backward(m, tokens, targets, &grads, &dx0);

    auto model = GptModel::Create(c.shape);
    ASSERT_TRUE(model.ok());
    auto run = ModelRun<S>::Create(**model, *host.device, {c.B, c.T});
    ASSERT_TRUE(run.ok()) << run.status().ToString();
    const StatusOr<ModelRunResult<S>> r = (*run)->ForwardBackward(*host.stream, m, tokens, targets);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(std::memcmp(&r->loss, &loss, sizeof(float)), 0) << r->loss << " vs " << loss;
    for (size_t b = 0; b < grads.size(); ++b) {
      EXPECT_TRUE(SameBits(r->grads[b], grads[b])) << BlockName(c.shape, b);
    }
    EXPECT_TRUE(SameBits(r->tied_grads.back(), kernels.head_tied_grads())) << "head tied_grads";
    EXPECT_TRUE(SameBits(r->dx0, dx0));
    EXPECT_TRUE(SameBits(r->logits, kernels.logits()));
  }
}

// In S against double on the same S-rounded parameters, within the whole-model bound of the
// untied model (the tied head has the same roundings: its product reads wte transposed).
TYPED_TEST(GptTiedHostTest, WholeModelIsWithinItsPathBoundOfDouble) {
  using S = TypeParam;
  for (const TiedCase& c : TiedCases()) {
    SCOPED_TRACE("C=" + std::to_string(c.shape.channels) + " T=" + std::to_string(c.T));
    const Model<double> md = RandomModel(c.shape, 61);
    const std::vector<int32_t> tokens = RandomTokens(c.B * c.T, c.shape.vocab_size, 62);
    const std::vector<int32_t> targets = RandomTokens(c.B * c.T, c.shape.vocab_size, 63);
    Runner<S> rs(c.shape, c.B, c.T);
    Runner<double> rd(c.shape, c.B, c.T);
    std::vector<std::vector<S>> gs;
    std::vector<std::vector<double>> gd;
    std::vector<S> dxs;
    std::vector<double> dxd;
    const double loss_s = rs.Backward(CastModel<S>(md), tokens, targets, &gs, &dxs);
    const double loss_d = rd.Backward(RoundedModel<S>(md), tokens, targets, &gd, &dxd);
    const test_model::WholeModelBound bound = test_model::WholeModelBoundFor<S>(c.shape, c.B, c.T);
    ExpectWithinBound("loss", {loss_s}, {loss_d}, bound.loss_k, bound.eps);
    ExpectWithinBound("head dwte", ToDoubles(rs.head_tied_grads()), rd.head_tied_grads(),
                      bound.grad_k, bound.eps);
    for (size_t b = 0; b < gd.size(); ++b) {
      ExpectWithinBound(BlockName(c.shape, b), ToDoubles(gs[b]), gd[b], bound.grad_k, bound.eps);
    }
  }
}

TEST(GptTiedBuffers, TheTiedHeadRefusesMissingOrMistypedTiedBuffersNamingThem) {
  HostDevice host = MakeHostDevice();
  const GptShape s = TiedShape(256, 16, 2, 2, 16);
  auto model = GptModel::Create(s);
  ASSERT_TRUE(model.ok());
  auto run = ModelRun<float>::Create(**model, *host.device, {2, 7});
  ASSERT_TRUE(run.ok()) << run.status().ToString();
  ASSERT_TRUE((*run)
                  ->Upload(*host.stream, CastModel<float>(RandomModel(s, 5)),
                           RandomTokens(14, s.vocab_size, 6), RandomTokens(14, s.vocab_size, 7))
                  .ok());
  const int head = (*model)->num_blocks() - 1;
  auto expect_refused = [&](const Status& st, const std::string& word) {
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
    EXPECT_NE(st.message().find(word), std::string::npos) << st.ToString();
  };
  engine::BlockBuffers f = (*run)->ForwardBuffers(head);
  f.tied_params = {};
  expect_refused((*model)->Forward(head, f, *host.stream), "tied_params");
  f = (*run)->ForwardBuffers(head);
  f.tied_params.num_elems -= 1;
  expect_refused((*model)->Forward(head, f, *host.stream), "tied_params");
  engine::BlockBuffers b = (*run)->BackwardBuffers(head);
  b.tied_grads = {};
  expect_refused((*model)->Backward(head, b, *host.stream), "tied_grads");
  b = (*run)->BackwardBuffers(head);
  b.tied_grads.dtype = DType::kBF16;
  expect_refused((*model)->Backward(head, b, *host.stream), "tied_grads");
  EXPECT_TRUE(host.stream->Synchronize().ok());
}

}  // namespace
}  // namespace strata::models

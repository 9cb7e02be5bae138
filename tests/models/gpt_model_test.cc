// GptModel (models/gpt.h) on the host device, through engine::Model with typed BlockBuffers as
// the engine lays them out (tests/models/gpt_model_run.h):
//   - the whole model runs the host kernels bit for bit, in fp32, bf16 and fp16;
//   - the host half of the CUDA whole-model bound (gpt_cuda_test.cc): on the cases the GPU test
//     runs, the host's result in S is within the whole-model bound of double;
//   - Forward and Backward refuse buffers of the wrong dtype, a too-small scratch and missing
//     gradients with kInvalidArgument naming the buffer, before enqueuing anything.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "engine/plan/model.h"
#include "gpu/device.h"
#include "models/gpt.h"
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
using test_model::WholeModelCase;

std::string CaseName(const WholeModelCase& c) {
  return "layers=" + std::to_string(c.shape.num_layers) + " C=" + std::to_string(c.shape.channels) +
         " B=" + std::to_string(c.B) + " T=" + std::to_string(c.T);
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

std::unique_ptr<GptModel> MakeModel(const GptShape& s) {
  auto model = GptModel::Create(s);
  STRATA_CHECK_MSG(model.ok(), model.status().ToString());
  return std::move(*model);
}

template <typename S>
bool AllFinite(const std::vector<S>& v) {
  return std::all_of(v.begin(), v.end(), [](S x) { return std::isfinite(ToFloat(x)); });
}

template <typename T>
bool SameBits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

template <typename S>
class GptModelHostTest : public ::testing::Test {};
using StorageTypes = ::testing::Types<float, Bf16, Fp16>;
TYPED_TEST_SUITE(GptModelHostTest, StorageTypes);

// The host blocks are the kernels of gpt_kernels.h run as host functions on the stream; the
// model's chaining, the shared scratch of the largest block and the typed views change nothing.
TYPED_TEST(GptModelHostTest, WholeModelRunsTheHostKernelsBitForBit) {
  using S = TypeParam;
  HostDevice host = MakeHostDevice();
  for (const WholeModelCase& c : test_model::WholeModelCases()) {
    SCOPED_TRACE(CaseName(c));
    const Model<S> m = CastModel<S>(RandomModel(c.shape, 81));
    const std::vector<int32_t> tokens = RandomTokens(c.B * c.T, c.shape.vocab_size, 82);
    const std::vector<int32_t> targets = RandomTokens(c.B * c.T, c.shape.vocab_size, 83);
    Runner<S> kernels(c.shape, c.B, c.T);
    std::vector<std::vector<S>> grads;
    std::vector<S> dx0;
    const float loss = kernels.Backward(m, tokens, targets, &grads, &dx0);

    const std::unique_ptr<GptModel> model = MakeModel(c.shape);
    auto run = ModelRun<S>::Create(*model, *host.device, {c.B, c.T});
    ASSERT_TRUE(run.ok()) << run.status().ToString();
    const StatusOr<ModelRunResult<S>> r = (*run)->ForwardBackward(*host.stream, m, tokens, targets);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(std::memcmp(&r->loss, &loss, sizeof(float)), 0) << r->loss << " vs " << loss;
    EXPECT_TRUE(std::isfinite(loss) && loss > 1.0f) << loss;
    ASSERT_EQ(r->grads.size(), grads.size());
    for (size_t b = 0; b < grads.size(); ++b) {
      EXPECT_TRUE(SameBits(r->grads[b], grads[b])) << BlockName(c.shape, b);
      EXPECT_TRUE(AllFinite(grads[b])) << BlockName(c.shape, b) << ": unwritten (NaN) gradients";
    }
    EXPECT_TRUE(SameBits(r->dx0, dx0)) << "d(embedding output)";
    EXPECT_TRUE(SameBits(r->logits, kernels.logits())) << "last-position logits";
    EXPECT_TRUE(AllFinite(r->logits)) << "unwritten (NaN) logits";
  }
}

// |got - ref| <= k eps (|ref| + rms(ref)) element by element; returns max |got - ref| / bound.
double ExpectWithinBound(const std::string& what, const std::vector<double>& got,
                         const std::vector<double>& ref, double k, double eps) {
  EXPECT_EQ(got.size(), ref.size()) << what;
  double sum = 0;
  for (double x : ref) sum += x * x;
  const double rms = ref.empty() ? 0 : std::sqrt(sum / static_cast<double>(ref.size()));
  double worst = 0;
  int failures = 0;
  for (size_t i = 0; i < ref.size() && i < got.size(); ++i) {
    const double bound = k * eps * (std::abs(ref[i]) + rms);
    const double err = std::abs(got[i] - ref[i]);
    if (bound > 0) worst = std::max(worst, err / bound);
    if (!(err <= bound) && ++failures <= 5) {
      ADD_FAILURE() << what << "[" << i << "]: got " << got[i] << " reference " << ref[i]
                    << " error " << err << " bound " << bound;
    }
  }
  EXPECT_EQ(failures, 0) << what << ": " << failures << " elements out of bounds";
  return worst;
}

std::vector<double> Slice(const std::vector<double>& v, const TensorInfo& t) {
  return {v.begin() + t.offset, v.begin() + t.offset + t.num_elems};
}

// The host in S against double on the same S-rounded parameters, within the whole-model bound
// (test_model::WholeModelBoundFor), on the cases the CUDA whole-model test runs: that test holds
// the CUDA run to the same bound and the difference of the two runs to twice it, so this is the
// host's half, checked where CI runs. The worst error over the bound goes to the XML report.
TYPED_TEST(GptModelHostTest, WholeModelIsWithinItsPathBoundOfDouble) {
  using S = TypeParam;
  double worst = 0;
  for (const WholeModelCase& c : test_model::WholeModelCases()) {
    SCOPED_TRACE(CaseName(c));
    const Model<double> md = RandomModel(c.shape, 81);
    const std::vector<int32_t> tokens = RandomTokens(c.B * c.T, c.shape.vocab_size, 82);
    const std::vector<int32_t> targets = RandomTokens(c.B * c.T, c.shape.vocab_size, 83);
    Runner<S> rs(c.shape, c.B, c.T);
    Runner<double> rd(c.shape, c.B, c.T);
    std::vector<std::vector<S>> gs;
    std::vector<std::vector<double>> gd;
    std::vector<S> dxs;
    std::vector<double> dxd;
    const double loss_s = rs.Backward(CastModel<S>(md), tokens, targets, &gs, &dxs);
    const Model<double> rounded = RoundedModel<S>(md);
    const double loss_d = rd.Backward(rounded, tokens, targets, &gd, &dxd);
    const test_model::WholeModelBound bound = test_model::WholeModelBoundFor<S>(c.shape, c.B, c.T);
    worst = std::max(worst, ExpectWithinBound("loss", {loss_s}, {loss_d}, bound.loss_k, bound.eps));
    // attn_qkv_w and attn_qkv_b add the magnitude of the attention backward's cancelling terms
    // (test_model::AttentionQkvTerms, terms_bound.h; the key bias and, at T = 1, q and k).
    for (size_t b = 0; b < gd.size(); ++b) {
      const std::vector<double> g = ToDoubles(gs[b]);
      const bool layer = b >= 1 && b <= static_cast<size_t>(c.shape.num_layers);
      const int l = static_cast<int>(b) - 1;
      const std::vector<double> terms =
          layer ? test_model::AttentionQkvTerms(c.shape, rounded.blocks[b], rd.layer_input(l),
                                                rd.layer_output_grad(l), c.B, c.T)
                : std::vector<double>(g.size(), 0.0);
      for (const TensorInfo& t : BlockTensors(c.shape, b)) {
        worst = std::max(worst, terms_bound::ExpectWithinTermsBound(
                                    BlockName(c.shape, b) + ".d" + t.name, Slice(g, t),
                                    Slice(gd[b], t), Slice(terms, t), bound.grad_k, bound.eps));
      }
    }
    worst = std::max(worst, ExpectWithinBound("d(embedding output)", ToDoubles(dxs), dxd,
                                              bound.grad_k, bound.eps));
  }
  ::testing::Test::RecordProperty("worst_error_over_bound", std::to_string(worst));
}

// ---------------------------------------------------------------------------
// Buffer checks: kInvalidArgument naming the buffer, nothing enqueued.

class GptModelBuffersTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto s = GptPreset("tiny");
    ASSERT_TRUE(s.ok());
    model_ = MakeModel(*s);
    auto run = ModelRun<float>::Create(*model_, *host_.device, {2, 7});
    ASSERT_TRUE(run.ok()) << run.status().ToString();
    run_ = std::move(*run);
    const Status st =
        run_->Upload(*host_.stream, CastModel<float>(RandomModel(*s, 91)),
                     RandomTokens(14, s->vocab_size, 92), RandomTokens(14, s->vocab_size, 93));
    ASSERT_TRUE(st.ok()) << st.ToString();
  }
  // Refused with kInvalidArgument, the message naming each of `words`; the stream stays clean.
  void ExpectRefused(const Status& st, std::initializer_list<std::string> words) {
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
    for (const std::string& w : words) {
      EXPECT_NE(st.message().find(w), std::string::npos) << st.ToString() << " lacks " << w;
    }
    const Status sync = host_.stream->Synchronize();
    EXPECT_TRUE(sync.ok()) << sync.ToString();
  }
  int head() const { return model_->num_blocks() - 1; }

  HostDevice host_ = MakeHostDevice();
  std::unique_ptr<GptModel> model_;
  std::unique_ptr<ModelRun<float>> run_;
};

TEST_F(GptModelBuffersTest, TheEngineLayoutIsAccepted) {
  for (int b = 0; b <= head(); ++b) {
    EXPECT_TRUE(model_->Forward(b, run_->ForwardBuffers(b), *host_.stream).ok()) << b;
  }
  for (int b = head(); b >= 0; --b) {
    EXPECT_TRUE(model_->Backward(b, run_->BackwardBuffers(b), *host_.stream).ok()) << b;
  }
  EXPECT_TRUE(host_.stream->Synchronize().ok());
}

TEST_F(GptModelBuffersTest, ForwardRefusesABufferOfTheWrongDtypeNamingIt) {
  gpu::Stream& stream = *host_.stream;
  engine::BlockBuffers b = run_->ForwardBuffers(1);
  b.x_in.dtype = DType::kBF16;
  ExpectRefused(model_->Forward(1, b, stream), {"x_in", "bf16", "fp32"});
  b = run_->ForwardBuffers(1);
  b.x_out.dtype = DType::kF16;
  ExpectRefused(model_->Forward(1, b, stream), {"x_out", "fp16"});
  b = run_->ForwardBuffers(0);
  b.params.dtype = DType::kBF16;
  ExpectRefused(model_->Forward(0, b, stream), {"params", "bf16"});
  b = run_->ForwardBuffers(head());
  b.logits.dtype = DType::kF16;
  ExpectRefused(model_->Forward(head(), b, stream), {"logits", "fp16"});
  // Every buffer fp32 but the working precision bf16: the first buffer checked is named.
  b = run_->ForwardBuffers(1);
  b.precision = DType::kBF16;
  ExpectRefused(model_->Forward(1, b, stream), {"params", "working precision is bf16"});
}

TEST_F(GptModelBuffersTest, BackwardRefusesABufferOfTheWrongDtypeNamingIt) {
  engine::BlockBuffers b = run_->BackwardBuffers(1);
  b.dx_out.dtype = DType::kBF16;
  ExpectRefused(model_->Backward(1, b, *host_.stream), {"dx_out", "bf16"});
  b = run_->BackwardBuffers(1);
  b.grads.dtype = DType::kF16;
  ExpectRefused(model_->Backward(1, b, *host_.stream), {"grads", "fp16"});
}

TEST_F(GptModelBuffersTest, TooSmallScratchIsRefusedForEveryBlock) {
  for (int block = 0; block <= head(); ++block) {
    SCOPED_TRACE(model_->block_name(block));
    const int64_t need = model_->scratch_bytes(block, {2, 7}, DType::kF32);
    ASSERT_GT(need, 0);
    engine::BlockBuffers f = run_->ForwardBuffers(block), b = run_->BackwardBuffers(block);
    f.scratch = f.scratch.subspan(0, static_cast<size_t>(need) - 1);
    b.scratch = f.scratch;
    ExpectRefused(model_->Forward(block, f, *host_.stream), {"scratch", std::to_string(need)});
    ExpectRefused(model_->Backward(block, b, *host_.stream), {"scratch", std::to_string(need)});
  }
}

TEST_F(GptModelBuffersTest, BackwardWithoutGradientsIsRefused) {
  for (int block = 0; block <= head(); ++block) {
    SCOPED_TRACE(model_->block_name(block));
    engine::BlockBuffers b = run_->BackwardBuffers(block);
    b.grads = {};
    ExpectRefused(model_->Backward(block, b, *host_.stream), {"grads", "missing"});
  }
}

TEST_F(GptModelBuffersTest, TooFewElementsAreRefusedNamingTheBuffer) {
  engine::BlockBuffers b = run_->BackwardBuffers(1);
  b.dx_in.num_elems -= 1;
  ExpectRefused(model_->Backward(1, b, *host_.stream), {"dx_in", "elements"});
}

}  // namespace
}  // namespace strata::models

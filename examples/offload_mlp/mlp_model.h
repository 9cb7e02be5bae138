// A deep residual MLP on a synthetic regression task, written as a strata::engine::Model: the
// example of a user-defined model trained by the engine (see main.cc).
//
// The task. The data set is num_samples points (x_n, y_n), n = 0 .. num_samples - 1, made from n
// alone: x_n in [-1, 1]^input_dim from a hash of (n, j), and y_n = Teacher(x_n), a fixed smooth
// function. The engine's interface is shaped for token models, so a sample id plays the token:
// tokens[n] = targets[n] = n, vocab_size() = num_samples. Every position of a (B, T) micro-batch
// is one sample, handled independently (the MLP mixes nothing across positions).
//
// The blocks (one contiguous parameter chunk each; C = width, D = input_dim):
//   0        "input"    h = tanh(x W + b)          W (D, C) row-major, then b (C)
//   1 .. L   "layerL"   h = h + tanh(h W + b)      W (C, C) row-major, then b (C)
//   L + 1    "head"     y_hat = h . w + b          w (C), then b (1)
// The loss is the mean squared error over the B*T positions, fp32. Boundary activations h are
// (B, T, C) in the engine's working precision (fp32, fp16 or bf16); inside a block everything is
// computed in fp32 and rounded once when stored. The head's "logits" (the interface's (B, V)
// buffer) hold the prediction of each sequence's last position in column 0 and zeros elsewhere.
//
// The kernels are plain host loops run with Stream::LaunchHost: the model runs on the host
// device backend only (gpu::CreateHostDevice); on another backend Forward and Backward return
// kUnimplemented. Thread-safety: the const methods may be called from any thread; Forward and
// Backward from the engine's driving thread (the work then runs on the stream's thread).
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "base/dtype.h"
#include "base/status.h"
#include "engine/plan/model.h"
#include "gpu/device.h"

namespace offload_mlp {

struct MlpConfig {
  int input_dim = 16;      // D
  int width = 256;         // C
  int hidden_layers = 8;   // L residual blocks
  int num_samples = 1024;  // size of the synthetic data set (the "vocabulary")
  int max_positions = 64;  // T at most
};

// y = Teacher(x) for x of input_dim values: sin(2 a.x) + 0.5 x0 x1, a a fixed unit vector.
float Teacher(std::span<const float> x);
// x_n[j] in [-1, 1], deterministic.
float Feature(int64_t sample, int j, int input_dim);

class MlpRegressor final : public strata::engine::Model {
 public:
  explicit MlpRegressor(const MlpConfig& config) : c_(config) {}

  std::string description() const override;
  int num_blocks() const override { return c_.hidden_layers + 2; }
  std::string block_name(int block) const override;
  int64_t block_num_params(int block) const override;
  int64_t activation_elems(strata::engine::MicroBatchShape s) const override {
    return s.tokens() * c_.width;
  }
  int64_t logits_elems(strata::engine::MicroBatchShape s) const override {
    return int64_t{s.batch_size} * c_.num_samples;
  }
  int vocab_size() const override { return c_.num_samples; }
  int max_seq_len() const override { return c_.max_positions; }
  int64_t scratch_bytes(int block, strata::engine::MicroBatchShape s,
                        strata::DType precision) const override;
  strata::Status InitParams(int block, uint64_t seed, std::span<float> out) const override;
  strata::Status Forward(int block, const strata::engine::BlockBuffers& b,
                         strata::gpu::Stream& stream) override;
  strata::Status Backward(int block, const strata::engine::BlockBuffers& b,
                          strata::gpu::Stream& stream) override;

 private:
  strata::Status Launch(int block, const strata::engine::BlockBuffers& b,
                        strata::gpu::Stream& stream, bool backward);
  int fan_in(int block) const { return block == 0 ? c_.input_dim : c_.width; }
  bool is_head(int block) const { return block == num_blocks() - 1; }

  MlpConfig c_;
};

}  // namespace offload_mlp

#include "mlp_model.h"

#include <algorithm>
#include <cmath>

namespace offload_mlp {
namespace {

using strata::DType;
using strata::FromFloat;
using strata::Status;
using strata::ToFloat;
using strata::engine::BlockBuffers;

// Uniform in [-1, 1) from a 64-bit key (the splitmix64 finalizer).
float HashUniform(uint64_t key) {
  key += 0x9e3779b97f4a7c15ull;
  key = (key ^ (key >> 30)) * 0xbf58476d1ce4e5b9ull;
  key = (key ^ (key >> 27)) * 0x94d049bb133111ebull;
  key ^= key >> 31;
  return static_cast<float>(key >> 40) / static_cast<float>(1 << 23) - 1.0f;
}

// What one block's kernel sees, all host-addressable on the host backend. The scratch holds fp32
// copies: w (fan_in + 1, C) = the block's weights and bias widened, x (N, fan_in) its input
// widened, t (N, C) the tanh outputs (then their gradients), dw (fan_in + 1, C) the weight
// gradients before rounding.
struct Kernel {
  int rows = 0;  // N = B * T positions
  int fan_in = 0;
  int width = 0;  // C
  int input_dim = 0;
  bool residual = false;
  float* w = nullptr;
  float* x = nullptr;
  float* t = nullptr;
  float* dw = nullptr;
};

// Fills k.w, k.x and computes t = tanh(x W + b) for a hidden block ("input" or "layerL").
template <typename S>
void HiddenForward(const Kernel& k, const S* params, const S* x_in, const int32_t* tokens) {
  const int64_t n_w = int64_t{k.fan_in + 1} * k.width;
  for (int64_t i = 0; i < n_w; ++i) k.w[i] = ToFloat(params[i]);
  for (int n = 0; n < k.rows; ++n) {
    float* x = k.x + int64_t{n} * k.fan_in;
    for (int j = 0; j < k.fan_in; ++j) {
      x[j] = x_in ? ToFloat(x_in[int64_t{n} * k.fan_in + j]) : Feature(tokens[n], j, k.input_dim);
    }
    float* z = k.t + int64_t{n} * k.width;
    const float* bias = k.w + int64_t{k.fan_in} * k.width;
    std::copy(bias, bias + k.width, z);
    for (int j = 0; j < k.fan_in; ++j) {  // z += x[j] * W[j, :], a row of W at a time
      const float* w_row = k.w + int64_t{j} * k.width;
      for (int i = 0; i < k.width; ++i) z[i] += x[j] * w_row[i];
    }
    for (int i = 0; i < k.width; ++i) z[i] = std::tanh(z[i]);
  }
}

template <typename S>
Status HiddenBlock(const Kernel& k, const BlockBuffers& b, bool backward) {
  HiddenForward<S>(k, b.params.as<S>(), b.x_in.as<S>(), b.tokens);
  const int64_t act = int64_t{k.rows} * k.width;
  if (!backward) {  // h_out = (h_in +) t
    S* out = b.x_out.as<S>();
    for (int64_t e = 0; e < act; ++e) out[e] = FromFloat<S>((k.residual ? k.x[e] : 0.0f) + k.t[e]);
    return Status::Ok();
  }
  // g = dh_out * (1 - t^2); dW = x^T g; db = sum_n g; dh_in = dh_out (residual) + g W^T.
  const S* dout = b.dx_out.as<S>();
  for (int64_t e = 0; e < act; ++e) k.t[e] = ToFloat(dout[e]) * (1.0f - k.t[e] * k.t[e]);
  const int64_t n_w = int64_t{k.fan_in + 1} * k.width;
  std::fill(k.dw, k.dw + n_w, 0.0f);
  float* db = k.dw + int64_t{k.fan_in} * k.width;
  for (int n = 0; n < k.rows; ++n) {
    const float* g = k.t + int64_t{n} * k.width;
    const float* x = k.x + int64_t{n} * k.fan_in;
    for (int j = 0; j < k.fan_in; ++j) {
      float* dw_row = k.dw + int64_t{j} * k.width;
      for (int i = 0; i < k.width; ++i) dw_row[i] += x[j] * g[i];
    }
    for (int i = 0; i < k.width; ++i) db[i] += g[i];
  }
  S* grads = b.grads.as<S>();
  for (int64_t i = 0; i < n_w; ++i) grads[i] = FromFloat<S>(k.dw[i]);
  if (b.dx_in.empty()) return Status::Ok();  // the first block has no input gradient
  S* din = b.dx_in.as<S>();
  for (int n = 0; n < k.rows; ++n) {
    const float* g = k.t + int64_t{n} * k.width;
    for (int j = 0; j < k.fan_in; ++j) {
      const float* w_row = k.w + int64_t{j} * k.width;
      float s = k.residual ? ToFloat(dout[int64_t{n} * k.width + j]) : 0.0f;
      for (int i = 0; i < k.width; ++i) s += w_row[i] * g[i];
      din[int64_t{n} * k.fan_in + j] = FromFloat<S>(s);
    }
  }
  return Status::Ok();
}

// The head: y_hat = h . w + b; loss = mean (y_hat - y)^2. Scratch: k.t holds y_hat (N), then y (N).
template <typename S>
Status HeadBlock(const Kernel& k, const BlockBuffers& b, int num_samples, bool backward) {
  const S* params = b.params.as<S>();
  const S* h = b.x_in.as<S>();
  const int c = k.width;
  for (int i = 0; i <= c; ++i) k.w[i] = ToFloat(params[i]);
  float* y_hat = k.t;
  float* y = k.t + k.rows;
  float sum_sq = 0;
  for (int n = 0; n < k.rows; ++n) {
    float s = k.w[c];
    for (int i = 0; i < c; ++i) s += ToFloat(h[int64_t{n} * c + i]) * k.w[i];
    y_hat[n] = s;
    if (b.targets == nullptr) continue;
    float x[64];  // input_dim <= 64 (MlpRegressor checks)
    for (int j = 0; j < k.input_dim; ++j) x[j] = Feature(b.targets[n], j, k.input_dim);
    y[n] = Teacher({x, static_cast<size_t>(k.input_dim)});
    sum_sq += (s - y[n]) * (s - y[n]);
  }
  if (!backward) {
    if (b.targets != nullptr && b.loss != nullptr) *b.loss = sum_sq / static_cast<float>(k.rows);
    // (B, V) "logits": the last position's prediction in column 0.
    S* logits = b.logits.as<S>();
    const int t_len = b.shape.seq_len;
    for (int s = 0; s < b.shape.batch_size; ++s) {
      S* row = logits + int64_t{s} * num_samples;
      std::fill(row, row + num_samples, FromFloat<S>(0.0f));
      row[0] = FromFloat<S>(y_hat[int64_t{s} * t_len + t_len - 1]);
    }
    return Status::Ok();
  }
  // d loss / d y_hat[n] = 2 (y_hat - y) / N, times dloss (the engine's scale).
  std::fill(k.dw, k.dw + c + 1, 0.0f);
  S* din = b.dx_in.as<S>();
  for (int n = 0; n < k.rows; ++n) {
    const float d = b.dloss * 2.0f * (y_hat[n] - y[n]) / static_cast<float>(k.rows);
    for (int i = 0; i < c; ++i) {
      k.dw[i] += d * ToFloat(h[int64_t{n} * c + i]);
      din[int64_t{n} * c + i] = FromFloat<S>(d * k.w[i]);
    }
    k.dw[c] += d;
  }
  S* grads = b.grads.as<S>();
  for (int i = 0; i <= c; ++i) grads[i] = FromFloat<S>(k.dw[i]);
  return Status::Ok();
}

}  // namespace

float Feature(int64_t sample, int j, int input_dim) {
  return HashUniform(static_cast<uint64_t>(sample) * static_cast<uint64_t>(input_dim) + j);
}

float Teacher(std::span<const float> x) {
  // a: a fixed direction (hash of j), normalized.
  float norm = 0, dot = 0;
  for (size_t j = 0; j < x.size(); ++j) {
    const float a = HashUniform(0xa11ce000ull + j);
    norm += a * a;
    dot += a * x[j];
  }
  const float cross = x.size() >= 2 ? 0.5f * x[0] * x[1] : 0.0f;
  return std::sin(2.0f * dot / std::sqrt(norm)) + cross;
}

std::string MlpRegressor::description() const {
  return "residual MLP regressor: input " + std::to_string(c_.input_dim) + ", " +
         std::to_string(c_.hidden_layers) + " layers of width " + std::to_string(c_.width) + ", " +
         std::to_string(num_params()) + " parameters";
}

std::string MlpRegressor::block_name(int block) const {
  if (block == 0) return "input";
  if (is_head(block)) return "head";
  return "layer" + std::to_string(block);
}

int64_t MlpRegressor::block_num_params(int block) const {
  if (is_head(block)) return c_.width + 1;
  return int64_t{fan_in(block) + 1} * c_.width;
}

int64_t MlpRegressor::scratch_bytes(int block, strata::engine::MicroBatchShape s,
                                    DType precision) const {
  const int64_t rows = s.tokens();
  if (is_head(block)) return (2 * int64_t{c_.width + 1} + 2 * rows) * 4;  // w, dw, y_hat, y
  const int64_t weights = int64_t{fan_in(block) + 1} * c_.width;
  return (2 * weights + rows * fan_in(block) + rows * c_.width) * 4;  // w, dw, x, t
}

Status MlpRegressor::InitParams(int block, uint64_t seed, std::span<float> out) const {
  if (static_cast<int64_t>(out.size()) != block_num_params(block)) {
    return strata::InvalidArgumentError("InitParams: wrong chunk size for " + block_name(block));
  }
  // Weights uniform in +-sqrt(3 / fan_in) (unit variance through a linear map); the residual
  // branches and the head start smaller so the sum over layers stays near unit scale. Biases 0.
  const int64_t num_weights = is_head(block) ? c_.width : int64_t{fan_in(block)} * c_.width;
  float scale = std::sqrt(3.0f / static_cast<float>(is_head(block) ? c_.width : fan_in(block)));
  if (block > 0) scale *= 0.5f;
  const uint64_t key = (seed * 1000003ull + static_cast<uint64_t>(block)) << 32;
  for (int64_t i = 0; i < num_weights; ++i) out[i] = scale * HashUniform(key + i);
  std::fill(out.begin() + num_weights, out.end(), 0.0f);
  return Status::Ok();
}

Status MlpRegressor::Forward(int block, const BlockBuffers& b, strata::gpu::Stream& stream) {
  return Launch(block, b, stream, /*backward=*/false);
}

Status MlpRegressor::Backward(int block, const BlockBuffers& b, strata::gpu::Stream& stream) {
  return Launch(block, b, stream, /*backward=*/true);
}

Status MlpRegressor::Launch(int block, const BlockBuffers& b, strata::gpu::Stream& stream,
                            bool backward) {
  // The engine hands every buffer; check them (sizes, dtypes, roles) before enqueuing anything.
  STRATA_RETURN_IF_ERROR(strata::engine::CheckBlockBuffers(*this, block, b, backward));
  if (stream.device_kind() != strata::gpu::DeviceKind::kHost) {
    return strata::UnimplementedError("offload_mlp runs on the host device backend only");
  }
  if (c_.input_dim < 2 || c_.input_dim > 64) {
    return strata::InvalidArgumentError("offload_mlp: input_dim must be in [2, 64]");
  }
  Kernel k;
  k.rows = static_cast<int>(b.shape.tokens());
  k.fan_in = fan_in(block);
  k.width = c_.width;
  k.input_dim = c_.input_dim;
  k.residual = block > 0;
  float* scratch = b.scratch.as<float>();
  const int64_t weights = is_head(block) ? c_.width + 1 : int64_t{k.fan_in + 1} * c_.width;
  k.w = scratch;
  k.dw = k.w + weights;
  k.x = k.dw + weights;
  k.t = is_head(block) ? k.x : k.x + int64_t{k.rows} * k.fan_in;
  const int num_samples = c_.num_samples;
  const bool head = is_head(block);
  // The work runs later, in stream order, on the stream's thread: capture by value.
  return strata::DispatchDType(b.precision, [&]<typename S>() {
    return stream.LaunchHost([k, b, head, num_samples, backward]() -> Status {
      return head ? HeadBlock<S>(k, b, num_samples, backward) : HiddenBlock<S>(k, b, backward);
    });
  });
}

}  // namespace offload_mlp

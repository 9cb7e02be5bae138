#include "models/llama.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>

#include "models/cuda/llama_cuda.h"
#include "models/decoder_model_impl.h"
#include "models/llama_kernels.h"

namespace strata::models {

namespace {

LlamaConfig Llama2(int vocab, int C, int I, int layers, int heads, int kv_heads, int context) {
  LlamaConfig c;
  c.vocab_size = vocab;
  c.hidden_size = C;
  c.intermediate_size = I;
  c.num_layers = layers;
  c.num_heads = heads;
  c.num_kv_heads = kv_heads;
  c.head_dim = C / heads;
  c.max_seq_len = context;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 10000.0;
  c.tie_embeddings = false;
  return c;
}

// Meta-Llama-3-70B's published config.json: 80 layers, 8192 channels, 64 heads, 8 key/value
// heads, MLP 28672, vocabulary 128256, context 8192, rope_theta 500000, untied: 70.55e9 params.
LlamaConfig Llama3_70B() {
  LlamaConfig c = Llama2(128256, 8192, 28672, 80, 64, 8, 8192);
  c.rope_theta = 500000.0;
  return c;
}

// The other families' published config.json files (Hugging Face Hub, the base models): the
// shape, theta, eps and tying; their options as LlamaConfig holds them.
LlamaConfig Family(LlamaArch arch, int vocab, int C, int I, int layers, int heads, int kv_heads,
                   int head_dim, int context, double theta, double eps, bool tied) {
  LlamaConfig c = Llama2(vocab, C, I, layers, heads, kv_heads, context);
  c.arch = arch;
  c.head_dim = head_dim;
  c.rope_theta = theta;
  c.rms_norm_eps = eps;
  c.tie_embeddings = tied;
  c.qkv_bias = arch == LlamaArch::kQwen2;
  c.qk_norm = arch == LlamaArch::kQwen3;
  return c;
}

// Mistral-7B-v0.1: a 4096-token window on every layer.
LlamaConfig Mistral7B() {
  LlamaConfig c =
      Family(LlamaArch::kMistral, 32000, 4096, 14336, 32, 32, 8, 128, 32768, 10000.0, 1e-5, false);
  c.sliding_window = 4096;
  c.sliding_layers.assign(c.num_layers, true);
  return c;
}

// Gemma 3 text models: (1 + w) and sandwich norms, GeGLU, q/k norms, embeddings times
// sqrt(hidden), every sixth layer global (rope_theta 1e6, linear scaling), the others sliding
// (rope_local_base_freq 1e4); tied.
LlamaConfig Gemma3(int vocab, int C, int I, int layers, int heads, int kv_heads, int head_dim,
                   int context, double query_pre_attn_scalar, int window, double linear_factor) {
  LlamaConfig c = Family(LlamaArch::kGemma3, vocab, C, I, layers, heads, kv_heads, head_dim,
                         context, 1e6, 1e-6, true);
  c.qk_norm = c.norm_unit_offset = c.sandwich_norms = c.gelu_tanh_mlp = true;
  c.embed_scale = std::sqrt(static_cast<double>(C));
  c.query_pre_attn_scalar = query_pre_attn_scalar;
  c.rope_local_theta = 10000.0;
  c.rope_linear_factor = linear_factor;
  c.sliding_window = window;
  for (int i = 0; i < layers; ++i) c.sliding_layers.push_back((i + 1) % 6 != 0);
  return c;
}

// Gemma 2 models: Gemma 3's norms and MLP without q/k norms, the even layers sliding (a 4096
// window), one RoPE base (1e4), soft-capped scores (50) and logits (30); tied.
LlamaConfig Gemma2(int C, int I, int layers, int heads, int kv_heads, int head_dim,
                   double query_pre_attn_scalar) {
  LlamaConfig c = Family(LlamaArch::kGemma2, 256000, C, I, layers, heads, kv_heads, head_dim, 8192,
                         10000.0, 1e-6, true);
  c.norm_unit_offset = c.sandwich_norms = c.gelu_tanh_mlp = true;
  c.embed_scale = std::sqrt(static_cast<double>(C));
  c.query_pre_attn_scalar = query_pre_attn_scalar;
  c.attn_logit_softcapping = 50.0;
  c.final_logit_softcapping = 30.0;
  c.sliding_window = 4096;
  for (int i = 0; i < layers; ++i) c.sliding_layers.push_back(i % 2 == 0);
  return c;
}

struct Preset {
  const char* name;
  LlamaConfig config;
};

std::vector<Preset> Presets() {
  using A = LlamaArch;
  return {
      {"llama-tiny", Llama2(256, 64, 96, 2, 4, 2, 64)},
      {"llama-1b", Llama2(32000, 2048, 5632, 22, 32, 4, 2048)},
      {"llama-7b", Llama2(32000, 4096, 11008, 32, 32, 32, 4096)},
      {"llama-13b", Llama2(32000, 5120, 13824, 40, 40, 40, 4096)},
      {"llama-70b", Llama3_70B()},
      {"mistral-7b", Mistral7B()},
      {"qwen2.5-0.5b", Family(A::kQwen2, 151936, 896, 4864, 24, 14, 2, 64, 32768, 1e6, 1e-6, true)},
      {"qwen2.5-7b",
       Family(A::kQwen2, 152064, 3584, 18944, 28, 28, 4, 128, 131072, 1e6, 1e-6, false)},
      {"qwen3-0.6b", Family(A::kQwen3, 151936, 1024, 3072, 28, 16, 8, 128, 40960, 1e6, 1e-6, true)},
      {"qwen3-8b", Family(A::kQwen3, 151936, 4096, 12288, 36, 32, 8, 128, 40960, 1e6, 1e-6, false)},
      {"phi4",
       Family(A::kPhi3, 100352, 5120, 17920, 40, 40, 10, 128, 16384, 250000.0, 1e-5, false)},
      {"gemma2-2b", Gemma2(2304, 9216, 26, 8, 4, 256, 256)},
      {"gemma2-9b", Gemma2(3584, 14336, 42, 16, 8, 256, 256)},
      {"gemma3-1b", Gemma3(262144, 1152, 6912, 26, 4, 1, 256, 32768, 256, 512, 1.0)},
      {"gemma3-27b", Gemma3(262208, 5376, 21504, 62, 32, 16, 128, 131072, 168, 1024, 8.0)},
  };
}

}  // namespace

StatusOr<LlamaConfig> LlamaPreset(std::string_view name) {
  for (const Preset& p : Presets()) {
    if (name == p.name) return p.config;
  }
  return InvalidArgumentError(fmt::format("unknown llama preset '{}': choose one of {}", name,
                                          fmt::join(LlamaPresetNames(), ", ")));
}

std::vector<std::string> LlamaPresetNames() {
  std::vector<std::string> v;
  for (const Preset& p : Presets()) v.emplace_back(p.name);
  return v;
}

StatusOr<std::unique_ptr<LlamaModel>> LlamaModel::Create(
    const LlamaConfig& config, std::shared_ptr<const WeightSource> weights) {
  STRATA_RETURN_IF_ERROR(ValidateLlamaConfig(config));
  return std::unique_ptr<LlamaModel>(new LlamaModel(config, std::move(weights)));
}

std::string LlamaModel::description() const {
  const LlamaConfig& c = config();
  std::string s = fmt::format(
      "{}: {} layers, {} heads ({} key/value), {} channels, head dim {}, MLP {}, context {}, "
      "vocabulary {}",
      LlamaArchName(c.arch), c.num_layers, c.num_heads, c.num_kv_heads, c.hidden_size, c.head_dim,
      c.intermediate_size, c.max_seq_len, c.vocab_size);
  if (c.tie_embeddings) s += ", tied embeddings";
  if (c.rope_llama3) s += fmt::format(", llama3 RoPE scaling x{}", c.rope_factor);
  if (!c.rope_short_factor.empty()) {
    s += fmt::format(", LongRoPE from {} positions", c.rope_original_max_position);
  }
  if (LlamaRotaryDim(c) != c.head_dim) {
    s += fmt::format(", rotary on {} of {} head dims", LlamaRotaryDim(c), c.head_dim);
  }
  if (c.qkv_bias) s += c.o_bias ? ", q/k/v/o biases" : ", q/k/v biases";
  if (c.qk_norm) s += ", q/k norms";
  if (c.sandwich_norms) s += ", (1 + w) sandwich norms";
  if (c.gelu_tanh_mlp) s += ", GeGLU";
  int sliding = 0;
  for (int i = 0; i < c.num_layers; ++i) sliding += LlamaLayerWindow(c, i) > 0 ? 1 : 0;
  if (sliding == c.num_layers) {
    s += fmt::format(", sliding window {}", c.sliding_window);
  } else if (sliding > 0) {
    s += fmt::format(", sliding window {} on {} of {} layers", c.sliding_window, sliding,
                     c.num_layers);
  }
  return s;
}

std::vector<std::vector<int64_t>> LlamaFamily::TensorShapes(DecoderBlock kind, int layer) const {
  std::vector<LlamaTensor> tensors;
  switch (kind) {
    case DecoderBlock::kEmbedding:
      tensors = LlamaEmbeddingTensors(config);
      break;
    case DecoderBlock::kHead:
      tensors = LlamaHeadTensors(config);
      break;
    case DecoderBlock::kLayer:
      tensors = LlamaLayerTensors(config, layer);
      break;
  }
  std::vector<std::vector<int64_t>> shapes;
  for (const LlamaTensor& t : tensors) shapes.push_back(t.shape);
  return shapes;
}

int64_t LlamaFamily::NumParams(DecoderBlock kind) const {
  switch (kind) {
    case DecoderBlock::kEmbedding:
      return LlamaEmbeddingNumParams(config);
    case DecoderBlock::kHead:
      return LlamaHeadNumParams(config);
    case DecoderBlock::kLayer:
      break;
  }
  return LlamaLayerNumParams(config);
}

std::vector<LoraModule> LlamaFamily::LoraModules() const { return LlamaLoraModules(config); }

void LlamaFamily::Init(DecoderBlock kind, int layer, uint64_t seed, float* out) const {
  switch (kind) {
    case DecoderBlock::kEmbedding:
      return InitLlamaEmbeddingParams(config, seed, out);
    case DecoderBlock::kHead:
      return InitLlamaHeadParams(config, seed, out);
    case DecoderBlock::kLayer:
      return InitLlamaLayerParams(config, layer, seed, out);
  }
}

template <typename S>
int64_t LlamaFamily::HostScratchBytes(DecoderBlock kind, int B, int T) const {
  switch (kind) {
    case DecoderBlock::kEmbedding:
      return LlamaEmbeddingScratchBytes<S>(config, B, T);
    case DecoderBlock::kHead:
      return LlamaHeadScratchBytes<S>(config, B, T);
    case DecoderBlock::kLayer:
      break;
  }
  return LlamaLayerScratchBytes<S>(config, B, T);
}

template <typename S>
int64_t LlamaFamily::CudaScratchBytes(DecoderBlock kind, int B, int T) const {
  switch (kind) {
    case DecoderBlock::kEmbedding:
      return cuda::LlamaCudaEmbeddingScratchBytes<S>(config, B, T);
    case DecoderBlock::kHead:
      return cuda::LlamaCudaHeadScratchBytes<S>(config, B, T);
    case DecoderBlock::kLayer:
      break;
  }
  return cuda::LlamaCudaLayerScratchBytes<S>(config, B, T);
}

// The host blocks (llama_kernels.h).
template <typename S>
void LlamaFamily::HostEmbeddingForward(const BlockArgs<S>& a) const {
  LlamaEmbeddingForward<S>(config, a.params, a.tokens, a.B, a.T, a.x_out);
}
template <typename S>
void LlamaFamily::HostLayerForward(const BlockArgs<S>& a) const {
  LlamaLayerForward<S>(config, a.params, a.x_in, a.x_out, a.B, a.T, a.scratch, a.lora,
                       a.position_ids, a.layer, a.max_positions);
}
template <typename S>
float LlamaFamily::HostHeadForward(const BlockArgs<S>& a) const {
  return LlamaHeadForward<S>(config, a.params, a.tied_params, a.x_in, a.targets, a.B, a.T, a.logits,
                             a.scratch, a.loss_tokens, a.target_losses);
}
template <typename S>
void LlamaFamily::HostEmbeddingBackward(const BlockArgs<S>& a) const {
  LlamaEmbeddingBackward<S>(config, a.tokens, a.dx_out, a.B, a.T, a.grads, a.scratch);
}
template <typename S>
void LlamaFamily::HostLayerBackward(const BlockArgs<S>& a) const {
  LlamaLayerBackward<S>(config, a.params, a.x_in, a.dx_out, a.dx_in, a.grads, a.B, a.T, a.scratch,
                        a.lora, a.position_ids, a.forward_kept, a.layer, a.max_positions);
}
template <typename S>
void LlamaFamily::HostHeadBackward(const BlockArgs<S>& a) const {
  LlamaHeadBackward<S>(config, a.params, a.tied_params, a.x_in, a.targets, a.dloss, a.B, a.T,
                       a.dx_in, a.grads, a.tied_grads, a.scratch, a.loss_tokens, a.target_weights);
}

#ifdef STRATA_HAVE_CUDA
// The Llama CUDA blocks take every valid config up to head_dim 256 (the attention kernels').
Status LlamaFamily::CudaSupports() const {
  if (config.head_dim > cuda::kLlamaCudaMaxHeadDim) {
    return UnimplementedError(
        fmt::format("the Llama CUDA kernels take head_dim <= {}, not {}; use --device host",
                    cuda::kLlamaCudaMaxHeadDim, config.head_dim));
  }
  return Status::Ok();
}

Status LlamaFamily::CudaPrepareStream(gpu::Stream& stream) const {
  return cuda::LlamaCudaPrepareStream(stream);
}

// The CUDA blocks (models/cuda/llama_cuda.h).
template <typename S>
Status LlamaFamily::CudaEmbeddingForward(const BlockArgs<S>& a, gpu::Stream& stream) const {
  return cuda::LlamaCudaEmbeddingForward<S>(config, stream, a.params, a.tokens, a.B, a.T, a.x_out);
}
template <typename S>
Status LlamaFamily::CudaLayerForward(const BlockArgs<S>& a, gpu::Stream& stream) const {
  return cuda::LlamaCudaLayerForward<S>(config, stream, a.params, a.x_in, a.x_out, a.B, a.T,
                                        a.scratch, a.position_ids, a.lora, a.layer,
                                        a.max_positions);
}
template <typename S>
Status LlamaFamily::CudaHeadForward(const BlockArgs<S>& a, gpu::Stream& stream) const {
  return cuda::LlamaCudaHeadForward<S>(config, stream, a.params, a.tied_params, a.x_in, a.targets,
                                       a.B, a.T, a.logits, a.scratch, a.loss, a.loss_tokens,
                                       a.target_losses);
}
template <typename S>
Status LlamaFamily::CudaEmbeddingBackward(const BlockArgs<S>& a, gpu::Stream& stream) const {
  return cuda::LlamaCudaEmbeddingBackward<S>(config, stream, a.tokens, a.dx_out, a.B, a.T, a.grads,
                                             a.scratch);
}
template <typename S>
Status LlamaFamily::CudaLayerBackward(const BlockArgs<S>& a, gpu::Stream& stream) const {
  return cuda::LlamaCudaLayerBackward<S>(config, stream, a.params, a.x_in, a.dx_out, a.dx_in,
                                         a.grads, a.B, a.T, a.scratch, a.position_ids, a.lora,
                                         a.forward_kept, a.layer, a.max_positions);
}
template <typename S>
Status LlamaFamily::CudaHeadBackward(const BlockArgs<S>& a, gpu::Stream& stream) const {
  return cuda::LlamaCudaHeadBackward<S>(config, stream, a.params, a.tied_params, a.x_in, a.targets,
                                        a.dloss, a.B, a.T, a.dx_in, a.grads, a.tied_grads,
                                        a.scratch, a.loss_tokens, a.target_weights);
}
#endif

template class DecoderModel<LlamaFamily>;

}  // namespace strata::models

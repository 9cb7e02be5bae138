// LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models") for the decoder
// families, as Hugging Face PEFT applies it to a causal LM: for each targeted weight W of a layer
// (out x in) the layer computes
//
//   y = x W^T + s * dropout(x) A^T B^T,   s = lora_alpha / r,
//
// with A (r x in) and B (out x r) trained and W frozen (the engine's frozen chunk: Model::
// block_frozen_params). A starts Kaiming-uniform with a = sqrt(5) (bound 1 / sqrt(in), PEFT's
// init_lora_weights=True) and B at zero, so the first step's loss is the base model's.
//
// Where the adapters sit. A family lists its targetable modules (LoraModule): the Hugging Face
// module name (q_proj, c_attn, ...), which of the layer's products it adds to, the product's
// input width and the columns [col, col + out) of the product's output it covers (Llama's
// q_proj, k_proj, v_proj are one fused product; GPT-2's c_proj names two products, the
// attention's and the MLP's, both targeted by the one name, as PEFT does). A layer's trained
// chunk is, for every targeted module in the family's order, A (r, in) then B (out, r),
// row-major: PEFT's lora_A.weight and lora_B.weight, nn.Linear layouts (also for GPT-2, whose
// base weights are Conv1D (in, out)).
//
// Dropout: element j of row i of the input of site k of layer l is kept when
//   LoraDropoutUniform(seed, l, k, i * in + j) >= p,
// and a kept element is scaled by 1 / (1 - p) (torch.nn.Dropout); seed is the micro-batch's
// (engine::BlockBuffers::dropout_seed, 0 = evaluation: no dropout). The mask is a function of
// those four numbers only, so a backward that recomputes the forward sees the same mask.
//
// Rounding (storage type S, fp32 accumulation in every product, ops/matmul.h): the forward
// rounds u = S(x_d A^T), v = S(u B^T) and y = S(y + s v); the backward rounds
// dys = S(s dy[:, cols]), dB = S(dys^T u), g = S(dys B), dA = S(g^T x_d), t = S(g A) and
// dx = S(dx + t_d) (t_d: t with the dropout mask and scale applied). Thread-safety: as the ops
// (reentrant, oneTBB inside); concurrent calls must not share outputs or scratch.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "base/host_device.h"
#include "base/status.h"
#include "models/init.h"

namespace strata::models {

// The run's LoRA settings (strata train --lora-rank/--lora-alpha/--lora-targets/--lora-dropout).
struct LoraConfig {
  int rank = 0;                      // r; 0: no LoRA
  double alpha = 16;                 // lora_alpha; the adapters' output is scaled by alpha / r
  std::vector<std::string> targets;  // Hugging Face module names of the family
  double dropout = 0;                // p in [0, 1)
  bool enabled() const { return rank > 0; }
  double scaling() const { return alpha / rank; }
};

// A module a family lets LoRA target (see the top of this file).
struct LoraModule {
  std::string name;  // "q_proj", "c_attn", ...
  std::string path;  // the module inside a layer, Hugging Face names: "self_attn.q_proj", ...
  int product = 0;   // which of the layer's products (the family's numbering)
  int64_t in = 0;    // the product's input width
  int64_t out = 0;   // the columns the module covers: [col, col + out) of the product's output
  int64_t col = 0;
  // Where the product's base weight starts in the layer's base chunk: (outputs, in) row-major
  // (nn.Linear's layout: the module's rows are [col, col + out)), or with in_out (GPT-2's
  // Conv1D) (in, product_out) row-major (its columns [col, col + out)).
  int64_t weight_offset = 0;
  bool in_out = false;
  int64_t product_out = 0;  // the product's output width (in_out only)
};

// One adapter of a layer: a targeted module and where its A and B sit in the layer's chunk.
struct LoraSite {
  LoraModule module;
  int64_t a_offset = 0;  // A (r, in)
  int64_t b_offset = 0;  // B (out, r)
};

// The adapters of every layer of a model (all layers alike).
struct LoraLayout {
  int rank = 0;
  float scaling = 0;  // alpha / r
  float dropout = 0;
  std::vector<LoraSite> sites;  // in the family's module order
  int64_t layer_params = 0;     // the trained chunk of a layer: sum of r (in + out)
};

// PEFT's rule for a list of target_modules (peft tuners_utils.check_target_module_exists): a
// module is adapted when its name within the model equals a target or ends with "." + target,
// so "q_proj" and "self_attn.q_proj" both select every layer's self_attn.q_proj. Returns the
// names (LoraModule::name) of the `modules` that `targets` select, in the order of `targets`,
// each once. Errors (kInvalidArgument, one line led by `what`, e.g. "--lora-targets"): a target
// that selects none of them (listing the names; a target with a layer index, which PEFT applies
// to that layer only, is one), or one that selects some modules of a name but not all (GPT-2's
// "attn.c_proj": Strata adapts every module of a name or none). Pure.
StatusOr<std::vector<std::string>> LoraTargetNames(std::span<const std::string> targets,
                                                   std::span<const LoraModule> modules,
                                                   std::string_view family_name,
                                                   std::string_view what);

// The layout of `config` over a family's `modules` (family_name for messages); config.targets
// are read with LoraTargetNames. Errors (kInvalidArgument, one line naming the flag): rank < 1,
// alpha not positive, dropout outside [0, 1), no targets, a target that selects none of the
// family's modules (listing their names).
StatusOr<LoraLayout> MakeLoraLayout(const LoraConfig& config, std::span<const LoraModule> modules,
                                    std::string_view family_name);

// W[col + o][i] += s * sum_k B[o][k] A[k][i] for every site: the adapters of one layer
// (`adapters`, the layout's chunk) merged into its base chunk `base` (fp32). Pure.
void MergeLoraLayer(const LoraLayout& layout, const float* adapters, float* base);

// PEFT's initialisation of a layer's chunk (fp32, layout of `layout`): A uniform in
// [-1/sqrt(in), 1/sqrt(in)], B zero; deterministic from (seed, layer) (std::mt19937_64).
void InitLoraLayer(const LoraLayout& layout, int layer, uint64_t seed, float* params);

// The dropout uniform in [0, 1) of element `index` of site `site` of layer `layer` under
// micro-batch seed `seed`: SplitMix64 (Steele et al. 2014) of
//   SplitMix64(seed + 0x9E3779B97F4A7C15 * (layer * 4096 + site + 1)) ^ index,
// its top 24 bits over 2^24. Pure.
float LoraDropoutUniform(uint64_t seed, int layer, int site, uint64_t index);
// LoraDropoutUniform in its two parts: the site's stream (once per site and micro-batch), then
// each element's uniform from it. LoraDropoutUniform(seed, l, k, i) ==
// LoraStreamUniform(LoraDropoutStream(seed, l, k), i). The second is host and device code (the
// CUDA adapters draw the same mask, models/cuda/lora_cuda.cuh).
uint64_t LoraDropoutStream(uint64_t seed, int layer, int site);
STRATA_HD inline float LoraStreamUniform(uint64_t stream, uint64_t index) {
  return static_cast<float>(init::SplitMix64(stream ^ index) >> 40) * 0x1.0p-24f;
}
// The factor of a kept element, 1 / (1 - p) in double (torch.nn.Dropout); each backend rounds
// it to its compute type once.
double LoraKeepScale(float p);

// What a layer's kernels need to apply its adapters, for storage type S. Null adapters: no
// LoRA. dadapters null in a forward; in a backward the whole trained chunk is OVERWRITTEN (sites
// the pass does not reach stay untouched: every site is reached by a layer's backward).
template <typename S>
struct LoraLayerArgs {
  const LoraLayout* layout = nullptr;
  int layer = 0;
  uint64_t dropout_seed = 0;  // 0: no dropout (evaluation)
  const S* adapters = nullptr;
  S* dadapters = nullptr;
  void* scratch = nullptr;  // LoraScratchBytes<S>
  bool active() const { return adapters != nullptr; }
};

// Scratch of one site's forward or backward for `rows` input rows (the largest site), plus one
// (rows, largest input) buffer for the family (LoraGradBuffer), bytes.
template <typename S>
int64_t LoraScratchBytes(const LoraLayout& layout, int64_t rows);
// The regions of that scratch at `base` (host or device memory: only addresses are computed;
// base null gives offsets from 0): xd (rows, in) the input after dropout, u (rows, r) = x_d A^T,
// v (rows, out) = u B^T or the scaled output gradient, g (rows, r), t (rows, in) the input
// gradient through the adapter, family (rows, in) LoraGradBuffer's; in and out the largest
// site's. size_bytes = LoraScratchBytes.
template <typename S>
struct LoraScratch {
  S *xd, *u, *v, *g, *t, *family;
  int64_t size_bytes;
};
template <typename S>
LoraScratch<S> CarveLoraScratch(const LoraLayout& layout, int64_t rows, void* base);
// A (rows, largest site input) buffer of the scratch that LoraForward/LoraBackward never touch:
// where a family keeps an input gradient it must finish before applying an activation's
// derivative (GPT-2's MLP projection, whose product and DGELU are fused without LoRA).
template <typename S>
S* LoraGradBuffer(const LoraLayerArgs<S>& a, int64_t rows);
// Whether any site adds to `product`.
bool LoraTargets(const LoraLayout& layout, int product);
// Whether a layer's adapters add to `product`: active, and a site targets it. Pure.
template <typename S>
bool LoraAddsTo(const LoraLayerArgs<S>& a, int product) {
  return a.active() && LoraTargets(*a.layout, product);
}

// y (rows, ld), columns [col, col + out) of every site of `product`: y += s dropout(x) A^T B^T,
// rounded as the top of this file says. x (rows, in) is the product's input.
template <typename S>
void LoraForward(const LoraLayerArgs<S>& a, int product, const S* x, int64_t rows, S* y,
                 int64_t ld);

// For every site of `product`: its dA and dB (in a.dadapters) from dy (rows, ld) (the gradient
// of the product's output) and x (rows, in), and dx (rows, in) += the gradient through the
// adapter. dx must already hold the base product's input gradient.
template <typename S>
void LoraBackward(const LoraLayerArgs<S>& a, int product, const S* x, const S* dy, int64_t rows,
                  int64_t ld, S* dx);

}  // namespace strata::models

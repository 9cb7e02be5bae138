// The parameter layout of one GPT layer chunk (models/gpt_kernels.h, "Chunk layouts"), shared by
// the host kernels and the CUDA kernels so that both read the same element offsets.
#pragma once

#include <cstdint>

namespace strata::models {

// Pointers into a layer chunk of a model with C channels, in layout order. P is a (const)
// S* for a storage type S (float, double, Bf16, Fp16); the pointers are computed, never
// dereferenced, here.
template <typename P>
struct LayerParams {
  P ln1_w, ln1_b, qkv_w, qkv_b, attn_proj_w, attn_proj_b, ln2_w, ln2_b, fc_w, fc_b, mlp_proj_w,
      mlp_proj_b;
  // base null (a backward that computes no weight gradient: LoRA's frozen layer): all null.
  LayerParams(P base, int64_t C) {
    if (base == nullptr) {
      ln1_w = ln1_b = qkv_w = qkv_b = attn_proj_w = attn_proj_b = ln2_w = ln2_b = fc_w = fc_b =
          mlp_proj_w = mlp_proj_b = nullptr;
      return;
    }
    P p = base;
    auto take = [&p](int64_t n) {
      P r = p;
      p += n;
      return r;
    };
    ln1_w = take(C);
    ln1_b = take(C);
    qkv_w = take(C * 3 * C);
    qkv_b = take(3 * C);
    attn_proj_w = take(C * C);
    attn_proj_b = take(C);
    ln2_w = take(C);
    ln2_b = take(C);
    fc_w = take(C * 4 * C);
    fc_b = take(4 * C);
    mlp_proj_w = take(4 * C * C);
    mlp_proj_b = take(C);
  }
};

}  // namespace strata::models

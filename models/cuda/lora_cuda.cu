// LoRA on CUDA (lora_cuda.cuh): per targeted site, the host's steps (models/lora.cc) as device
// kernels and cuBLASLt products.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "base/dtype.h"
#include "models/cuda/lora_cuda.cuh"
#include "models/ops/cuda/common.cuh"

namespace strata::models::cuda {
namespace {

namespace oc = ::strata::models::ops::cuda;

using oc::internal::CheckPointers;
using oc::internal::D;
using oc::internal::Dev;
using oc::internal::FromF;
using oc::internal::GridFor;
using oc::internal::Launched;
using oc::internal::ToF;
using ops::WeightLayout;

constexpr int kBlock = 256;
constexpr WeightLayout kOutIn = WeightLayout::kOutIn;  // A (r, in), B (out, r): nn.Linear

// The dropout of one site and micro-batch: keep element i when its uniform >= p, scale kept
// elements by keep_scale. active false: no dropout (p = 0 or an evaluation, seed 0).
struct DropoutDraw {
  bool active = false;
  uint64_t stream = 0;
  float p = 0;
  float keep_scale = 1;
};

__device__ __forceinline__ bool Kept(const DropoutDraw& d, int64_t i) {
  return !d.active || LoraStreamUniform(d.stream, static_cast<uint64_t>(i)) >= d.p;
}

// xd = S(x keep_scale) where kept, 0 where dropped.
template <typename D>
__global__ void DropoutKernel(DropoutDraw d, const D* x, int64_t n, D* xd) {
  STRATA_FOR_EACH_INDEX(i, n) { xd[i] = FromF<D>(Kept(d, i) ? ToF(x[i]) * d.keep_scale : 0.0f); }
}

// y[r, col + c] = S(y + s v[r, c]), v (rows, out).
template <typename D>
__global__ void AddScaledKernel(const D* v, int64_t rows, int64_t out, float s, D* y, int64_t ld,
                                int64_t col) {
  STRATA_FOR_EACH_INDEX(i, rows * out) {
    D& yi = y[(i / out) * ld + col + i % out];
    yi = FromF<D>(ToF(yi) + s * ToF(v[i]));
  }
}

// v[r, c] = S(s dy[r, col + c]).
template <typename D>
__global__ void ScaledColumnsKernel(const D* dy, int64_t rows, int64_t out, float s, int64_t ld,
                                    int64_t col, D* v) {
  STRATA_FOR_EACH_INDEX(i, rows * out) {
    v[i] = FromF<D>(s * ToF(dy[(i / out) * ld + col + i % out]));
  }
}

// dx = S(dx + keep_scale t) where kept; dropped elements unchanged.
template <typename D>
__global__ void AddDroppedOutKernel(DropoutDraw d, const D* t, int64_t n, D* dx) {
  STRATA_FOR_EACH_INDEX(i, n) {
    if (Kept(d, i)) dx[i] = FromF<D>(ToF(dx[i]) + d.keep_scale * ToF(t[i]));
  }
}

template <typename S>
DropoutDraw Draw(const LoraLayerArgs<S>& a, int site) {
  DropoutDraw d;
  d.p = a.layout->dropout;
  d.active = d.p > 0 && a.dropout_seed != 0;
  if (d.active) {
    d.stream = LoraDropoutStream(a.dropout_seed, a.layer, site);
    d.keep_scale = static_cast<float>(LoraKeepScale(d.p));
  }
  return d;
}

// Site k's input after dropout (sc.xd, or x itself) and u = S(x_d A^T) into sc.u: what the
// forward computes first and the backward recomputes.
template <typename S>
StatusOr<const S*> SiteInput(const oc::Products<S>& mm, const LoraLayerArgs<S>& a, int k,
                             const S* x, int64_t rows, const LoraScratch<S>& sc) {
  const LoraSite& site = a.layout->sites[k];
  const int64_t in = site.module.in;
  const DropoutDraw d = Draw(a, k);
  const S* xd = x;
  if (d.active) {
    const int64_t n = rows * in;
    DropoutKernel<<<GridFor(n, kBlock), kBlock, 0, mm.stream>>>(d, D(x), n, D(sc.xd));
    STRATA_RETURN_IF_ERROR(Launched("LoRA DropoutKernel"));
    xd = sc.xd;
  }
  STRATA_RETURN_IF_ERROR(mm.Forward(kOutIn, rows, in, a.layout->rank, xd,
                                    a.adapters + site.a_offset, nullptr, nullptr, sc.u));
  return xd;
}

// Runs fn(k, site) for every site k of `product` over the adapters' scratch, after the
// pointer checks; nothing for an inactive call, a product no site targets, or no rows.
template <typename S, typename Fn>
Status ForEachSite(const char* what, const LoraLayerArgs<S>& a, int product, int64_t rows,
                   std::initializer_list<const void*> pointers, Fn fn) {
  if (!LoraAddsTo(a, product) || rows == 0) return Status::Ok();
  STRATA_RETURN_IF_ERROR(CheckPointers(what, {a.scratch}));
  STRATA_RETURN_IF_ERROR(CheckPointers(what, pointers));
  const LoraScratch<S> sc = CarveLoraScratch<S>(*a.layout, rows, a.scratch);
  for (size_t k = 0; k < a.layout->sites.size(); ++k) {
    if (a.layout->sites[k].module.product != product) continue;
    STRATA_RETURN_IF_ERROR(fn(static_cast<int>(k), a.layout->sites[k], sc));
  }
  return Status::Ok();
}

}  // namespace

template <typename S>
Status LoraCudaForward(const oc::Products<S>& mm, const LoraLayerArgs<S>& a, int product,
                       const S* x, int64_t rows, S* y, int64_t ld) {
  const LoraLayout& l = *a.layout;
  return ForEachSite(
      "LoraCudaForward", a, product, rows, {x, y},
      [&](int k, const LoraSite& site, const LoraScratch<S>& sc) -> Status {
        const LoraModule& m = site.module;
        STRATA_RETURN_IF_ERROR(SiteInput(mm, a, k, x, rows, sc).status());
        STRATA_RETURN_IF_ERROR(mm.Forward(kOutIn, rows, l.rank, m.out, sc.u,
                                          a.adapters + site.b_offset, nullptr, nullptr, sc.v));
        const int64_t n = rows * m.out;
        AddScaledKernel<<<GridFor(n, kBlock), kBlock, 0, mm.stream>>>(D(sc.v), rows, m.out,
                                                                      l.scaling, D(y), ld, m.col);
        return Launched("LoRA AddScaledKernel");
      });
}

template <typename S>
Status LoraCudaBackward(const oc::Products<S>& mm, const LoraLayerArgs<S>& a, int product,
                        const S* x, const S* dy, int64_t rows, int64_t ld, S* dx) {
  const LoraLayout& l = *a.layout;
  return ForEachSite(
      "LoraCudaBackward", a, product, rows, {x, dy, dx, a.dadapters},
      [&](int k, const LoraSite& site, const LoraScratch<S>& sc) -> Status {
        const LoraModule& m = site.module;
        STRATA_ASSIGN_OR_RETURN(const S* xd, SiteInput(mm, a, k, x, rows, sc));
        // dys = S(s dy[:, cols]) into v.
        const int64_t n_out = rows * m.out;
        ScaledColumnsKernel<<<GridFor(n_out, kBlock), kBlock, 0, mm.stream>>>(
            D(dy), rows, m.out, l.scaling, ld, m.col, D(sc.v));
        STRATA_RETURN_IF_ERROR(Launched("LoRA ScaledColumnsKernel"));
        // v = u B^T: dB = S(dys^T u) (out, r), g = S(dys B) (rows, r).
        const S* B = a.adapters + site.b_offset;
        STRATA_RETURN_IF_ERROR(
            mm.WeightGrad(kOutIn, rows, l.rank, m.out, sc.u, sc.v, a.dadapters + site.b_offset));
        STRATA_RETURN_IF_ERROR(mm.InputGrad(kOutIn, rows, l.rank, m.out, sc.v, B, sc.g));
        // u = x_d A^T: dA = S(g^T x_d) (r, in), t = S(g A) (rows, in).
        const S* A = a.adapters + site.a_offset;
        STRATA_RETURN_IF_ERROR(
            mm.WeightGrad(kOutIn, rows, m.in, l.rank, xd, sc.g, a.dadapters + site.a_offset));
        STRATA_RETURN_IF_ERROR(mm.InputGrad(kOutIn, rows, m.in, l.rank, sc.g, A, sc.t));
        // dx += dropout'(t).
        const int64_t n_in = rows * m.in;
        AddDroppedOutKernel<<<GridFor(n_in, kBlock), kBlock, 0, mm.stream>>>(Draw(a, k), D(sc.t),
                                                                             n_in, D(dx));
        return Launched("LoRA AddDroppedOutKernel");
      });
}

#define STRATA_INSTANTIATE_LORA_CUDA(S)                                                     \
  template Status LoraCudaForward<S>(const oc::Products<S>&, const LoraLayerArgs<S>&, int,  \
                                     const S*, int64_t, S*, int64_t);                       \
  template Status LoraCudaBackward<S>(const oc::Products<S>&, const LoraLayerArgs<S>&, int, \
                                      const S*, const S*, int64_t, int64_t, S*);
STRATA_INSTANTIATE_LORA_CUDA(float)
STRATA_INSTANTIATE_LORA_CUDA(Bf16)
STRATA_INSTANTIATE_LORA_CUDA(Fp16)
#undef STRATA_INSTANTIATE_LORA_CUDA

}  // namespace strata::models::cuda

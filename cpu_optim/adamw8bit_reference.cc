// The scalar reference of AdamW8bitUpdate: one element at a time, base/dtype.h
// conversions, the operation order of adamw.h, nearest codes by binary search.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>

#include "cpu_optim/adamw8bit.h"
#include "cpu_optim/kernels.h"

namespace strata::cpu_optim {

Status AdamW8bitUpdateReference(const AdamWConfig& config, const OptimStep& step,
                                std::span<float> master, QuantizedState m, QuantizedState v,
                                GradView grad, CopyOut copy_out) {
  using internal::WeightDecayMode;
  STRATA_RETURN_IF_ERROR(internal::ValidateAdamW8bit(config, step, master, m, v, grad, copy_out));
  const internal::AdamWScalars s = internal::PrepareAdamW(config, step);
  const std::span<const float> m_map = DynamicQuantizationMap(true);
  const std::span<const float> v_map = DynamicQuantizationMap(false);
  const size_t n = master.size();
  float m_new[kQuantBlockElems], v_new[kQuantBlockElems];
  for (size_t begin = 0; begin < n; begin += kQuantBlockElems) {
    const size_t block = begin / kQuantBlockElems;
    const size_t len = std::min<size_t>(kQuantBlockElems, n - begin);
    uint32_t m_absmax_bits = 0, v_absmax_bits = 0;
    for (size_t j = 0; j < len; ++j) {
      const size_t i = begin + j;
      float g = internal::ReferenceLoad(grad, i) * s.grad_scale;
      float p = master[i];
      if (s.weight_decay_mode == WeightDecayMode::kL2) g = g + s.weight_decay * p;
      if (s.weight_decay_mode == WeightDecayMode::kDecoupled) p = p * s.decay;
      const float m_old = m_map[m.codes[i]] * m.absmax[block];
      const float v_old = v_map[v.codes[i]] * v.absmax[block];
      // torch.lerp(m, g, w), w = 1 - beta1.
      const float mi = s.lerp_small ? m_old + s.one_minus_beta1 * (g - m_old)
                                    : g - (g - m_old) * s.lerp_one_minus_w;
      const float vi = s.beta2 * v_old + (s.one_minus_beta2 * g) * g;
      const float denom = std::sqrt(vi) / s.bias_correction2_sqrt + s.eps;
      p = p - (s.step_size * mi) / denom;
      master[i] = p;
      if (copy_out.data != nullptr) internal::ReferenceStore(copy_out, i, p);
      m_new[j] = mi;
      v_new[j] = vi;
      // max |x| as the integer max of |x|'s bits (adamw8bit.h).
      const auto abs_bits = [](float x) { return std::bit_cast<uint32_t>(x) & 0x7fffffffu; };
      m_absmax_bits = std::max(m_absmax_bits, abs_bits(mi));
      v_absmax_bits = std::max(v_absmax_bits, abs_bits(vi));
    }
    const float m_absmax = std::bit_cast<float>(m_absmax_bits);
    const float v_absmax = std::bit_cast<float>(v_absmax_bits);
    m.absmax[block] = m_absmax;
    v.absmax[block] = v_absmax;
    // y = x * (1 / absmax), a block with absmax below 2^-64 first scaled by 2^64 (adamw8bit.h).
    const auto quantize = [&](bool is_signed, float absmax, const float* x, uint8_t* codes) {
      const float pre = absmax < 0x1p-64f ? 0x1p64f : 1.0f;
      const float recip = 1.0f / (absmax * pre);
      for (size_t j = 0; j < len; ++j) {
        codes[j] = internal::SearchQuant8Code(is_signed, (x[j] * pre) * recip);
      }
    };
    quantize(true, m_absmax, m_new, m.codes.data() + begin);
    quantize(false, v_absmax, v_new, v.codes.data() + begin);
  }
  return Status::Ok();
}

}  // namespace strata::cpu_optim

#include "models/ops/add.h"

#include "base/status.h"
#include "models/ops/parallel.h"

namespace strata::models::ops {

template <typename S>
void AddForward(const S* a, const S* b, int64_t n, S* out) {
  STRATA_CHECK(n >= 0);
  // Elements as rows of one: tasks of kGrainElems elements, each element read before it is
  // written by the same iteration (so out may equal a or b).
  ParallelRows(n, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) out[i] = FromFloat<S>(ToFloat(a[i]) + ToFloat(b[i]));
  });
}

#define STRATA_INSTANTIATE_ADD(S) template void AddForward<S>(const S*, const S*, int64_t, S*);
STRATA_INSTANTIATE_ADD(float)
STRATA_INSTANTIATE_ADD(double)
STRATA_INSTANTIATE_ADD(Bf16)
STRATA_INSTANTIATE_ADD(Fp16)
#undef STRATA_INSTANTIATE_ADD

}  // namespace strata::models::ops

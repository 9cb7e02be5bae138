#include "gpu/cuda/cuda_lt_matmul.h"

#include <cublasLt.h>
#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <map>
#include <mutex>
#include <tuple>

#include "base/thread_annotations.h"
#include "gpu/cuda/cublas_loader.h"
#include "gpu/cuda/cuda_status.h"

namespace strata::gpu::cuda {
namespace {

static_assert(static_cast<uint32_t>(LtEpilogue::kDefault) == CUBLASLT_EPILOGUE_DEFAULT);
static_assert(static_cast<uint32_t>(LtEpilogue::kBias) == CUBLASLT_EPILOGUE_BIAS);
static_assert(static_cast<uint32_t>(LtEpilogue::kGeluAuxBias) == CUBLASLT_EPILOGUE_GELU_AUX_BIAS);
static_assert(static_cast<uint32_t>(LtEpilogue::kDGelu) == CUBLASLT_EPILOGUE_DGELU);
static_assert(static_cast<uint32_t>(LtEpilogue::kBgradA) == CUBLASLT_EPILOGUE_BGRADA);

uint32_t Align(const void* p) { return LtAlignmentBytes(reinterpret_cast<uintptr_t>(p)); }

// Everything that picks the algorithm.
using ProblemKey = std::tuple<int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                              int, int, int, uint32_t, int, uint64_t, int64_t, size_t>;

struct LtState {
  std::mutex mu;
  std::map<int, cublasLtHandle_t> handles STRATA_GUARDED_BY(mu);  // per device, never destroyed
  // nullopt-like: found == false records "no algorithm" so the heuristic is not asked again.
  struct Entry {
    bool found = false;
    cublasLtMatmulAlgo_t algo{};
  };
  std::map<ProblemKey, Entry> algos STRATA_GUARDED_BY(mu);
};

LtState& State() {
  static LtState* const state = new LtState;  // never destroyed (handles outlive statics)
  return *state;
}

StatusOr<cublasLtHandle_t> HandleForCurrentDevice(const CublasLtApi& lt, int* device_out) {
  int device = 0;
  STRATA_RETURN_IF_ERROR(CudaStatus(cudaGetDevice(&device), "cudaGetDevice"));
  *device_out = device;
  LtState& st = State();
  std::lock_guard<std::mutex> lock(st.mu);
  auto it = st.handles.find(device);
  if (it != st.handles.end()) return it->second;
  cublasLtHandle_t h = nullptr;
  STRATA_CUBLAS_RETURN_IF_ERROR(lt.Create(&h));
  st.handles.emplace(device, h);
  return h;
}

// RAII for the per-call descriptors (host objects; creating them allocates a few bytes of
// host memory and touches no device).
struct Descriptors {
  const CublasLtApi* lt = nullptr;
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr, d = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  ~Descriptors() {
    if (pref) lt->MatmulPreferenceDestroy(pref);
    for (cublasLtMatrixLayout_t l : {a, b, c, d}) {
      if (l) lt->MatrixLayoutDestroy(l);
    }
    if (op) lt->MatmulDescDestroy(op);
  }
};

bool FitsInt(int64_t v) { return v >= 0 && v <= std::numeric_limits<int>::max(); }

Status Check(const LtMatmulArgs& a) {
  if (!FitsInt(a.M) || !FitsInt(a.N) || !FitsInt(a.K)) {
    return InvalidArgumentError(
        fmt::format("LtMatmul: M={} N={} K={} must be in [0, 2^31)", a.M, a.N, a.K));
  }
  const LeadingDims min_ld = RowMajorMinLeadingDims(a.trans_a, a.trans_b, a.M, a.N, a.K);
  if (a.lda < std::max<int64_t>(min_ld.lda, 1) || a.ldb < std::max<int64_t>(min_ld.ldb, 1) ||
      a.ldd < std::max<int64_t>(a.N, 1) || (a.C && a.ldc < std::max<int64_t>(a.N, 1))) {
    return InvalidArgumentError(fmt::format(
        "LtMatmul: row strides lda={} ldb={} ldc={} ldd={} below the stored row lengths", a.lda,
        a.ldb, a.ldc, a.ldd));
  }
  if (!LtMappingSupported(a.epilogue, a.trans_b, a.fp32_output)) {
    return InvalidArgumentError(
        "LtMatmul: the bias gradient of B needs trans_b false, an fp32 output no epilogue");
  }
  if (a.M == 0 || a.N == 0) return Status::Ok();
  if (a.D == nullptr || (a.K > 0 && (a.A == nullptr || a.B == nullptr))) {
    return InvalidArgumentError("LtMatmul: A, B or D is null");
  }
  const bool need_bias =
      a.epilogue == RowEpilogue::kBias || a.epilogue == RowEpilogue::kGeluAuxBias;
  const bool need_aux =
      a.epilogue == RowEpilogue::kGeluAuxBias || a.epilogue == RowEpilogue::kDGelu;
  if ((need_bias && a.bias == nullptr) || (need_aux && a.aux == nullptr) ||
      (a.epilogue == RowEpilogue::kBiasGradB && a.bias_grad == nullptr)) {
    return InvalidArgumentError("LtMatmul: the epilogue's bias, bias gradient or aux is null");
  }
  if (need_aux && (a.aux_ld < a.N || a.aux_ld % 8 != 0)) {
    return InvalidArgumentError(fmt::format(
        "LtMatmul: aux row stride {} must be >= N = {} and a multiple of 8", a.aux_ld, a.N));
  }
  return Status::Ok();
}

}  // namespace

cudaDataType_t CudaDataType(DType t) {
  switch (t) {
    case DType::kF32:
      return CUDA_R_32F;
    case DType::kF16:
      return CUDA_R_16F;
    case DType::kBF16:
      return CUDA_R_16BF;
  }
  return CUDA_R_32F;
}

Status PrepareLtForCurrentDevice() {
  STRATA_ASSIGN_OR_RETURN(const CublasLtApi* lt, CublasLt());
  int device = 0;
  return HandleForCurrentDevice(*lt, &device).status();
}

Status LtMatmul(cudaStream_t stream, const LtMatmulArgs& a, void* workspace,
                size_t workspace_bytes) {
  STRATA_RETURN_IF_ERROR(Check(a));
  if (a.M == 0 || a.N == 0) return Status::Ok();
  STRATA_ASSIGN_OR_RETURN(const CublasLtApi* lt, CublasLt());
  int device = 0;
  STRATA_ASSIGN_OR_RETURN(cublasLtHandle_t handle, HandleForCurrentDevice(*lt, &device));
  const LtMatmulMapping m = RowMajorAsLt(a.trans_a, a.trans_b, a.M, a.N, a.K, a.lda, a.ldb,
                                         a.C ? a.ldc : a.ldd, a.epilogue, a.aux_ld);
  const LtOperandTypes types = LtTypesFor(a.dtype, a.fp32_output);
  const cudaDataType_t type = CudaDataType(types.a_b);
  const cudaDataType_t cd_type = CudaDataType(types.c_d);
  const cublasComputeType_t compute =
      a.dtype == DType::kF32 && a.allow_tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  const ColumnMajorGemm& g = m.gemm;
  // Lt's A is our B and Lt's B our A (cuda_lt_mapping.h).
  const void* lt_a = a.B;
  const void* lt_b = a.A;
  const void* lt_c = a.C ? a.C : a.D;
  const int64_t ldc = a.C ? a.ldc : a.ldd;

  Descriptors d;
  d.lt = lt;
  STRATA_CUBLAS_RETURN_IF_ERROR(lt->MatmulDescCreate(&d.op, compute, CUDA_R_32F));
  const cublasOperation_t ta = g.transa ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t tb = g.transb ? CUBLAS_OP_T : CUBLAS_OP_N;
  const auto epilogue = static_cast<cublasLtEpilogue_t>(m.epilogue);
  STRATA_CUBLAS_RETURN_IF_ERROR(
      lt->MatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  STRATA_CUBLAS_RETURN_IF_ERROR(
      lt->MatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  STRATA_CUBLAS_RETURN_IF_ERROR(
      lt->MatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)));
  const void* vec = a.epilogue == RowEpilogue::kBiasGradB ? a.bias_grad : a.bias;
  if (m.vector_len > 0) {
    STRATA_CUBLAS_RETURN_IF_ERROR(
        lt->MatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &vec, sizeof(vec)));
    STRATA_CUBLAS_RETURN_IF_ERROR(
        lt->MatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &type, sizeof(type)));
  }
  if (m.aux_ld > 0) {
    STRATA_CUBLAS_RETURN_IF_ERROR(lt->MatmulDescSetAttribute(
        d.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &a.aux, sizeof(a.aux)));
    STRATA_CUBLAS_RETURN_IF_ERROR(lt->MatmulDescSetAttribute(
        d.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &m.aux_ld, sizeof(m.aux_ld)));
    STRATA_CUBLAS_RETURN_IF_ERROR(lt->MatmulDescSetAttribute(
        d.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE, &type, sizeof(type)));
  }
  // Stored (rows, cols) of the column-major operands.
  const uint64_t a_rows = g.transa ? g.k : g.m, a_cols = g.transa ? g.m : g.k;
  const uint64_t b_rows = g.transb ? g.n : g.k, b_cols = g.transb ? g.k : g.n;
  STRATA_CUBLAS_RETURN_IF_ERROR(lt->MatrixLayoutCreate(&d.a, type, a_rows, a_cols, g.lda));
  STRATA_CUBLAS_RETURN_IF_ERROR(lt->MatrixLayoutCreate(&d.b, type, b_rows, b_cols, g.ldb));
  STRATA_CUBLAS_RETURN_IF_ERROR(lt->MatrixLayoutCreate(&d.c, cd_type, g.m, g.n, ldc));
  STRATA_CUBLAS_RETURN_IF_ERROR(lt->MatrixLayoutCreate(&d.d, cd_type, g.m, g.n, a.ldd));

  const uint32_t al_a = Align(lt_a), al_b = Align(lt_b), al_c = Align(lt_c), al_d = Align(a.D);
  const uint32_t al_v = std::min({Align(vec), Align(a.aux), al_d});
  const ProblemKey key{
      device,
      g.m,
      g.n,
      g.k,
      g.lda,
      g.ldb,
      ldc,
      a.ldd,
      static_cast<int>(g.transa) | (static_cast<int>(g.transb) << 1),
      static_cast<int>(type) | (static_cast<int>(cd_type) << 16),
      static_cast<int>(compute),
      static_cast<uint32_t>(m.epilogue),
      a.C != nullptr,
      (uint64_t{al_a} << 48) | (uint64_t{al_b} << 32) | (uint64_t{al_c} << 16) | uint64_t{al_d},
      int64_t{al_v} * 65536 + m.aux_ld,
      workspace_bytes};
  LtState& st = State();
  LtState::Entry entry;
  bool cached = false;
  {
    std::lock_guard<std::mutex> lock(st.mu);
    auto it = st.algos.find(key);
    if (it != st.algos.end()) {
      entry = it->second;
      cached = true;
    }
  }
  if (!cached) {  // the heuristic, once per problem (host-only work)
    STRATA_CUBLAS_RETURN_IF_ERROR(lt->MatmulPreferenceCreate(&d.pref));
    const uint64_t ws = workspace_bytes;
    STRATA_CUBLAS_RETURN_IF_ERROR(lt->MatmulPreferenceSetAttribute(
        d.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
    const std::pair<cublasLtMatmulPreferenceAttributes_t, uint32_t> aligns[] = {
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, al_a},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, al_b},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, al_c},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, al_d}};
    for (const auto& [attr, value] : aligns) {
      STRATA_CUBLAS_RETURN_IF_ERROR(
          lt->MatmulPreferenceSetAttribute(d.pref, attr, &value, sizeof(value)));
    }
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    const cublasStatus_t s =
        lt->MatmulAlgoGetHeuristic(handle, d.op, d.a, d.b, d.c, d.d, d.pref, 1, &result, &found);
    if (s != CUBLAS_STATUS_SUCCESS && s != CUBLAS_STATUS_NOT_SUPPORTED) {
      return CublasStatus(s, "cublasLtMatmulAlgoGetHeuristic");
    }
    entry.found = s == CUBLAS_STATUS_SUCCESS && found > 0 && result.state == CUBLAS_STATUS_SUCCESS;
    if (entry.found) entry.algo = result.algo;
    std::lock_guard<std::mutex> lock(st.mu);
    st.algos.emplace(key, entry);
  }
  if (!entry.found) {
    return UnimplementedError(fmt::format(
        "cuBLASLt has no algorithm for the row-major {}x{}x{} product (dtype {}, epilogue {})", a.M,
        a.N, a.K, DTypeName(a.dtype), static_cast<uint32_t>(m.epilogue)));
  }
  const float alpha = 1.0f, beta = a.C ? 1.0f : 0.0f;
  STRATA_CUBLAS_RETURN_IF_ERROR(lt->Matmul(handle, d.op, &alpha, lt_a, d.a, lt_b, d.b, &beta, lt_c,
                                           d.c, a.D, d.d, &entry.algo, workspace, workspace_bytes,
                                           stream));
  return Status::Ok();
}

}  // namespace strata::gpu::cuda

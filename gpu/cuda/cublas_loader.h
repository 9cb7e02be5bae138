// cuBLAS, loaded on first use (dlopen) instead of linked.
//
// Linking libcublas makes every strata process map and relocate libcublas and
// libcublasLt at start-up (`strata estimate` peaked at 218 MiB RSS with them linked and
// at 7 MiB without; `strata train --device host` at 232 MiB and 34 MiB), and makes the
// binary fail to start where the CUDA libraries are absent. So strata::gpu links no cuBLAS library:
// the CUDA backend asks Cublas() for the entry points when it first needs a cuBLAS handle, and
// Cublas() dlopens libcublas.so.<CUBLAS_VER_MAJOR> (the soname of the toolkit this build was
// compiled against; minor versions are backward compatible) with RTLD_NOW | RTLD_LOCAL
// and resolves each entry point with dlsym. The library stays loaded for the life of
// the process (it is never dlclosed: CUDA tears its state down at exit).
//
// Each member of CublasApi is typed with decltype of the declaration in cublas_api.h,
// and its dlsym name is the exported symbol behind the cublas_v2.h macro
// (cublasCreate -> cublasCreate_v2, ...), so signature and name cannot drift from the
// headers. Code that uses cuBLAS calls through the table:
//   STRATA_ASSIGN_OR_RETURN(const cuda::CublasApi* blas, cuda::Cublas());
//   STRATA_CUBLAS_RETURN_IF_ERROR(blas->GemmEx(handle, ...));
// and must not call cublas* functions directly (the link would fail: nothing provides
// them). Only the types and constants of cublas_v2.h are used from the headers.
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>

#include <string>

#include "base/status.h"

namespace strata::gpu::cuda {

// cublasGemmEx and cublasGemmStridedBatchedEx are overloaded in C++ (cublas_api.h adds
// inline wrappers taking a cudaDataType compute type); these are the exported ones,
// with a cublasComputeType_t compute type. Selecting the overload with static_cast
// fails to compile if the header's declaration ever changes.
using CublasGemmExFn = cublasStatus_t (*)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int,
                                          int, int, const void*, const void*, cudaDataType, int,
                                          const void*, cudaDataType, int, const void*, void*,
                                          cudaDataType, int, cublasComputeType_t, cublasGemmAlgo_t);
using CublasGemmStridedBatchedExFn = cublasStatus_t (*)(
    cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int, const void*, const void*,
    cudaDataType, int, long long int, const void*, cudaDataType, int, long long int, const void*,
    void*, cudaDataType, int, long long int, int, cublasComputeType_t, cublasGemmAlgo_t);

// The cuBLAS entry points Strata uses, resolved from the loaded library. Every member
// is non-null in a CublasApi that Cublas() or internal::LoadCublas() returned. Calling
// them follows cuBLAS' own rules (a handle is used by one thread at a time).
struct CublasApi {
  decltype(&::cublasCreate_v2) Create;                  // cublasCreate
  decltype(&::cublasDestroy_v2) Destroy;                // cublasDestroy
  decltype(&::cublasSetStream_v2) SetStream;            // cublasSetStream
  decltype(&::cublasGetStream_v2) GetStream;            // cublasGetStream
  decltype(&::cublasSetWorkspace_v2) SetWorkspace;      // cublasSetWorkspace
  decltype(&::cublasSetPointerMode_v2) SetPointerMode;  // cublasSetPointerMode
  decltype(&::cublasSetMathMode) SetMathMode;           // cublasSetMathMode
  decltype(static_cast<CublasGemmExFn>(&::cublasGemmEx)) GemmEx;
  decltype(static_cast<CublasGemmStridedBatchedExFn>(
      &::cublasGemmStridedBatchedEx)) GemmStridedBatchedEx;
  decltype(&::cublasGetStatusName) GetStatusName;      // "CUBLAS_STATUS_..."
  decltype(&::cublasGetStatusString) GetStatusString;  // a sentence
  decltype(&::cublasGetProperty) GetProperty;          // MAJOR_VERSION, MINOR_VERSION, PATCH_LEVEL

  // Where the dynamic linker found the library (e.g.
  // "/usr/local/cuda-13.0/lib/libcublas.so.13"), for messages and `strata doctor`.
  std::string path;
};

// "libcublas.so.13": the soname this build loads (CUBLAS_VER_MAJOR of the headers it was
// compiled against). Thread-safe.
const char* CublasLibraryName();

// The process-wide cuBLAS table: the first call loads the library and resolves every
// entry point (typically a few ms; it does not touch the GPU); later calls return the
// same pointer, valid for the life of the process. The outcome of the first call is
// kept: a failed load is not retried (install the library and restart the process).
// Thread-safe: concurrent first calls load once (std::call_once) and all see the result.
// Errors (kUnavailable, naming what the dynamic linker said):
//   - the library is not found (or one of its dependencies, e.g. libcublasLt, is not):
//     "libcublas.so.13 not found: install the CUDA toolkit's cuBLAS ... or use
//     --device host (dlopen: ...)";
//   - an entry point is missing (a cuBLAS older than the headers): names the symbol.
StatusOr<const CublasApi*> Cublas();

// cuBLASLt (the matrix products with epilogues of models/cuda/), loaded the same way:
// libcublasLt.so.<CUBLAS_VER_MAJOR> (falling back to libcublasLt.so), RTLD_NOW | RTLD_LOCAL,
// never closed. Members typed with decltype of the declarations in cublasLt.h.
struct CublasLtApi {
  decltype(&::cublasLtCreate) Create;
  decltype(&::cublasLtDestroy) Destroy;
  decltype(&::cublasLtMatmulDescCreate) MatmulDescCreate;
  decltype(&::cublasLtMatmulDescDestroy) MatmulDescDestroy;
  decltype(&::cublasLtMatmulDescSetAttribute) MatmulDescSetAttribute;
  decltype(&::cublasLtMatrixLayoutCreate) MatrixLayoutCreate;
  decltype(&::cublasLtMatrixLayoutDestroy) MatrixLayoutDestroy;
  decltype(&::cublasLtMatmulPreferenceCreate) MatmulPreferenceCreate;
  decltype(&::cublasLtMatmulPreferenceDestroy) MatmulPreferenceDestroy;
  decltype(&::cublasLtMatmulPreferenceSetAttribute) MatmulPreferenceSetAttribute;
  decltype(&::cublasLtMatmulAlgoGetHeuristic) MatmulAlgoGetHeuristic;
  decltype(&::cublasLtMatmul) Matmul;
  std::string path;  // where the dynamic linker found it
};

// "libcublasLt.so.13". Thread-safe.
const char* CublasLtLibraryName();

// The process-wide cuBLASLt table, loaded on the first call (the outcome is kept, as for
// Cublas()). Thread-safe. kUnavailable naming the library when it is not found (install the
// CUDA toolkit's cuBLAS, which ships libcublasLt, or use --device host), or naming a missing
// entry point.
StatusOr<const CublasLtApi*> CublasLt();

namespace internal {

// What Cublas() does once, with the library name as a parameter (for tests: a name that
// does not exist, or a library without the cuBLAS symbols). Not cached: each call
// dlopens `library_name` again (raising its reference count), and on success the
// library is never closed; on failure nothing stays loaded. Thread-safe.
StatusOr<CublasApi> LoadCublas(const std::string& library_name);

// What CublasLt() does once, for one library name (tests). Not cached.
StatusOr<CublasLtApi> LoadCublasLt(const std::string& library_name);

}  // namespace internal
}  // namespace strata::gpu::cuda

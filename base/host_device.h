// STRATA_HD marks a function of a plain C++ header as host and device code when nvcc compiles the
// including file (kernels call it: the attention's tile schedule, LoRA's dropout draw, the
// scalar helpers of gpu/cuda/cuda_dtype.cuh) and is empty for every other compiler, so the header
// stays plain C++. The project's one host-and-device macro; an inline function says `inline`.
#pragma once

#if defined(__CUDACC__)
#define STRATA_HD __host__ __device__
#else
#define STRATA_HD
#endif

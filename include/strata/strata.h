/* Strata C API: the CPU optimizers and gradient passes of libstrata.so behind a
 * stable C ABI, for frameworks and languages that cannot link C++ (the Python
 * package python/strata/ uses it through ctypes).
 *
 * Shape of the API
 *   - Opaque handles: a strata_optimizer holds an optimizer's hyper-parameters and
 *     its threading options; it owns no tensor memory.
 *   - Caller-owned buffers: parameters (fp32 master weights), optimizer state and
 *     gradients are the caller's, laid out as torch.optim keeps them (one flat
 *     fp32 buffer per state tensor: exp_avg, exp_avg_sq, ...), so a PyTorch
 *     state_dict can be used as is. Nothing is retained after a call returns.
 *   - Explicit dtypes (strata_dtype) and lengths in ELEMENTS (num_elems), never
 *     bytes. No alignment is required (64-byte aligned buffers are faster).
 *   - Every fallible function returns a strata_status (the codes of
 *     strata::StatusCode, chosen by what the caller should do) and, when it is not
 *     STRATA_OK, sets a message for the calling thread: strata_last_error(). On an
 *     error no buffer has been modified, unless stated otherwise.
 *
 * Thread-safety: every function may be called from any thread. A strata_optimizer
 * may run strata_optimizer_step from several threads at once on different buffers;
 * strata_optimizer_set_config and strata_optimizer_destroy must not run
 * concurrently with any other use of the same handle. Buffers passed to one call
 * must not be read or written by anyone else until it returns.
 *
 * Numerics: formulas and hyper-parameter rules are those of torch.optim (see each
 * optimizer below); every result is bit-identical whatever the thread count and
 * whatever the ISA variant (AVX-512, AVX2, generic) chosen at run time by CPUID.
 *
 * Link with -lstrata (CMake: find_package(Strata) and Strata::strata). The header
 * is C99 and C++ compatible. */
#ifndef STRATA_STRATA_H_
#define STRATA_STRATA_H_

#include <stddef.h>
#include <stdint.h>

#if defined(_WIN32)
#define STRATA_API
#elif defined(__GNUC__) || defined(__clang__)
#define STRATA_API __attribute__((visibility("default")))
#else
#define STRATA_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------------------
 * Version
 * ------------------------------------------------------------------------- */

/* The version of this header. The library's own version is strata_version(); a
 * program built against this header runs with any libstrata.so.0 whose major
 * version is the same and whose minor version is at least this one. */
#define STRATA_VERSION_MAJOR 0
#define STRATA_VERSION_MINOR 2
#define STRATA_VERSION_PATCH 0
/* MAJOR * 10000 + MINOR * 100 + PATCH, comparable with strata_version_number(). */
#define STRATA_VERSION_NUMBER \
  (STRATA_VERSION_MAJOR * 10000 + STRATA_VERSION_MINOR * 100 + STRATA_VERSION_PATCH)

/* "MAJOR.MINOR.PATCH" of the loaded library; a static string, never freed. */
STRATA_API const char* strata_version(void);
/* The loaded library's STRATA_VERSION_NUMBER. */
STRATA_API int strata_version_number(void);

/* ---------------------------------------------------------------------------
 * Status codes and errors
 * ------------------------------------------------------------------------- */

/* The canonical codes of strata::StatusCode (base/status.h), same values. */
/* In C++ the enums get int as their fixed underlying type: C passes them as int, and a caller may
 * pass any int (an unknown value is STRATA_INVALID_ARGUMENT, not undefined behaviour). */
#ifdef __cplusplus
#define STRATA_ENUM_INT : int
#else
#define STRATA_ENUM_INT
#endif

typedef enum strata_status STRATA_ENUM_INT {
  STRATA_OK = 0,
  STRATA_CANCELLED = 1,
  STRATA_UNKNOWN = 2,
  STRATA_INVALID_ARGUMENT = 3, /* fix the arguments; nothing was modified */
  STRATA_DEADLINE_EXCEEDED = 4,
  STRATA_NOT_FOUND = 5,
  STRATA_ALREADY_EXISTS = 6,
  STRATA_PERMISSION_DENIED = 7,
  STRATA_RESOURCE_EXHAUSTED = 8, /* memory or threads could not be had */
  STRATA_FAILED_PRECONDITION = 9,
  STRATA_ABORTED = 10,
  STRATA_OUT_OF_RANGE = 11,
  STRATA_UNIMPLEMENTED = 12, /* a feature this version does not have */
  STRATA_INTERNAL = 13,      /* a bug or a failure of a dependency (oneTBB) */
  STRATA_UNAVAILABLE = 14,
  STRATA_DATA_LOSS = 15
} strata_status;

/* "OK", "INVALID_ARGUMENT", ... as strata::StatusCodeName; "UNKNOWN_CODE" for a
 * value outside the enum. A static string. */
STRATA_API const char* strata_status_name(strata_status status);

/* The message of the last non-OK status returned to the calling thread, e.g.
 * "INVALID_ARGUMENT: AdamW: lr must be finite and >= 0, got -1"; "" if there was
 * none. Thread-local: calls on other threads do not change it. The pointer stays
 * valid until the next failing Strata call on this thread; copy it to keep it. */
STRATA_API const char* strata_last_error(void);

/* ---------------------------------------------------------------------------
 * Element types
 * ------------------------------------------------------------------------- */

typedef enum strata_dtype STRATA_ENUM_INT {
  STRATA_DTYPE_F32 = 0, /* IEEE binary32 */
  STRATA_DTYPE_F16 = 1, /* IEEE binary16 */
  STRATA_DTYPE_BF16 = 2 /* bfloat16: the upper 16 bits of a binary32 */
} strata_dtype;

/* Size of one element in bytes (4 or 2); 0 for an unknown dtype. */
STRATA_API size_t strata_dtype_size(strata_dtype dtype);

/* ---------------------------------------------------------------------------
 * Optimizers
 * ------------------------------------------------------------------------- */

/* Values are stable across versions. */
typedef enum strata_optimizer_kind STRATA_ENUM_INT {
  /* torch.optim.AdamW: Loshchilov & Hutter, "Decoupled Weight Decay
   * Regularization", ICLR 2019. Config: strata_adamw_config. State buffers, in
   * this order: exp_avg (m), exp_avg_sq (v), and max_exp_avg_sq when amsgrad != 0
   * (AMSGrad: Reddi, Kale & Kumar, "On the Convergence of Adam and Beyond", ICLR
   * 2018). */
  STRATA_OPTIMIZER_ADAMW = 1,
  /* torch.optim.Adam (weight decay as an L2 term added to the gradient): Kingma &
   * Ba, "Adam: A Method for Stochastic Optimization", ICLR 2015. Config:
   * strata_adamw_config. State buffers: exp_avg, exp_avg_sq (, max_exp_avg_sq). */
  STRATA_OPTIMIZER_ADAM = 2,
  /* torch.optim.Adagrad: Duchi, Hazan & Singer, "Adaptive Subgradient Methods for
   * Online Learning and Stochastic Optimization", JMLR 12, 2011. Config:
   * strata_adagrad_config. State buffers: sum (torch's state['sum']), which the
   * caller fills with initial_accumulator_value before the first step. */
  STRATA_OPTIMIZER_ADAGRAD = 3,
  /* Lion (EvoLved Sign Momentum): Chen et al., "Symbolic Discovery of
   * Optimization Algorithms", NeurIPS 2023 (arXiv:2302.06675), Algorithm 2;
   * torch.optim has no Lion, the operation order is google/automl's
   * lion_pytorch.py. Config: strata_lion_config. State buffers: exp_avg. */
  STRATA_OPTIMIZER_LION = 4,
  /* torch.optim.SGD with momentum, dampening and Nesterov momentum (Polyak 1964;
   * Sutskever, Martens, Dahl & Hinton, "On the importance of initialization and
   * momentum in deep learning", ICML 2013). Config: strata_sgd_config. State
   * buffers: momentum_buffer when momentum != 0, none when momentum == 0
   * (strata_optimizer_num_state says which). */
  STRATA_OPTIMIZER_SGD = 5
} strata_optimizer_kind;

/* Hyper-parameters of AdamW and Adam, with torch.optim's meaning. Per element, in
 * fp32, in this order (t = the step argument of strata_optimizer_step):
 *   g = float(grad[i]) * grad_scale;   maximize != 0:  g = -g
 *   Adam,  weight_decay != 0:   g = g + weight_decay * p
 *   AdamW, weight_decay != 0:   p = p * (1 - lr * weight_decay)
 *   m = beta1 * m + (1 - beta1) * g
 *   v = beta2 * v + ((1 - beta2) * g) * g
 *   amsgrad != 0:               vmax = max(vmax, v)   (NaN if either is NaN, as torch.maximum)
 *   denom = sqrt(v) / sqrt(1 - beta2^t) + eps     (sqrt(v) + eps without bias correction;
 *                                                  sqrt(vmax) instead of sqrt(v) with amsgrad)
 *   p = p - ((lr / (1 - beta1^t)) * m) / denom    (lr * m / denom without bias correction)
 * The per-step scalars are computed in fp64 and rounded to fp32 once, as PyTorch
 * computes them in Python floats; results equal PyTorch's in exact arithmetic (the
 * rounding of the last bits may differ: PyTorch writes m as a lerp in newer
 * versions). Valid values are those torch.optim accepts: lr, eps, weight_decay
 * finite and >= 0; beta1, beta2 in [0, 1). */
typedef struct strata_adamw_config {
  size_t struct_size;  /* = sizeof(strata_adamw_config); checked, for ABI evolution */
  float lr;            /* learning rate, e.g. 1e-3 */
  float beta1;         /* e.g. 0.9 */
  float beta2;         /* e.g. 0.999 */
  float eps;           /* added to the denominator, e.g. 1e-8 */
  float weight_decay;  /* AdamW: decoupled (torch default 1e-2); Adam: L2 (torch default 0) */
  int bias_correction; /* 1: Adam's bias correction (as torch); 0: none (DeepSpeed option) */
  int amsgrad;         /* 0: off; 1: AMSGrad, a third state buffer max_exp_avg_sq (starts at 0) */
  int maximize;        /* 0: minimize; 1: maximize the objective (the gradient's sign is flipped) */
} strata_adamw_config;

/* Fills *config with torch.optim.AdamW's defaults (lr 1e-3, betas (0.9, 0.999),
 * eps 1e-8, weight_decay 1e-2, bias correction on, amsgrad and maximize off) and
 * sets struct_size. For Adam set weight_decay to 0 (torch.optim.Adam's default). */
STRATA_API void strata_adamw_config_init(strata_adamw_config* config);

/* Hyper-parameters of Adagrad, with torch.optim.Adagrad's meaning. Per element,
 * in fp32, in this order (t = the step argument of strata_optimizer_step):
 *   g = float(grad[i]) * grad_scale;   maximize != 0:  g = -g
 *   weight_decay != 0:  g = g + weight_decay * p                 (L2)
 *   clr = lr / (1 + (t - 1) * lr_decay)                          (fp64, rounded once)
 *   sum = sum + g * g
 *   p = p - (clr * g) / (sqrt(sum) + eps)
 * Valid values are those torch.optim.Adagrad accepts: lr, lr_decay, weight_decay,
 * initial_accumulator_value, eps finite and >= 0. */
typedef struct strata_adagrad_config {
  size_t struct_size;              /* = sizeof(strata_adagrad_config); checked */
  float lr;                        /* learning rate; torch default 1e-2 */
  float lr_decay;                  /* default 0 */
  float weight_decay;              /* L2; default 0 */
  float initial_accumulator_value; /* default 0; validated only: the caller fills sum with it */
  float eps;                       /* default 1e-10 */
  int maximize;                    /* default 0 */
} strata_adagrad_config;

/* Fills *config with torch.optim.Adagrad's defaults and sets struct_size. */
STRATA_API void strata_adagrad_config_init(strata_adagrad_config* config);

/* Hyper-parameters of Lion (the lion-pytorch package's arguments). Per element,
 * in fp32, in this order (sign(+-0) = +0, sign(NaN) = NaN):
 *   g = float(grad[i]) * grad_scale;   maximize != 0:  g = -g
 *   weight_decay != 0:  p = p * (1 - lr * weight_decay)    (decoupled; fp64 scalar, rounded once)
 *   c = beta1 * m + (1 - beta1) * g
 *   p = p - lr * sign(c)
 *   m = beta2 * m + (1 - beta2) * g
 * The step count is not used. Valid values: lr, weight_decay finite and >= 0;
 * beta1, beta2 in [0, 1]. Lion wants a learning rate 3-10x smaller and a weight
 * decay 3-10x larger than AdamW's (the paper, section 5). */
typedef struct strata_lion_config {
  size_t struct_size; /* = sizeof(strata_lion_config); checked */
  float lr;           /* default 1e-4 */
  float beta1;        /* default 0.9 */
  float beta2;        /* default 0.99 */
  float weight_decay; /* decoupled, as AdamW; default 0 */
  int maximize;       /* default 0 */
} strata_lion_config;

/* Fills *config with lion-pytorch's defaults (lr 1e-4, betas (0.9, 0.99),
 * weight_decay 0) and sets struct_size. */
STRATA_API void strata_lion_config_init(strata_lion_config* config);

/* Hyper-parameters of SGD, with torch.optim.SGD's meaning. Per element, in fp32,
 * in this order (t = the step argument of strata_optimizer_step):
 *   g = float(grad[i]) * grad_scale;   maximize != 0:  g = -g
 *   weight_decay != 0:  g = g + weight_decay * p                 (L2)
 *   momentum != 0:
 *     t == 1:  buf = g          (torch's first step: the buffer is a clone of g)
 *     t > 1:   buf = momentum * buf + (1 - dampening) * g
 *     nesterov != 0:  g = g + momentum * buf;   else:  g = buf
 *   p = p - lr * g
 * Pass t = 1 on the step that creates the momentum buffer (its contents are then
 * ignored) and any t > 1 afterwards. Valid values are those torch.optim.SGD
 * accepts: lr, momentum, weight_decay finite and >= 0, dampening finite; nesterov
 * needs momentum > 0 and dampening == 0. */
typedef struct strata_sgd_config {
  size_t struct_size; /* = sizeof(strata_sgd_config); checked */
  float lr;           /* torch requires it; default here 1e-3 (cpu_optim's) */
  float momentum;     /* default 0: no state buffer */
  float dampening;    /* default 0 */
  float weight_decay; /* L2; default 0 */
  int nesterov;       /* default 0 */
  int maximize;       /* default 0 */
} strata_sgd_config;

/* Fills *config with torch.optim.SGD's defaults (momentum, dampening,
 * weight_decay 0, nesterov and maximize off; lr 1e-3, since torch has no default
 * lr) and sets struct_size. */
STRATA_API void strata_sgd_config_init(strata_sgd_config* config);

/* Threading options of an optimizer handle. */
typedef struct strata_optimizer_options {
  size_t struct_size; /* = sizeof(strata_optimizer_options); checked (the 0.1.0 layout,
                         which ends after num_threads, is accepted too) */
  /* Worker threads of a step, the calling thread included: 0 = oneTBB's default
   * (all CPUs this process may use; with cores: one per listed core), 1 = the
   * calling thread only, n > 1 = a private oneTBB arena of n threads. Results do
   * not depend on it. */
  int num_threads;
  /* Optional core binding (cpu_optim::WorkerArena): num_cores logical CPU ids (as
   * sched_setaffinity and /proc/cpuinfo number them), each in the process's
   * affinity mask, none twice; the handle's threads, and the calling thread for the
   * duration of a step, are bound to them while they run its steps (thread slot i
   * to cores[i % num_cores]), e.g. to keep the optimizer off the cores that feed
   * the GPU and on the NUMA node that holds the state. The ids are copied at
   * create; NULL / 0 = no binding. Binding never changes results. Linux only. */
  const int* cores;
  int num_cores;
} strata_optimizer_options;

/* Fills *options with the defaults (num_threads 0, no binding) and sets struct_size. */
STRATA_API void strata_optimizer_options_init(strata_optimizer_options* options);

typedef struct strata_optimizer strata_optimizer;

/* Creates an optimizer of the given kind. config points to the kind's config
 * struct (see strata_optimizer_kind) with struct_size set; options may be NULL for
 * the defaults. On success *out is a new handle owned by the caller (free it with
 * strata_optimizer_destroy). Errors: STRATA_INVALID_ARGUMENT for a NULL config or
 * out, an unknown kind, a struct_size that does not match the kind's struct (it
 * catches a header/library version mismatch; it cannot tell apart structs of
 * equal size, so pass the struct that belongs to kind), a
 * hyper-parameter torch.optim rejects, num_threads < 0, num_cores < 0, cores NULL with
 * num_cores > 0, a core id out of range, listed twice or outside the process's
 * affinity mask; STRATA_UNIMPLEMENTED for core binding off Linux; STRATA_RESOURCE_EXHAUSTED
 * when memory or the thread arena cannot be had. *out is NULL on error. */
STRATA_API strata_status strata_optimizer_create(strata_optimizer_kind kind, const void* config,
                                                 const strata_optimizer_options* options,
                                                 strata_optimizer** out);

/* Frees the handle. NULL is allowed and does nothing. */
STRATA_API void strata_optimizer_destroy(strata_optimizer* optimizer);

/* Replaces the hyper-parameters (e.g. a learning-rate schedule changing lr) with
 * config, of the handle's kind; same checks and errors as strata_optimizer_create.
 * On error the handle keeps its previous hyper-parameters. Not thread-safe with
 * respect to other calls on the same handle. */
STRATA_API strata_status strata_optimizer_set_config(strata_optimizer* optimizer,
                                                     const void* config);

/* The handle's kind; the number of state buffers strata_optimizer_step expects
 * with its current config (AdamW, Adam: 2, or 3 with amsgrad; Adagrad, Lion: 1;
 * SGD: 1, or 0 when momentum == 0). Both are 0 for a NULL handle. */
STRATA_API strata_optimizer_kind strata_optimizer_get_kind(const strata_optimizer* optimizer);
STRATA_API int strata_optimizer_num_state(const strata_optimizer* optimizer);

/* One optimizer step over one flat tensor of num_elems elements:
 *   params      fp32 master weights, updated in place;
 *   state       num_state pointers to fp32 state buffers of num_elems elements each,
 *               in the kind's order (see strata_optimizer_kind), updated in place;
 *               initialized before the first step as torch does (zeros; Adagrad's
 *               sum: initial_accumulator_value; SGD's momentum_buffer: anything);
 *   grad        num_elems gradient elements of grad_dtype (F32, F16 or BF16), read
 *               only; 16-bit gradients are widened exactly;
 *   step        t >= 1, the 1-based step count (torch's state['step'] after its
 *               increment): Adam's bias correction, Adagrad's lr_decay, SGD's
 *               buffer creation at t == 1; Lion ignores it;
 *   grad_scale  every gradient element is multiplied by it first, e.g.
 *               clip_coef / loss_scale; 1 for none; must be finite;
 *   copy_out    NULL, or num_elems elements of copy_out_dtype receiving the updated
 *               weights (round to nearest even, NaN kept), e.g. the bf16 working
 *               copy for the next forward pass; ignored when NULL.
 * No buffer may overlap another. Non-finite gradients are not an error (a NaN
 * gradient makes NaN weights): check strata_grad_stats_compute's nonfinite first.
 * Errors (nothing modified): STRATA_INVALID_ARGUMENT for a NULL handle, num_state
 * different from strata_optimizer_num_state, a NULL pointer with num_elems > 0,
 * num_elems < 0, an unknown dtype, overlapping buffers, step < 1, a non-finite
 * grad_scale. STRATA_RESOURCE_EXHAUSTED / STRATA_INTERNAL when oneTBB fails (the
 * buffers may then be partly updated). Runs on the calling thread and the handle's
 * workers; returns when the step is complete. */
STRATA_API strata_status strata_optimizer_step(const strata_optimizer* optimizer, int64_t step,
                                               float grad_scale, float* params, float* const* state,
                                               int num_state, const void* grad,
                                               strata_dtype grad_dtype, void* copy_out,
                                               strata_dtype copy_out_dtype, int64_t num_elems);

/* ---------------------------------------------------------------------------
 * Gradient passes (stateless; run on the calling thread and oneTBB's default
 * arena, or the innermost tbb::task_arena of the caller)
 *
 * Global-norm clipping as in Pascanu et al., "On the difficulty of training
 * recurrent neural networks", ICML 2013; overflow detection for dynamic loss
 * scaling as in Micikevicius et al., "Mixed Precision Training", ICLR 2018.
 * ------------------------------------------------------------------------- */

/* Statistics of a gradient bucket. */
typedef struct strata_grad_stats {
  double sum_squares; /* sum of (scale * g)^2, each product and the sum in fp64 */
  int nonfinite;      /* 1 if some element is +-inf or NaN, else 0 */
  int64_t num_elems;  /* elements covered */
} strata_grad_stats;

/* *out = statistics of num_elems elements of grad (dtype F32, F16 or BF16), each
 * multiplied by scale (e.g. 1 / loss_scale) before squaring. The sum is
 * bit-identical for any thread count (fixed fp64 summation order). The global
 * norm of several buckets is sqrt of the sum of their sum_squares, merged in a
 * fixed order. Errors (STRATA_INVALID_ARGUMENT): NULL grad with num_elems > 0,
 * NULL out, num_elems < 0, unknown dtype, non-finite scale. */
STRATA_API strata_status strata_grad_stats_compute(const void* grad, strata_dtype dtype,
                                                   int64_t num_elems, float scale,
                                                   strata_grad_stats* out);

/* Gradient accumulation over micro-batches into an fp32 buffer of num_elems:
 *   overwrite != 0:  accum[i] = float(grad[i])            (exact)
 *   overwrite == 0:  accum[i] = accum[i] + float(grad[i])  (one fp32 rounding)
 * When stats is not NULL it receives the statistics of the resulting accum values
 * (scale 1), computed in the same pass. accum and grad must not overlap. Errors
 * (STRATA_INVALID_ARGUMENT, nothing modified): NULL pointers with num_elems > 0,
 * num_elems < 0, unknown dtype, overlap. */
STRATA_API strata_status strata_grad_accumulate(float* accum, const void* grad,
                                                strata_dtype grad_dtype, int64_t num_elems,
                                                int overwrite, strata_grad_stats* stats);

/* dst[i] = dst_dtype(src[i]) for num_elems elements: round to nearest even, NaN
 * kept (quiet), overflow to inf, denormals kept. F32 copies the bits. Errors
 * (STRATA_INVALID_ARGUMENT): NULL pointers with num_elems > 0, num_elems < 0,
 * unknown dtype, overlapping buffers. */
STRATA_API strata_status strata_convert_from_f32(const float* src, void* dst,
                                                 strata_dtype dst_dtype, int64_t num_elems);

/* dst[i] = float(src[i]) for num_elems elements (exact). Errors as above. */
STRATA_API strata_status strata_convert_to_f32(const void* src, strata_dtype src_dtype, float* dst,
                                               int64_t num_elems);

/* The CPU kernel variant in use, chosen once by CPUID: "avx512", "avx2" or
 * "generic". A static string. */
STRATA_API const char* strata_kernel_name(void);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* STRATA_STRATA_H_ */

/* Strata C API: the CPU optimizers, gradient passes and the offload optimizer of libstrata.so
 * behind a stable C ABI, for frameworks and languages that cannot link C++ (the Python package
 * python/strata/ uses it through ctypes).
 *
 * Shape of the API
 *   - Opaque handles: a strata_optimizer holds an optimizer's hyper-parameters and
 *     its threading options; it owns no tensor memory.
 *   - Caller-owned buffers: parameters (fp32 master weights), optimizer state and
 *     gradients are the caller's, laid out as torch.optim keeps them (one flat
 *     fp32 buffer per state tensor: exp_avg, exp_avg_sq, ...), so a PyTorch
 *     state_dict can be used as is. Nothing is retained after a call returns.
 *     AdamW8bit and Adafactor keep state that is not one fp32 value per parameter
 *     (8-bit codes, per-block scales, factored rows and columns): their state is
 *     described by strata_optimizer_state_layout and stepped by
 *     strata_optimizer_step_state (since 0.4), which serve every kind.
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
#define STRATA_VERSION_MINOR 4
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
  STRATA_OPTIMIZER_SGD = 5,
  /* AdamW with 8-bit block-wise quantized moments (since 0.4): Dettmers, Lewis,
   * Shleifer & Zettlemoyer, "8-bit Optimizers via Block-wise Quantization", ICLR
   * 2022 (dynamic tree quantization; one fp32 absmax per block of 2048 values).
   * Config: strata_adamw_config (decoupled weight decay as ADAMW; amsgrad must be
   * 0). The update is AdamW's formulas on the dequantized moments, after which m
   * and v are re-quantized (cpu_optim/adamw8bit.h has the exact definition).
   * State sections (strata_optimizer_state_layout), for a tensor of n elements:
   * exp_avg (U8, n codes, start 127), exp_avg.absmax (F32, ceil(n / 2048), start 0),
   * exp_avg_sq (U8, n codes, start 0), exp_avg_sq.absmax (F32, ceil(n / 2048),
   * start 0): about 2 bytes per parameter instead of 8. Stepped only by
   * strata_optimizer_step_state (strata_optimizer_num_state is 0). */
  STRATA_OPTIMIZER_ADAMW8BIT = 6,
  /* Adafactor (since 0.4): Shazeer & Stern, "Adafactor: Adaptive Learning Rates
   * with Sublinear Memory Cost", ICML 2018, with Hugging Face transformers'
   * options. Config: strata_adafactor_config. A tensor of >= 2 dimensions keeps a
   * factored second moment: exp_avg_sq_row (F32, prod(shape[:-1]) values) and
   * exp_avg_sq_col (F32, shape[-1] values); another keeps exp_avg_sq (F32, one per
   * element); beta1 > 0 adds exp_avg (F32, one per element). All start at 0.
   * Stepped only by strata_optimizer_step_state, which takes the tensor's shape. */
  STRATA_OPTIMIZER_ADAFACTOR = 7
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

/* Hyper-parameters of Adafactor (since 0.4), with the names and meaning of
 * Hugging Face transformers' Adafactor. Per tensor, t = the step argument of
 * strata_optimizer_step_state, RMS(x) = sqrt(mean(x^2)) over the tensor:
 *   g = float(grad) * grad_scale;   maximize != 0:  g = -g
 *   lr_t = relative_step ? min(warmup_init ? 1e-6 * t : 1e-2, 1 / sqrt(t)) : lr
 *   scale_parameter != 0:  lr_t = lr_t * max(eps2, RMS(p))
 *   beta2t = 1 - t^decay_rate;   u = g * g + eps1
 *   >= 2 dims, as a (rows = prod(shape[:-1]), cols = shape[-1]) matrix:
 *     R = beta2t * R + (1 - beta2t) * row means of u;  C likewise with column means
 *     update = rsqrt(R[i] / mean(R)) * rsqrt(C[j]) * g
 *   otherwise:  V = beta2t * V + (1 - beta2t) * u;  update = rsqrt(V) * g
 *   update = update * (lr_t / max(1, RMS(update) / clip_threshold))
 *   beta1 > 0:  M = beta1 * M + (1 - beta1) * update;  update = M
 *   weight_decay != 0:  p = p * (1 - weight_decay * lr_t);   p = p - update
 * Scalars in fp64 rounded once, element-wise arithmetic fp32, reductions as fp64
 * sums in a fixed order (cpu_optim/adafactor.h): bit-identical on every thread
 * count and ISA. Valid values: lr, eps1, eps2, weight_decay finite and >= 0;
 * clip_threshold finite and > 0; decay_rate finite and <= 0; beta1 in [0, 1);
 * warmup_init needs relative_step. */
typedef struct strata_adafactor_config {
  size_t struct_size;   /* = sizeof(strata_adafactor_config); checked */
  float lr;             /* used when relative_step == 0; default 1e-3 */
  float eps1;           /* added to g^2; default 1e-30 */
  float eps2;           /* lower bound of RMS(p) with scale_parameter; default 1e-3 */
  float clip_threshold; /* update clipping; default 1 */
  float decay_rate;     /* beta2t = 1 - t^decay_rate; default -0.8 */
  float beta1;          /* default 0: no first moment (no exp_avg section) */
  float weight_decay;   /* default 0 */
  int relative_step;    /* default 0 (transformers' default is 1, with lr None) */
  int scale_parameter;  /* default 0 */
  int warmup_init;      /* default 0 */
  int maximize;         /* default 0 */
} strata_adafactor_config;

/* Fills *config with the defaults above and sets struct_size. */
STRATA_API void strata_adafactor_config_init(strata_adafactor_config* config);

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
 * SGD: 1, or 0 when momentum == 0; AdamW8bit, Adafactor: 0, they are stepped by
 * strata_optimizer_step_state). Both are 0 for a NULL handle. */
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
 * different from strata_optimizer_num_state, a NULL buffer with num_elems > 0
 * (the message names it: params, grad, state[i]),
 * num_elems < 0, an unknown dtype, overlapping buffers, step < 1, a non-finite
 * grad_scale. STRATA_RESOURCE_EXHAUSTED / STRATA_INTERNAL when oneTBB fails (the
 * buffers may then be partly updated). Runs on the calling thread and the handle's
 * workers; returns when the step is complete. */
STRATA_API strata_status strata_optimizer_step(const strata_optimizer* optimizer, int64_t step,
                                               float grad_scale, float* params, float* const* state,
                                               int num_state, const void* grad,
                                               strata_dtype grad_dtype, void* copy_out,
                                               strata_dtype copy_out_dtype, int64_t num_elems);

/* ---- State of any kind: layout, initial values, step (since 0.4) ----
 *
 * An optimizer's state for one tensor is a list of sections, each a buffer of
 * fp32 values or of 8-bit codes whose size may depend on the tensor's shape (see
 * strata_optimizer_kind). For AdamW, Adam, Adagrad, Lion and SGD the sections are
 * the state buffers of strata_optimizer_step (num_elems fp32 values each), so the
 * calls below serve every kind. */

/* A section's element type. */
typedef enum strata_state_dtype STRATA_ENUM_INT {
  STRATA_STATE_F32 = 0, /* IEEE binary32, host byte order; 4-byte aligned buffers */
  STRATA_STATE_U8 = 1   /* uint8 codes (indices into a quantization map); any alignment */
} strata_state_dtype;

/* The most sections any kind has (a bound for arrays of strata_state_section). */
#define STRATA_MAX_STATE_SECTIONS 8

/* One section of a tensor's state. The layout of this struct never changes; a
 * later version adds fields through a new struct and function. */
typedef struct strata_state_section {
  char name[48];            /* NUL-terminated: "exp_avg", "exp_avg.absmax", "exp_avg_sq_row", ...
                               (torch.optim's key where there is one) */
  strata_state_dtype dtype; /* STRATA_STATE_F32 or STRATA_STATE_U8 */
  int64_t num_elems;        /* elements (values or codes) */
  int64_t size_bytes;       /* num_elems * 4 (F32) or num_elems (U8) */
  float initial_value;      /* F32: what every element starts at */
  int initial_code;         /* U8: the code every element starts at (0..255) */
} strata_state_section;

/* The state sections of one tensor of shape shape[0..ndim) (row-major; ndim >= 0,
 * ndim 0 = a scalar; every dimension > 0) for the handle's kind and current
 * config: *num_sections receives their count (0..STRATA_MAX_STATE_SECTIONS), and
 * the first min(count, max_sections) are written to sections (which may be NULL
 * when max_sections is 0: a query of the count). Errors (INVALID_ARGUMENT, nothing
 * written): NULL handle or num_sections, shape NULL with ndim > 0, ndim < 0, a
 * dimension <= 0, more than 2^50 elements, sections NULL with max_sections > 0.
 * Thread-safe as
 * strata_optimizer_step. */
STRATA_API strata_status strata_optimizer_state_layout(const strata_optimizer* optimizer,
                                                       const int64_t* shape, int ndim,
                                                       strata_state_section* sections,
                                                       int max_sections, int* num_sections);

/* Writes each section's initial value (initial_value / initial_code) into state,
 * num_sections buffers of the layout's sizes, in its order (e.g. before a first
 * step). Errors as strata_optimizer_state_layout, and INVALID_ARGUMENT for
 * num_sections different from the layout's, a NULL buffer, or an fp32 section's
 * buffer not 4-byte aligned. */
STRATA_API strata_status strata_optimizer_init_state(const strata_optimizer* optimizer,
                                                     const int64_t* shape, int ndim,
                                                     void* const* state, int num_sections);

/* One step of any kind over one tensor of shape shape[0..ndim) (num_elems =
 * the product of the dimensions; 1 for ndim 0):
 *   params      num_elems fp32 master weights, updated in place;
 *   state       num_sections buffers, one per section of
 *               strata_optimizer_state_layout for this shape, in that order, each
 *               state_size_bytes[i] == the section's size_bytes (F32 sections
 *               4-byte aligned), updated in place;
 *   grad, grad_dtype, copy_out, copy_out_dtype, step, grad_scale  as
 *               strata_optimizer_step.
 * Numerics as the kind's definition above; for the per-element kinds the same
 * bits as strata_optimizer_step. No buffer may overlap another. Errors (nothing
 * modified): INVALID_ARGUMENT for the layout's errors, a section count or size
 * that differs from the layout (the message names the section), a NULL params
 * or grad with num_elems > 0, an unknown dtype, step < 1, a non-finite
 * grad_scale, a rejected config (AdamW8bit with amsgrad); RESOURCE_EXHAUSTED /
 * INTERNAL as strata_optimizer_step (Adafactor allocates fp64 partial sums of
 * about num_elems / 64 values). */
STRATA_API strata_status
strata_optimizer_step_state(const strata_optimizer* optimizer, int64_t step, float grad_scale,
                            float* params, const int64_t* shape, int ndim, void* const* state,
                            const int64_t* state_size_bytes, int num_sections, const void* grad,
                            strata_dtype grad_dtype, void* copy_out, strata_dtype copy_out_dtype);

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

/* ---------------------------------------------------------------------------
 * Offload optimizer (ZeRO-Offload for any framework)
 *
 * Ren et al., "ZeRO-Offload: Democratizing Billion-Scale Model Training", USENIX
 * ATC 2021; optimizer state on NVMe as in Rajbhandari et al., "ZeRO-Infinity",
 * SC 2021. The C face of strata::engine::OffloadOptimizer
 * (offload/offload_optimizer.h, which has the full contract).
 *
 * The caller owns its model and working parameters; Strata owns the fp32 master
 * weights and the optimizer state, in host memory or on NVMe (the swap store:
 * striped over the given directories, xxh3-checked, removed at destroy).
 *   group   an optimizer kind and its hyper-parameters (the config structs above)
 *           with its own step count t, as torch.optim's param_groups;
 *   bucket  the unit of gradient hand-off, update and write-back: an ordered list
 *           of the caller's parameter buffers (segments) of one dtype, in one group.
 * A training step: during backward, hand each bucket's gradients in
 * (strata_offload_submit_grad, from a staging buffer or the caller's memory); the
 * call returns at once and Strata's threads fold them into fp32 accumulators with
 * their statistics. strata_offload_step then starts the update of every bucket in
 * bucket order (global-norm clipping, loss-scale unscaling, the overflow skip) and
 * returns; each bucket's new weights are written into the caller's segments, and
 * strata_offload_wait_bucket returns when that happened, so the next forward
 * waits per bucket, not per step. Results are those of a sequential step, bit for
 * bit, whatever the threads, the home of the state or the timing.
 *
 * Errors: every call returns a strata_status and sets strata_last_error(); no
 * call aborts the process. Bad use (unknown bucket, dtype or size mismatch, a
 * step before every segment received its gradient) is INVALID_ARGUMENT or
 * FAILED_PRECONDITION and changes nothing. An error of the asynchronous work (an
 * NVMe write failing, a checksum mismatch) is sticky: it comes back from the next
 * call that waits on that work and, as FAILED_PRECONDITION naming it, from every
 * later call; destroy the handle and load a saved state into a new one.
 *
 * Thread-safety: calls on one handle must not run concurrently, except
 * strata_offload_wait_bucket, which may run concurrently with any call but
 * strata_offload_destroy.
 * ------------------------------------------------------------------------- */

typedef struct strata_offload strata_offload;

typedef enum strata_offload_device STRATA_ENUM_INT {
  STRATA_OFFLOAD_CPU = 0, /* master weights and state in host memory */
  STRATA_OFFLOAD_NVME = 1 /* in the NVMe swap store under nvme_paths */
} strata_offload_device;

typedef struct strata_offload_options {
  size_t struct_size;           /* = sizeof(strata_offload_options); checked */
  strata_offload_device device; /* default STRATA_OFFLOAD_CPU */
  /* STRATA_OFFLOAD_NVME: num_nvme_paths parent directories, one per drive; a
   * private 0700 directory is made in each. Copied at create. */
  const char* const* nvme_paths;
  int num_nvme_paths;
  /* Threads of the folds and updates; 0 (default) = all CPUs. */
  int num_threads;
  /* NVMe read/update/write pipeline buffers, >= 2 (default 4; DeepSpeed's
   * offload_optimizer.buffer_count). */
  int buffer_count;
  /* Gradient staging buffers, >= 1 (default 4). */
  int staging_buffers;
  /* 1 (default): page-lock staging and pipeline buffers (DeepSpeed's
   * pin_memory); a refused mlock logs one warning and goes on unpinned. */
  int pin_memory;
  /* "auto" (default, NULL too), "uring" or "posix": the NVMe I/O backend. */
  const char* io_backend;
} strata_offload_options;

/* Fills *options with the defaults and sets struct_size. */
STRATA_API void strata_offload_options_init(strata_offload_options* options);

/* The `auto` home of an offload optimizer's master weights and optimizer state, by the
 * engine's one planning author (engine/plan/plan_choice.h, ChooseOffloadHome): *device =
 * STRATA_OFFLOAD_CPU while state_bytes is at most 80 % of the host memory available now
 * (MemAvailable of /proc/meminfo; when it cannot be read, CPU), else STRATA_OFFLOAD_NVME when
 * nvme_paths_given is non-zero. state_bytes: the fp32 master weights and the optimizer state of
 * every parameter (4 bytes per element plus the state layout's, strata_optimizer_state_layout).
 * Errors: INVALID_ARGUMENT for a NULL device; RESOURCE_EXHAUSTED when the state does not fit
 * and no NVMe path is given (the message says both sizes). Thread-safe. */
STRATA_API strata_status strata_offload_choose_device(uint64_t state_bytes, int nvme_paths_given,
                                                      strata_offload_device* device);

/* Creates an offload optimizer; *out is owned by the caller (strata_offload_destroy).
 * Errors: INVALID_ARGUMENT for bad options (NVME without paths, buffer_count < 2,
 * an unknown io_backend, a struct_size mismatch); the swap store's errors naming
 * an unusable directory (PERMISSION_DENIED, NOT_FOUND, ...). *out is NULL on
 * error. */
STRATA_API strata_status strata_offload_create(const strata_offload_options* options,
                                               strata_offload** out);

/* Waits for the work in flight, frees everything and removes the swap files.
 * NULL does nothing. */
STRATA_API void strata_offload_destroy(strata_offload* offload);

/* A new parameter group of an optimizer kind, with config its config struct
 * (struct_size set); *group receives its index (0, 1, ...). Errors: as
 * strata_optimizer_create. */
STRATA_API strata_status strata_offload_add_group(strata_offload* offload,
                                                  strata_optimizer_kind kind, const void* config,
                                                  int* group);

/* Replaces a group's hyper-parameters from the next update on (a learning-rate
 * schedule). The kind is the group's; amsgrad and SGD momentum on/off must stay.
 * Errors: INVALID_ARGUMENT; the group keeps its previous config. */
STRATA_API strata_status strata_offload_set_group_config(strata_offload* offload, int group,
                                                         const void* config);

/* A group's step count t (updates applied), and setting it (>= 0; to restore a
 * saved state by other means than strata_offload_load). */
STRATA_API strata_status strata_offload_get_group_step(const strata_offload* offload, int group,
                                                       int64_t* step);
STRATA_API strata_status strata_offload_set_group_step(strata_offload* offload, int group,
                                                       int64_t step);

/* A new bucket of `group` over num_segments caller buffers: segments[i] holds
 * segment_num_elems[i] > 0 elements of param_dtype (F32, F16 or BF16). The
 * segments are read now into the fp32 master weights; Strata writes them at each
 * update of the bucket, so they must stay valid until strata_offload_destroy, and
 * the caller must not read them between strata_offload_step and
 * strata_offload_wait_bucket. Buckets are updated in the order they were added:
 * add them in the order the next forward uses them. *bucket receives the index.
 * Errors: INVALID_ARGUMENT (unknown group or dtype, NULL or empty segments, a
 * segment not aligned to its element size, segments that overlap, a bucket of
 * more than 2^50 elements); FAILED_PRECONDITION once a gradient, a staging buffer
 * or a step happened; RESOURCE_EXHAUSTED for memory or a full drive. With state
 * on NVMe a failed write to the drive is sticky (as the errors of asynchronous
 * work above): make a new handle with room on the drive. */
STRATA_API strata_status strata_offload_add_bucket(strata_offload* offload, int group,
                                                   strata_dtype param_dtype, void* const* segments,
                                                   const int64_t* segment_num_elems,
                                                   int num_segments, int* bucket);

/* Elements of a bucket (the sum of its segments), or -1 for an unknown bucket. */
STRATA_API int64_t strata_offload_bucket_num_elems(const strata_offload* offload, int bucket);

/* strata_offload_add_bucket with the segments' shapes (since 0.4): segment i is a
 * tensor of shape segment_shapes[i][0..segment_ndims[i]) (dimensions > 0 whose
 * product is segment_num_elems[i]); segment_shapes NULL, or segment_ndims[i] == 0,
 * means flat. Only Adafactor's state depends on shapes (tensors of >= 2 dimensions
 * are factored); every kind steps each segment as one tensor (AdamW8bit's
 * quantization blocks start at each segment). The shapes are copied. Errors as
 * strata_offload_add_bucket, and INVALID_ARGUMENT for a shape that does not
 * match its length (segment_ndims NULL with segment_shapes set, a NULL shape
 * with ndim > 0, a dimension <= 0). */
STRATA_API strata_status strata_offload_add_bucket_shaped(
    strata_offload* offload, int group, strata_dtype param_dtype, void* const* segments,
    const int64_t* segment_num_elems, const int64_t* const* segment_shapes,
    const int* segment_ndims, int num_segments, int* bucket);

/* A staging buffer for one whole-bucket gradient of grad_dtype: the bucket's
 * element count, 64-byte aligned, pinned when pin_memory. Blocks until a buffer
 * is free. Fill it and hand it back with strata_offload_submit_grad(bucket, -1,
 * *data, ...); it returns to the pool when that gradient is folded. A buffer
 * acquired and never submitted stays taken. Errors: INVALID_ARGUMENT for an
 * unknown bucket or dtype; FAILED_PRECONDITION when every staging buffer is
 * acquired and none submitted (no fold would free one: waiting would never end;
 * *data is NULL). */
STRATA_API strata_status strata_offload_acquire_staging(strata_offload* offload, int bucket,
                                                        strata_dtype grad_dtype, void** data);

/* One micro-batch's gradient for segment `segment` of `bucket` (-1: the whole
 * bucket, segment after segment): num_elems elements of grad_dtype (F32, F16,
 * BF16). Returns at once; Strata folds it on its thread, after cuda_event (a
 * cudaEvent_t, or NULL) has completed — e.g. recorded after the copy that fills
 * grad — and after the bucket's previous update. grad must stay unchanged until
 * the fold is done (strata_offload_wait_grads, _step and _synchronize wait for
 * it). The first gradient after a step overwrites the accumulator; later ones
 * add to it (gradient accumulation). Errors (nothing queued): INVALID_ARGUMENT for
 * an unknown bucket or segment, NULL grad, a size or dtype mismatch;
 * FAILED_PRECONDITION for a second gradient of a segment in one micro-batch, or a
 * cuda_event without a CUDA runtime in the process. */
STRATA_API strata_status strata_offload_submit_grad(strata_offload* offload, int bucket,
                                                    int segment, const void* grad,
                                                    strata_dtype grad_dtype, int64_t num_elems,
                                                    void* cuda_event);

/* Waits until every submitted gradient is folded. */
STRATA_API strata_status strata_offload_wait_grads(strata_offload* offload);

/* Drops every gradient submitted since the last step (since 0.4; torch's zero_grad
 * between backward and step, or after a backward that raised halfway): waits for
 * the folds in flight, then the next gradient of each segment starts a new
 * accumulation, and the staging buffers acquired and not submitted return to the
 * pool (the caller must not use them again). Master weights, state and step counts
 * do not change; an update in flight goes on. Errors: a fold's error (sticky);
 * FAILED_PRECONDITION after an earlier error. */
STRATA_API strata_status strata_offload_discard_grads(strata_offload* offload);

typedef struct strata_offload_step_options {
  size_t struct_size;   /* = sizeof(strata_offload_step_options); checked */
  double max_grad_norm; /* clip to this global L2 norm as torch's clip_grad_norm_;
                           0 (default) = none */
  float loss_scale;     /* gradients are divided by it; finite, > 0; default 1 */
} strata_offload_step_options;

/* Fills *options with the defaults and sets struct_size. */
STRATA_API void strata_offload_step_options_init(strata_offload_step_options* options);

typedef struct strata_offload_step_result {
  double grad_norm;  /* global L2 norm of the unscaled gradient before clipping */
  int skipped;       /* 1: a non-finite gradient; nothing changed */
  int micro_batches; /* gradients each segment received for this step */
} strata_offload_step_result;

/* Starts the update of every bucket and returns once it is queued (options NULL:
 * the defaults). Every segment must have received the same number n >= 1 of
 * gradients since the last step (FAILED_PRECONDITION naming the first that did
 * not; nothing changes). A non-finite gradient skips the step: no master weight,
 * state, step count or caller buffer changes, result->skipped = 1. result may be
 * NULL. */
STRATA_API strata_status strata_offload_step(strata_offload* offload,
                                             const strata_offload_step_options* options,
                                             strata_offload_step_result* result);

/* Waits until bucket's new weights are in the caller's segments. With state on
 * NVMe the bucket's state may still be on its way to the drive (synchronize waits
 * for that; a failed write comes back from a later call). Safe to call
 * concurrently with the other calls. */
STRATA_API strata_status strata_offload_wait_bucket(strata_offload* offload, int bucket);

/* Waits for every fold and update. */
STRATA_API strata_status strata_offload_synchronize(strata_offload* offload);

/* The number of state tensors (sections) of a bucket, and the name of tensor
 * `tensor`: 0 "master", 1.. the state's ("exp_avg", "exp_avg_sq", ...; torch.optim's
 * keys; AdamW8bit's and Adafactor's section names). A bucket's section is the
 * sections of that name of its segments (each one tensor, see
 * strata_offload_add_bucket_shaped), back to back, segment after segment; for
 * AdamW, Adam, Adagrad, Lion and SGD that is one fp32 value per element of the
 * bucket, as before 0.4. NULL / -1 for unknown indices. */
STRATA_API int strata_offload_bucket_num_state(const strata_offload* offload, int bucket);
STRATA_API const char* strata_offload_tensor_name(const strata_offload* offload, int bucket,
                                                  int tensor);

/* Reads / replaces tensor `tensor` (0 master weights, 1 + i section i) of a
 * bucket as fp32 values: num_elems must be the tensor's element count
 * (bucket_num_elems for the masters and the per-element kinds' state; the
 * section's num_elems otherwise). Waits for the work in flight first. Writing the
 * master weights also writes them, rounded, into the caller's segments. Errors:
 * INVALID_ARGUMENT for unknown indices, a NULL buffer, another count, or an 8-bit
 * section (use strata_offload_read_state_bytes). */
STRATA_API strata_status strata_offload_read_state(strata_offload* offload, int bucket, int tensor,
                                                   float* out, int64_t num_elems);
STRATA_API strata_status strata_offload_write_state(strata_offload* offload, int bucket, int tensor,
                                                    const float* in, int64_t num_elems);

/* Tensor `tensor` of a bucket described (since 0.4): tensor 0 is "master" (F32,
 * bucket_num_elems); 1 + i is section i. Errors: INVALID_ARGUMENT for a NULL
 * handle or out, unknown indices. */
STRATA_API strata_status strata_offload_state_section(const strata_offload* offload, int bucket,
                                                      int tensor, strata_state_section* out);

/* Where segment `segment`'s part of tensor `tensor` lies inside the bucket's
 * tensor, in elements of its dtype: [*offset_elems, *offset_elems + *num_elems);
 * *num_elems is 0 when the segment has no part in it (a 1-D tensor has no
 * Adafactor rows). With strata_optimizer_state_layout of the segment's shape it
 * gives a per-parameter state_dict. Errors: INVALID_ARGUMENT for NULL pointers
 * or unknown indices. */
STRATA_API strata_status strata_offload_segment_state_range(const strata_offload* offload,
                                                            int bucket, int segment, int tensor,
                                                            int64_t* offset_elems,
                                                            int64_t* num_elems);

/* Reads / replaces tensor `tensor` of a bucket as raw bytes, any kind (since
 * 0.4): size_bytes must be the tensor's size_bytes (F32 in host byte order, or U8
 * codes). Waits for the work in flight first; writing the masters also writes the
 * caller's segments. Errors: INVALID_ARGUMENT for unknown indices, a NULL buffer,
 * another size; the errors of the work in flight and of the swap store. */
STRATA_API strata_status strata_offload_read_state_bytes(strata_offload* offload, int bucket,
                                                         int tensor, void* out, int64_t size_bytes);
STRATA_API strata_status strata_offload_write_state_bytes(strata_offload* offload, int bucket,
                                                          int tensor, const void* in,
                                                          int64_t size_bytes);

/* Reads the caller's segments into the bucket's master weights again (after the
 * caller loaded new weights into its model). */
STRATA_API strata_status strata_offload_reload_masters(strata_offload* offload, int bucket);

/* Saves the whole optimizer state into directory `dir` (crash-safe: written under
 * a temporary name, fsynced, exchanged with dir; dir may be new, empty or an earlier
 * save, anything else there is ALREADY_EXISTS naming it), in Strata's checkpoint format
 * (safetensors plus a JSON manifest with xxh3 checksums), bucket by bucket; and
 * loads it into an optimizer with the same groups and buckets (checked before
 * anything changes: INVALID_ARGUMENT naming a difference, DATA_LOSS for a damaged
 * or hand-edited file naming the manifest field, FAILED_PRECONDITION for another
 * format version; strata_last_error is one line, text from the file escaped).
 * Loading writes the master weights into the caller's segments. */
STRATA_API strata_status strata_offload_save(strata_offload* offload, const char* dir);
STRATA_API strata_status strata_offload_load(strata_offload* offload, const char* dir);

typedef struct strata_offload_stats {
  int64_t steps;            /* updates applied */
  int64_t skipped_steps;    /* steps skipped for a non-finite gradient */
  uint64_t nvme_bytes_read; /* swap store payload bytes */
  uint64_t nvme_bytes_written;
  double update_seconds;     /* wall time of the updates, step start to last write-back */
  double wait_seconds;       /* time callers spent blocked on updates; 1 - wait/update
                                is the fraction of the update hidden under their work */
  uint64_t host_state_bytes; /* host memory of masters, state, accumulators */
} strata_offload_stats;

STRATA_API strata_status strata_offload_get_stats(const strata_offload* offload,
                                                  strata_offload_stats* stats);

/* The CPU kernel variant in use, chosen once by CPUID: "avx512", "avx2" or
 * "generic". A static string. */
STRATA_API const char* strata_kernel_name(void);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* STRATA_STRATA_H_ */

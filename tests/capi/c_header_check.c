/* Compiled as C (C99, -pedantic): proves include/strata/strata.h is a C header,
 * and runs a small AdamW step through the C API the way a C program would. The
 * gtest in capi_test.cc calls strata_capi_c_smoke() and checks its result. */
#include "tests/capi/c_header_check.h"

#include <string.h>

#include "strata/strata.h"

int strata_capi_c_smoke(float out_params[3]) {
  float params[3] = {1.0f, -2.0f, 0.5f};
  float exp_avg[3] = {0.0f, 0.0f, 0.0f};
  float exp_avg_sq[3] = {0.0f, 0.0f, 0.0f};
  float* state[2];
  const float grad[3] = {0.5f, 0.25f, -1.0f};
  strata_adamw_config config;
  strata_optimizer_options options;
  strata_optimizer* opt = NULL;
  strata_status status;

  state[0] = exp_avg;
  state[1] = exp_avg_sq;
  strata_adamw_config_init(&config);
  config.lr = 0.1f;
  strata_optimizer_options_init(&options);
  options.num_threads = 1;
  status = strata_optimizer_create(STRATA_OPTIMIZER_ADAMW, &config, &options, &opt);
  if (status != STRATA_OK) return 1;
  if (strata_optimizer_num_state(opt) != 2) return 2;
  status = strata_optimizer_step(opt, 1, 1.0f, params, state, 2, grad, STRATA_DTYPE_F32, NULL,
                                 STRATA_DTYPE_BF16, 3);
  strata_optimizer_destroy(opt);
  if (status != STRATA_OK) return 3;
  /* A failing call must set a message for this thread. */
  status = strata_optimizer_create((strata_optimizer_kind)99, &config, NULL, &opt);
  if (status != STRATA_INVALID_ARGUMENT || opt != NULL) return 4;
  if (strlen(strata_last_error()) == 0) return 5;
  memcpy(out_params, params, sizeof(params));
  return 0;
}

/* Links the installed libstrata.so through find_package(Strata) and runs one Adam
 * step; exit code 0 when the library answers as documented. */
#include <stdio.h>
#include <strata/strata.h>

int main(void) {
  float params[2] = {1.0f, -1.0f};
  float m[2] = {0.0f, 0.0f};
  float v[2] = {0.0f, 0.0f};
  float* state[2];
  const unsigned short grad_bf16[2] = {0x3f80, 0xbf80}; /* 1.0, -1.0 */
  strata_adamw_config config;
  strata_optimizer* opt = NULL;
  state[0] = m;
  state[1] = v;
  if (strata_version_number() / 10000 != STRATA_VERSION_MAJOR) {
    fprintf(stderr, "libstrata %s is not ABI-compatible with this header\n", strata_version());
    return 1;
  }
  strata_adamw_config_init(&config);
  config.weight_decay = 0.0f;
  config.lr = 0.5f;
  if (strata_optimizer_create(STRATA_OPTIMIZER_ADAM, &config, NULL, &opt) != STRATA_OK ||
      strata_optimizer_step(opt, 1, 1.0f, params, state, 2, grad_bf16, STRATA_DTYPE_BF16, NULL,
                            STRATA_DTYPE_F32, 2) != STRATA_OK) {
    fprintf(stderr, "strata: %s\n", strata_last_error());
    return 1;
  }
  strata_optimizer_destroy(opt);
  /* The first Adam step moves each weight by lr against the gradient's sign. */
  printf("params %.6f %.6f (kernel %s)\n", params[0], params[1], strata_kernel_name());
  return (params[0] > 0.4999f && params[0] < 0.5001f && params[1] < -0.4999f &&
          params[1] > -0.5001f)
             ? 0
             : 1;
}

// The C-compiled smoke test of the C API (c_header_check.c), called from gtest.
#pragma once

#ifdef __cplusplus
extern "C" {
#endif

// Runs AdamW (lr 0.1, other torch defaults) one step over params {1, -2, 0.5} with
// fp32 grads {0.5, 0.25, -1}, writes the updated params to out_params; returns 0,
// or the number of the first check that failed.
int strata_capi_c_smoke(float out_params[3]);

#ifdef __cplusplus
}
#endif

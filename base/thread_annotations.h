// Clang thread-safety analysis macros (no-ops on other compilers).
#pragma once

#if defined(__clang__)
#define STRATA_THREAD_ANNOTATION_(x) __attribute__((x))
#else
#define STRATA_THREAD_ANNOTATION_(x)
#endif

#define STRATA_GUARDED_BY(x) STRATA_THREAD_ANNOTATION_(guarded_by(x))
#define STRATA_PT_GUARDED_BY(x) STRATA_THREAD_ANNOTATION_(pt_guarded_by(x))
#define STRATA_REQUIRES(...) STRATA_THREAD_ANNOTATION_(requires_capability(__VA_ARGS__))
#define STRATA_EXCLUDES(...) STRATA_THREAD_ANNOTATION_(locks_excluded(__VA_ARGS__))

// The parameterized io/ tests on the "uring" backend. Each test skips, with the reason, when
// ProbeUring() fails on this host (see BackendParamTest).
#include <gtest/gtest.h>

#include "tests/io/io_test_util.h"

namespace strata::io::testing {

INSTANTIATE_TEST_SUITE_P(Uring, BackendTest, ::testing::Values(BackendKind::kUring),
                         BackendParamName);
INSTANTIATE_TEST_SUITE_P(Uring, FaultInjectionTest, ::testing::Values(BackendKind::kUring),
                         BackendParamName);
INSTANTIATE_TEST_SUITE_P(Uring, SwapStoreTest, ::testing::Values(BackendKind::kUring),
                         BackendParamName);
INSTANTIATE_TEST_SUITE_P(Uring, SwapStoreOnDiskTest, ::testing::Values(BackendKind::kUring),
                         BackendParamName);

}  // namespace strata::io::testing

// The parameterized io/ tests on the backends that need no io_uring: "posix" and "memory".
#include <gtest/gtest.h>

#include "tests/io/io_test_util.h"

namespace strata::io::testing {

INSTANTIATE_TEST_SUITE_P(Portable, BackendTest,
                         ::testing::Values(BackendKind::kPosix, BackendKind::kMemory),
                         BackendParamName);
INSTANTIATE_TEST_SUITE_P(Portable, FaultInjectionTest,
                         ::testing::Values(BackendKind::kPosix, BackendKind::kMemory),
                         BackendParamName);
INSTANTIATE_TEST_SUITE_P(Portable, SwapStoreTest,
                         ::testing::Values(BackendKind::kPosix, BackendKind::kMemory),
                         BackendParamName);
INSTANTIATE_TEST_SUITE_P(Portable, SwapStoreOnDiskTest, ::testing::Values(BackendKind::kPosix),
                         BackendParamName);

}  // namespace strata::io::testing

// The committed H200 machine profile (bench/machines/h200.json), for the cost-model tests; the
// target defines STRATA_SOURCE_DIR.
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "engine/plan/machine_profile.h"

namespace strata::engine::testing {

inline MachineProfile H200Profile() {
  auto p = ReadMachineProfile(std::string(STRATA_SOURCE_DIR) + "/bench/machines/h200.json");
  EXPECT_TRUE(p.ok()) << p.status().ToString();
  return p.ok() ? *p : MachineProfile{};
}

}  // namespace strata::engine::testing

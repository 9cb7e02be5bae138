// An optimizer's kind and hyper-parameters as a JSON object, for the manifests of engine
// checkpoints (engine/checkpoint.h) and offload-optimizer saves (offload/offload_optimizer.h):
//   {"kind": "AdamW", "lr": 0.001, "beta1": 0.9, ..., every field of the kind's config}
// The field names are those of the config structs (cpu_optim/*.h). Pure functions.
#pragma once

#include <nlohmann/json.hpp>

#include "base/status.h"
#include "cpu_optim/any_optimizer.h"

namespace strata::engine {

nlohmann::json OptimizerToJson(const cpu_optim::AnyOptimizer& optimizer);

// Reads an object written by OptimizerToJson: "kind" must name a kind (OptimizerKindName) and
// every field of its config must be present with its type. kDataLoss naming what is missing or
// wrong (prefixed with `where`); the hyper-parameters are not validated (cpu_optim::Validate).
StatusOr<cpu_optim::AnyOptimizer> OptimizerFromJson(const nlohmann::json& j,
                                                    std::string_view where);

}  // namespace strata::engine

// The checkpoint manifest: serialization round trip, validation of hostile input, and the
// format-version-1 manifests (AdamW only) still read.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

#include "engine/checkpoint.h"

namespace strata::engine {
namespace {

// A valid manifest of two blocks, bf16, the rest at its defaults.
Manifest SmallManifest() {
  Manifest m;
  m.precision = "bf16";
  m.model_description = "GPT";
  m.block_names = {"embedding", "head"};
  m.block_num_params = {10, 20};
  m.vocab_size = 256;
  m.max_seq_len = 16;
  m.files = {{"master.safetensors", 123, 1}};
  return m;
}

TEST(Manifest, RoundTripsAndRejectsBadInput) {
  Manifest m = SmallManifest();
  m.precision = "fp16";
  m.engine_steps = 9;
  m.adam_steps = 7;
  m.loss_scaler = {32768.0f, 3, 2};
  m.optimizer.kind = cpu_optim::OptimizerKind::kLion;
  m.optimizer.config = cpu_optim::LionConfig{.lr = 1.25e-3f, .weight_decay = 0.1f};
  m.grad_clip_norm = 1.0f;
  m.trainer.step = 9;
  m.trainer.tokens_seen = 900;
  m.trainer.data_rng = "1 2 3";
  m.trainer.lr_schedule_json = R"({"next_step":9})";
  m.trainer.model_json = R"({"channels":16})";
  m.files = {{"master.safetensors", 123, 0xfedcba9876543210ull}};
  const std::string text = SerializeManifest(m);
  auto p = ParseManifest(text);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->block_names, m.block_names);
  EXPECT_EQ(p->block_num_params, m.block_num_params);
  EXPECT_EQ(p->adam_steps, 7);
  EXPECT_EQ(p->loss_scaler.scale, 32768.0f);
  EXPECT_EQ(p->loss_scaler.clean_steps, 3);
  EXPECT_EQ(p->loss_scaler.overflows, 2);
  EXPECT_EQ(p->optimizer.kind, cpu_optim::OptimizerKind::kLion);
  EXPECT_EQ(std::get<cpu_optim::LionConfig>(p->optimizer.config).lr, 1.25e-3f);
  EXPECT_EQ(std::get<cpu_optim::LionConfig>(p->optimizer.config).weight_decay, 0.1f);
  EXPECT_EQ(p->trainer.data_rng, "1 2 3");
  EXPECT_EQ(p->trainer.lr_schedule_json, R"({"next_step":9})");
  EXPECT_EQ(p->trainer.model_json, R"({"channels":16})");
  ASSERT_EQ(p->files.size(), 1u);
  EXPECT_EQ(p->files[0].xxh3, 0xfedcba9876543210ull);

  auto replace = [&](const std::string& from, const std::string& to) {
    std::string t = text;
    const auto pos = t.find(from);
    EXPECT_NE(pos, std::string::npos) << from;
    return ParseManifest(t.replace(pos, from.size(), to));
  };
  EXPECT_EQ(ParseManifest("").status().code(), StatusCode::kDataLoss);
  EXPECT_EQ(ParseManifest("[]").status().code(), StatusCode::kDataLoss);
  EXPECT_EQ(replace("\"format_version\": 2", "\"format_version\": 3").status().code(),
            StatusCode::kFailedPrecondition);
  EXPECT_EQ(replace("\"kind\": \"Lion\"", "\"kind\": \"Lamb\"").status().code(),
            StatusCode::kDataLoss);
  EXPECT_EQ(replace("\"maximize\": false", "\"maximize\": 0").status().code(),
            StatusCode::kDataLoss);
  for (const char* bad :
       {"../master.safetensors", "/etc/passwd", ".hidden", "a/b", "", "manifest.json"}) {
    auto r = replace("\"master.safetensors\"", std::string("\"") + bad + "\"");
    EXPECT_EQ(r.status().code(), StatusCode::kDataLoss) << bad;
  }
  EXPECT_EQ(replace("\"size_bytes\": 123", "\"size_bytes\": -1").status().code(),
            StatusCode::kDataLoss);
  EXPECT_EQ(replace("\"size_bytes\": 123", "\"size_bytes\": 1e300").status().code(),
            StatusCode::kDataLoss);
  EXPECT_EQ(replace("fedcba9876543210", "fedcba98765432zz").status().code(), StatusCode::kDataLoss);
  EXPECT_EQ(replace("\"adam_steps\": 7", "\"adam_steps\": 10").status().code(),
            StatusCode::kDataLoss);  // more updates than steps
  EXPECT_EQ(replace("20\n", "20, 30\n").status().code(), StatusCode::kDataLoss);
  EXPECT_EQ(replace("\"loss_scale\": 32768.0", "\"loss_scale\": -1.0").status().code(),
            StatusCode::kDataLoss);
  // A number beyond fp32 is refused, not made inf (which serialized again as null and made the
  // manifest unreadable: found by manifest_fuzz).
  nlohmann::json edited = nlohmann::json::parse(text);
  edited["optimizer"]["weight_decay"] = 1e39;
  const auto huge = ParseManifest(edited.dump());
  EXPECT_EQ(huge.status().code(), StatusCode::kDataLoss);
  EXPECT_EQ(huge.status().message(),
            "manifest: optimizer: \"weight_decay\" = 1e+39 does not fit fp32");
  EXPECT_EQ(replace("\"grad_clip_norm\": 1.0", "\"grad_clip_norm\": -4e38").status().message(),
            "manifest: engine.grad_clip_norm = -4e+38 does not fit fp32");
  // An unknown kind is quoted escaped, cut whole characters at a time (it was cut at 40 bytes
  // and quoted raw).
  edited = nlohmann::json::parse(text);
  edited["optimizer"]["kind"] = "Lamb\x1b[2J" + std::string(60, 'x');
  EXPECT_EQ(
      ParseManifest(edited.dump()).status().message(),
      "manifest: optimizer: unknown optimizer kind 'Lamb\\x1B[2Jxxxxxxxxxxxxxxxxxxxxxxxxxxxxx... "
      "(68 bytes)'");
  EXPECT_EQ(replace("fedcba9876543210", "fedcba98765432zz").status().message(),
            "manifest: files[0].xxh3 'fedcba98765432zz' is not 16 hex digits");
  // A model config nested two million deep: refused by the parser's nesting limit (it overflowed
  // the stack of the dump() that keeps the config as text).
  const std::string deep = std::string(2000000, '[') + std::string(2000000, ']');
  const std::string config_key = "\"config\": {";
  const size_t at = text.find(config_key);
  ASSERT_NE(at, std::string::npos) << text;
  std::string nested = text;
  nested.insert(at + config_key.size(), "\"deep\": " + deep + ", ");
  const auto too_deep = ParseManifest(nested);
  EXPECT_EQ(too_deep.status().code(), StatusCode::kDataLoss);
  EXPECT_THAT(too_deep.status().message(),
              ::testing::StartsWith("manifest is not a JSON object: JSON nested deeper than 64 "
                                    "levels (the limit) under /model/config/deep/0/"));
}

TEST(Manifest, ReadsVersionOneAsAdamW) {
  // A manifest of format version 1 (before any optimizer but AdamW/Adam): its optimizer object.
  Manifest m = SmallManifest();
  nlohmann::json j = nlohmann::json::parse(SerializeManifest(m));
  j["format_version"] = 1;
  j["optimizer"] = {{"name", "adam"},
                    {"lr", 0.5},
                    {"beta1", 0.8},
                    {"beta2", 0.9},
                    {"eps", 1e-6},
                    {"weight_decay", 0.25},
                    {"decoupled_weight_decay", false},
                    {"bias_correction", true}};
  auto p = ParseManifest(j.dump());
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->optimizer.kind, cpu_optim::OptimizerKind::kAdam);
  EXPECT_EQ(p->optimizer.adamw().lr, 0.5f);
  EXPECT_EQ(p->optimizer.adamw().beta1, 0.8f);
  EXPECT_FALSE(p->optimizer.adamw().decoupled_weight_decay);
  j["optimizer"]["lr"] = 6.7e98;
  EXPECT_EQ(ParseManifest(j.dump()).status().message(),
            "manifest: optimizer.lr = 6.7e+98 does not fit fp32");
}

// The weight decay groups are recorded; a manifest from before them (no field) decayed every
// element and reads so.
TEST(Manifest, RecordsTheWeightDecayGroupsAndReadsTheirAbsenceAsDecayAll) {
  Manifest m = SmallManifest();
  for (const bool decay_all : {false, true}) {
    m.decay_norms_and_biases = decay_all;
    auto p = ParseManifest(SerializeManifest(m));
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    EXPECT_EQ(p->decay_norms_and_biases, decay_all);
  }
  m.decay_norms_and_biases = false;
  nlohmann::json j = nlohmann::json::parse(SerializeManifest(m));
  ASSERT_TRUE(j["engine"].contains("decay_norms_and_biases"));
  j["engine"].erase("decay_norms_and_biases");
  auto old = ParseManifest(j.dump());
  ASSERT_TRUE(old.ok()) << old.status().ToString();
  EXPECT_TRUE(old->decay_norms_and_biases);
  j["engine"]["decay_norms_and_biases"] = 1;
  EXPECT_EQ(ParseManifest(j.dump()).status().code(), StatusCode::kDataLoss);
}

TEST(Manifest, UpdateSettingsDifferencesNameEachChangedSettingButTheLearningRate) {
  Manifest saved;
  saved.optimizer.adamw() = {.lr = 3e-4f, .beta2 = 0.95f, .weight_decay = 0.1f};
  saved.grad_clip_norm = 1.0f;
  saved.decay_norms_and_biases = false;
  cpu_optim::AnyOptimizer run = saved.optimizer;
  run.adamw().lr = 1e-5f;  // the schedule's: not a setting
  EXPECT_EQ(UpdateSettingsDifferences(saved, run, 1.0f, false), "");
  run.adamw().weight_decay = 0.01f;
  run.adamw().beta2 = 0.999f;
  EXPECT_EQ(UpdateSettingsDifferences(saved, run, 0.5f, true),
            "beta2 0.95 -> 0.999, weight_decay 0.1 -> 0.01, grad_clip_norm 1 -> 0.5, "
            "decay_norms_and_biases false -> true");
  // Another kind: the fields either has; the weight decay both have, equal, is not named.
  cpu_optim::AnyOptimizer lion{.kind = cpu_optim::OptimizerKind::kLion,
                               .config = cpu_optim::LionConfig{.weight_decay = 0.1f}};
  EXPECT_EQ(UpdateSettingsDifferences(saved, lion, 1.0f, false),
            "amsgrad false -> (none), beta2 0.95 -> 0.99, bias_correction true -> (none), "
            "decoupled_weight_decay true -> (none), eps 1e-08 -> (none)");
}

// `strata inspect` passes a checkpoint only when its manifest lists what a resume reads.
TEST(Manifest, ListsEveryFileItsOptimizerKeepsOrSaysWhichIsMissing) {
  using cpu_optim::OptimizerKind;
  const auto with_files = [](cpu_optim::AnyOptimizer o, std::vector<std::string> names) {
    Manifest m = SmallManifest();
    m.optimizer = std::move(o);
    m.files.clear();
    for (std::string& n : names) m.files.push_back({std::move(n) + ".safetensors", 1, 1});
    return m;
  };
  cpu_optim::AnyOptimizer adamw;  // AdamW: exp_avg, exp_avg_sq
  EXPECT_TRUE(
      CheckManifestListsItsFiles(with_files(adamw, {"master", "exp_avg", "exp_avg_sq", "working"}))
          .ok());
  Status s = CheckManifestListsItsFiles(with_files(adamw, {"master", "exp_avg", "working"}));
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_EQ(s.message(),
            "the manifest lists no 'exp_avg_sq.safetensors', which its adamw state needs (a "
            "resume refuses it; export reads only the master weights)");
  s = CheckManifestListsItsFiles(with_files(adamw, {"exp_avg", "exp_avg_sq", "working"}));
  EXPECT_EQ(s.message(), "the manifest lists no 'master.safetensors', which every checkpoint has");
  s = CheckManifestListsItsFiles(with_files(adamw, {"master", "exp_avg", "exp_avg_sq"}));
  EXPECT_EQ(s.message(), "the manifest lists no 'working.safetensors', which every checkpoint has");

  cpu_optim::AnyOptimizer amsgrad;
  amsgrad.adamw().amsgrad = true;
  s = CheckManifestListsItsFiles(
      with_files(amsgrad, {"master", "exp_avg", "exp_avg_sq", "working"}));
  EXPECT_NE(s.message().find("'max_exp_avg_sq.safetensors'"), std::string::npos) << s.message();

  cpu_optim::AnyOptimizer sgd;  // momentum 0 keeps no state
  sgd.kind = OptimizerKind::kSgd;
  sgd.config = cpu_optim::SgdConfig{};
  EXPECT_TRUE(CheckManifestListsItsFiles(with_files(sgd, {"master", "working"})).ok());
  sgd.config = cpu_optim::SgdConfig{.momentum = 0.9f};
  s = CheckManifestListsItsFiles(with_files(sgd, {"master", "working"}));
  EXPECT_NE(s.message().find("'momentum_buffer.safetensors', which its sgd"), std::string::npos)
      << s.message();

  cpu_optim::AnyOptimizer eight_bit;
  eight_bit.kind = OptimizerKind::kAdamW8bit;
  s = CheckManifestListsItsFiles(
      with_files(eight_bit, {"master", "exp_avg", "exp_avg_sq", "exp_avg_sq.absmax", "working"}));
  EXPECT_NE(s.message().find("'exp_avg.absmax.safetensors'"), std::string::npos) << s.message();

  cpu_optim::AnyOptimizer adafactor;  // factored or not, some second moment; exp_avg with beta1
  adafactor.kind = OptimizerKind::kAdafactor;
  adafactor.config = cpu_optim::AdafactorConfig{};
  EXPECT_TRUE(CheckManifestListsItsFiles(
                  with_files(adafactor, {"master", "exp_avg_sq_row", "exp_avg_sq_col", "working"}))
                  .ok());
  EXPECT_TRUE(
      CheckManifestListsItsFiles(with_files(adafactor, {"master", "exp_avg_sq", "working"})).ok());
  s = CheckManifestListsItsFiles(with_files(adafactor, {"master", "working"}));
  EXPECT_NE(s.message().find("'exp_avg_sq.safetensors'"), std::string::npos) << s.message();
  adafactor.config = cpu_optim::AdafactorConfig{.beta1 = 0.9f};
  s = CheckManifestListsItsFiles(with_files(adafactor, {"master", "exp_avg_sq", "working"}));
  EXPECT_NE(s.message().find("'exp_avg.safetensors'"), std::string::npos) << s.message();

  // A model without trained params (every block frozen) keeps no optimizer state.
  Manifest frozen = with_files(adamw, {"master", "working"});
  frozen.block_num_params = {0, 0};
  EXPECT_TRUE(CheckManifestListsItsFiles(frozen).ok());
}

}  // namespace
}  // namespace strata::engine

// `strata train --objective dpo|ipo|simpo` end to end on the host backend (issue 46): synthetic
// preference pairs whose chosen completion follows a rule (the prompt's letters in upper case)
// that the rejected one breaks (other letters, lower case), tokenized by `strata tokenize`; full
// and LoRA DPO learn the rule on held-out pairs with their state offloaded; a resumed run equals
// the uninterrupted one bit for bit; bad data and mismatched options are one line, nothing written.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <random>
#include <string>

#include "run_strata.h"

namespace strata {
namespace {

using cli_test::Lines;
using cli_test::Result;
using cli_test::RunStrata;
namespace fs = std::filesystem;

class PreferenceCli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("strata_preference_cli_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    WritePairs(dir_ / "train.jsonl", 600, 7);
    WritePairs(dir_ / "val.jsonl", 100, 8);
    for (const char* split : {"train", "val"}) {
      const Result r =
          RunStrata("tokenize --byte-level --input " + Path(std::string(split) + ".jsonl") +
                    " --output " + Path(std::string(split) + ".bin"));
      ASSERT_EQ(r.exit_code, 0) << r.err;
    }
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string Path(const std::string& name) const { return (dir_ / name).string(); }

  // n pairs: a prompt of 3-6 random lowercase letters; chosen: the prompt in upper case;
  // rejected: other random lowercase letters.
  static void WritePairs(const fs::path& path, int n, uint64_t seed) {
    std::mt19937_64 rng(seed);
    auto word = [&] {
      std::string w(3 + rng() % 4, 'a');
      for (char& c : w) c = static_cast<char>('a' + rng() % 26);
      return w;
    };
    std::ofstream out(path);
    for (int i = 0; i < n; ++i) {
      const std::string w = word();
      std::string upper = w;
      for (char& c : upper) c = static_cast<char>(c - 'a' + 'A');
      out << nlohmann::json{{"prompt", w}, {"chosen", upper}, {"rejected", word()}}.dump() << "\n";
    }
  }

  // train on the tokenized pairs; the summary's JSON.
  nlohmann::json Train(const std::string& flags, const std::string& summary) {
    const Result r = RunStrata("train --model llama-tiny --data " + Path("train.bin") +
                               " --val-data " + Path("val.bin") +
                               " --seq-len 32 --micro-batch-size 8 --sample-bytes 0 --log-every 0 "
                               "--summary-json " +
                               Path(summary) + " " + flags);
    EXPECT_EQ(r.exit_code, 0) << r.err << r.out;
    std::ifstream in(Path(summary));
    if (!in) return {};
    return nlohmann::json::parse(in);
  }

  fs::path dir_;
};

// TRL's metrics of the final validation: accuracy on held-out pairs and a positive margin; DPO
// starts at ln 2 (the policy is its reference).
void ExpectLearned(const nlohmann::json& s, bool starts_at_ln2) {
  ASSERT_TRUE(s.contains("preference")) << s.dump();
  const nlohmann::json& val = s["preference"]["val"];
  EXPECT_EQ(val["pairs"], 100);
  EXPECT_GE(val["rewards/accuracies"].get<double>(), 0.95) << val.dump();
  EXPECT_GT(val["rewards/margins"].get<double>(), 0) << val.dump();
  EXPECT_LT(val["loss"].get<double>(), s["loss_first"].get<double>());
  if (starts_at_ln2) {
    EXPECT_EQ(s["loss_first"].get<float>(), static_cast<float>(std::log(2.0)));
  }
}

TEST_F(PreferenceCli, FullAndLoraDpoLearnTheRuleOnHeldOutPairsWithTheStateOffloaded) {
  const std::string nvme = " --nvme-path " + Path("swap");
  fs::create_directories(dir_ / "swap");
  ExpectLearned(Train("--objective dpo --steps 40 --lr 1e-3 --grad-accum-steps 1 "
                      "--offload-params nvme --offload-optimizer nvme" +
                          nvme,
                      "full.json"),
                true);
  ExpectLearned(Train("--objective dpo --lora-rank 8 --steps 40 --lr 5e-3 --grad-accum-steps 2 "
                      "--offload-params host --offload-optimizer host",
                      "lora.json"),
                true);
  ExpectLearned(Train("--objective dpo --lora-rank 8 --steps 20 --lr 5e-3 --grad-accum-steps 2 "
                      "--offload-params nvme --offload-optimizer nvme --schedule layer-major" +
                          nvme,
                      "lora_nvme.json"),
                true);
}

TEST_F(PreferenceCli, IpoAndSimpoLearnTheRuleToo) {
  ExpectLearned(
      Train("--objective ipo --beta 0.5 --steps 40 --lr 1e-3 --grad-accum-steps 1", "ipo.json"),
      false);
  const nlohmann::json simpo = Train(
      "--objective simpo --beta 2 --simpo-gamma 0.5 --steps 40 --lr 1e-3 --grad-accum-steps 1",
      "simpo.json");
  ExpectLearned(simpo, false);
  // CPO-SimPO (TRL CPOTrainer's defaults: cpo_alpha 1): learns too, and the NLL term pulls the
  // chosen completions' cross-entropy below plain SimPO's.
  const nlohmann::json cpo = Train(
      "--objective simpo --beta 2 --simpo-gamma 0.5 --cpo-alpha 1 --steps 40 --lr 1e-3 "
      "--grad-accum-steps 1",
      "cpo.json");
  ExpectLearned(cpo, false);
  EXPECT_LT(cpo["preference"]["val"]["nll_loss"].get<double>(),
            simpo["preference"]["val"]["nll_loss"].get<double>());
  // Each NLL flag belongs to its objectives: one line naming the right one.
  for (const auto& [flags, needle] :
       {std::pair{"--objective simpo --rpo-alpha 1", "--cpo-alpha"},
        std::pair{"--objective dpo --cpo-alpha 1", "--rpo-alpha"},
        std::pair{"--objective dpo --rpo-alpha -1", "--rpo-alpha"},
        std::pair{"--rpo-alpha 1", "--objective dpo, ipo or simpo"}}) {
    const Result r = RunStrata("train --model llama-tiny --data " + Path("train.bin") +
                               " --seq-len 32 --micro-batch-size 8 --steps 1 " + flags);
    EXPECT_NE(r.exit_code, 0) << flags;
    EXPECT_EQ(Lines(r.err), 1) << r.err;
    EXPECT_NE(r.err.find(needle), std::string::npos) << flags << ": " << r.err;
  }
}

// Steps 1-30 in one run, or 1-15 and then --resume latest to 30: the same master weights and
// validation, bit for bit; full fine-tuning reads its reference back from reference-logps.json.
TEST_F(PreferenceCli, ResumingGivesTheUninterruptedRunBitForBit) {
  for (const std::string lora : {"", " --lora-rank 4"}) {
    SCOPED_TRACE(lora.empty() ? "full" : "lora");
    // A constant rate: the first run's --steps 15 then schedules as the whole run's 30 do.
    const std::string common =
        "--objective dpo --lr 1e-3 --lr-schedule constant --grad-accum-steps 2" + lora;
    fs::remove_all(dir_ / "a");
    fs::remove_all(dir_ / "b");
    const nlohmann::json straight =
        Train(common + " --steps 30 --save-dir " + Path("a"), "straight.json");
    Train(common + " --save-dir " + Path("b") + " --save-every 15 --steps 15", "first.json");
    if (lora.empty()) {
      EXPECT_TRUE(fs::exists(dir_ / "b" / "reference-logps.json"));
    }
    const nlohmann::json resumed =
        Train(common + " --steps 30 --save-dir " + Path("b") + " --resume latest", "resumed.json");
    EXPECT_EQ(resumed["start_step"], 15);
    ASSERT_TRUE(straight["master_xxh3"].is_string());
    EXPECT_EQ(straight["master_xxh3"], resumed["master_xxh3"]);
    EXPECT_EQ(straight["preference"]["val"], resumed["preference"]["val"]);
    EXPECT_EQ(straight["loss_last"], resumed["loss_last"]);
  }
}

// strata eval --objective scores a file of pairs as training's validation does: the LoRA run's
// final validation metrics again, from its checkpoint.
TEST_F(PreferenceCli, EvalScoresPairsAsTrainingValidatesThem) {
  const nlohmann::json s = Train(
      "--objective dpo --lora-rank 4 --steps 10 --lr 5e-3 "
      "--grad-accum-steps 2 --save-dir " +
          Path("e"),
      "e.json");
  const Result r = RunStrata("eval --checkpoint " + Path("e") + " --data " + Path("val.bin") +
                             " --seq-len 32 --micro-batch-size 8 --objective dpo --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json e = nlohmann::json::parse(r.out);
  const nlohmann::json& val = s["preference"]["val"];
  EXPECT_EQ(e["pairs"], val["pairs"]);
  for (const char* key : {"loss", "rewards/accuracies", "rewards/margins", "rewards/chosen",
                          "rewards/rejected", "logps/chosen", "logps/rejected", "nll_loss"}) {
    EXPECT_EQ(e[key], val[key]) << key;
  }
  // A full model without a reference model is refused; SimPO needs none.
  Train("--objective dpo --steps 2 --grad-accum-steps 1 --save-dir " + Path("f"), "f.json");
  const std::string full = "eval --checkpoint " + Path("f") + " --data " + Path("val.bin") +
                           " --seq-len 32 --micro-batch-size 8 --json --objective ";
  Result bad = RunStrata(full + "dpo");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_EQ(Lines(bad.err), 1) << bad.err;
  EXPECT_NE(bad.err.find("--reference-model-dir"), std::string::npos) << bad.err;
  EXPECT_EQ(RunStrata(full + "simpo").exit_code, 0);
}

// A full model's DPO and IPO against a reference model: a run's checkpoint evaluated with its
// initial weights as the reference (the directory it started from, or that directory's
// checkpoint) gives the run's final validation metrics exactly, as training computed them with
// its precomputed reference. The reference's flags are refused where they do not apply.
TEST_F(PreferenceCli, EvalOfAFullModelAgainstAReferenceModelScoresAsTrainingValidates) {
  // The initial weights: a short SimPO run on the pairs, exported as a directory.
  Train("--objective simpo --steps 3 --grad-accum-steps 1 --save-dir " + Path("sft"), "sft.json");
  Result r = RunStrata("export --checkpoint " + Path("sft") + " --hf-dir " + Path("sft_dir"));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (const char* objective : {"dpo", "ipo"}) {
    SCOPED_TRACE(objective);
    const std::string run = std::string("run_") + objective;
    r = RunStrata("train --model-dir " + Path("sft_dir") + " --data " + Path("train.bin") +
                  " --val-data " + Path("val.bin") +
                  " --seq-len 32 --micro-batch-size 8 --sample-bytes 0 --log-every 0 " +
                  "--steps 6 --lr 1e-3 --grad-accum-steps 1 --objective " + objective +
                  " --save-dir " + Path(run) + " --summary-json " + Path(run + ".json"));
    ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
    std::ifstream in(Path(run + ".json"));
    const nlohmann::json val = nlohmann::json::parse(in)["preference"]["val"];
    const std::string eval = "eval --checkpoint " + Path(run) + " --data " + Path("val.bin") +
                             " --seq-len 32 --micro-batch-size 8 --json --objective " + objective;
    for (const std::string& reference :
         {" --reference-model-dir " + Path("sft_dir"), " --reference-checkpoint " + Path("sft")}) {
      SCOPED_TRACE(reference);
      r = RunStrata(eval + reference);
      ASSERT_EQ(r.exit_code, 0) << r.err;
      const nlohmann::json e = nlohmann::json::parse(r.out);
      EXPECT_EQ(e["pairs"], val["pairs"]);
      for (const char* key : {"loss", "rewards/accuracies", "rewards/margins", "rewards/chosen",
                              "rewards/rejected", "logps/chosen", "logps/rejected"}) {
        EXPECT_EQ(e[key], val[key]) << key;
      }
    }
    // ... and not by accident: against the trained model itself the rewards are zero.
    r = RunStrata(eval + " --reference-checkpoint " + Path(run));
    ASSERT_EQ(r.exit_code, 0) << r.err;
    EXPECT_EQ(nlohmann::json::parse(r.out)["rewards/margins"], 0.0);
  }
  const auto refused = [&](const std::string& command, const std::string& what) {
    const Result b = RunStrata(command);
    EXPECT_EQ(b.exit_code, 1) << b.out;
    EXPECT_EQ(Lines(b.err), 1) << b.err;
    EXPECT_NE(b.err.find(what), std::string::npos) << b.err;
  };
  const std::string eval = "eval --checkpoint " + Path("run_dpo") + " --data " + Path("val.bin") +
                           " --seq-len 32 --micro-batch-size 8 ";
  refused(eval + "--objective simpo --reference-checkpoint " + Path("sft"),
          "has no reference model");
  refused(eval + "--reference-checkpoint " + Path("sft"), "give --objective dpo or ipo");
  refused(eval + "--objective dpo --reference-checkpoint " + Path("sft") +
              " --reference-model-dir " + Path("sft_dir"),
          "give one of --reference-model-dir");
  refused(eval + "--objective dpo --reference-model-dir " + Path("nowhere"), "nowhere");
}

// A save directory holding only a reference file (a run stopped before its first checkpoint) and
// a fresh run in another working precision: the file is of other log-probabilities, and is
// recomputed, not taken; a resumed run in another precision is refused naming it.
TEST_F(PreferenceCli, AReferenceOfAnotherPrecisionIsRecomputedOrRefused) {
  Train("--objective dpo --steps 1 --grad-accum-steps 1 --precision fp32 --save-dir " + Path("p32"),
        "p32.json");
  fs::create_directories(dir_ / "p16");
  fs::copy_file(dir_ / "p32" / "reference-logps.json", dir_ / "p16" / "reference-logps.json");
  const std::string flags = "train --model llama-tiny --data " + Path("train.bin") +
                            " --val-data " + Path("val.bin") +
                            " --seq-len 32 --micro-batch-size 8 --objective dpo "
                            "--grad-accum-steps 1 --eval-every 0 --sample-bytes 0 --log-every 1 ";
  Result r = RunStrata(flags + "--steps 1 --precision bf16 --save-dir " + Path("p16"));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("reference log-probabilities: computed with the initial weights"),
            std::string::npos)
      << r.out;
  // The policy is its own reference at step 1: no margin.
  EXPECT_NE(r.out.find("acc 0.00 margin 0.000"), std::string::npos) << r.out;
  r = RunStrata(flags + "--steps 2 --precision fp16 --save-dir " + Path("p32") +
                " --resume latest");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("does not match this run's working precision"), std::string::npos) << r.err;
  EXPECT_EQ(Lines(r.err), 1) << r.err;
}

TEST_F(PreferenceCli, AReferenceOfOtherDataIsRefusedOnResume) {
  Train("--objective dpo --steps 4 --grad-accum-steps 1 --save-dir " + Path("c"), "c.json");
  // A file of this run's hashes whose arrays do not fit the data: damaged, named, one line.
  const fs::path ref = dir_ / "c" / "reference-logps.json";
  const std::string saved = [&] {
    std::ifstream in(ref);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }();
  nlohmann::json damaged = nlohmann::json::parse(saved);
  damaged["train"]["logp_sum"].erase(damaged["train"]["logp_sum"].begin());
  std::ofstream(ref) << damaged.dump();
  const std::string resume = "train --model llama-tiny --data " + Path("train.bin") +
                             " --val-data " + Path("val.bin") +
                             " --seq-len 32 --micro-batch-size 8 --objective dpo --steps 8 "
                             "--grad-accum-steps 1 --save-dir " +
                             Path("c") + " --resume latest";
  Result d = RunStrata(resume);
  EXPECT_NE(d.exit_code, 0);
  EXPECT_NE(d.err.find("reference-logps.json' is damaged"), std::string::npos) << d.err;
  EXPECT_EQ(Lines(d.err), 1) << d.err;
  // A target count beyond int64 is named, not converted (undefined behaviour before).
  damaged = nlohmann::json::parse(saved);
  damaged["val"]["targets"][1] = 1e300;
  std::ofstream(ref) << damaged.dump();
  d = RunStrata(resume);
  EXPECT_NE(d.exit_code, 0);
  EXPECT_NE(d.err.find("is damaged: \"val\".targets[1] = 1e+300 is not an integer in [1, "),
            std::string::npos)
      << d.err;
  EXPECT_EQ(Lines(d.err), 1) << d.err;
  std::ofstream(ref) << saved;
  WritePairs(dir_ / "train.jsonl", 600, 99);
  ASSERT_EQ(RunStrata("tokenize --byte-level --input " + Path("train.jsonl") + " --output " +
                      Path("train.bin"))
                .exit_code,
            0);
  const Result r = RunStrata(resume);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("reference-logps.json"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("does not match this run's data"), std::string::npos) << r.err;
  EXPECT_EQ(Lines(r.err), 1) << r.err;
}

TEST_F(PreferenceCli, BadPreferenceDataOrOptionsAreOneLineAndWriteNothing) {
  // A pair longer than --seq-len: refused naming it unless --long-examples says otherwise.
  const std::string base = "train --model llama-tiny --data " + Path("train.bin") + " --val-data " +
                           Path("val.bin") + " --micro-batch-size 8 --steps 2 " + "--save-dir " +
                           Path("out") + " --summary-json " + Path("s.json");
  Result r = RunStrata(base + " --seq-len 8 --objective dpo");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_EQ(Lines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find("pair"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("--long-examples"), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(dir_ / "out"));
  EXPECT_FALSE(fs::exists(dir_ / "s.json"));
  r = RunStrata(base + " --seq-len 8 --objective dpo --long-examples skip");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  fs::remove_all(dir_ / "out");
  fs::remove(dir_ / "s.json");
  // Preference data needs a preference objective, and the objectives need preference data.
  r = RunStrata(base + " --seq-len 32");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("--objective dpo, ipo or simpo"), std::string::npos) << r.err;
  r = RunStrata("train --model tiny --seq-len 16 --steps 2 --objective dpo --summary-json " +
                Path("s.json"));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("needs preference data"), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(dir_ / "s.json"));
  // Out-of-range hyper-parameters name their flag.
  r = RunStrata(base + " --seq-len 32 --objective dpo --beta 0");
  EXPECT_NE(r.err.find("--beta"), std::string::npos) << r.err;
  r = RunStrata(base + " --seq-len 32 --objective ipo --label-smoothing 0.1");
  EXPECT_NE(r.err.find("--label-smoothing"), std::string::npos) << r.err;
  r = RunStrata(base + " --seq-len 32 --beta 0.3");
  EXPECT_NE(r.err.find("--objective"), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(dir_ / "out"));
}

}  // namespace
}  // namespace strata

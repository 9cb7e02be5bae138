// `strata train` checkpoint flags, signals, `strata inspect` and `strata export`, run as a user
// would: the real binary, real files, real signals (SIGTERM, SIGKILL at random moments).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace {

namespace fs = std::filesystem;

std::string ReadFile(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// The step-N directory of `save_dir` with the highest N, or "" when there is none.
std::string NewestCheckpoint(const fs::path& save_dir) {
  std::string newest;
  int64_t newest_step = -1;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(save_dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("step-", 0) != 0 || name.size() == 5 ||
        name.find_first_not_of("0123456789", 5) != std::string::npos) {
      continue;
    }
    if (const int64_t step = std::stoll(name.substr(5)); step > newest_step) {
      newest_step = step;
      newest = e.path().string();
    }
  }
  return newest;
}

struct Proc {
  pid_t pid = -1;
};

// Starts `strata args...` with stdout and stderr into out_file.
Proc Spawn(const std::vector<std::string>& args, const fs::path& out_file) {
  std::vector<std::string> argv_s = {STRATA_BINARY};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : argv_s) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, out_file.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  Proc p;
  if (posix_spawn(&p.pid, argv[0], &fa, nullptr, argv.data(), environ) != 0) p.pid = -1;
  posix_spawn_file_actions_destroy(&fa);
  return p;
}

// Exit code, or 128 + signal for a killed process.
int Wait(Proc p) {
  int status = 0;
  if (waitpid(p.pid, &status, 0) != p.pid) return -1;
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

struct Result {
  int code;
  std::string out;
};

class CheckpointCliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("strata_ckpt_cli_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_ / "swap");
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::vector<std::string> Tiny(const std::string& precision = "bf16",
                                const std::string& optim = "nvme") {
    return {"train",
            "--data",
            STRATA_DATA,
            "--model",
            "tiny",
            "--seq-len",
            "16",
            "--grad-accum-steps",
            "2",
            "--eval-every",
            "0",
            "--sample-bytes",
            "0",
            "--precision",
            precision,
            "--offload-optimizer",
            optim,
            "--offload-params",
            optim == "nvme" ? "nvme" : "host",
            "--nvme-path",
            (dir_ / "swap").string()};
  }
  Result Run(std::vector<std::string> args) {
    const fs::path out = dir_ / "out.txt";
    const int code = Wait(Spawn(args, out));
    return {code, ReadFile(out)};
  }
  nlohmann::json Summary(const fs::path& p) { return nlohmann::json::parse(ReadFile(p)); }

  fs::path dir_;
};

std::vector<std::string> operator+(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

class ResumeCliTest : public CheckpointCliTest,
                      public ::testing::WithParamInterface<std::tuple<const char*, const char*>> {};

TEST_P(ResumeCliTest, ResumeFromStepNGivesTheSameMasterWeightsAsTheUninterruptedRun) {
  const auto [precision, optim] = GetParam();
  const std::string save = (dir_ / "save").string();
  const auto straight = dir_ / "straight.json", resumed = dir_ / "resumed.json";
  Result r = Run(Tiny(precision, optim) +
                 std::vector<std::string>{"--steps", "6", "--save-every", "2", "--save-dir", save,
                                          "--summary-json", straight.string()});
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(fs::is_directory(save + "/step-2"));
  EXPECT_TRUE(fs::is_directory(save + "/step-6"));
  EXPECT_EQ(ReadFile(save + "/latest"), "step-6\n");
  r = Run(Tiny(precision, optim) + std::vector<std::string>{"--steps", "6", "--resume",
                                                            save + "/step-2", "--summary-json",
                                                            resumed.string()});
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("resumed from " + save + "/step-2 at step 2"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("schedule differs"), std::string::npos) << r.out;  // the same flags
  const auto a = Summary(straight), b = Summary(resumed);
  EXPECT_EQ(b["start_step"], 2);
  EXPECT_EQ(a["master_xxh3"], b["master_xxh3"]);
  EXPECT_EQ(a["loss_scale"], b["loss_scale"]);
  EXPECT_EQ(a["loss_last"], b["loss_last"]);
  // A different start (no resume) gives different weights: the comparison can fail.
  r = Run(Tiny(precision, optim) +
          std::vector<std::string>{"--steps", "4", "--summary-json", resumed.string()});
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(Summary(resumed)["master_xxh3"], a["master_xxh3"]);
}

INSTANTIATE_TEST_SUITE_P(PrecisionAndOptimizerHome, ResumeCliTest,
                         ::testing::Combine(::testing::Values("fp16", "bf16"),
                                            ::testing::Values("nvme", "host")),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param)) + "_" +
                                  std::get<1>(info.param);
                         });

// --optimizer: adamw8bit and adafactor train, resume exactly with their compact state, and a
// checkpoint refuses to resume under another optimizer, naming both.
TEST_F(CheckpointCliTest, EachOptimizerResumesExactlyAndRefusesAnothersCheckpoint) {
  for (const std::string optimizer : {"adamw8bit", "adafactor"}) {
    SCOPED_TRACE(optimizer);
    const std::string save = (dir_ / ("save-" + optimizer)).string();
    const auto straight = dir_ / "straight.json", resumed = dir_ / "resumed.json";
    const auto args = Tiny() + std::vector<std::string>{"--optimizer", optimizer, "--steps", "4"};
    Result r = Run(args + std::vector<std::string>{"--save-every", "2", "--save-dir", save,
                                                   "--summary-json", straight.string()});
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_NE(r.out.find(optimizer + " state"), std::string::npos) << r.out;  // the plan
    r = Run(args + std::vector<std::string>{"--resume", save + "/step-2", "--summary-json",
                                            resumed.string()});
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_EQ(Summary(straight)["master_xxh3"], Summary(resumed)["master_xxh3"]);
    const nlohmann::json manifest =
        nlohmann::json::parse(ReadFile(fs::path(save) / "step-2" / "manifest.json"));
    EXPECT_EQ(manifest["optimizer"]["name"], optimizer);
    // Under AdamW: refused with one line naming both optimizers.
    r = Run(Tiny() + std::vector<std::string>{"--steps", "4", "--resume", save + "/step-2"});
    EXPECT_NE(r.code, 0);
    EXPECT_NE(r.out.find("holds " + optimizer + " optimizer state, this run uses adamw"),
              std::string::npos)
        << r.out;
    // Resuming with another learning rate and more steps: said, each difference named.
    r = Run(Tiny() + std::vector<std::string>{"--optimizer", optimizer, "--steps", "5", "--lr",
                                              "1e-3", "--resume", save + "/step-2"});
    EXPECT_EQ(r.code, 0) << r.out;
    // (Each optimizer's default --lr is its own.)
    EXPECT_NE(r.out.find("note: this run's learning-rate schedule differs from the checkpoint's "
                         "(peak_lr "),
              std::string::npos)
        << r.out;
    EXPECT_NE(r.out.find(" -> 0.001, total_steps 4 -> 5); this run's is followed from step 3 on"),
              std::string::npos)
        << r.out;
    // Resuming a finished run (the same command again) trains nothing, says so, and reports
    // no rate of "-N steps"; nothing is saved over the checkpoint.
    const auto before = fs::last_write_time(fs::path(save) / "step-4" / "manifest.json");
    r = Run(args + std::vector<std::string>{"--resume", save + "/step-4"});
    EXPECT_EQ(r.code, 0) << r.out;
    EXPECT_NE(r.out.find("nothing to train: the run is at step 4, --steps is 4"), std::string::npos)
        << r.out;
    EXPECT_NE(r.out.find("done: 0 steps (to step 4) in "), std::string::npos) << r.out;
    EXPECT_NE(r.out.find(" 0 tokens/s"), std::string::npos) << r.out;
    EXPECT_EQ(fs::last_write_time(fs::path(save) / "step-4" / "manifest.json"), before);
  }
  // The 8-bit state files hold U8 codes.
  Result r = Run({"inspect", (dir_ / "save-adamw8bit" / "step-2").string()});
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("U8"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("exp_avg.absmax"), std::string::npos) << r.out;
}

// A resume takes the optimizer settings of its own flags: each one that differs from what the
// checkpoint recorded is named, and a checkpoint from before weight decay groups (no field: every
// element decayed) is said to differ from today's default.
TEST_F(CheckpointCliTest, AResumeNamesEachOptimizerSettingThatDiffersFromTheCheckpoint) {
  const std::string save = (dir_ / "save-settings").string();
  const auto args = Tiny() + std::vector<std::string>{"--steps", "3", "--weight-decay", "0.1"};
  Result r = Run(args + std::vector<std::string>{"--save-every", "2", "--save-dir", save});
  ASSERT_EQ(r.code, 0) << r.out;
  const fs::path manifest_path = fs::path(save) / "step-2" / "manifest.json";
  nlohmann::json manifest = nlohmann::json::parse(ReadFile(manifest_path));
  EXPECT_EQ(manifest["engine"]["decay_norms_and_biases"], false);
  // The same flags: no note.
  r = Run(args + std::vector<std::string>{"--resume", save + "/step-2"});
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(r.out.find("optimizer settings differ"), std::string::npos) << r.out;
  r = Run(Tiny() + std::vector<std::string>{"--steps", "3", "--weight-decay", "0.01", "--grad-clip",
                                            "0.5", "--decay-norms-and-biases", "--resume",
                                            save + "/step-2"});
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("note: this run's optimizer settings differ from the checkpoint's "
                       "(weight_decay 0.1 -> 0.01, grad_clip_norm 1 -> 0.5, "
                       "decay_norms_and_biases false -> true); this run's are used from step 3 "
                       "on"),
            std::string::npos)
      << r.out;
  manifest["engine"].erase("decay_norms_and_biases");
  {
    std::ofstream out(manifest_path, std::ios::trunc);
    out << manifest.dump(2);
  }
  r = Run(args + std::vector<std::string>{"--resume", save + "/step-2"});
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("(decay_norms_and_biases true -> false)"), std::string::npos) << r.out;
}

// A resumed run that takes another number of tokens per step (--grad-accum-steps 1 after 2)
// counts on from the checkpoint's tokens_seen: 2 steps of 2 x 16 tokens, then 1 of 16.
TEST_F(CheckpointCliTest, AResumeWithAnotherStepSizeCountsTokensOnFromTheCheckpoint) {
  const std::string save = (dir_ / "save-tokens").string();
  Result r = Run(Tiny() + std::vector<std::string>{"--steps", "2", "--save-dir", save});
  ASSERT_EQ(r.code, 0) << r.out;
  const auto tokens_seen = [&](const std::string& step) {
    return nlohmann::json::parse(
               ReadFile(fs::path(save) / step / "manifest.json"))["trainer"]["tokens_seen"]
        .get<int64_t>();
  };
  ASSERT_EQ(tokens_seen("step-2"), 2 * 2 * 16);
  std::vector<std::string> one_micro_batch = Tiny();
  *(std::find(one_micro_batch.begin(), one_micro_batch.end(), "--grad-accum-steps") + 1) = "1";
  r = Run(one_micro_batch +
          std::vector<std::string>{"--steps", "3", "--save-dir", save, "--resume", "latest"});
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("at step 2 (64 tokens seen)"), std::string::npos) << r.out;
  EXPECT_EQ(tokens_seen("step-3"), 2 * 2 * 16 + 16);
}

TEST_F(CheckpointCliTest, InspectListsTensorsAndReportsTheFirstCorruptFile) {
  const std::string save = (dir_ / "save").string();
  Result r = Run(Tiny() + std::vector<std::string>{"--steps", "2", "--save-dir", save});
  ASSERT_EQ(r.code, 0) << r.out;
  r = Run({"inspect", save});
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("step 2"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("master.safetensors"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("layer1"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("BF16"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("verified: 4 files"), std::string::npos) << r.out;
  // Flip one byte in the data of the second file.
  const fs::path victim = fs::path(save) / "step-2" / "exp_avg.safetensors";
  std::string bytes = ReadFile(victim);
  bytes[bytes.size() - 5] ^= 1;
  fs::remove(victim);
  std::ofstream(victim, std::ios::binary) << bytes;
  r = Run({"inspect", save + "/step-2"});
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.out.find("exp_avg.safetensors': xxh3"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("verified:"), std::string::npos) << r.out;
  // And resuming from it refuses before training.
  r = Run(Tiny() + std::vector<std::string>{"--steps", "3", "--resume", save});
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.out.find("corrupted"), std::string::npos) << r.out;
  // A manifest that leaves out a state file (and the file gone with it) verifies what it lists,
  // but a resume reads more: inspect says which file is missing.
  fs::remove(victim);
  const fs::path manifest = fs::path(save) / "step-2" / "manifest.json";
  nlohmann::json j = nlohmann::json::parse(ReadFile(manifest));
  nlohmann::json kept = nlohmann::json::array();
  for (const auto& f : j["files"]) {
    if (f["name"] != "exp_avg.safetensors") kept.push_back(f);
  }
  j["files"] = kept;
  fs::remove(manifest);
  std::ofstream(manifest) << j.dump();
  r = Run({"inspect", save});
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.out.find("the manifest lists no 'exp_avg.safetensors', which its adamw state needs"),
            std::string::npos)
      << r.out;
  EXPECT_EQ(r.out.find("verified:"), std::string::npos) << r.out;
}

TEST_F(CheckpointCliTest, ExportWritesGpt2NamesThatPythonCanLoad) {
  const std::string save = (dir_ / "save").string();
  Result r = Run(Tiny() + std::vector<std::string>{"--steps", "1", "--save-dir", save});
  ASSERT_EQ(r.code, 0) << r.out;
  for (const char* dtype : {"fp32", "bf16"}) {
    const std::string out = (dir_ / (std::string(dtype) + ".safetensors")).string();
    // A leftover of a killed export (the old fixed temporary name) blocks nothing.
    std::ofstream(out + ".tmp") << "partial";
    r = Run({"export", "--checkpoint", save, "--safetensors", out, "--dtype", dtype});
    ASSERT_EQ(r.code, 0) << r.out;
    fs::remove(out + ".tmp");
    // Exporting onto an existing file is refused at once, naming it, and leaves nothing.
    const auto before = fs::last_write_time(out);
    r = Run({"export", "--checkpoint", save, "--safetensors", out});
    EXPECT_EQ(r.code, 1);
    EXPECT_NE(r.out.find("--safetensors '" + out + "' exists"), std::string::npos) << r.out;
    EXPECT_EQ(fs::last_write_time(out), before);
    for (const auto& e : fs::directory_iterator(dir_)) {
      EXPECT_EQ(e.path().filename().string().find(".tmp"), std::string::npos) << e.path();
    }
    // An independent reader: Python's standard library parses the header and checks names,
    // shapes, offsets, and that ln weights are 1-ish and lm_head is the transpose of the
    // checkpoint's (C, V) head matrix.
    const fs::path script = dir_ / "check.py";
    std::ofstream(script) << R"PY(
import json, struct, sys
path, dtype, master = sys.argv[1], sys.argv[2], sys.argv[3]
raw = open(path, 'rb').read()
n = struct.unpack('<Q', raw[:8])[0]
header = json.loads(raw[8:8 + n]); data = raw[8 + n:]
assert (8 + n) % 8 == 0
meta = header.pop('__metadata__')
C, V, T, L = 16, 256, 16, 2
want = {'wte.weight': [V, C], 'wpe.weight': [T, C], 'ln_f.weight': [C], 'ln_f.bias': [C],
        'lm_head.weight': [V, C]}
for i in range(L):
    for k, s in [('ln_1.weight', [C]), ('ln_1.bias', [C]), ('attn.c_attn.weight', [C, 3 * C]),
                 ('attn.c_attn.bias', [3 * C]), ('attn.c_proj.weight', [C, C]),
                 ('attn.c_proj.bias', [C]), ('ln_2.weight', [C]), ('ln_2.bias', [C]),
                 ('mlp.c_fc.weight', [C, 4 * C]), ('mlp.c_fc.bias', [4 * C]),
                 ('mlp.c_proj.weight', [4 * C, C]), ('mlp.c_proj.bias', [C])]:
        want['h.%d.%s' % (i, k)] = s
assert sorted(header) == sorted(want), sorted(set(header) ^ set(want))
size = 4 if dtype == 'fp32' else 2
def values(name):
    t = header[name]; b, e = t['data_offsets']
    assert t['shape'] == want[name], (name, t['shape'])
    assert t['dtype'] == ('F32' if dtype == 'fp32' else 'BF16')
    count = e - b
    if dtype == 'fp32': return list(struct.unpack('<%df' % (count // 4), data[b:e]))
    return [struct.unpack('<f', struct.pack('<I', h << 16))[0]
            for h in struct.unpack('<%dH' % (count // 2), data[b:e])]
end = max(t['data_offsets'][1] for t in header.values())
assert end == len(data)
ln = values('h.0.ln_1.weight')
assert all(0.8 < x < 1.2 for x in ln), ln
# lm_head.weight[v][c] == the checkpoint's head block at lnf (2C) + c * V + v
mraw = open(master, 'rb').read(); mn = struct.unpack('<Q', mraw[:8])[0]
mh = json.loads(mraw[8:8 + mn]); mdata = mraw[8 + mn:]
hb, he = mh['head']['data_offsets']
head = struct.unpack('<%df' % ((he - hb) // 4), mdata[hb:he])
lm = values('lm_head.weight')
tol = 0 if dtype == 'fp32' else 1e-2
for v in (0, 7, 255):
    for c in (0, 5, 15):
        x, y = lm[v * C + c], head[2 * C + c * V + v]
        assert abs(x - y) <= tol * abs(y), (v, c, x, y)
try:
    from safetensors.numpy import load_file
except ImportError:
    print('stdlib-ok'); sys.exit(0)
if dtype == 'fp32':
    t = load_file(path)
    assert sorted(t) == sorted(want)
    assert list(t['lm_head.weight'].shape) == [V, C]
print('safetensors-ok')
)PY";
    const fs::path py_out = dir_ / "py.txt";
    const std::string master = save + "/step-1/master.safetensors";
    const std::string cmd = "/usr/bin/python3 " + script.string() + " " + out + " " + dtype + " " +
                            master + " > " + py_out.string() + " 2>&1";
    if (::access("/usr/bin/python3", X_OK) != 0) GTEST_SKIP() << "no /usr/bin/python3";
    const int rc = std::system(cmd.c_str());
    const std::string py = ReadFile(py_out);
    EXPECT_EQ(rc, 0) << py;
    EXPECT_TRUE(py.find("stdlib-ok") != std::string::npos ||
                py.find("safetensors-ok") != std::string::npos)
        << py;
  }
}

TEST_F(CheckpointCliTest, SigintWithoutSaveOnSignalExits130AndSaysNoCheckpoint) {
  const fs::path out = dir_ / "run.txt";
  Proc p = Spawn(Tiny() + std::vector<std::string>{"--steps", "100000", "--log-every", "1"}, out);
  ASSERT_GT(p.pid, 0);
  for (int i = 0; i < 600 && ReadFile(out).find("step     2/") == std::string::npos; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ::kill(p.pid, SIGINT);
  const int code = Wait(p);
  const std::string text = ReadFile(out);
  EXPECT_EQ(code, 130) << text;
  EXPECT_NE(text.find("stopped by signal 2 after step"), std::string::npos) << text;
  EXPECT_NE(text.find("no checkpoint saved"), std::string::npos) << text;
  EXPECT_TRUE(fs::is_empty(dir_ / "swap"));
  // --resume latest without --save-dir is refused up front.
  const Result r = Run(Tiny() + std::vector<std::string>{"--steps", "1", "--resume", "latest"});
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.out.find("needs --save-dir"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("plan:"), std::string::npos) << r.out;
}

// A signal while the engine initialises (from when its swap directory exists) stops the start
// at the next block: one line, exit 130, the swap directory removed, no step.
TEST_F(CheckpointCliTest, SigintWhileTheEngineInitialisesRemovesTheSwapDirectory) {
  std::vector<std::string> args = Tiny();
  *std::find(args.begin(), args.end(), "tiny") = "gpt2-124m";  // ~1 GiB of state to lay out
  const fs::path out = dir_ / "run.txt";
  Proc p = Spawn(args + std::vector<std::string>{"--steps", "5"}, out);
  ASSERT_GT(p.pid, 0);
  bool made = false;
  // The swap store's directory, not the probe file the run's destination check makes and removes
  // before the signal handlers are installed (a signal then kills with the default action).
  for (int i = 0; i < 60000 && !made; ++i) {
    for (const auto& e : fs::directory_iterator(dir_ / "swap")) {
      made = made || e.path().filename().string().starts_with("strata-swap-");
    }
    if (!made) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ::kill(p.pid, SIGINT);
  const int code = Wait(p);
  const std::string text = ReadFile(out);
  ASSERT_TRUE(made) << text;
  EXPECT_EQ(code, 130) << text;
  EXPECT_NE(text.find("strata: stopped by signal 2 while initialising "), std::string::npos)
      << text;
  EXPECT_NE(text.find("; no step ran"), std::string::npos) << text;
  EXPECT_EQ(text.find("step     1/"), std::string::npos) << text;
  EXPECT_TRUE(fs::is_empty(dir_ / "swap")) << text;
}

// After the last step a long text sample (a forward per token) hears a signal too: it used to run
// on for minutes with SIGINT and SIGTERM caught and ignored.
TEST_F(CheckpointCliTest, SigintWhileSamplingAfterTheLastStepStopsIt) {
  std::vector<std::string> args = Tiny();
  *(std::find(args.begin(), args.end(), "--sample-bytes") + 1) = "100000000";
  *(std::find(args.begin(), args.end(), "--eval-every") + 1) = "1";
  const fs::path out = dir_ / "run.txt";
  Proc p = Spawn(args + std::vector<std::string>{"--steps", "2"}, out);
  ASSERT_GT(p.pid, 0);
  for (int i = 0; i < 1200 && ReadFile(out).find("validation loss") == std::string::npos; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ::kill(p.pid, SIGINT);
  const int code = Wait(p);
  const std::string text = ReadFile(out);
  EXPECT_EQ(code, 130) << text;
  EXPECT_NE(text.find("strata: stopped by signal 2 after the last step (2), while sampling text; "
                      "no checkpoint saved"),
            std::string::npos)
      << text;
  EXPECT_TRUE(fs::is_empty(dir_ / "swap")) << text;
}

TEST_F(CheckpointCliTest, SigtermFinishesTheStepSavesAndExits143) {
  const std::string save = (dir_ / "save").string();
  const fs::path out = dir_ / "run.txt";
  Proc p = Spawn(Tiny() + std::vector<std::string>{"--steps", "100000", "--save-dir", save,
                                                   "--save-on-signal", "--log-every", "1"},
                 out);
  ASSERT_GT(p.pid, 0);
  // Wait until training runs, then ask it to stop.
  for (int i = 0; i < 600 && ReadFile(out).find("step     3/") == std::string::npos; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ::kill(p.pid, SIGTERM);
  const int code = Wait(p);
  const std::string text = ReadFile(out);
  EXPECT_EQ(code, 143) << text;
  EXPECT_NE(text.find("stopped by signal 15 after step"), std::string::npos) << text;
  EXPECT_NE(text.find("last checkpoint: " + save + "/step-"), std::string::npos) << text;
  EXPECT_EQ(Run({"inspect", save}).code, 0);
  // The swap space was removed on the way out.
  EXPECT_TRUE(fs::is_empty(dir_ / "swap"));
  const int64_t step = std::stoll(ReadFile(fs::path(save) / "latest").substr(5));
  EXPECT_GE(step, 3);
  const Result r = Run(Tiny() + std::vector<std::string>{"--steps", std::to_string(step + 1),
                                                         "--save-dir", save, "--resume", "latest"});
  EXPECT_EQ(r.code, 0) << r.out;
}

// SIGKILL at random moments, many times, while a checkpoint is saved after every step: `latest`
// always names a complete checkpoint that inspect verifies and that --resume latest continues.
TEST_F(CheckpointCliTest, SigkillAtRandomMomentsAlwaysLeavesALoadableLatest) {
  const std::string save = (dir_ / "save").string();
  std::mt19937_64 rng(20261122);
  int with_latest = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(150);
  int iterations = 0;
  for (; iterations < 30 && std::chrono::steady_clock::now() < deadline; ++iterations) {
    std::vector<std::string> args =
        Tiny() + std::vector<std::string>{"--steps",      "1000000", "--save-dir",  save,
                                          "--save-every", "1",       "--keep-last", "2"};
    // From the second run on, continue from the last checkpoint: a resume that fails would exit
    // at once with code 1 instead of being killed. A kill between a step-N's rename and `latest`
    // leaves step-N alone: a run too (a new one is refused there), resumed by its directory.
    if (fs::exists(fs::path(save) / "latest")) {
      args = args + std::vector<std::string>{"--resume", "latest"};
    } else if (const std::string newest = NewestCheckpoint(save); !newest.empty()) {
      args = args + std::vector<std::string>{"--resume", newest};
    }
    Proc p = Spawn(args, dir_ / "run.txt");
    ASSERT_GT(p.pid, 0);
    std::this_thread::sleep_for(std::chrono::microseconds(300000 + rng() % 1200000));
    ::kill(p.pid, SIGKILL);
    EXPECT_EQ(Wait(p), 128 + SIGKILL);
    if (!fs::exists(fs::path(save) / "latest")) continue;
    ++with_latest;
    const Result inspect = Run({"inspect", save});
    ASSERT_EQ(inspect.code, 0) << "iteration " << iterations << "\n" << inspect.out;
  }
  EXPECT_GE(with_latest, iterations / 2);
  // And a last resume runs one more step to completion.
  ASSERT_TRUE(fs::exists(fs::path(save) / "latest"));
  const std::string name = ReadFile(fs::path(save) / "latest");
  const int64_t step = std::stoll(name.substr(5));
  const Result r = Run(Tiny() + std::vector<std::string>{"--steps", std::to_string(step + 1),
                                                         "--save-dir", save, "--resume", "latest"});
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("at step " + std::to_string(step)), std::string::npos) << r.out;
}

}  // namespace

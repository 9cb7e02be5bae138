#include "cpu_optim/threading.h"

#include <gtest/gtest.h>
#include <sched.h>
#include <tbb/global_control.h>
#include <tbb/parallel_for.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "cpu_optim/adamw.h"
#include "tests/cpu_optim/test_data.h"

namespace strata::cpu_optim {
namespace {

std::vector<int> AllowedCores() {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (sched_getaffinity(0, sizeof(allowed), &allowed) != 0) return {};
  std::vector<int> cores;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &allowed)) cores.push_back(c);
  }
  return cores;
}

std::vector<int> CurrentMask() {
  cpu_set_t mask;
  CPU_ZERO(&mask);
  EXPECT_EQ(sched_getaffinity(0, sizeof(mask), &mask), 0);
  std::vector<int> cores;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &mask)) cores.push_back(c);
  }
  return cores;
}

// Every thread that runs work inside Execute is bound to exactly one of the given
// cores; the caller's own mask is back as it was afterwards.
TEST(WorkerArena, ThreadsRunBoundToTheGivenCores) {
  const std::vector<int> allowed = AllowedCores();
  ASSERT_FALSE(allowed.empty());
  // More threads than cores: oneTBB caps workers at the core count by default.
  tbb::global_control allow(tbb::global_control::max_allowed_parallelism, 4);
  const std::vector<int> cores(allowed.begin(),
                               allowed.begin() + std::min<size_t>(2, allowed.size()));
  auto arena = WorkerArena::Create({.num_threads = 4, .cores = cores});
  ASSERT_TRUE(arena.ok()) << arena.status().ToString();
  EXPECT_EQ(arena.value()->num_threads(), 4);
  const std::vector<int> before = CurrentMask();
  std::mutex mu;
  std::vector<std::vector<int>> masks;
  arena.value()->Execute([&] {
    tbb::parallel_for(0, 64, [&](int) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      const std::vector<int> m = CurrentMask();
      std::lock_guard<std::mutex> lock(mu);
      masks.push_back(m);
    });
  });
  ASSERT_EQ(masks.size(), 64u);
  for (const auto& m : masks) {
    ASSERT_EQ(m.size(), 1u);
    EXPECT_NE(std::find(cores.begin(), cores.end(), m[0]), cores.end()) << m[0];
  }
  EXPECT_EQ(CurrentMask(), before);
}

TEST(WorkerArena, WithoutCoresItOnlySizesTheArena) {
  auto arena = WorkerArena::Create({.num_threads = 2});
  ASSERT_TRUE(arena.ok());
  EXPECT_TRUE(arena.value()->cores().empty());
  std::atomic<int> ran{0};
  arena.value()->Execute([&] { tbb::parallel_for(0, 100, [&](int) { ++ran; }); });
  EXPECT_EQ(ran.load(), 100);
}

TEST(WorkerArena, RejectsCoresItCannotUse) {
  const std::vector<int> allowed = AllowedCores();
  ASSERT_FALSE(allowed.empty());
  int not_allowed = -1;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (std::find(allowed.begin(), allowed.end(), c) == allowed.end()) {
      not_allowed = c;
      break;
    }
  }
  ASSERT_GE(not_allowed, 0);
  for (const ThreadingOptions& bad :
       {ThreadingOptions{.num_threads = -1}, ThreadingOptions{.cores = {-3}},
        ThreadingOptions{.cores = {CPU_SETSIZE}}, ThreadingOptions{.cores = {not_allowed}},
        ThreadingOptions{.cores = {allowed[0], allowed[0]}}}) {
    const auto arena = WorkerArena::Create(bad);
    EXPECT_EQ(arena.status().code(), StatusCode::kInvalidArgument);
    EXPECT_FALSE(arena.status().message().empty());
  }
}

// Binding never changes results: AdamW in a bound arena gives the reference's bits.
TEST(WorkerArena, AdamWInABoundArenaIsBitIdenticalToTheReference) {
  constexpr int64_t n = 300001;
  std::mt19937 rng(21);
  std::vector<float> p(n), m(n, 0.0f), v(n, 0.0f);
  for (auto& x : p) x = testing::RandomFloat(rng, -6, 2);
  const auto g = testing::GradData::Random(DType::kBF16, n, rng, testing::Mix::kFinite);
  std::vector<float> rp = p, rm = m, rv = v;
  AdamWConfig config;
  config.weight_decay = 0.1f;
  auto arena = WorkerArena::Create({.num_threads = 3, .cores = AllowedCores()});
  ASSERT_TRUE(arena.ok()) << arena.status().ToString();
  for (int64_t t = 1; t <= 3; ++t) {
    Status s;
    arena.value()->Execute([&] { s = AdamWUpdate(config, {.step = t}, p, m, v, g.view()); });
    ASSERT_TRUE(s.ok()) << s.ToString();
    ASSERT_TRUE(AdamWUpdateReference(config, {.step = t}, rp, rm, rv, g.view()).ok());
  }
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_TRUE(testing::SameFloat(p[i], rp[i])) << i;
    ASSERT_TRUE(testing::SameFloat(m[i], rm[i])) << i;
  }
}

}  // namespace
}  // namespace strata::cpu_optim

// engine/shared_frozen_base.h over ranks that are threads of one process (thread_communicator.h),
// each with its own host device: the ranks of one machine see one region, the writer's bytes;
// a rank that cannot pin its mapping (its pinned budget too small) makes every rank fall back
// to its own copy, without an error and without a rank left waiting in a collective.
#include "engine/shared_frozen_base.h"

#include <gtest/gtest.h>

#include <cstring>
#include <thread>
#include <vector>

#include "gpu/device.h"
#include "tests/engine/thread_communicator.h"

namespace strata::engine {
namespace {

using testing::ThreadWorld;

constexpr size_t kBytes = size_t{64} << 10;

struct RankOutcome {
  bool shared = false;
  bool writer = false;
  int ranks = 0;
  size_t span_bytes = 0;
  std::vector<std::byte> seen;  // the region's bytes after Publish
  size_t pinned_after = 0;      // the device's pinned bytes once the region is gone
};

// Every rank of `budgets.size()` calls Create with its device's pinned budget; the writer fills
// the region, all read it after Publish.
std::vector<RankOutcome> RunRanks(const std::vector<size_t>& budgets) {
  const int n = static_cast<int>(budgets.size());
  ThreadWorld world(n);
  std::vector<RankOutcome> out(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      auto comm = world.Rank(r);
      gpu::HostDeviceOptions d;
      d.pinned_budget_bytes = budgets[r];
      auto device = gpu::CreateHostDevice(d);
      ASSERT_TRUE(device.ok()) << device.status().ToString();
      {
        auto s = SharedFrozenBase::Create(*comm, **device, kBytes);
        ASSERT_TRUE(s.ok()) << s.status().ToString();
        RankOutcome& o = out[r];
        o.shared = *s != nullptr;
        if (o.shared) {
          o.writer = (*s)->writer();
          o.ranks = (*s)->ranks();
          o.span_bytes = (*s)->span().size_bytes;
          if (o.writer) {
            for (size_t i = 0; i < kBytes; ++i) (*s)->span().data[i] = std::byte(i * 7 + 3);
          }
          ASSERT_TRUE((*s)->Publish().ok());
          o.seen.assign((*s)->span().data, (*s)->span().data + kBytes);
          // Nobody destroys its mapping before every rank has read.
          ASSERT_TRUE(comm->Barrier().ok());
        }
      }
      out[r].pinned_after = (*device)->pinned_used_bytes();
    });
  }
  for (std::thread& t : threads) t.join();
  return out;
}

TEST(SharedFrozenBaseTest, TheRanksOfAMachineReadTheWritersBytes) {
  const std::vector<RankOutcome> out = RunRanks({size_t{1} << 30, size_t{1} << 30});
  std::vector<std::byte> want(kBytes);
  for (size_t i = 0; i < kBytes; ++i) want[i] = std::byte(i * 7 + 3);
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE(r);
    ASSERT_TRUE(out[r].shared);
    EXPECT_EQ(out[r].writer, r == 0);
    EXPECT_EQ(out[r].ranks, 2);
    EXPECT_EQ(out[r].span_bytes, kBytes);
    EXPECT_EQ(out[r].seen, want);
    EXPECT_EQ(out[r].pinned_after, 0u);  // unpinned with the region
  }
}

// The registration is the last stage that can fail, after the object exists on every rank: the
// failing rank's vote brings every rank back to its own copy, and whatever the others had pinned
// is released.
TEST(SharedFrozenBaseTest, ARankThatCannotPinItMakesEveryRankKeepItsOwnCopy) {
  for (int failing = 0; failing < 2; ++failing) {
    SCOPED_TRACE(failing);
    std::vector<size_t> budgets = {size_t{1} << 30, size_t{1} << 30};
    budgets[failing] = kBytes / 2;
    const std::vector<RankOutcome> out = RunRanks(budgets);
    for (int r = 0; r < 2; ++r) {
      EXPECT_FALSE(out[r].shared) << "rank " << r;
      EXPECT_EQ(out[r].pinned_after, 0u) << "rank " << r;
    }
  }
}

TEST(SharedFrozenBaseTest, OneRankOnItsMachineSharesNothing) {
  const std::vector<RankOutcome> out = RunRanks({size_t{1} << 30});
  EXPECT_FALSE(out[0].shared);
}

}  // namespace
}  // namespace strata::engine

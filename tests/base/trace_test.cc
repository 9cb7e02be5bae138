#include "base/trace.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>
#include <vector>

namespace strata::trace {
namespace {

TEST(TraceRecorderTest, BreakdownSumsBusyTimePerCategory) {
  TraceRecorder r(/*keep_events=*/false);
  const int h2d = r.RegisterTrack("h2d");
  const int compute = r.RegisterTrack("compute");
  r.Record(h2d, "copy", Category::kH2D, 1000, 3000);
  r.Record(h2d, "copy", Category::kH2D, 5000, 5500);
  r.Record(compute, "block", Category::kCompute, 0, 4000);
  r.Record(compute, "end-before-begin", Category::kCompute, 10, 5);  // counts as zero
  const Breakdown b = r.breakdown();
  EXPECT_DOUBLE_EQ(b[Category::kH2D], 2500e-9);
  EXPECT_DOUBLE_EQ(b[Category::kCompute], 4000e-9);
  EXPECT_DOUBLE_EQ(b[Category::kNvmeRead], 0.0);
  EXPECT_EQ(r.num_events(), 0u);  // not kept
  r.ResetBreakdown();
  EXPECT_DOUBLE_EQ(r.breakdown()[Category::kH2D], 0.0);
}

TEST(TraceRecorderTest, SameTrackNameGivesSameId) {
  TraceRecorder r(true);
  const int a = r.RegisterTrack("a");
  const int b = r.RegisterTrack("b");
  EXPECT_NE(a, b);
  EXPECT_EQ(r.RegisterTrack("a"), a);
}

TEST(TraceRecorderTest, WritesChromeTraceEventsWithTrackNames) {
  TraceRecorder r(true);
  const int d2h = r.RegisterTrack("d2h");
  const int opt = r.RegisterTrack("cpu-optimizer");
  r.Record(d2h, "grad bucket", Category::kD2H, 2000, 6000);
  r.Record(opt, "adamw \"block\" 3", Category::kCpuOptimizer, 3000, 9000);
  const std::string path = ::testing::TempDir() + "/strata_trace_test.json";
  ASSERT_TRUE(r.WriteChromeTrace(path).ok());
  std::ifstream in(path);
  const nlohmann::json j = nlohmann::json::parse(in);
  std::remove(path.c_str());
  std::vector<nlohmann::json> complete;
  std::vector<std::string> track_names(2);
  for (const auto& e : j.at("traceEvents")) {
    if (e.at("ph") == "X") complete.push_back(e);
    if (e.at("ph") == "M" && e.at("name") == "thread_name") {
      track_names.at(e.at("tid").get<int>()) = e.at("args").at("name");
    }
  }
  EXPECT_EQ(track_names, (std::vector<std::string>{"d2h", "cpu-optimizer"}));
  ASSERT_EQ(complete.size(), 2u);
  EXPECT_EQ(complete[0].at("name"), "grad bucket");
  EXPECT_EQ(complete[0].at("cat"), "d2h");
  EXPECT_DOUBLE_EQ(complete[0].at("ts").get<double>(), 2.0);  // microseconds
  EXPECT_DOUBLE_EQ(complete[0].at("dur").get<double>(), 4.0);
  EXPECT_EQ(complete[0].at("tid"), d2h);
  EXPECT_EQ(complete[1].at("name"), "adamw \"block\" 3");  // escaped, parses back
  EXPECT_EQ(complete[1].at("cat"), "cpu_optimizer");
  EXPECT_EQ(complete[1].at("tid"), opt);
}

TEST(TraceRecorderTest, RefusesToWriteWithoutEventsAndNamesAnUnwritablePath) {
  TraceRecorder none(false);
  EXPECT_EQ(none.WriteChromeTrace("/tmp/x.json").code(), StatusCode::kFailedPrecondition);
  TraceRecorder r(true);
  const Status s = r.WriteChromeTrace("/nonexistent-dir/t.json");
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("/nonexistent-dir/t.json"), std::string::npos) << s.message();
}

TEST(TraceRecorderTest, ConcurrentRecordingLosesNothing) {
  TraceRecorder r(true);
  constexpr int kThreads = 4, kEvents = 2000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&r, t] {
      const int track = r.RegisterTrack("worker-" + std::to_string(t));
      for (int i = 0; i < kEvents; ++i) {
        ScopedTraceEvent e(&r, track, "work", Category::kCpuOptimizer);
      }
      r.Record(track, "fixed", Category::kNvmeWrite, 0, 1000);
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(r.num_events(), size_t{kThreads} * (kEvents + 1));
  EXPECT_DOUBLE_EQ(r.breakdown()[Category::kNvmeWrite], kThreads * 1000e-9);
  ScopedTraceEvent null_recorder(nullptr, 0, "nothing", Category::kOther);  // a no-op
}

}  // namespace
}  // namespace strata::trace

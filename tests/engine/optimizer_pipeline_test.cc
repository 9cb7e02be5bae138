#include "engine/optimizer_pipeline.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <new>
#include <thread>
#include <vector>

#include "engine/work_queue.h"

namespace strata::engine {
namespace {

TEST(WorkQueue, RunsTasksInSubmissionOrder) {
  WorkQueue q("test");
  std::vector<int> order;  // touched only by the worker until Drain returns
  for (int i = 0; i < 100; ++i) {
    q.Submit([&order, i] {
      order.push_back(i);
      return Status::Ok();
    });
  }
  ASSERT_TRUE(q.Drain().ok());
  ASSERT_EQ(order.size(), 100u);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(order[i], i);
}

TEST(WorkQueue, AnErrorIsStickyAndLaterTasksAreSkipped) {
  WorkQueue q("test");
  std::atomic<int> ran{0};
  const uint64_t first = q.Submit([&] {
    ++ran;
    return Status::Ok();
  });
  const uint64_t failing = q.Submit([] { return DataLossError("extent block3.optim"); });
  const uint64_t later = q.Submit([&] {
    ++ran;
    return Status::Ok();
  });
  EXPECT_TRUE(q.WaitFor(first).ok() || q.WaitFor(first).code() == StatusCode::kDataLoss);
  const Status s = q.WaitFor(later);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_NE(s.message().find("block3.optim"), std::string::npos);
  EXPECT_EQ(ran.load(), 1);  // the task after the failure did not run
  EXPECT_TRUE(q.Done(failing));
  EXPECT_EQ(q.Drain().code(), StatusCode::kDataLoss);
}

// A task that throws fails the queue as an error would, naming the queue, instead of ending the
// process in std::terminate on the worker thread.
TEST(WorkQueue, ATaskThatThrowsIsAnError) {
  WorkQueue q("optimizer");
  const uint64_t t = q.Submit([]() -> Status { throw std::bad_alloc(); });
  const Status s = q.WaitFor(t);
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(s.message().rfind("optimizer: out of host memory", 0), 0u) << s.message();
}

// Records which stage ran when, and checks that no two submissions hold one buffer at once.
struct Recorder {
  std::mutex mu;
  std::vector<std::string> events;
  std::vector<int> buffer_owner;  // block holding each buffer, -1 free
  bool conflict = false;
  void Log(std::string e) {
    std::lock_guard<std::mutex> lock(mu);
    events.push_back(std::move(e));
  }
};

TEST(OptimizerPipeline, EachBlockIsReadUpdatedAndWrittenInOrderAndBuffersNeverOverlap) {
  constexpr int kBlocks = 12, kBuffers = 3;
  Recorder rec;
  rec.buffer_owner.assign(kBuffers, -1);
  std::vector<std::atomic<int>> stage(kBlocks);
  for (auto& s : stage) s = 0;
  OptimizerPipeline::Stages st;
  st.read = [&](int b, int i) {
    {
      std::lock_guard<std::mutex> lock(rec.mu);
      if (rec.buffer_owner[i] != -1) rec.conflict = true;
      rec.buffer_owner[i] = b;
    }
    EXPECT_EQ(stage[b].exchange(1), 0);
    return Status::Ok();
  };
  st.update = [&](int b, int i) {
    EXPECT_EQ(stage[b].exchange(2), 1);
    std::lock_guard<std::mutex> lock(rec.mu);
    EXPECT_EQ(rec.buffer_owner[i], b);
    return Status::Ok();
  };
  st.write = [&](int b, int i) {
    EXPECT_EQ(stage[b].exchange(3), 2);
    std::lock_guard<std::mutex> lock(rec.mu);
    EXPECT_EQ(rec.buffer_owner[i], b);
    rec.buffer_owner[i] = -1;
    return Status::Ok();
  };
  OptimizerPipeline p(kBlocks, kBuffers, st);
  for (int b = 0; b < kBlocks; ++b) p.Submit(b);
  for (int b = 0; b < kBlocks; ++b) {
    ASSERT_TRUE(p.WaitBlock(b).ok());
    EXPECT_EQ(stage[b].load(), 3) << "block " << b << " waited on but not written";
  }
  EXPECT_FALSE(rec.conflict);
}

TEST(OptimizerPipeline, ReadOfALaterBlockOverlapsTheWriteBackOfAnEarlierOne) {
  // The write of block 0 does not finish until the read of block 2 has started: a pipeline
  // that ran the blocks one after the other would never get there (the test then fails on the
  // timeout instead of hanging).
  std::mutex mu;
  std::condition_variable cv;
  bool read2_started = false;
  bool timed_out = false;
  OptimizerPipeline::Stages st;
  st.read = [&](int b, int) {
    if (b == 2) {
      std::lock_guard<std::mutex> lock(mu);
      read2_started = true;
      cv.notify_all();
    }
    return Status::Ok();
  };
  st.update = [](int, int) { return Status::Ok(); };
  st.write = [&](int b, int) {
    if (b == 0) {
      std::unique_lock<std::mutex> lock(mu);
      if (!cv.wait_for(lock, std::chrono::seconds(20), [&] { return read2_started; })) {
        timed_out = true;
      }
    }
    return Status::Ok();
  };
  OptimizerPipeline p(4, 3, st);
  for (int b = 0; b < 4; ++b) p.Submit(b);
  ASSERT_TRUE(p.Drain().ok());
  EXPECT_FALSE(timed_out);
}

TEST(OptimizerPipeline, AFailedReadComesBackFromEveryLaterWait) {
  OptimizerPipeline::Stages st;
  std::atomic<int> updates{0};
  st.read = [](int b, int) {
    return b == 1 ? DataLossError("checksum mismatch in extent block1.optim") : Status::Ok();
  };
  st.update = [&](int, int) {
    ++updates;
    return Status::Ok();
  };
  OptimizerPipeline p(4, 2, st);
  for (int b = 0; b < 4; ++b) p.Submit(b);
  EXPECT_EQ(p.WaitBlock(3).code(), StatusCode::kDataLoss);
  EXPECT_EQ(p.Drain().code(), StatusCode::kDataLoss);
  EXPECT_LE(updates.load(), 1);  // at most block 0: nothing after the failure is updated
}

TEST(OptimizerPipeline, DestroyingItAfterAFailedWriteWaitsForEveryStage) {
  // The write stage fails at once and skips the rest while reads are still queued; those reads
  // wait on the write stage, which must outlive them (ASan checks this).
  std::atomic<int> reads{0};
  {
    OptimizerPipeline::Stages st;
    st.read = [&](int, int) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));  // a slow drive
      ++reads;
      return Status::Ok();
    };
    st.update = [](int, int) { return Status::Ok(); };
    st.write = [](int, int) {
      return DataLossError("writing extent block0.optim failed: No space left on device");
    };
    auto p = std::make_unique<OptimizerPipeline>(16, 2, st);
    for (int b = 0; b < 16; ++b) p->Submit(b);
  }
  EXPECT_GE(reads.load(), 1);  // (reads after the failure are skipped: they wait on the write)
}

TEST(OptimizerPipeline, WaitingOnABlockNeverSubmittedReturnsAtOnce) {
  OptimizerPipeline::Stages st;
  st.update = [](int, int) { return Status::Ok(); };
  OptimizerPipeline p(3, 1, st);
  EXPECT_TRUE(p.WaitBlock(2).ok());
}

}  // namespace
}  // namespace strata::engine

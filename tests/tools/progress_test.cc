// The progress output of `strata train` (tools/progress.h): formatting, cadence, rate limiting
// and width, driven by an injected clock and captured in memory streams.
#include "tools/progress.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

namespace strata::tools {
namespace {

TEST(FormatEta, SecondsMinutesHoursAndDays) {
  EXPECT_EQ(FormatEta(0), "0s");
  EXPECT_EQ(FormatEta(59.4), "59s");
  EXPECT_EQ(FormatEta(59.6), "1m00s");
  EXPECT_EQ(FormatEta(83), "1m23s");
  EXPECT_EQ(FormatEta(3599), "59m59s");
  EXPECT_EQ(FormatEta(3600), "1h00m");
  EXPECT_EQ(FormatEta(2 * 3600 + 5 * 60 + 59), "2h05m");
  EXPECT_EQ(FormatEta(86399), "23h59m");
  EXPECT_EQ(FormatEta(3 * 86400 + 4 * 3600 + 1234), "3d04h");
}

TEST(FormatEta, UnknownWhenNegativeOrNotFinite) {
  EXPECT_EQ(FormatEta(-1), "--");
  EXPECT_EQ(FormatEta(NAN), "--");
  EXPECT_EQ(FormatEta(INFINITY), "--");
}

TEST(FitToWidth, KeepsTextShorterThanTheWidth) {
  EXPECT_EQ(FitToWidth("step 1/5 | loss 2.0", 80), "step 1/5 | loss 2.0");
  // 19 characters fit in 20 columns (the last column stays free), 20 do not.
  EXPECT_EQ(FitToWidth("0123456789012345678", 20), "0123456789012345678");
  EXPECT_NE(FitToWidth("01234567890123456789", 20), "01234567890123456789");
}

TEST(FitToWidth, CutsAtTheLastSeparatorThatFits) {
  const std::string text = "step 12/300 | loss 3.1416 | ETA 1m23s | 12345 tok/s";
  EXPECT_EQ(FitToWidth(text, static_cast<int>(text.size()) + 1), text);
  EXPECT_EQ(FitToWidth(text, static_cast<int>(text.size())),
            "step 12/300 | loss 3.1416 | ETA 1m23s");
  EXPECT_EQ(FitToWidth(text, 30), "step 12/300 | loss 3.1416");
  // "step 12/300 | loss 3.1416" is 25 characters: it fills 26 columns less the free one.
  EXPECT_EQ(FitToWidth(text, 26), "step 12/300 | loss 3.1416");
  EXPECT_EQ(FitToWidth(text, 25), "step 12/300");
}

TEST(FitToWidth, CutsHardWhenTheFirstFieldIsTooLong) {
  EXPECT_EQ(FitToWidth("step 12/300 | loss 3.1416", 8), "step 12");
  EXPECT_EQ(FitToWidth("abc", 2), "a");
  EXPECT_EQ(FitToWidth("abc", 1), "");
  EXPECT_EQ(FitToWidth("abc", 0), "");
  EXPECT_EQ(FitToWidth("abc", -5), "");
}

TEST(ProgressModeFor, LiveOnlyWhenStderrIsATerminal) {
  EXPECT_EQ(ProgressModeFor(false, false), ProgressMode::kPlain);
  EXPECT_EQ(ProgressModeFor(true, false), ProgressMode::kPlain);
  EXPECT_EQ(ProgressModeFor(false, true), ProgressMode::kLiveAndPlain);
  EXPECT_EQ(ProgressModeFor(true, true), ProgressMode::kLiveCommitted);
}

// A FILE* writing into memory.
class MemoryFile {
 public:
  MemoryFile() : file_(open_memstream(&buf_, &len_)) {}
  ~MemoryFile() {
    std::fclose(file_);
    std::free(buf_);
  }
  std::FILE* get() { return file_; }
  std::string str() {
    std::fflush(file_);
    return std::string(buf_, len_);
  }

 private:
  char* buf_ = nullptr;
  size_t len_ = 0;
  std::FILE* file_;
};

struct FakeClock {
  double now = 100.0;
};

ProgressOptions Options(ProgressMode mode, int64_t total, int64_t log_every, FakeClock* clock) {
  ProgressOptions o;
  o.mode = mode;
  o.total_steps = total;
  o.log_every = log_every;
  o.tokens_per_step = 60;
  o.start = {.bytes_h2d = 1000, .bytes_d2h = 2000, .nvme_bytes_read = 0, .nvme_bytes_written = 0};
  o.clock = [clock] { return clock->now; };
  o.terminal_width = [] { return 1000; };
  return o;
}

// Step `step` after the start counters of Options: per step 1 KiB H2D, 512 B D2H, 4 KiB NVMe
// read, 8 KiB NVMe written.
StepReport Report(int64_t step, bool skipped = false) {
  const auto n = static_cast<uint64_t>(step);
  return {.step = step,
          .loss = 3.0f - 0.125f * static_cast<float>(step),
          .grad_norm = 0.75,
          .lr = 1e-3,
          .skipped = skipped,
          .bytes_h2d = 1000 + 1024 * n,
          .bytes_d2h = 2000 + 512 * n,
          .nvme_bytes_read = 4096 * n,
          .nvme_bytes_written = 8192 * n};
}

// The pieces of a live stream: each `\r`-started draw's text (up to `\x1b[K`), and whether a
// newline followed it.
struct Draw {
  std::string text;
  bool newline;
};
std::vector<Draw> Draws(const std::string& s) {
  std::vector<Draw> draws;
  size_t pos = 0;
  while ((pos = s.find('\r', pos)) != std::string::npos) {
    const size_t end = s.find("\x1b[K", pos);
    if (end == std::string::npos) break;
    if (end > pos + 1) {  // "\r\x1b[K" alone is a clear, not a draw
      draws.push_back({s.substr(pos + 1, end - pos - 1), s.compare(end + 3, 1, "\n") == 0});
    }
    pos = end + 3;
  }
  return draws;
}

TEST(ProgressLine, PlainModePrintsThePlainLinesEveryLogEveryStepsOverTheirInterval) {
  FakeClock clock;
  MemoryFile plain, live;
  {
    ProgressLine p(Options(ProgressMode::kPlain, 5, 2, &clock), plain.get(), live.get());
    for (int step = 1; step <= 5; ++step) {
      clock.now += step;  // step k takes k seconds
      p.Update(Report(step, /*skipped=*/step == 5));
    }
  }
  EXPECT_EQ(plain.str(),
            "step     1/5 | loss 2.8750 | norm  0.750 | lr 1.00e-03 |      60 tok/s | h2d 1.0 KiB "
            "d2h 512 B | nvme r 4.0 KiB w 8.0 KiB\n"
            "step     2/5 | loss 2.7500 | norm  0.750 | lr 1.00e-03 |      30 tok/s | h2d 1.0 KiB "
            "d2h 512 B | nvme r 4.0 KiB w 8.0 KiB\n"
            // steps 3 and 4: 120 tokens in 7 s
            "step     4/5 | loss 2.5000 | norm  0.750 | lr 1.00e-03 |      17 tok/s | h2d 2.0 KiB "
            "d2h 1.0 KiB | nvme r 8.0 KiB w 16.0 KiB\n"
            "step     5/5 | loss 2.3750 | norm  0.750 | lr 1.00e-03 |      12 tok/s | h2d 1.0 KiB "
            "d2h 512 B | nvme r 4.0 KiB w 8.0 KiB | skipped (overflow)\n");
  EXPECT_EQ(live.str(), "");
}

TEST(ProgressLine, PlainModeWithLogEveryZeroPrintsNothing) {
  FakeClock clock;
  MemoryFile plain, live;
  {
    ProgressLine p(Options(ProgressMode::kPlain, 3, 0, &clock), plain.get(), live.get());
    for (int step = 1; step <= 3; ++step) p.Update(Report(step));
  }
  EXPECT_EQ(plain.str(), "");
  EXPECT_EQ(live.str(), "");
}

TEST(ProgressLine, LiveLineShowsStepLossEtaRateLrNormAndBytesOfTheLastStep) {
  FakeClock clock;
  MemoryFile plain, live;
  ProgressLine p(Options(ProgressMode::kLiveAndPlain, 10, 0, &clock), plain.get(), live.get());
  clock.now += 0.5;
  p.Update(Report(1));
  clock.now += 0.5;
  p.Update(Report(2));
  // 8 steps left at 0.5 s; 60 tokens per 0.5 s.
  EXPECT_EQ(p.live_text(),
            "step 2/10 | loss 2.7500 | ETA 4s | 120 tok/s | lr 1.00e-03 | norm 0.750 | "
            "h2d 1.0 KiB d2h 512 B nvme r 4.0 KiB w 8.0 KiB /step");
  clock.now += 0.5;
  p.Update(Report(3, /*skipped=*/true));
  EXPECT_EQ(p.live_text().rfind("step 3/10 | loss 2.6250 | skipped | ETA 4s |", 0), 0u)
      << p.live_text();
}

// An evaluation's or a checkpoint's bytes between two steps: neither the next step's live line
// nor the plain line's interval counts them.
TEST(ProgressLine, BytesSkippedBetweenStepsAreNotChargedToTheNextStep) {
  FakeClock clock;
  MemoryFile plain, live;
  {
    ProgressLine p(Options(ProgressMode::kLiveAndPlain, 4, 4, &clock), plain.get(), live.get());
    for (int step = 1; step <= 4; ++step) {
      clock.now += 1;
      StepReport r = Report(step);
      if (step >= 3) {  // 1 MiB read and written by a checkpoint after step 2
        r.nvme_bytes_read += 1 << 20;
        r.nvme_bytes_written += 1 << 20;
      }
      p.Update(r);
      if (step == 2) {
        StepReport after = Report(2);
        after.nvme_bytes_read += 1 << 20;
        after.nvme_bytes_written += 1 << 20;
        p.SkipBytes(after);
      }
      if (step == 3) {
        EXPECT_NE(p.live_text().find("nvme r 4.0 KiB w 8.0 KiB /step"), std::string::npos)
            << p.live_text();
      }
    }
  }
  // The interval since step 1's line, steps 2..4: their 3 steps' bytes only.
  EXPECT_NE(plain.str().find("step     4/4 | loss 2.5000 | norm  0.750 | lr 1.00e-03 |      60 "
                             "tok/s | h2d 3.0 KiB d2h 1.5 KiB | nvme r 12.0 KiB w 24.0 KiB\n"),
            std::string::npos)
      << plain.str();
}

TEST(ProgressLine, MfuFollowsTokPerSecondWhenThePeakIsKnown) {
  // 60 tokens per step, 1e6 model FLOPs per token, a 1e9 FLOP/s peak: MFU = 6e7 / step_s / 1e9.
  FakeClock clock;
  MemoryFile plain, live;
  {
    ProgressOptions o = Options(ProgressMode::kLiveAndPlain, 3, 1, &clock);
    o.model_flops_per_token = 1'000'000;
    o.peak_flops_per_s = 1e9;
    ProgressLine p(o, plain.get(), live.get());
    clock.now += 0.5;  // 120 tok/s: 1.2e8 FLOP/s, 12 %
    p.Update(Report(1));
    EXPECT_EQ(p.live_text(),
              "step 1/3 | loss 2.8750 | ETA 1s | 120 tok/s | MFU 12.0% | lr 1.00e-03 | "
              "norm 0.750 | h2d 1.0 KiB d2h 512 B nvme r 4.0 KiB w 8.0 KiB /step");
    clock.now += 2.0;  // 30 tok/s on the plain line (its interval); the live line's mean 48
    p.Update(Report(2));
    EXPECT_NE(p.live_text().find("| 48 tok/s | MFU 4.8% |"), std::string::npos) << p.live_text();
  }
  EXPECT_EQ(plain.str(),
            "step     1/3 | loss 2.8750 | norm  0.750 | lr 1.00e-03 |     120 tok/s | MFU 12.0% | "
            "h2d 1.0 KiB d2h 512 B | nvme r 4.0 KiB w 8.0 KiB\n"
            "step     2/3 | loss 2.7500 | norm  0.750 | lr 1.00e-03 |      30 tok/s | MFU 3.0% | "
            "h2d 1.0 KiB d2h 512 B | nvme r 4.0 KiB w 8.0 KiB\n");
}

TEST(ProgressLine, NoMfuFieldWithoutThePeakOrTheFlops) {
  for (const auto& [flops, peak] : {std::pair<int64_t, double>{1'000'000, 0}, {0, 1e9}}) {
    FakeClock clock;
    MemoryFile plain, live;
    {
      ProgressOptions o = Options(ProgressMode::kLiveAndPlain, 1, 1, &clock);
      o.model_flops_per_token = flops;
      o.peak_flops_per_s = peak;
      ProgressLine p(o, plain.get(), live.get());
      clock.now += 0.5;
      p.Update(Report(1));
      EXPECT_EQ(p.live_text().find("MFU"), std::string::npos) << p.live_text();
    }
    EXPECT_EQ(plain.str().find("MFU"), std::string::npos) << plain.str();
  }
}

TEST(ProgressLine, EtaAndRateAreTheMeanOfTheLastSixteenSteps) {
  FakeClock clock;
  MemoryFile plain, live;
  ProgressOptions o = Options(ProgressMode::kLiveAndPlain, 100, 0, &clock);
  o.tokens_per_step = 1000;
  ProgressLine p(std::move(o), plain.get(), live.get());
  for (int step = 1; step <= 20; ++step) {
    clock.now += step <= 4 ? 9.0 : step <= 16 ? 1.0 : 2.0;  // the 9 s steps leave the window
    p.Update(Report(step));
  }
  // Window = steps 5..20: 12 x 1 s + 4 x 2 s = 20 s, 1.25 s per step; 80 steps left.
  EXPECT_NE(p.live_text().find("| ETA 1m40s | 800 tok/s |"), std::string::npos) << p.live_text();
}

TEST(ProgressLine, RedrawsAtMostEveryTenthOfASecondButAlwaysTheFirstAndLastStep) {
  FakeClock clock;
  MemoryFile plain, live;
  {
    ProgressLine p(Options(ProgressMode::kLiveAndPlain, 10, 0, &clock), plain.get(), live.get());
    for (int step = 1; step <= 10; ++step) {
      clock.now += 0.03125;  // 4 steps = 0.125 s >= 0.1 s; 3 steps = 0.09375 s < 0.1 s
      p.Update(Report(step));
    }
  }
  const std::vector<Draw> draws = Draws(live.str());
  ASSERT_EQ(draws.size(), 4u) << live.str();
  EXPECT_EQ(draws[0].text.rfind("step 1/10 |", 0), 0u);
  EXPECT_EQ(draws[1].text.rfind("step 5/10 |", 0), 0u);
  EXPECT_EQ(draws[2].text.rfind("step 9/10 |", 0), 0u);
  EXPECT_EQ(draws[3].text.rfind("step 10/10 |", 0), 0u);
  for (size_t i = 0; i + 1 < draws.size(); ++i) EXPECT_EQ(draws[i].newline, false) << i;
  // Finish (the destructor) ends the last draw with a newline, and nothing follows.
  EXPECT_TRUE(draws[3].newline);
  EXPECT_EQ(live.str().substr(live.str().size() - 4), "\x1b[K\n");
}

TEST(ProgressLine, FinishDrawsARateLimitedLastStateBeforeTheNewline) {
  FakeClock clock;
  MemoryFile plain, live;
  ProgressLine p(Options(ProgressMode::kLiveAndPlain, 10, 0, &clock), plain.get(), live.get());
  p.Update(Report(1));
  p.Update(Report(2));  // no time passed: not drawn
  ASSERT_EQ(Draws(live.str()).size(), 1u);
  p.Finish();  // a run stopped early (signal, error) still shows where it stopped
  const std::vector<Draw> draws = Draws(live.str());
  ASSERT_EQ(draws.size(), 2u);
  EXPECT_EQ(draws[1].text.rfind("step 2/10 |", 0), 0u);
  EXPECT_EQ(live.str().back(), '\n');
  p.Finish();
  EXPECT_EQ(Draws(live.str()).size(), 2u);  // idempotent
}

TEST(ProgressLine, LiveAndPlainModeAlsoWritesThePlainLines) {
  FakeClock clock;
  MemoryFile plain, live;
  {
    ProgressLine p(Options(ProgressMode::kLiveAndPlain, 4, 2, &clock), plain.get(), live.get());
    for (int step = 1; step <= 4; ++step) {
      clock.now += 1;
      p.Update(Report(step));
    }
  }
  const std::string out = plain.str();
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 3) << out;  // steps 1, 2, 4
  EXPECT_EQ(out.find('\r'), std::string::npos);
  EXPECT_EQ(out.find('\x1b'), std::string::npos);
  EXPECT_EQ(Draws(live.str()).size(), 4u);
}

TEST(ProgressLine, CommittedModeEndsTheLineWithANewlineAtTheLogCadenceOnly) {
  FakeClock clock;
  MemoryFile plain, live;
  {
    ProgressLine p(Options(ProgressMode::kLiveCommitted, 5, 2, &clock), plain.get(), live.get());
    for (int step = 1; step <= 5; ++step) {
      clock.now += 1;
      p.Update(Report(step));
    }
  }
  EXPECT_EQ(plain.str(), "");
  const std::vector<Draw> draws = Draws(live.str());
  ASSERT_EQ(draws.size(), 5u) << live.str();
  const bool committed[] = {true, true, false, true, true};  // steps 1, 2, 4, 5
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(draws[i].text.rfind("step " + std::to_string(i + 1) + "/5 |", 0), 0u);
    EXPECT_EQ(draws[i].newline, committed[i]) << "step " << i + 1;
  }
  // The last commit already ended the line: Finish adds no empty line.
  EXPECT_EQ(live.str().substr(live.str().size() - 4), "\x1b[K\n");
}

TEST(ProgressLine, EveryDrawFitsTheTerminalWidthReadAtThatDraw) {
  FakeClock clock;
  MemoryFile plain, live;
  int width = 30;
  ProgressOptions o = Options(ProgressMode::kLiveAndPlain, 3, 0, &clock);
  o.terminal_width = [&width] { return width; };
  ProgressLine p(std::move(o), plain.get(), live.get());
  clock.now += 1;
  p.Update(Report(1));
  width = 45;  // the terminal was resized
  clock.now += 1;
  p.Update(Report(2));
  width = 5;
  clock.now += 1;
  p.Update(Report(3));
  const std::vector<Draw> draws = Draws(live.str());
  ASSERT_EQ(draws.size(), 3u);
  EXPECT_EQ(draws[0].text, "step 1/3 | loss 2.8750");
  EXPECT_EQ(draws[1].text, "step 2/3 | loss 2.7500 | ETA 1s | 60 tok/s");
  EXPECT_EQ(draws[2].text, "step");
  EXPECT_GT(p.live_text().size(), 45u);
}

TEST(ProgressLine, SuspendClearsTheLineRedrawsItAfterAndLeavesThePauseOutOfTheRate) {
  FakeClock clock;
  MemoryFile plain, live;
  ProgressLine p(Options(ProgressMode::kLiveAndPlain, 10, 0, &clock), plain.get(), live.get());
  clock.now += 1;
  p.Update(Report(1));
  const size_t before = live.str().size();
  {
    const auto pause = p.Suspend();
    EXPECT_EQ(live.str().substr(before), "\r\x1b[K");
    std::fputs("step     1 | val loss 2.0\n", plain.get());
    clock.now += 100;  // validation
  }
  const std::string after = live.str().substr(before + 4);
  ASSERT_EQ(Draws(after).size(), 1u);
  EXPECT_EQ(Draws(after)[0].text.rfind("step 1/10 |", 0), 0u);
  EXPECT_EQ(Draws(after)[0].newline, false);
  EXPECT_EQ(plain.str(), "step     1 | val loss 2.0\n");
  clock.now += 1;
  p.Update(Report(2));
  // 1 s per step, not (1 + 101) / 2: 8 steps left.
  EXPECT_NE(p.live_text().find("| ETA 8s | 60 tok/s |"), std::string::npos) << p.live_text();
}

TEST(ProgressLine, SuspendAfterACommitDoesNotRedrawTheCommittedLine) {
  FakeClock clock;
  MemoryFile plain, live;
  ProgressLine p(Options(ProgressMode::kLiveCommitted, 4, 2, &clock), plain.get(), live.get());
  clock.now += 1;
  p.Update(Report(1));
  clock.now += 1;
  p.Update(Report(2));
  const std::string before = live.str();
  { const auto pause = p.Suspend(); }
  EXPECT_EQ(live.str(), before);  // nothing live to clear or redraw
}

}  // namespace
}  // namespace strata::tools

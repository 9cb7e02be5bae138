// GPU faults, clearly (issue 42, item 6), on the host backend's fault injection
// (HostDeviceOptions::fault_stream / fault_at_launch): a kernel that fails on the compute stream
// ends the step with an error naming the op and the block, nothing hangs (the ctest TIMEOUT is the
// guard), later steps return the same error, and the master weights are those of the last good
// step; an arena the device cannot give is kResourceExhausted naming the request and what is free.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <atomic>
#include <map>
#include <memory>
#include <ostream>
#include <string>
#include <tuple>
#include <vector>

#include "base/units.h"
#include "engine/engine.h"
#include "engine/plan/model.h"
#include "engine_test_util.h"
#include "gpu/device.h"
#include "gpu/pinned_memory.h"
#include "models/gpt.h"

namespace strata::engine {
namespace {

// A stream that forwards everything to `real` (owned) and counts the host functions launched on
// it, as HostDeviceOptions::fault_at_launch counts them.
class CountingStream final : public gpu::Stream {
 public:
  explicit CountingStream(std::unique_ptr<gpu::Stream> real) : real_(std::move(real)) {}
  int64_t launches() const { return launches_; }
  std::string_view name() const override { return real_->name(); }
  gpu::DeviceKind device_kind() const override { return real_->device_kind(); }
  Status CopyH2D(gpu::DeviceSpan d, gpu::PinnedSpan s) override { return real_->CopyH2D(d, s); }
  Status CopyD2H(gpu::PinnedSpan d, gpu::DeviceSpan s) override { return real_->CopyD2H(d, s); }
  Status Convert(gpu::DeviceSpan dst, DType dt, gpu::DeviceSpan src, DType st, int64_t n,
                 float scale) override {
    return real_->Convert(dst, dt, src, st, n, scale);
  }
  Status LaunchHost(std::function<Status()> fn) override {
    ++launches_;
    return real_->LaunchHost(std::move(fn));
  }
  Status LaunchHostAs(trace::Category c, std::function<Status()> fn) override {
    ++launches_;
    return real_->LaunchHostAs(c, std::move(fn));
  }
  void SetWorkLabel(std::string label) override { real_->SetWorkLabel(std::move(label)); }
  Status Record(gpu::Event& e) override { return real_->Record(e); }
  Status Wait(gpu::Event& e) override { return real_->Wait(e); }
  Status Synchronize() override { return real_->Synchronize(); }

 private:
  std::unique_ptr<gpu::Stream> real_;
  std::atomic<int64_t> launches_{0};
};

// A host device whose streams count their launches (the engine's and the model's alike).
class CountingDevice final : public gpu::Device {
 public:
  explicit CountingDevice(std::unique_ptr<gpu::Device> real)
      : Device(size_t{1} << 40), real_(std::move(real)) {}
  gpu::DeviceKind kind() const override { return real_->kind(); }
  std::string description() const override { return real_->description(); }
  StatusOr<std::unique_ptr<gpu::DeviceArena>> CreateArena(size_t n) override {
    return real_->CreateArena(n);
  }
  StatusOr<gpu::DeviceMemoryInfo> MemoryInfo() override { return real_->MemoryInfo(); }
  StatusOr<std::unique_ptr<gpu::Stream>> CreateStream(std::string name) override {
    STRATA_ASSIGN_OR_RETURN(auto s, real_->CreateStream(std::move(name)));
    return std::unique_ptr<gpu::Stream>(new CountingStream(std::move(s)));
  }
  StatusOr<std::unique_ptr<gpu::Event>> CreateEvent() override { return real_->CreateEvent(); }

 protected:
  StatusOr<std::byte*> PinnedAlloc(size_t n) override { return gpu::MapAlignedHostMemory(n); }
  void PinnedFree(std::byte* p, size_t n) override { gpu::UnmapAlignedHostMemory(p, n); }

 private:
  std::unique_ptr<gpu::Device> real_;
};

// Records, for each block call (step, backward, block, call within the step), the number
// (1-based) the first host function it launches on the compute stream gets: where a fault lands.
class LaunchCountingModel final : public ForwardingModel {
 public:
  using ForwardingModel::ForwardingModel;
  using Call = std::tuple<int, bool, int, int>;
  void BeginStep(int step) {
    step_ = step;
    calls_.clear();
  }
  Status Forward(int b, const BlockBuffers& buf, gpu::Stream& s) override {
    Note(false, b, s);
    return inner()->Forward(b, buf, s);
  }
  Status Backward(int b, const BlockBuffers& buf, gpu::Stream& s) override {
    Note(true, b, s);
    return inner()->Backward(b, buf, s);
  }
  // 0 when the call was not seen.
  int64_t FirstLaunchOf(const Call& call) const {
    auto it = first_launch_.find(call);
    return it == first_launch_.end() ? 0 : it->second;
  }

 private:
  void Note(bool backward, int b, gpu::Stream& s) {
    auto* counting = dynamic_cast<CountingStream*>(&s);
    ASSERT_NE(counting, nullptr);
    first_launch_.emplace(Call{step_, backward, b, calls_[{backward, b}]++},
                          counting->launches() + 1);
  }
  int step_ = 0;
  std::map<std::pair<bool, int>, int> calls_;
  std::map<Call, int64_t> first_launch_;
};

class GpuFaultTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto shape = models::GptPreset("tiny");
    ASSERT_TRUE(shape.ok());
    auto model = models::GptModel::Create(*shape);
    ASSERT_TRUE(model.ok());
    model_ = std::move(*model);
  }

  // Params resident, the optimizer on the host (its update never touches the compute stream).
  EngineOptions Options(int accum, Schedule schedule) const {
    EngineOptions o;
    o.precision = DType::kF32;
    o.micro_batch = {2, 16};
    o.grad_accum_steps = accum;
    o.placement.param_home = ParamHome::kDevice;
    o.placement.optimizer_home = OptimizerHome::kHost;
    o.placement.device_budget_bytes = 64 << 20;
    o.placement.schedule = schedule;
    return o;
  }

  std::vector<MicroBatch> Batch(int step, int accum) {
    tokens_ = testing::RandomTokenVectors(2 * accum, 32, 1000 + step);
    std::vector<MicroBatch> mbs;
    for (int i = 0; i < accum; ++i) mbs.push_back({tokens_[2 * i], tokens_[2 * i + 1]});
    return mbs;
  }

  std::unique_ptr<models::GptModel> model_;
  std::vector<std::vector<int32_t>> tokens_;
};

struct FaultCase {
  const char* name;
  int accum;
  Schedule schedule;
  bool backward;  // the op that fails in step 3 (index 2): block `block`'s backward or forward
  int block;
  const char* op;  // what the error must name
};

void PrintTo(const FaultCase& c, std::ostream* os) { *os << c.name; }

class GpuFaultCaseTest : public GpuFaultTest, public ::testing::WithParamInterface<FaultCase> {};

TEST_P(GpuFaultCaseTest, KernelFaultNamesOpAndBlockIsStickyAndLosesNothing) {
  const FaultCase& c = GetParam();
  const EngineOptions o = Options(c.accum, c.schedule);
  // A clean run: the master weights after two steps, and where the third step's op launches.
  LaunchCountingModel counting(model_.get());
  uint64_t after_two = 0;
  {
    auto host = gpu::CreateHostDevice({});
    ASSERT_TRUE(host.ok());
    CountingDevice device(std::move(*host));
    auto e = Engine::Create(&counting, &device, o);
    ASSERT_TRUE(e.ok()) << e.status().ToString();
    for (int step = 0; step < 3; ++step) {
      counting.BeginStep(step);
      ASSERT_TRUE((*e)->Step(Batch(step, c.accum)).ok());
      if (step == 1) {
        auto h = (*e)->MasterWeightsXxh3();
        ASSERT_TRUE(h.ok());
        after_two = *h;
      }
    }
  }
  const int64_t launch = counting.FirstLaunchOf({2, c.backward, c.block, 0});
  ASSERT_GT(launch, 0);

  gpu::HostDeviceOptions faulty;
  faulty.fault_stream = "compute";
  faulty.fault_at_launch = launch;
  auto device = gpu::CreateHostDevice(faulty);
  ASSERT_TRUE(device.ok());
  auto e = Engine::Create(model_.get(), device->get(), o);
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  for (int step = 0; step < 2; ++step) ASSERT_TRUE((*e)->Step(Batch(step, c.accum)).ok());
  auto failed = (*e)->Step(Batch(2, c.accum));
  ASSERT_FALSE(failed.ok());
  const Status& s = failed.status();
  EXPECT_EQ(s.code(), StatusCode::kInternal);
  const std::string want =
      fmt::format("{} of block {} ('{}') failed", c.op, c.block, model_->block_name(c.block));
  EXPECT_NE(s.message().find(want), std::string::npos) << s.message() << "\nwants: " << want;
  EXPECT_NE(s.message().find("stream 'compute'"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find(fmt::format("injected fault (launch {}", launch)), std::string::npos)
      << s.message();
  EXPECT_EQ(s.message().find('\n'), std::string::npos) << "one line: " << s.message();

  // Sticky: the next steps refuse with the same error, at once.
  for (int again = 0; again < 2; ++again) {
    auto next = (*e)->Step(Batch(3 + again, c.accum));
    ASSERT_FALSE(next.ok());
    EXPECT_EQ(next.status(), s);
  }
  // Nothing lost: the master weights are those of the two good steps.
  auto h = (*e)->MasterWeightsXxh3();
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  EXPECT_EQ(*h, after_two);
  // The engine's destructor drains every queue and stream: the test ends, or times out.
}

INSTANTIATE_TEST_SUITE_P(
    Ops, GpuFaultCaseTest,
    ::testing::Values(
        FaultCase{"BackwardMicroBatchMajor", 1, Schedule::kMicroBatchMajor, true, 2, "backward"},
        FaultCase{"ForwardMicroBatchMajor", 1, Schedule::kMicroBatchMajor, false, 1, "forward"},
        FaultCase{"BackwardOfHeadLayerMajor", 2, Schedule::kLayerMajor, true, 3, "backward"},
        FaultCase{"ForwardLayerMajor", 2, Schedule::kLayerMajor, false, 0, "forward"}),
    [](const auto& info) { return std::string(info.param.name); });

TEST_F(GpuFaultTest, ArenaTheDeviceCannotGiveNamesRequestAndFreeMemory) {
  const EngineOptions o = Options(1, Schedule::kMicroBatchMajor);
  auto plan =
      MakePlan(*model_, o.precision, o.micro_batch, o.placement, PlanOptimizer{o.optimizer, 1});
  ASSERT_TRUE(plan.ok());
  const size_t asked = AlignUp(plan->device_total_bytes, 4096);  // the host arena's pages
  ASSERT_GE(asked, size_t{8192});
  // Another user holds all but half of what the engine asks of a 64 MiB device.
  const size_t memory = size_t{64} << 20, left = asked / 2 / 4096 * 4096;
  gpu::HostDeviceOptions small;
  small.memory_bytes = memory;
  auto device = gpu::CreateHostDevice(small);
  ASSERT_TRUE(device.ok());
  auto other = (*device)->CreateArena(memory - left);
  ASSERT_TRUE(other.ok()) << other.status().ToString();
  auto info = (*device)->MemoryInfo();
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->total_bytes, memory);
  EXPECT_EQ(info->free_bytes, left);

  auto e = Engine::Create(model_.get(), device->get(), o);
  ASSERT_FALSE(e.ok());
  const Status& s = e.status();
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted);
  const std::string want = fmt::format(
      "could not take {} of device memory for the device arena "
      "({} of {} is free on the host device",
      FormatBytes(asked), FormatBytes(left), FormatBytes(memory));
  EXPECT_NE(s.message().find(want), std::string::npos) << s.message() << "\nwants: " << want;
  EXPECT_EQ(s.message().find('\n'), std::string::npos) << s.message();

  // Freed, the same device gives it, and counts it.
  other->reset();
  auto ok = Engine::Create(model_.get(), device->get(), o);
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_EQ((*device)->MemoryInfo()->free_bytes, memory - asked);
}

TEST(HostDeviceFaults, NegativeLaunchIsRefused) {
  gpu::HostDeviceOptions o;
  o.fault_at_launch = -1;
  auto d = gpu::CreateHostDevice(o);
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.status().message().find("fault_at_launch -1"), std::string::npos);
}

}  // namespace
}  // namespace strata::engine

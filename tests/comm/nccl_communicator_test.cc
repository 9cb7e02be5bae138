// The NCCL communicator on one GPU (a world of one rank bootstrapped by the local communicator):
// stream-ordered reduce-scatter and all-gather for every dtype, refusals, host collectives.
// Needs a CUDA GPU and libnccl.so.2 (skips without either, saying which).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <vector>

#include "comm/communicator.h"
#include "tests/gpu/cuda_test_util.h"

namespace strata::comm {
namespace {

using ::testing::HasSubstr;

class NcclCommunicatorTest : public gpu::testing::CudaTest {
 protected:
  void SetUp() override {
    CudaTest::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    local_ = CreateLocalCommunicator();
    auto comm = CreateNcclCommunicator(*local_);
    if (!comm.ok() && comm.status().message().find("libnccl") != std::string::npos) {
      GTEST_SKIP() << comm.status().message();
    }
    ASSERT_TRUE(comm.ok()) << comm.status().ToString();
    comm_ = std::move(*comm);
  }
  void TearDown() override {
    comm_.reset();
    CudaTest::TearDown();
  }
  std::unique_ptr<Communicator> local_;
  std::unique_ptr<Communicator> comm_;
};

TEST_F(NcclCommunicatorTest, IsAWorldOfOneGpu) {
  EXPECT_EQ(comm_->backend(), "nccl");
  EXPECT_EQ(comm_->rank(), 0);
  EXPECT_EQ(comm_->world_size(), 1);
}

TEST_F(NcclCommunicatorTest, ReduceScatterOfOneRankCopiesEveryDtypeBitForBit) {
  constexpr int64_t kCount = 1001;
  for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
    SCOPED_TRACE(DTypeName(dtype));
    const size_t bytes = kCount * SizeOf(dtype);
    std::vector<uint8_t> data(bytes);
    for (size_t i = 0; i < bytes; ++i) data[i] = static_cast<uint8_t>(i * 13 + 5);
    // Keep every value finite: 0x7f/0xff high bytes would make NaNs whose sum may not keep bits.
    for (size_t i = SizeOf(dtype) - 1; i < bytes; i += SizeOf(dtype)) data[i] &= 0x3f;
    gpu::DeviceSpan send = Carve(bytes);
    gpu::DeviceSpan recv = Carve(bytes);
    Upload(send, data);
    ASSERT_TRUE(comm_->ReduceScatter(send, recv, kCount, dtype, *stream_).ok());
    EXPECT_EQ(Download<uint8_t>(recv, bytes), data);
  }
}

TEST_F(NcclCommunicatorTest, AllGatherInPlaceOfOneRankKeepsTheBuffer) {
  std::vector<float> data(333);
  for (size_t i = 0; i < data.size(); ++i) data[i] = 0.5f * static_cast<float>(i) - 7;
  gpu::DeviceSpan buffer = Carve(data.size() * 4);
  Upload(buffer, data);
  ASSERT_TRUE(comm_->AllGatherInPlace(buffer, 333, DType::kF32, *stream_).ok());
  EXPECT_EQ(Download<float>(buffer, data.size()), data);
}

TEST_F(NcclCommunicatorTest, RefusesHostStreamsAndBadBounds) {
  auto host = gpu::CreateHostDevice({});
  ASSERT_TRUE(host.ok());
  auto host_stream = (*host)->CreateStream("host");
  ASSERT_TRUE(host_stream.ok());
  gpu::DeviceSpan a = Carve(64);
  gpu::DeviceSpan b = Carve(64);
  Status s = comm_->ReduceScatter(a, b, 4, DType::kF32, **host_stream);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("NCCL takes CUDA streams"));
  EXPECT_EQ(comm_->ReduceScatter(a, b, 17, DType::kF32, *stream_).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(comm_->AllGatherInPlace(a, 17, DType::kF32, *stream_).code(),
            StatusCode::kInvalidArgument);
}

TEST_F(NcclCommunicatorTest, HostCollectivesAndDuplicateWork) {
  std::vector<double> v = {1.25, -3};
  ASSERT_TRUE(comm_->AllReduce(v, ReduceOp::kSum).ok());
  EXPECT_EQ(v, (std::vector<double>{1.25, -3}));
  EXPECT_TRUE(comm_->Barrier().ok());
  auto dup = comm_->Duplicate();
  ASSERT_TRUE(dup.ok()) << dup.status().ToString();
  EXPECT_EQ((*dup)->backend(), "nccl");
}

}  // namespace
}  // namespace strata::comm

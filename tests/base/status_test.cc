#include "base/status.h"

#include <gtest/gtest.h>

#include <cerrno>

namespace strata {
namespace {

StatusOr<int> Half(int x) {
  if (x % 2) return InvalidArgumentError("odd");
  return x / 2;
}

Status UseHalf(int x, int* out) {
  STRATA_ASSIGN_OR_RETURN(*out, Half(x));
  return Status::Ok();
}

TEST(Status, ErrnoMapsToTheCodeACallerActsOn) {
  EXPECT_EQ(ErrnoToStatus(ENOSPC, "write /x").code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(ErrnoToStatus(ENOENT, "open").code(), StatusCode::kNotFound);
  EXPECT_EQ(ErrnoToStatus(EACCES, "open").code(), StatusCode::kPermissionDenied);
  EXPECT_EQ(ErrnoToStatus(EIO, "read").code(), StatusCode::kDataLoss);
  EXPECT_EQ(ErrnoToStatus(EAGAIN, "read").code(), StatusCode::kUnavailable);
  EXPECT_TRUE(ErrnoToStatus(0, "x").ok());
  const Status s = ErrnoToStatus(ENOSPC, "write /mnt/a");
  EXPECT_NE(s.message().find("write /mnt/a"), std::string::npos);
  EXPECT_NE(s.message().find("errno 28"), std::string::npos);
}

// The errno stays with the status through added context, so that a caller tells a full drive
// from the other causes of kResourceExhausted without reading the message.
TEST(Status, KeepsTheErrnoItCameFromThroughContext) {
  const Status full = ErrnoToStatus(ENOSPC, "write /mnt/a").WithContext("extent 'b.m'");
  EXPECT_EQ(full.os_error(), ENOSPC);
  EXPECT_EQ(full.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(ErrnoToStatus(EDQUOT, "write").os_error(), EDQUOT);
  EXPECT_EQ(ErrnoToStatus(ENOMEM, "write").os_error(), ENOMEM);
  EXPECT_EQ(ResourceExhaustedError("pinned budget short").os_error(), 0);
  EXPECT_EQ(ResourceExhaustedError("x (errno 28)").os_error(), 0);  // words are not the cause
  EXPECT_EQ(Status::Ok().os_error(), 0);
}

TEST(Status, AssignOrReturnPropagatesErrorsAndValues) {
  int v = 0;
  EXPECT_TRUE(UseHalf(8, &v).ok());
  EXPECT_EQ(v, 4);
  Status s = UseHalf(3, &v);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.ToString(), "INVALID_ARGUMENT: odd");
  EXPECT_EQ(s.WithContext("step 3").message(), "step 3: odd");
}

}  // namespace
}  // namespace strata

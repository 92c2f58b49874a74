// cpd::Status, cpd::Result and the two propagation macros.
#include "cpd/status.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>

namespace cpd {
namespace {

Result<int> Parse(const std::string& s) {
  if (s.empty()) return Status::InvalidArgument("empty");
  return std::stoi(s);
}

Result<int> Twice(const std::string& s) {
  CPD_ASSIGN_OR_RETURN(const int v, Parse(s));
  return 2 * v;
}

Status StoreSum(const std::string& a, const std::string& b, int* out) {
  int x = 0;
  CPD_ASSIGN_OR_RETURN(x, Parse(a));
  CPD_ASSIGN_OR_RETURN(const int y, Parse(b));  // two in one scope: distinct temporaries
  *out = x + y;
  return Status::Ok();
}

Result<std::unique_ptr<int>> MakeBox(int v) { return std::make_unique<int>(v); }

Result<int> Unbox(int v) {
  CPD_ASSIGN_OR_RETURN(auto box, MakeBox(v));  // move-only values move out
  return *box;
}

TEST(Status, AssignOrReturnDeclaresFromTheValue) {
  const Result<int> r = Twice("21");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*r, 42);
}

TEST(Status, AssignOrReturnPropagatesTheError) {
  const Result<int> r = Twice("");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Status::Code::kInvalidArgument);
  EXPECT_EQ(r.status().message(), "empty");
}

TEST(Status, AssignOrReturnAssignsAndWorksInStatusFunctions) {
  int sum = -1;
  EXPECT_TRUE(StoreSum("2", "3", &sum).ok());
  EXPECT_EQ(sum, 5);
  sum = -1;
  EXPECT_EQ(StoreSum("2", "", &sum).code(), Status::Code::kInvalidArgument);
  EXPECT_EQ(sum, -1) << "nothing is written after an error";
}

TEST(Status, AssignOrReturnMovesMoveOnlyValues) {
  const Result<int> r = Unbox(7);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*r, 7);
}

}  // namespace
}  // namespace cpd

// Hybrid precision: the rules of --allreduce-layer-format resolved against the all-reducer's
// layers (first, last, bn, names; later rules win), and the errors that name what is accepted.
#include "runtime/train/allreduce_layers.h"

#include <gtest/gtest.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

namespace cpd::runtime {
namespace {

comm::GradientLayout Layout(const std::vector<std::string>& names) {
  comm::GradientLayout l;
  l.layer_names = names;
  for (size_t i = 0; i <= names.size(); ++i) l.offsets.push_back(i * 10);
  return l;
}

using Rules = std::vector<std::pair<std::string, std::string>>;
using Map = std::map<std::string, std::string>;

TEST(AllReduceLayers, FirstLastBatchNormAndNamesResolveInOrder) {
  const comm::GradientLayout layout =
      Layout({"conv1", "bn1", "layer1.0.conv1", "layer1.0.bn1", "fc"});
  const std::vector<std::string> bn = {"bn1", "layer1.0.bn1"};
  auto r = ResolveAllReduceLayers({{"first", "fp32"}, {"last", "e5m2"}}, layout, bn);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(*r, (Map{{"conv1", "fp32"}, {"fc", "e5m2"}}));
  r = ResolveAllReduceLayers({{"bn", "fp32"}, {"layer1.0.bn1", "int8"}}, layout, bn);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*r, (Map{{"bn1", "fp32"}, {"layer1.0.bn1", "int8"}}));  // the later rule wins
  r = ResolveAllReduceLayers({{"layer1.0.bn1", "int8"}, {"bn", "fp32"}}, layout, bn);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*r, (Map{{"bn1", "fp32"}, {"layer1.0.bn1", "fp32"}}));
  r = ResolveAllReduceLayers({}, layout, bn);
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->empty());
}

TEST(AllReduceLayers, UnknownNamesAndBatchNormWithoutAnyAreRefusedByName) {
  const comm::GradientLayout layout = Layout({"conv1", "fc1", "fc2"});
  auto r = ResolveAllReduceLayers({{"conv9", "fp32"}}, layout, {});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Status::Code::kInvalidArgument);
  EXPECT_NE(r.status().message().find("--allreduce-layer-format"), std::string::npos);
  EXPECT_NE(r.status().message().find("'conv9'"), std::string::npos);
  EXPECT_NE(r.status().message().find("conv1, fc1, fc2"), std::string::npos)
      << r.status().message();
  r = ResolveAllReduceLayers({{"bn", "fp32"}}, layout, {});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("BatchNorm"), std::string::npos);
  // A BatchNorm layer without gradients in the layout is not a target.
  r = ResolveAllReduceLayers({{"bn", "fp32"}}, layout, {"bn_frozen"});
  EXPECT_FALSE(r.ok());
}

}  // namespace
}  // namespace cpd::runtime

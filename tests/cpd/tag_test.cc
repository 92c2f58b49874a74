#include "cpd/tag.h"

#include <gtest/gtest.h>

#include <string>

namespace cpd {
namespace {

TEST(Tag, AcceptsTheDocumentedCharactersUpToTheLimit) {
  EXPECT_TRUE(IsTag("aps-large-batch_v2.1", kMaxStudyNameLength));
  EXPECT_TRUE(IsTag("AZaz09._-", 9));
  EXPECT_TRUE(IsTag(std::string(kMaxJobNameLength, 'j'), kMaxJobNameLength));
  EXPECT_FALSE(IsTag(std::string(kMaxJobNameLength + 1, 'j'), kMaxJobNameLength));
  EXPECT_FALSE(IsTag("", kMaxJobNameLength));
}

TEST(Tag, RefusesEveryOtherCharacter) {
  for (int c = 0; c < 256; ++c) {
    const char ch = char(c);
    const bool documented = (ch >= 'A' && ch <= 'Z') || (ch >= 'a' && ch <= 'z') ||
                            (ch >= '0' && ch <= '9') || ch == '.' || ch == '_' || ch == '-';
    EXPECT_EQ(IsTagCharacter(ch), documented) << c;
    EXPECT_EQ(IsTag(std::string("a") + ch, 8), documented) << c;
  }
  EXPECT_FALSE(IsTag("a/b", 8));  // a path
  EXPECT_FALSE(IsTag("a b", 8));  // a space
  EXPECT_TRUE(HasOnlyTagCharacters(""));
}

}  // namespace
}  // namespace cpd

// The candidate enumerator: the counts its rules give, every candidate within its code budget
// exactly, the named formats (fixed point, fp134/fp143/fp152, log) among them with the same
// values as their own specs, and the family of a list.
#include "cpd/candidates.h"

#include <gtest/gtest.h>

#include <map>
#include <set>
#include <string>
#include <vector>

#include "cpd/format.h"

namespace cpd {
namespace {

std::vector<BinadeCandidate> Enumerate(int bits) {
  auto list = EnumerateBinadeCandidates(bits);
  EXPECT_TRUE(list.ok()) << list.status().message();
  return list.ok() ? *list : std::vector<BinadeCandidate>{};
}

// The count of the rules, derived independently: per p in 1..b-2 the odd c in 1..2^(b-p)-3 (one
// a each), and one log format when its 2^(b-1)-1 binades fit in 127.
int ExpectedCount(int bits) {
  int n = 0;
  for (int p = 1; p <= bits - 2; ++p) {
    for (int c = 1; c <= (1 << (bits - p)) - 3; c += 2) {
      const int a = ((1 << (bits - p)) - 1 - c) / 2;
      if (a + c + (p - 1) <= 127) ++n;
    }
  }
  if ((1 << (bits - 1)) - 1 <= 127) ++n;
  return n;
}

TEST(Candidates, CountsOfTheRules) {
  EXPECT_EQ(Enumerate(8).size(), 121u);
  EXPECT_EQ(Enumerate(7).size(), 58u);
  EXPECT_EQ(Enumerate(6).size(), 27u);
  for (int bits = 2; bits <= 16; ++bits) {
    EXPECT_EQ(int(Enumerate(bits).size()), ExpectedCount(bits)) << bits << " bits";
  }
}

TEST(Candidates, EveryCandidateUsesItsWholeCodeBudget) {
  for (int bits : {4, 6, 7, 8, 10}) {
    std::set<std::string> specs;
    for (const BinadeCandidate& c : Enumerate(bits)) {
      auto f = Format::Parse(c.spec);
      ASSERT_TRUE(f.ok()) << c.spec << ": " << f.status().message();
      EXPECT_EQ(f->spec(), c.spec) << "not canonical";
      EXPECT_EQ(f->bits(), bits) << c.spec;
      EXPECT_EQ(c.bits, bits) << c.spec;
      // 2^(b-1) - 1 magnitudes per sign, both signs, and zero.
      EXPECT_EQ(f->Info().distinct_finite, (uint64_t(1) << bits) - 1) << c.spec;
      EXPECT_EQ(f->binade_mbits(), c.mbits) << c.spec;
      EXPECT_TRUE(specs.insert(c.spec).second) << c.spec << " listed twice";
    }
  }
}

TEST(Candidates, NamedFormatsAreAmongThemWithTheirOwnValues) {
  std::map<std::string, BinadeCandidate> by_name;
  for (const BinadeCandidate& c : Enumerate(8)) by_name[c.name] = c;
  const std::map<std::string, std::string> named = {
      {"fp134", "fp134"}, {"fp143", "fp143"}, {"fp152", "fp152"}, {"log8", "log8"}};
  for (const auto& [name, spec] : named) {
    ASSERT_TRUE(by_name.count(name)) << name << " is not a candidate";
    auto own = Format::Parse(spec);
    ASSERT_TRUE(own.ok()) << own.status().message();
    auto cand = Format::Parse(by_name[name].spec);
    ASSERT_TRUE(cand.ok());
    EXPECT_EQ(*cand->Values(), *own->Values()) << name;
  }
  ASSERT_TRUE(by_name.count("fixed8"));
  EXPECT_EQ(by_name["fixed8"].mbits, (std::vector<int>{6, 5, 4, 3, 2, 1, 0}));
  // int8's grid is max|x| / 127 times 0..127: fixed point under a power-of-two scale instead.
  auto fixed = Format::Parse(by_name["fixed8"].spec + ":room=0");
  ASSERT_TRUE(fixed.ok());
  const std::vector<float> v = *fixed->Values();
  for (size_t i = 1; i < v.size(); ++i) EXPECT_FLOAT_EQ(v[i] - v[i - 1], 1.0f / 64) << i;
}

TEST(Candidates, OrderAndFamilies) {
  const std::vector<BinadeCandidate> c8 = Enumerate(8);
  EXPECT_EQ(c8.front().family, "fixed");
  EXPECT_EQ(c8.back().family, "log");
  std::map<std::string, int> families;
  for (const BinadeCandidate& c : c8) families[c.family]++;
  // One fixed, floats fp1e(7-e) for e = 2..6 (e = 7 is the log format), the rest hybrids.
  EXPECT_EQ(families["fixed"], 1);
  EXPECT_EQ(families["float"], 5);
  EXPECT_EQ(families["log"], 1);
  EXPECT_EQ(families["hybrid"], 121 - 7);
  for (size_t i = 1; i < c8.size(); ++i) {
    EXPECT_GE(c8[i - 1].mbits.front(), c8[i].mbits.front()) << "ordered by p, descending";
  }
}

TEST(Candidates, FamilyOfAnyList) {
  EXPECT_EQ(BinadeFamily({6, 5, 4, 3, 2, 1, 0}), "fixed");
  EXPECT_EQ(BinadeFamily({4, 4, 4, 4, 4, 4, 4, 3, 2, 1, 0}), "float");
  EXPECT_EQ(BinadeFamily({5, 5, 4, 4, 4, 4, 4, 3, 2, 1, 0}), "hybrid");
  EXPECT_EQ(BinadeFamily({0, 0, 0}), "log");
  EXPECT_EQ(BinadeFamily({3, 3, 3}), "binades");        // no underflow tail
  EXPECT_EQ(BinadeFamily({4, 3, 3, 1, 0}), "binades");  // a gap in the tail
  EXPECT_EQ(BinadeFamily({4, 3, 2, 1}), "binades");     // the tail stops above 0
  EXPECT_EQ(BinadeFamily({1, 0}), "fixed");
  EXPECT_EQ(BinadeFamily({}), "binades");
}

TEST(Candidates, WidthsOutsideTheRangeAreRefused) {
  for (int bits : {-1, 0, 1, 17}) {
    auto list = EnumerateBinadeCandidates(bits);
    ASSERT_FALSE(list.ok()) << bits;
    EXPECT_NE(list.status().message().find("2..16"), std::string::npos);
  }
}

TEST(Candidates, WidthListsAreParsedStrictly) {
  auto list = EnumerateBinadeCandidates(std::string_view("8,6"));
  ASSERT_TRUE(list.ok()) << list.status().message();
  EXPECT_EQ(list->size(), 121u + 27u);
  EXPECT_EQ(list->front().bits, 8);
  EXPECT_EQ(list->back().bits, 6);
  for (const char* bad : {"8x", "8,", "", " 8", "8,x", "+8", "99999999999"}) {
    auto r = EnumerateBinadeCandidates(std::string_view(bad));
    EXPECT_FALSE(r.ok()) << bad;
  }
  EXPECT_NE(EnumerateBinadeCandidates(std::string_view("8x")).status().message().find("'8x'"),
            std::string::npos);
  EXPECT_NE(
      EnumerateBinadeCandidates(std::string_view("99999999999")).status().message().find("2..16"),
      std::string::npos);
}

}  // namespace
}  // namespace cpd

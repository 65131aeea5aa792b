#include <gtest/gtest.h>

#include <map>
#include <set>

#include "text/mqar.h"
#include "util/error.h"

using namespace kvx::text;

TEST(Mqar, SequencesAreSolvableAndCorrectlyLabelled) {
  std::mt19937_64 rng(3);
  for (int pairs : {1, 5, 16, 31}) {
    auto spec = MqarSpec::for_vocab(512, pairs, 32 - pairs / 2, 128);
    for (int rep = 0; rep < 20; ++rep) {
      auto s = make_mqar(spec, rng);
      ASSERT_EQ(s.tokens.size(), 128u);
      std::map<int32_t, int32_t> value_of;
      for (int i = 0; i < pairs; ++i) {
        const int32_t k = s.tokens[2 * i], v = s.tokens[2 * i + 1];
        EXPECT_TRUE(k >= spec.key_lo && k < spec.key_hi);
        EXPECT_TRUE(v >= spec.value_lo && v < spec.value_hi);
        EXPECT_EQ(value_of.count(k), 0u) << "keys must be distinct";
        value_of[k] = v;
        EXPECT_EQ(s.answer[2 * i], -1);
      }
      int scored = 0;
      std::set<int32_t> asked;
      for (size_t i = 2 * pairs; i < s.tokens.size(); ++i) {
        if (s.answer[i] < 0) continue;
        ++scored;
        ASSERT_EQ(value_of.count(s.tokens[i]), 1u) << "a query must repeat a key";
        EXPECT_EQ(s.answer[i], value_of[s.tokens[i]]);
        EXPECT_EQ(s.tokens[i + 1], s.answer[i]) << "the answer follows its query";
        asked.insert(s.tokens[i]);
      }
      EXPECT_EQ(scored, spec.queries);
      EXPECT_EQ(asked.size(), static_cast<size_t>(std::min(spec.queries, pairs)));  // without replacement first
    }
  }
}

TEST(Mqar, RejectsImpossibleSpecs) {
  EXPECT_THROW(MqarSpec::for_vocab(512, 40, 40, 128), kvx::Error);
  EXPECT_THROW(MqarSpec::for_vocab(16, 8, 4, 64), kvx::Error);  // 4 keys in range, 8 pairs
  EXPECT_THROW(MqarSpec::for_vocab(512, 0, 4, 64), kvx::Error);
}

TEST(Mqar, DeterministicGivenTheSeed) {
  auto spec = MqarSpec::for_vocab(256, 8, 8, 40);
  std::mt19937_64 a(9), b(9);
  EXPECT_EQ(make_mqar(spec, a).tokens, make_mqar(spec, b).tokens);
}

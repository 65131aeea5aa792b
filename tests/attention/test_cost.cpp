// Cache and parameter accounting: the LRKV seed's table (Eq. 9, Table 7), its rank sweep
// (Table 8) and MLA rows, hand-computed byte counts, and clear errors for bad shapes.
#include <gtest/gtest.h>

#include "attention/cost.h"
#include "util/error.h"

using namespace kvx;
using attention::AttentionShape;

TEST(Cost, ReproducesTheLrkvSeedTable) {
  const struct {
    int H, r;
    double percent;
  } rows[] = {{6, 46, 52.60}, {12, 51, 48.18}, {18, 55, 48.52}, {32, 54, 45.31}};
  for (const auto& row : rows) {
    const auto a = AttentionShape::parse("lrkv:H=" + std::to_string(row.H) + ",r=" + std::to_string(row.r) + ",d_h=128");
    EXPECT_NEAR(100 * a.cache_elements() / a.mha_cache_elements(), row.percent, 0.005) << a.describe();
  }
  // 2.5B: 4,608 -> 2,236 elements per token per layer.
  const auto big = AttentionShape::parse("lrkv:H=18,r=55,d_h=128");
  EXPECT_EQ(big.mha_cache_elements(), 4608);
  EXPECT_EQ(big.cache_elements(), 2236);
}

TEST(Cost, RankSweepAndMlaRows) {
  const struct {
    const char* spec;
    double percent;
  } rows[] = {{"lrkv:H=6,r=8,d_h=128", 22.9},   {"lrkv:H=6,r=16,d_h=128", 29.2},      {"lrkv:H=6,r=32,d_h=128", 41.7},
              {"lrkv:H=6,r=64,d_h=128", 66.7},  {"lrkv:H=6,r=128,d_h=128", 116.7},    {"mla:H=6,d_h=128,d_c=128,d_R=0", 8.3},
              {"mla:H=6,d_h=128,d_c=192,d_R=0", 12.5}, {"mla:H=6,d_h=128,d_c=384,d_R=0", 25.0}};
  for (const auto& row : rows) {
    const auto a = AttentionShape::parse(row.spec);
    EXPECT_NEAR(100 * a.cache_elements() / a.mha_cache_elements(), row.percent, 0.05) << row.spec;
  }
}

TEST(Cost, BytesAndParametersByHand) {
  const auto gqa = AttentionShape::parse("gqa:H=8,Hkv=2,d_h=64,d=512");
  EXPECT_EQ(gqa.cache_elements(), 2 * 2 * 64);
  EXPECT_EQ(gqa.cache_bytes(kernels::KVType::Q8), 2 * 2 * 2 * 34);  // 2 blocks of 34 bytes per row
  EXPECT_EQ(gqa.kv_params(), 2.0 * 512 * 2 * 64);
  const auto lrkv = AttentionShape::parse("lrkv:H=4,r=32,d_h=64,d=256");
  EXPECT_EQ(lrkv.cache_elements(), 2 * (64 + 4 * 32));
  EXPECT_EQ(lrkv.cache_bytes(kernels::KVType::BF16), 2 * 2 * (64 + 4 * 32));
  EXPECT_EQ(lrkv.cache_bytes(kernels::KVType::Q4), 2 * 2 * 18 + 2 * 4 * 18);  // K_s, V_s: 2 blocks; R: 1 block
  EXPECT_EQ(lrkv.kv_params(), 2.0 * 256 * 64 + 2.0 * 4 * 32 * (256 + 64));    // 2 d d_h + 2 H r (d + d_h)
  auto pair = lrkv;
  pair.rope = "pair_aligned";
  EXPECT_EQ(pair.kv_params(), lrkv.kv_params() - 4.0 * 32 * 64);  // B_h^K is fixed
  const auto r0 = AttentionShape::parse("lrkv:H=4,r=0,d_h=64");  // one shared K/V: MQA's cache
  EXPECT_EQ(r0.cache_elements(), AttentionShape::parse("mqa:H=4,d_h=64").cache_elements());
  const auto mla = AttentionShape::parse("mla:H=4,d_h=64,d_c=96,d_R=32,d=256");
  EXPECT_EQ(mla.cache_elements(), 96 + 32);
  EXPECT_EQ(mla.kv_params(), 256.0 * (96 + 32) + 2.0 * 4 * 96 * 64);
}

TEST(Cost, BadShapesNameTheProblem) {
  EXPECT_THROW(AttentionShape::parse("lrkv:H=6,r=200,d_h=128"), Error);  // rank above the head width
  EXPECT_THROW(AttentionShape::parse("gqa:H=6,Hkv=4,d_h=128"), Error);   // 4 does not divide 6
  EXPECT_THROW(AttentionShape::parse("gqa:H=6,d_h=128"), Error);         // gqa needs Hkv
  EXPECT_THROW(AttentionShape::parse("ssm:H=6"), Error);
  EXPECT_THROW(AttentionShape::parse("mha:H=6,dh=128"), Error);          // unknown key
  EXPECT_THROW(AttentionShape::parse("mha:H=six,d_h=128"), Error);
  EXPECT_THROW(AttentionShape::parse("lrkv:H=6,r=16,d_h=128,rope=bogus"), Error);  // unknown RoPE mode
  try {
    AttentionShape::parse("lrkv:H=6,r=200,d_h=128");
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("d_h = 128"), std::string::npos) << e.what();
  }
  EXPECT_THROW(AttentionShape::parse("mla:H=4,d_h=64,d_c=100").cache_bytes(kernels::KVType::Q8), Error);  // 100 % 32 != 0
  EXPECT_THROW(AttentionShape::parse("lrkv:H=18,r=55,d_h=128,rope=pair_aligned"), Error);  // half a RoPE plane
  EXPECT_THROW(AttentionShape::parse("mha:H=8,Hkv=2,d_h=64"), Error);  // an MHA with 2 KV heads is a gqa
  EXPECT_THROW(AttentionShape::parse("mqa:H=8,Hkv=4,d_h=64"), Error);
  EXPECT_EQ(AttentionShape::parse("mqa:H=8,Hkv=1,d_h=64").kv_heads, 1);
}

TEST(Cost, WhichCacheTypesAShapeDecodesFrom) {
  // expand rebuilds keys from an f32 cache; the compressed types are for the other two modes
  const auto expand = AttentionShape::parse("lrkv:H=16,r=32,d_h=128,rope=expand");
  EXPECT_TRUE(expand.decodes_from(kernels::KVType::F32));
  for (auto t : {kernels::KVType::BF16, kernels::KVType::Q8, kernels::KVType::Q4}) EXPECT_FALSE(expand.decodes_from(t));
  for (const char* mode : {"shared_rope", "pair_aligned"})
    for (auto t : {kernels::KVType::F32, kernels::KVType::BF16, kernels::KVType::Q8, kernels::KVType::Q4})
      EXPECT_TRUE(AttentionShape::parse(std::string("lrkv:H=16,r=32,d_h=128,rope=") + mode).decodes_from(t)) << mode;
  // q8/q4 rows are whole 32-blocks: H r = 6 x 46 is not, d_c = 100 is not
  EXPECT_FALSE(AttentionShape::parse("lrkv:H=6,r=46,d_h=128,rope=shared_rope").decodes_from(kernels::KVType::Q8));
  EXPECT_FALSE(AttentionShape::parse("mla:H=4,d_h=64,d_c=100").decodes_from(kernels::KVType::Q4));
  EXPECT_TRUE(AttentionShape::parse("mla:H=4,d_h=64,d_c=96,d_R=32").decodes_from(kernels::KVType::Q8));
}

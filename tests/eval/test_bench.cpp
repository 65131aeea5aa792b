// Whole-model decode speed runs for every mixer family and cache kind (random history).
#include <gtest/gtest.h>

#include <cmath>

#include "eval/bench.h"

using namespace kvx;

TEST(DecodeSpeed, EveryFamilyCanBeFilledAndTimed) {
  model::ModelConfig c;
  c.vocab_size = 50;
  c.hidden_size = 32;
  c.num_hidden_layers = 3;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 32;
  c.intermediate_size = 48;
  c.max_position_embeddings = 64;
  c.lrkv_rank = 32;
  c.kv_lora_rank = 48;
  c.qk_rope_head_dim = 16;
  for (const char* rope : {"expand", "pair_aligned"}) {
    c.layout = "dense,lrkv,mla";
    c.lrkv_rope = rope;
    for (const char* type : {"f32", "q8"}) {
      if (std::string(rope) == "expand" && std::string(type) != "f32") continue;  // expand decodes on the f32 reference cache
      const double tps = eval::decode_tokens_per_second(c, attention::CacheOptions::parse(type, "", false), 200, 0.01);
      EXPECT_TRUE(std::isfinite(tps) && tps > 0) << rope << " " << type;
    }
  }
  c.layout = "gdn,natsl,dense";
  c.linear_num_heads = 2;
  c.nats_attention_heads = 4;
  c.linear_key_head_dim = c.linear_value_head_dim = 64;
  c.nats_block_size = 16;
  for (const char* type : {"f32", "q8"}) {
    const double tps = eval::decode_tokens_per_second(c, attention::CacheOptions::parse(type, "", false), 200, 0.01);
    EXPECT_TRUE(std::isfinite(tps) && tps > 0) << "gdn/natsl " << type;
  }
}

TEST(DecodeBench, GdnAndNatslRowsAreMeasuredBesideTheDenseKernel) {
  eval::DecodeBenchOptions o;
  o.contexts = {256, 512};
  o.types = {"f32"};
  o.kv_heads = {4};
  o.heads = 4;
  o.head_dim = 32;
  o.lrkv_ranks = {};
  o.natsl_kept = {0.5};
  o.seconds_per_point = 0.01;
  o.whole_model = false;
  const auto rows = eval::bench_decode(o, false);
  int gdn = 0, natsl = 0;
  for (const auto& r : rows) {
    if (r.value("family", "") == "gdn") {
      ++gdn;
      EXPECT_GT(r["us_per_step"].get<double>(), 0);
      EXPECT_EQ(r["state_bytes"].get<int64_t>(), 4 * (2 * 64 * 64 + 3 * 2 * (3 * 64)));  // H = 2 heads of 64 x 64
    }
    if (r.value("family", "") == "natsl") {
      ++natsl;
      EXPECT_DOUBLE_EQ(r["kept_fraction"].get<double>(), 0.5);
      EXPECT_GT(r["speedup_vs_dense"].get<double>(), 0);  // the dense MHA kernel at the same shape was timed
      EXPECT_DOUBLE_EQ(r["target_speedup_vs_dense"].get<double>(), 1.6);
    }
  }
  EXPECT_EQ(gdn, 2);
  EXPECT_EQ(natsl, 2);
}

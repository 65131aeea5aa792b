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
}

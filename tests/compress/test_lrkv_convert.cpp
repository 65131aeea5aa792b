// Dense -> LRKV conversion: exact at full rank (expand, pair_aligned), the shared projection is
// the head mean, lower ranks approximate, GQA sources, and bad requests are clear errors.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "attention/dense.h"
#include "attention/lrkv.h"
#include "compress/lrkv_convert.h"
#include "util/error.h"

using namespace kvx;

namespace {
model::ModelConfig dense_config(int heads, int kv_heads) {
  model::ModelConfig c;
  c.vocab_size = 30;
  c.hidden_size = 24;
  c.num_hidden_layers = 2;
  c.num_attention_heads = heads;
  c.num_key_value_heads = kv_heads;
  c.head_dim = 8;
  c.intermediate_size = 32;
  c.max_position_embeddings = 32;
  c.layout = "dense*2";
  return c;
}

double rel_diff(const torch::Tensor& a, const torch::Tensor& b) { return ((a - b).abs().max() / b.abs().max()).item<double>(); }
}  // namespace

TEST(LrkvConvert, FullRankIsExactAndLowerRanksApproximate) {
  torch::manual_seed(1);
  model::Transformer dense(dense_config(4, 4));
  dense->to(torch::kFloat64);
  auto ids = torch::randint(30, {2, 12}, torch::kLong);
  torch::NoGradGuard ng;
  auto ref = dense->forward(ids);
  for (const char* rope : {"expand", "pair_aligned"}) {
    auto full = compress::convert_to_lrkv(dense, {8, rope});
    full->to(torch::kFloat64);
    EXPECT_LT(rel_diff(full->forward(ids), ref), 1e-5) << rope;  // float32 factors, float64 forward
    EXPECT_EQ(full->config().layout, "lrkv,lrkv");
  }
  double previous = 1e9;
  for (int r : {0, 2, 4, 6}) {  // error falls as the rank grows
    auto conv = compress::convert_to_lrkv(dense, {r, "expand"});
    conv->to(torch::kFloat64);
    const double err = rel_diff(conv->forward(ids), ref);
    EXPECT_LT(err, previous + 1e-12) << "rank " << r;
    previous = err;
  }
  // The shared projection is the mean of the heads' key projections.
  auto conv = compress::convert_to_lrkv(dense, {2, "shared_rope"});
  auto* l0 = dynamic_cast<attention::LrkvAttention*>(conv->layers[0]->as<model::BlockImpl>()->self_attn.get());
  auto* d0 = dynamic_cast<attention::DenseAttention*>(dense->layers[0]->as<model::BlockImpl>()->self_attn.get());
  auto mean = d0->k_proj->weight.view({4, 8, 24}).mean(0).to(torch::kFloat32);
  EXPECT_TRUE(torch::allclose(l0->k_shared_proj->weight, mean, 1e-6, 1e-6));
}

TEST(LrkvConvert, GqaSourcesExpandTheirKvHeads) {
  torch::manual_seed(2);
  model::Transformer dense(dense_config(4, 2));
  dense->to(torch::kFloat64);
  auto conv = compress::convert_to_lrkv(dense, {8, "expand"});
  conv->to(torch::kFloat64);
  auto ids = torch::randint(30, {1, 9}, torch::kLong);
  torch::NoGradGuard ng;
  EXPECT_LT(rel_diff(conv->forward(ids), dense->forward(ids)), 1e-5);
}

TEST(LrkvConvert, AConversionThatGrowsTheCacheIsWarnedAbout) {
  // MHA H=4 d_h=8 caches 64 a token and layer; LRKV 2 (8 + 4 r): smaller at every rank below 8.
  const auto mha = dense_config(4, 4);
  EXPECT_EQ(compress::cache_growth_warning(mha, compress::lrkv_config_for(mha, {4, "expand"})), "");
  // GQA Hkv=2 caches 32: LRKV at r=4 caches 48 (150%); r <= (Hkv-1) d_h / H = 2 keeps it no larger.
  const auto gqa = dense_config(4, 2);
  const std::string w = compress::cache_growth_warning(gqa, compress::lrkv_config_for(gqa, {4, "expand"}));
  EXPECT_NE(w.find("caches 150.0% of the source's KV"), std::string::npos) << w;
  EXPECT_NE(w.find("ranks up to 2 keep it no larger"), std::string::npos) << w;
  EXPECT_EQ(compress::cache_growth_warning(gqa, compress::lrkv_config_for(gqa, {2, "expand"})), "");
  // MQA: LRKV's shared K/V alone is the source's whole cache.
  const auto mqa = dense_config(4, 1);
  EXPECT_NE(compress::cache_growth_warning(mqa, compress::lrkv_config_for(mqa, {2, "expand"})).find("only rank 0"),
            std::string::npos);
  EXPECT_EQ(compress::cache_growth_warning(mqa, compress::lrkv_config_for(mqa, {0, "expand"})), "");
}

TEST(LrkvConvert, BadRequestsAreClearErrors) {
  model::Transformer dense(dense_config(4, 4));
  EXPECT_THROW(compress::convert_to_lrkv(dense, {9, "expand"}), Error);       // rank above d_h = 8
  EXPECT_THROW(compress::convert_to_lrkv(dense, {3, "pair_aligned"}), Error); // odd rank for whole planes
  EXPECT_THROW(compress::convert_to_lrkv(dense, {4, "full"}), Error);         // unknown mode
  auto qk = dense_config(4, 4);
  qk.qk_norm = true;  // per-head key norms have no place in LRKV's shared keys
  try {
    compress::lrkv_config_for(qk, {4, "expand"});
    ADD_FAILURE() << "a qk_norm model was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("qk_norm"), std::string::npos) << e.what();
  }
}

// LLA codec (SPEC 1.3): capture of pre-RoPE K/V across loops, SVD initialisation (exact at full
// rank, the optimal rank-r error below it), the seed's budget -> ranks example, save/load with a
// teacher check, and the errors for ranks and teachers that cannot work.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>

#include "attention/dense.h"
#include "compress/lla_codec.h"
#include "support/fixtures.h"
#include "util/error.h"

using namespace kvx;

namespace {

model::ModelConfig looped_config(int loops, int kv_heads) {
  auto c = kvx::testing::mixer_config(4, kv_heads, 8, 24);
  c.num_hidden_layers = 2;
  c.loops = loops;
  c.sandwich_norm = true;
  c.vocab_size = 37;
  c.validate();
  return c;
}

std::vector<torch::Tensor> windows(int count, int64_t length, uint64_t seed) {
  torch::manual_seed(seed);
  std::vector<torch::Tensor> w;
  for (int i = 0; i < count; ++i) w.push_back(torch::randint(37, {2, length}, torch::kLong));
  return w;
}

}  // namespace

TEST(LlaCodec, CaptureStacksEachLoopsPreRopeKeysAndValues) {
  const auto c = looped_config(3, 2);
  torch::manual_seed(1);
  model::Transformer m(c);
  const auto w = windows(1, 9, 2);
  const auto kv = compress::capture_stacked_kv(m, w, "head");
  ASSERT_EQ(kv.keys.size(), 2u);
  EXPECT_EQ(kv.keys[0].sizes(), torch::IntArrayRef({18, 2, 3 * 8}));  // N = 2 x 9 tokens, Hkv = 2, T d_h
  // Loop 0 of layer 0 is k_proj of the normed embedding (before RoPE).
  torch::NoGradGuard ng;
  auto* block = m->layers[0]->as<model::BlockImpl>();
  auto* dense = dynamic_cast<attention::DenseAttention*>(block->self_attn.get());
  const auto k0 = dense->k_proj(block->input_layernorm(m->embed_tokens(w[0]))).view({18, 2, 8});
  EXPECT_TRUE(torch::allclose(kv.keys[0].narrow(2, 0, 8), k0, 1e-6, 1e-6));
  const auto kv2d = compress::capture_stacked_kv(m, w, "2d");
  EXPECT_EQ(kv2d.values[1].sizes(), torch::IntArrayRef({18, 1, 2 * 3 * 8}));
}

TEST(LlaCodec, FullRankIsExactAndLowerRanksHitTheSvdOptimum) {
  const auto c = looped_config(2, 2);
  torch::manual_seed(3);
  model::Transformer m(c);
  const auto kv = compress::capture_stacked_kv(m, windows(2, 13, 4), "head");  // N = 52 >= W = 16
  const auto full = compress::LlaCodec::fit_svd(compress::LlaShape::of_teacher(c, "head", 16, 16), kv.keys, kv.values);
  for (auto [ek, ev] : compress::reconstruction_error(full, kv)) {
    EXPECT_LT(ek, 1e-10);
    EXPECT_LT(ev, 1e-10);
  }
  const auto low = compress::LlaCodec::fit_svd(compress::LlaShape::of_teacher(c, "head", 3, 5), kv.keys, kv.values);
  const auto err = compress::reconstruction_error(low, kv);
  for (int l = 0; l < 2; ++l) {
    // The discarded singular values' share of the centred energy, summed over the KV heads.
    auto expected = [&](const torch::Tensor& x, int r) {
      double kept = 0, total = 0;
      for (int64_t g = 0; g < x.size(1); ++g) {
        auto xg = x.select(1, g).to(torch::kDouble);
        auto s = torch::linalg_svdvals(xg - xg.mean(0)).pow(2);
        total += s.sum().item<double>();
        kept += s.narrow(0, 0, r).sum().item<double>();
      }
      return (total - kept) / total;
    };
    EXPECT_NEAR(err[l].first, expected(kv.keys[l], 3), 1e-5);
    EXPECT_NEAR(err[l].second, expected(kv.values[l], 5), 1e-5);
    EXPECT_GT(err[l].first, 0.0);
  }
  EXPECT_DOUBLE_EQ(low.shape.compression(), 2.0 * 16 / 8);
}

TEST(LlaCodec, BudgetPicksTheSeedsRanks) {
  auto c = looped_config(4, 2);
  c.head_dim = 128;  // Ouro-1.4B: T = 4, d_h = 128, 4x -> (96, 160)
  EXPECT_EQ(compress::ranks_for_budget("4x", "head", c), std::make_pair(96, 160));
  const auto s = compress::LlaShape::of_teacher(c, "head", 96, 160);
  EXPECT_DOUBLE_EQ(s.compression(), 4.0);
  EXPECT_DOUBLE_EQ(s.teacher_bytes_per_token() / s.bytes_per_token(), 4.0);
  EXPECT_THROW(compress::ranks_for_budget("0.5x", "head", c), Error);
  EXPECT_THROW(compress::ranks_for_budget("fast", "head", c), Error);
}

TEST(LlaCodec, SavedCodecLoadsOnlyForItsTeacher) {
  const auto c = looped_config(2, 2);
  torch::manual_seed(5);
  model::Transformer m(c);
  const auto kv = compress::capture_stacked_kv(m, windows(2, 13, 6), "2d");
  const auto codec = compress::LlaCodec::fit_svd(compress::LlaShape::of_teacher(c, "2d", 6, 10), kv.keys, kv.values);
  const std::string dir = kvx::testing::temp_dir("lla_codec");
  codec.save(dir);
  const auto back = compress::LlaCodec::load(dir, c);
  EXPECT_TRUE(torch::equal(back.values[1].up, codec.values[1].up));
  EXPECT_EQ(back.shape.to_json(), codec.shape.to_json());
  auto other = c;
  other.num_key_value_heads = 1;
  try {
    compress::LlaCodec::load(dir, other);
    FAIL() << "a codec loaded for another teacher";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("fitted for another model"), std::string::npos) << e.what();
  }
  std::filesystem::remove_all(dir);
}

TEST(LlaCodec, RanksAndTeachersThatCannotWorkAreRefused) {
  const auto c = looped_config(2, 2);
  auto expect_error = [](const std::function<void()>& f, const std::string& needle) {
    try {
      f();
      FAIL() << "accepted: " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error([&] { compress::LlaShape::of_teacher(c, "head", 17, 4); }, "must be in [1, 16]");
  expect_error([&] { compress::LlaShape::of_teacher(c, "head", 0, 4); }, "r_k = 0 must be in");
  expect_error([&] { compress::LlaShape::of_teacher(c, "3d", 4, 4); }, "is not one of head");
  auto flat = c;
  flat.loops = 1;
  expect_error([&] { compress::LlaShape::of_teacher(flat, "head", 4, 4); }, "is not looped");
  auto mixed = c;
  mixed.layout = "dense,mla";
  expect_error([&] { compress::LlaShape::of_teacher(mixed, "head", 4, 4); }, "compresses dense");
}

// LRKV factored decode kernel against its double-precision reference over the same stores:
// element types, head counts, odd widths and lengths, r = 0, page and split boundaries,
// threads and eviction.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/lrkv_decode.h"
#include "support/value_weights.h"
#include "util/error.h"

using namespace kvx;
using namespace kvx::kernels;

namespace {

std::vector<float> randn(size_t n, float sd, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.0f, sd);
  std::vector<float> x(n);
  for (auto& v : x) v = nd(rng);
  return x;
}

double worst_rel(const std::vector<float>& a, const std::vector<float>& b, int rows, int w) {
  double worst = 0;
  for (int h = 0; h < rows; ++h) {
    double diff = 0, mag = 1e-30;
    for (int i = 0; i < w; ++i) {
      diff = std::max(diff, std::fabs(static_cast<double>(a[h * w + i]) - b[h * w + i]));
      mag = std::max(mag, std::fabs(static_cast<double>(b[h * w + i])));
    }
    worst = std::max(worst, diff / mag);
  }
  return worst;
}

void check(KVType type, int H, int d, int r, int64_t L, int page, Eviction evict, uint32_t seed,
           KVLayout layout = KVLayout::Rows) {  // layout: K_s / V_s's (the latents stay Rows)
  const std::string what = kv_type_name(type) + " H" + std::to_string(H) + " d" + std::to_string(d) + " r" + std::to_string(r) +
                           " L" + std::to_string(L) + " P" + std::to_string(page) + (evict.enabled() ? " evict" : "") + " " +
                           kv_layout_name(layout);
  std::mt19937 rng(seed);
  KVStore shared(type, 1, d, evict, page, false, layout), shared_abs(type, 1, d, evict, page, false, layout);  // shared_abs: |V_s|
  std::unique_ptr<KVStore> residual = r > 0 ? std::make_unique<KVStore>(type, 1, H * r, evict, page) : nullptr;
  std::unique_ptr<KVStore> residual_abs = r > 0 ? std::make_unique<KVStore>(type, 1, H * r, evict, page) : nullptr;  // |R^V|
  for (int64_t t = 0; t < L; ++t) {
    auto k = randn(d, 1.0f, rng), v = randn(d, 1.0f, rng);
    shared.append(k.data(), v.data());
    for (auto& x : v) x = std::fabs(x);
    shared_abs.append(k.data(), v.data());
    if (residual) {
      auto rk = randn(static_cast<size_t>(H) * r, 1.0f, rng), rv = randn(static_cast<size_t>(H) * r, 1.0f, rng);
      residual->append(rk.data(), rv.data());
      for (auto& x : rv) x = std::fabs(x);
      residual_abs->append(rk.data(), rv.data());
    }
  }
  const auto q = randn(static_cast<size_t>(H) * d, 2.0f, rng), qb = randn(static_cast<size_t>(H) * std::max(r, 1), 2.0f, rng);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  std::vector<float> ref_s(H * d), ref_r(H * std::max(r, 1)), out_s(ref_s.size()), out_r(ref_r.size()), abs_s(ref_s.size()),
      abs_r(ref_r.size());
  // out_s and out_r against the reference: to 1e-5, or within the bf16 rounding of the weights where the kernel rounds them
  std::vector<float> largest(H);
  auto check_outputs = [&](DecodeIsa isa, const std::string& where) {
    if (decode_weighs_values_in_int16(isa, type)) {  // V_s weighed in integers; the latents in f32
      lrkv_decode_attention_reference(q.data(), qb.data(), H, shared, residual.get(), scale, ref_s.data(), ref_r.data(),
                                      lrkv_decode_rounds_query(isa, type, d, r), largest.data());
      EXPECT_LE(kvx::testing::worst_over_int16_weights(out_s, ref_s, largest, shared, H), 1.0) << where << " (15-bit V_s weights)";
      if (r > 0) EXPECT_LE(worst_rel(out_r, ref_r, H, r), 1e-5) << where;
      return;
    }
    if (!lrkv_rounds_value_weights(isa, type)) {
      EXPECT_LE(worst_rel(out_s, ref_s, H, d), 1e-5) << where;
      if (r > 0) EXPECT_LE(worst_rel(out_r, ref_r, H, r), 1e-5) << where;
      return;
    }
    lrkv_decode_attention_reference(q.data(), qb.data(), H, shared_abs, residual_abs.get(), scale, abs_s.data(), abs_r.data(),
                                    lrkv_decode_rounds_query(isa, type, d, r));
    EXPECT_LE(kvx::testing::worst_over_rounding(out_s, ref_s, abs_s, H, d), 1.0) << where << " (weights rounded to bf16)";
    if (r > 0) EXPECT_LE(kvx::testing::worst_over_rounding(out_r, ref_r, abs_r, H, r), 1.0) << where << " (latent weights rounded to bf16)";
  };
  std::vector<DecodeIsa> isas = {DecodeIsa::Avx2};
  if (lrkv_decode_isa(DecodeIsa::Auto, type, d, r) == DecodeIsa::Avx512) isas.push_back(DecodeIsa::Avx512);
  for (DecodeIsa isa : isas)
  for (auto [threads, splits] : std::vector<std::pair<int, int>>{{1, 1}, {1, 3}, {2, 2}, {2, 5}}) {
    lrkv_decode_attention_reference(q.data(), qb.data(), H, shared, residual.get(), scale, ref_s.data(), ref_r.data(),
                                    lrkv_decode_rounds_query(isa, type, d, r));
    std::fill(out_s.begin(), out_s.end(), NAN);
    std::fill(out_r.begin(), out_r.end(), NAN);
    lrkv_decode_attention_splits(q.data(), qb.data(), H, shared, residual.get(), scale, out_s.data(), out_r.data(), threads,
                                 splits, isa);
    const std::string where = what + " " + decode_isa_name(isa) + " threads " + std::to_string(threads) + " splits " + std::to_string(splits);
    check_outputs(isa, where);
  }
  lrkv_decode_attention_reference(q.data(), qb.data(), H, shared, residual.get(), scale, ref_s.data(), ref_r.data(),
                                  lrkv_decode_rounds_query(DecodeIsa::Auto, type, d, r));
  lrkv_decode_attention(q.data(), qb.data(), H, shared, residual.get(), scale, out_s.data(), out_r.data(), 0);
  check_outputs(lrkv_decode_isa(DecodeIsa::Auto, type, d, r), what);
  for (DecodeIsa isa : isas) {  // the model's call (its own threads and splits) on each back end
    lrkv_decode_attention_reference(q.data(), qb.data(), H, shared, residual.get(), scale, ref_s.data(), ref_r.data(),
                                    lrkv_decode_rounds_query(isa, type, d, r));
    std::fill(out_s.begin(), out_s.end(), NAN);
    lrkv_decode_attention(q.data(), qb.data(), H, shared, residual.get(), scale, out_s.data(), out_r.data(), 2, isa);
    check_outputs(isa, what + " " + decode_isa_name(isa) + " lrkv_decode_attention");
  }
}

}  // namespace

TEST(LrkvDecode, MatchesReferenceForEveryTypeAndShape) {
  uint32_t seed = 10;
  for (KVType t : {KVType::F32, KVType::BF16})
    for (int H : {1, 3, 6})
      for (auto [d, r] : std::vector<std::pair<int, int>>{{32, 0}, {40, 5}, {32, 8}, {64, 12}, {64, 24}, {128, 32}, {96, 40}})
        for (int64_t L : {1, 7, 33, 70}) check(t, H, d, r, L, 16, {}, seed++);
  // H r a multiple of 64: the latent values by whole rows (bf16 at r % 16 == 0 or r = 8; r = 24 not),
  // gcd(r / 8, 8) = 1, 2, 4, 8 vectors of a row to a weight
  for (KVType t : {KVType::F32, KVType::BF16})
    for (auto [d, r] : std::vector<std::pair<int, int>>{{32, 8}, {64, 16}, {64, 24}, {128, 32}, {96, 48}, {128, 64}})
      for (int64_t L : {1, 7, 33, 70}) check(t, 8, d, r, L, 16, {}, seed++);
  // H r a multiple of 64 with r not a multiple of 8 (vectors straddle heads): heads' blocks
  for (KVType t : {KVType::F32, KVType::BF16, KVType::Q8, KVType::Q4}) check(t, 16, 64, 12, 45, 16, {}, seed++);
  for (KVType t : {KVType::Q8, KVType::Q4})
    for (int H : {1, 5})
      for (auto [d, r] : std::vector<std::pair<int, int>>{{32, 0}, {64, 32}, {128, 64}})
        for (int64_t L : {1, 33, 70}) check(t, H, d, r, L, 16, {}, seed++);
  for (KVType t : {KVType::Q8, KVType::Q4}) {
    check(t, 16, 128, 32, 45, 16, {}, seed++);  // the bench shape: 16 latent blocks, one 32-byte scale transpose
    check(t, 6, 256, 96, 37, 16, {}, seed++);   // 18 latent blocks (two scale transposes), 8 blocks of K_s/V_s
    check(t, 16, 128, 8, 45, 16, {}, seed++);   // r = 8: a block holds 4 heads' latents
  }
  // q8/q4 blocks that straddle heads (r % 32 != 0): scored in integers per head segment where
  // segments are whole row words (q8 r % 4 == 0, q4 r % 8 == 0), else from dequantised columns
  // (AVX-512) or rows (AVX2); AVX2 weighs the values from the codes as stored where r % 8 == 0;
  // r > 32, H > 16, heads not a multiple of 16, 32-row tiles (page 64), eviction.
  for (KVType t : {KVType::Q8, KVType::Q4}) {
    check(t, 16, 64, 6, 70, 64, {}, seed++);   // columns (q8 and q4)
    check(t, 16, 64, 34, 70, 64, {}, seed++);  // r > 32, columns
    check(t, 8, 64, 36, 70, 64, {}, seed++);   // q8 words, q4 columns
    check(t, 24, 32, 4, 70, 64, {}, seed++);   // q8 words, q4 columns; H not a multiple of 16
    check(t, 32, 32, 3, 70, 64, {}, seed++);   // columns, 32 heads
    check(t, 32, 32, 1, 70, 64, {}, seed++);   // a block spans 32 heads
    check(t, 12, 64, 16, 70, 64, {}, seed++);  // words (q8 and q4)
    check(t, 16, 64, 6, 90, 16, {4, 28}, seed++);   // columns with eviction
    check(t, 16, 64, 8, 90, 16, {4, 28}, seed++);   // words with eviction
  }
  // f32/bf16 latents of r % 32 != 0 (flat rows): the bench shape in 32-row tiles (bf16), more than
  // 16 heads, a latent row that ends mid-vector, eviction.
  for (KVType t : {KVType::F32, KVType::BF16}) {
    check(t, 16, 128, 8, 70, 64, {}, seed++);
    check(t, 20, 64, 6, 70, 64, {}, seed++);
    check(t, 33, 32, 3, 45, 16, {4, 20}, seed++);
  }
  // q8/q4 head segments of whole words across block boundaries (values from the codes on AVX2)
  for (KVType t : {KVType::Q8, KVType::Q4}) {
    check(t, 16, 64, 24, 70, 64, {}, seed++);  // head 1's segment in blocks 0 and 1
    check(t, 8, 64, 40, 37, 64, {}, seed++);   // r > 32
  }
}

// AVX-512 scores with heads in lanes (f32, and bf16 with vdpbf16ps, at 8 to 16 heads with latents
// of up to 8 words a head, f32 also 16, 32 and 64, bf16 16 and 32): the ranks of 2 or more words (r = 1 can cancel to near
// zero, below 1e-5 of f32 rounding), with neighbours that keep the score blocks (r = 6), heads
// below 16, r = 0, tiles of 8 (1 KB rows) and 32 rows, a tile's last 1-8 rows, pages and
// eviction.
TEST(LrkvDecode, HeadsInLanesMatchReference) {
  // bench decode's roofline charges these latents at the bf16 dot-product peak
  const bool dots = decode_dots_bf16(DecodeIsa::Avx512);
  EXPECT_EQ(lrkv_latent_scores_in_bf16(DecodeIsa::Avx512, KVType::BF16, 16, 8), dots);
  EXPECT_EQ(lrkv_latent_scores_in_bf16(DecodeIsa::Avx512, KVType::BF16, 16, 32), dots);
  EXPECT_FALSE(lrkv_latent_scores_in_bf16(DecodeIsa::Avx512, KVType::BF16, 16, 24));  // widened
  EXPECT_FALSE(lrkv_latent_scores_in_bf16(DecodeIsa::Avx2, KVType::BF16, 16, 8));
  EXPECT_FALSE(lrkv_latent_scores_in_bf16(DecodeIsa::Avx512, KVType::F32, 16, 8));
  // and V_s's weights rounded to bf16 (check() then holds out_s to that rounding's bound)
  EXPECT_EQ(lrkv_rounds_value_weights(DecodeIsa::Avx512, KVType::BF16), dots);
  EXPECT_FALSE(lrkv_rounds_value_weights(DecodeIsa::Avx512, KVType::F32));
  EXPECT_FALSE(lrkv_rounds_value_weights(DecodeIsa::Avx512, KVType::Q8));
  EXPECT_FALSE(lrkv_rounds_value_weights(DecodeIsa::Avx2, KVType::BF16));
  uint32_t seed = 700;
  for (KVType t : {KVType::F32, KVType::BF16})
    for (int H : {8, 11, 16})
      for (int r : {0, 2, 4, 6, 8, 16})
        for (int64_t L : {1, 19, 70}) check(t, H, 64, r, L, 32, {}, seed++);
  for (KVType t : {KVType::F32, KVType::BF16}) {
    check(t, 16, 128, 8, 203, 64, {}, seed++);
    check(t, 16, 96, 4, 150, 40, {3, 60}, seed++);
    check(t, 9, 32, 2, 77, 16, {2, 25}, seed++);
  }
  // f32 latents of 16, 32 and 64 words a head (rows under 2 KB: 32-row tiles; H = 16 r = 32: 16; 64: 8)
  check(KVType::F32, 16, 128, 16, 203, 64, {}, seed++);
  check(KVType::F32, 12, 64, 16, 150, 40, {3, 60}, seed++);
  check(KVType::F32, 16, 128, 32, 203, 64, {}, seed++);
  check(KVType::F32, 9, 64, 32, 150, 40, {3, 60}, seed++);
  check(KVType::F32, 16, 128, 64, 90, 64, {}, seed++);  // 8-row tiles
  check(KVType::F32, 11, 32, 64, 77, 16, {2, 25}, seed++);
  // r = 8 at H = 16, d_h = 128 (8-row tiles, each stream fetched rows ahead): short pages, eviction
  check(KVType::F32, 16, 128, 8, 171, 24, {3, 60}, seed++);
  // bf16 latents of 16 and 32 pair words a head (r = 32, 64: 16- or 32-row tiles, whose latent values
  // take the numerators' pair words transposed to heads)
  check(KVType::BF16, 16, 128, 32, 203, 64, {}, seed++);
  check(KVType::BF16, 9, 64, 32, 150, 40, {3, 60}, seed++);
  check(KVType::BF16, 16, 128, 64, 139, 256, {}, seed++);
  check(KVType::BF16, 11, 64, 64, 77, 16, {2, 25}, seed++);
}

// Random shapes (seeded): head counts, widths and ranks the lists above do not name, short
// pages, eviction. q8/q4 need d_h and H r multiples of 32 (their blocks).
TEST(LrkvDecode, RandomShapesMatchReference) {
  std::mt19937 rng(2026);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  const KVType types[] = {KVType::F32, KVType::BF16, KVType::Q8, KVType::Q4};
  for (int i = 0; i < 150; ++i) {
    const KVType t = types[i % 4];
    const bool quant = t == KVType::Q8 || t == KVType::Q4;
    const int H = pick(1, 20), d = quant ? 32 * pick(1, 5) : pick(1, 160);
    // r >= 4: a latent of 1-3 values can cancel to near zero, where 1e-5 of it is below f32
    // rounding (r = 5 and 8 are among the fixed cases)
    int r = pick(0, 3) == 0 || d < 4 ? 0 : pick(4, d);
    if (quant && r > 0)  // H r a multiple of 32
      while ((H * r) % 32 != 0) r = r < d ? r + 1 : 4;
    const int64_t L = pick(1, 300);
    const int page = pick(1, 4) == 1 ? pick(1, 20) : pick(21, 300);
    Eviction evict;
    if (pick(0, 4) == 0) evict = {pick(0, 8), pick(1, 64)};
    check(t, H, d, r, L, page, evict, 9000 + i);
  }
}

TEST(LrkvDecode, LongContextsAndEviction) {
  check(KVType::F32, 8, 128, 32, 600, 256, {}, 50);
  // bf16 rows of 1-1.25 KB with pair values and score blocks (r = 24 at 16 heads, 20 heads): 64-row
  // tiles on AVX-512, whose softmax rescales the latents' accumulators too when a head's maximum
  // rises; r = 32 at 16 heads takes heads in lanes, 64 rows too
  check(KVType::BF16, 16, 128, 32, 333, 256, {}, 54);
  check(KVType::BF16, 20, 128, 24, 333, 256, {}, 55);
  check(KVType::BF16, 16, 128, 24, 290, 128, {}, 56);
  check(KVType::BF16, 12, 128, 40, 200, 256, {5, 150}, 57);
  check(KVType::F32, 16, 128, 16, 333, 256, {}, 58);  // f32 rows of 1.5-2 KB: 16-row tiles on AVX-512
  check(KVType::Q8, 4, 64, 32, 515, 100, {}, 51);
  check(KVType::BF16, 3, 64, 16, 300, 32, {4, 37}, 52);  // sink + window in both stores
  check(KVType::Q4, 16, 128, 32, 515, 100, {4, 200}, 53);  // integer scores across pages and eviction
  // q8/q4 latents that straddle heads, or r = 32 or 64, at 9-16 heads (AVX-512: softmax and V weight codes
  // with heads in lanes, int_weights_by_token): pages that end tiles at odd rows, groups of 8 + 2 and
  // 8 + 4 + 2 heads, eviction
  for (KVType t : {KVType::Q8, KVType::Q4}) {
    const uint32_t seed = t == KVType::Q8 ? 59 : 159;
    check(t, 16, 128, 8, 515, 100, {}, seed);
    check(t, 10, 64, 16, 301, 45, {3, 120}, seed + 1);
    check(t, 14, 96, 16, 77, 33, {}, seed + 2);
    check(t, 16, 128, 32, 515, 100, {}, seed + 3);  // r = 32: latent weights by token too
    check(t, 12, 64, 32, 301, 45, {3, 120}, seed + 4);
    check(t, 16, 128, 64, 301, 100, {}, seed + 5);  // r = 64: two latent blocks a head, 16-row tiles
    check(t, 10, 64, 64, 77, 33, {2, 40}, seed + 6);
  }
}

// K_s / V_s in the Tiled16 layout (decode_kv_layout's q8 and q4 choice on AVX-512): latents of every
// kind (none, straddling heads, r = 32, 64), odd pages, eviction, both back ends.
TEST(LrkvDecode, Tiled16SharedStoreMatchesReference) {
  uint32_t seed = 700;
  for (KVType t : {KVType::Q8, KVType::Q4}) {
    for (auto [H, d, r, L, page] : std::vector<std::tuple<int, int, int, int64_t, int>>{
             {1, 32, 0, 33, 16}, {5, 64, 32, 70, 16}, {16, 128, 8, 515, 256}, {16, 128, 12, 45, 16}, {14, 96, 16, 77, 16},
             {16, 128, 32, 300, 32}, {16, 128, 64, 301, 256}, {6, 256, 96, 37, 48}})
      check(t, H, d, r, L, page, {}, seed++, KVLayout::Tiled16);
    check(t, 10, 64, 16, 301, 48, {3, 120}, seed++, KVLayout::Tiled16);
    check(t, 16, 128, 32, 200, 64, {5, 100}, seed++, KVLayout::Tiled16);
  }
}

TEST(LrkvDecode, MismatchedStoresAreClearErrors) {
  KVStore shared(KVType::F32, 1, 32), residual(KVType::F32, 1, 3 * 8), wrong(KVType::F32, 2, 32);
  std::vector<float> q(3 * 32, 0.1f), qb(3 * 8, 0.1f), os(3 * 32), orr(3 * 8), k(3 * 8, 0.5f), ks(32, 0.5f);
  EXPECT_THROW(lrkv_decode_attention(q.data(), qb.data(), 3, shared, &residual, 1.0f, os.data(), orr.data(), 1), Error);  // empty
  shared.append(ks.data(), ks.data());
  EXPECT_THROW(lrkv_decode_attention(q.data(), qb.data(), 3, shared, &residual, 1.0f, os.data(), orr.data(), 1), Error);  // slots differ
  residual.append(k.data(), k.data());
  lrkv_decode_attention(q.data(), qb.data(), 3, shared, &residual, 1.0f, os.data(), orr.data(), 1);
  EXPECT_NEAR(os[0], 0.5f, 1e-6);
  EXPECT_THROW(lrkv_decode_attention(q.data(), qb.data(), 3, wrong, &residual, 1.0f, os.data(), orr.data(), 1), Error);  // 2 shared heads
  EXPECT_THROW(lrkv_decode_attention(q.data(), qb.data(), 5, shared, &residual, 1.0f, os.data(), orr.data(), 1), Error);  // 24 % 5 != 0
  KVStore bf16_residual(KVType::BF16, 1, 3 * 8);
  bf16_residual.append(k.data(), k.data());
  try {
    lrkv_decode_attention(q.data(), qb.data(), 3, shared, &bf16_residual, 1.0f, os.data(), orr.data(), 1);
    ADD_FAILURE() << "an f32 shared store with a bf16 residual was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("different cache types"), std::string::npos) << e.what();
  }
  // Layouts LRKV decode does not read: a bf16 Tiled16 K_s, a Tiled16 residual.
  KVStore tiled_shared(KVType::BF16, 1, 32, {}, 16, false, KVLayout::Tiled16), tiled_residual(KVType::Q8, 1, 3 * 32, {}, 16, false, KVLayout::Tiled16),
      q8_shared(KVType::Q8, 1, 32, {}, 16, false, KVLayout::Tiled16);
  std::vector<float> wide(3 * 32, 0.5f);
  tiled_shared.append(ks.data(), ks.data());
  tiled_residual.append(wide.data(), wide.data());
  q8_shared.append(ks.data(), ks.data());
  for (auto [s, r, what] : std::vector<std::tuple<const KVStore*, const KVStore*, std::string>>{
           {&tiled_shared, nullptr, "bf16 in the tiled16 layout"}, {&q8_shared, &tiled_residual, "residual store is in the tiled16"}}) {
    std::vector<float> qbw(3 * 32, 0.1f), orw(3 * 32);
    try {
      lrkv_decode_attention(q.data(), qbw.data(), 3, *s, r, 1.0f, os.data(), orw.data(), 1);
      ADD_FAILURE() << "LRKV decode accepted " << what;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  }
  // Stores whose rings hold different tokens in the same slots, though they store as many: other
  // eviction settings (sink 4 + window 28 against window 32), or one token more in one of them.
  auto filled = [&](Eviction e, int tokens, int width) {
    KVStore st(KVType::F32, 1, width, e, 16);
    std::vector<float> row(width, 0.5f);
    for (int t = 0; t < tokens; ++t) st.append(row.data(), row.data());
    return st;
  };
  const KVStore ring_s = filled({4, 28}, 100, 32), ring_r = filled({0, 32}, 100, 3 * 8), ring_late = filled({4, 28}, 101, 3 * 8);
  ASSERT_EQ(ring_s.stored(), ring_r.stored());
  for (const KVStore* other : {&ring_r, &ring_late}) {
    try {
      lrkv_decode_attention(q.data(), qb.data(), 3, ring_s, other, 1.0f, os.data(), orr.data(), 1);
      ADD_FAILURE() << "stores holding different tokens in the same slots were accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("different slots"), std::string::npos) << e.what();
    }
  }
}

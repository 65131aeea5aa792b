// Fused decode attention against the plain double-precision reference on the same stored rows:
// every type, GQA grouping, odd lengths, page and split boundaries, 1 and 2 threads; eviction
// against a reference built from the kept tokens only.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/decode_attention.h"
#include "support/value_weights.h"
#include "util/error.h"

using namespace kvx;
using namespace kvx::kernels;

namespace {

struct Case {
  KVType type;
  int heads, kv_heads, d;
  int64_t len;
  int page_tokens;
  Eviction evict = {};
  KVLayout layout = KVLayout::Rows;
};

std::string name(const Case& c) {
  return kv_type_name(c.type) + " H" + std::to_string(c.heads) + "/" + std::to_string(c.kv_heads) + " d" +
         std::to_string(c.d) + " L" + std::to_string(c.len) + " P" + std::to_string(c.page_tokens) +
         (c.evict.enabled() ? " sink " + std::to_string(c.evict.sink) + " window " + std::to_string(c.evict.window) : "") +
         (c.layout != KVLayout::Rows ? " " + kv_layout_name(c.layout) : "");
}

std::vector<float> randn(size_t n, float sd, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.0f, sd);
  std::vector<float> x(n);
  for (auto& v : x) v = nd(rng);
  return x;
}

// Worst |a - b| over each head, relative to that head's largest |b|.
double rel_err(const std::vector<float>& a, const std::vector<float>& b, int heads, int d) {
  double worst = 0.0;
  for (int h = 0; h < heads; ++h) {
    double diff = 0.0, mag = 1e-30;
    for (int i = 0; i < d; ++i) {
      diff = std::max(diff, std::fabs(static_cast<double>(a[h * d + i]) - b[h * d + i]));
      mag = std::max(mag, std::fabs(static_cast<double>(b[h * d + i])));
    }
    worst = std::max(worst, diff / mag);
  }
  return worst;
}

// A kernel's output against the reference on the same rows (kv): to 1e-5 of each head's largest
// value, or, where the back end `isa` weighs q8 values in integers, within the rounding of the
// weights (largest: the reference's largest_weight), and where it rounds bf16 weights to bf16,
// within that rounding (abs_ref: the reference over the rows with |v|, the same scores). Returns
// the error over its allowance (<= 1 passes).
double kernel_error(const std::vector<float>& out, const std::vector<float>& ref, const std::vector<float>& largest,
                    const KVStore& kv, int heads, DecodeIsa isa, const std::vector<float>* abs_ref = nullptr) {
  const DecodeIsa resolved = resolve_decode_isa(isa, kv.head_dim());
  if (decode_weighs_values_in_int16(resolved, kv.type())) return kvx::testing::worst_over_int16_weights(out, ref, largest, kv, heads);
  if (decode_rounds_value_weights(resolved, kv.type(), heads / kv.kv_heads())) {
    if (!abs_ref) {
      ADD_FAILURE() << "bf16 weights rounded at " << heads / kv.kv_heads() << " queries a KV head: the check needs the |v| reference";
      return 2.0;
    }
    return kvx::testing::worst_over_rounding(out, ref, *abs_ref, heads, kv.head_dim());
  }
  return rel_err(out, ref, heads, kv.head_dim()) / 1e-5;
}

// Fills a store with `len` random tokens; q gets a larger spread so the softmax is peaked
// (scores span several units) and the running max moves.
// abs, if given, gets the same keys and |v| (the rounded-weights bound's reference).
void fill(KVStore& s, int64_t len, std::mt19937& rng, float bias = 0.0f, KVStore* abs = nullptr) {
  const size_t n = static_cast<size_t>(s.kv_heads()) * s.head_dim();
  for (int64_t t = 0; t < len; ++t) {
    auto k = randn(n, 1.0f, rng), v = randn(n, 1.0f, rng);
    for (size_t i = 0; i < n; i += s.head_dim()) k[i] += bias * t;  // drifting scores
    s.append(k.data(), v.data());
    if (!abs) continue;
    for (auto& x : v) x = std::fabs(x);
    abs->append(k.data(), v.data());
  }
}

// The back ends this machine can run for head width d (AVX2 always; AVX-512 where the CPU has
// it and d % 32 == 0).
std::vector<DecodeIsa> isas(int d) {
  std::vector<DecodeIsa> r = {DecodeIsa::Avx2};
  if (decode_isa_usable(DecodeIsa::Avx512, d)) r.push_back(DecodeIsa::Avx512);
  return r;
}

void check_case(const Case& c, uint32_t seed) {
  std::mt19937 rng(seed);
  // bf16 only (the type whose weights a kernel rounds): the same keys with |v|
  KVStore s(c.type, c.kv_heads, c.d, c.evict, c.page_tokens, false, c.layout), abs(c.type, c.kv_heads, c.d, c.evict, c.page_tokens);
  const bool bf16 = c.type == KVType::BF16;
  fill(s, c.len, rng, 0.0f, bf16 ? &abs : nullptr);
  const auto q = randn(static_cast<size_t>(c.heads) * c.d, 2.5f, rng);
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.d));
  std::vector<float> plain_ref(q.size()), rounded_query_ref(q.size()), abs_ref(q.size()), out(q.size()), largest(c.heads);
  decode_attention_reference(q.data(), c.heads, s, scale, plain_ref.data());
  const bool roundable = c.type != KVType::F32;
  if (roundable) decode_attention_reference(q.data(), c.heads, s, scale, rounded_query_ref.data(), true, nullptr, largest.data());
  // over |v| with the kernels' scores (bf16 rounds the query everywhere): the bound of bf16 weights
  if (bf16) decode_attention_reference(q.data(), c.heads, abs, scale, abs_ref.data(), true);
  auto& auto_ref = decode_rounds_query(DecodeIsa::Auto, c.type, c.d) ? rounded_query_ref : plain_ref;
  std::fill(out.begin(), out.end(), NAN);
  decode_attention(q.data(), c.heads, s, scale, out.data(), 2);
  EXPECT_LE(kernel_error(out, auto_ref, largest, s, c.heads, DecodeIsa::Auto, &abs_ref), 1.0) << name(c);
  if (roundable)  // the rounded query changes the result by about the cache's own error on the keys, no more
    EXPECT_LE(rel_err(rounded_query_ref, plain_ref, c.heads, c.d), 0.05) << name(c);
  // Splits cut heads and tiles at odd places; one thread runs them in turn, two share them.
  for (DecodeIsa isa : isas(c.d))
    for (auto [threads, splits] : std::vector<std::pair<int, int>>{{1, 1}, {1, 3}, {1, 7}, {2, 2}, {2, 5}}) {
      const auto& ref = decode_rounds_query(isa, c.type, c.d) ? rounded_query_ref : plain_ref;
      std::fill(out.begin(), out.end(), NAN);
      decode_attention_splits(q.data(), c.heads, s, scale, out.data(), threads, splits, isa);
      EXPECT_LE(kernel_error(out, ref, largest, s, c.heads, isa, &abs_ref), 1.0)
          << name(c) << " " << decode_isa_name(isa) << " threads " << threads << " splits " << splits;
    }
}

}  // namespace

TEST(DecodeAttention, MatchesReferenceForEveryTypeAndGrouping) {
  const std::vector<std::pair<int, int>> groupings = {{8, 8}, {8, 4}, {8, 2}, {8, 1}, {6, 3}};
  uint32_t seed = 100;
  for (KVType t : {KVType::F32, KVType::BF16, KVType::Q8, KVType::Q4}) {
    std::vector<int> dims = {32, 128};
    if (t == KVType::F32 || t == KVType::BF16) dims.push_back(40);
    for (auto [H, Hkv] : groupings)
      for (int d : dims)
        for (int64_t L : {1, 7, 33, 97})  // tails of 8-row blocks and 32-row tiles; pages of 16 (MHA's 64-row tiles: below)
          check_case({t, H, Hkv, d, L, 16}, seed++);
  }
}

TEST(DecodeAttention, LongerContextsAcrossPagesAndSplits) {
  uint32_t seed = 200;
  for (KVType t : {KVType::F32, KVType::BF16, KVType::Q8, KVType::Q4}) {
    check_case({t, 8, 2, 128, 700, 256}, seed++);  // default-sized pages, partial last page
    check_case({t, 4, 4, 64, 515, 100}, seed++);   // pages that are not a multiple of the tile
    check_case({t, 4, 4, 128, 515, 100}, seed++);  // (f32 MHA: 64-row tiles)
  }
  // stores past 2 MiB, whose pages are carved from chunks (KVStore): f32 6 MB, q4 2.5 MB
  check_case({KVType::F32, 8, 4, 128, 3000, 256}, seed++);
  check_case({KVType::Q4, 16, 8, 128, 4500, 256}, seed++);
}

TEST(DecodeAttention, LargeAndOddGroups) {
  uint32_t seed = 300;
  for (KVType t : {KVType::F32, KVType::BF16, KVType::Q8, KVType::Q4})
    for (auto [H, Hkv] : std::vector<std::pair<int, int>>{{16, 1}, {12, 1}, {7, 1}, {30, 2}, {24, 3}})
      check_case({t, H, Hkv, 64, 45, 32}, seed++);
  // bf16 from 8 queries a KV head (values by row pairs: decode_rounds_value_weights): odd tile
  // tails, pages, eviction
  // (9-16 queries: heads in lanes, as LRKV at r = 0; more: 64-row tiles)
  for (auto [H, Hkv, L, page] : std::vector<std::tuple<int, int, int64_t, int>>{
           {8, 1, 1, 16}, {16, 2, 33, 7}, {9, 1, 300, 100}, {32, 4, 97, 256}, {16, 1, 200, 256}, {32, 1, 131, 70}, {20, 1, 65, 64}})
    check_case({KVType::BF16, H, Hkv, 128, L, page}, seed++);
  check_case({KVType::BF16, 16, 1, 96, 150, 16, {3, 40}}, seed++);
  // heads in lanes (bf16 9-16 queries a KV head, f32 13-16; f32 at 11 and 12 stays on the score
  // blocks): one row, odd widths and pages, eviction
  for (KVType t : {KVType::F32, KVType::BF16}) {
    check_case({t, 11, 1, 32, 1, 8}, seed++);
    check_case({t, 13, 1, 32, 1, 8}, seed++);
    check_case({t, 32, 2, 96, 77, 16}, seed++);
    check_case({t, 13, 1, 160, 257, 100}, seed++);
    check_case({t, 36, 3, 128, 300, 64, {5, 100}}, seed++);
    check_case({t, 42, 3, 64, 300, 64, {5, 100}}, seed++);
  }
  check_case({KVType::BF16, 24, 1, 288, 150, 100}, seed++);  // 24 queries (64-row tiles), rows past 256 bytes
  for (KVType t : {KVType::Q8, KVType::Q4})
    for (int d : {96, 256})  // 3 and 8 blocks per row
      for (auto [H, Hkv] : std::vector<std::pair<int, int>>{{4, 4}, {8, 2}, {6, 3}, {6, 2}}) check_case({t, H, Hkv, d, 37, 16}, seed++);
  check_case({KVType::BF16, 7, 7, 20, 19, 8}, seed++);  // head_dim 20: 8-lane chunks plus a tail
  check_case({KVType::F32, 3, 1, 3, 11, 4}, seed++);    // head_dim below one vector
}

// Random shapes (seeded): groupings, widths, lengths, page sizes and sink + window eviction the
// lists above do not name. q8/q4 need d a multiple of 32 (their blocks).
TEST(DecodeAttention, RandomShapesMatchReference) {
  std::mt19937 rng(2026);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  const KVType types[] = {KVType::F32, KVType::BF16, KVType::Q8, KVType::Q4};
  for (int i = 0; i < 200; ++i) {
    const KVType t = types[i % 4];
    const bool quant = t == KVType::Q8 || t == KVType::Q4;
    const int kv_heads = pick(1, 6), group = pick(1, 7), d = quant ? 32 * pick(1, 6) : pick(1, 200);
    const int64_t len = pick(1, 400);
    const int page = pick(1, 4) == 1 ? pick(1, 20) : pick(21, 300);
    Eviction evict;
    if (pick(0, 4) == 0) evict = {pick(0, 8), pick(1, 64)};
    check_case({t, kv_heads * group, kv_heads, d, len, page, evict}, 8000 + i);
  }
}

namespace {

// Stores of type t in the Tiled16 layout against the reference: each (H, Hkv) grouping at tails of
// 16-token groups and of tiles, widths `dims` on pages of 16 to 256, chunked pages, eviction, and
// `random` cases of 1-8 queries a KV head; check_case runs both back ends and splits.
void check_tiled16_stores(KVType t, const std::vector<std::pair<int, int>>& groupings, const std::vector<int>& dims,
                          uint32_t seed, int random) {
  for (auto [H, Hkv] : groupings)
    for (int64_t L : {1, 15, 17, 33, 97}) check_case({t, H, Hkv, 128, L, 16, {}, KVLayout::Tiled16}, seed++);
  for (int d : dims)
    for (auto [L, page] : std::vector<std::pair<int64_t, int>>{{16, 16}, {47, 32}, {300, 48}, {700, 256}})
      check_case({t, 8, 2, d, L, page, {}, KVLayout::Tiled16}, seed++);
  check_case({t, 16, 4, 128, 3000, 256, {}, KVLayout::Tiled16}, seed++);  // chunked pages
  check_case({t, 8, 2, 128, 300, 32, {5, 100}, KVLayout::Tiled16}, seed++);
  check_case({t, 4, 4, 64, 200, 16, {3, 37}, KVLayout::Tiled16}, seed++);
  std::mt19937 rng(seed);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  for (int i = 0; i < random; ++i) {
    const int kv_heads = pick(1, 4), group = pick(1, 8);
    Eviction evict;
    if (pick(0, 3) == 0) evict = {pick(0, 8), pick(1, 64)};
    check_case({t, kv_heads * group, kv_heads, 32 * pick(1, 5), pick(1, 400), 16 * pick(1, 8), evict, KVLayout::Tiled16}, seed++);
  }
}

}  // namespace

// q8 and q4 stores in the Tiled16 layout (decode_kv_layout's choice on AVX-512): every grouping,
// splits (piece_cut moves their cuts to groups), widths of 1 to 8 blocks, odd tails (a V pair's
// missing slot); AVX2 reads the rows copied out.
TEST(DecodeAttention, Tiled16StoresMatchReference) {
  check_tiled16_stores(KVType::Q8, {{8, 8}, {8, 4}, {8, 2}, {8, 1}, {6, 3}, {16, 1}, {30, 2}}, {32, 96, 256}, 900, 40);
  check_tiled16_stores(KVType::Q4, {{8, 8}, {8, 4}, {8, 2}, {8, 1}, {6, 3}, {16, 1}, {30, 2}}, {32, 96, 256}, 950, 40);
}

// bf16 stores in the Tiled16 layout (decode_kv_layout's choice for dense groups of up to 8 queries
// where AVX-512 dots bf16): groupings of 1-8 queries a KV head, tails of 16-token groups and of
// tiles, pages of 16 to 256, splits, eviction, widths; both back ends (AVX2 reads the rows copied
// out); run again without BF16 dot products (kernels.decode_without_avx512_bf16): the widened
// token-lane scores. A group that AVX-512 reads with heads in lanes, from rows, is an error.
TEST(DecodeAttention, Tiled16Bf16StoresMatchReference) {
  // (17 and 32 queries a KV head: passes of 8 and a remainder, bf16 weights by row pairs on 64-row tiles)
  check_tiled16_stores(KVType::BF16, {{8, 8}, {8, 4}, {8, 2}, {8, 1}, {6, 3}, {5, 1}, {16, 2}, {17, 1}, {32, 1}}, {32, 40, 96, 256},
                       1900, 30);
  if (decode_dots_bf16(DecodeIsa::Avx512) && decode_isa_usable(DecodeIsa::Avx512, 128)) {
    KVStore s(KVType::BF16, 1, 128, {}, 16, false, KVLayout::Tiled16);
    std::mt19937 r(5);
    fill(s, 40, r, 0.0f);
    const auto q = randn(16 * 128, 1.0f, r);
    std::vector<float> out(q.size());
    try {
      decode_attention(q.data(), 16, s, 0.1f, out.data(), 1);
      ADD_FAILURE() << "a bf16 tiled16 store was read with heads in lanes";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("cannot read this bf16 store in the tiled16 layout"), std::string::npos) << e.what();
    }
    std::vector<float> ref(q.size());
    decode_attention_reference(q.data(), 16, s, 0.1f, ref.data(), true);
    decode_attention(q.data(), 16, s, 0.1f, out.data(), 1, DecodeIsa::Avx2);  // the rows copied out
    for (size_t i = 0; i < out.size(); ++i) EXPECT_NEAR(out[i], ref[i], 1e-4f) << i;
  }
}

TEST(DecodeAttention, RunningMaxRisesEveryTile) {
  // Scores grow with position, so every tile raises the max and rescales the accumulator. MHA
  // (Hkv = H) runs f32 rows of 128 dims in tiles of 64 rows, here 64 + 36 a page.
  for (KVType t : {KVType::F32, KVType::BF16, KVType::Q8, KVType::Q4})
    for (int Hkv : {2, 4}) {
      std::mt19937 rng(400);
      const int H = 4, d = 128;
      KVStore s(t, Hkv, d, {}, 100);
      fill(s, 300, rng, 0.05f);
      std::vector<float> q(H * d, 0.0f);
      for (int h = 0; h < H; ++h) q[h * d] = 3.0f;
      std::vector<float> ref(q.size()), out(q.size()), largest(H);
      for (DecodeIsa isa : isas(d)) {
        decode_attention_reference(q.data(), H, s, 1.0f, ref.data(), decode_rounds_query(isa, t, d), nullptr, largest.data());
        decode_attention_splits(q.data(), H, s, 1.0f, out.data(), 2, 3, isa);
        EXPECT_LE(kernel_error(out, ref, largest, s, H, isa), 1.0) << kv_type_name(t) << " Hkv " << Hkv << " " << decode_isa_name(isa);
      }
    }
}

TEST(DecodeAttention, EvictionAttendsToSinkAndWindowOnly) {
  for (KVType t : {KVType::F32, KVType::BF16, KVType::Q8, KVType::Q4}) {
    const int H = 6, Hkv = 2, d = 32, S = 4, W = 37, N = 250;
    std::mt19937 rng(500);
    KVStore evicting(t, Hkv, d, {S, W}, 16), kept(t, Hkv, d, {}, 16);
    for (int i = 0; i < N; ++i) {
      const auto k = randn(Hkv * d, 1.0f, rng), v = randn(Hkv * d, 1.0f, rng);
      evicting.append(k.data(), v.data());
      if (i < S || i >= N - W) kept.append(k.data(), v.data());
    }
    ASSERT_EQ(evicting.stored(), S + W);
    EXPECT_EQ(evicting.length(), N);
    EXPECT_EQ(evicting.bytes(), kept.bytes());
    const auto q = randn(H * d, 2.0f, rng);
    std::vector<float> ref(q.size()), out(q.size()), largest(H);
    for (DecodeIsa isa : isas(d))
      for (int threads : {1, 2}) {
        decode_attention_reference(q.data(), H, kept, 0.2f, ref.data(), decode_rounds_query(isa, t, d), nullptr, largest.data());
        decode_attention_splits(q.data(), H, evicting, 0.2f, out.data(), threads, 3, isa);
        EXPECT_LE(kernel_error(out, ref, largest, kept, H, isa), 1.0) << kv_type_name(t) << " " << decode_isa_name(isa);
      }
  }
}

TEST(DecodeAttention, BytesReadAndErrors) {
  KVStore s(KVType::Q8, 4, 128);
  std::vector<float> q(8 * 128, 0.1f), out(8 * 128);
  EXPECT_THROW(decode_attention(q.data(), 8, s, 1.0f, out.data(), 1), Error);  // empty store
  std::mt19937 rng(600);
  fill(s, 10, rng);
  EXPECT_EQ(decode_bytes_read(s), 10 * 2 * 4 * 136);
  EXPECT_THROW(decode_attention(q.data(), 6, s, 1.0f, out.data(), 1), Error);  // 6 % 4 != 0
  EXPECT_THROW(decode_attention_reference(q.data(), 6, s, 1.0f, out.data()), Error);
  decode_attention(q.data(), 8, s, 1.0f, out.data(), 0);
  for (float x : out) EXPECT_TRUE(std::isfinite(x));
}

TEST(DecodeAttention, BackEndChoice) {
  EXPECT_EQ(parse_decode_isa("avx512"), DecodeIsa::Avx512);
  EXPECT_THROW(parse_decode_isa("sse"), Error);
  EXPECT_EQ(resolve_decode_isa(DecodeIsa::Avx2, 40), DecodeIsa::Avx2);
  EXPECT_EQ(resolve_decode_isa(DecodeIsa::Auto, 40), DecodeIsa::Avx2);  // AVX-512 needs head_dim % 32 == 0
  EXPECT_THROW(resolve_decode_isa(DecodeIsa::Avx512, 40), Error);
  if (decode_isa_usable(DecodeIsa::Avx512, 128)) EXPECT_EQ(resolve_decode_isa(DecodeIsa::Auto, 128), DecodeIsa::Avx512);
  // bf16 weights rounded to bf16: AVX-512 with BF16 dot products, from 8 queries a KV head
  EXPECT_EQ(decode_rounds_value_weights(DecodeIsa::Avx512, KVType::BF16, 8), decode_dots_bf16(DecodeIsa::Avx512));
  EXPECT_EQ(decode_rounds_value_weights(DecodeIsa::Avx512, KVType::BF16, 16), decode_dots_bf16(DecodeIsa::Avx512));
  EXPECT_FALSE(decode_rounds_value_weights(DecodeIsa::Avx512, KVType::BF16, 4));
  EXPECT_FALSE(decode_rounds_value_weights(DecodeIsa::Avx512, KVType::F32, 16));
  EXPECT_FALSE(decode_rounds_value_weights(DecodeIsa::Avx2, KVType::BF16, 16));
  // store layouts: Tiled16 for q8 and q4 read by AVX-512 with values of their own (bf16: below)
  const bool avx512 = decode_isa_usable(DecodeIsa::Avx512, 128);
  for (KVType t : {KVType::Q8, KVType::Q4}) {
    EXPECT_EQ(decode_kv_layout(t, 128), avx512 ? KVLayout::Tiled16 : KVLayout::Rows);
    EXPECT_EQ(decode_kv_layout(t, 128, true), KVLayout::Rows);
    EXPECT_EQ(decode_kv_layout(t, 128, false, DecodeIsa::Avx2), KVLayout::Rows);
    EXPECT_EQ(decode_kv_layout(t, 40), KVLayout::Rows);
    for (int group : {1, 4, 16}) EXPECT_TRUE(decode_reads_tiled16(DecodeIsa::Avx512, t, group));
  }
  for (KVType t : {KVType::F32, KVType::BF16}) EXPECT_EQ(decode_kv_layout(t, 128), KVLayout::Rows);
  EXPECT_FALSE(decode_reads_tiled16(DecodeIsa::Avx512, KVType::F32, 4));
  // bf16: Tiled16 for dense groups of 1 to 8 queries a KV head where AVX-512 dots bf16; not LRKV's
  // K_s (group 0) nor groups read with heads in lanes
  const KVLayout bf16_tiled = avx512 && decode_dots_bf16(DecodeIsa::Avx512) ? KVLayout::Tiled16 : KVLayout::Rows;
  for (int group : {1, 4, 8}) EXPECT_EQ(decode_kv_layout(KVType::BF16, 128, false, DecodeIsa::Auto, group), bf16_tiled);
  EXPECT_EQ(decode_kv_layout(KVType::BF16, 128, false, DecodeIsa::Auto, 16), KVLayout::Rows);
  EXPECT_EQ(decode_kv_layout(KVType::BF16, 128, false, DecodeIsa::Auto, 32), KVLayout::Rows);  // (readable, not measured)
  EXPECT_EQ(decode_kv_layout(KVType::BF16, 128, false, DecodeIsa::Avx2, 4), KVLayout::Rows);
  EXPECT_EQ(decode_kv_layout(KVType::BF16, 128, true, DecodeIsa::Auto, 4), KVLayout::Rows);
  EXPECT_EQ(decode_kv_layout(KVType::F32, 128, false, DecodeIsa::Auto, 4), KVLayout::Rows);
  if (!avx512) EXPECT_THROW(decode_kv_layout(KVType::Q8, 128, false, DecodeIsa::Avx512), Error);
}

TEST(DecodeAttention, ValuesAreKeysStoresEachRowOnce) {
  // MLA's latent cache: one row per token is both key and value; the kernels read V = K. 16 heads
  // on it (MLA's absorbed decode): heads in lanes for f32/bf16, and bf16's rounded weights.
  for (auto [t, H] : std::vector<std::pair<KVType, int>>{{KVType::F32, 4}, {KVType::Q8, 4}, {KVType::F32, 16}, {KVType::BF16, 16}}) {
    std::mt19937 rng(700);
    const int d = 64;
    KVStore shared(t, 1, d, {}, 16, true), both(t, 1, d, {}, 16), abs(t, 1, d, {}, 16);
    for (int i = 0; i < 45; ++i) {
      const auto k = randn(d, 1.0f, rng);
      shared.append(k.data(), nullptr);
      both.append(k.data(), k.data());
      std::vector<float> a(k);
      for (auto& x : a) x = std::fabs(x);
      abs.append(k.data(), a.data());
    }
    EXPECT_EQ(shared.bytes() * 2, both.bytes());
    EXPECT_DOUBLE_EQ(shared.bytes_per_token() * 2, both.bytes_per_token());
    const auto q = randn(H * d, 2.0f, rng);
    std::vector<float> ref(q.size()), abs_ref(q.size()), out(q.size()), largest(H);
    for (DecodeIsa isa : isas(d)) {
      const bool rounded = decode_rounds_query(isa, t, d);
      decode_attention_reference(q.data(), H, both, 0.125f, ref.data(), rounded, nullptr, largest.data());
      decode_attention_reference(q.data(), H, abs, 0.125f, abs_ref.data(), rounded);
      decode_attention_splits(q.data(), H, shared, 0.125f, out.data(), 2, 3, isa);
      EXPECT_LE(kernel_error(out, ref, largest, both, H, isa, &abs_ref), 1.0) << kv_type_name(t) << " H" << H << " " << decode_isa_name(isa);
    }
  }
}

// Nectar's virtual pair (SPEC 1.4): the fused merge and the reference agree, and a pair built
// from some of the rows (alpha = logsumexp of their scores, A = their softmax average) gives the
// same output as attending over all rows, for every type's own rows, GQA, splits and threads.
TEST(DecodeAttention, ExtraPairMergesLikeTheRowsItSummarises) {
  std::mt19937 rng(77);
  for (const auto type : {KVType::F32, KVType::Q8}) {
    for (const auto [heads, kv_heads] : {std::pair{4, 4}, {6, 2}, {3, 1}}) {
      const int d = 32;
      const int64_t n_doc = 37, n_loc = 11;
      KVStore all(type, kv_heads, d, {}, 16), local(type, kv_heads, d, {}, 16), doc(type, kv_heads, d, {}, 16);
      const size_t row = static_cast<size_t>(kv_heads) * d;
      for (int64_t t = 0; t < n_doc + n_loc; ++t) {
        auto k = randn(row, 1.0f, rng), v = randn(row, 1.0f, rng);
        all.append(k.data(), v.data());
        (t < n_doc ? doc : local).append(k.data(), v.data());
      }
      const auto q = randn(static_cast<size_t>(heads) * d, 2.0f, rng);
      const float scale = 1.0f / std::sqrt(static_cast<float>(d));
      // The document pair: A from the reference over the document rows alone, alpha from their
      // dequantised keys.
      std::vector<float> content(q.size()), logit(heads);
      decode_attention_reference(q.data(), heads, doc, scale, content.data());
      const int G = heads / kv_heads;
      std::vector<float> k(d);
      std::vector<uint8_t> key_row(doc.row_bytes());
      for (int h = 0; h < heads; ++h) {
        double mx = -1e300, sum = 0;
        std::vector<double> s(n_doc);
        for (int64_t j = 0; j < n_doc; ++j) {
          doc.read_k_rows(j, 1, h / G, key_row.data());
          dequantize_row(type, key_row.data(), d, k.data());
          double dot = 0;
          for (int i = 0; i < d; ++i) dot += static_cast<double>(q[h * d + i]) * k[i];
          s[j] = dot * scale;
          mx = std::max(mx, s[j]);
        }
        for (double x : s) sum += std::exp(x - mx);
        logit[h] = static_cast<float>(mx + std::log(sum));
      }
      const VirtualPair pair{logit.data(), content.data()};
      std::vector<float> full(q.size()), ref(q.size()), out(q.size());
      decode_attention_reference(q.data(), heads, all, scale, full.data());
      decode_attention_reference(q.data(), heads, local, scale, ref.data(), false, &pair);
      const std::string what = kv_type_name(type) + " H" + std::to_string(heads) + "/" + std::to_string(kv_heads);
      EXPECT_LT(rel_err(ref, full, heads, d), 1e-5) << what;
      // The kernels dot bf16/q8 keys with the query rounded (round_query): the reference does the same.
      std::vector<float> rounded_query_ref(q.size()), largest(heads);
      decode_attention_reference(q.data(), heads, local, scale, rounded_query_ref.data(), true, &pair, largest.data());
      for (const DecodeIsa isa : {DecodeIsa::Avx2, DecodeIsa::Auto}) {
        const auto& kernel_ref = decode_rounds_query(isa, type, d) ? rounded_query_ref : ref;
        for (const int threads : {1, 2})
          for (const int splits : {1, 3, 7}) {
            decode_attention_splits(q.data(), heads, local, scale, out.data(), threads, splits, isa, &pair);
            EXPECT_LT(kernel_error(out, kernel_ref, largest, local, heads, isa), 1.0)
                << what << " " << decode_isa_name(isa) << " splits " << splits;
          }
      }
      // No local rows: the pair alone.
      KVStore empty(type, kv_heads, d, {}, 16);
      decode_attention(q.data(), heads, empty, scale, out.data(), 1, DecodeIsa::Auto, &pair);
      EXPECT_EQ(out, content);
      decode_attention_reference(q.data(), heads, empty, scale, ref.data(), false, &pair);
      EXPECT_EQ(ref, content);
    }
  }
  KVStore empty(KVType::F32, 1, 32, {}, 16);
  std::vector<float> q(32, 0.0f), out(32);
  EXPECT_THROW(decode_attention(q.data(), 1, empty, 1.0f, out.data(), 1), Error);
  const VirtualPair half{q.data(), nullptr};
  EXPECT_THROW(decode_attention(q.data(), 1, empty, 1.0f, out.data(), 1, DecodeIsa::Auto, &half), Error);
}

// KVStore: accounting, paging without copies, clear-and-reuse, StreamingLLM eviction.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "kernels/kv_store.h"
#include "util/error.h"

using namespace kvx;
using namespace kvx::kernels;

namespace {

struct Tokens {  // per token: k, v as [kv_heads][head_dim]
  std::vector<std::vector<float>> k, v;
};

Tokens make_tokens(int n, int kv_heads, int d, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  Tokens t;
  for (int i = 0; i < n; ++i) {
    std::vector<float> k(kv_heads * d), v(kv_heads * d);
    for (auto& x : k) x = nd(rng);
    for (auto& x : v) x = nd(rng);
    t.k.push_back(k);
    t.v.push_back(v);
  }
  return t;
}

// The stored bytes of (slot, head) equal quantize_row of token `pos`.
void expect_row(const KVStore& s, const Tokens& tk, int64_t slot, int64_t pos) {
  const int d = s.head_dim();
  std::vector<uint8_t> want(s.row_bytes()), got(s.row_bytes());
  for (int h = 0; h < s.kv_heads(); ++h) {
    quantize_row(s.type(), tk.k[pos].data() + h * d, d, want.data());
    s.read_k_rows(slot, 1, h, got.data());
    EXPECT_EQ(got, want) << "K slot " << slot << " head " << h;
    quantize_row(s.type(), tk.v[pos].data() + h * d, d, want.data());
    s.read_v_rows(slot, 1, h, got.data());
    EXPECT_EQ(got, want) << "V slot " << slot << " head " << h;
  }
}

}  // namespace

TEST(KVStore, AccountingAndPageGrowth) {
  for (KVType t : {KVType::F32, KVType::BF16, KVType::Q8, KVType::Q4}) {
    const int H = 3, d = 64, P = 4;
    KVStore s(t, H, d, {}, P);
    const double bpt = 2.0 * H * row_bytes(t, d);
    EXPECT_EQ(s.bytes_per_token(), bpt);
    EXPECT_EQ(s.length(), 0);
    EXPECT_EQ(s.reserved_bytes(), 0);
    const Tokens tk = make_tokens(11, H, d, 5);
    std::vector<const uint8_t*> first_page_rows;
    for (int i = 0; i < 11; ++i) {
      s.append(tk.k[i].data(), tk.v[i].data());
      EXPECT_EQ(s.length(), i + 1);
      EXPECT_EQ(s.stored(), i + 1);
      EXPECT_EQ(s.bytes(), static_cast<int64_t>((i + 1) * bpt));
      EXPECT_EQ(s.reserved_bytes(), static_cast<int64_t>((i / P + 1) * P * bpt));
      if (i == 0) first_page_rows = {s.k_rows(0, 0), s.v_rows(0, H - 1)};
    }
    EXPECT_EQ(s.pages(), 3);
    // Growth never moved history.
    EXPECT_EQ(s.k_rows(0, 0), first_page_rows[0]);
    EXPECT_EQ(s.v_rows(0, H - 1), first_page_rows[1]);
    for (int i = 0; i < 11; ++i) {
      EXPECT_EQ(s.slot_of(i), i);
      EXPECT_EQ(s.position_of(i), i);
      expect_row(s, tk, i, i);
    }
    // One head's rows are contiguous within a page, and read out together as read one at a time.
    std::vector<uint8_t> rows(3 * s.row_bytes()), one(s.row_bytes());
    s.read_k_rows(4, 3, 1, rows.data());
    EXPECT_EQ(std::memcmp(s.k_rows(1, 1), rows.data(), rows.size()), 0);
    s.read_k_rows(5, 1, 1, one.data());
    EXPECT_EQ(std::memcmp(rows.data() + s.row_bytes(), one.data(), one.size()), 0);
    EXPECT_THROW(s.read_k_rows(3, 2, 0, rows.data()), Error);  // spans two pages
    EXPECT_THROW(s.read_v_rows(10, 2, 0, rows.data()), Error);  // past the stored rows
  }
}

TEST(KVStore, ClearKeepsPagesForReuse) {
  const int H = 2, d = 32;
  KVStore s(KVType::Q8, H, d, {}, 8);
  const Tokens tk = make_tokens(20, H, d, 6);
  for (int i = 0; i < 20; ++i) s.append(tk.k[i].data(), tk.v[i].data());
  const int64_t reserved = s.reserved_bytes();
  const uint8_t* p0 = s.k_rows(0, 0);
  s.clear();
  EXPECT_EQ(s.length(), 0);
  EXPECT_EQ(s.stored(), 0);
  EXPECT_EQ(s.bytes(), 0);
  EXPECT_EQ(s.reserved_bytes(), reserved);
  const Tokens tk2 = make_tokens(13, H, d, 7);
  for (int i = 0; i < 13; ++i) s.append(tk2.k[i].data(), tk2.v[i].data());
  EXPECT_EQ(s.reserved_bytes(), reserved);
  EXPECT_EQ(s.k_rows(0, 0), p0);
  for (int i = 0; i < 13; ++i) expect_row(s, tk2, i, i);
}

TEST(KVStore, TruncateDropsTheNewestTokensAndAppendsOverThem) {
  const int H = 2, d = 32;
  KVStore s(KVType::Q4, H, d, {}, 8);
  const Tokens tk = make_tokens(30, H, d, 8);
  for (int i = 0; i < 20; ++i) s.append(tk.k[i].data(), tk.v[i].data());
  s.truncate(12);  // NAtS-L drops a block routed to the GDN state
  EXPECT_EQ(s.length(), 12);
  EXPECT_EQ(s.bytes(), 12 * 2 * H * static_cast<int64_t>(s.row_bytes()));
  for (int i = 20; i < 30; ++i) s.append(tk.k[i].data(), tk.v[i].data());
  for (int i = 0; i < 12; ++i) expect_row(s, tk, i, i);
  for (int i = 12; i < 22; ++i) expect_row(s, tk, i, i + 8);
  EXPECT_THROW(s.truncate(23), kvx::Error);
  KVStore evicting(KVType::F32, 1, 4, {2, 4});
  EXPECT_THROW(evicting.truncate(0), kvx::Error);
}

TEST(KVStore, LargeStoresCarvePagesFromChunks) {
  // 128 KiB pages: the first 16 (2 MiB) one by one, then chunks of max(16, pages so far) pages
  // (a head's run of 8 KiB per page would reach 1 MiB at 128).
  const int H = 8, d = 128, P = 16;
  KVStore s(KVType::F32, H, d, {}, P);
  const int64_t run_bytes = static_cast<int64_t>(P * row_bytes(KVType::F32, d)), page_bytes = 2 * H * run_bytes;
  const int N = 600;  // 38 pages
  const Tokens tk = make_tokens(N, H, d, 9);
  for (int i = 0; i < N; ++i) s.append(tk.k[i].data(), tk.v[i].data());
  EXPECT_EQ(s.pages(), 38);
  EXPECT_EQ(s.reserved_bytes(), (16 + 16 + 32) * page_bytes);  // 16 single pages, a 16-page chunk, a 32-page chunk
  // In a chunk, each head's rows run on across its pages; the V runs follow the K runs.
  EXPECT_EQ(s.k_rows(17, 0), s.k_rows(16, 0) + run_bytes);
  EXPECT_EQ(s.k_rows(16, 1), s.k_rows(16, 0) + 16 * run_bytes);
  EXPECT_EQ(s.v_rows(16, 0), s.k_rows(16, 0) + H * 16 * run_bytes);
  EXPECT_EQ(s.v_rows(37, H - 1), s.k_rows(32, 0) + (2 * H * 32 - 32 + 5) * run_bytes);
  EXPECT_EQ(s.k_rows(3, 1), s.k_rows(3, 0) + run_bytes);  // a single page: heads back to back
  for (int i = 0; i < N; i += 7) expect_row(s, tk, i, i);
  expect_row(s, tk, N - 1, N - 1);
  s.clear();
  for (int i = 0; i < 20; ++i) s.append(tk.k[i].data(), tk.v[i].data());
  EXPECT_EQ(s.reserved_bytes(), (16 + 16 + 32) * page_bytes);
}

TEST(KVStore, EvictionKeepsFirstSinkAndLastWindow) {
  const int H = 2, d = 32, S = 3, W = 5, N = 23;
  KVStore s(KVType::BF16, H, d, {S, W}, 4);
  const Tokens tk = make_tokens(N, H, d, 8);
  for (int i = 0; i < N; ++i) {
    s.append(tk.k[i].data(), tk.v[i].data());
    EXPECT_EQ(s.stored(), std::min(i + 1, S + W));
    EXPECT_EQ(s.bytes(), static_cast<int64_t>(s.stored() * s.bytes_per_token()));
  }
  EXPECT_EQ(s.length(), N);
  EXPECT_EQ(s.pages(), 2);  // S + W = 8 slots, never more
  std::vector<int> seen(N, 0);
  for (int64_t slot = 0; slot < s.stored(); ++slot) {
    const int64_t pos = s.position_of(slot);
    ++seen[pos];
    EXPECT_EQ(s.slot_of(pos), slot);
    expect_row(s, tk, slot, pos);
  }
  for (int i = 0; i < N; ++i) {
    const bool kept = i < S || i >= N - W;
    EXPECT_EQ(seen[i], kept ? 1 : 0) << i;
    if (!kept) {
      EXPECT_EQ(s.slot_of(i), -1);
    }
  }
}

TEST(KVStore, BadArgumentsAreErrors) {
  EXPECT_THROW(KVStore(KVType::F32, 0, 64), Error);
  EXPECT_THROW(KVStore(KVType::F32, 2, 64, {}, 0), Error);
  EXPECT_THROW(KVStore(KVType::F32, 2, 64, {4, 0}), Error);
  EXPECT_THROW(KVStore(KVType::F32, 2, 64, {-1, 8}), Error);
  try {
    KVStore(KVType::Q4, 2, 40);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("head_dim"), std::string::npos);
  }
  KVStore s(KVType::Q8, 1, 32);
  std::vector<float> k(32, 0.5f), v(32, 0.5f);
  v[7] = NAN;
  EXPECT_THROW(s.append(k.data(), v.data()), Error);
  EXPECT_EQ(s.length(), 0);
}

// Each type takes exactly the finite values it can hold: f32 up to FLT_MAX; bf16 up to the
// largest float that does not round to inf; q8/q4 up to their fp16 scale times the largest code.
TEST(KVStore, RangeLimitsPerType) {
  auto append_one = [](KVType t, float x) {
    KVStore s(t, 1, 32);
    std::vector<float> k(32, 0.5f), v(32, 0.5f);
    k[3] = x;
    s.append(k.data(), v.data());
    std::vector<float> back(32);
    dequantize_row(t, s.k_rows(0, 0), 32, back.data());
    return back[3];
  };
  const float fmax = std::numeric_limits<float>::max();
  EXPECT_EQ(append_one(KVType::F32, fmax), fmax);
  EXPECT_EQ(append_one(KVType::F32, -fmax), -fmax);
  EXPECT_THROW(append_one(KVType::F32, INFINITY), Error);
  uint32_t below_bits = 0x7f7f7fffu, at_bits = 0x7f7f8000u;  // the last float that rounds down in bf16, the first up
  float below, at;
  std::memcpy(&below, &below_bits, 4);
  std::memcpy(&at, &at_bits, 4);
  EXPECT_TRUE(std::isfinite(append_one(KVType::BF16, below)));
  try {
    append_one(KVType::BF16, at);
    FAIL() << "a bf16 value that rounds to inf was stored";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("bf16 can hold"), std::string::npos) << e.what();
  }
  EXPECT_THROW(append_one(KVType::Q8, 65504.0f * 127.0f * 1.01f), Error);
  EXPECT_THROW(append_one(KVType::Q4, 65504.0f * 8.0f * 1.01f), Error);
  EXPECT_NEAR(append_one(KVType::Q8, 1000.0f), 1000.0f, 1000.0f / 127);
}

namespace {

// A Rows and a Tiled16 store of `type` given the same n tokens: the same bytes, and the tiled one
// reads back every stored row (across pages and the eviction ring).
std::pair<KVStore, KVStore> rows_and_tiled(KVType type, int H, int d, Eviction evict, int P, int n, uint32_t seed) {
  KVStore rows(type, H, d, evict, P), tiled(type, H, d, evict, P, false, KVLayout::Tiled16);
  EXPECT_EQ(tiled.layout(), KVLayout::Tiled16);
  const Tokens tk = make_tokens(n, H, d, seed);
  for (int i = 0; i < n; ++i) {
    rows.append(tk.k[i].data(), tk.v[i].data());
    tiled.append(tk.k[i].data(), tk.v[i].data());
  }
  EXPECT_EQ(tiled.bytes(), rows.bytes());
  EXPECT_EQ(tiled.reserved_bytes(), rows.reserved_bytes());
  for (int64_t slot = 0; slot < tiled.stored(); ++slot) expect_row(tiled, tk, slot, tiled.position_of(slot));
  return {std::move(rows), std::move(tiled)};
}

}  // namespace

// Tiled16 (q8): the same rows as the Rows layout, at the documented places, across pages and an
// eviction ring; the layout's preconditions are errors naming the fix.
TEST(KVStore, Tiled16HoldsTheRowsOfTheRowsLayout) {
  const int H = 2, d = 64, P = 32, nb = d / 32;
  const auto [rows, tiled] = rows_and_tiled(KVType::Q8, H, d, {5, 40}, P, 97, 9);
  // The documented places, for slot 37 (page 1, group 0, lane 5), head 1, block 1, code 13.
  std::vector<uint8_t> k(rows.row_bytes()), v(rows.row_bytes());
  rows.read_k_rows(37, 1, 1, k.data());
  rows.read_v_rows(37, 1, 1, v.data());
  const int t = 5, b = 1, c = 32 + 13;
  const uint8_t* kr = tiled.k_rows(1, 1);
  const uint8_t* vr = tiled.v_rows(1, 1);
  EXPECT_EQ(kr[512 * b + 64 * (c % 32 / 4) + 4 * t + c % 4], static_cast<uint8_t>(k[2 * nb + c] ^ 0x80));
  EXPECT_EQ(vr[2 * d * (t / 2) + 2 * c + t % 2], v[2 * nb + c]);  // V: slot pairs, byte-interleaved
  EXPECT_EQ(std::memcmp(kr + P * d + 32 * b + 2 * t, k.data() + 2 * b, 2), 0);
  EXPECT_EQ(std::memcmp(vr + P * d + 32 * b + 2 * t, v.data() + 2 * b, 2), 0);

  EXPECT_THROW(KVStore(KVType::Q8, H, d, {}, 24, false, KVLayout::Tiled16), Error);
  EXPECT_THROW(KVStore(KVType::Q8, H, d, {}, P, true, KVLayout::Tiled16), Error);
}

// Tiled16 (q4): the same rows as the Rows layout, K codes token-interleaved by words as q8's (but
// not flipped) and V codes in byte-interleaved slot pairs (c = d / 2 bytes a row), scales per group
// as q8's, at the documented places (d = 96: a last K segment of 16 bytes a token).
TEST(KVStore, Tiled16Q4HoldsTheRowsOfTheRowsLayout) {
  const int H = 3, d = 96, P = 16, nb = d / 32, c = d / 2;
  const auto [rows, tiled] = rows_and_tiled(KVType::Q4, H, d, {2, 51}, P, 120, 11);
  // The documented places, for slot 27 (page 1, group 0, lane 11), head 2, block 2, code byte 40.
  std::vector<uint8_t> k(rows.row_bytes()), v(rows.row_bytes());
  rows.read_k_rows(27, 1, 2, k.data());
  rows.read_v_rows(27, 1, 2, v.data());
  const int t = 11, b = 2, i = 40;
  const uint8_t* kr = tiled.k_rows(1, 2);
  const uint8_t* vr = tiled.v_rows(1, 2);
  EXPECT_EQ(kr[512 * (i / 32) + 64 * (i % 32 / 4) + 4 * t + i % 4], k[2 * nb + i]);
  EXPECT_EQ(kr[512 + 64 * 3 + 4 * t + 3], k[2 * nb + 47]);  // the last byte, in the half segment
  EXPECT_EQ(vr[2 * c * (t / 2) + 2 * i + t % 2], v[2 * nb + i]);
  EXPECT_EQ(std::memcmp(kr + P * c + 32 * b + 2 * t, k.data() + 2 * b, 2), 0);
  EXPECT_EQ(std::memcmp(vr + P * c + 32 * b + 2 * t, v.data() + 2 * b, 2), 0);
  EXPECT_THROW(KVStore(KVType::Q4, H, d, {}, 40, false, KVLayout::Tiled16), Error);
}

// Tiled16 (bf16): the same rows as the Rows layout, K words token-interleaved at the documented
// places, V as rows; f32, odd widths and shared K/V rows are errors naming the layout.
TEST(KVStore, Tiled16Bf16HoldsTheRowsOfTheRowsLayout) {
  const int H = 2, d = 96, P = 48;
  const auto [rows, tiled] = rows_and_tiled(KVType::BF16, H, d, {3, 70}, P, 131, 10);
  // The documented places, for slot 70 (page 1, group 1, lane 6), head 1, word 29 (values 58, 59).
  std::vector<uint8_t> k(rows.row_bytes()), v(rows.row_bytes());
  rows.read_k_rows(70, 1, 1, k.data());
  rows.read_v_rows(70, 1, 1, v.data());
  const int g = 1, t = 6, i = 29;
  EXPECT_EQ(std::memcmp(tiled.k_rows(1, 1) + 32 * d * g + 64 * i + 4 * t, k.data() + 4 * i, 4), 0);
  EXPECT_EQ(std::memcmp(tiled.v_rows(1, 1) + 2 * d * (16 * g + t), v.data(), v.size()), 0);

  EXPECT_THROW(KVStore(KVType::F32, H, d, {}, P, false, KVLayout::Tiled16), Error);
  EXPECT_THROW(KVStore(KVType::BF16, H, 33, {}, P, false, KVLayout::Tiled16), Error);
  EXPECT_THROW(KVStore(KVType::BF16, H, d, {}, P, true, KVLayout::Tiled16), Error);
}

// The fused LLA reconstruct-on-read kernel against its plain double reference: odd ranks, per-head
// and LLA-2D groups, GQA, two history segments (sink + window), tails of 1 and 3 rows, 1 and 2
// threads, forced splits; the absorbed mode likewise and, without RoPE, equal to reconstruct.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "kernels/lla_decode.h"
#include "util/error.h"

using namespace kvx::kernels;

namespace {

std::vector<float> randn(size_t n, std::mt19937& rng, float sd = 1.f) {
  std::normal_distribution<float> nd(0.0f, sd);
  std::vector<float> x(n);
  for (auto& v : x) v = nd(rng);
  return x;
}

struct Case {
  int heads, kv_heads, head_dim, groups, rk, rv;
  std::vector<LlaSegment> history;
  int64_t rows, tail;
  double theta = 10000.0;
};

struct Data {
  std::vector<float> kc, vc, up_k, mu_k, up_v, mu_v, tk, tv, q, q_pre;
  std::vector<double> inv_freq;
  LlaDecodeArgs args;
};

Data make(const Case& c, uint32_t seed, LlaReadMode mode) {
  std::mt19937 rng(seed);
  Data d;
  const int rows = c.kv_heads / c.groups * c.head_dim;
  const int64_t stride_k = (c.rows + 5) * c.rk, stride_v = (c.rows + 3) * c.rv;  // padded like a growing buffer
  d.kc = randn(c.groups * stride_k, rng);
  d.vc = randn(c.groups * stride_v, rng);
  d.up_k = randn(static_cast<size_t>(c.groups) * c.rk * rows, rng, 0.3f);
  d.mu_k = randn(static_cast<size_t>(c.groups) * rows, rng, 0.5f);
  d.up_v = randn(static_cast<size_t>(c.groups) * c.rv * rows, rng, 0.3f);
  d.mu_v = randn(static_cast<size_t>(c.groups) * rows, rng, 0.5f);
  d.tk = randn(c.tail * c.kv_heads * c.head_dim, rng);
  d.tv = randn(c.tail * c.kv_heads * c.head_dim, rng);
  d.q = randn(static_cast<size_t>(c.heads) * c.head_dim, rng);
  d.q_pre = randn(static_cast<size_t>(c.heads) * c.head_dim, rng);
  for (int m = 0; m < c.head_dim / 2; ++m)
    d.inv_freq.push_back(c.theta > 0 ? std::pow(c.theta, -2.0 * m / c.head_dim) : 0.0);
  auto& a = d.args;
  a.heads = c.heads, a.kv_heads = c.kv_heads, a.head_dim = c.head_dim, a.groups = c.groups;
  a.key_codes = d.kc.data(), a.value_codes = d.vc.data(), a.key_group_stride = stride_k, a.value_group_stride = stride_v;
  a.history = c.history;
  a.keys = {d.up_k.data(), d.mu_k.data(), c.rk};
  a.values = {d.up_v.data(), d.mu_v.data(), c.rv};
  a.inv_freq = d.inv_freq.data();
  a.tail_keys = d.tk.data(), a.tail_values = d.tv.data(), a.tail = c.tail;
  a.scale = 1.f / std::sqrt(static_cast<float>(c.head_dim));
  a.mode = mode;
  return d;
}

double max_rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double m = 0, scale = 1e-3;
  for (size_t i = 0; i < a.size(); ++i) scale = std::max(scale, std::fabs(static_cast<double>(b[i])));
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(static_cast<double>(a[i]) - b[i]));
  return m / scale;
}

std::vector<Case> cases() {
  return {
      {6, 6, 64, 6, 48, 80, {{0, 300, 0}}, 300, 1},                   // per-head, tiny-looped's shape at 4x
      {6, 2, 10, 2, 7, 13, {{0, 37, 0}}, 37, 3},                      // GQA, odd ranks, chunk tail
      {4, 4, 8, 1, 5, 9, {{0, 1, 0}}, 1, 1},                          // LLA-2D, one history row
      {6, 3, 12, 1, 11, 3, {{0, 4, 0}, {9, 530, 700}}, 530, 2},      // 2D, sink + window segments
      {3, 3, 16, 3, 4, 6, {}, 0, 2},                                  // no history: the tail alone
      {8, 2, 32, 2, 33, 17, {{0, 1000, 0}}, 1000, 1},                 // long (several splits when forced)
  };
}

}  // namespace

TEST(LlaDecodeKernel, MatchesTheReferenceForEveryShapeThreadsAndSplits) {
  uint32_t seed = 1;
  for (const auto mode : {LlaReadMode::Reconstruct, LlaReadMode::Absorbed})
    for (const auto& c : cases()) {
      auto d = make(c, seed++, mode);
      std::vector<float> ref(static_cast<size_t>(c.heads) * c.head_dim), out(ref.size());
      lla_decode_attention_reference(d.args, d.q.data(), d.q_pre.data(), ref.data());
      for (int threads : {1, 2})
        for (int splits : {0, 1, 3}) {
          std::fill(out.begin(), out.end(), 0.f);
          lla_decode_attention(d.args, d.q.data(), d.q_pre.data(), out.data(), threads, splits);
          EXPECT_LT(max_rel_diff(out, ref), 2e-5) << "heads " << c.heads << " groups " << c.groups << " rk " << c.rk
                                                  << " threads " << threads << " splits " << splits << " mode "
                                                  << static_cast<int>(mode);
        }
    }
}

// Random shapes (seeded): groupings, even head widths, ranks, lengths, tails and sink + window
// segments the fixed cases do not name, both read modes, 1 and 2 threads, forced splits.
TEST(LlaDecodeKernel, RandomShapesMatchTheReference) {
  std::mt19937 rng(2026);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  for (int i = 0; i < 100; ++i) {
    Case c;
    c.kv_heads = pick(1, 4);
    c.heads = c.kv_heads * pick(1, 3);
    c.groups = pick(0, 1) ? c.kv_heads : 1;
    c.head_dim = 2 * pick(1, 40);
    c.rk = pick(1, 40), c.rv = pick(1, 40);
    c.rows = pick(0, 3) == 0 ? pick(0, 3) : pick(4, 700);
    c.tail = c.rows == 0 ? pick(1, 3) : pick(0, 3);
    if (c.rows > 0) {
      if (pick(0, 2) == 0 && c.rows > 8) {  // a sink and a window whose positions run on
        const int64_t sink = pick(1, 4), start = pick(static_cast<int>(sink), static_cast<int>(c.rows) - 1);
        c.history = {{0, sink, 0}, {start, c.rows, start + pick(0, 500)}};
      } else {
        c.history = {{0, c.rows, 0}};
      }
    }
    const auto mode = i % 2 ? LlaReadMode::Absorbed : LlaReadMode::Reconstruct;
    auto d = make(c, 7000 + i, mode);
    std::vector<float> ref(static_cast<size_t>(c.heads) * c.head_dim), out(ref.size());
    lla_decode_attention_reference(d.args, d.q.data(), d.q_pre.data(), ref.data());
    for (auto [threads, splits] : std::vector<std::pair<int, int>>{{1, 0}, {2, 0}, {2, 3}}) {
      std::fill(out.begin(), out.end(), 0.f);
      lla_decode_attention(d.args, d.q.data(), d.q_pre.data(), out.data(), threads, splits);
      EXPECT_LT(max_rel_diff(out, ref), 2e-5) << "case " << i << " heads " << c.heads << "/" << c.kv_heads << " groups "
                                              << c.groups << " d " << c.head_dim << " rk " << c.rk << " rv " << c.rv
                                              << " rows " << c.rows << " tail " << c.tail << " threads " << threads
                                              << " splits " << splits << " mode " << static_cast<int>(mode);
    }
  }
}

TEST(LlaDecodeKernel, AbsorbedEqualsReconstructWhenTheKeysCarryNoRope) {
  // theta = 0 turns RoPE off (every angle 0); then (W_up^T q) . c + q . mu is exact.
  Case c{6, 2, 10, 2, 7, 13, {{0, 4, 0}, {20, 200, 300}}, 200, 2, 0.0};
  auto rec = make(c, 7, LlaReadMode::Reconstruct), abs = make(c, 7, LlaReadMode::Absorbed);
  abs.q_pre = abs.q;  // no RoPE: the pre-RoPE query is the query
  std::vector<float> a(static_cast<size_t>(c.heads) * c.head_dim), b(a.size());
  lla_decode_attention(rec.args, rec.q.data(), nullptr, a.data(), 2);
  lla_decode_attention(abs.args, abs.q.data(), abs.q_pre.data(), b.data(), 2);
  EXPECT_LT(max_rel_diff(b, a), 2e-5);
}

TEST(LlaDecodeKernel, TheRotationFollowsEachRowsPosition) {
  // Moving the window segment to other positions changes the output (RoPE is applied per row).
  Case c{4, 4, 16, 4, 6, 6, {{0, 64, 0}}, 64, 1};
  auto d0 = make(c, 3, LlaReadMode::Reconstruct);
  auto d1 = make(c, 3, LlaReadMode::Reconstruct);
  d1.args.history = {{0, 64, 17}};
  std::vector<float> a(64), b(64), ref(64);
  lla_decode_attention(d0.args, d0.q.data(), nullptr, a.data(), 1);
  lla_decode_attention(d1.args, d1.q.data(), nullptr, b.data(), 1);
  lla_decode_attention_reference(d1.args, d1.q.data(), nullptr, ref.data());
  EXPECT_GT(max_rel_diff(a, b), 1e-3);
  EXPECT_LT(max_rel_diff(b, ref), 2e-5);
}

TEST(LlaDecodeKernel, BytesReadAndBadShapes) {
  Case c{6, 3, 12, 1, 11, 3, {{0, 4, 0}, {9, 530, 700}}, 530, 2};
  auto d = make(c, 5, LlaReadMode::Reconstruct);
  EXPECT_EQ(lla_decode_bytes_read(d.args), (4 + 521) * 1 * (11 + 3) * 4);
  EXPECT_NE(lla_reconstruct_keys_only(d.args, 2), 0.0);
  std::vector<float> out(72);
  auto bad = d.args;
  bad.groups = 2;  // 3 KV heads do not split into 2 groups
  EXPECT_THROW(lla_decode_attention(bad, d.q.data(), nullptr, out.data(), 1), kvx::Error);
  bad = d.args;
  bad.history.clear();
  bad.tail = 0;
  EXPECT_THROW(lla_decode_attention(bad, d.q.data(), nullptr, out.data(), 1), kvx::Error);
  bad = d.args;
  bad.tail = -1;
  EXPECT_THROW(lla_decode_attention(bad, d.q.data(), nullptr, out.data(), 1), kvx::Error);
  bad = d.args;
  bad.key_group_stride = 100;  // shorter than the 530 rows read
  EXPECT_THROW(lla_decode_attention(bad, d.q.data(), nullptr, out.data(), 1), kvx::Error);
  bad = d.args;
  bad.mode = LlaReadMode::Absorbed;
  EXPECT_THROW(lla_decode_attention(bad, d.q.data(), nullptr, out.data(), 1), kvx::Error);
}

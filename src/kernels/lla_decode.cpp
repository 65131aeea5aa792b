#include "kernels/lla_decode.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "kernels/simd_avx2.h"
#include "util/error.h"

namespace kvx::kernels {

namespace {

constexpr int kTile = 32;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Geometry {
  int per_group = 0;    // KV heads a code reconstructs
  int q_per_kv = 0;     // query heads per KV head
  int group_heads = 0;  // query heads per group
  int rows = 0;         // per_group * head_dim
  int half = 0;
  int64_t total = 0;    // history rows
};

Geometry geometry(const LlaDecodeArgs& a) {
  if (a.heads <= 0 || a.kv_heads <= 0 || a.head_dim <= 0 || a.head_dim % 2 || a.heads % a.kv_heads || a.groups <= 0 ||
      a.kv_heads % a.groups)
    throw Error("lla_decode_attention: need heads % kv_heads == 0, kv_heads % groups == 0, even head_dim");
  if (a.keys.rank <= 0 || a.values.rank <= 0 || !a.keys.up || !a.keys.mu || !a.values.up || !a.values.mu || !a.inv_freq)
    throw Error("lla_decode_attention: codec panels, ranks and RoPE frequencies are required");
  Geometry g;
  g.per_group = a.kv_heads / a.groups;
  g.q_per_kv = a.heads / a.kv_heads;
  g.group_heads = g.per_group * g.q_per_kv;
  g.rows = g.per_group * a.head_dim;
  g.half = a.head_dim / 2;
  for (const auto& s : a.history) {
    if (s.row_end < s.row_begin || s.row_begin < 0) throw Error("lla_decode_attention: bad history segment");
    g.total += s.row_end - s.row_begin;
  }
  if (a.tail < 0) throw Error("lla_decode_attention: tail must be >= 0");
  if (g.total + a.tail < 1) throw Error("lla_decode_attention: nothing to attend to (no history, no tail)");
  int64_t last_row = 0;
  for (const auto& s : a.history) last_row = std::max(last_row, s.row_end);
  if (g.total > 0 && (!a.key_codes || !a.value_codes || a.key_group_stride < last_row * a.keys.rank ||
                      a.value_group_stride < last_row * a.values.rank))
    throw Error("lla_decode_attention: history codes missing, or a group stride shorter than the rows read");
  if (a.tail > 0 && (!a.tail_keys || !a.tail_values)) throw Error("lla_decode_attention: tail K/V missing");
  return g;
}

// cos/sin of n consecutive positions from p0 for every plane: exact at p0, then the angle-addition
// recurrence in double (a tile is short, so it stays at double rounding).
void rope_tile(const double* inv_freq, const double* step_cos, const double* step_sin, int half, int64_t p0, int n,
               float* cs, float* sn) {
  for (int m = 0; m < half; ++m) {
    double c = std::cos(static_cast<double>(p0) * inv_freq[m]), s = std::sin(static_cast<double>(p0) * inv_freq[m]);
    for (int i = 0; i < n; ++i) {
      cs[i * half + m] = static_cast<float>(c);
      sn[i * half + m] = static_cast<float>(s);
      const double next = c * step_cos[m] - s * step_sin[m];
      s = s * step_cos[m] + c * step_sin[m];
      c = next;
    }
  }
}

KVX_INLINE float dot(const float* __restrict a, const float* __restrict b, int n) {
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  int x = 0;
  for (; x + 16 <= n; x += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + x), _mm256_loadu_ps(b + x), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + x + 8), _mm256_loadu_ps(b + x + 8), s1);
  }
  if (x + 8 <= n) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + x), _mm256_loadu_ps(b + x), s0);
    x += 8;
  }
  float acc = hsum(_mm256_add_ps(s0, s1));
  for (; x < n; ++x) acc += a[x] * b[x];
  return acc;
}

// out[i] = mu + codes[i] W (W = up [r][rows]), then each head's planes rotated by the row's angles.
// Micro-kernel: 4 rows x 16 columns of accumulators in registers, one pass over the rank.
void reconstruct_tile(const float* __restrict codes, int n, int r, const float* __restrict up,
                      const float* __restrict mu, int rows, const float* cs, const float* sn, int head_dim,
                      float* __restrict out) {
  const int vec_rows = rows / 16 * 16;
  for (int i = 0; i < n; i += 4) {
    const int m = std::min(4, n - i);
    const float* c[4];
    for (int t = 0; t < 4; ++t) c[t] = codes + static_cast<size_t>(i + std::min(t, m - 1)) * r;
    for (int x = 0; x < vec_rows; x += 16) {
      const __m256 mu0 = _mm256_loadu_ps(mu + x), mu1 = _mm256_loadu_ps(mu + x + 8);
      __m256 a00 = mu0, a01 = mu1, a10 = mu0, a11 = mu1, a20 = mu0, a21 = mu1, a30 = mu0, a31 = mu1;
      const float* u = up + x;
      for (int k = 0; k < r; ++k, u += rows) {
        const __m256 u0 = _mm256_loadu_ps(u), u1 = _mm256_loadu_ps(u + 8);
        __m256 b = _mm256_broadcast_ss(c[0] + k);
        a00 = _mm256_fmadd_ps(b, u0, a00), a01 = _mm256_fmadd_ps(b, u1, a01);
        b = _mm256_broadcast_ss(c[1] + k);
        a10 = _mm256_fmadd_ps(b, u0, a10), a11 = _mm256_fmadd_ps(b, u1, a11);
        b = _mm256_broadcast_ss(c[2] + k);
        a20 = _mm256_fmadd_ps(b, u0, a20), a21 = _mm256_fmadd_ps(b, u1, a21);
        b = _mm256_broadcast_ss(c[3] + k);
        a30 = _mm256_fmadd_ps(b, u0, a30), a31 = _mm256_fmadd_ps(b, u1, a31);
      }
      float* o = out + static_cast<size_t>(i) * rows + x;
      const __m256 acc[4][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}};
      for (int t = 0; t < m; ++t) {
        _mm256_storeu_ps(o + static_cast<size_t>(t) * rows, acc[t][0]);
        _mm256_storeu_ps(o + static_cast<size_t>(t) * rows + 8, acc[t][1]);
      }
    }
    for (int t = 0; t < m; ++t)  // columns past the last 16-block
      for (int x = vec_rows; x < rows; ++x) {
        float acc = mu[x];
        for (int k = 0; k < r; ++k) acc += c[t][k] * up[static_cast<size_t>(k) * rows + x];
        out[static_cast<size_t>(i + t) * rows + x] = acc;
      }
  }
  const int half = head_dim / 2;
  for (int i = 0; i < n; ++i)
    for (int p = 0; p < rows / head_dim; ++p) {
      float* __restrict x = out + static_cast<size_t>(i) * rows + p * head_dim;
      const float* c = cs + i * half;
      const float* s = sn + i * half;
      for (int m = 0; m < half; ++m) {
        const float x1 = x[m], x2 = x[m + half];
        x[m] = x1 * c[m] - x2 * s[m];
        x[m + half] = x2 * c[m] + x1 * s[m];
      }
    }
}

// A contiguous piece of the history: rows [row, row + n) at positions from `position`.
struct Piece {
  int64_t row, position;
  int n;
};

// Calls f(piece) for the tiles covering virtual rows [v0, v1) (tiles never cross a segment).
template <class F>
void for_tiles(const std::vector<LlaSegment>& history, int64_t v0, int64_t v1, F&& f) {
  int64_t base = 0;
  for (const auto& s : history) {
    const int64_t len = s.row_end - s.row_begin, a = std::max(v0, base), b = std::min(v1, base + len);
    for (int64_t v = a; v < b; v += kTile) {
      const int n = static_cast<int>(std::min<int64_t>(kTile, b - v));
      f(Piece{s.row_begin + (v - base), s.first_position + (v - base), n});
    }
    base += len;
  }
}

int choose_splits(const Geometry& g, const LlaDecodeArgs& a, int threads, int splits) {
  if (splits > 0) return splits;
  if (g.total == 0) return 1;
  const int64_t want = (threads + a.groups - 1) / a.groups;  // enough items for every thread
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(want, g.total / 256)));
}

struct Partial {
  std::vector<float> m, l, z;  // per item x group head: running max, sum, value-code accumulator
};

}  // namespace

void lla_decode_attention(const LlaDecodeArgs& a, const float* q, const float* q_pre, float* out, int threads,
                          int splits) {
  const Geometry g = geometry(a);
  if (a.mode == LlaReadMode::Absorbed && !q_pre) throw Error("lla_decode_attention: absorbed mode needs q_pre");
  const int T = std::max(1, threads <= 0 ? omp_get_max_threads() : threads);
  const int S = choose_splits(g, a, T, splits);
  const int items = a.groups * S, rk = a.keys.rank, rv = a.values.rank, d = a.head_dim, GH = g.group_heads;
  std::vector<double> step_cos(g.half), step_sin(g.half);
  for (int m = 0; m < g.half; ++m) step_cos[m] = std::cos(a.inv_freq[m]), step_sin[m] = std::sin(a.inv_freq[m]);

  Partial part;
  part.m.assign(static_cast<size_t>(items) * GH, kNegInf);
  part.l.assign(static_cast<size_t>(items) * GH, 0.f);
  part.z.assign(static_cast<size_t>(items) * GH * rv, 0.f);
  if (g.total > 0) {
#pragma omp parallel num_threads(std::min(T, items)) if (T > 1 && items > 1)
    {
      std::vector<float> keys(static_cast<size_t>(kTile) * g.rows), cs(kTile * g.half), sn(kTile * g.half);
      std::vector<float> scores(static_cast<size_t>(GH) * kTile), qa(static_cast<size_t>(GH) * rk), qm(GH);
#pragma omp for schedule(static)
      for (int item = 0; item < items; ++item) {
        const int grp = item / S, split = item % S;
        const int64_t v0 = g.total * split / S, v1 = g.total * (split + 1) / S;
        const float* up_k = a.keys.up + static_cast<size_t>(grp) * rk * g.rows;
        const float* mu_k = a.keys.mu + static_cast<size_t>(grp) * g.rows;
        const float* kc = a.key_codes + grp * a.key_group_stride;
        const float* vc = a.value_codes + grp * a.value_group_stride;
        float* m = part.m.data() + static_cast<size_t>(item) * GH;
        float* l = part.l.data() + static_cast<size_t>(item) * GH;
        float* z = part.z.data() + static_cast<size_t>(item) * GH * rv;
        if (a.mode == LlaReadMode::Absorbed)  // qa_h = W_up^T q'_h, qm_h = q'_h . mu (this group's rows)
          for (int hh = 0; hh < GH; ++hh) {
            const int p = hh / g.q_per_kv;
            const float* qh = q_pre + static_cast<size_t>(grp * GH + hh) * d;
            for (int k = 0; k < rk; ++k) {
              const float* u = up_k + static_cast<size_t>(k) * g.rows + p * d;
              float acc = 0.f;
              for (int x = 0; x < d; ++x) acc += u[x] * qh[x];
              qa[static_cast<size_t>(hh) * rk + k] = acc;
            }
            float acc = 0.f;
            for (int x = 0; x < d; ++x) acc += mu_k[p * d + x] * qh[x];
            qm[hh] = acc;
          }
        for_tiles(a.history, v0, v1, [&](const Piece& pc) {
          const float* codes = kc + pc.row * rk;
          if (a.mode == LlaReadMode::Reconstruct) {
            rope_tile(a.inv_freq, step_cos.data(), step_sin.data(), g.half, pc.position, pc.n, cs.data(), sn.data());
            reconstruct_tile(codes, pc.n, rk, up_k, mu_k, g.rows, cs.data(), sn.data(), d, keys.data());
            for (int hh = 0; hh < GH; ++hh) {
              const int p = hh / g.q_per_kv;
              const float* __restrict qh = q + static_cast<size_t>(grp * GH + hh) * d;
              for (int i = 0; i < pc.n; ++i)
                scores[static_cast<size_t>(hh) * kTile + i] = a.scale * dot(qh, keys.data() + static_cast<size_t>(i) * g.rows + p * d, d);
            }
          } else {
            for (int hh = 0; hh < GH; ++hh) {
              const float* __restrict qh = qa.data() + static_cast<size_t>(hh) * rk;
              for (int i = 0; i < pc.n; ++i)
                scores[static_cast<size_t>(hh) * kTile + i] = a.scale * (qm[hh] + dot(qh, codes + static_cast<size_t>(i) * rk, rk));
            }
          }
          const float* vcodes = vc + pc.row * rv;
          for (int hh = 0; hh < GH; ++hh) {  // online softmax; values stay codes (absorbed)
            float* s = scores.data() + static_cast<size_t>(hh) * kTile;
            float tile_max = kNegInf;
            for (int i = 0; i < pc.n; ++i) tile_max = std::max(tile_max, s[i]);
            float* __restrict zh = z + static_cast<size_t>(hh) * rv;
            if (tile_max > m[hh]) {
              const float f = std::exp(m[hh] - tile_max);
              l[hh] *= f;
              for (int k = 0; k < rv; ++k) zh[k] *= f;
              m[hh] = tile_max;
            }
            for (int i = 0; i < pc.n; ++i) {
              const float w = std::exp(s[i] - m[hh]);
              l[hh] += w;
              const float* __restrict c = vcodes + static_cast<size_t>(i) * rv;
              for (int k = 0; k < rv; ++k) zh[k] += w * c[k];
            }
          }
        });
      }
    }
  }

  // Merge the items of each head, apply W_up^V once, then fold in the exact tail.
  std::vector<float> zsum(rv), st(a.tail);
  for (int h = 0; h < a.heads; ++h) {
    const int kv = h / g.q_per_kv, grp = kv / g.per_group, p = kv % g.per_group, hh = h - grp * GH;
    float M = kNegInf;
    for (int s = 0; s < S; ++s) M = std::max(M, part.m[static_cast<size_t>(grp * S + s) * GH + hh]);
    std::fill(zsum.begin(), zsum.end(), 0.f);
    float L = 0.f;
    for (int s = 0; s < S && M > kNegInf; ++s) {
      const size_t at = static_cast<size_t>(grp * S + s) * GH + hh;
      if (part.l[at] == 0.f) continue;
      const float f = std::exp(part.m[at] - M);
      L += f * part.l[at];
      for (int k = 0; k < rv; ++k) zsum[k] += f * part.z[at * rv + k];
    }
    float* o = out + static_cast<size_t>(h) * d;
    const float* up_v = a.values.up + static_cast<size_t>(grp) * rv * g.rows + p * d;
    const float* mu_v = a.values.mu + static_cast<size_t>(grp) * g.rows + p * d;
    for (int x = 0; x < d; ++x) o[x] = mu_v[x] * L;
    for (int k = 0; k < rv; ++k) {
      const float* u = up_v + static_cast<size_t>(k) * g.rows;
      for (int x = 0; x < d; ++x) o[x] += zsum[k] * u[x];
    }
    const float* qh = q + static_cast<size_t>(h) * d;
    float M2 = M;
    for (int64_t i = 0; i < a.tail; ++i) {
      const float* k = a.tail_keys + (i * a.kv_heads + kv) * d;
      float acc = 0.f;
      for (int x = 0; x < d; ++x) acc += qh[x] * k[x];
      st[i] = a.scale * acc;
      M2 = std::max(M2, st[i]);
    }
    const float f = M > kNegInf ? std::exp(M - M2) : 0.f;
    L *= f;
    for (int x = 0; x < d; ++x) o[x] *= f;
    for (int64_t i = 0; i < a.tail; ++i) {
      const float w = std::exp(st[i] - M2);
      L += w;
      const float* v = a.tail_values + (i * a.kv_heads + kv) * d;
      for (int x = 0; x < d; ++x) o[x] += w * v[x];
    }
    for (int x = 0; x < d; ++x) o[x] /= L;
  }
}

void lla_decode_attention_reference(const LlaDecodeArgs& a, const float* q, const float* q_pre, float* out) {
  const Geometry g = geometry(a);
  if (a.mode == LlaReadMode::Absorbed && !q_pre) throw Error("lla_decode_attention: absorbed mode needs q_pre");
  const int d = a.head_dim, rk = a.keys.rank, rv = a.values.rank;
  for (int h = 0; h < a.heads; ++h) {
    const int kv = h / g.q_per_kv, grp = kv / g.per_group, p = kv % g.per_group;
    const float* qh = q + static_cast<size_t>(h) * d;
    std::vector<double> scores;
    std::vector<std::vector<double>> values;
    auto rebuild = [&](const LlaLoopPanels& panel, const float* code, std::vector<double>& x) {
      x.assign(d, 0.0);
      for (int i = 0; i < d; ++i) {
        double acc = panel.mu[static_cast<size_t>(grp) * g.rows + p * d + i];
        for (int k = 0; k < panel.rank; ++k)
          acc += static_cast<double>(code[k]) * panel.up[(static_cast<size_t>(grp) * panel.rank + k) * g.rows + p * d + i];
        x[i] = acc;
      }
    };
    for (const auto& s : a.history)
      for (int64_t row = s.row_begin; row < s.row_end; ++row) {
        std::vector<double> k, v;
        rebuild(a.keys, a.key_codes + grp * a.key_group_stride + row * rk, k);
        rebuild(a.values, a.value_codes + grp * a.value_group_stride + row * rv, v);
        double dot = 0;
        if (a.mode == LlaReadMode::Reconstruct) {
          const double pos = static_cast<double>(s.first_position + (row - s.row_begin));
          for (int m = 0; m < g.half; ++m) {
            const double c = std::cos(pos * a.inv_freq[m]), sn = std::sin(pos * a.inv_freq[m]);
            const double x1 = k[m], x2 = k[m + g.half];
            dot += qh[m] * (x1 * c - x2 * sn) + qh[m + g.half] * (x2 * c + x1 * sn);
          }
        } else {
          for (int i = 0; i < d; ++i) dot += q_pre[static_cast<size_t>(h) * d + i] * k[i];
        }
        scores.push_back(a.scale * dot);
        values.push_back(v);
      }
    for (int64_t i = 0; i < a.tail; ++i) {
      double dot = 0;
      for (int x = 0; x < d; ++x) dot += static_cast<double>(qh[x]) * a.tail_keys[(i * a.kv_heads + kv) * d + x];
      scores.push_back(a.scale * dot);
      values.emplace_back(a.tail_values + (i * a.kv_heads + kv) * d, a.tail_values + (i * a.kv_heads + kv + 1) * d);
    }
    const double M = *std::max_element(scores.begin(), scores.end());
    double L = 0;
    std::vector<double> o(d, 0.0);
    for (size_t j = 0; j < scores.size(); ++j) {
      const double w = std::exp(scores[j] - M);
      L += w;
      for (int x = 0; x < d; ++x) o[x] += w * values[j][x];
    }
    for (int x = 0; x < d; ++x) out[static_cast<size_t>(h) * d + x] = static_cast<float>(o[x] / L);
  }
}

double lla_reconstruct_keys_only(const LlaDecodeArgs& a, int threads) {
  const Geometry g = geometry(a);
  const int T = std::max(1, threads <= 0 ? omp_get_max_threads() : threads);
  const int S = choose_splits(g, a, T, 0), items = a.groups * S, rk = a.keys.rank;
  std::vector<double> step_cos(g.half), step_sin(g.half);
  for (int m = 0; m < g.half; ++m) step_cos[m] = std::cos(a.inv_freq[m]), step_sin[m] = std::sin(a.inv_freq[m]);
  double checksum = 0;
#pragma omp parallel num_threads(std::min(T, items)) if (T > 1 && items > 1) reduction(+ : checksum)
  {
    std::vector<float> keys(static_cast<size_t>(kTile) * g.rows), cs(kTile * g.half), sn(kTile * g.half);
#pragma omp for schedule(static)
    for (int item = 0; item < items; ++item) {
      const int grp = item / S, split = item % S;
      const float* up_k = a.keys.up + static_cast<size_t>(grp) * rk * g.rows;
      const float* mu_k = a.keys.mu + static_cast<size_t>(grp) * g.rows;
      for_tiles(a.history, g.total * split / S, g.total * (split + 1) / S, [&](const Piece& pc) {
        rope_tile(a.inv_freq, step_cos.data(), step_sin.data(), g.half, pc.position, pc.n, cs.data(), sn.data());
        reconstruct_tile(a.key_codes + grp * a.key_group_stride + pc.row * rk, pc.n, rk, up_k, mu_k, g.rows, cs.data(),
                         sn.data(), a.head_dim, keys.data());
        checksum += keys[0];
      });
    }
  }
  return checksum;
}

int64_t lla_decode_bytes_read(const LlaDecodeArgs& a) {
  int64_t rows = 0;
  for (const auto& s : a.history) rows += s.row_end - s.row_begin;
  return rows * a.groups * (a.keys.rank + a.values.rank) * static_cast<int64_t>(sizeof(float));
}

}  // namespace kvx::kernels

#include "kernels/decode_attention.h"

#if !(defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#error "kernels/decode_attention.cpp needs AVX2, FMA and F16C: compile with -march=x86-64-v3 (the project flags)"
#endif

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "util/error.h"

#define KVX_INLINE inline __attribute__((always_inline))

namespace kvx::kernels {

namespace {

constexpr int kTile = 32;  // rows per online-softmax step
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// ---------------------------------------------------------------------------------------------
// Row readers. load8(q, c) returns values 8c..8c+7 of a row as floats, q pointing at the
// row's data (past the fp16 scales for q8/q4, which load8 leaves out: integer q or q - 8).

struct F32Row {
  static constexpr bool kQuant = false;
  static KVX_INLINE __m256 load8(const uint8_t* q, int c) { return _mm256_loadu_ps(reinterpret_cast<const float*>(q) + 8 * c); }
  static float at(const uint8_t* q, int i) {
    float x;
    std::memcpy(&x, q + 4 * i, 4);
    return x;
  }
};

struct BF16Row {
  static constexpr bool kQuant = false;
  static KVX_INLINE __m256 load8(const uint8_t* q, int c) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * c)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  static float at(const uint8_t* q, int i) {
    uint16_t h;
    std::memcpy(&h, q + 2 * i, 2);
    return bf16_to_float(h);
  }
};

struct Q8Row {
  static constexpr bool kQuant = true;
  static KVX_INLINE __m256 load8(const uint8_t* q, int c) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * c));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  }
  static float at(const uint8_t*, int) { return 0.0f; }  // no tails: head_dim % 32 == 0
};

struct Q4Row {
  static constexpr bool kQuant = true;
  // Word c holds nibbles 8c..8c+7; (2^23 + n) - (2^23 + 8) = n - 8 exactly.
  static KVX_INLINE __m256 load8(const uint8_t* q, int c) {
    int32_t w;
    std::memcpy(&w, q + 4 * c, 4);
    __m256i v = _mm256_srlv_epi32(_mm256_set1_epi32(w), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
    v = _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi32(0xf)), _mm256_set1_epi32(0x4b000000));
    return _mm256_sub_ps(_mm256_castsi256_ps(v), _mm256_set1_ps(8388616.0f));
  }
  static float at(const uint8_t*, int) { return 0.0f; }
};

// ---------------------------------------------------------------------------------------------
// Vector helpers.

// Lane i of the result = sum of the lanes of a[i].
KVX_INLINE __m256 reduce8(const __m256* a) {
  const __m256 h0 = _mm256_hadd_ps(a[0], a[1]), h1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 h2 = _mm256_hadd_ps(a[4], a[5]), h3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 h01 = _mm256_hadd_ps(h0, h1), h23 = _mm256_hadd_ps(h2, h3);
  return _mm256_add_ps(_mm256_permute2f128_ps(h01, h23, 0x20), _mm256_permute2f128_ps(h01, h23, 0x31));
}

KVX_INLINE __m128 reduce4(const __m256* a) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

KVX_INLINE float hsum(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

KVX_INLINE float hmax(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}

// e^x = 2^k e^r, k = round(x log2 e), r = x - k ln 2 (two-step), e^r by its degree-7 Taylor
// polynomial (|r| <= 0.347: truncation < 1e-8). x < -87 gives 0 (also for -inf).
KVX_INLINE __m256 exp256(__m256 x) {
  const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), live);
}

// ---------------------------------------------------------------------------------------------
// Scores: out[t * GB + g] = q_g . k_{ti[t]} for TB rows and GB queries (q rows d apart).

// f32 / bf16: TB * GB == 8 accumulators.
template <class R, int GB, int TB>
KVX_INLINE void dot_plain(const float* q, int d, const uint8_t* base, size_t rb, const int* ti, float* out) {
  static_assert(GB * TB == 8, "dot_plain uses 8 accumulators");
  const uint8_t* rows[TB];
  for (int t = 0; t < TB; ++t) rows[t] = base + ti[t] * rb;
  __m256 acc[TB * GB];
  for (int i = 0; i < TB * GB; ++i) acc[i] = _mm256_setzero_ps();
  const int nc = d >> 3;
  for (int c = 0; c < nc; ++c) {
    for (int t = 0; t < TB; ++t) {
      const __m256 k = R::load8(rows[t], c);
      for (int g = 0; g < GB; ++g) acc[t * GB + g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * d + 8 * c), k, acc[t * GB + g]);
    }
  }
  _mm256_storeu_ps(out, reduce8(acc));
  for (int i = nc * 8; i < d; ++i)
    for (int t = 0; t < TB; ++t)
      for (int g = 0; g < GB; ++g) out[t * GB + g] += q[g * d + i] * R::at(rows[t], i);
}

// q8 / q4, GB * TB == 4: per 32-block the dot of q with the integer codes, times the block's
// scale: q . k = sum_b d_b (q_b . code_b).
template <class R, int GB, int TB>
KVX_INLINE void dot_quant(const float* q, int d, const uint8_t* base, size_t rb, size_t qoff, const int* ti,
                          const float* ks, int nb, float* out) {
  static_assert(GB * TB == 4, "dot_quant uses 4 block and 4 total accumulators");
  const uint8_t* rows[TB];
  const float* sc[TB];
  for (int t = 0; t < TB; ++t) {
    rows[t] = base + ti[t] * rb + qoff;
    sc[t] = ks + ti[t] * nb;
  }
  __m256 acc[4];
  for (int i = 0; i < 4; ++i) acc[i] = _mm256_setzero_ps();
  for (int b = 0; b < nb; ++b) {
    __m256 bs[4];
    for (int j = 0; j < 4; ++j) {
      const int c = 4 * b + j;
      for (int t = 0; t < TB; ++t) {
        const __m256 k = R::load8(rows[t], c);
        for (int g = 0; g < GB; ++g) {
          const __m256 qv = _mm256_loadu_ps(q + g * d + 8 * c);
          bs[t * GB + g] = j == 0 ? _mm256_mul_ps(qv, k) : _mm256_fmadd_ps(qv, k, bs[t * GB + g]);
        }
      }
    }
    for (int t = 0; t < TB; ++t) {
      const __m256 s = _mm256_broadcast_ss(sc[t] + b);
      for (int g = 0; g < GB; ++g) acc[t * GB + g] = _mm256_fmadd_ps(bs[t * GB + g], s, acc[t * GB + g]);
    }
  }
  _mm_storeu_ps(out, reduce4(acc));
}

// q8 / q4 with 8 queries on one row: dequantise each 8-chunk once (codes * d_b), 8 FMAs.
template <class R>
KVX_INLINE void dot_quant8(const float* q, int d, const uint8_t* base, size_t rb, size_t qoff, const int* ti,
                           const float* ks, int nb, float* out) {
  const uint8_t* row = base + ti[0] * rb + qoff;
  const float* sc = ks + ti[0] * nb;
  __m256 acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
  for (int b = 0; b < nb; ++b) {
    const __m256 s = _mm256_broadcast_ss(sc + b);
    for (int j = 0; j < 4; ++j) {
      const int c = 4 * b + j;
      const __m256 k = _mm256_mul_ps(R::load8(row, c), s);
      for (int g = 0; g < 8; ++g) acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * d + 8 * c), k, acc[g]);
    }
  }
  _mm256_storeu_ps(out, reduce8(acc));
}

// ---------------------------------------------------------------------------------------------
// Values: acc[g][8c..] += sum_t w(g, t, block of c) * v_t[8c..] for chunks c0..c0+CB-1,
// GB * CB accumulators held in registers across the n rows of the tile.
template <class R, int GB, int CB>
KVX_INLINE void acc_pass(const uint8_t* v0, size_t rb, int n, const float* w, int wg, int wt, float* acc, int d,
                         int c0) {
  __m256 a[GB * CB];
  for (int g = 0; g < GB; ++g)
    for (int cb = 0; cb < CB; ++cb) a[g * CB + cb] = _mm256_loadu_ps(acc + g * d + 8 * (c0 + cb));
  for (int t = 0; t < n; ++t) {
    const uint8_t* row = v0 + t * rb;
    const float* wr = w + t * wt;
    for (int cb = 0; cb < CB; ++cb) {
      const int c = c0 + cb;
      const __m256 v = R::load8(row, c);
      const int blk = R::kQuant ? c >> 2 : 0;
      for (int g = 0; g < GB; ++g)
        a[g * CB + cb] = _mm256_fmadd_ps(_mm256_broadcast_ss(wr + g * wg + blk), v, a[g * CB + cb]);
    }
  }
  for (int g = 0; g < GB; ++g)
    for (int cb = 0; cb < CB; ++cb) _mm256_storeu_ps(acc + g * d + 8 * (c0 + cb), a[g * CB + cb]);
}

template <class R, int GB>
void acc_tile(const uint8_t* v0, size_t rb, int n, const float* w, int wg, int wt, float* acc, int d) {
  constexpr int CB = 8 / GB;
  const int nc = d >> 3;
  int c = 0;
  for (; c + CB <= nc; c += CB) acc_pass<R, GB, CB>(v0, rb, n, w, wg, wt, acc, d, c);
  if constexpr (CB > 4)
    for (; c + 4 <= nc; c += 4) acc_pass<R, GB, 4>(v0, rb, n, w, wg, wt, acc, d, c);
  if constexpr (CB > 2)
    for (; c + 2 <= nc; c += 2) acc_pass<R, GB, 2>(v0, rb, n, w, wg, wt, acc, d, c);
  if constexpr (CB > 1)
    for (; c < nc; ++c) acc_pass<R, GB, 1>(v0, rb, n, w, wg, wt, acc, d, c);
  for (int i = nc * 8; i < d; ++i)  // f32/bf16 widths that are not a multiple of 8
    for (int t = 0; t < n; ++t)
      for (int g = 0; g < GB; ++g) acc[g * d + i] += w[t * wt + g * wg] * R::at(v0 + t * rb, i);
}

// ---------------------------------------------------------------------------------------------
// One piece: KV head h, stored rows [r0, r1), its G queries. Writes m[G], l[G], acc[G][d].

struct Scratch {
  std::vector<float> s, w, ks, vs;
};

Scratch& thread_scratch() {
  thread_local Scratch sc;
  return sc;
}

// fp16 scales of a row -> floats.
KVX_INLINE void load_scales(const uint8_t* row, int nb, float* dst) {
  int b = 0;
  for (; b + 8 <= nb; b += 8)
    _mm256_storeu_ps(dst + b, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * b))));
  for (; b + 4 <= nb; b += 4)
    _mm_storeu_ps(dst + b, _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 2 * b))));
  for (; b < nb; ++b) {
    uint16_t h;
    std::memcpy(&h, row + 2 * b, 2);
    dst[b] = _cvtsh_ss(h);
  }
}

template <class R>
void scores_group(int GB, const float* q, int d, const uint8_t* kbase, size_t rb, size_t qoff, int n, const float* ks,
                  int nb, float* s /* s[g * kTile + t] */) {
  alignas(32) float tmp[8];
  int ti[8];
  auto scatter = [&](int t0, int TB) {
    for (int i = 0; i < TB && t0 + i < n; ++i)
      for (int g = 0; g < GB; ++g) s[g * kTile + t0 + i] = tmp[i * GB + g];
  };
  auto rows = [&](int t0, int TB) {
    for (int i = 0; i < TB; ++i) ti[i] = std::min(t0 + i, n - 1);  // tail: repeat the last row
  };
  if constexpr (!R::kQuant) {
    const int TB = 8 / GB;
    for (int t0 = 0; t0 < n; t0 += TB) {
      rows(t0, TB);
      switch (GB) {
        case 1: dot_plain<R, 1, 8>(q, d, kbase, rb, ti, tmp); break;
        case 2: dot_plain<R, 2, 4>(q, d, kbase, rb, ti, tmp); break;
        case 4: dot_plain<R, 4, 2>(q, d, kbase, rb, ti, tmp); break;
        default: dot_plain<R, 8, 1>(q, d, kbase, rb, ti, tmp); break;
      }
      scatter(t0, TB);
    }
  } else {
    const int TB = GB == 8 ? 1 : 4 / GB;
    for (int t0 = 0; t0 < n; t0 += TB) {
      rows(t0, TB);
      switch (GB) {
        case 1: dot_quant<R, 1, 4>(q, d, kbase, rb, qoff, ti, ks, nb, tmp); break;
        case 2: dot_quant<R, 2, 2>(q, d, kbase, rb, qoff, ti, ks, nb, tmp); break;
        case 4: dot_quant<R, 4, 1>(q, d, kbase, rb, qoff, ti, ks, nb, tmp); break;
        default: dot_quant8<R>(q, d, kbase, rb, qoff, ti, ks, nb, tmp); break;
      }
      scatter(t0, TB);
    }
  }
}

template <class R>
void values_group(int GB, const uint8_t* v0, size_t rb, int n, const float* w, int wg, int wt, float* acc, int d) {
  switch (GB) {
    case 1: acc_tile<R, 1>(v0, rb, n, w, wg, wt, acc, d); break;
    case 2: acc_tile<R, 2>(v0, rb, n, w, wg, wt, acc, d); break;
    case 4: acc_tile<R, 4>(v0, rb, n, w, wg, wt, acc, d); break;
    default: acc_tile<R, 8>(v0, rb, n, w, wg, wt, acc, d); break;
  }
}

struct Piece {
  int head;
  int64_t r0, r1;
};

template <class R>
void run_piece(const KVStore& kv, const Piece& pc, const float* qs /* [G][d], scaled */, int G, float* part) {
  const int d = kv.head_dim(), P = kv.page_tokens();
  const size_t rb = kv.row_bytes();
  const int nb = R::kQuant ? d / kQBlock : 0;
  const size_t qoff = R::kQuant ? 2 * static_cast<size_t>(nb) : 0;
  float* m = part;
  float* l = part + G;
  float* acc = part + 2 * G;
  std::fill(m, m + G, kNegInf);
  std::fill(l, l + G, 0.0f);
  std::fill(acc, acc + static_cast<size_t>(G) * d, 0.0f);

  Scratch& sc = thread_scratch();
  // Weights: plain w(g, t) = s[g][t]; quant w(g, t, b) = p_gt * dv_tb at w[(g * kTile + t) * nb + b].
  sc.s.resize(static_cast<size_t>(G) * kTile);
  if (R::kQuant) {
    sc.w.resize(static_cast<size_t>(G) * kTile * nb);
    sc.ks.resize(static_cast<size_t>(kTile) * nb);
    sc.vs.resize(static_cast<size_t>(kTile) * nb);
  }
  float* s = sc.s.data();
  const float* w = R::kQuant ? sc.w.data() : s;
  const int wg = R::kQuant ? kTile * nb : kTile, wt = R::kQuant ? nb : 1;

  // Query heads go in groups of 8, 4, 2, 1 that share each K/V load.
  auto group = [G](int g0) { return G - g0 >= 8 ? 8 : G - g0 >= 4 ? 4 : G - g0 >= 2 ? 2 : 1; };

  for (int64_t r = pc.r0; r < pc.r1;) {
    const int64_t page = r / P;
    const int off = static_cast<int>(r % P);
    const int n = static_cast<int>(std::min<int64_t>({kTile, pc.r1 - r, P - off}));
    const uint8_t* kb = kv.k_rows(page, pc.head) + off * rb;
    const uint8_t* vb = kv.v_rows(page, pc.head) + off * rb;
    {  // The tiles are read column by column; fetch the next tile's rows (same page) ahead.
      const int nn = static_cast<int>(std::min<int64_t>({kTile, pc.r1 - r - n, P - off - n}));
      const uint8_t* kn = kb + n * rb;
      const uint8_t* vn = vb + n * rb;
      for (size_t o = 0; o < nn * rb; o += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(kn + o), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(vn + o), _MM_HINT_T0);
      }
    }
    if (R::kQuant)
      for (int t = 0; t < n; ++t) {
        load_scales(kb + t * rb, nb, sc.ks.data() + t * nb);
        load_scales(vb + t * rb, nb, sc.vs.data() + t * nb);
      }

    // Scores, padded to a multiple of 8 with -inf.
    const int n8 = (n + 7) & ~7;
    for (int g = 0; g < G; ++g)
      for (int t = n; t < n8; ++t) s[g * kTile + t] = kNegInf;
    for (int g0 = 0, gb; g0 < G; g0 += gb) {
      gb = group(g0);
      scores_group<R>(gb, qs + static_cast<size_t>(g0) * d, d, kb, rb, qoff, n, sc.ks.data(), nb, s + g0 * kTile);
    }

    // Online softmax: m' = max(m, max_t s_t); l = l e^(m - m') + sum_t e^(s_t - m'); acc *= e^(m - m').
    for (int g = 0; g < G; ++g) {
      float* sg = s + g * kTile;
      __m256 mx = _mm256_set1_ps(kNegInf);
      for (int t = 0; t < n8; t += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(sg + t));
      const float mt = hmax(mx);
      if (mt > m[g]) {
        if (m[g] != kNegInf) {
          const float alpha = std::exp(m[g] - mt);
          l[g] *= alpha;
          float* ag = acc + static_cast<size_t>(g) * d;
          const __m256 av = _mm256_set1_ps(alpha);
          int i = 0;
          for (; i + 8 <= d; i += 8) _mm256_storeu_ps(ag + i, _mm256_mul_ps(_mm256_loadu_ps(ag + i), av));
          for (; i < d; ++i) ag[i] *= alpha;
        }
        m[g] = mt;
      }
      const __m256 mv = _mm256_set1_ps(m[g]);
      __m256 sum = _mm256_setzero_ps();
      for (int t = 0; t < n8; t += 8) {
        const __m256 p = exp256(_mm256_sub_ps(_mm256_loadu_ps(sg + t), mv));
        _mm256_storeu_ps(sg + t, p);
        sum = _mm256_add_ps(sum, p);
      }
      l[g] += hsum(sum);
      if (R::kQuant) {  // fold the V block scales into the weights
        float* wq = sc.w.data() + static_cast<size_t>(g) * kTile * nb;
        const float* vs = sc.vs.data();
        if (nb % 4 == 0) {
          for (int t = 0; t < n; ++t) {
            const __m128 p = _mm_set1_ps(sg[t]);
            for (int b = 0; b < nb; b += 4)
              _mm_storeu_ps(wq + t * nb + b, _mm_mul_ps(p, _mm_loadu_ps(vs + t * nb + b)));
          }
        } else {
          for (int t = 0; t < n; ++t)
            for (int b = 0; b < nb; ++b) wq[t * nb + b] = sg[t] * vs[t * nb + b];
        }
      }
    }

    for (int g0 = 0, gb; g0 < G; g0 += gb) {
      gb = group(g0);
      values_group<R>(gb, vb + qoff, rb, n, w + static_cast<size_t>(g0) * wg, wg, wt, acc + static_cast<size_t>(g0) * d, d);
    }
    r += n;
  }
}

void run_piece_any(const KVStore& kv, const Piece& pc, const float* qs, int G, float* part) {
  switch (kv.type()) {
    case KVType::F32: run_piece<F32Row>(kv, pc, qs, G, part); return;
    case KVType::BF16: run_piece<BF16Row>(kv, pc, qs, G, part); return;
    case KVType::Q8: run_piece<Q8Row>(kv, pc, qs, G, part); return;
    case KVType::Q4: run_piece<Q4Row>(kv, pc, qs, G, part); return;
  }
}

void check_args(const float* q, int heads, const KVStore& kv, const float* out, const char* who) {
  if (q == nullptr || out == nullptr) throw Error(std::string(who) + ": q and out must be non-null buffers");
  if (heads < 1 || heads % kv.kv_heads() != 0)
    throw Error(std::string(who) + ": heads (" + std::to_string(heads) + ") must be a positive multiple of kv_heads (" +
                std::to_string(kv.kv_heads()) + "); check the model's num_key_value_heads");
  if (kv.stored() == 0)
    throw Error(std::string(who) + ": the KV store is empty; append the current token's K/V before attending");
}

}  // namespace

int64_t decode_bytes_read(const KVStore& kv) { return kv.bytes(); }

void decode_attention_splits(const float* q, int heads, const KVStore& kv, float scale, float* out, int threads,
                             int splits) {
  check_args(q, heads, kv, out, "decode_attention");
  const int hkv = kv.kv_heads(), G = heads / hkv, d = kv.head_dim();
  const int64_t L = kv.stored(), W = hkv * L;
  const int T = std::max(1, threads <= 0 ? omp_get_max_threads() : threads);
  const int ns = static_cast<int>(std::clamp<int64_t>(splits, 1, W));

  // Caller-side scratch, reused across calls: scaled queries, pieces, partial results.
  thread_local std::vector<float> qs, parts;
  thread_local std::vector<Piece> pieces;
  thread_local std::vector<int> split_begin;
  qs.resize(static_cast<size_t>(heads) * d);
  for (size_t i = 0; i < qs.size(); ++i) qs[i] = q[i] * scale;

  // Split i covers work items [W i / ns, W (i+1) / ns) of the (head, row) order, cut at heads.
  pieces.clear();
  split_begin.assign(ns + 1, 0);
  for (int i = 0; i < ns; ++i) {
    split_begin[i] = static_cast<int>(pieces.size());
    const int64_t hi = W * (i + 1) / ns;
    for (int64_t x = W * i / ns; x < hi;) {
      const int64_t h = x / L, r0 = x % L, r1 = std::min(L, r0 + (hi - x));
      pieces.push_back({static_cast<int>(h), r0, r1});
      x += r1 - r0;
    }
  }
  split_begin[ns] = static_cast<int>(pieces.size());
  const size_t part_size = static_cast<size_t>(G) * (d + 2);
  parts.resize(pieces.size() * part_size);

  const int nt = std::min(T, ns);
  const Piece* pcs = pieces.data();
  const int* sb = split_begin.data();
  float* pp = parts.data();
  const float* qsp = qs.data();
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
  for (int i = 0; i < ns; ++i)
    for (int p = sb[i]; p < sb[i + 1]; ++p)
      run_piece_any(kv, pcs[p], qsp + static_cast<size_t>(pcs[p].head) * G * d, G, pp + p * part_size);

  // Log-sum-exp merge of the pieces of each KV head (pieces are in head order).
  for (size_t p0 = 0; p0 < pieces.size();) {
    const int h = pieces[p0].head;
    size_t p1 = p0;
    while (p1 < pieces.size() && pieces[p1].head == h) ++p1;
    for (int g = 0; g < G; ++g) {
      float M = kNegInf;
      for (size_t p = p0; p < p1; ++p) M = std::max(M, parts[p * part_size + g]);
      float* o = out + (static_cast<size_t>(h) * G + g) * d;
      std::fill(o, o + d, 0.0f);
      float lsum = 0.0f;
      for (size_t p = p0; p < p1; ++p) {
        const float* pt = pp + p * part_size;
        const float e = std::exp(pt[g] - M);
        lsum += e * pt[G + g];
        const float* a = pt + 2 * G + static_cast<size_t>(g) * d;
        for (int i = 0; i < d; ++i) o[i] += e * a[i];
      }
      const float inv = 1.0f / lsum;
      for (int i = 0; i < d; ++i) o[i] *= inv;
    }
    p0 = p1;
  }
}

void decode_attention(const float* q, int heads, const KVStore& kv, float scale, float* out, int threads) {
  check_args(q, heads, kv, out, "decode_attention");
  int T = std::max(1, threads <= 0 ? omp_get_max_threads() : threads);
  constexpr int64_t kMinBytesPerThread = 256 << 10;  // below this a thread costs more than it saves
  T = static_cast<int>(std::clamp<int64_t>(kv.bytes() / kMinBytesPerThread, 1, T));
  decode_attention_splits(q, heads, kv, scale, out, T, T);
}

void decode_attention_reference(const float* q, int heads, const KVStore& kv, float scale, float* out) {
  check_args(q, heads, kv, out, "decode_attention_reference");
  const int hkv = kv.kv_heads(), G = heads / hkv, d = kv.head_dim();
  const int64_t L = kv.stored();
  std::vector<float> k(static_cast<size_t>(L) * d), v(static_cast<size_t>(L) * d);
  std::vector<double> sc(L), o(d);
  for (int h = 0; h < hkv; ++h) {
    for (int64_t j = 0; j < L; ++j) {
      dequantize_row(kv.type(), kv.k_row(j, h), d, k.data() + j * d);
      dequantize_row(kv.type(), kv.v_row(j, h), d, v.data() + j * d);
    }
    for (int g = 0; g < G; ++g) {
      const float* qh = q + (static_cast<size_t>(h) * G + g) * d;
      double mx = -std::numeric_limits<double>::infinity();
      for (int64_t j = 0; j < L; ++j) {
        double dot = 0.0;
        for (int i = 0; i < d; ++i) dot += static_cast<double>(qh[i]) * k[j * d + i];
        sc[j] = dot * scale;
        mx = std::max(mx, sc[j]);
      }
      double sum = 0.0;
      std::fill(o.begin(), o.end(), 0.0);
      for (int64_t j = 0; j < L; ++j) {
        const double p = std::exp(sc[j] - mx);
        sum += p;
        for (int i = 0; i < d; ++i) o[i] += p * v[j * d + i];
      }
      float* oh = out + (static_cast<size_t>(h) * G + g) * d;
      for (int i = 0; i < d; ++i) oh[i] = static_cast<float>(o[i] / sum);
    }
  }
}

}  // namespace kvx::kernels

// AVX2 back end of decode_attention and the dispatch (decode_attention.h); the measurements behind
// its choices are in docs/decode-kernels.md.
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
#include <numeric>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/decode_attention_isa.h"
#include "kernels/simd_avx2.h"
#include "util/error.h"


namespace kvx::kernels {

namespace {

// Rows per online-softmax step (PieceRunner::kTileRows): 24 for f32/bf16 (a multiple of their
// 8/6/3-row score blocks; smaller tiles keep the current and the prefetched tile in L1: 24 beats 32
// streaming from memory). q8/q4 are compute-bound and 64 rows halve the per-tile work (scale
// transposes, softmax reductions).
constexpr int kTile = 64;          // the largest tile: scratch strides
constexpr int kRow = kTile + 12;   // score row stride (room for a 12-wide tail)
// Software prefetch distance: the larger of one tile and 4 KB (f32/bf16) or 8 KB (q8/q4), so a
// tile's rows are requested while earlier tiles are computed (measured best; shorter distances
// leave misses exposed, longer ones lose lines from L1 before use).
constexpr size_t kAheadBytesPlain = 4096, kAheadBytesQuant = 8192;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// ---------------------------------------------------------------------------------------------
// Row readers.
//
// f32 / bf16: load8(row, c) = values 8c..8c+7 as floats. bf16 also has load_pair(row, j, a, b):
// values 16j..16j+15 from one 32-byte load without shuffles, a = even positions (dword << 16),
// b = odd positions (dword & 0xffff0000); the query is permuted to match and the V accumulator
// un-permuted at the end (kPair).
// q8 / q4 values (their keys are scored in integers, int_token_scores): load_half(data, h, a, b)
// = the 16 codes of half-block h (data points past the fp16 scales) as two float vectors,
// without the scale. q8: a = codes 0-7, b = 8-15 of the half. q4: a = nibbles n at even
// positions 0, 2, .., 14, b = odd positions, so one byte-to-dword widening serves both (the V
// accumulator is un-permuted at the end). load_half leaves q4's offset 8 out, taken out after
// the fact: sum_t w_t (n_t - 8) = sum_t w_t n_t - 8 sum_t w_t.

struct F32Row {
  static constexpr bool kQuant = false, kOffset8 = false, kPair = false;
  static KVX_INLINE __m256 load8(const uint8_t* q, int c) { return _mm256_loadu_ps(reinterpret_cast<const float*>(q) + 8 * c); }
  static float at(const uint8_t* q, int i) {
    float x;
    std::memcpy(&x, q + 4 * i, 4);
    return x;
  }
};

struct BF16Row {
  static constexpr bool kQuant = false, kOffset8 = false, kPair = true;
  static KVX_INLINE __m256 load8(const uint8_t* q, int c) { return bf16x8_to_ps(q + 16 * c); }
  // kLowReg: clear the low halves with two shifts instead of an AND, saving the mask register.
  template <bool kLowReg = false>
  static KVX_INLINE void load_pair(const uint8_t* q, int j, __m256& a, __m256& b) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * j));
    a = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
    if constexpr (kLowReg)
      b = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(w, 16), 16));
    else
      b = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
  }
  static float at(const uint8_t* q, int i) {
    uint16_t h;
    std::memcpy(&h, q + 2 * i, 2);
    return bf16_to_float(h);
  }
};

struct Q8Row {
  static constexpr bool kQuant = true, kOffset8 = false, kPair = false;
  static KVX_INLINE void load_half(const uint8_t* q, int h, __m256& a, __m256& b) {
    const uint8_t* p = q + 16 * h;
    a = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    b = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))));
  }
};

struct Q4Row {
  static constexpr bool kQuant = true, kOffset8 = true, kPair = false;
  static KVX_INLINE void load_half(const uint8_t* q, int h, __m256& a, __m256& b) {
    const __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * h)));
    a = _mm256_cvtepi32_ps(_mm256_and_si256(w, _mm256_set1_epi32(0xf)));
    b = _mm256_cvtepi32_ps(_mm256_srli_epi32(w, 4));
  }
};

// Software prefetch of one stream (K or V rows of one head): bytes [from, to) + dist past
// `base` (the tile start), which runs on for `end` bytes on this page, then continues at
// `next` (the head's rows on the next page) for `next_end` bytes; nothing past the piece.
// share(i, k, bytes): a copy that maps the offsets [0, bytes) it is given onto the i-th of k
// equal parts of them, so that k readers of one tile (LRKV's groups of query heads) each fetch a
// part of the next tile's rows along their own work.
struct Prefetch {
  const uint8_t *base, *next;
  size_t dist, end, next_end;
  size_t from0 = 0, shares = 1;
  Prefetch share(int i, int k, size_t bytes) const {
    Prefetch p = *this;
    p.from0 = bytes * i / k;
    p.shares = k;
    return p;
  }
  KVX_INLINE void rows(size_t from, size_t to) const {
    from = from0 + from / shares + dist;
    to = from0 + to / shares + dist;
    for (size_t o = from & ~size_t{63}; o < std::min(to, end); o += 64)
      _mm_prefetch(reinterpret_cast<const char*>(base + o), _MM_HINT_T0);
    if (to > end && next) {
      const size_t f = from > end ? from - end : 0, t = std::min(to - end, next_end);
      for (size_t o = f & ~size_t{63}; o < t; o += 64) _mm_prefetch(reinterpret_cast<const char*>(next + o), _MM_HINT_T0);
    }
  }
};

// ---------------------------------------------------------------------------------------------
// Scores for TB rows x GB queries: s[g * kRow + t] = q_g . k_t, t < TB (rows past the tile's
// end repeat its last row; their scores land in the padding and are overwritten).

// f32 / bf16: GB * TB = 8 or 12 accumulators (fewer would make the FMA latency the bound), q
// rows d floats apart. kAdd: s += (LRKV's latent scores onto the shared ones).
template <class R, int GB, int TB, bool kAdd = false>
KVX_INLINE void dot_plain(const float* q, int d, const uint8_t* const* rows, float* s) {
  constexpr int NA = GB * TB;
  static_assert(NA == 12 || NA == 8 || NA == 4, "dot_plain reduces 4, 8 or 12 accumulators");
  __m256 acc[NA];
  for (int i = 0; i < NA; ++i) acc[i] = _mm256_setzero_ps();
  const int nc = d >> 3;
  int c = 0;
  if constexpr (R::kPair)
    for (; c + 2 <= nc; c += 2)
      for (int t = 0; t < TB; ++t) {
        __m256 ka, kb;
        R::template load_pair<(GB * TB > 8)>(rows[t], c >> 1, ka, kb);
        for (int g = 0; g < GB; ++g) {
          acc[g * TB + t] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * d + 8 * c), ka, acc[g * TB + t]);
          acc[g * TB + t] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * d + 8 * c + 8), kb, acc[g * TB + t]);
        }
      }
  for (; c < nc; ++c)
    for (int t = 0; t < TB; ++t) {
      const __m256 k = R::load8(rows[t], c);
      for (int g = 0; g < GB; ++g)
        acc[g * TB + t] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * d + 8 * c), k, acc[g * TB + t]);
    }
  alignas(32) float r[12];
  if constexpr (NA >= 8) _mm256_store_ps(r, reduce8(acc));
  if constexpr (NA != 8) _mm_store_ps(r + NA - 4, reduce4(acc + NA - 4));
  for (int i = nc * 8; i < d; ++i)  // widths that are not a multiple of 8
    for (int g = 0; g < GB; ++g)
      for (int t = 0; t < TB; ++t) r[g * TB + t] += q[g * d + i] * R::at(rows[t], i);
  if constexpr (GB == 1 && TB == 8) {  // one vector of 8 rows' scores
    const __m256 v = _mm256_load_ps(r);
    _mm256_storeu_ps(s, kAdd ? _mm256_add_ps(_mm256_loadu_ps(s), v) : v);
  } else {
    for (int g = 0; g < GB; ++g)
      for (int t = 0; t < TB; ++t) s[g * kRow + t] = kAdd ? s[g * kRow + t] + r[g * TB + t] : r[g * TB + t];
  }
}

// q8 / q4 scores in integers with tokens in lanes (the AVX-512 back end's token_scores, with
// vpmaddubsw standing in for its VNNI): 8 rows' code words transposed so that lane t of w[i]
// holds word i of row t, dotted with the query's int8 codes (prepare_int_queries) broadcast a
// word at a time; no horizontal sums, and the transpose is shared by all G queries (LRKV: the H
// heads on one K_s). Against dequantise-then-FMA: a dense Hkv=4 q4 call at 16K in cache, one
// thread, 4.7-5.0 -> 2.6-3.0 ms on Zen 3.
// q4: nibbles (value + 8) x codes, 8 products summed in int16 (|.| <= 8 x 2 x 15 x 127 = 30480),
// then one vpmaddwd and the query's bias -8 sum(codes).
// q8: |k| x (codes with k's sign) (vpsignb; a pair sum <= 2 x 128 x 127 fits int16), to int32
// per word. Its rows are read signed, so the query's bias (for AVX-512's unsigned rows) is unused.

// w[i] lane t = word i (i < 4) of the 16 bytes at rows[t] + offset, t < 8.
KVX_INLINE void transpose_words8x4(const uint8_t* const* rows, size_t offset, __m256i* w) {
  __m256i y[4];  // [row k | row k + 4]
  for (int k = 0; k < 4; ++k)
    y[k] = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[k] + offset))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[k + 4] + offset)), 1);
  // 4 x 4 word transposes in each 128-bit lane (rows 0-3 low, 4-7 high)
  const __m256i a = _mm256_unpacklo_epi32(y[0], y[1]), c = _mm256_unpackhi_epi32(y[0], y[1]);
  const __m256i e = _mm256_unpacklo_epi32(y[2], y[3]), f = _mm256_unpackhi_epi32(y[2], y[3]);
  w[0] = _mm256_unpacklo_epi64(a, e);
  w[1] = _mm256_unpackhi_epi64(a, e);
  w[2] = _mm256_unpacklo_epi64(c, f);
  w[3] = _mm256_unpackhi_epi64(c, f);
}

// s[g * kRow + t] (kAdd: +=) q_g . k_t for 8 rows (codes at rows[t], nb blocks) and G integer
// queries qstride floats apart; kT: the rows' K block scales, block b at kT + b * kTile.
// GB = G <= 4 known at compile time keeps the partial scores in registers across the blocks;
// GB = 0 (any G: LRKV's H heads) passes them through s (through memory they were a store-load
// chain: 17% of a dense Hkv=4 q8 call).
template <class R, bool kAdd, int GB>
KVX_INLINE void int_token_scores(const uint8_t* const* rows, int nb, const float* q, size_t qstride, int G,
                                 const float* kT, float* s) {
  static_assert(GB >= 0 && GB <= 4, "int_token_scores keeps up to 4 queries' scores in registers");
  if constexpr (GB > 0) G = GB;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 part[GB > 0 ? GB : 1];
  for (auto& x : part) x = _mm256_setzero_ps();
  // s_g += dot * d_k d_q (through s: the first part of a score without kAdd sets s_g)
  auto accumulate = [&](int g, bool first, __m256i dot, __m256 dk, const float* dq) __attribute__((always_inline)) {
    const __m256 scale = _mm256_mul_ps(dk, _mm256_broadcast_ss(dq));
    if constexpr (GB > 0) {
      part[g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, part[g]);
    } else {
      float* sg = s + g * kRow;
      const __m256 prev = kAdd || !first ? _mm256_loadu_ps(sg) : _mm256_setzero_ps();
      _mm256_storeu_ps(sg, _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, prev));
    }
  };
  for (int b = 0; b < nb; ++b) {
    const __m256 dk = _mm256_loadu_ps(kT + b * kTile);
    if constexpr (R::kOffset8) {  // q4: 16 bytes a block, low nibbles pair with words 0-3, high with 4-7
      __m256i w[4], u[8];
      transpose_words8x4(rows, 16 * static_cast<size_t>(b), w);
      const __m256i lo4 = _mm256_set1_epi8(0x0f);
      for (int i = 0; i < 4; ++i) {
        u[i] = _mm256_and_si256(w[i], lo4);
        u[4 + i] = _mm256_and_si256(_mm256_srli_epi16(w[i], 4), lo4);
      }
      for (int g = 0; g < G; ++g) {
        const float* qg = q + g * qstride;
        const float* words = qg + 8 * b;  // int32 words, broadcast as floats
        auto word = [&](int i) { return _mm256_castps_si256(_mm256_broadcast_ss(words + i)); };
        __m256i lo = _mm256_maddubs_epi16(u[0], word(0)), hi = _mm256_maddubs_epi16(u[4], word(4));
        for (int i = 1; i < 4; ++i) {
          lo = _mm256_add_epi16(lo, _mm256_maddubs_epi16(u[i], word(i)));
          hi = _mm256_add_epi16(hi, _mm256_maddubs_epi16(u[4 + i], word(4 + i)));
        }
        const __m256i bias = _mm256_castps_si256(_mm256_broadcast_ss(qg + 8 * nb + b));
        accumulate(g, b == 0, _mm256_add_epi32(_mm256_madd_epi16(_mm256_add_epi16(lo, hi), ones), bias), dk, qg + 9 * nb + b);
      }
    } else {  // q8: 32 bytes a block, in two halves of 4 words
      for (int h = 0; h < 2; ++h) {
        __m256i w[4], mag[4];
        transpose_words8x4(rows, 32 * static_cast<size_t>(b) + 16 * h, w);
        for (int i = 0; i < 4; ++i) mag[i] = _mm256_sign_epi8(w[i], w[i]);
        for (int g = 0; g < G; ++g) {
          const float* qg = q + g * qstride;
          const float* words = qg + 8 * b + 4 * h;
          auto product = [&](int i) {
            const __m256i signed_q = _mm256_sign_epi8(_mm256_castps_si256(_mm256_broadcast_ss(words + i)), w[i]);
            return _mm256_madd_epi16(_mm256_maddubs_epi16(mag[i], signed_q), ones);
          };
          const __m256i dot = _mm256_add_epi32(_mm256_add_epi32(product(0), product(1)), _mm256_add_epi32(product(2), product(3)));
          accumulate(g, b == 0 && h == 0, dot, dk, qg + 9 * nb + b);
        }
      }
    }
  }
  if constexpr (GB > 0)
    for (int g = 0; g < GB; ++g) {
      float* sg = s + g * kRow;
      _mm256_storeu_ps(sg, kAdd ? _mm256_add_ps(_mm256_loadu_ps(sg), part[g]) : part[g]);
    }
}

// The head segments of latent block b (values [32 b, 32 b + 32) of the flat [H][r] row), in order:
// f(h, c0, c1) for head h's columns [c0, c1). (The AVX-512 back end has its own copy: it may not
// share inline code with this file, decode_attention_isa.h.)
template <class F>
KVX_INLINE void for_block_segments(int b, int r, F&& f) {
  int h = 32 * b / r;
  for (int c0 = 32 * b, c1; c0 < 32 * b + 32; c0 = c1, ++h) {
    c1 = std::min((h + 1) * r, 32 * b + 32);
    f(h, c0, c1);
  }
}

// LRKV's q8/q4 latents whose blocks straddle heads (r % 32 != 0), each head's segment of a block
// whole row words (latent_segments_in_words): s[h * kRow + t] += qb_h . R_h,t for 8 rows (codes at rows[t], nb
// blocks), in integers against the flat [H][r] integer query qi (prepare_int_queries of width H r:
// the reference's rounding of qb), one transpose of the rows' words a block for all its heads,
// each word's products as int_token_scores', summed per segment; q4 adds seg_bias (-8 times the
// scales, block b at kT + b * kTile. Faster than dequantising the tile's latent K rows and scoring
// them in floats.
template <class R>
KVX_INLINE void int_segment_scores(const uint8_t* const* rows, int nb, int r, const float* qi, const int32_t* seg_bias,
                                   const float* kT, float* s) {
  constexpr int kUnit = R::kOffset8 ? 8 : 4;  // values per row word
  const __m256i ones = _mm256_set1_epi16(1);
  const float* dq = qi + 9 * nb;
  for (int b = 0; b < nb; ++b) {
    const float* words = qi + 8 * b;
    auto word = [&](int i) { return _mm256_castps_si256(_mm256_broadcast_ss(words + i)); };
    __m256i dot[8];  // lane t: row t's word i dotted with the query's
    if constexpr (R::kOffset8) {
      __m256i w[4];
      transpose_words8x4(rows, 16 * static_cast<size_t>(b), w);
      const __m256i lo4 = _mm256_set1_epi8(0x0f);
      for (int i = 0; i < 4; ++i) {
        const __m256i lo = _mm256_and_si256(w[i], lo4), hi = _mm256_and_si256(_mm256_srli_epi16(w[i], 4), lo4);
        dot[i] = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, word(i)), _mm256_maddubs_epi16(hi, word(4 + i))), ones);
      }
    } else {
      for (int half = 0; half < 2; ++half) {
        __m256i w[4];
        transpose_words8x4(rows, 32 * static_cast<size_t>(b) + 16 * half, w);
        for (int i = 0; i < 4; ++i)
          dot[4 * half + i] = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w[i], w[i]), _mm256_sign_epi8(word(4 * half + i), w[i])), ones);
      }
    }
    const __m256 scale = _mm256_mul_ps(_mm256_loadu_ps(kT + static_cast<size_t>(b) * kTile), _mm256_broadcast_ss(dq + b));
    for_block_segments(b, r, [&](int h, int c0, int c1) {
      const int w0 = (c0 - 32 * b) / kUnit, w1 = (c1 - 32 * b) / kUnit;
      __m256i sum = dot[w0];
      for (int i = w0 + 1; i < w1; ++i) sum = _mm256_add_epi32(sum, dot[i]);
      if constexpr (R::kOffset8) sum = _mm256_add_epi32(sum, _mm256_set1_epi32(*seg_bias++));
      float* sh = s + h * kRow;
      _mm256_storeu_ps(sh, _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), scale, _mm256_loadu_ps(sh)));
    });
  }
}

// ---------------------------------------------------------------------------------------------
// Values: acc[g][..] += sum_t w(g, t, block) * v_t[..] over the n rows of a tile, 8
// accumulators held in registers across the rows. Weight of (g, t): f32/bf16 w[g*wg + t], q8/q4
// per block b w[g*wg + b*kTile + t] (fold_value_scales).
// Passes of 4 or fewer accumulators (LRKV's latents: one query, r values) keep two sets, for even
// and odd rows, so that the FMA latency does not bound them.

// row_into(t, a) adds row t into the accumulators a, for rows [0, n); with NS = 2 sets, even rows
// go to sets[0] and odd ones to sets[1] (zeroed here), merged into sets[0] at the end.
template <int NS, int NA, class RowInto>
KVX_INLINE void accumulate_rows(int n, __m256 (*sets)[NA], const RowInto& row_into) {
  if constexpr (NS == 2)
    for (int i = 0; i < NA; ++i) sets[1][i] = _mm256_setzero_ps();
  int t = 0;
  if constexpr (NS == 2)
    for (; t + 2 <= n; t += 2) {
      row_into(t, sets[0]);
      row_into(t + 1, sets[1]);
    }
  for (; t < n; ++t) row_into(t, sets[0]);
  if constexpr (NS == 2)
    for (int i = 0; i < NA; ++i) sets[0][i] = _mm256_add_ps(sets[0][i], sets[1][i]);
}

// f32 / bf16: chunks c0 .. c0 + CB - 1.
template <class R, int GB, int CB>
KVX_INLINE void acc_pass_plain(const uint8_t* v0, size_t rb, int n, const float* w, int wg, float* acc, int d, int c0) {
  constexpr int NA = GB * CB, NS = NA <= 4 ? 2 : 1;
  __m256 sets[NS][NA];
  for (int g = 0; g < GB; ++g)
    for (int cb = 0; cb < CB; ++cb) sets[0][g * CB + cb] = _mm256_loadu_ps(acc + g * d + 8 * (c0 + cb));
  auto row_into = [&](int t, __m256* a) __attribute__((always_inline)) {
    const uint8_t* row = v0 + t * rb;
    if constexpr (R::kPair && CB % 2 == 0) {  // c0 is even here: passes of 2+ chunks start at pairs
      for (int cb = 0; cb < CB; cb += 2) {
        __m256 va, vb;
        R::template load_pair<false>(row, (c0 + cb) >> 1, va, vb);
        for (int g = 0; g < GB; ++g) {
          const __m256 wv = _mm256_broadcast_ss(w + g * wg + t);
          a[g * CB + cb] = _mm256_fmadd_ps(wv, va, a[g * CB + cb]);
          a[g * CB + cb + 1] = _mm256_fmadd_ps(wv, vb, a[g * CB + cb + 1]);
        }
      }
    } else {
      for (int cb = 0; cb < CB; ++cb) {
        const __m256 v = R::load8(row, c0 + cb);
        for (int g = 0; g < GB; ++g) a[g * CB + cb] = _mm256_fmadd_ps(_mm256_broadcast_ss(w + g * wg + t), v, a[g * CB + cb]);
      }
    }
  };
  accumulate_rows<NS, NA>(n, sets, row_into);
  for (int g = 0; g < GB; ++g)
    for (int cb = 0; cb < CB; ++cb) _mm256_storeu_ps(acc + g * d + 8 * (c0 + cb), sets[0][g * CB + cb]);
}

// The V prefetch is spread over the passes: pass p of np fetches rows [p n / np, (p+1) n / np)
// of the tile `ahead` (one burst per tile would leave the memory idle during the other passes).
// `also` (with rb2 bytes per row of progress): a second stream fetched along (LRKV's latent rows
// during the shared phases).
struct PassPrefetch {
  const Prefetch* pf;
  size_t rb;
  int n, np;
  const Prefetch* also = nullptr;
  size_t rb2 = 0;
  int p = 0;
  KVX_INLINE void next() {
    if (p < np) {
      const size_t t0 = static_cast<size_t>(p * n / np), t1 = static_cast<size_t>((p + 1) * n / np);
      if (pf) pf->rows(t0 * rb, t1 * rb);
      if (also) also->rows(t0 * rb2, t1 * rb2);
    }
    ++p;
  }
};

// Rows go in blocks of row_block through all the passes (a pass reads a few lines of every row
// of its block). Where one group of queries is the only reader of the tile from memory, blocks of
// 8 rows beat whole tiles: dense Hkv=4 f32 at 16K, caches emptied, Zen 3, 4-20% faster in each of
// 10 alternating rounds. LRKV's four groups over one V_s tile keep whole tiles (8 was slower).
template <class R, int GB>
void acc_tile_plain(const uint8_t* v0, size_t rb, int n, const float* w, int wg, float* acc, int d, const Prefetch* pf,
                    int row_block, const Prefetch* also = nullptr, size_t also_rb = 0) {
  constexpr int CB = 8 / GB;
  const int nc = d >> 3, nblk = (n + row_block - 1) / row_block;
  PassPrefetch pp{pf, rb, n, nblk * std::max(1, (nc + CB - 1) / CB), also, also_rb};
  for (int t0 = 0; t0 < n; t0 += row_block) {
    const uint8_t* vb = v0 + t0 * rb;
    const float* wb = w + t0;
    const int m = std::min(row_block, n - t0);
    int c = 0;
    for (; c + CB <= nc; c += CB, pp.next()) acc_pass_plain<R, GB, CB>(vb, rb, m, wb, wg, acc, d, c);
    if constexpr (CB > 4)
      for (; c + 4 <= nc; c += 4, pp.next()) acc_pass_plain<R, GB, 4>(vb, rb, m, wb, wg, acc, d, c);
    if constexpr (CB > 2)
      for (; c + 2 <= nc; c += 2, pp.next()) acc_pass_plain<R, GB, 2>(vb, rb, m, wb, wg, acc, d, c);
    if constexpr (CB > 1)
      for (; c < nc; ++c, pp.next()) acc_pass_plain<R, GB, 1>(vb, rb, m, wb, wg, acc, d, c);
  }
  while (pp.p < pp.np) pp.next();
  for (int i = nc * 8; i < d; ++i)
    for (int t = 0; t < n; ++t)
      for (int g = 0; g < GB; ++g) acc[g * d + i] += w[g * wg + t] * R::at(v0 + t * rb, i);
}

// q8 / q4: half-blocks h0 .. h0 + HB - 1 (16 values each, in the reader's lane order).
template <class R, int GB, int HB>
KVX_INLINE void acc_pass_quant(const uint8_t* v0, size_t rb, int n, const float* w, int wg, int nb, float* acc, int d,
                               int h0) {
  static_assert(GB * HB <= 4, "acc_pass_quant uses up to 8 accumulators");
  constexpr int NA = 2 * GB * HB, NS = NA <= 4 ? 2 : 1;
  __m256 sets[NS][NA];  // [g * 2 HB + i]
  for (int g = 0; g < GB; ++g)
    for (int i = 0; i < 2 * HB; ++i) sets[0][g * 2 * HB + i] = _mm256_loadu_ps(acc + g * d + 16 * h0 + 8 * i);
  auto row_into = [&](int t, __m256* a) __attribute__((always_inline)) {
    const uint8_t* row = v0 + t * rb;
    const float* wt = w + t;
    for (int h = 0; h < HB; ++h) {
      __m256 va, vb;
      R::load_half(row, h0 + h, va, vb);
      const int blk = (h0 + h) >> 1;
      for (int g = 0; g < GB; ++g) {
        const __m256 wv = _mm256_broadcast_ss(wt + g * wg + blk * kTile);
        a[g * 2 * HB + 2 * h] = _mm256_fmadd_ps(wv, va, a[g * 2 * HB + 2 * h]);
        a[g * 2 * HB + 2 * h + 1] = _mm256_fmadd_ps(wv, vb, a[g * 2 * HB + 2 * h + 1]);
      }
    }
  };
  accumulate_rows<NS, NA>(n, sets, row_into);
  for (int g = 0; g < GB; ++g)
    for (int i = 0; i < 2 * HB; ++i) _mm256_storeu_ps(acc + g * d + 16 * h0 + 8 * i, sets[0][g * 2 * HB + i]);
}

template <class R, int GB>
void acc_tile_quant(const uint8_t* v0, size_t rb, int n, const float* w, int wg, int nb, float* acc, int d,
                    const Prefetch* pf) {
  constexpr int HB = 4 / GB;
  const int nh = 2 * nb;  // a multiple of 2
  PassPrefetch pp{pf, rb, n, (nh + HB - 1) / HB};
  int h = 0;
  for (; h + HB <= nh; h += HB, pp.next()) acc_pass_quant<R, GB, HB>(v0, rb, n, w, wg, nb, acc, d, h);
  if constexpr (HB > 2)
    for (; h < nh; h += 2, pp.next()) acc_pass_quant<R, GB, 2>(v0, rb, n, w, wg, nb, acc, d, h);
}

// ---------------------------------------------------------------------------------------------
// Pieces: KV head h, stored rows [r0, r1), its G queries -> partial m[G], l[G], acc[G][d]; with
// LRKV's latents also acc_r[G][r].

struct Scratch {
  std::vector<float> s, w, ks, vs;
  std::vector<float> rks, rvs, wr, rk, rv;  // LRKV latents: block scales, value weights, dequantised rows
  std::vector<int> seg_of;                  // latent_code_values: each vector's segment,
  std::vector<float> wsum;                  // and q4's weight sums per segment
  std::vector<uint8_t> krows, vrows;        // a Tiled16 store's tile, copied out as rows
};

Scratch& thread_scratch() {
  thread_local Scratch sc;
  return sc;
}

// The nb fp16 block scales at the start of the n rows of a tile (rb bytes apart) as floats,
// token-major per block as the integer scores and the value weights read them: dst[b * kTile + t].
// 8 rows x 4 scales at a time by a 16-bit transpose (a scalar loop was 7% of a dense q4 call);
// rows up to the next multiple of 8 repeat the last.
KVX_INLINE void load_scales_transposed(const uint8_t* rows0, size_t rb, int n, int nb, float* dst) {
  for (int t0 = 0; t0 < n; t0 += 8) {
    const uint8_t* row[8];
    for (int i = 0; i < 8; ++i) row[i] = rows0 + std::min(t0 + i, n - 1) * rb;
    int b = 0;
    for (; b + 4 <= nb; b += 4) {
      __m256i y[4];  // [row k scales b..b+3 | row k + 4's]
      for (int k = 0; k < 4; ++k)
        y[k] = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row[k] + 2 * b))),
                                       _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row[k + 4] + 2 * b)), 1);
      const __m256i a = _mm256_unpacklo_epi16(y[0], y[1]), c = _mm256_unpacklo_epi16(y[2], y[3]);
      // per 128-bit lane: scales b, b+1 (01) or b+2, b+3 (23) of 4 rows each; then rows 0-7 per scale
      const __m256i s01 = _mm256_permute4x64_epi64(_mm256_unpacklo_epi32(a, c), 0xd8);
      const __m256i s23 = _mm256_permute4x64_epi64(_mm256_unpackhi_epi32(a, c), 0xd8);
      float* o = dst + static_cast<size_t>(b) * kTile + t0;
      _mm256_storeu_ps(o, _mm256_cvtph_ps(_mm256_castsi256_si128(s01)));
      _mm256_storeu_ps(o + kTile, _mm256_cvtph_ps(_mm256_extracti128_si256(s01, 1)));
      _mm256_storeu_ps(o + 2 * kTile, _mm256_cvtph_ps(_mm256_castsi256_si128(s23)));
      _mm256_storeu_ps(o + 3 * kTile, _mm256_cvtph_ps(_mm256_extracti128_si256(s23, 1)));
    }
    for (; b < nb; ++b)
      for (int i = 0; i < 8; ++i) {
        uint16_t h;
        std::memcpy(&h, row[i] + 2 * b, 2);
        dst[b * kTile + t0 + i] = _cvtsh_ss(h);
      }
  }
}

// Query heads go in groups of 4, 2, 1 that share each K/V load (larger groups re-read the tile
// from L1).
KVX_INLINE int group_size(int G, int g0) {
  const int left = G - g0;
  return left >= 4 ? 4 : left >= 2 ? 2 : 1;
}

// f32 / bf16 scores of GB queries against a tile (q8/q4: int_token_scores). One query takes 8 rows
// at a time, not 12: fewer rows in flight, and bf16 keeps its mask register; bf16 4 rows (1 KB).
// Heads in lanes (as the AVX-512 back end's head_lane_scores) ran faster in cache but not cold, so
// this back end keeps query groups.
// also / also_rb: a second stream fetched along, as PassPrefetch.
template <class R>
void scores_tile(int GB, const float* q, int d, const uint8_t* kb, size_t rb, int n, float* s, const Prefetch* pf,
                 const Prefetch* also = nullptr, size_t also_rb = 0) {
  const uint8_t* rows[12];
  const int TB = GB == 1 ? (R::kPair ? 4 : 8) : 12 / GB;
  for (int t0 = 0; t0 < n; t0 += TB) {
    if (pf) pf->rows(t0 * rb, (t0 + TB) * rb);
    if (also) also->rows(t0 * also_rb, std::min(t0 + TB, n) * also_rb);
    for (int i = 0; i < TB; ++i) rows[i] = kb + std::min(t0 + i, n - 1) * rb;
    switch (GB) {
      case 1:
        if constexpr (R::kPair)
          dot_plain<R, 1, 4>(q, d, rows, s + t0);
        else
          dot_plain<R, 1, 8>(q, d, rows, s + t0);
        break;
      case 2: dot_plain<R, 2, 6>(q, d, rows, s + t0); break;
      default: dot_plain<R, 4, 3>(q, d, rows, s + t0); break;
    }
  }
}

using Piece = detail::DecodePiece;

// x[0, n) *= alpha (the online softmax's rescale of an accumulator).
KVX_INLINE void scale_floats(float* x, int n, float alpha) {
  const __m256 av = _mm256_set1_ps(alpha);
  int i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), av));
  for (; i < n; ++i) x[i] *= alpha;
}

// q8/q4 value weights of a tile, token-major per block (like the K scales, see
// load_scales_transposed): wq[b kTile + t] = p[t] vsT[b kTile + t] (the probabilities times the
// rows' V block scales) for t < n8 (a multiple of 8; p is 0 past the tile's rows), nb blocks;
// kSum (q4's offset): also ws[b] = sum_t wq[b kTile + t]. 8 rows to a vector (the row-major
// scales took a broadcast per row and block: 4x the instructions).
template <bool kSum>
KVX_INLINE void fold_value_scales(const float* p, int n8, const float* vsT, int nb, float* wq, float* ws) {
  for (int b = 0; b < nb; ++b) {
    __m256 sum = _mm256_setzero_ps();
    for (int t = 0; t < n8; t += 8) {
      const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(p + t), _mm256_loadu_ps(vsT + b * kTile + t));
      _mm256_storeu_ps(wq + b * kTile + t, x);
      if constexpr (kSum) sum = _mm256_add_ps(sum, x);
    }
    if constexpr (kSum) ws[b] = hsum(sum);
  }
}

// q4's offset: sum_t w (n - 8) = sum_t w n - 8 sum_t w, for `heads` accumulators `w` floats apart
// of nb blocks each, ws[h nb + b] the weight sums.
KVX_INLINE void subtract_q4_offset(float* acc, int heads, int w, int nb, const float* ws) {
  for (int h = 0; h < heads; ++h)
    for (int b = 0; b < nb; ++b) {
      const __m256 c = _mm256_set1_ps(8.0f * ws[h * nb + b]);
      float* ab = acc + static_cast<size_t>(h) * w + 32 * b;
      for (int i = 0; i < 32; i += 8) _mm256_storeu_ps(ab + i, _mm256_sub_ps(_mm256_loadu_ps(ab + i), c));
    }
}

// Prefetch of LRKV's q8/q4 latent rows, read head by head: a head's share of the next tile over
// this many bytes is fetched in parts spread over its score blocks and value parts (bursts of 48
// lines stalled on outstanding misses), smaller shares (q8/q4 at r=32, 1.1 KB) in one burst per
// head (1-2% faster so). f32/bf16: PieceRunner::prefetch_block_share, latent_values_by_rows.
constexpr size_t kLatentBurstBytes = 2048;
// f32/bf16 latent rows up to this many bytes are fetched whole during LRKV's shared phases, longer
// ones half there (PieceRunner::latent_split_).
constexpr size_t kLatentInSharedBytes = 1024;

// LRKV's latent path (lrkv_decode.h): a second store whose row per token is [R_0 | .. | R_{G-1}]
// (r values per query head), scored onto the shared scores and accumulated with the same
// weights, head by head.
struct Latents {
  const KVStore* store = nullptr;
  const float* qb = nullptr;  // detail::avx2_prepare_latent_queries
  size_t qb_stride = 0;       // floats per head
  int r = 0;
  // q8/q4 latents straddling heads in segments of whole row words (latent_segments_in_words): the
  // flat integer query and q4's segment biases (int_segment_scores), instead of qb.
  const float* qi = nullptr;
  const int32_t* seg_bias = nullptr;
};

// The latent reader of the dense kernel, which has none (and so carries no latent code).
struct NoLatents {
  static constexpr bool kQuant = false, kOffset8 = false, kPair = false;
};

// Runs pieces tile by tile; qs: a KV head's G queries (detail::avx2_prepare_queries).
// A piece's partial result part = [m[G], l[G], acc[G][d]], then with latents acc_r[G][r].
// RR: the latents' reader (of latent_read_type), or NoLatents.
template <class R, class RR = NoLatents>
class PieceRunner {
 public:
  static constexpr bool kLatent = !std::is_same_v<RR, NoLatents>;
  PieceRunner(const KVStore& kv, int G, const Latents& lat = {})
      : kv_(kv), G_(G), d_(kv.head_dim()), P_(kv.page_tokens()), nb_(R::kQuant ? d_ / kQBlock : 1),
        qstride_(R::kQuant ? static_cast<int>(detail::int_query_floats(d_)) : d_), rb_(kv.row_bytes()), sc_(thread_scratch()), lat_(lat), r_(lat.r) {
    // Scores s[g * kRow + t] (then probabilities); q8/q4 K and V scales [nb][kTile], weights
    // w[(g * nb + b) * kTile + t] = p_gt * (V scale of row t, block b), and their block sums (q4's offset).
    sc_.s.resize(static_cast<size_t>(G) * kRow);
    if (R::kQuant) {
      sc_.w.resize(static_cast<size_t>(G) * kTile * nb_ + static_cast<size_t>(G) * nb_ + 8);
      sc_.ks.resize(static_cast<size_t>(kTile) * nb_);
      sc_.vs.resize(static_cast<size_t>(kTile) * nb_);
    }
    for (int g0 = 0; g0 < G; g0 += group_size(G, g0)) ++groups_;
    const size_t ahead_bytes = R::kQuant ? kAheadBytesQuant : kAheadBytesPlain;
    ahead_ = std::max<size_t>(kTileRows, (ahead_bytes + rb_ - 1) / rb_);
    if constexpr (kLatent) {
      rrb_ = lat.store->row_bytes();
      if constexpr (RR::kQuant) {  // K and V block scales [G rnb][kTile], weights [G][rnb][kTile] + block sums [G][rnb]
        rnb_ = r_ / kQBlock;
        nbr_ = G * rnb_;
        rcodes_ = 2 * static_cast<size_t>(nbr_);
        sc_.rks.resize(static_cast<size_t>(kTile) * nbr_);
        sc_.rvs.resize(sc_.rks.size());
        sc_.wr.resize(static_cast<size_t>(G) * kTile * rnb_ + nbr_);
      }
      latent_bytes_ = (rrb_ - rcodes_) / G;
      read_rb_ = rrb_;
      // f32/bf16: the shared phases (16 heads on one K_s, V_s: compute-bound) carry up to 1 KB of
      // the next tile's latent K rows (and as much of V) per row, the latent phases the rest
      // (alone, the two parts' times added up). Against all in the latent phases, 16K, caches
      // emptied, two threads, alternating calls (min / quartile / median of 4 rounds of 24 calls):
      // f32 r=32 (half) 12-19% faster a call, bf16 r=32 (all) 10-23%, f32 r=8 (all) 10-18%; half
      // against all at f32 r=32 10% faster, equal at bf16 r=32. q8/q4 keep theirs in the latent
      // phases (all in the shared ones: 5-10% slower).
      if constexpr (!R::kQuant && !RR::kQuant) latent_split_ = rrb_ <= kLatentInSharedBytes ? 1 : 2;
      if constexpr (kDequant) {  // rows of G r floats
        if (lat.qi) {  // latent K scored in integers: the block scales transposed
          nbw_ = G * r_ / kQBlock;
          sc_.rks.resize(static_cast<size_t>(kTile) * nbw_);
          if (r_ % 8 == 0) {  // and V from the codes (latent_code_values): segment weights
            const size_t segments = static_cast<size_t>(nbw_) * (32 / 8 + 1);
            sc_.rvs.resize(sc_.rks.size());
            sc_.wr.resize(segments * kTile);
            sc_.seg_of.resize(static_cast<size_t>(G) * r_ / 8);
            sc_.wsum.resize(segments);
          }
        }
        if (!lat.qi) sc_.rk.resize(static_cast<size_t>(kTile) * G * r_);
        if (!lat.qi || r_ % 8 != 0) sc_.rv.resize(static_cast<size_t>(kTile) * G * r_);
        latent_bytes_ = sizeof(float) * r_;
        read_rb_ = sizeof(float) * G * r_;
      }
    }
  }

  void begin(float* part) const {
    std::fill(part, part + G_, kNegInf);
    std::fill(part + G_, part + 2 * G_, 0.0f);
    std::fill(part + 2 * G_, part + 2 * G_ + static_cast<size_t>(G_) * (d_ + r_), 0.0f);
  }

  // One tile of piece pc from row r (within the piece); returns the row after it.
  int64_t step(const Piece& pc, int64_t r, const float* qs, float* part);

  void end(float* part) const {
    float* acc = part + 2 * G_;
    if constexpr (R::kOffset8 || R::kPair)
      for (int g = 0; g < G_; ++g) unpermute(acc + static_cast<size_t>(g) * d_, d_);
    if constexpr (kLatent && (RR::kOffset8 || RR::kPair))
      for (int g = 0; g < G_; ++g) unpermute(acc + static_cast<size_t>(G_) * d_ + static_cast<size_t>(g) * r_, r_);
  }

 private:
  // Lanes (even | odd) per whole 16 values of an accumulator of width w -> natural order.
  static void unpermute(float* acc, int w) {
    for (int i = 0; i + 16 <= w; i += 16) {
      float* x = acc + i;
      const __m256 ev = _mm256_loadu_ps(x), od = _mm256_loadu_ps(x + 8);
      const __m256 lo = _mm256_unpacklo_ps(ev, od), hi = _mm256_unpackhi_ps(ev, od);
      _mm256_storeu_ps(x, _mm256_permute2f128_ps(lo, hi, 0x20));
      _mm256_storeu_ps(x + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
    }
  }

  void latent_scores(const uint8_t* rows0, int n, float* s, const Prefetch& pf) const;
  void prefetch_block_share(const Prefetch& pf, int t0, int m, int h) const;
  static constexpr int kLatentBlock = 8;  // rows per block of f32/bf16 latent scores and values
  void latent_values(const uint8_t* rows0, int n, const float* s, float* acc_r, const Prefetch& pf) const;
  void latent_code_values(const uint8_t* rows0, int n, const float* s, float* acc_r, const Prefetch& pf) const;
  template <int kPer>
  void latent_values_by_rows(const uint8_t* rows0, int n, const float* s, float* acc_r, const Prefetch& pf) const;

  static constexpr int kTileRows = R::kQuant ? 64 : 24;  // see kTile
  // Latents read from rows dequantised to f32 (q8/q4 blocks straddling heads).
  static constexpr bool kDequant = kLatent && R::kQuant && std::is_same_v<RR, F32Row>;
  const KVStore& kv_;
  const int G_, d_, P_, nb_, qstride_;
  const size_t rb_;
  size_t ahead_;
  int groups_ = 0;  // groups of queries (group_size) on a tile
  // Which phases fetch the next tile's latent rows: 0 the latent phases; k > 0: the shared
  // phases the first 1/k of them (the latent phases the rest, k = 2).
  int latent_split_ = 0;
  Scratch& sc_;
  // Latents: r per head; rrb_ the store's row bytes, read_rb_ the rows' as read (dequantised:
  // G r floats); rnb_ blocks per head, nbr_ per row, rcodes_ scale bytes before the codes;
  // latent_bytes_: bytes per head segment of a row's values.
  const Latents lat_;
  const int r_;
  int rnb_ = 0, nbr_ = 0;
  int nbw_ = 0;  // latent blocks a row, where the dequantised latents' K are scored in integers (lat_.qi)
  // ... and their values weigh the codes as stored (every 8 values in one head)
  bool code_values() const { return kDequant && nbw_ > 0 && r_ % 8 == 0; }
  size_t rrb_ = 0, read_rb_ = 0, rcodes_ = 0, latent_bytes_ = 0;
};

// Prefetch of the next tile's latent rows (the part pf covers: see latent_split_), spread over
// the work on this one: f32/bf16 (and rows dequantised from q8/q4) go in blocks of kLatentBlock
// rows, and each block's bytes of the next tile are fetched in one share per head, before that
// head's part of the block.
template <class R, class RR>
KVX_INLINE void PieceRunner<R, RR>::prefetch_block_share(const Prefetch& pf, int t0, int m, int h) const {
  const size_t b0 = static_cast<size_t>(t0) * rrb_, b1 = static_cast<size_t>(t0 + m) * rrb_;
  const size_t share = ((b1 - b0) / G_ + 63) & ~size_t{63};
  const size_t from = b0 + static_cast<size_t>(h) * share;
  if (from < b1) pf.rows(from, std::min(b1, from + share));
}

// s[h * kRow + t] += qb_h . R_h,t for the tile's n rows (rows0: row 0 as read); pf's part of the
// next tile's latent rows is fetched along the way.
// f32/bf16 (and rows dequantised from q8/q4): blocks of 8 rows with the heads inner, one head's
// 8 scores a dot_plain (one vector added to s), so that a block's rows are read front to back;
// at r = 8 a head's latent is one vector: 8 products reduced to 8 scores (with the values by
// whole rows, r=8 f32 in cache 14-17% faster a call than through dot_plain and acc_tile_plain).
// q8/q4: each head's column, 8 rows at a time (one integer transpose per 8 rows and head).
template <class R, class RR>
void PieceRunner<R, RR>::latent_scores(const uint8_t* rows0, int n, float* s, const Prefetch& pf) const {
  const int G = G_;
  if constexpr (!RR::kQuant) {
    constexpr int TB = kLatentBlock;
    static_assert(TB == 8, "a block's scores are one vector");
    for (int t0 = 0; t0 < n; t0 += TB) {
      const uint8_t* rows[TB];  // rows past the tile's end repeat its last (their scores land in the padding)
      for (int i = 0; i < TB; ++i) rows[i] = rows0 + std::min(t0 + i, n - 1) * read_rb_;
      if (r_ == 8) {  // the block's next-tile rows at once; head h's latent is vector h of a row
        pf.rows(t0 * rrb_, std::min(t0 + TB, n) * rrb_);
        for (int h = 0; h < G; ++h) {
          const __m256 qv = _mm256_loadu_ps(lat_.qb + h * lat_.qb_stride);
          __m256 p[TB];
          for (int i = 0; i < TB; ++i) p[i] = _mm256_mul_ps(qv, RR::load8(rows[i], h));
          float* sh = s + h * kRow + t0;
          _mm256_storeu_ps(sh, _mm256_add_ps(_mm256_loadu_ps(sh), reduce8(p)));
        }
        continue;
      }
      for (int h = 0; h < G; ++h) {
        prefetch_block_share(pf, t0, std::min(TB, n - t0), h);
        dot_plain<RR, 1, TB, true>(lat_.qb + h * lat_.qb_stride, r_, rows, s + h * kRow + t0);
        for (auto& row : rows) row += latent_bytes_;
      }
    }
  } else {
    const size_t span = static_cast<size_t>(n) * rrb_;
    constexpr int TB = 8;  // rows per score block
    const int nt = (n + TB - 1) / TB;
    const size_t parts = static_cast<size_t>(G) * nt;
    const bool fine = span / G > kLatentBurstBytes;  // the next tile's latent K rows: a part per head, or per score block
    for (int h = 0; h < G; ++h) {
      if (!fine) pf.rows(span * h / G, span * (h + 1) / G);
      const float* qh = lat_.qb + h * lat_.qb_stride;
      const uint8_t* base = rows0 + rcodes_ + h * latent_bytes_;
      float* sh = s + h * kRow;
      const uint8_t* rows[TB];
      for (int t0 = 0; t0 < n; t0 += TB) {
        if (fine) {
          const size_t k = static_cast<size_t>(h) * nt + t0 / TB;
          pf.rows(span * k / parts, span * (k + 1) / parts);
        }
        for (int i = 0; i < TB; ++i) rows[i] = base + std::min(t0 + i, n - 1) * read_rb_;
        // K scales [block][kTile]
        int_token_scores<RR, true, 1>(rows, rnb_, qh, 0, 1, sc_.rks.data() + static_cast<size_t>(h) * rnb_ * kTile + t0, sh + t0);
      }
    }
  }
}

// f32/bf16 latent values by whole rows: acc_r (the heads' r values each, as a row lies) += sum_t
// w(head, t) row_t, 8 vectors of every row at a time, each vector weighted by its head's
// probability (bf16 at r % 16 == 0 in the pair lane order, 16 values to a pair, r = 8 in
// order); each group of vectors fetches its share of the next tile. Against each head's part of
// 8-row blocks (Zen 3, alternating calls in one process, one thread): r = 8 f32 9% faster a call
// with 72 tokens in L2 and 7% with 512 in L3, r = 32 1-2%; 16K with the caches emptied, two
// threads, r = 8 3% (median of 40 calls), r = 32 3-9%.
// kPer = gcd(r / 8, 8) vectors in a row share a head, so one broadcast of its weight serves them
// (against one a vector, f32, one thread, 480 tokens in L2/L3, alternating calls: r = 32 3-7%
// faster a call, r = 64 2-5%; bf16, against one a pair: within 1%).
template <class R, class RR>
template <int kPer>
void PieceRunner<R, RR>::latent_values_by_rows(const uint8_t* rows0, int n, const float* s, float* acc_r,
                                               const Prefetch& pf) const {
  const int nv = G_ * r_ / 8, per_head = r_ / 8;  // vectors in a row, and per head
  const size_t span = static_cast<size_t>(n) * rrb_;
  const bool pairs = RR::kPair && r_ % 16 == 0;  // so kPer >= 2
  for (int v0 = 0; v0 < nv; v0 += 8) {
    pf.rows(span * v0 / nv, span * (v0 + 8) / nv);
    float* acc = acc_r + 8 * static_cast<size_t>(v0);
    __m256 a[8];
    const float* w[8 / kPer];  // the weights of vectors v0 + j kPer .. v0 + (j + 1) kPer - 1
    for (int i = 0; i < 8; ++i) a[i] = _mm256_loadu_ps(acc + 8 * i);
    for (int j = 0; j < 8 / kPer; ++j) w[j] = s + ((v0 + j * kPer) / per_head) * kRow;
    const uint8_t* row = rows0;
    if (pairs) {
      if constexpr (RR::kPair && kPer >= 2)
        for (int t = 0; t < n; ++t, row += read_rb_)
#pragma GCC unroll 8
          for (int j = 0; j < 8 / kPer; ++j) {
            const __m256 wt = _mm256_broadcast_ss(w[j] + t);
#pragma GCC unroll 8
            for (int i = j * kPer; i < (j + 1) * kPer; i += 2) {
              __m256 va, vb;
              RR::template load_pair<false>(row, (v0 + i) >> 1, va, vb);
              a[i] = _mm256_fmadd_ps(wt, va, a[i]);
              a[i + 1] = _mm256_fmadd_ps(wt, vb, a[i + 1]);
            }
          }
    } else {
      for (int t = 0; t < n; ++t, row += read_rb_)
#pragma GCC unroll 8
        for (int j = 0; j < 8 / kPer; ++j) {
          const __m256 wt = _mm256_broadcast_ss(w[j] + t);
#pragma GCC unroll 8
          for (int i = j * kPer; i < (j + 1) * kPer; ++i) a[i] = _mm256_fmadd_ps(wt, RR::load8(row, v0 + i), a[i]);
        }
    }
    for (int i = 0; i < 8; ++i) _mm256_storeu_ps(acc + 8 * i, a[i]);
  }
}

// acc_r[h] += sum_t w(h, t) R_h,t over the tile (w: the probabilities s, q8/q4 times the rows' V
// block scales). f32/bf16 (and dequantised rows): by whole rows where a row is whole groups of
// 8 vectors (latent_values_by_rows), else blocks of 8 rows with the heads inner, like the scores,
// each head's part one acc_tile_plain (those blocks against head by head, with the scores'
// blocks, Zen 3, alternating calls in one process, 16K, caches emptied, two threads, 20-40
// calls: r = 32 f32 4-13% faster, bf16 8-9%); q8/q4: head by head.
template <class R, class RR>
void PieceRunner<R, RR>::latent_values(const uint8_t* rows0, int n, const float* s, float* acc_r, const Prefetch& pf) const {
  const int G = G_;
  if constexpr (!RR::kQuant) {
    if (r_ % 8 == 0 && (G * r_) % 64 == 0 && (!RR::kPair || r_ % 16 == 0 || r_ == 8)) {
      switch (std::gcd(r_ / 8, 8)) {  // vectors of a row per weight
        case 8: latent_values_by_rows<8>(rows0, n, s, acc_r, pf); break;
        case 4: latent_values_by_rows<4>(rows0, n, s, acc_r, pf); break;
        case 2: latent_values_by_rows<2>(rows0, n, s, acc_r, pf); break;
        default: latent_values_by_rows<1>(rows0, n, s, acc_r, pf); break;
      }
      return;
    }
    constexpr int TB = kLatentBlock;
    for (int t0 = 0; t0 < n; t0 += TB) {
      const int m = std::min(TB, n - t0);
      const uint8_t* v0 = rows0 + t0 * read_rb_;
      for (int h = 0; h < G; ++h, v0 += latent_bytes_) {
        prefetch_block_share(pf, t0, m, h);
        acc_tile_plain<RR, 1>(v0, read_rb_, m, s + h * kRow + t0, kRow, acc_r + static_cast<size_t>(h) * r_, r_, nullptr, m);
      }
    }
  } else {
    const size_t span = static_cast<size_t>(n) * rrb_;
    constexpr int TB = 8;  // rows per part where the prefetch is split finer
    const bool fine = span / G > kLatentBurstBytes;
    const int nt = fine ? (n + TB - 1) / TB : 1;
    const size_t parts = static_cast<size_t>(G) * nt;
    for (int h = 0; h < G; ++h) {
      const uint8_t* v0 = rows0 + rcodes_ + h * latent_bytes_;
      float* ar = acc_r + static_cast<size_t>(h) * r_;
      for (int i = 0; i < nt; ++i) {
        const size_t k = static_cast<size_t>(h) * nt + i;
        pf.rows(span * k / parts, span * (k + 1) / parts);
        const int t0 = n * i / nt, t1 = n * (i + 1) / nt;
        acc_tile_quant<RR, 1>(v0 + t0 * read_rb_, read_rb_, t1 - t0, sc_.wr.data() + static_cast<size_t>(h) * rnb_ * kTile + t0,
                              0, rnb_, ar, r_, nullptr);
      }
    }
    if constexpr (RR::kOffset8) subtract_q4_offset(acc_r, G, r_, rnb_, sc_.wr.data() + static_cast<size_t>(G) * kTile * rnb_);
  }
}

// q8/q4 latents whose blocks straddle heads, with every 8 values of a row in one head (r % 8 ==
// 0; nbw_ > 0), values from the codes as stored (rows0: the tile's V latent rows): acc_r (the
// flat [H][r]) += sum_t w(v, t) codes_t[v] per 8-value vector v, w(v, t) = p_h,t d_t,b for v's head
// h and block b (the row's V block scale, sc_.rvs), one weight row per head segment of a block;
// q4 codes are value + 8, taken out after: - 8 sum_t w(v, t). Vectors go 8 at a time (8
// accumulators held across the rows), each group fetching its share of the next tile.
template <class R, class RR>
void PieceRunner<R, RR>::latent_code_values(const uint8_t* rows0, int n, const float* s, float* acc_r, const Prefetch& pf) const {
  const int nv = G_ * r_ / 8, n8 = (n + 7) & ~7;
  const size_t codes = 2 * static_cast<size_t>(nbw_);
  float* wv = sc_.wr.data();          // [segment][kTile]
  int* seg_of = sc_.seg_of.data();    // the segment of each vector
  float* wsum = sc_.wsum.data();      // q4: the weights' sum per segment
  int nseg = 0;
  for (int b = 0; b < nbw_; ++b)
    for_block_segments(b, r_, [&](int h, int c0, int c1) {
      float* w = wv + static_cast<size_t>(nseg) * kTile;
      __m256 sum = _mm256_setzero_ps();
      for (int t = 0; t < n8; t += 8) {
        const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(s + h * kRow + t), _mm256_loadu_ps(sc_.rvs.data() + static_cast<size_t>(b) * kTile + t));
        _mm256_storeu_ps(w + t, x);
        sum = _mm256_add_ps(sum, x);
      }
      if constexpr (R::kOffset8) wsum[nseg] = hsum(sum);
      for (int v = c0 / 8; v < c1 / 8; ++v) seg_of[v] = nseg;
      ++nseg;
    });
  const size_t span = static_cast<size_t>(n) * rrb_;
  for (int v0 = 0; v0 < nv; v0 += 8) {
    const int m = std::min(8, nv - v0);
    pf.rows(span * v0 / nv, span * (v0 + m) / nv);
    __m256 a[8];
    const float* w[8];
    for (int i = 0; i < 8; ++i) {
      a[i] = i < m ? _mm256_loadu_ps(acc_r + 8 * static_cast<size_t>(v0 + i)) : _mm256_setzero_ps();
      w[i] = wv + static_cast<size_t>(seg_of[std::min(v0 + i, nv - 1)]) * kTile;
    }
    const uint8_t* row = rows0 + codes;
    auto vector = [&](int v) __attribute__((always_inline)) {  // the 8 codes of vector v as floats, natural order
      if constexpr (R::kOffset8) {
        int32_t bytes;
        std::memcpy(&bytes, row + 16 * (v / 4) + 4 * (v % 4), sizeof bytes);
        const __m128i b4 = _mm_cvtsi32_si128(bytes);
        const __m128i lo4 = _mm_set1_epi8(0x0f);
        const __m128i nib = _mm_unpacklo_epi8(_mm_and_si128(b4, lo4), _mm_and_si128(_mm_srli_epi16(b4, 4), lo4));
        return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(nib));
      } else {
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 8 * v))));
      }
    };
    if (m == 8) {
      for (int t = 0; t < n; ++t, row += rrb_)
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) a[i] = _mm256_fmadd_ps(_mm256_broadcast_ss(w[i] + t), vector(v0 + i), a[i]);
    } else {
      for (int t = 0; t < n; ++t, row += rrb_)
        for (int i = 0; i < m; ++i) a[i] = _mm256_fmadd_ps(_mm256_broadcast_ss(w[i] + t), vector(v0 + i), a[i]);
    }
    for (int i = 0; i < m; ++i) {
      if constexpr (R::kOffset8) a[i] = _mm256_fnmadd_ps(_mm256_set1_ps(8.0f), _mm256_set1_ps(wsum[seg_of[v0 + i]]), a[i]);
      _mm256_storeu_ps(acc_r + 8 * static_cast<size_t>(v0 + i), a[i]);
    }
  }
}

template <class R, class RR>
int64_t PieceRunner<R, RR>::step(const Piece& pc, int64_t r, const float* qs, float* part) {
  const int G = G_, d = d_, P = P_, nb = nb_, qstride = qstride_;
  const size_t rb = rb_;
  Scratch& sc = sc_;
  float* m = part;
  float* l = part + G;
  float* acc = part + 2 * G;
  float* acc_r = acc + static_cast<size_t>(G) * d;
  float* s = sc.s.data();
  float* wsum = R::kQuant ? sc.w.data() + static_cast<size_t>(G) * kTile * nb : nullptr;

  const int64_t page = r / P;
  const int off = static_cast<int>(r % P);
  const int n = static_cast<int>(std::min<int64_t>({kTileRows, pc.r1 - r, P - off}));
  const uint8_t* kb = kv_.k_rows(page, pc.head) + off * rb;
  const uint8_t* vb = kv_.v_rows(page, pc.head) + off * rb;
  // Tiled16 stores (laid out for the AVX-512 back end, decode_kv_layout) are read here through a
  // copy of the tile's rows, unprefetched: correct on any CPU, not a fast path.
  const bool copied = kv_.layout() != KVLayout::Rows;
  if (copied) {
    sc.krows.resize(static_cast<size_t>(kTileRows + 8) * rb);  // (slack: no pass reads past its tile's rows)
    sc.vrows.resize(static_cast<size_t>(kTileRows + 8) * rb);
    kv_.read_k_rows(r, n, pc.head, sc.krows.data());
    kv_.read_v_rows(r, n, pc.head, sc.vrows.data());
    kb = sc.krows.data();
    vb = sc.vrows.data();
  }
  if constexpr (R::kQuant) {  // K and V scales [block][kTile]
    load_scales_transposed(kb, rb, n, nb, sc.ks.data());
    load_scales_transposed(vb, rb, n, nb, sc.vs.data());
  }

  // Tiles are read column by column, which hardware prefetchers follow poorly: fetch the rows
  // `ahead` rows on (same page, this piece), K while computing the scores, V over the passes,
  // f32/bf16 a share per group of queries (LRKV's 16 heads on K_s, V_s: against all of it in the
  // first group's work, 16K with the caches emptied, two threads, alternating calls in one
  // process on Zen 3: r=32 f32 6% faster, r=8 15-19%, bf16 unchanged).
  const int64_t page_rows = std::min<int64_t>(P - off, pc.r1 - r), next_rows = std::min<int64_t>(P, pc.r1 - r - page_rows);
  const bool has_next = next_rows > 0;
  const size_t end = static_cast<size_t>(page_rows) * rb, next_end = has_next ? static_cast<size_t>(next_rows) * rb : 0;
  const Prefetch kpf = copied ? Prefetch{kb, nullptr, 0, 0, 0}
                              : Prefetch{kb, has_next ? kv_.k_rows(page + 1, pc.head) : nullptr, ahead_ * rb, end, next_end};
  const Prefetch vpf = copied ? Prefetch{vb, nullptr, 0, 0, 0}
                              : Prefetch{vb, has_next ? kv_.v_rows(page + 1, pc.head) : nullptr, ahead_ * rb, end, next_end};
  const size_t tile_bytes = static_cast<size_t>(n) * rb;

  // LRKV's latent rows of the next tile: the shared phases (compute-bound: 16 heads on one K_s,
  // V_s) fetch the part 1 / latent_split_ of them, a share per group of queries, the latent
  // phases the rest (latent_split_ 0: all).
  [[maybe_unused]] const uint8_t *rkb = nullptr, *rvb = nullptr;
  [[maybe_unused]] Prefetch lk_all{}, lv_all{}, lkpf{}, lvpf{};
  [[maybe_unused]] const int lsplit = latent_split_;
  [[maybe_unused]] const size_t latent_span = static_cast<size_t>(n) * rrb_;
  [[maybe_unused]] const size_t latent_part = lsplit > 0 ? latent_span / lsplit : 0;
  [[maybe_unused]] const size_t latent_rb = lsplit > 0 ? rrb_ / lsplit : 0;  // bytes per row of progress
  if constexpr (kLatent) {
    const KVStore& ls = *lat_.store;
    rkb = ls.k_rows(page, 0) + off * rrb_;
    rvb = ls.v_rows(page, 0) + off * rrb_;
    lk_all = Prefetch{rkb, has_next ? ls.k_rows(page + 1, 0) : nullptr, ahead_ * rrb_, page_rows * rrb_, next_rows * rrb_};
    lv_all = Prefetch{rvb, has_next ? ls.v_rows(page + 1, 0) : nullptr, ahead_ * rrb_, page_rows * rrb_, next_rows * rrb_};
    const Prefetch none{rkb, nullptr, 0, 0, 0};
    lkpf = lsplit == 0 ? lk_all : lsplit == 1 ? none : lk_all.share(1, 2, latent_span);
    lvpf = lsplit == 0 ? lv_all : lsplit == 1 ? none : lv_all.share(1, 2, latent_span);
  }

  if constexpr (R::kQuant) {  // all G queries at once on each 8 rows' transpose
    const uint8_t* rows[8];
    for (int t0 = 0; t0 < n; t0 += 8) {
      kpf.rows(t0 * rb, (t0 + 8) * rb);
      for (int i = 0; i < 8; ++i) rows[i] = kb + std::min(t0 + i, n - 1) * rb + 2 * nb;
      const float* kT = sc.ks.data() + t0;
      switch (G) {
        case 1: int_token_scores<R, false, 1>(rows, nb, qs, qstride, G, kT, s + t0); break;
        case 2: int_token_scores<R, false, 2>(rows, nb, qs, qstride, G, kT, s + t0); break;
        case 3: int_token_scores<R, false, 3>(rows, nb, qs, qstride, G, kT, s + t0); break;
        case 4: int_token_scores<R, false, 4>(rows, nb, qs, qstride, G, kT, s + t0); break;
        default: int_token_scores<R, false, 0>(rows, nb, qs, qstride, G, kT, s + t0); break;
      }
    }
  } else {  // each group of queries fetches its share of the next tile's K rows
    for (int g0 = 0, gb, gi = 0; g0 < G; g0 += gb, ++gi) {
      gb = group_size(G, g0);
      const Prefetch pf = kpf.share(gi, groups_, tile_bytes), lpf = lk_all.share(gi, groups_, latent_part);
      scores_tile<R>(gb, qs + static_cast<size_t>(g0) * qstride, d, kb, rb, n, s + g0 * kRow, &pf,
                     lsplit > 0 ? &lpf : nullptr, latent_rb);
    }
  }

  // LRKV: the tile's latent rows (read in place, or dequantised), their scores added per head.
  [[maybe_unused]] const uint8_t *lk = nullptr, *lv = nullptr;
  if constexpr (kLatent) {
    const KVStore& ls = *lat_.store;
    lk = rkb;
    lv = rvb;
    if constexpr (RR::kQuant) {
      load_scales_transposed(rkb, rrb_, n, nbr_, sc.rks.data());
      load_scales_transposed(rvb, rrb_, n, nbr_, sc.rvs.data());
    }
    bool scored = false;
    if constexpr (kDequant) {
      const int w = G * r_;
      if (nbw_ > 0) {  // K in integers from the rows as stored; only V dequantised
        load_scales_transposed(rkb, rrb_, n, nbw_, sc.rks.data());
        const uint8_t* rows[8];
        for (int t0 = 0; t0 < n; t0 += 8) {
          lkpf.rows(t0 * rrb_, std::min(t0 + 8, n) * rrb_);
          for (int i = 0; i < 8; ++i) rows[i] = rkb + std::min(t0 + i, n - 1) * rrb_ + 2 * static_cast<size_t>(nbw_);
          int_segment_scores<R>(rows, nbw_, r_, lat_.qi, lat_.seg_bias, sc.rks.data() + t0, s + t0);
        }
        scored = true;
      }
      if (code_values()) load_scales_transposed(rvb, rrb_, n, nbw_, sc.rvs.data());
      if (!scored || !code_values())
        for (int t = 0; t < n; ++t) {
          if (!scored) dequantize_row(ls.type(), rkb + t * rrb_, w, sc.rk.data() + static_cast<size_t>(t) * w);
          if (!code_values()) dequantize_row(ls.type(), rvb + t * rrb_, w, sc.rv.data() + static_cast<size_t>(t) * w);
        }
      lk = reinterpret_cast<const uint8_t*>(sc.rk.data());
      lv = reinterpret_cast<const uint8_t*>(sc.rv.data());
    }
    if (!scored) latent_scores(lk, n, s, lkpf);
  }

  // Online softmax: m' = max(m, max_t s_t); l = l e^(m - m') + sum_t e^(s_t - m'); acc *= e^(m - m').
  const int n8 = (n + 7) & ~7;
  for (int g = 0; g < G; ++g) {
    float* sg = s + g * kRow;
    for (int t = n; t < n8; ++t) sg[t] = kNegInf;
    __m256 mx = _mm256_set1_ps(kNegInf);
    for (int t = 0; t < n8; t += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(sg + t));
    const float mt = hmax(mx);
    if (mt > m[g]) {
      if (m[g] != kNegInf) {
        const float alpha = std::exp(m[g] - mt);
        l[g] *= alpha;
        scale_floats(acc + static_cast<size_t>(g) * d, d, alpha);
        if constexpr (kLatent) scale_floats(acc_r + static_cast<size_t>(g) * r_, r_, alpha);
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
    if constexpr (kLatent && RR::kQuant)  // the latents' value weights
      fold_value_scales<RR::kOffset8>(sg, n8, sc.rvs.data() + static_cast<size_t>(g) * rnb_ * kTile, rnb_,
                                      sc.wr.data() + static_cast<size_t>(g) * rnb_ * kTile,
                                      sc.wr.data() + static_cast<size_t>(G) * kTile * rnb_ + static_cast<size_t>(g) * rnb_);
    if constexpr (R::kQuant)  // fold the V block scales into the weights; q4 also sums them (its offset)
      fold_value_scales<R::kOffset8>(sg, n8, sc.vs.data(), nb, sc.w.data() + static_cast<size_t>(g) * kTile * nb,
                                     wsum + static_cast<size_t>(g) * nb);
  }

  // f32/bf16: each group fetches its share of the next V rows; q8/q4: the first group all of them
  // (shares measured 2-3% slower for LRKV q8/q4 at 16K, alternating calls)
  for (int g0 = 0, gb, gi = 0; g0 < G; g0 += gb, ++gi) {
    gb = group_size(G, g0);
    float* ag = acc + static_cast<size_t>(g0) * d;
    const Prefetch vsh = vpf.share(gi, groups_, tile_bytes);
    const Prefetch* vp = !R::kQuant ? &vsh : g0 == 0 ? &vpf : nullptr;
    if constexpr (!R::kQuant) {
      const float* w = s + g0 * kRow;
      const int row_block = gb == G ? 8 : n;  // one group reads the tile: rows in blocks (acc_tile_plain)
      const Prefetch lpf = lv_all.share(gi, groups_, latent_part);
      const Prefetch* lp = lsplit > 0 ? &lpf : nullptr;
      switch (gb) {
        case 1: acc_tile_plain<R, 1>(vb, rb, n, w, kRow, ag, d, vp, row_block, lp, latent_rb); break;
        case 2: acc_tile_plain<R, 2>(vb, rb, n, w, kRow, ag, d, vp, row_block, lp, latent_rb); break;
        default: acc_tile_plain<R, 4>(vb, rb, n, w, kRow, ag, d, vp, row_block, lp, latent_rb); break;
      }
    } else {
      const float* w = sc.w.data() + static_cast<size_t>(g0) * kTile * nb;
      const uint8_t* v0 = vb + 2 * static_cast<size_t>(nb);
      switch (gb) {
        case 1: acc_tile_quant<R, 1>(v0, rb, n, w, kTile * nb, nb, ag, d, vp); break;
        case 2: acc_tile_quant<R, 2>(v0, rb, n, w, kTile * nb, nb, ag, d, vp); break;
        default: acc_tile_quant<R, 4>(v0, rb, n, w, kTile * nb, nb, ag, d, vp); break;
      }
    }
  }
  if constexpr (R::kOffset8) subtract_q4_offset(acc, G, d, nb, wsum);
  if constexpr (kLatent) {
    if (code_values())
      latent_code_values(rvb, n, s, acc_r, lvpf);
    else
      latent_values(lv, n, s, acc_r, lvpf);
  }
  return r + n;
}

// Runs the pieces [p0, p1) of one split, tile by tile. (Interleaving two splits' tiles on one
// thread, for four row streams instead of two, measured slower for f32/bf16.)
template <class R, class RR = NoLatents>
void run_split(const KVStore& kv, const Piece* pcs, int p0, int p1, const float* qs, size_t qstride, int G, float* parts,
               size_t part_size, const Latents& lat = {}) {
  PieceRunner<R, RR> run(kv, G, lat);
  for (int p = p0; p < p1; ++p) {
    const Piece& pc = pcs[p];
    float* part = parts + p * part_size;
    const float* q = qs + static_cast<size_t>(pc.head) * G * qstride;
    run.begin(part);
    for (int64_t r = pc.r0; r < pc.r1;) r = run.step(pc, r, q, part);
    run.end(part);
  }
}

void run_split_any(const KVStore& kv, const Piece* pcs, int p0, int p1, const float* qs, size_t qstride, int G,
                   float* parts, size_t part_size) {
  switch (kv.type()) {
    case KVType::F32: run_split<F32Row>(kv, pcs, p0, p1, qs, qstride, G, parts, part_size); return;
    case KVType::BF16: run_split<BF16Row>(kv, pcs, p0, p1, qs, qstride, G, parts, part_size); return;
    case KVType::Q8: run_split<Q8Row>(kv, pcs, p0, p1, qs, qstride, G, parts, part_size); return;
    case KVType::Q4: run_split<Q4Row>(kv, pcs, p0, p1, qs, qstride, G, parts, part_size); return;
  }
}

// Floats per head of the query layout (detail::avx2_prepare_queries) at width d.
size_t query_floats(KVType type, int d) {
  return type == KVType::Q8 || type == KVType::Q4 ? detail::int_query_floats(d) : d;
}

}  // namespace

// Scaled queries in the layout the kernel reads: f32 [heads][d]; bf16 the same with each whole
// 16 values as (even | odd), see BF16Row::load_pair; q8/q4 the integer queries.
float* detail::avx2_prepare_queries(const float* q, int heads, int d, float scale, KVType type, std::vector<float>& buf) {
  const size_t n = query_floats(type, d) * heads;
  float* qs = slot_aligned(buf, n);
  if (type == KVType::Q8 || type == KVType::Q4) {
    prepare_int_queries(q, heads, d, scale, type, qs);
    return qs;
  }
  round_query(type, q, static_cast<int>(n), scale, qs);  // bf16: rounded to bf16 (round_query)
  if (type == KVType::BF16)
    for (int h = 0; h < heads; ++h)
      for (int i = 0; i + 16 <= d; i += 16) {
        float* y = qs + static_cast<size_t>(h) * d + i;
        float x[16];
        std::copy(y, y + 16, x);
        for (int j = 0; j < 8; ++j) {
          y[j] = x[2 * j];
          y[8 + j] = x[2 * j + 1];
        }
      }
  return qs;
}

size_t detail::int_query_floats(int w) { return static_cast<size_t>(w / kQBlock) * 10; }

void detail::prepare_int_queries(const float* q, int heads, int w, float scale, KVType type, float* out) {
  if (w % kQBlock != 0 || (type != KVType::Q8 && type != KVType::Q4))
    throw Error("prepare_int_queries: integer queries are for q8/q4 at widths that are multiples of 32 (" +
                kv_type_name(type) + ", " + std::to_string(w) + ")");
  const bool q4 = type == KVType::Q4;
  const int nq = w / kQBlock;
  const size_t stride = int_query_floats(w);
  thread_local std::vector<float> scaled;
  thread_local std::vector<int8_t> q4_codes;
  scaled.resize(w);
  if (q4) q4_codes.resize(w);
  for (int h = 0; h < heads; ++h) {
    float* qh = out + h * stride;
    int8_t* words = reinterpret_cast<int8_t*>(qh);
    const float* x = q + static_cast<size_t>(h) * w;
    for (int i = 0; i < w; ++i) scaled[i] = x[i] * scale;
    // Word i of a block: q8 its values 4i .. 4i + 3, so the codes in order; q4 the even values of
    // word i, then (16 bytes on) the odd ones.
    int8_t* c = q4 ? q4_codes.data() : words;
    quantize_query_blocks(scaled.data(), w, c, qh + 9 * nq);  // all the head's blocks in one call
    for (int b = 0; b < nq; ++b) {
      const int8_t* cb = c + kQBlock * b;
      int sum = 0;
      for (int i = 0; i < kQBlock; ++i) sum += cb[i];
      const int32_t bias = (q4 ? -8 : -128) * sum;
      std::memcpy(qh + 8 * nq + b, &bias, sizeof bias);
      if (q4) {
        int8_t* y = words + kQBlock * b;
        for (int j = 0; j < kQBlock / 2; ++j) {
          y[j] = cb[2 * j];
          y[kQBlock / 2 + j] = cb[2 * j + 1];
        }
      }
    }
  }
}

namespace {

void check_args(const float* q, int heads, const KVStore& kv, const float* out, const VirtualPair* extra, const char* who) {
  if (q == nullptr || out == nullptr) throw Error(std::string(who) + ": q and out must be non-null buffers");
  if (heads < 1 || heads % kv.kv_heads() != 0)
    throw Error(std::string(who) + ": heads (" + std::to_string(heads) + ") must be a positive multiple of kv_heads (" +
                std::to_string(kv.kv_heads()) + "); check the model's num_key_value_heads");
  if (extra && (extra->logit == nullptr || extra->value == nullptr))
    throw Error(std::string(who) + ": the extra (document) pair needs both a logit and a value buffer");
  if (kv.stored() == 0 && !extra)
    throw Error(std::string(who) + ": the KV store is empty; append the current token's K/V before attending");
}

// Nothing stored: the extra pair is the whole softmax.
bool only_extra(int heads, const KVStore& kv, float* out, const VirtualPair* extra) {
  if (kv.stored() > 0) return false;
  std::copy(extra->value, extra->value + static_cast<size_t>(heads) * kv.head_dim(), out);
  return true;
}

}  // namespace

int64_t decode_bytes_read(const KVStore& kv) { return kv.bytes(); }

std::string decode_isa_name(DecodeIsa isa) {
  switch (isa) {
    case DecodeIsa::Auto: return "auto";
    case DecodeIsa::Avx2: return "avx2";
    case DecodeIsa::Avx512: return "avx512";
  }
  return "?";
}

DecodeIsa parse_decode_isa(const std::string& name) {
  for (DecodeIsa i : {DecodeIsa::Auto, DecodeIsa::Avx2, DecodeIsa::Avx512})
    if (decode_isa_name(i) == name) return i;
  throw Error("unknown decode instruction set '" + name + "'; valid: auto, avx2, avx512");
}

bool decode_isa_usable(DecodeIsa isa, int head_dim) {
  switch (isa) {
    case DecodeIsa::Auto:
    case DecodeIsa::Avx2: return true;
    case DecodeIsa::Avx512: {
      static const bool cpu = detail::avx512_usable();
      return cpu && head_dim % 32 == 0;
    }
  }
  return false;
}

DecodeIsa resolve_decode_isa(DecodeIsa isa, int head_dim) {
  if (isa == DecodeIsa::Auto) return decode_isa_usable(DecodeIsa::Avx512, head_dim) ? DecodeIsa::Avx512 : DecodeIsa::Avx2;
  if (!decode_isa_usable(isa, head_dim))
    throw Error("decode back end " + decode_isa_name(isa) + " cannot run here: " +
                (head_dim % 32 != 0 ? "it needs head_dim % 32 == 0 (head_dim " + std::to_string(head_dim) + ")"
                                    : std::string("this CPU lacks AVX-512 F/BW/VL/DQ/VNNI")) +
                "; use --isa auto or avx2");
  return isa;
}

KVLayout decode_kv_layout(KVType type, int head_dim, bool values_are_keys, DecodeIsa isa, int group) {
  if (values_are_keys || type == KVType::F32) return KVLayout::Rows;
  const DecodeIsa resolved = resolve_decode_isa(isa, head_dim);
  if (resolved != DecodeIsa::Avx512) return KVLayout::Rows;
  if (type != KVType::BF16) return KVLayout::Tiled16;
  return decode_dots_bf16(resolved) && group >= 1 && group <= 8 ? KVLayout::Tiled16 : KVLayout::Rows;
}

bool decode_reads_tiled16(DecodeIsa isa, KVType type, int group) {
  if (type == KVType::F32) return false;
  return isa != DecodeIsa::Avx512 || type != KVType::BF16 || !detail::avx512_dense_head_lanes(type, group);
}

namespace {
// The type LRKV's latents are read as: their own (f32, bf16, and q8/q4 with r % 32 == 0, so that a
// block lies in one head), or f32 from rows dequantised tile by tile (q8/q4 blocks that straddle
// heads; of those, segments of whole row words score K in integers, and with r % 8 == 0 weigh V
// from the codes as stored: the tile dequantises nothing then).
KVType latent_read_type(KVType type, int r) {
  return (type == KVType::Q8 || type == KVType::Q4) && r % kQBlock != 0 ? KVType::F32 : type;
}

// The q4 biases of int_segment_scores' segments, in its order, from the flat integer query qi of
// nb blocks: -8 times the sum of a segment's codes (its words' even and odd values).
void segment_biases(const float* qi, int nb, int r, int32_t* seg_bias) {
  const int8_t* codes = reinterpret_cast<const int8_t*>(qi);
  for (int b = 0; b < nb; ++b)
    for_block_segments(b, r, [&](int, int c0, int c1) {
      int sum = 0;
      for (int i = (c0 - 32 * b) / 8; i < (c1 - 32 * b) / 8; ++i)
        for (int k = 0; k < 4; ++k) sum += codes[4 * (8 * b + i) + k] + codes[4 * (8 * b + 4 + i) + k];
      *seg_bias++ = -8 * sum;
    });
}
}  // namespace

namespace detail {
size_t slot_floats(size_t n) { return (n + 1023) / 1024 * 1024; }

bool latent_segments_in_words(KVType type, int r) {
  return (type == KVType::Q8 || type == KVType::Q4) && r % kQBlock != 0 && r % (type == KVType::Q4 ? 8 : 4) == 0;
}

float* avx2_prepare_latent_queries(const float* qb, int heads, int r, float scale, KVType type, std::vector<float>& buf) {
  const KVType read = latent_read_type(type, r);
  if (read == type) return avx2_prepare_queries(qb, heads, r, scale, read, buf);
  if (detail::latent_segments_in_words(type, r)) {  // the flat integer query, then q4's segment biases (r >= 8: at most 5 a block)
    const int w = heads * r, nb = w / kQBlock;
    float* qi = slot_aligned(buf, int_query_floats(w) + (32 / 8 + 1) * static_cast<size_t>(nb));
    prepare_int_queries(qb, 1, w, scale, type, qi);
    if (type == KVType::Q4) segment_biases(qi, nb, r, reinterpret_cast<int32_t*>(qi + int_query_floats(w)));
    return qi;
  }
  thread_local std::vector<float> rounded;  // q8/q4 read as f32: qb as the integer q is rounded
  rounded.resize(static_cast<size_t>(heads) * r);
  round_query_blocks(qb, heads * r, scale, rounded.data());
  return avx2_prepare_queries(rounded.data(), heads, r, 1.0f, read, buf);
}

void avx2_run_lrkv(const KVStore& shared, const KVStore* residual, const DecodePiece* pieces, int p0, int p1,
                   const float* qs, const float* qbs, int H, float* parts, size_t part_size) {
  const KVType type = shared.type();
  const size_t q_stride = query_floats(type, shared.head_dim());
  if (!residual) {  // r = 0: one shared K/V head for all H queries (MQA)
    run_split_any(shared, pieces, p0, p1, qs, q_stride, H, parts, part_size);
    return;
  }
  Latents lat{residual, qbs, 0, residual->head_dim() / H};
  const KVType read = latent_read_type(type, lat.r);
  lat.qb_stride = query_floats(read, lat.r);
  if (detail::latent_segments_in_words(type, lat.r)) {
    lat.qi = qbs;
    lat.seg_bias = reinterpret_cast<const int32_t*>(qbs + int_query_floats(H * lat.r));
    lat.qb = nullptr;
  }
  auto run = [&](auto row, auto latent_row) {
    run_split<decltype(row), decltype(latent_row)>(shared, pieces, p0, p1, qs, q_stride, H, parts, part_size, lat);
  };
  switch (type) {
    case KVType::F32: return run(F32Row{}, F32Row{});
    case KVType::BF16: return run(BF16Row{}, BF16Row{});
    case KVType::Q8: return read == KVType::Q8 ? run(Q8Row{}, Q8Row{}) : run(Q8Row{}, F32Row{});
    case KVType::Q4: return read == KVType::Q4 ? run(Q4Row{}, Q4Row{}) : run(Q4Row{}, F32Row{});
  }
}

float* slot_aligned(std::vector<float>& v, size_t n) {
  v.resize(n + 1024);
  const uintptr_t a = reinterpret_cast<uintptr_t>(v.data());
  return v.data() + ((4096 - a % 4096) % 4096) / sizeof(float);
}
}  // namespace detail

void decode_attention_splits(const float* q, int heads, const KVStore& kv, float scale, float* out, int threads,
                             int splits, DecodeIsa isa, const VirtualPair* extra) {
  check_args(q, heads, kv, out, extra, "decode_attention");
  if (only_extra(heads, kv, out, extra)) return;
  const int hkv = kv.kv_heads(), G = heads / hkv, d = kv.head_dim();
  const int64_t L = kv.stored(), W = hkv * L;
  const int T = std::max(1, threads <= 0 ? omp_get_max_threads() : threads);
  const int ns = static_cast<int>(std::clamp<int64_t>(splits, 1, W));
  const bool wide = resolve_decode_isa(isa, d) == DecodeIsa::Avx512;
  if (wide && kv.layout() == KVLayout::Tiled16 && !decode_reads_tiled16(DecodeIsa::Avx512, kv.type(), G))
    throw Error("decode_attention: the AVX-512 back end reads a group of " + std::to_string(G) + " query heads a KV head with "
                "heads in lanes, from rows, so it cannot read this bf16 store in the tiled16 layout. Build the store with "
                "decode_kv_layout(type, head_dim, false, isa, group) (rows here), or use the avx2 back end");

  // Caller-side scratch, reused across calls: queries, pieces, partial results, and for the
  // AVX-512 back end its per-split working memory.
  thread_local std::vector<float> qbuf, parts, scratch;
  thread_local std::vector<Piece> pieces;
  thread_local std::vector<int> split_begin;
  size_t scratch_size = 0, qstride = 0;
  float* qs = nullptr;  // page-aligned: no query load splits a cache line
  if (wide) {  // per KV head, its group's queries
    qstride = detail::avx512_dense_query_floats(G, d, kv.type());
    qs = detail::slot_aligned(qbuf, qstride * hkv);
    detail::avx512_prepare_dense_queries(q, heads, G, d, scale, kv.type(), qs);
    scratch_size = detail::slot_floats(detail::avx512_scratch_floats(G, d, kv.type()));
  } else {
    qstride = query_floats(kv.type(), d);
    qs = detail::avx2_prepare_queries(q, heads, d, scale, kv.type(), qbuf);
  }

  // Split i covers work items [W i / ns, W (i+1) / ns) of the (head, row) order, cut at heads.
  pieces.clear();
  split_begin.assign(ns + 1, 0);
  for (int i = 0; i < ns; ++i) {
    split_begin[i] = static_cast<int>(pieces.size());
    const int64_t hi = detail::piece_cut(kv, W * (i + 1) / ns, L);
    for (int64_t x = detail::piece_cut(kv, W * i / ns, L); x < hi;) {
      const int64_t h = x / L, r0 = x % L, r1 = std::min(L, r0 + (hi - x));
      pieces.push_back({static_cast<int>(h), r0, r1});
      x += r1 - r0;
    }
  }
  split_begin[ns] = static_cast<int>(pieces.size());
  const size_t part_size = detail::slot_floats(static_cast<size_t>(G) * (d + 2));
  float* pp = detail::slot_aligned(parts, pieces.size() * part_size);
  // Splits handed out one at a time (detail::decode_splits); the AVX-512 scratch is per thread.
  const int nt = std::min(T, ns);
  float* scr = wide ? detail::slot_aligned(scratch, scratch_size * nt) : nullptr;
  const Piece* pcs = pieces.data();
  const int* sb = split_begin.data();
  const float* qsp = qs;
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1) if (nt > 1)
  for (int i = 0; i < ns; ++i) {
    if (wide)
      detail::avx512_run_split(kv, pcs, sb[i], sb[i + 1], qsp, G, pp, part_size, scr + omp_get_thread_num() * scratch_size);
    else
      run_split_any(kv, pcs, sb[i], sb[i + 1], qsp, qstride, G, pp, part_size);
  }

  // Log-sum-exp merge of the pieces of each KV head (pieces are in head order).
  for (size_t p0 = 0; p0 < pieces.size();) {
    const int h = pieces[p0].head;
    size_t p1 = p0;
    while (p1 < pieces.size() && pieces[p1].head == h) ++p1;
    for (int g = 0; g < G; ++g) {
      const size_t head = static_cast<size_t>(h) * G + g;
      float M = kNegInf;
      for (size_t p = p0; p < p1; ++p) M = std::max(M, pp[p * part_size + g]);
      if (extra) M = std::max(M, extra->logit[head]);
      float* o = out + head * d;
      std::fill(o, o + d, 0.0f);
      float lsum = 0.0f;
      if (extra) {  // the extra pair is one more piece: m = logit, l = 1, acc = value
        const float e = std::exp(extra->logit[head] - M);
        lsum += e;
        for (int i = 0; i < d; ++i) o[i] += e * extra->value[head * d + i];
      }
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

void decode_attention(const float* q, int heads, const KVStore& kv, float scale, float* out, int threads,
                      DecodeIsa isa, const VirtualPair* extra) {
  check_args(q, heads, kv, out, extra, "decode_attention");
  if (only_extra(heads, kv, out, extra)) return;
  int T = std::max(1, threads <= 0 ? omp_get_max_threads() : threads);
  constexpr int64_t kMinBytesPerThread = 256 << 10;  // below this a thread costs more than it saves
  T = static_cast<int>(std::clamp<int64_t>(kv.bytes() / kMinBytesPerThread, 1, T));
  decode_attention_splits(q, heads, kv, scale, out, T, detail::decode_splits(T), isa, extra);
}

bool decode_rounds_query(DecodeIsa isa, KVType type, int head_dim) {
  resolve_decode_isa(isa, head_dim);  // both back ends round the query alike; this checks isa
  return type != KVType::F32;
}

bool decode_dots_bf16(DecodeIsa isa) { return isa == DecodeIsa::Avx512 && detail::avx512_bf16_dot(); }

bool decode_weighs_values_in_int16(DecodeIsa isa, KVType type) {
  return isa == DecodeIsa::Avx512 && (type == KVType::Q8 || type == KVType::Q4);
}

bool decode_rounds_value_weights(DecodeIsa isa, KVType type, int group) {
  return isa == DecodeIsa::Avx512 && detail::avx512_pair_values(type, group, false);
}

void decode_attention_reference(const float* q, int heads, const KVStore& kv, float scale, float* out,
                                bool rounded_query, const VirtualPair* extra, float* largest_weight) {
  check_args(q, heads, kv, out, extra, "decode_attention_reference");
  const int hkv = kv.kv_heads(), G = heads / hkv, d = kv.head_dim();
  const int64_t L = kv.stored();
  std::vector<float> qq;
  if (rounded_query) {  // the scaled query as the kernels round it; no further scaling
    qq.resize(static_cast<size_t>(heads) * d);
    round_query(kv.type(), q, heads * d, scale, qq.data());
    q = qq.data();
    scale = 1.0f;
  }
  std::vector<float> k(static_cast<size_t>(L) * d), v(static_cast<size_t>(L) * d);
  std::vector<double> sc(L), o(d);
  std::vector<uint8_t> row(kv.row_bytes());
  for (int h = 0; h < hkv; ++h) {
    for (int64_t j = 0; j < L; ++j) {
      kv.read_k_rows(j, 1, h, row.data());
      dequantize_row(kv.type(), row.data(), d, k.data() + j * d);
      kv.read_v_rows(j, 1, h, row.data());
      dequantize_row(kv.type(), row.data(), d, v.data() + j * d);
    }
    for (int g = 0; g < G; ++g) {
      const size_t head = static_cast<size_t>(h) * G + g;
      const float* qh = q + head * d;
      double mx = extra ? extra->logit[head] : -std::numeric_limits<double>::infinity();
      for (int64_t j = 0; j < L; ++j) {
        double dot = 0.0;
        for (int i = 0; i < d; ++i) dot += static_cast<double>(qh[i]) * k[j * d + i];
        sc[j] = dot * scale;
        mx = std::max(mx, sc[j]);
      }
      double sum = 0.0;
      std::fill(o.begin(), o.end(), 0.0);
      if (extra) {
        const double p = std::exp(extra->logit[head] - mx);
        sum += p;
        for (int i = 0; i < d; ++i) o[i] += p * extra->value[head * d + i];
      }
      for (int64_t j = 0; j < L; ++j) {
        const double p = std::exp(sc[j] - mx);
        sum += p;
        for (int i = 0; i < d; ++i) o[i] += p * v[j * d + i];
      }
      float* oh = out + (static_cast<size_t>(h) * G + g) * d;
      for (int i = 0; i < d; ++i) oh[i] = static_cast<float>(o[i] / sum);
      if (largest_weight) largest_weight[head] = static_cast<float>(1.0 / sum);  // the max's p is 1
    }
  }
}

}  // namespace kvx::kernels

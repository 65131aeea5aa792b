// AVX-512 back end of decode_attention (see decode_attention.h for the maths, and
// decode_attention_isa.h for why this file uses no std:: templates).
//
// Same algorithm as the AVX2 kernel: per (KV head, row range) piece, tiles of rows; scores of
// all G query heads against a tile, an online-softmax update, then the V rows accumulated with
// the weights. 16-lane vectors and 32 registers double the multiply-adds per instruction,
// which is what GQA needs: with G query heads per KV head the kernel does 2 G d multiply-adds
// per row pair, so at G = 4 on AVX2 it is bound by the FMA pipes rather than by memory.
// f32/bf16 scores: each K row read once per group of up to 4 queries, lanes along head_dim,
// then one transpose-add per 16 scores; bf16 rows are dotted as they are stored, by vdpbf16ps
// with the query rounded to bf16 (AVX-512 BF16: half the instructions of widening the row to
// fp32; Zen 5, G = 4, rows in L1: 11 cycles a row and KV head against 19), else widened.
// LRKV f32/bf16 at 8-16 heads with latents of up to 8 words a head (f32: 64): heads in lanes
// instead (head_lane_scores);
// bf16 then also weighs V_s and the latents two rows at a time by vdpbf16ps, with the softmax
// numerators rounded to bf16 (pair_value_pass, pair_latent_values).
// q8/q4 scores: tokens in lanes (token_scores): 16 rows transposed once for all G queries, then per query and block 8 integer dot-product
// instructions (VNNI) and no horizontal sums.
// Values: rows read 32 values at a time (a "group"; a q8/q4 block): f32 and q8 as two vectors
// in natural order, bf16 and q4 as (even | odd) positions (one load, shift/mask, no shuffles);
// the query is permuted to match and the V accumulator un-permuted at the end of a piece. q8/q4
// codes are read unscaled, the V block scales folded into the weights (p_t d_b); q8/q4 weights become
// 15-bit codes per tile, dotted with pairs of rows in int16 by vpdpwssd (int_value_pass).
// On the Zen 5 this was tuned on, about 3 vector instructions start a cycle with FMAs in the mix,
// so the work around the multiply-adds (conversions, transposes, horizontal sums) costs time even
// where its pipes idle.
// The measurements behind each choice (A/B ratios, variants built and not kept) are in
// docs/decode-kernels.md, under the name of the function or constant they concern.
#include "kernels/decode_attention_isa.h"

#if !(defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__) && defined(__AVX512VNNI__))
#error "kernels/decode_attention_avx512.cpp must be compiled with -march=x86-64-v4 -mavx512vnni (see CMakeLists.txt)"
#endif

#include <immintrin.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define KVX_INLINE inline __attribute__((always_inline))

namespace kvx::kernels::detail {

namespace {

constexpr int kMaxTile = 64;
constexpr int kRow = kMaxTile + 16;  // score row stride: room for a 16-row block past the tile
constexpr float kNegInf = -INFINITY;

template <int N>
struct Int {
  static constexpr int value = N;
};

// f(Int<1>{}) if `on`, else f(Int<0>{}); the first compiled only where kCompiled.
template <bool kCompiled, class F>
KVX_INLINE void with_flag(bool on, F&& f) {
  if constexpr (kCompiled)
    if (on) return f(Int<1>{});
  f(Int<0>{});
}

KVX_INLINE int imin(int a, int b) { return a < b ? a : b; }
KVX_INLINE int64_t lmin(int64_t a, int64_t b) { return a < b ? a : b; }
// Query heads go in groups of 4, 2, 1 that share each K/V load.
KVX_INLINE int group_size(int left) { return left >= 4 ? 4 : left >= 2 ? 2 : 1; }

// ---------------------------------------------------------------------------------------------
// Row readers: val(row, j, a, b) = group j (values 32j .. 32j + 31) as vectors a, b; q8/q4
// without their block scale, `row` pointing past the fp16 scales.

// Per-type switches (the tuning ones set the way they measured faster with the cache cold):
// - kMhaValuePrefetch / kMhaKeyPrefetch: software prefetch of the next V / K tile with one query
//   per KV head (MHA); f32 leaves both to the hardware prefetcher, q8/q4 prefetch their K rows in
//   their 16-row transposes.
// - kUnrolledValuePass: value_pass unrolls its loops over the accumulators by pragma and steps its
//   row and weight pointers (f32/bf16), or keeps plain indexed loops (q8/q4).
// - kMhaValuePrefetchSteps: MHA value passes prefetch the next V tile in steps of 8 rows
//   (value_tile), not in one burst at the pass's start.
// - kGroupFarPrefetch: the L2 prefetch of the tile 3 ahead (run_piece) for every f32/bf16 piece
//   with 8 or more queries per row; f32 takes it only for LRKV latents wider than the shared rows.
// - kHeadLanes: LRKV scores may run with heads in lanes (head_lane_scores: f32, and bf16 by
//   vdpbf16ps).
// - kIntValues: values weighed in integers (int_value_pass; q8, q4).
struct F32Row {
  static constexpr bool kQuant = false, kPerm = false, kNibbles = false, kWideResidualGroups = true, kMhaValuePrefetch = false,
                        kMhaKeyPrefetch = false, kGroupFarPrefetch = false,
                        kUnrolledValuePass = true, kMhaValuePrefetchSteps = true, kDotBF16 = false, kHeadLanes = true, kIntValues = false;
  static KVX_INLINE void val(const uint8_t* row, int j, __m512& a, __m512& b) {
    const float* p = reinterpret_cast<const float*>(row) + 32 * j;
    a = _mm512_loadu_ps(p);
    b = _mm512_loadu_ps(p + 16);
  }
  // Values 16 v .. 16 v + 15 in natural order, zeros outside m (LRKV latents of r % 32 != 0,
  // read as flat rows).
  static KVX_INLINE __m512 flat(const uint8_t* row, int v, __mmask16 m) {
    return _mm512_maskz_loadu_ps(m, reinterpret_cast<const float*>(row) + 16 * v);
  }
};

struct BF16Row {
  static constexpr bool kQuant = false, kPerm = true, kNibbles = false, kWideResidualGroups = false, kMhaValuePrefetch = true,
                        kMhaKeyPrefetch = true, kGroupFarPrefetch = true,
                        kUnrolledValuePass = true, kMhaValuePrefetchSteps = true, kDotBF16 = true, kHeadLanes = true, kIntValues = false;
  static KVX_INLINE void val(const uint8_t* row, int j, __m512& a, __m512& b) {
    const __m512i w = _mm512_loadu_si512(row + 64 * j);
    a = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    b = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
  }
  // As F32Row::flat: natural order (not even | odd).
  static KVX_INLINE __m512 flat(const uint8_t* row, int v, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, row + 32 * v)), 16));
  }
};

// bf16 on CPUs without AVX-512 BF16 (or with KVX_NO_AVX512_BF16 set, for the tests): keys
// widened to floats (val) against the same bf16-rounded query, prepared as (even | odd) floats.
struct BF16FmaRow : BF16Row {
  static constexpr bool kDotBF16 = false, kHeadLanes = false;
};

// q8/q4 values: codes as floats, without the block scale (folded into the attention weights), for
// LRKV's latents; V rows (kIntValues) in int16 instead, against 15-bit weight codes (int_value_pass).
// q8/q4 keys are read by token_scores below, in integers.
struct Q8Row {
  static constexpr bool kQuant = true, kPerm = false, kNibbles = false, kWideResidualGroups = false, kMhaValuePrefetch = true,
                        kMhaKeyPrefetch = true, kGroupFarPrefetch = false,
                        kUnrolledValuePass = false, kMhaValuePrefetchSteps = true, kDotBF16 = false, kHeadLanes = false, kIntValues = true;
  static KVX_INLINE void val(const uint8_t* row, int j, __m512& a, __m512& b) {
    const uint8_t* p = row + 32 * j;
    a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
  }
};

// q4 nibble n -> n - 8, by _mm512_permutexvar_ps(lanes, q4_values()) (vpermps reads the low 4 bits of each lane).
KVX_INLINE __m512 q4_values() { return _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7); }

struct Q4Row {
  static constexpr bool kQuant = true, kPerm = true, kNibbles = true, kWideResidualGroups = false, kMhaValuePrefetch = true,
                        kMhaKeyPrefetch = true, kGroupFarPrefetch = false,
                        kUnrolledValuePass = false, kMhaValuePrefetchSteps = false, kDotBF16 = false, kHeadLanes = false, kIntValues = true;
  // even positions, odd positions
  static KVX_INLINE void val(const uint8_t* row, int j, __m512& a, __m512& b) {
    const __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * j)));
    a = _mm512_permutexvar_ps(w, q4_values());
    b = _mm512_permutexvar_ps(_mm512_srli_epi32(w, 4), q4_values());
  }
};

// The line `ahead` bytes on from p, to L1: a stream fetched at a fixed distance in rows as it is
// read, one prefetch per line read (run_piece's `ahead`: f32 heads in lanes, latents of r % 32 != 0). A stream's
// pages lie back to back in a KVStore chunk, so past a tile's or a page's end it fetches the next
// rows; past a chunk's or the piece's end, lines nobody reads (a prefetch never faults).
KVX_INLINE void prefetch_ahead(const void* p, size_t ahead) { __builtin_prefetch(static_cast<const char*>(p) + ahead, 0, 3); }

// One prefetch (into L2) per 4 KiB page boundary in [base + far, base + far + bytes). On a VM whose
// hardware prefetchers stop at every page and pay a nested table walk for the next, touching a page
// ~16 KB before the stream reaches it starts that walk early.
KVX_INLINE void touch_pages(const uint8_t* base, size_t bytes, size_t far) {
  const uintptr_t lo = reinterpret_cast<uintptr_t>(base) + far, hi = lo + bytes;
  for (uintptr_t a = (lo + 4095) & ~uintptr_t{4095}; a < hi; a += 4096) __builtin_prefetch(reinterpret_cast<const void*>(a), 0, 1);
}

// ---------------------------------------------------------------------------------------------
// Vector helpers.

// Lane i of the result = sum of the lanes of a[i] (a transpose-and-add tree, 45 instructions).
KVX_INLINE __m512 reduce16(const __m512* a) {
  __m512 x[8], y[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0 + a2, b0 + b2, a1 + a3, b1 + b3]
    x[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: partial sums of a[4i .. 4i + 3]
    const __m512d u = _mm512_castps_pd(x[2 * i]), v = _mm512_castps_pd(x[2 * i + 1]);
    y[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(u, v)), _mm512_castpd_ps(_mm512_unpackhi_pd(u, v)));
  }
  const __m512 z0 = _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(y[0], y[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 z1 = _mm512_add_ps(_mm512_shuffle_f32x4(y[2], y[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(y[2], y[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z0, z1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(z0, z1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// acc + a times the 32-bit word at w broadcast: a's bf16 pairs dotted with the word's pair
// (vdpbf16ps), or a's floats times the float (vfmadd231ps); {1to16} from memory, which the
// compiler does not fold on its own.
KVX_INLINE __m512 dpbf16_broadcast(__m512 acc, __m512 a, const int32_t* w) {
  __asm__("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(a), "m"(*w));
  return acc;
}
KVX_INLINE __m512 fmadd_broadcast(__m512 acc, __m512 a, const int32_t* w) {
  __asm__("vfmadd231ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(a), "m"(*w));
  return acc;
}

// e^x = 2^k e^r, k = round(x log2 e), r = x - k ln 2 (two-step), e^r by its degree-7 Taylor
// polynomial (|r| <= 0.347: truncation < 1e-8). x < -87 gives 0 (also for -inf).
KVX_INLINE __m512 exp512(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, k));
}

// Software prefetch of one stream (K or V rows of a head) ahead of a tile: the byte range [from,
// to) past `base` (the start of the tile it fetches), which runs on for `end` bytes on this page,
// then continues at `next` (the next page) for `next_end` bytes; nothing past the piece. The next
// tile goes to L1; with `far`, the same share of a tile further on to L2. One line an iteration
// (tighter bursts ran slower). The kernels depend on it: without software prefetch most run at half
// to two thirds of their speed cold.
struct Prefetch {
  const uint8_t *base, *next;
  size_t end, next_end;
  const Prefetch* far = nullptr;
  size_t lo = 0, span = 0, total = 0;  // a share (share()): range(from, to) of [0, total) maps into [lo, lo + span)
  // range(f, t) of [0, whole) maps onto [from + (to - from) f / whole, ...): bytes [from, to) of the
  // range, for a caller that spreads [0, whole) over its own part of the work.
  Prefetch share(size_t from, size_t to, size_t whole) const {
    if (from == 0 && to == whole) return *this;  // the whole range (one query group): no mapping
    Prefetch p = *this;
    p.lo = from;
    p.span = to - from;
    p.total = whole;
    return p;
  }
  template <int kLocality = 3>  // __builtin_prefetch locality: 3 = prefetcht0 (L1), 2 = prefetcht1 (L2)
  KVX_INLINE void range(size_t from, size_t to) const {
    if (total) {
      from = lo + span * from / total;
      to = lo + span * to / total;
    }
    for (size_t o = from & ~size_t{63}; o < (to < end ? to : end); o += 64) __builtin_prefetch(base + o, 0, kLocality);
    if (to > end && next) {
      const size_t f = from > end ? from - end : 0, t = to - end < next_end ? to - end : next_end;
      for (size_t o = f & ~size_t{63}; o < t; o += 64) __builtin_prefetch(next + o, 0, kLocality);
    }
    if (far) far->template range<2>(from, to);
  }
};

// ---------------------------------------------------------------------------------------------
// Float scores: s[g * kRow + t] = q_g . k_t for GB queries x TB rows (GB * TB = 16); rows past
// the tile repeat its last row, their scores land in the padding.
// LRKV's residual in a score block: query g also dots its own latent segment of the residual
// rows (rows[t] + g * head_bytes) with qb_g, into the same accumulator, so one reduction serves
// both parts (lrkv_decode.h).
// f32/bf16 latents of r % 32 != 0 are read as flat rows [R_0 | .. | R_{H-1}] of 16-value vectors
// (FlatLatents): head h's segment [h r, h r + r) lies in vectors h r / 16 on, each dotted with a
// position vector of its prepared qb (qb_h scaled at the segment's lanes, zeros elsewhere:
// avx512_prepare_latent_queries).
struct FlatLatents {
  int r = 0;
  int row_vectors = 0;       // ceil(H r / 16)
  __mmask16 last = 0xffff;   // the lanes of the row's last vector
  static int head_vectors(int r) { return (r + 30) / 16; }  // position vectors per head (the most a segment spans)
  int max_count = 0;         // the most vectors one head's segment spans
  int first(int h) const { return h * r / 16; }
  int count(int h) const { return (h * r % 16 + r + 15) / 16; }
  // The lanes of vector v inside the row. A vector also holds other heads' values (zero query
  // lanes drop them; the store refuses non-finite values, so 0 x inf never arises).
  __mmask16 mask(int v) const { return v < row_vectors - 1 ? static_cast<__mmask16>(0xffff) : v == row_vectors - 1 ? last : 0; }
};

struct ResidualRows {
  const uint8_t* qb = nullptr;  // the group's first prepared qb (flat: head 0's position vectors)
  size_t qb_stride = 0;         // bytes between heads' qb
  int blocks = 0;               // r / 32 per head
  size_t head_bytes = 0;        // bytes per head segment
  const uint8_t* const* rows = nullptr;  // flat: at head 0
  const FlatLatents* flat = nullptr;
  int head = 0;                 // flat: the group's first head
};

// acc + the products of the 32 bf16 values in k with the 32 at q, pairwise into 16 lanes
// (vdpbf16ps; the products are exact in fp32).
KVX_INLINE __m512 dot_bf16(__m512 acc, __m512i k, const uint8_t* q) {
  return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q), (__m512bh)k);
}

// kFlat: latents of r % 32 != 0, as flat rows (a separate instantiation, so that the code of r % 32
// == 0 stays as it was).
// kSpread: the block prefetches its rows' share [pf_lo, pf_hi) of the next K tile in nj steps,
// one per 32 values of d, instead of all of it before the block (scores_for).
template <class R, int GB, int TB, bool kFlat = false, bool kSpread = false>
KVX_INLINE void score_block(const float* q, int d, int nj, const uint8_t* const* rows, float* s,
                            const ResidualRows* res = nullptr, const Prefetch* pf = nullptr, size_t pf_lo = 0, size_t pf_hi = 0) {
  static_assert(GB * TB == 16, "score_block reduces 16 accumulators");
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  const size_t pf_step = kSpread ? (pf_hi - pf_lo) / nj : 0;
  for (int j = 0; j < nj; ++j) {
    if constexpr (kSpread) pf->range(pf_lo + pf_step * j, j + 1 == nj ? pf_hi : pf_lo + pf_step * (j + 1));
    for (int t = 0; t < TB; ++t) {
      if constexpr (R::kDotBF16) {
        const __m512i k = _mm512_loadu_si512(rows[t] + 64 * j);
        for (int g = 0; g < GB; ++g)
          acc[g * TB + t] = dot_bf16(acc[g * TB + t], k, reinterpret_cast<const uint8_t*>(q + g * d) + 64 * j);
        continue;
      }
      __m512 ka, kb;
      R::val(rows[t], j, ka, kb);
      for (int g = 0; g < GB; ++g) {
        const float* qg = q + g * d + 32 * j;
        acc[g * TB + t] = _mm512_fmadd_ps(_mm512_loadu_ps(qg), ka, acc[g * TB + t]);
        acc[g * TB + t] = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16), kb, acc[g * TB + t]);
      }
    }
  }
  if constexpr (kFlat) {  // k-th vector of each head's segment (zero position vectors past its count)
    const FlatLatents& fl = *res->flat;
    const size_t hv = static_cast<size_t>(FlatLatents::head_vectors(fl.r)) * 16;
    const float* qp = reinterpret_cast<const float*>(res->qb) + res->head * hv;
    for (int k = 0; k < fl.max_count; ++k)
      for (int g = 0; g < GB; ++g) {
        const int v = fl.first(res->head + g) + k;
        const __m512 qv = _mm512_loadu_ps(qp + g * hv + 16 * k);
        const __mmask16 m = fl.mask(v);
        for (int t = 0; t < TB; ++t) acc[g * TB + t] = _mm512_fmadd_ps(qv, R::flat(res->rows[t], v, m), acc[g * TB + t]);
      }
  } else if (res) {
    for (int j = 0; j < res->blocks; ++j)
      for (int g = 0; g < GB; ++g) {
        if constexpr (R::kDotBF16) {
          const uint8_t* qg = res->qb + g * res->qb_stride + 64 * j;
          for (int t = 0; t < TB; ++t)
            acc[g * TB + t] = dot_bf16(acc[g * TB + t], _mm512_loadu_si512(res->rows[t] + g * res->head_bytes + 64 * j), qg);
          continue;
        }
        const float* qg = reinterpret_cast<const float*>(res->qb + g * res->qb_stride) + 32 * j;
        const __m512 q0 = _mm512_loadu_ps(qg), q1 = _mm512_loadu_ps(qg + 16);
        for (int t = 0; t < TB; ++t) {
          __m512 ka, kb;
          R::val(res->rows[t] + g * res->head_bytes, j, ka, kb);
          acc[g * TB + t] = _mm512_fmadd_ps(q0, ka, acc[g * TB + t]);
          acc[g * TB + t] = _mm512_fmadd_ps(q1, kb, acc[g * TB + t]);
        }
      }
  }
  alignas(64) float r[16];
  _mm512_store_ps(r, reduce16(acc));
  for (int g = 0; g < GB; ++g)
    for (int t = 0; t < TB; ++t) s[g * kRow + t] = r[g * TB + t];
}

template <class R, int GB, int TB>
KVX_INLINE void score_block_flat(bool flat, const float* q, int d, int nj, const uint8_t* const* rows, float* s,
                                 const ResidualRows* res, const Prefetch* spread, size_t pf_lo, size_t pf_hi) {
  if (flat)
    score_block<R, GB, TB, true>(q, d, nj, rows, s, res);
  else if (spread)
    score_block<R, GB, TB, false, true>(q, d, nj, rows, s, res, spread, pf_lo, pf_hi);
  else
    score_block<R, GB, TB>(q, d, nj, rows, s, res);
}

// bf16 scores from a Tiled16 store's K group (kv_store.h), tokens in lanes: s[g * kRow + t] = q_g .
// k_t for its 16 tokens and GB queries (q + g * d floats as prepared for R). Word i of the 16 tokens
// is one vector, dotted with query g's pair i broadcast (vdpbf16ps; widened: the pair's two floats
// against the even and odd values): no row transposes or horizontal sums. Two chains a query. pf:
// [pf_lo, pf_hi) of it fetched in 4 steps over the words (faster cold than one burst).
template <class R, int GB>
KVX_INLINE void bf16_group_scores(const uint8_t* group, const float* q, int d, float* s, const Prefetch* pf, size_t pf_lo,
                                  size_t pf_hi) {
  __m512 a[GB][2];
#pragma GCC unroll 8
  for (int g = 0; g < GB; ++g) a[g][0] = a[g][1] = _mm512_setzero_ps();
  const int words = d / 2;
  for (int i = 0; i < words; i += 2) {
    if (pf && i % 16 == 0) pf->range(pf_lo + (pf_hi - pf_lo) * i / words, pf_lo + (pf_hi - pf_lo) * imin(i + 16, words) / words);
    const __m512i k0 = _mm512_loadu_si512(group + 64 * i), k1 = _mm512_loadu_si512(group + 64 * (i + 1));
    if constexpr (R::kDotBF16) {
#pragma GCC unroll 8
      for (int g = 0; g < GB; ++g) {
        const int32_t* qw = reinterpret_cast<const int32_t*>(q + g * d);
        a[g][0] = dpbf16_broadcast(a[g][0], _mm512_castsi512_ps(k0), qw + i);
        a[g][1] = dpbf16_broadcast(a[g][1], _mm512_castsi512_ps(k1), qw + i + 1);
      }
    } else {  // (even | odd) query floats a 32-value group: pair i's at 32 (i / 16) + i % 16 and + 16
      const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
      const __m512 e0 = _mm512_castsi512_ps(_mm512_slli_epi32(k0, 16)), o0 = _mm512_castsi512_ps(_mm512_and_si512(k0, high));
      const __m512 e1 = _mm512_castsi512_ps(_mm512_slli_epi32(k1, 16)), o1 = _mm512_castsi512_ps(_mm512_and_si512(k1, high));
      const int at = 32 * (i / 16) + i % 16;
#pragma GCC unroll 8
      for (int g = 0; g < GB; ++g) {
        const float* qg = q + g * d + at;
        a[g][0] = _mm512_fmadd_ps(e0, _mm512_set1_ps(qg[0]), a[g][0]);
        a[g][0] = _mm512_fmadd_ps(o0, _mm512_set1_ps(qg[16]), a[g][0]);
        a[g][1] = _mm512_fmadd_ps(e1, _mm512_set1_ps(qg[1]), a[g][1]);
        a[g][1] = _mm512_fmadd_ps(o1, _mm512_set1_ps(qg[17]), a[g][1]);
      }
    }
  }
#pragma GCC unroll 8
  for (int g = 0; g < GB; ++g) _mm512_storeu_ps(s + g * kRow, _mm512_add_ps(a[g][0], a[g][1]));
}

// bf16_group_scores for G queries, in passes of up to 8 (the first fetches pf's range).
template <class R>
KVX_INLINE void bf16_group_scores_all(const uint8_t* group, const float* q, int d, int G, float* s, const Prefetch& kpf,
                                      size_t pf_lo, size_t pf_hi) {
  for (int g = 0, gb; g < G; g += gb) {
    gb = G - g >= 8 ? 8 : group_size(G - g);
    const Prefetch* pf = g == 0 ? &kpf : nullptr;
    switch (gb) {
      case 8: bf16_group_scores<R, 8>(group, q + g * d, d, s + g * kRow, pf, pf_lo, pf_hi); break;
      case 4: bf16_group_scores<R, 4>(group, q + g * d, d, s + g * kRow, pf, pf_lo, pf_hi); break;
      case 2: bf16_group_scores<R, 2>(group, q + g * d, d, s + g * kRow, pf, pf_lo, pf_hi); break;
      default: bf16_group_scores<R, 1>(group, q + g * d, d, s + g * kRow, pf, pf_lo, pf_hi); break;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// q8/q4 scores with tokens in lanes. 16 rows are transposed so that lane t of vector i holds
// 32-bit word i of row t; a query's block dot is then 8 vpdpbusd (unsigned row bytes x signed
// query bytes, 4 per lane) with the query's matching 4 bytes broadcast, and no horizontal sum.
// The transpose is shared by every query head reading the rows (the GQA group, or all H for
// LRKV's shared K).
// q8 stores in the Tiled16 layout (kv_store.h, decode_kv_layout) skip the transposes: a group's
// word i of block b is one load (TokenGroup), its scales one fp16 vector a block (group_scales).
// Outputs identical to the Rows layout's. q4 the same (nibbles as stored, split after the load).

// 16 rows `stride` bytes apart from `base`; with kClamp, rows past `last` repeat it (a tile's
// tail), so nothing past the tile is read.
template <bool kClamp>
struct Rows16 {
  const uint8_t* base;
  size_t stride;
  int last;
  KVX_INLINE const uint8_t* operator[](int k) const { return base + static_cast<size_t>(kClamp ? imin(k, last) : k) * stride; }
};

// out[i] lane t = word i of row t, the rows given as r[k] = [row k | row k + 8] (32 bytes each):
// two 8 x 8 word transposes side by side.
KVX_INLINE void transpose_words(const __m512i* r, __m512i* out) {
  __m512i t[8], u[8];
  for (int k = 0; k < 8; k += 2) {  // per 128-bit lane: words (0, 1) or (2, 3) of rows k, k + 1
    t[k] = _mm512_unpacklo_epi32(r[k], r[k + 1]);
    t[k + 1] = _mm512_unpackhi_epi32(r[k], r[k + 1]);
  }
  for (int k = 0; k < 8; k += 4) {  // per 128-bit lane: one word of rows k .. k + 3
    u[k] = _mm512_unpacklo_epi64(t[k], t[k + 2]);
    u[k + 1] = _mm512_unpackhi_epi64(t[k], t[k + 2]);
    u[k + 2] = _mm512_unpacklo_epi64(t[k + 1], t[k + 3]);
    u[k + 3] = _mm512_unpackhi_epi64(t[k + 1], t[k + 3]);
  }
  // u[i] lanes: word i of rows 0-3, word i + 4 of rows 0-3, the same of rows 8-11; u[i + 4]: of
  // rows 4-7 and 12-15.
  const __m512i first = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13), second = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
  for (int i = 0; i < 4; ++i) {
    out[i] = _mm512_permutex2var_epi64(u[i], first, u[i + 4]);
    out[i + 4] = _mm512_permutex2var_epi64(u[i], second, u[i + 4]);
  }
}

// out[i] lane t = word i of the `bytes` (<= 32) bytes at rows[t] + offset (t < 16), zeros past them.
template <class Rows>
KVX_INLINE void transpose16x8(const Rows& rows, size_t offset, int bytes, __m512i* out) {
  const __mmask32 m = bytes >= 32 ? ~__mmask32{0} : (__mmask32{1} << bytes) - 1;
  __m512i r[8];
  for (int k = 0; k < 8; ++k)
    r[k] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_maskz_loadu_epi8(m, rows[k] + offset)),
                              _mm256_maskz_loadu_epi8(m, rows[k + 8] + offset), 1);
  transpose_words(r, out);
}

// Scale j (fp16) of 16 rows, from words w (two scales per word) -> 16 floats.
KVX_INLINE __m512 scale_lanes(const __m512i* w, int j) {
  const __m512i x = j % 2 ? _mm512_srli_epi32(w[j / 2], 16) : w[j / 2];
  return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(x));
}

// The fp16 scales of `blocks` blocks at the start of 16 rows -> dst[b * kMaxTile + t] floats.
template <class Rows>
KVX_INLINE void transpose_scales(const Rows& rows, int blocks, float* dst) {
  for (int c = 0; c < blocks; c += 16) {
    __m512i w[8];
    transpose16x8(rows, 2 * static_cast<size_t>(c), imin(32, 2 * (blocks - c)), w);
    for (int j = 0; j < imin(16, blocks - c); ++j) _mm512_storeu_ps(dst + static_cast<size_t>(c + j) * kMaxTile, scale_lanes(w, j));
  }
}

// The K and V rows' scales (nb <= 8 blocks each) in one transpose: a row's K scales followed by
// its V scales make up the 4 nb bytes transposed -> kT, vT [b][kMaxTile].
template <class Rows>
KVX_INLINE void transpose_kv_scales(const Rows& krows, const Rows& vrows, int nb, float* kT, float* vT) {
  const int bytes = 2 * nb;
  const __mmask32 mk = (__mmask32{1} << bytes) - 1, mv = (bytes == 16 ? ~__mmask32{0} : (__mmask32{1} << (2 * bytes)) - 1) & ~mk;
  auto row = [&](int k) {  // V's scales loaded as if they followed K's (masked: no byte before the row is read)
    return _mm256_mask_loadu_epi8(_mm256_maskz_loadu_epi8(mk, krows[k]), mv, vrows[k] - bytes);
  };
  __m512i r[8], w[8];
  for (int k = 0; k < 8; ++k) r[k] = _mm512_inserti64x4(_mm512_castsi256_si512(row(k)), row(k + 8), 1);
  transpose_words(r, w);
  for (int j = 0; j < nb; ++j) {
    _mm512_storeu_ps(kT + static_cast<size_t>(j) * kMaxTile, scale_lanes(w, j));
    _mm512_storeu_ps(vT + static_cast<size_t>(j) * kMaxTile, scale_lanes(w, nb + j));
  }
}

// acc + the dot products of the unsigned bytes of u with the signed bytes of *w, in each lane
// (vpdpbusd with *w broadcast from memory, which the compiler does not fold on its own).
KVX_INLINE __m512i dpbusd_broadcast(__m512i acc, __m512i u, const int32_t* w) {
  __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*w));
  return acc;
}

// q4 blocks b and (pair) b + 1 from w[i] lane t = word i of token t's 32 bytes of them (4 words a
// block): u[8 k .. 8 k + 3] the low nibbles of block b + k's words, u[8 k + 4 ..] the high ones.
KVX_INLINE void split_nibbles(const __m512i* w, bool pair, __m512i* u) {
  const __m512i lo4 = _mm512_set1_epi8(0x0f);
  for (int i = 0; i < (pair ? 8 : 4); ++i) {
    u[(i / 4) * 8 + i % 4] = _mm512_and_si512(w[i], lo4);
    u[(i / 4) * 8 + 4 + i % 4] = _mm512_and_si512(_mm512_srli_epi16(w[i], 4), lo4);
  }
}

// The rows' blocks b and (pair) b + 1 as 8 vectors each of unsigned 4-byte groups, u[i] pairing
// with the query's word i (q8: code + 128; q4: the low nibbles of word i, then the high ones); the
// query in the integer layout of prepare_int_queries (decode_attention_isa.h).
template <class R, class Rows>
KVX_INLINE void row_words(const Rows& rows, size_t offset, int nb, int b, bool pair, __m512i* u) {
  __m512i w[8];
  if constexpr (R::kNibbles) {  // 16 bytes a block: one 32-byte transpose holds both (b is even)
    transpose16x8(rows, offset + 16 * static_cast<size_t>(b), pair ? 32 : 16, w);
    split_nibbles(w, pair, u);
  } else {
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    for (int k = 0; k < (pair ? 2 : 1); ++k) {
      transpose16x8(rows, offset + 32 * static_cast<size_t>(b + k), 32, w);
      for (int i = 0; i < 8; ++i) u[8 * k + i] = _mm512_xor_si512(w[i], flip);
    }
  }
}

// A Tiled16 store's K group of 16 tokens (kv_store.h): word i of each 32 code bytes of its tokens
// is already one vector (q8: codes + 128), loaded instead of transposed; `offset` is unused (the
// group starts at its codes).
struct TokenGroup {
  const uint8_t* codes;
};
template <class R>
KVX_INLINE void row_words(const TokenGroup& group, size_t, int, int b, bool pair, __m512i* u) {
  if constexpr (R::kNibbles) {  // blocks b, b + 1 (b even): 32 bytes a token
    __m512i w[8];
    for (int i = 0; i < (pair ? 8 : 4); ++i) w[i] = _mm512_loadu_si512(group.codes + 256 * static_cast<size_t>(b) + 64 * i);
    split_nibbles(w, pair, u);
  } else {
    for (int k = 0; k < (pair ? 2 : 1); ++k)
      for (int i = 0; i < 8; ++i) u[8 * k + i] = _mm512_loadu_si512(group.codes + 512 * static_cast<size_t>(b + k) + 64 * i);
  }
}

// The fp16 scales of `blocks` blocks of a Tiled16 group (16 per block, 32 bytes apart) -> dst[b *
// kMaxTile + t] floats; lanes outside `live` (past a tile's end) 0, so their scores and weights are 0.
KVX_INLINE void group_scales(const uint8_t* scales, int blocks, __mmask16 live, float* dst) {
  for (int b = 0; b < blocks; ++b)
    _mm512_storeu_ps(dst + static_cast<size_t>(b) * kMaxTile, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, scales + 32 * static_cast<size_t>(b))));
}

// s[g * kRow + t] (add: +=) q_g . k_t for the 16 rows (`offset` bytes into rows[t]: nb blocks of
// codes; or a TokenGroup) and G queries q + g * qstride bytes; kT: the rows' block scales [b][kMaxTile].
template <class R, class Rows>
KVX_INLINE void token_scores(const Rows& rows, size_t offset, int nb, const uint8_t* q, size_t qstride, int G,
                             const float* kT, float* s, bool add) {
  // q4 blocks in pairs (one transpose holds both; each query's two dot products are the two
  // independent chains); q8 blocks one at a time, the chain split in two (pairs keep 16 more
  // registers live across LRKV's 16 heads).
  for (int b = 0, step; b < nb; b += step) {
    const bool pair = R::kNibbles && b + 1 < nb;
    step = pair ? 2 : 1;
    __m512i u[16];
    row_words<R>(rows, offset, nb, b, pair, u);
    const __m512 dk0 = _mm512_loadu_ps(kT + static_cast<size_t>(b) * kMaxTile);
    const __m512 dk1 = pair ? _mm512_loadu_ps(kT + static_cast<size_t>(b + 1) * kMaxTile) : dk0;
    for (int g = 0; g < G; ++g) {
      const uint8_t* qg = q + g * qstride;
      const int32_t* words = reinterpret_cast<const int32_t*>(qg) + 8 * b;
      const int32_t* bias = reinterpret_cast<const int32_t*>(qg) + 8 * nb + b;
      const float* dq = reinterpret_cast<const float*>(qg) + 9 * nb + b;
      float* sg = s + g * kRow;
      const __m512 prev = add || b > 0 ? _mm512_loadu_ps(sg) : _mm512_setzero_ps();
      __m512i acc0 = _mm512_set1_epi32(bias[0]), acc1;
      __m512 x;
      if (pair) {
        acc1 = _mm512_set1_epi32(bias[1]);
        for (int i = 0; i < 8; ++i) {
          acc0 = dpbusd_broadcast(acc0, u[i], words + i);
          acc1 = dpbusd_broadcast(acc1, u[8 + i], words + 8 + i);
        }
        x = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc0), _mm512_mul_ps(dk0, _mm512_set1_ps(dq[0])), prev);
        x = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc1), _mm512_mul_ps(dk1, _mm512_set1_ps(dq[1])), x);
      } else {
        acc1 = _mm512_setzero_si512();
        for (int i = 0; i < 8; i += 2) {
          acc0 = dpbusd_broadcast(acc0, u[i], words + i);
          acc1 = dpbusd_broadcast(acc1, u[i + 1], words + i + 1);
        }
        x = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(acc0, acc1)), _mm512_mul_ps(dk0, _mm512_set1_ps(dq[0])), prev);
      }
      _mm512_storeu_ps(sg, x);
    }
  }
}

// LRKV latent scores for r = 32 (one block per head) and up to 16 heads, a row at a time with
// dimensions in lanes: a row's [R_0 | .. | R_{H-1}] is 2 (q8) or 4 (q4) heads to a vector, dotted
// with the heads' qb side by side, the lanes summed per head by a transpose-add tree into one
// vector of the 16 heads (lane L: head perm[L]); 16 rows' vectors are then transposed to token
// lanes and added to the scores. Cheaper than a transpose of the rows per head (token_scores).
// r = 64 stays per head (token_scores): as "block heads" of r = 32 it was no faster.
struct LatentQuery {
  const uint8_t* codes;  // q8: per 2 heads 64 bytes (qb codes side by side); q4: per 4 heads 64 bytes of
                         // their low-nibble halves, then 64 of the high
  __m512i perm;          // lane L of the summed vector is head perm[L]
  __m512i bias;          // per lane, of its head
  __m512 dq;             // per lane, of its head
  int heads;
};

// The tree's head order: q8 sums 8 lanes per head (3 levels), q4 4 lanes (2 levels).
template <class R>
KVX_INLINE __m512i latent_head_order() {
  return R::kNibbles ? _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15)
                     : _mm512_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
}

// lanes (0 + 2, 1 + 3) of each 128-bit lane of a and b, interleaved: one level of the sum tree.
KVX_INLINE __m512i sum_pairs32(__m512i a, __m512i b) {
  return _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
}
KVX_INLINE __m512i sum_pairs64(__m512i a, __m512i b) {
  return _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
}

// Bytes [64 c, 64 c + 64) of the first `total` bytes at row (zeros past them; total > 64 c).
KVX_INLINE __m512i row_chunk(const uint8_t* row, int c, int total) {
  const int bytes = total - 64 * c;
  const __mmask64 m = bytes >= 64 ? ~__mmask64{0} : (__mmask64{1} << bytes) - 1;
  return _mm512_maskz_loadu_epi8(m, row + 64 * c);
}

// One latent row (codes at row): the 16-head vector of integer dots (lane L: head perm[L]).
// kHeads: 16 for a layer of 16 heads (known at compile time: no masked loads or head checks), else
// 0 (lq.heads).
template <class R, int kHeads>
KVX_INLINE __m512i latent_row_dots(const uint8_t* row, const LatentQuery& lq) {
  const int heads = kHeads ? kHeads : lq.heads;
  const __m512i zero = _mm512_setzero_si512();
  if constexpr (R::kNibbles) {
    __m512i d[4];
    const __m512i lo4 = _mm512_set1_epi8(0x0f);
    for (int c = 0; c < 4; ++c) {
      if (64 * c >= 16 * heads) {
        d[c] = zero;
        continue;
      }
      const __m512i w = row_chunk(row, c, 16 * heads);
      const uint8_t* q = lq.codes + 128 * c;
      d[c] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, _mm512_and_si512(w, lo4), _mm512_loadu_si512(q)),
                                 _mm512_and_si512(_mm512_srli_epi16(w, 4), lo4), _mm512_loadu_si512(q + 64));
    }
    return sum_pairs64(sum_pairs32(d[0], d[1]), sum_pairs32(d[2], d[3]));
  } else {
    __m512i d[8];
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    for (int c = 0; c < 8; ++c) {
      if (64 * c >= 32 * heads) {
        d[c] = zero;
        continue;
      }
      const __m512i u = _mm512_xor_si512(row_chunk(row, c, 32 * heads), flip);
      d[c] = _mm512_dpbusd_epi32(zero, u, _mm512_loadu_si512(lq.codes + 64 * c));  // a missing head's query is 0
    }
    const __m512i f0 = sum_pairs64(sum_pairs32(d[0], d[1]), sum_pairs32(d[2], d[3]));
    const __m512i f1 = sum_pairs64(sum_pairs32(d[4], d[5]), sum_pairs32(d[6], d[7]));
    return _mm512_add_epi32(_mm512_shuffle_i32x4(f0, f1, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_i32x4(f0, f1, _MM_SHUFFLE(3, 1, 3, 1)));
  }
}

// x[i] (16 x 16 floats) -> x[i] lane t = lane i of the input x[t].
KVX_INLINE void transpose16x16(__m512* x) {
  __m512i lo[8], hi[8], a[8], b[8];
  for (int k = 0; k < 8; ++k) {  // [row k | row k + 8], lanes 0-7 (lo) and 8-15 (hi) of each
    const __m512i xk = _mm512_castps_si512(x[k]), xk8 = _mm512_castps_si512(x[k + 8]);
    lo[k] = _mm512_shuffle_i64x2(xk, xk8, _MM_SHUFFLE(1, 0, 1, 0));
    hi[k] = _mm512_shuffle_i64x2(xk, xk8, _MM_SHUFFLE(3, 2, 3, 2));
  }
  transpose_words(lo, a);
  transpose_words(hi, b);
  for (int i = 0; i < 8; ++i) {
    x[i] = _mm512_castsi512_ps(a[i]);
    x[8 + i] = _mm512_castsi512_ps(b[i]);
  }
}

// dst row j (j < min(out_rows, 16)) = column j of the up to 16 src rows (rows past `rows`: zeros),
// 16 floats each; src/dst rows src_stride/dst_stride floats apart.
KVX_INLINE void transpose_block(const float* src, size_t src_stride, int rows, float* dst, size_t dst_stride, int out_rows) {
  __m512 x[16];
  for (int i = 0; i < 16; ++i) x[i] = i < rows ? _mm512_loadu_ps(src + i * src_stride) : _mm512_setzero_ps();
  transpose16x16(x);
  for (int j = 0; j < 16 && j < out_rows; ++j) _mm512_storeu_ps(dst + j * dst_stride, x[j]);
}

// s[h * kRow + t] += qb_h . R_h,t for the 16 rows (scales at the row start, codes `offset` on).
// pf: a row's share of [from, from + span) of the next tile is prefetched with it.
template <class R, int kHeads, class Rows>
KVX_INLINE void latent_scores(const Rows& rows, size_t offset, const LatentQuery& lq, float* s, const Prefetch& pf,
                              size_t from, size_t span) {
  const int heads = kHeads ? kHeads : lq.heads;
  __m512 x[16];
  const __mmask16 hm = heads >= 16 ? 0xffff : static_cast<__mmask16>((1u << heads) - 1);
  for (int t = 0; t < 16; ++t) {
    pf.range(from + span * t / 16, from + span * (t + 1) / 16);
    const uint8_t* row = rows[t];
    const __m512 dk = _mm512_permutexvar_ps(lq.perm, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(hm, row)));
    const __m512i dots = _mm512_add_epi32(latent_row_dots<R, kHeads>(row + offset, lq), lq.bias);
    x[t] = _mm512_mul_ps(_mm512_cvtepi32_ps(dots), _mm512_mul_ps(dk, lq.dq));
  }
  transpose16x16(x);
  alignas(64) int32_t head[16];
  _mm512_store_si512(head, lq.perm);
  for (int i = 0; i < 16; ++i)
    if (head[i] < heads) {
      float* sh = s + head[i] * kRow;
      _mm512_storeu_ps(sh, _mm512_add_ps(_mm512_loadu_ps(sh), x[i]));
    }
}

// The LatentQuery of G heads' prepared qb (width 32; qb_bytes apart) in `codes` (room for 1 KB).
template <class R>
KVX_INLINE LatentQuery latent_query(const uint8_t* qb, size_t qb_bytes, int G, uint8_t* codes) {
  memset(codes, 0, 1024);
  alignas(64) int32_t bias[16], perm[16];
  alignas(64) float dq[16];
  for (int h = 0; h < G; ++h) {
    const uint8_t* q = qb + h * qb_bytes;  // [32 code bytes][int32 bias][float scale]
    if (R::kNibbles) {
      memcpy(codes + 128 * (h / 4) + 16 * (h % 4), q, 16);
      memcpy(codes + 128 * (h / 4) + 64 + 16 * (h % 4), q + 16, 16);
    } else {
      memcpy(codes + 32 * h, q, 32);
    }
  }
  _mm512_store_si512(perm, latent_head_order<R>());
  for (int i = 0; i < 16; ++i) {
    const int h = perm[i];
    bias[i] = h < G ? reinterpret_cast<const int32_t*>(qb + h * qb_bytes)[8] : 0;
    dq[i] = h < G ? reinterpret_cast<const float*>(qb + h * qb_bytes)[9] : 0.0f;
  }
  return {codes, _mm512_load_si512(perm), _mm512_load_si512(bias), _mm512_load_ps(dq), G};
}

// The head segments of latent block b (values [32 b, 32 b + 32) of the flat [H][r] row), in order:
// f(h, c0, c1) for head h's columns [c0, c1) (one division a block; the head steps by one).
template <class F>
KVX_INLINE void for_block_segments(int b, int r, F&& f) {
  int h = 32 * b / r;
  for (int c0 = 32 * b, c1; c0 < 32 * b + 32; c0 = c1, ++h) {
    c1 = imin((h + 1) * r, 32 * b + 32);
    f(h, c0, c1);
  }
}

// q8/q4 latents whose blocks straddle heads (r % 32 != 0), each head's segment of a block whole
// row words (latent_words): s[h * kRow + t] += qb_h . R_h,t in integers, per block one transpose
// of the 16 rows' words (row_words) and per head segment its words' vpdpbusd with the flat
// [H][r] integer query (prepare_int_queries of width H r, the reference's rounding) and that
// segment's bias (seg_bias, in segment order).
template <class R, class Rows>
KVX_INLINE void latent_word_scores(const Rows& rows, size_t offset, int blocks, int r, const uint8_t* qi, const int32_t* seg_bias,
                                   const float* kT, float* s) {
  constexpr int kUnit = R::kNibbles ? 8 : 4;  // values per row word
  const int32_t* words = reinterpret_cast<const int32_t*>(qi);
  const float* dq = reinterpret_cast<const float*>(qi) + 9 * blocks;
  for (int b = 0; b < blocks; ++b) {
    __m512i u[16];
    row_words<R>(rows, offset, blocks, b, false, u);
    const __m512 scale = _mm512_mul_ps(_mm512_loadu_ps(kT + static_cast<size_t>(b) * kMaxTile), _mm512_set1_ps(dq[b]));
    for_block_segments(b, r, [&](int h, int c0, int c1) {
      __m512i acc = _mm512_set1_epi32(*seg_bias++);
      for (int i = (c0 - 32 * b) / kUnit; i < (c1 - 32 * b) / kUnit; ++i) {
        acc = dpbusd_broadcast(acc, u[i], words + 8 * b + i);
        if constexpr (R::kNibbles) acc = dpbusd_broadcast(acc, u[4 + i], words + 8 * b + 4 + i);  // the odd values
      }
      float* sh = s + h * kRow;
      _mm512_storeu_ps(sh, _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), scale, _mm512_loadu_ps(sh)));
    });
  }
}

// The biases of latent_word_scores' segments (-128 or -8 times the sum of a segment's query codes:
// rows are read unsigned), in its order.
template <class R>
KVX_INLINE void latent_segment_biases(const uint8_t* qi, int blocks, int r, int32_t* seg_bias) {
  constexpr int kUnit = R::kNibbles ? 8 : 4;
  const int8_t* codes = reinterpret_cast<const int8_t*>(qi);
  for (int b = 0; b < blocks; ++b)
    for_block_segments(b, r, [&](int, int c0, int c1) {
      int sum = 0;
      for (int i = (c0 - 32 * b) / kUnit; i < (c1 - 32 * b) / kUnit; ++i)
        for (int k = 0; k < 4; ++k) sum += codes[4 * (8 * b + i) + k] + (R::kNibbles ? codes[4 * (8 * b + 4 + i) + k] : 0);
      *seg_bias++ = (R::kNibbles ? -8 : -128) * sum;
    });
}

// q8/q4 latents whose blocks straddle heads (r % 32 != 0): s[h * kRow + t] += sum_c qbr[c] K_t[c]
// over head h's columns c of [h r, (h + 1) r), qbr the scaled qb as the reference rounds it
// (round_query_blocks of the flat [H][r]). Per block, the 16 rows' codes are transposed to
// token lanes and dequantised column by column into cols; each head's run of columns is then
// dotted in floats and scaled once by the rows' block scale (kT).
template <class R, class Rows>
KVX_INLINE void latent_column_scores(const Rows& rows, size_t offset, int blocks, int r, const float* qbr, const float* kT,
                                     float* s, float* cols) {
  constexpr int kBytes = R::kNibbles ? 16 : 32;  // one block
  for (int b = 0; b < blocks; ++b) {
    __m512i w[8];
    transpose16x8(rows, offset + static_cast<size_t>(kBytes) * b, kBytes, w);
    if constexpr (R::kNibbles) {  // nibble k of word i is value 8 i + k
      for (int i = 0; i < 4; ++i)
        for (int k = 0; k < 8; ++k)
          _mm512_storeu_ps(cols + 16 * (8 * i + k), _mm512_permutexvar_ps(_mm512_srli_epi32(w[i], 4 * k), q4_values()));
    } else {  // byte k of word i is value 4 i + k, signed
      for (int i = 0; i < 8; ++i)
        for (int k = 0; k < 4; ++k)
          _mm512_storeu_ps(cols + 16 * (4 * i + k), _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(w[i], 24 - 8 * k), 24)));
    }
    const __m512 dk = _mm512_loadu_ps(kT + static_cast<size_t>(b) * kMaxTile);
    for_block_segments(b, r, [&](int h, int c0, int c1) {
      __m512 x = _mm512_setzero_ps();
      for (int c = c0; c < c1; ++c) x = _mm512_fmadd_ps(_mm512_set1_ps(qbr[c]), _mm512_loadu_ps(cols + 16 * (c - 32 * b)), x);
      float* sh = s + h * kRow;
      _mm512_storeu_ps(sh, _mm512_fmadd_ps(x, dk, _mm512_loadu_ps(sh)));
    });
  }
}

// ---------------------------------------------------------------------------------------------
// Values: acc[g][group j] += sum_t w(g, t, j) v_t[group j] for groups j0 .. j0 + JB - 1, GB * 2 JB
// <= 16 accumulators in registers across the n rows. Weights: f32/bf16 w[g * wg + t] (the
// softmax numerators; f32 with heads in lanes takes head_lane_values instead);
// q8/q4 w[g * wg + j * kMaxTile + t], the numerators times the rows' block scales (the codes are
// read unscaled); kByToken: w[g * wg + j * 16 + t * ws] (heads in lanes: run_piece's q8 r = 32, 64 latents).
template <class R, bool kByToken = false>
KVX_INLINE float weight(const float* w, size_t wg, size_t ws, int g, int j, int t) {
  if constexpr (R::kQuant && kByToken)
    return w[g * wg + static_cast<size_t>(j) * 16 + t * ws];
  else if constexpr (R::kQuant)
    return w[g * wg + static_cast<size_t>(j) * kMaxTile + t];
  else
    return w[g * wg + t * ws];
}

// A value pass's GB x V accumulator vectors, head g's at base + g * stride, unrolled (kept in
// registers across the pass).
template <int GB, int V>
KVX_INLINE void load_accumulators(__m512 (&a)[GB][V], const float* base, int stride) {
#pragma GCC unroll 16
  for (int g = 0; g < GB; ++g)
#pragma GCC unroll 16
    for (int i = 0; i < V; ++i) a[g][i] = _mm512_loadu_ps(base + g * stride + 16 * i);
}
template <int GB, int V>
KVX_INLINE void store_accumulators(const __m512 (&a)[GB][V], float* base, int stride) {
#pragma GCC unroll 16
  for (int g = 0; g < GB; ++g)
#pragma GCC unroll 16
    for (int i = 0; i < V; ++i) _mm512_storeu_ps(base + g * stride + 16 * i, a[g][i]);
}

// R::kUnrolledValuePass: the loops over the accumulators unrolled by pragma (left to GCC 12 they
// were not, and the accumulators went through a stack array at each pass's ends). pf: the pass
// prefetches [pf_lo, pf_hi) of it in steps of 8 rows (value_tile).
template <class R, int GB, int JB>
KVX_INLINE void value_pass(const uint8_t* v0, size_t rb, int n, const float* w, size_t wg, float* acc, int d, int j0,
                           const Prefetch* pf = nullptr, size_t pf_lo = 0, size_t pf_hi = 0) {
  static_assert(GB * 2 * JB <= 16, "value_pass holds up to 16 accumulators");
  __m512 a[GB][2 * JB];
  float* base = acc + 32 * j0;
  load_accumulators(a, base, d);
  const float* w0 = R::kQuant ? w + static_cast<size_t>(j0) * kMaxTile : w;  // row 0's weights
  auto add_row = [&](const uint8_t* row, const float* wt) __attribute__((always_inline)) {
    __m512 wf[GB];  // f32/bf16: one weight per query and row, for all groups
    if constexpr (!R::kQuant)
#pragma GCC unroll 16
      for (int g = 0; g < GB; ++g) wf[g] = _mm512_set1_ps(wt[g * wg]);
#pragma GCC unroll 16
    for (int jj = 0; jj < JB; ++jj) {
      __m512 va, vb;
      R::val(row, j0 + jj, va, vb);
#pragma GCC unroll 16
      for (int g = 0; g < GB; ++g) {
        const __m512 wv = R::kQuant ? _mm512_set1_ps(wt[g * wg + static_cast<size_t>(jj) * kMaxTile]) : wf[g];
        a[g][2 * jj] = _mm512_fmadd_ps(wv, va, a[g][2 * jj]);
        a[g][2 * jj + 1] = _mm512_fmadd_ps(wv, vb, a[g][2 * jj + 1]);
      }
    }
  };
  const size_t chunk = n > 0 ? (pf_hi - pf_lo) * 8 / n : 0;  // the prefetch per 8 rows
  auto prefetch_step = [&](int t) __attribute__((always_inline)) {
    if (pf && t % 8 == 0) pf->range(pf_lo + chunk * (t / 8), t + 8 >= n ? pf_hi : pf_lo + chunk * (t / 8 + 1));
  };
  if constexpr (R::kUnrolledValuePass) {
    const uint8_t* row = v0;
    const float* wt = w0;
    for (int t = 0; t < n; ++t, row += rb, ++wt) {
      prefetch_step(t);
      add_row(row, wt);
    }
  } else {
    for (int t = 0; t < n; ++t) {
      prefetch_step(t);
      const uint8_t* row = v0 + t * rb;
      for (int jj = 0; jj < JB; ++jj) {
        __m512 va, vb;
        R::val(row, j0 + jj, va, vb);
        for (int g = 0; g < GB; ++g) {
          const __m512 wv = _mm512_set1_ps(weight<R>(w, wg, 1, g, j0 + jj, t));
          a[g][2 * jj] = _mm512_fmadd_ps(wv, va, a[g][2 * jj]);
          a[g][2 * jj + 1] = _mm512_fmadd_ps(wv, vb, a[g][2 * jj + 1]);
        }
      }
    }
  }
  store_accumulators(a, base, d);
}

// A tile's rows two at a time: body(k, row 2k, row 2k + 1, or past n row 2k again), with the
// prefetch of [pf_lo, pf_hi) in steps of 8 rows (value_tile).
template <class Body>
KVX_INLINE void for_row_pairs(const uint8_t* v0, size_t rb, int n, const Prefetch* pf, size_t pf_lo, size_t pf_hi, Body&& body) {
  const size_t chunk = n > 0 ? (pf_hi - pf_lo) * 8 / n : 0;  // the prefetch per 8 rows
  for (int k = 0; 2 * k < n; ++k) {
    if (pf && k % 4 == 0) pf->range(pf_lo + chunk * (k / 4), 2 * k + 8 >= n ? pf_hi : pf_lo + chunk * (k / 4 + 1));
    const uint8_t* ra = v0 + 2 * k * rb;
    body(k, ra, 2 * k + 1 < n ? ra + rb : ra);
  }
}

// bf16 values weighed two rows at a time by vdpbf16ps (LRKV; dense from kPairValueQueries queries a
// KV head: decode_rounds_value_weights): the softmax numerators rounded to bf16
// (to nearest even: a weight's error is up to 2^-8 of it, as in FlashAttention's P V with P in
// bf16; the denominators sum them unrounded) as pair words, (p_g,2k, p_g,2k+1) with the first
// token in the low half, by token (heads in lanes: [pair][16 heads]) or by head ([head][kMaxTile /
// 2 pairs]). A token past the tile weighs 0.
struct PairWords {
  const uint32_t* words;  // head 0's first
  bool by_token;
};
template <bool kByToken>
KVX_INLINE __m512bh pair_word(const uint32_t* words, int g, int k) {
  return (__m512bh)_mm512_set1_epi32(static_cast<int>(words[kByToken ? 16 * k + g : g * (kMaxTile / 2) + k]));
}

// The numerators of n tokens by token (pt, heads in lanes) as pair words [pair][16].
KVX_INLINE void pair_weights(const float* pt, int pt_stride, int n, uint32_t* pairs) {
  alignas(64) static constexpr int16_t kInterleave[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                          8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i interleave = _mm512_load_si512(kInterleave);
  for (int k = 0; 2 * k < n; ++k) {
    const __m512 a = _mm512_loadu_ps(pt + 2 * k * pt_stride);
    const __m512 b = 2 * k + 1 < n ? _mm512_loadu_ps(pt + (2 * k + 1) * pt_stride) : _mm512_setzero_ps();
    const __m512bh x = _mm512_cvtne2ps_pbh(b, a);  // [a's 16 | b's 16]
    _mm512_storeu_si512(pairs + 16 * k, _mm512_permutexvar_epi16(interleave, (__m512i)x));
  }
}

// The numerators of G heads' n tokens (s[g * kRow + t]) as pair words [head][kMaxTile / 2]: 32
// tokens in order are already 16 pairs.
KVX_INLINE void pair_weights_by_head(const float* s, int G, int n, uint32_t* pairs) {
  for (int g = 0; g < G; ++g)
    for (int t0 = 0; t0 < n; t0 += 32) {
      const int left = n - t0;
      const __mmask16 m0 = left >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1);
      const __mmask16 m1 = left >= 32 ? static_cast<__mmask16>(0xffff) : left > 16 ? static_cast<__mmask16>((1u << (left - 16)) - 1) : 0;
      const float* x = s + g * kRow + t0;
      const __m512bh w = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(m1, x + 16), _mm512_maskz_loadu_ps(m0, x));
      _mm512_storeu_si512(pairs + g * (kMaxTile / 2) + t0 / 2, (__m512i)w);
    }
}

// acc[g] += sum_t p_g,t V_t for GB heads over groups j0 .. j0 + JB - 1 of the rows (head g's at
// v0 + g * head_bytes: LRKV latents; 0 for V_s, whose row pairs are then interleaved once for all
// GB heads): lanes (V_2k[c], V_2k+1[c]) built from the two rows' words by a shift and a blend, for
// the even positions and the odd ones (the (even | odd) order of BF16Row::val, which the piece's
// end un-permutes). A row past n is row n - 1 again (its weight is 0). Weights broadcast to
// registers, each used twice (as memory operands: 6% slower a call in cache). acc: head g's at
// acc + g * as. pf: as value_pass's.
template <int GB, int JB, bool kByToken, bool kPerHead>
KVX_INLINE void pair_value_pass_of(const uint8_t* v0, size_t rb, size_t head_bytes, int n, const uint32_t* words, float* acc,
                                   int as, int j0, const Prefetch* pf, size_t pf_lo, size_t pf_hi) {
  static_assert(GB * 2 * JB <= 16, "pair_value_pass holds up to 16 accumulators");
  __m512 a[GB][2 * JB];
  float* base = acc + 32 * j0;
  load_accumulators(a, base, as);
  const __mmask32 high = 0xaaaaaaaau;
  auto pair_lanes = [&](const uint8_t* ra, const uint8_t* rb1, int j, __m512bh& even, __m512bh& odd) __attribute__((always_inline)) {
    const __m512i x = _mm512_loadu_si512(ra + 64 * j), y = _mm512_loadu_si512(rb1 + 64 * j);
    even = (__m512bh)_mm512_mask_blend_epi16(high, x, _mm512_slli_epi32(y, 16));
    odd = (__m512bh)_mm512_mask_blend_epi16(high, _mm512_srli_epi32(x, 16), y);
  };
  for_row_pairs(v0, rb, n, pf, pf_lo, pf_hi, [&](int k, const uint8_t* ra, const uint8_t* rb1) __attribute__((always_inline)) {
#pragma GCC unroll 8
    for (int jj = 0; jj < JB; ++jj) {
      __m512bh even, odd;
      if constexpr (!kPerHead) pair_lanes(ra, rb1, j0 + jj, even, odd);
#pragma GCC unroll 16
      for (int g = 0; g < GB; ++g) {
        if constexpr (kPerHead) pair_lanes(ra + g * head_bytes, rb1 + g * head_bytes, j0 + jj, even, odd);
        const __m512bh w = pair_word<kByToken>(words, g, k);
        a[g][2 * jj] = _mm512_dpbf16_ps(a[g][2 * jj], even, w);
        a[g][2 * jj + 1] = _mm512_dpbf16_ps(a[g][2 * jj + 1], odd, w);
      }
    }
  });
  store_accumulators(a, base, as);
}

template <int GB, int JB>
KVX_INLINE void pair_value_pass(const uint8_t* v0, size_t rb, size_t head_bytes, int n, const PairWords& pw, float* acc, int as,
                                int j0, const Prefetch* pf, size_t pf_lo, size_t pf_hi) {
  if (head_bytes)  // LRKV latents (by head)
    pair_value_pass_of<GB, JB, false, true>(v0, rb, head_bytes, n, pw.words, acc, as, j0, pf, pf_lo, pf_hi);
  else if (pw.by_token)
    pair_value_pass_of<GB, JB, true, false>(v0, rb, 0, n, pw.words, acc, as, j0, pf, pf_lo, pf_hi);
  else
    pair_value_pass_of<GB, JB, false, false>(v0, rb, 0, n, pw.words, acc, as, j0, pf, pf_lo, pf_hi);
}

// q8/q4 values in integers: per tile, query g and block j, the weights w_t = p_t d_t,j (numerator
// times the row's block scale) as 15-bit codes c_t = round(w_t / sig), sig = max_t |d_t,j| / 32767
// (p_t <= 1: the running max; one sig a block for every query) (IntWeights, written by the
// softmax), so acc[g][j] += sig sum_t c_t v_t with the int8 codes (q4: nibble - 8) v_t summed
// exactly in int32 by vpdpwssd, two rows per lane (half the multiply instructions of f32 FMAs, and
// no int -> float conversion per value). Each weight is off by up to sig / 2, i.e. max_t |d_t,j| /
// (65534 l) <= max_t a_t max_t |d_t,j| / 65534 in units of the normalised weights a_t = p_t / l (a
// later rise of the max scales it down): out is off by up to that times sum_t |v_t| (the tests'
// bound; decode_weighs_values_in_int16). 8-bit codes by vpdpbusd were no faster and far less exact,
// so the codes stay 15-bit.
struct IntWeights {
  const int32_t* words;  // [g][j][kMaxTile / 2]: codes of rows (2k, 2k + 1), the first in the low half
  const float* sig;      // [j]: max_t |d_t,j| / 32767, the same for every query
  int nb;  // (by token: words [k][j][16]; int_weights_by_token)
};

// acc + the dot products of x's and w's signed 16-bit pairs in each lane (vpdpwssd; as an
// intrinsic GCC 12 copied each accumulator before and after it).
KVX_INLINE __m512i dpwssd(__m512i acc, __m512i x, __m512i w) {
  __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(x), "v"(w));
  return acc;
}

// acc (natural order) += sig * the int32 sums (lanes of unpacklo / unpackhi of the row pair: value
// 8c + i in lo's lane 4c + i, 8c + 4 + i in hi's).
KVX_INLINE void add_int_sums(__m512i lo, __m512i hi, float sig, float* acc) {
  const __m512i first = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11), second = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
  const __m512 x = _mm512_cvtepi32_ps(lo), y = _mm512_cvtepi32_ps(hi), sv = _mm512_set1_ps(sig);
  const __m512 a = _mm512_castsi512_ps(_mm512_permutex2var_epi64(_mm512_castps_si512(x), first, _mm512_castps_si512(y)));
  const __m512 b = _mm512_castsi512_ps(_mm512_permutex2var_epi64(_mm512_castps_si512(x), second, _mm512_castps_si512(y)));
  _mm512_storeu_ps(acc, _mm512_fmadd_ps(sv, a, _mm512_loadu_ps(acc)));
  _mm512_storeu_ps(acc + 16, _mm512_fmadd_ps(sv, b, _mm512_loadu_ps(acc + 16)));
}

// IntWeights by token from a tile's numerators with heads in lanes (pt[t * pt_stride + h], n rows,
// after head_lane_softmax; each <= 1, as the codes by head): head h's codes are p_h,t times
// vT[j][t] (the V scales times 32767 / vmax_j), paired (2k, 2k + 1) into words[k][j][16] (a row
// past n weighs 0).
KVX_INLINE void int_weights_by_token(const float* pt, int pt_stride, int n, const float* vT, int nb, int32_t* words) {
  for (int k = 0; 2 * k < n; ++k) {
    const float* x = pt + 2 * k * pt_stride;
    const __m512 p0 = _mm512_loadu_ps(x);
    const __m512 p1 = 2 * k + 1 < n ? _mm512_loadu_ps(x + pt_stride) : _mm512_setzero_ps();
    for (int j = 0; j < nb; ++j) {
      const float* v = vT + static_cast<size_t>(j) * kMaxTile + 2 * k;
      const __m512i c0 = _mm512_cvtps_epi32(_mm512_mul_ps(p0, _mm512_set1_ps(v[0])));
      const __m512i c1 = _mm512_cvtps_epi32(_mm512_mul_ps(p1, _mm512_set1_ps(v[1])));
      _mm512_storeu_si512(words + (static_cast<size_t>(k) * nb + j) * 16,
                          _mm512_mask_blend_epi16(0xaaaaaaaau, c0, _mm512_slli_epi32(c1, 16)));
    }
  }
}

// acc (its first 16 values, then the next 16: q4's even | odd positions as Q4Row::val, q8 pairs in
// natural order) += sig * the int32 sums of lo and hi.
KVX_INLINE void add_int_sums_halves(__m512i lo, __m512i hi, float sig, float* acc) {
  const __m512 sv = _mm512_set1_ps(sig);
  _mm512_storeu_ps(acc, _mm512_fmadd_ps(sv, _mm512_cvtepi32_ps(lo), _mm512_loadu_ps(acc)));
  _mm512_storeu_ps(acc + 16, _mm512_fmadd_ps(sv, _mm512_cvtepi32_ps(hi), _mm512_loadu_ps(acc + 16)));
}

// Block j of two rows as int16 pairs (row a's value in the low half): q8 (lo, hi) the unpacks of
// the sign-extended codes (values 8c + i in lo's lane 4c + i, 8c + 4 + i in hi's, add_int_sums); q4
// (lo, hi) the even and odd positions, lane k from byte k of each row (its low and high nibble),
// minus 8 (add_int_sums_halves). (One vpermt2b for q4 was barely faster and needs AVX-512 VBMI,
// which some VNNI parts lack.)
// kPaired: a Tiled16 store's slot pair, its bytes interleaved (kv_store.h) at ra: one widening
// gives the pairs, q8's values 0-15 in lo and 16-31 in hi (natural order, add_int_sums_halves), q4's
// even and odd positions as above.
template <class R, bool kPaired = false>
KVX_INLINE void int_value_pairs(const uint8_t* ra, const uint8_t* rb, int j, __m512i& lo, __m512i& hi) {
  if constexpr (kPaired && R::kNibbles) {
    const __m512i ab = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ra + 32 * j)));
    const __m512i eight = _mm512_set1_epi16(8);
    lo = _mm512_sub_epi16(_mm512_and_si512(ab, _mm512_set1_epi16(0x0f)), eight);
    hi = _mm512_sub_epi16(_mm512_srli_epi16(ab, 4), eight);
  } else if constexpr (kPaired) {
    lo = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ra + 64 * j)));
    hi = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ra + 64 * j + 32)));
  } else if constexpr (R::kNibbles) {
    const __m512i a = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ra + 16 * j)));
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rb + 16 * j)));
    const __m512i ab = _mm512_or_si512(a, _mm512_slli_epi32(b, 16)), nib = _mm512_set1_epi16(0x0f), eight = _mm512_set1_epi16(8);
    lo = _mm512_sub_epi16(_mm512_and_si512(ab, nib), eight);
    hi = _mm512_sub_epi16(_mm512_and_si512(_mm512_srli_epi16(ab, 4), nib), eight);
  } else {
    const __m512i x = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ra + 32 * j)));
    const __m512i y = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rb + 32 * j)));
    lo = _mm512_unpacklo_epi16(x, y);
    hi = _mm512_unpackhi_epi16(x, y);
  }
}

// acc[g][group j] += sig_g,j sum_t c_g,j,t v_t[group j] for groups j0 .. j0 + JB - 1 (q8/q4 codes at
// v0, rb bytes a row; past n the last row again, its code 0; kPaired: slot pairs interleaved, 2 rb
// bytes a pair, past n the pair's other slot, its code 0). pf: as value_pass's.
template <class R, int GB, int JB, bool kByToken, bool kPaired = false>
KVX_INLINE void int_value_pass(const uint8_t* v0, size_t rb, int n, const IntWeights& iw, float* acc, int d, int j0,
                               const Prefetch* pf, size_t pf_lo, size_t pf_hi) {
  static_assert(GB * 2 * JB <= 16, "int_value_pass holds up to 16 accumulators");
  __m512i a[GB][2 * JB];
#pragma GCC unroll 16
  for (int g = 0; g < GB; ++g)
#pragma GCC unroll 16
    for (int i = 0; i < 2 * JB; ++i) a[g][i] = _mm512_setzero_si512();
  for_row_pairs(v0, rb, n, pf, pf_lo, pf_hi, [&](int k, const uint8_t* ra, const uint8_t* rb1) __attribute__((always_inline)) {
#pragma GCC unroll 8
    for (int jj = 0; jj < JB; ++jj) {
      const int j = j0 + jj;
      __m512i lo, hi;
      int_value_pairs<R, kPaired>(ra, rb1, j, lo, hi);
#pragma GCC unroll 16
      for (int g = 0; g < GB; ++g) {
        const __m512i w = _mm512_set1_epi32(kByToken ? iw.words[(static_cast<size_t>(k) * iw.nb + j) * 16 + g]
                                                     : iw.words[(static_cast<size_t>(g) * iw.nb + j) * (kMaxTile / 2) + k]);
        a[g][2 * jj] = dpwssd(a[g][2 * jj], lo, w);
        a[g][2 * jj + 1] = dpwssd(a[g][2 * jj + 1], hi, w);
      }
    }
  });
#pragma GCC unroll 16
  for (int g = 0; g < GB; ++g)
#pragma GCC unroll 8
    for (int jj = 0; jj < JB; ++jj) {
      const float sig = iw.sig[j0 + jj];
      float* ag = acc + static_cast<size_t>(g) * d + 32 * (j0 + jj);
      if constexpr (R::kNibbles || kPaired)
        add_int_sums_halves(a[g][2 * jj], a[g][2 * jj + 1], sig, ag);
      else
        add_int_sums(a[g][2 * jj], a[g][2 * jj + 1], sig, ag);
    }
}

// LRKV latents: acc_r[g] += sum_t w(g, t, j) R_{h0+g},t for GB heads, each reading its own
// segment of the row (v0 + g * head_bytes), groups jr0 .. jr0 + JB - 1 of it; GB x 2 JB
// accumulators held across the rows.
template <class R, int GB, int JB, bool kByToken>
KVX_INLINE void residual_value_pass(const uint8_t* v0, size_t rb, size_t head_bytes, int n, const float* w, size_t wg,
                                    float* acc, int r, int jr0) {
  static_assert(GB * 2 * JB <= 16, "residual_value_pass holds up to 16 accumulators");
  __m512 a[GB][2 * JB];
  load_accumulators(a, acc + 32 * jr0, r);
  for (int t = 0; t < n; ++t)
    for (int g = 0; g < GB; ++g)
      for (int jj = 0; jj < JB; ++jj) {
        __m512 va, vb;
        R::val(v0 + t * rb + g * head_bytes, jr0 + jj, va, vb);
        const __m512 wv = _mm512_set1_ps(weight<R, kByToken>(w, wg, kByToken ? 16 * (r / 32) : 1, g, jr0 + jj, t));
        a[g][2 * jj] = _mm512_fmadd_ps(wv, va, a[g][2 * jj]);
        a[g][2 * jj + 1] = _mm512_fmadd_ps(wv, vb, a[g][2 * jj + 1]);
      }
  store_accumulators(a, acc + 32 * jr0, r);
}

// pw: bf16 with vdpbf16ps, the weights as pair words (pair_value_pass), not w.
// q8 latents of whole blocks a head stay f32 multiply-adds (within 1e-5 of the reference): weighed
// by 15-bit codes as V_s is, they gained only in cache.
// kByToken: w by token (weight<R, true>, 16 floats a row).
template <class R, int GB, bool kByToken = false>
KVX_INLINE void residual_values(const uint8_t* v0, size_t rb, size_t head_bytes, int n, const float* w, size_t wg, int blocks,
                                float* acc, int r, const PairWords* pw) {
  constexpr int JB = GB >= 8 ? 1 : 2;
  int j = 0;
  if (R::kDotBF16 && pw) {
    for (; j + JB <= blocks; j += JB) pair_value_pass<GB, JB>(v0, rb, head_bytes, n, *pw, acc, r, j, nullptr, 0, 0);
    for (; j < blocks; ++j) pair_value_pass<GB, 1>(v0, rb, head_bytes, n, *pw, acc, r, j, nullptr, 0, 0);
    return;
  }
  for (; j + JB <= blocks; j += JB) residual_value_pass<R, GB, JB, kByToken>(v0, rb, head_bytes, n, w, wg, acc, r, j);
  for (; j < blocks; ++j) residual_value_pass<R, GB, 1, kByToken>(v0, rb, head_bytes, n, w, wg, acc, r, j);
}

// Block b of a latent row: its 32 values in natural order (q8/q4: codes, unscaled; f32/bf16: zeros
// outside m0 (values 0-15), m1 (16-31), for a row that ends mid-block).
template <class R>
KVX_INLINE void latent_block_values(const uint8_t* row, int b, __m512& a, __m512& c, __mmask16 m0, __mmask16 m1) {
  if constexpr (!R::kQuant) {
    a = R::flat(row, 2 * b, m0);
    c = R::flat(row, 2 * b + 1, m1);
  } else if constexpr (R::kNibbles) {  // 16 bytes; value 2 j in byte j's low nibble, 2 j + 1 in its high one
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * b));
    const __m512i shift = _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
    a = _mm512_permutexvar_ps(_mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(x, x)), shift), q4_values());
    c = _mm512_permutexvar_ps(_mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(x, x)), shift), q4_values());
  } else {
    Q8Row::val(row, b, a, c);
  }
}

// Latents whose blocks straddle heads (r % 32 != 0), values: acc_r (the flat [H][r], i.e. the row's
// columns) += sum_t p_{head(c)}(t) dv_t,b v_t[c], whole rows in natural order, for the B blocks
// from b0 (2 B accumulators across the rows). A block's lane weights come from the numerators by
// token (pt) by a permute of the 32 heads from its first one (idx, head0), or where every 16-value
// vector lies in one head (r % 16 == 0, kWhole) by a broadcast of that head's (faster), q8/q4 times
// the row's block scale (vT: [b][kMaxTile]). f32/bf16 rows may end mid-block: a vector's lanes in
// the row are fl.mask.
template <class R, int B, bool kWhole>
KVX_INLINE void latent_row_pass(const uint8_t* v0, size_t rb, int n, const float* pt, int pt_stride, const float* vT,
                                const int32_t* idx, const int32_t* head0, float* acc, int b0, const FlatLatents& fl, size_t ahead) {
  __m512 a[2 * B];
  __mmask16 m[2 * B];
  for (int i = 0; i < 2 * B; ++i) m[i] = fl.mask(2 * b0 + i);
  for (int i = 0; i < 2 * B; ++i) a[i] = _mm512_maskz_loadu_ps(m[i], acc + 32 * b0 + 16 * i);
  int vh[2 * B];  // kWhole (r % 16 == 0): vector v of the row is head 16 v / r's
  for (int i = 0; i < 2 * B && kWhole; ++i) vh[i] = 16 * (2 * b0 + i) / fl.r;
  for (int t = 0; t < n; ++t) {
    const uint8_t* row = v0 + t * rb;
    const float* pth = pt + t * pt_stride;
    for (int i = 0; i < B; ++i) {
      const int b = b0 + i;
      __m512 wa, wb;
      if constexpr (kWhole) {
        wa = _mm512_set1_ps(pth[vh[2 * i]]);
        wb = _mm512_set1_ps(pth[vh[2 * i + 1]]);
      } else {
        const float* p = pth + head0[b];
        const __m512 p0 = _mm512_loadu_ps(p), p1 = _mm512_loadu_ps(p + 16);
        wa = _mm512_permutex2var_ps(p0, _mm512_loadu_si512(idx + 32 * b), p1);
        wb = _mm512_permutex2var_ps(p0, _mm512_loadu_si512(idx + 32 * b + 16), p1);
      }
      if constexpr (R::kQuant) {
        const __m512 dv = _mm512_set1_ps(vT[static_cast<size_t>(b) * kMaxTile + t]);
        wa = _mm512_mul_ps(wa, dv);
        wb = _mm512_mul_ps(wb, dv);
      }
      __m512 va, vb;
      if (ahead) {  // f32: a block is two lines
        prefetch_ahead(row + 128 * b, ahead);
        if (m[2 * i + 1]) prefetch_ahead(row + 128 * b + 64, ahead);
      }
      latent_block_values<R>(row, b, va, vb, m[2 * i], m[2 * i + 1]);
      a[2 * i] = _mm512_fmadd_ps(wa, va, a[2 * i]);
      a[2 * i + 1] = _mm512_fmadd_ps(wb, vb, a[2 * i + 1]);
    }
  }
  for (int i = 0; i < 2 * B; ++i) _mm512_mask_storeu_ps(acc + 32 * b0 + 16 * i, m[i], a[i]);
}

// ahead: f32 rows fetched that many bytes on as they are read (0: none, the caller fetches).
template <class R>
KVX_INLINE void latent_row_values(const uint8_t* v0, size_t rb, int n, const float* pt, int pt_stride, const float* vT,
                                  const int32_t* idx, const int32_t* head0, int blocks, float* acc, const FlatLatents& fl,
                                  size_t ahead = 0) {
  auto passes = [&](auto whole) {
    constexpr bool kWhole = decltype(whole)::value != 0;
    int b = 0;
    for (; b + 4 <= blocks; b += 4) latent_row_pass<R, 4, kWhole>(v0, rb, n, pt, pt_stride, vT, idx, head0, acc, b, fl, ahead);
    for (; b + 2 <= blocks; b += 2) latent_row_pass<R, 2, kWhole>(v0, rb, n, pt, pt_stride, vT, idx, head0, acc, b, fl, ahead);
    for (; b < blocks; ++b) latent_row_pass<R, 1, kWhole>(v0, rb, n, pt, pt_stride, vT, idx, head0, acc, b, fl, ahead);
  };
  with_flag<true>(fl.r % 16 == 0, passes);
}

// All 32-value groups of the row in passes of up to 8 / GB groups (then 4, 2, 1 for the rest: a
// pass needs several accumulators to hide the FMA latency), which share out the prefetch of the
// next V tile: f32/bf16 passes (kUnrolledValuePass) and q8 MHA's (kMhaValuePrefetchSteps) fetch
// their share in steps of 8 rows (faster when memory is slow), the rest at the pass's start (steps
// were slower).
// kCodesByToken: iw laid out by token (int_weights_by_token). kPaired: q8/q4 V codes in slot pairs
// (Tiled16; int_value_pairs).
template <class R, int GB, bool kCodesByToken = false, bool kPaired = false>
KVX_INLINE void value_tile(const uint8_t* v0, size_t rb, int n, const float* w, size_t wg, float* acc, int d,
                           const Prefetch* pf, const PairWords* pairs = nullptr, const IntWeights* iw = nullptr) {
  constexpr int JB = 8 / GB;
  const int nj = d / 32;
  const size_t bytes = static_cast<size_t>(n) * rb;
  int j = 0;
  auto pass = [&](auto jb) {
    constexpr int B = decltype(jb)::value;
    if (R::kDotBF16 && pairs) {  // the numerators as bf16 pairs (pair_weights), not w
      pair_value_pass<GB, B>(v0, rb, 0, n, *pairs, acc, d, j, pf, bytes * j / nj, bytes * (j + B) / nj);
    } else if (R::kIntValues && iw) {  // 15-bit weight codes (IntWeights), not w
      // one query: the pass prefetches its share in steps; more: all of it at the start
      const bool steps = GB == 1 && R::kMhaValuePrefetchSteps;
      const Prefetch* step_pf = steps ? pf : nullptr;
      const size_t lo = bytes * j / nj, hi = bytes * (j + B) / nj;
      if (!steps && pf) pf->range(lo, hi);
      int_value_pass<R, GB, B, kCodesByToken, kPaired>(v0, rb, n, *iw, acc, d, j, step_pf, lo, hi);
    } else if constexpr (R::kUnrolledValuePass || (GB == 1 && R::kMhaValuePrefetchSteps)) {
      value_pass<R, GB, B>(v0, rb, n, w, wg, acc, d, j, pf, bytes * j / nj, bytes * (j + B) / nj);
    } else {
      if (pf) pf->range(bytes * j / nj, bytes * (j + B) / nj);
      value_pass<R, GB, B>(v0, rb, n, w, wg, acc, d, j);
    }
    j += B;
  };
  while (j + JB <= nj) pass(Int<JB>{});
  if constexpr (JB > 4)
    while (j + 4 <= nj) pass(Int<4>{});
  if constexpr (JB > 2)
    while (j + 2 <= nj) pass(Int<2>{});
  if constexpr (JB > 1)
    while (j < nj) pass(Int<1>{});
}

// Floats per query head in the kernel's layout: d (f32/bf16), or the integer query.
template <class R>
KVX_INLINE size_t query_floats(int d) {
  return R::kQuant ? int_query_floats(d) : static_cast<size_t>(d);  // d % 32 == 0 (latents of r % 32 != 0: FlatLatents)
}

// Rows per tile, the fastest measured at long context with the caches emptied (wider float tiles,
// or rows fetched ahead instead of the next tile, run faster in cache but slower cold):
// - MHA (one query per KV head): 32 rows, float rows past 256 bytes 64 (a stream read in longer
//   runs suits the hardware prefetcher);
// - several queries: float rows 16 up to 256 bytes, else 8; q8/q4 32 up to 256 bytes, else 16 (one
//   transpose);
// - bf16 values by row pairs (avx512_pair_values) at 16+ queries a KV head: 64 rows, over which
//   each pair pass spreads its accumulator loads and stores (at 8 queries wider tiles were slower
//   cold).
int tile_rows(size_t rb, int G, bool quant, bool pair_values) {
  if (G == 1) return quant || rb <= 256 ? 32 : kMaxTile;
  if (quant) return rb <= 256 ? 32 : 16;
  if (pair_values && G >= 16) return kMaxTile;
  return rb <= 256 ? 16 : 8;
}

// Rows a tile for LRKV (row_bytes: a K_s row and a latent row together; hl: scores with heads in
// lanes), the fastest measured with the caches emptied, as decode at long context reads them:
// - bf16 with heads in lanes: 64 rows up to 512 bytes a row, 32 up to 1 KB, 16 past it;
// - else 32 rows below 1 KB a row (K and V tiles of both stores within ~40 KB);
// - f32 with heads in lanes: 32 rows over 1 KB and under 2 KB a row, 16 up to 4 KB, 8 past it
//   (latents that straddle heads take 8 rows: run_piece's `straddle_lanes`);
// - bf16 pair values with score blocks, rows up to 1.25 KB: 64 rows; q8/q4: 16 rows; f32 with score
//   blocks: 16 rows of 1.5-2 KB; else 8.
int lrkv_tile_rows(size_t row_bytes, KVType type, bool quant, bool pair_values, bool hl) {
  if (hl && type == KVType::BF16) return row_bytes <= 512 ? kMaxTile : row_bytes <= 1024 ? 32 : 16;
  if (row_bytes < 1024) return 32;
  if (hl) return row_bytes > 1024 && row_bytes < 2048 ? 32 : row_bytes <= 4096 ? 16 : 8;
  if (pair_values && row_bytes <= 1280) return kMaxTile;
  if (quant) return 16;
  return type == KVType::F32 && row_bytes >= 1536 && row_bytes <= 2048 ? 16 : 8;
}

// LRKV's residual path (lrkv_decode.h): a second store whose row per token is [R_0 | .. | R_{G-1}]
// (r values per head), with its own prepared queries qb (avx512_prepare_latent_queries).
struct Residual {
  const KVStore* store = nullptr;
  const float* qb = nullptr;
  size_t qstride = 0;
  int r = 0;
  bool head_lanes = false;  // scores with heads in lanes (head_lanes()): q is QT, qb flat
};

// Scratch (floats): scores G * kRow; the softmax denominators per lane, G * 16; q8/q4 also, per block of the rows (nb of K/V, nbr of the
// residual's), the tile's K and V scales [block][kMaxTile] and the weights of the values
// ([g][block][kMaxTile], then the residual's [block][kMaxTile]; q8 keeps in the first's space the
// IntWeights codes as int16 [g][block][kMaxTile], their scales [g][block] and the tile's largest V
// scale per block).
// LRKV with heads in lanes (by_token) gets the tile's scores, then numerators, by token,
// pt[t * pt_stride + h]; latents whose blocks straddle heads (r % 32 != 0; lb blocks of 32 a row)
// get them too (by_token), and per latent block, the lanes' head offsets from its
// first head (idx, 32 int32) and that head (head0); q8/q4 also a block's 32 dequantised columns of
// 16 rows (cols) and the integer query's bias per (block, head) segment (seg_bias, up to 32 / 4 + 2
// a block).
struct Scratch {
  float *s, *l, *kT, *vT, *w, *wr;
  uint8_t* latent_codes;  // LatentQuery::codes, 1 KB
  float* pt;
  uint32_t* pairs;  // LRKV bf16 (vdpbf16ps): the numerators as bf16 pairs (pair_weights), pair_words(G)
  float* cols;
  int32_t *idx, *head0, *seg_bias;
  int pt_stride;
  float* acc_cols;  // f32 heads in lanes: the value accumulators by column, [d][16] (head_lane_values)
  Scratch(float* base, int G, int nb, int nbr, int lb, bool by_token, bool with_pairs)
      : s(base), l(s + G * kRow), kT(l + 16 * G), vT(kT + kMaxTile * (nb + nbr)), w(vT + kMaxTile * (nb + nbr)),
        wr(w + kMaxTile * G * nb), latent_codes(reinterpret_cast<uint8_t*>(wr + kMaxTile * nbr)),
        pt(wr + kMaxTile * nbr + (nbr ? 256 : 0)), pairs(reinterpret_cast<uint32_t*>(pt + (by_token ? kMaxTile * pt_floats(G) : 0))),
        cols(reinterpret_cast<float*>(pairs + (with_pairs ? pair_words(G) : 0))),
        idx(reinterpret_cast<int32_t*>(cols + (nbr ? 32 * 16 : 0))), head0(idx + 32 * lb), seg_bias(head0 + lb),
        pt_stride(pt_floats(G)), acc_cols(base + (floats(G, nb, nbr, lb, by_token, with_pairs) + 15) / 16 * 16) {}
  // a row of pt: room for a 32-float load from any head
  static int pt_floats(int G) { return (G + 15) / 16 * 16 + 32; }
  // a tile's pairs of every head (16 words a pair with heads in lanes)
  static int pair_words(int G) { return kMaxTile / 2 * (G > 16 ? G : 16); }
  // column_floats: acc_cols' (16 d where the values take heads in lanes, else 0)
  static size_t floats(int G, int nb, int nbr, int lb, bool by_token, bool with_pairs, int column_floats = 0) {
    return static_cast<size_t>(G) * (kRow + 16) + static_cast<size_t>(kMaxTile) * (2 * (nb + nbr) + G * nb + nbr) +
           (nbr ? 256 + 32 * 16 + 10 * nbr : 0) + (by_token ? kMaxTile * pt_floats(G) : 0) + (with_pairs ? pair_words(G) : 0) +
           33 * lb + 16 + (column_floats ? column_floats + 16 : 0);
  }
};

// q8/q4 latents whose blocks straddle heads are scored in integers when every head's segment of
// a block is whole row words (q8: 4 values a word, q4: 8), else from dequantised columns.
KVX_INLINE bool latent_words(KVType type, int r) { return r % (type == KVType::Q4 ? 8 : 4) == 0; }

// q8/q4 LRKV at 9-16 heads with latents that straddle heads (r % 32 != 0) or of one or two blocks a head (r = 32,
// 64) takes its softmax and value weights with heads in lanes (run_piece).
KVX_INLINE bool quant_weights_by_token(KVType type, int G, int r) {
  return (type == KVType::Q8 || type == KVType::Q4) && G > 8 && G <= 16 && r > 0 && (r % 32 != 0 || r == 32 || r == 64);
}

// Float scores of the GB queries at q (d floats apart) against rows kb, TB at a time, into
// s[g * kRow + t]; with LRKV's residual (rows0: row 0's latent of head h0, head_bytes apart; flat:
// row 0 at head 0, and qb head 0's position vectors).
struct ResidualTile {
  const uint8_t* qb;     // prepared qb of head h0
  size_t qb_stride;      // bytes between heads
  int blocks;            // r / 32
  size_t head_bytes;     // bytes per head segment
  const uint8_t* rows0;  // row 0's latents, head h0's segment
  size_t rb;
  const FlatLatents* flat;  // r % 32 != 0
  int h0;
};

template <class R>
KVX_INLINE void scores_for(const float* q, int gb, int d, const uint8_t* kb, size_t rb, int n, float* s, const Prefetch* pf,
                           const ResidualTile* rt = nullptr) {
  const int nj = d / 32;
  const int TB = 16 / gb;
  for (int t0 = 0; t0 < n; t0 += TB) {
    const uint8_t* rows[16];
    const uint8_t* rrows[16];
    ResidualRows res;
    for (int i = 0; i < TB; ++i) {
      const int t = imin(t0 + i, n - 1);
      rows[i] = kb + t * rb;
      if (rt) rrows[i] = rt->rows0 + t * rt->rb;
    }
    if (rt) res = {rt->qb, rt->qb_stride, rt->blocks, rt->head_bytes, rrows, rt->flat, rt->h0};
    const ResidualRows* rp = rt ? &res : nullptr;
    const size_t lo = t0 * rb, hi = imin(t0 + TB, n) * rb;
    const bool flat = rt && rt->flat;
    // K rows with no far prefetch (MHA, f32 and bf16 GQA) spread the next tile's share over the
    // block (faster); with the far prefetch (bf16 MQA and LRKV; spreading was slower) and for flat
    // latents it is fetched before the block.
    const Prefetch* spread = pf && !pf->far && !flat ? pf : nullptr;
    if (pf && !spread) pf->range(lo, hi);
    float* sg = s + t0;
    switch (gb) {
      case 4: score_block_flat<R, 4, 4>(flat, q, d, nj, rows, sg, rp, spread, lo, hi); break;
      case 2: score_block_flat<R, 2, 8>(flat, q, d, nj, rows, sg, rp, spread, lo, hi); break;
      default: score_block_flat<R, 1, 16>(flat, q, d, nj, rows, sg, rp, spread, lo, hi); break;
    }
  }
}

// The 32 values whose even positions are ev and odd ones od, in natural order: lo (0-15), hi (16-31).
KVX_INLINE void natural_order(__m512 ev, __m512 od, __m512& lo, __m512& hi) {
  const __m512i lo_idx = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i hi_idx = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  lo = _mm512_permutex2var_ps(ev, lo_idx, od);
  hi = _mm512_permutex2var_ps(ev, hi_idx, od);
}

// (even | odd) per 32 values -> natural order, for n values (n % 32 == 0).
KVX_INLINE void unpermute(float* acc, int n) {
  for (int i = 0; i < n; i += 32) {
    __m512 lo, hi;
    natural_order(_mm512_loadu_ps(acc + i), _mm512_loadu_ps(acc + i + 16), lo, hi);
    _mm512_storeu_ps(acc + i, lo);
    _mm512_storeu_ps(acc + i + 16, hi);
  }
}

KVX_INLINE void scale_vec(float* x, int n, float alpha) {  // n floats (an LRKV latent may end mid-vector)
  const __m512 av = _mm512_set1_ps(alpha);
  int i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(x + i, _mm512_mul_ps(_mm512_loadu_ps(x + i), av));
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(x + i, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), av));
  }
}

// ---------------------------------------------------------------------------------------------
// LRKV f32/bf16 scores with heads in lanes (and dense groups of 9 to 16 query heads, as LRKV at
// r = 0: dense_head_lanes): for 8 to 16 heads on one K_s row, lane h of a row's
// score vector is head h's, so the row is read once with each of its values (f32) or value pairs
// (bf16) broadcast against the heads' query vectors QT (lane h: q_h's value or pair; prepared by
// avx512_prepare_group_queries), with no horizontal sums, no per-head row pointers and one
// exp512 a row for the softmax. The residual qb_h . R_h,t: the row's vectors times the flat qb
// ([H][r] in the row's own layout), each head's L lanes (f32: r values, bf16: r / 2 pairs) then
// summed by halving the groups pairwise (log2 L levels of two permutes and an add).
// Faster than the score blocks (score_block) at r = 8. Rows in lanes over K_s stored as transposed
// panels (GEMM-style) would save too little of a call for a store layout of their own.

// LRKV decode takes heads in lanes (run_piece), where they measured faster than the score blocks,
// for f32 and bf16 with vdpbf16ps at 8 to 16 heads (fewer leave most lanes idle), no latents or
// latents whose L (words a head: f32 r, bf16 r / 2) is a power of two up to 32 (f32: 64). A head's
// latent of L = 32 or 64 is 2 or 4 vectors, added before the sum (head_lane_residual).
bool head_lanes(KVType type, int G, int r) {
  if (type != KVType::F32 && !(type == KVType::BF16 && avx512_bf16_dot())) return false;
  if (G < 8 || G > 16) return false;
  if (r == 0) return true;
  if (type == KVType::BF16 && r % 2) return false;
  const int L = type == KVType::F32 ? r : r / 2;
  return (L <= 32 || (type == KVType::F32 && L == 64)) && (L & (L - 1)) == 0;
}

// Dense decode takes heads in lanes too (run_pieces: LRKV's kernel at r = 0) for groups of 9 (bf16)
// or 13 (f32) to 16 query heads on one KV head; the score blocks keep the rest (fewer heads leave
// lanes idle).
KVX_INLINE bool dense_head_lanes(KVType type, int G) { return G > (type == KVType::F32 ? 12 : 8) && head_lanes(type, G, 0); }

// The residual's layout with heads in lanes.
struct HeadLaneResidual {
  int L = 0;                 // words per head (f32: r, bf16: r / 2)
  int words = 0;             // G L: the row's words
  __m512i lo[4], hi[4];      // halving level i (groups of min(L, 16) >> i lanes): lanes from the first and second half of each group
  const float* qb = nullptr; // flat qb, zeros past G heads (16 L words)
  explicit HeadLaneResidual(int L_ = 0, int G = 0, const float* qb_ = nullptr) : L(L_), words(G * L_), qb(qb_) {
    for (int level = 0, g = L > 16 ? 16 : L; g > 1; ++level, g /= 2) {
      alignas(64) int32_t a[16], b[16];
      for (int o = 0; o < 16; ++o) {  // output lane o: from the first vector (o < 8) or the second (+ 16)
        const int src = o < 8 ? 0 : 16, p = o % 8, k = p / (g / 2), e = p % (g / 2);
        a[o] = src + k * g + e;
        b[o] = src + k * g + g / 2 + e;
      }
      lo[level] = _mm512_load_si512(a);
      hi[level] = _mm512_load_si512(b);
    }
  }
};

// Lane h = the sum of head h's L lanes of the flat product x[0 .. L) (L <= 16; vector v holds heads
// from v 16 / L, in order), by halving: each level sums the first and second halves of every group
// of two vectors side by side, so the heads stay in order. L at compile time keeps x in registers
// (a run-time L left it on the stack).
template <int L>
KVX_INLINE __m512 sum_head_groups(__m512* x, const HeadLaneResidual& hr) {
#pragma GCC unroll 16
  for (int level = 0, n = L; n > 1; ++level, n /= 2)
#pragma GCC unroll 16
    for (int i = 0; i < n / 2; ++i)
      x[i] = _mm512_add_ps(_mm512_permutex2var_ps(x[2 * i], hr.lo[level], x[2 * i + 1]),
                           _mm512_permutex2var_ps(x[2 * i], hr.hi[level], x[2 * i + 1]));
  return x[0];
}

// pt[t * pt_stride + h] += qb_h . R_h,t for the n latent rows at rkb (rrb bytes apart), L words a
// head (L = 32, 64: each head's 2 or 4 vectors added first, bf16 by chained vdpbf16ps, then summed as L = 16); rkpf: the next tile's
// latent rows, a share every 4 rows.
template <class R, int L, bool kAhead>
KVX_INLINE void head_lane_residual(const HeadLaneResidual& hr, const uint8_t* rkb, size_t rrb, int n, float* pt, int pt_stride,
                                   const Prefetch& rkpf, size_t ahead) {
  constexpr int T = L > 16 ? 16 : L, P = L / T;  // the tree's width; vectors a head pre-added (f32 r = 32: 2, 64: 4)
  const size_t rbytes = static_cast<size_t>(n) * rrb;
  __mmask16 lanes[L];
  __m512 qbv[T];
#pragma GCC unroll 64
  for (int v = 0; v < L; ++v) {
    const int left = hr.words - 16 * v;
    lanes[v] = left >= 16 ? static_cast<__mmask16>(0xffff) : left > 0 ? static_cast<__mmask16>((1u << left) - 1) : 0;
  }
#pragma GCC unroll 16
  for (int v = 0; v < T && P == 1; ++v) qbv[v] = _mm512_loadu_ps(hr.qb + 16 * v);
  for (int t = 0; t < n; ++t) {
    if (t % 4 == 0 && !kAhead) rkpf.range(rbytes * t / n, rbytes * imin(t + 4, n) / n);
    const uint8_t* row = rkb + t * rrb;
    __m512 x[T];
#pragma GCC unroll 16
    for (int v = 0; v < T; ++v) {
      if constexpr (P == 1) {
        if (kAhead && lanes[v]) prefetch_ahead(row + 64 * v, ahead);
        const __m512 w = _mm512_maskz_loadu_ps(lanes[v], row + 64 * v);
        x[v] = R::kDotBF16 ? _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)qbv[v], (__m512bh)w) : _mm512_mul_ps(qbv[v], w);
      } else {  // head v's P vectors (bf16: of pairs)
        x[v] = _mm512_setzero_ps();
#pragma GCC unroll 4
        for (int p = 0; p < P; ++p) {
          const __m512 q = _mm512_loadu_ps(hr.qb + 16 * (P * v + p)), w = _mm512_maskz_loadu_ps(lanes[P * v + p], row + 64 * (P * v + p));
          x[v] = R::kDotBF16 ? _mm512_dpbf16_ps(x[v], (__m512bh)q, (__m512bh)w) : _mm512_fmadd_ps(q, w, x[v]);
        }
      }
    }
    float* s = pt + t * pt_stride;
    _mm512_storeu_ps(s, _mm512_add_ps(_mm512_loadu_ps(s), sum_head_groups<T>(x, hr)));
  }
}

// K_s scores of TB rows from row t0 of the tile (rows past n repeat its last), prefetching
// steps [step0, step0 + chunks) of `steps` shares of the next tile's K_s (kAhead: instead, for
// each line of the rows, the line `ahead` bytes on).
template <class R, int TB, bool kAhead>
KVX_INLINE void head_lane_block(const float* qt, int chunks, const uint8_t* kb, size_t rb, int n, int t0, float* pt,
                                int pt_stride, const Prefetch& kpf, size_t kbytes, int step0, int steps, size_t ahead) {
  const int32_t* rows[TB];
  for (int t = 0; t < TB; ++t) rows[t] = reinterpret_cast<const int32_t*>(kb + imin(t0 + t, n - 1) * rb);
  // TB accumulators in registers (GCC 12 left the loops rolled, one chain through memory)
  __m512 acc[TB];
#pragma GCC unroll 16
  for (int t = 0; t < TB; ++t) acc[t] = _mm512_setzero_ps();
  for (int c = 0; c < chunks; ++c) {
    const int step = step0 + c;
    if constexpr (!kAhead) {
      kpf.range(kbytes * step / steps, kbytes * (step + 1) / steps);
    } else if (c % 2 == 0) {  // chunks c, c + 1: the rows' line 32 c .. 32 c + 63
#pragma GCC unroll 16
      for (int t = 0; t < TB; ++t) prefetch_ahead(rows[t] + 8 * c, ahead);
    }
    __m512 q[8];
#pragma GCC unroll 8
    for (int k = 0; k < 8; ++k) q[k] = _mm512_loadu_ps(qt + 16 * (8 * c + k));
    // row by row (word-major order measured 10-15% slower a call, in cache and not)
#pragma GCC unroll 16
    for (int t = 0; t < TB; ++t)
#pragma GCC unroll 8
      for (int k = 0; k < 8; ++k)
        acc[t] = R::kDotBF16 ? dpbf16_broadcast(acc[t], q[k], rows[t] + 8 * c + k) : fmadd_broadcast(acc[t], q[k], rows[t] + 8 * c + k);
  }
  for (int t = 0; t < TB && t0 + t < n; ++t) _mm512_storeu_ps(pt + (t0 + t) * pt_stride, acc[t]);
}

// pt[t * pt_stride + h] = q_h . K_s,t (+ qb_h . R_h,t) for the n rows at kb (rb bytes apart; the
// residual's at rkb, rrb apart). qt: [words of a K_s row][16] (lane h of word i: q_h's value i, or
// its pair i). kpf/rkpf: the next tile's K_s / latent rows, fetched a share per step. ahead > 0:
// instead, each line read fetches the one `ahead` rows on (prefetch_ahead). Rows in blocks of 16,
// or 8 for a tile's last 8 or fewer (f32 and wide latents tile by 8 rows).
template <class R, bool kAhead>
KVX_INLINE void head_lane_scores(const float* qt, int d, const uint8_t* kb, size_t rb, int n, const HeadLaneResidual* hr,
                                 const uint8_t* rkb, size_t rrb, float* pt, int pt_stride, const Prefetch& kpf,
                                 const Prefetch* rkpf, int ahead) {
  const int chunks = (R::kDotBF16 ? d / 2 : d) / 8;  // 8 words of QT held at a time
  const size_t kbytes = static_cast<size_t>(n) * rb;
  const int blocks = (n + 15) / 16, steps = blocks * chunks;
  for (int t0 = 0, b = 0; t0 < n; t0 += 16, ++b) {
    if (n - t0 > 8)
      head_lane_block<R, 16, kAhead>(qt, chunks, kb, rb, n, t0, pt, pt_stride, kpf, kbytes, b * chunks, steps, ahead * rb);
    else
      head_lane_block<R, 8, kAhead>(qt, chunks, kb, rb, n, t0, pt, pt_stride, kpf, kbytes, b * chunks, steps, ahead * rb);
  }
  if (!hr) return;
  switch (hr->L) {
    case 1: head_lane_residual<R, 1, kAhead>(*hr, rkb, rrb, n, pt, pt_stride, *rkpf, ahead * rrb); break;
    case 2: head_lane_residual<R, 2, kAhead>(*hr, rkb, rrb, n, pt, pt_stride, *rkpf, ahead * rrb); break;
    case 4: head_lane_residual<R, 4, kAhead>(*hr, rkb, rrb, n, pt, pt_stride, *rkpf, ahead * rrb); break;
    case 8: head_lane_residual<R, 8, kAhead>(*hr, rkb, rrb, n, pt, pt_stride, *rkpf, ahead * rrb); break;
    case 16: head_lane_residual<R, 16, kAhead>(*hr, rkb, rrb, n, pt, pt_stride, *rkpf, ahead * rrb); break;
    case 32: head_lane_residual<R, 32, kAhead>(*hr, rkb, rrb, n, pt, pt_stride, *rkpf, ahead * rrb); break;
    default: head_lane_residual<R, 64, kAhead>(*hr, rkb, rrb, n, pt, pt_stride, *rkpf, ahead * rrb); break;
  }
}

// The online softmax of a tile's n score vectors at pt (heads in lanes; G heads): m (the G running
// maxima) and l (16 lanes) updated, acc (G x d; by_column: d x 16, head_lane_values) and acc_r
// (G x r) rescaled where a head's max rises, pt replaced by the numerators e^(s - m).
KVX_INLINE void head_lane_softmax(float* pt, int pt_stride, int n, int G, float* m, float* l, float* acc, int d, float* acc_r, int r,
                                  bool by_column) {
  const __mmask16 heads = G >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << G) - 1);
  const __m512 ninf = _mm512_set1_ps(kNegInf);
  __m512 mv = _mm512_maskz_loadu_ps(heads, m);  // lanes past G: scores 0, max 0 (finite numerators, unused)
  __m512 smax = ninf;
  for (int t = 0; t < n; ++t) smax = _mm512_max_ps(smax, _mm512_loadu_ps(pt + t * pt_stride));
  __m512 lv = _mm512_loadu_ps(l);
  const __mmask16 rise = _mm512_mask_cmp_ps_mask(heads, smax, mv, _CMP_GT_OQ);
  if (rise) {
    const __m512 mt = _mm512_mask_max_ps(mv, rise, mv, smax);
    const __m512 alpha = exp512(_mm512_sub_ps(mv, mt));  // 0 where m was -inf (acc and l are 0 there)
    alignas(64) float a[16], mo[16];
    _mm512_store_ps(a, alpha);
    _mm512_store_ps(mo, mv);
    for (int c = 0; c < d && by_column; ++c) {  // lanes that rise only (where m was -inf, alpha is 0 and so is acc)
      const __m512 x = _mm512_loadu_ps(acc + 16 * c);
      _mm512_storeu_ps(acc + 16 * c, _mm512_mask_mul_ps(x, rise, x, alpha));
    }
    for (int h = 0; h < G; ++h)
      if ((rise >> h & 1) && mo[h] != kNegInf) {
        if (!by_column) scale_vec(acc + static_cast<size_t>(h) * d, d, a[h]);
        if (r > 0) scale_vec(acc_r + static_cast<size_t>(h) * r, r, a[h]);
      }
    lv = _mm512_mask_mul_ps(lv, rise, lv, alpha);
    mv = mt;
    _mm512_mask_storeu_ps(m, heads, mv);
  }
  for (int t = 0; t < n; ++t) {
    float* s = pt + t * pt_stride;
    const __m512 p = exp512(_mm512_sub_ps(_mm512_loadu_ps(s), mv));
    _mm512_storeu_ps(s, p);
    lv = _mm512_add_ps(lv, p);
  }
  _mm512_storeu_ps(l, lv);
}

// f32 values with heads in lanes: acc_cols[c][16] (lane h: head h's value c) += sum_t pt[t][h]
// v_t[c] for the n rows at v0 (rb bytes apart), each value broadcast against its row's 16
// numerators (faster than value_tile's per-head weight broadcasts, except at r = 32); 16 columns a
// pass, their accumulators in registers over the tile. pf: the next V tile, a share at each pass's
// start (faster cold than in steps); kAhead: instead, each row's line `ahead` bytes on is fetched
// (prefetch_ahead).
template <bool kAhead>
KVX_INLINE void head_lane_values(const uint8_t* v0, size_t rb, int n, const float* pt, int pt_stride, float* acc_cols, int d,
                                 const Prefetch* pf, size_t ahead) {
  const size_t bytes = static_cast<size_t>(n) * rb;
  const int passes = d / 16;
  for (int c = 0; c < passes; ++c) {
    if (pf && !kAhead) pf->range(bytes * c / passes, bytes * (c + 1) / passes);
    float* base = acc_cols + 256 * c;
    __m512 a[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) a[i] = _mm512_loadu_ps(base + 16 * i);
    for (int t = 0; t < n; ++t) {
      const __m512 p = _mm512_loadu_ps(pt + t * pt_stride);
      const int32_t* row = reinterpret_cast<const int32_t*>(v0 + t * rb) + 16 * c;
      if (kAhead) prefetch_ahead(row, ahead);
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) a[i] = fmadd_broadcast(a[i], p, row + i);
    }
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) _mm512_storeu_ps(base + 16 * i, a[i]);
  }
}

// LRKV bf16 latents with heads in lanes (r = 2..16: a row's G r values in 32-value blocks that
// straddle heads), values: acc_r (flat [G][r]) += sum_t p_head(c),t R^V_t[c] over the tile, by
// vdpbf16ps on token pairs as pair_value_pass (the weights' pair words, pair_weights): block i's
// lane j takes head (32 i + 2 j) / r's word (r even: its two columns share a head), one permute of
// the pair's 16 words a block. The tile's sums start from zero in registers and are added to acc_r
// in natural order at the end. rvpf: the next tile's latent rows, a share every 8 rows (one burst
// was slower). Out of line (one call a tile, as fast): inlined, its eight widths made clang's
// sanitizer build far slower to compile.
template <int NV>
__attribute__((noinline)) void pair_latent_values(const uint8_t* v0, size_t rb, int n, const uint32_t* pairs, int r, int width,
                                                  float* acc_r, const Prefetch& rvpf) {
  __m512i head[NV];
  __m512 a[2 * NV];
  __mmask32 live[NV];  // the row's values in block i
  const __m128i log2_r = _mm_cvtsi32_si128(__builtin_ctz(r));  // r a power of two (head_lanes)
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
#pragma GCC unroll 8
  for (int i = 0; i < NV; ++i) {
    head[i] = _mm512_min_epi32(_mm512_srl_epi32(_mm512_add_epi32(even, _mm512_set1_epi32(32 * i)), log2_r), _mm512_set1_epi32(15));
    a[2 * i] = a[2 * i + 1] = _mm512_setzero_ps();
    const int left = width - 32 * i;
    live[i] = left >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << left) - 1);
  }
  const __mmask32 high = 0xaaaaaaaau;
  const size_t bytes = static_cast<size_t>(n) * rb;
  for (int k = 0; 2 * k < n; ++k) {
    if (k % 4 == 0) rvpf.range(bytes * (2 * k) / n, bytes * imin(2 * k + 8, n) / n);
    const uint8_t* ra = v0 + 2 * k * rb;
    const uint8_t* rb1 = 2 * k + 1 < n ? ra + rb : ra;
    const __m512i p = _mm512_loadu_si512(pairs + 16 * k);
#pragma GCC unroll 8
    for (int i = 0; i < NV; ++i) {
      const __m512i x = _mm512_maskz_loadu_epi16(live[i], ra + 64 * i), y = _mm512_maskz_loadu_epi16(live[i], rb1 + 64 * i);
      const __m512bh w = (__m512bh)_mm512_permutexvar_epi32(head[i], p);
      a[2 * i] = _mm512_dpbf16_ps(a[2 * i], (__m512bh)_mm512_mask_blend_epi16(high, x, _mm512_slli_epi32(y, 16)), w);
      a[2 * i + 1] = _mm512_dpbf16_ps(a[2 * i + 1], (__m512bh)_mm512_mask_blend_epi16(high, _mm512_srli_epi32(x, 16), y), w);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < NV; ++i) {
    __m512 lo, hi;
    natural_order(a[2 * i], a[2 * i + 1], lo, hi);
    const int left = width - 32 * i;
    const __mmask16 mlo = left >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1);
    const __mmask16 mhi = left >= 32 ? static_cast<__mmask16>(0xffff) : left > 16 ? static_cast<__mmask16>((1u << (left - 16)) - 1) : 0;
    float* o = acc_r + 32 * i;
    _mm512_mask_storeu_ps(o, mlo, _mm512_add_ps(_mm512_maskz_loadu_ps(mlo, o), lo));
    _mm512_mask_storeu_ps(o + 16, mhi, _mm512_add_ps(_mm512_maskz_loadu_ps(mhi, o + 16), hi));
  }
}

// run_piece's online softmax for one query's tile of 33..64 rows (f32 MHA, bf16 pair values: tile_rows and LRKV's
// rows of 1-1.25 KB), with four score vectors; acc_r: the query's latent accumulators (r values), rescaled with acc.
// Out of line: inlined into run_piece, its code slowed f32 GQA 5-10%.
__attribute__((noinline)) void wide_tile_softmax(float* s, float* l, float& m, float* acc, int d, float* acc_r, int r, int n) {
  const __m512 ninf = _mm512_set1_ps(kNegInf);
  __m512 sv[kMaxTile / 16];
  __m512 smax = ninf;
  for (int v = 0; v < kMaxTile / 16; ++v) {
    const int left = n - 16 * v;
    const __mmask16 lanes = left >= 16 ? static_cast<__mmask16>(0xffff) : left > 0 ? static_cast<__mmask16>((1u << left) - 1) : 0;
    sv[v] = _mm512_mask_loadu_ps(ninf, lanes, s + 16 * v);
    smax = _mm512_max_ps(smax, sv[v]);
  }
  if (_mm512_cmp_ps_mask(smax, _mm512_set1_ps(m), _CMP_GT_OQ)) {
    const float mt = _mm512_reduce_max_ps(smax);
    if (m != kNegInf) {
      const float alpha = expf(m - mt);
      scale_vec(l, 16, alpha);
      scale_vec(acc, d, alpha);
      if (r > 0) scale_vec(acc_r, r, alpha);
    }
    m = mt;
  }
  const __m512 mv = _mm512_set1_ps(m);
  __m512 lsum = _mm512_loadu_ps(l);
  for (int v = 0; v < kMaxTile / 16; ++v) {
    sv[v] = exp512(_mm512_sub_ps(sv[v], mv));
    _mm512_storeu_ps(s + 16 * v, sv[v]);
    lsum = _mm512_add_ps(lsum, sv[v]);
  }
  _mm512_storeu_ps(l, lsum);
}

// One piece: rows [r0, r1) of KV head `head` for its G queries -> part = [m[G], l[G],
// acc[G][d], acc_r[G][r] (with a residual)], natural order.
// kLrkv: with LRKV's residual path compiled in (the dense kernel runs faster without its code). kD:
// the store's head_dim where it is compiled in (fixed_head_dim), else 0.
template <class R, bool kLrkv, int kD = 0>
void run_piece(const KVStore& kv, const DecodePiece& pc, const float* q, int G, float* part, float* scratch,
               const Residual& res = {}) {
  const int d = kD ? kD : kv.head_dim(), nj = d / 32, nb = R::kQuant ? nj : 0, P = kv.page_tokens();
  const size_t rb = kv.row_bytes();
  const KVStore* rst = kLrkv ? res.store : nullptr;
  const int r = rst ? res.r : 0, rblocks = r / 32;  // latent blocks (whole groups) per head
  const int nbr = rst && R::kQuant ? G * r / 32 : 0;  // q8/q4 latent blocks per row (G r % 32 == 0: lrkv.cpp)
  // Latents of r % 32 != 0: blocks straddle heads. Values by whole rows (latent_row_values) of lb
  // blocks; q8/q4 scored per head segment (latent_word_scores where segments are whole words, else
  // latent_column_scores), f32/bf16 as flat rows (FlatLatents), which may end mid-block.
  const bool latent_straddle = rst && r % 32 != 0;
  const bool latent_int = R::kQuant && latent_straddle && latent_words(kv.type(), r);
  const int lb = latent_straddle ? (G * r + 31) / 32 : 0;
  // quant_weights_by_token (faster for q8 and q4): the softmax and the V weight codes with heads in
  // lanes (the scores transposed to pt, which straddling latents' values read by token anyway;
  // int_weights_by_token), r = 32 and 64's latent weights by token too: no per-head maxima,
  // branches or scalar scales. Straddling q8 latents stay f32 (latent_row_values): weight codes
  // were faster only in L2 and missed the latents' 1e-5 bound.
  const bool codes_by_token = kLrkv && rst && quant_weights_by_token(kv.type(), G, r);
  FlatLatents flat;  // f32/bf16 scores; every type's latent_row_values (q8/q4 rows end on a block: H r % 32 == 0)
  if (latent_straddle) {
    flat.r = r;
    flat.row_vectors = (G * r + 15) / 16;
    flat.last = G * r % 16 ? static_cast<__mmask16>((1u << (G * r % 16)) - 1) : static_cast<__mmask16>(0xffff);
    for (int h = 0; h < G; ++h) flat.max_count = flat.count(h) > flat.max_count ? flat.count(h) : flat.max_count;
  }
  const size_t rrb = rst ? rst->row_bytes() : 0;
  // heads in lanes (head_lane_scores): q is QT, res.qb the flat qb
  const bool hl = R::kHeadLanes && kLrkv && res.head_lanes;
  // bf16 with vdpbf16ps, LRKV and dense of 8+ queries a KV head: values two rows at a time against bf16
  // numerator pairs (pair_weights; avx512_pair_values)
  const bool pairs = avx512_pair_values(kv.type(), G, kLrkv);
  const bool lane_values = hl && !R::kQuant && !R::kDotBF16;  // f32: head_lane_values into sc.acc_cols
  // f32 heads in lanes with latents of r % 32 != 0: 8-row tiles, each stream (K_s, V_s, both
  // latents) fetched `ahead` = 8 rows on, a line per line read (prefetch_ahead), instead of the
  // next tile's ranges spread over the passes: no bookkeeping a step (the ranges' address
  // arithmetic alone took most of MQA's time a row in L3). 8 rows ahead on 8-row tiles is a narrow
  // optimum (the streams' fetched rows likely have to fit L1); MQA, r = 32 and bf16 heads in lanes
  // were no faster this way.
  const bool straddle_lanes = lane_values && latent_straddle;
  const int ahead = straddle_lanes ? 8 : 0;
  // Tiled16 (q8/q4): the scales of K and V read per group, K scored from its token groups, V's
  // codes in slot pairs (kv_store.h); tiles start on groups (pieces do: piece_cut) and span whole
  // ones.
  const bool tiled = R::kQuant && kv.layout() == KVLayout::Tiled16;
  // Tiled16 (bf16): K scored from its token groups (bf16_group_scores), V as rows; same row stride.
  // (decode_attention refuses such stores where heads in lanes would read them, lrkv_decode_attention always)
  const bool bf16_tiled = !kLrkv && !R::kQuant && kv.type() == KVType::BF16 && kv.layout() == KVLayout::Tiled16;
  const size_t kstride = tiled ? static_cast<size_t>(R::kNibbles ? d / 2 : d) : rb;  // bytes a row of the K and V code streams
  const int row_tile = straddle_lanes ? 8
                       : rst || (hl && R::kDotBF16) ? lrkv_tile_rows(rb + rrb, kv.type(), R::kQuant, pairs, hl)
                                                    : tile_rows(rb, G, R::kQuant, pairs);
  const int tile = (tiled || bf16_tiled) && row_tile % 16 ? (row_tile < 16 ? 16 : row_tile & ~15) : row_tile;
  const Scratch sc(scratch, G, nb, nbr, lb, lb > 0 || hl || codes_by_token, pairs);
  const HeadLaneResidual hlr(hl && rst ? (R::kDotBF16 ? r / 2 : r) : 0, G, res.qb);
  float* const acc_cols = lane_values ? sc.acc_cols : nullptr;
  // Also prefetch to L2 the tile kFarTiles ahead (far), for float pieces of several queries without
  // heads in lanes: bf16 at 8+ queries a KV head (kGroupFarPrefetch) and LRKV with latent rows
  // wider than the shared ones (rrb > rb). Elsewhere it was slower or no faster (compute hid the
  // latency, and each prefetch instruction costs issue slots).
  constexpr int kFarTiles = 3;
  const bool far = !R::kQuant && G > 1 && !hl && ((R::kGroupFarPrefetch && G >= 8) || rrb > rb);
  float* m = part;
  float* l = part + G;
  float* acc = part + 2 * G;
  float* acc_r = acc + static_cast<size_t>(G) * d;
  for (int g = 0; g < G; ++g) m[g] = kNegInf;
  for (int i = 0; i < 16 * G; ++i) sc.l[i] = 0.0f;
  for (int i = 0; i < G * (d + r); ++i) acc[i] = 0.0f;
  for (int i = 0; i < 16 * d && lane_values; ++i) acc_cols[i] = 0.0f;
  const size_t codes = 2 * static_cast<size_t>(nb);  // bytes of scales before the codes
  const size_t rcodes = 2 * static_cast<size_t>(nbr);
  // Byte offset of head h's latent within a residual row's codes (r % 32 == 0).
  const size_t latent_bytes = rst ? (rrb - rcodes) / G : 0;
  const uint8_t* qi = reinterpret_cast<const uint8_t*>(q);  // integer queries (q8/q4)
  // q8/q4 latents of r = 32 for up to 16 heads: scored a row at a time (latent_scores).
  const bool latent_rows = R::kQuant && rst && r == 32 && G <= 16;
  LatentQuery lq{};
  if constexpr (R::kQuant)
    if (latent_rows) lq = latent_query<R>(reinterpret_cast<const uint8_t*>(res.qb), res.qstride * sizeof(float), G, sc.latent_codes);
  const size_t qbytes = query_floats<R>(d) * sizeof(float), qb_bytes = res.qstride * sizeof(float);
  if (latent_int) latent_segment_biases<R>(reinterpret_cast<const uint8_t*>(res.qb), nbr, r, sc.seg_bias);
  if (latent_straddle)
    for (int b = 0; b < lb; ++b) {
      sc.head0[b] = 32 * b / r;
      for (int i = 0; i < 32; ++i) sc.idx[32 * b + i] = (32 * b + i) / r - sc.head0[b];
    }

  // Page touch 16 KB ahead (touch_pages) where it measured faster: dense float rows; in LRKV's
  // kernel (kLrkv, also run by dense heads in lanes) bf16 with vdpbf16ps and q8; f32 LRKV heads in
  // lanes bar straddling latents (fetched rows ahead); q8 MHA. Not q8 GQA on Rows (FMA-bound: the
  // touches cost issue slots), q4 or other f32 LRKV.
  constexpr bool kTouch = kLrkv ? R::kDotBF16 || (R::kQuant && !R::kNibbles) : !R::kQuant;
  // Tiled16 q8 stores touch too (without it q8 GQA read them no faster than Rows).
  const bool touch = tiled || kTouch || (!kLrkv && R::kQuant && !R::kNibbles && G == 1) || (rst && lane_values && !latent_straddle);
  constexpr size_t kTouchAhead = 16384;
  for (int64_t row = pc.r0; row < pc.r1;) {
    const int64_t page = row / P;
    const int off = static_cast<int>(row % P);
    const int n = static_cast<int>(lmin(lmin(tile, pc.r1 - row), P - off));
    const uint8_t* kb = kv.k_rows(page, pc.head) + off * kstride;
    const uint8_t* vb = kv.v_rows(page, pc.head) + off * kstride;
    // Tiled16: the tile's first group's K and V scales
    const size_t scale_off = P * kstride + 2 * static_cast<size_t>(nb) * off;
    const uint8_t* ks = tiled ? kv.k_rows(page, pc.head) + scale_off : nullptr;
    const uint8_t* vs = tiled ? kv.v_rows(page, pc.head) + scale_off : nullptr;
    const uint8_t* rkb = rst ? rst->k_rows(page, 0) + off * rrb : nullptr;
    const uint8_t* rvb = rst ? rst->v_rows(page, 0) + off * rrb : nullptr;
    // The next tile (this page, then the next one; within the piece) is fetched while this one
    // computes: K during the scores, V during the value passes.
    const int64_t page_rows = lmin(P - off, pc.r1 - row), next_rows = lmin(P, pc.r1 - row - page_rows);
    const bool has_next = next_rows > 0;
    // `tiles` ahead: the tile after this one, or (far) the one kFarTiles - 1 tiles after that.
    auto prefetcher = [&](const uint8_t* base, const uint8_t* next_page, size_t rowb, int tiles = 1) {
      const size_t ahead = static_cast<size_t>(n + (tiles - 1) * tile) * rowb;
      const size_t end = page_rows * rowb > ahead ? page_rows * rowb - ahead : 0, next_end = has_next ? next_rows * rowb : 0;
      const size_t skip = page_rows * rowb > ahead ? 0 : ahead - page_rows * rowb;  // the next tile starts on the next page
      return Prefetch{base + ahead, has_next ? next_page + skip : nullptr, end, next_end > skip ? next_end - skip : 0};
    };
    Prefetch kpf = prefetcher(kb, has_next ? kv.k_rows(page + 1, pc.head) : nullptr, kstride);
    Prefetch vpf = prefetcher(vb, has_next ? kv.v_rows(page + 1, pc.head) : nullptr, kstride);
    if (tiled) {  // the next tile's scales (2 nb bytes a row): a few lines, fetched at once (q8 MHA 1.17x against none, 1.12x)
      const size_t next_scales = P * kstride;
      prefetcher(ks, has_next ? kv.k_rows(page + 1, pc.head) + next_scales : nullptr, 2 * nb).range(0, 2 * nb * static_cast<size_t>(n));
      prefetcher(vs, has_next ? kv.v_rows(page + 1, pc.head) + next_scales : nullptr, 2 * nb).range(0, 2 * nb * static_cast<size_t>(n));
    }
    const Prefetch kfar = prefetcher(kb, has_next ? kv.k_rows(page + 1, pc.head) : nullptr, rb, kFarTiles);
    const Prefetch vfar = prefetcher(vb, has_next ? kv.v_rows(page + 1, pc.head) : nullptr, rb, kFarTiles);
    if (far) kpf.far = &kfar, vpf.far = &vfar;
    // The residual's next tile is spread over the heads' passes: its K during the scores, its V
    // during the value passes (a burst of both would overrun the outstanding-miss slots).
    Prefetch rkpf = rst ? prefetcher(rkb, has_next ? rst->k_rows(page + 1, 0) : nullptr, rrb) : Prefetch{};
    Prefetch rvpf = rst ? prefetcher(rvb, has_next ? rst->v_rows(page + 1, 0) : nullptr, rrb) : Prefetch{};
    const Prefetch rkfar = rst ? prefetcher(rkb, has_next ? rst->k_rows(page + 1, 0) : nullptr, rrb, kFarTiles) : Prefetch{};
    const Prefetch rvfar = rst ? prefetcher(rvb, has_next ? rst->v_rows(page + 1, 0) : nullptr, rrb, kFarTiles) : Prefetch{};
    if (rst && far) rkpf.far = &rkfar, rvpf.far = &rvfar;
    const size_t rtile = static_cast<size_t>(n) * rrb;
    if (touch) {
      touch_pages(kb, static_cast<size_t>(n) * kstride, kTouchAhead);
      touch_pages(vb, static_cast<size_t>(n) * kstride, kTouchAhead);
      if (rst) touch_pages(rkb, rtile, kTouchAhead), touch_pages(rvb, rtile, kTouchAhead);
    }

    // Scores: the shared rows for all G queries, with (LRKV) each query's latent segment added.
    if constexpr (R::kQuant) {
      // 16 rows in lanes; past the tile's end the last row repeats
      auto rows16 = [&](auto clamp, int t0) {
        constexpr bool kClamp = decltype(clamp)::value != 0;
        const int last = n - 1 - t0;
        const Rows16<kClamp> krow{kb + t0 * rb, rb, last}, vrow{vb + t0 * rb, rb, last};
        kpf.range(t0 * kstride, imin(t0 + 16, n) * kstride);
        if (tiled) {
          const __mmask16 live = kClamp ? static_cast<__mmask16>((1u << (last + 1)) - 1) : static_cast<__mmask16>(0xffff);
          const size_t group = static_cast<size_t>(t0 / 16) * 32 * nb;
          group_scales(ks + group, nb, live, sc.kT + t0);
          group_scales(vs + group, nb, live, sc.vT + t0);
          token_scores<R>(TokenGroup{kb + t0 * kstride}, 0, nb, qi, qbytes, G, sc.kT + t0, sc.s + t0, false);
        } else {
          if (nb <= 8) {
            transpose_kv_scales(krow, vrow, nb, sc.kT + t0, sc.vT + t0);
          } else {
            transpose_scales(krow, nb, sc.kT + t0);
            transpose_scales(vrow, nb, sc.vT + t0);
          }
          token_scores<R>(krow, codes, nb, qi, qbytes, G, sc.kT + t0, sc.s + t0, false);
        }
        if (rst) {
          const Rows16<kClamp> rkrow{rkb + t0 * rrb, rrb, last}, rvrow{rvb + t0 * rrb, rrb, last};
          if (latent_straddle || !codes_by_token) transpose_scales(rvrow, nbr, sc.vT + nb * kMaxTile + t0);
          const size_t a = t0 * rrb, span = static_cast<size_t>(imin(t0 + 16, n) - t0) * rrb;
          if (latent_straddle) {
            rkpf.range(a, a + span);
            transpose_scales(rkrow, nbr, sc.kT + nb * kMaxTile + t0);
            if (latent_int)
              latent_word_scores<R>(rkrow, rcodes, nbr, r, reinterpret_cast<const uint8_t*>(res.qb), sc.seg_bias,
                                    sc.kT + nb * kMaxTile + t0, sc.s + t0);
            else
              latent_column_scores<R>(rkrow, rcodes, nbr, r, res.qb, sc.kT + nb * kMaxTile + t0, sc.s + t0, sc.cols);
            return;
          }
          if (latent_rows) {
            if (G == 16)
              latent_scores<R, 16>(rkrow, rcodes, lq, sc.s + t0, rkpf, a, span);
            else
              latent_scores<R, 0>(rkrow, rcodes, lq, sc.s + t0, rkpf, a, span);
            return;
          }
          transpose_scales(rkrow, nbr, sc.kT + nb * kMaxTile + t0);
          const uint8_t* qb = reinterpret_cast<const uint8_t*>(res.qb);
          for (int h = 0; h < G; ++h) {
            rkpf.range(a + span * h / G, a + span * (h + 1) / G);
            token_scores<R>(rkrow, rcodes + h * latent_bytes, rblocks, qb + h * qb_bytes, qb_bytes, 1,
                            sc.kT + (nb + h * rblocks) * kMaxTile + t0, sc.s + h * kRow + t0, true);
          }
        }
      };
      for (int t0 = 0; t0 < n; t0 += 16) {
        if (n - t0 >= 16)
          rows16(Int<0>{}, t0);
        else
          rows16(Int<1>{}, t0);
      }
    } else if (bf16_tiled) {
      for (int t0 = 0; t0 < n; t0 += 16) {
        bf16_group_scores_all<R>(kb + t0 * rb, q, d, G, sc.s + t0, kpf, t0 * rb, imin(t0 + 16, n) * rb);
      }
    } else if (hl) {
      auto scores = [&](auto by_rows) {
        head_lane_scores<R, decltype(by_rows)::value != 0>(q, d, kb, rb, n, rst ? &hlr : nullptr, rkb, rrb, sc.pt, sc.pt_stride, kpf, &rkpf, ahead);
      };
      with_flag<kLrkv && R::kHeadLanes && !R::kDotBF16>(ahead > 0, scores);
    } else {
      for (int g0 = 0, gb; g0 < G; g0 += gb) {
        gb = group_size(G - g0);
        ResidualTile rt{};
        if (rst) {
          rt = latent_straddle ? ResidualTile{reinterpret_cast<const uint8_t*>(res.qb), 0, 0, 0, rkb, rrb, &flat, g0}
                               : ResidualTile{reinterpret_cast<const uint8_t*>(res.qb + g0 * res.qstride), qb_bytes, rblocks,
                                              latent_bytes, rkb + g0 * latent_bytes, rrb, nullptr, g0};
          rkpf.range(rtile * g0 / G, rtile * (g0 + gb) / G);
        }
        // each query group fetches its share of the next K tile (faster than one fetching it all)
        const size_t kbytes = static_cast<size_t>(n) * rb;
        const Prefetch kshare = kpf.share(kbytes * g0 / G, kbytes * (g0 + gb) / G, kbytes);
        scores_for<R>(q + g0 * d, gb, d, kb, rb, n, sc.s + g0 * kRow, G > 1 || R::kMhaKeyPrefetch ? &kshare : nullptr,
                      rst ? &rt : nullptr);
      }
    }

    // Online softmax: m' = max(m, max_t s_t); l = l e^(m - m') + sum_t e^(s_t - m'); acc *= e^(m - m').
    if (codes_by_token)
      for (int t0 = 0; t0 < n; t0 += 16) transpose_block(sc.s + t0, kRow, G, sc.pt + t0 * sc.pt_stride, sc.pt_stride, n - t0);
    if (hl || codes_by_token) head_lane_softmax(sc.pt, sc.pt_stride, n, G, m, sc.l, lane_values ? acc_cols : acc, d, acc_r, r, lane_values);
    if (n > 32 && !hl)  // f32 MHA, bf16 pair values (tile_rows, LRKV rows of 1-1.25 KB): float weights
      for (int g = 0; g < G; ++g)
        wide_tile_softmax(sc.s + g * kRow, sc.l + 16 * g, m[g], acc + static_cast<size_t>(g) * d, d,
                          acc_r + static_cast<size_t>(g) * r, r, n);
    const __mmask16 lo = n >= 16 ? 0xffff : static_cast<__mmask16>((1u << n) - 1);
    const __mmask16 hi = n <= 16 ? 0 : n >= 32 ? 0xffff : static_cast<__mmask16>((1u << (n - 16)) - 1);
    // q8/q4 integer values (IntWeights): each block's largest |V scale| in the tile, vmax; vT becomes
    // d_t,j 32767 / vmax and sig vmax / 32767
    int16_t* const wcodes = reinterpret_cast<int16_t*>(sc.w);
    // (by token: words [kMaxTile / 2][nb][16]; G > 8 leaves room for them and sig)
    float* const wsig = sc.w + static_cast<size_t>(codes_by_token ? 16 : G) * nb * kMaxTile / 2;
    if constexpr (R::kIntValues)
      for (int b = 0; b < nb; ++b) {
        float* x = sc.vT + static_cast<size_t>(b) * kMaxTile;
        const __m512 x0 = _mm512_maskz_loadu_ps(lo, x), x1 = _mm512_maskz_loadu_ps(hi, x + 16);
        const float vmax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));  // (q4 scales take either sign)
        wsig[b] = vmax * (1.0f / 32767.0f);
        const __m512 k = _mm512_set1_ps(vmax > 0.0f ? 32767.0f / vmax : 0.0f);
        _mm512_storeu_ps(x, _mm512_mul_ps(x0, k));
        _mm512_storeu_ps(x + 16, _mm512_mul_ps(x1, k));
      }
    if constexpr (R::kIntValues)
      if (codes_by_token) {
        int_weights_by_token(sc.pt, sc.pt_stride, n, sc.vT, nb, reinterpret_cast<int32_t*>(sc.w));
        if (!latent_straddle) {  // r = 32, 64: wr[t][j][h] = p_h,t times the V scale of head h's block j, from the row
          const __mmask32 scales = static_cast<__mmask32>((1ull << nbr) - 1);
          const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
          const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
          for (int t = 0; t < n; ++t) {
            const __m512 p = _mm512_loadu_ps(sc.pt + t * sc.pt_stride);
            const __m512i dh = _mm512_maskz_loadu_epi16(scales, rvb + t * rrb);  // the row's nbr fp16 scales
            const __m512 d0 = _mm512_cvtph_ps(_mm512_castsi512_si256(dh)), d1 = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(dh, 1));
            float* wt = sc.wr + static_cast<size_t>(16 * rblocks) * t;
            if (rblocks == 1) {
              _mm512_storeu_ps(wt, _mm512_mul_ps(p, d0));
            } else {  // head h's blocks 2h, 2h + 1
              _mm512_storeu_ps(wt, _mm512_mul_ps(p, _mm512_permutex2var_ps(d0, even, d1)));
              _mm512_storeu_ps(wt + 16, _mm512_mul_ps(p, _mm512_permutex2var_ps(d0, odd, d1)));
            }
          }
        }
      }
    for (int g = 0; g < G && n <= 32 && !hl && !codes_by_token; ++g) {  // up to 32 rows (wider tiles: above)
      float* sg = sc.s + g * kRow;
      const __m512 ninf = _mm512_set1_ps(kNegInf);
      const __m512 s0 = _mm512_mask_loadu_ps(ninf, lo, sg), s1 = _mm512_mask_loadu_ps(ninf, hi, sg + 16);
      const __m512 smax = _mm512_max_ps(s0, s1);
      float* lg = sc.l + 16 * g;  // l per lane, summed at the end of the piece
      if (_mm512_cmp_ps_mask(smax, _mm512_set1_ps(m[g]), _CMP_GT_OQ)) {  // the running max rises
        const float mt = _mm512_reduce_max_ps(smax);
        if (m[g] != kNegInf) {
          const float alpha = expf(m[g] - mt);  // libm, not the std:: inline wrapper
          scale_vec(lg, 16, alpha);
          scale_vec(acc + static_cast<size_t>(g) * d, d, alpha);
          if (r > 0) scale_vec(acc_r + static_cast<size_t>(g) * r, r, alpha);
        }
        m[g] = mt;
      }
      const __m512 mv = _mm512_set1_ps(m[g]);
      // tiles of up to 16 rows (f32/bf16 GQA, LRKV's widest rows, a page's end) skip the second vector
      const __m512 p0 = exp512(_mm512_sub_ps(s0, mv)), p1 = n > 16 ? exp512(_mm512_sub_ps(s1, mv)) : _mm512_setzero_ps();
      if (!R::kQuant || latent_straddle) {  // f32/bf16 weights (and latent_row_values'); q8/q4 keep theirs with the V scales below
        _mm512_storeu_ps(sg, p0);
        if (n > 16) _mm512_storeu_ps(sg + 16, p1);
      }
      _mm512_storeu_ps(lg, _mm512_add_ps(_mm512_loadu_ps(lg), n > 16 ? _mm512_add_ps(p0, p1) : p0));
      if constexpr (R::kIntValues) {  // the V weights as codes of the numerators times the scales (IntWeights)
        for (int b = 0; b < nb; ++b) {
          int16_t* c = wcodes + (static_cast<size_t>(g) * nb + b) * kMaxTile;
          const float* x = sc.vT + static_cast<size_t>(b) * kMaxTile;
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(c), _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(p0, _mm512_loadu_ps(x)))));
          if (n > 16)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + 16),
                                _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(p1, _mm512_loadu_ps(x + 16)))));
        }
      }
      if constexpr (R::kQuant)  // value weights: the numerators times the V rows' block scales
        for (int t0 = 0; t0 < n; t0 += 16) {
          const __m512 p = t0 == 0 ? p0 : p1;
          for (int b = 0; b < nb && !R::kIntValues; ++b) {
            const size_t o = static_cast<size_t>(b) * kMaxTile + t0;
            _mm512_storeu_ps(sc.w + static_cast<size_t>(g) * nb * kMaxTile + o, _mm512_mul_ps(p, _mm512_loadu_ps(sc.vT + o)));
          }
          for (int b = g * rblocks; b < (g + 1) * rblocks && rst && !latent_straddle; ++b) {
            const size_t o = static_cast<size_t>(b) * kMaxTile + t0;
            _mm512_storeu_ps(sc.wr + o, _mm512_mul_ps(p, _mm512_loadu_ps(sc.vT + nb * kMaxTile + o)));
          }
        }
    }

    // Values; the first group's passes prefetch the next V tile (MHA: where R::kMhaValuePrefetch).
    const float* w = R::kQuant ? sc.w : sc.s;  // (f32 heads in lanes: head_lane_values; bf16: pair words)
    const size_t wg = R::kQuant ? static_cast<size_t>(nb) * kMaxTile : kRow;
    if (pairs) {
      if (hl)
        pair_weights(sc.pt, sc.pt_stride, n, sc.pairs);
      else
        pair_weights_by_head(sc.s, G, n, sc.pairs);
    }
    if (lane_values && ahead) head_lane_values<true>(vb, rb, n, sc.pt, sc.pt_stride, acc_cols, d, &vpf, ahead * rb);
    if (lane_values && !ahead) head_lane_values<false>(vb, rb, n, sc.pt, sc.pt_stride, acc_cols, d, &vpf, 0);
    for (int g0 = 0, gb; g0 < G && !lane_values; g0 += gb) {
      gb = G - g0 >= 8 ? 8 : group_size(G - g0);
      const Prefetch* pf = g0 == 0 && (G > 1 || R::kMhaValuePrefetch) ? &vpf : nullptr;
      float* ag = acc + static_cast<size_t>(g0) * d;
      const float* wgp = w + g0 * wg;
      const PairWords pw{sc.pairs + g0 * (hl ? 1 : kMaxTile / 2), hl};
      const PairWords* pwp = pairs ? &pw : nullptr;
      const IntWeights iw = codes_by_token
                                ? IntWeights{reinterpret_cast<const int32_t*>(sc.w) + g0, wsig, nb}
                                : IntWeights{reinterpret_cast<const int32_t*>(wcodes + static_cast<size_t>(g0) * nb * kMaxTile), wsig, nb};
      const IntWeights* iwp = R::kIntValues ? &iw : nullptr;
      const uint8_t* v0 = tiled ? vb : vb + codes;  // the tile's first V codes, kstride bytes a row
      auto values = [&](auto by_token, auto paired) {
        constexpr bool kByToken = decltype(by_token)::value != 0, kPaired = decltype(paired)::value != 0;
        switch (gb) {
          case 8: value_tile<R, 8, kByToken, kPaired>(v0, kstride, n, wgp, wg, ag, d, pf, pwp, iwp); break;
          case 4: value_tile<R, 4, kByToken, kPaired>(v0, kstride, n, wgp, wg, ag, d, pf, pwp, iwp); break;
          case 2: value_tile<R, 2, kByToken, kPaired>(v0, kstride, n, wgp, wg, ag, d, pf, pwp, iwp); break;
          default: value_tile<R, 1, kByToken, kPaired>(v0, kstride, n, wgp, wg, ag, d, pf, pwp, iwp); break;
        }
      };
      // (the dense kernel compiles only the codes by head)
      with_flag<kLrkv && R::kIntValues>(codes_by_token, [&](auto by_token) {
        with_flag<R::kIntValues>(tiled, [&](auto paired) { values(by_token, paired); });
      });
    }
    if (latent_straddle) {  // + a_h R_h^V, whole rows; the numerators by token first
      for (int h0 = 0; h0 < G && !hl && !codes_by_token; h0 += 16)  // (heads in lanes: already by token)
        for (int t0 = 0; t0 < n; t0 += 16)
          transpose_block(sc.s + h0 * kRow + t0, kRow, G - h0, sc.pt + t0 * sc.pt_stride + h0, sc.pt_stride, n - t0);
      if (pairs && hl) {  // G r <= 256
        const uint8_t* v0 = rvb + rcodes;
        switch ((G * r + 31) / 32) {
          case 1: pair_latent_values<1>(v0, rrb, n, sc.pairs, r, G * r, acc_r, rvpf); break;
          case 2: pair_latent_values<2>(v0, rrb, n, sc.pairs, r, G * r, acc_r, rvpf); break;
          case 3: pair_latent_values<3>(v0, rrb, n, sc.pairs, r, G * r, acc_r, rvpf); break;
          case 4: pair_latent_values<4>(v0, rrb, n, sc.pairs, r, G * r, acc_r, rvpf); break;
          case 5: pair_latent_values<5>(v0, rrb, n, sc.pairs, r, G * r, acc_r, rvpf); break;
          case 6: pair_latent_values<6>(v0, rrb, n, sc.pairs, r, G * r, acc_r, rvpf); break;
          case 7: pair_latent_values<7>(v0, rrb, n, sc.pairs, r, G * r, acc_r, rvpf); break;
          default: pair_latent_values<8>(v0, rrb, n, sc.pairs, r, G * r, acc_r, rvpf); break;
        }
      } else {
        if (!ahead) rvpf.range(0, rtile);
        latent_row_values<R>(rvb + rcodes, rrb, n, sc.pt, sc.pt_stride, sc.vT + nb * kMaxTile, sc.idx, sc.head0, lb, acc_r, flat,
                             ahead * rrb);
      }
    } else if (rst) {  // + a_h R_h^V, heads in groups of up to 4
      const uint32_t* head_pairs = sc.pairs;
      if (hl && pairs) {  // (bf16 r = 32, 64) the pair words by head first, into the scores' room
        uint32_t* by_head = reinterpret_cast<uint32_t*>(sc.s);
        const int np = (n + 1) / 2;
        for (int k0 = 0; k0 < np; k0 += 16)
          transpose_block(reinterpret_cast<const float*>(sc.pairs + 16 * k0), 16, np - k0, reinterpret_cast<float*>(by_head + k0),
                          kMaxTile / 2, G);
        head_pairs = by_head;
      } else if (hl) {  // (f32 r = 32, 64) the numerators by head first
        for (int t0 = 0; t0 < n; t0 += 16) transpose_block(sc.pt + t0 * sc.pt_stride, sc.pt_stride, n - t0, sc.s + t0, kRow, G);
      }
      const float* wr = R::kQuant ? sc.wr : sc.s;
      const size_t wrg = codes_by_token ? 1 : R::kQuant ? static_cast<size_t>(rblocks) * kMaxTile : kRow;
      for (int h0 = 0, gb; h0 < G; h0 += gb) {
        // f32 latents in groups of 8 heads (measured 20% faster at H=16, r=32; the others are not)
        gb = R::kWideResidualGroups && G - h0 >= 8 ? 8 : group_size(G - h0);
        rvpf.range(rtile * h0 / G, rtile * (h0 + gb) / G);
        const uint8_t* v0 = rvb + rcodes + h0 * latent_bytes;
        const float* wh = wr + h0 * wrg;
        float* ar = acc_r + static_cast<size_t>(h0) * r;
        const PairWords pwh{head_pairs + h0 * (kMaxTile / 2), false};  // (heads in lanes straddle: above)
        const PairWords* pw = pairs ? &pwh : nullptr;
        auto latents = [&](auto by_token) {
          constexpr bool kByToken = decltype(by_token)::value != 0;
          switch (gb) {
            case 8: residual_values<R, 8, kByToken>(v0, rrb, latent_bytes, n, wh, wrg, rblocks, ar, r, pw); break;
            case 4: residual_values<R, 4, kByToken>(v0, rrb, latent_bytes, n, wh, wrg, rblocks, ar, r, pw); break;
            case 2: residual_values<R, 2, kByToken>(v0, rrb, latent_bytes, n, wh, wrg, rblocks, ar, r, pw); break;
            default: residual_values<R, 1, kByToken>(v0, rrb, latent_bytes, n, wh, wrg, rblocks, ar, r, pw); break;
          }
        };
        with_flag<kLrkv && R::kIntValues>(codes_by_token, latents);
      }
    }
    row += n;
  }

  for (int g = 0; g < G; ++g) l[g] = hl || codes_by_token ? sc.l[g] : _mm512_reduce_add_ps(_mm512_loadu_ps(sc.l + 16 * g));
  for (int c0 = 0; c0 < d && lane_values; c0 += 16) transpose_block(acc_cols + 16 * c0, 16, 16, acc + c0, d, G);  // [d][16] -> [G][d]
  if constexpr (R::kPerm) {  // whole groups only (straddling latents, read as flat rows, are in natural order)
    unpermute(acc, G * d);
    for (int g = 0; g < G && rblocks > 0 && !latent_straddle; ++g) unpermute(acc_r + static_cast<size_t>(g) * r, 32 * rblocks);
  }
}

// The head_dim a Row type's pieces are compiled for (run_piece's kD; 0: read at run time): q4 128
// (the realistic layer), d then a constant in every loop (faster); f32, bf16 and q8 gained nothing
// reliable and read d at run time.
template <class R>
constexpr int fixed_head_dim() {
  return R::kNibbles ? 128 : 0;
}
// f(Int<kD>{}) with kD = fixed_head_dim<R>() where the store's head_dim is it, else f(Int<0>{}).
template <class R, class F>
KVX_INLINE void with_head_dim(int head_dim, F&& f) {
  constexpr int kFixed = fixed_head_dim<R>();
  with_flag<kFixed != 0>(head_dim == kFixed, [&](auto fixed) { f(Int<decltype(fixed)::value ? kFixed : 0>{}); });
}

template <class R>
void run_pieces(const KVStore& kv, const DecodePiece* pieces, int p0, int p1, const float* qs, int G, float* parts,
                size_t part_size, float* scratch) {
  const size_t qstride = avx512_dense_query_floats(G, kv.head_dim(), kv.type());
  if (dense_head_lanes(kv.type(), G)) {  // LRKV's kernel without latents
    Residual lanes;
    lanes.head_lanes = true;
    for (int p = p0; p < p1; ++p)
      run_piece<R, true>(kv, pieces[p], qs + pieces[p].head * qstride, G, parts + p * part_size, scratch, lanes);
    return;
  }
  with_head_dim<R>(kv.head_dim(), [&](auto dim) {
    for (int p = p0; p < p1; ++p)
      run_piece<R, false, decltype(dim)::value>(kv, pieces[p], qs + pieces[p].head * qstride, G, parts + p * part_size, scratch);
  });
}

}  // namespace

// Wherever the CPU has AVX-512 BF16 (KVX_NO_AVX512_BF16: the widened path). Not gated by vendor: on
// the one Intel machine measured the widened path was faster for LRKV and slower for dense GQA.
bool avx512_bf16_dot() {
  static const bool dot = __builtin_cpu_supports("avx512bf16") && !getenv("KVX_NO_AVX512_BF16");
  return dot;
}

bool avx512_usable() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vnni");
}

size_t avx512_query_floats(int d, KVType type) {
  switch (type) {
    case KVType::F32: return query_floats<F32Row>(d);
    case KVType::BF16: return query_floats<BF16Row>(d);
    case KVType::Q8: return query_floats<Q8Row>(d);
    case KVType::Q4: return query_floats<Q4Row>(d);
  }
  return 0;
}

// n values of x scaled (round_query: f32 scaled, bf16 also rounded) as the rows store them: f32
// as floats, bf16 packed two to a 32-bit word (the first in the low half); word i of the result
// to out[i * stride] (n even for bf16). Rounded 256 values at a time (32 a call cost a bf16
// decode call at 512 tokens ~1 us), packed 32 at a time.
namespace {
void round_words(KVType type, const float* x, int n, float scale, uint32_t* out, size_t stride) {
  constexpr int kChunk = 256;
  alignas(64) float y[kChunk];
  alignas(64) uint32_t u[kChunk];
  const bool f32 = type == KVType::F32;
  for (int i0 = 0; i0 < n; i0 += kChunk) {
    const int m = imin(kChunk, n - i0), words = f32 ? m : m / 2;
    round_query(type, x + i0, m, scale, y);
    if (f32) {
      memcpy(u, y, sizeof(float) * m);
    } else {  // rounded to bf16: the high halves, in order (past m: unused)
      for (int j = 0; j < m; j += 32) {
        const __m512i a = _mm512_castps_si512(_mm512_load_ps(y + j)), b = _mm512_castps_si512(_mm512_load_ps(y + j + 16));
        _mm256_store_si256(reinterpret_cast<__m256i*>(u + j / 2), _mm512_cvtepi32_epi16(_mm512_srli_epi32(a, 16)));
        _mm256_store_si256(reinterpret_cast<__m256i*>(u + j / 2 + 8), _mm512_cvtepi32_epi16(_mm512_srli_epi32(b, 16)));
      }
    }
    uint32_t* o = out + static_cast<size_t>(f32 ? i0 : i0 / 2) * stride;
    if (stride == 1)
      memcpy(o, u, sizeof(uint32_t) * words);
    else
      for (int i = 0; i < words; ++i) o[i * stride] = u[i];
  }
}
}  // namespace

void avx512_prepare_queries(const float* q, int heads, int d, float scale, KVType type, float* qs) {
  const size_t stride = avx512_query_floats(d, type);
  if (type == KVType::F32 || (type == KVType::BF16 && avx512_bf16_dot())) {  // F32Row; BF16Row: bf16 in natural order, head h's in the first half of its floats
    for (int h = 0; h < heads; ++h)
      round_words(type, q + static_cast<size_t>(h) * d, d, scale, reinterpret_cast<uint32_t*>(qs + h * stride), 1);
    return;
  }
  if (type == KVType::BF16) {  // BF16FmaRow: the scaled query rounded to bf16 (round_query) as floats, (even | odd) per 32 values, in place
    round_query(type, q, heads * d, scale, qs);
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    for (int h = 0; h < heads; ++h)
      for (int i = 0; i < d; i += 32) {
        float* x = qs + static_cast<size_t>(h) * d + i;
        const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
        _mm512_storeu_ps(x, _mm512_permutex2var_ps(a, even, b));
        _mm512_storeu_ps(x + 16, _mm512_permutex2var_ps(a, _mm512_add_epi32(even, _mm512_set1_epi32(1)), b));
      }
    return;
  }
  prepare_int_queries(q, heads, d, scale, type, qs);  // integer queries (decode_attention_isa.h)
}

bool avx512_head_lanes(KVType type, int heads, int r) { return head_lanes(type, heads, r); }

bool avx512_pair_values(KVType type, int G, bool lrkv) { return type == KVType::BF16 && avx512_bf16_dot() && (lrkv || G >= kPairValueQueries); }

size_t avx512_group_query_floats(int heads, int d, int r, KVType type) {
  if (head_lanes(type, heads, r)) return static_cast<size_t>(type == KVType::F32 ? 16 : 8) * d;  // QT
  return heads * avx512_query_floats(d, type);
}

// QT: word i of a K_s row's [16 lanes], lane h of head h's query, zeros past the heads.
void avx512_prepare_group_queries(const float* q, int heads, int d, int r, float scale, KVType type, float* qs) {
  if (!head_lanes(type, heads, r)) return avx512_prepare_queries(q, heads, d, scale, type, qs);
  uint32_t* w = reinterpret_cast<uint32_t*>(qs);
  memset(w, 0, sizeof(float) * avx512_group_query_floats(heads, d, r, type));
  for (int h = 0; h < heads; ++h) round_words(type, q + static_cast<size_t>(h) * d, d, scale, w + h, 16);
}

bool avx512_dense_head_lanes(KVType type, int G) { return dense_head_lanes(type, G); }

size_t avx512_dense_query_floats(int G, int d, KVType type) {
  return dense_head_lanes(type, G) ? avx512_group_query_floats(G, d, 0, type) : G * avx512_query_floats(d, type);
}

void avx512_prepare_dense_queries(const float* q, int heads, int G, int d, float scale, KVType type, float* qs) {
  if (!dense_head_lanes(type, G)) return avx512_prepare_queries(q, heads, d, scale, type, qs);
  const size_t stride = avx512_dense_query_floats(G, d, type);
  for (int h = 0; h < heads / G; ++h)
    avx512_prepare_group_queries(q + static_cast<size_t>(h) * G * d, G, d, 0, scale, type, qs + h * stride);
}

size_t avx512_latent_query_floats(int heads, int r, KVType type) {
  const bool quant = type == KVType::Q8 || type == KVType::Q4;
  if (head_lanes(type, heads, r)) return static_cast<size_t>(type == KVType::F32 ? 16 : 8) * r;  // flat, 16 heads' room
  if (r % 32 == 0) return heads * avx512_query_floats(r, type);
  if (!quant) return static_cast<size_t>(heads) * FlatLatents::head_vectors(r) * 16;
  return latent_words(type, r) ? int_query_floats(heads * r) : static_cast<size_t>(heads) * r;
}

void avx512_prepare_latent_queries(const float* qb, int heads, int r, float scale, KVType type, float* qbs) {
  const bool quant = type == KVType::Q8 || type == KVType::Q4;
  if (head_lanes(type, heads, r)) {  // head_lane_scores: the flat [heads][r] in the row's layout, zeros to 16 heads
    memset(qbs, 0, sizeof(float) * avx512_latent_query_floats(heads, r, type));
    round_words(type, qb, heads * r, scale, reinterpret_cast<uint32_t*>(qbs), 1);
  } else if (r % 32 == 0) {
    avx512_prepare_queries(qb, heads, r, scale, type, qbs);
  } else if (!quant) {  // FlatLatents: per head, its scaled (bf16: and rounded) qb at its segment's lanes of the flat row's vectors
    const int hv = FlatLatents::head_vectors(r);
    for (int h = 0; h < heads; ++h) {
      float* y = qbs + static_cast<size_t>(h) * hv * 16;
      const int off = h * r % 16;  // the segment's first lane in its first vector
      for (int i = 0; i < hv * 16; ++i) y[i] = 0.0f;
      round_query(type, qb + static_cast<size_t>(h) * r, r, scale, y + off);
    }
  } else if (latent_words(type, r)) {  // latent_word_scores: the flat [H][r] as one integer query
    prepare_int_queries(qb, 1, heads * r, scale, type, qbs);
  } else {  // latent_column_scores: qb as the reference rounds it
    round_query_blocks(qb, heads * r, scale, qbs);
  }
}

size_t avx512_scratch_floats(int G, int d, KVType type, int residual_width, bool lrkv) {
  const bool quant = type == KVType::Q8 || type == KVType::Q4;
  const int latent_blocks = (residual_width + 31) / 32;  // the most a straddling row has
  const bool by_token = latent_blocks > 0 || (lrkv ? head_lanes(type, G, residual_width / G) || quant_weights_by_token(type, G, residual_width / G)
                                                   : dense_head_lanes(type, G));
  const bool pairs = avx512_pair_values(type, G, lrkv);  // run_piece's
  const bool lanes = lrkv ? head_lanes(type, G, residual_width / G) : dense_head_lanes(type, G);
  return Scratch::floats(G, quant ? d / 32 : 0, quant ? residual_width / 32 : 0, latent_blocks, by_token, pairs,
                         lanes && type == KVType::F32 ? 16 * d : 0);
}

void avx512_run_lrkv(const KVStore& shared, const KVStore* residual, const DecodePiece* pieces, int p0, int p1,
                     const float* qs, const float* qbs, int H, float* parts, size_t part_size, float* scratch) {
  Residual res;
  if (residual) {
    res.store = residual;
    res.qb = qbs;
    res.r = residual->head_dim() / H;
  }
  res.head_lanes = head_lanes(shared.type(), H, res.r);
  auto run = [&](auto tag) {
    using R = decltype(tag);
    res.qstride = residual && res.r % 32 == 0 ? query_floats<R>(res.r) : 0;  // per head (latents of r % 32 != 0: unused)
    with_head_dim<R>(shared.head_dim(), [&](auto dim) {
      for (int p = p0; p < p1; ++p)
        run_piece<R, true, decltype(dim)::value>(shared, pieces[p], qs, H, parts + p * part_size, scratch, res);
    });
  };
  switch (shared.type()) {
    case KVType::F32: run(F32Row{}); return;
    case KVType::BF16:
      if (avx512_bf16_dot())
        run(BF16Row{});
      else
        run(BF16FmaRow{});
      return;
    case KVType::Q8: run(Q8Row{}); return;
    case KVType::Q4: run(Q4Row{}); return;
  }
}

void avx512_run_split(const KVStore& kv, const DecodePiece* pieces, int p0, int p1, const float* qs, int G, float* parts,
                      size_t part_size, float* scratch) {
  switch (kv.type()) {
    case KVType::F32: run_pieces<F32Row>(kv, pieces, p0, p1, qs, G, parts, part_size, scratch); return;
    case KVType::BF16:
      if (avx512_bf16_dot())
        run_pieces<BF16Row>(kv, pieces, p0, p1, qs, G, parts, part_size, scratch);
      else
        run_pieces<BF16FmaRow>(kv, pieces, p0, p1, qs, G, parts, part_size, scratch);
      return;
    case KVType::Q8: run_pieces<Q8Row>(kv, pieces, p0, p1, qs, G, parts, part_size, scratch); return;
    case KVType::Q4: run_pieces<Q4Row>(kv, pieces, p0, p1, qs, G, parts, part_size, scratch); return;
  }
}

}  // namespace kvx::kernels::detail

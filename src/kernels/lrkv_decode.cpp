#include "kernels/lrkv_decode.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/decode_attention_isa.h"
#include "kernels/simd_avx2.h"
#include "util/error.h"

namespace kvx::kernels {

namespace {

constexpr int kTile = 16;  // rows per online-softmax step
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Elements of the tiles the compute reads: float (f32 rows in place, q8/q4 rows dequantised) or
// bf16 (uint16_t, read in place and widened in registers).
KVX_INLINE __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
KVX_INLINE __m256 load8(const uint16_t* p) { return bf16x8_to_ps(p); }
KVX_INLINE float value(float x) { return x; }
KVX_INLINE float value(uint16_t x) { return bf16_to_float(x); }

// Rows [off, off + n) of page `page` of a one-head store as rows of E `stride` elements apart:
// f32 and bf16 rows are read in place, q8/q4 rows dequantised into `buf` (room for kTile rows).
template <class E>
const E* tile_rows(const KVStore& s, bool keys, int64_t page, int off, int n, float* buf, int& stride) {
  const size_t rb = s.row_bytes();
  const uint8_t* rows = (keys ? s.k_rows(page, 0) : s.v_rows(page, 0)) + off * rb;
  if constexpr (std::is_same_v<E, uint16_t>) {  // bf16
    stride = static_cast<int>(rb / 2);
    return reinterpret_cast<const uint16_t*>(rows);
  } else {
    if (s.type() == KVType::F32) {
      stride = static_cast<int>(rb / 4);
      return reinterpret_cast<const float*>(rows);
    }
    stride = s.head_dim();
    for (int t = 0; t < n; ++t) dequantize_row(s.type(), rows + t * rb, s.head_dim(), buf + t * stride);
    return buf;
  }
}

// Software prefetch (into L2) of slots [first, first + count) of a one-head store, K and V.
void prefetch_slots(const KVStore& s, int64_t first, int64_t count) {
  const int P = s.page_tokens();
  const size_t rb = s.row_bytes();
  for (int64_t slot = first; slot < first + count;) {
    const int64_t page = slot / P;
    const int off = static_cast<int>(slot % P);
    const int64_t n = std::min<int64_t>(first + count - slot, P - off);
    for (const uint8_t* base : {s.k_rows(page, 0), s.v_rows(page, 0)})
      for (size_t o = (off * rb) & ~size_t{63}; o < (off + n) * rb; o += 64)
        _mm_prefetch(reinterpret_cast<const char*>(base + o), _MM_HINT_T1);
    slot += n;
  }
}

// s[g][t] (+)= q_g . k_g,t for GB <= 2 queries (q rows qs apart) against the n rows of a tile, 4
// rows at a time with GB x 4 accumulators (then one transpose-add): each q chunk is loaded once
// for 4 rows. Query g reads rows k + g * kg (kg = 0: all read the shared rows; otherwise each
// head its own latents).
template <int GB, bool kAdd, class E>
void scores(const float* q, int qs, const E* k, size_t kg, int ks, int n, int w, float* s, int ss) {
  static_assert(GB == 2 || GB == 1, "groups of 2, 1");
  const int w8 = w & ~7;
  for (int t0 = 0; t0 < n; t0 += 4) {
    int tr[4];
    for (int j = 0; j < 4; ++j) tr[j] = std::min(t0 + j, n - 1);  // past the tile: the last row again
    __m256 acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
    for (int i = 0; i < w8; i += 8)
      for (int g = 0; g < GB; ++g) {
        const E* kr = k + g * kg + i;
        const __m256 qv = _mm256_loadu_ps(q + g * qs + i);
        for (int j = 0; j < 4; ++j) acc[4 * g + j] = _mm256_fmadd_ps(qv, load8(kr + tr[j] * ks), acc[4 * g + j]);
      }
    alignas(32) float x[8];
    _mm256_store_ps(x, reduce8(acc));
    for (int g = 0; g < GB; ++g)
      for (int j = 0; j < 4 && t0 + j < n; ++j) {
        const int t = t0 + j;
        float v = x[4 * g + j];
        for (int i = w8; i < w; ++i) v += q[g * qs + i] * value(k[g * kg + t * ks + i]);
        float& out = s[g * ss + t];
        out = kAdd ? out + v : v;
      }
  }
}

// acc_g += sum_t p[g][t] v_g,t over the tile for GB heads (rows v + g * vg, as above), C chunks
// of 8 at a time (GB x C accumulators held across the rows).
template <int GB, int C, class E>
void value_chunks(const float* p, int ps, const E* v, size_t vg, int vs, int n, int i, float* acc, int as) {
  __m256 a[GB][C];
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < C; ++c) a[g][c] = _mm256_loadu_ps(acc + g * as + i + 8 * c);
  for (int t = 0; t < n; ++t)
    for (int g = 0; g < GB; ++g) {
      const E* vr = v + g * vg + t * vs + i;
      const __m256 pg = _mm256_broadcast_ss(p + g * ps + t);
      for (int c = 0; c < C; ++c) a[g][c] = _mm256_fmadd_ps(pg, load8(vr + 8 * c), a[g][c]);
    }
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(acc + g * as + i + 8 * c, a[g][c]);
}

// Widths in chunks of 16, then 8 (a latent of r = 8 or 24), then one value at a time.
template <int GB, class E>
void values(const float* p, int ps, const E* v, size_t vg, int vs, int n, int w, float* acc, int as) {
  int i = 0;
  for (; i + 16 <= w; i += 16) value_chunks<GB, 2>(p, ps, v, vg, vs, n, i, acc, as);
  if (i + 8 <= w) value_chunks<GB, 1>(p, ps, v, vg, vs, n, i, acc, as), i += 8;
  for (int g = 0; g < GB; ++g)
    for (int t = 0; t < n; ++t)
      for (int j = i; j < w; ++j) acc[g * as + j] += p[g * ps + t] * value(v[g * vg + t * vs + j]);
}

template <class F>
void for_head_groups(int H, int most, F&& f) {  // groups of `most` (4 or 2), then 2, 1 heads
  for (int h0 = 0, gb; h0 < H; h0 += gb) {
    gb = H - h0 >= 4 && most >= 4 ? 4 : H - h0 >= 2 ? 2 : 1;
    f(h0, gb);
  }
}

struct Shapes {
  int H, d, r;
  size_t part() const { return static_cast<size_t>(H) * (2 + d + r); }  // m, l, acc_s, acc_r
};

// Rows [r0, r1) of all heads -> part = [m[H], l[H], acc_s[H][d], acc_r[H][r]]; E: tile_rows.
template <class E>
void run_range(const float* q, const float* qb, const Shapes& sh, const KVStore& shared, const KVStore* residual, float scale,
               int64_t r0, int64_t r1, float* part) {
  const int H = sh.H, d = sh.d, r = sh.r, P = shared.page_tokens();
  float* m = part;
  float* l = part + H;
  float* acc_s = part + 2 * H;
  float* acc_r = acc_s + static_cast<size_t>(H) * d;
  std::fill(m, m + H, kNegInf);
  std::fill(l, l + H, 0.0f);
  std::fill(acc_s, part + sh.part(), 0.0f);
  thread_local std::vector<float> kbuf, vbuf, rkbuf, rvbuf, sbuf;
  kbuf.resize(static_cast<size_t>(kTile) * d);
  vbuf.resize(kbuf.size());
  rkbuf.resize(static_cast<size_t>(kTile) * std::max(r, 1) * H);  // one tile of [H r] rows
  rvbuf.resize(rkbuf.size());
  sbuf.resize(static_cast<size_t>(H) * kTile + 8);
  float* s = sbuf.data();
  for (int64_t row = r0; row < r1;) {
    const int64_t page = row / P;
    const int off = static_cast<int>(row % P);
    const int n = static_cast<int>(std::min<int64_t>({kTile, r1 - row, P - off}));
    int kst, vst, rkst = 0, rvst = 0;
    const E* K = tile_rows<E>(shared, true, page, off, n, kbuf.data(), kst);
    const E* V = tile_rows<E>(shared, false, page, off, n, vbuf.data(), vst);
    const E* Rk = residual ? tile_rows<E>(*residual, true, page, off, n, rkbuf.data(), rkst) : nullptr;
    const E* Rv = residual ? tile_rows<E>(*residual, false, page, off, n, rvbuf.data(), rvst) : nullptr;
    const size_t rkh = r, rvh = r;  // head h's latent: columns [h r, (h + 1) r) of a row
    const int64_t ahead = std::min<int64_t>(kTile, r1 - row - n);  // the next tile, fetched while this one computes
    if (ahead > 0) {
      prefetch_slots(shared, row + n, ahead);
      if (residual) prefetch_slots(*residual, row + n, ahead);
    }
    // Scores: the shared part for all heads (K_s read once), then each head's residual part.
    for_head_groups(H, 2, [&](int h0, int gb) {
      const float* qg = q + static_cast<size_t>(h0) * d;
      float* sg = s + h0 * kTile;
      if (gb == 2)
        scores<2, false>(qg, d, K, 0, kst, n, d, sg, kTile);
      else
        scores<1, false>(qg, d, K, 0, kst, n, d, sg, kTile);
    });
    if (residual)
      for_head_groups(H, 2, [&](int h0, int gb) {
        const float* qg = qb + static_cast<size_t>(h0) * r;
        const E* kg = Rk + h0 * rkh;
        float* sg = s + h0 * kTile;
        if (gb == 2)
          scores<2, true>(qg, r, kg, rkh, rkst, n, r, sg, kTile);
        else
          scores<1, true>(qg, r, kg, rkh, rkst, n, r, sg, kTile);
      });
    // Online softmax per head: m' = max(m, max_t s); l = l e^(m - m') + sum_t e^(s - m'); acc *= e^(m - m').
    for (int h = 0; h < H; ++h) {
      float* sh_ = s + h * kTile;
      float mt = kNegInf;
      {
        const __m256 sc = _mm256_set1_ps(scale);
        __m256 mx = _mm256_set1_ps(kNegInf);
        int t = 0;
        for (; t + 8 <= n; t += 8) {
          const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(sh_ + t), sc);
          _mm256_storeu_ps(sh_ + t, x);
          mx = _mm256_max_ps(mx, x);
        }
        mt = hmax(mx);
        for (; t < n; ++t) mt = std::max(mt, sh_[t] *= scale);
      }
      if (mt > m[h]) {
        if (m[h] != kNegInf) {
          const float alpha = std::exp(m[h] - mt);
          l[h] *= alpha;
          for (int i = 0; i < d; ++i) acc_s[h * d + i] *= alpha;
          for (int i = 0; i < r; ++i) acc_r[h * r + i] *= alpha;
        }
        m[h] = mt;
      }
      const __m256 mv = _mm256_set1_ps(m[h]);
      __m256 sum = _mm256_setzero_ps();
      int t = 0;
      for (; t + 8 <= n; t += 8) {
        const __m256 p = exp256(_mm256_sub_ps(_mm256_loadu_ps(sh_ + t), mv));
        _mm256_storeu_ps(sh_ + t, p);
        sum = _mm256_add_ps(sum, p);
      }
      float tail = 0.0f;
      for (; t < n; ++t) tail += (sh_[t] = std::exp(sh_[t] - m[h]));
      l[h] += hsum(sum) + tail;
    }
    // Values: V_s for all heads (read once), then each head's R^V.
    for_head_groups(H, 4, [&](int h0, int gb) {
      const float* pg = s + h0 * kTile;
      float* ag = acc_s + static_cast<size_t>(h0) * d;
      switch (gb) {
        case 4: values<4>(pg, kTile, V, 0, vst, n, d, ag, d); break;
        case 2: values<2>(pg, kTile, V, 0, vst, n, d, ag, d); break;
        default: values<1>(pg, kTile, V, 0, vst, n, d, ag, d); break;
      }
    });
    if (residual)
      for_head_groups(H, 4, [&](int h0, int gb) {
        const float* pg = s + h0 * kTile;
        const E* vg = Rv + h0 * rvh;
        float* ag = acc_r + static_cast<size_t>(h0) * r;
        switch (gb) {
          case 4: values<4>(pg, kTile, vg, rvh, rvst, n, r, ag, r); break;
          case 2: values<2>(pg, kTile, vg, rvh, rvst, n, r, ag, r); break;
          default: values<1>(pg, kTile, vg, rvh, rvst, n, r, ag, r); break;
        }
      });
    row += n;
  }
}

void check(const float* q, const float* qb, int heads, const KVStore& shared, const KVStore* residual, const float* out_s,
           const float* out_r, const char* who) {
  const std::string w = who;
  if (!q || !out_s) throw Error(w + ": q and out_s must be non-null");
  if (heads < 1) throw Error(w + ": heads must be positive");
  if (shared.kv_heads() != 1) throw Error(w + ": the shared store must have one KV head (K_s, V_s)");
  if (shared.stored() == 0) throw Error(w + ": the cache is empty; append the current token before attending");
  if (residual) {
    if (!qb || !out_r) throw Error(w + ": qb and out_r must be non-null with a residual store");
    if (residual->kv_heads() != 1 || residual->head_dim() % heads != 0)
      throw Error(w + ": the residual store must hold one row of H r values per token (one KV head of width H r); it has " +
                  std::to_string(residual->kv_heads()) + " heads of width " + std::to_string(residual->head_dim()) +
                  " for H = " + std::to_string(heads));
    if (residual->type() != shared.type())
      throw Error(w + ": the shared and residual stores hold different cache types (" + kv_type_name(shared.type()) + ", " +
                  kv_type_name(residual->type()) + "); make both the same");
    if (residual->stored() != shared.stored() || residual->page_tokens() != shared.page_tokens())
      throw Error(w + ": the shared and residual stores hold different slots (append both for every token)");
  }
}

}  // namespace

DecodeIsa lrkv_decode_isa(DecodeIsa isa, KVType type, int head_dim, int rank) {
  const bool quant = type == KVType::Q8 || type == KVType::Q4;
  const bool wide_ok = decode_isa_usable(DecodeIsa::Avx512, head_dim) && (!quant || rank % kQBlock == 0);
  if (isa == DecodeIsa::Auto) return wide_ok ? DecodeIsa::Avx512 : DecodeIsa::Avx2;
  if (isa == DecodeIsa::Avx512 && !wide_ok)
    throw Error("LRKV decode back end avx512 needs an AVX-512 CPU, head_dim a multiple of 32 and, for q8/q4 caches, a rank that "
                "is one too (" + kv_type_name(type) + ", head_dim " + std::to_string(head_dim) + ", rank " + std::to_string(rank) +
                "); use auto or avx2");
  return isa;
}

bool lrkv_decode_quantizes_query(DecodeIsa isa, KVType type, int head_dim, int rank) {
  return lrkv_decode_isa(isa, type, head_dim, rank) == DecodeIsa::Avx512 && (type == KVType::Q8 || type == KVType::Q4);
}

void lrkv_decode_attention_splits(const float* q, const float* qb, int heads, const KVStore& shared,
                                  const KVStore* residual, float scale, float* out_s, float* out_r, int threads,
                                  int splits, DecodeIsa isa) {
  check(q, qb, heads, shared, residual, out_s, out_r, "lrkv_decode_attention");
  const Shapes sh{heads, shared.head_dim(), residual ? residual->head_dim() / heads : 0};
  const int64_t L = shared.stored();
  const int ns = static_cast<int>(std::clamp<int64_t>(splits, 1, L));
  const int T = std::max(1, threads <= 0 ? omp_get_max_threads() : threads);
  const bool wide = lrkv_decode_isa(isa, shared.type(), sh.d, sh.r) == DecodeIsa::Avx512;
  thread_local std::vector<float> parts, qs, qbs, scratch;
  thread_local std::vector<detail::DecodePiece> pieces;
  const size_t part_size = detail::slot_floats(sh.part());
  float* pp = detail::slot_aligned(parts, part_size * ns);
  if (wide) {  // queries in the AVX-512 layout, scaled; one piece (row range of the shared head) per split
    qs.resize(detail::avx512_query_floats(sh.d, shared.type()) * heads);
    detail::avx512_prepare_queries(q, heads, sh.d, scale, shared.type(), qs.data());
    if (sh.r > 0) {
      qbs.resize(detail::avx512_query_floats(sh.r, shared.type()) * heads);
      detail::avx512_prepare_queries(qb, heads, sh.r, scale, shared.type(), qbs.data());
    }
    pieces.clear();
    for (int i = 0; i < ns; ++i) pieces.push_back({0, L * i / ns, L * (i + 1) / ns});
    const size_t scratch_size = detail::slot_floats(detail::avx512_scratch_floats(heads, sh.d, shared.type(), sh.r * heads));
    float* scr = detail::slot_aligned(scratch, scratch_size * ns);
    const detail::DecodePiece* pcs = pieces.data();
    const float *qsp = qs.data(), *qbp = qbs.data();
#pragma omp parallel for num_threads(std::min(T, ns)) schedule(static) if (T > 1 && ns > 1)
    for (int i = 0; i < ns; ++i)
      detail::avx512_run_lrkv(shared, residual, pcs, i, i + 1, qsp, qbp, heads, pp, part_size, scr + i * scratch_size);
  } else {
#pragma omp parallel for num_threads(std::min(T, ns)) schedule(static) if (T > 1 && ns > 1)
    for (int i = 0; i < ns; ++i)
      if (shared.type() == KVType::BF16)
        run_range<uint16_t>(q, qb, sh, shared, residual, scale, L * i / ns, L * (i + 1) / ns, pp + i * part_size);
      else
        run_range<float>(q, qb, sh, shared, residual, scale, L * i / ns, L * (i + 1) / ns, pp + i * part_size);
  }
  // Log-sum-exp merge per head: M = max_i m_i, out = sum_i e^(m_i - M) acc_i / sum_i e^(m_i - M) l_i.
  const int H = heads, d = sh.d, r = sh.r;
  for (int h = 0; h < H; ++h) {
    float M = kNegInf;
    for (int i = 0; i < ns; ++i) M = std::max(M, pp[i * part_size + h]);
    float lsum = 0.0f;
    std::fill(out_s + static_cast<size_t>(h) * d, out_s + static_cast<size_t>(h + 1) * d, 0.0f);
    if (r > 0) std::fill(out_r + static_cast<size_t>(h) * r, out_r + static_cast<size_t>(h + 1) * r, 0.0f);
    for (int i = 0; i < ns; ++i) {
      const float* part = pp + i * part_size;
      const float e = std::exp(part[h] - M);
      lsum += e * part[H + h];
      const float* as = part + 2 * H + static_cast<size_t>(h) * d;
      const float* ar = part + 2 * H + static_cast<size_t>(H) * d + static_cast<size_t>(h) * r;
      for (int j = 0; j < d; ++j) out_s[h * d + j] += e * as[j];
      for (int j = 0; j < r; ++j) out_r[h * r + j] += e * ar[j];
    }
    const float inv = 1.0f / lsum;
    for (int j = 0; j < d; ++j) out_s[h * d + j] *= inv;
    for (int j = 0; j < r; ++j) out_r[h * r + j] *= inv;
  }
}

void lrkv_decode_attention(const float* q, const float* qb, int heads, const KVStore& shared, const KVStore* residual,
                           float scale, float* out_s, float* out_r, int threads) {
  int T = std::max(1, threads <= 0 ? omp_get_max_threads() : threads);
  constexpr int64_t kMinBytesPerThread = 256 << 10;  // below this a thread costs more than it saves
  const int64_t bytes = shared.bytes() + (residual ? residual->bytes() : 0);
  T = static_cast<int>(std::clamp<int64_t>(bytes / kMinBytesPerThread, 1, T));
  lrkv_decode_attention_splits(q, qb, heads, shared, residual, scale, out_s, out_r, T, T);
}

void lrkv_decode_attention_reference(const float* q, const float* qb, int heads, const KVStore& shared,
                                     const KVStore* residual, float scale, float* out_s, float* out_r,
                                     bool quantized_query) {
  check(q, qb, heads, shared, residual, out_s, out_r, "lrkv_decode_attention_reference");
  const int d = shared.head_dim(), r = residual ? residual->head_dim() / heads : 0;
  std::vector<float> qq, qbq;
  if (quantized_query) {  // the scaled q and qb through quantize_query_blocks; no further scaling
    auto quantize = [&](const float* x, int n, std::vector<float>& out) {
      std::vector<float> scaled(n), dq(n / kQBlock);
      std::vector<int8_t> codes(n);
      for (int i = 0; i < n; ++i) scaled[i] = x[i] * scale;
      quantize_query_blocks(scaled.data(), n, codes.data(), dq.data());
      out.resize(n);
      for (int i = 0; i < n; ++i) out[i] = static_cast<float>(codes[i]) * dq[i / kQBlock];
    };
    quantize(q, heads * d, qq);
    q = qq.data();
    if (r > 0) {
      quantize(qb, heads * r, qbq);
      qb = qbq.data();
    }
    scale = 1.0f;
  }
  const int64_t L = shared.stored();
  std::vector<float> ks(d), vs(d), rk(std::max(r * heads, 1)), rv(std::max(r * heads, 1));
  for (int h = 0; h < heads; ++h) {
    std::vector<double> s(L);
    double mx = -std::numeric_limits<double>::infinity();
    for (int64_t t = 0; t < L; ++t) {
      dequantize_row(shared.type(), shared.k_row(t, 0), d, ks.data());
      double x = 0;
      for (int i = 0; i < d; ++i) x += static_cast<double>(q[h * d + i]) * ks[i];
      if (residual) {
        dequantize_row(residual->type(), residual->k_row(t, 0), r * heads, rk.data());
        for (int i = 0; i < r; ++i) x += static_cast<double>(qb[h * r + i]) * rk[h * r + i];
      }
      s[t] = x * scale;
      mx = std::max(mx, s[t]);
    }
    std::vector<double> os(d, 0.0), orr(r, 0.0);
    double sum = 0;
    for (int64_t t = 0; t < L; ++t) {
      const double p = std::exp(s[t] - mx);
      sum += p;
      dequantize_row(shared.type(), shared.v_row(t, 0), d, vs.data());
      for (int i = 0; i < d; ++i) os[i] += p * vs[i];
      if (residual) {
        dequantize_row(residual->type(), residual->v_row(t, 0), r * heads, rv.data());
        for (int i = 0; i < r; ++i) orr[i] += p * rv[h * r + i];
      }
    }
    for (int i = 0; i < d; ++i) out_s[h * d + i] = static_cast<float>(os[i] / sum);
    for (int i = 0; i < r; ++i) out_r[h * r + i] = static_cast<float>(orr[i] / sum);
  }
}

}  // namespace kvx::kernels

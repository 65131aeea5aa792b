#include "kernels/lrkv_decode.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "kernels/decode_attention_isa.h"
#include "util/error.h"

namespace kvx::kernels {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Shapes {
  int H, d, r;
  size_t part() const { return static_cast<size_t>(H) * (2 + d + r); }  // m, l, acc_s, acc_r
};

void check(const float* q, const float* qb, int heads, const KVStore& shared, const KVStore* residual, const float* out_s,
           const float* out_r, const char* who) {
  const std::string w = who;
  if (!q || !out_s) throw Error(w + ": q and out_s must be non-null");
  if (heads < 1) throw Error(w + ": heads must be positive");
  if (shared.kv_heads() != 1) throw Error(w + ": the shared store must have one KV head (K_s, V_s)");
  if (shared.stored() == 0) throw Error(w + ": the cache is empty; append the current token before attending");
  if (shared.layout() != KVLayout::Rows && shared.type() != KVType::Q8 && shared.type() != KVType::Q4)
    throw Error(w + ": the shared store is " + kv_type_name(shared.type()) + " in the " + kv_layout_name(shared.layout()) +
                " layout, which LRKV decode does not read (q8 and q4 only); build it with decode_kv_layout(type, head_dim)");
  if (residual && residual->layout() != KVLayout::Rows)
    throw Error(w + ": the residual store is in the " + kv_layout_name(residual->layout()) +
                " layout; LRKV decode reads its latents as rows, so build it with KVLayout::Rows");
  if (residual) {
    if (!qb || !out_r) throw Error(w + ": qb and out_r must be non-null with a residual store");
    if (residual->kv_heads() != 1 || residual->head_dim() % heads != 0)
      throw Error(w + ": the residual store must hold one row of H r values per token (one KV head of width H r); it has " +
                  std::to_string(residual->kv_heads()) + " heads of width " + std::to_string(residual->head_dim()) +
                  " for H = " + std::to_string(heads));
    if (residual->type() != shared.type())
      throw Error(w + ": the shared and residual stores hold different cache types (" + kv_type_name(shared.type()) + ", " +
                  kv_type_name(residual->type()) + "); make both the same");
    const Eviction &es = shared.eviction(), &er = residual->eviction();
    if (residual->length() != shared.length() || residual->page_tokens() != shared.page_tokens() ||
        es.sink != er.sink || es.window != er.window)
      throw Error(w + ": the shared and residual stores hold different slots (lengths " + std::to_string(shared.length()) +
                  " and " + std::to_string(residual->length()) +
                  "); make them with the same page size and eviction and append both for every token");
  }
}

}  // namespace

DecodeIsa lrkv_decode_isa(DecodeIsa isa, KVType type, int head_dim, int rank) {
  const bool wide_ok = decode_isa_usable(DecodeIsa::Avx512, head_dim);
  if (isa == DecodeIsa::Auto) return wide_ok ? DecodeIsa::Avx512 : DecodeIsa::Avx2;
  if (isa == DecodeIsa::Avx512 && !wide_ok)
    throw Error("LRKV decode back end avx512 needs an AVX-512 CPU and head_dim a multiple of 32 (" + kv_type_name(type) +
                ", head_dim " + std::to_string(head_dim) + ", rank " + std::to_string(rank) + "); use auto or avx2");
  return isa;
}

bool lrkv_decode_rounds_query(DecodeIsa isa, KVType type, int head_dim, int rank) {
  lrkv_decode_isa(isa, type, head_dim, rank);  // both back ends round q and qb alike (round_query); this checks isa
  return type != KVType::F32;
}

bool lrkv_latent_scores_in_int8(DecodeIsa isa, KVType type, int rank) {
  if (type != KVType::Q8 && type != KVType::Q4) return false;
  (void)isa;  // both back ends alike
  return rank % 32 == 0 || detail::latent_segments_in_words(type, rank);
}

bool lrkv_latent_scores_in_bf16(DecodeIsa isa, KVType type, int heads, int rank) {
  if (type != KVType::BF16 || !decode_dots_bf16(isa)) return false;
  return rank % 32 == 0 || detail::avx512_head_lanes(type, heads, rank);
}

bool lrkv_rounds_value_weights(DecodeIsa isa, KVType type) { return isa == DecodeIsa::Avx512 && detail::avx512_pair_values(type, 0, true); }

void lrkv_decode_attention_splits(const float* q, const float* qb, int heads, const KVStore& shared,
                                  const KVStore* residual, float scale, float* out_s, float* out_r, int threads,
                                  int splits, DecodeIsa isa) {
  check(q, qb, heads, shared, residual, out_s, out_r, "lrkv_decode_attention");
  const Shapes sh{heads, shared.head_dim(), residual ? residual->head_dim() / heads : 0};
  const int64_t L = shared.stored();
  const int ns = static_cast<int>(std::clamp<int64_t>(splits, 1, L));
  const int T = std::max(1, threads <= 0 ? omp_get_max_threads() : threads);
  const bool wide = lrkv_decode_isa(isa, shared.type(), sh.d, sh.r) == DecodeIsa::Avx512;
  thread_local std::vector<float> parts, qbuf, qbbuf, scratch;
  thread_local std::vector<detail::DecodePiece> pieces;
  const size_t part_size = detail::slot_floats(sh.part());
  float* pp = detail::slot_aligned(parts, part_size * ns);
  pieces.clear();  // one piece (row range of the shared head) per split
  for (int i = 0; i < ns; ++i)
    pieces.push_back({0, detail::piece_cut(shared, L * i / ns, L), detail::piece_cut(shared, L * (i + 1) / ns, L)});
  const detail::DecodePiece* pcs = pieces.data();
  // Queries page-aligned (slot_aligned): no query load splits a cache line.
  const float *qsp = nullptr, *qbp = nullptr;
  if (wide) {  // queries in the AVX-512 layout, scaled
    float* qs = detail::slot_aligned(qbuf, detail::avx512_group_query_floats(heads, sh.d, sh.r, shared.type()));
    detail::avx512_prepare_group_queries(q, heads, sh.d, sh.r, scale, shared.type(), qs);
    qsp = qs;
    if (sh.r > 0) {
      float* qbs = detail::slot_aligned(qbbuf, detail::avx512_latent_query_floats(heads, sh.r, shared.type()));
      detail::avx512_prepare_latent_queries(qb, heads, sh.r, scale, shared.type(), qbs);
      qbp = qbs;
    }
    const size_t scratch_size = detail::slot_floats(detail::avx512_scratch_floats(heads, sh.d, shared.type(), sh.r * heads, true));
    float* scr = detail::slot_aligned(scratch, scratch_size * std::min(T, ns));  // per thread
#pragma omp parallel for num_threads(std::min(T, ns)) schedule(dynamic, 1) if (T > 1 && ns > 1)
    for (int i = 0; i < ns; ++i)
      detail::avx512_run_lrkv(shared, residual, pcs, i, i + 1, qsp, qbp, heads, pp, part_size,
                              scr + omp_get_thread_num() * scratch_size);
  } else {  // the same on the AVX2 machinery, in its query layout
    qsp = detail::avx2_prepare_queries(q, heads, sh.d, scale, shared.type(), qbuf);
    if (sh.r > 0) qbp = detail::avx2_prepare_latent_queries(qb, heads, sh.r, scale, shared.type(), qbbuf);
#pragma omp parallel for num_threads(std::min(T, ns)) schedule(dynamic, 1) if (T > 1 && ns > 1)
    for (int i = 0; i < ns; ++i) detail::avx2_run_lrkv(shared, residual, pcs, i, i + 1, qsp, qbp, heads, pp, part_size);
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
                           float scale, float* out_s, float* out_r, int threads, DecodeIsa isa) {
  int T = std::max(1, threads <= 0 ? omp_get_max_threads() : threads);
  constexpr int64_t kMinBytesPerThread = 256 << 10;  // below this a thread costs more than it saves
  const int64_t bytes = shared.bytes() + (residual ? residual->bytes() : 0);
  T = static_cast<int>(std::clamp<int64_t>(bytes / kMinBytesPerThread, 1, T));
  lrkv_decode_attention_splits(q, qb, heads, shared, residual, scale, out_s, out_r, T, detail::decode_splits(T), isa);
}

void lrkv_decode_attention_reference(const float* q, const float* qb, int heads, const KVStore& shared,
                                     const KVStore* residual, float scale, float* out_s, float* out_r,
                                     bool rounded_query, float* largest_weight) {
  check(q, qb, heads, shared, residual, out_s, out_r, "lrkv_decode_attention_reference");
  const int d = shared.head_dim(), r = residual ? residual->head_dim() / heads : 0;
  std::vector<float> qq, qbq;
  if (rounded_query) {  // the scaled q and qb as the kernels round them (round_query); no further scaling
    qq.resize(static_cast<size_t>(heads) * d);
    round_query(shared.type(), q, heads * d, scale, qq.data());
    q = qq.data();
    if (r > 0) {
      qbq.resize(static_cast<size_t>(heads) * r);
      round_query(residual->type(), qb, heads * r, scale, qbq.data());
      qb = qbq.data();
    }
    scale = 1.0f;
  }
  const int64_t L = shared.stored();
  std::vector<float> ks(d), vs(d), rk(std::max(r * heads, 1)), rv(std::max(r * heads, 1));
  std::vector<uint8_t> row(shared.row_bytes()), latent_row(residual ? residual->row_bytes() : 0);
  for (int h = 0; h < heads; ++h) {
    std::vector<double> s(L);
    double mx = -std::numeric_limits<double>::infinity();
    for (int64_t t = 0; t < L; ++t) {
      shared.read_k_rows(t, 1, 0, row.data());
      dequantize_row(shared.type(), row.data(), d, ks.data());
      double x = 0;
      for (int i = 0; i < d; ++i) x += static_cast<double>(q[h * d + i]) * ks[i];
      if (residual) {
        residual->read_k_rows(t, 1, 0, latent_row.data());
        dequantize_row(residual->type(), latent_row.data(), r * heads, rk.data());
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
      shared.read_v_rows(t, 1, 0, row.data());
      dequantize_row(shared.type(), row.data(), d, vs.data());
      for (int i = 0; i < d; ++i) os[i] += p * vs[i];
      if (residual) {
        residual->read_v_rows(t, 1, 0, latent_row.data());
        dequantize_row(residual->type(), latent_row.data(), r * heads, rv.data());
        for (int i = 0; i < r; ++i) orr[i] += p * rv[h * r + i];
      }
    }
    for (int i = 0; i < d; ++i) out_s[h * d + i] = static_cast<float>(os[i] / sum);
    for (int i = 0; i < r; ++i) out_r[h * r + i] = static_cast<float>(orr[i] / sum);
    if (largest_weight) largest_weight[h] = static_cast<float>(1.0 / sum);  // the max's p is 1
  }
}

}  // namespace kvx::kernels

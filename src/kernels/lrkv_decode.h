// LRKV factored decode (seed 000 Eq. 7) for one token and all H heads of a layer, over two
// stores: `shared` holds K_s, V_s (1 KV head of width d_h), `residual` holds R_h^K, R_h^V
// (H heads of width r; null when r = 0). Both stores hold the same slots.
//
//   s_h,t = scale (q_h . K_s,t + qb_h . R_h,t^K),   a_h = softmax_t(s_h),
//   out_s[h] = sum_t a_h,t V_s,t   (d_h),   out_r[h] = sum_t a_h,t R_h,t^V   (r),
// qb_h = q_h B_h^K (the caller's small product); the caller finishes o_h = out_s[h] + out_r[h] B_h^V^T.
// Historical per-head K/V are never formed: K_s and V_s are read once for all heads, the
// latents once per head.
//
// The fused kernel splits the stored rows into token ranges (threads), runs tiles of rows with an
// online softmax per head (rows dequantised to f32 in L1-sized tiles, AVX2/FMA dots), and merges
// the ranges by log-sum-exp. The reference dequantises everything and works in double.
#pragma once
#include "kernels/kv_store.h"

namespace kvx::kernels {

// q [H][d_h], qb [H][r]; out_s [H][d_h], out_r [H][r]. threads <= 0: all OpenMP threads.
void lrkv_decode_attention(const float* q, const float* qb, int heads, const KVStore& shared, const KVStore* residual,
                           float scale, float* out_s, float* out_r, int threads);
void lrkv_decode_attention_splits(const float* q, const float* qb, int heads, const KVStore& shared,
                                  const KVStore* residual, float scale, float* out_s, float* out_r, int threads,
                                  int splits);
void lrkv_decode_attention_reference(const float* q, const float* qb, int heads, const KVStore& shared,
                                     const KVStore* residual, float scale, float* out_s, float* out_r);

}  // namespace kvx::kernels

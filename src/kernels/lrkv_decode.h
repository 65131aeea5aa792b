// LRKV factored decode (seed 000 Eq. 7) for one token and all H heads of a layer, over two
// stores: `shared` holds K_s, V_s (one KV head of width d_h), `residual` holds the latents of all
// heads as one row per token, [R_0 | R_1 | ... | R_{H-1}] (one KV head of width H r, so a tile
// of tokens is one contiguous run; with r % 32 == 0 every q8/q4 block lies in one head; null
// when r = 0). Both stores hold the same slots.
//
//   s_h,t = scale (q_h . K_s,t + qb_h . R_h,t^K),   a_h = softmax_t(s_h),
//   out_s[h] = sum_t a_h,t V_s,t   (d_h),   out_r[h] = sum_t a_h,t R_h,t^V   (r),
// qb_h = q_h B_h^K (the caller's small product); the caller finishes o_h = out_s[h] + out_r[h] B_h^V^T.
// Historical per-head K/V are never formed: K_s and V_s are read once for all heads, the
// latents once per head.
//
// The fused kernel splits the stored rows into token ranges (threads), runs tiles of rows with an
// online softmax per head, and merges the ranges by log-sum-exp. Back ends as decode_attention:
// AVX-512 (the dense kernel's machinery: K_s/V_s are one KV head read for all H queries in
// groups of 4, each head's latent a 1-query pass; needs d_h a multiple of 32; q8/q4 keys are
// dotted in integers against the int8 query and qb, latents whose blocks straddle heads
// (r % 32 != 0) per head segment of a block, in integers where it is whole row words, else from
// dequantised columns; f32/bf16 latents of any r end in a masked group) or AVX2 (the dense AVX2 kernel's machinery in the same arrangement, float
// queries, f32/bf16 latent scores in 8-row blocks with all heads on each and latent values by
// whole rows; q8/q4 latents of r % 32 != 0 in integers per head segment of a block where it is whole row words, their
// values weighed from the codes as stored where every 8 values lie in one head, else dequantised per tile). The
// reference dequantises everything and works in
// double.
#pragma once
#include "kernels/decode_attention.h"
#include "kernels/kv_store.h"

namespace kvx::kernels {

// q [H][d_h], qb [H][r]; out_s [H][d_h], out_r [H][r]. threads <= 0: all OpenMP threads. As
// decode_attention: fewer threads for small caches, the work cut into detail::decode_splits pieces.
void lrkv_decode_attention(const float* q, const float* qb, int heads, const KVStore& shared, const KVStore* residual,
                           float scale, float* out_s, float* out_r, int threads, DecodeIsa isa = DecodeIsa::Auto);
// The same with exactly `splits` pieces (tests, tuning).
void lrkv_decode_attention_splits(const float* q, const float* qb, int heads, const KVStore& shared,
                                  const KVStore* residual, float scale, float* out_s, float* out_r, int threads,
                                  int splits, DecodeIsa isa = DecodeIsa::Auto);
// The back end Auto picks for this cache type and these widths (AVX-512 needs d_h % 32 == 0), and
// whether it rounds q and qb (round_query: bf16, q8, q4, on both back ends).
DecodeIsa lrkv_decode_isa(DecodeIsa isa, KVType type, int head_dim, int rank);
bool lrkv_decode_rounds_query(DecodeIsa isa, KVType type, int head_dim, int rank);
// Whether the fused kernel scores the latents of rank `rank` with int8 dot products (q8/q4: whole
// 32-value blocks per head, or head segments of whole row words; both back ends alike) rather than f32
// multiply-adds on dequantised values: what bench decode's roofline charges them at. isa: a
// resolved back end (lrkv_decode_isa).
bool lrkv_latent_scores_in_int8(DecodeIsa isa, KVType type, int rank);
// The same for bf16 dot products (bf16 caches where the back end has vdpbf16ps: decode_dots_bf16):
// latents of whole 32-value groups per head, and on AVX-512 those it scores with heads in lanes
// (8-16 heads, r = 2, 4, 8, 16, 32, 64); other bf16 latents are widened to f32.
bool lrkv_latent_scores_in_bf16(DecodeIsa isa, KVType type, int heads, int rank);
// Whether the fused kernel weighs the values with the softmax numerators rounded to bf16 (bf16
// caches on AVX-512 with vdpbf16ps: V_s rows, and the latents' where each head's are whole 32-value
// groups or the scores take heads in lanes, dotted two tokens at a time, as FlashAttention's P V
// with P in bf16). Each weight is then off by up to 2^-8 of itself, so out_s by up to
// 2^-8 sum_t a_h,t |V_s,t| and out_r by up to 2^-8 sum_t a_h,t |R^V_h,t| (the tests' bound); the
// denominators sum the unrounded numerators. isa: a resolved back end.
bool lrkv_rounds_value_weights(DecodeIsa isa, KVType type);
// largest_weight [heads], if given: as decode_attention_reference's.
void lrkv_decode_attention_reference(const float* q, const float* qb, int heads, const KVStore& shared,
                                     const KVStore* residual, float scale, float* out_s, float* out_r,
                                     bool rounded_query = false, float* largest_weight = nullptr);

}  // namespace kvx::kernels

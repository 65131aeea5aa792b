// Internal to the decode kernels: what the ISA back ends of decode_attention share.
//
// decode_attention.cpp (AVX2, the project baseline) owns the driver: work split, threads and
// the log-sum-exp merge. decode_attention_avx512.cpp is compiled with AVX-512 flags and only
// called after a run-time CPU check. It must not use std:: templates or other inline code it
// shares with the AVX2 files: the linker keeps one copy of an inline function, and an AVX-512
// copy would crash AVX2-only machines. So the AVX-512 side gets raw buffers from the driver.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kernels/kv_store.h"

namespace kvx::kernels::detail {

// KV head `head`, stored rows [r0, r1) (slots).
struct DecodePiece {
  int head;
  int64_t r0, r1;
};

// Where a split may cut the (head, row) work order, L rows a head: at item x itself, or in a
// Tiled16 store at its head's next row that starts a group of 16 (a piece then starts where the
// AVX-512 back end's token groups do; a head's end stays its end).
inline int64_t piece_cut(const KVStore& kv, int64_t x, int64_t L) {
  if (kv.layout() == KVLayout::Rows) return x;
  const int64_t h = x / L, row = (x % L + 15) / 16 * 16;
  return row >= L ? (h + 1) * L : h * L + row;
}

// Splits a call cuts its work into with `threads` threads: several a thread, handed out one at a
// time (OpenMP schedule(dynamic, 1)), so that a thread slowed by something else on its core
// (another process, the host under a VM) does less of the work instead of holding up the call (a
// static split waits for its slowest thread). With the cores to themselves, the extra splits cost
// nothing that shows. GDN decode keeps its heads on fixed threads (each head's state stays in that
// core's cache from step to step); LLA decode's items are not yet measured this way.
constexpr int kSplitsPerThread = 4;
inline int decode_splits(int threads) { return threads > 1 ? kSplitsPerThread * threads : 1; }

// Memory that threads write (per-split partial results, per-thread scratch) is cut into slots of whole
// 4 KiB pages, so that no hardware prefetcher running along one split's slot pulls in lines of
// the next one (prefetchers stop at 4 KiB pages). On this project's VM, with the two vCPUs on
// different cache domains, LRKV decode (H=16, q8, 16K) ran 599 us with adjacent partial
// results, 540 us with them 128-byte aligned and padded, and 492 us with a slot between them.
// slot_floats(n): n floats rounded up to whole pages; slot_aligned(v, n): v resized to hold n
// floats from a page boundary, which it returns.
size_t slot_floats(size_t n);
float* slot_aligned(std::vector<float>& v, size_t n);

// Integer queries (both back ends' q8/q4), int_query_floats(w) floats per head of
// width w (w % 32 == 0), nq = w / 32 blocks: [nq][8] words of 4 signed codes in the order of
// the rows' words transposed to token lanes (q8: values 4i .. 4i + 3 of the block; q4: the even
// values of word i, then the odd ones: its low and high nibbles), then [nq] int32 biases, then
// [nq] float scales. Rows are read unsigned (q8 on AVX-512: code + 128; q4: the nibble, value + 8),
// so the bias is -128 (q8) or -8 (q4) times the block's code sum (AVX2 reads q8 signed and skips
// it). Codes: quantize_query_blocks of q * scale.
size_t int_query_floats(int w);
void prepare_int_queries(const float* q, int heads, int w, float scale, KVType type, float* out);

// AVX2 back end (decode_attention.cpp), for LRKV's driver. Scaled queries in its layout: f32
// [heads][d], bf16 rounded to bf16 (round_query) in (even | odd) per whole 16 values, q8/q4 the
// integer queries; returned
// page-aligned in buf (slot_aligned), so that no query load splits a cache line (LRKV f32/bf16,
// in cache, Zen 3: 1.5-5.5% faster a call than from a plain vector's 16-byte alignment).
float* avx2_prepare_queries(const float* q, int heads, int d, float scale, KVType type, std::vector<float>& buf);
// LRKV's q8/q4 latents whose blocks straddle heads (r % 32 != 0) with each head's part of a block
// whole row words (q8: r % 4 == 0, q4: r % 8 == 0): both back ends score them in integers against
// the flat [H][r] integer query (prepare_int_queries of width H r). Baseline code: the AVX-512
// file keeps its own inline copy of the rule (see above).
bool latent_segments_in_words(KVType type, int r);
// LRKV's qb ([heads][r], for a cache of `type`) in the layout its latents are read with: their own
// type's; for q8/q4 with r % 32 != 0 (blocks straddle heads) the flat integer query, then q4's
// segment biases, where latent_segments_in_words, else f32 (rows dequantised per tile) rounded as
// the integer q is (round_query_blocks), as the reference models. Page-aligned in buf, as
// avx2_prepare_queries.
float* avx2_prepare_latent_queries(const float* qb, int heads, int r, float scale, KVType type, std::vector<float>& buf);
// LRKV factored decode on the dense kernel's machinery: pieces are row ranges of the shared store
// (head 0) for all H queries (qs, groups of 4 sharing each K_s/V_s load), f32/bf16 latents in
// 8-row blocks with every head on each (values by whole rows where they can), q8/q4 latents head
// by head; qbs from avx2_prepare_latent_queries. part p = [m[H], l[H], acc_s[H][d], acc_r[H][r]] at
// parts + p * part_size.
void avx2_run_lrkv(const KVStore& shared, const KVStore* residual, const DecodePiece* pieces, int p0, int p1,
                   const float* qs, const float* qbs, int H, float* parts, size_t part_size);

// AVX-512 back end (AVX-512 F/BW/VL/DQ/VNNI), for head_dim % 32 == 0. bf16 keys are dotted
// with vdpbf16ps where the CPU has AVX-512 BF16 (and KVX_NO_AVX512_BF16 is unset), else widened
// to fp32; either way against the query rounded to bf16 (round_query), so the results agree.
bool avx512_usable();
bool avx512_bf16_dot();  // bf16 keys by vdpbf16ps (BF16Row), else widened (BF16FmaRow)
// Queries per KV head from which the dense kernel weighs bf16 values by vdpbf16ps on row pairs, the
// numerators rounded to bf16 (LRKV does at any H); avx512_pair_values: whether a call does
// (decode_rounds_value_weights, lrkv_rounds_value_weights). At 4 queries (GQA-4) it was within the
// noise, so GQA-4 keeps fp32 weights.
constexpr int kPairValueQueries = 8;
bool avx512_pair_values(KVType type, int G, bool lrkv);
// Scaled queries in its layout, avx512_query_floats(d, type) floats per head: f32 [d]; bf16
// rounded to bf16 (round_query) and stored as bf16 in natural order in the first half (vdpbf16ps),
// or as floats in (even | odd) positions per 32 values (without AVX-512 BF16); q8/q4 quantised to
// int8 blocks (integer dot products). d % 32 == 0.
size_t avx512_query_floats(int d, KVType type);
void avx512_prepare_queries(const float* q, int heads, int d, float scale, KVType type, float* qs);
// The queries of one KV head's group (the G heads reading it; LRKV: all H on K_s, with latents of
// rank r; dense groups: r = 0): as avx512_prepare_queries, or with heads in lanes (f32, and bf16 with
// vdpbf16ps, at 8 to 16 heads and a rank that suits; see head_lanes() there) QT: per 32-bit word
// of a K row, 16 lanes of the heads' matching value (f32) or pair (bf16), zeros past the heads.
bool avx512_head_lanes(KVType type, int heads, int r);
size_t avx512_group_query_floats(int heads, int d, int r, KVType type);
void avx512_prepare_group_queries(const float* q, int heads, int d, int r, float scale, KVType type, float* qs);
// LRKV's qb in the layout avx512_run_lrkv reads: with heads in lanes, the flat [heads][r] in the
// rows' layout (f32, or packed bf16), zeros to 16 heads; else per head as avx512_prepare_queries,
// except for latents of r % 32 != 0 (blocks straddle heads). f32/bf16: per head, (r + 30) / 16 position
// vectors (its scaled qb at its segment's lanes of the flat row's 16-value vectors, zeros
// elsewhere). q8/q4: the flat [heads][r] as one integer query (prepare_int_queries) where each
// head's part of a block is whole row words (q8: r % 4 == 0, q4: r % 8 == 0), else rounded as the
// reference does (round_query_blocks), read as floats.
size_t avx512_latent_query_floats(int heads, int r, KVType type);
void avx512_prepare_latent_queries(const float* qb, int heads, int r, float scale, KVType type, float* qbs);
// Scratch floats one split needs (lrkv: for LRKV decode; residual_width: its H r, else 0).
size_t avx512_scratch_floats(int G, int d, KVType type, int residual_width = 0, bool lrkv = false);
// Dense decode's queries, per KV head its group of G (avx512_dense_query_floats(G, d, type) floats
// apart): as avx512_prepare_queries, or with heads in lanes (avx512_prepare_group_queries) for
// groups of 13 to 16 f32 heads, or 9 to 16 bf16 ones with vdpbf16ps (dense_head_lanes() there).
size_t avx512_dense_query_floats(int G, int d, KVType type);
bool avx512_dense_head_lanes(KVType type, int G);  // whether a group of G takes heads in lanes (reads K as rows)
void avx512_prepare_dense_queries(const float* q, int heads, int G, int d, float scale, KVType type, float* qs);
// Pieces [p0, p1): part p = [m[G], l[G], acc[G][d]] at parts + p * part_size (natural order); qs:
// avx512_prepare_dense_queries'.
void avx512_run_split(const KVStore& kv, const DecodePiece* pieces, int p0, int p1, const float* qs, int G,
                      float* parts, size_t part_size, float* scratch);

// LRKV factored decode (lrkv_decode.h) on the same machinery: pieces are row ranges of the
// shared store (head 0) for all H queries; qbs: avx512_prepare_latent_queries'.
// part p = [m[H], l[H], acc_s[H][d], acc_r[H][r]]. Needs d % 32 == 0.
void avx512_run_lrkv(const KVStore& shared, const KVStore* residual, const DecodePiece* pieces, int p0, int p1,
                     const float* qs, const float* qbs, int H, float* parts, size_t part_size, float* scratch);

}  // namespace kvx::kernels::detail

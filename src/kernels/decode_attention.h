// Single-query (decode-step) attention of all heads of a layer against a KVStore.
//
//   out_h = sum_j softmax_j(scale * q_h . k_j) v_j   over the stored rows j of KV head h / G,
//   G = heads / kv_heads (MHA G = 1, GQA, MQA kv_heads = 1).
//
// The fused kernel reads each K and V row once per KV head from memory, for all G query heads
// of the group (in groups of up to 4 that share each register load), and dequantises in
// registers: q8/q4 dot each 32-block in code space and scale the block sum, q . k =
// sum_b d_b (q_b . code_b) (with 4 queries, codes * d_b once per vector instead), and fold the
// V block scales into the softmax weights (bf16 and q4 unpack into permuted lanes; the query is
// permuted to match; the AVX-512 back end rounds q8/q4's to 15-bit codes, decode_weighs_values_in_int16,
// and from 8 queries a KV head bf16's numerators to bf16, decode_rounds_value_weights). It is one
// pass with an online softmax over tiles of 8-64 rows (running max m, running sum l, accumulator
// rescaled by e^(m_old - m_new)); only a tile's scores are held. The (KV head, token range) work
// is cut into `splits` chunks (decode_attention: 4 a thread) that the threads take one at a time
// (a thread slowed by another process does less of the work), and the partial (m, l, acc) of
// each chunk are merged by log-sum-exp:
//   M = max_i m_i,  out = sum_i e^(m_i - M) acc_i / sum_i e^(m_i - M) l_i.
// Software prefetch runs one tile (at least 4 KB) ahead on the K and V streams (the AVX-512 back
// end leaves f32 MHA's to the hardware prefetcher, measured faster); it also fetches the tile 3
// ahead into L2 where that measured faster (f32/bf16 with several query heads per row, f32/bf16
// LRKV). The AVX-512 back end also touches each 4 KiB page 16 KB before its stream reaches it
// (f32/bf16 dense, q8 MHA, bf16/q8 LRKV, f32 LRKV with heads in lanes: the hardware prefetchers
// stop at page ends here). Each split's partial results and each thread's scratch sit in their
// own 4 KiB pages (a prefetcher running along one thread's must not pull in another's).
// Speed on an AVX2 core with 2 FMA pipes: f32/bf16 and MHA q8/q4 are bound by memory
// bandwidth; with 4+ query heads per KV head q8/q4 are bound by FMA throughput (2 * G * d
// multiply-adds per row pair, the same as f32), so they gain less than their size ratio.
// Where the CPU has AVX-512 (and head_dim % 32 == 0) a 16-lane back end with the same
// algorithm runs instead (decode_attention_avx512.cpp), chosen at run time. Its q8/q4 scores
// put 16 tokens in the lanes (the rows transposed once for all G queries, or loaded so from a q8/q4
// store in the Tiled16 layout, decode_kv_layout, whose values come in token pairs; bf16 stores in
// that layout score the same way by vdpbf16ps) and dot the int8
// query with VNNI, so GQA/MQA and LRKV's shared keys stop being bound by the score FMAs. Its
// f32/bf16 groups of 9 to 16 query heads on one KV head (bf16; f32 from 13) score with heads in
// lanes, LRKV's kernel at r = 0 (each K row read once, no horizontal sums).
#pragma once
#include <cstdint>
#include <string>

#include "kernels/kv_store.h"

namespace kvx::kernels {

// Instruction-set back ends. Auto: AVX-512 where usable, else AVX2 (the build's baseline).
enum class DecodeIsa { Auto, Avx2, Avx512 };
std::string decode_isa_name(DecodeIsa isa);
DecodeIsa parse_decode_isa(const std::string& name);  // "auto", "avx2", "avx512"
bool decode_isa_usable(DecodeIsa isa, int head_dim);  // this CPU, this head width
DecodeIsa resolve_decode_isa(DecodeIsa isa, int head_dim);  // Auto -> the one that runs; throws if unusable

// The store layout decode (dense and LRKV's shared K_s, V_s) reads fastest with back end `isa`
// (Auto: the one that runs here): Tiled16 where the AVX-512 back end reads it (its scores load a
// group's token lanes or scales instead of transposing 16 rows or summing across lanes, its q8/q4
// values widen slot pairs stored interleaved; kv_store.h): q8, q4,
// and bf16 (with vdpbf16ps) in a dense layer of `group` = 1 to 8 query heads a KV head (the ones
// measured; 9 to 16 take heads in lanes, which read rows); else Rows. group 0: not a dense layer's store (LRKV's K_s /
// V_s: bf16 stays Rows). Stores whose rows are read as rows stay Rows: values_are_keys stores
// (MLA's latents) here, LRKV's residual latents at their call site.
KVLayout decode_kv_layout(KVType type, int head_dim, bool values_are_keys = false, DecodeIsa isa = DecodeIsa::Auto,
                          int group = 0);
// Whether dense decode with back end `isa` (resolved) reads a Tiled16 store of `type` at `group`
// query heads a KV head: q8 and q4 always; bf16 unless AVX-512 reads the group with heads in lanes, from
// rows (9+ queries with vdpbf16ps); AVX2 reads the rows copied out.
bool decode_reads_tiled16(DecodeIsa isa, KVType type, int group);

// One extra logit/value pair per query head merged into the softmax as if it were one more
// stored row (Nectar, SPEC 1.4, Eqs. 3.4-3.5: a document's log-mass alpha and content A beside the
// exact local rows): out = (e^alpha A + sum_j e^{s_j} v_j) / (e^alpha + sum_j e^{s_j}). logit
// [heads] is already in scaled-score units; value [heads][head_dim]. It joins the log-sum-exp
// merge of the pieces, so the stable form costs nothing extra per row.
struct VirtualPair {
  const float* logit = nullptr;
  const float* value = nullptr;
};

// q [heads][head_dim] (RoPE applied), out [heads][head_dim]. heads % kv_heads == 0; the store
// must hold at least one row unless `extra` is given. threads <= 0: all OpenMP threads. Short
// contexts use fewer threads than asked (parallel start-up would cost more than it saves).
void decode_attention(const float* q, int heads, const KVStore& kv, float scale, float* out, int threads,
                      DecodeIsa isa = DecodeIsa::Auto, const VirtualPair* extra = nullptr);

// The same with the work cut into exactly `splits` chunks whatever the size, on a chosen back
// end (tests, tuning, benchmarks).
void decode_attention_splits(const float* q, int heads, const KVStore& kv, float scale, float* out,
                             int threads, int splits, DecodeIsa isa = DecodeIsa::Auto, const VirtualPair* extra = nullptr);

// Whether a back end rounds the query for a cache type (round_query): both back ends dot q8/q4 keys
// in integers against the scaled query in int8 32-blocks (quantize_query_blocks, as llama.cpp
// does), and bf16 keys with the scaled query rounded to bf16 (bf16 pairs multiply exactly into
// fp32 sums: AVX-512 BF16's vdpbf16ps); either error is of the order of the cache's own on the keys.
bool decode_rounds_query(DecodeIsa isa, KVType type, int head_dim);
// Whether a resolved back end scores bf16 keys with bf16 dot products (AVX-512 BF16; the rate
// bench decode charges them at), rather than fp32 multiply-adds.
bool decode_dots_bf16(DecodeIsa isa);

// Whether a resolved back end weighs q8/q4 values in integers (AVX-512): per tile, query head and
// 32-value block, the softmax numerators (<= 1) times the rows' block scales d_t as 15-bit codes
// against the bound max_t |d_t| / 32767, summed exactly with the int8 values (q4: nibble - 8) by
// vpdpwssd (half the multiply instructions of f32). A weight is then off by up to max_t a_t max_t
// |d_t| / 65534 (a: the normalised weights), so out_i by up to that times sum_t |code_t,i| (the
// tests' bound); the denominators sum the unrounded numerators.
bool decode_weighs_values_in_int16(DecodeIsa isa, KVType type);

// Whether a resolved back end weighs bf16 values with the softmax numerators rounded to bf16, at
// `group` query heads per KV head: AVX-512 with BF16, from 8 queries a KV head (MQA, GQA of 8+,
// MLA's absorbed decode), two rows at a time by vdpbf16ps (as FlashAttention's P V with P in
// bf16; the denominators sum the unrounded numerators). A weight is then off by up to 2^-8 of
// itself, so out_i by up to 2^-8 sum_t a_t |v_t,i| (the tests' bound). At 4 queries or fewer
// the f32 multiply-adds were as fast (Zen 5, A/B in one process: 8 queries 1.07-1.17x, 16
// 1.13-1.16x, 4 0.94-1.06x, 2 0.98x).
bool decode_rounds_value_weights(DecodeIsa isa, KVType type, int group);

// Plain reference: dequantise every stored row, two-pass softmax in double. rounded_query:
// the scaled query goes through round_query for the cache's type first (what the kernels compute).
// largest_weight [heads], if given: each query head's largest softmax weight max_t a_t.
void decode_attention_reference(const float* q, int heads, const KVStore& kv, float scale, float* out,
                                bool rounded_query = false, const VirtualPair* extra = nullptr,
                                float* largest_weight = nullptr);

// Bytes the fused kernel reads from the cache per call: K and V rows of all stored tokens,
// once per KV head (= kv.bytes()).
int64_t decode_bytes_read(const KVStore& kv);

}  // namespace kvx::kernels

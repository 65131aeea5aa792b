// Single-query (decode-step) attention of all heads of a layer against a KVStore.
//
//   out_h = sum_j softmax_j(scale * q_h . k_j) v_j   over the stored rows j of KV head h / G,
//   G = heads / kv_heads (MHA G = 1, GQA, MQA kv_heads = 1).
//
// The fused kernel reads each K and V row once per KV head from memory, for all G query heads
// of the group (in groups of up to 4 that share each register load), and dequantises in
// registers: q8/q4 dot each 32-block in code space and scale the block sum, q . k =
// sum_b d_b (q_b . code_b) (with 4 queries, codes * d_b once per vector instead), and fold the
// V block scales into the softmax weights. It is one pass with an online softmax over tiles of
// 32 rows (running max m, running sum l, accumulator rescaled by e^(m_old - m_new)); the
// (KV head, token range) work is cut into `splits` chunks shared by the threads, and the
// partial (m, l, acc) of each chunk are merged by log-sum-exp:
//   M = max_i m_i,  out = sum_i e^(m_i - M) acc_i / sum_i e^(m_i - M) l_i.
// Software prefetch runs a few KB ahead on the K and V streams (tiles are read column-wise).
#pragma once
#include <cstdint>

#include "kernels/kv_store.h"

namespace kvx::kernels {

// q [heads][head_dim] (RoPE applied), out [heads][head_dim]. heads % kv_heads == 0; the store
// must hold at least one row. threads <= 0: all OpenMP threads. Short contexts use fewer
// threads than asked (parallel start-up would cost more than it saves).
void decode_attention(const float* q, int heads, const KVStore& kv, float scale, float* out, int threads);

// The same with the work cut into exactly `splits` chunks whatever the size (tests, tuning).
void decode_attention_splits(const float* q, int heads, const KVStore& kv, float scale, float* out,
                             int threads, int splits);

// Plain reference: dequantise every stored row, two-pass softmax in double.
void decode_attention_reference(const float* q, int heads, const KVStore& kv, float scale, float* out);

// Bytes the fused kernel reads from the cache per call: K and V rows of all stored tokens,
// once per KV head (= kv.bytes()).
int64_t decode_bytes_read(const KVStore& kv);

}  // namespace kvx::kernels

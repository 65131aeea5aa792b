// LLA reconstruct-on-read decode (SPEC 1.3; seed 002) for one query token of one (loop, layer),
// all H heads. The history is codes only: per token and codec group g, a key code c^K (r_k) and
// a value code c^V (r_v). Loop t reads
//
//   k^_j = R_{pos j} (W_up,t^K c^K_j + mu^K_t)         (reconstructed, then RoPE'd)
//   s_h,j = scale q_h . k^_j,   a_h = softmax_j(s_h)    (history and the exact tail together)
//   out_h = W_up,t^V (sum_j a_h,j c^V_j) + mu^V_t sum_j a_h,j + sum_tail a_h,i v_i
//
// Keys are rebuilt a tile at a time in L1 (never a materialised history) and shared by the
// query heads of their KV head; values are absorbed, so only the r_v-wide weighted code sum is
// accumulated per head and W_up^V is applied once at the end. A group is one KV head (per-head
// codec) or all KV heads of the layer (LLA-2D, one code reconstructs every head).
//
// Absorbed mode (Absorbed): the history's key part is scored in code space,
//   s_h,j = scale ((W_up,t^K^T q'_h) . c^K_j + q'_h . mu^K_t),   q' the pre-RoPE query,
// i.e. as if the reconstructed keys carried no RoPE (relative distance 0). It is exact for a
// model without RoPE on those dims (decoupled RoPE) and only an approximation for a RoPE model;
// kvx reports its fidelity separately. The tail (the chunk in flight) is always exact.
//
// Work is cut into (group, token range) items over the threads; each runs an online softmax
// per head over tiles, and the items of a head are merged by log-sum-exp.
#pragma once
#include <cstdint>
#include <vector>

namespace kvx::kernels {

// One loop's rows of one codec part of a layer, laid out for reading.
struct LlaLoopPanels {
  const float* up = nullptr;  // [groups][rank][group_rows]: W_up,t transposed
  const float* mu = nullptr;  // [groups][group_rows]
  int rank = 0;
};

// A run of stored rows and the position of its first row (rows after it are consecutive).
struct LlaSegment {
  int64_t row_begin = 0, row_end = 0, first_position = 0;
};

enum class LlaReadMode { Reconstruct, Absorbed };

struct LlaDecodeArgs {
  int heads = 0, kv_heads = 0, head_dim = 0;
  int groups = 0;  // kv_heads (per-head codec) or 1 (LLA-2D); group_rows = kv_heads / groups * head_dim
  const float* key_codes = nullptr;    // row j of group g at key_codes[g * key_group_stride + j * rank_k]
  const float* value_codes = nullptr;  // likewise with value_group_stride, rank_v
  int64_t key_group_stride = 0, value_group_stride = 0;
  std::vector<LlaSegment> history;     // rows read (none: no history)
  LlaLoopPanels keys, values;
  const double* inv_freq = nullptr;    // [head_dim / 2], RoPE "rotate half" planes (nn/layers.h)
  const float* tail_keys = nullptr;    // [tail][kv_heads][head_dim], RoPE applied
  const float* tail_values = nullptr;  // [tail][kv_heads][head_dim]
  int64_t tail = 0;
  float scale = 1.f;
  LlaReadMode mode = LlaReadMode::Reconstruct;
};

// q [heads][head_dim] RoPE'd at its position; q_pre the same before RoPE (Absorbed mode only,
// else may be null). out [heads][head_dim]. threads <= 0: all OpenMP threads. splits <= 0: chosen.
void lla_decode_attention(const LlaDecodeArgs& args, const float* q, const float* q_pre, float* out, int threads,
                          int splits = 0);

// Plain reference: reconstruct every history row in double, rotate with exact cos/sin, two-pass softmax.
void lla_decode_attention_reference(const LlaDecodeArgs& args, const float* q, const float* q_pre, float* out);

// The key reconstruction (W_up c + mu, then RoPE) the kernel runs, alone over the same history
// into a scratch tile (benchmarks: the share of kernel time spent reconstructing). Returns a
// checksum so the work is not optimised away.
double lla_reconstruct_keys_only(const LlaDecodeArgs& args, int threads);

// Bytes the kernel reads from the store per call: both codes of every history row.
int64_t lla_decode_bytes_read(const LlaDecodeArgs& args);

}  // namespace kvx::kernels

// LRKV (SPEC 1.1, seed 000): keys and values of head h are a shared projection plus a rank-r
// residual,
//   K_h = X W_s^K + (X U_h^K) B_h^K^T,   V_h = X W_s^V + (X U_h^V) B_h^V^T,
// queries stay full per head. Parameters: k_shared_proj / v_shared_proj (W_s), k_down_proj /
// v_down_proj (U_h of all heads stacked, [H r, d]), k_up / v_up (B_h^T per head, [H, r, d_h]).
//
// Training materialises the per-head K/V. The cache holds K_s, V_s (d_h per token) and the
// latents R_h^K = X U_h^K, R_h^V (r per head and token): 2 (d_h + H r) elements per token,
// 1/H + r/d_h of MHA. Decode is factored and never expands the history's V:
//   logits_h = q_h K_s^T + (q_h B_h^K) R_h^K^T,  o_h = a_h V_s + (a_h R_h^V) B_h^V^T  (seed Eq. 7).
// RoPE modes (the seed shows full RoPE does not commute with B_h in general):
//   expand        K_h = rope(K_s + R_h^K B_h^K^T): the paper's model. The cache keeps K_s and R_h^K
//                 before RoPE and decode rebuilds and rotates each head's keys: exact, same cache,
//                 O(L r d_h) extra work per head and step.
//   shared_rope   logits = rope(q_h) rope(K_s)^T + q_h (R_h^K B_h^K^T)^T: RoPE on the shared path
//                 only, the residual position-free (MLA-style split). Factored decode is exact.
//   pair_aligned  the residual lives in r/2 whole RoPE planes per head (B_h^K a fixed selection of
//                 the r/2 lowest-frequency planes; in-plane scaling is U_h's), so
//                 rope_t(z B_h) = rope~_t(z) B_h: the latent is rotated at write time and decode is
//                 factored and exact with full RoPE. B_h^K has no parameters (H r d_h fewer).
#pragma once
#include "attention/cost.h"
#include "attention/mixer.h"

namespace kvx::attention {

enum class LrkvRope { Expand, SharedRope, PairAligned };
LrkvRope parse_lrkv_rope(const std::string& name);

// The libtorch reference cache (f32): K_s, V_s [B, 1, L, d_h]; R^K, R^V [B, H, L, r], in the
// form the RoPE mode stores them (see above).
class LrkvCache : public MixerCache {
 public:
  LrkvCache(int64_t batch, int64_t heads, int64_t head_dim, int64_t rank);
  int64_t length() const override { return ks.length(); }
  int64_t bytes() const override { return static_cast<int64_t>(length() * batch_ * bytes_per_token()); }
  double bytes_per_token() const override { return 4.0 * 2 * (head_dim_ + heads_ * rank_); }
  void clear() override;
  void append_random_history(int64_t tokens, uint32_t seed) override;
  SequenceBuffer ks, vs, rk, rv;

 private:
  int64_t batch_, heads_, head_dim_, rank_;
};

// The fused decode cache (shared_rope and pair_aligned): per batch row a KVStore for K_s, V_s
// (one head of width d_h) and one for the latents (one head of width H r), f32/bf16/q8/q4, optional
// sink + window eviction; read by kernels::lrkv_decode_attention. The latents of a token are one
// row [R_0 | .. | R_{H-1}], so a tile of tokens streams as one run.
class LrkvFusedCache : public MixerCache {
 public:
  LrkvFusedCache(int64_t batch, int64_t heads, int64_t head_dim, int64_t rank, const CacheOptions& options);
  int64_t length() const override { return shared_.front().length(); }
  int64_t bytes() const override;
  double bytes_per_token() const override;
  void clear() override;
  kernels::KVStore& shared(int64_t b) { return shared_[b]; }
  kernels::KVStore* residual(int64_t b) { return residual_.empty() ? nullptr : &residual_[b]; }
  int threads() const { return threads_; }
  void append_random_history(int64_t tokens, uint32_t seed) override;

 private:
  std::vector<kernels::KVStore> shared_, residual_;
  int threads_;
};

class LrkvAttention : public Mixer {
 public:
  LrkvAttention(const model::ModelConfig& config, int layer);
  torch::Tensor forward(const torch::Tensor& x) override;
  std::unique_ptr<MixerCache> new_cache(int64_t batch, const CacheOptions& options) const override;
  torch::Tensor step(const torch::Tensor& x, MixerCache& cache) override;
  double cache_bytes_per_token(kernels::KVType type) const override { return shape_.cache_bytes(type); }
  bool head_projections(torch::Tensor& wq, torch::Tensor& wk) const override;
  // ||U_h B_h^T||_F = 0.1 ||W_s||_F for every head, separately for K and V (SPEC 1.1).
  void initialize() override;

  // The per-head keys and values materialised, from positions start..: q, k ready for
  // causal_attention (shared_rope: [rope(q), q] sqrt(2) against [rope(K_s), R B^T], so the
  // 1/sqrt(2 d_h) scaling there is 1/sqrt(d_h)), v: [B, H, T, d_h]. The training path, and what
  // factored decode must equal.
  void expanded(const torch::Tensor& x, int64_t start, torch::Tensor& q, torch::Tensor& k, torch::Tensor& v);

  LrkvRope rope_mode() const { return mode_; }
  int64_t rank() const { return rank_; }
  const nn::Rope& latent_rope() const { return latent_rope_; }  // pair_aligned: rope~ on the latent

  nn::Linear q_proj{nullptr}, k_shared_proj{nullptr}, v_shared_proj{nullptr}, k_down_proj{nullptr},
      v_down_proj{nullptr}, o_proj{nullptr};
  torch::Tensor k_up, v_up;  // [H, r, d_h]; pair_aligned: k_up a fixed 0/1 plane selection (a buffer)

 private:
  // q [B, H, T, d_h] (no RoPE), K_s, V_s [B, 1, T, d_h] (no RoPE), R^K, R^V [B, H, T, r].
  void project(const torch::Tensor& x, torch::Tensor& q, torch::Tensor& ks, torch::Tensor& vs, torch::Tensor& rk,
               torch::Tensor& rv);
  torch::Tensor merge_heads(const torch::Tensor& o);
  torch::Tensor step_fused(const torch::Tensor& x, LrkvFusedCache& cache);
  int64_t heads_, head_dim_, rank_;
  LrkvRope mode_;
  AttentionShape shape_;
  nn::Rope rope_, latent_rope_;
};

}  // namespace kvx::attention

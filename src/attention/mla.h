// MLA (SPEC 2; DeepSeek-V2's multi-head latent attention, the baseline LRKV is compared with):
// a shared latent c = x W_DKV (width d_c) and a decoupled RoPE key k_R = rope(x W_KR) (width d_R,
// shared by the heads); head h's key is [c W_UK,h^T, k_R], its value c W_UV,h^T, its query
// [q_h, rope(q_R,h)], scale 1/sqrt(d_h + d_R). Parameters in DeepSeek-V2 names: q_proj
// (H (d_h + d_R)), kv_a_proj_with_mqa (d_c + d_R: W_DKV and W_KR), kv_b_proj (per head
// [W_UK,h; W_UV,h], H 2 d_h x d_c), o_proj.
//
// The cache is one row [c | k_R] per token and layer (d_c + d_R elements). Decode is absorbed:
//   logits_h = (q_h W_UK,h) C^T + rope(q_R,h) K_R^T,   o_h = (a_h C) W_UV,h^T,
// so the history is never expanded per head. The fused path runs the dense decode kernel with
// one KV head of width d_c + d_R whose values are its keys (KVStore values_are_keys) and the H
// absorbed queries [q_h W_UK,h, rope(q_R,h)], then keeps the first d_c columns of a_h [C | K_R].
#pragma once
#include "attention/cost.h"
#include "attention/dense.h"
#include "attention/mixer.h"

namespace kvx::attention {

// The libtorch reference cache (f32): C [B, 1, L, d_c], K_R [B, 1, L, d_R] (after RoPE).
class MlaCache : public MixerCache {
 public:
  MlaCache(int64_t batch, int64_t latent, int64_t rope_dim) : batch_(batch), latent_(latent), width_(latent + rope_dim) {}
  int64_t length() const override { return c.length(); }
  int64_t bytes() const override { return static_cast<int64_t>(length() * batch_ * bytes_per_token()); }
  double bytes_per_token() const override { return 4.0 * width_; }
  void clear() override {
    c.clear();
    kr.clear();
  }
  void append_random_history(int64_t tokens, uint32_t seed) override {
    torch::manual_seed(seed);
    c.append(torch::randn({batch_, 1, tokens, latent_}));
    kr.append(torch::randn({batch_, 1, tokens, width_ - latent_}));
  }
  SequenceBuffer c, kr;

 private:
  int64_t batch_, latent_, width_;
};

class MlaAttention : public Mixer {
 public:
  MlaAttention(const model::ModelConfig& config, int layer);
  torch::Tensor forward(const torch::Tensor& x) override;
  std::unique_ptr<MixerCache> new_cache(int64_t batch, const CacheOptions& options) const override;
  torch::Tensor step(const torch::Tensor& x, MixerCache& cache) override;
  double cache_bytes_per_token(kernels::KVType type) const override { return shape_.cache_bytes(type); }
  bool head_projections(torch::Tensor& wq, torch::Tensor& wk) const override;

  nn::Linear q_proj{nullptr}, kv_a_proj_with_mqa{nullptr}, kv_b_proj{nullptr}, o_proj{nullptr};

 private:
  // q [B, H, T, d_h] (no RoPE part), qr [B, H, T, d_R] (RoPE applied), c [B, 1, T, d_c],
  // kr [B, 1, T, d_R] (RoPE applied), all from positions start..
  void project(const torch::Tensor& x, int64_t start, torch::Tensor& q, torch::Tensor& qr, torch::Tensor& c, torch::Tensor& kr);
  torch::Tensor w_uk() const;  // [H, d_h, d_c]
  torch::Tensor w_uv() const;  // [H, d_h, d_c]
  torch::Tensor merge_heads(const torch::Tensor& o);
  torch::Tensor step_fused(const torch::Tensor& x, FusedKVCache& cache);  // one [c | k_R] row per token, values are keys
  int64_t heads_, head_dim_, latent_, rope_dim_;
  AttentionShape shape_;
  nn::Rope rope_;  // over d_R
};

}  // namespace kvx::attention

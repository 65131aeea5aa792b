// Dense causal softmax attention with Hkv in {H, divisors of H, 1}: MHA, GQA, MQA.
#pragma once
#include "attention/mixer.h"

namespace kvx::attention {

// Grows by doubling its capacity, so appending a token never copies the whole history.
class DenseKVCache : public MixerCache {
 public:
  DenseKVCache(int64_t batch, int64_t kv_heads, int64_t head_dim);
  int64_t length() const override { return length_; }
  int64_t bytes() const override;
  double bytes_per_token() const override;
  void clear() override { length_ = 0; }
  void append(const torch::Tensor& k, const torch::Tensor& v);  // [B, Hkv, T, d_h] (post-RoPE keys)
  torch::Tensor keys() const;    // [B, Hkv, length, d_h] views
  torch::Tensor values() const;

 private:
  int64_t batch_, kv_heads_, head_dim_, length_ = 0;
  torch::Tensor k_, v_;  // [B, Hkv, capacity, d_h]
};

// softmax(q k^T / sqrt(d_h) + causal mask) v for q: [B, H, Tq, d_h], k, v: [B, Hkv, Tk, d_h]
// where query i sits at position q_start + i and key j at position j. Grouped: each KV head
// serves H/Hkv query heads without being copied.
torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, int64_t q_start);

class DenseAttention : public Mixer {
 public:
  DenseAttention(const model::ModelConfig& config, int layer);
  torch::Tensor forward(const torch::Tensor& x) override;
  std::unique_ptr<MixerCache> new_cache(int64_t batch) const override;
  torch::Tensor step(const torch::Tensor& x, MixerCache& cache) override;
  int64_t cache_bytes_per_token() const override;

  torch::nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};

 private:
  // q: [B, H, T, d_h], k, v: [B, Hkv, T, d_h], RoPE applied from position `start`.
  void project(const torch::Tensor& x, int64_t start, torch::Tensor& q, torch::Tensor& k, torch::Tensor& v);
  torch::Tensor merge_heads(const torch::Tensor& o);
  int64_t heads_, kv_heads_, head_dim_;
  nn::Rope rope_;
};

}  // namespace kvx::attention

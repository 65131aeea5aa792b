// Dense causal softmax attention with Hkv in {H, divisors of H, 1}: MHA, GQA, MQA.
#pragma once
#include "attention/cost.h"
#include "attention/mixer.h"

namespace kvx::attention {

class LlaLoopCache;
class NectarCache;
struct DocumentAttention;

// The libtorch reference cache (f32 tensors, SequenceBuffer storage).
class DenseKVCache : public MixerCache {
 public:
  DenseKVCache(int64_t batch, int64_t kv_heads, int64_t head_dim);
  int64_t length() const override { return k_.length(); }
  int64_t bytes() const override;
  double bytes_per_token() const override;
  void clear() override {
    k_.clear();
    v_.clear();
  }
  void append(const torch::Tensor& k, const torch::Tensor& v);  // [B, Hkv, T, d_h] (post-RoPE keys)
  void append_random_history(int64_t tokens, uint32_t seed) override;
  torch::Tensor keys() const { return k_.view(); }              // [B, Hkv, length, d_h]
  torch::Tensor values() const { return v_.view(); }

 private:
  int64_t batch_, kv_heads_, head_dim_;
  SequenceBuffer k_, v_;
};

// Cross-layer KV sharing (CLA, posthoc): a layer with this cache keeps no K/V of its own and reads
// the K/V its source layer (the one before it in the same loop, stepped first) has appended,
// with its own queries. Holds no bytes.
class SharedKVCache : public MixerCache {
 public:
  explicit SharedKVCache(const DenseKVCache* source) : source_(source) {}
  int64_t length() const override { return length_; }
  int64_t bytes() const override { return 0; }
  double bytes_per_token() const override { return 0.0; }
  void clear() override { length_ = 0; }
  void append_random_history(int64_t tokens, uint32_t seed) override {
    (void)seed;
    length_ += tokens;
  }
  const DenseKVCache& source() const { return *source_; }
  void advance(int64_t tokens) { length_ += tokens; }

 private:
  const DenseKVCache* source_;
  int64_t length_ = 0;
};

// The fused decode cache: one torch-free kernels::KVStore per batch row (paged, f32/bf16/q8/q4,
// optional sink + window eviction), read by kernels::decode_attention. values_are_keys: one row
// per token serves as key and value (MLA's latent). group: query heads per KV head of the layer
// reading it, for the store layout (kernels::decode_kv_layout).
class FusedKVCache : public MixerCache {
 public:
  FusedKVCache(int64_t batch, int64_t kv_heads, int64_t head_dim, const CacheOptions& options, bool values_are_keys = false,
               int64_t group = 0);
  int64_t length() const override { return stores_.front().length(); }
  int64_t bytes() const override;
  double bytes_per_token() const override { return stores_.front().bytes_per_token(); }
  void clear() override;
  void truncate(int64_t length);  // drop the tokens past `length` (a reused prefix: back to the prefix)
  kernels::KVStore& store(int64_t b) { return stores_[b]; }
  int threads() const { return threads_; }
  void append_random_history(int64_t tokens, uint32_t seed) override;

 private:
  std::vector<kernels::KVStore> stores_;
  int threads_;
};

// softmax(q k^T / sqrt(w) + causal mask) v for q, k: [B, H or Hkv, T, w], v: [B, Hkv, Tk, d_v]
// where query i sits at position q_start + i and key j at position j. Grouped: each KV head
// serves H/Hkv query heads without being copied.
torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, int64_t q_start);

class DenseAttention : public Mixer {
 public:
  DenseAttention(const model::ModelConfig& config, int layer);
  torch::Tensor forward(const torch::Tensor& x) override;
  std::unique_ptr<MixerCache> new_cache(int64_t batch, const CacheOptions& options) const override;
  torch::Tensor step(const torch::Tensor& x, MixerCache& cache) override;
  double cache_bytes_per_token(kernels::KVType type) const override;
  bool head_projections(torch::Tensor& wq, torch::Tensor& wk) const override;
  // Queries before RoPE, [B, H, T, d_h].
  torch::Tensor queries_pre_rope(const torch::Tensor& x);
  // Keys before RoPE and values, [B, Hkv, T, d_h] (what a latent KV codec compresses).
  std::pair<torch::Tensor, torch::Tensor> keys_values_pre_rope(const torch::Tensor& x);
  // Causal attention where query i reads its own exact key and value and, for j < i, the given
  // history (pre-RoPE keys, values [B, Hkv, T, d_h]): decode through a latent store with the
  // history reconstructed (LLA distillation). Differentiable in the history.
  torch::Tensor forward_with_history(const torch::Tensor& x, const torch::Tensor& history_keys, const torch::Tensor& history_values);
  // Nectar: x [B, T, d] at positions offset .. offset + T - 1 after a document whose response to
  // this layer's rotated queries [B, H, T, d_h] `document` gives (exact, or a module's); causal
  // local attention composed with it (attention/nectar.h). Differentiable.
  torch::Tensor forward_after_document(const torch::Tensor& x, int64_t offset,
                                       const std::function<DocumentAttention(const torch::Tensor&)>& document);

  nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
  nn::RMSNorm q_norm{nullptr}, k_norm{nullptr};  // Qwen3 (config qk_norm): over each head's d_h before RoPE

 private:
  // q: [B, H, T, d_h], k, v: [B, Hkv, T, d_h], RoPE applied from position `start`.
  void project(const torch::Tensor& x, int64_t start, torch::Tensor& q, torch::Tensor& k, torch::Tensor& v);
  torch::Tensor merge_heads(const torch::Tensor& o);
  // Token by token: append the token's K/V, then attend with the fused kernel (SPEC 3).
  // With `document`, its pair [B, H, T] / [B, H, T, d_h] joins each read (Nectar).
  torch::Tensor step_fused(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, FusedKVCache& cache,
                           const DocumentAttention* document = nullptr);
  torch::Tensor step_after_document(const torch::Tensor& x, NectarCache& cache);
  // History stored as LLA codes (attention/lla.h).
  torch::Tensor step_lla(const torch::Tensor& x, LlaLoopCache& cache);
  int layer_;
  int64_t heads_, kv_heads_, head_dim_;
  AttentionShape shape_;
  nn::Rope rope_;
};

}  // namespace kvx::attention

#include "attention/dense.h"

#include <cmath>

#include "attention/lla.h"
#include "attention/nectar.h"
#include "kernels/decode_attention.h"
#include "util/error.h"

namespace kvx::attention {

DenseKVCache::DenseKVCache(int64_t batch, int64_t kv_heads, int64_t head_dim)
    : batch_(batch), kv_heads_(kv_heads), head_dim_(head_dim) {}

int64_t DenseKVCache::bytes() const { return length() * batch_ * kv_heads_ * head_dim_ * 2 * 4; }
double DenseKVCache::bytes_per_token() const { return static_cast<double>(kv_heads_ * head_dim_ * 2 * 4); }

void DenseKVCache::append(const torch::Tensor& k, const torch::Tensor& v) {
  k_.append(k);
  v_.append(v);
}

void DenseKVCache::append_random_history(int64_t tokens, uint32_t seed) {
  torch::manual_seed(seed);
  append(torch::randn({batch_, kv_heads_, tokens, head_dim_}), torch::randn({batch_, kv_heads_, tokens, head_dim_}));
}

void FusedKVCache::append_random_history(int64_t tokens, uint32_t seed) {
  for (auto& s : stores_) kernels::append_random_rows(s, tokens, seed++);
}

FusedKVCache::FusedKVCache(int64_t batch, int64_t kv_heads, int64_t head_dim, const CacheOptions& o, bool values_are_keys,
                           int64_t group)
    : threads_(o.threads > 0 ? o.threads : torch::get_num_threads()) {
  if (batch < 1) throw Error("a KV cache needs a batch of at least 1 sequence, got " + std::to_string(batch));
  stores_.reserve(batch);
  for (int64_t b = 0; b < batch; ++b)
    stores_.emplace_back(o.type, static_cast<int>(kv_heads), static_cast<int>(head_dim), o.evict, 256, values_are_keys,
                         kernels::decode_kv_layout(o.type, static_cast<int>(head_dim), values_are_keys, kernels::DecodeIsa::Auto,
                                                   static_cast<int>(group)));
}

int64_t FusedKVCache::bytes() const {
  int64_t n = 0;
  for (const auto& s : stores_) n += s.bytes();
  return n;
}

void FusedKVCache::clear() {
  for (auto& s : stores_) s.clear();
}

void FusedKVCache::truncate(int64_t length) {
  for (auto& s : stores_) s.truncate(length);
}

torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, int64_t q_start) {
  const int64_t B = q.size(0), H = q.size(1), Tq = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), Tk = k.size(2), G = H / Hkv;
  // Group query heads by their KV head: [B, Hkv, G*Tq, d_h], so K/V are read as they are.
  auto qg = q.reshape({B, Hkv, G * Tq, D});
  auto scores = torch::matmul(qg, k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(D)));
  auto probs = causal_softmax(scores.view({B, Hkv, G, Tq, Tk}), q_start).view({B, Hkv, G * Tq, Tk});
  return torch::matmul(probs, v).view({B, H, Tq, v.size(3)});
}

DenseAttention::DenseAttention(const model::ModelConfig& c, int layer)
    : layer_(layer), heads_(c.num_attention_heads), kv_heads_(c.num_key_value_heads), head_dim_(c.head_dim),
      shape_(AttentionShape::of_layer(c, "dense")), rope_(c.head_dim, c.rope_theta) {
  q_proj = register_module("q_proj", nn::linear_no_bias(c.hidden_size, heads_ * head_dim_));
  k_proj = register_module("k_proj", nn::linear_no_bias(c.hidden_size, kv_heads_ * head_dim_));
  v_proj = register_module("v_proj", nn::linear_no_bias(c.hidden_size, kv_heads_ * head_dim_));
  o_proj = register_module("o_proj", nn::linear_no_bias(heads_ * head_dim_, c.hidden_size));
  if (c.qk_norm) {
    q_norm = register_module("q_norm", nn::RMSNorm(head_dim_, c.rms_norm_eps));
    k_norm = register_module("k_norm", nn::RMSNorm(head_dim_, c.rms_norm_eps));
  }
}

torch::Tensor DenseAttention::queries_pre_rope(const torch::Tensor& x) {
  const int64_t B = x.size(0), T = x.size(1);
  auto q = q_proj(x).view({B, T, heads_, head_dim_});
  if (q_norm) q = q_norm(q);
  return q.transpose(1, 2);
}

std::pair<torch::Tensor, torch::Tensor> DenseAttention::keys_values_pre_rope(const torch::Tensor& x) {
  const int64_t B = x.size(0), T = x.size(1);
  auto k = k_proj(x).view({B, T, kv_heads_, head_dim_});
  if (k_norm) k = k_norm(k);
  return {k.transpose(1, 2), v_proj(x).view({B, T, kv_heads_, head_dim_}).transpose(1, 2)};
}

void DenseAttention::project(const torch::Tensor& x, int64_t start, torch::Tensor& q, torch::Tensor& k, torch::Tensor& v) {
  q = rope_.apply(queries_pre_rope(x), start);
  std::tie(k, v) = keys_values_pre_rope(x);
  k = rope_.apply(k, start);
}

torch::Tensor DenseAttention::merge_heads(const torch::Tensor& o) {
  const int64_t B = o.size(0), T = o.size(2);
  return o_proj(o.transpose(1, 2).reshape({B, T, heads_ * head_dim_}));
}

torch::Tensor DenseAttention::forward(const torch::Tensor& x) {
  torch::Tensor q, k, v;
  project(x, 0, q, k, v);
  return merge_heads(causal_attention(q, k, v, 0));
}

torch::Tensor DenseAttention::forward_with_history(const torch::Tensor& x, const torch::Tensor& history_keys,
                                                   const torch::Tensor& history_values) {
  torch::Tensor q, k, v;
  project(x, 0, q, k, v);
  const int64_t group = heads_ / kv_heads_, T = x.size(1);
  const auto per_head = [&](const torch::Tensor& t) { return t.repeat_interleave(group, 1); };  // [B, H, T, d_h]
  const auto kh = per_head(rope_.apply(history_keys.to(q.scalar_type()), 0)), vh = per_head(history_values.to(q.scalar_type()));
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim_));
  const auto earlier = torch::ones({T, T}, torch::dtype(torch::kBool)).tril(-1);
  const auto hist = (torch::matmul(q, kh.transpose(-1, -2)) * scale).masked_fill(earlier.logical_not(), -INFINITY);
  const auto self = (q * per_head(k)).sum(-1, true) * scale;  // [B, H, T, 1]
  const auto a = torch::softmax(torch::cat({hist, self}, -1), -1);
  const auto out = torch::matmul(a.narrow(-1, 0, T), vh) + a.narrow(-1, T, 1) * per_head(v);
  return merge_heads(out);
}

std::unique_ptr<MixerCache> DenseAttention::new_cache(int64_t batch, const CacheOptions& options) const {
  std::unique_ptr<MixerCache> cache;
  if (options.reference)
    cache = std::make_unique<DenseKVCache>(batch, kv_heads_, head_dim_);
  else
    cache = std::make_unique<FusedKVCache>(batch, kv_heads_, head_dim_, options, false, heads_ / kv_heads_);
  if (!options.document) return cache;
  const auto& doc = *options.document;
  if (layer_ >= static_cast<int>(doc.layers.size()))
    throw Error("the Nectar document module has " + std::to_string(doc.layers.size()) + " layers; layer " +
                std::to_string(layer_) + " has none (a module fitted for another model?)");
  return std::make_unique<NectarCache>(std::move(cache), doc.layers[layer_], doc.tokens);
}

torch::Tensor DenseAttention::step(const torch::Tensor& x, MixerCache& cache) {
  if (auto* lla = dynamic_cast<LlaLoopCache*>(&cache)) return step_lla(x, *lla);
  if (auto* nectar = dynamic_cast<NectarCache*>(&cache)) return step_after_document(x, *nectar);
  const int64_t start = cache.length();
  torch::Tensor q, k, v;
  project(x, start, q, k, v);
  if (auto* fused = dynamic_cast<FusedKVCache*>(&cache)) return merge_heads(step_fused(q, k, v, *fused));
  if (auto* shared = dynamic_cast<SharedKVCache*>(&cache)) {  // CLA: the source layer's K/V, these queries
    const auto& src = shared->source();
    if (src.length() != start + x.size(1))
      throw Error("CLA: the source layer holds " + std::to_string(src.length()) + " tokens but this layer is at " +
                  std::to_string(start + x.size(1)) + "; the source layer must step first in each loop");
    shared->advance(x.size(1));
    return merge_heads(causal_attention(q, src.keys(), src.values(), start));
  }
  auto* kv = dynamic_cast<DenseKVCache*>(&cache);
  if (!kv) throw Error("DenseAttention::step: the cache was not made by a dense layer (layer/cache mismatch)");
  kv->append(k.contiguous(), v.contiguous());
  return merge_heads(causal_attention(q, kv->keys(), kv->values(), start));
}

torch::Tensor DenseAttention::step_lla(const torch::Tensor& x, LlaLoopCache& cache) {
  // The chunk's own K/V are exact; the history is loop t's reconstruction, rotated after it.
  const int64_t start = cache.length(), T = x.size(1);
  auto& store = cache.store();
  if (store.committed() != start)
    throw Error("LLA decode: loop " + std::to_string(cache.loop()) + " is at position " + std::to_string(start) + " but " +
                std::to_string(store.committed()) + " tokens are committed; a chunk must run all loops before the next");
  const auto q_pre = queries_pre_rope(x);
  auto q = rope_.apply(q_pre, start);
  auto [k, v] = keys_values_pre_rope(x);
  store.set_pending(cache.loop(), k, v);
  k = rope_.apply(k, start);
  torch::Tensor out;
  if (!store.reference()) {
    out = merge_heads(store.attend(cache.loop(), q, q_pre, k, v, rope_.inv_freq()));
  } else {
    auto [hk, hv] = store.history(cache.loop());
    if (hk.defined()) {
      k = torch::cat({rope_.apply(hk.to(k.scalar_type()), 0), k}, 2);
      v = torch::cat({hv.to(v.scalar_type()), v}, 2);
    }
    out = merge_heads(causal_attention(q, k, v, start));
  }
  cache.advance(T);
  if (cache.last_loop()) store.commit();
  return out;
}

torch::Tensor DenseAttention::forward_after_document(const torch::Tensor& x, int64_t offset,
                                                     const std::function<DocumentAttention(const torch::Tensor&)>& document) {
  torch::Tensor q, k, v;
  project(x, offset, q, k, v);
  return merge_heads(compose_document_attention(q, k, v, 0, document(q)));
}

torch::Tensor DenseAttention::step_after_document(const torch::Tensor& x, NectarCache& cache) {
  const int64_t start = cache.length();
  torch::Tensor q, k, v;
  project(x, start, q, k, v);
  const auto doc = cache.module().forward(q);
  if (auto* fused = dynamic_cast<FusedKVCache*>(&cache.local())) return merge_heads(step_fused(q, k, v, *fused, &doc));
  auto* kv = dynamic_cast<DenseKVCache*>(&cache.local());
  if (!kv) throw Error("Nectar decode: the local cache must be a dense layer's");
  kv->append(k.contiguous(), v.contiguous());
  return merge_heads(compose_document_attention(q, kv->keys(), kv->values(), start - cache.offset(), doc));
}

torch::Tensor DenseAttention::step_fused(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                         FusedKVCache& cache, const DocumentAttention* document) {
  // [B, heads, T, d_h] -> [B, T, heads, d_h] float32, contiguous rows per token.
  auto qt = token_major_f32(q), kt = token_major_f32(k), vt = token_major_f32(v);
  torch::Tensor doc_logit, doc_value;  // [B, T, heads] and [B, T, heads, d_h]
  if (document) {
    doc_logit = token_major_f32(document->log_mass.detach());
    doc_value = token_major_f32(document->content.detach());
  }
  const int64_t B = qt.size(0), T = qt.size(1);
  auto out = torch::empty_like(qt);
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim_)));
  const int64_t q_row = heads_ * head_dim_, kv_row = kv_heads_ * head_dim_;
  for (int64_t b = 0; b < B; ++b) {
    auto& store = cache.store(b);
    for (int64_t t = 0; t < T; ++t) {
      store.append(kt.data_ptr<float>() + (b * T + t) * kv_row, vt.data_ptr<float>() + (b * T + t) * kv_row);
      kernels::VirtualPair pair;
      if (document) pair = {doc_logit.data_ptr<float>() + (b * T + t) * heads_, doc_value.data_ptr<float>() + (b * T + t) * q_row};
      kernels::decode_attention(qt.data_ptr<float>() + (b * T + t) * q_row, static_cast<int>(heads_), store, scale,
                                out.data_ptr<float>() + (b * T + t) * q_row, cache.threads(), kernels::DecodeIsa::Auto,
                                document ? &pair : nullptr);
    }
  }
  return out.to(q.scalar_type()).transpose(1, 2);
}

bool DenseAttention::head_projections(torch::Tensor& wq, torch::Tensor& wk) const {
  if (q_norm) return false;  // normed queries and keys: no fixed bilinear form per head
  const int64_t d = q_proj->weight.size(1);
  wq = q_proj->weight.detach().view({heads_, head_dim_, d}).transpose(1, 2);  // [H, d, d_h]
  wk = k_proj->weight.detach().view({kv_heads_, head_dim_, d}).transpose(1, 2).repeat_interleave(heads_ / kv_heads_, 0);
  return true;
}

double DenseAttention::cache_bytes_per_token(kernels::KVType type) const { return shape_.cache_bytes(type); }

}  // namespace kvx::attention

#include "attention/mla.h"

#include <cmath>

#include "attention/dense.h"
#include "kernels/decode_attention.h"
#include "util/error.h"

namespace kvx::attention {

MlaAttention::MlaAttention(const model::ModelConfig& c, int layer)
    : heads_(c.num_attention_heads), head_dim_(c.head_dim), latent_(c.kv_lora_rank), rope_dim_(c.qk_rope_head_dim),
      shape_(AttentionShape::of_layer(c, "mla")), rope_(c.qk_rope_head_dim, c.rope_theta) {
  (void)layer;
  const int64_t d = c.hidden_size;
  q_proj = register_module("q_proj", nn::linear_no_bias(d, heads_ * (head_dim_ + rope_dim_)));
  kv_a_proj_with_mqa = register_module("kv_a_proj_with_mqa", nn::linear_no_bias(d, latent_ + rope_dim_));
  kv_b_proj = register_module("kv_b_proj", nn::linear_no_bias(latent_, heads_ * 2 * head_dim_));
  o_proj = register_module("o_proj", nn::linear_no_bias(heads_ * head_dim_, d));
}

torch::Tensor MlaAttention::w_uk() const { return kv_b_proj->weight.view({heads_, 2 * head_dim_, latent_}).narrow(1, 0, head_dim_); }
torch::Tensor MlaAttention::w_uv() const {
  return kv_b_proj->weight.view({heads_, 2 * head_dim_, latent_}).narrow(1, head_dim_, head_dim_);
}

void MlaAttention::project(const torch::Tensor& x, int64_t start, torch::Tensor& q, torch::Tensor& qr, torch::Tensor& c,
                           torch::Tensor& kr) {
  const int64_t B = x.size(0), T = x.size(1);
  auto qa = q_proj(x).view({B, T, heads_, head_dim_ + rope_dim_}).transpose(1, 2);
  q = qa.narrow(-1, 0, head_dim_);
  qr = rope_.apply(qa.narrow(-1, head_dim_, rope_dim_), start);
  auto ckv = kv_a_proj_with_mqa(x).view({B, T, 1, latent_ + rope_dim_}).transpose(1, 2);
  c = ckv.narrow(-1, 0, latent_);
  kr = rope_.apply(ckv.narrow(-1, latent_, rope_dim_), start);
}

torch::Tensor MlaAttention::merge_heads(const torch::Tensor& o) {
  const int64_t B = o.size(0), T = o.size(2);
  return o_proj(o.transpose(1, 2).reshape({B, T, heads_ * head_dim_}));
}

torch::Tensor MlaAttention::forward(const torch::Tensor& x) {
  // Training: expand every head's key and value from the latent.
  torch::Tensor q, qr, c, kr;
  project(x, 0, q, qr, c, kr);
  const int64_t B = x.size(0), T = x.size(1);
  auto kv = kv_b_proj(c.squeeze(1)).view({B, T, heads_, 2 * head_dim_}).transpose(1, 2);
  auto k = torch::cat({kv.narrow(-1, 0, head_dim_), kr.expand({B, heads_, T, rope_dim_})}, -1);
  auto v = kv.narrow(-1, head_dim_, head_dim_);
  return merge_heads(causal_attention(torch::cat({q, qr}, -1), k, v, 0));  // scale 1/sqrt(d_h + d_R)
}

std::unique_ptr<MixerCache> MlaAttention::new_cache(int64_t batch, const CacheOptions& options) const {
  if (options.reference) return std::make_unique<MlaCache>(batch, latent_, rope_dim_);
  return std::make_unique<FusedKVCache>(batch, 1, latent_ + rope_dim_, options, true);
}

torch::Tensor MlaAttention::step(const torch::Tensor& x, MixerCache& cache_base) {
  if (auto* fused = dynamic_cast<FusedKVCache*>(&cache_base)) return step_fused(x, *fused);
  auto* cache = dynamic_cast<MlaCache*>(&cache_base);
  if (!cache) throw Error("MlaAttention::step: the cache was not made by an MLA layer (layer/cache mismatch)");
  const int64_t start = cache->length();
  torch::Tensor q, qr, c, kr;
  project(x, start, q, qr, c, kr);
  cache->c.append(c.contiguous());
  cache->kr.append(kr.contiguous());
  const auto C = cache->c.view(), KR = cache->kr.view();
  // Absorbed: (q_h W_UK,h) C^T + rope(q_R,h) K_R^T, then (a_h C) W_UV,h^T.
  auto q_abs = torch::matmul(q, w_uk());  // [B, H, T, d_h] @ [H, d_h, d_c]
  auto scores = torch::matmul(q_abs, C.transpose(-2, -1)) + torch::matmul(qr, KR.transpose(-2, -1));
  auto a = causal_softmax(scores * (1.0 / std::sqrt(static_cast<double>(head_dim_ + rope_dim_))), start);
  return merge_heads(torch::matmul(torch::matmul(a, C), w_uv().transpose(-2, -1)));
}

torch::Tensor MlaAttention::step_fused(const torch::Tensor& x, FusedKVCache& cache) {
  const int64_t start = cache.length(), B = x.size(0), T = x.size(1), H = heads_, W = latent_ + rope_dim_;
  torch::Tensor q, qr, c, kr;
  project(x, start, q, qr, c, kr);
  // Rows [c | k_R] per token; queries [q_h W_UK,h | rope(q_R,h)] per head.
  auto rows = token_major_f32(torch::cat({c, kr}, -1));              // [B, T, 1, W]
  auto qa = token_major_f32(torch::cat({torch::matmul(q, w_uk()), qr}, -1));  // [B, T, H, W]
  auto out = torch::empty({B, T, H, W}, torch::kFloat32);
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim_ + rope_dim_)));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t i = b * T + t;
      cache.store(b).append(rows.data_ptr<float>() + i * W, nullptr);
      kernels::decode_attention(qa.data_ptr<float>() + i * H * W, static_cast<int>(H), cache.store(b), scale,
                                out.data_ptr<float>() + i * H * W, cache.threads());
    }
  auto ac = out.narrow(-1, 0, latent_).to(x.scalar_type()).transpose(1, 2);  // a_h C: [B, H, T, d_c]
  return merge_heads(torch::matmul(ac, w_uv().transpose(-2, -1)));
}

bool MlaAttention::head_projections(torch::Tensor& wq, torch::Tensor& wk) const {
  // Key of head h from x: [x W_DKV W_UK,h^T, x W_KR] -> W_k,h = [W_DKV^T W_UK,h^T | W_KR^T]: [d, d_h + d_R].
  const int64_t d = q_proj->weight.size(1);
  wq = q_proj->weight.detach().view({heads_, head_dim_ + rope_dim_, d}).transpose(1, 2);
  auto a = kv_a_proj_with_mqa->weight.detach();  // [d_c + d_R, d]
  auto nope = torch::matmul(a.narrow(0, 0, latent_).t(), w_uk().detach().transpose(1, 2));  // [H, d, d_h]
  auto rope = a.narrow(0, latent_, rope_dim_).t().unsqueeze(0).expand({heads_, d, rope_dim_});
  wk = torch::cat({nope, rope}, -1);
  return true;
}

}  // namespace kvx::attention

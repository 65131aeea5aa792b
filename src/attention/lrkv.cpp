#include "attention/lrkv.h"

#include <cmath>

#include "attention/dense.h"
#include "kernels/lrkv_decode.h"
#include "util/error.h"

namespace kvx::attention {

namespace {

// pair_aligned: the r/2 lowest-frequency RoPE planes (rotate-half plane j = dims j, j + d_h/2).
std::vector<int64_t> residual_planes(int64_t head_dim, int64_t rank) {
  std::vector<int64_t> planes;
  for (int64_t m = 0; m < rank / 2; ++m) planes.push_back(head_dim / 2 - rank / 2 + m);
  return planes;
}

}  // namespace

LrkvRope parse_lrkv_rope(const std::string& name) {
  if (name == "expand") return LrkvRope::Expand;
  if (name == "shared_rope") return LrkvRope::SharedRope;
  if (name == "pair_aligned") return LrkvRope::PairAligned;
  throw Error("lrkv_rope '" + name + "' is not one of expand, shared_rope, pair_aligned");
}

LrkvCache::LrkvCache(int64_t batch, int64_t heads, int64_t head_dim, int64_t rank)
    : batch_(batch), heads_(heads), head_dim_(head_dim), rank_(rank) {}

void LrkvCache::clear() {
  ks.clear();
  vs.clear();
  rk.clear();
  rv.clear();
}

LrkvFusedCache::LrkvFusedCache(int64_t batch, int64_t heads, int64_t head_dim, int64_t rank, const CacheOptions& o)
    : threads_(o.threads > 0 ? o.threads : torch::get_num_threads()) {
  for (int64_t b = 0; b < batch; ++b) {
    shared_.emplace_back(o.type, 1, static_cast<int>(head_dim), o.evict, 256, false,
                         kernels::decode_kv_layout(o.type, static_cast<int>(head_dim)));
    if (rank > 0) residual_.emplace_back(o.type, 1, static_cast<int>(heads * rank), o.evict);  // [R_0 | .. | R_{H-1}] per token
  }
}

void LrkvCache::append_random_history(int64_t tokens, uint32_t seed) {
  torch::manual_seed(seed);
  ks.append(torch::randn({batch_, 1, tokens, head_dim_}));
  vs.append(torch::randn({batch_, 1, tokens, head_dim_}));
  rk.append(torch::randn({batch_, heads_, tokens, rank_}));
  rv.append(torch::randn({batch_, heads_, tokens, rank_}));
}

void LrkvFusedCache::append_random_history(int64_t tokens, uint32_t seed) {
  for (auto& s : shared_) kernels::append_random_rows(s, tokens, seed++);
  for (auto& s : residual_) kernels::append_random_rows(s, tokens, seed++);
}

int64_t LrkvFusedCache::bytes() const {
  int64_t n = 0;
  for (const auto& s : shared_) n += s.bytes();
  for (const auto& s : residual_) n += s.bytes();
  return n;
}

double LrkvFusedCache::bytes_per_token() const {
  return shared_.front().bytes_per_token() + (residual_.empty() ? 0.0 : residual_.front().bytes_per_token());
}

void LrkvFusedCache::clear() {
  for (auto& s : shared_) s.clear();
  for (auto& s : residual_) s.clear();
}

LrkvAttention::LrkvAttention(const model::ModelConfig& c, int layer)
    : heads_(c.num_attention_heads), head_dim_(c.head_dim), rank_(c.lrkv_rank), mode_(parse_lrkv_rope(c.lrkv_rope)),
      shape_(AttentionShape::of_layer(c, "lrkv")), rope_(c.head_dim, c.rope_theta),
      latent_rope_(nn::Rope::of_planes(c.head_dim, c.rope_theta,
                                       mode_ == LrkvRope::PairAligned ? residual_planes(c.head_dim, c.lrkv_rank)
                                                                      : std::vector<int64_t>{})) {
  (void)layer;
  const int64_t d = c.hidden_size;
  q_proj = register_module("q_proj", nn::linear_no_bias(d, heads_ * head_dim_));
  k_shared_proj = register_module("k_shared_proj", nn::linear_no_bias(d, head_dim_));
  v_shared_proj = register_module("v_shared_proj", nn::linear_no_bias(d, head_dim_));
  if (rank_ > 0) {
    k_down_proj = register_module("k_down_proj", nn::linear_no_bias(d, heads_ * rank_));
    v_down_proj = register_module("v_down_proj", nn::linear_no_bias(d, heads_ * rank_));
    v_up = register_parameter("v_up", torch::randn({heads_, rank_, head_dim_}) * 0.02);
    if (mode_ == LrkvRope::PairAligned) {
      auto sel = torch::zeros({heads_, rank_, head_dim_});
      const auto planes = residual_planes(head_dim_, rank_);
      for (int64_t m = 0; m < rank_ / 2; ++m) {
        sel.select(1, m).select(1, planes[m]).fill_(1.0);
        sel.select(1, m + rank_ / 2).select(1, planes[m] + head_dim_ / 2).fill_(1.0);
      }
      k_up = register_buffer("k_up", sel);
    } else {
      k_up = register_parameter("k_up", torch::randn({heads_, rank_, head_dim_}) * 0.02);
    }
  }
  o_proj = register_module("o_proj", nn::linear_no_bias(heads_ * head_dim_, d));
  initialize();
}

void LrkvAttention::initialize() {
  if (rank_ == 0) return;
  torch::NoGradGuard ng;
  auto scale_residual = [&](nn::Linear& shared, nn::Linear& down, torch::Tensor& up, bool scale_down) {
    const double target = 0.1 * shared->weight.norm().item<double>();
    for (int64_t h = 0; h < heads_; ++h) {
      auto u = down->weight.narrow(0, h * rank_, rank_);  // [r, d] = U_h^T
      const double now = torch::matmul(u.t(), up[h]).norm().item<double>();  // ||U_h B_h^T||_F
      if (now == 0.0) continue;
      if (scale_down)
        u.mul_(target / now);
      else
        up[h].mul_(target / now);
    }
  };
  scale_residual(k_shared_proj, k_down_proj, k_up, mode_ == LrkvRope::PairAligned);
  scale_residual(v_shared_proj, v_down_proj, v_up, false);
}

void LrkvAttention::project(const torch::Tensor& x, torch::Tensor& q, torch::Tensor& ks, torch::Tensor& vs,
                            torch::Tensor& rk, torch::Tensor& rv) {
  const int64_t B = x.size(0), T = x.size(1);
  q = q_proj(x).view({B, T, heads_, head_dim_}).transpose(1, 2);
  ks = k_shared_proj(x).view({B, T, 1, head_dim_}).transpose(1, 2);
  vs = v_shared_proj(x).view({B, T, 1, head_dim_}).transpose(1, 2);
  if (rank_ > 0) {
    rk = k_down_proj(x).view({B, T, heads_, rank_}).transpose(1, 2);
    rv = v_down_proj(x).view({B, T, heads_, rank_}).transpose(1, 2);
  } else {
    rk = torch::zeros({B, heads_, T, 0}, x.options());
    rv = rk;
  }
}

torch::Tensor LrkvAttention::merge_heads(const torch::Tensor& o) {
  const int64_t B = o.size(0), T = o.size(2);
  return o_proj(o.transpose(1, 2).reshape({B, T, heads_ * head_dim_}));
}

void LrkvAttention::expanded(const torch::Tensor& x, int64_t start, torch::Tensor& q, torch::Tensor& k, torch::Tensor& v) {
  torch::Tensor q0, ks, vs, rk, rv;
  project(x, q0, ks, vs, rk, rv);
  const int64_t B = x.size(0), T = x.size(1);
  // R_h B_h^T: [B, H, T, r] @ [H, r, d_h]
  auto kres = rank_ > 0 ? torch::matmul(rk, k_up) : torch::zeros({B, heads_, T, head_dim_}, x.options());
  auto vres = rank_ > 0 ? torch::matmul(rv, v_up) : torch::zeros({B, heads_, T, head_dim_}, x.options());
  v = vs + vres;
  if (mode_ == LrkvRope::SharedRope) {
    q = torch::cat({rope_.apply(q0, start), q0}, -1) * std::sqrt(2.0);
    k = torch::cat({rope_.apply(ks, start).expand({B, heads_, T, head_dim_}), kres}, -1);
  } else {
    q = rope_.apply(q0, start);
    k = rope_.apply(ks + kres, start);
  }
}

bool LrkvAttention::head_projections(torch::Tensor& wq, torch::Tensor& wk) const {
  const int64_t d = q_proj->weight.size(1);
  wq = q_proj->weight.detach().view({heads_, head_dim_, d}).transpose(1, 2);  // [H, d, d_h]
  wk = k_shared_proj->weight.detach().t().unsqueeze(0).repeat({heads_, 1, 1});  // W_s^K per head
  if (rank_ > 0)  // + U_h B_h^T: [H, d, r] @ [H, r, d_h]
    wk = wk + torch::matmul(k_down_proj->weight.detach().view({heads_, rank_, d}).transpose(1, 2), k_up.detach());
  return true;
}

torch::Tensor LrkvAttention::forward(const torch::Tensor& x) {
  torch::Tensor q, k, v;
  expanded(x, 0, q, k, v);
  return merge_heads(causal_attention(q, k, v, 0));
}

std::unique_ptr<MixerCache> LrkvAttention::new_cache(int64_t batch, const CacheOptions& options) const {
  const bool plain = options.type == kernels::KVType::F32 && !options.evict.enabled();
  if (options.reference || mode_ == LrkvRope::Expand) {
    if (!plain)
      throw Error(std::string("LRKV ") + (options.reference ? "--reference decoding" : "lrkv_rope expand") +
                  " runs on the libtorch f32 cache (expand rebuilds every head's keys at read time); use --kv-cache f32 "
                  "without --evict, or a shared_rope / pair_aligned model for compressed caches");
    return std::make_unique<LrkvCache>(batch, heads_, head_dim_, rank_);
  }
  // q8/q4 quantise a token's latents [R_0 | .. | R_{H-1}] in blocks of 32 (blocks may span heads)
  if ((options.type == kernels::KVType::Q8 || options.type == kernels::KVType::Q4) && (heads_ * rank_) % kernels::kQBlock != 0)
    throw Error("a " + kernels::kv_type_name(options.type) + " cache quantises a token's LRKV latents (heads x lrkv_rank = " +
                std::to_string(heads_ * rank_) + " values) in blocks of 32, so that must be a multiple of 32; use f32 or bf16, "
                "or a rank that makes it one");
  return std::make_unique<LrkvFusedCache>(batch, heads_, head_dim_, rank_, options);
}

torch::Tensor LrkvAttention::step_fused(const torch::Tensor& x, LrkvFusedCache& cache) {
  const int64_t start = cache.length(), B = x.size(0), T = x.size(1), H = heads_, D = head_dim_, r = rank_;
  torch::Tensor q, ks, vs, rk, rv;
  project(x, q, ks, vs, rk, rv);
  auto qr = rope_.apply(q, start);
  const auto to_rows = token_major_f32;  // [B, T, heads, w]
  auto q_rows = to_rows(qr), ks_rows = to_rows(rope_.apply(ks, start)), vs_rows = to_rows(vs);
  torch::Tensor qb_rows, rk_rows, rv_rows;
  if (r > 0) {  // qb = q B^K (shared_rope: the unrotated q; pair_aligned: rope(q)); latents as stored
    qb_rows = to_rows(torch::matmul(mode_ == LrkvRope::SharedRope ? q : qr, k_up.transpose(-2, -1)));
    rk_rows = to_rows(mode_ == LrkvRope::PairAligned ? latent_rope_.apply(rk, start) : rk);
    rv_rows = to_rows(rv);
  }
  auto out_s = torch::empty({B, T, H, D}, torch::kFloat32), out_r = torch::empty({B, T, H, std::max<int64_t>(r, 1)}, torch::kFloat32);
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t i = b * T + t;
      cache.shared(b).append(ks_rows.data_ptr<float>() + i * D, vs_rows.data_ptr<float>() + i * D);
      if (r > 0) cache.residual(b)->append(rk_rows.data_ptr<float>() + i * H * r, rv_rows.data_ptr<float>() + i * H * r);
      kernels::lrkv_decode_attention(q_rows.data_ptr<float>() + i * H * D, r > 0 ? qb_rows.data_ptr<float>() + i * H * r : nullptr,
                                     static_cast<int>(H), cache.shared(b), cache.residual(b), scale,
                                     out_s.data_ptr<float>() + i * H * D, out_r.data_ptr<float>() + i * H * out_r.size(3),
                                     cache.threads());
    }
  auto o = out_s.to(x.scalar_type()).transpose(1, 2);  // [B, H, T, d_h]
  if (r > 0) o = o + torch::matmul(out_r.to(x.scalar_type()).transpose(1, 2), v_up);  // (a R^V) B^V^T
  return merge_heads(o);
}

torch::Tensor LrkvAttention::step(const torch::Tensor& x, MixerCache& cache_base) {
  if (auto* fused = dynamic_cast<LrkvFusedCache*>(&cache_base)) return step_fused(x, *fused);
  auto* cache = dynamic_cast<LrkvCache*>(&cache_base);
  if (!cache) throw Error("LrkvAttention::step: the cache was not made by an LRKV layer (layer/cache mismatch)");
  const int64_t start = cache->length();
  torch::Tensor q, ks, vs, rk, rv;
  project(x, q, ks, vs, rk, rv);
  // What the cache stores depends on the RoPE mode (see lrkv.h).
  cache->ks.append((mode_ == LrkvRope::Expand ? ks : rope_.apply(ks, start)).contiguous());
  cache->vs.append(vs.contiguous());
  cache->rk.append((mode_ == LrkvRope::PairAligned && rank_ > 0 ? latent_rope_.apply(rk, start) : rk).contiguous());
  cache->rv.append(rv.contiguous());
  const auto Ks = cache->ks.view(), Vs = cache->vs.view(), Rk = cache->rk.view(), Rv = cache->rv.view();

  torch::Tensor scores;
  if (mode_ == LrkvRope::Expand) {  // rebuild each head's keys from the latents, then rotate
    auto K = rank_ > 0 ? Ks + torch::matmul(Rk, k_up) : Ks;
    scores = torch::matmul(rope_.apply(q, start), rope_.apply(K, 0).transpose(-2, -1));
  } else {
    // shared_rope: rope(q) K_s^T + (q B^K) R^K^T; pair_aligned: the same with rope(q) in both.
    auto qr = rope_.apply(q, start);
    scores = torch::matmul(qr, Ks.transpose(-2, -1));
    if (rank_ > 0) {
      auto qb = torch::matmul(mode_ == LrkvRope::SharedRope ? q : qr, k_up.transpose(-2, -1));  // [B, H, T, r]
      scores = scores + torch::matmul(qb, Rk.transpose(-2, -1));
    }
  }
  auto a = causal_softmax(scores * (1.0 / std::sqrt(static_cast<double>(head_dim_))), start);
  auto o = torch::matmul(a, Vs);  // a V_s (V_s broadcast over heads)
  if (rank_ > 0) o = o + torch::matmul(torch::matmul(a, Rv), v_up);  // (a R^V) B^V^T
  return merge_heads(o);
}

}  // namespace kvx::attention

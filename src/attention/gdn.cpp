#include "attention/gdn.h"

#include <cmath>
#include <string>

#include "kernels/gdn_decode.h"
#include "util/error.h"

namespace kvx::attention {

namespace {

void check_shapes(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& g,
                  const torch::Tensor& beta, const torch::Tensor& state) {
  auto shape = [](const torch::Tensor& t) {
    std::string s = "[";
    for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
    return s + "]";
  };
  const bool ok = q.dim() == 4 && k.sizes() == q.sizes() && v.dim() == 4 && v.size(0) == q.size(0) &&
                  v.size(1) == q.size(1) && v.size(2) == q.size(2) && g.sizes() == q.sizes().slice(0, 3) &&
                  beta.sizes() == g.sizes() &&
                  (!state.defined() || state.sizes() == torch::IntArrayRef({q.size(0), q.size(1), q.size(3), v.size(3)}));
  if (!ok)
    throw Error("gdn: expected q, k [B, H, T, K], v [B, H, T, V], g and beta [B, H, T], state [B, H, K, V]; got q " +
                shape(q) + ", k " + shape(k) + ", v " + shape(v) + ", g " + shape(g) + ", beta " + shape(beta) +
                (state.defined() ? ", state " + shape(state) : std::string()));
  if (q.size(2) == 0) throw Error("gdn: the sequence is empty (T = 0); give at least one token");
}

torch::Tensor zero_state(const torch::Tensor& q, const torch::Tensor& v) {
  return torch::zeros({q.size(0), q.size(1), q.size(3), v.size(3)}, v.options());
}

}  // namespace

torch::Tensor l2_normalize(const torch::Tensor& x) { return x * torch::rsqrt(x.pow(2).sum(-1, true) + 1e-6); }

std::pair<torch::Tensor, torch::Tensor> gdn_recurrent(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                                      const torch::Tensor& g, const torch::Tensor& beta, double scale,
                                                      torch::Tensor state) {
  check_shapes(q, k, v, g, beta, state);
  torch::Tensor S = state.defined() ? state : zero_state(q, v);
  std::vector<torch::Tensor> outs;
  for (int64_t t = 0; t < q.size(2); ++t) {
    const auto kt = k.select(2, t), vt = v.select(2, t);                       // [B, H, K], [B, H, V]
    S = S * g.select(2, t).exp().unsqueeze(-1).unsqueeze(-1);
    const auto u = beta.select(2, t).unsqueeze(-1) * (vt - (S * kt.unsqueeze(-1)).sum(2));  // v - S^T k
    S = S + kt.unsqueeze(-1) * u.unsqueeze(-2);
    outs.push_back((S * (scale * q.select(2, t)).unsqueeze(-1)).sum(2));      // S^T (scale q)
  }
  return {torch::stack(outs, 2), S};
}

std::pair<torch::Tensor, torch::Tensor> gdn_chunked(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                                    const torch::Tensor& g, const torch::Tensor& beta, double scale,
                                                    torch::Tensor state, int64_t chunk) {
  check_shapes(q, k, v, g, beta, state);
  if (chunk < 1) throw Error("gdn_chunked: chunk must be >= 1, got " + std::to_string(chunk));
  torch::Tensor S = state.defined() ? state : zero_state(q, v);
  const int64_t T = q.size(2);
  std::vector<torch::Tensor> outs;
  for (int64_t t0 = 0; t0 < T; t0 += chunk) {
    const int64_t C = std::min(chunk, T - t0);
    const auto Q = q.narrow(2, t0, C), K = k.narrow(2, t0, C), V = v.narrow(2, t0, C);
    const auto b = beta.narrow(2, t0, C).unsqueeze(-1);                        // [B, H, C, 1]
    const auto gamma = g.narrow(2, t0, C).cumsum(-1);                          // [B, H, C]
    const auto decay = (gamma.unsqueeze(-1) - gamma.unsqueeze(-2));            // gamma_t - gamma_i, [B, H, C, C]
    const auto causal = torch::ones({C, C}, torch::dtype(torch::kBool)).tril();
    // Masked before exp: above the diagonal gamma_t - gamma_i > 0 and could overflow.
    const auto M = torch::where(causal, decay, torch::full({}, -INFINITY, decay.options())).exp();
    const auto L = (M * torch::matmul(K, K.transpose(-1, -2))).tril(-1);
    const auto A = torch::eye(C, L.options()) + b * L;                         // unit lower triangular
    const auto G = gamma.exp().unsqueeze(-1);                                  // [B, H, C, 1]
    const auto rhs = b * (V - G * torch::matmul(K, S));
    const auto U = torch::linalg_solve_triangular(A, rhs, /*upper=*/false, /*left=*/true, /*unitriangular=*/true);
    outs.push_back(scale * (G * torch::matmul(Q, S) + torch::matmul(M * torch::matmul(Q, K.transpose(-1, -2)), U)));
    const auto last = gamma.select(-1, C - 1);                                 // gamma_C, [B, H]
    const auto tail = (last.unsqueeze(-1) - gamma).exp().unsqueeze(-1);        // exp(gamma_C - gamma_i), [B, H, C, 1]
    S = last.exp().unsqueeze(-1).unsqueeze(-1) * S + torch::matmul(K.transpose(-1, -2), tail * U);
  }
  return {torch::cat(outs, 2), S};
}


torch::Tensor gdn_recurrent_fused(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                  const torch::Tensor& g, const torch::Tensor& beta, double scale, torch::Tensor& state,
                                  int threads) {
  check_shapes(q, k, v, g, beta, state);
  if (state.scalar_type() != torch::kFloat32 || !state.is_contiguous())
    throw Error("gdn_recurrent_fused: the state must be a contiguous f32 tensor");
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), K = q.size(3), V = v.size(3);
  // [B, T, H, w] f32 copies: one token's heads are contiguous.
  const auto qf = token_major_f32(q), kf = token_major_f32(k), vf = token_major_f32(v), gf = token_major_f32(g),
             bf = token_major_f32(beta);
  auto out = torch::empty({B, T, H, V}, torch::kFloat32);
  for (int64_t b = 0; b < B; ++b) {
    float* S = state.data_ptr<float>() + b * H * K * V;
    for (int64_t t = 0; t < T; ++t) {
      const int64_t i = b * T + t;
      kernels::gdn_decode_step(S, qf.data_ptr<float>() + i * H * K, kf.data_ptr<float>() + i * H * K,
                               vf.data_ptr<float>() + i * H * V, gf.data_ptr<float>() + i * H, bf.data_ptr<float>() + i * H,
                               static_cast<int>(H), static_cast<int>(K), static_cast<int>(V), static_cast<float>(scale),
                               out.data_ptr<float>() + i * H * V, threads);
    }
  }
  return out.to(q.scalar_type()).transpose(1, 2);
}

GdnCache::GdnCache(int64_t batch, const AttentionShape& shape, bool fused_steps, int thread_count)
    : fused(fused_steps), threads(thread_count), batch_(batch), shape_(shape) {
  state = torch::zeros({batch, shape.heads, shape.head_dim, shape.value_dim});
}

int64_t GdnCache::bytes() const { return static_cast<int64_t>(batch_ * shape_.state_bytes()); }

void GdnCache::clear() {
  state.zero_();
  tails.clear();
  length_ = 0;
}

void GdnCache::append_random_history(int64_t tokens, uint32_t seed) {
  torch::manual_seed(seed);
  state = torch::randn_like(state) * (1.0 / std::sqrt(static_cast<double>(shape_.head_dim)));
  const int64_t tail = shape_.conv - 1, hk = static_cast<int64_t>(shape_.heads) * shape_.head_dim;
  tails.q = torch::randn({batch_, tail, hk});
  tails.k = torch::randn({batch_, tail, hk});
  tails.v = torch::randn({batch_, tail, static_cast<int64_t>(shape_.heads) * shape_.value_dim});
  length_ += tokens;
}

GdnLayerBase::GdnLayerBase(const model::ModelConfig& c, const std::string& kind)
    : heads_(c.linear_num_heads), key_dim_(c.linear_key_head_dim), value_dim_(c.linear_value_head_dim),
      shape_(AttentionShape::of_layer(c, kind)) {
  const int64_t d = c.hidden_size, hk = heads_ * key_dim_, hv = heads_ * value_dim_, conv = c.linear_conv_kernel_dim;
  q_proj = register_module("q_proj", nn::linear_no_bias(d, hk));
  k_proj = register_module("k_proj", nn::linear_no_bias(d, hk));
  v_proj = register_module("v_proj", nn::linear_no_bias(d, hv));
  a_proj = register_module("a_proj", nn::linear_no_bias(d, heads_));
  b_proj = register_module("b_proj", nn::linear_no_bias(d, heads_));
  g_proj = register_module("g_proj", nn::linear_no_bias(d, hv));
  o_proj = register_module("o_proj", nn::linear_no_bias(hv, d));
  q_conv1d = register_module("q_conv1d", nn::CausalConv1d(hk, conv));
  k_conv1d = register_module("k_conv1d", nn::CausalConv1d(hk, conv));
  v_conv1d = register_module("v_conv1d", nn::CausalConv1d(hv, conv));
  A_log = register_parameter("A_log", torch::zeros({heads_}));
  dt_bias = register_parameter("dt_bias", torch::zeros({heads_}));
  initialize();
}

void GdnLayerBase::initialize() {
  torch::NoGradGuard ng;
  A_log.copy_(torch::empty({heads_}).uniform_(0, 16).clamp_min(1e-6).log());
  const double lo = std::log(1e-3), hi = std::log(0.1);
  auto dt = (torch::rand({heads_}) * (hi - lo) + lo).exp().clamp_min(1e-4);
  dt_bias.copy_(dt + torch::log(-torch::expm1(-dt)));  // softplus^-1(dt)
}

torch::Tensor GdnLayerBase::heads_first(const torch::Tensor& x, int64_t width) const {
  return x.view({x.size(0), x.size(1), heads_, width}).transpose(1, 2);
}

GdnInputs GdnLayerBase::project(const torch::Tensor& x, ConvTails* tails) {
  GdnInputs in;
  in.q = torch::silu(q_conv1d(q_proj(x), tails ? &tails->q : nullptr));
  in.k = torch::silu(k_conv1d(k_proj(x), tails ? &tails->k : nullptr));
  in.v = torch::silu(v_conv1d(v_proj(x), tails ? &tails->v : nullptr));
  in.beta = torch::sigmoid(b_proj(x));
  // The log decay in at least fp32 (SPEC 1.2): its cumulative sums and exps lose too much in bf16.
  const auto wide = x.scalar_type() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
  in.g = (-A_log.to(wide).exp() * torch::nn::functional::softplus(a_proj(x).to(wide) + dt_bias.to(wide))).to(x.scalar_type());
  return in;
}

GdnAttention::GdnAttention(const model::ModelConfig& c, int layer) : GdnLayerBase(c, "gdn") {
  (void)layer;
  o_norm = register_module("o_norm", nn::RMSNorm(value_dim_, c.rms_norm_eps));
}

torch::Tensor GdnAttention::finish(const torch::Tensor& o, const torch::Tensor& x) {
  const int64_t B = x.size(0), T = x.size(1);
  auto gate = torch::silu(g_proj(x)).view({B, T, heads_, value_dim_});
  return o_proj((o_norm(o.transpose(1, 2)) * gate).reshape({B, T, heads_ * value_dim_}));
}

torch::Tensor GdnAttention::forward(const torch::Tensor& x) {
  if (x.dim() == 3 && x.size(1) == 0) throw Error("GdnAttention::forward: the sequence is empty; give at least one token");
  const auto in = project(x, nullptr);
  const double scale = 1.0 / std::sqrt(static_cast<double>(key_dim_));
  auto o = gdn_chunked(l2_normalize(heads_first(in.q, key_dim_)), l2_normalize(heads_first(in.k, key_dim_)),
                       heads_first(in.v, value_dim_), in.g.transpose(1, 2), in.beta.transpose(1, 2), scale)
               .first;
  return finish(o, x);
}

std::unique_ptr<MixerCache> GdnAttention::new_cache(int64_t batch, const CacheOptions& options) const {
  if (options.evict.enabled())
    throw Error("a GDN layer has no KV to evict (its state is constant in the context length); drop --evict");
  return std::make_unique<GdnCache>(batch, shape_, !options.reference,
                                    options.threads > 0 ? options.threads : torch::get_num_threads());
}

torch::Tensor GdnAttention::step(const torch::Tensor& x, MixerCache& cache_base) {
  auto* cache = dynamic_cast<GdnCache*>(&cache_base);
  if (!cache) throw Error("GdnAttention::step: the cache was not made by a GDN layer (layer/cache mismatch)");
  if (x.dim() == 3 && x.size(1) == 0) throw Error("GdnAttention::step: the chunk is empty; give at least one token");
  const auto in = project(x, &cache->tails);
  const int64_t T = x.size(1);
  const double scale = 1.0 / std::sqrt(static_cast<double>(key_dim_));
  auto q = l2_normalize(heads_first(in.q, key_dim_)), k = l2_normalize(heads_first(in.k, key_dim_));
  auto v = heads_first(in.v, value_dim_);
  auto g = in.g.transpose(1, 2), beta = in.beta.transpose(1, 2);
  torch::Tensor o;
  if (cache->fused) {
    o = gdn_recurrent_fused(q, k, v, g, beta, scale, cache->state, cache->threads);
  } else {
    auto state = cache->state.to(x.scalar_type());
    auto r = T >= 64 ? gdn_chunked(q, k, v, g, beta, scale, state) : gdn_recurrent(q, k, v, g, beta, scale, state);
    o = r.first;
    cache->state = r.second.detach();  // kept in the model's dtype (fp64 in the tests)
  }
  cache->length_ += T;
  return finish(o, x);
}

}  // namespace kvx::attention

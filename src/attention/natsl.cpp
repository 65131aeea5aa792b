#include "attention/natsl.h"

#include <cmath>
#include <limits>
#include <string>

#include "kernels/decode_attention.h"
#include "nn/tensor_io.h"
#include "util/error.h"

namespace kvx::attention {

using nn::shape_of;

namespace {

int64_t blocks_of(int64_t T, int64_t block) { return (T + block - 1) / block; }

void check_routes(const torch::Tensor& routes, int64_t B, int64_t T, int64_t block, const char* what) {
  if (block < 1) throw Error(std::string(what) + ": the block size must be >= 1, got " + std::to_string(block));
  if (routes.dim() != 3 || routes.size(0) != B || routes.size(1) != blocks_of(T, block) || routes.size(2) < 1)
    throw Error(std::string(what) + ": routes must be [B, ceil(T / block), H] = [" + std::to_string(B) + ", " +
                std::to_string(blocks_of(T, block)) + ", H], got " + shape_of(routes));
}

struct RouteSelectFunction : public torch::autograd::Function<RouteSelectFunction> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& probs, const torch::Tensor& chosen,
                               bool sparse) {
    (void)probs;
    ctx->saved_data["sparse"] = sparse;
    ctx->save_for_backward({chosen});
    return chosen.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad) {
    const auto chosen = ctx->get_saved_variables()[0];
    auto g = grad[0];
    if (ctx->saved_data["sparse"].toBool()) g = g * chosen;  // only the chosen op's signal (seed 001 Sec. 4.2)
    return {g, torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor choose_routes(const torch::Tensor& probs, const KvBudget& budget, torch::Tensor& softmax_counts,
                            int64_t blocks_before, bool last_forced) {
  if (probs.dim() != 4 || probs.size(3) != 2)
    throw Error("choose_routes: router probabilities must be [B, NB, H, 2], got " + shape_of(probs));
  const int64_t B = probs.size(0), NB = probs.size(1), H = probs.size(2);
  if (!softmax_counts.defined()) softmax_counts = torch::zeros({B, H}, torch::kLong);
  auto type = probs.detach().argmax(-1).to(torch::kLong).contiguous();  // 0 softmax, 1 GDN
  auto t = type.accessor<int64_t, 3>();
  auto count = softmax_counts.accessor<int64_t, 2>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t nb = 0; nb < NB; ++nb)
      for (int64_t h = 0; h < H; ++h) {
        if (last_forced && nb == NB - 1) {
          t[b][nb][h] = 1;
        } else if (t[b][nb][h] == 0) {
          const double allowed = std::floor(budget.fraction * static_cast<double>(blocks_before + nb + 1) + 1e-9);
          if (static_cast<double>(count[b][h] + 1) > allowed || (budget.max_blocks > 0 && count[b][h] + 1 > budget.max_blocks))
            t[b][nb][h] = 1;  // over the KV budget: the block goes to the state
          else
            ++count[b][h];
        }
      }
  return torch::one_hot(type, 2).to(probs.scalar_type());
}

torch::Tensor route_select(const torch::Tensor& probs, const torch::Tensor& chosen, bool sparse) {
  return RouteSelectFunction::apply(probs, chosen, sparse);
}

torch::Tensor routed_softmax_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                       const torch::Tensor& keep, int64_t block, double scale) {
  if (q.dim() != 4 || k.sizes() != q.sizes() || v.dim() != 4 || v.size(0) != q.size(0) || v.size(1) != q.size(1) ||
      v.size(2) != q.size(2))
    throw Error("routed_softmax_attention: expected q, k [B, HA, T, KA] and v [B, HA, T, VA]; got q " + shape_of(q) + ", k " +
                shape_of(k) + ", v " + shape_of(v));
  const int64_t B = q.size(0), HA = q.size(1), T = q.size(2);
  check_routes(keep, B, T, block, "routed_softmax_attention");
  const int64_t H = keep.size(2);
  if (HA % H != 0)
    throw Error("routed_softmax_attention: " + std::to_string(HA) + " softmax heads do not split into " + std::to_string(H) +
                " head groups");
  const auto pos = torch::arange(T, torch::kLong);
  const auto blk = torch::div(pos, block, "floor");
  const auto same_block = blk.unsqueeze(1).eq(blk.unsqueeze(0));  // [t, s]
  const auto causal = pos.unsqueeze(0).le(pos.unsqueeze(1));      // s <= t
  // Key s is visible from a later block iff its block was routed to softmax for the head's group.
  const auto key_keep = keep.index_select(1, blk).permute({0, 2, 1}).repeat_interleave(HA / H, 1).unsqueeze(2);  // [B, HA, 1, T]
  const auto M = torch::where(same_block, torch::ones({}, q.options()), key_keep) * causal.to(q.scalar_type());
  const auto scores = torch::matmul(q, k.transpose(-1, -2)).mul(scale).masked_fill(causal.logical_not(), -INFINITY);
  // Shift by the largest visible score (the query's own key is always visible), so visible terms
  // are <= 1 and never all underflow; hidden keys scoring far higher are capped at e^60 (finite,
  // and multiplied by M = 0).
  const auto visible = M.detach() > 0;
  const auto shift = std::get<0>(scores.masked_fill(visible.logical_not(), -INFINITY).max(-1, true)).detach();
  const auto E = (scores - shift).clamp_max(60.0).exp() * M;
  return torch::matmul(E / E.sum(-1, true), v);
}

namespace {

using GdnCore = std::pair<torch::Tensor, torch::Tensor> (*)(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                                                            const torch::Tensor&, const torch::Tensor&, double, torch::Tensor,
                                                            int64_t);

std::pair<torch::Tensor, torch::Tensor> routed(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                               const torch::Tensor& g, const torch::Tensor& beta, const torch::Tensor& commit,
                                               int64_t block, double scale, bool chunked) {
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2);
  check_routes(commit, B, T, block, "routed GDN");
  if (commit.size(2) != H)
    throw Error("routed GDN: routes have " + std::to_string(commit.size(2)) + " heads but q has " + std::to_string(H));
  auto S = torch::zeros({B, H, q.size(3), v.size(3)}, v.options());
  std::vector<torch::Tensor> outs;
  for (int64_t nb = 0, t0 = 0; t0 < T; ++nb, t0 += block) {
    const int64_t C = std::min(block, T - t0);
    const auto qb = q.narrow(2, t0, C), kb = k.narrow(2, t0, C), vb = v.narrow(2, t0, C);
    const auto gb = g.narrow(2, t0, C), bb = beta.narrow(2, t0, C);
    auto r = chunked ? gdn_chunked(qb, kb, vb, gb, bb, scale, S, block) : gdn_recurrent(qb, kb, vb, gb, bb, scale, S);
    outs.push_back(r.first);
    const auto D = gb.sum(-1).exp().unsqueeze(-1).unsqueeze(-1) * S;  // no writes, the decay keeps running
    const auto m = commit.select(1, nb).unsqueeze(-1).unsqueeze(-1);
    S = D + m * (r.second - D);
  }
  return {torch::cat(outs, 2), S};
}

}  // namespace

std::pair<torch::Tensor, torch::Tensor> gdn_routed_blocks(const torch::Tensor& q, const torch::Tensor& k,
                                                          const torch::Tensor& v, const torch::Tensor& g,
                                                          const torch::Tensor& beta, const torch::Tensor& commit,
                                                          int64_t block, double scale) {
  return routed(q, k, v, g, beta, commit, block, scale, true);
}

std::pair<torch::Tensor, torch::Tensor> gdn_routed_recurrent(const torch::Tensor& q, const torch::Tensor& k,
                                                             const torch::Tensor& v, const torch::Tensor& g,
                                                             const torch::Tensor& beta, const torch::Tensor& commit,
                                                             int64_t block, double scale) {
  return routed(q, k, v, g, beta, commit, block, scale, false);
}

// ---- decode cache ----

NatslCache::NatslCache(int64_t batch, const AttentionShape& shape, int64_t hidden, const CacheOptions& options)
    : fused(!options.reference),
      fused_kv(!options.reference && shape.head_dim == shape.value_dim),
      threads(options.threads > 0 ? options.threads : torch::get_num_threads()),
      batch_(batch), hidden_(hidden), shape_(shape), options_(options) {
  clear();
}

int64_t NatslCache::kv_tokens(int64_t b, int64_t group) const {
  return fused_kv ? stores[b][group].length() : keys[b][group].length();
}

void NatslCache::drop_newest(int64_t b, int64_t group, int64_t tokens) {
  if (fused_kv) {
    stores[b][group].truncate(stores[b][group].length() - tokens);
  } else {
    keys[b][group].truncate(keys[b][group].length() - tokens);
    values[b][group].truncate(values[b][group].length() - tokens);
  }
}

void NatslCache::append_random_history(int64_t tokens, uint32_t seed) {
  if (length_ != 0) throw Error("NatslCache::append_random_history: the cache must be empty");
  torch::manual_seed(seed);
  const int64_t H = shape_.heads, GA = shape_.attn_heads / H, KA = shape_.head_dim / GA, VA = shape_.value_dim / GA;
  const int64_t C = shape_.block, complete = tokens / C, partial = tokens % C;
  const double f = options_.history_softmax_fraction >= 0 ? options_.history_softmax_fraction : shape_.softmax_fraction;
  committed = torch::randn_like(committed) * (1.0 / std::sqrt(static_cast<double>(shape_.head_dim)));
  running = committed.clone();
  for (int64_t nb = 0; nb < complete; ++nb) {
    // Block nb is kept iff it raises floor(f (nb + 1)): round(f complete) blocks, evenly spread.
    const bool keep = std::floor(f * (nb + 1) + 1e-9) > std::floor(f * nb + 1e-9);
    routes.push_back(torch::full({batch_, H}, keep ? 0 : 1, torch::kLong));
    if (keep) softmax_counts += 1;
  }
  const int64_t kept = static_cast<int64_t>(std::floor(f * complete + 1e-9)) * C + partial;
  for (int64_t b = 0; b < batch_; ++b)
    for (int64_t j = 0; j < H; ++j) {
      if (fused_kv) {
        kernels::append_random_rows(stores[b][j], kept, seed + static_cast<uint32_t>(b * H + j));
      } else {
        keys[b][j].append(torch::randn({1, GA, kept, KA}));
        values[b][j].append(torch::randn({1, GA, kept, VA}));
      }
    }
  if (partial > 0) block_inputs.push_back(torch::randn({batch_, partial, hidden_}));
  block_filled = partial;
  length_ = tokens;
}

void NatslCache::clear() {
  tails.clear();
  if (fused_kv) {
    const int GA = shape_.attn_heads / shape_.heads;
    stores.clear();
    stores.resize(batch_);
    for (auto& row : stores)
      for (int64_t j = 0; j < shape_.heads; ++j) row.emplace_back(options_.type, GA, shape_.head_dim / GA);
  }
  committed = torch::zeros({batch_, shape_.heads, shape_.head_dim, shape_.value_dim});
  running = committed.clone();
  g_sum = torch::zeros({batch_, shape_.heads});
  block_inputs.clear();
  block_filled = 0;
  keys.assign(batch_, std::vector<SequenceBuffer>(shape_.heads));
  values.assign(batch_, std::vector<SequenceBuffer>(shape_.heads));
  softmax_counts = torch::zeros({batch_, shape_.heads}, torch::kLong);
  routes.clear();
  length_ = 0;
}

int64_t NatslCache::kv_bytes() const {
  int64_t n = 0;
  if (fused_kv) {
    for (const auto& row : stores)
      for (const auto& s : row) n += s.bytes();
    return n;
  }
  for (int64_t b = 0; b < batch_; ++b)  // the reference buffers hold the model's dtype
    for (int64_t j = 0; j < shape_.heads; ++j)
      for (const auto* buf : {&keys[b][j], &values[b][j]})
        if (buf->length() > 0) n += buf->view().numel() * buf->view().element_size();
  return n;
}

double NatslCache::bytes_per_token() const {
  if (fused_kv) return shape_.heads * stores[0][0].bytes_per_token();
  return 4.0 * shape_.attn_heads * (shape_.head_dim + shape_.value_dim) / (shape_.attn_heads / shape_.heads);
}

int64_t NatslCache::bytes() const {
  return kv_bytes() + static_cast<int64_t>(batch_ * shape_.state_bytes());
}

// ---- the layer ----

NatslAttention::NatslAttention(const model::ModelConfig& c, int layer)
    : GdnLayerBase(c, "natsl"), attn_heads_(c.nats_attention_heads), groups_(c.nats_attention_heads / c.linear_num_heads),
      block_(c.nats_block_size), rope_enabled_(c.nats_rope), sparse_router_grad_(c.nats_router_grad == "sparse"),
      budget_{c.nats_max_softmax_fraction, c.nats_max_softmax_blocks},
      rope_(c.nats_rope ? c.linear_key_head_dim / (c.nats_attention_heads / c.linear_num_heads) : 2, c.rope_theta) {
  (void)layer;
  const int64_t d = c.hidden_size, ka = key_dim_ / groups_, va = value_dim_ / groups_;
  mix_proj = register_module("mix_proj", nn::linear_no_bias(heads_ * key_dim_, 2 * attn_heads_));
  router = register_module("router", nn::linear_no_bias(d, 2 * heads_));
  q_norm = register_module("q_norm", nn::RMSNorm(ka, c.rms_norm_eps));
  k_norm = register_module("k_norm", nn::RMSNorm(ka, c.rms_norm_eps));
  gdn_norm = register_module("gdn_norm", nn::RMSNorm(va, c.rms_norm_eps));
  attn_norm = register_module("attn_norm", nn::RMSNorm(va, c.rms_norm_eps));
}

torch::Tensor NatslAttention::router_probs(const torch::Tensor& pooled) {
  return torch::softmax(router(pooled).view({pooled.size(0), pooled.size(1), heads_, 2}), -1);
}

void NatslAttention::softmax_inputs(const GdnInputs& in, int64_t start, torch::Tensor& qa, torch::Tensor& ka,
                                    torch::Tensor& va) {
  const int64_t B = in.q.size(0), n = in.q.size(1), KA = key_dim_ / groups_, VA = value_dim_ / groups_;
  qa = q_norm(in.q.view({B, n, attn_heads_, KA})).transpose(1, 2);
  ka = k_norm(in.k.view({B, n, attn_heads_, KA})).transpose(1, 2);
  va = in.v.view({B, n, attn_heads_, VA}).transpose(1, 2);
  if (rope_enabled_) {
    qa = rope_.apply(qa, start);
    ka = rope_.apply(ka, start);
  }
}

torch::Tensor NatslAttention::combine(const torch::Tensor& o_gdn, const torch::Tensor& o_attn, const GdnInputs& in,
                                      const torch::Tensor& x) {
  const int64_t B = x.size(0), n = x.size(1), VA = value_dim_ / groups_;
  const auto w = torch::softmax(mix_proj(in.q).view({B, n, attn_heads_, 2}), -1);  // [..., 0] GDN, [..., 1] softmax
  auto y = gdn_norm(o_gdn.transpose(1, 2).reshape({B, n, attn_heads_, VA})) * w.narrow(-1, 0, 1) +
           attn_norm(o_attn.transpose(1, 2)) * w.narrow(-1, 1, 1);
  return o_proj(y.reshape({B, n, heads_ * value_dim_}) * torch::silu(g_proj(x)));
}

torch::Tensor NatslAttention::forward(const torch::Tensor& x) {
  if (x.dim() == 3 && x.size(1) == 0) throw Error("NatslAttention::forward: the sequence is empty; give at least one token");
  const auto in = project(x, nullptr);
  const int64_t T = x.size(1);
  std::vector<torch::Tensor> pooled;
  for (int64_t t0 = 0; t0 < T; t0 += block_) pooled.push_back(x.narrow(1, t0, std::min(block_, T - t0)).mean(1));
  const auto probs = router_probs(torch::stack(pooled, 1));
  torch::Tensor counts;
  const auto chosen = choose_routes(probs, budget_, counts, 0, true);
  const auto types = route_select(probs, chosen, sparse_router_grad_);
  last_routes_ = chosen.argmax(-1).detach();
  torch::Tensor qa, ka, va;
  softmax_inputs(in, 0, qa, ka, va);
  const auto o_attn = routed_softmax_attention(qa, ka, va, types.select(-1, 0), block_,
                                               1.0 / std::sqrt(static_cast<double>(key_dim_ / groups_)));
  const auto o_gdn = gdn_routed_blocks(l2_normalize(heads_first(in.q, key_dim_)), l2_normalize(heads_first(in.k, key_dim_)),
                                       heads_first(in.v, value_dim_), in.g.transpose(1, 2), in.beta.transpose(1, 2),
                                       types.select(-1, 1), block_, 1.0 / std::sqrt(static_cast<double>(key_dim_)))
                         .first;
  return combine(o_gdn, o_attn, in, x);
}

std::unique_ptr<MixerCache> NatslAttention::new_cache(int64_t batch, const CacheOptions& options) const {
  if (options.evict.enabled())
    throw Error("NAtS-L layers choose which KV to keep by routing; --evict does not apply (use nats_max_softmax_fraction "
                "for a KV budget)");
  if (options.type != kernels::KVType::F32 && key_dim_ != value_dim_)
    throw Error("this NAtS-L layer's softmax keys and values differ in width (linear_key_head_dim != linear_value_head_dim), "
                "so its KV stays in f32 torch buffers; use --kv-cache f32");
  return std::make_unique<NatslCache>(batch, shape_, router->weight.size(1), options);
}

torch::Tensor NatslAttention::step(const torch::Tensor& x, MixerCache& cache_base) {
  auto* cache = dynamic_cast<NatslCache*>(&cache_base);
  if (!cache) throw Error("NatslAttention::step: the cache was not made by a NAtS-L layer (layer/cache mismatch)");
  if (x.size(1) == 0) throw Error("NatslAttention::step: the chunk is empty; give at least one token");
  std::vector<torch::Tensor> outs;
  for (int64_t pos = 0; pos < x.size(1);) {  // pieces that stay inside one block
    const int64_t n = std::min(x.size(1) - pos, block_ - cache->block_filled);
    outs.push_back(step_within_block(x.narrow(1, pos, n), *cache));
    pos += n;
  }
  return torch::cat(outs, 1);
}

torch::Tensor NatslAttention::step_within_block(const torch::Tensor& x, NatslCache& cache) {
  const int64_t B = x.size(0), n = x.size(1), start = cache.length_;
  const auto in = project(x, &cache.tails);
  // GDN branch: the running state of this block, writes included.
  const auto q = l2_normalize(heads_first(in.q, key_dim_)), k = l2_normalize(heads_first(in.k, key_dim_));
  const auto v = heads_first(in.v, value_dim_), g = in.g.transpose(1, 2), beta = in.beta.transpose(1, 2);
  const double scale = 1.0 / std::sqrt(static_cast<double>(key_dim_));
  torch::Tensor o_gdn;
  if (cache.fused) {
    o_gdn = gdn_recurrent_fused(q, k, v, g, beta, scale, cache.running, cache.threads);
  } else {
    const auto S = cache.running.to(x.scalar_type());
    auto r = n >= 64 ? gdn_chunked(q, k, v, g, beta, scale, S) : gdn_recurrent(q, k, v, g, beta, scale, S);
    o_gdn = r.first;
    cache.running = r.second.detach();
  }
  cache.g_sum = cache.g_sum.to(g.scalar_type()) + g.sum(-1).detach();
  // Softmax branch: per batch row and head group, the kept blocks and this block so far.
  torch::Tensor qa, ka, va;
  softmax_inputs(in, start, qa, ka, va);
  const double attn_scale = 1.0 / std::sqrt(static_cast<double>(key_dim_ / groups_));
  torch::Tensor o_attn;
  if (cache.fused_kv) {
    o_attn = softmax_branch_fused(qa, ka, va, cache, attn_scale).to(x.scalar_type());
  } else {
    std::vector<torch::Tensor> rows;
    for (int64_t b = 0; b < B; ++b) {
      std::vector<torch::Tensor> group_out;
      for (int64_t j = 0; j < heads_; ++j) {
        auto& K = cache.keys[b][j];
        auto& V = cache.values[b][j];
        K.append(ka.narrow(0, b, 1).narrow(1, j * groups_, groups_).detach().contiguous());
        V.append(va.narrow(0, b, 1).narrow(1, j * groups_, groups_).detach().contiguous());
        const auto scores = torch::matmul(qa.narrow(0, b, 1).narrow(1, j * groups_, groups_), K.view().transpose(-1, -2));
        group_out.push_back(torch::matmul(causal_softmax(scores * attn_scale, K.length() - n), V.view()));
      }
      rows.push_back(torch::cat(group_out, 1));
    }
    o_attn = torch::cat(rows, 0);
  }
  const auto out = combine(o_gdn, o_attn, in, x);
  cache.block_inputs.push_back(x.detach());
  cache.block_filled += n;
  cache.length_ += n;
  if (cache.block_filled == block_) commit_block(cache);
  return out;
}

torch::Tensor NatslAttention::softmax_branch_fused(const torch::Tensor& qa, const torch::Tensor& ka, const torch::Tensor& va,
                                                   NatslCache& cache, double scale) {
  // [B, n, HA, w] f32: one token's heads contiguous, head group j = heads GA j .. GA j + GA - 1.
  const auto q = token_major_f32(qa.detach()), k = token_major_f32(ka.detach()), v = token_major_f32(va.detach());
  const int64_t B = q.size(0), n = q.size(1), HA = q.size(2), W = q.size(3);
  auto out = torch::empty({B, n, HA, W}, torch::kFloat32);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < n; ++t) {
      const int64_t token = (b * n + t) * HA * W;
      for (int64_t j = 0; j < heads_; ++j)
        cache.stores[b][j].append(k.data_ptr<float>() + token + j * groups_ * W, v.data_ptr<float>() + token + j * groups_ * W);
      // Head groups in parallel, one thread each (their stores differ in length; one parallel
      // region per token instead of one per group).
      at::parallel_for(0, heads_, 1, [&](int64_t j0, int64_t j1) {
        for (int64_t j = j0; j < j1; ++j) {
          const int64_t at = token + j * groups_ * W;
          kernels::decode_attention(q.data_ptr<float>() + at, static_cast<int>(groups_), cache.stores[b][j],
                                    static_cast<float>(scale), out.data_ptr<float>() + at, 1);
        }
      });
    }
  return out.transpose(1, 2);
}

void NatslAttention::commit_block(NatslCache& cache) {
  torch::NoGradGuard ng;
  const auto pooled = torch::cat(cache.block_inputs, 1).mean(1).unsqueeze(1);  // [B, 1, d]
  const auto chosen = choose_routes(router_probs(pooled), budget_, cache.softmax_counts,
                                    static_cast<int64_t>(cache.routes.size()), false);
  const auto route = chosen.argmax(-1).select(1, 0).to(torch::kLong).contiguous();  // [B, H], 1 = GDN
  const auto r = route.accessor<int64_t, 2>();
  for (int64_t b = 0; b < route.size(0); ++b)
    for (int64_t j = 0; j < heads_; ++j)
      if (r[b][j] == 1) cache.drop_newest(b, j, block_);  // the state keeps the block; its KV goes
  const auto dtype = cache.running.scalar_type();
  const auto D = cache.g_sum.to(dtype).exp().unsqueeze(-1).unsqueeze(-1) * cache.committed.to(dtype);
  const auto m = route.to(dtype).unsqueeze(-1).unsqueeze(-1);
  cache.committed = (D + m * (cache.running - D)).contiguous();
  cache.running = cache.committed.clone();
  cache.g_sum.zero_();
  cache.block_inputs.clear();
  cache.block_filled = 0;
  cache.routes.push_back(route);
}

}  // namespace kvx::attention

// kvx's attention operators for Python: the fused torch-free decode kernels (dense, LRKV
// factored, MLA absorbed, LLA reconstruct-on-read) beside their plain references, and the
// libtorch operators (causal attention, RoPE, GDN recurrent/chunked, NAtS-L routing, Nectar
// composition, the LLA codec). Each checks its shapes and names the argument that is wrong.
#include <pybind11/stl.h>

#include <cmath>

#include "attention/dense.h"
#include "attention/gdn.h"
#include "attention/lla.h"
#include "attention/natsl.h"
#include "attention/nectar.h"
#include "kernels/decode_attention.h"
#include "kernels/kv_store.h"
#include "kernels/lrkv_decode.h"
#include "nn/layers.h"
#include "nn/tensor_io.h"
#include "python/arrays.h"
#include "util/error.h"

namespace kvx::python {

namespace {

using torch::Tensor;

float default_scale(std::optional<double> scale, int64_t width) {
  return static_cast<float>(scale ? *scale : 1.0 / std::sqrt(static_cast<double>(width)));
}

kernels::Eviction eviction(int64_t sink, int64_t window) {
  if (sink < 0 || window < 0 || (sink > 0 && window == 0))
    throw Error("eviction: sink and window must be >= 0 and a sink needs a window (got sink " + std::to_string(sink) +
                ", window " + std::to_string(window) + ")");
  return {sink, window};
}

// Rows [L, heads, width] (f32, contiguous) appended to a store one token at a time.
void append_rows(kernels::KVStore& store, const Tensor& k, const Tensor* v) {
  const int64_t row = k.numel() / std::max<int64_t>(k.size(0), 1);
  for (int64_t t = 0; t < k.size(0); ++t)
    store.append(k.data_ptr<float>() + t * row, v ? v->data_ptr<float>() + t * row : nullptr);
}

Tensor f32(const py::array& a) { return to_float(a, false); }

// q [heads, width] of a single-token kernel: at least one head of positive width.
void require_heads(const Tensor& q) {
  if (q.size(0) < 1 || q.size(1) < 1) throw Error("q must hold at least one head of positive width, got shape " + nn::shape_of(q));
}

// --- fused decode kernels ---------------------------------------------------------------------

py::array decode_attention(const py::array& q_in, const py::array& k_in, const py::array& v_in, std::optional<double> scale,
                           const std::string& kv_cache, int64_t sink, int64_t window, std::optional<py::array> extra_logit,
                           std::optional<py::array> extra_value, bool reference, int threads) {
  const auto q = f32(q_in), k = f32(k_in), v = f32(v_in);
  require_shape(q, "q", {-1, -1}, "[heads, head_dim]");
  const int64_t H = q.size(0), d = q.size(1);
  require_heads(q);
  require_shape(k, "k", {-1, -1, d}, "[tokens, kv_heads, head_dim] with q's head_dim " + std::to_string(d));
  require_shape(v, "v", {k.size(0), k.size(1), d}, "k's shape " + nn::shape_of(k));
  const int64_t Hkv = k.size(1);
  if (Hkv == 0 || H % Hkv != 0)
    throw Error("q's " + std::to_string(H) + " heads must be a multiple of k's " + std::to_string(Hkv) + " KV heads");
  if (extra_logit.has_value() != extra_value.has_value())
    throw Error("give extra_logit and extra_value together (one virtual row per query head), or neither");
  Tensor el, ev;
  kernels::VirtualPair pair;
  if (extra_logit) {
    el = f32(*extra_logit), ev = f32(*extra_value);
    require_shape(el, "extra_logit", {H}, "[heads]");
    require_shape(ev, "extra_value", {H, d}, "[heads, head_dim]");
    pair = {el.data_ptr<float>(), ev.data_ptr<float>()};
  } else if (k.size(0) == 0) {
    throw Error("k holds no tokens; give at least one row (or an extra_logit/extra_value pair)");
  }
  const auto type = kernels::parse_kv_type(kv_cache);
  kernels::KVStore store(type, static_cast<int>(Hkv), static_cast<int>(d), eviction(sink, window), 256, false,
                         kernels::decode_kv_layout(type, static_cast<int>(d), false, kernels::DecodeIsa::Auto,
                                                   static_cast<int>(H / Hkv)));
  append_rows(store, k, &v);
  auto out = torch::empty({H, d}, torch::kFloat32);
  const float s = default_scale(scale, d);
  const auto* extra = extra_logit ? &pair : nullptr;
  if (reference)
    kernels::decode_attention_reference(q.data_ptr<float>(), static_cast<int>(H), store, s, out.data_ptr<float>(), false, extra);
  else
    kernels::decode_attention(q.data_ptr<float>(), static_cast<int>(H), store, s, out.data_ptr<float>(), threads,
                              kernels::DecodeIsa::Auto, extra);
  return to_array(out);
}

py::tuple lrkv_decode(const py::array& q_in, std::optional<py::array> qb_in, const py::array& ks_in, const py::array& vs_in,
                      std::optional<py::array> rk_in, std::optional<py::array> rv_in, std::optional<double> scale,
                      const std::string& kv_cache, bool reference, int threads) {
  const auto q = f32(q_in), ks = f32(ks_in), vs = f32(vs_in);
  require_shape(q, "q", {-1, -1}, "[heads, head_dim]");
  const int64_t H = q.size(0), d = q.size(1);
  require_heads(q);
  require_shape(ks, "k_shared", {-1, d}, "[tokens, head_dim]");
  require_shape(vs, "v_shared", {ks.size(0), d}, "k_shared's shape " + nn::shape_of(ks));
  if (ks.size(0) == 0) throw Error("k_shared holds no tokens; give at least one row");
  const bool residual = rk_in.has_value();
  if (residual != rv_in.has_value() || residual != qb_in.has_value())
    throw Error("give qb, r_k and r_v together (rank r > 0), or none of them (r = 0: one shared K/V)");
  const auto type = kernels::parse_kv_type(kv_cache);
  kernels::KVStore shared(type, 1, static_cast<int>(d), {}, 256, false, kernels::decode_kv_layout(type, static_cast<int>(d)));
  append_rows(shared, ks, &vs);
  int64_t r = 0;
  Tensor qb, rk, rv;
  std::optional<kernels::KVStore> latents;
  if (residual) {
    qb = f32(*qb_in), rk = f32(*rk_in), rv = f32(*rv_in);
    require_shape(qb, "qb", {H, -1}, "[heads, rank] (q_h B_h^K)");
    r = qb.size(1);
    if (r > d) throw Error("the rank " + std::to_string(r) + " exceeds head_dim " + std::to_string(d) + "; use r <= head_dim");
    require_shape(rk, "r_k", {ks.size(0), H, r}, "[tokens, heads, rank] = [" + std::to_string(ks.size(0)) + ", " +
                                                     std::to_string(H) + ", " + std::to_string(r) + "]");
    require_shape(rv, "r_v", {ks.size(0), H, r}, "r_k's shape " + nn::shape_of(rk));
    if (r > 0 && (type == kernels::KVType::Q8 || type == kernels::KVType::Q4) && (H * r) % 32 != 0)
      throw Error("a " + kv_cache + " cache quantises a token's latents (heads x rank = " + std::to_string(H * r) +
                  " values) in blocks of 32, so that must be a multiple of 32; use f32 or bf16");
    if (r > 0) {
      latents.emplace(type, 1, static_cast<int>(H * r));
      append_rows(*latents, rk, &rv);
    }
  }
  auto out_s = torch::empty({H, d}, torch::kFloat32), out_r = torch::zeros({H, r}, torch::kFloat32);
  const float s = default_scale(scale, d);
  const auto* res = latents ? &*latents : nullptr;
  const float* qbp = r > 0 ? qb.data_ptr<float>() : nullptr;
  float* orp = r > 0 ? out_r.data_ptr<float>() : nullptr;
  if (reference)
    kernels::lrkv_decode_attention_reference(q.data_ptr<float>(), qbp, static_cast<int>(H), shared, res, s,
                                             out_s.data_ptr<float>(), orp);
  else
    kernels::lrkv_decode_attention(q.data_ptr<float>(), qbp, static_cast<int>(H), shared, res, s, out_s.data_ptr<float>(),
                                   orp, threads);
  return py::make_tuple(to_array(out_s), to_array(out_r));
}

py::array mla_decode(const py::array& q_in, const py::array& latents_in, std::optional<double> scale,
                     const std::string& kv_cache, bool reference, int threads) {
  const auto q = f32(q_in), c = f32(latents_in);
  require_shape(q, "q", {-1, -1}, "[heads, d_c + d_R] (q_h W_UK,h beside the rotated q_R,h)");
  const int64_t H = q.size(0), W = q.size(1);
  require_heads(q);
  require_shape(c, "latents", {-1, W}, "[tokens, d_c + d_R] rows [c | k_R] as wide as q");
  if (c.size(0) == 0) throw Error("latents holds no tokens; give at least one row");
  if (!scale) throw Error("mla_decode needs the scale: 1/sqrt(d_h + d_R) of the model, not of the latent width");
  const auto type = kernels::parse_kv_type(kv_cache);
  if ((type == kernels::KVType::Q8 || type == kernels::KVType::Q4) && W % 32 != 0)
    throw Error("a " + kv_cache + " cache quantises the latent rows [c | k_R] in blocks of 32, so d_c + d_R must be a "
                "multiple of 32 (it is " + std::to_string(W) + "); use f32 or bf16");
  kernels::KVStore store(type, 1, static_cast<int>(W), {}, 256, /*values_are_keys=*/true);
  append_rows(store, c, nullptr);
  auto out = torch::empty({H, W}, torch::kFloat32);
  const float s = static_cast<float>(*scale);
  if (reference)
    kernels::decode_attention_reference(q.data_ptr<float>(), static_cast<int>(H), store, s, out.data_ptr<float>());
  else
    kernels::decode_attention(q.data_ptr<float>(), static_cast<int>(H), store, s, out.data_ptr<float>(), threads);
  return to_array(out);
}

// --- libtorch operators -------------------------------------------------------------------------

py::array causal_attention(const py::array& q_in, const py::array& k_in, const py::array& v_in, int64_t q_start) {
  const auto q = to_float(q_in), k = to_float(k_in).to(q.scalar_type()), v = to_float(v_in).to(q.scalar_type());
  require_shape(q, "q", {-1, -1, -1, -1}, "[batch, heads, tokens, head_dim]");
  require_shape(k, "k", {q.size(0), -1, -1, q.size(3)}, "[batch, kv_heads, tokens, head_dim] matching q");
  require_shape(v, "v", {q.size(0), k.size(1), k.size(2), -1}, "[batch, kv_heads, tokens, value_dim] matching k");
  if (k.size(1) == 0 || q.size(1) % k.size(1) != 0)
    throw Error("q's " + std::to_string(q.size(1)) + " heads must be a multiple of k's " + std::to_string(k.size(1)) + " KV heads");
  if (q_start < 0 || q_start + q.size(2) > k.size(2))
    throw Error("queries at positions q_start .. q_start + T - 1 = " + std::to_string(q_start) + " .. " +
                std::to_string(q_start + q.size(2) - 1) + " need that many keys (k holds " + std::to_string(k.size(2)) + ")");
  torch::NoGradGuard ng;
  return to_array(attention::causal_attention(q, k, v, q_start));
}

py::array l2_normalize(const py::array& x) {
  torch::NoGradGuard ng;
  return to_array(attention::l2_normalize(to_float(x)));
}

py::array rope(const py::array& x_in, int64_t start, double theta) {
  const auto x = to_float(x_in);
  if (x.dim() < 2 || x.size(-1) % 2 != 0)
    throw Error("x must be [..., tokens, head_dim] with an even head_dim, got shape " + nn::shape_of(x));
  if (start < 0) throw Error("start must be >= 0 (got " + std::to_string(start) + ")");
  torch::NoGradGuard ng;
  const int64_t T = x.size(-2), d = x.size(-1);
  return to_array(nn::Rope(d, theta).apply(x.reshape({-1, 1, T, d}), start).reshape(x.sizes()));
}

struct GdnArgs {
  Tensor q, k, v, g, beta, state;
  double scale;
};
GdnArgs gdn_args(const py::array& q_in, const py::array& k_in, const py::array& v_in, const py::array& g_in,
                 const py::array& beta_in, std::optional<double> scale, std::optional<py::array> state_in,
                 bool keep_double = true) {
  GdnArgs a;
  a.q = to_float(q_in, keep_double);
  const auto type = a.q.scalar_type();
  a.k = to_float(k_in).to(type), a.v = to_float(v_in).to(type), a.g = to_float(g_in).to(type);
  a.beta = to_float(beta_in).to(type);
  require_shape(a.q, "q", {-1, -1, -1, -1}, "[batch, heads, tokens, key_dim] (L2-normalised)");
  const int64_t B = a.q.size(0), H = a.q.size(1), T = a.q.size(2), K = a.q.size(3);
  require_shape(a.k, "k", {B, H, T, K}, "q's shape " + nn::shape_of(a.q));
  require_shape(a.v, "v", {B, H, T, -1}, "[batch, heads, tokens, value_dim]");
  require_shape(a.g, "g", {B, H, T}, "[batch, heads, tokens] (log decay, <= 0)");
  require_shape(a.beta, "beta", {B, H, T}, "[batch, heads, tokens]");
  if (state_in) {
    a.state = to_float(*state_in).to(type);
    require_shape(a.state, "state", {B, H, K, a.v.size(3)}, "[batch, heads, key_dim, value_dim]");
  }
  a.scale = scale ? *scale : 1.0 / std::sqrt(static_cast<double>(K));
  return a;
}

py::tuple gdn(const py::array& q, const py::array& k, const py::array& v, const py::array& g, const py::array& beta,
              std::optional<double> scale, std::optional<py::array> state, const std::string& form, int64_t chunk,
              int threads) {
  torch::NoGradGuard ng;
  if (form == "fused") {
    auto a = gdn_args(q, k, v, g, beta, scale, state, false);
    if (!a.state.defined()) a.state = torch::zeros({a.q.size(0), a.q.size(1), a.q.size(3), a.v.size(3)}, torch::kFloat32);
    a.state = a.state.contiguous();
    auto o = attention::gdn_recurrent_fused(a.q, a.k, a.v, a.g, a.beta, a.scale, a.state, threads);
    return py::make_tuple(to_array(o), to_array(a.state));
  }
  auto a = gdn_args(q, k, v, g, beta, scale, state);
  std::pair<Tensor, Tensor> r;
  if (form == "recurrent") {
    r = attention::gdn_recurrent(a.q, a.k, a.v, a.g, a.beta, a.scale, a.state);
  } else if (form == "chunked") {
    if (chunk < 1) throw Error("chunk must be >= 1 (got " + std::to_string(chunk) + ")");
    r = attention::gdn_chunked(a.q, a.k, a.v, a.g, a.beta, a.scale, a.state, chunk);
  } else {
    throw Error("unknown GDN form '" + form + "'; use recurrent, chunked or fused");
  }
  return py::make_tuple(to_array(r.first), to_array(r.second));
}

py::array natsl_routes(const py::array& probs_in, double fraction, int64_t max_blocks, bool last_forced) {
  const auto probs = to_float(probs_in);
  if (!(fraction >= 0 && fraction <= 1)) throw Error("fraction must be in [0, 1] (got " + std::to_string(fraction) + ")");
  Tensor counts;
  return to_array(attention::choose_routes(probs, {fraction, max_blocks}, counts, 0, last_forced).argmax(-1));
}

// Routes [B, NB, H] (0 softmax, 1 GDN) -> the 0/1 mask of one branch.
Tensor route_mask(const py::array& routes_in, int64_t branch) {
  const auto routes = to_tensor(routes_in);
  if (routes.scalar_type() != torch::kInt64 && routes.scalar_type() != torch::kBool)
    throw Error("routes must be integers (0: softmax KV, 1: GDN state), [batch, blocks, heads]");
  return (routes.to(torch::kInt64) == branch).to(torch::kFloat32);
}

py::array natsl_softmax(const py::array& q_in, const py::array& k_in, const py::array& v_in, const py::array& routes,
                        int64_t block, std::optional<double> scale) {
  const auto q = to_float(q_in), k = to_float(k_in).to(q.scalar_type()), v = to_float(v_in).to(q.scalar_type());
  if (block < 1) throw Error("block must be >= 1 (got " + std::to_string(block) + ")");
  torch::NoGradGuard ng;
  const double s = scale ? *scale : 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  return to_array(attention::routed_softmax_attention(q, k, v, route_mask(routes, 0).to(q.scalar_type()), block, s));
}

py::tuple natsl_gdn(const py::array& q, const py::array& k, const py::array& v, const py::array& g, const py::array& beta,
                    const py::array& routes, int64_t block, std::optional<double> scale, bool reference) {
  if (block < 1) throw Error("block must be >= 1 (got " + std::to_string(block) + ")");
  torch::NoGradGuard ng;
  auto a = gdn_args(q, k, v, g, beta, scale, std::nullopt);
  const auto commit = route_mask(routes, 1).to(a.q.scalar_type());
  auto r = reference ? attention::gdn_routed_recurrent(a.q, a.k, a.v, a.g, a.beta, commit, block, a.scale)
                     : attention::gdn_routed_blocks(a.q, a.k, a.v, a.g, a.beta, commit, block, a.scale);
  return py::make_tuple(to_array(r.first), to_array(r.second));
}

py::tuple nectar_exact(const py::array& q_in, const py::array& k_in, const py::array& v_in) {
  const auto q = to_float(q_in), k = to_float(k_in).to(q.scalar_type()), v = to_float(v_in).to(q.scalar_type());
  require_shape(q, "q", {-1, -1, -1, -1}, "[batch, heads, tokens, head_dim] (rotated)");
  require_shape(k, "doc_k", {-1, -1, -1, q.size(3)}, "[batch or 1, kv_heads, doc_tokens, head_dim]");
  if (k.size(0) != 1 && k.size(0) != q.size(0))
    throw Error("doc_k's batch must be 1 (one document for every query row) or q's " + std::to_string(q.size(0)) + ", got " +
                nn::shape_of(k));
  require_shape(v, "doc_v", {k.size(0), k.size(1), k.size(2), q.size(3)}, "doc_k's shape " + nn::shape_of(k));
  if (k.size(2) == 0) throw Error("the document is empty (doc_k holds no tokens)");
  if (k.size(1) == 0 || q.size(1) % k.size(1) != 0)
    throw Error("q's " + std::to_string(q.size(1)) + " heads must be a multiple of doc_k's " + std::to_string(k.size(1)) + " KV heads");
  torch::NoGradGuard ng;
  const auto d = attention::exact_document_attention(q, k, v);
  return py::make_tuple(to_array(d.log_mass), to_array(d.content));
}

py::array nectar_compose(const py::array& q_in, std::optional<py::array> k_in, std::optional<py::array> v_in,
                         const py::array& log_mass_in, const py::array& content_in, int64_t q_start) {
  const auto q = to_float(q_in);
  const auto type = q.scalar_type();
  require_shape(q, "q", {-1, -1, -1, -1}, "[batch, heads, tokens, head_dim] (rotated)");
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), d = q.size(3);
  Tensor k, v;
  if (k_in.has_value() != v_in.has_value()) throw Error("give local_k and local_v together, or neither (no local tokens)");
  if (k_in) {
    k = to_float(*k_in).to(type), v = to_float(*v_in).to(type);
    require_shape(k, "local_k", {B, -1, -1, d}, "[batch, kv_heads, local_tokens, head_dim]");
    require_shape(v, "local_v", {B, k.size(1), k.size(2), d}, "local_k's shape " + nn::shape_of(k));
    if (k.size(1) == 0 || H % k.size(1) != 0) throw Error("q's heads must be a multiple of local_k's KV heads");
    if (q_start < 0 || q_start + T > k.size(2))
      throw Error("queries at local positions q_start .. q_start + T - 1 need that many local keys (local_k holds " +
                  std::to_string(k.size(2)) + ")");
  } else if (q_start != 0) {
    throw Error("q_start applies to local tokens; without local_k it must be 0");
  }
  attention::DocumentAttention doc{to_float(log_mass_in).to(type), to_float(content_in).to(type)};
  require_shape(doc.log_mass, "log_mass", {B, H, T}, "[batch, heads, tokens] (alpha)");
  require_shape(doc.content, "content", {B, H, T, d}, "[batch, heads, tokens, head_dim] (A)");
  torch::NoGradGuard ng;
  return to_array(attention::compose_document_attention(q, k, v, q_start, doc));
}

// --- LLA ----------------------------------------------------------------------------------------

attention::LlaCodecPart codec_part(const py::array& mu, const py::array& down, const py::array& up, const std::string& what) {
  attention::LlaCodecPart p{to_float(mu), to_float(down), to_float(up)};
  p.down = p.down.to(p.mu.scalar_type()), p.up = p.up.to(p.mu.scalar_type());
  require_shape(p.mu, what + " mu", {-1, -1}, "[groups, width]");
  require_shape(p.down, what + " down", {p.mu.size(0), p.mu.size(1), -1}, "[groups, width, rank]");
  require_shape(p.up, what + " up", {p.mu.size(0), p.mu.size(1), p.down.size(2)}, "down's shape " + nn::shape_of(p.down));
  if (p.down.size(2) > p.mu.size(1))
    throw Error(what + ": rank " + std::to_string(p.down.size(2)) + " exceeds the stacked width " + std::to_string(p.mu.size(1)));
  return p;
}

class LlaCodec {
 public:
  LlaCodec(const py::array& mu, const py::array& down, const py::array& up) : part_(codec_part(mu, down, up, "codec")) {}
  py::array encode(const py::array& x) const { return run([&] { return part_.encode(checked(x, part_.mu.size(1))); }); }
  py::array decode(const py::array& c) const { return run([&] { return part_.decode(checked(c, part_.rank())); }); }
  int64_t rank() const { return part_.rank(); }
  int64_t groups() const { return part_.mu.size(0); }
  int64_t width() const { return part_.mu.size(1); }
  const attention::LlaCodecPart& part() const { return part_; }

 private:
  Tensor checked(const py::array& a, int64_t last) const {
    auto t = to_float(a).to(part_.mu.scalar_type());
    if (t.dim() < 2 || t.size(-2) != part_.mu.size(0) || t.size(-1) != last)
      throw Error("expected [..., " + std::to_string(part_.mu.size(0)) + " groups, " + std::to_string(last) + "], got " +
                  nn::shape_of(t));
    return t;
  }
  template <class F>
  static py::array run(F f) {
    torch::NoGradGuard ng;
    return to_array(f());
  }
  attention::LlaCodecPart part_;
};

// One layer's LLA decode store (attention/lla.h): chunks commit their stacked K/V as codes, and
// each loop's reads reconstruct the history through the fused kernel.
class LlaStore {
 public:
  LlaStore(const LlaCodec& keys, const LlaCodec& values, int loops, int kv_heads, int head_dim, bool two_d, bool absorbed,
           int64_t sink, int64_t window, double rope_theta, int threads)
      : rope_(nn::Rope(std::max(head_dim, 2), rope_theta)) {
    if (loops < 1 || kv_heads < 1 || head_dim < 2 || head_dim % 2 != 0)
      throw Error("an LLA store needs loops >= 1, kv_heads >= 1 and an even head_dim >= 2 (got loops " + std::to_string(loops) +
                  ", kv_heads " + std::to_string(kv_heads) + ", head_dim " + std::to_string(head_dim) + ")");
    attention::LlaCodecSet set;
    set.loops = loops, set.kv_heads = kv_heads, set.head_dim = head_dim, set.two_d = two_d;
    const int64_t width = static_cast<int64_t>(loops) * head_dim * (two_d ? kv_heads : 1);
    const int64_t groups = two_d ? 1 : kv_heads;
    for (const auto* c : {&keys, &values})
      if (c->groups() != groups || c->width() != width)
        throw Error("the codec is [" + std::to_string(c->groups()) + " groups, width " + std::to_string(c->width()) +
                    "]; this store needs [" + std::to_string(groups) + ", " + std::to_string(width) +
                    "] (groups = kv_heads, or 1 with two_d; width = loops x head_dim, x kv_heads with two_d)");
    set.layers.push_back({keys.part(), values.part()});
    attention::CacheOptions o;
    o.evict = eviction(sink, window);
    o.lla_absorbed = absorbed;
    o.threads = threads;
    store_ = std::make_unique<attention::LlaLayerStore>(set, 0, o);
  }
  // Loop `loop`'s keys (before RoPE) and values of the chunk in flight: [B, kv_heads, n, head_dim].
  void set_pending(int loop, const py::array& k, const py::array& v) { store_->set_pending(loop, f32(k), f32(v)); }
  void commit() { store_->commit(); }
  // q [B, H, n, d] (RoPE'd at positions committed .. committed + n - 1); k, v the chunk's
  // [B, kv_heads, n, d]; q_pre (absorbed reads) q before RoPE.
  py::array attend(int loop, const py::array& q, const py::array& k, const py::array& v, std::optional<py::array> q_pre) {
    Tensor qp;
    if (q_pre) qp = f32(*q_pre);
    torch::NoGradGuard ng;
    return to_array(store_->attend(loop, f32(q), qp, f32(k), f32(v), rope_.inv_freq()));  // shapes checked by the store
  }
  py::tuple history(int loop) const {
    auto [k, v] = store_->history(loop);
    if (!k.defined()) return py::make_tuple(py::none(), py::none());
    return py::make_tuple(to_array(k), to_array(v));
  }
  int64_t committed() const { return store_->committed(); }
  int64_t bytes() const { return store_->bytes(); }

 private:
  std::unique_ptr<attention::LlaLayerStore> store_;
  nn::Rope rope_;
};

}  // namespace

void register_ops(py::module_& m) {
  using namespace pybind11::literals;
  auto none = py::none();
  m.def("decode_attention", &decode_attention, "q"_a, "k"_a, "v"_a, "scale"_a = none, "kv_cache"_a = "f32", "sink"_a = 0,
        "window"_a = 0, "extra_logit"_a = none, "extra_value"_a = none, "reference"_a = false, "threads"_a = 0);
  m.def("lrkv_decode", &lrkv_decode, "q"_a, "qb"_a, "k_shared"_a, "v_shared"_a, "r_k"_a, "r_v"_a, "scale"_a = none,
        "kv_cache"_a = "f32", "reference"_a = false, "threads"_a = 0);
  m.def("mla_decode", &mla_decode, "q"_a, "latents"_a, "scale"_a, "kv_cache"_a = "f32", "reference"_a = false, "threads"_a = 0);
  m.def("causal_attention", &causal_attention, "q"_a, "k"_a, "v"_a, "q_start"_a = 0);
  m.def("l2_normalize", &l2_normalize, "x"_a);
  m.def("rope", &rope, "x"_a, "start"_a = 0, "theta"_a = 10000.0);
  m.def("gdn", &gdn, "q"_a, "k"_a, "v"_a, "g"_a, "beta"_a, "scale"_a = none, "state"_a = none, "form"_a = "chunked",
        "chunk"_a = 64, "threads"_a = 0);
  m.def("natsl_routes", &natsl_routes, "probs"_a, "fraction"_a = 1.0, "max_blocks"_a = 0, "last_forced"_a = false);
  m.def("natsl_softmax", &natsl_softmax, "q"_a, "k"_a, "v"_a, "routes"_a, "block"_a, "scale"_a = none);
  m.def("natsl_gdn", &natsl_gdn, "q"_a, "k"_a, "v"_a, "g"_a, "beta"_a, "routes"_a, "block"_a, "scale"_a = none,
        "reference"_a = false);
  m.def("nectar_exact", &nectar_exact, "q"_a, "doc_k"_a, "doc_v"_a);
  m.def("nectar_compose", &nectar_compose, "q"_a, "local_k"_a, "local_v"_a, "log_mass"_a, "content"_a, "q_start"_a = 0);
  py::class_<LlaCodec>(m, "LlaCodec")
      .def(py::init<const py::array&, const py::array&, const py::array&>(), "mu"_a, "down"_a, "up"_a)
      .def("encode", &LlaCodec::encode, "x"_a)
      .def("decode", &LlaCodec::decode, "codes"_a)
      .def_property_readonly("rank", &LlaCodec::rank)
      .def_property_readonly("groups", &LlaCodec::groups)
      .def_property_readonly("width", &LlaCodec::width);
  py::class_<LlaStore>(m, "LlaStore")
      .def(py::init<const LlaCodec&, const LlaCodec&, int, int, int, bool, bool, int64_t, int64_t, double, int>(), "keys"_a,
           "values"_a, "loops"_a, "kv_heads"_a, "head_dim"_a, "two_d"_a = false, "absorbed"_a = false, "sink"_a = 0,
           "window"_a = 0, "rope_theta"_a = 10000.0, "threads"_a = 0)
      .def("set_pending", &LlaStore::set_pending, "loop"_a, "k"_a, "v"_a)
      .def("commit", &LlaStore::commit)
      .def("attend", &LlaStore::attend, "loop"_a, "q"_a, "k"_a, "v"_a, "q_pre"_a = none)
      .def("history", &LlaStore::history, "loop"_a)
      .def_property_readonly("committed", &LlaStore::committed)
      .def_property_readonly("bytes", &LlaStore::bytes);
}

}  // namespace kvx::python

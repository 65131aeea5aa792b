#include "attention/nectar.h"

#include <cmath>

#include "util/error.h"
#include "util/strings.h"

namespace kvx::attention {

namespace {

double inv_sqrt(int64_t d) { return 1.0 / std::sqrt(static_cast<double>(d)); }

void check_queries(const torch::Tensor& q, int64_t kv_heads, int64_t head_dim, const char* who) {
  if (q.dim() != 4 || q.size(1) % kv_heads != 0 || q.size(3) != head_dim)
    throw Error(std::string(who) + ": queries must be [B, H, T, d_h] with H a multiple of " + std::to_string(kv_heads) +
                " and d_h = " + std::to_string(head_dim) + ", got " + c10::str(q.sizes()));
}

}  // namespace

DocumentAttention exact_document_attention(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values) {
  if (keys.dim() != 4 || values.sizes() != keys.sizes() || keys.size(2) == 0)
    throw Error("exact_document_attention: document keys and values must be equal [B, Hkv, n, d_h] with n >= 1, got " +
                c10::str(keys.sizes()) + " and " + c10::str(values.sizes()));
  check_queries(q, keys.size(1), keys.size(3), "exact_document_attention");
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), d = q.size(3), Hkv = keys.size(1);
  const auto qg = q.reshape({B, Hkv, H / Hkv * T, d});
  const auto s = torch::matmul(qg, keys.to(q.scalar_type()).transpose(-1, -2)) * inv_sqrt(d);  // [B, Hkv, G T, n]
  return {torch::logsumexp(s, -1).reshape({B, H, T}),
          torch::matmul(torch::softmax(s, -1), values.to(q.scalar_type())).reshape({B, H, T, d})};
}

torch::Tensor compose_document_attention(const torch::Tensor& q, const torch::Tensor& local_keys,
                                         const torch::Tensor& local_values, int64_t q_start, const DocumentAttention& doc) {
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), d = q.size(3);
  if (doc.log_mass.sizes() != torch::IntArrayRef({B, H, T}) || doc.content.sizes() != q.sizes())
    throw Error("compose_document_attention: the document pair must be [B, H, T] and [B, H, T, d_h] like the queries " +
                c10::str(q.sizes()) + ", got " + c10::str(doc.log_mass.sizes()) + " and " + c10::str(doc.content.sizes()));
  const bool has_local = local_keys.defined() && local_keys.size(2) > 0;
  if (!has_local) return doc.content;
  const int64_t Hkv = local_keys.size(1), Tk = local_keys.size(2), G = H / Hkv;
  const auto qg = q.reshape({B, Hkv, G * T, d});
  const auto scores = causal_mask((torch::matmul(qg, local_keys.transpose(-1, -2)) * inv_sqrt(d)).view({B, Hkv, G, T, Tk}), q_start);
  // One virtual key in front of the local ones: softmax over [alpha, s_loc] is the stable form of Eq. 3.5.
  const auto all = torch::cat({doc.log_mass.view({B, Hkv, G, T, 1}).to(scores.scalar_type()), scores}, -1);
  const auto p = torch::softmax(all, -1);
  const auto local = torch::matmul(p.narrow(-1, 1, Tk).reshape({B, Hkv, G * T, Tk}), local_values).view({B, Hkv, G, T, d});
  return (p.narrow(-1, 0, 1) * doc.content.view({B, Hkv, G, T, d}) + local).reshape({B, H, T, d});
}

// ---- architecture -------------------------------------------------------------------------------

nlohmann::json NectarArch::to_json() const {
  nlohmann::json j{{"kind", kind}};
  if (kind == "mlp") j["depths"] = {backbone_depth, score_depth, target_depth};
  return j;
}

NectarArch NectarArch::from_json(const nlohmann::json& j) {
  NectarArch a;
  a.kind = j.at("kind").get<std::string>();
  if (a.kind == "mlp") {
    const auto d = j.at("depths").get<std::vector<int>>();
    if (d.size() != 3) throw Error("Nectar arch: depths must be [D_b, D_s, D_t]");
    a.backbone_depth = d[0], a.score_depth = d[1], a.target_depth = d[2];
  }
  a.validate();
  return a;
}

NectarArch NectarArch::parse(const std::string& kind, const std::string& depths) {
  NectarArch a;
  a.kind = kind;
  if (!depths.empty()) {
    std::vector<int> d;
    size_t start = 0;
    while (start <= depths.size()) {
      const size_t comma = std::min(depths.find(',', start), depths.size());
      const std::string item = depths.substr(start, comma - start);
      const auto depth = whole_int(item);  // "1x" is not 1
      if (!depth)
        throw Error("--depths '" + depths + "': expected three integers D_b,D_s,D_t, e.g. 1,1,2");
      d.push_back(*depth);
      start = comma + 1;
    }
    if (d.size() != 3) throw Error("--depths '" + depths + "': expected three integers D_b,D_s,D_t, e.g. 1,1,2");
    a.backbone_depth = d[0], a.score_depth = d[1], a.target_depth = d[2];
  }
  a.validate();
  return a;
}

void NectarArch::validate() const {
  if (kind != "mlp" && kind != "quadrature")
    throw Error("unknown Nectar architecture '" + kind + "' (valid: mlp, quadrature)");
  if (kind == "mlp" && (backbone_depth < 0 || score_depth < 0 || target_depth < 0 || backbone_depth + score_depth < 1 ||
                        backbone_depth + target_depth < 1))
    throw Error("Nectar MLP depths (" + std::to_string(backbone_depth) + "," + std::to_string(score_depth) + "," +
                std::to_string(target_depth) + ") must be >= 0 with D_b + D_s >= 1 and D_b + D_t >= 1");
}

// ---- layers -------------------------------------------------------------------------------------

int64_t NectarLayer::parameters_per_head() const {
  int64_t n = 0;
  for (const auto& p : parameters()) n += p.numel();
  return n / kv_heads_;
}

torch::Tensor NectarLayer::by_kv_head(const torch::Tensor& q) const {
  check_queries(q, kv_heads_, head_dim_, "Nectar module");
  if (q.size(1) != heads_)
    throw Error("Nectar module: fitted for " + std::to_string(heads_) + " query heads, got " + std::to_string(q.size(1)));
  const int64_t B = q.size(0), T = q.size(2), G = heads_ / kv_heads_;
  return q.view({B, kv_heads_, G, T, head_dim_}).permute({1, 0, 2, 3, 4}).reshape({kv_heads_, B * G * T, head_dim_});
}

torch::Tensor NectarLayer::by_query_head(const torch::Tensor& x, int64_t B, int64_t T) const {
  const int64_t G = heads_ / kv_heads_, w = x.size(2);
  return x.view({kv_heads_, B, G, T, w}).permute({1, 0, 2, 3, 4}).reshape({B, heads_, T, w});
}

int64_t NectarMlp::parameter_count(const NectarArch& a, int head_dim, int64_t w) {
  const int64_t d = head_dim;
  const auto stack = [&](int depth, bool first_has_rec) {
    int64_t n = 0;
    for (int k = 0; k < depth; ++k) n += w * d + w + ((k > 0 || first_has_rec) ? w * w : 0);
    return n;
  };
  const bool after_backbone = a.backbone_depth > 0;
  return stack(a.backbone_depth, false) + stack(a.score_depth, after_backbone) + stack(a.target_depth, after_backbone) +
         (w + 1) + (w * d + d);
}

int64_t NectarMlp::width_for_budget(const NectarArch& a, int head_dim, double budget) {
  if (parameter_count(a, head_dim, 1) > budget)
    throw Error("a Nectar MLP with depths (" + std::to_string(a.backbone_depth) + "," + std::to_string(a.score_depth) + "," +
                std::to_string(a.target_depth) + ") needs at least " + std::to_string(parameter_count(a, head_dim, 1)) +
                " parameters per KV head but the budget is " + std::to_string(static_cast<int64_t>(budget)) +
                "; raise --rho, use a longer document, or fewer depths");
  int64_t w = 1;
  while (parameter_count(a, head_dim, w + 1) <= budget) ++w;
  return w;
}

NectarMlp::NectarMlp(int heads, int kv_heads, int head_dim, const NectarArch& arch, int64_t width)
    : NectarLayer(heads, kv_heads, head_dim, width) {
  arch.validate();
  if (arch.kind != "mlp") throw Error("NectarMlp: architecture is '" + arch.kind + "'");
  const int64_t w = width, d = head_dim, Hkv = kv_heads;
  const auto make = [&](const std::string& name, int depth, bool first_has_rec, std::vector<Depth>& stack) {
    for (int k = 0; k < depth; ++k) {
      const std::string p = name + std::to_string(k) + "_";
      Depth s;
      s.in = register_parameter(p + "in", torch::randn({Hkv, w, d}) * inv_sqrt(d));
      if (k > 0 || first_has_rec) s.rec = register_parameter(p + "rec", torch::randn({Hkv, w, w}) * inv_sqrt(w));
      s.bias = register_parameter(p + "bias", torch::zeros({Hkv, w}));
      stack.push_back(s);
    }
  };
  make("backbone", arch.backbone_depth, false, backbone_);
  make("score", arch.score_depth, arch.backbone_depth > 0, score_);
  make("target", arch.target_depth, arch.backbone_depth > 0, target_);
  score_out_ = register_parameter("score_out", torch::randn({Hkv, 1, w}) * (0.01 * inv_sqrt(w)));
  score_bias_ = register_parameter("score_bias", torch::zeros({Hkv, 1}));
  target_out_ = register_parameter("target_out", torch::randn({Hkv, d, w}) * (0.01 * inv_sqrt(w)));
  target_bias_ = register_parameter("target_bias", torch::zeros({Hkv, d}));
}

torch::Tensor NectarMlp::run(const std::vector<Depth>& stack, const torch::Tensor& x, torch::Tensor h) const {
  for (const auto& s : stack) {  // h_{k+1} = SiLU(V_k q + U_k h_k + b_k)
    auto pre = torch::baddbmm(s.bias.unsqueeze(1), x, s.in.transpose(1, 2));
    if (s.rec.defined()) pre = pre + torch::bmm(h, s.rec.transpose(1, 2));
    h = torch::silu(pre);
  }
  return h;
}

DocumentAttention NectarMlp::forward(const torch::Tensor& q) {
  const int64_t B = q.size(0), T = q.size(2);
  const auto x = by_kv_head(q);
  const auto h = run(backbone_, x, {});
  const auto hs = run(score_, x, h), ht = run(target_, x, h);
  const auto alpha = torch::baddbmm(score_bias_.unsqueeze(1), hs, score_out_.transpose(1, 2));  // [Hkv, N, 1]
  const auto content = torch::baddbmm(target_bias_.unsqueeze(1), ht, target_out_.transpose(1, 2));
  return {by_query_head(alpha, B, T).squeeze(-1), by_query_head(content, B, T)};
}

void NectarMlp::initialize(const torch::Tensor& q, const torch::Tensor& log_mass, const torch::Tensor& content) {
  torch::NoGradGuard no_grad;
  const int64_t N = q.size(0), G = heads_ / kv_heads_;
  // Per KV head: the statistics of its group's queries and targets.
  const auto qg = q.reshape({N, kv_heads_, G, head_dim_}).to(torch::kFloat32);
  const auto rms = qg.pow(2).mean(std::vector<int64_t>{0, 2, 3}).sqrt().clamp_min(1e-6);  // [Hkv]
  for (auto* stack : {&backbone_, &score_, &target_})
    for (auto& s : *stack) s.in.div_(rms.view({kv_heads_, 1, 1}));
  score_bias_.copy_(log_mass.reshape({N, kv_heads_, G}).mean(std::vector<int64_t>{0, 2}).unsqueeze(1));
  target_bias_.copy_(content.reshape({N, kv_heads_, G, head_dim_}).mean(std::vector<int64_t>{0, 2}));
}

NectarQuadrature::NectarQuadrature(int heads, int kv_heads, int head_dim, int64_t pairs)
    : NectarLayer(heads, kv_heads, head_dim, pairs) {
  if (pairs < 1) throw Error("Nectar Quadrature needs at least one pair");
  w_ = register_parameter("keys", torch::zeros({kv_heads, pairs, head_dim}));
  z_ = register_parameter("values", torch::zeros({kv_heads, pairs, head_dim}));
}

int64_t NectarQuadrature::pairs_for_budget(int head_dim, double budget) {
  const auto p = static_cast<int64_t>(std::floor(budget / (2.0 * head_dim)));
  if (p < 1)
    throw Error("a Nectar Quadrature pair costs " + std::to_string(2 * head_dim) + " parameters but the budget is " +
                std::to_string(static_cast<int64_t>(budget)) + "; raise --rho or use a longer document");
  return p;
}

void NectarQuadrature::initialize(const torch::Tensor& keys, const torch::Tensor& values) {
  if (keys.dim() != 3 || keys.size(0) != kv_heads_ || keys.size(2) != head_dim_ || values.sizes() != keys.sizes())
    throw Error("Nectar Quadrature init: cached pairs must be [Hkv, n, d_h] = [" + std::to_string(kv_heads_) + ", n, " +
                std::to_string(head_dim_) + "], got " + c10::str(keys.sizes()));
  if (keys.size(1) < size_)
    throw Error("Nectar Quadrature: " + std::to_string(size_) + " pairs initialised from a document of only " +
                std::to_string(keys.size(1)) + " tokens; lower --rho");
  torch::NoGradGuard no_grad;
  w_.copy_(keys.narrow(1, 0, size_));
  z_.copy_(values.narrow(1, 0, size_));
}

DocumentAttention NectarQuadrature::forward(const torch::Tensor& q) {
  const int64_t B = q.size(0), T = q.size(2);
  const auto s = torch::bmm(by_kv_head(q), w_.transpose(1, 2)) * inv_sqrt(head_dim_);  // [Hkv, N, p]
  return {by_query_head(torch::logsumexp(s, -1, true), B, T).squeeze(-1),
          by_query_head(torch::bmm(torch::softmax(s, -1), z_), B, T)};
}

ExactDocument::ExactDocument(int heads, const torch::Tensor& keys, const torch::Tensor& values)
    : NectarLayer(heads, static_cast<int>(keys.size(1)), static_cast<int>(keys.size(3)), keys.size(2)),
      keys_(keys), values_(values) {
  if (keys.dim() != 4 || keys.size(0) != 1 || values.sizes() != keys.sizes() || keys.size(2) == 0)
    throw Error("ExactDocument: keys and values must be equal [1, Hkv, n, d_h] with n >= 1, got " + c10::str(keys.sizes()));
}

DocumentAttention NoDocument::forward(const torch::Tensor& q) {
  check_queries(q, kv_heads_, head_dim_, "NoDocument");
  return {torch::full({q.size(0), q.size(1), q.size(2)}, -INFINITY, q.options()), torch::zeros_like(q)};
}

}  // namespace kvx::attention

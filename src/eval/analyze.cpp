#include "eval/analyze.h"

#include "attention/natsl.h"

#include <cmath>

namespace kvx::eval {

double centred_effective_rank(const torch::Tensor& wq_in, const torch::Tensor& wk_in) {
  torch::NoGradGuard ng;
  auto wq = wq_in.to(torch::kFloat64), wk = wk_in.to(torch::kFloat64);
  const int64_t H = wq.size(0);
  // G[h][g] = <A_h, A_g>_F = sum over d_h x d_h of (Wq_h^T Wq_g) * (Wk_h^T Wk_g).
  auto qq = torch::einsum("hdi,gdj->hgij", {wq, wq});
  auto kk = torch::einsum("hdi,gdj->hgij", {wk, wk});
  auto G = (qq * kk).sum({2, 3});
  auto norms = G.diagonal().clamp_min(1e-300).sqrt();
  G = G / torch::outer(norms, norms);
  auto J = torch::eye(H, torch::kFloat64) - torch::full({H, H}, 1.0 / H, torch::kFloat64);
  auto Gc = torch::matmul(torch::matmul(J, G), J);
  auto eig = torch::linalg::eigvalsh(Gc, "L").clamp_min(0.0);
  const double total = eig.sum().item<double>();
  if (total < 1e-12) return 0.0;
  auto p = eig / total;
  auto nz = p.masked_select(p > 1e-15);
  return std::exp(-(nz * nz.log()).sum().item<double>());
}

std::vector<HeadDiversity> head_diversity(const model::Transformer& model) {
  std::vector<HeadDiversity> out;
  const auto kinds = model->config().layer_kinds();
  const auto& layers = *model->layers;
  for (size_t i = 0; i < layers.size(); ++i) {
    torch::Tensor wq, wk;
    if (!layers[i]->as<model::BlockImpl>()->self_attn->head_projections(wq, wk)) continue;
    out.push_back({static_cast<int>(i), kinds[i], static_cast<int>(wq.size(0)), centred_effective_rank(wq, wk)});
  }
  return out;
}

nlohmann::json to_json(const std::vector<HeadDiversity>& rows) {
  nlohmann::json j = nlohmann::json::array();
  for (const auto& r : rows)
    j.push_back({{"layer", r.layer},
                 {"kind", r.kind},
                 {"heads", r.heads},
                 {"effective_rank", r.effective_rank},
                 {"ceiling", r.heads - 1},
                 {"share_of_ceiling", r.share_of_ceiling()},
                 {"share_of_heads", r.share_of_heads()}});
  return j;
}

nlohmann::json RoutingStats::to_json() const {
  return {{"layers", layers}, {"softmax_fraction", softmax_fraction}, {"overall", overall},
          {"kv_bytes_per_token", kv_bytes_per_token}};
}

RoutingStats routing_fractions(model::Transformer& model,
                               const std::vector<std::pair<torch::Tensor, torch::Tensor>>& windows) {
  RoutingStats st;
  std::vector<std::shared_ptr<attention::NatslAttention>> natsl;
  for (size_t i = 0; i < model->layers->size(); ++i)
    if (auto m = std::dynamic_pointer_cast<attention::NatslAttention>(model->layers[i]->as<model::BlockImpl>()->self_attn)) {
      natsl.push_back(m);
      st.layers.push_back(static_cast<int>(i));
    }
  if (natsl.empty() || windows.empty()) return st;
  std::vector<torch::Tensor> softmax(natsl.size()), total(natsl.size());
  torch::NoGradGuard ng;
  for (const auto& w : windows) {
    model->forward(w.first);
    for (size_t l = 0; l < natsl.size(); ++l) {
      const auto& r = natsl[l]->last_routes();  // [B, NB, H]
      if (r.size(1) < 2) continue;
      const auto routed = r.narrow(1, 0, r.size(1) - 1);  // the last block is forced to GDN
      const auto s = (routed == 0).to(torch::kDouble).sum(torch::IntArrayRef{0, 1});
      const auto n = torch::full_like(s, static_cast<double>(routed.size(0) * routed.size(1)));
      softmax[l] = softmax[l].defined() ? softmax[l] + s : s;
      total[l] = total[l].defined() ? total[l] + n : n;
    }
  }
  double all_s = 0, all_n = 0;
  const auto& cfg = model->config();
  const double full = attention::AttentionShape::of_layer(cfg, "natsl").cache_bytes(kernels::KVType::F32) /
                      cfg.nats_max_softmax_fraction;  // every block kept
  st.kv_bytes_per_token = model->kv_bytes_per_token();
  for (size_t l = 0; l < natsl.size(); ++l) {
    std::vector<double> row;
    double layer_fraction = 0;
    if (total[l].defined()) {
      const auto f = (softmax[l] / total[l]).contiguous();
      row.assign(f.data_ptr<double>(), f.data_ptr<double>() + f.numel());
      all_s += softmax[l].sum().item<double>();
      all_n += total[l].sum().item<double>();
      layer_fraction = (softmax[l].sum() / total[l].sum()).item<double>();
    }
    st.softmax_fraction.push_back(row);
    // The accounting counted the budget fraction for this layer; the measured one replaces it.
    st.kv_bytes_per_token += full * (layer_fraction - cfg.nats_max_softmax_fraction);
  }
  st.overall = all_n > 0 ? all_s / all_n : 0;
  return st;
}

}  // namespace kvx::eval

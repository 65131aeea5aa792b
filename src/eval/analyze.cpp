#include "eval/analyze.h"

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
                 {"share_of_ceiling", r.share_of_ceiling()}});
  return j;
}

}  // namespace kvx::eval

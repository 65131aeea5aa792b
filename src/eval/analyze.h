// Head diversity (seed 000 Sec. 4.3, SPEC 1.1): per layer, the bilinear forms
// A_h = W_h^Q (W_h^K)^T (the unscaled, position-free attention logit x_i A_h x_j^T), their Gram
// matrix after normalising each A_h, centred G_c = J G J (J = I - 11^T/H), and the effective rank
// r_eff = exp(entropy of G_c's eigenvalue shares), at most H - 1.
#pragma once
#include <nlohmann/json.hpp>

#include "model/transformer.h"

namespace kvx::eval {

struct HeadDiversity {
  int layer;
  std::string kind;
  int heads;
  double effective_rank;  // 0 when every head has the same form (G_c = 0)
  double share_of_ceiling() const { return heads > 1 ? effective_rank / (heads - 1) : 0.0; }
};

// From per-head projections wq, wk: [H, d, d_h]. Computed in double without forming A_h:
// <A_h, A_g>_F = sum((W_h^Q^T W_g^Q) * (W_h^K^T W_g^K)).
double centred_effective_rank(const torch::Tensor& wq, const torch::Tensor& wk);

// Every layer whose mixer has per-head softmax keys.
std::vector<HeadDiversity> head_diversity(const model::Transformer& model);
nlohmann::json to_json(const std::vector<HeadDiversity>& rows);

}  // namespace kvx::eval

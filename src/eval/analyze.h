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
  double share_of_heads() const { return heads > 0 ? effective_rank / heads : 0.0; }  // seed 000 Table 3's unit
};

// From per-head projections wq, wk: [H, d, d_h]. Computed in double without forming A_h:
// <A_h, A_g>_F = sum((W_h^Q^T W_g^Q) * (W_h^K^T W_g^K)).
double centred_effective_rank(const torch::Tensor& wq, const torch::Tensor& wk);

// Every layer whose mixer has per-head softmax keys.
std::vector<HeadDiversity> head_diversity(const model::Transformer& model);
nlohmann::json to_json(const std::vector<HeadDiversity>& rows);

// NAtS-L routing (seed 001 Fig. 5): per NAtS-L layer and head group, the fraction of blocks the
// router sent to softmax over the given windows (each window's forced last block excluded), and
// what the kept KV costs per token at that fraction (all layers, f32, the other layers' caches as
// they are).
struct RoutingStats {
  std::vector<int> layers;                             // indices of the NAtS-L layers
  std::vector<std::vector<double>> softmax_fraction;   // [layer][head group]
  double overall = 0;                                  // over all NAtS-L layers and groups
  double kv_bytes_per_token = 0;
  nlohmann::json to_json() const;
};
// Windows as from train::evaluation_batches (inputs, targets); empty stats if no NAtS-L layer.
RoutingStats routing_fractions(model::Transformer& model,
                               const std::vector<std::pair<torch::Tensor, torch::Tensor>>& windows);

}  // namespace kvx::eval

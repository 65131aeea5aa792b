// Gated DeltaNet (SPEC 1.2; seed 001's GDN branch): the core recurrence in two forms that must
// agree, per head, state S [K x V]:
//   S = exp(g_t) S;   u_t = beta_t (v_t - S^T k_t);   S = S + k_t u_t^T;   o_t = S^T (scale q_t)
// q and k are L2-normalised by the caller (l2_normalize) and g_t <= 0 is a natural-log decay.
//
// gdn_recurrent: token by token (the reference; also the decode step).
// gdn_chunked: chunks of C tokens in parallel (the WY / UT-transform form). Inside a chunk with
// start state S_0, gamma_t = sum_{i<=t} g_i and G_t = exp(gamma_t):
//   (I + diag(beta) L) U = diag(beta) (V - diag(G) K S_0),   L_ti = exp(gamma_t - gamma_i) k_t.k_i (i < t)
//   O = scale (diag(G) Q S_0 + (M o Q K^T) U),                M_ti = exp(gamma_t - gamma_i) (i <= t)
//   S_C = G_C S_0 + K^T diag(exp(gamma_C - gamma)) U
// Both differentiate through libtorch autograd (the triangular solve included).
#pragma once
#include <torch/torch.h>

#include <utility>

namespace kvx::attention {

// x / sqrt(sum x^2 + 1e-6) over the last dimension (SPEC 1.2).
torch::Tensor l2_normalize(const torch::Tensor& x);

// q, k [B, H, T, K], v [B, H, T, V], g, beta [B, H, T]; state [B, H, K, V] or undefined (zeros).
// Returns (o [B, H, T, V], final state [B, H, K, V]).
std::pair<torch::Tensor, torch::Tensor> gdn_recurrent(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                                      const torch::Tensor& g, const torch::Tensor& beta, double scale,
                                                      torch::Tensor state = {});
std::pair<torch::Tensor, torch::Tensor> gdn_chunked(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                                    const torch::Tensor& g, const torch::Tensor& beta, double scale,
                                                    torch::Tensor state = {}, int64_t chunk = 64);

}  // namespace kvx::attention

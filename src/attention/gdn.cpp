#include "attention/gdn.h"

#include <string>

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

}  // namespace kvx::attention

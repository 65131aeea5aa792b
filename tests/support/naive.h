// Plain fp64 reference pieces shared by the attention tests, one scalar at a time.
#pragma once
#include <torch/torch.h>

#include <cmath>
#include <vector>

namespace kvx::testing {

// Rotate-half RoPE of x: [T, w] at positions start.., pair i = dims (i, i + w/2) turning with
// inverse frequency inv_freq[i] (default: theta^(-2i/w)).
inline torch::Tensor naive_rope(const torch::Tensor& x, double theta, int64_t start = 0, std::vector<double> inv_freq = {}) {
  const int64_t T = x.size(0), D = x.size(1), half = D / 2;
  if (inv_freq.empty())
    for (int64_t i = 0; i < half; ++i) inv_freq.push_back(std::pow(theta, -2.0 * i / D));
  std::vector<torch::Tensor> rows;
  for (int64_t t = 0; t < T; ++t) {
    std::vector<torch::Tensor> a(D);
    for (int64_t i = 0; i < half; ++i) {
      const double ang = (start + t) * inv_freq[i];
      a[i] = x[t][i] * std::cos(ang) - x[t][i + half] * std::sin(ang);
      a[i + half] = x[t][i + half] * std::cos(ang) + x[t][i] * std::sin(ang);
    }
    rows.push_back(torch::stack(a));
  }
  return torch::stack(rows);
}

// Causal softmax attention of one head with an explicit loop: q, k [T, w], v [T, d], scale.
inline torch::Tensor naive_head(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, double scale) {
  std::vector<torch::Tensor> rows;
  for (int64_t i = 0; i < q.size(0); ++i) {
    std::vector<torch::Tensor> s;
    for (int64_t j = 0; j <= i; ++j) s.push_back((q[i] * k[j]).sum() * scale);
    auto sc = torch::stack(s);
    auto p = torch::exp(sc - sc.max());
    p = p / p.sum();
    rows.push_back(torch::matmul(p, v.narrow(0, 0, i + 1)));
  }
  return torch::stack(rows);
}

}  // namespace kvx::testing

// CausalConv1d (nn/layers.h): equals a plain loop over taps in fp64, outputs and gradients, and
// processing a sequence in pieces with the carried tail equals processing it whole.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "nn/layers.h"
#include "util/error.h"

using namespace kvx;

namespace {
// y_t[c] = sum_j w[c][j] x_{t-K+1+j}[c], zeros before t = 0.
torch::Tensor naive_conv(const torch::Tensor& x, const torch::Tensor& w) {
  const int64_t T = x.size(1), K = w.size(2);
  std::vector<torch::Tensor> ys;
  for (int64_t t = 0; t < T; ++t) {
    auto y = torch::zeros_like(x.select(1, t));
    for (int64_t j = 0; j < K; ++j) {
      const int64_t s = t - K + 1 + j;
      if (s >= 0) y = y + w.select(1, 0).select(1, j) * x.select(1, s);
    }
    ys.push_back(y);
  }
  return torch::stack(ys, 1);
}
}  // namespace

TEST(CausalConv1d, EqualsTheTapLoopWithGradients) {
  torch::manual_seed(3);
  for (int64_t T : {1, 3, 13}) {
    nn::CausalConv1d conv(7, 4);
    conv->to(torch::kDouble);
    auto x = torch::randn({2, T, 7}, torch::kDouble).requires_grad_();
    const auto y = conv->forward(x), ref = naive_conv(x, conv->weight);
    EXPECT_LT((y - ref).abs().max().item<double>(), 1e-12) << "T " << T;
    const auto w = torch::randn_like(y);
    const auto g1 = torch::autograd::grad({(y * w).sum()}, {x, conv->weight});
    const auto g2 = torch::autograd::grad({(ref * w).sum()}, {x, conv->weight});
    for (int i = 0; i < 2; ++i) EXPECT_LT((g1[i] - g2[i]).abs().max().item<double>(), 1e-12) << "T " << T;
  }
}

TEST(CausalConv1d, PiecesWithTheCarriedTailEqualTheWhole) {
  torch::manual_seed(4);
  nn::CausalConv1d conv(5, 4);
  torch::NoGradGuard no_grad;
  const auto x = torch::randn({3, 11, 5});
  const auto whole = conv->forward(x);
  torch::Tensor tail;
  std::vector<torch::Tensor> parts;
  for (auto [start, len] : std::vector<std::pair<int64_t, int64_t>>{{0, 1}, {1, 2}, {3, 5}, {8, 1}, {9, 2}})
    parts.push_back(conv->forward(x.narrow(1, start, len), &tail));
  EXPECT_TRUE(torch::allclose(torch::cat(parts, 1), whole, 1e-6, 1e-7));
  EXPECT_TRUE(torch::equal(tail, x.narrow(1, 8, 3)));
  EXPECT_THROW(conv->forward(torch::randn({3, 2, 4})), Error);
}

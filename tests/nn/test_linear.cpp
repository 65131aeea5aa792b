// nn::linear / nn::Linear (nn/layers.h): the one-row matrix-vector path equals torch::linear in
// fp64, outputs and gradients, with and without bias, for every shape a decode step passes; rows
// of more than one go through torch::linear unchanged.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <vector>

#include "nn/layers.h"

using namespace kvx;

TEST(Linear, OneRowEqualsTorchLinearWithGradients) {
  torch::manual_seed(5);
  const auto f64 = torch::TensorOptions().dtype(torch::kDouble);
  for (bool with_bias : {false, true})
    for (const std::vector<int64_t>& lead : {std::vector<int64_t>{}, {1}, {1, 1}, {1, 1, 1}})
      for (auto [in, out] : std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {7, 3}, {33, 65}}) {
        auto shape = lead;
        shape.push_back(in);
        auto x = torch::randn(shape, f64).requires_grad_(true);
        auto w = torch::randn({out, in}, f64).requires_grad_(true);
        auto b = with_bias ? torch::randn({out}, f64).requires_grad_(true) : torch::Tensor();
        auto y = nn::linear(x, w, b);
        auto want = torch::linear(x, w, b);
        ASSERT_EQ(y.sizes(), want.sizes());
        EXPECT_TRUE(torch::allclose(y, want, 1e-12, 1e-12));
        auto g = torch::randn_like(want);
        auto grads = torch::autograd::grad({y}, with_bias ? std::vector<torch::Tensor>{x, w, b} : std::vector<torch::Tensor>{x, w}, {g});
        auto want_grads =
            torch::autograd::grad({want}, with_bias ? std::vector<torch::Tensor>{x, w, b} : std::vector<torch::Tensor>{x, w}, {g});
        for (size_t i = 0; i < grads.size(); ++i) EXPECT_TRUE(torch::allclose(grads[i], want_grads[i], 1e-12, 1e-12)) << i;
      }
}

TEST(Linear, ModuleMatchesTorchLinearForOneAndManyRows) {
  torch::manual_seed(6);
  nn::Linear ours(torch::nn::LinearOptions(12, 5).bias(true));
  for (const std::vector<int64_t>& shape : {std::vector<int64_t>{1, 1, 12}, {2, 3, 12}, {1, 4, 12}}) {
    auto x = torch::randn(shape);
    EXPECT_TRUE(torch::allclose(ours(x), torch::linear(x, ours->weight, ours->bias), 1e-5, 1e-6));
  }
  auto names = ours->named_parameters().keys();
  EXPECT_EQ(names, (std::vector<std::string>{"weight", "bias"}));  // checkpoints keep their keys
  EXPECT_FALSE(nn::linear_no_bias(4, 3)->bias.defined());
}

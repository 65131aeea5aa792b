// Gated DeltaNet core (attention/gdn.h): the chunked (UT-transform) form equals the
// token-recurrent form, outputs, final state and gradients, in fp64 at odd lengths and widths
// and across chunk boundaries; hand-checked cases of the recurrence itself.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "attention/gdn.h"
#include "util/error.h"

using namespace kvx;

namespace {

struct Inputs {
  torch::Tensor q, k, v, g, beta, state;
  std::vector<torch::Tensor> leaves() const { return {q, k, v, g, beta, state}; }
};

Inputs random_inputs(int64_t B, int64_t H, int64_t T, int64_t K, int64_t V, uint64_t seed) {
  torch::manual_seed(seed);
  auto opt = torch::dtype(torch::kDouble);
  Inputs in;
  in.q = attention::l2_normalize(torch::randn({B, H, T, K}, opt)).detach().requires_grad_();
  in.k = attention::l2_normalize(torch::randn({B, H, T, K}, opt)).detach().requires_grad_();
  in.v = torch::randn({B, H, T, V}, opt).requires_grad_();
  in.g = (-torch::nn::functional::softplus(torch::randn({B, H, T}, opt))).detach().requires_grad_();  // log decay <= 0
  in.beta = torch::sigmoid(torch::randn({B, H, T}, opt)).detach().requires_grad_();
  in.state = torch::randn({B, H, K, V}, opt).requires_grad_();
  return in;
}

std::vector<torch::Tensor> grads(const std::pair<torch::Tensor, torch::Tensor>& out, const Inputs& in, uint64_t seed) {
  torch::manual_seed(seed);
  const auto wo = torch::randn_like(out.first), ws = torch::randn_like(out.second);
  const auto loss = (out.first * wo).sum() + (out.second * ws).sum();
  return torch::autograd::grad({loss}, in.leaves());
}

}  // namespace

TEST(Gdn, ChunkedEqualsRecurrentWithGradients) {
  const double scale = 1.0 / std::sqrt(5.0);
  for (int64_t T : {1, 63, 64, 65, 193}) {
    for (int64_t chunk : {64, 16}) {
      const auto in = random_inputs(2, 3, T, 5, 7, 100 + T);
      const auto rec = attention::gdn_recurrent(in.q, in.k, in.v, in.g, in.beta, scale, in.state);
      const auto chk = attention::gdn_chunked(in.q, in.k, in.v, in.g, in.beta, scale, in.state, chunk);
      SCOPED_TRACE("T " + std::to_string(T) + ", chunk " + std::to_string(chunk));
      EXPECT_LT((rec.first - chk.first).abs().max().item<double>(), 1e-10);
      EXPECT_LT((rec.second - chk.second).abs().max().item<double>(), 1e-10);
      const auto ga = grads(rec, in, 7), gb = grads(chk, in, 7);
      const char* names[] = {"q", "k", "v", "g", "beta", "state"};
      for (size_t i = 0; i < ga.size(); ++i)
        EXPECT_LT((ga[i] - gb[i]).abs().max().item<double>(), 1e-9 * (1 + ga[i].abs().max().item<double>())) << names[i];
    }
  }
}

TEST(Gdn, RecurrenceByHand) {
  auto opt = torch::dtype(torch::kDouble);
  // One token, no decay, beta 1, empty state: S = k v^T, o = scale (k . q) v.
  const auto k = torch::tensor({0.6, 0.8}, opt).view({1, 1, 1, 2});
  const auto q = torch::tensor({1.0, 0.0}, opt).view({1, 1, 1, 2});
  const auto v = torch::tensor({2.0, -1.0, 3.0}, opt).view({1, 1, 1, 3});
  const auto zeros = torch::zeros({1, 1, 1}, opt), ones = torch::ones({1, 1, 1}, opt);
  auto [o, S] = attention::gdn_recurrent(q, k, v, zeros, ones, 0.5);
  EXPECT_TRUE(torch::allclose(o.view({3}), 0.5 * 0.6 * v.view({3})));
  EXPECT_TRUE(torch::allclose(S.view({2, 3}), torch::outer(k.view({2}), v.view({3}))));
  // Writing the same key again with beta 1 replaces its value (the delta rule), decay first.
  const auto k2 = torch::cat({k, k}, 2), q2 = torch::cat({q, q}, 2);
  const auto v2 = torch::cat({v, torch::tensor({1.0, 1.0, 1.0}, opt).view({1, 1, 1, 3})}, 2);
  const auto g2 = torch::tensor({0.0, std::log(0.5)}, opt).view({1, 1, 2});
  auto [o2, S2] = attention::gdn_recurrent(q2, k2, v2, g2, torch::ones({1, 1, 2}, opt), 1.0);
  EXPECT_TRUE(torch::allclose(S2.view({2, 3}), torch::outer(k.view({2}), torch::ones({3}, opt))));
  // beta 0: nothing is written, the initial state only decays.
  const auto S0 = torch::randn({1, 1, 2, 3}, opt);
  auto [o3, S3] = attention::gdn_chunked(q2, k2, v2, g2, torch::zeros({1, 1, 2}, opt), 1.0, S0);
  EXPECT_TRUE(torch::allclose(S3, 0.5 * S0));
  EXPECT_TRUE(torch::allclose(o3.select(2, 1).view({3}), 0.5 * (S0.view({2, 3}).t().matmul(q.view({2})))));
}

TEST(Gdn, BadShapesNameTheExpectedLayout) {
  auto x = torch::zeros({1, 2, 3, 4});
  try {
    attention::gdn_recurrent(x, x, x, torch::zeros({1, 2, 4}), torch::zeros({1, 2, 3}), 1.0);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("expected q, k [B, H, T, K]"), std::string::npos) << e.what();
  }
  EXPECT_THROW(attention::gdn_chunked(x, x, x, torch::zeros({1, 2, 3}), torch::zeros({1, 2, 3}), 1.0, {}, 0), Error);
}

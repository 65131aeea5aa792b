// Shared checks for attention mixers (tests/attention): fp64 layers with random weights, the
// libtorch reference cache, and "a decode step differentiates like the training path".
#pragma once
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <memory>
#include <string>

#include "attention/mixer.h"
#include "model/config.h"
#include "support/fixtures.h"

namespace kvx::testing {

inline attention::CacheOptions reference_cache() {
  attention::CacheOptions o;
  o.reference = true;
  return o;
}

// A GDN-family config (layout "gdn" or "natsl") on mixer_config's small model.
inline model::ModelConfig linear_mixer_config(const std::string& layout, int heads, int key_dim, int value_dim) {
  auto c = mixer_config(2, 2, 4, 12);
  c.max_position_embeddings = 1024;
  c.layout = layout;
  c.linear_num_heads = heads;
  c.linear_key_head_dim = key_dim;
  c.linear_value_head_dim = value_dim;
  return c;
}

// Layer M of config c in fp64 with projection/convolution weights N(0, 0.3) and norm weights
// U(0.5, 1.5) (the other parameters keep their initialisation).
template <class M>
std::shared_ptr<M> make_fp64_layer(const model::ModelConfig& c, int seed) {
  torch::manual_seed(seed);
  auto m = std::make_shared<M>(c, 0);
  m->to(torch::kFloat64);
  torch::NoGradGuard ng;
  for (auto& p : m->named_parameters()) {
    if (p.key().find("conv") != std::string::npos || p.key().find("proj") != std::string::npos) p.value().normal_(0, 0.3);
    if (p.key().find("norm") != std::string::npos) p.value().uniform_(0.5, 1.5);
  }
  return m;
}

// One step over x [B, T, d] on a fresh reference cache has the forward's parameter and input gradients.
inline void expect_step_gradients_equal_forward(attention::Mixer& m, const torch::Tensor& x) {
  auto xg = x.clone().requires_grad_(true);
  auto w = torch::randn_like(x);
  auto params = m.parameters();
  params.push_back(xg);
  auto g_full = torch::autograd::grad({(m.forward(xg) * w).sum()}, params);
  auto cache = m.new_cache(x.size(0), reference_cache());
  auto g_step = torch::autograd::grad({(m.step(xg, *cache) * w).sum()}, params);
  for (size_t i = 0; i < params.size(); ++i)
    EXPECT_TRUE(torch::allclose(g_step[i], g_full[i], 1e-9, 1e-11)) << "gradient " << i;
}

}  // namespace kvx::testing

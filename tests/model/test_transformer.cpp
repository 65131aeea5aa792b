#include <gtest/gtest.h>
#include <torch/torch.h>

#include "attention/cost.h"
#include "attention/dense.h"
#include "nn/layers.h"
#include "model/memory.h"
#include "model/sampling.h"
#include "model/transformer.h"
#include "util/error.h"

using namespace kvx;

namespace {
model::ModelConfig tiny(int heads, int kv_heads) {
  model::ModelConfig c;
  c.vocab_size = 37;
  c.hidden_size = 24;
  c.num_hidden_layers = 3;
  c.num_attention_heads = heads;
  c.num_key_value_heads = kv_heads;
  c.head_dim = 8;
  c.intermediate_size = 40;
  c.max_position_embeddings = 32;
  c.layout = "dense*3";
  return c;
}

// tiny(4, 2) with this layout and small GDN layers (2 heads of K = 8, V = 6).
model::ModelConfig tiny_with_gdn(const std::string& layout, int layers) {
  auto c = tiny(4, 2);
  c.num_hidden_layers = layers;
  c.layout = layout;
  c.linear_num_heads = 2;
  c.linear_key_head_dim = 8;
  c.linear_value_head_dim = 6;
  return c;
}
}  // namespace

class IncrementalDecode : public ::testing::TestWithParam<std::pair<int, int>> {};

TEST_P(IncrementalDecode, PrefillThenSingleStepsEqualsFullForward) {
  auto [H, Hkv] = GetParam();
  torch::manual_seed(11);
  model::Transformer m(tiny(H, Hkv));
  m->to(torch::kFloat64);
  m->eval();
  torch::NoGradGuard ng;
  auto ids = torch::randint(37, {2, 20}, torch::kLong);
  auto full = m->forward(ids);
  attention::CacheOptions reference;
  reference.reference = true;
  auto state = m->new_state(2, reference);
  std::vector<torch::Tensor> parts{m->step(ids.narrow(1, 0, 7), state)};  // odd-length prefill
  for (int t = 7; t < 20; ++t) parts.push_back(m->step(ids.narrow(1, t, 1), state));
  auto inc = torch::cat(parts, 1);
  EXPECT_TRUE(torch::allclose(inc, full, 1e-10, 1e-10)) << (inc - full).abs().max().item<double>();
  EXPECT_EQ(state.length(), 20);
  EXPECT_EQ(state.bytes(), 20 * 2 * m->kv_bytes_per_token());
  EXPECT_EQ(m->kv_bytes_per_token(), 3 * 2 * Hkv * 8 * 4);
}

// The fused torch-free kernels (f32 cache) against the full forward, in float32.
TEST_P(IncrementalDecode, FusedKernelsMatchFullForward) {
  auto [H, Hkv] = GetParam();
  torch::manual_seed(12);
  auto c = tiny(H, Hkv);
  model::Transformer m(c);
  m->eval();
  torch::NoGradGuard ng;
  auto ids = torch::randint(37, {2, 21}, torch::kLong);
  auto full = m->forward(ids);
  for (int threads : {1, 2}) {
    attention::CacheOptions fused;
    fused.threads = threads;
    auto state = m->new_state(2, fused);
    std::vector<torch::Tensor> parts{m->step(ids.narrow(1, 0, 9), state)};
    for (int t = 9; t < 21; ++t) parts.push_back(m->step(ids.narrow(1, t, 1), state));
    auto inc = torch::cat(parts, 1);
    EXPECT_TRUE(torch::allclose(inc, full, 1e-4, 1e-5)) << (inc - full).abs().max().item<double>();
    EXPECT_EQ(state.bytes(), 21 * 2 * m->kv_bytes_per_token());
  }
}

TEST(Transformer, QuantisedAndEvictedCachesReportTheirBytes) {
  auto c = tiny(4, 2);
  c.head_dim = 32;
  model::Transformer m(c);
  torch::NoGradGuard ng;
  auto ids = torch::randint(37, {1, 30}, torch::kLong);
  auto full = m->forward(ids);
  for (const char* type : {"f32", "bf16", "q8", "q4"}) {
    auto o = attention::CacheOptions::parse(type, "", false);
    auto state = m->new_state(1, o);
    auto logits = m->step(ids, state);
    const double per_token = m->kv_bytes_per_token(o.type);
    EXPECT_DOUBLE_EQ(state.bytes_per_token(), per_token) << type;
    EXPECT_EQ(state.bytes(), static_cast<int64_t>(30 * per_token)) << type;
    // Coarser caches drift further from the f32 logits, but stay close.
    const double err = (logits - full).abs().max().item<double>();
    EXPECT_LT(err, std::string(type) == "q4" ? 0.5 : 0.05) << type;
  }
  EXPECT_DOUBLE_EQ(m->kv_bytes_per_token(kernels::KVType::Q8), 3 * 2 * 2 * 34);
  EXPECT_DOUBLE_EQ(m->kv_bytes_per_token(kernels::KVType::Q4), 3 * 2 * 2 * 18);
  auto evict = attention::CacheOptions::parse("f32", "sink=2,window=5", false);
  auto state = m->new_state(1, evict);
  m->step(ids, state);
  EXPECT_EQ(state.length(), 30);
  EXPECT_EQ(state.bytes(), static_cast<int64_t>(7 * m->kv_bytes_per_token()));
}

TEST(CacheOptions, BadNamesListTheValidOnes) {
  try {
    attention::CacheOptions::parse("fp8", "", false);
    FAIL();
  } catch (const kvx::Error& e) {
    EXPECT_NE(std::string(e.what()).find("q4"), std::string::npos) << e.what();
  }
  EXPECT_THROW(attention::CacheOptions::parse("f32", "sink=4", false), kvx::Error);
  EXPECT_THROW(attention::CacheOptions::parse("f32", "sink=4,window=x", false), kvx::Error);
  // sink + window overflowed int64 (negative rows held, garbage attention)
  EXPECT_THROW(attention::CacheOptions::parse("f32", "sink=4,window=9223372036854775807", false), kvx::Error);
  EXPECT_THROW(kernels::KVStore(kernels::KVType::F32, 1, 8, {4, int64_t{1} << 62}), kvx::Error);
  EXPECT_THROW(attention::CacheOptions::parse("f32", "keep=4,window=8", false), kvx::Error);
  EXPECT_THROW(attention::CacheOptions::parse("q8", "", true), kvx::Error);
  auto o = attention::CacheOptions::parse("q4", "sink=4,window=60", false);
  EXPECT_EQ(o.evict.sink, 4);
  EXPECT_EQ(o.evict.window, 60);
}

INSTANTIATE_TEST_SUITE_P(MhaGqaMqa, IncrementalDecode,
                         ::testing::Values(std::make_pair(3, 3), std::make_pair(4, 2), std::make_pair(3, 1)));

TEST(Transformer, HuggingFaceParameterNames) {
  auto c = tiny(4, 2);
  c.tie_word_embeddings = false;
  model::Transformer m(c);
  auto sd = m->state_dict_hf();
  for (const char* n : {"model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                        "model.layers.2.self_attn.k_proj.weight", "model.layers.1.mlp.gate_proj.weight",
                        "model.layers.1.input_layernorm.weight", "model.layers.1.post_attention_layernorm.weight",
                        "model.norm.weight", "lm_head.weight"})
    EXPECT_TRUE(sd.count(n)) << n;
  EXPECT_EQ(sd.at("model.layers.0.self_attn.k_proj.weight").sizes(), (std::vector<int64_t>{16, 24}));
}

TEST(Transformer, ContextPastTheLimitIsAClearError) {
  model::Transformer m(tiny(2, 2));
  torch::NoGradGuard ng;
  auto state = m->new_state(1);
  m->step(torch::zeros({1, 30}, torch::kLong), state);
  try {
    m->step(torch::zeros({1, 3}, torch::kLong), state);
    FAIL() << "expected an error";
  } catch (const kvx::Error& e) {
    EXPECT_NE(std::string(e.what()).find("context"), std::string::npos) << e.what();
  }
  std::vector<int32_t> prompt(31, 1);
  try {
    model::generate(m, prompt, 5, {}, 0);
    FAIL() << "expected an error";
  } catch (const kvx::Error& e) {
    EXPECT_NE(std::string(e.what()).find("context limit"), std::string::npos) << e.what();
  }
  // sampling options out of range, before any work
  EXPECT_THROW(model::check_generation(m->config(), 2, 2, {std::nan(""), 0.9}), kvx::Error);
  EXPECT_THROW(model::check_generation(m->config(), 2, 2, {-1.0, 0.9}), kvx::Error);
  EXPECT_THROW(model::check_generation(m->config(), 2, 2, {0.8, 0.0}), kvx::Error);
  EXPECT_THROW(model::check_generation(m->config(), 2, 2, {0.8, 1.5}), kvx::Error);
  EXPECT_THROW(model::check_generation(m->config(), 0, 2, {0.8, 0.9}), kvx::Error);  // empty prompt
  model::check_generation(m->config(), 2, 2, {0.0, 1.0});
  // The last new token is sampled, not fed back: a prompt filling the context still gets one.
  const int64_t limit = m->config().max_position_embeddings;
  model::check_generation(m->config(), limit, 1, {});
  EXPECT_THROW(model::check_generation(m->config(), limit, 2, {}), kvx::Error);
  // A Nectar document's tokens take positions before the prompt's.
  try {
    model::check_generation(m->config(), 2, 2, {}, limit - 2);
    FAIL() << "expected an error";
  } catch (const kvx::Error& e) {
    EXPECT_NE(std::string(e.what()).find("document (" + std::to_string(limit - 2) + " tokens)"), std::string::npos) << e.what();
  }
  model::check_generation(m->config(), 2, 2, {}, limit - 3);
}

TEST(Sampling, FusedGreedyGenerationEqualsTheReferencePath) {
  torch::manual_seed(8);
  auto c = tiny(4, 2);
  model::Transformer m(c);
  std::vector<int32_t> prompt{3, 1, 4, 1, 5};
  attention::CacheOptions reference;
  reference.reference = true;
  auto ref = model::generate(m, prompt, 20, {0.0, 1.0}, 0, nullptr, reference);
  auto fused = model::generate(m, prompt, 20, {0.0, 1.0}, 0, nullptr, attention::CacheOptions{});
  EXPECT_EQ(ref.tokens, fused.tokens);
}

TEST(Sampling, GreedyAndSeededSamplingAreDeterministic) {
  torch::manual_seed(5);
  model::Transformer m(tiny(2, 1));
  std::vector<int32_t> prompt{1, 2, 3};
  auto a = model::generate(m, prompt, 8, {0.0, 1.0}, 1);
  auto b = model::generate(m, prompt, 8, {0.0, 1.0}, 2);
  EXPECT_EQ(a.tokens, b.tokens);  // greedy ignores the seed
  auto c1 = model::generate(m, prompt, 8, {1.0, 0.9}, 42);
  auto c2 = model::generate(m, prompt, 8, {1.0, 0.9}, 42);
  EXPECT_EQ(c1.tokens, c2.tokens);
  EXPECT_EQ(c1.tokens.size(), 8u);
}

TEST(Sampling, TopPKeepsOnlyTheNucleus) {
  auto logits = torch::tensor({10.0, 9.0, -10.0, -10.0});
  std::mt19937_64 rng(0);
  for (int i = 0; i < 200; ++i) {
    auto t = model::sample_token(logits, {1.0, 0.5}, rng);
    EXPECT_EQ(t, 0);  // the top token alone holds > 0.5 of the mass
  }
  // A tiny temperature is greedy (logits / T alone overflowed to inf, the softmax to NaN, and an
  // arbitrary token came out); a -inf logit is a token that cannot come; NaN or +inf is damage.
  const auto spread = torch::tensor({1.0, 3.0, 2.0, -std::numeric_limits<double>::infinity()});
  for (double t : {1e-310, 1e-30}) EXPECT_EQ(model::sample_token(spread, {t, 1.0}, rng), 1) << t;
  EXPECT_THROW(model::sample_token(torch::tensor({1.0, std::nan("")}), {1.0, 1.0}, rng), kvx::Error);
  EXPECT_THROW(model::sample_token(torch::tensor({1.0, std::numeric_limits<double>::infinity()}), {1.0, 1.0}, rng), kvx::Error);
}

TEST(Transformer, MlaModelDecodesLikeItsForwardAndCountsItsLatent) {
  auto c = tiny(4, 4);
  c.layout = "mla,dense,mla";
  c.kv_lora_rank = 16;
  c.qk_rope_head_dim = 16;
  torch::manual_seed(13);
  model::Transformer m(c);
  m->to(torch::kFloat64);
  torch::NoGradGuard ng;
  auto ids = torch::randint(37, {2, 15}, torch::kLong);
  auto full = m->forward(ids);
  auto state = m->new_state(2);
  std::vector<torch::Tensor> parts{m->step(ids.narrow(1, 0, 6), state)};
  for (int t = 6; t < 15; ++t) parts.push_back(m->step(ids.narrow(1, t, 1), state));
  auto inc = torch::cat(parts, 1);
  EXPECT_TRUE(torch::allclose(inc, full, 1e-5, 1e-5)) << (inc - full).abs().max().item<double>();
  EXPECT_EQ(m->kv_bytes_per_token(), 4.0 * (2 * (16 + 16) + 2 * 4 * 8));
  EXPECT_TRUE(m->state_dict_hf().count("model.layers.0.self_attn.kv_a_proj_with_mqa.weight"));
}

TEST(Transformer, HybridLrkvDenseModelDecodesLikeItsForward) {
  for (const char* rope : {"expand", "shared_rope", "pair_aligned"}) {
    auto c = tiny(4, 2);
    c.layout = "lrkv,dense,lrkv";
    c.lrkv_rank = 4;
    c.lrkv_rope = rope;
    torch::manual_seed(12);
    model::Transformer m(c);
    m->to(torch::kFloat64);
    torch::NoGradGuard ng;
    auto ids = torch::randint(37, {2, 15}, torch::kLong);
    auto full = m->forward(ids);
    auto state = m->new_state(2);  // LRKV layers: libtorch f32 cache; the dense layer: fused
    std::vector<torch::Tensor> parts{m->step(ids.narrow(1, 0, 6), state)};
    for (int t = 6; t < 15; ++t) parts.push_back(m->step(ids.narrow(1, t, 1), state));
    auto inc = torch::cat(parts, 1);
    EXPECT_TRUE(torch::allclose(inc, full, 1e-5, 1e-5)) << rope << ": " << (inc - full).abs().max().item<double>();
    // Bytes per token: 2 LRKV layers x 2 (d_h + H r) + one dense GQA layer 2 Hkv d_h, f32.
    EXPECT_EQ(m->kv_bytes_per_token(), 4.0 * (2 * 2 * (8 + 4 * 4) + 2 * 2 * 8));
    // Round trip through the HF tensor map: the pair-aligned selection is rebuilt, not stored.
    model::Transformer m2(c);
    m2->to(torch::kFloat64);
    m2->load_state_dict_hf(m->state_dict_hf(), "test");
    EXPECT_TRUE(torch::allclose(m2->forward(ids), full, 1e-12, 1e-12)) << rope;
    EXPECT_TRUE(m->state_dict_hf().count("model.layers.0.self_attn.k_shared_proj.weight"));
    EXPECT_EQ(m->state_dict_hf().count("model.layers.0.self_attn.k_up"), std::string(rope) == "pair_aligned" ? 0u : 1u);
  }
}

TEST(Transformer, GdnNatslDenseHybridDecodesLikeItsForward) {
  auto c = tiny_with_gdn("gdn,natsl,dense", 3);
  c.nats_attention_heads = 4;
  c.nats_block_size = 4;
  c.validate();
  torch::manual_seed(14);
  model::Transformer m(c);
  m->to(torch::kFloat64);
  EXPECT_EQ(m->num_parameters(), static_cast<int64_t>(model::parameter_count(c)));
  torch::NoGradGuard ng;
  auto ids = torch::randint(37, {2, 23}, torch::kLong);
  auto full = m->forward(ids);
  for (bool reference : {false, true}) {
    attention::CacheOptions o;
    o.reference = reference;
    auto state = m->new_state(2, o);
    std::vector<torch::Tensor> parts{m->step(ids.narrow(1, 0, 6), state)};
    for (int t = 6; t < 23; ++t) parts.push_back(m->step(ids.narrow(1, t, 1), state));
    auto inc = torch::cat(parts, 1);
    EXPECT_TRUE(torch::allclose(inc, full, 1e-5, 1e-5)) << reference << ": " << (inc - full).abs().max().item<double>();
  }
  // The GDN layer holds no per-token cache; the NAtS-L layer at most its full KV; both a constant state.
  EXPECT_EQ(m->kv_bytes_per_token(), 4.0 * (2 * (8 + 6) + 2 * 2 * 8));
  EXPECT_EQ(m->state_bytes(), attention::AttentionShape::of_layer(c, "gdn").state_bytes() +
                                  attention::AttentionShape::of_layer(c, "natsl").state_bytes());
  model::Transformer m2(c);
  m2->to(torch::kFloat64);
  m2->load_state_dict_hf(m->state_dict_hf(), "test");
  EXPECT_TRUE(torch::allclose(m2->forward(ids), full, 1e-12, 1e-12));
  EXPECT_TRUE(m->state_dict_hf().count("model.layers.0.self_attn.A_log"));
  EXPECT_TRUE(m->state_dict_hf().count("model.layers.1.self_attn.router.weight"));
}

// Eviction on a GDN + dense hybrid: the dense layer holds sink + window rows, the GDN layer keeps
// its state, and the outputs differ from the unevicted decode; a GDN-only model has nothing to evict.
TEST(Transformer, HybridGdnDenseEvictsItsDenseLayers) {
  auto c = tiny_with_gdn("gdn,dense", 2);
  c.validate();
  torch::manual_seed(15);
  model::Transformer m(c);
  torch::NoGradGuard ng;
  auto ids = torch::randint(37, {1, 20}, torch::kLong);
  attention::CacheOptions evicting = attention::CacheOptions::parse("f32", "sink=2,window=5", false);
  auto state = m->new_state(1, evicting), full_state = m->new_state(1, attention::CacheOptions{});
  torch::Tensor last, last_full;
  for (int t = 0; t < 20; ++t) {
    last = m->step(ids.narrow(1, t, 1), state);
    last_full = m->step(ids.narrow(1, t, 1), full_state);
  }
  EXPECT_EQ(state.layers[1]->bytes(), static_cast<int64_t>(7 * state.layers[1]->bytes_per_token()));  // 2 + 5 rows held
  EXPECT_GT((last - last_full).abs().max().item<double>(), 1e-6);  // the evicted rows mattered
  auto g = c;
  g.layout = "gdn";
  g.num_hidden_layers = 1;
  model::Transformer only_gdn(g);
  EXPECT_THROW(only_gdn->new_state(1, evicting), kvx::Error);
}

TEST(Transformer, LoopedModelRunsItsStackTTimesAndDecodesWithACachePerLoopAndLayer) {
  auto c = tiny(4, 2);
  c.num_hidden_layers = 2;
  c.layout = "dense,gdn";
  c.linear_num_heads = 2;
  c.linear_key_head_dim = c.linear_value_head_dim = 8;
  c.loops = 3;
  c.sandwich_norm = true;
  c.validate();
  torch::manual_seed(15);
  model::Transformer m(c);
  m->to(torch::kFloat64);
  EXPECT_EQ(m->num_parameters(), static_cast<int64_t>(model::parameter_count(c)));  // shared weights, sandwich norms
  torch::NoGradGuard ng;
  {  // random norm weights so the sandwich norms matter
    for (auto& p : m->named_parameters())
      if (p.key().find("norm") != std::string::npos) p.value().uniform_(0.5, 1.5);
  }
  auto ids = torch::randint(37, {2, 13}, torch::kLong);
  // The forward written out: T passes over the stack, the final norm between loops and at the end.
  auto h = m->embed_tokens(ids);
  for (int t = 0; t < 3; ++t) {
    if (t > 0) h = m->norm(h);
    for (auto& layer : *m->layers) {
      auto* b = layer->as<model::BlockImpl>();
      auto x = h + b->input_layernorm_2(b->self_attn->forward(b->input_layernorm(h)));
      h = x + b->post_attention_layernorm_2(b->mlp(b->post_attention_layernorm(x)));
    }
  }
  auto full = m->forward(ids);
  EXPECT_TRUE(torch::allclose(torch::matmul(m->norm(h), m->embed_tokens->weight.t()), full, 1e-12, 1e-12));
  for (bool reference : {false, true}) {
    attention::CacheOptions o;
    o.reference = reference;
    auto state = m->new_state(2, o);
    EXPECT_EQ(state.layers.size(), 6u);  // loops x layers
    std::vector<torch::Tensor> parts{m->step(ids.narrow(1, 0, 5), state)};
    for (int t = 5; t < 13; ++t) parts.push_back(m->step(ids.narrow(1, t, 1), state));
    auto inc = torch::cat(parts, 1);
    EXPECT_TRUE(torch::allclose(inc, full, 1e-5, 1e-5)) << reference << ": " << (inc - full).abs().max().item<double>();
  }
  EXPECT_EQ(m->kv_bytes_per_token(), 3 * 4.0 * 2 * 2 * 8);  // T x the dense layer's 2 Hkv d_h floats
  EXPECT_TRUE(m->state_dict_hf().count("model.layers.1.post_attention_layernorm_2.weight"));
  // One loop without sandwich norms is the plain stack.
  auto plain = c;
  plain.loops = 1;
  plain.sandwich_norm = false;
  EXPECT_EQ(plain.to_json().count("loops"), 0u);
  EXPECT_EQ(c.to_json()["loops"], 3);
  auto bad = c;
  bad.loops = 0;
  EXPECT_THROW(bad.validate(), Error);
}

TEST(Transformer, CrossLayerKvSharingReadsTheFirstLayersKeysAndValuesWithEachLayersOwnQueries) {
  auto c = tiny(4, 2);
  c.num_hidden_layers = 3;  // runs of 2: layers 0-1 share layer 0's K/V, layer 2 keeps its own
  c.loops = 2;
  c.sandwich_norm = true;
  c.validate();
  torch::manual_seed(17);
  model::Transformer m(c);
  m->to(torch::kFloat64);
  torch::NoGradGuard ng;
  const auto ids = torch::randint(37, {2, 11}, torch::kLong);
  // Written out with the forward's mixer override: layer 1's keys and values are layer 0's (same loop).
  torch::Tensor first_input;
  const auto want = m->forward(ids, nullptr, [&](int, int layer, const torch::Tensor& x) -> torch::Tensor {
    if (layer == 0) first_input = x;
    if (layer != 1) return {};
    auto& own = dynamic_cast<attention::DenseAttention&>(*m->layers[1]->as<model::BlockImpl>()->self_attn);
    auto& src = dynamic_cast<attention::DenseAttention&>(*m->layers[0]->as<model::BlockImpl>()->self_attn);
    const int64_t B = x.size(0), T = x.size(1);
    const nn::Rope rope(c.head_dim, c.rope_theta);
    const auto q = rope.apply(own.q_proj(x).view({B, T, 4, 8}).transpose(1, 2), 0);
    auto [k, v] = src.keys_values_pre_rope(first_input);
    const auto o = attention::causal_attention(q, rope.apply(k, 0), v, 0);
    return own.o_proj(o.transpose(1, 2).reshape({B, T, 32}));
  });
  attention::CacheOptions o;
  o.share_kv_layers = 2;
  auto state = m->new_state(2, o);
  std::vector<torch::Tensor> parts{m->step(ids.narrow(1, 0, 4), state)};
  for (int t = 4; t < 11; ++t) parts.push_back(m->step(ids.narrow(1, t, 1), state));
  const auto got = torch::cat(parts, 1);
  EXPECT_LT((got - want).abs().max().item<double>(), 1e-9);
  EXPECT_GT((got - m->forward(ids)).abs().max().item<double>(), 1e-4);  // sharing changes the model
  // Layers 0 and 2 of each loop keep K/V: 2 of 3 layers' bytes.
  EXPECT_EQ(state.bytes(), 2 * 11 * 2 * (2 * 2 * 8 * 4) * 2);
  EXPECT_NE(o.describe().find("CLA"), std::string::npos);
  o.type = kernels::KVType::Q8;
  EXPECT_THROW(m->new_state(1, o), Error);
}

TEST(Transformer, ExitGatePicksTheFirstLoopWhoseCumulativeExitProbabilityReachesTheThreshold) {
  // p_t = lambda_t prod_{s<t} (1 - lambda_s), the last loop the rest.
  const auto p = model::TransformerImpl::exit_distribution(torch::tensor({0.2, 0.5, 0.9}, torch::kFloat64));
  EXPECT_TRUE(torch::allclose(p, torch::tensor({0.2, 0.4, 0.4}, torch::kFloat64), 0, 1e-15));
  auto c = tiny(4, 2);
  c.num_hidden_layers = 2;
  c.layout = "dense*2";
  c.loops = 3;
  c.exit_gate = true;
  c.exit_threshold = 0.6;
  c.validate();
  torch::manual_seed(19);
  model::Transformer m(c);
  m->to(torch::kFloat64);
  EXPECT_EQ(m->num_parameters(), static_cast<int64_t>(model::parameter_count(c)));
  EXPECT_TRUE(m->state_dict_hf().count("model.early_exit_gate.weight"));
  {  // a gate that varies across tokens so every loop gets picked somewhere
    torch::NoGradGuard ng;
    m->early_exit_gate->weight.normal_(0, 3.0);
  }
  const auto ids = torch::randint(37, {2, 15}, torch::kLong);
  torch::Tensor want, loss_want;
  {
    torch::NoGradGuard ng;
    const auto s = m->loop_states(ids);
    want = torch::empty({2, 15, 37}, torch::kFloat64);
    std::vector<int> picked(3, 0);
    for (int b = 0; b < 2; ++b)
      for (int i = 0; i < 15; ++i) {
        double cdf = 0;
        int exit = 2;
        for (int t = 0; t < 3; ++t) {
          cdf += s.exit_probs[b][i][t].item<double>();
          if (cdf >= 0.6) {
            exit = t;
            break;
          }
        }
        ++picked[exit];
        want[b][i] = torch::matmul(s.normed[exit][b][i], m->embed_tokens->weight.t());
      }
    EXPECT_GT(picked[0] * picked[1] + picked[0] * picked[2] + picked[1] * picked[2], 0);  // more than one loop used
  }
  torch::NoGradGuard ng;
  const auto got = m->forward(ids);
  EXPECT_TRUE(torch::allclose(got, want, 1e-12, 1e-12));
  // Decode takes the same exits.
  auto state = m->new_state(2);
  std::vector<torch::Tensor> parts{m->step(ids.narrow(1, 0, 6), state)};
  for (int t = 6; t < 15; ++t) parts.push_back(m->step(ids.narrow(1, t, 1), state));
  EXPECT_LT((torch::cat(parts, 1) - got).abs().max().item<double>(), 1e-5);
  {  // threshold 1 in float32: always the last loop, whatever the rounding of the cumulative sum
    auto one = c;
    one.exit_threshold = 1.0;
    model::Transformer m1(one);
    m1->load_state_dict_hf(m->state_dict_hf(), "test");
    m1->to(torch::kFloat32);
    m1->early_exit_gate->weight.normal_(0, 0.3);  // unsaturated: no lambda rounds to exactly 1
    const auto s = m1->loop_states(ids);
    const auto last = torch::matmul(s.normed.back(), m1->embed_tokens->weight.t());
    EXPECT_LT((m1->forward(ids) - last).abs().max().item<double>(), 1e-5);
  }
  auto bad = c;
  bad.loops = 1;
  EXPECT_THROW(bad.validate(), Error);
  bad = c;
  bad.exit_threshold = 0;
  EXPECT_THROW(bad.validate(), Error);
}

TEST(Transformer, ExitGateLossIsTheExpectedCrossEntropyMinusTheEntropyAndTrainsTheGate) {
  auto c = tiny(4, 4);
  c.num_hidden_layers = 1;
  c.layout = "dense";
  c.loops = 3;
  c.exit_gate = true;
  c.exit_entropy_weight = 0.1;
  torch::manual_seed(21);
  model::Transformer m(c);
  m->to(torch::kFloat64);
  const auto ids = torch::randint(37, {2, 9}, torch::kLong), y = torch::randint(37, {2, 9}, torch::kLong);
  const auto loss = m->lm_loss(ids, y);
  {
    torch::NoGradGuard ng;
    const auto s = m->loop_states(ids);
    double want = 0;
    for (int b = 0; b < 2; ++b)
      for (int i = 0; i < 9; ++i) {
        double expected = 0, entropy = 0;
        for (int t = 0; t < 3; ++t) {
          const auto logp = torch::log_softmax(torch::matmul(s.normed[t][b][i], m->embed_tokens->weight.t()), -1);
          const double pt = s.exit_probs[b][i][t].item<double>();
          expected += pt * -logp[y[b][i].item<int64_t>()].item<double>();
          entropy -= pt * std::log(pt);
        }
        want += expected - 0.1 * entropy;
      }
    EXPECT_NEAR(loss.item<double>(), want / 18, 1e-12);
  }
  loss.backward();
  EXPECT_GT(m->early_exit_gate->weight.grad().abs().sum().item<double>(), 0.0);
  // Without a gate the loss is the plain cross-entropy of the forward.
  auto plain_cfg = c;
  plain_cfg.exit_gate = false;
  model::Transformer plain(plain_cfg);
  const auto logits = plain->forward(ids);
  EXPECT_NEAR(plain->lm_loss(ids, y).item<double>(),
              torch::nn::functional::cross_entropy(logits.reshape({-1, 37}), y.reshape({-1})).item<double>(), 1e-6);
  auto masked = y.clone();
  masked.narrow(1, 0, 4).fill_(-100);  // ignored targets count nowhere, as in cross_entropy's mean
  EXPECT_NEAR(plain->lm_loss(ids, masked).item<double>(),
              torch::nn::functional::cross_entropy(logits.reshape({-1, 37}), masked.reshape({-1})).item<double>(), 1e-6);
}

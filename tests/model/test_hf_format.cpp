// Hugging Face interchange: export then import gives the same model (logits bit-equal in f32,
// equal to the rounded model in bf16), sharded checkpoints load, a tiny Qwen3 model (per-head
// q/k norms) computes what its definition says, and configs kvx cannot honour are refused.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>

#include "attention/dense.h"
#include "io/atomic_file.h"
#include "io/json_config.h"
#include "model/hf_format.h"
#include "nn/tensor_io.h"
#include "support/fixtures.h"
#include "support/naive.h"
#include "train/checkpoint.h"
#include "util/error.h"

using namespace kvx;

namespace {

model::ModelConfig small(bool qk_norm, bool tied, int kv_heads) {
  model::ModelConfig c;
  c.vocab_size = 300;  // >= the byte tokenizer's 256
  c.hidden_size = 24;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = kv_heads;
  c.head_dim = 8;
  c.intermediate_size = 40;
  c.max_position_embeddings = 64;
  c.rope_theta = 500.0;
  c.rms_norm_eps = 1e-6;
  c.tie_word_embeddings = tied;
  c.qk_norm = qk_norm;
  c.validate();
  return c;
}

model::Transformer random_model(const model::ModelConfig& c, uint64_t seed) {
  torch::manual_seed(seed);
  model::Transformer m(c);
  torch::NoGradGuard no_grad;
  for (auto& p : m->parameters()) p.add_(torch::randn_like(p) * 0.05);  // norms away from 1 too
  return m;
}

torch::Tensor logits(model::Transformer& m) {
  torch::NoGradGuard no_grad;
  torch::manual_seed(5);
  return m->forward(torch::randint(256, {2, 11}, torch::kLong));
}

}  // namespace

TEST(HfFormat, ExportThenImportIsTheSameModel) {
  const auto dir = kvx::testing::temp_dir("hf_roundtrip");
  for (const bool qk : {false, true})
    for (const bool tied : {true, false})
      for (const int kv : {4, 2, 1}) {
        const auto c = small(qk, tied, kv);
        auto m = random_model(c, 7 + kv);
        train::save_model_dir(dir + "/kvx", m, text::BpeTokenizer());
        train::export_hf(dir + "/kvx", dir + "/hf", "f32");
        const auto hf = io::parse_json_file(dir + "/hf/config.json");
        EXPECT_EQ(hf["model_type"], qk ? "qwen3" : "llama");
        EXPECT_EQ(hf["tie_word_embeddings"], tied);
        auto back = train::import_hf(dir + "/hf", dir + "/back");
        EXPECT_TRUE(torch::equal(logits(back), logits(m))) << "qk_norm " << qk << " tied " << tied << " kv " << kv;
        auto loaded = train::load_model(dir + "/back");
        EXPECT_TRUE(torch::equal(logits(loaded.model), logits(m)));
        EXPECT_EQ(loaded.model->config().to_json(), c.to_json());
      }
  // bf16 weights load as f32 equal to the rounded model.
  const auto c = small(true, false, 2);
  auto m = random_model(c, 3);
  train::save_model_dir(dir + "/kvx", m, text::BpeTokenizer());
  train::export_hf(dir + "/kvx", dir + "/hf16", "bf16");
  EXPECT_EQ(io::parse_json_file(dir + "/hf16/config.json")["torch_dtype"], "bfloat16");
  auto back = train::import_hf(dir + "/hf16", dir + "/back16");
  {
    torch::NoGradGuard no_grad;
    for (auto& p : m->parameters()) p.copy_(p.to(torch::kBFloat16).to(torch::kFloat32));
  }
  EXPECT_TRUE(torch::equal(logits(back), logits(m)));
  EXPECT_THROW(train::export_hf(dir + "/kvx", dir + "/bad", "fp8"), Error);
  std::filesystem::remove_all(dir);
}

// Looped models travel in Ouro's layout (model_type "ouro": total_ut_steps, sandwich norms, the
// exit gate and early_exit_threshold). A model without a gate gets one that never exits early.
TEST(HfFormat, LoopedModelsRoundTripInOurosLayout) {
  const auto dir = kvx::testing::temp_dir("hf_ouro");
  for (const bool gate : {true, false})
    for (const int kv : {4, 2}) {
      auto c = small(false, false, kv);
      c.loops = 3;
      c.sandwich_norm = true;
      c.exit_gate = gate;
      c.exit_threshold = 0.7;
      c.validate();
      auto m = random_model(c, 11 + kv);
      train::save_model_dir(dir + "/kvx", m, text::BpeTokenizer());
      train::export_hf(dir + "/kvx", dir + "/hf", "f32");
      const auto hf = io::parse_json_file(dir + "/hf/config.json");
      EXPECT_EQ(hf["model_type"], "ouro");
      EXPECT_EQ(hf["architectures"][0], "OuroForCausalLM");
      EXPECT_EQ(hf["total_ut_steps"], 3);
      EXPECT_DOUBLE_EQ(hf["early_exit_threshold"].get<double>(), gate ? 0.7 : 1.0);
      auto back = train::import_hf(dir + "/hf", dir + "/back");
      const auto& bc = back->config();
      EXPECT_EQ(bc.loops, 3);
      EXPECT_TRUE(bc.sandwich_norm && bc.exit_gate);
      // Gated: the same exits; ungated: the never-exit gate reads the last loop, as the original does.
      EXPECT_TRUE(torch::equal(logits(back), logits(m))) << "gate " << gate << " kv " << kv;
      if (!gate) {
        const auto w = nn::load_safetensors(dir + "/hf/model.safetensors");
        EXPECT_TRUE(torch::equal(w.at("model.early_exit_gate.weight"), torch::zeros({1, c.hidden_size})));
        EXPECT_EQ(w.at("model.early_exit_gate.bias").item<float>(), -30.0f);
      }
    }
  std::filesystem::remove_all(dir);
}

// What Ouro-1.4B's config.json declares becomes kvx's looped config (values from the published
// model: 24 layers x 4 loops, MHA 16 x 128, rope_theta 1e6, untied head).
TEST(HfFormat, OuroConfigTranslates) {
  nlohmann::json hf = {{"architectures", {"OuroForCausalLM"}}, {"model_type", "ouro"}, {"vocab_size", 49152},
                       {"hidden_size", 2048}, {"intermediate_size", 5632}, {"num_hidden_layers", 24},
                       {"num_attention_heads", 16}, {"num_key_value_heads", 16}, {"head_dim", 128},
                       {"max_position_embeddings", 65536}, {"rms_norm_eps", 1e-6}, {"rope_theta", 1000000.0},
                       {"rope_scaling", nullptr}, {"tie_word_embeddings", false}, {"hidden_act", "silu"},
                       {"total_ut_steps", 4}, {"early_exit_threshold", 1.0}, {"use_sliding_window", false},
                       {"sliding_window", 4096}, {"max_window_layers", 28}, {"torch_dtype", "bfloat16"},
                       {"auto_map", {{"AutoConfig", "configuration_ouro.OuroConfig"}}}};
  const auto c = model::config_from_hf(hf);
  EXPECT_EQ(c.loops, 4);
  EXPECT_TRUE(c.sandwich_norm);
  EXPECT_TRUE(c.exit_gate);
  EXPECT_DOUBLE_EQ(c.exit_threshold, 1.0);
  EXPECT_EQ(c.num_hidden_layers, 24);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_FALSE(c.tie_word_embeddings);
  hf.erase("total_ut_steps");
  EXPECT_EQ(model::config_from_hf(hf).loops, 4);  // OuroConfig's default
  // A loop count that is not a small whole number is refused (read as 4 before: 2^32 + 4, 4.5, true).
  for (const auto& bad : {nlohmann::json(4294967300LL), nlohmann::json(4.5), nlohmann::json(true)}) {
    auto j = hf;
    j["total_ut_steps"] = bad;
    EXPECT_THROW(model::config_from_hf(j), Error) << bad.dump();
  }
  hf["use_sliding_window"] = true;
  EXPECT_THROW(model::config_from_hf(hf), Error);
}

TEST(HfFormat, ShardedCheckpointsLoadAndBrokenOnesAreRefused) {
  const auto dir = kvx::testing::temp_dir("hf_shards");
  const auto c = small(false, false, 2);
  auto m = random_model(c, 11);
  train::save_model_dir(dir + "/kvx", m, text::BpeTokenizer());
  train::export_hf(dir + "/kvx", dir + "/hf", "f32");
  // Split into two shards with an index, as large checkpoints come.
  const auto all = nn::load_safetensors(dir + "/hf/model.safetensors");
  nn::TensorMap a, b;
  nlohmann::json map;
  int i = 0;
  for (const auto& [name, t] : all) {
    const bool first = i++ % 2 == 0;
    (first ? a : b)[name] = t.to(torch::kFloat16);  // and half-precision shards
    map[name] = first ? "model-00001-of-00002.safetensors" : "model-00002-of-00002.safetensors";
  }
  std::filesystem::remove(dir + "/hf/model.safetensors");
  nn::save_safetensors(dir + "/hf/model-00001-of-00002.safetensors", a);
  nn::save_safetensors(dir + "/hf/model-00002-of-00002.safetensors", b);
  io::write_file_atomic(dir + "/hf/model.safetensors.index.json", nlohmann::json{{"metadata", {}}, {"weight_map", map}}.dump());
  auto back = train::import_hf(dir + "/hf", dir + "/back");
  {
    torch::NoGradGuard no_grad;
    for (auto& p : m->parameters()) p.copy_(p.to(torch::kFloat16).to(torch::kFloat32));
  }
  EXPECT_TRUE(torch::equal(logits(back), logits(m)));
  // A tensor the index promises but no shard holds.
  map["model.layers.9.mlp.up_proj.weight"] = "model-00001-of-00002.safetensors";
  io::write_file_atomic(dir + "/hf/model.safetensors.index.json", nlohmann::json{{"weight_map", map}}.dump());
  EXPECT_THROW(train::import_hf(dir + "/hf", dir + "/back2"), Error);
  map.erase("model.layers.9.mlp.up_proj.weight");
  map["model.norm.weight"] = "../elsewhere.safetensors";
  io::write_file_atomic(dir + "/hf/model.safetensors.index.json", nlohmann::json{{"weight_map", map}}.dump());
  EXPECT_THROW(train::import_hf(dir + "/hf", dir + "/back3"), Error);
  std::filesystem::remove_all(dir);
}

TEST(HfFormat, Qwen3QkNormsComputeWhatTheDefinitionSays) {
  // One layer by hand in fp64: RMSNorm, q/k projections, per-head RMSNorm of q and k (Qwen3),
  // rotate-half RoPE, causal softmax, o_proj, residual, RMSNorm, SwiGLU, residual, final norm, tied head.
  auto c = small(true, true, 2);
  c.num_hidden_layers = 1;
  auto m = random_model(c, 13);
  m->to(torch::kFloat64);
  torch::NoGradGuard no_grad;
  const auto ids = torch::tensor(std::vector<int64_t>{3, 77, 5, 250, 9, 9, 41}, torch::kLong);
  const int64_t T = ids.size(0), H = 4, Hkv = 2, d = 8;
  auto* block = (*m->layers)[0]->as<model::BlockImpl>();
  auto* attn = dynamic_cast<attention::DenseAttention*>(block->self_attn.get());
  ASSERT_NE(attn, nullptr);
  ASSERT_TRUE(attn->q_norm && attn->k_norm);
  const auto rms = [&](const torch::Tensor& x, const torch::Tensor& w) {
    return x / torch::sqrt(x.pow(2).mean(-1, true) + c.rms_norm_eps) * w;
  };
  const auto x = m->embed_tokens->weight.index_select(0, ids);  // [T, D]
  const auto xn = rms(x, block->input_layernorm->weight);
  const auto q = torch::matmul(xn, attn->q_proj->weight.t()).view({T, H, d});
  const auto k = torch::matmul(xn, attn->k_proj->weight.t()).view({T, Hkv, d});
  const auto v = torch::matmul(xn, attn->v_proj->weight.t()).view({T, Hkv, d});
  std::vector<torch::Tensor> heads;
  for (int64_t h = 0; h < H; ++h) {
    const auto qh = kvx::testing::naive_rope(rms(q.select(1, h), attn->q_norm->weight), c.rope_theta);
    const auto kh = kvx::testing::naive_rope(rms(k.select(1, h / 2), attn->k_norm->weight), c.rope_theta);
    heads.push_back(kvx::testing::naive_head(qh, kh, v.select(1, h / 2), 1 / std::sqrt(static_cast<double>(d))));
  }
  const auto h1 = x + torch::matmul(torch::cat(heads, 1), attn->o_proj->weight.t());
  const auto hn = rms(h1, block->post_attention_layernorm->weight);
  const auto& mlp = block->mlp;
  const auto up = torch::silu(torch::matmul(hn, mlp->gate_proj->weight.t())) * torch::matmul(hn, mlp->up_proj->weight.t());
  const auto h2 = h1 + torch::matmul(up, mlp->down_proj->weight.t());
  const auto want = torch::matmul(rms(h2, m->norm->weight), m->embed_tokens->weight.t());
  const auto got = m->forward(ids.unsqueeze(0))[0];
  EXPECT_TRUE(torch::allclose(got, want, 1e-10, 1e-10)) << (got - want).abs().max().item<double>();
  // The norms are real: without them the model computes something else.
  auto plain = c;
  plain.qk_norm = false;
  model::Transformer other(plain);
  other->to(torch::kFloat64);
  auto sd = m->state_dict_hf();
  sd.erase("model.layers.0.self_attn.q_norm.weight");
  sd.erase("model.layers.0.self_attn.k_norm.weight");
  other->load_state_dict_hf(sd, "test");
  EXPECT_FALSE(torch::allclose(other->forward(ids.unsqueeze(0))[0], want, 1e-6, 1e-6));
  // Decode (fused kernels, f32) reads the normed keys too.
  m->to(torch::kFloat32);
  auto state = m->new_state(1);
  std::vector<torch::Tensor> steps;
  for (int64_t t = 0; t < T; ++t) steps.push_back(m->step(ids.narrow(0, t, 1).unsqueeze(0), state));
  EXPECT_TRUE(torch::allclose(torch::cat(steps, 1)[0].to(torch::kFloat64), want, 1e-4, 1e-4));
}

TEST(HfFormat, ConfigsKvxCannotHonourAreRefusedByName) {
  nlohmann::json base = {{"model_type", "llama"}, {"vocab_size", 300}, {"hidden_size", 24}, {"intermediate_size", 40},
                         {"num_hidden_layers", 2}, {"num_attention_heads", 4}, {"num_key_value_heads", 2},
                         {"max_position_embeddings", 64}, {"rms_norm_eps", 1e-6}, {"rope_theta", 500.0}, {"hidden_act", "silu"},
                         {"torch_dtype", "bfloat16"}, {"bos_token_id", 1}, {"architectures", {"LlamaForCausalLM"}}};
  const auto c = model::config_from_hf(base);
  EXPECT_EQ(c.head_dim, 6);  // hidden / heads when absent
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_FALSE(c.qk_norm);
  // Absent or null (Python's None) fields take transformers' defaults, not kvx's (tied embeddings
  // dropped lm_head; eps 1e-5 against Llama's and Qwen3's 1e-6).
  auto nulls = base;
  nulls["tie_word_embeddings"] = nullptr;
  nulls["rms_norm_eps"] = nullptr;
  auto absent = base;
  absent.erase("rms_norm_eps");
  for (const auto& cfg : {model::config_from_hf(nulls), model::config_from_hf(absent)}) {
    EXPECT_FALSE(cfg.tie_word_embeddings);
    EXPECT_DOUBLE_EQ(cfg.rms_norm_eps, 1e-6);
  }
  {
    auto j = base;
    j["rope_theta"] = true;  // a boolean is not a number (nlohmann read it as 1.0)
    EXPECT_THROW(model::config_from_hf(j), Error);
  }
  auto qwen = base;
  qwen["model_type"] = "qwen3";
  qwen["head_dim"] = 8;
  qwen["use_sliding_window"] = false;
  EXPECT_TRUE(model::config_from_hf(qwen).qk_norm);
  const auto refused = [&](const std::string& key, const nlohmann::json& value, const std::string& mention) {
    auto j = base;
    j[key] = value;
    try {
      model::config_from_hf(j);
      ADD_FAILURE() << key << " = " << value.dump() << " was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(mention), std::string::npos) << e.what();
    }
  };
  refused("model_type", "gpt2", "gpt2");
  refused("model_type", "qwen2", "qwen2");
  refused("rope_scaling", {{"type", "yarn"}, {"factor", 4.0}}, "rope_scaling");
  refused("attention_bias", true, "attention_bias");
  refused("mlp_bias", true, "mlp_bias");
  refused("hidden_act", "gelu", "hidden_act");
  refused("quantization_config", nlohmann::json::object(), "quantization_config");
  refused("use_sliding_window", true, "use_sliding_window");
  refused("num_key_value_heads", 3, "num_key_value_heads");
  // Export: only dense, non-looped models.
  auto lrkv = small(false, true, 4);
  lrkv.layout = "lrkv";
  EXPECT_THROW(model::config_to_hf(lrkv), Error);
  auto looped = small(false, true, 4);
  looped.loops = 2;  // Ouro's layout has sandwich norms; a looped model without them has no HF form
  EXPECT_THROW(model::config_to_hf(looped), Error);
  looped.sandwich_norm = true;
  looped.qk_norm = true;
  EXPECT_THROW(model::config_to_hf(looped), Error);
  refused("total_ut_steps", 4, "total_ut_steps");  // a looped field on a llama config
  refused("auto_map", {{"AutoModelForCausalLM", "custom.Model"}}, "auto_map");  // custom code kvx would not run
  auto sandwich = small(false, true, 4);  // one loop with Ouro's norms: neither Llama nor Ouro
  sandwich.sandwich_norm = true;
  EXPECT_THROW(model::config_to_hf(sandwich), Error);
  auto ouro = base;
  ouro["model_type"] = "ouro";
  ouro["early_exit_step"] = 2;  // a fixed exit loop: not what kvx computes
  EXPECT_THROW(model::config_from_hf(ouro), Error);
  auto bad = small(false, true, 4);
  bad.layout = "mla";
  bad.qk_norm = true;
  EXPECT_THROW(bad.validate(), Error);
}

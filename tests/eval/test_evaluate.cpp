// Evaluation through decode caches: the cache's bytes per cached token and per token held (which
// eviction lowers), and CE/KL against the full forward.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include "eval/commands.h"
#include "eval/evaluate.h"
#include "support/fixtures.h"
#include "train/dataset.h"
#include "util/error.h"

using namespace kvx;

TEST(EvaluateCached, EvictionLowersTheBytesHeldPerTokenNotThoseOfACachedToken) {
  torch::manual_seed(0);
  const auto run = kvx::testing::small_run(1);
  model::Transformer m(run.model);
  const auto data = kvx::testing::synthetic_data(64, 200, 300);
  const auto batches = train::evaluation_batches(data.validation.tokens, 2, 2, 32);  // 2 windows of 32 tokens
  const double row = m->kv_bytes_per_token(kernels::KVType::F32);

  const auto full = eval::evaluate_lm_cached(m, batches, data.tokenizer, attention::CacheOptions::parse("f32", "", false), 0);
  EXPECT_DOUBLE_EQ(full.cache_bytes_per_token, row);
  EXPECT_DOUBLE_EQ(full.held_bytes_per_token, row);  // every token held
  EXPECT_LT(full.kl_vs_full, 1e-9);                  // the exact f32 cache
  EXPECT_EQ(full.top1_agreement, 1.0);

  // sink 2 + window 6: 8 of a window's 32 tokens held at its end
  const auto evicted =
      eval::evaluate_lm_cached(m, batches, data.tokenizer, attention::CacheOptions::parse("f32", "sink=2,window=6", false), 0);
  EXPECT_DOUBLE_EQ(evicted.cache_bytes_per_token, row);
  EXPECT_NEAR(evicted.held_bytes_per_token, row * 8 / 32, 1e-9);
  EXPECT_GT(evicted.kl_vs_full, 0.0);  // tokens past the window attend to fewer keys
}

// Windows that start with a tokenizer's BOS (an imported Llama 3's, as HF scores text): the
// input is the prefix then text, and the scored targets run from the prefix's last token's
// prediction (the text's first token) to the window's end, in both evaluators.
TEST(EvaluationBatches, APrefixStartsEachInputAndItsLastTokenPredictsTheText) {
  std::vector<int32_t> tokens(40);
  for (int i = 0; i < 40; ++i) tokens[i] = 3 * i % 256;
  const auto plain = train::evaluation_batches(tokens, 3, 2, 8);
  ASSERT_EQ(plain.size(), 2u);
  EXPECT_EQ(plain[0].first.sizes(), (std::vector<int64_t>{2, 8}));
  EXPECT_EQ(plain[0].second.sizes(), (std::vector<int64_t>{2, 8}));
  EXPECT_EQ(plain[0].second[0][0].item<int64_t>(), tokens[1]);  // no prefix: targets are the next tokens

  const std::vector<int32_t> bos{250, 251};
  const auto prefixed = train::evaluation_batches(tokens, 3, 2, 8, bos);
  ASSERT_EQ(prefixed.size(), 2u);
  const auto& [x, y] = prefixed[1];  // the third window, at the text's end
  EXPECT_EQ(x.sizes(), (std::vector<int64_t>{1, 8}));
  EXPECT_EQ(y.sizes(), (std::vector<int64_t>{1, 7}));  // 6 text tokens, and the prefix's last position
  const int64_t start = 40 - 6 - 1;                    // windows spread to the end of the text
  EXPECT_EQ(x[0][0].item<int64_t>(), 250);
  EXPECT_EQ(x[0][1].item<int64_t>(), 251);
  for (int t = 0; t < 6; ++t) EXPECT_EQ(x[0][2 + t].item<int64_t>(), tokens[start + t]);
  for (int t = 0; t < 7; ++t) EXPECT_EQ(y[0][t].item<int64_t>(), tokens[start + t]);
  try {
    train::evaluation_batches(tokens, 1, 1, 2, bos);
    FAIL() << "a window no longer than the prefix was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("use longer windows"), std::string::npos) << e.what();
  }

  torch::manual_seed(0);
  model::Transformer m(kvx::testing::small_run(1).model);
  m->eval();
  const auto data = kvx::testing::synthetic_data(64, 200, 300);
  const auto q = eval::evaluate_lm(m, prefixed, data.tokenizer);
  EXPECT_EQ(q.tokens, 3 * 7);
  double nats = 0;  // the targets' log-probabilities at positions 1 .. 7 of each input
  for (const auto& [bx, by] : prefixed) {
    torch::NoGradGuard ng;
    auto logp = torch::log_softmax(m->forward(bx).to(torch::kFloat64), -1).narrow(1, 1, 7);
    nats -= logp.gather(-1, by.unsqueeze(-1)).sum().item<double>();
  }
  EXPECT_NEAR(q.cross_entropy, nats / 21, 1e-9);
  const auto c = eval::evaluate_lm_cached(m, prefixed, data.tokenizer, attention::CacheOptions::parse("f32", "", false), 0);
  EXPECT_NEAR(c.quality.cross_entropy, q.cross_entropy, 1e-5);
  EXPECT_LT(c.kl_vs_full, 1e-9);
  EXPECT_EQ(c.quality.tokens, q.tokens);
}

// A prompt gets what the tokenizer's post_processor puts before a sequence (Llama 3's BOS), as
// HF's tokenizer does by default, and not what it puts after (an EOS would end the text to
// continue); a tokenizer without one (kvx trains none) adds nothing.
TEST(GenerateText, PromptsGetThePostProcessorsSpecialTokens) {
  torch::manual_seed(0);
  auto config = kvx::testing::small_run(1).model;
  config.vocab_size = 258;
  train::LoadedModel m{model::Transformer(config), text::BpeTokenizer(), ""};
  eval::GenerateRequest r;
  r.prompt = "hello";
  r.max_new = 1;
  r.temperature = 0;
  EXPECT_EQ(eval::generate_text(m, r).prompt_tokens, 5);
  auto j = nlohmann::json::parse(m.tokenizer.to_json());
  j["added_tokens"] = {{{"id", 256}, {"content", "<|begin_of_text|>"}, {"special", true}},
                       {{"id", 257}, {"content", "<|end_of_text|>"}, {"special", true}}};
  j["post_processor"] = {{"type", "TemplateProcessing"},
                         {"single",
                          {{{"SpecialToken", {{"id", "<|begin_of_text|>"}}}},
                           {{"Sequence", {{"id", "A"}}}},
                           {{"SpecialToken", {{"id", "<|end_of_text|>"}}}}}},
                         {"special_tokens", {{"<|begin_of_text|>", {{"ids", {256}}}}, {"<|end_of_text|>", {{"ids", {257}}}}}}};
  m.tokenizer = text::BpeTokenizer::from_json(j.dump());
  EXPECT_EQ(eval::generate_text(m, r).prompt_tokens, 6);
}

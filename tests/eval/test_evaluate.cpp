// Evaluation through decode caches: the cache's bytes per cached token and per token held (which
// eviction lowers), and CE/KL against the full forward.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include "eval/commands.h"
#include "eval/evaluate.h"
#include "support/fixtures.h"
#include "train/dataset.h"

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

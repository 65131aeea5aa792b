// Serving after a document three ways: with the exact document in the module's place every mode
// answers the same greedy tokens (so the prefix cache's rollback and the composed reads are right),
// and the state each holds is what it should be.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "compress/nectar.h"
#include "eval/serving.h"
#include "support/fixtures.h"
#include "util/error.h"

using namespace kvx;

TEST(DocumentServing, EveryModeAnswersAlikeWithTheExactDocument) {
  torch::manual_seed(21);
  auto c = kvx::testing::mixer_config(4, 2, 8, 24);
  c.num_hidden_layers = 2;
  c.vocab_size = 29;
  c.max_position_embeddings = 80;
  model::Transformer m(c);
  std::vector<int32_t> document, prompt;
  for (int i = 0; i < 37; ++i) document.push_back((i * 7 + 3) % 29);
  for (int i = 0; i < 5; ++i) prompt.push_back((i * 5 + 1) % 29);
  const auto doc = compress::prefill_document(m, document, 16);
  const auto rows = eval::measure_document_serving(m, document, doc.exact(c), 0, prompt, 6, 2);
  ASSERT_EQ(rows.size(), 3u);
  EXPECT_EQ(rows[0].mode, "prefill");
  EXPECT_EQ(rows[1].mode, "prefix");
  EXPECT_EQ(rows[2].mode, "module");
  for (const auto& r : rows) {
    EXPECT_EQ(r.tokens, rows[0].tokens) << r.mode;
    EXPECT_GT(r.ttft_seconds, 0) << r.mode;
    EXPECT_GT(r.decode_tokens_per_second, 0) << r.mode;
  }
  // Document + prompt + answer (the last answer token is appended too), f32 K and V of 2 layers x 2 KV heads x 8.
  const int64_t row_bytes = 2 * 2 * 2 * 8 * 4;
  EXPECT_EQ(rows[0].state_bytes, (37 + 5 + 6) * row_bytes);
  EXPECT_EQ(rows[1].state_bytes, rows[0].state_bytes);
  EXPECT_EQ(rows[2].state_bytes, (5 + 6) * row_bytes);  // the exact "module" has no weights of its own
  EXPECT_GT(rows[1].setup_seconds, 0);
  EXPECT_THROW(eval::measure_document_serving(m, document, nullptr, 0, {}, 2, 1), Error);
}

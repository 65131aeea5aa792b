#include "eval/serving.h"

#include <algorithm>
#include <chrono>

#include "attention/dense.h"
#include "model/sampling.h"
#include "util/error.h"

namespace kvx::eval {

namespace {

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// Prompt in, first logits out, then greedy decode: {ttft, decode tok/s}; the answer in *tokens.
std::pair<double, double> request(model::Transformer& model, model::DecodeState& state, const torch::Tensor& input, int new_tokens,
                                  std::vector<int64_t>* tokens) {
  tokens->clear();
  const double t0 = now();
  auto logits = model->step(input, state);
  const double t1 = now();
  for (int i = 0; i < new_tokens; ++i) {
    const auto next = logits.select(1, logits.size(1) - 1).argmax(-1, true);
    tokens->push_back(next.item<int64_t>());
    logits = model->step(next, state);
  }
  const double t2 = now();
  return {t1 - t0, new_tokens / std::max(t2 - t1, 1e-9)};
}

}  // namespace

nlohmann::json ServingRow::to_json() const {
  return {{"mode", mode}, {"ttft_s", ttft_seconds}, {"decode_tok_s", decode_tokens_per_second}, {"setup_s", setup_seconds},
          {"state_bytes", state_bytes}};
}

std::vector<ServingRow> measure_document_serving(model::Transformer& model, const std::vector<int32_t>& document,
                                                 std::shared_ptr<const attention::NectarDocument> module, int64_t module_bytes,
                                                 const std::vector<int32_t>& prompt, int new_tokens, int repeats) {
  if (document.empty() || prompt.empty()) throw Error("document serving: the document and the prompt must be non-empty");
  torch::NoGradGuard no_grad;
  const auto doc = model::token_batch(document), p = model::token_batch(prompt);
  std::vector<int32_t> joined = document;
  joined.insert(joined.end(), prompt.begin(), prompt.end());
  const auto doc_and_prompt = model::token_batch(joined);
  const int64_t n = static_cast<int64_t>(document.size());
  std::vector<ServingRow> rows;
  const auto best = [&](ServingRow& row, const std::function<std::pair<double, double>()>& one) {
    row.ttft_seconds = 1e30;
    for (int r = 0; r < std::max(1, repeats); ++r) {
      const auto [ttft, tps] = one();
      row.ttft_seconds = std::min(row.ttft_seconds, ttft);
      row.decode_tokens_per_second = std::max(row.decode_tokens_per_second, tps);
    }
  };
  {  // (a) the document prefilled with every request
    ServingRow row{"prefill"};
    auto state = model->new_state(1);
    best(row, [&] {
      state.clear();
      return request(model, state, doc_and_prompt, new_tokens, &row.tokens);
    });
    row.state_bytes = state.bytes();
    rows.push_back(row);
  }
  {  // (b) a reused prefix cache: prefilled once, rolled back to the document after each request
    ServingRow row{"prefix"};
    auto state = model->new_state(1);
    const double t0 = now();
    model->step(doc, state);
    row.setup_seconds = now() - t0;
    best(row, [&] {
      for (auto& layer : state.layers) dynamic_cast<attention::FusedKVCache&>(*layer).truncate(n);
      return request(model, state, p, new_tokens, &row.tokens);
    });
    row.state_bytes = state.bytes();
    rows.push_back(row);
  }
  if (module) {  // (c) the module in the document's place
    ServingRow row{"module"};
    attention::CacheOptions options;
    options.document = module;
    auto state = model->new_state(1, options);
    best(row, [&] {
      state.clear();
      return request(model, state, p, new_tokens, &row.tokens);
    });
    row.state_bytes = state.bytes() + module_bytes;
    rows.push_back(row);
  }
  return rows;
}

}  // namespace kvx::eval

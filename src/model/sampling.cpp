#include "model/sampling.h"

#include <chrono>
#include <cmath>

#include "attention/nectar.h"
#include "util/error.h"
#include "util/strings.h"

namespace kvx::model {

torch::Tensor token_batch(const std::vector<int32_t>& ids) {
  return torch::tensor(std::vector<int64_t>(ids.begin(), ids.end()), torch::kLong).unsqueeze(0);
}

int64_t sample_token(const torch::Tensor& logits, const SamplingOptions& opt, std::mt19937_64& rng) {
  auto l = logits.to(torch::kFloat64).contiguous();
  // One reduction: the max is NaN if any logit is, +inf if any is, -inf if none is finite.
  const auto top = l.max();
  if (!std::isfinite(top.item<double>()))
    throw Error("sample_token: the model produced NaN or +inf logits (or no finite one); the weights or the cache are damaged");
  if (opt.temperature <= 0) return l.argmax().item<int64_t>();
  // (l - max) / T: at a tiny T, l / T alone overflowed to inf and the softmax to NaN
  auto probs = torch::softmax((l - top) / opt.temperature, 0);
  auto sorted = probs.sort(0, /*descending=*/true);
  auto p = std::get<0>(sorted);
  auto idx = std::get<1>(sorted);
  const double* pp = p.data_ptr<double>();
  const int64_t V = p.size(0);
  double mass = 0;
  int64_t keep = 0;
  while (keep < V && (keep == 0 || mass < opt.top_p)) mass += pp[keep++];
  double u = std::uniform_real_distribution<double>(0.0, mass)(rng);
  double acc = 0;
  for (int64_t i = 0; i < keep; ++i) {
    acc += pp[i];
    if (u < acc) return idx[i].item<int64_t>();
  }
  return idx[keep - 1].item<int64_t>();
}

void check_generation(const ModelConfig& config, int64_t prompt_tokens, int max_new, const SamplingOptions& opt,
                      int64_t document_tokens) {
  if (prompt_tokens < 1) throw Error("generate: the prompt is empty; give at least one token of text");
  if (max_new < 0) throw Error("generate: --max-new must be >= 0");
  const int64_t limit = config.max_position_embeddings;
  if (document_tokens + prompt_tokens + std::max(max_new - 1, 0) > limit) {
    const std::string document =
        document_tokens > 0 ? "the document module's document (" + std::to_string(document_tokens) + " tokens) + " : "";
    throw Error("generate: " + document + "prompt (" + std::to_string(prompt_tokens) + " tokens) + max-new (" +
                std::to_string(max_new) + ") exceeds the model's context limit of " + std::to_string(limit) +
                " tokens; shorten the prompt or lower --max-new");
  }
  if (!(std::isfinite(opt.temperature) && opt.temperature >= 0))
    throw Error("generate: --temperature must be a finite number >= 0 (0 is greedy), got " + format_number(opt.temperature));
  if (!(opt.top_p > 0 && opt.top_p <= 1))
    throw Error("generate: --top-p must be in (0, 1] (1 keeps every token), got " + format_number(opt.top_p));
}

GenerateResult generate(Transformer& model, const std::vector<int32_t>& prompt, int max_new,
                        const SamplingOptions& opt, uint64_t seed, const std::function<void(int32_t)>& on_token,
                        const attention::CacheOptions& cache) {
  check_generation(model->config(), static_cast<int64_t>(prompt.size()), max_new, opt,
                   cache.document ? cache.document->tokens : 0);
  torch::NoGradGuard ng;
  model->eval();
  std::mt19937_64 rng(seed);
  GenerateResult r;
  auto state = model->new_state(1, cache);
  auto t0 = std::chrono::steady_clock::now();
  auto ids = token_batch(prompt);
  auto logits = model->step(ids, state);
  auto t1 = std::chrono::steady_clock::now();
  for (int i = 0; i < max_new; ++i) {
    int64_t next = sample_token(logits[0][-1], opt, rng);
    r.tokens.push_back(static_cast<int32_t>(next));
    if (on_token) on_token(static_cast<int32_t>(next));
    if (i + 1 < max_new) logits = model->step(torch::full({1, 1}, next, torch::kLong), state);
  }
  auto t2 = std::chrono::steady_clock::now();
  r.prefill_seconds = std::chrono::duration<double>(t1 - t0).count();
  r.decode_seconds = std::chrono::duration<double>(t2 - t1).count();
  r.cache_bytes = state.bytes();
  r.cache_bytes_per_token = state.bytes_per_token();
  return r;
}

}  // namespace kvx::model

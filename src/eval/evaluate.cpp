#include "eval/evaluate.h"

#include <cmath>
#include <random>

#include "text/mqar.h"
#include "train/dataset.h"

namespace kvx::eval {

namespace {
std::vector<int64_t> token_byte_lengths(const text::BpeTokenizer& tok, int vocab) {
  std::vector<int64_t> len(vocab, 0);
  for (int i = 0; i < std::min(vocab, tok.vocab_size()); ++i) len[i] = static_cast<int64_t>(tok.token_bytes(i).size());
  return len;
}
int64_t target_bytes(const torch::Tensor& y, const std::vector<int64_t>& len) {
  int64_t b = 0;
  auto yc = y.contiguous();
  const int64_t* p = yc.data_ptr<int64_t>();
  for (int64_t i = 0; i < yc.numel(); ++i) b += len[p[i]];
  return b;
}
// The positions whose predictions `y` scores: the last y.size(1) of the window (all of them, or
// from the last prefix token on: train::evaluation_batches).
torch::Tensor scored(const torch::Tensor& per_position, const torch::Tensor& y) {
  return per_position.narrow(1, per_position.size(1) - y.size(1), y.size(1));
}
LmQuality finish(double nats, int64_t tokens, int64_t bytes) {
  LmQuality q;
  q.tokens = tokens;
  q.bytes = bytes;
  q.cross_entropy = tokens ? nats / tokens : 0;
  q.perplexity = std::exp(q.cross_entropy);
  q.bits_per_byte = bytes ? nats / std::log(2.0) / bytes : 0;
  return q;
}
}  // namespace

LmQuality evaluate_lm(model::Transformer& model, const std::vector<std::pair<torch::Tensor, torch::Tensor>>& batches,
                      const text::BpeTokenizer& tokenizer) {
  torch::NoGradGuard ng;
  const bool was_training = model->is_training();
  model->eval();
  auto len = token_byte_lengths(tokenizer, model->config().vocab_size);
  double nats = 0;
  int64_t tokens = 0, bytes = 0;
  for (const auto& [x, y] : batches) {
    auto logits = scored(model->forward(x), y);
    auto loss = torch::nn::functional::cross_entropy(
        logits.reshape({-1, logits.size(-1)}).to(torch::kFloat64), y.reshape({-1}),
        torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum));
    nats += loss.item<double>();
    tokens += y.numel();
    bytes += target_bytes(y, len);
  }
  if (was_training) model->train();
  return finish(nats, tokens, bytes);
}

CachedQuality evaluate_lm_cached(model::Transformer& model,
                                 const std::vector<std::pair<torch::Tensor, torch::Tensor>>& batches,
                                 const text::BpeTokenizer& tokenizer, const attention::CacheOptions& cache,
                                 int64_t chunk) {
  torch::NoGradGuard ng;
  const bool was_training = model->is_training();
  model->eval();
  auto len = token_byte_lengths(tokenizer, model->config().vocab_size);
  double nats = 0, kl = 0, agree = 0;
  int64_t tokens = 0, bytes = 0;
  CachedQuality out;
  for (const auto& [x, y] : batches) {
    auto full = torch::log_softmax(scored(model->forward(x), y).to(torch::kFloat64), -1);
    auto state = model->new_state(x.size(0), cache);
    torch::Tensor logits;
    if (chunk <= 0) {
      logits = model->step(x, state);
    } else {
      std::vector<torch::Tensor> parts;
      for (int64_t at = 0; at < x.size(1); at += chunk) parts.push_back(model->step(x.narrow(1, at, std::min(chunk, x.size(1) - at)), state));
      logits = torch::cat(parts, 1);
    }
    auto cached = torch::log_softmax(scored(logits, y).to(torch::kFloat64), -1);
    out.cache_bytes_per_token = state.bytes_per_token();
    out.held_bytes_per_token = static_cast<double>(state.bytes()) / static_cast<double>(x.numel());
    nats -= cached.gather(-1, y.unsqueeze(-1)).sum().item<double>();
    kl += (full.exp() * (full - cached)).sum().item<double>();
    agree += full.argmax(-1).eq(cached.argmax(-1)).sum().item<double>();
    tokens += y.numel();
    bytes += target_bytes(y, len);
  }
  if (was_training) model->train();
  out.quality = finish(nats, tokens, bytes);
  out.kl_vs_full = tokens ? kl / tokens : 0;
  out.top1_agreement = tokens ? agree / tokens : 0;
  return out;
}

std::vector<MqarPoint> mqar_accuracy(model::Transformer& model, const std::vector<int>& pairs, int sequences, int length,
                                     int symbols, uint64_t seed, const attention::CacheOptions* cache) {
  torch::NoGradGuard ng;
  const bool was_training = model->is_training();
  model->eval();
  std::mt19937_64 rng(seed);
  std::vector<MqarPoint> out;
  for (int n : pairs) {
    auto spec = train::mqar_spec(model->config().vocab_size, n, length, symbols);
    auto x = torch::empty({sequences, length}, torch::kLong);
    auto want = torch::full({sequences, length}, -1, torch::kLong);
    int64_t* px = x.data_ptr<int64_t>();
    int64_t* pw = want.data_ptr<int64_t>();
    for (int s = 0; s < sequences; ++s) {
      auto seq = text::make_mqar(spec, rng);
      for (int t = 0; t < length; ++t) {
        px[s * length + t] = seq.tokens[t];
        pw[s * length + t] = seq.answer[t];
      }
    }
    torch::Tensor logits;
    if (cache) {
      auto state = model->new_state(sequences, *cache);
      logits = model->step(x, state);
    } else {
      logits = model->forward(x);
    }
    auto pred = logits.argmax(-1);
    auto scored = want.ge(0);
    MqarPoint p;
    p.pairs = n;
    p.queries = scored.sum().item<int64_t>();
    p.accuracy = p.queries ? pred.eq(want).logical_and(scored).sum().item<double>() / p.queries : 0;
    out.push_back(p);
  }
  if (was_training) model->train();
  return out;
}

LmQuality unigram_quality(const std::vector<int32_t>& train, int vocab_size,
                          const std::vector<std::pair<torch::Tensor, torch::Tensor>>& batches,
                          const text::BpeTokenizer& tokenizer) {
  std::vector<double> count(vocab_size, 1.0);
  for (int32_t t : train) count[t] += 1.0;
  double total = 0;
  for (double c : count) total += c;
  auto len = token_byte_lengths(tokenizer, vocab_size);
  double nats = 0;
  int64_t tokens = 0, bytes = 0;
  for (const auto& [x, y] : batches) {
    auto yc = y.contiguous();
    const int64_t* p = yc.data_ptr<int64_t>();
    for (int64_t i = 0; i < yc.numel(); ++i) nats -= std::log(count[p[i]] / total);
    tokens += yc.numel();
    bytes += target_bytes(yc, len);
  }
  return finish(nats, tokens, bytes);
}

}  // namespace kvx::eval

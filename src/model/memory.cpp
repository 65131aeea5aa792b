#include "model/memory.h"

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "attention/cost.h"
#include "util/error.h"

namespace kvx::model {

namespace {

constexpr double kFloat = 4.0;
constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

std::string gib(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f", bytes / kGiB);
  return buf;
}

// Query, key and value widths a layer projects to per token (what attention reads).
double qkv_width(const ModelConfig& c, const std::string& kind) {
  const double q = static_cast<double>(c.num_attention_heads) * c.head_dim;
  if (kind == "dense") return q + 2.0 * c.num_key_value_heads * c.head_dim;
  if (kind == "gdn" || kind == "natsl")  // q, k, v before and after the convolution, the gate
    return 2.0 * c.linear_num_heads * (2.0 * c.linear_key_head_dim + c.linear_value_head_dim) +
           static_cast<double>(c.linear_num_heads) * c.linear_value_head_dim;
  return 3.0 * q;  // lrkv / mla: per-head K and V are materialised in training
}

}  // namespace

std::string MemoryEstimate::describe() const {
  std::string s = gib(total()) + " GiB (";
  auto part = [&](const char* name, double v) {
    if (v <= 0) return;
    if (s.back() != '(') s += ", ";
    s += std::string(name) + " " + gib(v);
  };
  part("weights", weights);
  part("gradients", gradients);
  part("optimizer", optimizer);
  part("activations", activations);
  part("KV cache", cache);
  return s + ")";
}

double parameter_count(const ModelConfig& c) {
  const double d = c.hidden_size, V = c.vocab_size, I = c.intermediate_size;
  double p = V * d * (c.tie_word_embeddings ? 1 : 2) + d;  // embeddings, head, final norm
  for (const auto& kind : c.layer_kinds())
    p += attention::AttentionShape::of_layer(c, kind).mixer_params() + 3 * d * I + (c.sandwich_norm ? 4 : 2) * d;
  if (c.exit_gate) p += d + 1;  // early_exit_gate
  return p;
}

MemoryEstimate training_memory(const ModelConfig& c, int batch, int seq_len) {
  MemoryEstimate m;
  const double P = parameter_count(c);
  m.weights = kFloat * P;
  m.gradients = kFloat * P;
  m.optimizer = 2 * kFloat * P;
  const double d = c.hidden_size, I = c.intermediate_size, T = seq_len;
  const double H = c.num_attention_heads, hq = H * c.head_dim;
  double per_token = 3.0 * c.vocab_size;  // logits, their log-softmax, its gradient
  for (const auto& kind : c.layer_kinds())  // every loop keeps its own activations for backward
    per_token += c.loops * (8 * d + qkv_width(c, kind) + hq + 4 * I + 2 * H * T);
  m.activations = kFloat * batch * T * per_token;
  return m;
}

MemoryEstimate inference_memory(const ModelConfig& c, int batch, int64_t prefill_tokens, int64_t cached_tokens,
                                double cache_bytes_per_token) {
  MemoryEstimate m;
  const double P = static_cast<double>(prefill_tokens), H = c.num_attention_heads;
  m.cache = cache_bytes_per_token * batch * static_cast<double>(cached_tokens);
  m.activations = kFloat * batch * (2 * H * P * P + 4 * P * (c.hidden_size + c.intermediate_size) + P * c.vocab_size);
  return m;
}

double available_memory_bytes() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  double kb = 0;
  std::string unit;
  while (in >> key >> kb >> unit)
    if (key == "MemAvailable:") return kb * 1024.0;
  return 0;
}

void require_memory(const MemoryEstimate& need, double available, const std::string& what, const std::string& fix) {
  const char* skip = std::getenv("KVX_SKIP_MEMORY_CHECK");
  if ((skip && std::string(skip) == "1") || available <= 0 || need.total() <= available) return;
  throw Error(what + " needs about " + need.describe() + " of memory but this machine has " + gib(available) +
              " GiB available; " + fix + " (or set KVX_SKIP_MEMORY_CHECK=1 if the estimate is wrong)");
}

}  // namespace kvx::model

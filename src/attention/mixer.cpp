#include "attention/mixer.h"

#include "attention/dense.h"
#include "attention/gdn.h"
#include "attention/lrkv.h"
#include "attention/mla.h"
#include "attention/natsl.h"
#include "attention/nectar.h"
#include <sstream>

#include "util/error.h"
#include "util/strings.h"

namespace kvx::attention {

CacheOptions CacheOptions::parse(const std::string& type, const std::string& evict, bool reference) {
  CacheOptions o;
  o.type = kernels::parse_kv_type(type);
  o.reference = reference;
  if (!evict.empty()) {
    const std::string usage = "; write --evict sink=S,window=W with S >= 0 and W >= 1";
    std::stringstream ss(evict);
    std::string item;
    bool have_window = false;
    while (std::getline(ss, item, ',')) {
      auto eq = item.find('=');
      if (eq == std::string::npos) throw Error("--evict: '" + item + "' is not key=value" + usage);
      const std::string key = item.substr(0, eq), value = item.substr(eq + 1);
      const int64_t n = whole_integer(value).value_or(-1);
      if (n < 0) throw Error("--evict: '" + value + "' is not a non-negative integer" + usage);
      if (n > (int64_t{1} << 40)) throw Error("--evict: " + key + "=" + value + " is longer than any context (2^40 tokens)" + usage);
      if (key == "sink") {
        o.evict.sink = n;
      } else if (key == "window") {
        o.evict.window = n;
        have_window = true;
      } else {
        throw Error("--evict: unknown key '" + key + "'" + usage);
      }
    }
    if (!have_window || o.evict.window < 1) throw Error("--evict needs window >= 1" + usage);
  }
  if (o.reference && (o.type != kernels::KVType::F32 || o.evict.enabled()))
    throw Error("the libtorch reference decode path supports only --kv-cache f32 without --evict; drop --reference");
  return o;
}

std::string CacheOptions::describe() const {
  std::string s = kernels::kv_type_name(type);
  if (evict.enabled()) s += ", sink=" + std::to_string(evict.sink) + ",window=" + std::to_string(evict.window);
  if (reference) s += ", libtorch reference path";
  if (share_kv_layers > 1) s += ", K/V shared by " + std::to_string(share_kv_layers) + " adjacent layers (CLA, libtorch path)";
  if (document) s += ", after a Nectar document module (" + std::to_string(document->tokens) + " document tokens, no document KV)";
  if (lla) {
    s = lla_absorbed ? "LLA codes, absorbed read (no RoPE on history keys: approximate)" : "LLA codes (reconstruct-on-read)";
    if (reference) s += ", libtorch reference path";
    if (evict.enabled()) s += ", sink=" + std::to_string(evict.sink) + ",window=" + std::to_string(evict.window);
  }
  return s;
}

void MixerCache::append_random_history(int64_t tokens, uint32_t seed) {
  (void)tokens;
  (void)seed;
  throw Error("this layer's cache cannot be filled with random history for a decode benchmark");
}

void SequenceBuffer::append(const torch::Tensor& x) {
  const int64_t t = x.size(2);
  const int64_t capacity = data_.defined() ? data_.size(2) : 0;
  if (length_ + t > capacity || data_.scalar_type() != x.scalar_type() || data_.size(0) != x.size(0) ||
      data_.size(1) != x.size(1) || data_.size(3) != x.size(3)) {
    const int64_t cap = std::max<int64_t>({length_ + t, capacity * 2, 64});
    auto grown = torch::empty({x.size(0), x.size(1), cap, x.size(3)}, x.options());
    if (length_ > 0) grown.narrow(2, 0, length_).copy_(data_.narrow(2, 0, length_));
    data_ = grown;
  }
  data_.narrow(2, length_, t).copy_(x);
  length_ += t;
}

void SequenceBuffer::truncate(int64_t length) {
  if (length < 0 || length > length_)
    throw Error("SequenceBuffer::truncate: length " + std::to_string(length) + " is outside [0, " + std::to_string(length_) + "]");
  length_ = length;
}

torch::Tensor SequenceBuffer::view() const { return data_.defined() ? data_.narrow(2, 0, length_) : data_; }

torch::Tensor token_major_f32(const torch::Tensor& x) { return x.transpose(1, 2).to(torch::kFloat32).contiguous(); }

torch::Tensor causal_mask(const torch::Tensor& scores, int64_t q_start) {
  const int64_t Tq = scores.size(-2), Tk = scores.size(-1);
  if (Tq == 1 && q_start + Tq >= Tk) return scores;  // one query that sees every key
  auto qpos = torch::arange(q_start, q_start + Tq, torch::kLong).unsqueeze(1);
  auto kpos = torch::arange(Tk, torch::kLong).unsqueeze(0);
  return scores.masked_fill(kpos > qpos, -std::numeric_limits<double>::infinity());
}

torch::Tensor causal_softmax(const torch::Tensor& scores, int64_t q_start) {
  return torch::softmax(causal_mask(scores, q_start), -1);
}

std::shared_ptr<Mixer> make_mixer(const std::string& kind, const model::ModelConfig& config, int layer) {
  if (kind == "dense") return std::make_shared<DenseAttention>(config, layer);
  if (kind == "lrkv") return std::make_shared<LrkvAttention>(config, layer);
  if (kind == "mla") return std::make_shared<MlaAttention>(config, layer);
  if (kind == "gdn") return std::make_shared<GdnAttention>(config, layer);
  if (kind == "natsl") return std::make_shared<NatslAttention>(config, layer);
  std::string valid;
  for (const auto& k : model::mixer_kinds()) valid += (valid.empty() ? "" : ", ") + k;
  throw Error("unknown mixer kind '" + kind + "' in layout (valid: " + valid + ")");
}

}  // namespace kvx::attention

#include "attention/lla.h"

#include <string>

#include "util/error.h"

namespace kvx::attention {

torch::Tensor LlaCodecPart::encode(const torch::Tensor& x) const {
  return torch::einsum("...gw,gwr->...gr", {x - mu.to(x.scalar_type()), down.to(x.scalar_type())});
}

torch::Tensor LlaCodecPart::decode(const torch::Tensor& c) const {
  return torch::einsum("...gr,gwr->...gw", {c, up.to(c.scalar_type())}) + mu.to(c.scalar_type());
}

LlaLayerStore::LlaLayerStore(const LlaCodecSet& codec, int layer)
    : keys_(codec.layers.at(layer).first), values_(codec.layers.at(layer).second), loops_(codec.loops),
      kv_heads_(codec.kv_heads), head_dim_(codec.head_dim), two_d_(codec.two_d), pending_k_(codec.loops),
      pending_v_(codec.loops) {}

int64_t LlaLayerStore::bytes() const {
  int64_t b = 0;
  for (size_t i = 0; i < codes_k_.size(); ++i) b += 4 * (codes_k_[i].numel() + codes_v_[i].numel());
  return b;
}

double LlaLayerStore::bytes_per_token() const { return 4.0 * keys_.mu.size(0) * (keys_.rank() + values_.rank()); }

void LlaLayerStore::clear() {
  codes_k_.clear();
  codes_v_.clear();
  joined_k_ = joined_v_ = torch::Tensor();
  for (auto& p : pending_k_) p = torch::Tensor();
  for (auto& p : pending_v_) p = torch::Tensor();
  committed_ = 0;
}

void LlaLayerStore::set_pending(int loop, const torch::Tensor& k, const torch::Tensor& v) {
  pending_k_.at(loop) = k.detach();
  pending_v_.at(loop) = v.detach();
}

torch::Tensor LlaLayerStore::stack(const std::vector<torch::Tensor>& per_loop) const {
  for (int t = 0; t < loops_; ++t)
    if (!per_loop[t].defined())
      throw Error("LLA: loop " + std::to_string(t) + " has not run for the chunk being committed (the loops must run in order)");
  auto x = torch::stack(per_loop, 3).permute({0, 2, 1, 3, 4});  // [B, n, Hkv, T, d_h]
  const int64_t B = x.size(0), n = x.size(1);
  return two_d_ ? x.reshape({B, n, 1, kv_heads_ * loops_ * head_dim_}) : x.reshape({B, n, kv_heads_, loops_ * head_dim_});
}

std::pair<torch::Tensor, torch::Tensor> LlaLayerStore::history(int loop) const {
  if (committed_ == 0) return {};
  if (!joined_k_.defined()) {
    joined_k_ = torch::cat(codes_k_, 1);
    joined_v_ = torch::cat(codes_v_, 1);
  }
  // Reconstruct-on-read: the codes are the only history; only loop `loop`'s rows of W_up and mu
  // are applied (x^_t = c W_up,t^T + mu_t).
  auto rebuild = [&](const LlaCodecPart& part, const torch::Tensor& codes) {
    const int64_t G = part.up.size(0), per_group = part.up.size(1) / (loops_ * head_dim_), r = part.up.size(2);
    const auto up_t = part.up.view({G, per_group, loops_, head_dim_, r}).select(2, loop).reshape({G, per_group * head_dim_, r});
    const auto mu_t = part.mu.view({G, per_group, loops_, head_dim_}).select(2, loop).reshape({G, per_group * head_dim_});
    const auto x = torch::einsum("blgr,gwr->blgw", {codes, up_t.to(codes.scalar_type())}) + mu_t.to(codes.scalar_type());
    return x.reshape({codes.size(0), codes.size(1), kv_heads_, head_dim_}).transpose(1, 2);  // [B, Hkv, L, d_h]
  };
  return {rebuild(keys_, joined_k_), rebuild(values_, joined_v_)};
}

void LlaLayerStore::commit() {
  torch::NoGradGuard ng;
  const auto xk = stack(pending_k_), xv = stack(pending_v_);
  codes_k_.push_back(keys_.encode(xk).to(torch::kFloat32));  // the persistent store is f32 codes
  codes_v_.push_back(values_.encode(xv).to(torch::kFloat32));
  committed_ += xk.size(1);
  joined_k_ = joined_v_ = torch::Tensor();
  for (auto& p : pending_k_) p = torch::Tensor();
  for (auto& p : pending_v_) p = torch::Tensor();
}

void LlaLayerStore::append_random_codes(int64_t batch, int64_t tokens, uint32_t seed) {
  torch::manual_seed(seed);
  const int64_t G = keys_.mu.size(0);
  codes_k_.push_back(torch::randn({batch, tokens, G, keys_.rank()}));
  codes_v_.push_back(torch::randn({batch, tokens, G, values_.rank()}));
  committed_ += tokens;
  joined_k_ = joined_v_ = torch::Tensor();
}

void LlaLoopCache::clear() {
  if (loop_ == 0) store_->clear();
  length_ = 0;
}

void LlaLoopCache::append_random_history(int64_t tokens, uint32_t seed) {
  if (loop_ == 0) store_->append_random_codes(1, tokens, seed);
  length_ += tokens;
}

std::vector<std::unique_ptr<MixerCache>> make_lla_caches(const LlaCodecSet& codec, int layers) {
  if (static_cast<int>(codec.layers.size()) != layers)
    throw Error("LLA codec has " + std::to_string(codec.layers.size()) + " layers but the model has " + std::to_string(layers));
  std::vector<std::shared_ptr<LlaLayerStore>> stores;
  for (int l = 0; l < layers; ++l) stores.push_back(std::make_shared<LlaLayerStore>(codec, l));
  std::vector<std::unique_ptr<MixerCache>> caches;
  for (int t = 0; t < codec.loops; ++t)
    for (int l = 0; l < layers; ++l) caches.push_back(std::make_unique<LlaLoopCache>(stores[l], t, codec.loops));
  return caches;
}

}  // namespace kvx::attention

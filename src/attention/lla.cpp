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

torch::Tensor LlaCodecPart::decode_loop(const torch::Tensor& codes, int loop, int loops, int head_dim) const {
  const int64_t G = up.size(0), per_group = up.size(1) / (static_cast<int64_t>(loops) * head_dim), r = up.size(2);
  const auto up_t = up.view({G, per_group, loops, head_dim, r}).select(2, loop).reshape({G, per_group * head_dim, r});
  const auto mu_t = mu.view({G, per_group, loops, head_dim}).select(2, loop).reshape({G, per_group * head_dim});
  const auto x = torch::einsum("blgr,gwr->blgw", {codes, up_t.to(codes.scalar_type())}) + mu_t.to(codes.scalar_type());
  return x.reshape({codes.size(0), codes.size(1), G * per_group, head_dim}).transpose(1, 2);  // [B, Hkv, L, d_h]
}

torch::Tensor stack_loops(const std::vector<torch::Tensor>& per_loop, bool across_heads) {
  auto x = torch::stack(per_loop, 3).permute({0, 2, 1, 3, 4});  // [B, n, Hkv, T, d_h]
  const int64_t B = x.size(0), n = x.size(1), H = x.size(2), width = x.size(3) * x.size(4);
  return across_heads ? x.reshape({B, n, 1, H * width}) : x.reshape({B, n, H, width});
}

LlaLayerStore::LlaLayerStore(const LlaCodecSet& codec, int layer)
    : keys_(codec.layers.at(layer).first), values_(codec.layers.at(layer).second), loops_(codec.loops),
      kv_heads_(codec.kv_heads), head_dim_(codec.head_dim), two_d_(codec.two_d), pending_k_(codec.loops),
      pending_v_(codec.loops) {}

int64_t LlaLayerStore::bytes() const {
  return committed_ == 0 ? 0 : 4 * (codes_k_.view().numel() + codes_v_.view().numel());
}

double LlaLayerStore::bytes_per_token() const { return 4.0 * keys_.mu.size(0) * (keys_.rank() + values_.rank()); }

void LlaLayerStore::clear() {
  codes_k_.clear();
  codes_v_.clear();
  for (auto& p : pending_k_) p = torch::Tensor();
  for (auto& p : pending_v_) p = torch::Tensor();
  committed_ = 0;
}

void LlaLayerStore::set_pending(int loop, const torch::Tensor& k, const torch::Tensor& v) {
  pending_k_.at(loop) = k.detach();
  pending_v_.at(loop) = v.detach();
}

std::pair<torch::Tensor, torch::Tensor> LlaLayerStore::history(int loop) const {
  if (committed_ == 0) return {};
  // Reconstruct-on-read: the codes are the only history (x^_t = c W_up,t^T + mu_t).
  return {keys_.decode_loop(codes_k_.view().transpose(1, 2), loop, loops_, head_dim_),
          values_.decode_loop(codes_v_.view().transpose(1, 2), loop, loops_, head_dim_)};
}

void LlaLayerStore::commit() {
  torch::NoGradGuard ng;
  for (int t = 0; t < loops_; ++t)
    if (!pending_k_[t].defined())
      throw Error("LLA: loop " + std::to_string(t) + " has not run for the chunk being committed (the loops must run in order)");
  const auto xk = stack_loops(pending_k_, two_d_), xv = stack_loops(pending_v_, two_d_);  // [B, n, G, W]
  // The persistent store is f32 codes, appended along the token axis.
  codes_k_.append(keys_.encode(xk).to(torch::kFloat32).transpose(1, 2).contiguous());
  codes_v_.append(values_.encode(xv).to(torch::kFloat32).transpose(1, 2).contiguous());
  committed_ += xk.size(1);
  for (auto& p : pending_k_) p = torch::Tensor();
  for (auto& p : pending_v_) p = torch::Tensor();
}

void LlaLayerStore::append_random_codes(int64_t batch, int64_t tokens, uint32_t seed) {
  torch::manual_seed(seed);
  const int64_t G = keys_.mu.size(0);
  codes_k_.append(torch::randn({batch, G, tokens, keys_.rank()}));
  codes_v_.append(torch::randn({batch, G, tokens, values_.rank()}));
  committed_ += tokens;
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

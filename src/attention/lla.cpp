#include "attention/lla.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "nn/tensor_io.h"
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

namespace {

// One loop's rows of a codec part in the kernel's layout: up [G, r, rows] (W_up,t transposed), mu [G, rows],
// rows = the group's KV heads x d_h of loop `loop`.
std::pair<torch::Tensor, torch::Tensor> loop_panels(const LlaCodecPart& part, int loop, int loops, int head_dim) {
  torch::NoGradGuard ng;
  const int64_t G = part.up.size(0), per_group = part.up.size(1) / (static_cast<int64_t>(loops) * head_dim), r = part.up.size(2);
  const auto up = part.up.view({G, per_group, loops, head_dim, r}).select(2, loop).reshape({G, per_group * head_dim, r});
  const auto mu = part.mu.view({G, per_group, loops, head_dim}).select(2, loop).reshape({G, per_group * head_dim});
  return {up.transpose(1, 2).to(torch::kFloat32).contiguous().detach(), mu.to(torch::kFloat32).contiguous().detach()};
}

void check_loop(int loop, int loops) {
  if (loop < 0 || loop >= loops)
    throw Error("LLA: loop " + std::to_string(loop) + " is outside the model's " + std::to_string(loops) + " loops");
}

}  // namespace

LlaLayerStore::LlaLayerStore(const LlaCodecSet& codec, int layer, const CacheOptions& options)
    : keys_(codec.layers.at(layer).first), values_(codec.layers.at(layer).second), loops_(codec.loops),
      kv_heads_(codec.kv_heads), head_dim_(codec.head_dim), two_d_(codec.two_d), reference_(options.reference),
      absorbed_(options.lla_absorbed), evict_(options.evict), threads_(options.threads), pending_k_(codec.loops),
      pending_v_(codec.loops) {
  if (options.type != kernels::KVType::F32)
    throw Error("an LLA codec stores f32 codes; drop --kv-cache (" + kernels::kv_type_name(options.type) + ")");
  if (reference_ && (absorbed_ || evict_.enabled()))
    throw Error("the libtorch reference LLA path reconstructs every history key with RoPE; drop --reference to use the "
                "absorbed read or eviction");
  if (evict_.sink < 0 || evict_.window < 0 || (evict_.sink > 0 && !evict_.enabled()))
    throw Error("LLA eviction: sink and window must be >= 0 and a sink needs a window");
  for (int t = 0; t < loops_; ++t) {
    auto [uk, mk] = loop_panels(keys_, t, loops_, head_dim_);
    auto [uv, mv] = loop_panels(values_, t, loops_, head_dim_);
    panels_.insert(panels_.end(), {uk, mk, uv, mv});
  }
}

int64_t LlaLayerStore::bytes() const {
  return codes_k_.length() == 0 ? 0 : 4 * (codes_k_.view().numel() + codes_v_.view().numel());
}

double LlaLayerStore::bytes_per_token() const { return 4.0 * keys_.mu.size(0) * (keys_.rank() + values_.rank()); }

void LlaLayerStore::clear() {
  codes_k_.clear();
  codes_v_.clear();
  for (auto& p : pending_k_) p = torch::Tensor();
  for (auto& p : pending_v_) p = torch::Tensor();
  committed_ = shift_ = 0;
}

void LlaLayerStore::set_pending(int loop, const torch::Tensor& k, const torch::Tensor& v) {
  check_loop(loop, loops_);
  if (k.dim() != 4 || k.size(1) != kv_heads_ || k.size(3) != head_dim_ || v.sizes() != k.sizes())
    throw Error("LLA: a chunk's keys and values are [batch, " + std::to_string(kv_heads_) + " KV heads, tokens, " +
                std::to_string(head_dim_) + "], both the same; got k " + nn::shape_of(k) + ", v " + nn::shape_of(v));
  for (const auto& other : pending_k_)  // every loop of a chunk holds the same tokens
    if (other.defined() && other.sizes() != k.sizes())
      throw Error("LLA: loop " + std::to_string(loop) + "'s chunk is " + nn::shape_of(k) + " but another loop's is " +
                  nn::shape_of(other) + "; the loops of a chunk run over the same tokens");
  const auto kc = codes_k_.view();
  if (kc.defined() && kc.size(0) != k.size(0))
    throw Error("LLA: the chunk has batch " + std::to_string(k.size(0)) + " but the store holds codes for batch " +
                std::to_string(kc.size(0)));
  pending_k_.at(loop) = k.detach();
  pending_v_.at(loop) = v.detach();
}

std::pair<torch::Tensor, torch::Tensor> LlaLayerStore::history(int loop) const {
  check_loop(loop, loops_);
  if (committed_ == 0) return {};
  // Reconstruct-on-read: the codes are the only history (x^_t = c W_up,t^T + mu_t).
  return {keys_.decode_loop(codes_k_.view().transpose(1, 2), loop, loops_, head_dim_),
          values_.decode_loop(codes_v_.view().transpose(1, 2), loop, loops_, head_dim_)};
}

kernels::LlaDecodeArgs LlaLayerStore::read_args(int loop, int64_t position, int64_t batch_row) const {
  if (loop < 0 || loop >= loops_ || position < committed_)
    throw Error("LLA read: loop " + std::to_string(loop) + " of " + std::to_string(loops_) + " at position " +
                std::to_string(position) + " (the history holds " + std::to_string(committed_) +
                " committed tokens; a read is for a position at or after them)");
  kernels::LlaDecodeArgs a;
  a.heads = 0;  // the caller's
  a.kv_heads = kv_heads_;
  a.head_dim = head_dim_;
  a.groups = static_cast<int>(keys_.mu.size(0));
  const auto& p = panels_;
  a.keys = {p[4 * loop].data_ptr<float>(), p[4 * loop + 1].data_ptr<float>(), static_cast<int>(keys_.rank())};
  a.values = {p[4 * loop + 2].data_ptr<float>(), p[4 * loop + 3].data_ptr<float>(), static_cast<int>(values_.rank())};
  a.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim_)));
  a.mode = absorbed_ ? kernels::LlaReadMode::Absorbed : kernels::LlaReadMode::Reconstruct;
  if (committed_ == 0) return a;
  const auto kc = codes_k_.view(), vc = codes_v_.view();
  a.key_codes = kc.data_ptr<float>() + batch_row * kc.stride(0);
  a.value_codes = vc.data_ptr<float>() + batch_row * vc.stride(0);
  a.key_group_stride = kc.stride(1);
  a.value_group_stride = vc.stride(1);
  if (!evict_.enabled()) {
    a.history = {{0, committed_, 0}};
    return a;
  }
  // Visible: positions < sink and the last `window` positions up to the query's own.
  const int64_t sink_rows = std::min(evict_.sink, committed_), low = std::max(evict_.sink, position + 1 - evict_.window);
  if (sink_rows > 0) a.history.push_back({0, sink_rows, 0});
  if (low < committed_) a.history.push_back({low - shift_, committed_ - shift_, low});
  return a;
}

torch::Tensor LlaLayerStore::attend(int loop, const torch::Tensor& q, const torch::Tensor& q_pre, const torch::Tensor& k,
                                    const torch::Tensor& v, const std::vector<double>& inv_freq) const {
  check_loop(loop, loops_);
  const auto kc = codes_k_.view();
  if (q.dim() != 4 || q.size(3) != head_dim_ || q.size(1) % kv_heads_ != 0 || k.dim() != 4 || k.size(0) != q.size(0) ||
      k.size(1) != kv_heads_ || k.size(2) != q.size(2) || k.size(3) != head_dim_ || v.sizes() != k.sizes() ||
      (absorbed_ && (!q_pre.defined() || q_pre.sizes() != q.sizes())) || (kc.defined() && kc.size(0) != q.size(0)))
    throw Error("LLA read: expected q (and q_pre for an absorbed read) [batch, heads, tokens, " + std::to_string(head_dim_) +
                "] and the chunk's k, v [batch, " + std::to_string(kv_heads_) + " KV heads, tokens, " +
                std::to_string(head_dim_) + "] with the store's batch; got q " + nn::shape_of(q) + ", k " + nn::shape_of(k) +
                ", v " + nn::shape_of(v) + (kc.defined() ? ", store batch " + std::to_string(kc.size(0)) : ""));
  const auto qt = token_major_f32(q), kt = token_major_f32(k), vt = token_major_f32(v);  // [B, n, heads, d_h]
  const auto qp = absorbed_ ? token_major_f32(q_pre) : torch::Tensor();
  const int64_t B = qt.size(0), n = qt.size(1), H = qt.size(2), d = head_dim_, row = kv_heads_ * d;
  auto out = torch::empty_like(qt);
  std::vector<float> tail_k, tail_v;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < n; ++i) {
      const int64_t position = committed_ + i;
      auto a = read_args(loop, position, b);
      a.heads = static_cast<int>(H);
      a.inv_freq = inv_freq.data();
      // The chunk's tokens 0..i this query sees: [0, i] without eviction; with it, those at positions
      // < sink and within the window (one run, or two gathered into a scratch tail).
      int64_t first = 0, sink_end = 0;
      if (evict_.enabled()) {
        sink_end = std::clamp<int64_t>(evict_.sink - committed_, 0, i + 1);
        first = std::max<int64_t>(0, position + 1 - evict_.window - committed_);
      }
      const float* kb = kt.data_ptr<float>() + b * n * row;
      const float* vb = vt.data_ptr<float>() + b * n * row;
      if (sink_end == 0 || first <= sink_end) {
        a.tail_keys = kb, a.tail_values = vb, a.tail = i + 1;
        if (sink_end == 0) a.tail_keys += first * row, a.tail_values += first * row, a.tail = i + 1 - first;
      } else {
        tail_k.assign(kb, kb + sink_end * row);
        tail_v.assign(vb, vb + sink_end * row);
        tail_k.insert(tail_k.end(), kb + first * row, kb + (i + 1) * row);
        tail_v.insert(tail_v.end(), vb + first * row, vb + (i + 1) * row);
        a.tail_keys = tail_k.data(), a.tail_values = tail_v.data(), a.tail = sink_end + (i + 1 - first);
      }
      const int64_t at = (b * n + i) * H * d;
      kernels::lla_decode_attention(a, qt.data_ptr<float>() + at, absorbed_ ? qp.data_ptr<float>() + at : nullptr,
                                    out.data_ptr<float>() + at, threads_);
    }
  return out.to(q.scalar_type()).transpose(1, 2);
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
  compact();
}

void LlaLayerStore::compact() {
  // Rows no later read can reach are those at positions in [sink, committed - window + 1); they are
  // dropped in batches (once the held rows pass sink + 2 window) so a commit stays O(1) amortised.
  if (!evict_.enabled()) return;
  const int64_t held = codes_k_.length(), keep = std::min(evict_.window, committed_ - evict_.sink);
  if (keep <= 0 || held <= evict_.sink + std::max<int64_t>(2 * evict_.window, 64)) return;
  for (SequenceBuffer* buf : {&codes_k_, &codes_v_}) {
    auto view = buf->view();
    view.narrow(2, evict_.sink, keep).copy_(view.narrow(2, held - keep, keep).clone());
    buf->truncate(evict_.sink + keep);
  }
  shift_ = committed_ - keep - evict_.sink;
}

void LlaLayerStore::append_random_codes(int64_t batch, int64_t tokens, uint32_t seed) {
  torch::manual_seed(seed);
  const int64_t G = keys_.mu.size(0);
  codes_k_.append(torch::randn({batch, G, tokens, keys_.rank()}));
  codes_v_.append(torch::randn({batch, G, tokens, values_.rank()}));
  committed_ += tokens;
  compact();
}

void LlaLoopCache::clear() {
  if (loop_ == 0) store_->clear();
  length_ = 0;
}

void LlaLoopCache::append_random_history(int64_t tokens, uint32_t seed) {
  if (loop_ == 0) store_->append_random_codes(1, tokens, seed);
  length_ += tokens;
}

std::vector<std::unique_ptr<MixerCache>> make_lla_caches(const CacheOptions& options, int layers) {
  const auto& codec = *options.lla;
  if (static_cast<int>(codec.layers.size()) != layers)
    throw Error("LLA codec has " + std::to_string(codec.layers.size()) + " layers but the model has " + std::to_string(layers));
  std::vector<std::shared_ptr<LlaLayerStore>> stores;
  for (int l = 0; l < layers; ++l) stores.push_back(std::make_shared<LlaLayerStore>(codec, l, options));
  std::vector<std::unique_ptr<MixerCache>> caches;
  for (int t = 0; t < codec.loops; ++t)
    for (int l = 0; l < layers; ++l) caches.push_back(std::make_unique<LlaLoopCache>(stores[l], t, codec.loops));
  return caches;
}

}  // namespace kvx::attention

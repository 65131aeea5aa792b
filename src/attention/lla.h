// LLA decode (SPEC 1.3; seed 002): a looped dense model whose history is stored as codes only.
// Per dense layer, one store shared by the T loops holds each committed token's codes for keys
// and values (compress/lla_codec.h fits them). A chunk of new tokens runs its T loops with its
// own K/V exact: loop t's attention reads the history reconstructed for loop t (x^_t = c W_up,t^T
// + mu_t, RoPE applied after reconstruction) followed by the chunk's exact keys; after the last
// loop the chunk's K/V of all loops are stacked, encoded and committed. So no code exists for a
// token before its loop T, and single-token decode is the chunk size 1 case.
// Reads go through the fused torch-free kernel (kernels/lla_decode.h: keys rebuilt tile by tile,
// values absorbed), or its absorbed approximation, or with CacheOptions::reference the libtorch
// path (history reconstructed in full each step) the kernel is tested against. Sink + window
// eviction (StreamingLLM) composes with the codes: reads see the first `sink` positions and the
// last `window` ones (the chunk's own tokens included), at their original RoPE positions.
#pragma once
#include <torch/torch.h>

#include <memory>
#include <utility>
#include <vector>

#include "attention/mixer.h"
#include "kernels/lla_decode.h"

namespace kvx::attention {

// One codec (keys or values of one layer): mu [G, W], down [G, W, r], up [G, W, r]; G groups
// (KV heads, or 1 for LLA-2D) of stacked width W (T d_h, or Hkv T d_h: heads, then loops, then d_h).
struct LlaCodecPart {
  torch::Tensor mu, down, up;
  torch::Tensor encode(const torch::Tensor& x) const;  // x [..., G, W] -> c [..., G, r]
  torch::Tensor decode(const torch::Tensor& c) const;  // c [..., G, r] -> x^ [..., G, W]
  // Loop `loop`'s reconstruction only (its rows of W_up and mu): codes [B, L, G, r] ->
  // [B, Hkv, L, d_h] for a model of `loops` loops and head width `head_dim`.
  torch::Tensor decode_loop(const torch::Tensor& codes, int loop, int loops, int head_dim) const;
  int64_t rank() const { return down.size(2); }
};

// The stacked layout the codec reads: per-loop K or V [B, Hkv, n, d_h] (T of them) ->
// [B, n, G, W] (G = Hkv, W = T d_h; across_heads: G = 1, W = Hkv T d_h, heads then loops then d_h).
torch::Tensor stack_loops(const std::vector<torch::Tensor>& per_loop, bool across_heads);

// What decode needs: every layer's key and value codecs.
struct LlaCodecSet {
  int loops = 0, kv_heads = 0, head_dim = 0;
  bool two_d = false;
  std::vector<std::pair<LlaCodecPart, LlaCodecPart>> layers;  // (keys, values)
};

class LlaLayerStore {
 public:
  // options: reference (libtorch reads), lla_absorbed, evict, threads; the type must be f32.
  LlaLayerStore(const LlaCodecSet& codec, int layer, const CacheOptions& options);
  int64_t committed() const { return committed_; }
  int64_t bytes() const;  // the codes held (f32)
  double bytes_per_token() const;
  void clear();
  bool reference() const { return reference_; }
  // Loop `loop`'s exact pre-RoPE K/V of the chunk in flight, [B, Hkv, n, d_h].
  void set_pending(int loop, const torch::Tensor& k, const torch::Tensor& v);
  // Reference read: loop `loop`'s history reconstructed from the codes, pre-RoPE
  // [B, Hkv, committed, d_h] each (undefined when nothing is committed).
  std::pair<torch::Tensor, torch::Tensor> history(int loop) const;
  // Fused read for the chunk at positions start.. (start = committed()): queries q [B, H, n, d_h]
  // (RoPE'd; q_pre before RoPE, for the absorbed mode), the chunk's keys k (RoPE'd) and values v
  // [B, Hkv, n, d_h]; query i sees the history and the chunk's tokens up to i. -> [B, H, n, d_h].
  torch::Tensor attend(int loop, const torch::Tensor& q, const torch::Tensor& q_pre, const torch::Tensor& k,
                       const torch::Tensor& v, const std::vector<double>& inv_freq) const;
  void commit();  // after the chunk's last loop: encode its stacked K/V and append the codes
  void append_random_codes(int64_t batch, int64_t tokens, uint32_t seed);
  // The kernel's view of the history read by a query at `position` (benchmarks).
  kernels::LlaDecodeArgs read_args(int loop, int64_t position, int64_t batch_row) const;

 private:
  void compact();  // with eviction: drop rows no read can reach any more
  int64_t row_position(int64_t row) const { return row < evict_.sink ? row : row + shift_; }
  LlaCodecPart keys_, values_;
  int loops_, kv_heads_, head_dim_;
  bool two_d_, reference_, absorbed_;
  kernels::Eviction evict_;
  int threads_;
  std::vector<torch::Tensor> panels_;  // per loop: up_k, mu_k, up_v, mu_v in the kernel's layout (f32)
  std::vector<torch::Tensor> pending_k_, pending_v_;
  SequenceBuffer codes_k_, codes_v_;  // codes held, [B, G, rows, r] (f32)
  int64_t committed_ = 0;
  int64_t shift_ = 0;  // with eviction: rows >= sink hold positions row + shift_
};

// The cache one (loop, layer) of the model steps with; loop 0's reports the store's bytes.
class LlaLoopCache : public MixerCache {
 public:
  LlaLoopCache(std::shared_ptr<LlaLayerStore> store, int loop, int loops) : store_(std::move(store)), loop_(loop), loops_(loops) {}
  int64_t length() const override { return length_; }
  int64_t bytes() const override { return loop_ == 0 ? store_->bytes() : 0; }
  double bytes_per_token() const override { return loop_ == 0 ? store_->bytes_per_token() : 0.0; }
  void clear() override;
  void append_random_history(int64_t tokens, uint32_t seed) override;
  LlaLayerStore& store() { return *store_; }
  int loop() const { return loop_; }
  bool last_loop() const { return loop_ == loops_ - 1; }
  void advance(int64_t tokens) { length_ += tokens; }

 private:
  std::shared_ptr<LlaLayerStore> store_;
  int loop_, loops_;
  int64_t length_ = 0;
};

// The decode caches of a looped dense model with an LLA codec (options.lla), loop-major (loops x layers).
std::vector<std::unique_ptr<MixerCache>> make_lla_caches(const CacheOptions& options, int layers);

}  // namespace kvx::attention

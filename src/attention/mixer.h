// The mixer interface (SPEC section 3): every attention family provides
//  - forward(x): the full-sequence causal path used for training (autograd);
//  - a cache type that knows its exact bytes and bytes per token;
//  - step(x, cache): prefill chunks and single-token decode, continuing at cache.length().
#pragma once
#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "kernels/kv_format.h"
#include "kernels/kv_store.h"
#include "model/config.h"
#include "nn/layers.h"

namespace kvx::attention {

struct LlaCodecSet;
struct NectarDocument;

class MixerCache {
 public:
  virtual ~MixerCache() = default;
  virtual int64_t length() const = 0;           // tokens seen so far (next position)
  virtual int64_t bytes() const = 0;            // bytes of cache state currently held
  virtual double bytes_per_token() const = 0;   // bytes per token per batch row
  virtual void clear() = 0;                     // reuse across requests
  // Appends `tokens` positions of N(0, 1) history (decode-speed benchmarks: speed does not depend
  // on the values). Caches that cannot are an error.
  virtual void append_random_history(int64_t tokens, uint32_t seed);
};

// A libtorch tensor [B, X, capacity, w] that grows along dim 2 by doubling its capacity, so
// appending a token never copies the whole history (the reference caches' storage).
class SequenceBuffer {
 public:
  void append(const torch::Tensor& x);  // [B, X, T, w]
  torch::Tensor view() const;           // [B, X, length, w]; undefined while empty
  int64_t length() const { return length_; }
  void clear() { length_ = 0; }
  void truncate(int64_t length);  // drop the entries past `length` (the storage is kept)

 private:
  torch::Tensor data_;
  int64_t length_ = 0;
};

// [B, X, T, w] (or [B, X, T]) -> contiguous f32 [B, T, X, w]: one token's heads in a row, as the torch-free
// kernels read them.
torch::Tensor token_major_f32(const torch::Tensor& x);

// Scores [..., Tq, Tk] with keys past their query set to -inf, query i at position q_start + i and
// key j at position j; and the softmax over them.
torch::Tensor causal_mask(const torch::Tensor& scores, int64_t q_start);
torch::Tensor causal_softmax(const torch::Tensor& scores, int64_t q_start);

// How a decode cache stores and reads its history.
struct CacheOptions {
  kernels::KVType type = kernels::KVType::F32;  // element type, quantised at write
  kernels::Eviction evict;                      // sink + window (StreamingLLM); off by default
  bool reference = false;  // the plain libtorch path (f32, no eviction), which the fused kernels are tested against
  int threads = 0;         // fused-kernel threads; 0 = all hardware threads
  // Decode benchmarks with random history: the fraction of blocks a NAtS-L layer keeps as softmax
  // KV (< 0: its budget, nats_max_softmax_fraction).
  double history_softmax_fraction = -1;
  // Looped dense models: store the history as LLA codes (attention/lla.h), f32; read by the fused
  // reconstruct-on-read kernel (libtorch with `reference`), composable with `evict`.
  std::shared_ptr<const LlaCodecSet> lla;
  // The absorbed LLA read (kernels/lla_decode.h): history keys scored in code space without RoPE;
  // exact only for keys without RoPE, an approximation for a RoPE model (its fidelity is measured).
  bool lla_absorbed = false;
  // Cross-layer KV sharing (CLA, posthoc): within each run of this many adjacent dense layers the
  // first layer's K/V serve all of them (1: off). Runs on the libtorch f32 caches.
  int share_kv_layers = 1;
  // Nectar (attention/nectar.h): the local tokens follow a document whose KV a fitted module
  // replaces; every dense layer's cache holds only the local tokens, positions starting at its length.
  std::shared_ptr<const NectarDocument> document;

  // From CLI strings: type "f32|bf16|q8|q4", evict "" or "sink=S,window=W".
  static CacheOptions parse(const std::string& type, const std::string& evict, bool reference);
  std::string describe() const;  // e.g. "q8, sink=4,window=252", "LLA codes"
};

class Mixer : public torch::nn::Module {
 public:
  // x: [B, T, d] (pre-normed). Positions 0..T-1, causal.
  virtual torch::Tensor forward(const torch::Tensor& x) = 0;
  virtual std::unique_ptr<MixerCache> new_cache(int64_t batch, const CacheOptions& options) const = 0;
  // x: [B, T, d] new tokens at positions cache.length() .. +T-1; appends them to the cache.
  virtual torch::Tensor step(const torch::Tensor& x, MixerCache& cache) = 0;
  // Cache bytes per token per batch row at the given element type.
  virtual double cache_bytes_per_token(kernels::KVType type = kernels::KVType::F32) const = 0;
  // Bytes per batch row the cache holds whatever the context length (GDN's recurrent state).
  virtual double state_bytes() const { return 0; }
  // Per-head query and key projections as [H, d, d_h] (keys expanded per query head: GQA heads
  // share, LRKV heads are W_s + U_h B_h^T) for head-diversity analysis (SPEC 1.1); false for
  // families without per-head softmax keys.
  virtual bool head_projections(torch::Tensor& wq, torch::Tensor& wk) const {
    (void)wq;
    (void)wk;
    return false;
  }
  // Called after the model's generic N(0, 0.02) initialisation; families with a structured
  // initialisation (LRKV's residual scale) override it.
  virtual void initialize() {}
};

// The registry of mixer kinds used by layout strings (model::mixer_kinds names them; the config
// refuses others). Unknown kinds get an error listing the valid ones.
std::shared_ptr<Mixer> make_mixer(const std::string& kind, const model::ModelConfig& config, int layer);

}  // namespace kvx::attention

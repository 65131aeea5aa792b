// Gated DeltaNet (SPEC 1.2; seed 001's GDN branch): the core recurrence in two forms that must
// agree, per head, state S [K x V]:
//   S = exp(g_t) S;   u_t = beta_t (v_t - S^T k_t);   S = S + k_t u_t^T;   o_t = S^T (scale q_t)
// q and k are L2-normalised by the caller (l2_normalize) and g_t <= 0 is a natural-log decay.
//
// gdn_recurrent: token by token (the reference; also the decode step).
// gdn_chunked: chunks of C tokens in parallel (the WY / UT-transform form). Inside a chunk with
// start state S_0, gamma_t = sum_{i<=t} g_i and G_t = exp(gamma_t):
//   (I + diag(beta) L) U = diag(beta) (V - diag(G) K S_0),   L_ti = exp(gamma_t - gamma_i) k_t.k_i (i < t)
//   O = scale (diag(G) Q S_0 + (M o Q K^T) U),                M_ti = exp(gamma_t - gamma_i) (i <= t)
//   S_C = G_C S_0 + K^T diag(exp(gamma_C - gamma)) U
// Both differentiate through libtorch autograd (the triangular solve included).
//
// GdnLayerBase holds what GDN and NAtS-L layers share (SPEC 1.2; flash-linear-attention names):
// q/k/v projections, each followed by a short causal depthwise convolution and SiLU; beta =
// sigmoid(b_proj x); g = -exp(A_log) softplus(a_proj x + dt_bias); the output gate g_proj and
// o_proj. GdnAttention is the plain GDN layer: o = o_proj(RMSNorm_V(gdn(q, k, v)) * silu(g_proj x)).
#pragma once
#include <torch/torch.h>

#include <utility>

#include "attention/cost.h"
#include "attention/mixer.h"

namespace kvx::attention {

// x / sqrt(sum x^2 + 1e-6) over the last dimension (SPEC 1.2).
torch::Tensor l2_normalize(const torch::Tensor& x);

// q, k [B, H, T, K], v [B, H, T, V], g, beta [B, H, T]; state [B, H, K, V] or undefined (zeros).
// Returns (o [B, H, T, V], final state [B, H, K, V]).
std::pair<torch::Tensor, torch::Tensor> gdn_recurrent(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                                      const torch::Tensor& g, const torch::Tensor& beta, double scale,
                                                      torch::Tensor state = {});
std::pair<torch::Tensor, torch::Tensor> gdn_chunked(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                                    const torch::Tensor& g, const torch::Tensor& beta, double scale,
                                                    torch::Tensor state = {}, int64_t chunk = 64);

// The recurrence token by token through the torch-free kernel (kernels::gdn_decode_step) on the
// f32 state [B, H, K, V], updated in place; inputs as gdn_recurrent (q, k normalised). Returns o
// [B, H, T, V] in q's dtype.
torch::Tensor gdn_recurrent_fused(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                  const torch::Tensor& g, const torch::Tensor& beta, double scale, torch::Tensor& state,
                                  int threads);

// The last conv-1 inputs of the q, k, v convolutions, [B, conv-1, channels] (undefined: zeros).
struct ConvTails {
  torch::Tensor q, k, v;
  void clear() { q = k = v = torch::Tensor(); }
};

// The GDN decode state: S [B, H, K, V] (f32) and the convolution tails of q, k, v, constant in the
// context length. fused: steps run kernels::gdn_decode_step (else the libtorch recurrence).
class GdnCache : public MixerCache {
 public:
  GdnCache(int64_t batch, const AttentionShape& shape, bool fused, int threads);
  int64_t length() const override { return length_; }
  int64_t bytes() const override;  // the state and the tails
  double bytes_per_token() const override { return 0; }
  void clear() override;
  // A random state (a sum of `tokens` decayed unit writes' worth of scale) and the length advanced.
  void append_random_history(int64_t tokens, uint32_t seed) override;

  torch::Tensor state;  // [B, H, K, V]
  ConvTails tails;
  int64_t length_ = 0;
  bool fused;
  int threads;

 private:
  int64_t batch_;
  AttentionShape shape_;
};

// The per-token inputs of the GDN recurrence, [B, T, ...] as projected (q, k not yet normalised).
struct GdnInputs {
  torch::Tensor q, k, v;  // after convolution and SiLU: [B, T, H K], [B, T, H K], [B, T, H V]
  torch::Tensor g, beta;  // [B, T, H]
};

class GdnLayerBase : public Mixer {
 public:
  GdnLayerBase(const model::ModelConfig& config, const std::string& kind);
  void initialize() override;  // A ~ U(0, 16), A_log = log A; dt log-uniform in [1e-3, 0.1], dt_bias = softplus^-1(dt)
  double cache_bytes_per_token(kernels::KVType type) const override { return shape_.cache_bytes(type); }
  double state_bytes() const override { return shape_.state_bytes(); }

  nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, a_proj{nullptr}, b_proj{nullptr}, g_proj{nullptr},
      o_proj{nullptr};
  nn::CausalConv1d q_conv1d{nullptr}, k_conv1d{nullptr}, v_conv1d{nullptr};
  torch::Tensor A_log, dt_bias;  // [H]

 protected:
  // With tails the convolutions continue from (and update) them (decode).
  GdnInputs project(const torch::Tensor& x, ConvTails* tails);
  // [B, T, H*w] -> [B, H, T, w]
  torch::Tensor heads_first(const torch::Tensor& x, int64_t width) const;
  int64_t heads_, key_dim_, value_dim_;
  AttentionShape shape_;
};

class GdnAttention : public GdnLayerBase {
 public:
  GdnAttention(const model::ModelConfig& config, int layer);
  torch::Tensor forward(const torch::Tensor& x) override;  // chunked form (chunk 64)
  std::unique_ptr<MixerCache> new_cache(int64_t batch, const CacheOptions& options) const override;
  torch::Tensor step(const torch::Tensor& x, MixerCache& cache) override;

  nn::RMSNorm o_norm{nullptr};  // over V, per head

 private:
  torch::Tensor finish(const torch::Tensor& o, const torch::Tensor& x);  // o [B, H, T, V] -> the layer output
};

}  // namespace kvx::attention

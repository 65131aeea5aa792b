// Building blocks shared by every model: RMSNorm, rotary position embedding, SwiGLU MLP, causal
// depthwise convolution.
#pragma once
#include <torch/torch.h>

namespace kvx::nn {

// y = x / sqrt(mean(x^2) + eps) * weight
class RMSNormImpl : public torch::nn::Module {
 public:
  RMSNormImpl(int64_t dim, double eps);
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor weight;
  double eps;
};
TORCH_MODULE(RMSNorm);

// Rotary embedding in the Llama "rotate half" convention: dims i and i + d_h/2 form a plane
// rotated by angle pos * theta^(-2i/d_h).
class Rope {
 public:
  Rope(int64_t head_dim, double theta);
  // A narrower rotation whose pair m (dims m and m + planes.size()) turns like plane planes[m]
  // of the head_dim rotation (used to rotate a latent that lives in those planes).
  static Rope of_planes(int64_t head_dim, double theta, const std::vector<int64_t>& planes);
  // x: [..., T, width] at positions start .. start+T-1 (width = head_dim, or 2 * planes).
  torch::Tensor apply(const torch::Tensor& x, int64_t start) const;
  int64_t head_dim() const { return head_dim_; }
  const std::vector<double>& inv_freq() const { return inv_freq_; }  // per plane

 private:
  Rope() = default;
  void ensure(int64_t positions, torch::ScalarType dtype) const;
  int64_t head_dim_ = 0;             // rotated width
  std::vector<double> inv_freq_;     // per pair
  mutable torch::Tensor cos_, sin_;  // [P, width/2], grown on demand
};

// x W^T (+ b) over x's last dimension, as torch::linear, except that a single row (a decode
// step's one token) goes through a matrix-vector product: libtorch 1.13's sgemm packs W on every
// call, which made a one-row 384 -> 1024 projection 5x slower (120 us against 23 on this
// project's VM).
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias = {});

// torch::nn::Linear with its forward through nn::linear; the same parameters ("weight", "bias"),
// so checkpoints do not change. Every projection of kvx's models is one.
class LinearImpl : public torch::nn::LinearImpl {
 public:
  using torch::nn::LinearImpl::LinearImpl;
  torch::Tensor forward(const torch::Tensor& x) { return linear(x, weight, bias); }
};
TORCH_MODULE(Linear);

Linear linear_no_bias(int64_t in, int64_t out);

// down(silu(gate(x)) * up(x))
class SwiGLUImpl : public torch::nn::Module {
 public:
  SwiGLUImpl(int64_t dim, int64_t hidden);
  torch::Tensor forward(const torch::Tensor& x);
  Linear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};
};
TORCH_MODULE(SwiGLU);

// Causal depthwise convolution along time, no bias (the short convolution of GDN and NAtS-L,
// SPEC 1.2, kernel 4): y_t[c] = sum_j weight[c][0][j] x_{t-K+1+j}[c], zeros before the start.
// Decode carries the last K-1 inputs (`tail`) from one call to the next.
class CausalConv1dImpl : public torch::nn::Module {
 public:
  CausalConv1dImpl(int64_t channels, int64_t kernel);
  // x [B, T, C]; *tail [B, K-1, C] the inputs before x (undefined: zeros), replaced by the last
  // K-1 inputs when given (detached: it is decode state).
  torch::Tensor forward(const torch::Tensor& x, torch::Tensor* tail = nullptr);
  torch::Tensor weight;  // [C, 1, K], torch's depthwise conv1d layout
};
TORCH_MODULE(CausalConv1d);

}  // namespace kvx::nn

#include "nn/layers.h"

#include <string>

#include "util/error.h"

namespace kvx::nn {

RMSNormImpl::RMSNormImpl(int64_t dim, double eps_) : eps(eps_) {
  weight = register_parameter("weight", torch::ones({dim}));
}

torch::Tensor RMSNormImpl::forward(const torch::Tensor& x) {
  auto x32 = x.scalar_type() == torch::kFloat64 ? x : x.to(torch::kFloat32);  // at least f32
  auto y = x32 * torch::rsqrt(x32.pow(2).mean(-1, true) + eps);
  return y.to(x.scalar_type()) * weight;
}

Rope::Rope(int64_t head_dim, double theta) : head_dim_(head_dim) {
  for (int64_t i = 0; i < head_dim / 2; ++i) inv_freq_.push_back(std::pow(theta, -2.0 * i / static_cast<double>(head_dim)));
}

Rope Rope::of_planes(int64_t head_dim, double theta, const std::vector<int64_t>& planes) {
  const Rope full(head_dim, theta);
  Rope r;
  r.head_dim_ = 2 * static_cast<int64_t>(planes.size());
  for (int64_t p : planes) r.inv_freq_.push_back(full.inv_freq_.at(p));
  return r;
}

void Rope::ensure(int64_t positions, torch::ScalarType dtype) const {
  if (cos_.defined() && cos_.size(0) >= positions && cos_.scalar_type() == dtype) return;
  int64_t p = std::max<int64_t>(positions, cos_.defined() ? cos_.size(0) * 2 : 256);
  auto opts = torch::TensorOptions().dtype(torch::kFloat64);
  auto inv = torch::tensor(inv_freq_, opts);
  auto ang = torch::outer(torch::arange(p, opts), inv);
  cos_ = ang.cos().to(dtype);
  sin_ = ang.sin().to(dtype);
}

torch::Tensor Rope::apply(const torch::Tensor& x, int64_t start) const {
  const int64_t T = x.size(2), half = head_dim_ / 2;
  ensure(start + T, x.scalar_type());
  auto c = cos_.narrow(0, start, T);
  auto s = sin_.narrow(0, start, T);
  auto x1 = x.narrow(-1, 0, half), x2 = x.narrow(-1, half, half);
  return torch::cat({x1 * c - x2 * s, x2 * c + x1 * s}, -1);
}

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias) {
  const bool one_row = x.dim() >= 1 && x.size(-1) > 0 && x.numel() == x.size(-1);
  const bool cpu_float = x.device().is_cpu() && x.scalar_type() == weight.scalar_type() &&
                         (x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kDouble);
  if (!one_row || !cpu_float) return torch::linear(x, weight, bias);
  const auto v = x.reshape({x.size(-1)});
  auto shape = x.sizes().vec();
  shape.back() = weight.size(0);
  return (bias.defined() ? torch::addmv(bias, weight, v) : torch::mv(weight, v)).view(shape);
}

Linear linear_no_bias(int64_t in, int64_t out) { return Linear(torch::nn::LinearOptions(in, out).bias(false)); }

SwiGLUImpl::SwiGLUImpl(int64_t dim, int64_t hidden) {
  gate_proj = register_module("gate_proj", linear_no_bias(dim, hidden));
  up_proj = register_module("up_proj", linear_no_bias(dim, hidden));
  down_proj = register_module("down_proj", linear_no_bias(hidden, dim));
}

torch::Tensor SwiGLUImpl::forward(const torch::Tensor& x) {
  return down_proj(torch::silu(gate_proj(x)) * up_proj(x));
}

CausalConv1dImpl::CausalConv1dImpl(int64_t channels, int64_t kernel) {
  if (channels < 1 || kernel < 1)
    throw Error("CausalConv1d: channels and kernel must be >= 1, got " + std::to_string(channels) + " and " +
                std::to_string(kernel));
  weight = register_parameter("weight", torch::randn({channels, 1, kernel}) * 0.02);
}

torch::Tensor CausalConv1dImpl::forward(const torch::Tensor& x, torch::Tensor* tail) {
  const int64_t C = weight.size(0), K = weight.size(2);
  if (x.dim() != 3 || x.size(2) != C)
    throw Error("CausalConv1d: expected x [B, T, " + std::to_string(C) + "], got " + std::to_string(x.dim()) +
                "-d input with last size " + std::to_string(x.dim() ? x.size(-1) : 0));
  torch::Tensor before = tail && tail->defined() ? *tail : torch::zeros({x.size(0), K - 1, C}, x.options());
  if (before.sizes() != torch::IntArrayRef({x.size(0), K - 1, C}))
    throw Error("CausalConv1d: the carried tail must be [B, K-1, C] = [" + std::to_string(x.size(0)) + ", " +
                std::to_string(K - 1) + ", " + std::to_string(C) + "]");
  const auto padded = torch::cat({before, x}, 1);  // [B, K-1+T, C]
  if (tail) *tail = padded.narrow(1, padded.size(1) - (K - 1), K - 1).detach().clone();
  const std::vector<int64_t> one{1}, none{0};
  const auto y = torch::conv1d(padded.transpose(1, 2), weight.to(x.scalar_type()), c10::nullopt, one, none, one, C);
  return y.transpose(1, 2);
}

}  // namespace kvx::nn

#include "nn/layers.h"

namespace kvx::nn {

RMSNormImpl::RMSNormImpl(int64_t dim, double eps_) : eps(eps_) {
  weight = register_parameter("weight", torch::ones({dim}));
}

torch::Tensor RMSNormImpl::forward(const torch::Tensor& x) {
  auto x32 = x.to(torch::kFloat32);
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

torch::nn::Linear linear_no_bias(int64_t in, int64_t out) {
  return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false));
}

SwiGLUImpl::SwiGLUImpl(int64_t dim, int64_t hidden) {
  gate_proj = register_module("gate_proj", linear_no_bias(dim, hidden));
  up_proj = register_module("up_proj", linear_no_bias(dim, hidden));
  down_proj = register_module("down_proj", linear_no_bias(hidden, dim));
}

torch::Tensor SwiGLUImpl::forward(const torch::Tensor& x) {
  return down_proj(torch::silu(gate_proj(x)) * up_proj(x));
}

}  // namespace kvx::nn

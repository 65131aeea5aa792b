#include "train/adamw.h"

#include <cmath>

#include "util/error.h"

namespace kvx::train {

AdamW::AdamW(std::vector<std::pair<std::string, torch::Tensor>> named_params, AdamWOptions opt)
    : params_(std::move(named_params)), opt_(opt) {
  for (auto& [name, p] : params_) {
    m_.push_back(torch::zeros_like(p));
    v_.push_back(torch::zeros_like(p));
  }
}

void AdamW::zero_grad() {
  for (auto& [name, p] : params_)
    if (p.grad().defined()) p.mutable_grad().zero_();
}

void AdamW::step(double lr) {
  torch::NoGradGuard ng;
  ++steps_;
  const double bc1 = 1.0 - std::pow(opt_.beta1, static_cast<double>(steps_));
  const double bc2 = 1.0 - std::pow(opt_.beta2, static_cast<double>(steps_));
  for (size_t i = 0; i < params_.size(); ++i) {
    auto& p = params_[i].second;
    if (!p.grad().defined()) continue;
    const auto& g = p.grad();
    m_[i].mul_(opt_.beta1).add_(g, 1.0 - opt_.beta1);
    v_[i].mul_(opt_.beta2).addcmul_(g, g, 1.0 - opt_.beta2);
    if (p.dim() >= 2 && opt_.weight_decay > 0) p.mul_(1.0 - lr * opt_.weight_decay);
    auto denom = (v_[i] / bc2).sqrt_().add_(opt_.eps);
    p.addcdiv_(m_[i], denom, -lr / bc1);
  }
}

nn::TensorMap AdamW::state() const {
  nn::TensorMap s;
  for (size_t i = 0; i < params_.size(); ++i) {
    s["exp_avg." + params_[i].first] = m_[i];
    s["exp_avg_sq." + params_[i].first] = v_[i];
  }
  s["step"] = torch::tensor({steps_}, torch::kLong);
  return s;
}

void AdamW::load_state(const nn::TensorMap& s, const std::string& what) {
  auto get = [&](const std::string& key, const torch::Tensor& like) {
    auto it = s.find(key);
    if (it == s.end()) throw Error(what + ": optimizer state lacks '" + key + "'; the checkpoint does not match this model");
    if (it->second.sizes() != like.sizes()) throw Error(what + ": optimizer state '" + key + "' has the wrong shape");
    return it->second.to(like.scalar_type());
  };
  torch::NoGradGuard ng;
  for (size_t i = 0; i < params_.size(); ++i) {
    m_[i].copy_(get("exp_avg." + params_[i].first, m_[i]));
    v_[i].copy_(get("exp_avg_sq." + params_[i].first, v_[i]));
  }
  auto it = s.find("step");
  if (it == s.end() || it->second.numel() != 1) throw Error(what + ": optimizer state lacks 'step'");
  steps_ = it->second.item<int64_t>();
}

}  // namespace kvx::train

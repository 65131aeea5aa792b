// AdamW (Loshchilov & Hutter) with decoupled weight decay on matrices only (norm gains are
// not decayed). Its state is a TensorMap so checkpoints store it as safetensors.
#pragma once
#include <torch/torch.h>

#include <string>
#include <utility>
#include <vector>

#include "nn/tensor_io.h"

namespace kvx::train {

struct AdamWOptions {
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.1;
};

class AdamW {
 public:
  AdamW(std::vector<std::pair<std::string, torch::Tensor>> named_params, AdamWOptions opt);
  void step(double lr);
  void zero_grad();
  int64_t steps() const { return steps_; }
  nn::TensorMap state() const;                 // "exp_avg.<name>", "exp_avg_sq.<name>", "step"
  void load_state(const nn::TensorMap& state, const std::string& what);

 private:
  std::vector<std::pair<std::string, torch::Tensor>> params_;
  std::vector<torch::Tensor> m_, v_;
  AdamWOptions opt_;
  int64_t steps_ = 0;
};

}  // namespace kvx::train

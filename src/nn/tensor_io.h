// torch tensors <-> safetensors files (format in io/safetensors_format.h). Writes are atomic.
#pragma once
#include <torch/torch.h>

#include <map>
#include <string>

namespace kvx::nn {

// "[2, 3, 4]": a tensor's shape for error messages.
std::string shape_of(const torch::Tensor& t);

using TensorMap = std::map<std::string, torch::Tensor>;

void save_safetensors(const std::string& path, const TensorMap& tensors,
                      const std::map<std::string, std::string>& metadata = {});
TensorMap load_safetensors(const std::string& path, std::map<std::string, std::string>* metadata = nullptr);
// Same, from bytes already in memory; `what` names the source in errors.
TensorMap parse_safetensors_tensors(const std::string& bytes, const std::string& what,
                                    std::map<std::string, std::string>* metadata = nullptr);

}  // namespace kvx::nn

#include "nn/tensor_io.h"

#include <cstring>

#include "io/atomic_file.h"
#include "io/safetensors_format.h"
#include "util/error.h"

namespace kvx::nn {

std::string shape_of(const torch::Tensor& t) {
  std::string s = "[";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + "]";
}


namespace {
io::DType to_io(torch::ScalarType t) {
  switch (t) {
    case torch::kFloat64: return io::DType::F64;
    case torch::kFloat32: return io::DType::F32;
    case torch::kFloat16: return io::DType::F16;
    case torch::kBFloat16: return io::DType::BF16;
    case torch::kInt64: return io::DType::I64;
    case torch::kInt32: return io::DType::I32;
    case torch::kInt16: return io::DType::I16;
    case torch::kInt8: return io::DType::I8;
    case torch::kUInt8: return io::DType::U8;
    case torch::kBool: return io::DType::BOOL;
    default: throw Error(std::string("cannot store tensors of type ") + c10::toString(t) + " in safetensors");
  }
}
torch::ScalarType to_torch(io::DType t) {
  switch (t) {
    case io::DType::F64: return torch::kFloat64;
    case io::DType::F32: return torch::kFloat32;
    case io::DType::F16: return torch::kFloat16;
    case io::DType::BF16: return torch::kBFloat16;
    case io::DType::I64: return torch::kInt64;
    case io::DType::I32: return torch::kInt32;
    case io::DType::I16: return torch::kInt16;
    case io::DType::I8: return torch::kInt8;
    case io::DType::U8: return torch::kUInt8;
    case io::DType::BOOL: return torch::kBool;
  }
  return torch::kFloat32;
}
}  // namespace

void save_safetensors(const std::string& path, const TensorMap& tensors,
                      const std::map<std::string, std::string>& metadata) {
  std::vector<torch::Tensor> keep;
  std::vector<io::TensorBlob> blobs;
  for (const auto& [name, t] : tensors) {
    torch::Tensor c = t.detach().to(torch::kCPU).contiguous();
    keep.push_back(c);
    io::TensorBlob b;
    b.name = name;
    b.dtype = to_io(c.scalar_type());
    b.shape = c.sizes().vec();
    b.bytes = std::string_view(static_cast<const char*>(c.data_ptr()), c.numel() * c.element_size());
    blobs.push_back(b);
  }
  io::write_file_atomic(path, io::serialize_safetensors(blobs, metadata));
}

TensorMap parse_safetensors_tensors(const std::string& bytes, const std::string& what,
                                    std::map<std::string, std::string>* metadata) {
  io::SafetensorsView view = io::parse_safetensors(bytes, what);
  TensorMap out;
  for (const auto& e : view.tensors) {
    torch::Tensor t = torch::empty(e.shape, torch::TensorOptions().dtype(to_torch(e.dtype)));
    if (e.end > e.begin) std::memcpy(t.data_ptr(), bytes.data() + view.data_start + e.begin, e.end - e.begin);
    out.emplace(e.name, t);
  }
  if (metadata) *metadata = view.metadata;
  return out;
}

TensorMap load_safetensors(const std::string& path, std::map<std::string, std::string>* metadata) {
  return parse_safetensors_tensors(io::read_file(path), path, metadata);
}

}  // namespace kvx::nn

// The safetensors container, torch-free: 8-byte little-endian header length, a JSON header
// {name: {dtype, shape, data_offsets}, "__metadata__": {str: str}}, then the raw data.
// Parsing validates everything a stranger's file could get wrong.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace kvx::io {

enum class DType { F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL };

size_t dtype_size(DType t);
std::string dtype_name(DType t);   // "F32", ...
DType parse_dtype(const std::string& name);  // throws listing the valid names

struct TensorEntry {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // byte offsets relative to the data section
  int64_t numel() const;
};

struct SafetensorsView {
  std::map<std::string, std::string> metadata;
  std::vector<TensorEntry> tensors;  // sorted by name
  uint64_t data_start = 0;           // absolute offset of the data section in the file
  const TensorEntry* find(const std::string& name) const;
};

// `what` names the file in error messages. Throws kvx::Error on any inconsistency.
SafetensorsView parse_safetensors(std::string_view file_bytes, const std::string& what);

struct TensorBlob {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::string_view bytes;  // must have numel * dtype_size bytes
};
std::string serialize_safetensors(const std::vector<TensorBlob>& tensors,
                                  const std::map<std::string, std::string>& metadata);

}  // namespace kvx::io

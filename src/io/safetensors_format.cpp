#include "io/safetensors_format.h"

#include <algorithm>
#include <cstring>
#include <set>
#include <nlohmann/json.hpp>

#include "util/error.h"

namespace kvx::io {

namespace {
struct DTypeInfo {
  DType t;
  const char* name;
  size_t size;
};
constexpr DTypeInfo kDTypes[] = {
    {DType::F64, "F64", 8}, {DType::F32, "F32", 4}, {DType::F16, "F16", 2}, {DType::BF16, "BF16", 2},
    {DType::I64, "I64", 8}, {DType::I32, "I32", 4}, {DType::I16, "I16", 2}, {DType::I8, "I8", 1},
    {DType::U8, "U8", 1},   {DType::BOOL, "BOOL", 1}};
constexpr uint64_t kMaxHeader = 100ull << 20;
}  // namespace

size_t dtype_size(DType t) {
  for (const auto& d : kDTypes)
    if (d.t == t) return d.size;
  return 0;
}
std::string dtype_name(DType t) {
  for (const auto& d : kDTypes)
    if (d.t == t) return d.name;
  return "?";
}
DType parse_dtype(const std::string& name) {
  std::string valid;
  for (const auto& d : kDTypes) {
    if (name == d.name) return d.t;
    valid += std::string(valid.empty() ? "" : ", ") + d.name;
  }
  throw Error("unsupported safetensors dtype '" + name + "' (valid: " + valid + ")");
}

int64_t TensorEntry::numel() const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

const TensorEntry* SafetensorsView::find(const std::string& name) const {
  auto it = std::lower_bound(tensors.begin(), tensors.end(), name,
                             [](const TensorEntry& e, const std::string& n) { return e.name < n; });
  return (it != tensors.end() && it->name == name) ? &*it : nullptr;
}

SafetensorsView parse_safetensors(std::string_view bytes, const std::string& what) {
  const std::string fix = "; the file is damaged or not safetensors: re-create it (re-run the command that wrote it)";
  if (bytes.size() < 8) throw Error(what + ": truncated (" + std::to_string(bytes.size()) + " bytes, need at least 8)" + fix);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(bytes[i]);
  if (n > kMaxHeader || n > bytes.size() - 8)
    throw Error(what + ": header length " + std::to_string(n) + " exceeds the file size " + std::to_string(bytes.size()) + fix);
  nlohmann::json header;
  std::set<std::string> names;  // nlohmann keeps the last of repeated keys: a tensor listed twice would vanish
  std::string repeated;
  const nlohmann::json::parser_callback_t unique_names = [&](int depth, nlohmann::json::parse_event_t event,
                                                             nlohmann::json& parsed) {
    if (depth == 1 && event == nlohmann::json::parse_event_t::key && !names.insert(parsed.get<std::string>()).second &&
        repeated.empty())
      repeated = parsed.get<std::string>();
    return true;
  };
  try {
    header = nlohmann::json::parse(bytes.substr(8, n), unique_names);
  } catch (const std::exception& e) {
    throw Error(what + ": header is not valid JSON (" + e.what() + ")" + fix);
  }
  if (!repeated.empty()) throw Error(what + ": the header lists tensor '" + repeated + "' twice" + fix);
  if (!header.is_object()) throw Error(what + ": header is not a JSON object" + fix);
  SafetensorsView view;
  view.data_start = 8 + n;
  const uint64_t data_size = bytes.size() - view.data_start;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& key = it.key();
    const auto& v = it.value();
    if (key == "__metadata__") {
      if (!v.is_object()) throw Error(what + ": __metadata__ must be an object of strings" + fix);
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string()) throw Error(what + ": __metadata__['" + m.key() + "'] is not a string" + fix);
        view.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const std::string where = what + ": tensor '" + key + "'";
    if (!v.is_object() || !v.contains("dtype") || !v.contains("shape") || !v.contains("data_offsets"))
      throw Error(where + " needs dtype, shape and data_offsets" + fix);
    if (!v["dtype"].is_string()) throw Error(where + ": dtype is not a string" + fix);
    TensorEntry e;
    e.name = key;
    e.dtype = parse_dtype(v["dtype"].get<std::string>());
    if (!v["shape"].is_array()) throw Error(where + ": shape is not an array" + fix);
    uint64_t numel = 1;
    for (const auto& s : v["shape"]) {
      if (!s.is_number_integer() || s.get<int64_t>() < 0) throw Error(where + ": shape has a non-integer or negative entry" + fix);
      int64_t d = s.get<int64_t>();
      if (d > 0 && numel > (1ull << 50) / static_cast<uint64_t>(d)) throw Error(where + ": shape is absurdly large" + fix);
      numel *= static_cast<uint64_t>(d);
      e.shape.push_back(d);
    }
    const auto& off = v["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned())
      throw Error(where + ": data_offsets must be two non-negative integers" + fix);
    e.begin = off[0].get<uint64_t>();
    e.end = off[1].get<uint64_t>();
    if (e.begin > e.end || e.end > data_size)
      throw Error(where + ": data [" + std::to_string(e.begin) + ", " + std::to_string(e.end) +
                  ") lies outside the data section of " + std::to_string(data_size) + " bytes (truncated file?)" + fix);
    if (e.end - e.begin != numel * dtype_size(e.dtype))
      throw Error(where + ": " + std::to_string(e.end - e.begin) + " bytes do not match shape x dtype (" +
                  std::to_string(numel * dtype_size(e.dtype)) + ")" + fix);
    view.tensors.push_back(std::move(e));
  }
  std::sort(view.tensors.begin(), view.tensors.end(), [](const TensorEntry& a, const TensorEntry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  for (size_t i = 1; i < view.tensors.size(); ++i)
    if (view.tensors[i].begin < view.tensors[i - 1].end)
      throw Error(what + ": tensors '" + view.tensors[i - 1].name + "' and '" + view.tensors[i].name + "' overlap" + fix);
  std::sort(view.tensors.begin(), view.tensors.end(),
            [](const TensorEntry& a, const TensorEntry& b) { return a.name < b.name; });
  return view;
}

std::string serialize_safetensors(const std::vector<TensorBlob>& tensors,
                                  const std::map<std::string, std::string>& metadata) {
  nlohmann::json header = nlohmann::json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const auto& t : tensors) {
    int64_t numel = 1;
    for (auto s : t.shape) numel *= s;
    if (t.bytes.size() != static_cast<size_t>(numel) * dtype_size(t.dtype))
      throw Error("serialize_safetensors: tensor '" + t.name + "' has " + std::to_string(t.bytes.size()) +
                  " bytes, shape needs " + std::to_string(numel * dtype_size(t.dtype)));
    if (header.contains(t.name)) throw Error("serialize_safetensors: duplicate tensor name '" + t.name + "'");
    header[t.name] = {{"dtype", dtype_name(t.dtype)}, {"shape", t.shape}, {"data_offsets", {offset, offset + t.bytes.size()}}};
    offset += t.bytes.size();
  }
  std::string h = header.dump();
  while ((h.size() + 8) % 8 != 0) h.push_back(' ');  // align the data section to 8 bytes
  std::string out;
  out.reserve(8 + h.size() + offset);
  uint64_t n = h.size();
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
  out += h;
  for (const auto& t : tensors) out.append(t.bytes.data(), t.bytes.size());
  return out;
}

}  // namespace kvx::io

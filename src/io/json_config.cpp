#include "io/json_config.h"

#include "io/atomic_file.h"

namespace kvx::io {

JsonReader::JsonReader(const nlohmann::json& j, std::string what) : j_(j), what_(std::move(what)) {
  if (!j_.is_object()) throw Error(what_ + ": expected a JSON object, got " + j_.dump().substr(0, 80));
}

const nlohmann::json& JsonReader::sub(const std::string& key) {
  seen_.insert(key);
  if (!j_.contains(key) || j_[key].is_null()) return empty_;
  if (!j_[key].is_object()) throw Error(what_ + ": key '" + key + "' must be an object");
  return j_[key];
}

void JsonReader::finish() const {
  for (auto it = j_.begin(); it != j_.end(); ++it) {
    if (seen_.count(it.key())) continue;
    std::string known;
    for (const auto& k : seen_) known += (known.empty() ? "" : ", ") + k;
    throw Error(what_ + ": unknown key '" + it.key() + "' (known keys: " + known + "); fix the spelling or remove it");
  }
}

nlohmann::json parse_json_file(const std::string& path) {
  std::string text = read_file(path);
  try {
    return nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    throw Error(path + ": not valid JSON (" + e.what() + ")");
  }
}

}  // namespace kvx::io

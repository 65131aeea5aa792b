// Strict reading of JSON config objects: typed fields with defaults, and a clear error for
// unknown keys (a typo must not silently fall back to a default).
#pragma once
#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "util/error.h"

namespace kvx::io {

class JsonReader {
 public:
  JsonReader(const nlohmann::json& j, std::string what);

  template <class T>
  T get(const std::string& key, const T& fallback) {
    seen_.insert(key);
    if (!j_.contains(key) || j_[key].is_null()) return fallback;
    return convert<T>(key);
  }
  template <class T>
  T require(const std::string& key) {
    seen_.insert(key);
    if (!j_.contains(key) || j_[key].is_null())
      throw Error(what_ + ": missing required key '" + key + "'");
    return convert<T>(key);
  }
  bool has(const std::string& key) const { return j_.contains(key) && !j_[key].is_null(); }
  const nlohmann::json& sub(const std::string& key);  // an object member ({} if absent)
  // Throws if the object has keys that were never asked for, listing the known ones.
  void finish() const;

 private:
  template <class T>
  T convert(const std::string& key) {
    try {
      return j_[key].get<T>();
    } catch (const std::exception&) {
      throw Error(what_ + ": key '" + key + "' has the wrong type (" + j_[key].dump() + ")");
    }
  }
  const nlohmann::json& j_;
  std::string what_;
  std::set<std::string> seen_;
  nlohmann::json empty_ = nlohmann::json::object();
};

nlohmann::json parse_json_file(const std::string& path);  // clear error on missing/invalid file

}  // namespace kvx::io

// Strict reading of JSON config objects: typed fields with defaults, and a clear error for
// unknown keys (a typo must not silently fall back to a default).
#pragma once
#include <nlohmann/json.hpp>
#include <cstdint>
#include <limits>
#include <set>
#include <string>
#include <type_traits>

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
    const nlohmann::json& v = j_[key];
    if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
      // nlohmann turns 2e57 or -1 into an int/unsigned without complaint (undefined behaviour).
      using L = std::numeric_limits<T>;
      bool ok = v.is_number_integer();
      if (v.is_number_unsigned())
        ok = v.get<uint64_t>() <= static_cast<uint64_t>(L::max());
      else if constexpr (std::is_unsigned_v<T>)
        ok = ok && v.get<int64_t>() >= 0;  // a signed JSON integer (built in code) that is not negative
      else if (ok)
        ok = v.get<int64_t>() >= static_cast<int64_t>(L::min()) && v.get<int64_t>() <= static_cast<int64_t>(L::max());
      if (!ok)
        throw Error(what_ + ": key '" + key + "' must be an integer in [" + std::to_string(L::min()) + ", " +
                    std::to_string(L::max()) + "], got " + v.dump().substr(0, 80));
      return v.is_number_unsigned() ? static_cast<T>(v.get<uint64_t>()) : static_cast<T>(v.get<int64_t>());
    } else {
      if constexpr (std::is_floating_point_v<T>)  // nlohmann reads true as 1.0
        if (!v.is_number()) throw Error(what_ + ": key '" + key + "' must be a number, got " + v.dump().substr(0, 80));
      try {
        return v.get<T>();
      } catch (const std::exception&) {
        throw Error(what_ + ": key '" + key + "' has the wrong type (" + v.dump().substr(0, 80) + ")");
      }
    }
  }
  const nlohmann::json& j_;
  std::string what_;
  std::set<std::string> seen_;
  nlohmann::json empty_ = nlohmann::json::object();
};

nlohmann::json parse_json_file(const std::string& path);  // clear error on missing/invalid file

}  // namespace kvx::io

// Small string helpers shared by the CLI and the libraries.
#pragma once
#include <climits>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace kvx {

// "a,b,,c" -> {"a", "b", "c"} (empty items dropped).
inline std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ','))
    if (!item.empty()) out.push_back(item);
  return out;
}

// All of s as a whole number ("12x", "" and values past the type's range are not), else nothing;
// the caller names the problem.
inline std::optional<int64_t> whole_integer(const std::string& s) {
  try {
    size_t used = 0;
    const long long v = std::stoll(s, &used);
    if (used == s.size()) return v;
  } catch (const std::exception&) {
  }
  return std::nullopt;
}

inline std::optional<int> whole_int(const std::string& s) {
  const auto v = whole_integer(s);
  if (v && *v >= INT_MIN && *v <= INT_MAX) return static_cast<int>(*v);
  return std::nullopt;
}

// All of s as a number (3, 0.25, 1e-3), else nothing.
inline std::optional<double> whole_number(const std::string& s) {
  try {
    size_t used = 0;
    const double v = std::stod(s, &used);
    if (used == s.size()) return v;
  } catch (const std::exception&) {
  }
  return std::nullopt;
}

// A number as people write it in messages: 0.5, 1000, 3e-04, inf, nan (printf's %g).
inline std::string format_number(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", x);
  return buf;
}

}  // namespace kvx

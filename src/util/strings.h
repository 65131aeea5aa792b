// Small string helpers shared by the CLI and the libraries.
#pragma once
#include <cstdio>
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

// A number as people write it in messages: 0.5, 1000, 3e-04, inf, nan (printf's %g).
inline std::string format_number(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", x);
  return buf;
}

}  // namespace kvx

// Small string helpers shared by the CLI and the libraries.
#pragma once
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

}  // namespace kvx

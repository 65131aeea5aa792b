// kvx::Error: the one exception type for bad input. Messages name the problem and the fix.
#pragma once
#include <stdexcept>
#include <string>

namespace kvx {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

}  // namespace kvx

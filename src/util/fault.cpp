#include "util/fault.h"

#include <cstdlib>
#include <map>
#include <mutex>
#include <sstream>
#include <string>

#include "util/error.h"

namespace kvx {

namespace {

struct Range {
  long first = 1, last = 1;
};

struct Faults {
  std::string spec;  // the KVX_FAULT these ranges were parsed from
  std::multimap<std::string, Range> ranges;
  std::map<std::string, long> calls;

  void parse(const std::string& s) {
    ranges.clear();
    calls.clear();
    std::istringstream in(s);
    std::string item;
    while (std::getline(in, item, ',')) {
      if (item.empty()) continue;
      Range r;
      const size_t at = item.find('@');
      if (at != std::string::npos) {
        const std::string span = item.substr(at + 1);
        char* end = nullptr;
        r.first = r.last = std::strtol(span.c_str(), &end, 10);
        if (*end == '-') r.last = std::strtol(end + 1, &end, 10);
        if (*end != '\0' || r.first < 1 || r.last < r.first)
          throw Error("KVX_FAULT: '" + item + "' is not site@N or site@N-M (calls counted from 1)");
      }
      ranges.emplace(item.substr(0, at), r);
    }
    spec = s;
  }
};

}  // namespace

bool fault_at(const char* site) {
  static Faults faults;
  static std::mutex mu;
  const char* env = std::getenv("KVX_FAULT");
  if (!env && faults.spec.empty()) return false;  // every normal run
  std::lock_guard<std::mutex> lock(mu);
  if (faults.spec != (env ? env : "")) faults.parse(env ? env : "");  // (re)read when a test changes it
  const long n = ++faults.calls[site];
  auto [lo, hi] = faults.ranges.equal_range(site);
  for (auto it = lo; it != hi; ++it)
    if (n >= it->second.first && n <= it->second.last) return true;
  return false;
}

}  // namespace kvx

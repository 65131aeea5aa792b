// Replays the fuzzers' seeds and every input a fuzzer once crashed on (tests/fuzz/regressions/
// <target>/) through the same entry points, in the ordinary and the sanitizer builds.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>

#include "fuzz/fuzz_entries.h"

namespace fs = std::filesystem;

namespace {

const std::map<std::string, std::function<void(std::string_view)>>& entries() {
  static const std::map<std::string, std::function<void(std::string_view)>> e = {
      {"safetensors", kvx::fuzz::safetensors},
      {"tokenizer_json", kvx::fuzz::tokenizer_json},
      {"model_config", kvx::fuzz::model_config},
      {"hf_config", kvx::fuzz::hf_config},
      {"run_config", kvx::fuzz::run_config},
      {"lla_codec", kvx::fuzz::lla_codec},
  };
  return e;
}

int replay(const fs::path& root) {
  int n = 0;
  if (!fs::exists(root)) return 0;
  for (const auto& dir : fs::directory_iterator(root)) {
    if (!dir.is_directory()) continue;
    const auto it = entries().find(dir.path().filename().string());
    EXPECT_NE(it, entries().end()) << dir.path() << " names no fuzz entry";
    if (it == entries().end()) continue;
    for (const auto& f : fs::directory_iterator(dir.path())) {
      std::ifstream in(f.path(), std::ios::binary);
      std::ostringstream ss;
      ss << in.rdbuf();
      SCOPED_TRACE(f.path().string());
      it->second(ss.str());
      ++n;
    }
  }
  return n;
}

}  // namespace

TEST(FuzzInputs, SeedsParseOrFailCleanly) {
  const fs::path seeds = fs::path(KVX_SOURCE_DIR) / "tests/fuzz/seeds";
  EXPECT_GE(replay(seeds), static_cast<int>(entries().size()));  // at least one seed per target
  for (const auto& [name, fn] : entries()) EXPECT_TRUE(fs::exists(seeds / name)) << name << " has no seeds";
}

TEST(FuzzInputs, FoundCrashesStayFixed) { replay(fs::path(KVX_SOURCE_DIR) / "tests/fuzz/regressions"); }

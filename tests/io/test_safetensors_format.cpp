#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <unistd.h>

#include "io/atomic_file.h"
#include "io/safetensors_format.h"
#include "util/error.h"

using namespace kvx::io;

namespace {
std::string sample() {
  float a[6] = {1, 2, 3, 4, 5, 6};
  int32_t b[2] = {7, -8};
  return serialize_safetensors({{"a", DType::F32, {2, 3}, std::string_view(reinterpret_cast<char*>(a), sizeof a)},
                                {"b", DType::I32, {2}, std::string_view(reinterpret_cast<char*>(b), sizeof b)}},
                               {{"producer", "kvx"}});
}
std::string error_of(const std::string& bytes) {
  try {
    parse_safetensors(bytes, "f.safetensors");
  } catch (const kvx::Error& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST(SafetensorsFormat, RoundTrip) {
  std::string s = sample();
  auto v = parse_safetensors(s, "x");
  ASSERT_EQ(v.tensors.size(), 2u);
  EXPECT_EQ(v.metadata.at("producer"), "kvx");
  const TensorEntry* a = v.find("a");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(a->dtype, DType::F32);
  float f;
  std::memcpy(&f, s.data() + v.data_start + a->begin + 8, 4);
  EXPECT_EQ(f, 3.0f);
  EXPECT_EQ(v.data_start % 8, 0u);
}

TEST(SafetensorsFormat, TruncatedFilesAreRejectedClearly) {
  std::string s = sample();
  for (size_t cut : {size_t(0), size_t(5), size_t(20), s.size() - 1}) {
    std::string err = error_of(s.substr(0, cut));
    EXPECT_FALSE(err.empty()) << "cut at " << cut;
    EXPECT_NE(err.find("f.safetensors"), std::string::npos) << err;
  }
  EXPECT_NE(error_of(s.substr(0, s.size() - 1)).find("truncated"), std::string::npos);
}

TEST(SafetensorsFormat, CorruptHeadersAreRejected) {
  std::string s = sample();
  std::string bad = s;
  bad[8] = '#';  // breaks the JSON
  EXPECT_NE(error_of(bad).find("JSON"), std::string::npos);
  std::string huge = s;
  huge[7] = 0x7f;  // absurd header length
  EXPECT_NE(error_of(huge).find("header length"), std::string::npos);
  auto with_header = [](const std::string& h) {
    std::string out(8, '\0');
    uint64_t n = h.size();
    for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
    return out + h + std::string(16, '\0');
  };
  EXPECT_NE(error_of(with_header(R"({"t":{"dtype":"F99","shape":[1],"data_offsets":[0,4]}})")).find("dtype"), std::string::npos);
  EXPECT_NE(error_of(with_header(R"({"t":{"dtype":"F32","shape":[5],"data_offsets":[0,4]}})")).find("do not match"), std::string::npos);
  EXPECT_NE(error_of(with_header(R"({"t":{"dtype":"F32","shape":[8],"data_offsets":[0,32]}})")).find("outside"), std::string::npos);
  EXPECT_NE(error_of(with_header(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"u":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})")).find("overlap"), std::string::npos);
  EXPECT_NE(error_of(with_header(R"({"t":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})")).find("negative"), std::string::npos);
  // a tensor listed twice (the JSON parser kept the last, and the first vanished)
  EXPECT_NE(error_of(with_header(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})"))
                .find("'w' twice"), std::string::npos);
}

// A directory given where a file is expected (a model directory passed as its weights or
// config) is named as such, not read as an empty or truncated file.
TEST(ReadFile, ADirectoryIsNamedAsOne) {
  const auto dir = std::filesystem::temp_directory_path() / ("kvx_test_read_dir_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir / "model.safetensors");
  try {
    read_file((dir / "model.safetensors").string());
    ADD_FAILURE() << "a directory was read as a file";
  } catch (const kvx::Error& e) {
    EXPECT_NE(std::string(e.what()).find("is a directory"), std::string::npos) << e.what();
  }
  std::filesystem::remove_all(dir);
}

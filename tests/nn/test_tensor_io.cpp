#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>

#include "nn/tensor_io.h"

using namespace kvx;

TEST(TensorIo, RoundTripsEveryDtypeBitExact) {
  nn::TensorMap m;
  m["f32"] = torch::randn({3, 5});
  m["f64"] = torch::randn({2}, torch::kFloat64);
  m["bf16"] = torch::randn({4, 1}).to(torch::kBFloat16);
  m["f16"] = torch::randn({7}).to(torch::kFloat16);
  m["i64"] = torch::arange(6, torch::kLong).view({2, 3});
  m["u8"] = torch::randint(255, {9}, torch::kUInt8);
  m["empty"] = torch::empty({0, 3});
  m["scalar"] = torch::tensor(3.5);
  auto path = (std::filesystem::temp_directory_path() / "kvx_tensor_io.safetensors").string();
  nn::save_safetensors(path, m, {{"k", "v"}});
  std::map<std::string, std::string> meta;
  auto back = nn::load_safetensors(path, &meta);
  EXPECT_EQ(meta.at("k"), "v");
  ASSERT_EQ(back.size(), m.size());
  for (const auto& [k, t] : m) {
    EXPECT_EQ(back.at(k).scalar_type(), t.scalar_type()) << k;
    EXPECT_TRUE(torch::equal(back.at(k), t)) << k;
  }
  std::filesystem::remove(path);
}

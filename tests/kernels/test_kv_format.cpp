// KV cache formats: names, sizes, and quantise/dequantise round trips within each format's bound.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/kv_format.h"
#include "util/error.h"

using namespace kvx;
using namespace kvx::kernels;

namespace {

// The gap between fp16 numbers at magnitude d (2^-24 in the subnormal range below 2^-14).
float fp16_spacing(float d) { return d < std::ldexp(1.0f, -14) ? std::ldexp(1.0f, -24) : std::ldexp(1.0f, std::ilogb(d) - 10); }

std::vector<float> random_row(int n, float amp, std::mt19937& rng) {
  std::uniform_real_distribution<float> u(-amp, amp);
  std::vector<float> x(n);
  for (auto& v : x) v = u(rng);
  return x;
}

std::vector<float> round_trip(KVType t, const std::vector<float>& x) {
  std::vector<uint8_t> buf(row_bytes(t, static_cast<int>(x.size())));
  quantize_row(t, x.data(), static_cast<int>(x.size()), buf.data());
  std::vector<float> y(x.size());
  dequantize_row(t, buf.data(), static_cast<int>(x.size()), y.data());
  return y;
}

}  // namespace

TEST(KVFormat, NamesRoundTripAndUnknownNamesListTheValidOnes) {
  for (KVType t : {KVType::F32, KVType::BF16, KVType::Q8, KVType::Q4}) EXPECT_EQ(parse_kv_type(kv_type_name(t)), t);
  try {
    parse_kv_type("int8");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("int8"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("f32, bf16, q8, q4"), std::string::npos);
  }
  EXPECT_THROW(parse_kv_type("F32"), Error);
}

TEST(KVFormat, BitsAndRowBytes) {
  EXPECT_EQ(bits_per_value(KVType::F32), 32.0);
  EXPECT_EQ(bits_per_value(KVType::BF16), 16.0);
  EXPECT_EQ(bits_per_value(KVType::Q8), 8.5);
  EXPECT_EQ(bits_per_value(KVType::Q4), 4.5);
  EXPECT_EQ(row_bytes(KVType::F32, 40), 160u);
  EXPECT_EQ(row_bytes(KVType::BF16, 40), 80u);
  EXPECT_EQ(row_bytes(KVType::Q8, 128), 136u);
  EXPECT_EQ(row_bytes(KVType::Q4, 128), 72u);
  for (KVType t : {KVType::F32, KVType::BF16, KVType::Q8, KVType::Q4})
    EXPECT_EQ(row_bytes(t, 256) * 8, static_cast<size_t>(bits_per_value(t) * 256));
  try {
    row_bytes(KVType::Q8, 40);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("head_dim"), std::string::npos);
  }
  EXPECT_THROW(row_bytes(KVType::Q4, 48), Error);
  EXPECT_THROW(row_bytes(KVType::F32, 0), Error);
  std::vector<float> x(40, 1.0f);
  std::vector<uint8_t> buf(200);
  EXPECT_THROW(quantize_row(KVType::Q4, x.data(), 40, buf.data()), Error);
}

TEST(KVFormat, F32IsExact) {
  std::mt19937 rng(1);
  const auto x = random_row(37, 5.0f, rng);
  EXPECT_EQ(round_trip(KVType::F32, x), x);
}

TEST(KVFormat, Bf16ExactOnRepresentableAndRoundsToNearestEven) {
  std::mt19937 rng(2);
  std::vector<float> x = random_row(64, 100.0f, rng);
  for (auto& v : x) {  // keep only bf16-representable values
    uint32_t u;
    std::memcpy(&u, &v, 4);
    u &= 0xffff0000u;
    std::memcpy(&v, &u, 4);
  }
  x.push_back(0.0f);
  x.push_back(-0.0f);
  x.push_back(INFINITY);
  EXPECT_EQ(round_trip(KVType::BF16, x), x);
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1); 1 + 3 * 2^-8
  // is halfway between 1 + 2^-7 (odd) and 1 + 2^-6 (even).
  EXPECT_EQ(bf16_to_float(float_to_bf16(1.0f + std::ldexp(1.0f, -8))), 1.0f);
  EXPECT_EQ(bf16_to_float(float_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8))), 1.0f + std::ldexp(1.0f, -6));
  EXPECT_EQ(bf16_to_float(float_to_bf16(1.0f + 1.5f * std::ldexp(1.0f, -8))), 1.0f + std::ldexp(1.0f, -7));
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(NAN))));
  const auto y = random_row(256, 3.0f, rng), z = round_trip(KVType::BF16, y);
  for (size_t i = 0; i < y.size(); ++i) EXPECT_LE(std::fabs(z[i] - y[i]), std::ldexp(std::fabs(y[i]), -8));
}

// q8: d = max|x| / 127 and |x - x~| <= d/2, up to the fp16 rounding of d (relative 2^-11).
TEST(KVFormat, Q8ErrorWithinHalfAStep) {
  std::mt19937 rng(3);
  // 1e-4: the scale is an fp16 subnormal (spacing 2^-24, 8% of it), where a scale rounded down
  // clamped the largest codes to 4x this bound.
  for (float amp : {1e-4f, 1e-3f, 0.5f, 1.0f, 37.0f, 3000.0f}) {
    const auto x = random_row(256, amp, rng), y = round_trip(KVType::Q8, x);
    for (int b = 0; b < 8; ++b) {
      float amax = 0.0f;
      for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[32 * b + i]));
      const float d = amax / 127.0f, bound = 0.5f * (d + fp16_spacing(d)) + 1e-7f * amax;
      for (int i = 0; i < 32; ++i) EXPECT_LE(std::fabs(y[32 * b + i] - x[32 * b + i]), bound) << amp << " " << b;
    }
  }
  // Zeros stay zeros; codes times a power-of-two scale are exact.
  EXPECT_EQ(round_trip(KVType::Q8, std::vector<float>(32, 0.0f)), std::vector<float>(32, 0.0f));
  std::vector<float> x(64);
  for (int i = 0; i < 64; ++i) x[i] = std::ldexp(static_cast<float>(i % 32 == 0 ? -127 : (i * 37) % 255 - 127), -5);
  EXPECT_EQ(round_trip(KVType::Q8, x), x);
}

// The query's int8 blocks (the vectorised quantize_query_blocks) against the definition, done
// plainly: d = max|x| / 127, codes = round(x / d) with ties to even, 0 for an all-zero block.
TEST(KVFormat, QueryBlocksMatchTheirDefinition) {
  std::mt19937 rng(11);
  std::vector<float> x;
  for (float amp : {1e-30f, 1e-3f, 1.0f, 37.0f, 3e5f}) {
    const auto r = random_row(96, amp, rng);
    x.insert(x.end(), r.begin(), r.end());
  }
  x.insert(x.end(), 32, 0.0f);  // an all-zero block
  for (int i = 0; i < 32; ++i) x.push_back(i == 5 ? -127.0f : 0.5f + static_cast<float>(i % 9) - 4.0f);  // exact ties
  const int n = static_cast<int>(x.size());
  std::vector<int8_t> codes(n);
  std::vector<float> scales(n / 32);
  quantize_query_blocks(x.data(), n, codes.data(), scales.data());
  for (int b = 0; b < n / 32; ++b) {
    float amax = 0.0f;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[32 * b + i]));
    const float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
    EXPECT_EQ(scales[b], d) << "block " << b;
    for (int i = 0; i < 32; ++i) {
      const float want = std::min(127.0f, std::max(-127.0f, std::nearbyint(x[32 * b + i] * inv)));
      EXPECT_EQ(codes[32 * b + i], static_cast<int8_t>(want)) << "block " << b << " value " << i;
    }
  }
  EXPECT_EQ(codes[n - 32 + 0], -4);  // d = 1: -3.5 rounds to the even -4
  EXPECT_EQ(codes[n - 32 + 1], -2);  // -2.5 -> -2
  EXPECT_EQ(codes[n - 32 + 2], -2);  // -1.5 -> -2
  EXPECT_EQ(codes[n - 32 + 4], 0);   // 0.5 -> 0
  EXPECT_THROW(quantize_query_blocks(x.data(), 31, codes.data(), scales.data()), Error);
}

// q4: d = m / -8 (m the value of largest magnitude). |x - x~| <= |d|/2, except values of the
// opposite sign to m beyond 7.5|d|, which clamp to +7|d| with |x - x~| <= |d|; plus fp16
// rounding of d (relative 2^-11, times at most 8 steps).
TEST(KVFormat, Q4ErrorWithinHalfAStepExceptTheClampedSide) {
  std::mt19937 rng(4);
  int clamped = 0;
  for (float amp : {2e-5f, 1e-2f, 1.0f, 13.0f, 500.0f}) {  // 2e-5: a subnormal fp16 scale
    const auto x = random_row(512, amp, rng), y = round_trip(KVType::Q4, x);
    for (int b = 0; b < 16; ++b) {
      float m = 0.0f;
      for (int i = 0; i < 32; ++i)
        if (std::fabs(x[32 * b + i]) > std::fabs(m)) m = x[32 * b + i];
      const float d = std::fabs(m) / 8, slack = 8 * fp16_spacing(d) + 1e-7f * std::fabs(m);
      for (int i = 0; i < 32; ++i) {
        const float xi = x[32 * b + i], err = std::fabs(y[32 * b + i] - xi);
        const bool far_side = xi * m < 0 && std::fabs(xi) > 7.5f * d;
        clamped += far_side;
        EXPECT_LE(err, (far_side ? d : 0.5f * d) + slack) << amp << " " << b << " " << i;
        if (xi == m) {
          EXPECT_NEAR(y[32 * b + i], m, slack);  // the extreme value is (nearly) exact
        }
      }
    }
  }
  EXPECT_GT(clamped, 0);  // the clamped case was exercised
  // Codes times a power-of-two scale are exact; the nibble order covers all 32 slots.
  std::vector<float> x(32);
  for (int i = 0; i < 32; ++i) x[i] = std::ldexp(static_cast<float>(i == 5 ? -8 : (i * 7) % 15 - 7), -3);
  EXPECT_EQ(round_trip(KVType::Q4, x), x);
}

// dequantize_row (vectorised where the build allows) against the formats' definition read from
// the raw bytes: [nb fp16 scales][codes], q8 one signed byte a value, q4 two values a byte (low
// nibble first), value = (code - 8 for q4) * scale.
TEST(KVFormat, DequantizeRowMatchesTheByteLayout) {
  std::mt19937 rng(21);
  for (KVType t : {KVType::Q8, KVType::Q4})
    for (int n : {32, 96, 512}) {
      const auto x = random_row(n, 3.0f, rng);
      std::vector<uint8_t> buf(row_bytes(t, n));
      quantize_row(t, x.data(), n, buf.data());
      std::vector<float> y(n);
      dequantize_row(t, buf.data(), n, y.data());
      const int nb = n / 32;
      for (int i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, buf.data() + 2 * (i / 32), 2);
        const uint8_t* codes = buf.data() + 2 * nb;
        const int code = t == KVType::Q8 ? static_cast<int8_t>(codes[i]) : (i % 2 ? codes[i / 2] >> 4 : codes[i / 2] & 0xf) - 8;
        EXPECT_EQ(y[i], static_cast<float>(code) * fp16_to_float(h)) << kv_type_name(t) << " n " << n << " value " << i;
      }
    }
}

TEST(KVFormat, NonFiniteAndOversizedValuesAreRejected) {
  std::vector<float> x(32, 1.0f);
  std::vector<uint8_t> buf(64);
  x[3] = NAN;
  EXPECT_THROW(quantize_row(KVType::Q8, x.data(), 32, buf.data()), Error);
  x[3] = INFINITY;
  EXPECT_THROW(quantize_row(KVType::Q4, x.data(), 32, buf.data()), Error);
  x[3] = 1e7f;  // d = 1e7 / 8 > 65504
  EXPECT_THROW(quantize_row(KVType::Q4, x.data(), 32, buf.data()), Error);
}

TEST(KVFormat, Fp16Conversion) {
  EXPECT_EQ(fp16_to_float(float_to_fp16(1.0f)), 1.0f);
  EXPECT_EQ(fp16_to_float(float_to_fp16(65504.0f)), 65504.0f);
  EXPECT_EQ(fp16_to_float(float_to_fp16(std::ldexp(1.0f, -24))), std::ldexp(1.0f, -24));
  EXPECT_EQ(fp16_to_float(float_to_fp16(1.0f + std::ldexp(1.0f, -11))), 1.0f);  // tie to even
  EXPECT_TRUE(std::isinf(fp16_to_float(float_to_fp16(70000.0f))));
}

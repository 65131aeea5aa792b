// The multiply-add probes that bench decode's roofline divides by: finite positive rates for the
// back ends this CPU has, and a named error for a vector width no back end uses.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "kernels/compute_peak.h"
#include "util/error.h"

using namespace kvx;

TEST(ComputePeak, RatesArePositiveAndBadWidthsNamed) {
  for (int lanes : {8, 16}) {
    if (lanes == 16 && !(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vnni"))) continue;
    const double f32 = kernels::measure_fma_peak_gmacs(lanes, 1, 0.0), int8 = kernels::measure_int8_dot_peak_gmacs(lanes, 1, 0.0);
    EXPECT_TRUE(std::isfinite(f32) && f32 > 0) << lanes;
    EXPECT_TRUE(std::isfinite(int8) && int8 > 0) << lanes;
  }
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16")) {
    const double bf16 = kernels::measure_bf16_dot_peak_gmacs(1, 0.0);
    EXPECT_TRUE(std::isfinite(bf16) && bf16 > 0);
  } else {
    EXPECT_THROW(kernels::measure_bf16_dot_peak_gmacs(1, 0.0), Error);
  }
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vnni")) {
    const double int16 = kernels::measure_int16_dot_peak_gmacs(1, 0.0);
    EXPECT_TRUE(std::isfinite(int16) && int16 > 0);
  } else {
    EXPECT_THROW(kernels::measure_int16_dot_peak_gmacs(1, 0.0), Error);
  }
  try {
    kernels::measure_int8_dot_peak_gmacs(4);
    FAIL() << "4 lanes accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("lanes must be 8 (AVX2) or 16 (AVX-512)"), std::string::npos) << e.what();
  }
}

// One rate per thread, each a plausible rate of dependent adds (a broken probe reads 0 or inf).
TEST(ComputePeak, ThreadScalarRatesOnePerThread) {
  for (int threads : {1, 2}) {
    const auto rates = kernels::measure_thread_scalar_rates(threads, 0.01);
    ASSERT_EQ(rates.size(), static_cast<size_t>(threads));
    for (double g : rates) EXPECT_TRUE(std::isfinite(g) && g > 0.05 && g < 20.0) << g;
  }
}

// The wake cost of a parallel region: 0 with one thread, else a finite positive time well under a
// second, right after a region and after running alone (a broken probe reads 0, inf or NaN).
TEST(ComputePeak, ThreadWakeIsAShortPositiveTime) {
  EXPECT_EQ(kernels::measure_thread_wake_us(1, 0.0, 5), 0.0);
  for (double idle : {0.0, 200.0}) {
    const double us = kernels::measure_thread_wake_us(2, idle, 9);
    EXPECT_TRUE(std::isfinite(us) && us > 0.0 && us < 1e5) << us << " us after " << idle << " us alone";
  }
}

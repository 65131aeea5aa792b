#include "kernels/compute_peak.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "util/error.h"

namespace kvx::kernels {

namespace {

constexpr long kIters = 1 << 22;  // per pass and thread

// Independent chains (more than FMA latency x pipes on current cores: 12 of the 16 AVX2
// registers, 16 of AVX-512's 32), distinct starting values so the compiler cannot merge them.
// Returns a sum that keeps them live.
constexpr int kChainsAvx2 = 12, kChainsAvx512 = 16;

float chains_avx2() {
  __m256 a[kChainsAvx2];
  for (int i = 0; i < kChainsAvx2; ++i) a[i] = _mm256_set1_ps(1.0f + 0.001f * i);
  const __m256 b = _mm256_set1_ps(0.999999f), c = _mm256_set1_ps(1e-7f);
  for (long it = 0; it < kIters; ++it)
    for (int i = 0; i < kChainsAvx2; ++i) a[i] = _mm256_fmadd_ps(a[i], b, c);
  __m256 s = a[0];
  for (int i = 1; i < kChainsAvx2; ++i) s = _mm256_add_ps(s, a[i]);
  alignas(32) float r[8];
  _mm256_store_ps(r, s);
  return r[0];
}

// The chains' sum, lane 0 (keeps every chain live).
__attribute__((target("avx512f"))) inline float sum_chains512(const __m512* a) {
  __m512 s = a[0];
  for (int i = 1; i < kChainsAvx512; ++i) s = _mm512_add_ps(s, a[i]);
  return _mm512_cvtss_f32(s);
}

__attribute__((target("avx512f"))) float chains_avx512() {
  __m512 a[kChainsAvx512];
  for (int i = 0; i < kChainsAvx512; ++i) a[i] = _mm512_set1_ps(1.0f + 0.001f * i);
  const __m512 b = _mm512_set1_ps(0.999999f), c = _mm512_set1_ps(1e-7f);
  for (long it = 0; it < kIters; ++it)
    for (int i = 0; i < kChainsAvx512; ++i) a[i] = _mm512_fmadd_ps(a[i], b, c);
  return sum_chains512(a);
}

// int8 dot-product chains: vpmaddubsw of unsigned and signed bytes into 16-bit pair sums, added
// up (AVX2: 32 multiply-adds per pair of instructions); vpdpbusd (AVX-512 VNNI: 64 per
// instruction). 16-bit sums wrap or saturate harmlessly: only the rate counts.
float int8_chains_avx2() {
  __m256i a[kChainsAvx2];
  for (int i = 0; i < kChainsAvx2; ++i) a[i] = _mm256_set1_epi16(static_cast<short>(i));
  const __m256i s = _mm256_set1_epi8(-1);  // the chain's own bytes as the unsigned operand: nothing to hoist
  for (long it = 0; it < kIters; ++it)
    for (int i = 0; i < kChainsAvx2; ++i) a[i] = _mm256_add_epi16(a[i], _mm256_maddubs_epi16(a[i], s));
  __m256i t = a[0];
  for (int i = 1; i < kChainsAvx2; ++i) t = _mm256_xor_si256(t, a[i]);
  return static_cast<float>(_mm256_extract_epi16(t, 0));
}

__attribute__((target("avx512f,avx512vnni"))) float int8_chains_avx512() {
  __m512i a[kChainsAvx512];
  for (int i = 0; i < kChainsAvx512; ++i) a[i] = _mm512_set1_epi32(i);
  const __m512i u = _mm512_set1_epi8(1), s = _mm512_set1_epi8(-1);
  for (long it = 0; it < kIters; ++it)
    for (int i = 0; i < kChainsAvx512; ++i) a[i] = _mm512_dpbusd_epi32(a[i], u, s);
  __m512i t = a[0];
  for (int i = 1; i < kChainsAvx512; ++i) t = _mm512_xor_si512(t, a[i]);
  return static_cast<float>(_mm512_reduce_add_epi32(t));
}

// bf16 dot-product chains: vdpbf16ps (AVX-512 BF16: 32 multiply-adds per instruction, pairs of
// bf16 products into fp32 lanes), what the AVX-512 decode kernel scores bf16 keys with.
__attribute__((target("avx512f,avx512bf16"))) float bf16_chains_avx512() {
  __m512 a[kChainsAvx512];
  for (int i = 0; i < kChainsAvx512; ++i) a[i] = _mm512_set1_ps(1.0f + 0.001f * i);
  const __m512bh b = (__m512bh)_mm512_set1_epi32(0x3f803f80), c = (__m512bh)_mm512_set1_epi32(0x33d633d6);  // 1.0, 1e-7 pairs
  for (long it = 0; it < kIters; ++it)
    for (int i = 0; i < kChainsAvx512; ++i) a[i] = _mm512_dpbf16_ps(a[i], b, c);
  return sum_chains512(a);
}

// int16 dot-product chains: vpdpwssd (AVX-512 VNNI: 32 multiply-adds per instruction, pairs of
// 16-bit products into 32-bit lanes), what the AVX-512 decode kernel weighs q8 values with.
__attribute__((target("avx512f,avx512vnni"))) float int16_chains_avx512() {
  __m512i a[kChainsAvx512];
  for (int i = 0; i < kChainsAvx512; ++i) a[i] = _mm512_set1_epi32(i);
  const __m512i x = _mm512_set1_epi16(1), w = _mm512_set1_epi16(-1);
  for (long it = 0; it < kIters; ++it)
    for (int i = 0; i < kChainsAvx512; ++i) a[i] = _mm512_dpwssd_epi32(a[i], x, w);
  __m512i t = a[0];
  for (int i = 1; i < kChainsAvx512; ++i) t = _mm512_xor_si512(t, a[i]);
  return static_cast<float>(_mm512_reduce_add_epi32(t));
}

// Best multiply-adds per second (1e9) of `chains` run by T threads, each pass `macs_per_thread`.
template <class Chains>
double best_rate(Chains chains, double macs_per_thread, int T, double seconds) {
  double best = 0.0;
  float sink = 0.0f;
  const auto start = std::chrono::steady_clock::now();
  for (int pass = 0;; ++pass) {
    const auto t0 = std::chrono::steady_clock::now();
    float total = 0.0f;
#pragma omp parallel num_threads(T) reduction(+ : total)
    total += chains();
    const auto t1 = std::chrono::steady_clock::now();
    sink += total;
    best = std::max(best, T * macs_per_thread / std::chrono::duration<double>(t1 - t0).count() / 1e9);
    if (pass >= 2 && std::chrono::duration<double>(t1 - start).count() >= seconds) break;
  }
  if (sink == 1.5f) best = -best;  // keeps the chains live; a value the chains' sums do not reach
  return best;
}

void check_lanes(int lanes, const char* who) {
  if (lanes != 8 && lanes != 16) throw Error(std::string(who) + ": lanes must be 8 (AVX2) or 16 (AVX-512), got " + std::to_string(lanes));
  if (lanes == 16 && !__builtin_cpu_supports("avx512f")) throw Error(std::string(who) + ": this CPU has no AVX-512");
}

}  // namespace

double measure_fma_peak_gmacs(int lanes, int threads, double seconds) {
  check_lanes(lanes, "measure_fma_peak_gmacs");
  const int T = std::max(1, threads <= 0 ? omp_get_max_threads() : threads);
  const double macs = static_cast<double>(kIters) * (lanes == 16 ? kChainsAvx512 : kChainsAvx2) * lanes;
  return lanes == 16 ? best_rate(chains_avx512, macs, T, seconds) : best_rate(chains_avx2, macs, T, seconds);
}

double measure_int8_dot_peak_gmacs(int lanes, int threads, double seconds) {
  check_lanes(lanes, "measure_int8_dot_peak_gmacs");
  if (lanes == 16 && !__builtin_cpu_supports("avx512vnni")) throw Error("measure_int8_dot_peak_gmacs: this CPU has no AVX-512 VNNI");
  const int T = std::max(1, threads <= 0 ? omp_get_max_threads() : threads);
  // 4 byte products per 32-bit lane (VNNI), 2 per 16-bit lane of a 256-bit vector (AVX2)
  const double macs = static_cast<double>(kIters) * (lanes == 16 ? kChainsAvx512 * 64 : kChainsAvx2 * 32);
  return lanes == 16 ? best_rate(int8_chains_avx512, macs, T, seconds) : best_rate(int8_chains_avx2, macs, T, seconds);
}

double measure_bf16_dot_peak_gmacs(int threads, double seconds) {
  if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bf16"))
    throw Error("measure_bf16_dot_peak_gmacs: this CPU has no AVX-512 BF16");
  const int T = std::max(1, threads <= 0 ? omp_get_max_threads() : threads);
  const double macs = static_cast<double>(kIters) * kChainsAvx512 * 32;  // 2 products per fp32 lane
  return best_rate(bf16_chains_avx512, macs, T, seconds);
}

double measure_int16_dot_peak_gmacs(int threads, double seconds) {
  if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512vnni"))
    throw Error("measure_int16_dot_peak_gmacs: this CPU has no AVX-512 VNNI");
  const int T = std::max(1, threads <= 0 ? omp_get_max_threads() : threads);
  const double macs = static_cast<double>(kIters) * kChainsAvx512 * 32;  // 2 products per 32-bit lane
  return best_rate(int16_chains_avx512, macs, T, seconds);
}

std::vector<double> measure_thread_scalar_rates(int threads, double seconds) {
  const int T = std::max(1, threads <= 0 ? omp_get_max_threads() : threads);
  std::vector<double> rates(T, 0.0);
#pragma omp parallel num_threads(T)
  {
    const int t = omp_get_thread_num();
    // all the adds over the whole window (not the best pass: a core shared by time slices
    // would show its full clock in a short pass)
    uint64_t x = 0;
    const auto start = std::chrono::steady_clock::now();
    double elapsed = 0.0;
    do {
      for (long i = 0; i < (1L << 20); ++i) __asm__ volatile("add $1, %0" : "+r"(x));
      elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    } while (elapsed < seconds || x < (3u << 20));
    rates[t] = static_cast<double>(x) / elapsed / 1e9;
  }
  return rates;
}

double measure_thread_wake_us(int threads, double idle_us, int samples) {
  const int T = std::max(1, threads <= 0 ? omp_get_max_threads() : threads);
  if (T == 1 || samples < 1) return 0.0;
  using Clock = std::chrono::steady_clock;
  auto since_us = [](Clock::time_point t) { return std::chrono::duration<double, std::micro>(Clock::now() - t).count(); };
  std::vector<double> us;
  auto region = [T] {
#pragma omp parallel num_threads(T)
    if (omp_get_thread_num() >= T) std::abort();  // (never: keeps the region's body)
  };
  for (int i = 0; i < samples; ++i) {
    region();  // the last region before the caller runs alone
    const auto idle = Clock::now();
    while (since_us(idle) < idle_us) {
    }
    const auto t0 = Clock::now();
    region();
    us.push_back(since_us(t0));
  }
  std::nth_element(us.begin(), us.begin() + us.size() / 2, us.end());
  return us[us.size() / 2];
}

}  // namespace kvx::kernels

#include "kernels/compute_peak.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
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

__attribute__((target("avx512f"))) float chains_avx512() {
  __m512 a[kChainsAvx512];
  for (int i = 0; i < kChainsAvx512; ++i) a[i] = _mm512_set1_ps(1.0f + 0.001f * i);
  const __m512 b = _mm512_set1_ps(0.999999f), c = _mm512_set1_ps(1e-7f);
  for (long it = 0; it < kIters; ++it)
    for (int i = 0; i < kChainsAvx512; ++i) a[i] = _mm512_fmadd_ps(a[i], b, c);
  __m512 s = a[0];
  for (int i = 1; i < kChainsAvx512; ++i) s = _mm512_add_ps(s, a[i]);
  alignas(64) float r[16];
  _mm512_store_ps(r, s);
  return r[0];
}

}  // namespace

double measure_fma_peak_gmacs(int lanes, int threads, double seconds) {
  if (lanes != 8 && lanes != 16) throw Error("measure_fma_peak_gmacs: lanes must be 8 (AVX2) or 16 (AVX-512), got " + std::to_string(lanes));
  if (lanes == 16 && !__builtin_cpu_supports("avx512f")) throw Error("measure_fma_peak_gmacs: this CPU has no AVX-512");
  const int T = std::max(1, threads <= 0 ? omp_get_max_threads() : threads);
  double best = 0.0;
  float sink = 0.0f;
  const auto start = std::chrono::steady_clock::now();
  for (int pass = 0;; ++pass) {
    const auto t0 = std::chrono::steady_clock::now();
    float total = 0.0f;
#pragma omp parallel num_threads(T) reduction(+ : total)
    total += lanes == 16 ? chains_avx512() : chains_avx2();
    const auto t1 = std::chrono::steady_clock::now();
    sink += total;
    const double macs = static_cast<double>(T) * kIters * (lanes == 16 ? kChainsAvx512 : kChainsAvx2) * lanes;
    best = std::max(best, macs / std::chrono::duration<double>(t1 - t0).count() / 1e9);
    if (pass >= 2 && std::chrono::duration<double>(t1 - start).count() >= seconds) break;
  }
  if (sink < 0) best = -best;  // keeps the chains live; never true (values stay near 1)
  return best;
}

}  // namespace kvx::kernels

#include "kernels/memory_bandwidth.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <string>

#include <unistd.h>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "util/error.h"

namespace kvx::kernels {

namespace {

// Sum of a[0..n) (n % 256 == 0) as four interleaved sequential streams (one per quarter, which
// keeps more misses in flight than one stream), 8 independent vector accumulators, so the loop
// is bound by loads, not by add latency.
float read_chunk(const float* a, size_t n) {
  const size_t q = n / 4;
#if defined(__AVX__)
  __m256 s[8];
  for (auto& v : s) v = _mm256_setzero_ps();
  for (size_t i = 0; i < q; i += 16)
    for (int k = 0; k < 4; ++k) {
      s[2 * k] = _mm256_add_ps(s[2 * k], _mm256_load_ps(a + k * q + i));
      s[2 * k + 1] = _mm256_add_ps(s[2 * k + 1], _mm256_load_ps(a + k * q + i + 8));
    }
  for (int j = 1; j < 8; ++j) s[0] = _mm256_add_ps(s[0], s[j]);
  alignas(32) float r[8];
  _mm256_store_ps(r, s[0]);
  return r[0] + r[1] + r[2] + r[3] + r[4] + r[5] + r[6] + r[7];
#else
  float s[64] = {};
  for (size_t i = 0; i < q; i += 16)
    for (int k = 0; k < 4; ++k)
      for (int j = 0; j < 16; ++j) s[16 * k + j] += a[k * q + i + j];
  float r = 0.0f;
  for (float x : s) r += x;
  return r;
#endif
}

// The largest data cache the OS reports (L3, else L2; glibc reads CPUID), 0 if none.
size_t last_level_cache_bytes() {
  long bytes = 0;
#if defined(_SC_LEVEL3_CACHE_SIZE) && defined(_SC_LEVEL2_CACHE_SIZE)
  bytes = std::max(sysconf(_SC_LEVEL3_CACHE_SIZE), sysconf(_SC_LEVEL2_CACHE_SIZE));
#endif
  return bytes > 0 ? static_cast<size_t>(bytes) : 0;
}

// 256-float aligned range of thread t of T over n floats.
void thread_range(size_t n, int t, int T, size_t& lo, size_t& hi) {
  lo = n / 256 * t / T * 256;
  hi = n / 256 * (t + 1) / T * 256;
}
}  // namespace

ReadBandwidthProbe::ReadBandwidthProbe(size_t bytes, int threads) {
  constexpr size_t kAlign = size_t{2} << 20;
  evict_bytes_ = std::max(size_t{128} << 20, 2 * last_level_cache_bytes());
  bytes = std::max({bytes, size_t{1} << 30, evict_bytes_});
  bytes_ = (bytes + kAlign - 1) / kAlign * kAlign;
  threads_ = threads <= 0 ? omp_get_max_threads() : threads;
  void* mem = nullptr;
  if (posix_memalign(&mem, kAlign, bytes_) != 0 || mem == nullptr)
    throw Error("ReadBandwidthProbe: cannot allocate " + std::to_string(bytes_ >> 20) +
                " MiB (at least 1 GiB and twice the last-level cache, " + std::to_string(evict_bytes_ >> 20) +
                " MiB here, so that caches do not count); free memory");
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  madvise(mem, bytes_, MADV_HUGEPAGE);
#endif
  data_ = static_cast<float*>(mem);
  const size_t n = bytes_ / sizeof(float);
#pragma omp parallel num_threads(threads_)
  {
    size_t lo, hi;
    thread_range(n, omp_get_thread_num(), threads_, lo, hi);
    for (size_t i = lo; i < hi; ++i) data_[i] = 1.0f;  // first touch places pages near the reader
  }
}

ReadBandwidthProbe::~ReadBandwidthProbe() { std::free(data_); }

double ReadBandwidthProbe::read(size_t bytes) const {
  const size_t n = bytes_ / sizeof(float);
  const size_t per_thread = bytes >= bytes_ ? n : bytes / sizeof(float) / threads_ / 256 * 256;  // whole parts, or a prefix of each
  double total = 0.0;
#pragma omp parallel num_threads(threads_) reduction(+ : total)
  {
    size_t lo, hi;
    thread_range(n, omp_get_thread_num(), threads_, lo, hi);
    total += read_chunk(data_ + lo, std::min(hi - lo, per_thread));
  }
  return total;
}

void ReadBandwidthProbe::evict_caches() const {
  if (read(evict_bytes_) < 0) std::abort();  // keeps the sums live; never true (all ones)
}

double ReadBandwidthProbe::measure(double seconds, size_t bytes) const {
  bytes = bytes == 0 ? bytes_ : std::clamp(bytes, size_t{256} << 20, bytes_);
  double best = 0.0, sink = 0.0;
  const auto start = std::chrono::steady_clock::now();
  for (int pass = 0;; ++pass) {
    const auto t0 = std::chrono::steady_clock::now();
    sink += read(bytes);
    const auto t1 = std::chrono::steady_clock::now();
    best = std::max(best, static_cast<double>(bytes) / std::chrono::duration<double>(t1 - t0).count() / 1e9);
    if (pass >= 2 && std::chrono::duration<double>(t1 - start).count() >= seconds) break;
  }
  if (sink < 0) best = -best;  // keeps the sums live; never true (all ones)
  return best;
}

}  // namespace kvx::kernels

// STREAM-like read-bandwidth probe: the ceiling a memory-bound decode kernel is judged against.
#pragma once
#include <cstddef>

namespace kvx::kernels {

// Holds a buffer of `bytes` (at least 1 GiB and evict_bytes(), so caches do not count), first touched by the
// `threads` OpenMP threads (0: all) that read it. measure() reads it (or `bytes` of it, at least
// 256 MiB, from the start of each thread's part) with 256-bit loads into independent accumulators, each thread streaming its
// part as four sequential streams, for about `seconds` (at least 3 passes), and returns the
// best pass in GB/s (1e9 bytes/s). One probe can measure many times, e.g. between the kernels
// of a benchmark, so that each is judged against the bandwidth of the minutes it ran in.
class ReadBandwidthProbe {
 public:
  explicit ReadBandwidthProbe(size_t bytes = size_t{1} << 30, int threads = 0);
  ~ReadBandwidthProbe();
  ReadBandwidthProbe(const ReadBandwidthProbe&) = delete;
  ReadBandwidthProbe& operator=(const ReadBandwidthProbe&) = delete;
  double measure(double seconds = 1.0, size_t bytes = 0) const;
  // Reads evict_bytes() of the buffer, each thread from the start of its own part, so that the
  // caches hold none of what ran before: a benchmark's call then starts cold, like a decode step in
  // a model whose other layers ran in between (as triton's do_bench clears the L2 cache).
  void evict_caches() const;
  // Twice the last-level cache as the OS reports it, at least 128 MiB; the buffer holds at least this.
  // (A fixed 128 MiB left 16K-token stores partly cached on an Intel Xeon, Emerald Rapids, with a
  // 300 MiB L3: bf16 MHA decode read "109%" of the probe, 65% with 1 GiB read between calls.)
  size_t evict_bytes() const { return evict_bytes_; }

 private:
  double read(size_t bytes) const;  // the first bytes / threads of each thread's part; their sum
  float* data_ = nullptr;
  size_t bytes_ = 0, evict_bytes_ = 0;
  int threads_ = 1;
};

}  // namespace kvx::kernels

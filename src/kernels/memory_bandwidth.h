// STREAM-like read-bandwidth probe: the ceiling a memory-bound decode kernel is judged against.
#pragma once
#include <cstddef>

namespace kvx::kernels {

// Reads a buffer of `bytes` (at least 1 GiB is used, so caches do not count) with 256-bit loads
// into independent accumulators on `threads` OpenMP threads (0: all), each thread streaming the
// part it first touched as four sequential streams. Repeats passes for about `seconds` (at least 3) and returns the best
// pass in GB/s (1e9 bytes/s).
double measure_read_bandwidth_gbps(size_t bytes = 1ull << 30, int threads = 0, double seconds = 1.0);

}  // namespace kvx::kernels

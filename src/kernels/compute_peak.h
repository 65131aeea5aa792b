// Compute probes: multiply-add throughput, the ceiling a decode kernel is judged against when it
// is not bound by memory (GQA with many query heads per KV head, q8/q4 rows), and each thread's
// scalar rate, which shows a vCPU whose core is shared (the multiply-add probe does not).
#pragma once
#include <vector>

namespace kvx::kernels {

// Fused multiply-adds per second (in units of 1e9 scalar multiply-adds) that `threads` OpenMP
// threads (0: all) sustain with independent register accumulators, at a vector width of 8
// (AVX2) or 16 (AVX-512, where the CPU has it) lanes. Best of passes over about `seconds`.
double measure_fma_peak_gmacs(int lanes, int threads = 0, double seconds = 0.5);

// The same for int8 dot products, the instructions q8/q4 caches are scored with (unsigned x
// signed bytes into 32-bit sums): AVX-512 VNNI's vpdpbusd (64 multiply-adds each), or AVX2's
// vpmaddubsw into 16-bit sums plus an add (32 per pair), as the decode kernels use them.
double measure_int8_dot_peak_gmacs(int lanes, int threads = 0, double seconds = 0.5);

// The same for bf16 dot products (AVX-512 BF16's vdpbf16ps, 32 multiply-adds each), what the
// AVX-512 decode kernel scores bf16 keys with where the CPU has them (decode_dots_bf16).
double measure_bf16_dot_peak_gmacs(int threads = 0, double seconds = 0.5);

// The same for int16 dot products (AVX-512 VNNI's vpdpwssd, 32 multiply-adds each), what the
// AVX-512 decode kernel weighs q8/q4 values with (decode_weighs_values_in_int16).
double measure_int16_dot_peak_gmacs(int threads = 0, double seconds = 0.5);

// Each of `threads` OpenMP threads' (0: all) rate of a chain of dependent integer adds, run by all
// of them at once, in 1e9 adds a second: one a cycle, so the clock in GHz, on a core whose integer
// side is the thread's own. It is not the clock where the core is shared: on this project's VM one
// vCPU often ran these adds at 0.55-0.65x for minutes (independent integer adds 0.66x, 512-bit
// loads 0.89x) while its vector multiply-adds ran at the full rate, the same as the other vCPU's,
// and measure_fma_peak_gmacs saw nothing. The decode kernels, whose loads, addresses, loop counters
// and prefetch bookkeeping surround the multiply-adds, ran 1.35-1.53x slower there (one thread,
// H = 16, caches in L2: f32/bf16/q8/q4 GQA, f32 and q8 LRKV r = 8).
std::vector<double> measure_thread_scalar_rates(int threads = 0, double seconds = 0.05);

// Microseconds an empty OpenMP parallel region of `threads` threads (0: all) takes when the caller
// has run alone for `idle_us` since the last region ended: the fixed cost each decode call pays to
// start its threads, which depends on the process's OpenMP wait policy. With
// OMP_WAIT_POLICY=PASSIVE (what kvx runs with: README, Threads) idle threads sleep at once and each
// region wakes them: on this project's Zen 5 VM a median 20-24 us right after a region and 50-76 us
// after 1 ms alone, against ~4 us while they still spin (GOMP_SPINCOUNT). Median of `samples`; 0
// with one thread.
double measure_thread_wake_us(int threads = 0, double idle_us = 0.0, int samples = 200);

}  // namespace kvx::kernels

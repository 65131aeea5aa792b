// `kvx bench train` and `kvx bench tokenizer`: throughput measured in one run beside this
// machine's own reference figure (sgemm GFLOP/s), so the ratio is meaningful on a noisy box.
#pragma once
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "attention/mixer.h"
#include "model/config.h"
#include "train/train_config.h"

namespace kvx::eval {

// Best-of-several torch::mm timing at n x n, all threads.
double measure_sgemm_gflops(int n, double seconds);

// Matmul FLOPs of one training step (forward + backward = 3 x forward), counting the full
// T x T score matrix the dense path computes.
double training_flops_per_step(const model::ModelConfig& m, int batch, int seq_len);

nlohmann::json bench_train(const train::RunConfig& config, int steps, bool verbose);

// One data-parallel worker of `kvx bench train --nproc N` (coordinates from the environment, set
// by train::launch_workers): timed steps with the gradient buckets, the part of the step spent
// waiting for the all-reduce, and a blocking all-reduce of the whole gradient; rank 0 returns
// the row, the others null.
nlohmann::json bench_train_worker(const train::RunConfig& config, int steps);
// The launcher side: 1 worker in this process, then N workers; rows for both, the all-reduce's
// share and a projection to N machines (each like this one) joined by networks of given speeds.
nlohmann::json bench_train_data_parallel(const train::RunConfig& config, int steps, int nproc,
                                         const std::vector<std::string>& worker_argv, bool verbose);
// Whole-model decode tokens/s at `context` cached tokens with the given cache: a model of this
// config with random weights and a cache filled with random rows, one token per step.
double decode_tokens_per_second(model::ModelConfig config, const attention::CacheOptions& cache, int64_t context,
                                double seconds);

// How many sequences of `length` tokens fit in `budget_bytes` of decode cache, found by allocating
// them: decode states of a model of this config are filled with random history one after
// another until the next would pass the budget, or `limit` are held (then the answer is a lower
// bound: an evicting cache holds so little that counting on would only take time).
int64_t capacity_sequences(model::ModelConfig config, const attention::CacheOptions& cache, int64_t length,
                           int64_t budget_bytes, int64_t limit = 1024);

// Seconds to prefill `context` random tokens into an empty decode state of a model of this config
// (random weights), in chunks of `chunk` tokens through Transformer::step on the libtorch
// reference caches (batched matrix products; the fused caches take one token at a time).
double prefill_seconds(model::ModelConfig config, int64_t context, int64_t chunk = 512);

struct DecodeBenchOptions {
  std::vector<int64_t> contexts{1024, 4096, 16384, 65536};
  std::vector<std::string> types{"f32", "bf16", "q8", "q4"};
  std::vector<int> kv_heads{16, 4};
  std::vector<std::string> isas{"auto"};  // decode back ends: auto, avx2, avx512
  std::vector<int> lrkv_ranks{32};         // LRKV factored-decode rows at H, d_h (none: empty)
  bool gdn_rows = true;                    // a GDN layer's decode step per context (flat in context)
  std::vector<double> natsl_kept{0.25, 0.5};  // NAtS-L attention core at these kept-KV fractions (none: empty)
  std::vector<double> lla_budgets{4, 16};     // LLA reconstruct-on-read rows at these compressions (none: empty)
  int lla_loops = 4;                          // T of the LLA rows (Ouro)
  // q8 / q4 stores' layout (dense, LRKV K_s/V_s): auto (decode_kv_layout; rows when avx2 is among
  // the back ends timed, which would read tiled stores through a copy), rows or tiled16
  std::string q8_layout = "auto", q4_layout = "auto";
  // bf16 dense stores' layout: auto (decode_kv_layout: tiled16 for groups of 1-8 queries a KV head
  // where AVX-512 dots bf16; rows when avx2 is among the back ends timed), rows or tiled16 (groups
  // the AVX-512 back end reads with heads in lanes stay rows)
  std::string bf16_layout = "auto";
  int heads = 16, head_dim = 128;
  double seconds_per_point = 0.4;
  bool whole_model = true;  // also tiny-model decode tokens/s at each context
};
// Rows: one {"stream_gbps"} (the best read-bandwidth probe, with every probe); per (cache,
// context, hkv) the fused kernel's time per step, bytes read, GB/s, its ratio ("bw_ratio") to
// the better of the probes either side of its calls in the round of its fastest call ("probe_gbps"; the
// same for an f32 multiply-add probe beside each, "compute_probe_gmacs", as a share of the start's
// peak "compute_ratio", which scales the row's compute floor "fma_floor_us") and its
// speed-up over f32 at the same shape and back end ("isa"; "layout": the store's, kv_store.h; f32 rows also time the libtorch
// reference); LRKV rows ("family": "lrkv") per (rank, cache, context), with their speed-up over
// the dense MHA kernel timed in the same rounds (on the back end auto picks for the rank, against
// the dense rows of the same request); per (cache, context)
// whole-model decode tokens/s. GDN rows ("family": "gdn"): a whole GDN layer's decode step (d =
// 1024, H/2 heads of K = V = 2 d_h) per context and its ratio to the first context. NAtS-L rows
// ("family": "natsl"): one token's attention core of a NAtS-L layer with the softmax width of the
// dense rows (H softmax heads of d_h in H/2 head groups, so K = V = 2 d_h): the GDN state step plus
// attention over the kept fraction of the context, and its speed-up over the dense MHA kernel at
// the same context and type (target: 0.8 / kept fraction). LLA rows ("family": "lla"): one
// (loop, layer) read of a per-head LLA store (H = Hkv heads of d_h, T loops, ranks split 3:5 at
// the budget, e.g. (96, 160) at 4x for d_h 128, T 4) against the f32 MHA kernel at the same
// context: time, bytes read, the share of the time the key reconstruction alone takes, and the
// absorbed read's time.
nlohmann::json bench_decode(const DecodeBenchOptions& options, bool verbose);

nlohmann::json bench_tokenizer(const std::string& data_dir, int vocab_size, bool verbose);

}  // namespace kvx::eval

// `kvx bench train` and `kvx bench tokenizer`: throughput measured in one run beside this
// machine's own reference figure (sgemm GFLOP/s), so the ratio is meaningful on a noisy box.
#pragma once
#include <nlohmann/json.hpp>
#include <string>

#include "model/config.h"
#include "train/train_config.h"

namespace kvx::eval {

// Best-of-several torch::mm timing at n x n, all threads.
double measure_sgemm_gflops(int n, double seconds);

// Matmul FLOPs of one training step (forward + backward = 3 x forward), counting the full
// T x T score matrix the dense path computes.
double training_flops_per_step(const model::ModelConfig& m, int batch, int seq_len);

nlohmann::json bench_train(const train::RunConfig& config, int steps, bool verbose);
nlohmann::json bench_tokenizer(const std::string& data_dir, int vocab_size, bool verbose);

}  // namespace kvx::eval

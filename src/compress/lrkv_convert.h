// Post-hoc conversion of a trained dense (MHA/GQA) model to LRKV (issue 5, beyond the paper).
// Per layer and separately for keys and values: W_s = the mean over query heads of their
// projections; head h's difference D_h = W_h - W_s is approximated at rank r,
//   expand / shared_rope: the truncated SVD D_h^T ~ P S Q^T, U_h = P S^1/2, B_h = Q S^1/2;
//   pair_aligned (keys): B_h is the fixed selection of the r/2 lowest-frequency RoPE planes, so
//   U_h takes D_h's rows on those dims (the best approximation with that B_h).
// Everything else (embeddings, queries, outputs, MLPs, norms) is copied. With expand and r = d_h
// (or pair_aligned with r = d_h) the converted model computes the same function.
#pragma once
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "model/transformer.h"
#include "train/trainer.h"

namespace kvx::compress {

struct LrkvConversion {
  int rank = 16;
  std::string rope = "expand";
};

// The converted model's config (every layer LRKV at this rank and RoPE mode), validated; an
// error for what cannot be converted (non-dense layers, qk_norm, a bad rank or mode).
model::ModelConfig lrkv_config_for(const model::ModelConfig& dense, const LrkvConversion& options);
model::Transformer convert_to_lrkv(const model::Transformer& dense, const LrkvConversion& options);
// "" if the LRKV config caches no more per token than the source; else a warning naming the
// ratio and the largest rank that keeps it no larger (GQA/MQA sources: heads of a group share a KV head,
// so their residuals are identical and LRKV stores them H/Hkv times).
std::string cache_growth_warning(const model::ModelConfig& source, const model::ModelConfig& lrkv);

// `kvx convert lrkv`: convert a trained model, evaluate validation CE before and after, heal the
// converted model with a short fine-tune (all weights, the source's tokenizer and corpora), and
// evaluate again. Writes <out>/converted (model directory), <out>/heal (run directory, resumable)
// and <out>/report.json.
struct ConvertRun {
  std::string from, out, data_dir;
  std::vector<std::string> sources{"brown", "kjv"};
  LrkvConversion conversion;
  int heal_steps = 200;
  double heal_lr = 3e-4;
  int seq_len = 0;        // 0: min(256, the model's context)
  int eval_windows = 64;  // validation windows for each CE
  bool verbose = true;
  const train::TrainingData* data = nullptr;  // given (tests, the compare runner): used instead of the corpora
};
nlohmann::json convert_lrkv_run(const ConvertRun& run);

}  // namespace kvx::compress

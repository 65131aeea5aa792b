// What `kvx generate` and `kvx eval` compute, as requests on a loaded model: the CLI prints
// these results and the Python module (src/python/) returns them.
#pragma once
#include <nlohmann/json.hpp>

#include <functional>
#include <string>

#include "model/sampling.h"
#include "train/checkpoint.h"

namespace kvx::eval {

struct GenerateRequest {
  std::string prompt;
  int max_new = 100;
  double temperature = 0.8, top_p = 0.95;
  uint64_t seed = 0;
  std::string kv_cache = "f32", evict;  // decode cache element type; "" or "sink=S,window=W"
  bool reference = false;               // the libtorch decode path instead of the fused kernels
  std::string lla;                      // a codec directory (kvx fit lla): history stored as cross-loop codes
  bool lla_absorbed = false;
  int share_kv_layers = 1;
  std::string document_module;          // kvx fit nectar: the document's KV replaced by a module
};

struct GenerateOutput {
  std::string text;  // the generated continuation (prompt excluded)
  int64_t prompt_tokens = 0;
  model::GenerateResult stats;
  std::string cache;  // the cache as CacheOptions::describe() names it
};

// on_piece receives each generated token's bytes as it is produced (streaming output).
GenerateOutput generate_text(train::LoadedModel& m, const GenerateRequest& r,
                             const std::function<void(const std::string&)>& on_piece = nullptr);

struct EvalRequest {
  std::string split = "test", data_dir, sources = "brown,kjv";
  int max_windows = 0, seq_len = 0, batch = 8;  // seq_len 0: the model's context
  std::string kv_cache, evict;  // set: also evaluate through this decode cache
  std::string lla;              // set: also evaluate through these cross-loop codes, one token per step
  bool lla_absorbed = false;
  int share_kv_layers = 1;
  std::string mqar;             // set: MQAR accuracy at these pair counts ("1,4,16")
  int mqar_symbols = 0, mqar_sequences = 64;
  std::string document_module, document;  // set: a Nectar module on its held-out query splits instead
};

// Held-out cross-entropy, perplexity, bits/byte, the unigram baseline and KV bytes/token; with a
// cache, CE/KL/top-1 through it; with mqar, recall accuracy; with a document module, its report
// (compress::evaluate_module_dir). The JSON `kvx eval --json` prints.
nlohmann::json evaluate_model(train::LoadedModel& m, const EvalRequest& r);

}  // namespace kvx::eval

// Serving a request after a fixed document three ways (SPEC 1.4's comparison the Nectar paper
// omits): (a) prefill the document with every request, (b) reuse a prefix KV cache of the
// document (prefilled once, rolled back after each request), (c) a Nectar module in place of the
// document's KV. For each: time to first token (prompt in, first logits out), greedy decode
// tokens/s, and the bytes the request's state holds (document KV or module weights, plus the
// local tokens' KV). Fused f32 decode caches throughout; best of `repeats` timed requests.
#pragma once
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "attention/nectar.h"
#include "model/transformer.h"

namespace kvx::eval {

struct ServingRow {
  std::string mode;  // "prefill" | "prefix" | "module"
  double ttft_seconds = 0, decode_tokens_per_second = 0;
  double setup_seconds = 0;  // once per document: the prefix cache's prefill (0 otherwise)
  int64_t state_bytes = 0;   // document KV or module weights, plus the request's local KV
  std::vector<int64_t> tokens;  // the greedy answer (the same in every mode when the module is exact)
  nlohmann::json to_json() const;
};

// module may be null (then only prefill and prefix). module_bytes: the module's weights.
std::vector<ServingRow> measure_document_serving(model::Transformer& model, const std::vector<int32_t>& document,
                                                 std::shared_ptr<const attention::NectarDocument> module, int64_t module_bytes,
                                                 const std::vector<int32_t>& prompt, int new_tokens, int repeats);

}  // namespace kvx::eval

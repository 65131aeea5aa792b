// Nectar document modules for a whole model (SPEC 1.4; seed 003; the per-layer math is in
// attention/nectar.h): the document's exact KV, self-study queries, fitting, evaluation, files.
//
// Queries (self-study, made by the served model itself from the document, all `length` tokens):
//   quote   a document span followed by the document's own continuation,
//   cloze   a document span with one token blanked (" ___"), then "\nAnswer:" and the blanked
//           token followed by the span's continuation,
//   sample  a short document span continued by the model's own samples (the full document in context);
// a quote or cloze running past the document's end is continued by the model's samples. They are
// shuffled and split 80/20 into train (1/8 of it held out for checkpoint selection) and test; the
// challenge split is the quarter of the test queries least similar to any training query (cosine
// of token-count vectors; the paper uses sentence embeddings).
//
// Loss (seed Eqs. 3.2-3.3) on teacher-forced query tokens after the document:
//   L = l_alpha E sum_{l,h} (a - alpha)^2 + l_A E sum_{l,h} ||A_theta - A||^2 + l_KL E KL(p_full || p_module),
// the regression terms on the full-document teacher's queries (cached once), the KL term through
// the model with the modules in place. Only the modules train (AdamW, warmup + cosine, clipping 1).
//
// Files in a module directory: nectar.json (architecture, budget, sizes, the document's length
// and hash, the model's config and weight fingerprint), nectar.safetensors ("layers.<l>.<name>"),
// queries.json (the query splits as token ids), report.json.
#pragma once
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "attention/nectar.h"
#include "model/transformer.h"
#include "text/bpe.h"

namespace kvx::compress {

// A document's exact decode state: per layer post-RoPE keys and values [1, Hkv, n, d_h].
struct DocumentKV {
  std::vector<int32_t> ids;
  std::vector<torch::Tensor> keys, values;
  int64_t tokens() const { return static_cast<int64_t>(ids.size()); }
  int64_t bytes() const;  // f32 K and V of every layer (what a reused prefix cache holds)
  // The exact document as a module set (the full-document teacher; decode reads it like a module).
  std::shared_ptr<const attention::NectarDocument> exact(const model::ModelConfig& config) const;
};

// Prefills the document once. Errors: an empty document; a document that leaves fewer than
// `reserve` positions of the model's context for the tokens after it.
DocumentKV prefill_document(model::Transformer& model, const std::vector<int32_t>& document, int64_t reserve);

// Logits [B, T, V] of tokens ids [B, T] placed right after a document of `offset` tokens whose
// response each layer reads from `document` (exact, a module, or none); differentiable in the modules.
torch::Tensor forward_after_document(model::Transformer& model, const attention::NectarDocument& document,
                                     const torch::Tensor& ids,
                                     const std::function<void(int, const torch::Tensor&, const attention::DocumentAttention&)>&
                                         observe = nullptr);

// "no document": every layer reads nothing but the local tokens.
std::shared_ptr<const attention::NectarDocument> no_document(const model::ModelConfig& config, int64_t tokens);

struct NectarModuleConfig {
  attention::NectarArch arch;
  double rho = 0.02;
  std::vector<double> layer_multipliers;  // per contiguous layer group; empty = uniform
  int64_t document_tokens = 0;
  std::string document_hash, document_path;
  std::string model_fingerprint;
  nlohmann::json model;        // the model's config.json
  std::vector<int64_t> sizes;  // per layer: MLP width or Quadrature pairs
  nlohmann::json to_json() const;
  static NectarModuleConfig from_json(const nlohmann::json& j);
};

// Per layer |theta| budget per KV head: rho 2 n d_h, scaled by the layer's group multiplier
// (normalised so the total is unchanged). Multipliers split the layers into that many contiguous groups.
std::vector<double> layer_budgets(double rho, int64_t tokens, int head_dim, int layers, const std::vector<double>& multipliers);

class DocumentModule {
 public:
  NectarModuleConfig config;
  std::vector<std::shared_ptr<attention::NectarLayer>> layers;

  // Fresh modules of config.sizes for this model.
  static DocumentModule build(const NectarModuleConfig& config, const model::ModelConfig& model);
  std::shared_ptr<const attention::NectarDocument> decode_set() const;
  std::vector<std::pair<std::string, torch::Tensor>> named_parameters() const;  // "layers.<l>.<name>"
  int64_t parameter_count() const;
  int64_t bytes() const { return parameter_count() * 4; }  // f32
  void save(const std::string& dir) const;
  // Checks the module against the model (config and weights): a module fitted for another model is refused.
  static DocumentModule load(const std::string& dir, const model::Transformer& model);
};

// FNV-1a 64 (hex) of every weight of the model, and of a token sequence.
std::string model_fingerprint(const model::Transformer& model);
std::string tokens_fingerprint(const std::vector<int32_t>& ids);

struct QueryOptions {
  int count = 400;
  int length = 48;
  uint64_t seed = 1;
};
struct NectarQueries {
  torch::Tensor train, validation, test, challenge;  // [N, length] int64
  nlohmann::json to_json() const;
  static NectarQueries from_json(const nlohmann::json& j);
};
NectarQueries make_queries(model::Transformer& model, const text::BpeTokenizer& tokenizer, const DocumentKV& document,
                           const QueryOptions& options);
// Queries shared by several fits on one document: read from `file` when it exists (checked to be
// for this model and document), else made and written there ("" = made, not kept). *seconds: the
// time making them took (when they were made).
NectarQueries load_or_make_queries(const std::string& file, model::Transformer& model, const text::BpeTokenizer& tokenizer,
                                   const DocumentKV& document, const QueryOptions& options, double* seconds = nullptr);

// How well `student` stands in for the exact document on queries ids [N, length] (teacher forced).
struct NectarQuality {
  double alpha_mse = 0;        // mean over tokens, layers, query heads of (a - alpha)^2
  double content_mse = 0;      // mean of ||A_theta - A||^2
  double kl = 0;               // mean KL(p_full || p_student) per token, nats
  double teacher_accuracy = 0, student_accuracy = 0;  // next-token accuracy on the queries
  double top1_agreement = 0;
  int64_t tokens = 0;
  double accuracy_gap() const { return teacher_accuracy - student_accuracy; }
  nlohmann::json to_json() const;
};
NectarQuality evaluate_document_module(model::Transformer& model, const DocumentKV& document,
                                       const attention::NectarDocument& student, const torch::Tensor& queries);

// `kvx fit nectar`.
struct FitNectarRun {
  std::string model, document, out;  // out: the module directory (required; the CLI defaults it next to the model)
  attention::NectarArch arch;
  double rho = 0.02;
  std::vector<double> layer_multipliers;
  // Loss weights (l_alpha, l_A, l_KL); negative = the architecture's default: MLP (0.1, 1, 0.01),
  // Quadrature (0, 1, 0.01).
  double alpha_weight = -1, content_weight = -1, kl_weight = -1;
  int steps = 300, batch = 16;
  double lr = 3e-3;
  int warmup = 20, evals = 6;
  QueryOptions queries;
  std::string queries_file;  // shared queries (load_or_make_queries); "" = made for this fit only
  bool verbose = true;
};
nlohmann::json fit_nectar_run(const FitNectarRun& run);

// `kvx eval --document-module`: the module's test and challenge splits, with the document read
// from `document` (or the path recorded at fitting; its hash must match).
nlohmann::json evaluate_module_dir(model::Transformer& model, const text::BpeTokenizer& tokenizer, const std::string& module_dir,
                                   const std::string& document);

// The document file tokenised; an empty one is an error.
std::vector<int32_t> read_document(const text::BpeTokenizer& tokenizer, const std::string& path);

}  // namespace kvx::compress

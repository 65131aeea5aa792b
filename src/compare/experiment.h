// Declarative comparison experiments: a list of arms over shared data, steps and seed.
//
//   train arm:   a model config (overrides of the experiment's base model), trained from scratch
//   posthoc arm: a transform of a trained arm's model (cache type, sink + window eviction)
//   convert arm: a trained arm's model converted to another family and healed (kvx convert lrkv)
//   lla arm:     an LLA codec fitted (and optionally distilled) on a trained looped arm (kvx fit
//                lla), its history decoded through the codes, optionally with eviction
//   nectar arm:  a Nectar module fitted for one document on a trained arm (kvx fit nectar),
//                measured on the document's held-out and challenge queries and served in its place
//   document arm: that document read exactly ("full": served by prefill per request and by a
//                reused prefix cache) or not at all ("none"), the two ends a module sits between
//
// Arms are identified by a content hash of everything that determines their result, so a re-run
// only computes what changed and experiments share arms (posthoc's base is arch's MHA arm).
#pragma once
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "attention/mixer.h"
#include "train/train_config.h"

namespace kvx::compare {

struct Arm {
  std::string name;
  std::string kind;     // "train" | "posthoc" | "convert" | "lla" | "nectar" | "document"
  // train: {"model": {overrides}, optional "train": {overrides}}; posthoc: {"base": arm, "kv_cache": t, "evict": "sink=S,window=W"};
  // convert: {"base": arm, "rank": r, "rope": mode, "heal_steps": n}
  // lla: {"base": arm, "variant": v, "budget": "4x" (or "ranks": [rk, rv]), "steps": n, "init": i,
  //       "on_policy": b, "attention_weight": w, "evict": "sink=S,window=W", "absorbed": b}
  // nectar: {"base": arm, "document": "kjv" | "brown" | a file, "arch": "mlp" | "quadrature", "rho": x,
  //          "loss": "reg" | "mixed" | "kl"}; document: {"base": arm, "document": d, "mode": "full" | "none"}
  nlohmann::json spec;
};

// How arms are measured (part of every metric's cache key).
struct EvalSettings {
  int test_windows = 64;                     // held-out CE / bits-per-byte windows of seq_len
  std::vector<int> context_multiples{1, 2, 4};
  int long_context_tokens = 4096;            // tokens evaluated per context multiple
  std::vector<int> mqar_pairs{1, 2, 4, 8, 16, 24};
  int mqar_sequences = 64;
  std::vector<int64_t> decode_contexts{4096, 16384};
  double decode_seconds = 0.3;
  // Prefill seconds at these contexts (decode group; part of that group's key only, not to_json's).
  std::vector<int64_t> prefill_contexts;
  // Capacity: how many sequences of this many tokens fit in capacity_mib of cache, by allocation (0: off).
  int64_t capacity_tokens = 0;
  int64_t capacity_mib = 256;
  nlohmann::json to_json() const;
};

// The document experiment's settings (queries, fitting, serving; part of its arms' keys).
struct DocumentSettings {
  int queries = 300, query_length = 48;  // self-study queries per document (compress::QueryOptions)
  int steps = 200, batch = 16;           // fitting
  double lr = 3e-3;
  int max_tokens = 900;                  // the built-in documents are cut at a line to at most this many tokens
  int prompt_tokens = 32, new_tokens = 32, repeats = 3;  // serving: one request's prompt and answer, best of
  nlohmann::json to_json() const;
};

struct Experiment {
  std::string name, preset;
  train::RunConfig base;  // shared model, data, steps and seed
  EvalSettings eval;
  DocumentSettings document;
  std::vector<std::string> groups;  // metric groups to compute: "quality", "mqar", "decode", "capacity"
  std::vector<Arm> arms;
  nlohmann::json to_json() const;
};

std::vector<std::string> experiment_names();  // arch, posthoc, decode, doc
std::vector<std::string> preset_names();      // tiny, small
Experiment builtin_experiment(const std::string& name, const std::string& preset);

// Keep only the named arms (and the arms they derive from); empty: all. demo_arms: the subset
// `kvx demo` runs (empty: every arm).
void select_arms(Experiment& e, const std::vector<std::string>& names);
std::vector<std::string> demo_arms(const std::string& experiment);

// The run config of a train arm: the base with the arm's model overrides applied.
train::RunConfig arm_run_config(const Experiment& e, const Arm& arm);
// The cache options of a posthoc arm (an lla arm: its eviction and read mode; the codec is the runner's).
attention::CacheOptions arm_cache(const Arm& arm);
// An lla arm's codec settings (what its fit depends on: not its eviction or read mode).
nlohmann::json lla_fit_spec(const Arm& arm);
const Arm& find_arm(const Experiment& e, const std::string& name);
// What a declaration must hold before anything runs (arms, kinds, bases, eval and document
// settings); throws kvx::Error naming the arm or setting and the fix. run_experiment calls it.
void validate_experiment(const Experiment& e);
// Changes an experiment by a JSON merge patch (RFC 7386) on its to_json() form, e.g.
// {"base": {"train": {"steps": 6}}, "groups": ["quality"], "arms": [...]} (an array replaces the
// whole array). Settings to_json leaves out keep their values; unknown keys are refused by name.
void apply_patch(Experiment& e, const nlohmann::json& patch);

// The doc experiment on one given document file instead of its two built-in ones.
void use_document(Experiment& e, const std::string& path);

// Content hash (hex) of a train arm: its run config without machine-local paths.
std::string train_arm_key(const train::RunConfig& config);
// Content hash of a set of metrics computed on an arm: arm key + what + settings.
std::string metrics_key(const std::string& arm_key, const nlohmann::json& what);

}  // namespace kvx::compare

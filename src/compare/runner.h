// Runs a comparison experiment: trains (or resumes) each train arm once, computes each arm's
// metric groups once (cached by content hash under <out>/arms/), and collects one row per arm
// and metric.
#pragma once
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "compare/experiment.h"
#include "train/trainer.h"

namespace kvx::compare {

struct CompareOptions {
  std::string out_dir = "runs/compare";
  std::string data_dir;  // "" = default
  bool verbose = true;
  // Data given directly instead of loaded from the data directory (tests, custom corpora).
  const train::TrainingData* data = nullptr;
  const train::TokenizedText* test = nullptr;
};

struct ArmResult {
  std::string name, kind, key;   // key: the trained model's content hash (posthoc: its base's)
  nlohmann::json metrics;        // metric -> number
  nlohmann::json curve;          // train arms: {"step": [...], "train_loss": [...], "val_ce": [...]}
  std::vector<std::pair<int, double>> mqar;  // (pairs, accuracy)
  nlohmann::json routing;        // NAtS-L arms: eval::RoutingStats::to_json() on the test windows
};

struct ExperimentResult {
  Experiment experiment;
  std::vector<ArmResult> arms;
  std::string dir;  // <out>/<experiment>-<preset>
  double seconds = 0;
};

ExperimentResult run_experiment(const Experiment& e, const CompareOptions& options);

// results.json: {"experiment", "preset", "arms": [...], "rows": [{"arm", "kind", "metric", "value"}]}.
nlohmann::json results_json(const ExperimentResult& r);

}  // namespace kvx::compare

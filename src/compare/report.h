// report.md (tables and what each number means), results.json and PNG plots for an experiment.
#pragma once
#include <string>

#include "compare/runner.h"

namespace kvx::compare {

// Writes results.json, report.md and the plots into r.dir; returns the main table (markdown).
std::string write_report(const ExperimentResult& r);

}  // namespace kvx::compare

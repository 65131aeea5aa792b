// Line plots as PNG through gnuplot (Debian gnuplot-nox). Torch-free.
#pragma once
#include <string>
#include <vector>

namespace kvx::eval {

struct Series {
  std::string title;
  std::vector<double> x, y;
};

// Returns false (and prints why) if gnuplot is missing or fails; never throws for that.
bool plot_lines(const std::string& png_path, const std::string& title, const std::string& xlabel,
                const std::string& ylabel, const std::vector<Series>& series);

}  // namespace kvx::eval

// Line plots and heat maps as PNG through gnuplot (Debian gnuplot-nox). Torch-free.
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
                const std::string& ylabel, const std::vector<Series>& series, bool log_y = false);

// cells[row][column] in [lo, hi] as coloured squares labelled with their values; row 0 at the
// top. Same gnuplot rules as plot_lines.
bool plot_heatmap(const std::string& png_path, const std::string& title, const std::string& xlabel,
                  const std::string& ylabel, const std::vector<std::string>& row_labels,
                  const std::vector<std::vector<double>>& cells, double lo, double hi);

}  // namespace kvx::eval

#include "eval/plot.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>

namespace kvx::eval {

namespace {
std::string quoted(const std::string& s) {
  std::string q = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') q.push_back('\\');
    q.push_back(c);
  }
  return q + "\"";
}
}  // namespace

namespace {

bool have_gnuplot(const std::string& png_path) {
  if (std::system("command -v gnuplot >/dev/null 2>&1") == 0) return true;
  std::cerr << "note: gnuplot not found, skipping " << png_path << " (apt-get install gnuplot-nox)\n";
  return false;
}

bool run_gnuplot(const std::string& script, const std::string& png_path) {
  FILE* p = popen("gnuplot 2>&1", "w");
  bool ok = p != nullptr;
  if (p) {
    fwrite(script.data(), 1, script.size(), p);
    ok = pclose(p) == 0;
  }
  if (!ok) std::cerr << "note: gnuplot failed to write " << png_path << "\n";
  return ok;
}

}  // namespace

bool plot_heatmap(const std::string& png_path, const std::string& title, const std::string& xlabel,
                  const std::string& ylabel, const std::vector<std::string>& row_labels,
                  const std::vector<std::vector<double>>& cells, double lo, double hi) {
  if (cells.empty() || !have_gnuplot(png_path)) return false;
  const std::string data_path = png_path + ".dat";
  size_t cols = 0;
  {
    std::ofstream d(data_path);
    for (size_t r = 0; r < cells.size(); ++r) {
      cols = std::max(cols, cells[r].size());
      for (size_t c = 0; c < cells[r].size(); ++c) d << c << ' ' << r << ' ' << cells[r][c] << '\n';
    }
  }
  std::string ytics;
  for (size_t r = 0; r < cells.size(); ++r)
    ytics += std::string(r ? ", " : "") + quoted(r < row_labels.size() ? row_labels[r] : std::to_string(r)) + " " + std::to_string(r);
  const std::string script =
      "set terminal pngcairo size " + std::to_string(260 + 90 * cols) + "," + std::to_string(200 + 60 * cells.size()) +
      " noenhanced\nset output " + quoted(png_path) + "\nset title " + quoted(title) + "\nset xlabel " + quoted(xlabel) +
      "\nset ylabel " + quoted(ylabel) + "\nset yrange [" + std::to_string(cells.size()) + "-0.5:-0.5]\nset xrange [-0.5:" +
      std::to_string(cols) + "-0.5]\nset xtics 1\nset ytics (" + ytics + ")\nset cbrange [" + std::to_string(lo) + ":" +
      std::to_string(hi) + "]\nset palette defined (0 '#f28e2b', 1 '#4e79a7')\nunset key\nplot " + quoted(data_path) +
      " using 1:2:3 with image, " + quoted(data_path) + " using 1:2:(sprintf('%.2f', $3)) with labels tc rgb 'white'\n";
  const bool ok = run_gnuplot(script, png_path);
  std::filesystem::remove(data_path);
  return ok;
}

bool plot_lines(const std::string& png_path, const std::string& title, const std::string& xlabel,
                const std::string& ylabel, const std::vector<Series>& series, bool log_y) {
  if (!have_gnuplot(png_path)) return false;
  const std::string data_path = png_path + ".dat";
  {
    std::ofstream d(data_path);
    for (const auto& s : series) {
      for (size_t i = 0; i < s.x.size() && i < s.y.size(); ++i) d << s.x[i] << ' ' << s.y[i] << '\n';
      d << "\n\n";  // gnuplot data-set separator
    }
  }
  std::string script = "set terminal pngcairo size 900,560 noenhanced\nset output " + quoted(png_path) +
                       "\nset title " + quoted(title) + "\nset xlabel " + quoted(xlabel) + "\nset ylabel " +
                       quoted(ylabel) + "\nset grid\nset key top right\n" + (log_y ? "set logscale y\n" : "") + "plot ";
  bool first = true;
  for (size_t i = 0; i < series.size(); ++i) {
    if (series[i].x.empty()) continue;
    script += std::string(first ? "" : ", ") + quoted(data_path) + " index " + std::to_string(i) +
              " with linespoints pt 7 ps " + (series[i].x.size() == 1 ? "1.8" : "0.5") + " title " + quoted(series[i].title);
    first = false;
  }
  script += "\n";
  if (first) {
    std::filesystem::remove(data_path);
    return false;
  }
  const bool ok = run_gnuplot(script, png_path);
  std::filesystem::remove(data_path);
  return ok;
}

}  // namespace kvx::eval

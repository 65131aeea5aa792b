#include "eval/plot.h"

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

bool plot_lines(const std::string& png_path, const std::string& title, const std::string& xlabel,
                const std::string& ylabel, const std::vector<Series>& series) {
  if (std::system("command -v gnuplot >/dev/null 2>&1") != 0) {
    std::cerr << "note: gnuplot not found, skipping " << png_path << " (apt-get install gnuplot-nox)\n";
    return false;
  }
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
                       quoted(ylabel) + "\nset grid\nset key top right\nplot ";
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
  FILE* p = popen("gnuplot 2>&1", "w");
  bool ok = p != nullptr;
  if (p) {
    fwrite(script.data(), 1, script.size(), p);
    ok = pclose(p) == 0;
  }
  std::filesystem::remove(data_path);
  if (!ok) std::cerr << "note: gnuplot failed to write " << png_path << "\n";
  return ok;
}

}  // namespace kvx::eval

// unirl-report: one self-contained HTML report of one or more run directories (curves of the
// metrics files, summary and recipe tables, sampled completions, sample grids); see
// include/unirl/train/report.hpp and docs/unirl-train.md.
//
//   unirl-report runs/exp1                          # writes runs/exp1/report.html
//   unirl-report runs/exp1 runs/exp2 -o cmp.html    # two runs overlaid
#include <exception>
#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

#include <unirl/train/report.hpp>

namespace {
constexpr const char* usage =
    "usage: unirl-report RUN_DIR [RUN_DIR ...] [-o REPORT.html] [--title TEXT]\n"
    "  Writes one self-contained HTML file (open it from disk; no network or server) with the curves\n"
    "  of each run's metrics files (raw and smoothed, the runs overlaid), its summary.json and recipe\n"
    "  as tables, its sampled completions (samples.jsonl) and its images (sample grids).\n"
    "  -o FILE     where to write (default: RUN_DIR/report.html with one run, else report.html)\n"
    "  --title T   the page's title (default: the runs' names)\n";
}

int main(int argc, char** argv) {
  std::vector<std::filesystem::path> runs;
  std::filesystem::path out;
  unirl::train::report_options opts;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-h" || a == "--help") {
      std::cout << usage;
      return 0;
    }
    if (a == "-o" || a == "--output" || a == "--title") {
      if (i + 1 >= argc) {
        std::cerr << "unirl-report: " << a << " needs a value\n" << usage;
        return 2;
      }
      const std::string value = argv[++i];
      if (a == "--title") opts.title = value;
      else out = value;
      continue;
    }
    if (a.size() > 1 && a[0] == '-') {
      std::cerr << "unirl-report: unknown option '" << a << "'\n" << usage;
      return 2;
    }
    runs.emplace_back(a);
  }
  if (runs.empty()) {
    std::cerr << "unirl-report: no run directory given\n" << usage;
    return 2;
  }
  if (out.empty()) out = runs.size() == 1 ? runs[0] / "report.html" : std::filesystem::path("report.html");
  try {
    unirl::train::write_report(runs, out, opts);
  } catch (const std::exception& e) {
    std::cerr << "unirl-report: " << e.what() << "\n";
    return 1;
  }
  std::cout << "wrote " << out.string() << " (" << runs.size() << (runs.size() == 1 ? " run)\n" : " runs)\n");
  return 0;
}

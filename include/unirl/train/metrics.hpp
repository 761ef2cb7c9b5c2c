#pragma once
/// \file metrics.hpp
/// Training logs: `metrics_writer` appends one JSON object per step to a `.jsonl` file;
/// `progress_line` keeps one status line on the terminal (or prints a plain line now and then
/// when the output is not a terminal).
///
/// ```cpp
/// unirl::train::metrics_writer log("runs/exp1/metrics.jsonl");
/// unirl::train::progress_line bar(total_steps, /*enabled=*/true);
/// for (...) { auto s = t.step(batch); log.write(s.to_json()); bar.update(s); }
/// bar.finish();
/// ```
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <system_error>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <unirl/config.hpp>
#include <unirl/core/error.hpp>
#include <unirl/core/stats.hpp>

#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>
#endif

namespace unirl::train {

/// Appends JSON rows, one per line, to a file (the "JSON lines" format). Every row is flushed,
/// so the file can be followed or plotted while training runs. A default-constructed writer is
/// closed and `write` does nothing.
class metrics_writer {
 public:
  metrics_writer() = default;
  /// Opens `path` (truncating it unless `append`), creating its parent directories.
  explicit metrics_writer(const std::string& path, bool append = false) : path_(path) {
    const std::filesystem::path p(path);
    std::error_code ec;
    if (p.has_parent_path()) {
      std::filesystem::create_directories(p.parent_path(), ec);
      if (ec)
        throw error("metrics_writer: cannot create directory '" + p.parent_path().string() +
                    "' for '" + path + "': " + ec.message());
    }
    out_.open(path, append ? std::ios::app : std::ios::trunc);
    if (!out_) throw error("metrics_writer: cannot open '" + path + "' for writing");
  }
  bool is_open() const { return out_.is_open(); }
  const std::string& path() const { return path_; }
  /// Writes `row` as one line and flushes it. Non-finite numbers become `null`; invalid UTF-8 in a
  /// string (text a model wrote, cut inside a character) becomes U+FFFD.
  void write(const nlohmann::json& row) {
    if (!out_.is_open()) return;
    out_ << row.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << '\n';
    out_.flush();
    if (!out_) throw error("metrics_writer: writing to '" + path_ + "' failed");
  }

 private:
  std::string path_{};
  std::ofstream out_{};
};

/// Reads a JSON-lines file (blank lines are skipped); a malformed line throws `unirl::error`
/// naming the file and the line number.
inline std::vector<nlohmann::json> read_metrics(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw error("read_metrics: cannot open '" + path + "'");
  std::vector<nlohmann::json> rows;
  std::string line;
  std::size_t n = 0;
  while (std::getline(in, line)) {
    ++n;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    try {
      rows.push_back(nlohmann::json::parse(line));
    } catch (const nlohmann::json::exception& e) {
      throw error("read_metrics: '" + path + "' line " + std::to_string(n) + " is not JSON: " + e.what());
    }
  }
  return rows;
}

/// Writes the first `count` samples of a text batch `b` (one with `prompts`, `completions` and
/// `references`) with their `rewards` as rows of `out`: step, sample, prompt, completion,
/// reference, reward (the run report's samples.jsonl). One read of those rewards.
template <class Batch>
void write_sample_rows(metrics_writer& out, std::int64_t step, const Batch& b, const torch::Tensor& rewards,
                       std::int64_t count) {
  const auto n = std::min<std::int64_t>(count, static_cast<std::int64_t>(b.completions.size()));
  const torch::Tensor r = rewards.detach().reshape({-1}).slice(0, 0, n).to(torch::kCPU, torch::kFloat64).contiguous();
  for (std::int64_t i = 0; i < n; ++i) {
    const auto k = static_cast<std::size_t>(i);
    out.write({{"step", step},
               {"sample", i},
               {"prompt", k < b.prompts.size() ? b.prompts[k] : std::string{}},
               {"completion", b.completions[k]},
               {"reference", k < b.references.size() ? b.references[k] : std::string{}},
               {"reward", r.data_ptr<double>()[i]}});
  }
}

namespace detail {
/// "12s", "3m05s", "1h02m".
inline std::string duration_text(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const auto s = static_cast<long long>(std::llround(seconds));
  char buf[32];
  if (s < 60) std::snprintf(buf, sizeof buf, "%llds", s);
  else if (s < 3600) std::snprintf(buf, sizeof buf, "%lldm%02llds", s / 60, s % 60);
  else std::snprintf(buf, sizeof buf, "%lldh%02lldm", s / 3600, (s % 3600) / 60);
  return buf;
}
inline bool stderr_is_terminal() {
#if defined(__unix__) || defined(__APPLE__)
  return ::isatty(STDERR_FILENO) == 1;
#else
  return false;
#endif
}
}  // namespace detail

/// A one-line progress display: step/total, reward mean, KL, loss, samples/s and the ETA from
/// the mean step time. On a terminal the line is redrawn in place with `\r`; otherwise a plain
/// line is printed every `max(1, total / 10)` steps (every 10 when the total is unknown) and at
/// the last step. `step_stats::step` is read as the 0-based index of the step just done.
/// Call `finish()` at the end so the terminal's prompt starts on a fresh line.
class progress_line {
 public:
  /// Draws on std::cerr; redraws in place when stderr is a terminal.
  progress_line(std::int64_t total_steps, bool enabled)
      : progress_line(total_steps, enabled, std::cerr, detail::stderr_is_terminal()) {}
  /// Draws on `os`; `terminal` chooses in-place redrawing over periodic plain lines.
  progress_line(std::int64_t total_steps, bool enabled, std::ostream& os, bool terminal)
      : total_(std::max<std::int64_t>(total_steps, 0)), enabled_(enabled), terminal_(terminal), os_(&os) {}

  /// Reports one finished step.
  void update(const unirl::step_stats& s) {
    ++seen_;
    if (std::isfinite(s.seconds) && s.seconds > 0) {
      seconds_ += s.seconds;
      ++timed_;
    }
    if (!enabled_) return;
    const std::int64_t done = s.step + 1;
    const std::string text = format(s, done);
    if (terminal_) {
      std::string padded = text;
      if (padded.size() < width_) padded.append(width_ - padded.size(), ' ');
      width_ = text.size();
      *os_ << '\r' << padded << std::flush;
      open_ = true;
    } else {
      const std::int64_t every = total_ > 0 ? std::max<std::int64_t>(1, total_ / 10) : 10;
      if (done % every == 0 || done == total_ || seen_ == 1) *os_ << text << '\n' << std::flush;
    }
  }

  /// Ends the redrawn line with a newline (idempotent).
  void finish() {
    if (open_) *os_ << '\n' << std::flush;
    open_ = false;
  }

  /// Mean seconds per step of the steps seen so far (0 before the first timed step).
  double mean_step_seconds() const { return timed_ ? seconds_ / static_cast<double>(timed_) : 0.0; }

  /// The text of one line (without `\r` or newline), as `update` prints it.
  std::string format(const unirl::step_stats& s, std::int64_t done) const {
    char buf[256];
    std::string line;
    if (total_ > 0) std::snprintf(buf, sizeof buf, "step %lld/%lld", static_cast<long long>(done), static_cast<long long>(total_));
    else std::snprintf(buf, sizeof buf, "step %lld", static_cast<long long>(done));
    line += buf;
    std::snprintf(buf, sizeof buf, "  reward %.4g  kl %.3g  loss %.4g  %.1f samples/s", s.reward_mean, s.kl,
                  s.loss, s.samples_per_second);
    line += buf;
    if (total_ > 0 && timed_ > 0) {
      const double eta = mean_step_seconds() * static_cast<double>(std::max<std::int64_t>(0, total_ - done));
      line += "  ETA " + detail::duration_text(eta);
    }
    if (s.skipped_total > 0) line += "  skipped " + std::to_string(s.skipped_total);
    return line;
  }

 private:
  std::int64_t total_ = 0;
  bool enabled_ = true, terminal_ = false, open_ = false;
  std::ostream* os_;
  std::size_t width_ = 0;
  std::int64_t seen_ = 0, timed_ = 0;
  double seconds_ = 0.0;
};

}  // namespace unirl::train

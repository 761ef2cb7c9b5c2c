#pragma once
/// \file run_directory.hpp
/// A run directory's checkpoints: `<dir>/checkpoints/step-NNNNNNNN.pt`, written atomically by
/// `train::write_checkpoint` (through the trainer's `save`), the latest *complete* one found on
/// resume, and only the last `keep` kept.
///
/// ```cpp
/// unirl::train::run_directory run("runs/exp1", {.keep = 2});
/// if (auto last = run.latest()) trainer.load(last->path.string());   // resume
/// for (auto s = trainer.step_count(); s < steps; ++s) {
///   trainer.step(prompts());
///   run.save(trainer.step_count(), [&](const std::string& p) { trainer.save(p); });
/// }
/// ```
///
/// "Complete" means `read_checkpoint` accepts the file: header, size and checksum match and the
/// archive opens. A newest checkpoint that fails this (truncated by a crash of a build without the
/// atomic rename, or a disk error) is skipped with a warning on `std::cerr`, and the one before it
/// is used. Leftover `step-*.pt.tmp` files (a process killed while saving) are never taken for a
/// checkpoint; `remove_temporaries()` deletes them.
#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <iomanip>
#include <iostream>
#include <iterator>
#include <optional>
#include <sstream>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include <boost/hana.hpp>

#include <unirl/core/error.hpp>
#include <unirl/core/options.hpp>
#include <unirl/train/checkpoint.hpp>

namespace unirl::train {

/// Settings of a `run_directory`.
struct run_directory_options {
  std::int64_t keep = 2;  // complete checkpoints kept after a save (older ones deleted); >= 1
  bool warn = true;       // print a warning on std::cerr for each checkpoint skipped on resume

  void validate(const std::string& p) const { options::require(keep >= 1, p + "keep", keep, ">= 1"); }
};

/// One checkpoint file of a run directory.
struct checkpoint_entry {
  std::int64_t step = 0;          // from the file name
  std::filesystem::path path{};   // <dir>/checkpoints/step-NNNNNNNN.pt
};

/// The checkpoints of one run directory (see the file comment).
class run_directory {
 public:
  /// `dir` is the run directory; its `checkpoints/` subdirectory is created on the first save.
  explicit run_directory(std::filesystem::path dir, run_directory_options o = {}) : dir_(std::move(dir)), o_(o) {
    o_.validate("run_directory.");
  }

  /// The file name of the checkpoint of `step`: `step-00000042.pt` (8 digits at least).
  static std::string step_name(std::int64_t step) {
    UNIRL_CHECK(step >= 0, "run_directory: step = ", step, ": expected >= 0");
    std::ostringstream os;
    os << "step-" << std::setw(8) << std::setfill('0') << step << ".pt";
    return os.str();
  }

  /// The step a checkpoint file name stands for, or nothing for any other name (`*.tmp` included).
  static std::optional<std::int64_t> parse_step(const std::string& file) {
    constexpr std::size_t prefix = 5, suffix = 3;  // "step-", ".pt"
    if (file.size() <= prefix + suffix || file.size() > prefix + suffix + 12) return std::nullopt;
    if (file.compare(0, prefix, "step-") != 0 || file.compare(file.size() - suffix, suffix, ".pt") != 0)
      return std::nullopt;
    std::int64_t v = 0;
    for (std::size_t i = prefix; i < file.size() - suffix; ++i) {
      if (file[i] < '0' || file[i] > '9') return std::nullopt;
      v = v * 10 + (file[i] - '0');
    }
    return v;
  }

  const std::filesystem::path& dir() const { return dir_; }
  std::filesystem::path checkpoint_dir() const { return dir_ / "checkpoints"; }
  std::filesystem::path path_for(std::int64_t step) const { return checkpoint_dir() / step_name(step); }
  const run_directory_options& settings() const { return o_; }

  /// Every file named like a checkpoint, oldest step first (complete or not: see `latest`).
  std::vector<checkpoint_entry> list() const {
    std::vector<checkpoint_entry> found;
    std::error_code ec;
    const auto cdir = checkpoint_dir();
    if (!std::filesystem::is_directory(cdir, ec)) return found;
    for (std::filesystem::directory_iterator it(cdir, ec), end; !ec && it != end; it.increment(ec)) {
      std::error_code fe;
      if (!it->is_regular_file(fe)) continue;
      if (const auto s = parse_step(it->path().filename().string())) found.push_back({*s, it->path()});
    }
    std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) { return a.step < b.step; });
    return found;
  }

  /// The newest checkpoint that `read_checkpoint` accepts, or nothing (a fresh run). Newer files
  /// that fail are skipped, each with a warning naming the file and why; they are left in place
  /// (the next `save` prunes them with the older ones).
  std::optional<checkpoint_entry> latest() const {
    const auto all = list();
    for (auto it = all.rbegin(); it != all.rend(); ++it) {
      try {
        read_checkpoint(it->path.string(), [](torch::serialize::InputArchive&) {});
        return *it;
      } catch (const checkpoint_error& e) {
        if (o_.warn)
          std::cerr << "unirl: warning: skipping incomplete checkpoint " << it->path.filename().string() << " ("
                    << e.what() << ")" << (std::next(it) != all.rend() ? "; falling back to the one before it" : "")
                    << "\n";
      }
    }
    return std::nullopt;
  }

  /// Saves the checkpoint of `step`: `write(path)` must write it atomically (the trainer's `save`
  /// does); then every checkpoint file of a step up to `step` but the newest `keep` of them is
  /// deleted (files of later steps, from an abandoned branch of the run, are left). Returns the
  /// path written.
  std::filesystem::path save(std::int64_t step, const std::function<void(const std::string&)>& write) const {
    const auto path = path_for(step);
    std::error_code ec;
    std::filesystem::create_directories(checkpoint_dir(), ec);
    if (ec)
      throw checkpoint_error("run_directory: cannot create '" + checkpoint_dir().string() + "': " + ec.message());
    write(path.string());
    prune(step);
    return path;
  }

  /// Deletes leftover `step-*.pt.tmp` files (a save interrupted before its rename); returns how
  /// many. Call it when no other process writes to this run directory.
  std::int64_t remove_temporaries() const {
    std::int64_t n = 0;
    std::error_code ec;
    const auto cdir = checkpoint_dir();
    if (!std::filesystem::is_directory(cdir, ec)) return 0;
    std::vector<std::filesystem::path> tmp;
    for (std::filesystem::directory_iterator it(cdir, ec), end; !ec && it != end; it.increment(ec)) {
      const auto f = it->path().filename().string();
      if (f.size() > 4 && f.compare(f.size() - 4, 4, ".tmp") == 0 && parse_step(f.substr(0, f.size() - 4)))
        tmp.push_back(it->path());
    }
    for (const auto& p : tmp) n += std::filesystem::remove(p, ec) ? 1 : 0;
    return n;
  }

 private:
  // Keeps the `keep` newest checkpoints up to `newest` (the one just written), deletes older ones.
  void prune(std::int64_t newest) const {
    auto all = list();
    std::vector<checkpoint_entry> upto;
    for (auto& e : all)
      if (e.step <= newest) upto.push_back(e);
    const auto keep = static_cast<std::size_t>(o_.keep);
    if (upto.size() <= keep) return;
    std::error_code ec;
    for (std::size_t i = 0; i + keep < upto.size(); ++i) std::filesystem::remove(upto[i].path, ec);
  }

  std::filesystem::path dir_;
  run_directory_options o_;
};

}  // namespace unirl::train

BOOST_HANA_ADAPT_STRUCT(unirl::train::run_directory_options, keep, warn);

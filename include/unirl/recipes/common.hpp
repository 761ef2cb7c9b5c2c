#pragma once
/// \file common.hpp
/// What every recipe program shares (`token_recipe.hpp`, `flow_recipe.hpp`): the checkpoint
/// options of a run directory, the device and directory checks of pre-flight, and the metrics
/// rows a resumed run keeps.
///
/// ```cpp
/// unirl::recipes::detail::checked_device("cuda:3");             // config_error naming `device`
/// unirl::recipes::detail::check_writable("runs/x/checkpoints", "out");
/// auto kept = unirl::recipes::detail::truncate_metrics("runs/x/metrics.jsonl", 4);  // rows 0 .. 3
/// ```
#include <array>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include <boost/hana.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <unirl/core/error.hpp>
#include <unirl/core/options.hpp>

namespace unirl::recipes {

/// Checkpoints of a run directory.
struct checkpoint_recipe {
  std::int64_t every = 0;
  std::int64_t keep = 2;
  bool resume = true;

  void validate(const std::string& p) const {
    options::require(every >= 0, p + "every", every, ">= 0");
    options::require(keep >= 1, p + "keep", keep, ">= 1");
  }
};

}  // namespace unirl::recipes

BOOST_HANA_ADAPT_STRUCT(unirl::recipes::checkpoint_recipe, every, keep, resume);

template <>
inline constexpr std::array unirl::options::field_docs<unirl::recipes::checkpoint_recipe>{
    unirl::options::field_doc{"every", "steps between checkpoints; 0 = only at the end (and on SIGINT / SIGTERM)"},
    unirl::options::field_doc{"keep", "complete checkpoints kept (older ones are deleted)"},
    unirl::options::field_doc{"resume", "continue from the latest complete checkpoint of `out` when there is one"}};

namespace unirl::recipes::detail {

/// The `summary.json` an earlier invocation wrote in the run directory `out`, which a resumed
/// run continues (its counts are cumulative): `{}` when there is none, or when a kill left it
/// damaged or not an object (counted afresh then).
inline nlohmann::json previous_summary(const std::filesystem::path& out) {
  nlohmann::json previous = nlohmann::json::object();
  if (!std::filesystem::exists(out / "summary.json")) return previous;
  try {
    std::ifstream in(out / "summary.json");
    previous = nlohmann::json::parse(in);
  } catch (const std::exception&) {
    return nlohmann::json::object();
  }
  return previous.is_object() ? previous : nlohmann::json::object();
}

/// The device a recipe names, checked: a name LibTorch parses, CUDA only where this LibTorch has
/// it and the GPU exists; otherwise a `config_error` naming `device` and what is available.
inline torch::Device checked_device(const std::string& d) {
  const std::string cuda_note = torch::cuda::is_available()
                                    ? "cpu, cuda, cuda:0 .. cuda:" + std::to_string(torch::cuda::device_count() - 1)
                                    : "cpu (this LibTorch sees no CUDA device)";
  torch::Device dev(torch::kCPU);
  try {
    dev = torch::Device(d);
  } catch (const std::exception&) {
    throw config_error("device", "\"" + d + "\" is not a device name: expected cpu, cuda or cuda:N; available: " + cuda_note);
  }
  if (dev.is_cuda()) {
    if (!torch::cuda::is_available())
      throw config_error("device", "\"" + d + "\": this LibTorch has no usable CUDA (built without it, or no GPU "
                                   "visible); available: " + cuda_note);
    if (dev.has_index() && dev.index() >= static_cast<int>(torch::cuda::device_count()))
      throw config_error("device", "\"" + d + "\": no such GPU; available: " + cuda_note);
  } else if (!dev.is_cpu()) {
    throw config_error("device", "\"" + d + "\": a recipe runs on cpu or cuda; available: " + cuda_note);
  }
  return dev;
}

/// Creates `dir` and writes a file in it: an unwritable directory is found before any work.
inline void check_writable(const std::filesystem::path& dir, const char* key) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  const auto probe = dir / ".unirl-write-check";
  bool ok = !ec && std::filesystem::is_directory(dir);
  if (ok) {
    std::ofstream f(probe);
    f << "ok\n";
    ok = static_cast<bool>(f);
  }
  std::error_code ignored;
  std::filesystem::remove(probe, ignored);
  if (!ok)
    throw config_error(key, "'" + dir.string() + "' cannot be created or written" + (ec ? ": " + ec.message() : std::string()));
}

/// Keeps the rows of a metrics file whose "step" is below `step` — the steps a resumed run keeps;
/// the rest (steps after the checkpoint, a line torn by kill -9) go. Returns the kept rows.
inline std::vector<nlohmann::json> truncate_metrics(const std::filesystem::path& path, std::int64_t step) {
  std::vector<nlohmann::json> kept;
  if (!std::filesystem::exists(path)) return kept;
  std::string text;
  {
    std::ifstream in(path);
    std::string line;
    while (std::getline(in, line)) {
      if (line.empty()) continue;
      nlohmann::json row;
      try {
        row = nlohmann::json::parse(line);
      } catch (const std::exception&) {
        break;  // torn by a kill: nothing after it was written whole
      }
      if (!row.is_object() || !row.contains("step") || !row["step"].is_number_integer() ||
          row["step"].get<std::int64_t>() >= step)
        continue;
      text += line + "\n";
      kept.push_back(std::move(row));
    }
  }
  const auto tmp = path.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << text;
    UNIRL_CHECK(static_cast<bool>(out), "recipe: cannot rewrite ", path.string());
  }
  std::filesystem::rename(tmp, path);
  return kept;
}

}  // namespace unirl::recipes::detail

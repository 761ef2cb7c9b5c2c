#pragma once
// Test helpers for file fixtures: a temporary directory removed with its contents, a copy of a
// fixture directory, and an in-place edit of its config.json.
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <system_error>

#include <nlohmann/json.hpp>

namespace unirl_test {

/// A fresh directory under the system's temporary directory, removed with its contents.
struct temp_dir {
  std::filesystem::path path;
  temp_dir() {
    std::mt19937_64 rng(std::random_device{}());
    path = std::filesystem::temp_directory_path() / ("unirl_test_" + std::to_string(rng()));
    std::filesystem::create_directories(path);
  }
  temp_dir(const temp_dir&) = delete;
  temp_dir& operator=(const temp_dir&) = delete;
  ~temp_dir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
};

/// Copies the files of directory `from` into `to` (created).
inline void copy_dir(const std::filesystem::path& from, const std::filesystem::path& to) {
  std::filesystem::create_directories(to);
  for (const auto& e : std::filesystem::directory_iterator(from))
    std::filesystem::copy_file(e.path(), to / e.path().filename());
}

/// Rewrites `dir`/config.json after `edit` changed it.
inline void edit_config(const std::filesystem::path& dir, const std::function<void(nlohmann::json&)>& edit) {
  nlohmann::json j;
  std::ifstream(dir / "config.json") >> j;
  edit(j);
  std::ofstream(dir / "config.json") << j.dump(2);
}

}  // namespace unirl_test

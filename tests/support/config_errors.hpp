#pragma once
// Test helpers: the key and message of the unirl::config_error a construction throws, and the
// message of any exception a call throws.
#include <exception>
#include <functional>
#include <string>
#include <utility>

#include <unirl/core/error.hpp>

namespace unirl_test {

/// Runs `build`; returns the `config_error`'s key and message, or {"(nothing thrown)", ""}.
template <class Build>
std::pair<std::string, std::string> config_error_of(Build&& build) {
  try {
    build();
  } catch (const unirl::config_error& e) {
    return {e.key(), e.what()};
  }
  return {"(nothing thrown)", ""};
}

/// Runs `f`; returns the `what()` of the std::exception it throws, or "" when it throws none.
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

}  // namespace unirl_test

#pragma once
// Test helper: the key and message of the unirl::config_error a construction throws.
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

}  // namespace unirl_test

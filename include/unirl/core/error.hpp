#pragma once
/// \file error.hpp
/// The library's exception types and the `UNIRL_CHECK` macro for validating user input.
///
/// Errors thrown for user input name the offending value and what was expected:
/// ```cpp
/// UNIRL_CHECK(group_size >= 2, "group_size = ", group_size, ": expected >= 2 for GRPO");
/// ```
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace unirl {

/// Base class of every exception unirl throws.
struct error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// A bad option value, an unknown option key or a malformed recipe; `key()` is the dotted path.
struct config_error : error {
  config_error(std::string key, const std::string& what)
      : error("option '" + key + "': " + what), key_(std::move(key)) {}
  const std::string& key() const noexcept { return key_; }

 private:
  std::string key_;
};

/// A checkpoint that cannot be read back: missing, truncated, corrupted or of another layout.
struct checkpoint_error : error {
  using error::error;
};

/// Training could not go on (e.g. a remote reward service failed after its retries).
struct runtime_failure : error {
  using error::error;
};

namespace detail {
template <class... Args>
std::string concat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}
}  // namespace detail
}  // namespace unirl

/// Throws `unirl::error` with the streamed message when `cond` is false.
#define UNIRL_CHECK(cond, ...)                                                        \
  do {                                                                                \
    if (!(cond)) throw ::unirl::error(::unirl::detail::concat("unirl: ", __VA_ARGS__)); \
  } while (false)

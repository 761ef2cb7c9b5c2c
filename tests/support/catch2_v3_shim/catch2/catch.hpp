#pragma once
// Catch2 v2's single header, mapped onto Catch2 v3 (Debian 13 ships only v3). tests/CMakeLists.txt
// puts this directory on the include path only when it finds v3, so the tests keep writing
// `#include <catch2/catch.hpp>` and the v2 names they use, and build against either version.
// Main comes from Catch2::Catch2WithMain, so CATCH_CONFIG_MAIN is not needed (and is ignored).
#include <concepts>
#include <string>
#include <type_traits>

#include <catch2/catch_all.hpp>

// v2 declared Approx in the global namespace.
using Catch::Approx;

namespace Catch {
namespace Matchers {
// v2's `Contains(string)` matched a substring; v3 calls that ContainsSubstring and keeps
// `Contains` for range elements. For an argument that converts to std::string, this overload
// is more constrained than v3's (otherwise identical) `Contains(T&&)`, so it wins.
template <class S>
  requires(std::convertible_to<S &&, std::string> && !Detail::is_matcher<std::remove_cvref_t<S>>::value)
StringContainsMatcher Contains(S&& str) {
  return ContainsSubstring(std::string(std::forward<S>(str)));
}
}  // namespace Matchers
// v2 also had the string matchers directly in namespace Catch.
using Matchers::Contains;
using Matchers::EndsWith;
using Matchers::Equals;
using Matchers::Matches;
using Matchers::StartsWith;
}  // namespace Catch

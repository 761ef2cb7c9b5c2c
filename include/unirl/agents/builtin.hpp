#pragma once
/// \file builtin.hpp
/// The tools and text environments the library ships, and the registries that name them — what
/// a recipe chooses by name (`unirl-train`'s `tools:` and `environment.name`, docs/agents.md):
/// - tools: `calculator` (integer expressions with + - *);
/// - environments: `arithmetic` ("What is A*B?", A of 3 digits, B of 2; 1 for the right final answer).
/// Another built-in is one line in `builtin_tools` or `builtin_environments` (and its include).
/// Torch-free.
///
/// ```cpp
/// auto tools = unirl::agents::make_builtin_toolbox({.timeout_seconds = 1.0});
/// tools.select({"calculator"});                                   // unknown names: a config_error listing the known
/// unirl::agents::with_builtin_environment("arithmetic", [&](auto env) { run(env, tools); });
/// ```
#include <algorithm>
#include <cstdint>
#include <random>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include <boost/hana.hpp>
#include <nlohmann/json.hpp>

#include <unirl/agents/toolbox.hpp>
#include <unirl/concepts/text_agent.hpp>
#include <unirl/core/error.hpp>
#include <unirl/envs/guess_number.hpp>

namespace unirl::agents {

/// The value of an integer expression with + - * (multiplication first), e.g. "347*58+1".
/// Untrusted text: anything else, an operand of more than 12 digits or a result beyond 1e18 is a
/// `std::invalid_argument` naming the position.
inline std::int64_t evaluate_expression(const std::string& e) {
  std::size_t i = 0;
  auto number = [&] {
    const auto start = i;
    std::int64_t v = 0;
    while (i < e.size() && e[i] >= '0' && e[i] <= '9' && i - start < 12) v = v * 10 + (e[i++] - '0');
    if (i == start) throw std::invalid_argument("expected a number at position " + std::to_string(i) + " of '" + e + "'");
    if (i < e.size() && e[i] >= '0' && e[i] <= '9') throw std::invalid_argument("a number of more than 12 digits");
    return v;
  };
  auto term = [&] {
    std::int64_t v = number();
    while (i < e.size() && e[i] == '*') {
      ++i;
      const auto w = number();
      if (w != 0 && (v < 0 ? -v : v) > 1'000'000'000'000'000 / w) throw std::invalid_argument("the result is too large");
      v *= w;
    }
    return v;
  };
  std::int64_t v = term();
  while (i < e.size() && (e[i] == '+' || e[i] == '-')) {
    const char op = e[i++];
    v = op == '+' ? v + term() : v - term();
  }
  if (i != e.size()) throw std::invalid_argument("unexpected '" + std::string(1, e[i]) + "' at position " + std::to_string(i));
  return v;
}

/// A calculator tool: `{"expression": "347*58"}` -> "20126" (`evaluate_expression`).
struct calculator {
  std::string name() const { return "calculator"; }
  std::string description() const { return "Evaluates an integer expression with + - *."; }
  nlohmann::json parameters() const {
    return {{"type", "object"},
            {"properties", {{"expression", {{"type", "string"}, {"maxLength", 32}}}}},
            {"required", {"expression"}},
            {"additionalProperties", false}};
  }
  std::string call(const nlohmann::json& args) const {
    return std::to_string(evaluate_expression(args["expression"].get<std::string>()));
  }
};
static_assert(Tool<calculator>);

/// "What is A*B?" with A of 3 digits and B of 2, drawn from the seed; one turn: the final answer
/// (the turn's text, trailing spaces and newlines dropped) scores 1 when it is the product.
struct arithmetic_env {
  std::string expression;
  std::int64_t answer = 0;
  text_observation reset(std::uint64_t seed) {
    std::mt19937_64 g(seed);
    const auto a = std::uniform_int_distribution<std::int64_t>(100, 999)(g);
    const auto b = std::uniform_int_distribution<std::int64_t>(10, 99)(g);
    expression = std::to_string(a) + "*" + std::to_string(b);
    answer = a * b;
    return {.text = "What is " + expression + "?"};
  }
  text_step step(const std::string& text) {
    auto t = text;
    while (!t.empty() && (t.back() == '\n' || t.back() == ' ')) t.pop_back();
    return {.reward = t == std::to_string(answer) ? 1.0 : 0.0, .done = true};
  }
};
static_assert(TextEnvironment<arithmetic_env>);

/// A built-in of type `T` under its name (an entry of `builtin_tools` / `builtin_environments`).
template <class T>
struct builtin {
  using type = T;
  std::string_view name;
  std::string_view description;
};

/// The built-in tools (`tools:` of a recipe). One line each.
inline constexpr auto builtin_tools = boost::hana::make_tuple(
    builtin<calculator>{"calculator", "integer expressions with + - * (\"347*58\")"});

/// The built-in text environments (`environment.name` of a recipe). One line each.
inline constexpr auto builtin_environments = boost::hana::make_tuple(
    builtin<arithmetic_env>{"arithmetic", "\"What is A*B?\" (3 x 2 digits); 1 for the right final answer"},
    builtin<envs::guess_number>{"guess_number", "guess a number in 1..100 from higher / lower replies; 1 for a right guess"});

namespace detail {
template <class... T>
toolbox<T...> toolbox_of(const boost::hana::tuple<builtin<T>...>&);
template <class Registry>
std::vector<std::string> names_of(const Registry& r) {
  std::vector<std::string> out;
  boost::hana::for_each(r, [&](const auto& b) { out.emplace_back(b.name); });
  return out;
}
inline std::string listed(const std::vector<std::string>& names) {
  std::string s;
  for (const auto& n : names) s += (s.empty() ? "" : ", ") + n;
  return s;
}
}  // namespace detail

/// A toolbox of every built-in tool (`select` keeps the ones a recipe names).
using builtin_toolbox = decltype(detail::toolbox_of(builtin_tools));

/// The names of the built-in tools and environments.
inline std::vector<std::string> builtin_tool_names() { return detail::names_of(builtin_tools); }
inline std::vector<std::string> builtin_environment_names() { return detail::names_of(builtin_environments); }

/// Checks `names` against the built-in tools: an unknown or repeated one is a `config_error` on
/// `key` naming it and listing the known ones.
inline void check_builtin_tools(const std::vector<std::string>& names, const std::string& key = "tools") {
  const auto known = builtin_tool_names();
  for (std::size_t i = 0; i < names.size(); ++i) {
    if (std::find(known.begin(), known.end(), names[i]) == known.end())
      throw config_error(key, "unknown tool '" + names[i] + "'; the built-in tools are " + detail::listed(known));
    for (std::size_t j = 0; j < i; ++j)
      if (names[j] == names[i]) throw config_error(key, "the tool '" + names[i] + "' is listed twice");
  }
}
/// Checks `name` against the built-in environments (a `config_error` on `key` listing them).
inline void check_builtin_environment(const std::string& name, const std::string& key = "environment.name") {
  const auto known = builtin_environment_names();
  if (std::find(known.begin(), known.end(), name) == known.end())
    throw config_error(key, "unknown environment '" + name + "'; the built-in environments are " + detail::listed(known));
}

/// A toolbox of every built-in tool, all selected.
inline builtin_toolbox make_builtin_toolbox(const toolbox_options& o = {}) {
  return boost::hana::unpack(builtin_tools, [&](const auto&... b) {
    return builtin_toolbox{o, typename std::remove_cvref_t<decltype(b)>::type{}...};
  });
}

/// Calls `f` with a default-constructed built-in environment named `name` (checked first).
template <class F>
void with_builtin_environment(const std::string& name, F&& f) {
  check_builtin_environment(name);
  boost::hana::for_each(builtin_environments, [&](const auto& b) {
    if (b.name == name) f(typename std::remove_cvref_t<decltype(b)>::type{});
  });
}

}  // namespace unirl::agents

#pragma once
/// \file text_agent.hpp
/// Multi-turn language agents (agents/): a text environment a policy acts in over several turns,
/// and a tool it calls by writing a tool call. Tools compose at compile time into an
/// `agents::toolbox` the way scorers compose into `rewards::weighted`.
///
/// ```cpp
/// struct calculator {                                       // a Tool
///   std::string name() const { return "calculator"; }
///   std::string description() const { return "Evaluates an arithmetic expression."; }
///   nlohmann::json parameters() const {                     // a JSON schema of the arguments
///     return {{"type", "object"}, {"properties", {{"expression", {{"type", "string"}}}}},
///             {"required", {"expression"}}};
///   }
///   std::string call(const nlohmann::json& args) const;     // result text; may throw
/// };
/// static_assert(unirl::Tool<calculator>);
/// ```
#include <concepts>
#include <cstdint>
#include <stop_token>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace unirl {

/// What a text environment shows the policy: text (tokenized once by the rollout, in the chat
/// format's user turn) or token ids (appended as they are, `tokens` non-empty wins).
struct text_observation {
  std::string text{};
  std::vector<std::int64_t> tokens{};
};

/// What `step` returns: the next observation (ignored when `done`), the turn's reward, and
/// whether the episode ended.
struct text_step {
  text_observation observation{};
  double reward = 0.0;
  bool done = false;
};

/// An environment a language policy acts in over several turns.
///
/// Minimal complete definition:
/// - `text_observation reset(std::uint64_t seed)` — a new episode (a task drawn from `seed`);
///   the first observation becomes the user's first message;
/// - `text_step step(const std::string& action)` — the policy's turn as text (what it wrote,
///   decoded; its tokens stay in the trajectory as sampled), giving the reply, the turn's reward
///   and whether the episode ended. The text is untrusted: anything a model wrote is a valid
///   argument, never an exception for bad content.
/// Copyable: the rollout keeps one copy per episode in flight.
template <class E>
concept TextEnvironment = std::copy_constructible<E> && requires(E& e, std::uint64_t seed, const std::string& a) {
  { e.reset(seed) } -> std::convertible_to<text_observation>;
  { e.step(a) } -> std::convertible_to<text_step>;
};

/// A tool a language policy calls with JSON arguments.
///
/// Minimal complete definition:
/// - `std::string name() const` — what the model writes in `"name"`;
/// - `std::string description() const` — shown to the model with the schema;
/// - `nlohmann::json parameters() const` — a JSON schema (an object schema) of the arguments;
///   the toolbox checks every call against it before calling;
/// - `std::string call(const nlohmann::json& arguments) const` — the result text. It may throw
///   (the policy gets an error reply) and runs on the toolbox's worker threads, concurrently
///   with other calls: it must be safe to call from several threads.
/// Optional: `std::string call(const nlohmann::json&, std::stop_token) const` — preferred when
/// present; the token is stopped when the call's time limit passes, so a long call can end early.
template <class T>
concept Tool = std::move_constructible<T> && requires(const T& t, const nlohmann::json& args) {
  { t.name() } -> std::convertible_to<std::string>;
  { t.description() } -> std::convertible_to<std::string>;
  { t.parameters() } -> std::convertible_to<nlohmann::json>;
  { t.call(args) } -> std::convertible_to<std::string>;
};

/// A `Tool` whose call can be asked to stop (`call(arguments, std::stop_token)`).
template <class T>
concept StoppableTool = Tool<T> && requires(const T& t, const nlohmann::json& args, std::stop_token st) {
  { t.call(args, st) } -> std::convertible_to<std::string>;
};

}  // namespace unirl

#pragma once
/// \file guess_number.hpp
/// A multi-turn text game (a `TextEnvironment`): the environment thinks of a number in
/// [low, high], drawn from the seed alone; each turn the policy writes a guess and the
/// environment answers "Higher." or "Lower." until the guess is right (reward 1, done) or
/// `max_guesses` are spent (reward 0, done). Binary search always wins within
/// ceil(log2(high - low + 2)) guesses.
///
/// ```cpp
/// unirl::envs::guess_number env{{.low = 1, .high = 100, .max_guesses = 7}};
/// auto first = env.reset(42);          // "I am thinking of a number from 1 to 100. ..."
/// auto turn = env.step("50");          // {"Lower.", 0.0, false}, or "Higher.", or "Correct!" (1.0, done)
/// ```
/// The policy's text is untrusted: the guess is its first integer (an optional '-' and at most
/// 18 digits); text without one, or a number outside the range, costs a guess and gets a reply
/// saying what was expected. Everything the game writes is ASCII.
#include <cstdint>
#include <string>
#include <string_view>

#include <boost/hana.hpp>

#include <unirl/concepts/text_agent.hpp>
#include <unirl/core/error.hpp>
#include <unirl/core/options.hpp>

namespace unirl::envs {

/// The game's range and its number of guesses.
struct guess_number_options {
  std::int64_t low = 1;
  std::int64_t high = 100;
  std::int64_t max_guesses = 7;

  void validate(const std::string& p) const {
    options::require(low > -(std::int64_t{1} << 53) && low < (std::int64_t{1} << 53), p + "low", low, "in (-2^53, 2^53)");
    options::require(high >= low && high < (std::int64_t{1} << 53), p + "high", high, ">= low and < 2^53");
    options::require(max_guesses >= 1 && max_guesses <= 1000, p + "max_guesses", max_guesses, "in [1, 1000]");
  }
};
}  // namespace unirl::envs
BOOST_HANA_ADAPT_STRUCT(unirl::envs::guess_number_options, low, high, max_guesses);
namespace unirl::envs {

/// Guess the number from higher / lower replies (see the file comment).
class guess_number {
 public:
  using options = guess_number_options;

  guess_number() : guess_number(options{}) {}
  explicit guess_number(options o) : o_(o) { unirl::options::validate(o_); }

  /// A new game: the number is a function of `seed` (SplitMix64, the same on every platform).
  text_observation reset(std::uint64_t seed) {
    const auto span = static_cast<std::uint64_t>(o_.high - o_.low) + 1;
    target_ = o_.low + static_cast<std::int64_t>(mix(seed) % span);
    guesses_ = 0;
    done_ = false;
    return {.text = "I am thinking of a number from " + std::to_string(o_.low) + " to " + std::to_string(o_.high) +
                    ". Guess it: reply with one number. You have " + std::to_string(o_.max_guesses) + " guesses."};
  }

  /// One guess. Throws only for a step before `reset` or after the game ended.
  text_step step(const std::string& action) {
    UNIRL_CHECK(target_ != unset, "guess_number::step before reset");
    UNIRL_CHECK(!done_, "guess_number::step after the game ended (", guesses_, " guesses); reset it");
    ++guesses_;
    const auto left = o_.max_guesses - guesses_;
    auto reply = [&](std::string text, double reward, bool done) {
      done_ = done;
      return text_step{.observation = {.text = std::move(text)}, .reward = reward, .done = done};
    };
    std::int64_t g = 0;
    if (!first_integer(action, g) || g < o_.low || g > o_.high) {
      if (left == 0) return reply("No guesses left; the number was " + std::to_string(target_) + ".", 0.0, true);
      return reply("That is not a number from " + std::to_string(o_.low) + " to " + std::to_string(o_.high) +
                       ". Reply with one number. " + std::to_string(left) + " guesses left.",
                   0.0, false);
    }
    if (g == target_) return reply("Correct!", 1.0, true);
    if (left == 0) return reply("No guesses left; the number was " + std::to_string(target_) + ".", 0.0, true);
    return reply(std::string(g < target_ ? "Higher." : "Lower.") + " " + std::to_string(left) + " guesses left.", 0.0,
                 false);
  }

  /// The number of this game (for tests and scripted players).
  std::int64_t target() const { return target_; }
  std::int64_t guesses() const { return guesses_; }
  bool done() const { return done_; }
  const options& opts() const { return o_; }

  /// The first integer in `text` (an optional '-' right before at most 18 digits); false when
  /// there is none or its run of digits is longer.
  static bool first_integer(std::string_view text, std::int64_t& out) {
    for (std::size_t i = 0; i < text.size(); ++i) {
      if (text[i] < '0' || text[i] > '9') continue;
      std::size_t j = i;
      while (j < text.size() && text[j] >= '0' && text[j] <= '9') ++j;
      if (j - i > 18) return false;
      std::int64_t v = 0;
      for (std::size_t k = i; k < j; ++k) v = v * 10 + (text[k] - '0');
      out = i > 0 && text[i - 1] == '-' ? -v : v;
      return true;
    }
    return false;
  }

 private:
  static std::uint64_t mix(std::uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
  }
  static constexpr std::int64_t unset = INT64_MIN;
  options o_;
  std::int64_t target_ = unset, guesses_ = 0;
  bool done_ = false;
};
static_assert(TextEnvironment<guess_number>);

}  // namespace unirl::envs

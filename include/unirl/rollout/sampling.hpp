#pragma once
/// \file sampling.hpp
/// Options of autoregressive token sampling, shared by every algorithm that trains on the token
/// track (PPO, GRPO). Light: no model or sampler code here.
///
/// ```cpp
/// unirl::sampling_options s{.max_new_tokens = 8, .temperature = 1.0, .top_k = 0, .top_p = 1.0};
/// ```
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <boost/hana.hpp>

#include <unirl/core/options.hpp>

namespace unirl {

/// How completions are drawn: at most `max_new_tokens` tokens, stopping a sequence at any of
/// `stop_tokens` (kept in the completion), from the logits divided by `temperature`, restricted
/// to the `top_k` most likely tokens (0 = all) and the smallest set whose probability reaches
/// `top_p` (1 = all). The recorded log-probabilities are those of the temperature-scaled
/// distribution before top-k / top-p truncation: the distribution the loss evaluates.
/// `temperature = 0` is greedy: exactly `top_k = 1` at temperature 1 (draw and log-probs).
/// `engine` (the default) draws through the rollout engine (rollout/engine.hpp: continuous
/// batching over a paged KV cache, one random stream per sample) when the model is a
/// `PagedCausalLM` (the built-in GPT and the Hugging Face decoders are); `false`, or a model that
/// is not one (chosen at compile time), draws the static batch of `sample_tokens`.
struct sampling_options {
  std::int64_t max_new_tokens = 16;
  double temperature = 1.0;
  std::int64_t top_k = 0;
  double top_p = 1.0;
  std::vector<std::int64_t> stop_tokens{};
  bool engine = true;

  void validate(const std::string& prefix) const {
    options::require(max_new_tokens >= 1, prefix + "max_new_tokens", max_new_tokens, ">= 1");
    // A tiny positive temperature overflows the scaled logits to infinities and the distribution
    // to NaN mid-run (found by fuzz_engine_request: 1e-300 was accepted); below 1e-6 a draw is
    // greedy anyway, and 0 says so.
    options::require(temperature == 0.0 || (temperature >= 1e-6 && std::isfinite(temperature)), prefix + "temperature",
                     temperature, "0 (greedy) or in [1e-6, inf)");
    options::require(top_k >= 0, prefix + "top_k", top_k, ">= 0 (0 = no top-k)");
    options::require(top_p > 0.0 && top_p <= 1.0, prefix + "top_p", top_p, "in (0, 1]");
  }
};

}  // namespace unirl

BOOST_HANA_ADAPT_STRUCT(unirl::sampling_options, max_new_tokens, temperature, top_k, top_p, stop_tokens,
                        engine);
template <>
inline constexpr std::array unirl::options::field_docs<unirl::sampling_options>{
    unirl::options::field_doc{"max_new_tokens", "tokens generated per completion at most"},
    unirl::options::field_doc{"temperature", "the logits are divided by it; 0 = greedy (the same as top_k = 1)"},
    unirl::options::field_doc{"top_k", "sample among the k most likely tokens; 0 = all"},
    unirl::options::field_doc{"top_p", "sample among the smallest set of tokens whose probability reaches p; 1 = all"},
    unirl::options::field_doc{"stop_tokens", "token ids that end a completion (kept in it)"},
    unirl::options::field_doc{"engine", "sample through the rollout engine (continuous batching, paged KV cache) when the model is a PagedCausalLM; false = the static batch of sample_tokens"}};

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
struct sampling_options {
  std::int64_t max_new_tokens = 16;
  double temperature = 1.0;
  std::int64_t top_k = 0;
  double top_p = 1.0;
  std::vector<std::int64_t> stop_tokens{};

  void validate(const std::string& prefix) const {
    options::require(max_new_tokens >= 1, prefix + "max_new_tokens", max_new_tokens, ">= 1");
    options::require(temperature >= 0.0 && std::isfinite(temperature), prefix + "temperature", temperature,
                     ">= 0 (0 = greedy)");
    options::require(top_k >= 0, prefix + "top_k", top_k, ">= 0 (0 = no top-k)");
    options::require(top_p > 0.0 && top_p <= 1.0, prefix + "top_p", top_p, "in (0, 1]");
  }
};

}  // namespace unirl

BOOST_HANA_ADAPT_STRUCT(unirl::sampling_options, max_new_tokens, temperature, top_k, top_p, stop_tokens);
template <>
inline constexpr std::array unirl::options::field_docs<unirl::sampling_options>{
    unirl::options::field_doc{"max_new_tokens", "tokens generated per completion at most"},
    unirl::options::field_doc{"temperature", "the logits are divided by it; 0 = greedy (the same as top_k = 1)"},
    unirl::options::field_doc{"top_k", "sample among the k most likely tokens; 0 = all"},
    unirl::options::field_doc{"top_p", "sample among the smallest set of tokens whose probability reaches p; 1 = all"},
    unirl::options::field_doc{"stop_tokens", "token ids that end a completion (kept in it)"}};

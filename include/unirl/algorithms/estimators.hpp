#pragma once
/// \file estimators.hpp
/// Outcome-level advantage estimators as policy types (`GroupAdvantageEstimator`), for
/// algorithms that take the estimator as a template argument or an option.
///
/// ```cpp
/// unirl::algo::group_normalized est{};            // GRPO
/// auto a = est(rewards, /*group_size=*/8);         // (B*G,) advantages
/// static_assert(unirl::GroupAdvantageEstimator<unirl::algo::rloo>);
/// ```
#include <cstdint>

#include <torch/torch.h>

#include <unirl/algorithms/advantage.hpp>
#include <unirl/concepts/algorithm.hpp>

namespace unirl::algo {

/// GRPO: `(r - mean_g) / (std_g + eps)`; exactly 0 for constant groups.
struct group_normalized {
  group_advantage_options options{};
  torch::Tensor operator()(const torch::Tensor& rewards, std::int64_t group_size) const {
    return group_advantage(rewards, group_size, options);
  }
};
static_assert(GroupAdvantageEstimator<group_normalized>);

/// Dr.GRPO: `r - mean_g`, no division by the std.
struct dr_grpo {
  torch::Tensor operator()(const torch::Tensor& rewards, std::int64_t group_size) const {
    return group_advantage(rewards, group_size, {.scale_by_std = false});
  }
};
static_assert(GroupAdvantageEstimator<dr_grpo>);

/// RLOO: `r_i - mean_{j != i} r_j`.
struct rloo {
  torch::Tensor operator()(const torch::Tensor& rewards, std::int64_t group_size) const {
    return rloo_advantage(rewards, group_size);
  }
};
static_assert(GroupAdvantageEstimator<rloo>);

}  // namespace unirl::algo

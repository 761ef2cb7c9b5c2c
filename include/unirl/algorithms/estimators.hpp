#pragma once
/// \file estimators.hpp
/// Outcome-level advantage estimators as policy types (`GroupAdvantageEstimator`): the one
/// implementation of each, which GRPO's `advantage` option selects at run time
/// (`advantage_kind::group` -> `group_normalized`, `dr_grpo` -> `dr_grpo`, `rloo` -> `rloo`).
///
/// ```cpp
/// unirl::algo::group_normalized est{};                                   // GRPO
/// auto a = est(rewards, /*group_size=*/8);                               // (B*G,) advantages
/// auto r = unirl::algo::estimate<unirl::exec::reference>(unirl::algo::rloo{}, rewards, 8);
/// static_assert(unirl::GroupAdvantageEstimator<unirl::algo::rloo>);
/// ```
#include <cstdint>

#include <torch/torch.h>

#include <unirl/algorithms/advantage.hpp>
#include <unirl/concepts/algorithm.hpp>
#include <unirl/concepts/execution.hpp>
#include <unirl/exec/policy.hpp>

namespace unirl::algo {

/// GRPO: `(r - mean_g) / (std_g + eps)`; exactly 0 for constant groups.
struct group_normalized {
  group_advantage_options options{};
  template <ExecutionPolicy Exec = exec::automatic>
  torch::Tensor operator()(const torch::Tensor& rewards, std::int64_t group_size) const {
    return group_advantage<Exec>(rewards, group_size, {.scale_by_std = true, .unbiased_std = options.unbiased_std,
                                                       .eps = options.eps});
  }
};
static_assert(GroupAdvantageEstimator<group_normalized>);

/// Dr.GRPO: `r - mean_g`, no division by the std.
struct dr_grpo {
  template <ExecutionPolicy Exec = exec::automatic>
  torch::Tensor operator()(const torch::Tensor& rewards, std::int64_t group_size) const {
    return group_advantage<Exec>(rewards, group_size, {.scale_by_std = false});
  }
};
static_assert(GroupAdvantageEstimator<dr_grpo>);

/// RLOO: `r_i - mean_{j != i} r_j`.
struct rloo {
  template <ExecutionPolicy Exec = exec::automatic>
  torch::Tensor operator()(const torch::Tensor& rewards, std::int64_t group_size) const {
    return rloo_advantage<Exec>(rewards, group_size);
  }
};
static_assert(GroupAdvantageEstimator<rloo>);

/// Runs the estimator `e` with the execution policy `Exec` when it takes one (as the estimators
/// of this file do), else as `e(rewards, group_size)`.
template <ExecutionPolicy Exec, GroupAdvantageEstimator E>
torch::Tensor estimate(const E& e, const torch::Tensor& rewards, std::int64_t group_size) {
  if constexpr (requires { e.template operator()<Exec>(rewards, group_size); })
    return e.template operator()<Exec>(rewards, group_size);
  else
    return e(rewards, group_size);
}

}  // namespace unirl::algo

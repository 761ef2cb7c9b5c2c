#pragma once
/// \file kl.hpp
/// Per-element KL estimators between the policy and the reference (verl `kl_penalty`,
/// docs/algorithms/grpo.md), with `l = logp - logp_ref`:
/// `k1 = l`, `k2 = l^2 / 2`, `k3 = exp(-l) - 1 + l` (l clamped to [-20, 20], k3 to at most 10).
///
/// ```cpp
/// auto kl = unirl::algo::kl_penalty(logp, ref_logp, unirl::algo::kl_estimator::k3);  // (B, T)
/// ```
#include <array>
#include <string_view>

#include <torch/torch.h>

#include <unirl/core/error.hpp>
#include <unirl/core/options.hpp>
#include <unirl/exec/policy.hpp>

namespace unirl::algo {

/// Which estimator of KL(pi || pi_ref) a loss or a reward uses.
enum class kl_estimator { k1, k2, k3 };

/// Per-element KL estimate from log-probabilities under the policy and the reference.
/// The reference log-probabilities are constants. Reference implementation only (every policy).
template <ExecutionPolicy Exec = exec::automatic>
torch::Tensor kl_penalty(const torch::Tensor& logp, const torch::Tensor& logp_ref, kl_estimator estimator) {
  UNIRL_CHECK(logp.defined() && logp_ref.defined(), "kl_penalty: logp and logp_ref must be defined");
  UNIRL_CHECK(logp.sizes() == logp_ref.sizes(), "kl_penalty: logp sizes ", logp.sizes(),
              " differ from logp_ref sizes ", logp_ref.sizes());
  UNIRL_CHECK(estimator == kl_estimator::k1 || estimator == kl_estimator::k2 || estimator == kl_estimator::k3,
              "kl_penalty: unknown estimator ", static_cast<int>(estimator));
  return exec::dispatch<Exec>(logp, [&] {
    const auto l = logp - logp_ref.detach().to(logp.scalar_type());
    if (estimator == kl_estimator::k1) return l;
    if (estimator == kl_estimator::k2) return 0.5 * l.square();
    const auto lc = torch::clamp(l, -20.0, 20.0);
    return torch::clamp(torch::exp(-lc) - 1.0 + lc, /*min=*/c10::nullopt, /*max=*/10.0);
  });
}

}  // namespace unirl::algo

template <>
inline constexpr std::array unirl::enum_names<unirl::algo::kl_estimator>{std::string_view{"k1"},
                                                                        std::string_view{"k2"},
                                                                        std::string_view{"k3"}};

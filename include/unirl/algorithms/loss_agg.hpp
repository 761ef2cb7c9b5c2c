#pragma once
/// \file loss_agg.hpp
/// Reduction of per-token (or per-step) losses to one scalar (`loss_agg`, docs/algorithms/grpo.md).
///
/// - `token_mean`: sum over valid tokens / their count (DAPO);
/// - `seq_mean_token_mean`: mean over each sequence's valid tokens, then over sequences (GRPO);
/// - `seq_mean_token_sum_norm`: sum per sequence / `max_len`, then mean over sequences (Dr.GRPO),
///   where `max_len` is the configured maximum response length, not the padded width.
/// Masked tokens never enter a denominator; a fully masked sequence counts as one sequence
/// contributing 0.
///
/// ```cpp
/// auto loss = unirl::algo::aggregate(per_token, mask, unirl::algo::loss_agg::seq_mean_token_mean, 0);
/// ```
#include <array>
#include <cstdint>
#include <string_view>

#include <torch/torch.h>

#include <unirl/core/error.hpp>
#include <unirl/core/options.hpp>
#include <unirl/exec/policy.hpp>

namespace unirl::algo {

/// How per-token losses are reduced.
enum class loss_agg { token_mean, seq_mean_token_mean, seq_mean_token_sum_norm };

/// Reduces `per_token` ((B, T), or any shape for `token_mean`; a 1-D input is B sequences of one
/// element) under `mask` (same shape, non-zero = valid) to a scalar. `max_len` is used only by
/// `seq_mean_token_sum_norm` and must then be > 0. Reference implementation only (every policy).
template <ExecutionPolicy Exec = exec::automatic>
torch::Tensor aggregate(const torch::Tensor& per_token, const torch::Tensor& mask, loss_agg mode,
                        std::int64_t max_len) {
  UNIRL_CHECK(per_token.defined() && mask.defined(), "aggregate: per_token and mask must be defined");
  UNIRL_CHECK(per_token.sizes() == mask.sizes(), "aggregate: per_token sizes ", per_token.sizes(),
              " differ from mask sizes ", mask.sizes());
  UNIRL_CHECK(mode == loss_agg::token_mean || per_token.dim() >= 1,
              "aggregate: a sequence mode needs at least 1 dimension, got a scalar");
  UNIRL_CHECK(mode != loss_agg::seq_mean_token_sum_norm || max_len > 0,
              "aggregate: seq_mean_token_sum_norm needs max_len > 0 (the configured maximum ",
              "response length), got ", max_len);
  return exec::dispatch<Exec>(per_token, [&] {
    const auto m = mask.to(per_token.scalar_type());
    // where() rather than a product keeps a NaN or inf in a masked slot out of the result.
    const auto x = torch::where(mask.to(torch::kBool), per_token, torch::zeros_like(per_token));
    if (mode == loss_agg::token_mean) return x.sum() / m.sum().clamp_min(1.0);
    const auto xs = per_token.dim() == 1 ? x.unsqueeze(1) : x.flatten(1);
    const auto ms = per_token.dim() == 1 ? m.unsqueeze(1) : m.flatten(1);
    if (xs.size(0) == 0) return x.sum();
    if (mode == loss_agg::seq_mean_token_mean) return (xs.sum(1) / ms.sum(1).clamp_min(1.0)).mean();
    return (xs.sum(1) / static_cast<double>(max_len)).mean();
  });
}

/// What `aggregate` divides by for `mask` under `mode`, as a () float64 tensor (no read): the
/// valid elements for `token_mean`, the sequences (`mask.size(0)`; 1 for a scalar) for the two
/// sequence modes. Gradient accumulation weighs micro-batch i's loss by `n_i / sum_j n_j`, which
/// gives exactly the whole minibatch's loss in every mode — the token-mean normaliser is the whole
/// minibatch's token count, not each micro-batch's.
inline torch::Tensor aggregation_normaliser(const torch::Tensor& mask, loss_agg mode) {
  UNIRL_CHECK(mask.defined(), "aggregation_normaliser: mask must be defined");
  const auto f64 = torch::TensorOptions(torch::kFloat64).device(mask.device());
  if (mode == loss_agg::token_mean) return mask.to(torch::kFloat64).sum();
  return torch::full({}, static_cast<double>(mask.dim() == 0 ? 1 : mask.size(0)), f64);
}

/// Mean of `x` over the valid elements of `mask` (statistics: ratio mean, clip fraction).
template <ExecutionPolicy Exec = exec::automatic>
torch::Tensor masked_mean(const torch::Tensor& x, const torch::Tensor& mask) {
  UNIRL_CHECK(x.sizes() == mask.sizes(), "masked_mean: x sizes ", x.sizes(), " differ from mask sizes ", mask.sizes());
  return exec::dispatch<Exec>(x, [&] {
    const auto xf = x.is_floating_point() ? x : x.to(torch::kFloat);
    const auto m = mask.to(xf.scalar_type());
    return torch::where(mask.to(torch::kBool), xf, torch::zeros_like(xf)).sum() / m.sum().clamp_min(1.0);
  });
}

}  // namespace unirl::algo

template <>
inline constexpr std::array unirl::enum_names<unirl::algo::loss_agg>{
    std::string_view{"token_mean"}, std::string_view{"seq_mean_token_mean"},
    std::string_view{"seq_mean_token_sum_norm"}};

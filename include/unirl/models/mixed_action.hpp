#pragma once
/// \file mixed_action.hpp
/// A mixed action space for an action head (seed 003 §8.1's multimodal agent): a discrete action
/// type (categorical over K types: click / scroll / type ...) together with C continuous
/// coordinates (a diagonal Gaussian, C = 2 for a point (x, y)). The two parts are independent
/// given the observation, so
///
///     log pi(k, u) = log softmax(logits)_k + sum_c log N(u_c; mean_c, exp(log_std_c)^2)
///     H(pi)        = -sum_k p_k log p_k      + sum_c (log_std_c + (1 + log 2 pi) / 2)
///
/// An action is one float row `[k, u_1, ..., u_C]`: the type index (an integer written as a float)
/// then the coordinates, so a rollout stores (T*N, 1 + C) floats as it does continuous actions,
/// and a `box_space<1 + C>` environment (e.g. envs/canvas_click.hpp) takes it unchanged.
/// `actor_critic<mixed<C>>` (models/actor_critic.hpp) uses it as its action head.
///
/// ```cpp
/// unirl::models::mixed_distribution d{logits, mean, log_std};   // (B, K), (B, C), (B, C) or (1, C)
/// torch::Tensor a = d.sample();                  // (B, 1 + C) float: [type, x, y]
/// torch::Tensor lp = d.log_prob(a);              // (B,) = categorical part + Gaussian part
/// torch::Tensor h = d.entropy();                 // (B,)
/// unirl::models::mixed_actor_critic pi(obs_dim, /*types=*/3);   // K = 3 types, (x, y)
/// ```
#include <cmath>
#include <cstdint>
#include <numbers>

#include <torch/torch.h>

#include <unirl/core/error.hpp>

namespace unirl::models {

/// Mixed actions: a categorical action type and `Coordinates` Gaussian coordinates.
template <std::int64_t Coordinates = 2>
struct mixed {
  static_assert(Coordinates >= 1, "unirl::models::mixed: at least one continuous coordinate");
  static constexpr std::int64_t coordinates = Coordinates;
};

/// True for `mixed<C>`.
template <class D>
inline constexpr bool is_mixed_v = false;
template <std::int64_t C>
inline constexpr bool is_mixed_v<mixed<C>> = true;

/// The distribution of one batch of mixed actions, from the head's outputs.
struct mixed_distribution {
  torch::Tensor logits;   // (B, K) unnormalised log-probabilities of the action types
  torch::Tensor mean;     // (B, C) means of the coordinates
  torch::Tensor log_std;  // (B, C), or (1, C) broadcast over the batch

  std::int64_t types() const { return logits.size(-1); }
  std::int64_t coordinates() const { return mean.size(-1); }

  /// Samples (B, 1 + C) actions `[type, coordinates...]` in the mean's floating type.
  torch::Tensor sample() const {
    check();
    torch::NoGradGuard ng;
    const auto k = torch::multinomial(torch::softmax(logits.to(torch::kFloat), -1), 1);  // (B, 1) int64
    const auto u = mean + log_std.expand_as(mean).exp() * torch::randn_like(mean);
    return torch::cat({k.to(mean.scalar_type()), u}, -1);
  }

  /// The most likely action: the arg-max type and the mean coordinates, (B, 1 + C).
  torch::Tensor mode() const {
    check();
    return torch::cat({logits.argmax(-1, /*keepdim=*/true).to(mean.scalar_type()), mean}, -1);
  }

  /// log pi(actions): (B, 1 + C) rows `[type, coordinates...]` -> (B,), differentiable in the
  /// logits, the mean and the log-std. A type that is not an integer in [0, K) is an error.
  torch::Tensor log_prob(const torch::Tensor& actions) const {
    check();
    const auto B = mean.size(0), C = coordinates();
    UNIRL_CHECK(actions.is_floating_point() && actions.dim() == 2 && actions.size(0) == B && actions.size(1) == 1 + C,
                "mixed_distribution::log_prob: actions of shape ", actions.sizes(), " and type ", actions.scalar_type(),
                ": expected (", B, ", ", 1 + C, ") floats [type, coordinates...]");
    const auto t = actions.select(-1, 0).detach();
    const auto k = t.round().to(torch::kLong);
    UNIRL_CHECK(B == 0 || (torch::isfinite(t).all().item<bool>() && (t == t.round()).all().item<bool>() &&
                           k.min().item<std::int64_t>() >= 0 && k.max().item<std::int64_t>() < types()),
                "mixed_distribution::log_prob: action types ", t, ": expected integers in [0, ", types(), ")");
    const auto logp_type = torch::log_softmax(logits, -1).gather(-1, k.unsqueeze(-1)).squeeze(-1);
    const auto u = actions.narrow(-1, 1, C).to(mean.scalar_type());
    const auto ls = log_std.expand_as(mean);
    const double half_log_2pi = 0.5 * std::log(2.0 * std::numbers::pi);
    const auto logp_coords = (-(u - mean).square() * 0.5 * torch::exp(-2.0 * ls) - ls - half_log_2pi).sum(-1);
    return logp_type.to(logp_coords.scalar_type()) + logp_coords;
  }

  /// Entropy of the type plus that of the coordinates, (B,).
  torch::Tensor entropy() const {
    check();
    const auto lp = torch::log_softmax(logits, -1);
    const auto h_type = -(lp.exp() * lp).sum(-1);
    const auto h_coords = (log_std.expand_as(mean) + 0.5 * (1.0 + std::log(2.0 * std::numbers::pi))).sum(-1);
    return h_type.to(h_coords.scalar_type()) + h_coords;
  }

 private:
  void check() const {
    UNIRL_CHECK(logits.defined() && mean.defined() && log_std.defined(),
                "mixed_distribution: the logits, the mean or the log-std is undefined; expected three tensors");
    UNIRL_CHECK(logits.dim() == 2 && mean.dim() == 2 &&
                    logits.size(0) == mean.size(0) && logits.size(1) >= 1 && log_std.dim() == 2 &&
                    log_std.size(-1) == mean.size(-1) && (log_std.size(0) == 1 || log_std.size(0) == mean.size(0)),
                "mixed_distribution: logits ", logits.sizes(), ", mean ", mean.sizes(), ", log_std ", log_std.sizes(),
                ": expected (B, K), (B, C) and (B, C) or (1, C)");
  }
};

}  // namespace unirl::models

#pragma once
/// \file advantage.hpp
/// Advantage estimators shared by every track (docs/algorithms/grpo.md, docs/algorithms/ppo.md):
/// group-normalised (GRPO), Dr.GRPO (no std), RLOO, GAE (CleanRL convention) and whitening; on
/// (B, T) token layouts the token rewards, discounted returns, REINFORCE++ and GAE along each
/// completion; DAPO's dynamic-sampling mask (`informative_groups`). Each takes the execution
/// policy first (`exec::automatic` by default); `gae` has a fused CPU loop, the others only the
/// reference, so every policy runs the same LibTorch ops for them. Every function computes in its
/// inputs' floating type (float64 in, float64 out); integer rewards count as float32.
///
/// ```cpp
/// auto r = torch::tensor({1.f, 0.f, 0.f, 1.f});                    // two groups of two
/// auto a = unirl::algo::group_advantage(r, 2);                       // {0.7071, -0.7071, -0.7071, 0.7071}
/// auto d = unirl::algo::group_advantage(r, 2, {.scale_by_std = false});  // Dr.GRPO: {0.5, -0.5, -0.5, 0.5}
/// ```
#include <cstdint>

#include <torch/torch.h>

#include <unirl/core/error.hpp>
#include <unirl/exec/policy.hpp>

namespace unirl::algo {

/// How group-normalised advantages are scaled.
struct group_advantage_options {
  bool scale_by_std = true;   // false: Dr.GRPO, A = r - mean_g
  bool unbiased_std = true;   // verl's default; false: population std
  double eps = 1e-6;          // added to the std
};

namespace detail {
inline torch::Tensor as_float_rewards(const torch::Tensor& rewards, std::int64_t group_size, const char* who) {
  UNIRL_CHECK(rewards.defined(), who, ": rewards are undefined");
  UNIRL_CHECK(rewards.dim() == 1, who, ": rewards must be 1-D (B*G,), got ", rewards.dim(), " dimensions ",
              rewards.sizes());
  UNIRL_CHECK(group_size >= 1, who, ": group_size = ", group_size, ": expected >= 1");
  UNIRL_CHECK(rewards.size(0) % group_size == 0, who, ": ", rewards.size(0),
              " rewards are not a whole number of groups of group_size = ", group_size);
  return rewards.is_floating_point() ? rewards : rewards.to(torch::kFloat);
}

// (B, 1) bool: true where every reward of the group is the same value. Detected with max == min,
// never with std == 0: the computed mean of seven 0.7s is not exactly 0.7 in float32.
inline torch::Tensor constant_groups(const torch::Tensor& grouped) {
  return grouped.amax(1, /*keepdim=*/true) == grouped.amin(1, /*keepdim=*/true);
}
}  // namespace detail

/// Group-normalised advantages (GRPO, DeepSeekMath): `A_i = (r_i - mean_g) / (std_g + eps)`, or
/// `r_i - mean_g` with `scale_by_std = false` (Dr.GRPO).
///
/// `rewards` is (B*G,), grouped contiguously: samples `[g*G, (g+1)*G)` share one prompt or
/// condition. A group of size 1 or whose rewards are all equal gives exactly 0 (never NaN).
template <ExecutionPolicy Exec = exec::automatic>
torch::Tensor group_advantage(const torch::Tensor& rewards, std::int64_t group_size,
                              const group_advantage_options& o = {}) {
  const auto r = detail::as_float_rewards(rewards, group_size, "group_advantage");
  UNIRL_CHECK(o.eps >= 0.0, "group_advantage: eps = ", o.eps, ": expected >= 0");
  if (group_size == 1 || r.numel() == 0) return torch::zeros_like(r);
  return exec::dispatch<Exec>(r, [&] {
    const auto g = r.reshape({-1, group_size});                        // (B, G)
    auto adv = g - g.mean(1, /*keepdim=*/true);
    if (o.scale_by_std) adv = adv / (g.std(1, o.unbiased_std, /*keepdim=*/true) + o.eps);
    adv = torch::where(detail::constant_groups(g), torch::zeros_like(adv), adv);
    return adv.reshape({-1});
  });
}

/// RLOO (arXiv 2402.14740): `A_i = r_i - mean_{j != i} r_j = k/(k-1) (r_i - mean_g)`.
/// 0 for a group of size 1 or a group whose rewards are all equal.
template <ExecutionPolicy Exec = exec::automatic>
torch::Tensor rloo_advantage(const torch::Tensor& rewards, std::int64_t group_size) {
  const auto r = detail::as_float_rewards(rewards, group_size, "rloo_advantage");
  if (group_size == 1 || r.numel() == 0) return torch::zeros_like(r);
  return exec::dispatch<Exec>(r, [&] {
    const auto g = r.reshape({-1, group_size});
    const double k = static_cast<double>(group_size);
    auto adv = (g - g.mean(1, /*keepdim=*/true)) * (k / (k - 1.0));
    adv = torch::where(detail::constant_groups(g), torch::zeros_like(adv), adv);
    return adv.reshape({-1});
  });
}

/// Advantages and returns of `gae`, both (T, N).
struct gae_result {
  torch::Tensor advantages;  // (T, N)
  torch::Tensor returns;     // (T, N) = advantages + values
};

/// Generalised advantage estimation in CleanRL's convention (docs/algorithms/ppo.md). `exec::cpu`
/// (and `automatic` on CPU) runs one fused pass in double; `exec::reference` the tensor recursion.
///
/// `rewards`, `values`, `dones`: (T, N); `dones[t] = 1` when observation t is the first of a new
/// episode (the previous step ended one). `next_value`, `next_done`: (N,), the value and done flag
/// of the observation after the rollout.
/// `delta_t = r_t + gamma V_{t+1} (1 - d_{t+1}) - V_t`, `A_t = delta_t + gamma lambda (1 - d_{t+1}) A_{t+1}`.
/// ```cpp
/// auto [adv, ret] = unirl::algo::gae(r, v, d, v_next, d_next, 0.99, 0.95);
/// ```
template <ExecutionPolicy Exec = exec::automatic>
gae_result gae(const torch::Tensor& rewards, const torch::Tensor& values, const torch::Tensor& dones,
                      const torch::Tensor& next_value, const torch::Tensor& next_done, double gamma, double lambda) {
  UNIRL_CHECK(rewards.defined() && values.defined() && dones.defined() && next_value.defined() && next_done.defined(),
              "gae: every input must be defined");
  UNIRL_CHECK(rewards.dim() == 2, "gae: rewards must be (T, N), got sizes ", rewards.sizes());
  UNIRL_CHECK(values.sizes() == rewards.sizes(), "gae: values sizes ", values.sizes(), " differ from rewards sizes ",
              rewards.sizes());
  UNIRL_CHECK(dones.sizes() == rewards.sizes(), "gae: dones sizes ", dones.sizes(), " differ from rewards sizes ",
              rewards.sizes());
  const auto T = rewards.size(0), N = rewards.size(1);
  UNIRL_CHECK(next_value.numel() == N && next_done.numel() == N, "gae: next_value (", next_value.numel(),
              " elements) and next_done (", next_done.numel(), ") must have N = ", N, " elements");
  UNIRL_CHECK(gamma >= 0.0 && gamma <= 1.0, "gae: gamma = ", gamma, ": expected in [0, 1]");
  UNIRL_CHECK(lambda >= 0.0 && lambda <= 1.0, "gae: lambda = ", lambda, ": expected in [0, 1]");

  const auto dtype = values.is_floating_point() ? values.scalar_type() : torch::kFloat;
  const auto r = rewards.to(dtype), v = values.to(dtype), d = dones.to(dtype);
  const auto nv = next_value.reshape({N}).to(dtype), nd = next_done.reshape({N}).to(dtype);
  auto fused = [&] {
    // One fused pass over contiguous memory, in double, back to the values' dtype.
    const auto rc = r.to(torch::kDouble).contiguous(), vc = v.to(torch::kDouble).contiguous(),
               dc = d.to(torch::kDouble).contiguous(), nvc = nv.to(torch::kDouble).contiguous(),
               ndc = nd.to(torch::kDouble).contiguous();
    auto out = torch::empty({T, N}, torch::kDouble);
    const double *pr = rc.data_ptr<double>(), *pv = vc.data_ptr<double>(), *pd = dc.data_ptr<double>(),
                 *pnv = nvc.data_ptr<double>(), *pnd = ndc.data_ptr<double>();
    double* pa = out.data_ptr<double>();
    for (std::int64_t n = 0; n < N; ++n) {
      double last = 0.0;
      for (std::int64_t t = T - 1; t >= 0; --t) {
        const double nonterminal = 1.0 - (t == T - 1 ? pnd[n] : pd[(t + 1) * N + n]);
        const double next_v = t == T - 1 ? pnv[n] : pv[(t + 1) * N + n];
        const double delta = pr[t * N + n] + gamma * next_v * nonterminal - pv[t * N + n];
        last = delta + gamma * lambda * nonterminal * last;
        pa[t * N + n] = last;
      }
    }
    return out.to(dtype);
  };
  auto reference = [&] {
    auto adv = torch::empty_like(v);
    auto last = torch::zeros_like(nv);
    for (std::int64_t t = T - 1; t >= 0; --t) {
      const auto nonterminal = 1.0 - (t == T - 1 ? nd : d[t + 1]);
      const auto next_v = t == T - 1 ? nv : v[t + 1];
      const auto delta = r[t] + gamma * next_v * nonterminal - v[t];
      last = delta + gamma * lambda * nonterminal * last;
      adv[t] = last;
    }
    return adv;
  };
  const torch::Tensor adv = exec::dispatch<Exec>(r, reference, fused);
  return {adv, adv + v};
}

/// Whitening: `(x - mean) / (unbiased std + eps)` over all elements. A single element gives 0.
template <ExecutionPolicy Exec = exec::automatic>
torch::Tensor normalize(const torch::Tensor& x, double eps = 1e-8) {
  UNIRL_CHECK(x.defined() && x.is_floating_point(), "normalize: expected a defined floating tensor");
  return exec::dispatch<Exec>(x, [&] {
    if (x.numel() < 2) return x - x.mean();
    return (x - x.mean()) / (x.std(/*unbiased=*/true) + eps);
  });
}

/// Whitening over the elements where `mask` is non-zero; masked elements come out 0, and so does
/// everything when fewer than two elements are valid. No host synchronisation.
template <ExecutionPolicy Exec = exec::automatic>
torch::Tensor masked_normalize(const torch::Tensor& x, const torch::Tensor& mask, double eps = 1e-8) {
  UNIRL_CHECK(x.sizes() == mask.sizes(), "masked_normalize: x sizes ", x.sizes(), " differ from mask sizes ",
              mask.sizes());
  return exec::dispatch<Exec>(x, [&] {
    const auto m = mask.to(x.scalar_type());
    const auto n = m.sum();
    const auto mean = (x * m).sum() / n.clamp_min(1.0);
    const auto var = ((x - mean).square() * m).sum() / (n - 1.0).clamp_min(1.0);
    const auto out = (x - mean) / (var.sqrt() + eps) * m;
    return torch::where(n >= 2.0, out, torch::zeros_like(out));
  });
}

/// DAPO dynamic sampling: (B,) bool, true for each group of `group_size` rewards that are not
/// all equal (`max != min`) — the groups that carry a learning signal and are kept.
inline torch::Tensor informative_groups(const torch::Tensor& rewards, std::int64_t group_size) {
  const auto r = detail::as_float_rewards(rewards, group_size, "informative_groups");
  return detail::constant_groups(r.reshape({-1, group_size})).logical_not().reshape({-1});
}

namespace detail {
inline void check_token_layout(const torch::Tensor& x, const torch::Tensor& mask, const char* who, const char* name) {
  UNIRL_CHECK(mask.defined() && mask.dim() == 2, who, ": the mask must be (B, T), got ",
              mask.defined() ? mask.sizes() : torch::IntArrayRef{});
  UNIRL_CHECK(x.defined() && x.sizes() == mask.sizes(), who, ": ", name, " sizes ",
              x.defined() ? x.sizes() : torch::IntArrayRef{}, " differ from the mask sizes ", mask.sizes());
}
}  // namespace detail

/// Token-level rewards (B, T) of completions under `mask` ((B, T), 1 = valid, right-padded): the
/// outcome `outcome` ((B,)) on each completion's last valid token (index `sum(mask) - 1`, or 0
/// for an empty completion), minus `kl_coef * kl` on every valid token when `kl` ((B, T), e.g.
/// `kl_penalty(old_logp, ref_logp, k)`) is given: `r_t = -kl_coef kl_t m_t + [t = last] R`.
/// The dtype is the wider of the outcome's and the KL's (integer outcomes count as float32).
inline torch::Tensor token_level_rewards(const torch::Tensor& outcome, const torch::Tensor& mask,
                                         const torch::Tensor& kl = {}, double kl_coef = 0.0) {
  UNIRL_CHECK(mask.defined() && mask.dim() == 2, "token_level_rewards: the mask must be (B, T), got ",
              mask.defined() ? mask.sizes() : torch::IntArrayRef{});
  UNIRL_CHECK(outcome.defined() && outcome.numel() == mask.size(0), "token_level_rewards: ",
              outcome.defined() ? outcome.numel() : 0, " outcome rewards for ", mask.size(0), " completions");
  auto dtype = outcome.is_floating_point() ? outcome.scalar_type() : torch::kFloat;
  if (kl.defined()) {
    detail::check_token_layout(kl, mask, "token_level_rewards", "kl");
    dtype = c10::promoteTypes(dtype, kl.scalar_type());
  }
  auto tok = torch::zeros(mask.sizes(), mask.options().dtype(dtype));
  if (kl.defined() && kl_coef != 0.0) tok = tok - kl_coef * kl.to(dtype) * mask.to(dtype);
  const auto last = (mask.sum(1).to(torch::kInt64) - 1).clamp_min(0);
  return tok.scatter_add(1, last.unsqueeze(1), outcome.reshape({-1, 1}).to(tok.device(), dtype));
}

/// Discounted returns along the token axis: `G_t = r_t + gamma m_t G_{t+1}`, `G_T = 0`
/// (a return never runs across a masked token). rewards, mask (B, T) -> (B, T), the rewards' dtype.
template <ExecutionPolicy Exec = exec::automatic>
torch::Tensor discounted_returns(const torch::Tensor& rewards, const torch::Tensor& mask, double gamma) {
  detail::check_token_layout(rewards, mask, "discounted_returns", "rewards");
  UNIRL_CHECK(rewards.is_floating_point(), "discounted_returns: rewards must be floating point, got ",
              rewards.dtype());
  UNIRL_CHECK(gamma >= 0.0 && gamma <= 1.0, "discounted_returns: gamma = ", gamma, ": expected in [0, 1]");
  return exec::dispatch<Exec>(rewards, [&] {
    const auto m = mask.to(rewards.scalar_type());
    auto ret = torch::zeros_like(rewards);
    auto run = torch::zeros({rewards.size(0)}, rewards.options());
    for (std::int64_t t = rewards.size(1) - 1; t >= 0; --t) {
      run = rewards.select(1, t) + gamma * run * m.select(1, t);
      ret.select(1, t).copy_(run);
    }
    return ret;
  });
}

/// REINFORCE++ token advantages (arXiv 2501.03262): token rewards `-kl_coef (old_logp - ref_logp)`
/// (k1, when `ref_logp` is defined and `kl_coef > 0`) plus the outcome on the last valid token,
/// discounted returns with `gamma`, whitened over the valid tokens of the batch
/// (`masked_normalize`); 0 on masked tokens. outcome (B,), mask / logps (B, T) -> (B, T).
template <ExecutionPolicy Exec = exec::automatic>
torch::Tensor reinforce_pp_advantage(const torch::Tensor& outcome, const torch::Tensor& mask,
                                     const torch::Tensor& old_logp, const torch::Tensor& ref_logp, double kl_coef,
                                     double gamma) {
  torch::Tensor kl;
  if (ref_logp.defined() && kl_coef > 0.0) {
    detail::check_token_layout(old_logp, mask, "reinforce_pp_advantage", "old_logp");
    kl = old_logp - ref_logp.to(old_logp.scalar_type());
  }
  const auto tok = token_level_rewards(outcome, mask, kl, kl_coef);
  const auto m = mask.to(tok.scalar_type());
  return masked_normalize<Exec>(discounted_returns<Exec>(tok, mask, gamma) * m, m);
}

/// GAE along each completion (PPO on the token track): `gae` over the token axis with the
/// positions after a completion's end starting new episodes (no bootstrapping across them) and
/// nothing after the last column (`V_T = 0`, `d_T = 1`); advantages and returns are 0 on masked
/// tokens. token_rewards, values, mask (B, T) -> (B, T) each, in the values' dtype.
template <ExecutionPolicy Exec = exec::automatic>
gae_result token_gae(const torch::Tensor& token_rewards, const torch::Tensor& values, const torch::Tensor& mask,
                     double gamma, double lambda) {
  detail::check_token_layout(token_rewards, mask, "token_gae", "token_rewards");
  detail::check_token_layout(values, mask, "token_gae", "values");
  const auto B = mask.size(0);
  const auto dtype = values.is_floating_point() ? values.scalar_type() : torch::kFloat;
  const auto opts = values.options().dtype(dtype);
  const auto m = mask.to(dtype);
  const auto dones = (1.0 - m).t().contiguous();  // (T, B)
  const auto g = gae<Exec>(token_rewards.t(), values.t(), dones, torch::zeros({B}, opts), torch::ones({B}, opts),
                           gamma, lambda);
  return {g.advantages.t().contiguous() * m, g.returns.t().contiguous() * m};
}

}  // namespace unirl::algo

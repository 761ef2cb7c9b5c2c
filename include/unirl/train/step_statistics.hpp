#pragma once
/// \file step_statistics.hpp
/// How the RL trainer turns a step's device tensors into its `step_stats` with one host read:
/// the rewards' and advantages' moments, the loss figures summed over the optimizer steps
/// (`update_sums`, one `add` per step the update engine took), the algorithm's reported figures
/// and the deferred checks — averaged over the ranks of a `ParallelStrategy`.
///
/// ```cpp
/// unirl::train::update_sums u;
/// if (auto r = engine.step(mb, loss); r.taken) u.add(r, device);
/// unirl::train::finish_step_statistics(stats, engine.parallel(), device, rewards64, advantages, u, pending, checks);
/// ```
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <unirl/concepts/parallel.hpp>
#include <unirl/core/host.hpp>
#include <unirl/core/stats.hpp>
#include <unirl/train/update_engine.hpp>

namespace unirl::train {

/// Sums over the optimizer steps of one trainer step: the losses and gradient norms read with
/// each step's flags, and the loss figures as () float64 tensors (no read).
struct update_sums {
  std::int64_t taken = 0;
  double loss = 0, grad_norm = 0;
  torch::Tensor policy, value, kl, entropy, ratio, clip;
  std::map<std::string, torch::Tensor> extra;

  /// Adds one taken step of the update engine.
  void add(const update_outcome<loss_terms>& r, torch::Device device) {
    auto sum = [](torch::Tensor& acc, const torch::Tensor& x) { acc = acc.defined() ? acc + x : x; };
    const loss_terms& t = r.terms;
    ++taken;
    loss += r.loss;
    grad_norm += r.grad_norm;
    sum(policy, t.policy.tensor(device));
    sum(value, t.value.tensor(device));
    sum(kl, t.kl.tensor(device));
    sum(entropy, t.entropy.tensor(device));
    sum(ratio, t.ratio_mean.tensor(device));
    sum(clip, t.clip_fraction.tensor(device));
    for (const auto& [k, v] : t.extra) sum(extra[k], v.tensor(device));
  }
};

/// Mean, std (unbiased; 0 for one value), min and max of float64 values `r`: (4,), no read.
inline torch::Tensor reward_figures(const torch::Tensor& r, torch::Device device) {
  const auto f64 = torch::TensorOptions(torch::kFloat64).device(device);
  if (r.numel() == 0) return torch::zeros({4}, f64);
  return torch::stack({r.mean(), r.numel() > 1 ? r.std() : torch::zeros({}, f64), r.min(), r.max()});
}

/// Fills the step's statistics from device tensors with one read: advantage and loss figures
/// (averaged over ranks through `all_reduce_mean`; rewards and advantages from all ranks' counts,
/// sums and sums of squares; the reward range over ranks through `all_reduce_max` when the
/// strategy has it), the algorithm's reported figures (`pending`) and the deferred checks. The
/// `extra` figures are this rank's own. `r64`: the rewards as float64; `adv`: the advantages.
template <class Parallel>
void finish_step_statistics(step_stats& s, Parallel& parallel, torch::Device device, const torch::Tensor& r64,
                            const torch::Tensor& adv, const update_sums& u,
                            const std::map<std::string, torch::Tensor>& pending, deferred_checks& checks) {
  static_assert(ParallelStrategy<Parallel>, "unirl::train::finish_step_statistics: Parallel must model ParallelStrategy");
  torch::NoGradGuard ng;
  const auto f64 = torch::TensorOptions(torch::kFloat64).device(device);
  const auto zero = torch::zeros({}, f64);
  auto sum_or_zero = [&](const torch::Tensor& t) { return t.defined() ? t.to(device, torch::kFloat64) : zero; };
  const double d = u.taken > 0 ? static_cast<double>(u.taken) : 1.0;
  const auto a_own = adv.defined() ? adv.detach().reshape({-1}).to(device) : torch::zeros({0}, f64);
  const auto a = a_own.to(torch::kFloat64);
  auto moments = [&](const torch::Tensor& x) {
    return torch::stack({torch::full({}, static_cast<double>(x.numel()), f64), x.sum(), x.square().sum()});
  };
  std::vector<torch::Tensor> core{moments(r64),
                                  moments(a),
                                  a.numel() > 0 ? a_own.mean().to(torch::kFloat64) : zero,
                                  a.numel() > 1 ? a_own.std().to(torch::kFloat64) : zero,
                                  sum_or_zero(u.policy) / d,
                                  sum_or_zero(u.value) / d,
                                  sum_or_zero(u.kl) / d,
                                  sum_or_zero(u.entropy) / d,
                                  u.taken > 0 ? sum_or_zero(u.ratio) / d : torch::ones({}, f64),
                                  sum_or_zero(u.clip) / d,
                                  torch::full({}, u.loss / d, f64),
                                  torch::full({}, u.grad_norm / d, f64)};
  for (auto& c : core) c = c.reshape({-1});
  const bool many = parallel.world_size() > 1;
  torch::Tensor shared = torch::cat(core);
  if (many) shared = parallel.all_reduce_mean(shared);  // every rank: the same layout
  torch::Tensor range;
  if constexpr (requires(Parallel& p, const torch::Tensor& t) { p.all_reduce_max(t); })
    if (many)
      range = parallel.all_reduce_max(r64.numel() > 0 ? torch::stack({r64.max(), -r64.min()})
                                                      : torch::full({2}, -1e300, f64));
  std::vector<torch::Tensor> parts{shared, range};
  std::vector<std::string> keys;
  for (const auto& [k, v] : pending) {
    keys.push_back(k);
    parts.push_back(v);
  }
  for (const auto& [k, v] : u.extra) {
    keys.push_back(k);
    parts.push_back(v / d);
  }
  const auto got = read_figures(parts, &checks, device);
  std::size_t at = static_cast<std::size_t>(shared.numel());
  if (many) {
    auto moment_stats = [](double n, double sum, double sumsq, double& mean, double& sd) {
      if (n <= 0) return;
      mean = sum / n;
      sd = n > 1 ? std::sqrt(std::max(0.0, (sumsq - n * mean * mean) / (n - 1))) : 0.0;
    };
    const double w = parallel.world_size();
    moment_stats(got[0] * w, got[1] * w, got[2] * w, s.reward_mean, s.reward_std);
    moment_stats(got[3] * w, got[4] * w, got[5] * w, s.advantage_mean, s.advantage_std);
    if (range.defined()) {
      s.reward_max = got[at];
      s.reward_min = -got[at + 1];
      at += 2;
    }
  } else {
    s.advantage_mean = got[6];
    s.advantage_std = got[7];
  }
  if (u.taken > 0) {
    s.policy_loss = got[8];
    s.value_loss = got[9];
    s.kl = got[10];
    s.entropy = got[11];
    s.ratio_mean = got[12];
    s.clip_fraction = got[13];
    s.loss = got[14];
    s.grad_norm = got[15];
  }
  for (const auto& k : keys) s.extra[k] = got[at++];
}

}  // namespace unirl::train

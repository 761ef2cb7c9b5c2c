#pragma once
/// \file flow_sampler.hpp
/// Samplers of the flow track: `SamplerFor<S, M>`, and the two small types its calls return
/// (`step_coefficients`, `logprob_reduction`). The samplers themselves are in
/// rollout/flow_samplers.hpp.
///
/// ```cpp
/// static_assert(unirl::SamplerFor<unirl::sde::flow_grpo, my_flow_model>);
/// ```
#include <concepts>
#include <vector>

#include <torch/torch.h>

namespace unirl {

/// How per-element Gaussian log-probs (and KLs) are reduced over a sample: `mean` matches the
/// Flow-GRPO reference code (hence its 1e-4 clip range); `sum` is the true log-density.
enum class logprob_reduction { mean, sum };

/// One step: `mean = cx * x + cm * model_output`, Gaussian with standard deviation `std`.
struct step_coefficients {
  double cx = 1.0;
  double cm = 0.0;
  double std = 0.0;
};

/// A sampler usable with model `M`.
///
/// Minimal complete definition: `step_coefficients coefficients(M&, double t, double t_next) const`,
/// `torch::Tensor predict(M&, x, double t, cond) const` (the model output the coefficients
/// multiply), `std::vector<double> timesteps(M&) const` (K+1 times, noise first) and
/// `logprob_reduction reduction() const`.
template <class S, class M>
concept SamplerFor = requires(const S& s, M& m, const torch::Tensor& x, double t) {
  { s.coefficients(m, t, t) } -> std::same_as<step_coefficients>;
  { s.predict(m, x, t, x) } -> std::same_as<torch::Tensor>;
  { s.timesteps(m) } -> std::convertible_to<std::vector<double>>;
  { s.reduction() } -> std::same_as<logprob_reduction>;
};

}  // namespace unirl

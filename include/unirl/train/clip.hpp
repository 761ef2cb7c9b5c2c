#pragma once
/// \file clip.hpp
/// Global gradient-norm measurement and clipping (as `torch.nn.utils.clip_grad_norm_`).
///
/// ```cpp
/// loss.backward();
/// double norm = unirl::train::clip_grad_norm(params, 1.0);   // pre-clip L2 norm
/// if (!std::isfinite(norm)) { /* skip the update */ }
/// ```
#include <cmath>
#include <string>
#include <vector>

#include <boost/hana.hpp>
#include <torch/torch.h>

#include <unirl/config.hpp>
#include <unirl/core/options.hpp>

namespace unirl::train {

/// Gradient clipping. `max_grad_norm = 0` turns it off.
struct clip_options {
  double max_grad_norm = 0.0;  // 0: off

  void validate(const std::string& prefix) const {
    options::require(max_grad_norm >= 0.0 && std::isfinite(max_grad_norm), prefix + "max_grad_norm",
                     max_grad_norm, ">= 0 (0: no clipping)");
  }
};

/// The L2 norm of all existing gradients of `params` taken together (parameters without a
/// gradient are ignored; 0 when none has one). NaN or Inf when any gradient is non-finite.
/// One host synchronisation, whatever the number of tensors.
inline double grad_norm(const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> norms;
  norms.reserve(params.size());
  torch::Device device = torch::kCPU;
  for (const auto& p : params) {
    if (!p.defined()) continue;
    const auto& g = p.grad();
    if (!g.defined()) continue;
    if (norms.empty()) device = g.device();
    // Per-tensor norms in the gradient's dtype (as PyTorch), accumulated in double.
    norms.push_back(g.detach().norm().to(device, torch::kDouble));
  }
  if (norms.empty()) return 0.0;
  return torch::stack(norms).pow(2).sum().sqrt().item<double>();
}

/// Scales the gradients of `params` in place by `max_norm / (norm + 1e-6)` when their global
/// L2 norm exceeds `max_norm` (> 0); returns the norm before clipping. A non-finite norm leaves
/// the gradients untouched (the caller should skip the update). `max_norm <= 0` only measures.
/// ```cpp
/// double before = clip_grad_norm(model->parameters(), 0.5);
/// ```
inline double clip_grad_norm(const std::vector<torch::Tensor>& params, double max_norm) {
  const double norm = grad_norm(params);
  if (max_norm > 0.0 && std::isfinite(norm) && norm > max_norm) {
    const double coef = max_norm / (norm + 1e-6);
    torch::NoGradGuard no_grad;
    for (const auto& p : params)
      if (p.defined() && p.grad().defined()) p.grad().mul_(coef);
  }
  return norm;
}

}  // namespace unirl::train

BOOST_HANA_ADAPT_STRUCT(unirl::train::clip_options, max_grad_norm);

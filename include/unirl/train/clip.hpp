#pragma once
/// \file clip.hpp
/// Global gradient-norm measurement and clipping (as `torch.nn.utils.clip_grad_norm_`), with a
/// double result (one host read) or as tensors that stay on the device (`grad_norm_tensor`,
/// `clip_grads`: what the trainer uses, reading the norm with its step's other figures).
///
/// ```cpp
/// loss.backward();
/// double norm = unirl::train::clip_grad_norm(params, 1.0);   // pre-clip L2 norm
/// if (!std::isfinite(norm)) { /* skip the update */ }
/// torch::Tensor n = unirl::train::grad_norm_tensor(params);  // no host read
/// unirl::train::clip_grads(params, n, 1.0);                  // no host read either
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
/// Gradients off the CPU are reduced with a single host synchronisation.
inline double grad_norm(const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> grads;
  grads.reserve(params.size());
  bool all_cpu = true;
  for (const auto& p : params) {
    if (!p.defined() || !p.grad().defined()) continue;
    grads.push_back(p.grad().detach());
    all_cpu = all_cpu && grads.back().is_cpu();
  }
  if (grads.empty()) return 0.0;
  // Per-tensor norms in the gradient's dtype (as PyTorch), accumulated in double.
  if (all_cpu) {  // reading a CPU scalar costs nothing: skip the stacking
    double sq = 0.0;
    for (const auto& g : grads) {
      const double n = g.norm().item<double>();
      sq += n * n;
    }
    return std::sqrt(sq);
  }
  // On an accelerator: one reduction and a single host synchronisation.
  std::vector<torch::Tensor> norms;
  norms.reserve(grads.size());
  const auto device = grads.front().device();
  for (const auto& g : grads) norms.push_back(g.norm().to(device, torch::kFloat));
  return torch::stack(norms).to(torch::kDouble).pow(2).sum().sqrt().item<double>();
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

/// `grad_norm` as a () float64 tensor on the gradients' device, without reading it: per-tensor
/// norms in the gradient's dtype (as PyTorch), accumulated in double. 0 when no parameter has a
/// gradient (on the CPU).
inline torch::Tensor grad_norm_tensor(const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> norms;
  norms.reserve(params.size());
  for (const auto& p : params)
    if (p.defined() && p.grad().defined()) norms.push_back(p.grad().detach().norm().to(torch::kFloat64));
  if (norms.empty()) return torch::zeros({}, torch::kFloat64);
  const auto device = norms.front().device();
  for (auto& n : norms) n = n.to(device);
  return torch::stack(norms).pow(2).sum().sqrt();
}

/// `clip_grad_norm` given the norm (`grad_norm_tensor`), without reading it: scales the
/// gradients in place by `max_norm / (norm + 1e-6)` where the norm is finite and exceeds
/// `max_norm` (> 0), by 1 elsewhere.
inline void clip_grads(const std::vector<torch::Tensor>& params, const torch::Tensor& norm, double max_norm) {
  if (!(max_norm > 0.0)) return;
  torch::NoGradGuard no_grad;
  const auto coef = torch::where(torch::isfinite(norm) & (norm > max_norm), max_norm / (norm + 1e-6),
                                 torch::ones_like(norm));
  for (const auto& p : params)
    if (p.defined() && p.grad().defined()) p.grad().mul_(coef.to(p.grad().device()));
}

}  // namespace unirl::train

BOOST_HANA_ADAPT_STRUCT(unirl::train::clip_options, max_grad_norm);
template <>
inline constexpr std::array unirl::options::field_docs<unirl::train::clip_options>{
    unirl::options::field_doc{"max_grad_norm", "clip the global gradient norm to this; 0 = off"}};

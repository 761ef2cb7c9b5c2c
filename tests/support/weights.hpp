#pragma once
// Test helpers: copies of a model's parameters, compared exactly (bit-identical runs, frozen models).
#include <cstddef>
#include <vector>

#include <torch/torch.h>

namespace unirl_test {

/// Detached copies of `m.parameters()`, in order.
template <class M>
std::vector<torch::Tensor> parameter_copies(const M& m) {
  std::vector<torch::Tensor> w;
  for (const auto& p : m.parameters()) w.push_back(p.detach().clone());
  return w;
}

/// True when both lists have the same length and every tensor is equal, element for element.
inline bool all_equal(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (!torch::equal(a[i], b[i])) return false;
  return true;
}

}  // namespace unirl_test

// Small rollout batches for the reward tests: text (completions / references / prompts) and images.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <unirl/concepts/rollout.hpp>

namespace rewards_test {

struct text_batch {
  std::vector<std::string> completions{}, references{}, prompts{};
  std::int64_t size() const { return static_cast<std::int64_t>(completions.size()); }
  text_batch select(const torch::Tensor& index) const {
    const auto idx = index.to(torch::kInt64).contiguous();
    text_batch out;
    for (std::int64_t k = 0; k < idx.numel(); ++k) {
      const auto i = static_cast<std::size_t>(idx[k].item<std::int64_t>());
      out.completions.push_back(completions.at(i));
      if (!references.empty()) out.references.push_back(references.at(i));
      if (!prompts.empty()) out.prompts.push_back(prompts.at(i));
    }
    return out;
  }
};
static_assert(unirl::RolloutBatch<text_batch>);

struct image_batch {
  torch::Tensor images;  // (B, C, H, W)
  std::int64_t size() const { return images.size(0); }
  image_batch select(const torch::Tensor& index) const { return {images.index_select(0, index)}; }
};
static_assert(unirl::RolloutBatch<image_batch>);

/// A scorer that returns fixed scores, whatever the batch (for composer tests).
struct fixed_scorer {
  torch::Tensor values;
  std::string label = "fixed";
  std::string name() const { return label; }
  template <class B>
  torch::Tensor operator()(const B&) const { return values; }
};

}  // namespace rewards_test

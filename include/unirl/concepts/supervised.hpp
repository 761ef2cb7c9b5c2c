#pragma once
/// \file supervised.hpp
/// What `train::supervised_trainer<Model, Objective>` asks of its objective (the SFT
/// cross-entropy of train/sft.hpp and the flow-matching loss of train/flow_matching.hpp model it).
///
/// ```cpp
/// static_assert(unirl::SupervisedObjective<unirl::train::sft_objective<Model>, Model>);
/// ```
#include <concepts>
#include <cstdint>
#include <string_view>

#include <torch/torch.h>

#include <unirl/core/options.hpp>

namespace unirl {

/// What an objective's `loss` returns for one batch.
struct supervised_loss {
  torch::Tensor total;         // () float, differentiable: the batch's mean loss
  std::int64_t examples = 0;   // sequences / samples in the batch
  std::int64_t tokens = 0;     // tokens the loss covers (SFT: completion tokens; 0 where it means nothing)
};

/// A loss for `supervised_trainer<Model, O>` (see the file comment).
template <class O, class Model>
concept SupervisedObjective =
    std::constructible_from<O, typename O::options> && options::is_reflectable<typename O::options> &&
    requires(const O& o, Model& m, const typename O::batch_type& b) {
      { O::name } -> std::convertible_to<std::string_view>;
      { o.loss(m, b) } -> std::same_as<supervised_loss>;
    };

}  // namespace unirl

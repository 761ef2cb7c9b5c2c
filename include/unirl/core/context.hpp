#pragma once
/// \file context.hpp
/// What an algorithm sees of the trainer: the models it asked for and the current step.
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

#include <torch/torch.h>

#include <unirl/core/host.hpp>

namespace unirl {

// core/ sits below concepts/: what follows names no concept, so that the concepts (which
// speak of `model_set`, `step_info`) can include it and nothing here includes them back.
namespace detail {
template <class M>
struct critic_of { using type = void*; };
template <class M>
  requires requires(const M& m) { m.make_critic(); }
struct critic_of<M> { using type = std::remove_cvref_t<decltype(std::declval<const M&>().make_critic())>; };
}  // namespace detail

/// The critic type `M::make_critic()` builds (or `void*` when `M` builds none; see
/// `CriticFactory` in concepts/model.hpp).
template <class M>
using critic_t = typename detail::critic_of<M>::type;

/// The models a trainer holds, for a `ModelAdapter` `M` (concepts/model.hpp). Only what the
/// algorithm declared is built: `reference` when it `requires_reference` and uses it with the
/// current options, `critic` when it `requires_critic` and the model is a `CriticFactory`, `ema`
/// when it `requires_ema_rollout`.
template <class M>
struct model_set {
  M policy;
  std::optional<M> reference{};
  std::optional<critic_t<M>> critic{};
  std::optional<M> ema{};
};

namespace rollout {
class partial_rollouts;  // rollout/partial.hpp
}  // namespace rollout

/// Per-step information handed to the algorithm's stages.
struct step_info {
  std::int64_t step = 0;                 // 0-based index of the current trainer step
  std::int64_t group_size = 1;           // samples per prompt / condition
  torch::Device device = torch::kCPU;    // where rollouts and updates run
  std::map<std::string, double>* extra = nullptr;  // algorithm figures for the step statistics
  std::int64_t updates = 0;              // optimizer updates this step takes on its batch (0 = unknown);
                                         // 1: the update is on-policy (pi_old = pi_theta)
  std::map<std::string, torch::Tensor>* pending = nullptr;  // tensor figures the trainer reads at the step's end
  std::int64_t logprob_chunk = 0;        // sequences per chunk of the no-grad log-probs (reference, pi_old);
                                         // 0: all at once (trainer option memory.logprob_chunk)
  std::int64_t micro_batches = 1;        // > 1: loss() sees one of this many micro-batches of a minibatch
                                         // (gradient accumulation, trainer option micro_batch_size);
                                         // whole-minibatch statistics came from prepare_minibatch
  rollout::partial_rollouts* partial = nullptr;  // set: token completions are drawn through it, groups
                                                 // in flight carried across calls and weight versions
                                                 // (the split mode's worker_options::partial_rollouts)

  /// Reports a figure in this step's statistics (the last report of a key wins).
  void report(const std::string& key, double value) const {
    if (extra) (*extra)[key] = value;
  }
  /// Reports a scalar tensor figure without reading it: the trainer reads it with the step's other
  /// statistics (one host synchronisation per step). Without a trainer it is read at once.
  void report(const std::string& key, const torch::Tensor& value) const {
    if (pending) (*pending)[key] = value.detach().reshape({});
    else if (extra) (*extra)[key] = to_host(value).at(0);
  }
};

}  // namespace unirl

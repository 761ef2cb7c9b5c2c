#pragma once
/// \file trainer_options.hpp
/// `unirl::trainer_options<Algorithm>`: the run-time settings of a `unirl::trainer` — the
/// algorithm's own options, the update engine's (optimizer, schedule, clipping, guard, precision,
/// loss scale, micro-batches: train/update_engine.hpp), memory, the loop's sizes and its outputs.
/// Reflected (an accessor table for Boost.Hana), so recipes load, print and check them by key.
///
/// ```cpp
/// unirl::trainer_options<unirl::algo::grpo<>> o{.algorithm = {.clip_high = 0.28f}, .group_size = 8};
/// unirl::options::validate(o);   // config_error naming the key of a bad value
/// ```
#include <cstdint>
#include <exception>
#include <string>

#include <boost/hana.hpp>
#include <torch/torch.h>

#include <unirl/config.hpp>
#include <unirl/core/error.hpp>
#include <unirl/core/options.hpp>
#include <unirl/core/precision.hpp>
#include <unirl/train/clip.hpp>
#include <unirl/train/guard.hpp>
#include <unirl/train/loss_scaler.hpp>
#include <unirl/train/memory.hpp>
#include <unirl/train/optimizer.hpp>
#include <unirl/train/schedule.hpp>

namespace unirl {

/// Run-time settings of a `trainer<..., Algorithm, ...>`; an aggregate for designated initializers.
template <class Algorithm>
struct trainer_options {
  typename Algorithm::options algorithm{};  // the algorithm's own options
  train::optimizer_options optim{};         // AdamW and its parameter groups
  train::schedule_options schedule{};       // warmup + constant / linear / cosine
  train::clip_options clip{};               // global gradient-norm clipping
  train::guard_options guard{};             // NaN/Inf skips, loss and grad-norm spike monitor
  train::memory_options memory{};           // activation checkpointing, reference placement, tracker
  ::unirl::precision precision = ::unirl::precision::fp32;  // forwards and backward: fp32, bf16, fp16 (autocast;
                                                            // float32 master weights and optimizer state)
  train::loss_scale_options loss_scale{};   // dynamic loss scaling (with fp16; any precision with mode = on)
  std::int64_t group_size = Algorithm::requires_group ? 8 : 1;  // samples per prompt / condition
  std::int64_t epochs = 1;        // passes over each rollout batch
  std::int64_t minibatches = 1;   // optimizer steps per pass
  std::int64_t micro_batch_size = 0;  // samples per forward/backward inside a minibatch (gradient
                                      // accumulation, the same update); 0: the whole minibatch at once
  std::int64_t seed = 0;          // seeds LibTorch's generators (plus the rank)
  std::string device = "cpu";     // "cpu", "cuda", "cuda:1"
  std::string metrics_path{};     // JSONL, one object per step; empty: none
  std::string samples_path{};     // JSONL of sampled completions with their rewards (text batches:
                                  // prompt, completion, reference, reward), for the run report; empty: none
  std::int64_t samples_every = 10;  // steps between two writes of samples_path (steps 0, N, 2N, ...)
  std::int64_t samples_count = 4;   // samples written each time (the batch's first ones)
  bool progress = true;           // one-line progress display on stderr
  std::int64_t total_steps = 0;   // for the ETA, and the schedule when its total_steps is 0

  void validate(const std::string& p) const {
    options::require(group_size >= 1, p + "group_size", group_size, ">= 1");
    if constexpr (Algorithm::requires_group)
      options::require(group_size >= 2, p + "group_size", group_size,
                       ">= 2: this algorithm normalises rewards within a group");
    options::require(epochs >= 1, p + "epochs", epochs, ">= 1");
    options::require(minibatches >= 1, p + "minibatches", minibatches, ">= 1");
    options::require(micro_batch_size >= 0, p + "micro_batch_size", micro_batch_size,
                     ">= 0 (0: the whole minibatch in one forward)");
    if constexpr (!Algorithm::supports_multi_update)
      options::require(epochs * minibatches == 1, p + "epochs", epochs,
                       "1 with minibatches = 1: this algorithm is strictly on-policy");
    options::require(total_steps >= 0, p + "total_steps", total_steps, ">= 0");
    options::require(samples_every >= 1, p + "samples_every", samples_every, ">= 1");
    options::require(samples_count >= 1, p + "samples_count", samples_count, ">= 1");
    try {
      (void)torch::Device(device);
    } catch (const std::exception&) {
      throw config_error(p + "device", "value \"" + device + "\" is not a device: expected cpu, cuda or cuda:N");
    }
    check_precision_supported(precision, torch::Device(device), p + "precision");
  }
};

}  // namespace unirl

// trainer_options is a template, so BOOST_HANA_ADAPT_STRUCT cannot adapt it; this is the same
// accessor table the macro would generate.
namespace boost::hana {
template <class A>
struct accessors_impl<unirl::trainer_options<A>> {
#define UNIRL_MEMBER(name) \
  make_pair(BOOST_HANA_STRING(#name), [](auto&& s) -> decltype(auto) { return (static_cast<decltype(s)&&>(s).name); })
  static constexpr auto apply() {
    return make_tuple(UNIRL_MEMBER(algorithm), UNIRL_MEMBER(optim), UNIRL_MEMBER(schedule), UNIRL_MEMBER(clip),
                      UNIRL_MEMBER(guard), UNIRL_MEMBER(memory), UNIRL_MEMBER(precision), UNIRL_MEMBER(loss_scale),
                      UNIRL_MEMBER(group_size), UNIRL_MEMBER(epochs), UNIRL_MEMBER(minibatches),
                      UNIRL_MEMBER(micro_batch_size), UNIRL_MEMBER(seed), UNIRL_MEMBER(device),
                      UNIRL_MEMBER(metrics_path), UNIRL_MEMBER(samples_path), UNIRL_MEMBER(samples_every),
                      UNIRL_MEMBER(samples_count), UNIRL_MEMBER(progress), UNIRL_MEMBER(total_steps));
  }
#undef UNIRL_MEMBER
};
}  // namespace boost::hana

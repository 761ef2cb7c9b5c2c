#pragma once
/// \file model.hpp
/// Model adapters: what the trainer needs from a model, whatever its modality.
#include <concepts>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

namespace unirl {

/// (name, tensor) pairs in a stable order: checkpoints and parameter groups key on the names.
using named_tensors = std::vector<std::pair<std::string, torch::Tensor>>;

/// A set of trainable weights the trainer can optimise, copy, checkpoint and move.
///
/// Minimal complete definition:
/// - `std::vector<torch::Tensor> parameters() const` — the trainable tensors;
/// - `named_tensors named_parameters() const` and `named_tensors named_buffers() const`;
/// - `T clone() const` — a deep copy (reference model, EMA copy);
/// - `void train(bool on)` and `void to(torch::Device device)`.
///
/// `unirl::models::module_adapter<Net>` provides all of it for any cloneable `torch::nn` module.
template <class T>
concept TrainableModule = std::move_constructible<T> && requires(T& m, const T& cm, torch::Device d) {
  { cm.parameters() } -> std::convertible_to<std::vector<torch::Tensor>>;
  { cm.named_parameters() } -> std::convertible_to<named_tensors>;
  { cm.named_buffers() } -> std::convertible_to<named_tensors>;
  { cm.clone() } -> std::same_as<T>;
  m.train(true);
  m.to(d);
};

/// A model adapter: a `TrainableModule` that declares the track it belongs to.
///
/// Minimal complete definition: `TrainableModule` plus `typename M::track`, a track tag whose
/// `rollout_type` is the rollout batch its samplers fill (`token_track`, `flow_track`,
/// `env_track`, or a user-defined track). Optional: `make_critic()` returning a
/// `TrainableModule` (built only when the algorithm `requires_critic`).
template <class M>
concept ModelAdapter = TrainableModule<M> && requires { typename M::track; typename M::track::rollout_type; };

/// The rollout batch type of a model's track.
template <ModelAdapter M>
using rollout_t = typename M::track::rollout_type;

/// A model that can build a separate critic (value model) for algorithms that need one.
template <class M>
concept CriticFactory = ModelAdapter<M> && requires(const M& m) {
  { m.make_critic() } -> TrainableModule;
};

}  // namespace unirl

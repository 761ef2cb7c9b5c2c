#pragma once
/// \file model_set_builder.hpp
/// The model-set builder: from a policy and an algorithm's declarations (`requires_reference`
/// with `uses_reference()`, `requires_critic`, `requires_ema_rollout`) it builds the `model_set`
/// the algorithm needs — the critic, the frozen reference (or, for a policy with LoRA adapters,
/// the policy itself, scored with the adapters off), the EMA copy — on the training device, with
/// every rank starting from rank 0's weights; and it names, saves, loads and syncs their state.
///
/// ```cpp
/// unirl::model_set<my_model> ms{policy};
/// auto layout = unirl::train::build_model_set(ms, algorithm, memory, device, "cpu", parallel);
/// engine.bind(unirl::train::trainable_parameters(ms), "trainer");
/// unirl::train::save_models(archive, ms, layout);
/// ```
#include <concepts>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include <torch/torch.h>

#include <unirl/concepts/model.hpp>
#include <unirl/concepts/parallel.hpp>
#include <unirl/concepts/track.hpp>
#include <unirl/core/context.hpp>
#include <unirl/core/error.hpp>
#include <unirl/models/activation_checkpoint.hpp>
#include <unirl/models/lora.hpp>
#include <unirl/train/checkpoint.hpp>
#include <unirl/train/memory.hpp>

namespace unirl::train {

/// What `build_model_set` decided: whether the reference is the policy with its LoRA adapters
/// off (no second copy of the weights; nothing of it is saved), and the reference's bytes.
struct model_set_layout {
  bool reference_shared = false;
  std::int64_t reference_bytes = 0;
};

/// A module's parameters and buffers, by name.
template <class T>
named_tensors state_of(const T& m) {
  named_tensors all = m.named_parameters();
  for (auto& b : m.named_buffers()) all.push_back(b);
  return all;
}

/// A copy of `m` that trains nothing: no gradients, evaluation mode.
template <class M>
M frozen_copy(const M& m) {
  M c = m.clone();
  for (auto& p : c.parameters()) p.set_requires_grad(false);
  c.train(false);
  return c;
}

/// The parameters the optimizer trains: the policy's, then the critic's under "critic.".
template <class M>
named_tensors trainable_parameters(const model_set<M>& ms) {
  named_tensors named = ms.policy.named_parameters();
  if constexpr (CriticFactory<M>)
    if (ms.critic)
      for (auto& [n, t] : ms.critic->named_parameters()) named.emplace_back("critic." + n, t);
  return named;
}

/// The policy's (and critic's) parameters and buffers: what rank 0 broadcasts at construction.
template <class M>
named_tensors trainable_state(const model_set<M>& ms) {
  named_tensors all = state_of(ms.policy);
  if constexpr (CriticFactory<M>)
    if (ms.critic)
      for (auto& [n, t] : state_of(*ms.critic)) all.emplace_back("critic." + n, t);
  return all;
}

namespace detail {
template <class M>
inline constexpr bool trains_tokens = requires { requires std::is_same_v<typename M::track, token_track>; };

// The reference model: a frozen copy of the policy, or — for a policy with LoRA adapters — the
// policy itself (no second copy of the weights), which the algorithms score with the adapters
// switched off (lora::without_adapters): the base model.
template <class M>
M reference_of(const M& m, const memory_options& memory, torch::Device device, const std::string& device_text,
               model_set_layout& layout) {
  if constexpr (std::copy_constructible<M>) {
    if (lora::has_adapters(m.named_parameters())) {
      if (!memory.reference_device.empty() && torch::Device(memory.reference_device) != device)
        throw config_error("memory.reference_device",
                           "value \"" + memory.reference_device + "\": the reference of a model with LoRA "
                           "adapters is the policy's own weights with the adapters off; expected empty or \"" +
                               device_text + "\"");
      layout.reference_shared = true;
      return m;
    }
  }
  return frozen_copy(m);
}

// Moves the frozen reference to `memory.reference_device` (when set).
template <class M>
void place_reference(M& reference, const memory_options& memory, torch::Device device, const std::string& device_text) {
  if (memory.reference_device.empty()) return;
  const torch::Device d(memory.reference_device);
  if (d != device && !trains_tokens<M>)
    throw config_error("memory.reference_device",
                       "value \"" + memory.reference_device + "\" differs from device = \"" + device_text +
                           "\", but only the token track computes reference log-probs off the training device; "
                           "expected empty or \"" + device_text + "\"");
  if (d.is_cuda() && (!torch::cuda::is_available() || d.index() >= static_cast<int>(torch::cuda::device_count())))
    throw config_error("memory.reference_device",
                       "value \"" + memory.reference_device + "\" names a CUDA device this process does not see");
  reference.to(d);
}
}  // namespace detail

/// Builds in `ms` (whose policy is set) what algorithm `a` declares it needs, on `device`
/// (`device_text`: its option's text, for messages): activation checkpointing on the policy (the
/// critic copies it), the critic, the broadcast of rank 0's policy and critic state over
/// `parallel`, then the reference (placed on `memory.reference_device`) and the EMA copy.
template <class A, class M, class Parallel>
model_set_layout build_model_set(model_set<M>& ms, const A& a, const memory_options& memory, torch::Device device,
                                 const std::string& device_text, Parallel& parallel) {
  model_set_layout layout;
  models::enable_checkpointing(ms.policy, memory.checkpointing);  // the critic copies it
  ms.policy.to(device);
  if constexpr (A::requires_critic && CriticFactory<M>) {
    ms.critic.emplace(ms.policy.make_critic());
    ms.critic->to(device);
  }
  // Every rank starts from rank 0's parameters (trainable or frozen) and buffers, before the
  // reference and EMA copies are made from the policy.
  std::vector<torch::Tensor> state;
  for (auto& [n, t] : trainable_state(ms)) {
    (void)n;
    state.push_back(t);
  }
  parallel.broadcast(state, 0);
  if constexpr (A::requires_reference) {
    bool use = true;
    if constexpr (requires { { a.uses_reference() } -> std::convertible_to<bool>; }) use = a.uses_reference();
    if (use) ms.reference.emplace(detail::reference_of(ms.policy, memory, device, device_text, layout));
    if (ms.reference && !layout.reference_shared) {
      detail::place_reference(*ms.reference, memory, device, device_text);
      layout.reference_bytes = state_bytes(*ms.reference);
    }
  }
  if constexpr (A::requires_ema_rollout) ms.ema.emplace(frozen_copy(ms.policy));
  return layout;
}

/// Rank 0's buffers on every rank (BatchNorm statistics, any registered buffer change with each
/// rank's own data and get no gradient all-reduce), as PyTorch's DDP does with broadcast_buffers.
/// Looked up each time, so a module that replaces a buffer is seen.
template <class M, class Parallel>
void sync_buffers(model_set<M>& ms, Parallel& parallel) {
  if (parallel.world_size() <= 1) return;
  std::vector<torch::Tensor> buffers;
  for (auto& [n, b] : ms.policy.named_buffers()) {
    (void)n;
    buffers.push_back(b);
  }
  if constexpr (CriticFactory<M>)
    if (ms.critic)
      for (auto& [n, b] : ms.critic->named_buffers()) {
        (void)n;
        buffers.push_back(b);
      }
  if (!buffers.empty()) parallel.broadcast(buffers, 0);
}

/// Writes the models' state under `policy.`, `reference.` (a frozen copy only), `ema.`, `critic.`.
template <class M>
void save_models(torch::serialize::OutputArchive& a, const model_set<M>& ms, const model_set_layout& layout) {
  save_tensors(a, "policy.", state_of(ms.policy));
  if (ms.reference && !layout.reference_shared) save_tensors(a, "reference.", state_of(*ms.reference));
  if (ms.ema) save_tensors(a, "ema.", state_of(*ms.ema));
  if constexpr (CriticFactory<M>)
    if (ms.critic) save_tensors(a, "critic.", state_of(*ms.critic));
}

/// Restores what `save_models` wrote.
template <class M>
void load_models(torch::serialize::InputArchive& a, model_set<M>& ms, const model_set_layout& layout) {
  load_tensors(a, "policy.", state_of(ms.policy));
  if (ms.reference && !layout.reference_shared) load_tensors(a, "reference.", state_of(*ms.reference));
  if (ms.ema) load_tensors(a, "ema.", state_of(*ms.ema));
  if constexpr (CriticFactory<M>)
    if (ms.critic) load_tensors(a, "critic.", state_of(*ms.critic));
}

}  // namespace unirl::train

#pragma once
/// \file activation_checkpoint.hpp
/// Activation checkpointing: a block's forward keeps none of its intermediate activations; the
/// backward runs the block again (with the random-number state of the first run, so dropout
/// draws the same mask) and differentiates that. Memory falls from every block's activations to
/// the blocks' inputs plus one block's activations, for one more forward per block.
///
/// Models offer it per module *kind* (`checkpoint_kind`): the decoder blocks of the token
/// models (`models::gpt`, `models::hf::causal_lm`), the blocks of the flow nets
/// (`models/flow_nets.hpp`), and any kind a model of one's own declares (the vision tower of a
/// vision-language model, say). A model that offers it has `set_checkpointing(kinds)` and
/// `checkpointing_kinds()`; the trainer sets it from `memory.checkpointing`.
///
/// ```cpp
/// unirl::models::gpt lm({.n_layer = 12, .d_model = 256});
/// lm.set_checkpointing({unirl::models::checkpoint_kind::decoder_blocks});
/// // or, in a trainer:  {.memory = {.checkpointing = {"decoder_blocks"}}}
///
/// // a block of one's own:
/// auto y = unirl::models::checkpoint([&](const torch::autograd::variable_list& in) {
///   return torch::autograd::variable_list{block->forward(in[0])};
/// }, {x}, block->parameters())[0];
/// ```
/// Only a forward with gradients (an update) is checkpointed; sampling and the reference run the
/// plain path. A KV-cached forward with gradients (the prompt-sharing update layout) is
/// checkpointed too: the block becomes a function of its input and copies of the keys and values
/// so far, and its new keys and values are written into the cache after it. The outputs are the
/// plain path's (bit for bit without a cache); the gradients are those of the plain path (the
/// same operations, run again).
#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <ATen/autocast_mode.h>
#include <torch/torch.h>

#include <unirl/core/error.hpp>
#include <unirl/detail/compat.hpp>

namespace unirl::models {

/// The module kinds models offer for checkpointing. A model of one's own may name others.
namespace checkpoint_kind {
inline constexpr std::string_view decoder_blocks = "decoder_blocks";  // transformer blocks of a token model
inline constexpr std::string_view flow_blocks = "flow_blocks";        // residual blocks of a flow net
inline constexpr std::string_view vision_tower = "vision_tower";      // the image encoder of a vision-language model
}  // namespace checkpoint_kind

/// Whether `kinds` asks for `kind`.
inline bool wants_checkpointing(const std::vector<std::string>& kinds, std::string_view kind) {
  return std::find(kinds.begin(), kinds.end(), kind) != kinds.end();
}

/// Throws `config_error` for `memory.checkpointing` unless every entry of `kinds` is one of
/// `offered` (the kinds `model` offers).
inline void check_checkpointing_kinds(const std::vector<std::string>& kinds, const std::vector<std::string>& offered,
                                      const std::string& model) {
  for (const auto& k : kinds) {
    if (std::find(offered.begin(), offered.end(), k) != offered.end()) continue;
    std::string list;
    for (const auto& o : offered) list += (list.empty() ? "" : ", ") + o;
    throw config_error("memory.checkpointing", "kind \"" + k + "\" is not offered by " + model + ": expected one of " +
                                                   (list.empty() ? std::string("(none)") : list));
  }
}

namespace detail {

/// The random-number state a checkpointed block's first run started from: the CPU generator's,
/// and the CUDA generator's of each CUDA device among the block's inputs.
struct rng_snapshot {
  std::vector<std::pair<torch::Device, torch::Tensor>> states;

  static rng_snapshot take(const torch::autograd::variable_list& inputs) {
    rng_snapshot s;
    s.add(torch::Device(torch::kCPU));
    for (const auto& t : inputs)
      if (t.defined() && t.is_cuda()) s.add(t.device());
    return s;
  }
  void add(torch::Device d) {
    for (const auto& [dev, st] : states)
      if (dev == d) return;
    auto gen = at::globalContext().defaultGenerator(d);
    std::lock_guard<std::mutex> lock(gen.mutex());
    states.emplace_back(d, gen.get_state());
  }
  /// Sets every generator to its saved state; returns the states they had.
  rng_snapshot swap_in() const {
    rng_snapshot before;
    for (const auto& [dev, st] : states) {
      auto gen = at::globalContext().defaultGenerator(dev);
      std::lock_guard<std::mutex> lock(gen.mutex());
      before.states.emplace_back(dev, gen.get_state());
      gen.set_state(st);
    }
    return before;
  }
};

/// Autocast (mixed precision) settings of CPU and CUDA: the recomputation runs under those of
/// the first run.
struct autocast_snapshot {
  bool cpu = false, cuda = false;
  at::ScalarType cpu_dtype = at::kBFloat16, cuda_dtype = at::kHalf;

  static autocast_snapshot take() {
    autocast_snapshot s;
#if UNIRL_TORCH_VERSION_AT_LEAST(2, 4)
    s.cpu = at::autocast::is_autocast_enabled(at::kCPU);
    s.cuda = at::autocast::is_autocast_enabled(at::kCUDA);
    s.cpu_dtype = at::autocast::get_autocast_dtype(at::kCPU);
    s.cuda_dtype = at::autocast::get_autocast_dtype(at::kCUDA);
#else
    s.cpu = at::autocast::is_cpu_enabled();
    s.cuda = at::autocast::is_enabled();
    s.cpu_dtype = at::autocast::get_autocast_cpu_dtype();
    s.cuda_dtype = at::autocast::get_autocast_gpu_dtype();
#endif
    return s;
  }
  void apply() const {
#if UNIRL_TORCH_VERSION_AT_LEAST(2, 4)
    at::autocast::set_autocast_enabled(at::kCPU, cpu);
    at::autocast::set_autocast_enabled(at::kCUDA, cuda);
    at::autocast::set_autocast_dtype(at::kCPU, cpu_dtype);
    at::autocast::set_autocast_dtype(at::kCUDA, cuda_dtype);
#else
    at::autocast::set_cpu_enabled(cpu);
    at::autocast::set_enabled(cuda);
    at::autocast::set_autocast_cpu_dtype(cpu_dtype);
    at::autocast::set_autocast_gpu_dtype(cuda_dtype);
#endif
  }
};

/// What the backward of a checkpointed block needs besides its saved inputs (kept in the
/// autograd node's context as a capsule, so it dies with the node).
struct checkpoint_state : torch::CustomClassHolder {
  std::function<torch::autograd::variable_list(const torch::autograd::variable_list&)> fn;
  std::vector<torch::Tensor> params;  // the block's parameters (the very tensors `fn` reads)
  rng_snapshot rng;
  autocast_snapshot autocast;
};

/// The autograd function: forward runs the block and keeps its inputs only; backward runs it
/// again and differentiates it with respect to the inputs and parameters that need gradients.
/// Arguments: the state, the block's inputs, its parameters (inputs of the node so that their
/// gradients flow through the ordinary engine, hooks and accumulation included).
struct checkpoint_function : torch::autograd::Function<checkpoint_function> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                c10::intrusive_ptr<checkpoint_state> state, at::TensorList inputs,
                                                at::TensorList params) {
    (void)params;  // the same tensors as state->params
    const torch::autograd::variable_list in(inputs.begin(), inputs.end());
    state->rng = rng_snapshot::take(in);
    state->autocast = autocast_snapshot::take();
    torch::autograd::variable_list outs;
    {
      // With gradients, as the plain path runs (some ops take another path without them), on
      // detached inputs: the graph this builds dies with `outs` below, its activations with it.
      torch::AutoGradMode grad(true);
      torch::autograd::variable_list detached;
      for (const auto& t : in) detached.push_back(t.defined() ? t.detach() : t);
      outs = state->fn(detached);
    }
    for (auto& o : outs) o = o.detach();
    ctx->save_for_backward(in);
    ctx->saved_data["state"] = c10::IValue::make_capsule(std::move(state));
    return outs;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    UNIRL_CHECK(ctx->saved_data.count("state") == 1, "activation checkpoint: backward ran twice through a ",
                "checkpointed block (retain_graph is not supported with checkpointing)");
    const auto state = c10::static_intrusive_pointer_cast<checkpoint_state>(ctx->saved_data["state"].toCapsule());
    ctx->saved_data.erase("state");
    const auto saved = ctx->get_saved_variables();
    torch::autograd::variable_list inputs;
    std::vector<std::size_t> input_slots;  // the inputs that need a gradient
    for (std::size_t i = 0; i < saved.size(); ++i) {
      const auto& t = saved[i];
      if (!t.defined()) {
        inputs.push_back(t);
        continue;
      }
      auto d = t.detach();
      if (t.requires_grad()) {
        d.set_requires_grad(true);
        input_slots.push_back(i);
      }
      inputs.push_back(d);
    }
    torch::autograd::variable_list outs;
    {
      torch::AutoGradMode grad(true);
      const auto before = state->rng.swap_in();  // the first run's random numbers (dropout masks)
      const auto autocast_before = autocast_snapshot::take();
      state->autocast.apply();
      try {
        outs = state->fn(inputs);
      } catch (...) {
        autocast_before.apply();
        (void)before.swap_in();
        throw;
      }
      autocast_before.apply();
      (void)before.swap_in();
    }
    torch::autograd::variable_list ys, gs, xs;
    for (std::size_t i = 0; i < outs.size() && i < grad_out.size(); ++i)
      if (outs[i].defined() && outs[i].requires_grad() && grad_out[i].defined()) {
        ys.push_back(outs[i]);
        gs.push_back(grad_out[i]);
      }
    for (const auto i : input_slots) xs.push_back(inputs[i]);
    std::vector<std::size_t> param_slots;
    for (std::size_t j = 0; j < state->params.size(); ++j)
      if (state->params[j].requires_grad()) {
        xs.push_back(state->params[j]);
        param_slots.push_back(j);
      }
    torch::autograd::variable_list g;
    if (!ys.empty() && !xs.empty())
      g = torch::autograd::grad(ys, xs, gs, /*retain_graph=*/false, /*create_graph=*/false, /*allow_unused=*/true);
    // One gradient per forward argument: the state (none), every input, every parameter.
    torch::autograd::variable_list result(1 + saved.size() + state->params.size());
    std::size_t k = 0;
    for (const auto i : input_slots) result[1 + i] = g.empty() ? torch::Tensor() : g[k++];
    for (const auto j : param_slots) result[1 + saved.size() + j] = g.empty() ? torch::Tensor() : g[k++];
    return result;
  }
};

}  // namespace detail

/// Runs `fn(inputs)` as one checkpointed block: its activations are not kept, the backward runs
/// it again. `params` are the parameters `fn` reads (a module's `parameters()`); gradients reach
/// them and every input that requires one. `fn` must capture nothing by reference that may die
/// before the backward (pass tensors as inputs, capture module holders by value), and must not
/// change state outside its outputs (a KV cache, running statistics). Without gradients
/// (`torch::NoGradGuard`) it is `fn(inputs)`.
inline torch::autograd::variable_list checkpoint(
    std::function<torch::autograd::variable_list(const torch::autograd::variable_list&)> fn,
    const torch::autograd::variable_list& inputs, const std::vector<torch::Tensor>& params) {
  if (!torch::GradMode::is_enabled()) return fn(inputs);
  auto state = c10::make_intrusive<detail::checkpoint_state>();
  state->fn = std::move(fn);
  state->params = params;
  return detail::checkpoint_function::apply(state, at::TensorList(inputs), at::TensorList(params));
}

}  // namespace unirl::models

namespace unirl::models {

/// Turns on activation checkpointing of `kinds` in `model` (an empty list: off), through the
/// model's `set_checkpointing(kinds)` or its net's (`module_adapter::net()`). Throws
/// `config_error` for `memory.checkpointing` when kinds are asked of a model that offers none.
template <class M>
void enable_checkpointing(M& model, const std::vector<std::string>& kinds) {
  if constexpr (requires { model.set_checkpointing(kinds); }) {
    model.set_checkpointing(kinds);
  } else if constexpr (requires { model.net()->set_checkpointing(kinds); }) {
    model.net()->set_checkpointing(kinds);
  } else if (!kinds.empty()) {
    throw config_error("memory.checkpointing", "kind \"" + kinds.front() +
                                                   "\": this model offers no activation checkpointing (it has no "
                                                   "set_checkpointing(kinds), nor has its net()); expected an empty list");
  }
}

}  // namespace unirl::models

#pragma once
/// \file flow.hpp
/// Everything the flow track (image and video diffusion / flow matching) needs, with the
/// trainer: Flow-GRPO (and DanceGRPO through its sampler), Flow-DPPO, RAM, DiffusionNFT, the
/// flow-matching, DDPM and video adapters with their built-in networks, the ODE / SDE / DDIM
/// samplers and the Fréchet distance. Flow types live in `unirl::` as the token and env
/// track's do (`unirl::flow_rollout`, `unirl::flow_track`, `unirl::sde::flow_grpo`,
/// `unirl::sample_trajectory`); the algorithms and their free losses in `unirl::algo`.
///
/// ```cpp
/// #include <unirl/flow.hpp>
/// using model_t = unirl::models::flow_model<unirl::models::mlp_velocity_net>;
/// unirl::trainer<model_t, unirl::algo::flow_grpo<>, my_reward> t{model, reward, {.group_size = 8}};
/// auto stats = t.step(labels);   // (N,) conditions, each drawn group_size times
/// ```
#include <unirl/trainer.hpp>

#include <unirl/algorithms/diffusion_nft.hpp>
#include <unirl/algorithms/flow_common.hpp>
#include <unirl/algorithms/flow_dppo.hpp>
#include <unirl/algorithms/flow_grpo.hpp>
#include <unirl/algorithms/ram.hpp>
#include <unirl/concepts/flow.hpp>
#include <unirl/concepts/flow_sampler.hpp>
#include <unirl/eval/frechet.hpp>
#include <unirl/models/flow.hpp>
#include <unirl/models/flow_nets.hpp>
#include <unirl/rollout/flow.hpp>
#include <unirl/rollout/flow_samplers.hpp>

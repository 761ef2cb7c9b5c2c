#pragma once
/// \file flow.hpp
/// Models of the flow track (image / video diffusion and flow matching): what the samplers need
/// from a model (`VelocityModel`, `NoiseModel`) and what the built-in adapters need from a
/// network (`ConditionalNet`).
///
/// ```cpp
/// static_assert(unirl::VelocityModel<unirl::models::flow_model<unirl::models::mlp_velocity_net>>);
/// template <unirl::NoiseModel M> torch::Tensor denoise(M& m, const torch::Tensor& x);
/// ```
/// The names are also reachable as `unirl::models::VelocityModel` etc. (their former home).
#include <concepts>
#include <cstdint>
#include <vector>

#include <torch/torch.h>

namespace unirl {

/// A model that predicts the flow-matching velocity.
///
/// Minimal complete definition: `torch::Tensor velocity(x, t, cond)` (x: (B, S...), t: (B,)
/// float in [0, 1]) and `std::vector<std::int64_t> sample_shape() const`.
template <class M>
concept VelocityModel = requires(M& m, const M& cm, const torch::Tensor& x) {
  { m.velocity(x, x, x) } -> std::same_as<torch::Tensor>;
  { cm.sample_shape() } -> std::convertible_to<std::vector<std::int64_t>>;
};

/// A DDPM model that predicts the noise.
///
/// Minimal complete definition: `torch::Tensor epsilon(x, t, cond)` (t: (B,) timestep indices
/// 0..T-1), `torch::Tensor alphas_cumprod() const` ((T,) float64), `sample_shape()`.
template <class M>
concept NoiseModel = requires(M& m, const M& cm, const torch::Tensor& x) {
  { m.epsilon(x, x, x) } -> std::same_as<torch::Tensor>;
  { cm.alphas_cumprod() } -> std::same_as<torch::Tensor>;
  { cm.sample_shape() } -> std::convertible_to<std::vector<std::int64_t>>;
};

/// A network usable by the built-in flow adapters (models/flow.hpp): a `torch::nn::ModuleHolder`
/// with `torch::Tensor forward(x, t, cond)` (t a (B,) float tensor in [0, 1]) and
/// `torch::Tensor null_condition(cond)`, the unconditional condition of the same shape.
template <class Net>
concept ConditionalNet = requires(Net& n, const torch::Tensor& x) {
  { n->forward(x, x, x) } -> std::same_as<torch::Tensor>;
  { n->null_condition(x) } -> std::same_as<torch::Tensor>;
};

namespace models {
using unirl::ConditionalNet;
using unirl::NoiseModel;
using unirl::VelocityModel;
}  // namespace models

}  // namespace unirl

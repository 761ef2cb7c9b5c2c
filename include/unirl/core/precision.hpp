#pragma once
/// \file precision.hpp
/// Mixed precision (docs/training.md, "Mixed precision"): the `precision` a trainer runs its
/// forwards in, the scope that turns LibTorch's autocast on for it, and `upcast`, which a model
/// calls where a sum must be taken in float32 whatever the forward's precision (norms).
///
/// Under `bf16` / `fp16` the weights stay float32 (the master copy the optimizer updates, with
/// float32 moments); autocast runs matrix products and convolutions in the lower precision and
/// casts the float32 weights on the fly. What accumulates stays float32: the models' norms take
/// `upcast(x)`, the log-probabilities are taken from float32 logits (rollout/token_logprob.hpp),
/// attention scores meet a float32 bias (so the softmax runs in float32), and the losses follow
/// their float32 log-probs and advantages.
///
/// ```cpp
/// {
///   unirl::autocast_scope amp(torch::kCPU, unirl::precision::bf16);   // forward in bfloat16
///   loss = model_loss(...);
/// }
/// loss.backward();                                                    // float32 gradients
/// auto h = ln(unirl::upcast(x));                                      // in a model: the norm in float32
/// ```
#include <array>
#include <string>
#include <string_view>
#include <tuple>

#include <torch/torch.h>

#include <unirl/core/error.hpp>
#include <unirl/core/options.hpp>
#include <unirl/detail/compat.hpp>

namespace unirl {

/// The precision of the forward and backward passes. The weights and the optimizer state are
/// float32 in every mode.
enum class precision {
  fp32,  // everything in float32
  bf16,  // autocast to bfloat16 (CPU and CUDA); no loss scaling needed (float32's exponent range)
  fp16   // autocast to float16 with dynamic loss scaling (CUDA; CPU from LibTorch 2.4)
};

}  // namespace unirl

template <>
inline constexpr std::array unirl::enum_names<unirl::precision>{std::string_view{"fp32"}, std::string_view{"bf16"},
                                                                  std::string_view{"fp16"}};

namespace unirl {

/// The lower-precision dtype of `p` (float32 for `fp32`).
inline torch::ScalarType precision_dtype(precision p) {
  switch (p) {
    case precision::bf16: return torch::kBFloat16;
    case precision::fp16: return torch::kHalf;
    case precision::fp32: break;
  }
  return torch::kFloat;
}

/// `x` in float32 when it is a lower-precision float (float16, bfloat16); otherwise `x` itself
/// (float32 and float64 untouched: a float64 check of a model stays float64). A model calls it on
/// the input of a norm, so that the norm's statistics are taken in float32 under autocast.
inline torch::Tensor upcast(const torch::Tensor& x) {
  if (!x.defined()) return x;
  const auto t = x.scalar_type();
  return t == torch::kBFloat16 || t == torch::kHalf ? x.to(torch::kFloat) : x;
}

/// Throws `config_error` for `key` when `p` cannot run on `device` with this LibTorch.
inline void check_precision_supported(precision p, const torch::Device& device, const std::string& key) {
  if (p == precision::fp32 || device.is_cuda()) return;
  if (!device.is_cpu())
    throw config_error(key, detail::concat("value ", enum_to_string(p), " on device ", device.str(),
                                           ": autocast covers cpu and cuda; expected fp32 there"));
  if (!detail::compat::cpu_autocast_supports(precision_dtype(p)))
    throw config_error(key, detail::concat("value ", enum_to_string(p), " on the CPU needs LibTorch >= 2.4 (this is ",
                                           TORCH_VERSION, ", whose CPU autocast takes bfloat16 only); expected bf16 ",
                                           "or fp32 on the CPU, or a cuda device"));
}

/// Turns autocast on for `device`'s type with `p`'s dtype for its lifetime (nothing for `fp32`),
/// restoring the previous state (and clearing autocast's cast cache when the outermost scope ends,
/// as `torch.autocast` does).
class autocast_scope {
 public:
  autocast_scope(const torch::Device& device, precision p) {
    if (p == precision::fp32) return;
    type_ = device.is_cuda() ? c10::DeviceType::CUDA : c10::DeviceType::CPU;
    std::tie(was_on_, was_dtype_) = detail::compat::autocast_state(type_);
    detail::compat::set_autocast(type_, true, precision_dtype(p));
    at::autocast::increment_nesting();
    active_ = true;
  }
  ~autocast_scope() {
    if (!active_) return;
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    detail::compat::set_autocast(type_, was_on_, was_dtype_);
  }
  autocast_scope(const autocast_scope&) = delete;
  autocast_scope& operator=(const autocast_scope&) = delete;

 private:
  bool active_ = false, was_on_ = false;
  c10::DeviceType type_ = c10::DeviceType::CPU;
  at::ScalarType was_dtype_ = at::kBFloat16;
};

}  // namespace unirl

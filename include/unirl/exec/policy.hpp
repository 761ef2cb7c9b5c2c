#pragma once
/// \file policy.hpp
/// The execution policies — `exec::automatic` (default), `exec::reference`, `exec::cpu`,
/// `exec::cuda`, `exec::small_net` — and `exec::dispatch`, the one place where an op's
/// implementation is chosen.
///
/// ```cpp
/// auto [logp, ent] = unirl::ops::token_logprob<unirl::exec::reference>(logits, targets);  // test oracle
/// auto a = unirl::algo::group_advantage<unirl::exec::reference>(rewards, 8);
/// using algo = unirl::algo::grpo<unirl::exec::reference>;   // every op of a GRPO step on the reference
/// ```
/// An algorithm takes the policy as a template argument and passes it to every op it calls
/// (token log-prob, losses, advantages). The model's own forward (`ops::attention` inside
/// `models::gpt`) keeps `exec::automatic`: a model is not parameterised by the algorithm's policy.
#include <cstdint>
#include <functional>
#include <type_traits>
#include <utility>

#include <torch/torch.h>

#include <unirl/concepts/execution.hpp>

namespace unirl::exec {

/// LibTorch composite ops; runs anywhere; the test oracle.
struct reference {
  static backend select(const torch::Tensor&) { return backend::reference; }
};
/// Fused CPU loops where an op has them, else the reference.
struct cpu {
  static backend select(const torch::Tensor&) { return backend::cpu; }
};
/// CUDA kernels where an op has them, else the reference. Needs the kernels built
/// (`-DUNIRL_ENABLE_CUDA=ON`, the unirl::cuda target): without them an op called with
/// `exec::cuda` does not compile (`cuda_kernels_built`), rather than run the reference unasked.
struct cuda {
  static backend select(const torch::Tensor&) { return backend::cuda; }
};
/// Picks by the tensor's device: CUDA kernels for CUDA tensors, fused CPU loops otherwise. An op
/// may keep its reference where it measured faster for the size at hand (attention on long
/// sequences); an explicit `exec::cpu` / `exec::cuda` always takes the op's own implementation.
struct automatic {
  static backend select(const torch::Tensor& t) { return t.is_cuda() ? backend::cuda : backend::cpu; }
};

/// The env track's small-network kernels (ops/small_net.hpp: forward, backward, PPO loss and
/// Adam on Eigen, no autograd) for an actor-critic of the known forms (`models::actor_critic`
/// with a categorical or diagonal-Gaussian head on the CPU), whatever its size; tensor ops
/// elsewhere take the fused CPU loops. `exec::automatic` picks these kernels for such a network
/// when it is small (`small_net_fits`); LibTorch stays the reference path.
struct small_net {
  static backend select(const torch::Tensor&) { return backend::cpu; }
};

/// The size under which `exec::automatic` trains an actor-critic of the known forms on the
/// small-network kernels: every hidden width <= 256 and at most 100k parameters. Measured at
/// CleanRL's 64 x 64 (docs/performance.md): a 128-row minibatch update 3.8x, a rollout step 13x
/// and a whole PPO iteration 5.8x faster than LibTorch on one thread. The bound keeps the
/// kernels where per-operator overhead dominates; where LibTorch's own GEMMs (threaded, wider
/// SIMD) overtake them on wide layers was not measured.
inline constexpr std::int64_t small_net_max_width = 256;
inline constexpr std::int64_t small_net_max_parameters = 100000;
/// True when a network of hidden widths up to `max_width` and `parameters` parameters is small.
constexpr bool small_net_fits(std::int64_t max_width, std::int64_t parameters) {
  return max_width <= small_net_max_width && parameters <= small_net_max_parameters;
}

/// True when unirl was built with its CUDA kernels (`-DUNIRL_ENABLE_CUDA=ON` defines
/// `UNIRL_WITH_CUDA_KERNELS`). `exec::automatic` runs the reference on CUDA tensors without them.
#if defined(UNIRL_WITH_CUDA_KERNELS)
inline constexpr bool cuda_kernels_built = true;
#else
inline constexpr bool cuda_kernels_built = false;
#endif

static_assert(ExecutionPolicy<reference>);
static_assert(ExecutionPolicy<cpu>);
static_assert(ExecutionPolicy<cuda>);
static_assert(ExecutionPolicy<automatic>);
static_assert(ExecutionPolicy<small_net>);

/// True for `exec::automatic`, the policy that may weigh sizes (an explicit policy is obeyed).
template <ExecutionPolicy Exec>
inline constexpr bool decides_by_size = std::is_same_v<Exec, automatic>;

/// Sentinel of `dispatch` for an implementation an op does not have.
struct none_t {};
inline constexpr none_t none{};

/// Runs the implementation of an op that `Exec` selects for its main input `t`: `cpu_impl()` when
/// the policy selects `backend::cpu` and `t` is on the CPU, `cuda_impl()` when it selects
/// `backend::cuda` and `t` is a CUDA tensor, `reference_impl()` otherwise — and whenever the op has
/// no such implementation (`exec::none`). Every implementation returns the same type.
/// `dispatch<exec::cuda>` does not compile in a build without the CUDA kernels.
/// ```cpp
/// return unirl::exec::dispatch<Exec>(logits, [&] { return ref(logits); }, [&] { return fused(logits); });
/// ```
template <ExecutionPolicy Exec, class Ref, class Cpu = none_t, class Cuda = none_t>
std::invoke_result_t<Ref&> dispatch(const torch::Tensor& t, Ref&& reference_impl, Cpu&& cpu_impl = {},
                                    Cuda&& cuda_impl = {}) {
  static_assert(!std::is_same_v<Exec, cuda> || cuda_kernels_built,
                "unirl::exec::cuda needs unirl's CUDA kernels: configure with -DUNIRL_ENABLE_CUDA=ON "
                "(nvcc and a CUDA LibTorch), or use exec::automatic, which picks by device");
  const backend b = Exec::select(t);
  if constexpr (!std::is_same_v<std::remove_cvref_t<Cpu>, none_t>)
    if (b == backend::cpu && t.device().is_cpu()) return cpu_impl();
  if constexpr (!std::is_same_v<std::remove_cvref_t<Cuda>, none_t>)
    if (b == backend::cuda && t.is_cuda()) return cuda_impl();
  return reference_impl();
}

}  // namespace unirl::exec

#pragma once
/// \file actor_critic.hpp
/// Actor-critic policies for the env track, as CleanRL's `ppo.py` / `ppo_continuous_action.py`
/// build them: separate actor and critic MLPs (two tanh layers of 64 by default), orthogonal
/// weights with gain sqrt(2) on hidden layers, 0.01 on the actor head and 1.0 on the critic head,
/// zero biases. Three action distributions share the code:
/// - `categorical` — logits over n discrete actions;
/// - `diag_gaussian` — mean from the actor, state-independent log-std (a learned (1, A)
///   parameter, initialised to `init_log_std`);
/// - `mixed<C>` — a categorical action type over `action_dim` types plus C Gaussian coordinates
///   (models/mixed_action.hpp): the actor outputs the logits then the means, the log-std is a
///   learned (1, C) parameter; actions are (B, 1 + C) float rows `[type, coordinates...]`.
///
/// The policy is its own critic (the value head), so PPO needs no separate critic model.
/// ```cpp
/// unirl::models::categorical_actor_critic pi(4, 2);            // CartPole: 4 observations, 2 actions
/// auto a = pi.act(torch::zeros({8, 4}));                       // a.action (8,) int64, a.logp, a.value
/// unirl::models::gaussian_actor_critic mu(3, 1, {.init_log_std = 0.0});   // Pendulum
/// ```
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numbers>
#include <string>
#include <type_traits>
#include <vector>

#include <boost/hana.hpp>
#include <torch/torch.h>

#include <unirl/concepts/model.hpp>
#include <unirl/core/error.hpp>
#include <unirl/core/options.hpp>
#include <unirl/core/precision.hpp>
#include <unirl/models/mixed_action.hpp>
#include <unirl/models/module_adapter.hpp>
#include <unirl/ops/small_net.hpp>
#include <unirl/rollout/env.hpp>

namespace unirl::models {

/// Discrete actions: a softmax over the actor's logits.
struct categorical {};
/// Continuous actions: N(mean(obs), diag(exp(log_std))^2) with a state-independent log-std.
struct diag_gaussian {};

/// Architecture of an `actor_critic`.
struct actor_critic_options {
  std::vector<std::int64_t> hidden{64, 64};  // widths of the tanh hidden layers (actor and critic alike)
  double init_log_std = 0.0;                 // diag_gaussian: initial log standard deviation
  double actor_gain = 0.01;                  // orthogonal gain of the actor's output layer
  double critic_gain = 1.0;                  // orthogonal gain of the critic's output layer

  void validate(const std::string& prefix) const {
    for (auto h : hidden) options::require(h >= 1, prefix + "hidden", h, "every width >= 1");
    options::require(std::isfinite(init_log_std), prefix + "init_log_std", init_log_std, "a finite number");
    options::require(actor_gain > 0, prefix + "actor_gain", actor_gain, "> 0");
    options::require(critic_gain > 0, prefix + "critic_gain", critic_gain, "> 0");
  }
};

}  // namespace unirl::models

BOOST_HANA_ADAPT_STRUCT(unirl::models::actor_critic_options, hidden, init_log_std, actor_gain, critic_gain);

namespace unirl::models {

/// The network: `critic` (obs -> 1) and `actor` (obs -> logits or mean) MLPs, plus `log_std`.
template <class Dist>
class actor_critic_netImpl : public torch::nn::Cloneable<actor_critic_netImpl<Dist>> {
 public:
  actor_critic_netImpl(std::int64_t obs_dim, std::int64_t action_dim, actor_critic_options o = {})
      : obs_dim_(obs_dim), action_dim_(action_dim), opts_(std::move(o)) {
    UNIRL_CHECK(obs_dim >= 1, "actor_critic: obs_dim = ", obs_dim, ": expected >= 1");
    UNIRL_CHECK(action_dim >= (std::is_same_v<Dist, categorical> ? 2 : 1), "actor_critic: action_dim = ", action_dim,
                std::is_same_v<Dist, categorical> ? ": expected >= 2 discrete actions" : ": expected >= 1");
    opts_.validate("actor_critic.");
    reset();
  }

  void reset() override {
    critic = this->register_module("critic", mlp(1, opts_.critic_gain));
    if constexpr (is_mixed_v<Dist>) {  // logits of the types, then the coordinates' means
      actor = this->register_module("actor", mlp(action_dim_ + Dist::coordinates, opts_.actor_gain));
      log_std = this->register_parameter("log_std", torch::full({1, Dist::coordinates}, opts_.init_log_std));
    } else {
      actor = this->register_module("actor", mlp(action_dim_, opts_.actor_gain));
    }
    if constexpr (std::is_same_v<Dist, diag_gaussian>)
      log_std = this->register_parameter("log_std", torch::full({1, action_dim_}, opts_.init_log_std));
  }

  std::int64_t obs_dim() const { return obs_dim_; }
  std::int64_t action_dim() const { return action_dim_; }
  const actor_critic_options& options() const { return opts_; }
  /// A parameter whose device and dtype are the network's (inputs are converted to them).
  /// (Looked up each time: cloning replaces the child modules after `reset()`.)
  torch::Tensor anchor() const {
    torch::nn::Sequential c = critic;
    return c[0]->as<torch::nn::Linear>()->weight;
  }

  torch::nn::Sequential critic{nullptr}, actor{nullptr};
  torch::Tensor log_std;  // (1, A) diag_gaussian, (1, C) mixed<C>; undefined for categorical

 private:
  torch::nn::Sequential mlp(std::int64_t out, double head_gain) const {
    torch::nn::Sequential s;
    std::int64_t in = obs_dim_;
    auto layer = [&](std::int64_t o, double gain) {
      torch::nn::Linear l(in, o);
      torch::NoGradGuard ng;
      torch::nn::init::orthogonal_(l->weight, gain);
      torch::nn::init::constant_(l->bias, 0.0);
      in = o;
      return l;
    };
    for (auto h : opts_.hidden) {
      s->push_back(layer(h, std::sqrt(2.0)));
      s->push_back(torch::nn::Tanh());
    }
    s->push_back(layer(out, head_gain));
    return s;
  }

  std::int64_t obs_dim_, action_dim_;
  actor_critic_options opts_;
};

/// Module holder of `actor_critic_netImpl<Dist>` (what `TORCH_MODULE` would declare).
template <class Dist>
class actor_critic_net : public torch::nn::ModuleHolder<actor_critic_netImpl<Dist>> {
 public:
  using Impl = actor_critic_netImpl<Dist>;
  using torch::nn::ModuleHolder<Impl>::ModuleHolder;
};

/// The env-track model adapter: acts, re-evaluates stored actions and values observations.
template <class Dist>
class actor_critic : public module_adapter<actor_critic<Dist>, actor_critic_net<Dist>> {
  using base = module_adapter<actor_critic<Dist>, actor_critic_net<Dist>>;

 public:
  using track = env_track;
  using distribution = Dist;
  static constexpr bool discrete = std::is_same_v<Dist, categorical>;

  /// `action_dim`: number of actions (categorical), action dimension (diag_gaussian) or number of
  /// action types (mixed<C>, whose actions have 1 + C components).
  actor_critic(std::int64_t obs_dim, std::int64_t action_dim, actor_critic_options o = {})
      : base(actor_critic_net<Dist>(obs_dim, action_dim, std::move(o))) {}

  /// V(obs): (B, D) -> (B,).
  torch::Tensor value(const torch::Tensor& obs) const { return upcast(critic_forward(input(obs))).squeeze(-1); }

  /// Samples actions for (B, D) observations, with their log-probabilities and values.
  env_action act(const torch::Tensor& obs) const {
    const auto x = input(obs);
    const auto head = upcast(actor_forward(x));  // log-probs in float32 under autocast
    env_action a;
    if constexpr (discrete) {
      const auto logp_all = torch::log_softmax(head, -1);
      a.action = torch::multinomial(logp_all.exp(), 1).squeeze(-1);
      a.logp = logp_all.gather(-1, a.action.unsqueeze(-1)).squeeze(-1);
    } else if constexpr (is_mixed_v<Dist>) {
      const auto d = mixed_head(head);
      a.action = d.sample();
      a.logp = d.log_prob(a.action);
    } else {
      const auto log_std = this->net_->log_std.expand_as(head);
      a.action = head + log_std.exp() * torch::randn_like(head);
      a.logp = gaussian_logp(a.action, head, log_std);
    }
    a.value = upcast(critic_forward(x)).squeeze(-1);
    return a;
  }

  /// The most likely action (argmax / mean): for evaluating a trained policy.
  torch::Tensor greedy(const torch::Tensor& obs) const {
    const auto head = actor_forward(input(obs));
    if constexpr (discrete) return head.argmax(-1);
    else if constexpr (is_mixed_v<Dist>) return mixed_head(head).mode();
    else return head;
  }

  /// log pi(actions | obs), entropy and value, differentiable: for the loss.
  env_evaluation evaluate(const torch::Tensor& obs, const torch::Tensor& actions) const {
    const auto x = input(obs);
    const auto head = upcast(actor_forward(x));  // log-probs in float32 under autocast
    env_evaluation e;
    if constexpr (discrete) {
      UNIRL_CHECK(!actions.is_floating_point() && actions.dim() == 1 && actions.size(0) == x.size(0),
                  "actor_critic::evaluate: actions of shape ", actions.sizes(), " and type ", actions.scalar_type(),
                  ": expected (", x.size(0), ",) integers");
      const auto logp_all = torch::log_softmax(head, -1);
      e.logp = logp_all.gather(-1, actions.to(torch::kLong).unsqueeze(-1)).squeeze(-1);
      e.entropy = -(logp_all.exp() * logp_all).sum(-1);
    } else if constexpr (is_mixed_v<Dist>) {
      const auto d = mixed_head(head);
      e.logp = d.log_prob(actions.is_floating_point() ? actions.to(head.scalar_type()) : actions);
      e.entropy = d.entropy();
    } else {
      UNIRL_CHECK(actions.sizes() == head.sizes(), "actor_critic::evaluate: actions of shape ", actions.sizes(),
                  ": expected ", head.sizes());
      const auto log_std = this->net_->log_std.expand_as(head);
      e.logp = gaussian_logp(actions.to(head.scalar_type()), head, log_std);
      e.entropy = (log_std + 0.5 * (1.0 + std::log(2.0 * std::numbers::pi))).sum(-1);
    }
    e.value = upcast(critic_forward(x)).squeeze(-1);
    return e;
  }

  std::int64_t obs_dim() const { return this->net_->obs_dim(); }
  std::int64_t action_dim() const { return this->net_->action_dim(); }

 private:
  // Module holders share their module: a copy gives the non-const forward() a const adapter lacks.
  torch::Tensor critic_forward(const torch::Tensor& x) const {
    torch::nn::Sequential c = this->net_->critic;
    return c->forward(x);
  }
  torch::Tensor actor_forward(const torch::Tensor& x) const {
    torch::nn::Sequential a = this->net_->actor;
    return a->forward(x);
  }
  torch::Tensor input(const torch::Tensor& obs) const {
    UNIRL_CHECK(obs.dim() == 2 && obs.size(1) == obs_dim(), "actor_critic: observations of shape ", obs.sizes(),
                ": expected (B, ", obs_dim(), ")");
    const auto w = this->net_->anchor();
    return obs.to(w.device(), w.scalar_type());
  }
  // mixed<C>: the head's first action_dim() columns are the type logits, the last C the means.
  mixed_distribution mixed_head(const torch::Tensor& head) const {
    const auto k = action_dim();
    return {head.narrow(-1, 0, k), head.narrow(-1, k, head.size(-1) - k), this->net_->log_std};
  }
  static torch::Tensor gaussian_logp(const torch::Tensor& a, const torch::Tensor& mean, const torch::Tensor& log_std) {
    const double half_log_2pi = 0.5 * std::log(2.0 * std::numbers::pi);
    return (-(a - mean).square() * 0.5 * torch::exp(-2.0 * log_std) - log_std - half_log_2pi).sum(-1);
  }
};

/// The small-network kernels' head of a distribution (exec::small_net, ops/small_net.hpp):
/// defined for `categorical` and `diag_gaussian`, the forms the kernels know (not `mixed<C>`).
template <class Dist>
struct small_net_head_of {};
template <>
struct small_net_head_of<categorical> {
  using type = ops::categorical_head;
};
template <>
struct small_net_head_of<diag_gaussian> {
  using type = ops::gaussian_head;
};
/// True when the small-network kernels implement `actor_critic<Dist>`.
template <class Dist>
inline constexpr bool has_small_net = requires { typename small_net_head_of<Dist>::type; };

/// The kernels' network of `policy`'s architecture: same sizes, tanh hidden layers.
template <class Scalar, class Dist>
  requires has_small_net<Dist>
ops::small_actor_critic<Scalar, typename small_net_head_of<Dist>::type> small_net_like(
    const actor_critic<Dist>& policy, std::int64_t batch_capacity = 128) {
  return ops::small_actor_critic<Scalar, typename small_net_head_of<Dist>::type>(
      {.obs_dim = policy.obs_dim(),
       .action_dim = policy.action_dim(),
       .hidden = policy.net()->options().hidden,
       .activation = ops::mlp_activation::tanh},
      batch_capacity);
}

namespace detail {
// The LibTorch parameter `t.name` of `policy`, checked against the kernels' shape of it.
template <class Dist>
torch::Tensor small_net_counterpart(const actor_critic<Dist>& policy, const ops::small_net_tensor& t) {
  const auto named = policy.net()->named_parameters();
  const auto* p = named.find(t.name);
  UNIRL_CHECK(p != nullptr, "actor_critic: no parameter '", t.name, "' for the small-network kernels' tensor");
  UNIRL_CHECK(p->sizes() == torch::IntArrayRef(t.shape), "actor_critic: parameter '", t.name, "' has shape ",
              p->sizes(), "; the small-network kernels' has ", torch::IntArrayRef(t.shape));
  return *p;
}
}  // namespace detail

/// Copies `from`'s weights into the kernels' buffer `to` (converted to `Scalar`); the shapes
/// must match tensor by tensor (an error names the first that does not).
/// ```cpp
/// auto net = unirl::models::small_net_like<float>(policy);
/// unirl::models::copy_parameters(policy, net);      // LibTorch -> Eigen
/// unirl::models::copy_parameters(net, policy);      // and back
/// ```
template <class Dist, class Scalar, class Head>
  requires has_small_net<Dist> && std::is_same_v<Head, typename small_net_head_of<Dist>::type>
void copy_parameters(const actor_critic<Dist>& from, ops::small_actor_critic<Scalar, Head>& to) {
  constexpr auto dtype = std::is_same_v<Scalar, float> ? torch::kFloat : torch::kDouble;
  for (const auto& t : to.tensors()) {
    const auto src = detail::small_net_counterpart(from, t).detach().to(torch::kCPU, dtype).contiguous();
    std::memcpy(to.parameters() + t.offset, src.template data_ptr<Scalar>(), static_cast<std::size_t>(t.size) * sizeof(Scalar));
  }
}

/// Copies the kernels' weights `from` into `to`'s parameters (in their dtype and device).
template <class Dist, class Scalar, class Head>
  requires has_small_net<Dist> && std::is_same_v<Head, typename small_net_head_of<Dist>::type>
void copy_parameters(const ops::small_actor_critic<Scalar, Head>& from, actor_critic<Dist>& to) {
  constexpr auto dtype = std::is_same_v<Scalar, float> ? torch::kFloat : torch::kDouble;
  torch::NoGradGuard ng;
  for (const auto& t : from.tensors()) {
    auto dst = detail::small_net_counterpart(to, t);
    const auto src = torch::from_blob(const_cast<Scalar*>(from.parameters() + t.offset), t.shape, dtype);
    dst.copy_(src);
  }
}

/// Categorical policy (CartPole, discrete actions).
using categorical_actor_critic = actor_critic<categorical>;
/// Diagonal-Gaussian policy with state-independent log-std (Pendulum, continuous actions).
using gaussian_actor_critic = actor_critic<diag_gaussian>;
/// A categorical action type plus a point (x, y) (models/mixed_action.hpp; the click task).
using mixed_actor_critic = actor_critic<mixed<2>>;

static_assert(ModelAdapter<categorical_actor_critic>);
static_assert(ModelAdapter<gaussian_actor_critic>);
static_assert(EnvPolicy<categorical_actor_critic>);
static_assert(EnvPolicy<gaussian_actor_critic>);
static_assert(ModelAdapter<mixed_actor_critic>);
static_assert(EnvPolicy<mixed_actor_critic>);

}  // namespace unirl::models

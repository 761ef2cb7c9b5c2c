#pragma once
/// \file small_net.hpp
/// Small-network kernels on Eigen for the env track's actor-critics (`exec::small_net`): MLPs
/// with tanh or ReLU hidden layers, a categorical or a diagonal-Gaussian head (state-independent
/// log-std, as CleanRL) and a value head; sampling, the PPO loss with its hand-written gradient,
/// global gradient-norm clipping and Adam. All parameters live in one contiguous buffer of
/// `Scalar` (float or double), laid out tensor by tensor as LibTorch's `actor_critic_net` names
/// them (`critic.0.weight` row-major, ...), so weights convert with one copy per tensor; every
/// workspace is allocated at construction (or when a larger batch first arrives), never per call,
/// and no autograd graph is built.
///
/// The loss is the one `algo::ppo_loss` computes on the env track (token-mean aggregation over
/// an all-ones mask): clipped surrogate, clipped or unclipped value loss, entropy bonus, and
/// advantages whitened over the minibatch with the unbiased std; the gradient follows LibTorch's
/// rules at ties (`max` halves the gradient between equal operands, `clamp` passes it at the
/// bounds), so both paths give the same numbers up to summation order.
/// ```cpp
/// unirl::ops::small_actor_critic<float, unirl::ops::categorical_head> net({.obs_dim = 4, .action_dim = 2});
/// std::mt19937_64 rng(1);
/// std::int64_t action[8]; float logp[8], value[8];
/// net.act(obs, 8, rng, action, logp, value);           // obs: 8 x 4 floats, row-major
/// auto r = net.loss_and_gradient(settings, batch);    // net.gradients() now holds d loss / d params
/// unirl::ops::clip_gradient_norm(net.gradients(), net.parameter_count(), 0.5f);
/// adam.step(net.parameters(), net.gradients(), 2.5e-4);
/// ```
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numbers>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include <Eigen/Dense>

#include <unirl/core/error.hpp>

namespace unirl::ops {

/// The hidden layers' nonlinearity.
enum class mlp_activation { tanh, relu };

/// Discrete actions: a softmax over the actor's outputs.
struct categorical_head {};
/// Continuous actions: N(mean, diag(exp(log_std))^2), log-std a learned state-independent vector.
struct gaussian_head {};

/// Shape of a `small_actor_critic`: separate actor and critic MLPs over the observation.
struct small_net_shape {
  std::int64_t obs_dim = 1;
  std::int64_t action_dim = 2;                // actions (categorical) or action components (Gaussian)
  std::vector<std::int64_t> hidden{64, 64};   // hidden widths, actor and critic alike
  mlp_activation activation = mlp_activation::tanh;
};

/// The number of parameters of a network of this shape (weights, biases and, for a Gaussian
/// head, the log-std).
template <class Head>
std::int64_t small_net_parameter_count(const small_net_shape& s) {
  auto mlp = [&](std::int64_t out) {
    std::int64_t n = 0, in = s.obs_dim;
    for (auto h : s.hidden) {
      n += h * in + h;
      in = h;
    }
    return n + out * in + out;
  };
  return mlp(1) + mlp(s.action_dim) + (std::is_same_v<Head, gaussian_head> ? s.action_dim : 0);
}

/// One named parameter tensor inside the contiguous buffer (LibTorch's name and shape).
struct small_net_tensor {
  std::string name;                // "critic.0.weight", "actor.4.bias", "log_std"
  std::vector<std::int64_t> shape; // (out, in), (out,) or (1, A)
  std::int64_t offset = 0;         // first element in the buffer
  std::int64_t size = 0;           // elements
};

/// PPO settings the loss reads (those of `algo::ppo_options` the env track uses).
struct small_ppo_settings {
  double clip_low = 0.2, clip_high = 0.2;
  double value_clip = 0.2;  // <= 0: unclipped value loss
  double vf_coef = 0.5;
  double ent_coef = 0.01;
  bool norm_adv = true;
};

/// A minibatch: rows `index[0..size)` of a rollout held in plain buffers.
template <class Scalar>
struct small_ppo_batch {
  const float* obs = nullptr;            // (rows, obs_dim) row-major
  const std::int64_t* actions = nullptr; // categorical: (rows,)
  const float* box_actions = nullptr;    // Gaussian: (rows, action_dim), the unclipped samples
  const Scalar* old_logp = nullptr;      // (rows,)
  const Scalar* old_values = nullptr;    // (rows,)
  const Scalar* advantages = nullptr;    // (rows,)
  const Scalar* returns = nullptr;       // (rows,)
  const std::int64_t* index = nullptr;   // (size,) rows of the minibatch
  std::int64_t size = 0;
};

/// The loss terms of one minibatch (before the gradient step).
struct small_ppo_result {
  double loss = 0, policy_loss = 0, value_loss = 0, entropy = 0;
  double ratio_mean = 0, clip_fraction = 0, approx_kl = 0;
};

/// The global L2 norm of `g[0..n)`; when it exceeds `max_norm` (> 0) the gradient is scaled by
/// `max_norm / (norm + 1e-6)` (as `train::clip_grad_norm` and `torch.nn.utils.clip_grad_norm_`).
/// A non-finite norm leaves `g` unchanged. Returns the norm before clipping.
template <class Scalar>
double clip_gradient_norm(Scalar* g, std::int64_t n, double max_norm) {
  double sq = 0;
  for (std::int64_t i = 0; i < n; ++i) sq += static_cast<double>(g[i]) * static_cast<double>(g[i]);
  const double norm = std::sqrt(sq);
  if (max_norm > 0 && std::isfinite(norm) && norm > max_norm) {
    const auto coef = static_cast<Scalar>(max_norm / (norm + 1e-6));
    for (std::int64_t i = 0; i < n; ++i) g[i] *= coef;
  }
  return norm;
}

/// Adam (Kingma & Ba) as LibTorch's `AdamW` with no weight decay steps it: bias-corrected first
/// and second moments, `p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)`.
template <class Scalar>
class small_adam {
 public:
  small_adam(std::int64_t n, double beta1 = 0.9, double beta2 = 0.999, double eps = 1e-8)
      : m_(static_cast<std::size_t>(n), Scalar(0)), v_(static_cast<std::size_t>(n), Scalar(0)),
        beta1_(beta1), beta2_(beta2), eps_(eps) {
    UNIRL_CHECK(n >= 1, "small_adam: ", n, " parameters: expected >= 1");
    UNIRL_CHECK(beta1 >= 0 && beta1 < 1 && beta2 >= 0 && beta2 < 1, "small_adam: betas (", beta1, ", ", beta2,
                "): expected each in [0, 1)");
    UNIRL_CHECK(eps > 0, "small_adam: eps = ", eps, ": expected > 0");
  }

  /// One step of every parameter `p[i]` with gradient `g[i]` at learning rate `lr`.
  void step(Scalar* p, const Scalar* g, double lr) {
    ++t_;
    const double bc1 = 1.0 - std::pow(beta1_, static_cast<double>(t_));
    const double bc2 = 1.0 - std::pow(beta2_, static_cast<double>(t_));
    const auto b1 = static_cast<Scalar>(beta1_), b2 = static_cast<Scalar>(beta2_);
    const auto step_size = static_cast<Scalar>(lr / bc1);
    const auto bc2_sqrt = static_cast<Scalar>(std::sqrt(bc2));
    const auto eps = static_cast<Scalar>(eps_);
    for (std::size_t i = 0; i < m_.size(); ++i) {
      m_[i] = m_[i] * b1 + (Scalar(1) - b1) * g[i];
      v_[i] = v_[i] * b2 + (Scalar(1) - b2) * g[i] * g[i];
      const Scalar denom = std::sqrt(v_[i]) / bc2_sqrt + eps;
      p[i] -= step_size * (m_[i] / denom);
    }
  }

  std::int64_t steps() const { return t_; }
  /// The moments (for checkpoints): `first()[i]`, `second()[i]` of parameter i.
  std::vector<Scalar>& first() { return m_; }
  std::vector<Scalar>& second() { return v_; }
  const std::vector<Scalar>& first() const { return m_; }
  const std::vector<Scalar>& second() const { return v_; }
  void set_steps(std::int64_t t) {
    UNIRL_CHECK(t >= 0, "small_adam::set_steps: ", t, ": expected >= 0");
    t_ = t;
  }

 private:
  std::vector<Scalar> m_, v_;
  double beta1_, beta2_, eps_;
  std::int64_t t_ = 0;
};

/// Actor and critic MLPs with a categorical or Gaussian head, in one contiguous parameter buffer
/// (see the file comment). Not thread-safe: the workspaces are members.
template <class Scalar, class Head>
class small_actor_critic {
  static_assert(std::is_same_v<Scalar, float> || std::is_same_v<Scalar, double>,
                "small_actor_critic: Scalar must be float or double");
  static_assert(std::is_same_v<Head, categorical_head> || std::is_same_v<Head, gaussian_head>,
                "small_actor_critic: Head must be categorical_head or gaussian_head");
  using matrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using map = Eigen::Map<matrix>;
  using cmap = Eigen::Map<const matrix>;
  using row = Eigen::Matrix<Scalar, 1, Eigen::Dynamic>;

 public:
  static constexpr bool discrete = std::is_same_v<Head, categorical_head>;
  using scalar_type = Scalar;
  using head_type = Head;

  explicit small_actor_critic(small_net_shape shape, std::int64_t batch_capacity = 128) : shape_(std::move(shape)) {
    UNIRL_CHECK(shape_.obs_dim >= 1, "small_actor_critic: obs_dim = ", shape_.obs_dim, ": expected >= 1");
    UNIRL_CHECK(shape_.action_dim >= (discrete ? 2 : 1), "small_actor_critic: action_dim = ", shape_.action_dim,
                discrete ? ": expected >= 2 discrete actions" : ": expected >= 1");
    for (auto h : shape_.hidden) UNIRL_CHECK(h >= 1, "small_actor_critic: hidden width ", h, ": expected >= 1");
    std::int64_t offset = 0;
    critic_ = build("critic", 1, offset);
    actor_ = build("actor", shape_.action_dim, offset);
    if constexpr (!discrete) {
      log_std_offset_ = offset;
      tensors_.push_back({"log_std", {1, shape_.action_dim}, offset, shape_.action_dim});
      offset += shape_.action_dim;
    }
    params_.assign(static_cast<std::size_t>(offset), Scalar(0));
    grads_.assign(static_cast<std::size_t>(offset), Scalar(0));
    width_ = std::max<std::int64_t>({shape_.obs_dim, shape_.action_dim, 1});
    for (auto h : shape_.hidden) width_ = std::max(width_, h);
    reserve(batch_capacity);
  }

  const small_net_shape& shape() const { return shape_; }
  std::int64_t parameter_count() const { return static_cast<std::int64_t>(params_.size()); }
  Scalar* parameters() { return params_.data(); }
  const Scalar* parameters() const { return params_.data(); }
  Scalar* gradients() { return grads_.data(); }
  const Scalar* gradients() const { return grads_.data(); }
  /// The parameter tensors in buffer order, named as LibTorch's `actor_critic_net` names them.
  const std::vector<small_net_tensor>& tensors() const { return tensors_; }

  /// V(obs) for `b` rows of `obs` (b x obs_dim floats, row-major) into `value[0..b)`.
  void values(const float* obs, std::int64_t b, Scalar* value) {
    load_input(obs, b, nullptr);
    const auto& v = forward(critic_, b);
    for (std::int64_t i = 0; i < b; ++i) value[i] = v(i, 0);
  }

  /// Samples an action for each of `b` rows of `obs` with `rng`, with its log-probability and
  /// value. Categorical: `action[i]` in [0, action_dim) drawn by inverse CDF from one uniform;
  /// Gaussian: `action[i * A + d] = mean + exp(log_std) * z`, z standard normal (unclipped).
  template <class Action, class Rng>
  void act(const float* obs, std::int64_t b, Rng& rng, Action* action, Scalar* logp, Scalar* value) {
    if constexpr (discrete) static_assert(std::is_same_v<Action, std::int64_t>, "categorical actions are int64");
    else static_assert(std::is_same_v<Action, float>, "Gaussian actions are float");
    load_input(obs, b, nullptr);
    {
      const auto& v = forward(critic_, b);
      for (std::int64_t i = 0; i < b; ++i) value[i] = v(i, 0);
    }
    const auto& h = forward(actor_, b);
    const auto a_dim = shape_.action_dim;
    if constexpr (discrete) {
      std::uniform_real_distribution<double> u(0.0, 1.0);
      for (std::int64_t i = 0; i < b; ++i) {
        const Scalar mx = h.row(i).maxCoeff();
        Scalar s = 0;
        for (std::int64_t j = 0; j < a_dim; ++j) s += std::exp(h(i, j) - mx);
        const Scalar lse = mx + std::log(s);
        const double x = u(rng);
        double c = 0;
        std::int64_t pick = a_dim - 1;
        for (std::int64_t j = 0; j < a_dim; ++j) {
          c += std::exp(static_cast<double>(h(i, j) - lse));
          if (x < c) {
            pick = j;
            break;
          }
        }
        action[i] = pick;
        logp[i] = h(i, pick) - lse;
      }
    } else {
      std::normal_distribution<double> n(0.0, 1.0);
      const Scalar* ls = params_.data() + log_std_offset_;
      const Scalar half_log_2pi = static_cast<Scalar>(0.5 * std::log(2.0 * std::numbers::pi));
      for (std::int64_t i = 0; i < b; ++i) {
        Scalar lp = 0;
        for (std::int64_t d = 0; d < a_dim; ++d) {
          const Scalar mean = h(i, d);
          const Scalar a = mean + std::exp(ls[d]) * static_cast<Scalar>(n(rng));
          action[i * a_dim + d] = static_cast<float>(a);
          // log-prob of the action as stored (float), as the reference evaluates it later
          const Scalar diff = static_cast<Scalar>(static_cast<float>(a)) - mean;
          lp += -(diff * diff) * Scalar(0.5) * std::exp(Scalar(-2) * ls[d]) - ls[d] - half_log_2pi;
        }
        logp[i] = lp;
      }
    }
  }

  /// The most likely action of each row (argmax / mean), for evaluating a trained policy.
  template <class Action>
  void greedy(const float* obs, std::int64_t b, Action* action) {
    load_input(obs, b, nullptr);
    const auto& h = forward(actor_, b);
    for (std::int64_t i = 0; i < b; ++i) {
      if constexpr (discrete) {
        Eigen::Index j = 0;
        h.row(i).maxCoeff(&j);
        action[i] = static_cast<Action>(j);
      } else {
        for (std::int64_t d = 0; d < shape_.action_dim; ++d) action[i * shape_.action_dim + d] = static_cast<Action>(h(i, d));
      }
    }
  }

  /// The PPO loss of minibatch `mb` under the current parameters; writes its gradient into
  /// `gradients()` (overwriting it) and returns the loss terms.
  small_ppo_result loss_and_gradient(const small_ppo_settings& o, const small_ppo_batch<Scalar>& mb) {
    const std::int64_t b = mb.size;
    UNIRL_CHECK(b >= 1 && mb.index && mb.obs && mb.old_logp && mb.old_values && mb.advantages && mb.returns &&
                    (discrete ? mb.actions != nullptr : mb.box_actions != nullptr),
                "small_actor_critic::loss_and_gradient: a minibatch of ", b, " rows with a missing buffer");
    load_input(mb.obs, b, mb.index);
    const auto a_dim = shape_.action_dim;
    const Scalar inv_b = Scalar(1) / static_cast<Scalar>(b);

    // Advantages (whitened over the minibatch with the unbiased std, as masked_normalize).
    Scalar* adv = adv_.data();
    for (std::int64_t i = 0; i < b; ++i) adv[i] = mb.advantages[mb.index[i]];
    if (o.norm_adv) {
      if (b >= 2) {
        Scalar s = 0;
        for (std::int64_t i = 0; i < b; ++i) s += adv[i];
        const Scalar mean = s / static_cast<Scalar>(b);
        Scalar q = 0;
        for (std::int64_t i = 0; i < b; ++i) q += (adv[i] - mean) * (adv[i] - mean);
        const Scalar sd = std::sqrt(q / static_cast<Scalar>(b - 1));
        for (std::int64_t i = 0; i < b; ++i) adv[i] = (adv[i] - mean) / (sd + static_cast<Scalar>(1e-8));
      } else {
        adv[0] = 0;
      }
    }

    // Critic: value loss and d loss / d v.
    std::fill(grads_.begin(), grads_.end(), Scalar(0));
    small_ppo_result res;
    {
      const auto& v = forward(critic_, b);
      map dv(dout_.data(), b, 1);
      const Scalar c = static_cast<Scalar>(o.value_clip);
      double vl = 0;
      for (std::int64_t i = 0; i < b; ++i) {
        const auto r = mb.index[i];
        const Scalar vi = v(i, 0), ret = mb.returns[r];
        const Scalar u = vi - ret;
        const Scalar unclipped = u * u;
        Scalar g;  // d (per-row value loss) / d v
        if (o.value_clip <= 0) {
          vl += static_cast<double>(Scalar(0.5) * unclipped);
          g = u;
        } else {
          const Scalar vo = mb.old_values[r];
          const Scalar d = vi - vo;
          const Scalar dc = std::clamp(d, -c, c);
          const Scalar w = vo + dc - ret;
          const Scalar clipped = w * w;
          vl += static_cast<double>(Scalar(0.5) * std::max(unclipped, clipped));
          const Scalar pass = (d >= -c && d <= c) ? Scalar(1) : Scalar(0);
          if (unclipped > clipped) g = u;
          else if (clipped > unclipped) g = w * pass;
          else g = Scalar(0.5) * u + Scalar(0.5) * w * pass;
        }
        dv(i, 0) = static_cast<Scalar>(o.vf_coef) * g * inv_b;
      }
      res.value_loss = vl / static_cast<double>(b);
      backward(critic_, b);
    }

    // Actor: log-probs, entropy, the clipped surrogate and d loss / d head.
    const auto& h = forward(actor_, b);
    map dh(dout_.data(), b, a_dim);
    const Scalar lo = static_cast<Scalar>(1.0 - o.clip_low), hi = static_cast<Scalar>(1.0 + o.clip_high);
    const Scalar g_ent = static_cast<Scalar>(-o.ent_coef) * inv_b;  // d loss / d entropy_i
    double pl = 0, ent = 0, ratio_sum = 0, clipped_n = 0, kl = 0;
    Scalar* ls_grad = discrete ? nullptr : grads_.data() + log_std_offset_;
    const Scalar* ls = discrete ? nullptr : params_.data() + log_std_offset_;
    const Scalar half_log_2pi = static_cast<Scalar>(0.5 * std::log(2.0 * std::numbers::pi));
    for (std::int64_t i = 0; i < b; ++i) {
      const auto r = mb.index[i];
      Scalar logp = 0, entropy = 0;
      Scalar* lsm = nullptr;  // categorical: log-softmax of the row (in dout_'s row, overwritten below)
      if constexpr (discrete) {
        const Scalar mx = h.row(i).maxCoeff();
        Scalar s = 0;
        for (std::int64_t j = 0; j < a_dim; ++j) s += std::exp(h(i, j) - mx);
        const Scalar lse = mx + std::log(s);
        lsm = &dh(i, 0);
        for (std::int64_t j = 0; j < a_dim; ++j) lsm[j] = h(i, j) - lse;
        const auto a = mb.actions[r];
        UNIRL_CHECK(a >= 0 && a < a_dim, "small_actor_critic::loss_and_gradient: action ", a, " in row ", r,
                    ": expected in [0, ", a_dim, ")");
        logp = lsm[a];
        for (std::int64_t j = 0; j < a_dim; ++j) entropy -= std::exp(lsm[j]) * lsm[j];
      } else {
        for (std::int64_t d = 0; d < a_dim; ++d) {
          const Scalar diff = static_cast<Scalar>(mb.box_actions[r * a_dim + d]) - h(i, d);
          logp += -(diff * diff) * Scalar(0.5) * std::exp(Scalar(-2) * ls[d]) - ls[d] - half_log_2pi;
          entropy += ls[d] + static_cast<Scalar>(0.5 * (1.0 + std::log(2.0 * std::numbers::pi)));
        }
      }
      const Scalar log_ratio = logp - mb.old_logp[r];
      const Scalar ratio = std::exp(log_ratio);
      const Scalar unclipped = -adv[i] * ratio;
      const Scalar rc = std::clamp(ratio, lo, hi);
      const Scalar clipped = -adv[i] * rc;
      const Scalar pass = (ratio >= lo && ratio <= hi) ? Scalar(1) : Scalar(0);
      Scalar g_ratio;  // d (per-row surrogate) / d ratio
      if (unclipped > clipped) g_ratio = -adv[i];
      else if (clipped > unclipped) g_ratio = -adv[i] * pass;
      else g_ratio = Scalar(0.5) * -adv[i] + Scalar(0.5) * -adv[i] * pass;
      const Scalar g_logp = g_ratio * ratio * inv_b;
      pl += static_cast<double>(std::max(unclipped, clipped));
      ent += static_cast<double>(entropy);
      ratio_sum += static_cast<double>(ratio);
      clipped_n += clipped > unclipped ? 1.0 : 0.0;
      kl += static_cast<double>(std::exp(log_ratio) - Scalar(1) - log_ratio);
      if constexpr (discrete) {
        const auto a = mb.actions[r];
        for (std::int64_t j = 0; j < a_dim; ++j) {
          const Scalar p = std::exp(lsm[j]);
          const Scalar g = g_logp * ((j == a ? Scalar(1) : Scalar(0)) - p) + g_ent * (-p * (lsm[j] + entropy));
          lsm[j] = g;  // the row of dh
        }
      } else {
        for (std::int64_t d = 0; d < a_dim; ++d) {
          const Scalar diff = static_cast<Scalar>(mb.box_actions[r * a_dim + d]) - h(i, d);
          const Scalar inv_var = std::exp(Scalar(-2) * ls[d]);
          dh(i, d) = g_logp * diff * inv_var;
          ls_grad[d] += g_logp * (diff * diff * inv_var - Scalar(1)) + g_ent;
        }
      }
    }
    backward(actor_, b);
    const double bd = static_cast<double>(b);
    res.policy_loss = pl / bd;
    res.entropy = ent / bd;
    res.ratio_mean = ratio_sum / bd;
    res.clip_fraction = clipped_n / bd;
    res.approx_kl = kl / bd;
    res.loss = res.policy_loss + o.vf_coef * res.value_loss - o.ent_coef * res.entropy;
    return res;
  }

  /// Grows the workspaces to hold `b` rows (the only allocation; calls with fewer rows reuse them).
  void reserve(std::int64_t b) {
    UNIRL_CHECK(b >= 1, "small_actor_critic::reserve: ", b, " rows: expected >= 1");
    if (b <= capacity_) return;
    capacity_ = b;
    const auto layers = static_cast<std::size_t>(shape_.hidden.size() + 2);
    acts_.assign(layers, std::vector<Scalar>(static_cast<std::size_t>(b * width_)));
    dout_.assign(static_cast<std::size_t>(b * width_), Scalar(0));
    dtmp_.assign(static_cast<std::size_t>(b * width_), Scalar(0));
    adv_.assign(static_cast<std::size_t>(b), Scalar(0));
  }

 private:
  struct layer {
    std::int64_t in, out, w, bias;  // sizes and offsets of W (out x in) and b (out)
  };

  std::vector<layer> build(const std::string& prefix, std::int64_t out, std::int64_t& offset) {
    std::vector<layer> ls;
    std::int64_t in = shape_.obs_dim, index = 0;
    auto add = [&](std::int64_t o) {
      layer l{in, o, offset, offset + o * in};
      const std::string n = prefix + "." + std::to_string(index);
      tensors_.push_back({n + ".weight", {o, in}, l.w, o * in});
      tensors_.push_back({n + ".bias", {o}, l.bias, o});
      offset += o * in + o;
      index += 2;  // Linear, then the activation module, as torch::nn::Sequential numbers them
      in = o;
      ls.push_back(l);
    };
    for (auto h : shape_.hidden) add(h);
    add(out);
    return ls;
  }

  // Copies the rows (`index` or 0..b) of `obs` into the input workspace, in Scalar.
  void load_input(const float* obs, std::int64_t b, const std::int64_t* index) {
    UNIRL_CHECK(obs != nullptr && b >= 1, "small_actor_critic: ", b, " rows of observations: expected >= 1");
    reserve(b);
    Scalar* x = acts_[0].data();
    const auto d = shape_.obs_dim;
    for (std::int64_t i = 0; i < b; ++i) {
      const float* src = obs + (index ? index[i] : i) * d;
      for (std::int64_t k = 0; k < d; ++k) x[i * d + k] = static_cast<Scalar>(src[k]);
    }
  }

  // Runs `net` on the input workspace; returns its output (b x out) in acts_[L].
  map forward(const std::vector<layer>& net, std::int64_t b) {
    const Scalar* p = params_.data();
    for (std::size_t l = 0; l < net.size(); ++l) {
      const auto& L = net[l];
      cmap x(acts_[l].data(), b, L.in);
      map y(acts_[l + 1].data(), b, L.out);
      const cmap w(p + L.w, L.out, L.in);
      const Eigen::Map<const row> bias(p + L.bias, L.out);
      y.noalias() = x * w.transpose();
      y.rowwise() += bias;
      if (l + 1 < net.size()) {
        if (shape_.activation == mlp_activation::tanh) y = y.array().tanh();
        else y = y.array().max(Scalar(0));
      }
    }
    return map(acts_[net.size()].data(), b, net.back().out);
  }

  // Back-propagates d loss / d output (in dout_, b x out) through `net` (whose activations the
  // last `forward` left), accumulating into grads_.
  void backward(const std::vector<layer>& net, std::int64_t b) {
    const Scalar* p = params_.data();
    Scalar* g = grads_.data();
    Scalar* dy_buf = dout_.data();
    Scalar* dx_buf = dtmp_.data();
    for (std::size_t l = net.size(); l-- > 0;) {
      const auto& L = net[l];
      const map dy(dy_buf, b, L.out);
      const cmap x(acts_[l].data(), b, L.in);
      map gw(g + L.w, L.out, L.in);
      Eigen::Map<row> gb(g + L.bias, L.out);
      gw.noalias() += dy.transpose() * x;
      gb += dy.colwise().sum();
      if (l == 0) break;
      const cmap w(p + L.w, L.out, L.in);
      map dx(dx_buf, b, L.in);
      dx.noalias() = dy * w;
      if (shape_.activation == mlp_activation::tanh) dx.array() *= (Scalar(1) - x.array().square());
      else dx.array() *= (x.array() > Scalar(0)).template cast<Scalar>();
      std::swap(dy_buf, dx_buf);
    }
  }

  small_net_shape shape_;
  std::vector<layer> critic_, actor_;
  std::vector<small_net_tensor> tensors_;
  std::int64_t log_std_offset_ = 0;
  std::vector<Scalar> params_, grads_;
  std::int64_t width_ = 1, capacity_ = 0;
  std::vector<std::vector<Scalar>> acts_;  // acts_[0] input, acts_[l] output of layer l
  std::vector<Scalar> dout_, dtmp_, adv_;
};

}  // namespace unirl::ops

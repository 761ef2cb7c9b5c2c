#pragma once
/// \file weighted.hpp
/// `weighted<Scorers...>`: a reward composed of heterogeneous scorers held in a compile-time list
/// (a `boost::hana::tuple`), summed with run-time weights (a negative weight penalises), with
/// per-component statistics for the step metrics and optional adaptive weights.
///
/// ```cpp
/// using reward_t = unirl::rewards::weighted<unirl::rewards::exact_answer, unirl::rewards::regex_format>;
/// reward_t reward{{.weights = {1.0, 0.2}}, unirl::rewards::exact_answer{},
///                 unirl::rewards::regex_format{{.pattern = R"(\d+)"}}};
/// torch::Tensor r = reward(batch);                 // (B,) = 1.0 * exact + 0.2 * format
/// auto stats = reward.last_components();           // {"exact_answer": 0.4, "exact_answer/std": ...}
/// ```
///
/// Adaptive weights (`.adaptive = true`): each component's spread is tracked as an exponential
/// moving average `s_i <- m s_i + (1 - m) std_i` of its batch standard deviation (the first batch
/// sets it). The weight used is `w_i = b_i / s_i` for the components with `s_i > min_std`, rescaled
/// so that `sum |w_i| = sum |b_i|` over them (`b` the configured weights); a component whose spread
/// is still at most `min_std` keeps its base weight. Each component then moves the total reward in
/// proportion to its base weight rather than to its raw scale, and the overall scale is unchanged.
#include <cmath>
#include <cstddef>
#include <map>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <boost/hana.hpp>
#include <torch/torch.h>

#include <unirl/concepts/reward.hpp>
#include <unirl/core/error.hpp>
#include <unirl/core/options.hpp>
#include <unirl/rewards/scorer.hpp>

namespace unirl::rewards {

/// Options of `weighted`.
struct weighted_options {
  std::vector<double> weights{};        // one per scorer; empty = all 1 (negative = penalty)
  std::vector<std::string> names{};     // one per scorer; empty = each scorer's name
  bool adaptive = false;                // rescale weights from recent component statistics
  double adaptive_momentum = 0.9;       // EMA momentum of each component's standard deviation
  double adaptive_min_std = 1e-6;       // spreads at most this keep their base weight

  void validate(const std::string& prefix) const {
    for (std::size_t i = 0; i < weights.size(); ++i)
      options::require(std::isfinite(weights[i]), prefix + "weights[" + std::to_string(i) + "]", weights[i],
                       "a finite number");
    options::require(adaptive_momentum >= 0.0 && adaptive_momentum < 1.0, prefix + "adaptive_momentum",
                     adaptive_momentum, "in [0, 1)");
    options::require(adaptive_min_std >= 0.0, prefix + "adaptive_min_std", adaptive_min_std, ">= 0");
  }
};

}  // namespace unirl::rewards

BOOST_HANA_ADAPT_STRUCT(unirl::rewards::weighted_options, weights, names, adaptive, adaptive_momentum,
                        adaptive_min_std);

namespace unirl::rewards {

/// A weighted sum of scorers, each called on the same batch.
///
/// Minimal requirement on each `Scorer`: `ScorerFor<Scorer, Batch>` for the batch it is called
/// with; a scorer that does not fit fails to compile with a message naming the concept.
template <class... Scorers>
class weighted {
  static_assert(sizeof...(Scorers) > 0, "unirl::rewards::weighted needs at least one scorer");

 public:
  using options = weighted_options;
  static constexpr std::size_t size = sizeof...(Scorers);

  weighted()
    requires(std::is_default_constructible_v<Scorers> && ...)
      : weighted(options{}, Scorers{}...) {}
  explicit weighted(Scorers... scorers) : weighted(options{}, std::move(scorers)...) {}
  explicit weighted(options opts, Scorers... scorers)
      : scorers_(std::move(scorers)...), opts_(std::move(opts)) {
    unirl::options::validate(opts_);
    if (!opts_.weights.empty() && opts_.weights.size() != size)
      throw config_error("weights", "has " + std::to_string(opts_.weights.size()) + " entries; expected " +
                                        std::to_string(size) + ", one per scorer");
    if (!opts_.names.empty() && opts_.names.size() != size)
      throw config_error("names", "has " + std::to_string(opts_.names.size()) + " entries; expected " +
                                      std::to_string(size) + ", one per scorer");
    base_ = opts_.weights.empty() ? std::vector<double>(size, 1.0) : opts_.weights;
    weights_ = base_;
    spread_.assign(size, -1.0);
    std::size_t i = 0;
    boost::hana::for_each(scorers_, [&](const auto& s) {
      names_.push_back(opts_.names.empty() ? scorer_name(s, "component_" + std::to_string(i)) : opts_.names[i]);
      ++i;
    });
  }

  /// The weighted sum of the components, (B,) float32 on the first component's device.
  template <class Batch>
    requires(ScorerFor<Scorers, Batch> && ...)
  torch::Tensor operator()(const Batch& batch) {
    const std::int64_t n = batch_size(batch);
    std::vector<torch::Tensor> parts;
    parts.reserve(size);
    std::size_t i = 0;
    boost::hana::for_each(scorers_, [&](auto& s) {
      torch::NoGradGuard no_grad;
      parts.push_back(check_scores(s(batch), n, "reward component '" + names_[i] + "'").detach().to(torch::kFloat32));
      ++i;
    });
    const auto device = parts.front().device();
    components_.clear();
    std::vector<double> stds(size);
    for (std::size_t k = 0; k < size; ++k) {
      parts[k] = parts[k].to(device);
      UNIRL_CHECK(torch::isfinite(parts[k]).all().item<bool>(), "reward component '", names_[k],
                  "' returned a non-finite score: ", parts[k]);
      const double mean = n > 0 ? parts[k].mean().item<double>() : 0.0;
      stds[k] = n > 1 ? parts[k].std(/*unbiased=*/false).item<double>() : 0.0;
      components_[names_[k]] = mean;
      components_[names_[k] + "/std"] = stds[k];
    }
    if (opts_.adaptive) update_weights(stds);
    auto total = torch::zeros({n}, torch::TensorOptions().dtype(torch::kFloat32).device(device));
    for (std::size_t k = 0; k < size; ++k) {
      total.add_(parts[k], weights_[k]);
      if (opts_.adaptive) components_[names_[k] + "/weight"] = weights_[k];
    }
    last_parts_ = std::move(parts);
    return total;
  }

  /// Called with a batch some scorer cannot score: a compile error naming the concept. (It returns
  /// void, so `RewardFor<weighted<...>, Batch>` is false and the trainer rejects it too.)
  template <class Batch>
    requires(!(ScorerFor<Scorers, Batch> && ...))
  void operator()(const Batch&) {
    boost::hana::for_each(boost::hana::tuple_t<Scorers...>, [](auto t) {
      using S = typename decltype(t)::type;
      static_assert(ScorerFor<S, Batch>,
                    "unirl::rewards::weighted: a scorer does not model ScorerFor<Scorer, Batch> (the RewardFor "
                    "concept): it needs `torch::Tensor operator()(const Batch&)` for this batch type (e.g. a text "
                    "rule needs `batch.completions`); the instantiation below names the scorer and the batch");
    });
  }

  /// Per-component mean and standard deviation of the last call (and weights when adaptive).
  std::map<std::string, double> last_components() const { return components_; }
  /// The unweighted (B,) scores of each component from the last call, in scorer order.
  const std::vector<torch::Tensor>& last_scores() const { return last_parts_; }
  /// The weights used by the last call (the base weights until an adaptive update).
  const std::vector<double>& weights() const { return weights_; }
  /// Component names, in scorer order.
  const std::vector<std::string>& names() const { return names_; }
  const options& opts() const { return opts_; }

  /// The `I`-th scorer.
  template <std::size_t I>
  auto& get() { return scorers_[boost::hana::size_c<I>]; }
  template <std::size_t I>
  const auto& get() const { return scorers_[boost::hana::size_c<I>]; }

 private:
  void update_weights(const std::vector<double>& stds) {
    const double m = opts_.adaptive_momentum;
    for (std::size_t k = 0; k < size; ++k) spread_[k] = spread_[k] < 0 ? stds[k] : m * spread_[k] + (1 - m) * stds[k];
    double base_sum = 0, scaled_sum = 0;
    std::vector<double> scaled(size, 0.0);
    for (std::size_t k = 0; k < size; ++k) {
      if (spread_[k] > opts_.adaptive_min_std) {
        scaled[k] = base_[k] / spread_[k];
        base_sum += std::abs(base_[k]);
        scaled_sum += std::abs(scaled[k]);
      }
    }
    for (std::size_t k = 0; k < size; ++k)
      weights_[k] = (spread_[k] > opts_.adaptive_min_std && scaled_sum > 0) ? scaled[k] * base_sum / scaled_sum : base_[k];
  }

  boost::hana::tuple<Scorers...> scorers_;
  options opts_;
  std::vector<double> base_, weights_, spread_;
  std::vector<std::string> names_;
  std::map<std::string, double> components_;
  std::vector<torch::Tensor> last_parts_;
};

}  // namespace unirl::rewards

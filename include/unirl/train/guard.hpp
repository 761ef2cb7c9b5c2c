#pragma once
/// \file guard.hpp
/// Training stability guard: detects non-finite losses / gradients and spikes of the loss or
/// of the gradient norm against a rolling window, and counts the updates it made the trainer
/// skip. Its windows are saved in checkpoints so a resumed run judges spikes identically.
///
/// ```cpp
/// unirl::train::stability_guard guard({.window = 50, .spike_sigma = 6.0});
/// if (!guard.finite(loss) || !guard.grads_finite(params)) { guard.count_skip(); /* no step */ }
/// bool spike = guard.observe_loss(loss.item<double>());
/// ```
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include <boost/hana.hpp>
#include <torch/torch.h>

#include <unirl/config.hpp>
#include <unirl/core/error.hpp>
#include <unirl/core/host.hpp>
#include <unirl/core/options.hpp>

namespace unirl::train {

/// Options of `stability_guard`.
struct guard_options {
  bool enabled = true;             // false: observe_* never report a spike
  std::int64_t window = 50;        // rolling window of finite values (losses, grad norms)
  std::int64_t min_history = 10;   // values needed before a spike can be reported
  double spike_sigma = 6.0;        // spike: value > mean + spike_sigma * std of the window
  bool skip_loss_spikes = false;   // the trainer skips the update of a loss spike

  void validate(const std::string& prefix) const {
    options::require(window >= 2, prefix + "window", window, ">= 2");
    options::require(min_history >= 2 && min_history <= window, prefix + "min_history",
                     min_history, "in [2, window = " + std::to_string(window) + "]");
    options::require(spike_sigma > 0.0 && std::isfinite(spike_sigma), prefix + "spike_sigma",
                     spike_sigma, "a finite number > 0");
  }
};

/// Rolling-window spike detector and skip counter (see `guard_options`).
///
/// A value `v` is a spike when at least `min_history` finite values were seen before it and
/// `v > mean + spike_sigma * max(std, 1e-6 * max(1, |mean|))` over the last `window` of them
/// (population std; the floor keeps a perfectly flat history from flagging rounding noise).
/// Every finite value then enters the window, spikes included. A non-finite value is reported
/// as a spike and does not enter the window.
class stability_guard {
 public:
  explicit stability_guard(guard_options o = {}) : opts_(o) { o.validate("guard."); }

  /// True when `v` is neither NaN nor infinite.
  static bool finite(double v) { return std::isfinite(v); }
  /// True when every element of `t` is finite (an undefined tensor counts as finite).
  static bool finite(const torch::Tensor& t) {
    if (!t.defined() || t.numel() == 0) return true;
    if (!t.is_floating_point() && !t.is_complex()) return true;
    return to_host(torch::isfinite(t.detach()).all()).at(0) != 0.0;
  }
  /// True when every existing gradient of `params` is finite. One host synchronisation (the
  /// read of `nonfinite_grads`).
  static bool grads_finite(const std::vector<torch::Tensor>& params) {
    const auto bad = nonfinite_grads(params);
    return !bad.defined() || to_host(bad).at(0) == 0.0;
  }
  /// A () bool tensor, true when some existing gradient of `params` holds a NaN or an infinity —
  /// the found-non-finite flag, computed on the gradients' device without reading it (undefined
  /// when no parameter has a gradient).
  static torch::Tensor nonfinite_grads(const std::vector<torch::Tensor>& params) {
    torch::NoGradGuard ng;
    std::vector<torch::Tensor> ok;
    for (const auto& p : params)
      if (p.defined() && p.grad().defined() && p.grad().numel() > 0) ok.push_back(torch::isfinite(p.grad().detach()).all());
    if (ok.empty()) return {};
    for (auto& o : ok) o = o.to(ok.front().device());
    return torch::stack(ok).all().logical_not();
  }

  /// Records a loss; true when it is a spike (see the class comment).
  bool observe_loss(double loss) { return observe(losses_, loss); }
  /// Records a gradient norm; true when it is a spike.
  bool observe_grad_norm(double norm) { return observe(grad_norms_, norm); }

  /// Counts one update skipped because of the guard.
  void count_skip() { ++skipped_; }
  /// Updates skipped since the start of training (restored by `load`).
  std::int64_t skipped_total() const { return skipped_; }

  const guard_options& options() const { return opts_; }
  /// The current windows, oldest first.
  std::vector<double> loss_history() const { return {losses_.begin(), losses_.end()}; }
  std::vector<double> grad_norm_history() const { return {grad_norms_.begin(), grad_norms_.end()}; }

  /// Writes the windows and the skip count under the keys `guard/...`.
  void save(torch::serialize::OutputArchive& a) const {
    a.write("guard/losses", to_tensor(losses_));
    a.write("guard/grad_norms", to_tensor(grad_norms_));
    a.write("guard/skipped", c10::IValue(skipped_));
  }
  /// Restores what `save` wrote; throws `unirl::checkpoint_error` when a key is missing.
  void load(torch::serialize::InputArchive& a) {
    losses_ = from_tensor(a, "guard/losses");
    grad_norms_ = from_tensor(a, "guard/grad_norms");
    c10::IValue v;
    if (!a.try_read("guard/skipped", v) || !v.isInt())
      throw checkpoint_error("stability_guard: the archive has no integer 'guard/skipped'");
    skipped_ = v.toInt();
  }

 private:
  bool observe(std::deque<double>& h, double v) {
    if (!std::isfinite(v)) return opts_.enabled;
    bool spike = false;
    if (opts_.enabled && static_cast<std::int64_t>(h.size()) >= opts_.min_history) {
      double mean = 0.0;
      for (double x : h) mean += x;
      mean /= static_cast<double>(h.size());
      double var = 0.0;
      for (double x : h) var += (x - mean) * (x - mean);
      const double sd = std::sqrt(var / static_cast<double>(h.size()));
      const double floor = 1e-6 * std::max(1.0, std::abs(mean));
      spike = v > mean + opts_.spike_sigma * std::max(sd, floor);
    }
    h.push_back(v);
    while (static_cast<std::int64_t>(h.size()) > opts_.window) h.pop_front();
    return spike;
  }

  static torch::Tensor to_tensor(const std::deque<double>& h) {
    auto t = torch::empty({static_cast<std::int64_t>(h.size())}, torch::kDouble);
    auto* p = t.data_ptr<double>();
    for (double x : h) *p++ = x;
    return t;
  }
  std::deque<double> from_tensor(torch::serialize::InputArchive& a, const std::string& key) const {
    torch::Tensor t;
    if (!a.try_read(key, t))
      throw checkpoint_error("stability_guard: the archive has no tensor '" + key + "'");
    t = t.to(torch::kCPU, torch::kDouble).contiguous();
    std::deque<double> h(t.data_ptr<double>(), t.data_ptr<double>() + t.numel());
    while (static_cast<std::int64_t>(h.size()) > opts_.window) h.pop_front();
    return h;
  }

  guard_options opts_;
  std::deque<double> losses_{}, grad_norms_{};
  std::int64_t skipped_ = 0;
};

}  // namespace unirl::train

BOOST_HANA_ADAPT_STRUCT(unirl::train::guard_options, enabled, window, min_history, spike_sigma,
                        skip_loss_spikes);

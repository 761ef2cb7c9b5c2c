#pragma once
/// \file optimizer.hpp
/// AdamW with parameter groups chosen by name prefix, a learning-rate multiplier for schedules,
/// and an exact save / load of its state (a resumed run is bit-identical).
///
/// ```cpp
/// unirl::train::optimizer opt(model.named_parameters(),
///     {.lr = 1e-4, .weight_decay = 0.01,
///      .groups = {{.prefix = "head.", .lr_scale = 10.0, .weight_decay = 0.0}}});
/// opt.zero_grad(); loss.backward(); opt.step();
/// opt.set_lr_multiplier(unirl::train::lr_multiplier(schedule, step));
/// ```
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_set>
#include <vector>

#include <boost/hana.hpp>
#include <torch/torch.h>

#include <unirl/concepts/model.hpp>
#include <unirl/config.hpp>
#include <unirl/core/error.hpp>
#include <unirl/core/options.hpp>
#include <unirl/detail/compat.hpp>

namespace unirl::train {

/// One parameter group: the parameters whose name starts with `prefix`.
struct param_group_options {
  std::string prefix;             // e.g. "head." or "vision."
  double lr_scale = 1.0;          // the group's lr = optimizer lr * lr_scale * schedule multiplier
  double weight_decay = -1.0;     // < 0: inherit the optimizer's weight_decay
  double max_grad_norm = 0.0;     // > 0: the trainer clips this group's gradients on their own
};

/// AdamW hyper-parameters and parameter groups.
struct optimizer_options {
  double lr = 1e-4;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;      // decoupled (AdamW) weight decay
  std::vector<param_group_options> groups{};

  void validate(const std::string& prefix) const {
    options::require(lr > 0.0 && std::isfinite(lr), prefix + "lr", lr, "a finite number > 0");
    options::require(beta1 >= 0.0 && beta1 < 1.0, prefix + "beta1", beta1, "in [0, 1)");
    options::require(beta2 >= 0.0 && beta2 < 1.0, prefix + "beta2", beta2, "in [0, 1)");
    options::require(eps > 0.0, prefix + "eps", eps, "> 0");
    options::require(weight_decay >= 0.0, prefix + "weight_decay", weight_decay, ">= 0");
    for (std::size_t i = 0; i < groups.size(); ++i) {
      const auto key = prefix + "groups[" + std::to_string(i) + "].";
      const auto& g = groups[i];
      options::require(!g.prefix.empty(), key + "prefix", g.prefix,
                       "a non-empty name prefix (the default group takes the other parameters)");
      options::require(g.lr_scale > 0.0 && std::isfinite(g.lr_scale), key + "lr_scale", g.lr_scale,
                       "a finite number > 0");
      options::require(std::isfinite(g.weight_decay), key + "weight_decay", g.weight_decay,
                       ">= 0, or < 0 to inherit the optimizer's");
      options::require(g.max_grad_norm >= 0.0 && std::isfinite(g.max_grad_norm),
                       key + "max_grad_norm", g.max_grad_norm, ">= 0 (0: no per-group clipping)");
    }
  }
};

/// AdamW over named parameters split into groups.
///
/// A parameter goes to the first group in `optimizer_options::groups` whose `prefix` its name
/// starts with, else to the default group. Groups that receive no parameter are dropped, so
/// group indices count only non-empty groups, the default group (name "") first when it has
/// parameters. Parameters that do not require a gradient are left out; a tensor listed twice
/// (tied weights) is optimised once.
class optimizer {
 public:
  optimizer(const unirl::named_tensors& params, const optimizer_options& o) : opts_(o) {
    opts_.validate("optim.");
    const std::size_t n = o.groups.size() + 1;  // slot 0: default group
    std::vector<std::vector<torch::Tensor>> tensors(n);
    std::vector<std::vector<std::string>> names(n);
    std::unordered_set<const void*> seen;
    for (const auto& [name, t] : params) {
      UNIRL_CHECK(t.defined(), "optimizer: parameter '", name, "' is an undefined tensor");
      if (!t.requires_grad()) continue;
      if (!seen.insert(t.unsafeGetTensorImpl()).second) continue;
      std::size_t slot = 0;
      for (std::size_t g = 0; g < o.groups.size(); ++g)
        if (name.starts_with(o.groups[g].prefix)) { slot = g + 1; break; }
      tensors[slot].push_back(t);
      names[slot].push_back(name);
    }
    std::vector<torch::optim::OptimizerParamGroup> torch_groups;
    for (std::size_t s = 0; s < n; ++s) {
      if (tensors[s].empty()) continue;
      group g;
      g.name = s == 0 ? std::string{} : o.groups[s - 1].prefix;
      g.lr_scale = s == 0 ? 1.0 : o.groups[s - 1].lr_scale;
      g.weight_decay = s == 0 || o.groups[s - 1].weight_decay < 0.0 ? o.weight_decay
                                                                    : o.groups[s - 1].weight_decay;
      g.max_grad_norm = s == 0 ? 0.0 : o.groups[s - 1].max_grad_norm;
      g.params = tensors[s];
      g.param_names = names[s];
      torch::optim::AdamWOptions ao(o.lr * g.lr_scale);
      ao.betas({o.beta1, o.beta2}).eps(o.eps).weight_decay(g.weight_decay).amsgrad(false);
      torch_groups.emplace_back(g.params, std::make_unique<torch::optim::AdamWOptions>(ao));
      groups_.push_back(std::move(g));
    }
    UNIRL_CHECK(!groups_.empty(), "optimizer: none of the ", params.size(),
                " parameters given requires a gradient; expected at least one trainable parameter");
    torch::optim::AdamWOptions defaults(o.lr);
    defaults.betas({o.beta1, o.beta2}).eps(o.eps).weight_decay(o.weight_decay);
    adamw_ = std::make_unique<torch::optim::AdamW>(std::move(torch_groups), defaults);
  }

  /// Sets every group's learning rate to `lr * lr_scale * m` (m: the schedule's multiplier).
  void set_lr_multiplier(double m) {
    UNIRL_CHECK(m >= 0.0 && std::isfinite(m), "optimizer: learning-rate multiplier = ", m,
                ": expected a finite number >= 0");
    multiplier_ = m;
    auto& pg = adamw_->param_groups();
    for (std::size_t g = 0; g < groups_.size(); ++g)
      static_cast<torch::optim::AdamWOptions&>(pg[g].options()).lr(opts_.lr * groups_[g].lr_scale * m);
  }
  /// The current multiplier (1 until `set_lr_multiplier` is called).
  double lr_multiplier() const { return multiplier_; }
  /// The current learning rate of the default group: `lr * multiplier`.
  double learning_rate() const { return opts_.lr * multiplier_; }
  /// The current learning rate of group `g`.
  double group_learning_rate(std::size_t g) const {
    return opts_.lr * groups_.at(g).lr_scale * multiplier_;
  }

  /// Zeroes every gradient in place and keeps it (what LibTorch 1.13's zero_grad does; 2.x's frees
  /// them by default), so a step and the memory it holds are the same on every LibTorch.
  void zero_grad() {
    for (auto& g : adamw_->param_groups())
      for (auto& p : g.params())
        if (p.mutable_grad().defined()) {
          p.mutable_grad().detach_();
          p.mutable_grad().zero_();
        }
  }
  void step() { adamw_->step(); }

  std::size_t group_count() const { return groups_.size(); }
  const std::vector<torch::Tensor>& group_params(std::size_t g) const { return at(g).params; }
  const std::vector<std::string>& group_param_names(std::size_t g) const { return at(g).param_names; }
  /// The group's own clipping threshold (0: none).
  double group_max_grad_norm(std::size_t g) const { return at(g).max_grad_norm; }
  /// "" for the default group, else the group's prefix.
  const std::string& group_name(std::size_t g) const { return at(g).name; }
  double group_weight_decay(std::size_t g) const { return at(g).weight_decay; }
  /// Every optimised parameter, group by group.
  std::vector<torch::Tensor> parameters() const {
    std::vector<torch::Tensor> all;
    for (const auto& g : groups_) all.insert(all.end(), g.params.begin(), g.params.end());
    return all;
  }
  const optimizer_options& options() const { return opts_; }

  torch::optim::AdamW& torch_optimizer() { return *adamw_; }

  /// Writes the full AdamW state (step, exp_avg, exp_avg_sq per parameter, by group and
  /// parameter name) and the current multiplier under the keys `optimizer/...`.
  void save(torch::serialize::OutputArchive& a) const {
    a.write("optimizer/multiplier", c10::IValue(multiplier_));
    a.write("optimizer/groups", c10::IValue(static_cast<std::int64_t>(groups_.size())));
    const auto& state = adamw_->state();
    for (std::size_t g = 0; g < groups_.size(); ++g) {
      const auto gk = "optimizer/g" + std::to_string(g);
      a.write(gk + "/name", c10::IValue(groups_[g].name));
      a.write(gk + "/count", c10::IValue(static_cast<std::int64_t>(groups_[g].params.size())));
      for (std::size_t i = 0; i < groups_[g].params.size(); ++i) {
        const auto pk = gk + "/p" + std::to_string(i);
        const auto& p = groups_[g].params[i];
        a.write(pk + "/name", c10::IValue(groups_[g].param_names[i]));
        auto it = state.find(key_of(p));
        if (it == state.end()) continue;  // never stepped
        const auto& s = static_cast<const torch::optim::AdamWParamState&>(*it->second);
        a.write(pk + "/step", c10::IValue(s.step()));
        a.write(pk + "/exp_avg", s.exp_avg().detach().cpu(), true);
        a.write(pk + "/exp_avg_sq", s.exp_avg_sq().detach().cpu(), true);
      }
    }
  }

  /// Restores what `save` wrote into an optimizer built over the same parameters and groups.
  /// A different group layout, parameter name or shape throws `unirl::checkpoint_error`
  /// naming it.
  void load(torch::serialize::InputArchive& a) {
    const double m = read_double(a, "optimizer/multiplier");
    const auto ng = read_int(a, "optimizer/groups");
    if (ng != static_cast<std::int64_t>(groups_.size()))
      throw checkpoint_error("optimizer: the checkpoint has " + std::to_string(ng) +
                             " parameter groups, this optimizer " + std::to_string(groups_.size()));
    auto& state = adamw_->state();
    // Parse everything first so that a mismatch leaves the current state untouched.
    using state_key = ::unirl::detail::compat::optimizer_state_key;
    std::vector<std::pair<state_key, std::unique_ptr<torch::optim::OptimizerParamState>>> restored;
    for (std::size_t g = 0; g < groups_.size(); ++g) {
      const auto gk = "optimizer/g" + std::to_string(g);
      const auto gname = read_string(a, gk + "/name");
      if (gname != groups_[g].name)
        throw checkpoint_error("optimizer: parameter group " + std::to_string(g) + " is '" + gname +
                               "' in the checkpoint, '" + groups_[g].name + "' here");
      const auto count = read_int(a, gk + "/count");
      if (count != static_cast<std::int64_t>(groups_[g].params.size()))
        throw checkpoint_error("optimizer: parameter group '" + gname + "' has " + std::to_string(count) +
                               " parameters in the checkpoint, " +
                               std::to_string(groups_[g].params.size()) + " here");
      for (std::size_t i = 0; i < groups_[g].params.size(); ++i) {
        const auto pk = gk + "/p" + std::to_string(i);
        const auto& p = groups_[g].params[i];
        const auto pname = read_string(a, pk + "/name");
        if (pname != groups_[g].param_names[i])
          throw checkpoint_error("optimizer: parameter " + std::to_string(i) + " of group '" + gname +
                                 "' is '" + pname + "' in the checkpoint, '" + groups_[g].param_names[i] +
                                 "' here");
        c10::IValue step;
        if (!a.try_read(pk + "/step", step)) {
          restored.emplace_back(key_of(p), nullptr);
          continue;
        }
        torch::Tensor m1, m2;
        if (!a.try_read(pk + "/exp_avg", m1, true) || !a.try_read(pk + "/exp_avg_sq", m2, true))
          throw checkpoint_error("optimizer: the moments of '" + pname + "' are missing");
        if (m1.sizes() != p.sizes() || m2.sizes() != p.sizes())
          throw checkpoint_error("optimizer: the moments of '" + pname + "' have shape " +
                                 shape_text(m1) + " in the checkpoint, the parameter " + shape_text(p));
        auto s = std::make_unique<torch::optim::AdamWParamState>();
        s->step(step.toInt());
        s->exp_avg(m1.to(p.device(), p.scalar_type()).contiguous());
        s->exp_avg_sq(m2.to(p.device(), p.scalar_type()).contiguous());
        restored.emplace_back(key_of(p), std::move(s));
      }
    }
    for (auto& [key, s] : restored) {
      if (s) state[key] = std::move(s);
      else state.erase(key);
    }
    set_lr_multiplier(m);
  }

 private:
  struct group {
    std::string name;
    double lr_scale = 1.0, weight_decay = 0.0, max_grad_norm = 0.0;
    std::vector<torch::Tensor> params;
    std::vector<std::string> param_names;
  };

  const group& at(std::size_t g) const {
    UNIRL_CHECK(g < groups_.size(), "optimizer: group index ", g, " out of range; there are ",
                groups_.size(), " groups");
    return groups_[g];
  }
  // The key LibTorch's optimizers use for a parameter's state (a string in 1.13, a pointer in 2.x).
  static ::unirl::detail::compat::optimizer_state_key key_of(const torch::Tensor& p) {
    return ::unirl::detail::compat::optimizer_state_key_of(p);
  }
  static std::string shape_text(const torch::Tensor& t) {
    std::string s = "[";
    for (std::int64_t d = 0; d < t.dim(); ++d) s += (d ? ", " : "") + std::to_string(t.size(d));
    return s + "]";
  }
  static c10::IValue read_value(torch::serialize::InputArchive& a, const std::string& key) {
    c10::IValue v;
    if (!a.try_read(key, v)) throw checkpoint_error("optimizer: the archive has no entry '" + key + "'");
    return v;
  }
  static std::int64_t read_int(torch::serialize::InputArchive& a, const std::string& key) {
    auto v = read_value(a, key);
    if (!v.isInt()) throw checkpoint_error("optimizer: '" + key + "' is not an integer");
    return v.toInt();
  }
  static double read_double(torch::serialize::InputArchive& a, const std::string& key) {
    auto v = read_value(a, key);
    if (!v.isDouble()) throw checkpoint_error("optimizer: '" + key + "' is not a number");
    return v.toDouble();
  }
  static std::string read_string(torch::serialize::InputArchive& a, const std::string& key) {
    auto v = read_value(a, key);
    if (!v.isString()) throw checkpoint_error("optimizer: '" + key + "' is not a string");
    return v.toStringRef();
  }

  optimizer_options opts_;
  std::vector<group> groups_{};
  std::unique_ptr<torch::optim::AdamW> adamw_{};
  double multiplier_ = 1.0;
};

}  // namespace unirl::train

BOOST_HANA_ADAPT_STRUCT(unirl::train::param_group_options, prefix, lr_scale, weight_decay, max_grad_norm);
BOOST_HANA_ADAPT_STRUCT(unirl::train::optimizer_options, lr, beta1, beta2, eps, weight_decay, groups);
template <>
inline constexpr std::array unirl::options::field_docs<unirl::train::optimizer_options>{
    unirl::options::field_doc{"lr", "AdamW learning rate"},
    unirl::options::field_doc{"beta1", "AdamW first-moment decay"},
    unirl::options::field_doc{"beta2", "AdamW second-moment decay"},
    unirl::options::field_doc{"eps", "AdamW epsilon"},
    unirl::options::field_doc{"weight_decay", "decoupled (AdamW) weight decay"},
    unirl::options::field_doc{"groups", "parameter groups by name pattern with their own lr / weight_decay (JSON list)"}};

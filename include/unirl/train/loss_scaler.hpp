#pragma once
/// \file loss_scaler.hpp
/// Dynamic loss scaling for float16 training (docs/training.md, "Mixed precision"), the rule of
/// PyTorch's `GradScaler`: the loss is multiplied by `scale` before the backward, so that small
/// float16 gradients do not flush to zero; the gradients are divided by it again before clipping
/// and the optimizer step; a non-finite gradient means the scale overflowed: the step is skipped
/// (the stability guard's skip) and the scale multiplied by `backoff_factor`; after
/// `growth_interval` finite steps in a row it is multiplied by `growth_factor`.
///
/// ```cpp
/// unirl::train::loss_scaler scaler({.init_scale = 65536});
/// scaler.scale(loss).backward();
/// scaler.unscale(params);                        // gradients / scale
/// bool finite = ...;                             // the guard's found-non-finite flag
/// scaler.update(finite);                         // halves or (every growth_interval) doubles
/// if (finite) optimizer.step();
/// ```
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <boost/hana.hpp>
#include <torch/torch.h>

#include <unirl/core/error.hpp>
#include <unirl/core/options.hpp>

namespace unirl::train {

/// When the trainer scales the loss.
enum class loss_scaling {
  automatic,  // with precision = fp16 only
  on,         // always (any precision)
  off         // never
};

}  // namespace unirl::train

template <>
inline constexpr std::array unirl::enum_names<unirl::train::loss_scaling>{
    std::string_view{"auto"}, std::string_view{"on"}, std::string_view{"off"}};

namespace unirl::train {

/// Options of `loss_scaler` (PyTorch's GradScaler defaults).
struct loss_scale_options {
  loss_scaling mode = loss_scaling::automatic;
  double init_scale = 65536.0;          // 2^16
  double growth_factor = 2.0;           // after growth_interval finite steps in a row
  double backoff_factor = 0.5;          // after a non-finite gradient
  std::int64_t growth_interval = 2000;  // finite steps between growths
  double min_scale = 1.0;               // the scale never falls below it

  void validate(const std::string& p) const {
    options::require(init_scale > 0.0 && std::isfinite(init_scale), p + "init_scale", init_scale,
                     "a finite number > 0");
    options::require(growth_factor >= 1.0 && std::isfinite(growth_factor), p + "growth_factor", growth_factor,
                     "a finite number >= 1");
    options::require(backoff_factor > 0.0 && backoff_factor < 1.0, p + "backoff_factor", backoff_factor, "in (0, 1)");
    options::require(growth_interval >= 1, p + "growth_interval", growth_interval, ">= 1");
    options::require(min_scale > 0.0 && min_scale <= init_scale, p + "min_scale", min_scale,
                     "in (0, init_scale = " + std::to_string(init_scale) + "]");
  }
};

/// The dynamic loss scale (see the file comment). The scale lives on the host: the trainer reads
/// the found-non-finite flag once per minibatch anyway, so scaling adds no synchronisation.
class loss_scaler {
 public:
  explicit loss_scaler(loss_scale_options o = {}) : o_(o), scale_(o.init_scale) { o_.validate("loss_scale."); }

  /// `loss * scale`.
  torch::Tensor scale(const torch::Tensor& loss) const { return loss * scale_; }

  /// Divides every existing gradient of `params` by the scale, in place.
  void unscale(const std::vector<torch::Tensor>& params) const {
    torch::NoGradGuard ng;
    const double inv = 1.0 / scale_;
    for (const auto& p : params)
      if (p.defined() && p.grad().defined()) p.mutable_grad().mul_(inv);
  }

  /// Records one step: a non-finite gradient (`finite` false) multiplies the scale by
  /// `backoff_factor` (not below `min_scale`) and restarts the count; a finite one counts, and the
  /// `growth_interval`-th in a row multiplies it by `growth_factor`. Returns the new scale.
  double update(bool finite) {
    if (!finite) {
      scale_ = std::max(o_.min_scale, scale_ * o_.backoff_factor);
      good_ = 0;
    } else if (++good_ >= o_.growth_interval) {
      const double grown = scale_ * o_.growth_factor;
      if (std::isfinite(grown)) scale_ = grown;
      good_ = 0;
    }
    return scale_;
  }

  double value() const { return scale_; }
  /// Finite steps since the last change of the scale.
  std::int64_t good_steps() const { return good_; }
  const loss_scale_options& options() const { return o_; }

  /// Writes the scale and the count under `loss_scale/...`.
  void save(torch::serialize::OutputArchive& a) const {
    a.write("loss_scale/scale", c10::IValue(scale_));
    a.write("loss_scale/good_steps", c10::IValue(good_));
  }
  /// Restores what `save` wrote; throws `checkpoint_error` when a key is missing.
  void load(torch::serialize::InputArchive& a) {
    c10::IValue s, g;
    if (!a.try_read("loss_scale/scale", s) || !s.isDouble() || !a.try_read("loss_scale/good_steps", g) || !g.isInt())
      throw checkpoint_error("loss_scaler: the archive has no 'loss_scale/scale' (double) and "
                             "'loss_scale/good_steps' (integer)");
    scale_ = s.toDouble();
    good_ = g.toInt();
  }

 private:
  loss_scale_options o_;
  double scale_ = 1.0;
  std::int64_t good_ = 0;
};

}  // namespace unirl::train

BOOST_HANA_ADAPT_STRUCT(unirl::train::loss_scale_options, mode, init_scale, growth_factor, backoff_factor,
                        growth_interval, min_scale);
template <>
inline constexpr std::array unirl::options::field_docs<unirl::train::loss_scale_options>{
    unirl::options::field_doc{"mode", "dynamic loss scaling: auto (fp16 only), on or off"},
    unirl::options::field_doc{"init_scale", "initial scale"},
    unirl::options::field_doc{"growth_factor", "scale multiplier after growth_interval finite steps"},
    unirl::options::field_doc{"backoff_factor", "scale multiplier after a non-finite gradient"},
    unirl::options::field_doc{"growth_interval", "finite steps between growths"},
    unirl::options::field_doc{"min_scale", "the scale never falls below it"}};

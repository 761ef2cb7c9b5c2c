#pragma once
/// \file schedule.hpp
/// Learning-rate schedules: linear warm-up, then constant, linear or cosine decay.
///
/// The schedule is a multiplier on the optimizer's base learning rate:
/// ```cpp
/// unirl::train::schedule_options s{.kind = unirl::train::schedule_kind::cosine,
///                                  .warmup_steps = 10, .total_steps = 1000, .min_lr_ratio = 0.1};
/// opt.set_lr_multiplier(unirl::train::lr_multiplier(s, step));   // step is 0-based
/// ```
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <numbers>
#include <string>
#include <string_view>

#include <boost/hana.hpp>

#include <unirl/config.hpp>
#include <unirl/core/options.hpp>

namespace unirl::train {

/// Shape of the learning-rate curve after warm-up.
enum class schedule_kind { constant, linear, cosine };

}  // namespace unirl::train

template <>
inline constexpr std::array unirl::enum_names<unirl::train::schedule_kind>{
    std::string_view{"constant"}, std::string_view{"linear"}, std::string_view{"cosine"}};

namespace unirl::train {

/// Learning-rate schedule. With `warmup_steps = W > 0`, step `s < W` (0-based) gets the
/// multiplier `(s + 1) / W`. After warm-up: `constant` stays at 1; `linear` and `cosine` decay
/// from 1 at step `W` to `min_lr_ratio` at step `total_steps` and stay there. `total_steps = 0`
/// means "unknown": no decay.
struct schedule_options {
  schedule_kind kind = schedule_kind::constant;
  std::int64_t warmup_steps = 0;
  std::int64_t total_steps = 0;   // 0: no decay
  double min_lr_ratio = 0.0;      // final multiplier of linear / cosine decay

  void validate(const std::string& prefix) const {
    options::require(warmup_steps >= 0, prefix + "warmup_steps", warmup_steps, ">= 0");
    options::require(total_steps >= 0, prefix + "total_steps", total_steps, ">= 0 (0: no decay)");
    options::require(total_steps == 0 || warmup_steps <= total_steps, prefix + "warmup_steps",
                     warmup_steps, "<= total_steps (" + std::to_string(total_steps) + ")");
    options::require(min_lr_ratio >= 0.0 && min_lr_ratio <= 1.0, prefix + "min_lr_ratio",
                     min_lr_ratio, "in [0, 1]");
  }
};

/// The learning-rate multiplier at 0-based optimizer step `step` (see `schedule_options`).
/// ```cpp
/// lr_multiplier({.warmup_steps = 4}, 0);   // 0.25
/// lr_multiplier({.kind = schedule_kind::linear, .total_steps = 10}, 5);   // 0.5
/// ```
inline double lr_multiplier(const schedule_options& s, std::int64_t step) {
  if (step < 0) step = 0;
  if (s.warmup_steps > 0 && step < s.warmup_steps)
    return static_cast<double>(step + 1) / static_cast<double>(s.warmup_steps);
  if (s.kind == schedule_kind::constant || s.total_steps <= 0) return 1.0;
  const double span = static_cast<double>(s.total_steps - s.warmup_steps);
  const double p =
      span <= 0.0 ? 1.0 : std::clamp(static_cast<double>(step - s.warmup_steps) / span, 0.0, 1.0);
  const double shape = s.kind == schedule_kind::linear
                           ? 1.0 - p
                           : 0.5 * (1.0 + std::cos(std::numbers::pi * p));
  return s.min_lr_ratio + (1.0 - s.min_lr_ratio) * shape;
}

}  // namespace unirl::train

BOOST_HANA_ADAPT_STRUCT(unirl::train::schedule_options, kind, warmup_steps, total_steps, min_lr_ratio);
template <>
inline constexpr std::array unirl::options::field_docs<unirl::train::schedule_options>{
    unirl::options::field_doc{"kind", "learning-rate schedule after the warm-up"},
    unirl::options::field_doc{"warmup_steps", "linear warm-up steps from 0"},
    unirl::options::field_doc{"total_steps", "steps of the decay; 0 = the run's steps"},
    unirl::options::field_doc{"min_lr_ratio", "final multiplier of linear / cosine decay"}};

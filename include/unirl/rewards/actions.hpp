#pragma once
/// \file actions.hpp
/// Rewards for a multimodal agent whose actions are text (seed 003 §8.1): `click_reward` parses
/// the action each completion wrote (rewards/action_parser.hpp: `click(12, 30)`, `scroll(...)`,
/// `type(...)`) and scores it against the target box in the sample's reference, written as
/// iou_reward reads boxes (the first four numbers: "[x1, y1, x2, y2]" or "(x1,y1),(x2,y2)";
/// data/canvas.hpp's `box_text` writes them).
///
/// ```cpp
/// unirl::rewards::click_reward click{{.invalid = -0.5}};
/// batch.completions = {"click(12, 30)", "click(0, 0)", "clik(12"};
/// batch.references  = {"[8, 24, 16, 32]", "[8, 24, 16, 32]", "[8, 24, 16, 32]"};
/// torch::Tensor r = click(batch);                  // {1, 0, -0.5}
/// auto figures = click.last_components();          // {"malformed": 1, "clicks": 2, "hits": 1, ...}
/// ```
/// A click hits when x1 <= x < x2 and y1 <= y < y2 (pixel (x, y) covers [x, x+1) x [y, y+1), so the
/// box covers pixels x1 .. x2-1): a click on pixel 12 of a box [8, 24, 16, 32] hits, on pixel 16
/// it does not.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include <boost/hana.hpp>
#include <torch/torch.h>

#include <unirl/core/error.hpp>
#include <unirl/core/options.hpp>
#include <unirl/rewards/action_parser.hpp>
#include <unirl/rewards/rules.hpp>
#include <unirl/rewards/scorer.hpp>

namespace unirl::rewards {

/// Options of `click_reward`.
struct click_reward_options {
  double hit = 1.0;              // a click inside the target box
  double miss = 0.0;             // any other well-formed action (a click outside, a scroll, a type)
  double invalid = 0.0;          // a completion without a well-formed action
  bool whole = false;            // true: the completion must be exactly one action; false: the first action in it
  std::int64_t max_length = 256; // bytes of one action (action_limits::max_length)

  void validate(const std::string& prefix) const {
    options::require(std::isfinite(hit), prefix + "hit", hit, "a finite number");
    options::require(std::isfinite(miss), prefix + "miss", miss, "a finite number");
    options::require(std::isfinite(invalid), prefix + "invalid", invalid, "a finite number");
    options::require(max_length >= 8, prefix + "max_length", max_length, ">= 8");
  }
};

}  // namespace unirl::rewards
BOOST_HANA_ADAPT_STRUCT(unirl::rewards::click_reward_options, hit, miss, invalid, whole, max_length);
namespace unirl::rewards {

/// True when the point (x, y) lies in the box (x1, y1, x2, y2): x1 <= x < x2 and y1 <= y < y2.
inline bool box_contains(const std::vector<double>& box, double x, double y) {
  return box.size() >= 4 && x >= box[0] && x < box[2] && y >= box[1] && y < box[3];
}

/// `hit` when the completion's action is a click inside the reference box, `miss` for any other
/// action, `invalid` when it holds none. `last_components()` reports the last call's counts:
/// `malformed` (completions without a well-formed action), `clicks`, `hits`, and
/// `malformed_fraction`.
struct click_reward {
  using options = click_reward_options;
  static constexpr std::string_view name = "click";

  click_reward() : click_reward(options{}) {}
  explicit click_reward(options o) : opts_(std::move(o)), figures_(std::make_shared<figures>()) {
    unirl::options::validate(opts_);
    limits_.max_length = static_cast<std::size_t>(opts_.max_length);
  }

  /// The action a completion holds (per `whole`), or the reason it holds none.
  action_parse parse(std::string_view completion) const {
    return opts_.whole ? parse_action(completion, limits_) : find_action(completion, limits_);
  }

  template <class B>
    requires HasCompletions<B> && HasReferences<B>
  torch::Tensor operator()(const B& b) const {
    const auto& completions = completions_of(b, "click_reward");
    std::vector<float> r;
    r.reserve(completions.size());
    std::int64_t malformed = 0, clicks = 0, hits = 0;
    for (std::size_t i = 0; i < completions.size(); ++i) {
      const auto box = detail::numbers_in(reference_at(b, i, "click_reward"));
      UNIRL_CHECK(box.size() >= 4 && std::all_of(box.begin(), box.begin() + 4, [](double v) { return std::isfinite(v); }),
                  "click_reward: reference ", i, " '", b.references[i], "' has ", box.size(),
                  " numbers; expected a finite box x1, y1, x2, y2");
      const auto p = parse(completions[i]);
      if (!p) {
        ++malformed;
        r.push_back(static_cast<float>(opts_.invalid));
        continue;
      }
      const bool is_click = p.action->type == action_type::click;
      const bool hit = is_click && box_contains(box, p.action->x, p.action->y);
      clicks += is_click;
      hits += hit;
      r.push_back(static_cast<float>(hit ? opts_.hit : opts_.miss));
    }
    {
      std::lock_guard lock(figures_->mutex);
      const auto n = static_cast<double>(completions.size());
      figures_->last = {{"malformed", static_cast<double>(malformed)},
                        {"clicks", static_cast<double>(clicks)},
                        {"hits", static_cast<double>(hits)},
                        {"malformed_fraction", n > 0 ? static_cast<double>(malformed) / n : 0.0}};
    }
    return to_scores(r);
  }

  /// Counts of the last call: malformed, clicks, hits, malformed_fraction (empty before a call).
  std::map<std::string, double> last_components() const {
    std::lock_guard lock(figures_->mutex);
    return figures_->last;
  }
  const options& opts() const { return opts_; }

 private:
  struct figures {
    std::mutex mutex;
    std::map<std::string, double> last;
  };
  options opts_;
  action_limits limits_;
  std::shared_ptr<figures> figures_;  // copies of the scorer report together
};

}  // namespace unirl::rewards

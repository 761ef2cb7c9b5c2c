#pragma once
/// \file canvas_click.hpp
/// The click task of seed 003 §8.1's multimodal agent as an environment: a canvas of digits and
/// a target digit ("click the 7"); the agent acts with a mixed action (an action type and a point,
/// models/mixed_action.hpp) and earns `hit_reward` when it clicks inside the target digit's box.
///
/// ```cpp
/// unirl::data::digit_canvas canvases(digits.images, digits.labels, {.size = 32});
/// using click_env = unirl::envs::canvas_click<unirl::data::digit_canvas, 32>;
/// click_env env(canvases);
/// auto obs = env.reset(7);                      // 32*32 pixels then the target's one-hot (10)
/// auto r = env.step({0.0f, -0.25f, 0.1f});      // click (type 0) at pixel (12, 17.6)
/// unirl::envs::vector_env<click_env> venv(env, {.num_envs = 8});   // for PPO with mixed_actor_critic
/// ```
/// - Observation (Size * Size + 10 floats): the canvas image row by row, then the one-hot of the
///   target label.
/// - Action `{type, x, y}` (a `box_space<3>`: type in [0, 2], x and y in [-1, 1]): the type is
///   rounded to the nearest integer — 0 click, 1 scroll, 2 type; (x, y) maps to the pixel point
///   ((x + 1) / 2 * Size, (y + 1) / 2 * Size), so -1 is the left / top edge and 1 the right / bottom.
/// - Reward and end: a click ends the episode (terminated) with `hit_reward` when the point lies
///   in the target box (x1 <= px < x2, y1 <= py < y2), else `miss_reward`; scroll and type do
///   nothing (`other_reward`); the episode is truncated after `max_episode_steps` steps.
/// - `reset(seed)` draws the canvas `canvases(s1)` and the target among its digits from a
///   generator seeded with `seed`: the same episode for the same seed.
///
/// `Canvases` is any copyable callable `c(std::uint64_t seed)` returning a canvas with `image`
/// ((1, Size, Size) or (Size, Size) float tensor), `labels` (integers 0..9) and `boxes` (each
/// with x1, y1, x2, y2 in pixels), e.g. `data::digit_canvas`. The environment does not
/// checkpoint (a canvas is drawn again from its seed).
#include <array>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <utility>

#include <boost/hana.hpp>
#include <torch/torch.h>

#include <unirl/concepts/environment.hpp>
#include <unirl/core/error.hpp>
#include <unirl/core/options.hpp>

namespace unirl::envs {

/// Settings of a `canvas_click`.
struct canvas_click_options {
  std::int64_t max_episode_steps = 4;  // steps before truncation (a click always ends the episode)
  double hit_reward = 1.0;             // a click inside the target box
  double miss_reward = 0.0;            // a click outside it
  double other_reward = 0.0;           // a scroll or a type action

  void validate(const std::string& prefix) const {
    options::require(max_episode_steps >= 1, prefix + "max_episode_steps", max_episode_steps, ">= 1");
    for (auto [k, v] : {std::pair{"hit_reward", hit_reward}, {"miss_reward", miss_reward}, {"other_reward", other_reward}})
      options::require(std::isfinite(v), prefix + k, v, "a finite number");
  }
};

}  // namespace unirl::envs
BOOST_HANA_ADAPT_STRUCT(unirl::envs::canvas_click_options, max_episode_steps, hit_reward, miss_reward, other_reward);
namespace unirl::envs {

/// Click the target digit on a `Size` x `Size` canvas drawn by `Canvases`.
template <class Canvases, std::int64_t Size = 32>
class canvas_click {
  static_assert(Size >= 8 && Size <= 512, "unirl::envs::canvas_click: Size in [8, 512]");

 public:
  static constexpr std::int64_t size = Size;
  static constexpr std::int64_t classes = 10;
  static constexpr std::size_t observation_size = static_cast<std::size_t>(Size * Size + classes);
  using observation_type = std::array<float, observation_size>;
  using action_type = std::array<float, 3>;  // type, x, y
  using action_space_type = box_space<3>;
  /// Action types (the first component of an action, rounded).
  static constexpr std::int64_t click = 0, scroll = 1, type = 2;

  explicit canvas_click(Canvases canvases, canvas_click_options o = {})
      : canvases_(std::move(canvases)), opts_(std::move(o)) {
    unirl::options::validate(opts_);
  }

  action_space_type action_space() const { return {{0.0f, -1.0f, -1.0f}, {2.0f, 1.0f, 1.0f}}; }

  /// The pixel coordinate of an action coordinate in [-1, 1]: (c + 1) / 2 * Size.
  static double to_pixel(double c) { return (c + 1.0) / 2.0 * static_cast<double>(Size); }
  /// The action coordinate of a pixel coordinate (the inverse of `to_pixel`).
  static double to_action(double p) { return p / static_cast<double>(Size) * 2.0 - 1.0; }

  /// A new episode: the canvas and the target drawn from a generator seeded with `seed`.
  observation_type reset(std::uint64_t seed) {
    std::mt19937_64 rng(seed);
    auto c = canvases_(rng());
    UNIRL_CHECK(c.image.defined() && c.image.numel() == Size * Size, "canvas_click::reset: a canvas image of shape ",
                c.image.defined() ? c.image.sizes() : torch::IntArrayRef{}, ": expected (1, ", Size, ", ", Size, ")");
    UNIRL_CHECK(!c.labels.empty() && c.labels.size() == c.boxes.size(), "canvas_click::reset: a canvas with ",
                c.labels.size(), " labels and ", c.boxes.size(), " boxes: expected as many, at least one");
    const auto pixels = c.image.detach().to(torch::kCPU, torch::kFloat).contiguous();
    const float* p = pixels.template data_ptr<float>();
    std::copy(p, p + Size * Size, obs_.begin());
    const auto t = static_cast<std::size_t>(rng() % c.labels.size());
    label_ = static_cast<std::int64_t>(c.labels[t]);
    UNIRL_CHECK(label_ >= 0 && label_ < classes, "canvas_click::reset: target label ", label_, ": expected 0..9");
    const auto& b = c.boxes[t];
    box_ = {static_cast<double>(b.x1), static_cast<double>(b.y1), static_cast<double>(b.x2), static_cast<double>(b.y2)};
    std::fill(obs_.begin() + Size * Size, obs_.end(), 0.0f);
    obs_[static_cast<std::size_t>(Size * Size + label_)] = 1.0f;
    steps_ = 0;
    started_ = true;
    done_ = false;
    return obs_;
  }

  /// One action `{type, x, y}`. Throws for an action outside the space (NaN included) and for a
  /// step after the end of the episode or before `reset`.
  step_result<observation_type> step(const action_type& a) {
    UNIRL_CHECK(started_, "canvas_click::step: called before reset()");
    UNIRL_CHECK(!done_, "canvas_click::step: the episode ended after ", steps_, " steps; call reset() before stepping again");
    UNIRL_CHECK(action_space().contains(a), "canvas_click::step: action (", a[0], ", ", a[1], ", ", a[2],
                "): expected type in [0, 2] and x, y in [-1, 1], all finite");
    ++steps_;
    const auto kind = static_cast<std::int64_t>(std::lround(a[0]));
    step_result<observation_type> r;
    r.observation = obs_;
    if (kind == click) {
      r.reward = hits(a[1], a[2]) ? opts_.hit_reward : opts_.miss_reward;
      r.terminated = true;
    } else {
      r.reward = opts_.other_reward;
      r.truncated = steps_ >= opts_.max_episode_steps;
    }
    done_ = r.terminated || r.truncated;
    return r;
  }

  /// True when the action coordinates (x, y) in [-1, 1] fall inside the target box.
  bool hits(double x, double y) const {
    const double px = to_pixel(x), py = to_pixel(y);
    return px >= box_[0] && px < box_[2] && py >= box_[1] && py < box_[3];
  }
  /// The target's label and box (x1, y1, x2, y2) in pixels in the current episode.
  std::int64_t target_label() const { return label_; }
  const std::array<double, 4>& target_box() const { return box_; }
  std::int64_t elapsed_steps() const { return steps_; }
  const canvas_click_options& options() const { return opts_; }

 private:
  Canvases canvases_;
  canvas_click_options opts_;
  observation_type obs_{};
  std::array<double, 4> box_{};
  std::int64_t label_ = 0, steps_ = 0;
  bool started_ = false, done_ = false;
};

}  // namespace unirl::envs

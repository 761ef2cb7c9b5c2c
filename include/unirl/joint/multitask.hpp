#pragma once
/// \file multitask.hpp
/// `joint::multitask`: several tasks in one run — each a trainer of any track (token, flow, env),
/// or anything else stepped on an input (a `joint::chain`), with its own input source — one task
/// chosen per step by sampling weights, fixed or driven by each task's recent reward progress.
/// The trainers stay the caller's and keep their own algorithm, optimizer, options and
/// statistics; the multitask only decides who steps, records per-task statistics, and saves every
/// trainer with its own state (counts, reward averages, the task-choice stream) in one file.
///
/// ```cpp
/// using lm_t = unirl::trainer<unirl::models::gpt, unirl::algo::grpo<>, arithmetic_reward>;
/// using gen_t = unirl::trainer<flow_t, unirl::algo::flow_grpo<>, digit_reward>;
/// lm_t lm{model, arithmetic_reward{}, {.group_size = 8}};
/// gen_t gen{flow, digit_reward{}, {.group_size = 4}};
/// unirl::joint::multitask run{{.weighting = unirl::joint::task_weighting::progress, .seed = 1},
///                             unirl::joint::task{"arithmetic", 1.0, &lm, [&](std::int64_t k) { return prompts(k); }},
///                             unirl::joint::task{"digits", 2.0, &gen, [&](std::int64_t k) { return labels(k); }}};
/// for (int i = 0; i < 200; ++i) {
///   unirl::joint::task_step s = run.step();   // s.name, s.reward_mean, s.figures["task/digits/probability"]
/// }
/// run.save("run/multitask.pt");               // later, fresh objects: run.load(...) continues bit for bit
/// ```
///
/// Sampling distribution over the K tasks (weights w_i >= 0, not all 0):
/// - `fixed`: p_i = w_i / sum_j w_j.
/// - `progress`: each task keeps two exponential moving averages of its steps' mean reward r,
///   f_i <- (1 - fast) f_i + fast r and s_i <- (1 - slow) s_i + slow r (both start at the first
///   r observed); its progress is g_i = |f_i - s_i| (0 before its second step), and
///   q_i = w_i exp(g_i / temperature) / sum_j w_j exp(g_j / temperature),
///   p_i = floor / K + (1 - floor) q_i
///   so every task keeps at least floor / K, and a task whose reward is moving (up or down) is
///   chosen more often than one that has plateaued.
///
/// The choice stream is a `std::mt19937_64` seeded with `seed` (independent of LibTorch's
/// generators, which the trainers use): the choice u = (x >> 11) 2^-53 of the next 64-bit draw x
/// picks the first task whose cumulative probability exceeds u (`sample_index`).
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <boost/hana.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <unirl/concepts/checkpoint.hpp>
#include <unirl/concepts/joint.hpp>
#include <unirl/core/error.hpp>
#include <unirl/core/options.hpp>
#include <unirl/core/stats.hpp>
#include <unirl/train/checkpoint.hpp>

namespace unirl::joint {

/// How a `multitask` weighs its tasks (see the formulas in this header).
enum class task_weighting { fixed, progress };

}  // namespace unirl::joint

template <>
inline constexpr std::array unirl::enum_names<unirl::joint::task_weighting>{std::string_view{"fixed"},
                                                                            std::string_view{"progress"}};

namespace unirl::joint {

/// Settings of a `multitask` (reflectable: a recipe can declare them).
struct multitask_options {
  task_weighting weighting = task_weighting::fixed;
  double temperature = 0.05;  // progress weighting: softmax temperature on the progress g_i
  double fast = 0.5;          // progress weighting: rate of the fast moving average of a task's reward
  double slow = 0.1;          // ... and of the slow one; progress g_i = |fast average - slow average|
  double floor = 0.05;        // progress weighting: every task keeps >= floor / K probability
  std::uint64_t seed = 0;     // the task-choice stream (its own generator, saved in checkpoints)

  void validate(const std::string& p) const {
    options::require(std::isfinite(temperature) && temperature > 0, p + "temperature", temperature,
                     "a finite number > 0");
    options::require(std::isfinite(fast) && fast > 0 && fast <= 1, p + "fast", fast, "in (0, 1]");
    options::require(std::isfinite(slow) && slow > 0 && slow <= 1, p + "slow", slow, "in (0, 1]");
    options::require(std::isfinite(floor) && floor >= 0 && floor <= 1, p + "floor", floor, "in [0, 1]");
  }
};

}  // namespace unirl::joint

BOOST_HANA_ADAPT_STRUCT(unirl::joint::multitask_options, weighting, temperature, fast, slow, floor, seed);

namespace unirl::joint {

/// One task of a `multitask`: a name (unique; it keys the statistics), a sampling weight (>= 0),
/// the trainer (any `SteppedTrainer` for the input its source returns: a `unirl::trainer`, a
/// `joint::chain`; it stays the caller's, and two tasks may share one) and the source of its step
/// inputs, `next(k)` for the task's k-th step (k = 0, 1, ...: its own count, not the run's).
template <class Trainer, class Source>
struct task {
  std::string name;
  double weight = 1.0;
  Trainer* trainer = nullptr;
  Source next;
};
template <class Trainer, class Source>
task(std::string, double, Trainer*, Source) -> task<Trainer, Source>;

/// What the scheduler knows of one task.
struct task_statistics {
  std::string name;
  double weight = 0;
  std::int64_t steps = 0;  // steps taken by this task
  double reward = 0;       // mean reward of its last step (0 before its first)
  double reward_fast = 0;  // fast moving average of its steps' mean rewards
  double reward_slow = 0;  // slow moving average
  double progress = 0;     // |reward_fast - reward_slow|
  double probability = 0;  // its probability in the current sampling distribution
};

/// The task the cumulative distribution `p` gives for `u` in [0, 1): the first i with
/// p_0 + ... + p_i > u (rounding past the end: the last task of positive probability).
inline std::size_t sample_index(const std::vector<double>& p, double u) {
  UNIRL_CHECK(!p.empty(), "joint::sample_index: no probabilities: expected one per task");
  UNIRL_CHECK(u >= 0 && u < 1, "joint::sample_index: u = ", u, ": expected a number in [0, 1)");
  std::size_t last = p.size();
  for (std::size_t i = 0; i < p.size(); ++i) {
    UNIRL_CHECK(std::isfinite(p[i]) && p[i] >= 0, "joint::sample_index: probability ", i, " = ", p[i],
                ": expected a finite number >= 0");
    if (p[i] > 0) last = i;
  }
  UNIRL_CHECK(last < p.size(), "joint::sample_index: every probability is 0: expected a distribution");
  double c = 0;
  for (std::size_t i = 0; i < p.size(); ++i) {
    c += p[i];
    if (p[i] > 0 && u < c) return i;
  }
  return last;
}

/// The choice logic of a `multitask`, usable without trainers: the sampling distribution, the
/// choice stream, and each task's counts and reward averages. `draw()` picks a task; `observe`
/// records the mean reward of its step.
class task_scheduler {
 public:
  /// Throws naming the value for an empty, duplicate or missing name, a negative or non-finite
  /// weight, weights all 0, or a bad option (`config_error`, key `multitask.<member>`).
  task_scheduler(multitask_options o, std::vector<std::string> names, std::vector<double> weights)
      : opts_(o), names_(std::move(names)), weights_(std::move(weights)), gen_(o.seed) {
    opts_.validate("multitask.");
    UNIRL_CHECK(!names_.empty(), "joint::multitask: no tasks: expected at least one");
    UNIRL_CHECK(names_.size() == weights_.size(), "joint::multitask: ", names_.size(), " task names but ",
                weights_.size(), " weights: expected one weight per task");
    double sum = 0;
    for (std::size_t i = 0; i < names_.size(); ++i) {
      UNIRL_CHECK(!names_[i].empty(), "joint::multitask: task ", i, " has an empty name: expected a unique name");
      for (std::size_t j = 0; j < i; ++j)
        UNIRL_CHECK(names_[j] != names_[i], "joint::multitask: tasks ", j, " and ", i, " are both named '", names_[i],
                    "': expected unique names (they key the statistics and the checkpoint)");
      UNIRL_CHECK(std::isfinite(weights_[i]) && weights_[i] >= 0, "joint::multitask: task '", names_[i],
                  "' has weight ", weights_[i], ": expected a finite number >= 0");
      sum += weights_[i];
    }
    UNIRL_CHECK(sum > 0 && std::isfinite(sum), "joint::multitask: the weights ", weights_text(),
                " are all 0 (or sum to ", sum, "): expected at least one > 0 and a finite sum");
    const auto k = names_.size();
    steps_.assign(k, 0);
    reward_.assign(k, 0.0);
    fast_.assign(k, 0.0);
    slow_.assign(k, 0.0);
  }

  std::size_t size() const { return names_.size(); }
  const std::vector<std::string>& names() const { return names_; }
  const std::vector<double>& weights() const { return weights_; }
  const multitask_options& settings() const { return opts_; }
  /// Steps taken by task `i` (the k its source is called with next).
  std::int64_t steps(std::size_t i) const { return steps_.at(i); }
  /// Draws made: the run's steps.
  std::int64_t draws() const { return draws_; }

  /// The current sampling distribution (the formulas in this header's comment).
  std::vector<double> probabilities() const {
    const std::size_t k = size();
    std::vector<double> p(k, 0.0);
    double sum = 0;
    if (opts_.weighting == task_weighting::fixed) {
      for (double w : weights_) sum += w;
      for (std::size_t i = 0; i < k; ++i) p[i] = weights_[i] / sum;
      return p;
    }
    // log w_i + g_i / T, shifted by its maximum: the softmax without overflow at small T.
    double top = -std::numeric_limits<double>::infinity();
    for (std::size_t i = 0; i < k; ++i)
      if (weights_[i] > 0) top = std::max(top, std::log(weights_[i]) + progress(i) / opts_.temperature);
    for (std::size_t i = 0; i < k; ++i) {
      p[i] = weights_[i] > 0 ? std::exp(std::log(weights_[i]) + progress(i) / opts_.temperature - top) : 0.0;
      sum += p[i];
    }
    const double kf = static_cast<double>(k);
    for (std::size_t i = 0; i < k; ++i) p[i] = opts_.floor / kf + (1 - opts_.floor) * p[i] / sum;
    return p;
  }

  /// The next task: one draw of the choice stream against `probabilities()`.
  std::size_t draw() {
    const double u = static_cast<double>(gen_() >> 11) * 0x1.0p-53;
    ++draws_;
    return sample_index(probabilities(), u);
  }

  /// Records the mean reward of task `i`'s step: its count and moving averages. A non-finite
  /// reward is an error naming the task.
  void observe(std::size_t i, double reward_mean) {
    UNIRL_CHECK(i < size(), "joint::multitask: task index ", i, ": expected < ", size());
    UNIRL_CHECK(std::isfinite(reward_mean), "joint::multitask: task '", names_[i], "' step ", steps_[i],
                " reported a mean reward of ", reward_mean, ": expected a finite number");
    if (steps_[i] == 0) {
      fast_[i] = slow_[i] = reward_mean;
    } else {
      fast_[i] = (1 - opts_.fast) * fast_[i] + opts_.fast * reward_mean;
      slow_[i] = (1 - opts_.slow) * slow_[i] + opts_.slow * reward_mean;
    }
    reward_[i] = reward_mean;
    ++steps_[i];
  }

  /// g_i = |f_i - s_i|.
  double progress(std::size_t i) const { return std::abs(fast_.at(i) - slow_.at(i)); }

  std::vector<task_statistics> statistics() const {
    const auto p = probabilities();
    std::vector<task_statistics> out;
    for (std::size_t i = 0; i < size(); ++i)
      out.push_back({names_[i], weights_[i], steps_[i], reward_[i], fast_[i], slow_[i], progress(i), p[i]});
    return out;
  }

  /// The statistics as figures: `task/<name>/weight`, `.../steps`, `.../reward`, `.../reward_fast`,
  /// `.../reward_slow`, `.../progress`, `.../probability`.
  std::map<std::string, double> figures() const {
    std::map<std::string, double> f;
    for (const auto& s : statistics()) {
      const std::string k = "task/" + s.name + "/";
      f[k + "weight"] = s.weight;
      f[k + "steps"] = static_cast<double>(s.steps);
      f[k + "reward"] = s.reward;
      f[k + "reward_fast"] = s.reward_fast;
      f[k + "reward_slow"] = s.reward_slow;
      f[k + "progress"] = s.progress;
      f[k + "probability"] = s.probability;
    }
    return f;
  }

  void save(torch::serialize::OutputArchive& a) const {
    train::write_scalar(a, "tasks", nlohmann::json(names_).dump());
    train::write_scalar(a, "weights", nlohmann::json(weights_).dump());
    train::write_scalar(a, "options", options::to_json(opts_).dump());
    train::write_scalar(a, "draws", draws_);
    a.write("steps", torch::tensor(steps_, torch::kInt64), /*is_buffer=*/true);
    a.write("reward", torch::tensor(reward_, torch::kFloat64), /*is_buffer=*/true);
    a.write("reward_fast", torch::tensor(fast_, torch::kFloat64), /*is_buffer=*/true);
    a.write("reward_slow", torch::tensor(slow_, torch::kFloat64), /*is_buffer=*/true);
    std::ostringstream rng;
    rng << gen_;
    train::write_scalar(a, "rng", rng.str());
  }

  /// Restores what `save` wrote; a checkpoint of other tasks, weights or options is refused
  /// (`checkpoint_error` naming both), and a failure changes nothing.
  void load(torch::serialize::InputArchive& a) {
    const std::string who = "joint::multitask::load";
    const auto same = [&](const std::string& key, const std::string& mine, const std::string& what) {
      const auto saved = train::read_scalar<std::string>(a, key);
      if (saved != mine)
        throw checkpoint_error(who + ": the checkpoint's " + what + " " + saved + " differ from this run's " + mine);
    };
    same("tasks", nlohmann::json(names_).dump(), "tasks");
    same("weights", nlohmann::json(weights_).dump(), "weights");
    same("options", options::to_json(opts_).dump(), "options");
    const auto draws = train::read_scalar<std::int64_t>(a, "draws");
    const auto k = static_cast<std::int64_t>(size());
    const auto vec = [&](const std::string& key, torch::ScalarType type) {
      const auto t = train::read_tensor(a, key, who);
      if (t.dim() != 1 || t.size(0) != k || t.scalar_type() != type)
        throw checkpoint_error(who + ": entry '" + key + "' has " + std::to_string(t.numel()) + " " +
                               std::string(c10::toString(t.scalar_type())) + " values: expected " + std::to_string(k) +
                               " " + c10::toString(type));
      return t.contiguous();
    };
    const auto steps = vec("steps", torch::kInt64), reward = vec("reward", torch::kFloat64),
               fast = vec("reward_fast", torch::kFloat64), slow = vec("reward_slow", torch::kFloat64);
    std::mt19937_64 gen;
    std::istringstream rng(train::read_scalar<std::string>(a, "rng"));
    rng >> gen;
    if (rng.fail()) throw checkpoint_error(who + ": entry 'rng' is not a std::mt19937_64 state");
    for (std::int64_t i = 0; i < k; ++i)
      if (steps[i].item<std::int64_t>() < 0)
        throw checkpoint_error(who + ": task '" + names_[static_cast<std::size_t>(i)] + "' has " +
                               std::to_string(steps[i].item<std::int64_t>()) + " steps: expected >= 0");
    const auto as_vector = [](const torch::Tensor& t, auto zero) {
      using V = decltype(zero);
      return std::vector<V>(t.data_ptr<V>(), t.data_ptr<V>() + t.numel());
    };
    steps_ = as_vector(steps, std::int64_t{});
    reward_ = as_vector(reward, double{});
    fast_ = as_vector(fast, double{});
    slow_ = as_vector(slow, double{});
    draws_ = draws;
    gen_ = gen;
  }

 private:
  std::string weights_text() const { return nlohmann::json(weights_).dump(); }

  multitask_options opts_;
  std::vector<std::string> names_;
  std::vector<double> weights_;
  std::mt19937_64 gen_;
  std::int64_t draws_ = 0;
  std::vector<std::int64_t> steps_;
  std::vector<double> reward_, fast_, slow_;
};

/// What one `multitask::step` did.
struct task_step {
  std::int64_t step = 0;                  // the run's step (0-based)
  std::size_t index = 0;                  // the task chosen
  std::string name;                       // ... its name
  std::int64_t k = 0;                     // ... its own step index (its source was called with it)
  double probability = 0;                 // the probability it was drawn with
  double reward_mean = 0;                 // the mean reward of its step
  std::optional<step_stats> stats;        // its trainer's statistics (when its step returns step_stats)
  nlohmann::json task_stats;              // its step's result as JSON (`to_json()`: step_stats, chain_stats)
  std::map<std::string, double> figures;  // every task's statistics after the step (task_scheduler::figures)

  /// One flat JSON object: `step`, `task`, `index`, `k`, `probability`, `reward_mean`, the figures,
  /// and the chosen task's statistics under `<name>/`.
  nlohmann::json to_json() const {
    nlohmann::json j{{"step", step},
                     {"task", name},
                     {"index", index},
                     {"k", k},
                     {"probability", probability},
                     {"reward_mean", reward_mean}};
    for (const auto& [key, v] : figures) j[key] = v;
    if (task_stats.is_object())
      for (const auto& [key, v] : task_stats.items()) j[name + "/" + key] = v;
    return j;
  }
};

}  // namespace unirl::joint

namespace unirl::detail {
template <class T>
struct is_multitask_task : std::false_type {};
template <class Trainer, class Source>
struct is_multitask_task<joint::task<Trainer, Source>> : std::true_type {};

template <class T>
struct multitask_task_parts;
template <class Trainer, class Source>
struct multitask_task_parts<joint::task<Trainer, Source>> {
  static constexpr bool source_ok = std::is_invocable_v<Source&, std::int64_t>;
  static constexpr bool trainer_ok() {
    if constexpr (source_ok)
      return SteppedTrainer<Trainer, std::invoke_result_t<Source&, std::int64_t>>;
    else
      return true;
  }
};
}  // namespace unirl::detail

namespace unirl::joint {

/// Several tasks, one chosen per step (see this header's comment). `Tasks`: `task<Trainer, Source>`
/// each, `Trainer` a `SteppedTrainer` (concepts/joint.hpp) for the input its `Source` returns.
/// Models `Checkpointable`, so a multitask can itself be an extra of another checkpoint.
template <class... Tasks>
class multitask {
  static_assert(sizeof...(Tasks) >= 1, "unirl::joint::multitask: expected at least one task");
  static_assert((::unirl::detail::is_multitask_task<Tasks>::value && ...),
                "unirl::joint::multitask: every argument after the options must be a "
                "unirl::joint::task{name, weight, &trainer, source}");
  static_assert((::unirl::detail::multitask_task_parts<Tasks>::source_ok && ...),
                "unirl::joint::multitask: a task's Source is not callable as next(std::int64_t k) (the task's "
                "k-th step input)");
  static_assert((::unirl::detail::multitask_task_parts<Tasks>::trainer_ok() && ...),
                "unirl::joint::multitask: a task's Trainer does not model unirl::SteppedTrainer<Trainer, Input> "
                "(concepts/joint.hpp) for the Input its Source returns: it needs step(Input) returning "
                "unirl::step_stats (or a type with a double reward_mean, such as joint::chain_stats) and "
                "unirl::Checkpointable's save(torch::serialize::OutputArchive&) const and "
                "load(torch::serialize::InputArchive&)");

 public:
  /// Throws naming the value for a bad option, name or weight (see `task_scheduler`) or a task
  /// without a trainer.
  explicit multitask(multitask_options o, Tasks... tasks) : tasks_(std::move(tasks)...), sched_(o, names(), weights()) {
    const auto check = [](const auto& t) {
      UNIRL_CHECK(t.trainer != nullptr, "joint::multitask: task '", t.name,
                  "' has no trainer (a null pointer): expected the address of its trainer");
    };
    std::apply([&](const auto&... t) { (check(t), ...); }, tasks_);
  }

  /// One step: draws a task i, steps its trainer on `next(k_i)` (k_i its own step count) and
  /// records the mean reward. A step that throws leaves the task's count and averages unchanged
  /// (the draw is spent).
  task_step step() {
    task_step out;
    out.step = sched_.draws();
    const auto p = sched_.probabilities();
    out.index = sched_.draw();
    out.probability = p[out.index];
    run_task(out, std::index_sequence_for<Tasks...>{});
    out.figures = sched_.figures();
    return out;
  }

  /// The current sampling distribution, one probability per task in order.
  std::vector<double> probabilities() const { return sched_.probabilities(); }
  std::vector<task_statistics> statistics() const { return sched_.statistics(); }
  std::map<std::string, double> figures() const { return sched_.figures(); }
  /// Steps taken by the run.
  std::int64_t step_count() const { return sched_.draws(); }
  const task_scheduler& scheduler() const { return sched_; }
  const multitask_options& settings() const { return sched_.settings(); }
  static constexpr std::size_t size() { return sizeof...(Tasks); }
  /// Task `I` (its name, weight, trainer pointer and source).
  template <std::size_t I>
  auto& get() {
    return std::get<I>(tasks_);
  }

  /// One file for the whole run (atomic, checksummed, as a trainer's): every task's trainer,
  /// this scheduler's state, and each of `extras` (`Checkpointable`: an environment, a data
  /// set's position).
  template <class... Extras>
  void save(const std::string& path, const Extras&... extras) const {
    static_assert((Checkpointable<Extras> && ...),
                  "unirl::joint::multitask::save: every extra must model unirl::Checkpointable");
    train::save_with_extras(path, *this, extras...);
  }
  /// Restores what `save(path, extras...)` wrote; the run continues bit for bit (on CPU). A
  /// checkpoint of other tasks, weights or options is refused, naming both.
  template <class... Extras>
  void load(const std::string& path, Extras&... extras) {
    static_assert((Checkpointable<Extras> && ...),
                  "unirl::joint::multitask::load: every extra must model unirl::Checkpointable");
    train::load_with_extras(path, *this, "joint::multitask::load", extras...);
  }

  void save(torch::serialize::OutputArchive& a) const {
    torch::serialize::OutputArchive s;
    sched_.save(s);
    a.write("joint.multitask", s);
    std::size_t i = 0;
    std::apply(
        [&](const auto&... t) {
          (
              [&] {
                torch::serialize::OutputArchive sub;
                t.trainer->save(sub);
                a.write("joint.task." + std::to_string(i++), sub);
              }(),
              ...);
        },
        tasks_);
  }
  /// Restores what `save(OutputArchive&)` wrote. The scheduler's state and every task's entry are
  /// checked before any trainer is changed.
  void load(torch::serialize::InputArchive& a) {
    const std::string who = "joint::multitask::load";
    task_scheduler s = sched_;
    auto sa = train::read_archive(a, "joint.multitask", who);
    s.load(sa);
    std::vector<torch::serialize::InputArchive> subs;
    for (std::size_t i = 0; i < sizeof...(Tasks); ++i)
      subs.push_back(train::read_archive(a, "joint.task." + std::to_string(i), who));
    std::size_t i = 0;
    std::apply([&](auto&... t) { (t.trainer->load(subs[i++]), ...); }, tasks_);
    sched_ = std::move(s);
  }

 private:
  std::vector<std::string> names() const {
    return std::apply([](const auto&... t) { return std::vector<std::string>{t.name...}; }, tasks_);
  }
  std::vector<double> weights() const {
    return std::apply([](const auto&... t) { return std::vector<double>{t.weight...}; }, tasks_);
  }

  template <std::size_t... I>
  void run_task(task_step& out, std::index_sequence<I...>) {
    ((out.index == I ? run_one<I>(out) : void()), ...);
  }

  template <std::size_t I>
  void run_one(task_step& out) {
    auto& t = std::get<I>(tasks_);
    out.name = t.name;
    out.k = sched_.steps(I);
    auto result = t.trainer->step(std::invoke(t.next, out.k));
    out.reward_mean = static_cast<double>(result.reward_mean);
    if constexpr (std::is_convertible_v<decltype(result), step_stats>) out.stats = result;
    if constexpr (requires {
                    { result.to_json() } -> std::convertible_to<nlohmann::json>;
                  })
      out.task_stats = result.to_json();
    else
      out.task_stats = nlohmann::json{{"reward_mean", out.reward_mean}};
    sched_.observe(I, out.reward_mean);
  }

  std::tuple<Tasks...> tasks_;
  task_scheduler sched_;
};

}  // namespace unirl::joint

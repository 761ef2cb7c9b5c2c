#pragma once
/// \file chain.hpp
/// `joint::chain`: two trainers in one step — an upstream model (a language model writing a
/// condition) whose reward is a `joint::link` to a generator (a flow model drawing from it) —
/// with a staged schedule and one checkpoint for both. Each trainer keeps its own algorithm,
/// optimizer, options and statistics; the chain only decides, per step, who learns:
///
/// | stage mode  | upstream                      | generator                                  |
/// |-------------|-------------------------------|--------------------------------------------|
/// | `upstream`  | `step`: GRPO on the link      | frozen: sampled and scored                 |
/// | `generator` | `rollout` only (frozen)       | `step` on the decoded conditions            |
/// | `joint`     | `step`                        | `step` inside the upstream's reward        |
///
/// ```cpp
/// unirl::joint::chain c{lm, gen, {.stages = {{"lm alone", 50, unirl::joint::stage_mode::upstream},
///                                            {"generator alone", 50, unirl::joint::stage_mode::generator},
///                                            {"joint", 0, unirl::joint::stage_mode::joint}}}};
/// for (int i = 0; i < 200; ++i) auto s = c.step(prompts);   // s.stage, s.upstream, s.generator
/// c.save("run/joint.pt");   // later, fresh objects: c.load("run/joint.pt") continues in its stage
/// ```
/// The stages are options (`chain_options`, reflectable): a recipe declares them
/// (`stages: [{name: lm, steps: 50, train: upstream}, ...]`). A stage of 0 steps runs on; the last
/// stage runs on past its count.
#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
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

/// Who learns in a stage of a chain (see the table in this header).
enum class stage_mode { upstream, generator, joint };

}  // namespace unirl::joint

template <>
inline constexpr std::array unirl::enum_names<unirl::joint::stage_mode>{
    std::string_view{"upstream"}, std::string_view{"generator"}, std::string_view{"joint"}};

namespace unirl::joint {

/// One stage of a schedule: `steps` chain steps (0: unbounded; only the last stage may be) in
/// which `train` says who learns.
struct stage {
  std::string name = "joint";
  std::int64_t steps = 0;
  stage_mode train = stage_mode::joint;
};

/// Settings of a `chain`: the stages in order. Empty: one `joint` stage. The last stage runs on
/// past its count, so a run longer than the schedule keeps training in its final mode.
struct chain_options {
  std::vector<stage> stages{};

  void validate(const std::string& p) const {
    for (std::size_t i = 0; i < stages.size(); ++i) {
      const std::string k = p + "stages[" + std::to_string(i) + "].";
      options::require(!stages[i].name.empty(), k + "name", stages[i].name, "a non-empty name");
      options::require(stages[i].steps >= 0, k + "steps", stages[i].steps, ">= 0 (0: runs on)");
      if (i + 1 < stages.size())
        options::require(stages[i].steps >= 1, k + "steps", stages[i].steps,
                         ">= 1: only the last stage may run on (0 steps)");
    }
  }
};

}  // namespace unirl::joint

BOOST_HANA_ADAPT_STRUCT(unirl::joint::stage, name, steps, train);
BOOST_HANA_ADAPT_STRUCT(unirl::joint::chain_options, stages);

namespace unirl::joint {

/// What one chain step did: its stage, the mean reward of the upstream samples (the link's
/// rewards), and the statistics of whichever trainers stepped.
struct chain_stats {
  std::int64_t step = 0;
  std::string stage;
  stage_mode mode = stage_mode::joint;
  double reward_mean = 0.0;
  std::optional<step_stats> upstream, generator;

  /// One flat JSON object: `step`, `stage`, `mode`, `reward_mean`, and each trainer's
  /// statistics under `upstream/` and `generator/`.
  nlohmann::json to_json() const {
    nlohmann::json j{{"step", step}, {"stage", stage}, {"mode", std::string(enum_to_string(mode))},
                     {"reward_mean", reward_mean}};
    for (const auto& [prefix, s] : {std::pair{"upstream/", &upstream}, std::pair{"generator/", &generator}})
      if (*s) {
        const nlohmann::json part = (*s)->to_json();
        for (const auto& [k, v] : part.items()) j[std::string(prefix) + k] = v;
      }
    return j;
  }
};

/// The chain of `Upstream` (a trainer whose reward is a `GeneratorLink`, i.e. a `joint::link` to
/// the generator) and `Generator` (a `GeneratorTrainer`). It refers to both trainers (they stay
/// the caller's, usable on their own) and models `Checkpointable` and `SteppedTrainer`, so a chain
/// can itself be an extra of a checkpoint or a task of a `joint::multitask`.
template <class Upstream, class Generator>
class chain {
  using link_type = std::remove_cvref_t<decltype(std::declval<Upstream&>().reward())>;
  static_assert(GeneratorLink<link_type>,
                "unirl::joint::chain: the upstream trainer's Reward does not model unirl::GeneratorLink "
                "(concepts/joint.hpp): it must be a unirl::joint::link to the generator");
  static_assert(GeneratorTrainer<Generator, torch::Tensor>,
                "unirl::joint::chain: Generator does not model unirl::GeneratorTrainer (concepts/joint.hpp)");
  static_assert(Checkpointable<Upstream>,
                "unirl::joint::chain: Upstream does not model unirl::Checkpointable (a unirl::trainer does)");

 public:
  chain(Upstream& upstream, Generator& generator, chain_options o = {})
      : up_(&upstream), gen_(&generator), opts_(std::move(o)) {
    if (opts_.stages.empty()) opts_.stages.push_back(stage{});
    options::validate(opts_);
    if constexpr (requires { &upstream.reward().generator(); })
      UNIRL_CHECK(&upstream.reward().generator() == &generator,
                  "joint::chain: the upstream trainer's link points to another generator trainer than the one given");
  }

  /// One step in the current stage's mode on `input` (the upstream trainer's prompts).
  template <class Input>
  chain_stats step(Input&& input) {
    const stage& st = current_stage();
    chain_stats s;
    s.step = step_;
    s.stage = st.name;
    s.mode = st.train;
    auto& link = up_->reward();
    switch (st.train) {
      case stage_mode::upstream: {
        link.set_mode(generator_mode::frozen);
        s.upstream = up_->step(std::forward<Input>(input));
        s.reward_mean = s.upstream->reward_mean;
        break;
      }
      case stage_mode::generator: {
        link.set_mode(generator_mode::trained);
        const auto batch = up_->rollout(std::forward<Input>(input));
        torch::Tensor r;
        {
          torch::NoGradGuard no_grad;  // as the upstream trainer calls its reward
          r = link(batch);
        }
        s.reward_mean = r.numel() > 0 ? r.to(torch::kFloat64).mean().item<double>() : 0.0;
        break;
      }
      case stage_mode::joint: {
        link.set_mode(generator_mode::trained);
        s.upstream = up_->step(std::forward<Input>(input));
        s.reward_mean = s.upstream->reward_mean;
        break;
      }
    }
    if (st.train != stage_mode::upstream) s.generator = link.generator_stats();
    link.set_mode(generator_mode::frozen);
    ++step_;
    return s;
  }

  /// The stage the next `step` runs in.
  const stage& current_stage() const { return opts_.stages[stage_index(step_)]; }
  /// Index into `settings().stages` of the stage that chain step `k` belongs to.
  std::size_t stage_index(std::int64_t k) const {
    std::int64_t end = 0;
    for (std::size_t i = 0; i + 1 < opts_.stages.size(); ++i) {
      end += opts_.stages[i].steps;
      if (k < end) return i;
    }
    return opts_.stages.size() - 1;
  }
  std::int64_t step_count() const { return step_; }
  const chain_options& settings() const { return opts_; }
  Upstream& upstream() { return *up_; }
  Generator& generator() { return *gen_; }

  /// One file for the whole chain (atomic, checksummed, as a trainer's): both trainers, the
  /// chain's step and its stages, and each of `extras` (`Checkpointable`).
  template <class... Extras>
  void save(const std::string& path, const Extras&... extras) const {
    static_assert((Checkpointable<Extras> && ...),
                  "unirl::joint::chain::save: every extra must model unirl::Checkpointable");
    train::save_with_extras(path, *this, extras...);
  }
  /// Restores what `save(path, extras...)` wrote; the run continues bit for bit, in its stage.
  /// A checkpoint of a chain with other stages is refused (naming both schedules): the stage of
  /// a resumed step would otherwise silently change.
  template <class... Extras>
  void load(const std::string& path, Extras&... extras) {
    static_assert((Checkpointable<Extras> && ...),
                  "unirl::joint::chain::load: every extra must model unirl::Checkpointable");
    train::load_with_extras(path, *this, "joint::chain::load", extras...);
  }

  void save(torch::serialize::OutputArchive& a) const {
    a.write("joint.chain.step", torch::tensor(step_));
    train::write_scalar(a, "joint.chain.stages", options::to_json(opts_).dump());
    torch::serialize::OutputArchive up, gen;
    up_->save(up);
    gen_->save(gen);
    a.write("joint.upstream", up);
    a.write("joint.generator", gen);
  }
  void load(torch::serialize::InputArchive& a) {
    const std::string mine = options::to_json(opts_).dump();
    const auto saved = train::read_scalar<std::string>(a, "joint.chain.stages");
    if (saved != mine)
      throw checkpoint_error("joint::chain::load: the checkpoint's schedule " + saved +
                             " differs from this chain's " + mine);
    const auto k = train::read_tensor(a, "joint.chain.step", "joint::chain::load").item<std::int64_t>();
    auto up = train::read_archive(a, "joint.upstream", "joint::chain::load");
    auto gen = train::read_archive(a, "joint.generator", "joint::chain::load");
    up_->load(up);
    gen_->load(gen);
    step_ = k;
  }

 private:
  Upstream* up_;
  Generator* gen_;
  chain_options opts_;
  std::int64_t step_ = 0;
};

}  // namespace unirl::joint

#pragma once
/// \file link.hpp
/// `joint::link`: the reward of a model upstream of a generator — a language model that writes
/// the condition (a prompt enhancer), a flow model that draws from it — built from the
/// generator's own trainer. Each upstream sample is decoded into a condition; the generator draws
/// its `group_size` samples for every valid condition and its reward scores them; the upstream
/// sample is rewarded with their mean. Frozen, the generator is only sampled; trained, the same
/// call is the generator's `step` (its algorithm, optimizer and statistics), so one upstream step
/// trains both.
///
/// ```cpp
/// using flow_trainer = unirl::trainer<flow_t, unirl::algo::flow_grpo<>, image_reward>;
/// auto decode = [](const unirl::token_rollout& b) { return unirl::joint::decoded{conditions, valid}; };
/// using link_t = unirl::joint::link<flow_trainer, decltype(decode)>;
/// flow_trainer gen{flow, image_reward{}, {.group_size = 4}};
/// unirl::trainer<lm_t, unirl::algo::grpo<>, link_t> lm{model, link_t{gen, decode}, {.group_size = 8}};
/// lm.step(prompts);   // frozen by default; lm.reward().set_mode(generator_mode::trained) trains both
/// ```
/// What the model wrote is untrusted: a completion the decoder cannot read is marked invalid
/// and gets `invalid_reward` without reaching the generator; a decoder that returns tensors of
/// the wrong shape or type is an error naming them.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>

#include <boost/hana.hpp>
#include <torch/torch.h>

#include <unirl/concepts/joint.hpp>
#include <unirl/core/error.hpp>
#include <unirl/core/options.hpp>
#include <unirl/core/stats.hpp>

namespace unirl::joint {

using ::unirl::generator_mode;

/// What a decoder makes of an upstream batch of N samples: `conditions`, (N,) int64 class labels
/// or (N, D) float embeddings — any values where `valid` is false — and `valid`, (N,) bool.
struct decoded {
  torch::Tensor conditions;
  torch::Tensor valid;
};

/// Settings of a `link`.
struct link_options {
  double invalid_reward = 0.0;  // the reward of an upstream sample the decoder could not read

  void validate(const std::string& p) const {
    options::require(std::isfinite(invalid_reward), p + "invalid_reward", invalid_reward, "a finite number");
  }
};

}  // namespace unirl::joint

BOOST_HANA_ADAPT_STRUCT(unirl::joint::link_options, invalid_reward);

namespace unirl::joint {

/// The reward of an upstream trainer whose samples condition `Generator` (a `GeneratorTrainer`:
/// a `unirl::trainer` of the flow track, say). `Decode`: `decoded (const UpstreamBatch&)`.
/// Models `GeneratorLink` (what `joint::chain` switches per stage) and `ReportsComponents`:
/// `valid_fraction` and `generator_reward` (mean over the valid samples) reach the upstream
/// trainer's statistics as `reward/valid_fraction` and `reward/generator_reward`.
template <class Generator, class Decode>
class link {
  static_assert(GeneratorTrainer<Generator, torch::Tensor>,
                "unirl::joint::link: Generator does not model unirl::GeneratorTrainer (concepts/joint.hpp): it needs "
                "step(torch::Tensor conditions) -> step_stats, rollout(conditions), reward(), last_rewards(), "
                "settings().group_size and save/load of an archive (a unirl::trainer of the flow track has them)");

 public:
  link(Generator& generator, Decode decode, link_options o = {})
      : generator_(&generator), decode_(std::move(decode)), opts_(o) {
    opts_.validate("link.");
  }

  /// (N,) float32 rewards, one per upstream sample. Frozen: the generator samples and scores;
  /// trained: the generator takes one step on the valid conditions (with gradients enabled, as
  /// the upstream trainer calls its reward without them).
  template <class Batch>
  torch::Tensor operator()(const Batch& upstream) {
    decoded d = decode_(upstream);
    const auto n = static_cast<std::int64_t>(upstream.size());
    UNIRL_CHECK(d.valid.defined() && d.valid.dim() == 1 && d.valid.size(0) == n,
                "joint::link: the decoder's valid mask has shape ", shape_of(d.valid), ": expected (", n,
                ",), one flag per upstream sample");
    UNIRL_CHECK(d.conditions.defined() && d.conditions.dim() >= 1 && d.conditions.size(0) == n,
                "joint::link: the decoder's conditions have shape ", shape_of(d.conditions), ": expected (", n,
                ", ...), one condition per upstream sample");
    const auto valid = d.valid.to(torch::kCPU).to(torch::kBool);
    const auto rows = valid.nonzero().reshape({-1});
    const auto nv = rows.numel();
    torch::Tensor out = torch::full({n}, opts_.invalid_reward, torch::kFloat32);
    generator_stats_.reset();
    double mean_valid = 0.0;
    if (nv > 0) {
      const auto conditions = d.conditions.to(torch::kCPU).index_select(0, rows);
      const std::int64_t g = generator_->settings().group_size;
      torch::Tensor r;
      if (mode_ == generator_mode::trained) {
        torch::AutoGradMode grad(true);
        generator_stats_ = generator_->step(conditions);
        r = generator_->last_rewards();
      } else {
        torch::NoGradGuard no_grad;
        r = generator_->reward()(generator_->rollout(conditions));
      }
      UNIRL_CHECK(r.defined() && r.numel() == nv * g, "joint::link: the generator returned ",
                  r.defined() ? r.numel() : 0, " rewards for ", nv, " conditions: expected ", nv * g,
                  " (group_size = ", g, ")");
      const auto per = r.detach().to(torch::kCPU, torch::kFloat32).reshape({nv, g}).mean(1);
      out.index_copy_(0, rows, per);
      mean_valid = per.mean().item<double>();
    }
    components_ = {{"valid_fraction", static_cast<double>(nv) / static_cast<double>(std::max<std::int64_t>(n, 1))},
                   {"generator_reward", mean_valid}};
    return out;
  }

  void set_mode(generator_mode m) { mode_ = m; }
  generator_mode mode() const { return mode_; }
  /// The generator's statistics of its last step, when the last call trained it (else empty).
  const std::optional<step_stats>& generator_stats() const { return generator_stats_; }
  std::map<std::string, double> last_components() const { return components_; }
  Generator& generator() { return *generator_; }
  const link_options& settings() const { return opts_; }

 private:
  static std::string shape_of(const torch::Tensor& t) {
    if (!t.defined()) return "undefined";
    std::string s = "(";
    for (std::int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
    return s + (t.dim() == 1 ? ",)" : ")");
  }

  Generator* generator_;
  Decode decode_;
  link_options opts_;
  generator_mode mode_ = generator_mode::frozen;
  std::optional<step_stats> generator_stats_;
  std::map<std::string, double> components_;
};

}  // namespace unirl::joint

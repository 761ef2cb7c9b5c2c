#pragma once
/// \file supervised.hpp
/// The supervised stage before RL, as a first-class trainer: `supervised_trainer<Model, Objective,
/// Parallel>` runs on the RL trainer's update engine (train/update_engine.hpp: AdamW with parameter
/// groups, learning-rate schedule, gradient clipping, stability guard, mixed precision with loss
/// scaling, micro-batches and the parallel policy) with JSONL metrics, a progress line,
/// checkpoints (bit-identical resume) and run directories, around a loss that needs no reward:
/// cross-entropy on completion tokens (`train::sft_trainer`, sft.hpp) or the flow-matching
/// velocity loss (`train::flow_matching_trainer`, flow_matching.hpp).
///
/// ```cpp
/// unirl::train::sft_trainer<unirl::models::gpt> sft(model, {.optim = {.lr = 2e-3}, .batch_size = 64,
///                                                           .steps = 4000, .out = "runs/sft"});
/// auto r = sft.run([&](std::int64_t n) { return make_sft_batch(draw(n)); },    // a batch of n examples
///                  [&](const unirl::train::supervised_stats& s) { return accuracy(model) > 0.3; });  // stop?
/// ```
/// `step(batch)` is one optimizer step; `run(next_batch, on_eval)` is the loop: it resumes from
/// the latest complete checkpoint of `out` (so a finished run is a cache: it loads and returns),
/// calls `on_eval` every `eval_every` steps (returning true stops the run), checkpoints every
/// `checkpoint_every` steps and at the end. The model adapter is a handle on its network (as for
/// `unirl::trainer`): the caller's copy sees the weights change.
///
/// Minimal complete definition of an `Objective` (`SupervisedObjective<O, Model>`): member types
/// `options` (a reflectable options aggregate) and `batch_type`, a constructor from `options`,
/// `static constexpr std::string_view name` (stored in checkpoints), and
/// `supervised_loss loss(Model&, const batch_type&) const` — the differentiable mean loss of the
/// batch with its example and token counts. Optional: `torch::Tensor loss_normaliser(const
/// batch_type&) const` — what the batch's mean loss divides by (SFT: its completion tokens;
/// without it, the batch's size), which weighs the micro-batches of `micro_batch_size` (the batch
/// type then needs `size()` and `select(index)`).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <memory>
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
#include <unirl/concepts/supervised.hpp>
#include <unirl/concepts/model.hpp>
#include <unirl/concepts/parallel.hpp>
#include <unirl/config.hpp>
#include <unirl/core/error.hpp>
#include <unirl/core/host.hpp>
#include <unirl/core/options.hpp>
#include <unirl/core/precision.hpp>
#include <unirl/train/checkpoint.hpp>
#include <unirl/train/clip.hpp>
#include <unirl/train/guard.hpp>
#include <unirl/train/metrics.hpp>
#include <unirl/train/optimizer.hpp>
#include <unirl/train/run_directory.hpp>
#include <unirl/train/schedule.hpp>
#include <unirl/train/update_engine.hpp>

namespace unirl::train {

// `supervised_loss` and the `SupervisedObjective` concept live with the other concepts.
using ::unirl::supervised_loss;
using ::unirl::SupervisedObjective;

/// Run-time settings of a `supervised_trainer` (the objective's own under `objective`); an
/// aggregate for designated initializers. The optimizer, schedule, clipping and guard are the RL
/// trainer's (`trainer_options`), with the same keys.
template <class ObjectiveOptions>
struct supervised_options {
  ObjectiveOptions objective{};          // the loss's own options
  optimizer_options optim{.lr = 1e-3};   // AdamW and its parameter groups
  schedule_options schedule{};           // warmup + constant / linear / cosine (total: `steps` when 0)
  clip_options clip{};                   // global gradient-norm clipping
  guard_options guard{};                 // NaN/Inf skips, loss and grad-norm spike monitor
  ::unirl::precision precision = ::unirl::precision::fp32;  // the loss's forward: fp32, bf16, fp16 (autocast)
  loss_scale_options loss_scale{};       // dynamic loss scaling (with fp16; any precision with mode = on)
  std::int64_t micro_batch_size = 0;     // examples per forward/backward of a step (gradient accumulation); 0: all
  std::int64_t batch_size = 64;          // examples per step: what run() asks its batch source for
  std::int64_t steps = 1000;             // optimizer steps of run() (a resumed run continues to it)
  std::int64_t eval_every = 0;           // run(): steps between calls of on_eval; 0: never
  std::int64_t seed = -1;                // >= 0: seeds LibTorch's generators at construction; -1: leaves them
  std::string device = "cpu";            // "cpu", "cuda", "cuda:1"
  std::string metrics_path{};            // JSONL, one object per step; empty: none
  bool progress = true;                  // one-line progress display on stderr
  std::string out{};                     // run(): run directory of the checkpoints (<out>/checkpoints/); empty: none
  std::int64_t checkpoint_every = 0;     // run(): steps between checkpoints; 0: only at the end
  std::int64_t keep = 2;                 // run(): complete checkpoints kept
  bool resume = true;                    // run(): continue from the latest complete checkpoint of `out`

  void validate(const std::string& p) const {
    options::require(batch_size >= 1, p + "batch_size", batch_size, ">= 1");
    options::require(micro_batch_size >= 0, p + "micro_batch_size", micro_batch_size,
                     ">= 0 (0: the whole batch in one forward)");
    options::require(steps >= 0, p + "steps", steps, ">= 0");
    options::require(eval_every >= 0, p + "eval_every", eval_every, ">= 0 (0: never)");
    options::require(seed >= -1, p + "seed", seed, ">= 0, or -1 to leave the generators as they are");
    options::require(checkpoint_every >= 0, p + "checkpoint_every", checkpoint_every, ">= 0 (0: only at the end)");
    options::require(keep >= 1, p + "keep", keep, ">= 1");
    try {
      (void)torch::Device(device);
    } catch (const std::exception&) {
      throw config_error(p + "device", "value \"" + device + "\" is not a device: expected cpu, cuda or cuda:N");
    }
    check_precision_supported(precision, torch::Device(device), p + "precision");
  }
};

}  // namespace unirl::train

// supervised_options is a template, so BOOST_HANA_ADAPT_STRUCT cannot adapt it; this is the same
// accessor table the macro would generate (as for trainer_options).
namespace boost::hana {
template <class O>
struct accessors_impl<unirl::train::supervised_options<O>> {
#define UNIRL_MEMBER(name) \
  make_pair(BOOST_HANA_STRING(#name), [](auto&& s) -> decltype(auto) { return (static_cast<decltype(s)&&>(s).name); })
  static constexpr auto apply() {
    return make_tuple(UNIRL_MEMBER(objective), UNIRL_MEMBER(optim), UNIRL_MEMBER(schedule), UNIRL_MEMBER(clip),
                      UNIRL_MEMBER(guard), UNIRL_MEMBER(precision), UNIRL_MEMBER(loss_scale),
                      UNIRL_MEMBER(micro_batch_size), UNIRL_MEMBER(batch_size), UNIRL_MEMBER(steps), UNIRL_MEMBER(eval_every),
                      UNIRL_MEMBER(seed), UNIRL_MEMBER(device), UNIRL_MEMBER(metrics_path), UNIRL_MEMBER(progress),
                      UNIRL_MEMBER(out), UNIRL_MEMBER(checkpoint_every), UNIRL_MEMBER(keep), UNIRL_MEMBER(resume));
  }
#undef UNIRL_MEMBER
};
}  // namespace boost::hana

namespace unirl::train {

/// Statistics of one supervised step (one optimizer step), as written to metrics.jsonl.
struct supervised_stats {
  std::int64_t step = 0;              // 0-based index of the step
  std::int64_t examples = 0;          // sequences / samples in the batch
  std::int64_t tokens = 0;            // tokens the loss covered (SFT: completion tokens)
  double loss = 0, grad_norm = 0, learning_rate = 0;
  double seconds = 0, examples_per_second = 0, tokens_per_second = 0;
  std::int64_t optimizer_steps = 0;   // 1, or 0 when the guard skipped the update
  std::int64_t skipped_updates = 0;   // updates skipped by the stability guard in this step
  std::int64_t skipped_total = 0;     // ... since the start of training
  bool loss_spike = false, grad_spike = false;

  /// One flat JSON object, as written to metrics.jsonl.
  nlohmann::json to_json() const;
};

/// What `supervised_trainer::run` reports.
struct supervised_result {
  std::int64_t first_step = 0;     // 0, or the step a resumed run continued from
  std::int64_t steps = 0;          // steps run by this call
  double loss_first = 0.0, loss_last = 0.0;  // loss of the first and last step run (0 when none)
  double seconds = 0.0;            // wall time of the steps run
  bool stopped = false;            // on_eval asked to stop before `steps`
  bool resumed = false;            // a checkpoint of `out` was loaded
};

}  // namespace unirl::train

BOOST_HANA_ADAPT_STRUCT(unirl::train::supervised_stats, step, examples, tokens, loss, grad_norm, learning_rate, seconds,
                        examples_per_second, tokens_per_second, optimizer_steps, skipped_updates, skipped_total,
                        loss_spike, grad_spike);

inline nlohmann::json unirl::train::supervised_stats::to_json() const {
  nlohmann::json j = nlohmann::json::object();
  boost::hana::for_each(boost::hana::accessors<supervised_stats>(), [&](auto pair) {
    j[boost::hana::to<const char*>(boost::hana::first(pair))] = boost::hana::second(pair)(*this);
  });
  return j;
}

namespace unirl::train {

namespace detail {
// The supervised stage's progress line: step/total, loss, gradient norm, tokens (or examples) per
// second and the ETA; redrawn in place on a terminal, a plain line every total/10 steps otherwise.
class supervised_progress {
 public:
  supervised_progress(std::string what, std::int64_t total, bool enabled)
      : what_(std::move(what)), total_(total), enabled_(enabled), terminal_(stderr_is_terminal()) {}
  void update(const supervised_stats& s) {
    if (std::isfinite(s.seconds) && s.seconds > 0) {
      seconds_ += s.seconds;
      ++timed_;
    }
    if (!enabled_) return;
    const std::int64_t done = s.step + 1;
    char buf[256];
    std::snprintf(buf, sizeof buf, "%s step %lld/%lld  loss %.4g  grad %.3g  ", what_.c_str(),
                  static_cast<long long>(done), static_cast<long long>(total_), s.loss, s.grad_norm);
    std::string line = buf;
    if (s.tokens > 0) std::snprintf(buf, sizeof buf, "%.0f tokens/s", s.tokens_per_second);
    else std::snprintf(buf, sizeof buf, "%.1f examples/s", s.examples_per_second);
    line += buf;
    if (timed_ > 0 && total_ > done)
      line += "  ETA " + detail::duration_text(seconds_ / static_cast<double>(timed_) * static_cast<double>(total_ - done));
    if (s.skipped_total > 0) line += "  skipped " + std::to_string(s.skipped_total);
    if (terminal_) {
      std::string padded = line;
      if (padded.size() < width_) padded.append(width_ - padded.size(), ' ');
      width_ = line.size();
      std::cerr << '\r' << padded << std::flush;
      open_ = true;
    } else {
      const std::int64_t every = std::max<std::int64_t>(1, total_ / 10);
      if (++seen_ == 1 || done % every == 0 || done == total_) std::cerr << line << '\n' << std::flush;
    }
  }
  void finish() {
    if (open_) std::cerr << '\n' << std::flush;
    open_ = false;
  }

 private:
  std::string what_;
  std::int64_t total_ = 0;
  bool enabled_ = true, terminal_ = false, open_ = false;
  std::size_t width_ = 0;
  std::int64_t seen_ = 0, timed_ = 0;
  double seconds_ = 0.0;
};
}  // namespace detail

/// The supervised trainer (see the file comment). `Model` is a `TrainableModule` adapter,
/// `Objective` a `SupervisedObjective` for it, `Parallel` the engine's parallel policy (with a
/// data-parallel one every rank starts from rank 0's weights, feeds its own batches and gets the
/// averaged gradients; rank 0 writes the metrics and the checkpoints).
template <class Model, class Objective, class Parallel = ::unirl::parallel::single_device>
class supervised_trainer {
  static_assert(TrainableModule<Model>,
                "unirl::train::supervised_trainer: Model does not model TrainableModule: it needs parameters(), "
                "named_parameters(), named_buffers(), clone(), train(bool) and to(torch::Device)");
  static_assert(SupervisedObjective<Objective, Model>,
                "unirl::train::supervised_trainer: Objective does not model SupervisedObjective<Objective, Model>: "
                "it needs `options`, `batch_type`, a constructor from options, `name` and "
                "`supervised_loss loss(Model&, const batch_type&) const` (see train/supervised.hpp)");

 public:
  using model_type = Model;
  using objective_type = Objective;
  using batch_type = typename Objective::batch_type;
  using options = supervised_options<typename Objective::options>;

  /// Moves the model to `device`, builds the engine over its trainable parameters and seeds the
  /// generators when `seed >= 0` (plus the rank). Throws `config_error` naming the key of an
  /// invalid option.
  explicit supervised_trainer(Model model, options o = {}, Parallel parallel = {})
      : opts_(checked(std::move(o))),
        device_(opts_.device),
        model_(std::move(model)),
        objective_(opts_.objective),
        engine_(engine_options(opts_), device_, std::move(parallel)) {
    if (device_.is_cuda()) {
      const auto n = torch::cuda::is_available() ? static_cast<std::int64_t>(torch::cuda::device_count()) : 0;
      if (n == 0 || device_.index() >= n)
        throw config_error("device", ::unirl::detail::concat("value \"", opts_.device,
                                                            "\" names a CUDA device, but this process sees ", n,
                                                            " CUDA device(s)"));
    }
    if (opts_.seed >= 0) torch::manual_seed(static_cast<std::uint64_t>(opts_.seed + engine_.parallel().rank()));
    model_.to(device_);
    if (engine_.parallel().world_size() > 1) engine_.parallel().broadcast(tensors_of(state()), 0);
    engine_.bind_model(model_, "supervised_trainer");  // under ZeRO-3 also the block hooks
  }

  /// One optimizer step on `batch` through the engine: the objective's loss under the precision's
  /// autocast (in micro-batches of `micro_batch_size`, weighted by the objective's
  /// `loss_normaliser`), backward, the gradient average over ranks, per-group and global clipping,
  /// the guard (a non-finite loss or gradient skips the update and leaves the weights unchanged),
  /// AdamW. One host read (the non-finite flags, the loss and the gradient norm).
  supervised_stats step(const batch_type& batch) {
    const auto t0 = std::chrono::steady_clock::now();
    supervised_stats s;
    s.step = step_;
    s.learning_rate = engine_.begin_step(step_);
    model_.train(true);
    auto loss = [&](const batch_type& b, std::int64_t) {
      supervised_loss l = objective_.loss(model_, b);
      UNIRL_CHECK(l.total.defined() && l.total.numel() == 1, "supervised_trainer: the objective '", Objective::name,
                  "' returned a loss of ", l.total.defined() ? l.total.numel() : 0, " elements; expected one");
      return l;
    };
    auto normaliser = [&](const batch_type& b) -> torch::Tensor {
      if constexpr (requires { { objective_.loss_normaliser(b) } -> std::convertible_to<torch::Tensor>; })
        return objective_.loss_normaliser(b);
      else
        return torch::full({}, static_cast<double>(b.size()), torch::TensorOptions(torch::kFloat64).device(device_));
    };
    const auto r = engine_.step(batch, loss, normaliser);
    s.examples = r.terms.examples;
    s.tokens = r.terms.tokens;
    s.loss = r.loss;
    s.grad_norm = r.grad_norm;
    s.loss_spike = r.loss_spike;
    if (r.skipped) {
      ++s.skipped_updates;
    } else {
      s.grad_spike = r.grad_spike;
      s.optimizer_steps = 1;
    }
    engine_.zero_grad();
    if (engine_.parallel().world_size() > 1) {  // rank 0's buffers everywhere, as the RL trainer after each step
      const named_tensors buffers = model_.named_buffers();
      if (!buffers.empty()) engine_.parallel().broadcast(tensors_of(buffers), 0);
    }
    s.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (s.seconds > 0) {
      s.examples_per_second = static_cast<double>(s.examples) / s.seconds;
      s.tokens_per_second = static_cast<double>(s.tokens) / s.seconds;
    }
    s.skipped_total = engine_.guard().skipped_total();
    ++step_;
    report(s);
    return s;
  }

  /// The loop (see the file comment): `next_batch(batch_size)` gives each step's batch;
  /// `on_eval(const supervised_stats&)` runs every `eval_every` steps and may return `true` to
  /// stop (or nothing). `extras` (each `Checkpointable`, e.g. a `data::jsonl_dataset`) are saved
  /// and resumed with the model.
  template <class NextBatch, class OnEval = std::nullptr_t, class... Extras>
  supervised_result run(NextBatch&& next_batch, OnEval&& on_eval = nullptr, Extras&... extras) {
    supervised_result r;
    std::optional<run_directory> dir;
    if (!opts_.out.empty()) dir.emplace(opts_.out, run_directory_options{.keep = opts_.keep});
    if (dir && opts_.resume) {
      dir->remove_temporaries();
      if (const auto last = dir->latest()) {
        load(last->path.string(), extras...);
        r.resumed = true;
      }
    }
    r.first_step = step_;
    std::int64_t saved_at = r.resumed ? step_ : -1;
    auto save_now = [&] {
      if (!dir || engine_.parallel().rank() != 0) return;
      dir->save(step_, [&](const std::string& p) { save(p, extras...); });
      saved_at = step_;
    };
    const auto t0 = std::chrono::steady_clock::now();
    while (step_ < opts_.steps) {
      const supervised_stats s = step(next_batch(opts_.batch_size));
      if (r.steps == 0) r.loss_first = s.loss;
      r.loss_last = s.loss;
      ++r.steps;
      bool stop = false;
      if constexpr (!std::is_same_v<std::remove_cvref_t<OnEval>, std::nullptr_t>) {
        if (opts_.eval_every > 0 && step_ % opts_.eval_every == 0) {
          if (progress_) progress_->finish();
          if constexpr (std::is_convertible_v<std::invoke_result_t<OnEval&, const supervised_stats&>, bool>)
            stop = static_cast<bool>(on_eval(s));
          else
            on_eval(s);
        }
      }
      if (opts_.checkpoint_every > 0 && step_ % opts_.checkpoint_every == 0) save_now();
      if (stop) {
        r.stopped = true;
        break;
      }
    }
    r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (progress_) progress_->finish();
    if (saved_at != step_ && r.steps > 0) save_now();
    return r;
  }

  /// Writes a checkpoint atomically: the model's parameters and buffers, the optimizer, the
  /// guard, the generators' states, the step, the options and each of `extras` (`Checkpointable`).
  template <class... Extras>
  void save(const std::string& path, const Extras&... extras) const {
    static_assert((Checkpointable<Extras> && ...),
                  "unirl::train::supervised_trainer::save: every extra must model unirl::Checkpointable");
    static_assert(!FullyShardedParallelStrategy<Parallel> || sizeof...(Extras) < 0,
                  "unirl::train::supervised_trainer::save: under a FullyShardedParallelStrategy every rank holds a "
                  "slice of the weights: save with engine().parallel().save_sharded(dir, optim()) and export with "
                  "engine().parallel().with_full_weights(...) (parallel/fully_sharded.hpp)");
    write_checkpoint(path, [&](torch::serialize::OutputArchive& a) {
      a.write("unirl.format", torch::tensor(std::int64_t{1}));
      write_scalar(a, "unirl.stage", std::string(Objective::name));
      a.write("unirl.step", torch::tensor(step_));
      save_tensors(a, "policy.", state());
      engine_.save(a);  // optimizer, guard, loss scale
      save_rng(a);
      write_scalar(a, "options", ::unirl::options::to_json(opts_).dump());
      write_extras(a, extras...);
    });
  }

  /// Restores a checkpoint written by `save` (and `extras` from the same positions); training
  /// continues bit for bit on CPU. A missing or damaged file, a checkpoint of another stage
  /// (e.g. an RL trainer's) or another number of extras throws `checkpoint_error`.
  template <class... Extras>
  void load(const std::string& path, Extras&... extras) {
    static_assert((Checkpointable<Extras> && ...),
                  "unirl::train::supervised_trainer::load: every extra must model unirl::Checkpointable");
    static_assert(!FullyShardedParallelStrategy<Parallel> || sizeof...(Extras) < 0,
                  "unirl::train::supervised_trainer::load: under a FullyShardedParallelStrategy resume with "
                  "engine().parallel().load_sharded(dir, optim()) (parallel/fully_sharded.hpp)");
    read_checkpoint(path, [&](torch::serialize::InputArchive& a) {
      const std::string stage = has_key(a, "unirl.stage") ? read_scalar<std::string>(a, "unirl.stage") : "";
      if (stage != Objective::name)
        throw checkpoint_error("supervised_trainer::load: the checkpoint is of stage '" +
                               (stage.empty() ? std::string("(none: an RL trainer's?)") : stage) + "'; expected '" +
                               std::string(Objective::name) + "'");
      check_extras(a, static_cast<std::int64_t>(sizeof...(Extras)), "supervised_trainer::load");
      torch::Tensor t;
      a.read("unirl.step", t);
      const auto step = t.item<std::int64_t>();
      load_tensors(a, "policy.", state());
      engine_.load(a, "supervised_trainer::load");
      load_rng(a);
      read_extras(a, "supervised_trainer::load", extras...);
      step_ = step;
    });
    resumed_ = true;
  }

  Model& model() { return model_; }
  const Model& model() const { return model_; }
  Objective& objective() { return objective_; }
  optimizer& optim() { return engine_.optim(); }
  /// The update engine (optimizer, schedule, guard, precision, micro-batches, parallel policy).
  update_engine<Parallel>& engine() { return engine_; }
  const options& settings() const { return opts_; }
  std::int64_t step_count() const { return step_; }
  torch::Device device() const { return device_; }
  /// `key = value` lines of every option (print it at the start of a run).
  std::string describe() const { return ::unirl::options::to_string(opts_); }

 private:
  static options checked(options o) {
    ::unirl::options::validate(o);
    return o;
  }

  named_tensors state() const {
    named_tensors all = model_.named_parameters();
    for (auto& b : model_.named_buffers()) all.push_back(b);
    return all;
  }

  static std::vector<torch::Tensor> tensors_of(const named_tensors& named) {
    std::vector<torch::Tensor> ts;
    for (const auto& [n, t] : named) {
      (void)n;
      ts.push_back(t);
    }
    return ts;
  }

  // What the engine is built with: the options' optimizer, schedule (its total_steps `steps` when
  // 0), clipping, guard, precision, loss scale and micro-batch size; skips name the objective.
  static update_options engine_options(const options& o) {
    update_options e{o.optim, o.schedule, o.clip, o.guard, o.precision, o.loss_scale, o.micro_batch_size,
                     std::string(Objective::name)};
    if (e.schedule.total_steps == 0) e.schedule.total_steps = o.steps;
    return e;
  }

  void report(const supervised_stats& s) {
    if (engine_.parallel().rank() != 0) return;
    if (!opts_.metrics_path.empty() && !metrics_) metrics_.emplace(opts_.metrics_path, resumed_);
    if (metrics_) metrics_->write(s.to_json());
    if (!progress_) progress_.emplace(std::string(Objective::name), opts_.steps, opts_.progress);
    progress_->update(s);
  }

  options opts_;
  torch::Device device_;
  Model model_;
  Objective objective_;
  update_engine<Parallel> engine_;  // parameters, optimizer, schedule, guard, precision, parallel policy
  std::optional<metrics_writer> metrics_;
  std::optional<detail::supervised_progress> progress_;
  std::int64_t step_ = 0;
  bool resumed_ = false;
};

}  // namespace unirl::train

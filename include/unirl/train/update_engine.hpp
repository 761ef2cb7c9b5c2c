#pragma once
/// \file update_engine.hpp
/// The update engine: everything between a batch with its loss and new weights, in one type that
/// the RL `trainer`, `supervised_trainer` (SFT, flow matching) and anything else that takes
/// optimizer steps share. It owns the trainable parameters and their groups, AdamW, the
/// learning-rate schedule, the stability guard, the loss scaler, gradient clipping (global and per
/// group), autocast (mixed precision), micro-batching (gradient accumulation) and the parallel /
/// sharding policy (`ParallelStrategy`: `parallel::single_device`, `data_parallel`, `zero`), and it
/// saves and loads the state of all of them.
///
/// ```cpp
/// unirl::train::update_engine<> engine({.optim = {.lr = 1e-3}, .precision = unirl::precision::bf16,
///                                       .micro_batch_size = 16}, torch::kCPU);
/// engine.bind(model.named_parameters(), "my_stage");
/// engine.begin_step(step);                              // the schedule's learning rate
/// auto r = engine.step(batch,                           // anything with size() and select(index)
///     [&](const my_batch& b, std::int64_t /*micro_batches*/) { return my_loss(model, b); },
///     [](const my_batch& b) { return b.tokens_tensor(); });   // what b's mean loss divides by
/// if (r.taken) { /* r.loss, r.grad_norm, r.terms */ }
/// ```
///
/// Composition (in the manner of CUTLASS 3's collectives: small policies, each passed explicitly):
/// - the *loss* (`loss(batch, micro_batches) -> R`, `R` a `supervised_loss`, a `loss_terms` or a
///   type with a `loss_accumulation` specialisation) runs under the precision's autocast; its
///   backward runs outside it, on the loss multiplied by the loss scale when scaling is on;
/// - the *normaliser* (`normaliser(batch) -> () tensor`, default: the batch's size) weighs
///   micro-batch i's loss by n_i / sum_j n_j, so that micro-batches give the gradients of the
///   whole batch's mean loss; the optional *prepare* (`prepare(batch) -> batch`) first takes the
///   statistics the micro-batches share (PPO's advantage whitening);
/// - the *parallel policy* averages the gradients over ranks (`all_reduce_gradients`), agrees on
///   skipping (`all_agree`) and, when it is a `ShardedParallelStrategy`, hands this rank's pieces
///   to the optimizer, gives the global norms and brings every rank the stepped values. A new
///   strategy is a new `Parallel` type: neither the engine's owners nor the engine change.
///
/// One host read per `step` (the loss, the gradient norm, the found-non-finite flags and the
/// checks deferred by the loss's ops). Bad steps (a non-finite loss or gradient, a loss spike with
/// `guard.skip_loss_spikes`) are skipped on every rank and leave the weights unchanged; an overflow
/// under loss scaling lowers the scale (PyTorch's GradScaler).
#include <algorithm>
#include <cstdint>
#include <functional>
#include <iostream>
#include <memory>
#include <string>
#include <type_traits>
#include <unordered_set>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <unirl/concepts/model.hpp>
#include <unirl/concepts/parallel.hpp>
#include <unirl/concepts/supervised.hpp>
#include <unirl/config.hpp>
#include <unirl/core/error.hpp>
#include <unirl/core/host.hpp>
#include <unirl/core/precision.hpp>
#include <unirl/core/stats.hpp>
#include <unirl/train/checkpoint.hpp>
#include <unirl/train/clip.hpp>
#include <unirl/train/guard.hpp>
#include <unirl/train/loss_scaler.hpp>
#include <unirl/train/optimizer.hpp>
#include <unirl/train/schedule.hpp>

namespace unirl::train {

/// What an `update_engine` is built with (the owners' options pass these on under the same keys).
struct update_options {
  optimizer_options optim{};                                // AdamW and its parameter groups
  schedule_options schedule{};                              // total_steps as the owner resolved it
  clip_options clip{};                                      // global gradient-norm clipping
  guard_options guard{};                                    // NaN/Inf skips, spike monitor
  ::unirl::precision precision = ::unirl::precision::fp32;  // autocast of the loss's forward
  loss_scale_options loss_scale{};                          // dynamic loss scaling
  std::int64_t micro_batch_size = 0;                        // samples per forward/backward; 0: all at once
  std::string label{};  // the stage in skip messages: "" gives "unirl: step 3: ...", "sft" "unirl: sft step 3: ..."
};

/// Reads `parts` (scalars or 1-D, any dtype; undefined ones left out) and the checks waiting in
/// `checks` (may be null) in one host read, throws the first failed check's message, and returns
/// the parts' values in order.
inline std::vector<double> read_figures(const std::vector<torch::Tensor>& parts, deferred_checks* checks,
                                        torch::Device device) {
  std::vector<torch::Tensor> flat;
  std::size_t n = 0;
  for (const auto& p : parts) {
    if (!p.defined()) continue;
    flat.push_back(p.detach().reshape({-1}).to(device, torch::kFloat64));
    n += static_cast<std::size_t>(flat.back().numel());
  }
  const auto c = checks ? checks->values() : torch::Tensor{};
  if (c.defined()) flat.push_back(c.to(device));
  auto all = flat.empty() ? std::vector<double>{} : to_host(torch::cat(flat));
  if (c.defined()) checks->verify(std::vector<double>(all.begin() + static_cast<std::ptrdiff_t>(n), all.end()));
  all.resize(n);
  return all;
}

/// How the engine sums the figures of micro-batch results weighted by `w` (() float64 on
/// `device`): specialise it for a loss type of your own. `total` is summed by the engine.
template <class R>
struct loss_accumulation {
  static_assert(sizeof(R) == 0,
                "unirl::train::update_engine: the loss returns a type without a loss_accumulation specialisation; "
                "return unirl::loss_terms or unirl::supervised_loss, or specialise "
                "unirl::train::loss_accumulation<R> with static void add(R&, const R&, const torch::Tensor&, torch::Device)");
};

template <>
struct loss_accumulation<loss_terms> {
  static void add(loss_terms& into, const loss_terms& part, const torch::Tensor& w, torch::Device device) {
    auto acc = [&](scalar_stat& to, const scalar_stat& x) {
      const torch::Tensor v = x.tensor(device) * w;
      to = scalar_stat(to.value.defined() ? to.value + v : v);
    };
    acc(into.policy, part.policy);
    acc(into.value, part.value);
    acc(into.kl, part.kl);
    acc(into.entropy, part.entropy);
    acc(into.ratio_mean, part.ratio_mean);
    acc(into.clip_fraction, part.clip_fraction);
    for (const auto& [key, v] : part.extra) acc(into.extra[key], v);
  }
};

template <>
struct loss_accumulation<supervised_loss> {
  static void add(supervised_loss& into, const supervised_loss& part, const torch::Tensor&, torch::Device) {
    into.examples += part.examples;
    into.tokens += part.tokens;
  }
};

/// What one `update_engine::step` did. `terms` is the loss's result for the whole batch (`total`
/// detached; micro-batches weighted by the normaliser); `loss` and `grad_norm` are read even when
/// the step was skipped.
template <class R>
struct update_outcome {
  R terms{};
  bool taken = false;       // the optimizer stepped
  bool skipped = false;     // the guard skipped the step (weights unchanged)
  bool loss_spike = false;  // the guard saw a loss spike
  bool grad_spike = false;  // the guard saw a gradient-norm spike (taken steps only)
  double loss = 0.0, grad_norm = 0.0;
};

/// The normaliser every batch gets without one: its size, as a () float64 tensor.
struct batch_size_normaliser {
  torch::Device device = torch::kCPU;
  template <class Batch>
  torch::Tensor operator()(const Batch& b) const {
    return torch::full({}, static_cast<double>(b.size()), torch::TensorOptions(torch::kFloat64).device(device));
  }
};

/// The update engine (see the file comment). `Parallel` is the parallel / sharding policy.
template <class Parallel = ::unirl::parallel::single_device>
class update_engine {
  static_assert(ParallelStrategy<Parallel>,
                "unirl::train::update_engine: Parallel does not model ParallelStrategy (see concepts/parallel.hpp)");

 public:
  using parallel_type = Parallel;
  static constexpr bool sharded = ShardedParallelStrategy<Parallel>;

  /// An engine on `device` with the parallel policy `parallel`; `bind` gives it its parameters.
  explicit update_engine(update_options o, torch::Device device = torch::kCPU, Parallel parallel = {})
      : opts_(std::move(o)),
        device_(device),
        parallel_(std::move(parallel)),
        guard_(opts_.guard),
        scaling_(opts_.loss_scale.mode == loss_scaling::on ||
                 (opts_.loss_scale.mode == loss_scaling::automatic && opts_.precision == ::unirl::precision::fp16)),
        scaler_(opts_.loss_scale) {
    UNIRL_CHECK(opts_.micro_batch_size >= 0, "update_engine: micro_batch_size = ", opts_.micro_batch_size,
                ": expected >= 0 (0: the whole batch in one forward)");
  }

  /// Builds the optimizer over the parameters of `named` that require a gradient (under a
  /// sharding policy: over this rank's pieces of them). `who` names the owner in the error for a
  /// model without trainable parameters.
  void bind(named_tensors named, const std::string& who) {
    params_.clear();
    for (const auto& [n, t] : named) {
      (void)n;
      if (t.requires_grad()) params_.push_back(t);
    }
    UNIRL_CHECK(!params_.empty(), who, ": the model has no trainable parameters");
    if constexpr (sharded) {
      // The groups with their own clipping come from the full layout, so every rank clips the same groups.
      const optimizer full(named, opts_.optim);  // the group layout only (no state yet)
      for (std::size_t g = 0; g < full.group_count(); ++g)
        if (full.group_max_grad_norm(g) > 0) shard_clip_groups_.emplace_back(full.group_name(g), full.group_max_grad_norm(g));
      named = parallel_.owned_parameters(named);
    }
    optimizer_ = std::make_unique<optimizer>(named, opts_.optim);
    if constexpr (sharded) shards_ = optimizer_->parameters();
  }

  /// `bind(model.named_parameters(), who)`, and first, under a `FullyShardedParallelStrategy`
  /// (ZeRO-3, `parallel::fully_sharded`), the policy's block hooks into `model` (which must be a
  /// `BlockStructuredModel`): its blocks' parameters are then gathered around each block's forward.
  template <class Model>
  void bind_model(Model& model, const std::string& who) {
    if constexpr (FullyShardedParallelStrategy<Parallel>) {
      static_assert(BlockStructuredModel<Model>,
                    "unirl::train::update_engine::bind_model: a FullyShardedParallelStrategy needs a model that "
                    "models BlockStructuredModel (set_block_hooks and block_prefixes; see concepts/parallel.hpp)");
      model.set_block_hooks(parallel_.attach_blocks(model.block_prefixes()));
    }
    bind(model.named_parameters(), who);
  }

  /// Starts optimizer step(s) of owner step `step` (0-based): the schedule's learning rate, and
  /// the step number of skip messages. Returns the default group's learning rate.
  double begin_step(std::int64_t step) {
    step_ = step;
    optim().set_lr_multiplier(lr_multiplier(opts_.schedule, step));
    return optimizer_->learning_rate();
  }

  /// One optimizer step on `batch`: zeroed gradients, the forward / backward of `loss` (in
  /// micro-batches of `micro_batch_size` weighted by `normaliser`, after `prepare`), the gradient
  /// all-reduce, unscaling, clipping, the guard (one read, with the checks waiting in `checks`),
  /// AdamW and, under a sharding policy, the gather of the stepped values. `loss(part, m)` gets
  /// `m` = the number of micro-batches (1: the whole batch).
  template <class Batch, class LossFn, class Normaliser = batch_size_normaliser, class Prepare = std::identity>
  auto step(const Batch& batch, LossFn&& loss, Normaliser&& normaliser = {}, Prepare&& prepare = {},
            deferred_checks* checks = nullptr) {
    using R = std::remove_cvref_t<std::invoke_result_t<LossFn&, const Batch&, std::int64_t>>;
    update_outcome<R> r;
    optim().zero_grad();
    r.terms = forward_backward(batch, loss, normaliser, prepare);  // total detached; gradients in place
    note_model_state();
    parallel_.all_reduce_gradients(params_);
    note_model_state();
    // Under a sharding policy only this rank's pieces (`shards_`) hold gradients now, and norms are
    // the policy's global ones.
    const std::vector<torch::Tensor>& live = sharded ? shards_ : params_;
    if (scaling_) scaler_.unscale(live);
    if constexpr (sharded) {
      for (const auto& [name, max_norm] : shard_clip_groups_) {
        std::vector<torch::Tensor> ps;  // this rank's pieces of the group (maybe none)
        for (std::size_t g = 0; g < optimizer_->group_count(); ++g)
          if (optimizer_->group_name(g) == name) ps = optimizer_->group_params(g);
        clip_grads(ps, parallel_.grad_norm(ps), max_norm);
      }
    } else {
      for (std::size_t g = 0; g < optimizer_->group_count(); ++g)
        if (optimizer_->group_max_grad_norm(g) > 0)
          clip_grads(optimizer_->group_params(g), grad_norm_tensor(optimizer_->group_params(g)),
                     optimizer_->group_max_grad_norm(g));
    }
    torch::Tensor norm;
    if constexpr (sharded) norm = parallel_.grad_norm(live);
    else norm = grad_norm_tensor(live);
    const torch::Tensor bad_grads = stability_guard::nonfinite_grads(live);
    const torch::Tensor total = r.terms.total.detach();
    const auto got = read_figures({torch::isfinite(total).all(),
                                   bad_grads.defined() ? bad_grads : torch::zeros({}, torch::kBool), total, norm},
                                  checks, device_);
    r.loss = got.at(2);
    r.grad_norm = got.at(3);
    const bool loss_ok = parallel_.all_agree(got.at(0) != 0.0);
    r.loss_spike = loss_ok && guard_.observe_loss(r.loss);
    if (!loss_ok || (r.loss_spike && opts_.guard.skip_loss_spikes)) {
      optimizer_->zero_grad();
      skip(loss_ok ? "loss spike" : "non-finite loss");
      r.skipped = true;
      return r;
    }
    if (!parallel_.all_agree(got.at(1) == 0.0)) {
      optimizer_->zero_grad();
      if (scaling_) {  // an overflow of the loss scale: lower it and skip (PyTorch's GradScaler)
        const double was = scaler_.value();
        scaler_.update(false);
        skip(::unirl::detail::concat("non-finite gradient under loss scale ", was, "; scale lowered to ",
                                     scaler_.value()).c_str());
      } else {
        skip("non-finite gradient");
      }
      r.skipped = true;
      return r;
    }
    if (scaling_) scaler_.update(true);
    if (opts_.clip.max_grad_norm > 0) clip_grads(live, norm, opts_.clip.max_grad_norm);
    r.grad_spike = guard_.observe_grad_norm(r.grad_norm);
    optimizer_->step();
    if constexpr (sharded) parallel_.after_optimizer_step(params_);  // the owners' new values everywhere
    note_model_state();
    r.taken = true;
    return r;
  }

  /// Counts a skipped update (the guard's total) and says why on stderr.
  void skip(const char* why) {
    guard_.count_skip();
    std::cerr << "unirl: " << (opts_.label.empty() ? std::string() : opts_.label + " ") << "step " << step_ << ": "
              << why << "; optimizer step skipped, weights unchanged\n";
  }

  void zero_grad() { optim().zero_grad(); }

  /// Writes the optimizer, the guard and (when scaling) the loss scale under `optimizer`, `guard`
  /// and `loss_scale`.
  void save(torch::serialize::OutputArchive& a) const {
    UNIRL_CHECK(optimizer_, "update_engine::save: no parameters bound (call bind first)");
    torch::serialize::OutputArchive opt, guard;
    optimizer_->save(opt);
    a.write("optimizer", opt);
    guard_.save(guard);
    a.write("guard", guard);
    if (scaling_) {
      torch::serialize::OutputArchive scale;
      scaler_.save(scale);
      a.write("loss_scale", scale);
    }
  }
  /// Restores what `save` wrote (a checkpoint without a loss scale keeps the current one).
  void load(torch::serialize::InputArchive& a, const char* who) {
    torch::serialize::InputArchive opt, guard;
    a.read("optimizer", opt);
    optim().load(opt);
    a.read("guard", guard);
    guard_.load(guard);
    if (scaling_ && has_key(a, "loss_scale")) {
      auto scale = read_archive(a, "loss_scale", who);
      scaler_.load(scale);
    }
  }

  optimizer& optim() {
    UNIRL_CHECK(optimizer_, "update_engine: no parameters bound (call bind first)");
    return *optimizer_;
  }
  const optimizer& optim() const {
    UNIRL_CHECK(optimizer_, "update_engine: no parameters bound (call bind first)");
    return *optimizer_;
  }
  stability_guard& guard() { return guard_; }
  const stability_guard& guard() const { return guard_; }
  Parallel& parallel() { return parallel_; }
  const Parallel& parallel() const { return parallel_; }
  /// Whether the loss is scaled (loss_scale.mode on, or auto under fp16), and the scale.
  bool scaling() const { return scaling_; }
  double loss_scale() const { return scaler_.value(); }
  /// The parameters the engine trains (every one with a gradient, not only this rank's pieces).
  const std::vector<torch::Tensor>& parameters() const { return params_; }
  const update_options& options() const { return opts_; }
  torch::Device device() const { return device_; }

  /// Bytes of AdamW state (the moments) this rank's optimizer holds now.
  std::int64_t optimizer_state_bytes() const {
    std::int64_t bytes = 0;
    if (!optimizer_) return 0;
    for (const auto& [key, st] : optimizer_->torch_optimizer().state()) {
      (void)key;
      const auto& a = static_cast<const torch::optim::AdamWParamState&>(*st);
      for (const auto& t : {a.exp_avg(), a.exp_avg_sq(), a.max_exp_avg_sq()})
        if (t.defined()) bytes += t.numel() * static_cast<std::int64_t>(t.element_size());
    }
    return bytes;
  }
  /// The highest bytes of parameters and gradients this rank held in any step so far (each storage
  /// counted once), measured after the backward, after the gradient reduction and after the
  /// optimizer step; under a policy that counts its own (`peak_bytes()`, `parallel::fully_sharded`:
  /// its gathered blocks and gradient buffers inside the forward and backward) the larger of both.
  std::int64_t peak_parameter_gradient_bytes() const {
    std::int64_t peak = peak_pg_;
    if constexpr (requires(const Parallel& p) { { p.peak_bytes() } -> std::convertible_to<std::int64_t>; })
      peak = std::max<std::int64_t>(peak, parallel_.peak_bytes());
    return peak;
  }
  /// Peak model-state bytes of this rank: `peak_parameter_gradient_bytes()` plus
  /// `optimizer_state_bytes()` (the data-parallel, ZeRO-2 and ZeRO-3 figures of docs/performance.md).
  std::int64_t peak_model_state_bytes() const { return peak_parameter_gradient_bytes() + optimizer_state_bytes(); }

 private:
  // The forward and backward of `batch`, under the precision's autocast (the backward outside it,
  // as torch.autocast wants), the loss multiplied by the loss scale when scaling is on. With
  // `micro_batch_size` the batch runs in micro-batches whose losses weigh n_i / sum_j n_j (n_i the
  // normaliser), after `prepare` took the statistics they share. Returns the batch's result,
  // `total` detached, the figures weighted the same way.
  template <class Batch, class LossFn, class Normaliser, class Prepare>
  auto forward_backward(const Batch& batch, LossFn& loss, Normaliser& normaliser, Prepare& prepare) {
    using R = std::remove_cvref_t<std::invoke_result_t<LossFn&, const Batch&, std::int64_t>>;
    const std::int64_t k = opts_.micro_batch_size;
    auto backward = [&](const torch::Tensor& l) { (scaling_ ? scaler_.scale(l) : l).backward(); };
    auto forward = [&](const Batch& b, std::int64_t m) {
      if constexpr (FullyShardedParallelStrategy<Parallel>) parallel_.begin_forward();  // the parameters outside the blocks
      autocast_scope amp(device_, opts_.precision);
      return loss(b, m);
    };
    auto whole = [&] {
      R t = forward(batch, 1);
      backward(t.total);
      t.total = t.total.detach();
      return t;
    };
    if constexpr (!requires(const Batch& b, const torch::Tensor& i) {
                    { b.size() } -> std::convertible_to<std::int64_t>;
                    { b.select(i) } -> std::convertible_to<Batch>;
                  }) {
      UNIRL_CHECK(k == 0, "update_engine: micro_batch_size = ", k,
                  ", but the batch type has no size() and select(index) to split it: expected micro_batch_size = 0");
      return whole();
    } else {
      const std::int64_t n = batch.size();
      if (k <= 0 || k >= n) return whole();
      const std::int64_t m = (n + k - 1) / k;
      const Batch prepared = prepare(batch);
      std::vector<Batch> parts;
      std::vector<torch::Tensor> mass;
      for (std::int64_t lo = 0; lo < n; lo += k) {
        parts.push_back(prepared.select(torch::arange(lo, std::min(n, lo + k), torch::kInt64).to(device_)));
        mass.push_back(torch::Tensor(normaliser(parts.back())).to(device_, torch::kFloat64).reshape({}));
      }
      const torch::Tensor all = torch::stack(mass).sum();
      R out{};
      torch::Tensor total;
      for (std::size_t i = 0; i < parts.size(); ++i) {
        const torch::Tensor w = torch::where(all > 0, mass[i] / all, torch::zeros_like(all));  // () float64
        R t = forward(parts[i], m);
        backward(t.total * w.to(t.total.scalar_type()));
        const torch::Tensor v = t.total.detach().reshape({}).to(device_, torch::kFloat64) * w;
        total = total.defined() ? total + v : v;
        loss_accumulation<R>::add(out, t, w, device_);
      }
      out.total = total;
      return out;
    }
  }

  // The bytes of the parameters' and gradients' storages (each once) into the running peak.
  void note_model_state() {
    std::unordered_set<const void*> seen;
    std::int64_t bytes = 0;
    auto add = [&](const torch::Tensor& t) {
      if (!t.defined() || !t.has_storage()) return;
      const auto* impl = t.storage().unsafeGetStorageImpl();
      if (seen.insert(impl).second) bytes += static_cast<std::int64_t>(impl->nbytes());
    };
    for (const auto* list : {&params_, &shards_})
      for (const auto& p : *list) {
        add(p);
        add(p.grad());
      }
    peak_pg_ = std::max(peak_pg_, bytes);
  }

  update_options opts_;
  torch::Device device_;
  Parallel parallel_;
  stability_guard guard_;
  bool scaling_ = false;
  loss_scaler scaler_;
  std::vector<torch::Tensor> params_;
  std::unique_ptr<optimizer> optimizer_;
  std::vector<torch::Tensor> shards_;                               // sharded: the optimizer's pieces
  std::vector<std::pair<std::string, double>> shard_clip_groups_;  // ... and the groups clipped on their own
  std::int64_t step_ = 0;
  std::int64_t peak_pg_ = 0;  // bytes: see peak_parameter_gradient_bytes
};

}  // namespace unirl::train

// dp_worker's modes for the sharded optimizer (parallel/zero.hpp) and PowerSGD
// (parallel/powersgd.hpp); included by dp_worker.cpp only.
//   dp_worker zero_train0|zero_train1|zero_train2 <rank> <world> <store-file> <out-prefix>
//       the trainer with plain data_parallel (0) or zero stage 1 / 2, 6 steps, clipping on
//   dp_worker zero_resume1|zero_resume2 ...   the same 6 steps, saved after 3 and resumed
//   dp_worker zero_direct1|zero_direct2 ...   AdamW by hand on a least-squares problem, with the
//       one-process reference on the concatenated data computed by every rank itself
//   dp_worker powersgd ...                    PowerSGD: the rank-r exact case and error feedback
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <unirl/parallel/data_parallel.hpp>
#include <unirl/parallel/powersgd.hpp>
#include <unirl/parallel/zero.hpp>
#include <unirl/train/optimizer.hpp>
#include <unirl/trainer.hpp>

#include "common/bandit.hpp"
#include "common/digits.hpp"

namespace zero_modes {

using gloo_dp = unirl::parallel::data_parallel<unirl::parallel::gloo>;
using gloo_zero = unirl::parallel::zero<unirl::parallel::gloo>;

// Bytes of AdamW state (its moments) that an optimizer really holds.
inline std::int64_t state_bytes(unirl::train::optimizer& o) {
  std::int64_t bytes = 0;
  for (const auto& [key, st] : o.torch_optimizer().state()) {
    (void)key;
    const auto& s = static_cast<const torch::optim::AdamWParamState&>(*st);
    for (const auto& t : {s.exp_avg(), s.exp_avg_sq(), s.max_exp_avg_sq()})
      if (t.defined()) bytes += t.numel() * static_cast<std::int64_t>(t.element_size());
  }
  return bytes;
}

inline std::vector<double> flat_of(const std::vector<torch::Tensor>& ts) {
  std::vector<double> v;
  for (const auto& t : ts) {
    const auto c = t.detach().reshape({-1}).to(torch::kFloat64).contiguous();
    v.insert(v.end(), c.data_ptr<double>(), c.data_ptr<double>() + c.numel());
  }
  return v;
}

// The bandit trainer with clipping (global and one group of its own), 6 steps on this rank's digits.
template <class Strategy>
using bandit_trainer = unirl::trainer<bandit::model, bandit::policy_gradient, bandit::correct_label, Strategy>;

inline unirl::trainer_options<bandit::policy_gradient> train_options() {
  return {.optim = {.lr = 3e-3, .weight_decay = 0.01, .groups = {{.prefix = "fc2.", .lr_scale = 2.0, .max_grad_norm = 0.05}}},
          .clip = {.max_grad_norm = 0.1},
          .group_size = 4,
          .epochs = 1,
          .minibatches = 2,
          .seed = 7,
          .progress = false};
}

template <class Strategy>
nlohmann::json train_steps(Strategy par, std::int64_t from, std::int64_t to, const std::string& resume_from,
                           const std::string& save_to) {
  const auto digits = examples::load_digits(std::string(UNIRL_TEST_DATA_DIR) + "/digits.csv.gz");
  const int rank = par.rank(), world = par.world_size();
  torch::manual_seed(50 + rank);  // different initial weights: the trainer broadcasts rank 0's
  bandit_trainer<Strategy> t(bandit::model{bandit::policy_net(32)}, {}, train_options(), std::move(par));
  if (!resume_from.empty()) t.load(resume_from);
  nlohmann::json norms = nlohmann::json::array(), skipped = nlohmann::json::array();
  const std::int64_t size = 32;
  for (std::int64_t s = from; s < to; ++s) {
    auto idx = torch::arange((s * world + rank) * size, (s * world + rank + 1) * size, torch::kInt64)
                   .remainder(digits.labels.size(0));
    const auto st = t.step(bandit::prompts{digits.images.index_select(0, idx).reshape({size, 64}),
                                           digits.labels.index_select(0, idx)});
    norms.push_back(st.grad_norm);
    skipped.push_back(st.skipped_updates);
  }
  if (!save_to.empty()) t.save(save_to);
  std::int64_t elements = 0;
  for (const auto& p : t.optimizer().parameters()) elements += p.numel();
  return {{"params", flat_of(t.models().policy.parameters())},
          {"grad_norms", norms},
          {"skipped", skipped},
          {"state_bytes", state_bytes(t.optimizer())},
          {"optimizer_elements", elements},
          {"groups", t.optimizer().group_count()}};
}

// Least squares through a two-layer net; each rank's data is its half of the batch.
struct mlpImpl : torch::nn::Module {
  mlpImpl() {
    a = register_module("a", torch::nn::Linear(8, 16));
    b = register_module("b", torch::nn::Linear(16, 4));
  }
  torch::Tensor forward(const torch::Tensor& x) { return b->forward(torch::tanh(a->forward(x))); }
  torch::nn::Linear a{nullptr}, b{nullptr};
};
TORCH_MODULE(mlp);

inline std::pair<torch::Tensor, torch::Tensor> half_batch(int r, std::int64_t step) {
  torch::manual_seed(1000 * step + r);
  return {torch::randn({12, 8}), torch::randn({12, 4})};
}

inline nlohmann::json direct(gloo_zero par) {
  const int rank = par.rank(), world = par.world_size();
  const unirl::train::optimizer_options oo{.lr = 1e-2, .weight_decay = 0.01};
  torch::manual_seed(3);
  mlp net, ref;  // same seed: the same initial weights on every rank
  torch::manual_seed(3);
  ref = mlp();
  unirl::named_tensors named;
  for (const auto& it : net->named_parameters()) named.emplace_back(it.key(), it.value());
  unirl::train::optimizer sharded(par.owned_parameters(named), oo);
  unirl::named_tensors ref_named;
  for (const auto& it : ref->named_parameters()) ref_named.emplace_back(it.key(), it.value());
  unirl::train::optimizer full(ref_named, oo);
  const auto params = net->parameters();
  double norm_error = 0, max_norm = 0;
  for (std::int64_t step = 0; step < 5; ++step) {
    // This rank's half.
    sharded.zero_grad();  // the pieces only: the strategy must have freed the full gradients
    auto [x, y] = half_batch(rank, step);
    (net->forward(x) - y).pow(2).mean().backward();
    par.all_reduce_gradients(params);
    const double norm = par.grad_norm(sharded.parameters()).item<double>();
    sharded.step();
    par.after_optimizer_step(params);
    // The reference: one process on the concatenated data (equal halves: the mean of the means).
    full.zero_grad();
    std::vector<torch::Tensor> xs, ys;
    for (int r = 0; r < world; ++r) {
      auto [xr, yr] = half_batch(r, step);
      xs.push_back(xr);
      ys.push_back(yr);
    }
    (ref->forward(torch::cat(xs)) - torch::cat(ys)).pow(2).mean().backward();
    double sq = 0;
    for (const auto& p : ref->parameters()) sq += std::pow(p.grad().norm().item<double>(), 2);
    norm_error = std::max(norm_error, std::abs(norm - std::sqrt(sq)));
    max_norm = std::max(max_norm, std::sqrt(sq));
    full.step();
  }
  bool full_grads_freed = true;
  for (const auto& p : params) full_grads_freed = full_grads_freed && !p.grad().defined();
  double weight_error = 0;
  for (std::size_t i = 0; i < params.size(); ++i)
    weight_error = std::max(weight_error, (params[i] - ref->parameters()[i]).abs().max().item<double>());
  return {{"weight_error", weight_error},
          {"norm_error", norm_error},
          {"max_norm", max_norm},
          {"state_bytes", state_bytes(sharded)},
          {"reference_state_bytes", state_bytes(full)},
          {"full_grads_freed", full_grads_freed},
          {"params", flat_of(params)}};
}

// PowerSGD on fixed gradients across the ranks; every rank computes the true mean itself.
inline nlohmann::json powersgd(gloo_dp& par) {
  const int rank = par.rank(), world = par.world_size();
  auto sum = [&](torch::Tensor& flat) {
    std::vector<torch::Tensor> t{flat};
    par.process_group().allreduce(t)->wait();
  };
  nlohmann::json out;
  {  // rank-2 gradients sharing their column space (G_r = U V_r^T) and a bias: sent exactly
    torch::manual_seed(11);
    const auto u = torch::randn({16, 2});
    auto v_of = [](int r) {
      torch::manual_seed(20 + r);
      return torch::randn({12, 2});
    };
    auto b_of = [](int r) {
      torch::manual_seed(40 + r);
      return torch::randn({12});
    };
    auto w = torch::zeros({16, 12}, torch::requires_grad()), b = torch::zeros({12}, torch::requires_grad());
    w.mutable_grad() = torch::matmul(u, v_of(rank).t());
    b.mutable_grad() = b_of(rank);
    auto mean_w = torch::zeros({16, 12}), mean_b = torch::zeros({12});
    for (int r = 0; r < world; ++r) {
      mean_w += torch::matmul(u, v_of(r).t()) / world;
      mean_b += b_of(r) / world;
    }
    unirl::parallel::powersgd c({.rank = 2, .start_iter = 0});
    c.reduce({w, b}, world, sum);
    out["exact_error"] = (w.grad() - mean_w).abs().max().item<double>() / mean_w.abs().max().item<double>();
    out["exact_bias_error"] = (b.grad() - mean_b).abs().max().item<double>();
    out["exact_feedback"] = c.error_norm() / mean_w.norm().item<double>();
    out["compresses"] = c.compresses(w);
  }
  {  // full-rank fixed gradients, rank 2: each step approximate, the running sum tracks the truth
    auto g_of = [](int r) {
      torch::manual_seed(60 + r);
      return torch::randn({24, 20});
    };
    auto mean = torch::zeros({24, 20});
    for (int r = 0; r < world; ++r) mean += g_of(r) / world;
    auto w = torch::zeros({24, 20}, torch::requires_grad());
    unirl::parallel::powersgd c({.rank = 2, .start_iter = 0, .seed = 5});
    auto applied = torch::zeros({24, 20});
    nlohmann::json rel = nlohmann::json::object(), errs = nlohmann::json::array();
    double first_step = 0;
    for (int t = 1; t <= 400; ++t) {
      w.mutable_grad() = g_of(rank);
      c.reduce({w}, world, sum);
      applied += w.grad();
      if (t == 1) first_step = ((w.grad() - mean).norm() / mean.norm()).item<double>();
      if (t == 10 || t == 40 || t == 100 || t == 400)
        rel[std::to_string(t)] = ((applied / t - mean).norm() / mean.norm()).item<double>();
      errs.push_back(c.error_norm() / mean.norm().item<double>());
    }
    out["first_step_error"] = first_step;
    out["running_mean_error"] = rel;
    out["feedback_norms"] = errs;
  }
  {  // through data_parallel: start_iter = 2 plain all-reduces, then compressed
    auto dpar_grads = [&](gloo_dp& d, std::vector<double>& errors) {
      auto g_of = [](int r) {
        torch::manual_seed(80 + r);
        return torch::randn({24, 20});
      };
      auto mean = torch::zeros({24, 20});
      for (int r = 0; r < world; ++r) mean += g_of(r) / world;
      auto w = torch::zeros({24, 20}, torch::requires_grad());
      for (int t = 0; t < 3; ++t) {
        w.mutable_grad() = g_of(rank);
        d.all_reduce_gradients({w});
        errors.push_back(((w.grad() - mean).norm() / mean.norm()).item<double>());
      }
    };
    std::vector<double> errors;
    dpar_grads(par, errors);
    out["start_iter_errors"] = errors;
  }
  return out;
}

// Runs `mode` when it is one of this file's; nullopt otherwise.
inline std::optional<nlohmann::json> run(const std::string& mode, int rank, int world, const std::string& store,
                                         const std::string& out) {
  const unirl::parallel::rendezvous rdzv{.file_path = store, .interface_host = "127.0.0.1",
                                         .timeout = std::chrono::seconds(60)};
  const auto ckpt = out + ".rank" + std::to_string(rank) + ".ckpt";
  if (mode == "zero_train0") return train_steps(gloo_dp(rank, world, rdzv), 0, 6, "", "");
  for (std::int64_t stage : {1, 2}) {
    const auto s = std::to_string(stage);
    if (mode == "zero_train" + s) return train_steps(gloo_zero(gloo_dp(rank, world, rdzv), {.stage = stage}), 0, 6, "", "");
    if (mode == "zero_resume" + s) {
      gloo_zero par(gloo_dp(rank, world, rdzv), {.stage = stage});
      // The first 3 steps, saved by every rank (its own optimizer shard), then a fresh trainer
      // over the same process group resumes and takes the last 3.
      struct borrowed {  // the strategy, shared by both trainers
        gloo_zero* z;
        int rank() const { return z->rank(); }
        int world_size() const { return z->world_size(); }
        void all_reduce_gradients(const std::vector<torch::Tensor>& p) { z->all_reduce_gradients(p); }
        void broadcast(const std::vector<torch::Tensor>& t, int root) { z->broadcast(t, root); }
        torch::Tensor all_reduce_mean(const torch::Tensor& v) { return z->all_reduce_mean(v); }
        torch::Tensor all_reduce_max(const torch::Tensor& v) { return z->all_reduce_max(v); }
        bool all_agree(bool ok) { return z->all_agree(ok); }
        void sync_weights(const std::vector<torch::Tensor>& p) { z->sync_weights(p); }
        unirl::named_tensors owned_parameters(const unirl::named_tensors& n) { return z->owned_parameters(n); }
        torch::Tensor grad_norm(const std::vector<torch::Tensor>& p) { return z->grad_norm(p); }
        void after_optimizer_step(const std::vector<torch::Tensor>& p) { z->after_optimizer_step(p); }
      };
      static_assert(unirl::ShardedParallelStrategy<borrowed>);
      train_steps(borrowed{&par}, 0, 3, "", ckpt);
      return train_steps(borrowed{&par}, 3, 6, ckpt, "");
    }
    if (mode == "zero_direct" + s) return direct(gloo_zero(gloo_dp(rank, world, rdzv), {.stage = stage}));
  }
  if (mode == "powersgd") {
    gloo_dp par(rank, world, rdzv,
                {.compression = unirl::parallel::gradient_compression::powersgd, .powersgd = {.rank = 2, .start_iter = 2}});
    return powersgd(par);
  }
  return std::nullopt;
}

}  // namespace zero_modes

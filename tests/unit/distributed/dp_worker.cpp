// One rank of the distributed tests: started N times by test_distributed.cpp, the ranks meet
// through a FileStore and write what they saw to <out>.<rank>.json.
//   dp_worker grads|train|buffers <rank> <world> <store-file> <out-prefix>
// The learner / sampler split (parallel/c10d_transport.hpp) meets through torchrun-style
// variables instead (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; a TCPStore):
//   dp_worker split_sync|split_async|sync_bench env env <unused> <out-prefix>
//   dp_worker colocated 0 1 <unused> <out-prefix>   (the one-process reference of split_sync)
//   dp_worker overlap 0 1 <unused> <out-prefix>     (reward scoring overlapped with sampling, one process)
//   dp_worker worker_restart 0 1 <unused> <out-prefix>  (seed_per_version, the worker checkpoint; one process)
//   dp_worker split_reward_rank env env <unused> <out-prefix>   (learner, sampler, reward rank)
//   dp_worker split_partial env env <unused> <out-prefix>   (GRPO on a GPT, partial rollouts)
//   dp_worker fault_sampler_continue|fault_sampler_stop|fault_learner env env tcp|<store-file> <out-prefix>
//   dp_worker split_learners|split_learners_file env env <store-file> <out-prefix>   (two learners,
//                                      two samplers; a TCPStore, or a FileStore at <store-file>)
//   dp_worker split_learners_ref <rank> 2 <store-file> <out-prefix>  (its colocated reference)
#include <chrono>
#include <csignal>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <future>
#include <memory>
#include <thread>
#include <iostream>
#include <limits>
#include <vector>

#include <nlohmann/json.hpp>
#include <unirl/algorithms/grpo.hpp>
#include <unirl/models/gpt.hpp>
#include <unirl/models/module_adapter.hpp>
#include <unirl/parallel/c10d_transport.hpp>
#include <unirl/parallel/colocated.hpp>
#include <unirl/parallel/data_parallel.hpp>
#include <unirl/parallel/reward_ranks.hpp>
#include <unirl/parallel/rollout_worker.hpp>
#include <unirl/train/sft.hpp>
#include <unirl/trainer.hpp>

#include "common/bandit.hpp"
#include "common/digits.hpp"
#include "fsdp_modes.hpp"  // fsdp_single, fsdp_sft*, fsdp_resume, fsdp_fault
#include "zero_modes.hpp"  // zero_train*, zero_resume*, zero_direct*, powersgd

// The bandit's batch, reflected here so that the c10d transport can carry it (core/batch.hpp).
BOOST_HANA_ADAPT_STRUCT(bandit::rollout, contexts, labels, actions, old_logp, advantages);

using dp = unirl::par::data_parallel<unirl::par::gloo>;

namespace {

// Gradients of a least-squares loss on each rank's own data; after the all-reduce every rank
// must hold the mean of all ranks' gradients, which each rank can also compute by itself.
nlohmann::json check_gradients(dp& par) {
  auto data = [](int r) {
    torch::manual_seed(100 + r);
    return std::pair{torch::randn({16, 5}), torch::randn({16, 3})};
  };
  torch::manual_seed(1000 + par.rank());  // different on every rank: the broadcast must fix it
  auto lin = torch::nn::Linear(5, 3);
  std::vector<torch::Tensor> params = lin->parameters();
  par.broadcast(params, 0);
  const auto w0 = lin->weight.detach().clone();
  auto grads_on = [&](int r) {
    lin->zero_grad();
    auto [x, y] = data(r);
    (lin->forward(x) - y).pow(2).mean().backward();
    return std::pair{lin->weight.grad().clone(), lin->bias.grad().clone()};
  };
  auto expected_w = torch::zeros_like(lin->weight), expected_b = torch::zeros_like(lin->bias);
  for (int r = 0; r < par.world_size(); ++r) {
    auto [gw, gb] = grads_on(r);
    expected_w += gw / par.world_size();
    expected_b += gb / par.world_size();
  }
  grads_on(par.rank());
  par.all_reduce_gradients(params);
  return {{"max_grad_error", std::max((lin->weight.grad() - expected_w).abs().max().item<double>(),
                                      (lin->bias.grad() - expected_b).abs().max().item<double>())},
          {"weight_checksum", w0.sum().item<double>()},
          {"mean_of_ranks", par.all_reduce_mean(static_cast<double>(par.rank()))},
          {"all_agree_true", par.all_agree(true)},
          {"all_agree_one_false", par.all_agree(par.rank() != par.world_size() - 1)}};
}

// Returns a NaN score on one chosen call on the last rank only.
// Also keeps the mean, min and max of this rank's last scores (the step statistics are all ranks').
struct nan_on_last_rank {
  bool last = false;
  std::int64_t calls = 0;
  std::vector<double> local{};  // mean, min, max of the last call's scores
  torch::Tensor operator()(const bandit::rollout& b) {
    auto r = bandit::correct_label{}(b);
    if (last && calls == 5) r[0] = std::numeric_limits<float>::quiet_NaN();
    ++calls;
    const auto d = r.to(torch::kFloat64);
    local = {d.mean().item<double>(), d.min().item<double>(), d.max().item<double>()};
    return r;
  }
};

nlohmann::json train(dp par) {
  const auto digits = examples::load_digits(std::string(UNIRL_TEST_DATA_DIR) + "/digits.csv.gz");
  const int rank = par.rank(), world = par.world_size();
  torch::manual_seed(50 + rank);  // different initial weights: the trainer broadcasts rank 0's
  using dp_trainer = unirl::trainer<bandit::model, bandit::policy_gradient, nan_on_last_rank, dp>;
  dp_trainer t(bandit::model{bandit::policy_net(32)}, nan_on_last_rank{.last = rank == world - 1},
               {.optim = {.lr = 3e-3}, .group_size = 4, .epochs = 2, .minibatches = 2, .seed = 7, .progress = false},
               std::move(par));
  double first = 0, last = 0;
  const std::int64_t steps = 60, size = 32;
  nlohmann::json skipped = nlohmann::json::array(), reported = nlohmann::json::array(),
                 local = nlohmann::json::array();
  for (std::int64_t s = 0; s < steps; ++s) {
    auto idx = torch::arange((s * world + rank) * size, (s * world + rank + 1) * size, torch::kInt64)
                   .remainder(digits.labels.size(0));
    const auto st = t.step(bandit::prompts{digits.images.index_select(0, idx).reshape({size, 64}),
                                           digits.labels.index_select(0, idx)});
    skipped.push_back(st.skipped_updates);
    reported.push_back({st.reward_mean, st.reward_min, st.reward_max});
    local.push_back(t.reward().local);
    if (s < 5) first += st.reward_mean / 5;
    if (s >= steps - 5) last += st.reward_mean / 5;
  }
  std::vector<double> flat;
  for (const auto& p : t.models().policy.parameters()) {
    auto c = p.detach().reshape({-1}).to(torch::kFloat64).contiguous();
    flat.insert(flat.end(), c.data_ptr<double>(), c.data_ptr<double>() + c.numel());
  }
  return {{"first", first}, {"last", last}, {"skipped", skipped}, {"params", flat}, {"reported", reported},
          {"local", local}};
}

// A bandit policy with registered buffers that its forward pass changes in training mode from the
// data it sees: a running mean of the inputs (float) and a count of "bright" inputs (int64).
struct buffered_netImpl : torch::nn::Cloneable<buffered_netImpl> {
  buffered_netImpl() { reset(); }
  void reset() override {
    fc = register_module("fc", torch::nn::Linear(64, 10));
    input_mean = register_buffer("input_mean", torch::randn({64}));
    bright = register_buffer("bright", torch::randint(0, 1000, {1}, torch::kInt64));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    if (is_training()) {
      torch::NoGradGuard no_grad;
      input_mean.mul_(0.9).add_(x.mean(0), 0.1);
      bright.add_((x.mean(1) > 5.0).sum());
    }
    return fc->forward(x - input_mean);
  }
  torch::nn::Linear fc{nullptr};
  torch::Tensor input_mean, bright;
};
TORCH_MODULE(buffered_net);

struct buffered_model : unirl::models::module_adapter<buffered_model, buffered_net> {
  using track = bandit::track;
  using module_adapter::module_adapter;
  torch::Tensor log_probs(const torch::Tensor& contexts) { return torch::log_softmax(net()->forward(contexts), -1); }
};
static_assert(unirl::ModelAdapter<buffered_model>);

// The buffers as one list of doubles: input_mean (64 values) then bright.
std::vector<double> buffers_of(const buffered_net& net) {
  std::vector<double> v;
  auto m = net->input_mean.to(torch::kFloat64).contiguous();
  v.insert(v.end(), m.data_ptr<double>(), m.data_ptr<double>() + m.numel());
  v.push_back(static_cast<double>(net->bright.item<std::int64_t>()));
  return v;
}

// Each rank initialises the buffers differently and trains on its own digits; after construction
// and after every step all ranks must hold rank 0's buffers. Between steps each rank also runs its
// policy in training mode on its own data, so the buffers demonstrably diverge before each sync.
nlohmann::json buffers(dp par) {
  const auto digits = examples::load_digits(std::string(UNIRL_TEST_DATA_DIR) + "/digits.csv.gz");
  const int rank = par.rank(), world = par.world_size();
  torch::manual_seed(70 + rank);
  buffered_net net;
  const auto initial = buffers_of(net);
  using dp_trainer = unirl::trainer<buffered_model, bandit::policy_gradient, bandit::correct_label, dp>;
  dp_trainer t(buffered_model{net}, {}, {.optim = {.lr = 3e-3}, .group_size = 4, .epochs = 1, .minibatches = 2,
                                         .seed = 7, .progress = false},
               std::move(par));
  auto& policy = t.models().policy;
  const auto constructed = buffers_of(policy.net());
  nlohmann::json diverged = nlohmann::json::array(), stepped = nlohmann::json::array();
  const std::int64_t size = 16;
  for (std::int64_t s = 0; s < 4; ++s) {
    auto idx = torch::arange((s * world + rank) * size, (s * world + rank + 1) * size, torch::kInt64)
                   .remainder(digits.labels.size(0));
    const auto x = digits.images.index_select(0, idx).reshape({size, 64});
    {
      torch::NoGradGuard no_grad;
      policy.train(true);
      (void)policy.log_probs(x * static_cast<float>(rank + 1));  // a rank-specific change
    }
    diverged.push_back(buffers_of(policy.net()));
    t.step(bandit::prompts{x, digits.labels.index_select(0, idx)});
    stepped.push_back(buffers_of(policy.net()));
  }
  std::vector<double> flat;
  for (const auto& p : policy.parameters()) {
    auto c = p.detach().reshape({-1}).to(torch::kFloat64).contiguous();
    flat.insert(flat.end(), c.data_ptr<double>(), c.data_ptr<double>() + c.numel());
  }
  return {{"initial", initial}, {"constructed", constructed}, {"diverged", diverged}, {"stepped", stepped},
          {"params", flat}};
}


// SFT under data parallelism: rank r trains on rows [4r, 4r + 4) of a batch whose examples all
// have 2 completion tokens (so the average of the ranks' token means is the whole batch's).
unirl::train::sft_batch sft_dp_batch(std::int64_t step, std::int64_t world) {
  std::vector<std::vector<std::int64_t>> prompts, completions;
  for (std::int64_t i = 0; i < 4 * world; ++i) {
    prompts.push_back({1 + (i + step) % 10, 11, 2 + (3 * i + step) % 9});
    completions.push_back({1 + (i + 2 * step) % 12, 1 + (5 * i + step) % 12});
  }
  return unirl::train::make_sft_batch(prompts, completions, 0);
}

nlohmann::json sft_dp(dp par) {
  const int rank = par.rank(), world = par.world_size();
  torch::manual_seed(11 + rank);  // different weights per rank: the trainer must broadcast rank 0's
  unirl::models::gpt model(unirl::models::gpt_options{.vocab_size = 14, .max_len = 12, .n_layer = 1, .n_head = 2,
                                                      .d_model = 32});
  unirl::train::sft_trainer<unirl::models::gpt, dp> t(
      model, {.optim = {.lr = 1e-2}, .clip = {.max_grad_norm = 1.0}, .batch_size = 4, .steps = 3, .seed = 3,
              .progress = false},
      std::move(par));
  nlohmann::json losses = nlohmann::json::array();
  for (std::int64_t s = 0; s < 3; ++s)
    losses.push_back(t.step(sft_dp_batch(s, world).select(torch::arange(4 * rank, 4 * rank + 4, torch::kInt64))).loss);
  nlohmann::json params = nlohmann::json::object();
  for (const auto& [name, p] : model.named_parameters()) {
    auto c = p.detach().reshape({-1}).to(torch::kFloat64).contiguous();
    params[name] = std::vector<double>(c.data_ptr<double>(), c.data_ptr<double>() + c.numel());
  }
  return {{"losses", losses}, {"params", params}};
}


// ---- the learner / sampler split ----


using split_trainer = unirl::trainer<bandit::model, bandit::policy_gradient, bandit::correct_label>;
using c10d_tr = unirl::parallel::c10d_transport<bandit::rollout>;
using c10d_worker = unirl::parallel::rollout_worker<bandit::model, bandit::policy_gradient, bandit::correct_label, c10d_tr>;

template <class Algorithm = bandit::policy_gradient>
unirl::trainer_options<Algorithm> split_options() {
  return {.optim = {.lr = 3e-3}, .group_size = 4, .epochs = 1, .minibatches = 1, .seed = 7, .progress = false};
}

// The j-th input of sampler `stream`: 16 digits of its own.
bandit::prompts input_for(const examples::digits& d, std::int64_t j, std::int64_t stream) {
  auto idx = torch::arange((j * 4 + stream) * 16, (j * 4 + stream + 1) * 16, torch::kInt64).remainder(d.labels.size(0));
  return {d.images.index_select(0, idx).reshape({16, 64}), d.labels.index_select(0, idx)};
}

template <class M>
std::vector<double> flat_params(const M& m) {
  std::vector<double> flat;
  for (const torch::Tensor& p : m.parameters()) {
    const torch::Tensor c = p.detach().reshape({-1}).to(torch::kFloat64).contiguous();
    flat.insert(flat.end(), c.data_ptr<double>(), c.data_ptr<double>() + c.numel());
  }
  return flat;
}
template <class M>
double checksum(const M& m) {
  double s = 0;
  for (auto v : flat_params(m)) s += v;
  return s;
}

constexpr std::int64_t split_steps = 8;

// The bandit's algorithm, noting what each loss call is told about the update (step_info::updates:
// 1 on-policy, 0 when the batch may be stale).
struct recording_pg : bandit::policy_gradient {
  using bandit::policy_gradient::policy_gradient;
  static std::vector<std::int64_t>& seen() {
    static std::vector<std::int64_t> s;
    return s;
  }
  template <class M>
  unirl::loss_terms loss(unirl::model_set<M>& ms, const bandit::rollout& b, const unirl::step_info& info) {
    seen().push_back(info.updates);
    return bandit::policy_gradient::loss(ms, b, info);
  }
};
using recording_trainer = unirl::trainer<bandit::model, recording_pg, bandit::correct_label>;

// Rank 0 learns (one batch per sampler per step when synchronous), ranks 1.. sample.
nlohmann::json split(const std::string& mode) {
  const auto digits = examples::load_digits(std::string(UNIRL_TEST_DATA_DIR) + "/digits.csv.gz");
  const bool async = mode == "split_async";
  auto tr = c10d_tr::from_environment({.rdzv = {.interface_host = "127.0.0.1", .timeout = std::chrono::seconds(20)},
                                       .max_staleness = async ? 1 : 0});
  torch::manual_seed(50 + tr.rank());  // different initial weights: the samplers must get the learner's
  if (tr.is_learner()) {
    split_trainer t(bandit::model{bandit::policy_net(32)}, {}, split_options());
    unirl::parallel::learner l(t, tr);
    nlohmann::json staleness = nlohmann::json::array(), published = nlohmann::json::array();
    published.push_back(checksum(t.models().policy));
    for (std::int64_t s = 0; s < (async ? 16 : split_steps); ++s) {
      if (async) std::this_thread::sleep_for(std::chrono::milliseconds(25));  // a slow learner: samplers run ahead
      const auto st = l.step(async ? 1 : tr.samplers());
      if (!st) throw std::runtime_error("the samplers stopped early");
      staleness.push_back(st->extra.at("staleness"));
      published.push_back(checksum(t.models().policy));
    }
    l.finish();
    return {{"params", flat_params(t.models().policy)}, {"staleness", staleness}, {"published", published},
            {"dropped", tr.dropped()}};
  }
  c10d_worker w(bandit::model{bandit::policy_net(32)}, {}, split_options(), tr, tr.rank() - 1);
  nlohmann::json versions = nlohmann::json::array(), sums = nlohmann::json::array();
  for (std::int64_t j = 0; w.run_once(input_for(digits, j, tr.rank() - 1)); ++j) {
    versions.push_back(w.version());
    sums.push_back(checksum(w.models().policy));  // the weights this batch was drawn with
  }
  return {{"versions", versions}, {"sums", sums}};
}

// Partial rollouts (worker_options::partial_rollouts) between real processes: rank 0 learns GRPO on
// a small GPT, rank 1 samples on its engine with groups carried across weight versions. The
// learner records, for every batch it trains on, its version and the oldest and newest token.
struct count_ones {
  torch::Tensor operator()(const unirl::token_rollout& b) const {
    const auto hit = (b.completion_ids == 1).to(torch::kFloat) * b.completion_mask;
    return hit.sum(1) / b.completion_mask.sum(1).clamp_min(1.0);
  }
};
using partial_algo = unirl::algo::grpo<>;
using partial_trainer = unirl::trainer<unirl::models::gpt, partial_algo, count_ones>;
using partial_tr = unirl::parallel::c10d_transport<unirl::token_rollout>;
struct probing_learner {  // the learner's view of what it trains on
  using rollout_type = unirl::token_rollout;
  partial_trainer* t;
  std::int64_t version = 0;
  nlohmann::json rows = nlohmann::json::array();
  auto& models() { return t->models(); }
  unirl::step_stats learn(unirl::token_rollout b, torch::Tensor r, std::int64_t staleness) {
    const auto mk = b.completion_mask > 0;
    const auto big = torch::full_like(b.token_version, std::numeric_limits<std::int64_t>::max());
    const auto oldest = torch::where(mk, b.token_version, big).min().item<std::int64_t>();
    const auto newest = torch::where(mk, b.token_version, -big).max().item<std::int64_t>();
    rows.push_back({{"version", version}, {"oldest", oldest}, {"newest", newest}, {"staleness", staleness}});
    auto st = t->learn(std::move(b), std::move(r), staleness);
    ++version;
    return st;
  }
};
nlohmann::json split_partial() {
  auto tr = partial_tr::from_environment({.rdzv = {.interface_host = "127.0.0.1", .timeout = std::chrono::seconds(30)},
                                          .max_staleness = 2});
  const unirl::trainer_options<partial_algo> opts{
      .algorithm = {.agg = unirl::algo::loss_agg::token_mean,
                    .sampling = {.max_new_tokens = 24, .temperature = 1.0, .stop_tokens = {0}, .engine = true}},
      .optim = {.lr = 3e-3},
      .group_size = 4,
      .seed = 11,
      .progress = false};
  auto gpt = [] {
    return unirl::models::gpt(
        unirl::models::gpt_options{.vocab_size = 8, .max_len = 32, .n_layer = 2, .n_head = 2, .d_model = 32});
  };
  torch::manual_seed(60 + tr.rank());
  if (tr.is_learner()) {
    partial_trainer t{gpt(), count_ones{}, opts};
    probing_learner probe{&t};
    unirl::parallel::learner l(probe, tr);
    for (int s = 0; s < 10; ++s) {
      if (!l.step()) throw std::runtime_error("the sampler stopped early");
    }
    l.finish();
    return {{"rows", probe.rows}, {"dropped", tr.dropped()}};
  }
  unirl::parallel::rollout_worker<unirl::models::gpt, partial_algo, count_ones, partial_tr> w(
      gpt(), count_ones{}, opts, tr, tr.rank() - 1, {.partial_rollouts = true, .partial_batch_groups = 2});
  // 4 prompts offered per batch of 2 groups (over-sampling).
  const unirl::prompt_batch in{.tokens = {{2}, {3, 4}, {5}, {6, 7}}};
  nlohmann::json figures = nlohmann::json::array();
  while (w.run_once(in)) figures.push_back(w.figures());
  return {{"figures", figures}};
}

// The weights the plain trainer.step reaches on sampler 0's inputs (seed 50): the reference of
// the one-sampler split runs.
nlohmann::json plain_step_params(const auto& digits) {
  torch::manual_seed(50);
  split_trainer plain(bandit::model{bandit::policy_net(32)}, {}, split_options());
  for (std::int64_t j = 0; j < split_steps; ++j) plain.step(input_for(digits, j, 0));
  return flat_params(plain.models().policy);
}

// The one-process reference of split_sync with one sampler: the plain trainer.step on the
// sampler's inputs, and the colocated transport with a rollout_worker and a learner.
nlohmann::json colocated() {
  const auto digits = examples::load_digits(std::string(UNIRL_TEST_DATA_DIR) + "/digits.csv.gz");
  torch::manual_seed(50);
  split_trainer t(bandit::model{bandit::policy_net(32)}, {}, split_options());
  using tr_t = unirl::parallel::colocated_transport<bandit::rollout>;
  tr_t tr;
  unirl::parallel::rollout_worker<bandit::model, bandit::policy_gradient, bandit::correct_label, tr_t> w(
      bandit::model{bandit::policy_net(32)}, {}, split_options(), tr);
  unirl::parallel::learner l(t, tr);
  nlohmann::json staleness = nlohmann::json::array();
  for (std::int64_t j = 0; j < split_steps; ++j) {
    if (!w.run_once(input_for(digits, j, 0))) throw std::runtime_error("colocated worker stopped");
    staleness.push_back(l.step()->extra.at("staleness"));
  }
  l.finish();
  nlohmann::json out{{"step_params", plain_step_params(digits)},
                     {"colocated_params", flat_params(t.models().policy)},
                     {"staleness", staleness},
                     {"after_finish", w.run_once(input_for(digits, 0, 0))}};

  // Asynchronous, max_staleness = 1: three batches drawn with version 0, then the learner steps.
  recording_pg::seen().clear();
  torch::manual_seed(50);
  recording_trainer at(bandit::model{bandit::policy_net(32)}, {}, split_options<recording_pg>());
  tr_t atr({.max_staleness = 1});
  unirl::parallel::rollout_worker<bandit::model, recording_pg, bandit::correct_label, tr_t> aw(
      bandit::model{bandit::policy_net(32)}, {}, split_options<recording_pg>(), atr);
  unirl::parallel::learner al(at, atr);
  nlohmann::json a_staleness = nlohmann::json::array(), ratio = nlohmann::json::array();
  for (std::int64_t j = 0; j < 3; ++j) aw.run_once(input_for(digits, j, 0));
  for (int k = 0; k < 2; ++k) {
    const auto st = al.step();
    a_staleness.push_back(st->extra.at("staleness"));
    ratio.push_back(st->ratio_mean);
  }
  out["async"] = {{"staleness", a_staleness}, {"ratio_mean", ratio}, {"updates_seen", recording_pg::seen()},
                  {"third", al.step().has_value()}, {"dropped", atr.dropped()}};
  return out;
}

// Weight-sync throughput: the learner publishes 10 versions of 64 MB (16 float tensors of 4 MB)
// to every sampler, synchronously (each publish completes when every sampler holds it).
// UNIRL_BENCH_BUCKET_MB sets the bucket size (default: the transport's, 256 MB).
nlohmann::json sync_bench() {
  const char* bucket = std::getenv("UNIRL_BENCH_BUCKET_MB");
  auto tr = c10d_tr::from_environment({.rdzv = {.interface_host = "127.0.0.1", .timeout = std::chrono::seconds(60)},
                                       .bucket_bytes = bucket ? std::stoll(bucket) << 20 : 256LL << 20});
  std::vector<torch::Tensor> w;
  for (int i = 0; i < 16; ++i) w.push_back(torch::full({1 << 20}, static_cast<float>(tr.rank())));
  const int versions = 10;
  if (tr.is_learner()) {
    tr.publish(w, 0);  // connects every pair
    const auto t0 = std::chrono::steady_clock::now();
    for (int v = 1; v <= versions; ++v) tr.publish(w, v);
    const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    tr.finish();
    const double mb = static_cast<double>(tr.weight_bytes()) / (1 << 20);
    return {{"mb_per_version", mb}, {"bucket_mb", tr.bucket_mb()}, {"seconds", sec}, {"mb_per_s", mb * versions / sec},
            {"mb_per_s_all_samplers", mb * versions * tr.samplers() / sec}};
  }
  std::int64_t have = -1;
  for (int v = 0; v <= versions; ++v) have = tr.fetch(w, have, v);
  tr.leave();
  return {{"last", have}, {"value", w[0][0].item<double>()}};
}

// ---- reward overlap and reward ranks (worker_options::overlap_scoring, parallel/reward_ranks.hpp) ----

// A bandit batch as the reward service sees it: its actions and labels as tensors.
unirl::rewards::json_batch as_json(const bandit::rollout& b) {
  unirl::rewards::json_batch j;
  j.count = b.size();
  j.tensors["actions"] = b.actions;
  j.tensors["labels"] = b.labels;
  return j;
}

// The service side of bandit::correct_label: the same rule on the request's tensors.
struct json_correct_label {
  torch::Tensor operator()(const unirl::rewards::json_batch& b) const {
    UNIRL_CHECK(b.tensors.count("actions") && b.tensors.count("labels"), "json_correct_label: the request has no ",
                "'actions' / 'labels' tensors; expected both");
    return (b.tensors.at("actions") == b.tensors.at("labels")).to(torch::kFloat32);
  }
};

// The sampler side: a remote_scorer for bandit batches. `submit` is what an overlapping worker calls.
struct bandit_remote {
  std::shared_ptr<unirl::rewards::remote_scorer> remote;
  std::shared_ptr<std::int64_t> submits = std::make_shared<std::int64_t>(0);
  std::future<torch::Tensor> submit(const bandit::rollout& b) {
    ++*submits;
    return remote->submit(as_json(b));
  }
  torch::Tensor operator()(const bandit::rollout& b) { return (*remote)(as_json(b)); }
};

// bandit::correct_label after `delay`, noting for each call whether it ran on another thread than
// the one that made the reward.
struct slow_label {
  std::chrono::milliseconds delay{0};
  std::thread::id maker = std::this_thread::get_id();
  std::shared_ptr<std::vector<bool>> other_thread = std::make_shared<std::vector<bool>>();
  torch::Tensor operator()(const bandit::rollout& b) const {
    if (delay.count() > 0) std::this_thread::sleep_for(delay);
    other_thread->push_back(std::this_thread::get_id() != maker);
    return bandit::correct_label{}(b);
  }
};

std::vector<double> values_of(const torch::Tensor& t) {
  const auto c = t.detach().reshape({-1}).to(torch::kFloat64).contiguous();
  return {c.data_ptr<double>(), c.data_ptr<double>() + c.numel()};
}

// One asynchronous worker (colocated transport, max_staleness 10) under a fixed schedule: publish
// version 0, batch 0, publish 1, batches 1 and 2, publish 2, batch 3, flush. Returns what it
// pushed, in order, and how long each run_once took.
template <class Reward>
nlohmann::json async_schedule(const examples::digits& d, Reward reward, bool overlap) {
  using tr_t = unirl::parallel::colocated_transport<bandit::rollout>;
  tr_t tr({.max_staleness = 10});
  torch::manual_seed(50);
  bandit::model published{bandit::policy_net(32)};
  auto weights = unirl::parallel::policy_state(published);
  unirl::parallel::rollout_worker<bandit::model, bandit::policy_gradient, Reward, tr_t> w(
      bandit::model{bandit::policy_net(32)}, std::move(reward), split_options(), tr, 0, {.overlap_scoring = overlap});
  auto next_version = [&](std::int64_t v) {
    torch::NoGradGuard no_grad;
    for (auto& t : weights) t.mul_(-1.5).add_(0.01 * static_cast<double>(v));  // deterministic: no RNG draws
    tr.publish(weights, v);
  };
  nlohmann::json ms = nlohmann::json::array(), batches = nlohmann::json::array(), scoring = nlohmann::json::array();
  auto timed = [&](std::int64_t j) {
    const auto t0 = std::chrono::steady_clock::now();
    if (!w.run_once(input_for(d, j, 0))) throw std::runtime_error("async_schedule: the worker stopped");
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    scoring.push_back(w.scoring());
  };
  tr.publish(weights, 0);
  timed(0);
  next_version(1);
  timed(1);
  timed(2);
  next_version(2);
  timed(3);
  if (!w.flush()) throw std::runtime_error("async_schedule: flush failed");
  while (auto b = tr.pop(0))
    batches.push_back({{"version", b->policy_version}, {"actions", values_of(b->batch.actions)},
                       {"old_logp", values_of(b->batch.old_logp)}, {"rewards", values_of(b->rewards)}});
  return {{"batches", batches}, {"ms", ms}, {"scoring", scoring}};
}

// Overlap in one process: the same pushed batches with and without overlap (a local reward and a
// reward served over HTTP by rewards::reward_server), the run_once times with a slow reward, and
// the synchronous mode (overlap ignored) against trainer.step.
nlohmann::json overlap() {
  const auto digits = examples::load_digits(std::string(UNIRL_TEST_DATA_DIR) + "/digits.csv.gz");
  nlohmann::json out;
  slow_label plain_r, overlap_r;
  out["plain"] = async_schedule(digits, plain_r, false);
  out["overlap"] = async_schedule(digits, overlap_r, true);
  out["plain_other_thread"] = *plain_r.other_thread;
  out["overlap_other_thread"] = *overlap_r.other_thread;
  out["slow_plain"] = async_schedule(digits, slow_label{.delay = std::chrono::milliseconds(300)}, false)["ms"];
  out["slow_overlap"] = async_schedule(digits, slow_label{.delay = std::chrono::milliseconds(300)}, true)["ms"];

  unirl::rewards::reward_server server(json_correct_label{}, {.port = 0, .threads = 2});
  server.start();
  bandit_remote remote{std::make_shared<unirl::rewards::remote_scorer>(
      unirl::rewards::remote_options{.url = server.url(), .timeout_s = 10, .retries = 0})};
  out["remote"] = async_schedule(digits, remote, true);
  out["remote_submits"] = *remote.submits;
  out["remote_served"] = server.served();
  server.stop();

  // Synchronous (max_staleness 0): the option changes nothing; the same training as trainer.step.
  torch::manual_seed(50);
  split_trainer t(bandit::model{bandit::policy_net(32)}, {}, split_options());
  using tr_t = unirl::parallel::colocated_transport<bandit::rollout>;
  tr_t tr;
  slow_label sync_r;
  unirl::parallel::rollout_worker<bandit::model, bandit::policy_gradient, slow_label, tr_t> w(
      bandit::model{bandit::policy_net(32)}, sync_r, split_options(), tr, 0, {.overlap_scoring = true});
  unirl::parallel::learner l(t, tr);
  for (std::int64_t j = 0; j < split_steps; ++j) {
    if (!w.run_once(input_for(digits, j, 0))) throw std::runtime_error("overlap: the sync worker stopped");
    l.step();
  }
  l.finish();
  out["sync_step_params"] = plain_step_params(digits);
  out["sync_overlap_params"] = flat_params(t.models().policy);
  out["sync_other_thread"] = *sync_r.other_thread;
  return out;
}

// ---- restarts (worker_options::seed_per_version, rollout_worker::save / load) ----

// A sampler restarted at version 3 draws what one that ran from version 1 drew for version 3
// (seed_per_version); without it the batch depends on the history. The worker checkpoint round
// trip, and what load refuses. `dir` is a scratch directory.
nlohmann::json worker_restart(const std::string& dir) {
  const auto digits = examples::load_digits(std::string(UNIRL_TEST_DATA_DIR) + "/digits.csv.gz");
  using tr_t = unirl::parallel::colocated_transport<bandit::rollout>;
  using worker_t = unirl::parallel::rollout_worker<bandit::model, bandit::policy_gradient, bandit::correct_label, tr_t>;
  torch::manual_seed(50);
  bandit::model published{bandit::policy_net(32)};
  const auto weights = unirl::parallel::policy_state(published);
  // Draws versions first..3 (sync) and returns the actions of version 3's batch.
  auto draw = [&](std::int64_t first, bool per_version, std::int64_t stream, const std::string& save) {
    tr_t tr;
    worker_t w(bandit::model{bandit::policy_net(32)}, {}, split_options(), tr, stream, {.seed_per_version = per_version});
    std::vector<double> last;
    for (std::int64_t v = first; v <= 3; ++v) {
      tr.publish(weights, v);
      if (!w.run_once([&](std::int64_t x) { return input_for(digits, x, stream); }))
        throw std::runtime_error("worker_restart: the worker stopped");
      last = values_of(tr.pop(v)->batch.actions);
    }
    if (!save.empty()) w.save(save);
    return std::pair{last, w.batches()};
  };
  nlohmann::json out;
  out["per_version_long"] = draw(1, true, 1, dir + "/w.pt").first;
  out["per_version_restarted"] = draw(3, true, 1, "").first;
  out["one_stream_long"] = draw(1, false, 1, "").first;
  out["one_stream_restarted"] = draw(3, false, 1, "").first;
  {
    tr_t tr;
    worker_t w(bandit::model{bandit::policy_net(32)}, {}, split_options(), tr, 1, {.seed_per_version = true});
    out["loaded_version"] = w.load(dir + "/w.pt");
    out["loaded_batches"] = w.batches();
  }
  auto refused = [&](std::int64_t stream, bool per_version, const std::string& path) {
    tr_t tr;
    worker_t w(bandit::model{bandit::policy_net(32)}, {}, split_options(), tr, stream, {.seed_per_version = per_version});
    try {
      (void)w.load(path);
    } catch (const unirl::error& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  out["other_stream"] = refused(2, true, dir + "/w.pt");
  out["other_mode"] = refused(1, false, dir + "/w.pt");
  std::filesystem::copy_file(dir + "/w.pt", dir + "/cut.pt");
  std::filesystem::resize_file(dir + "/cut.pt", std::filesystem::file_size(dir + "/w.pt") / 2);
  out["truncated"] = refused(1, true, dir + "/cut.pt");
  // A learner resumed at step 5 publishes version 5 first, then 6.
  {
    tr_t tr;
    split_trainer t(bandit::model{bandit::policy_net(32)}, {}, split_options());
    unirl::parallel::learner l(t, tr, 5);
    worker_t w(bandit::model{bandit::policy_net(32)}, {}, split_options(), tr, 0, {.seed_per_version = true});
    std::vector<std::int64_t> versions;
    for (int k = 0; k < 2; ++k) {
      if (!w.run_once([&](std::int64_t x) { return input_for(digits, x, 0); }))
        throw std::runtime_error("worker_restart: the worker stopped");
      versions.push_back(w.version());
      (void)l.step();
    }
    out["resumed_versions"] = versions;
    out["resumed_learner_version"] = l.version();
  }
  return out;
}

// A deployment of three processes: rank 0 learns, rank 1 samples (asynchronous, overlap on) and
// scores through rank 2, a reward rank outside the c10d world serving json_correct_label. The
// sampler checks every remote score against bandit::correct_label on the same batch.
nlohmann::json split_reward_rank() {
  const auto digits = examples::load_digits(std::string(UNIRL_TEST_DATA_DIR) + "/digits.csv.gz");
  const unirl::parallel::rendezvous base{.interface_host = "127.0.0.1", .timeout = std::chrono::seconds(20)};
  const auto d = unirl::parallel::deployment::from_environment({.reward_ranks = 1}, base);
  if (d.is_reward()) return {{"served", d.serve_reward(json_correct_label{}, {.server = {.threads = 2}, .poll_s = 0.05})}};
  auto tr = d.transport<bandit::rollout>({.rdzv = base, .max_staleness = 1});
  torch::manual_seed(50 + tr.rank());
  if (tr.is_learner()) {
    split_trainer t(bandit::model{bandit::policy_net(32)}, {}, split_options());
    unirl::parallel::learner l(t, tr);
    const auto before = checksum(t.models().policy);
    std::int64_t steps = 0;
    for (; steps < 6; ++steps)
      if (!l.step(1)) throw std::runtime_error("the sampler stopped early");
    l.finish();
    return {{"steps", steps}, {"c10d_world", tr.world_size()}, {"moved", checksum(t.models().policy) != before}};
  }
  struct checked_remote {
    bandit_remote r;
    std::shared_ptr<std::vector<bool>> same = std::make_shared<std::vector<bool>>();
    std::future<torch::Tensor> submit(const bandit::rollout& b) {
      auto local = bandit::correct_label{}(b);
      return std::async(std::launch::deferred, [f = r.submit(b), local, same = same]() mutable {
        auto got = f.get();
        same->push_back(torch::equal(got, local));
        return got;
      });
    }
    torch::Tensor operator()(const bandit::rollout& b) { return submit(b).get(); }
  };
  const std::string url = d.reward_url(d.reward_for_sampler(tr.rank() - 1));
  checked_remote reward{bandit_remote{std::make_shared<unirl::rewards::remote_scorer>(
      unirl::rewards::remote_options{.url = url, .timeout_s = 10, .retries = 0})}};
  auto same = reward.same;
  auto submits = reward.r.submits;
  unirl::parallel::rollout_worker<bandit::model, bandit::policy_gradient, checked_remote, c10d_tr> w(
      bandit::model{bandit::policy_net(32)}, reward, split_options(), tr, tr.rank() - 1, {.overlap_scoring = true});
  std::int64_t batches = 0;
  for (std::int64_t j = 0; w.run_once(input_for(digits, j, tr.rank() - 1)); ++j) ++batches;
  return {{"same", *same}, {"submits", *submits}, {"batches", batches}, {"url", url}};
}


// ---- several learners (deployment_options::learner_ranks; the "two learner ranks" test) ----
//   dp_worker split_learners|split_learners_file|split_learners_async env env <store-file> <out-prefix>
//   (split_learners_async: a FileStore, max_staleness 1)
//   dp_worker split_learners_ref <rank> 2 <store-file> <out-prefix>
// WORLD_SIZE 4 (+ 1 reward rank with the TCPStore), learner_ranks 2: ranks 0 and 1 learn (data
// parallel among themselves), ranks 2 and 3 sample (sampler index s = rank - 2, learner s % 2),
// synchronously. Every rank starts from
// other weights (seed 50 + rank): the learners must take learner 0's, each sampler its learner's.
// The reference, split_learners_ref: the colocated 2-rank data-parallel trainer, rank r stepping
// on sampler r's inputs (see the test for why the two must agree).

using dp_split_trainer = unirl::trainer<bandit::model, bandit::policy_gradient, bandit::correct_label, dp>;

// bandit::correct_label — here, or served by a reward rank (json_correct_label) — keeping each
// batch's scores.
struct noting_label {
  std::shared_ptr<unirl::rewards::remote_scorer> remote{};  // null: scored here
  std::shared_ptr<nlohmann::json> seen = std::make_shared<nlohmann::json>(nlohmann::json::array());
  torch::Tensor operator()(const bandit::rollout& b) const {
    auto r = remote ? (*remote)(as_json(b)) : bandit::correct_label{}(b);
    seen->push_back(values_of(r));
    return r;
  }
};

// What a deployment refuses, and the strategy of a lone learner (no store is opened).
nlohmann::json deployment_checks(const unirl::parallel::rendezvous& base) {
  nlohmann::json out;
  auto refused = [](auto make) -> std::string {
    try {
      make();
    } catch (const std::exception& e) {
      return e.what();
    }
    return "";
  };
  using unirl::parallel::deployment;
  out["zero_learners"] = refused([&] { (void)deployment(0, 4, {.learner_ranks = 0}, base); });
  out["too_few_samplers"] = refused([&] { (void)deployment(0, 3, {.learner_ranks = 2}, base); });
  out["too_few_with_reward"] = refused([&] { (void)deployment(0, 5, {.learner_ranks = 2, .reward_ranks = 2}, base); });
  out["sampler_group"] = refused([&] { (void)deployment(2, 4, {.learner_ranks = 2}, base).learner_group(); });
  out["lone_learner_world"] = deployment(0, 2, {}, base).learner_group().world_size();
  const deployment five(4, 5, {.learner_ranks = 2}, base);  // samplers 0, 1, 2: learner 0 has two
  out["groups_of_five"] = {five.group(), five.group_samplers(0), five.group_samplers(1), five.sampler_index()};
  return out;
}

nlohmann::json split_learners(const std::string& store, std::int64_t max_staleness = 0) {
  const auto digits = examples::load_digits(std::string(UNIRL_TEST_DATA_DIR) + "/digits.csv.gz");
  unirl::parallel::rendezvous base{.interface_host = "127.0.0.1", .timeout = std::chrono::seconds(20)};
  if (store != "tcp") base.file_path = store;
  // With the TCPStore, rank 4 is a reward rank (a FileStore with reward ranks is refused).
  const auto d = unirl::parallel::deployment::from_environment(
      {.learner_ranks = 2, .reward_ranks = store == "tcp" ? 1 : 0}, base);
  if (d.is_reward()) return {{"served", d.serve_reward(json_correct_label{}, {.server = {.threads = 2}, .poll_s = 0.05})}};
  torch::manual_seed(50 + d.rank());
  if (d.is_learner()) {
    dp_split_trainer t(bandit::model{bandit::policy_net(32)}, {}, split_options(), d.learner_group());
    auto tr = d.transport<bandit::rollout>({.rdzv = base, .max_staleness = max_staleness});
    unirl::parallel::learner l(t, tr);
    nlohmann::json staleness = nlohmann::json::array(), published = nlohmann::json::array(),
                   rewards = nlohmann::json::array();
    published.push_back(checksum(t.models().policy));
    for (std::int64_t s = 0; s < split_steps; ++s) {
      const auto st = l.step(tr.samplers());
      if (!st) throw std::runtime_error("the samplers stopped early");
      staleness.push_back(st->extra.at("staleness"));
      rewards.push_back(values_of(t.last_rewards()));  // the scores of the batch this step learnt from
      published.push_back(checksum(t.models().policy));
    }
    l.finish();
    t.parallel().barrier();  // rank 0 serves the store: it ends after every learner finished
    nlohmann::json out{{"params", flat_params(t.models().policy)}, {"staleness", staleness},
                       {"published", published}, {"rewards", rewards}, {"group", d.group()},
                       {"local_rank", tr.rank()}, {"group_world", tr.world_size()}, {"dropped", tr.dropped()}};
    if (d.rank() == 0) out["checks"] = deployment_checks(base);
    return out;
  }
  auto tr = d.transport<bandit::rollout>({.rdzv = base, .max_staleness = max_staleness});
  noting_label reward;
  if (d.reward_ranks() > 0)
    reward.remote = std::make_shared<unirl::rewards::remote_scorer>(unirl::rewards::remote_options{
        .url = d.reward_url(d.reward_for_sampler(d.sampler_index())), .timeout_s = 10, .retries = 0});
  auto seen = reward.seen;
  unirl::parallel::rollout_worker<bandit::model, bandit::policy_gradient, noting_label, c10d_tr> w(
      bandit::model{bandit::policy_net(32)}, reward, split_options(), tr, d.sampler_index());
  nlohmann::json versions = nlohmann::json::array(), sums = nlohmann::json::array();
  for (std::int64_t j = 0; w.run_once(input_for(digits, j, d.sampler_index())); ++j) {
    versions.push_back(w.version());
    sums.push_back(checksum(w.models().policy));  // the weights this batch was drawn with
  }
  return {{"versions", versions}, {"sums", sums}, {"rewards", *seen}, {"group", d.group()},
          {"local_rank", tr.rank()}, {"sampler_index", d.sampler_index()}};
}

nlohmann::json split_learners_ref(dp par) {
  const auto digits = examples::load_digits(std::string(UNIRL_TEST_DATA_DIR) + "/digits.csv.gz");
  const int rank = par.rank();
  torch::manual_seed(50 + rank);
  dp_split_trainer t(bandit::model{bandit::policy_net(32)}, {}, split_options(), std::move(par));
  nlohmann::json rewards = nlohmann::json::array();
  for (std::int64_t j = 0; j < split_steps; ++j) {
    t.step(input_for(digits, j, rank));
    rewards.push_back(values_of(t.last_rewards()));
  }
  return {{"params", flat_params(t.models().policy)}, {"rewards", rewards}};
}

// ---- faults (c10d_transport: heartbeats, sampler_loss; the "faults: ..." tests) ----
//   dp_worker fault_sampler_continue|fault_sampler_stop|fault_learner env env tcp|<store-file> <out-prefix>
// Synchronous split, 1 learner + 2 samplers, fault_timeout 1 s, heartbeat 100 ms. One process
// dies by SIGKILL (raised by itself: no unwinding, no goodbye, its sockets closed by the kernel)
// at a fixed point, having written the monotonic time of its death to <out-prefix>.died:
// - fault_sampler_continue: sampler rank 2 while scoring its batch of version 3, before pushing
//   it (the learner waits in pop); the learner carries on with rank 1;
// - fault_sampler_stop: sampler rank 2 right after pushing its batch of version 3 (the learner
//   waits for it to receive version 4); the learner stops with an error;
// - fault_learner: the learner after receiving the batches of version 3 (the samplers wait for
//   version 4); the samplers must stop with an error.
// "tcp": a TCPStore served by the learner; otherwise a FileStore at that path (it outlives the
// learner, so only the heartbeat tells).
std::int64_t monotonic_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
[[noreturn]] void die(const std::string& out) {
  std::ofstream(out + ".died") << monotonic_ns();
  std::raise(SIGKILL);
  std::abort();
}

// bandit::correct_label that kills the process at its call number `die_at` (-1: never).
struct dying_label {
  std::string out;
  std::int64_t die_at = -1;
  std::shared_ptr<std::int64_t> calls = std::make_shared<std::int64_t>(0);
  torch::Tensor operator()(const bandit::rollout& b) const {
    if ((*calls)++ == die_at) die(out);
    return bandit::correct_label{}(b);
  }
};

nlohmann::json fault(const std::string& mode, const std::string& store, const std::string& out) {
  const auto digits = examples::load_digits(std::string(UNIRL_TEST_DATA_DIR) + "/digits.csv.gz");
  unirl::parallel::transport_options o{
      .rdzv = {.interface_host = "127.0.0.1", .timeout = std::chrono::seconds(20)},
      .on_sampler_loss = mode == "fault_sampler_continue" ? unirl::parallel::sampler_loss::carry_on
                                                          : unirl::parallel::sampler_loss::stop,
      .fault_timeout = std::chrono::milliseconds(1000),
      .heartbeat = std::chrono::milliseconds(100)};
  if (store != "tcp") o.rdzv.file_path = store;
  auto tr = c10d_tr::from_environment(o);
  torch::manual_seed(50 + tr.rank());
  if (tr.is_learner()) {
    split_trainer t(bandit::model{bandit::policy_net(32)}, {}, split_options());
    unirl::parallel::learner l(t, tr);
    nlohmann::json lost = nlohmann::json::array(), samples = nlohmann::json::array(),
                   staleness = nlohmann::json::array(), at = nlohmann::json::array();
    for (std::int64_t s = 0; s < split_steps; ++s) {
      if (mode == "fault_learner" && s == 3) {
        // receive both batches of version 3 (the samplers' sends complete), then die: the
        // samplers wait for version 4 in the store, outside any Gloo call
        for (int k = 0; k < tr.samplers(); ++k)
          if (!tr.pop(l.version())) throw std::runtime_error("the samplers stopped early");
        die(out);
      }
      const auto st = l.step(tr.samplers());
      if (!st) throw std::runtime_error("the samplers stopped early");
      lost.push_back(st->extra.at("samplers_lost"));
      samples.push_back(st->samples);
      staleness.push_back(st->extra.at("staleness"));
      at.push_back(monotonic_ns());
    }
    l.finish();
    return {{"samplers_lost", lost}, {"samples", samples}, {"staleness", staleness}, {"step_end_ns", at},
            {"lost_ranks", tr.lost_ranks()}, {"live", tr.live_samplers()}};
  }
  const bool dies = tr.rank() == 2 && mode != "fault_learner";
  using worker = unirl::parallel::rollout_worker<bandit::model, bandit::policy_gradient, dying_label, c10d_tr>;
  worker w(bandit::model{bandit::policy_net(32)}, dying_label{out, dies && mode == "fault_sampler_continue" ? 3 : -1},
           split_options(), tr, tr.rank() - 1);
  nlohmann::json versions = nlohmann::json::array();
  for (std::int64_t j = 0; w.run_once(input_for(digits, j, tr.rank() - 1)); ++j) {
    versions.push_back(w.version());
    if (dies && mode == "fault_sampler_stop" && w.version() == 3) die(out);  // pushed; version 4 not received
  }
  return {{"versions", versions}};
}
}  // namespace

int main(int argc, char** argv) try {
  if (argc != 6) {
    std::cerr << "usage: dp_worker grads|train|buffers <rank> <world> <store-file> <out-prefix>\n";
    return 2;
  }
  const std::string mode = argv[1];
  torch::set_num_threads(1);
  if (mode == "split_learners" || mode == "split_learners_file" || mode == "split_learners_async") {
    const char* r = std::getenv("RANK");
    const nlohmann::json out =
        split_learners(mode == "split_learners" ? "tcp" : argv[4], mode == "split_learners_async" ? 1 : 0);
    std::ofstream(std::string(argv[5]) + "." + (r ? r : "") + ".json") << out.dump();
    return 0;
  }
  if (mode.rfind("fault_", 0) == 0) {  // the faults: see fault()
    const char* r = std::getenv("RANK");
    const nlohmann::json out = fault(mode, argv[4], argv[5]);
    std::ofstream(std::string(argv[5]) + "." + (r ? r : "") + ".json") << out.dump();
    return 0;
  }
  if (mode == "split_partial") {
    const char* r = std::getenv("RANK");
    std::ofstream(std::string(argv[5]) + "." + (r ? r : "") + ".json") << split_partial().dump();
    return 0;
  }
  if (mode == "split_sync" || mode == "split_async" || mode == "sync_bench" || mode == "colocated" ||
      mode == "overlap" || mode == "split_reward_rank" || mode == "worker_restart") {
    const char* r = std::getenv("RANK");
    const std::string rank = mode == "colocated" || mode == "overlap" || mode == "worker_restart" ? "0" : r ? r : "";
    const nlohmann::json out = mode == "colocated"           ? colocated()
                               : mode == "overlap"           ? overlap()
                               : mode == "worker_restart"    ? worker_restart(std::filesystem::path(argv[5]).parent_path().string())
                               : mode == "split_reward_rank" ? split_reward_rank()
                               : mode == "sync_bench"        ? sync_bench()
                                                             : split(mode);
    std::ofstream(std::string(argv[5]) + "." + rank + ".json") << out.dump();
    return 0;
  }
  if (mode.rfind("fsdp_", 0) == 0 || mode.rfind("plan_", 0) == 0) {  // rank and world as arguments or, given "env", torchrun's variables
    const bool env = std::string(argv[2]) == "env";
    const int rank = std::stoi(env ? std::getenv("RANK") : argv[2]);
    const int world = std::stoi(env ? std::getenv("WORLD_SIZE") : argv[3]);
    if (const auto z = fsdp_modes::run(mode, rank, world, argv[4], argv[5])) {
      std::ofstream(std::string(argv[5]) + "." + std::to_string(rank) + ".json") << z->dump();
      return 0;
    }
  }
  const int rank = std::stoi(argv[2]), world = std::stoi(argv[3]);
  if (const auto z = zero_modes::run(mode, rank, world, argv[4], argv[5])) {
    std::ofstream(std::string(argv[5]) + "." + std::to_string(rank) + ".json") << z->dump();
    return 0;
  }
  dp par(rank, world, {.file_path = argv[4], .interface_host = "127.0.0.1", .timeout = std::chrono::seconds(60)});
  const nlohmann::json out = mode == "grads"                ? check_gradients(par)
                             : mode == "buffers"            ? buffers(std::move(par))
                             : mode == "split_learners_ref" ? split_learners_ref(std::move(par))
                             : mode == "sft"                ? sft_dp(std::move(par))
                                                            : train(std::move(par));
  std::ofstream(std::string(argv[5]) + "." + std::to_string(rank) + ".json") << out.dump();
  return 0;
} catch (const std::exception& e) {
  std::cerr << "dp_worker: " << e.what() << "\n";
  return 1;
}

// One rank of the distributed tests: started N times by test_distributed.cpp, the ranks meet
// through a FileStore and write what they saw to <out>.<rank>.json.
//   dp_worker grads|train|buffers <rank> <world> <store-file> <out-prefix>
// The learner / sampler split (parallel/c10d_transport.hpp) meets through torchrun-style
// variables instead (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; a TCPStore):
//   dp_worker split_sync|split_async|sync_bench env env <unused> <out-prefix>
//   dp_worker colocated 0 1 <unused> <out-prefix>   (the one-process reference of split_sync)
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <thread>
#include <iostream>
#include <limits>
#include <vector>

#include <nlohmann/json.hpp>
#include <unirl/models/module_adapter.hpp>
#include <unirl/parallel/c10d_transport.hpp>
#include <unirl/parallel/colocated.hpp>
#include <unirl/parallel/data_parallel.hpp>
#include <unirl/parallel/rollout_worker.hpp>
#include <unirl/trainer.hpp>

#include "common/bandit.hpp"
#include "common/digits.hpp"

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

// The one-process reference of split_sync with one sampler: the plain trainer.step on the
// sampler's inputs, and the colocated transport with a rollout_worker and a learner.
nlohmann::json colocated() {
  const auto digits = examples::load_digits(std::string(UNIRL_TEST_DATA_DIR) + "/digits.csv.gz");
  torch::manual_seed(50);
  split_trainer plain(bandit::model{bandit::policy_net(32)}, {}, split_options());
  for (std::int64_t j = 0; j < split_steps; ++j) plain.step(input_for(digits, j, 0));
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
  nlohmann::json out{{"step_params", flat_params(plain.models().policy)},
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

}  // namespace

int main(int argc, char** argv) try {
  if (argc != 6) {
    std::cerr << "usage: dp_worker grads|train|buffers <rank> <world> <store-file> <out-prefix>\n";
    return 2;
  }
  const std::string mode = argv[1];
  torch::set_num_threads(1);
  if (mode == "split_sync" || mode == "split_async" || mode == "sync_bench" || mode == "colocated") {
    const char* r = std::getenv("RANK");
    const std::string rank = mode == "colocated" ? "0" : r ? r : "";
    const nlohmann::json out = mode == "colocated" ? colocated() : mode == "sync_bench" ? sync_bench() : split(mode);
    std::ofstream(std::string(argv[5]) + "." + rank + ".json") << out.dump();
    return 0;
  }
  const int rank = std::stoi(argv[2]), world = std::stoi(argv[3]);
  dp par(rank, world, {.file_path = argv[4], .interface_host = "127.0.0.1", .timeout = std::chrono::seconds(60)});
  const nlohmann::json out = mode == "grads"     ? check_gradients(par)
                             : mode == "buffers" ? buffers(std::move(par))
                                                 : train(std::move(par));
  std::ofstream(std::string(argv[5]) + "." + std::to_string(rank) + ".json") << out.dump();
  return 0;
} catch (const std::exception& e) {
  std::cerr << "dp_worker: " << e.what() << "\n";
  return 1;
}

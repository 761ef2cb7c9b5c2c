// One rank of the distributed tests: started N times by test_distributed.cpp, the ranks meet
// through a FileStore and write what they saw to <out>.<rank>.json.
//   dp_worker grads|train|buffers <rank> <world> <store-file> <out-prefix>
#include <cmath>
#include <fstream>
#include <iostream>
#include <limits>
#include <vector>

#include <nlohmann/json.hpp>
#include <unirl/models/module_adapter.hpp>
#include <unirl/parallel/data_parallel.hpp>
#include <unirl/trainer.hpp>

#include "common/bandit.hpp"
#include "common/digits.hpp"

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

}  // namespace

int main(int argc, char** argv) try {
  if (argc != 6) {
    std::cerr << "usage: dp_worker grads|train|buffers <rank> <world> <store-file> <out-prefix>\n";
    return 2;
  }
  const std::string mode = argv[1];
  const int rank = std::stoi(argv[2]), world = std::stoi(argv[3]);
  torch::set_num_threads(1);
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

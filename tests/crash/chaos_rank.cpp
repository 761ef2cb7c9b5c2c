// One rank of the split deployment the chaos loop (chaos_driver.cpp) kills: of four processes,
// rank 0 learns, ranks 1 and 2 sample, rank 3 is a reward rank serving the bandit's reward over
// HTTP (parallel/reward_ranks.hpp). Synchronous (max_staleness 0); the learner checkpoints every
// step into DIR/learner and resumes from its newest complete checkpoint; each sampler keeps its
// worker checkpoint in DIR/sampler-<i>.pt and draws with `worker_options::seed_per_version`
// from the input of the version it fetched, so a restarted deployment draws the batches an
// uninterrupted one draws and the final weights are the same bit for bit. Deterministic on CPU:
// one LibTorch thread, inputs a function of (version, sampler), rewards a function of the batch.
//
//   RANK=r WORLD_SIZE=4 MASTER_ADDR=127.0.0.1 MASTER_PORT=p chaos_rank DIR STEPS
//
// Markers on stdout, one a line, flushed. Learner: "fresh" or "resumed S", "saving S" / "saved S"
// around each save, then "hash 0x..." and "done". Sampler: "fresh" or "resumed V B" (the worker
// checkpoint's version and batch count), "batch V" after each push, "done". Reward rank:
// "serving", "done".
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <unirl/parallel/c10d_transport.hpp>
#include <unirl/parallel/reward_ranks.hpp>
#include <unirl/parallel/rollout_worker.hpp>
#include <unirl/rewards/remote.hpp>
#include <unirl/train/run_directory.hpp>
#include <unirl/trainer.hpp>

#include "common/bandit.hpp"

// The bandit's batch, reflected so that the c10d transport can carry it (core/batch.hpp).
BOOST_HANA_ADAPT_STRUCT(bandit::rollout, contexts, labels, actions, old_logp, advantages);

namespace {
using trainer_t = unirl::trainer<bandit::model, bandit::policy_gradient, bandit::correct_label>;
using transport_t = unirl::parallel::c10d_transport<bandit::rollout>;

unirl::trainer_options<bandit::policy_gradient> options() {
  return {.optim = {.lr = 3e-3}, .group_size = 4, .epochs = 2, .minibatches = 2, .seed = 7, .progress = false};
}

// The input sampler `stream` draws for weight version `v`: 16 contexts whose label is the argmax
// of their first 10 features (a task the policy learns), a function of (v, stream) alone.
bandit::prompts input_of(std::int64_t v, std::int64_t stream) {
  std::mt19937_64 rng(static_cast<std::uint64_t>(v) * 1000003u + static_cast<std::uint64_t>(stream) * 7919u + 1u);
  std::normal_distribution<float> n(0.f, 1.f);
  std::vector<float> x(16 * 64);
  for (auto& e : x) e = n(rng);
  const auto contexts = torch::from_blob(x.data(), {16, 64}, torch::kFloat32).clone();
  return {contexts, contexts.slice(1, 0, 10).argmax(1)};
}

// The service side of bandit::correct_label: the same rule on the request's tensors.
struct json_label {
  torch::Tensor operator()(const unirl::rewards::json_batch& b) const {
    UNIRL_CHECK(b.tensors.count("actions") && b.tensors.count("labels"), "chaos_rank: the request has no 'actions' / ",
                "'labels' tensors; expected both");
    return (b.tensors.at("actions") == b.tensors.at("labels")).to(torch::kFloat32);
  }
};

// The sampler side: the reward rank's scores, through rewards::remote_scorer.
struct remote_label {
  std::shared_ptr<unirl::rewards::remote_scorer> remote;
  torch::Tensor operator()(const bandit::rollout& b) const {
    unirl::rewards::json_batch j;
    j.count = b.size();
    j.tensors["actions"] = b.actions;
    j.tensors["labels"] = b.labels;
    return (*remote)(j);
  }
};

// FNV-1a 64 over every parameter's and buffer's bytes (float32, CPU, contiguous).
std::string weights_hash(const bandit::model& m) {
  std::uint64_t h = 14695981039346656037ull;
  for (const auto& t : unirl::parallel::policy_state(m)) {
    const auto c = t.detach().to(torch::kCPU).contiguous();
    const auto* p = static_cast<const unsigned char*>(c.data_ptr());
    for (std::size_t i = 0; i < static_cast<std::size_t>(c.numel()) * c.element_size(); ++i) {
      h ^= p[i];
      h *= 1099511628211ull;
    }
  }
  char buf[24];
  std::snprintf(buf, sizeof buf, "0x%016llx", static_cast<unsigned long long>(h));
  return buf;
}
}  // namespace

int main(int argc, char** argv) try {
  if (argc < 3) {
    std::cerr << "usage: chaos_rank DIR STEPS (with RANK, WORLD_SIZE=4, MASTER_ADDR, MASTER_PORT)\n";
    return 2;
  }
  const std::filesystem::path dir = argv[1];
  const std::int64_t steps = std::atoll(argv[2]);
  torch::set_num_threads(1);
  // Every wait is bounded: a rank whose peer died notices within fault_timeout (heartbeats) or
  // at once (a closed connection), and no wait outlasts the rendezvous timeout.
  const unirl::parallel::rendezvous base{.interface_host = "127.0.0.1", .timeout = std::chrono::seconds(10)};
  const auto d = unirl::parallel::deployment::from_environment({.reward_ranks = 1}, base);
  UNIRL_CHECK(d.world_size() == 4, "chaos_rank: WORLD_SIZE = ", d.world_size(), ": expected 4 (a learner, two ",
              "samplers, a reward rank)");
  if (d.is_reward()) {
    std::cout << "serving" << std::endl;
    (void)d.serve_reward(json_label{}, {.server = {.host = "127.0.0.1", .port = 0, .threads = 2}, .poll_s = 0.02});
    std::cout << "done" << std::endl;
    return 0;
  }
  const unirl::parallel::transport_options to{.rdzv = base, .max_staleness = 0,
                                              .fault_timeout = std::chrono::seconds(2)};
  if (d.is_learner()) {
    torch::manual_seed(50);
    trainer_t t(bandit::model{bandit::policy_net(32)}, {}, options());
    auto tr = d.transport<bandit::rollout>(to);  // before the load: the checkpoint's RNG state is the last word
    unirl::train::run_directory run(dir / "learner", {.keep = 2});
    run.remove_temporaries();
    if (const auto last = run.latest()) {
      t.load(last->path.string());
      std::cout << "resumed " << t.step_count() << std::endl;
    } else {
      std::cout << "fresh" << std::endl;
    }
    unirl::parallel::learner l(t, tr, t.step_count());
    for (std::int64_t s = t.step_count(); s < steps; ++s) {
      UNIRL_CHECK(l.step(tr.samplers()).has_value(), "chaos_rank: the samplers stopped at step ", s);
      std::cout << "saving " << t.step_count() << std::endl;
      run.save(t.step_count(), [&](const std::string& p) { t.save(p); });
      std::cout << "saved " << t.step_count() << std::endl;
    }
    l.finish();
    std::cout << "hash " << weights_hash(t.models().policy) << std::endl << "done" << std::endl;
    return 0;
  }
  const std::int64_t stream = d.sampler_index();
  auto tr = d.transport<bandit::rollout>(to);
  remote_label reward{std::make_shared<unirl::rewards::remote_scorer>(unirl::rewards::remote_options{
      .url = d.reward_url(d.reward_for_sampler(stream)), .timeout_s = 5, .retries = 0, .deadline_s = 5})};
  unirl::parallel::rollout_worker<bandit::model, bandit::policy_gradient, remote_label, transport_t> w(
      bandit::model{bandit::policy_net(32)}, reward, options(), tr, stream, {.seed_per_version = true});
  const auto state = dir / ("sampler-" + std::to_string(stream) + ".pt");
  if (std::filesystem::exists(state)) {
    const auto v = w.load(state.string());
    std::cout << "resumed " << v << " " << w.batches() << std::endl;
  } else {
    std::cout << "fresh" << std::endl;
  }
  while (w.run_once([&](std::int64_t v) { return input_of(v, stream); })) {
    w.save(state.string());
    std::cout << "batch " << w.version() << std::endl;
  }
  std::cout << "done" << std::endl;
  return 0;
} catch (const std::exception& e) {
  std::cerr << "chaos_rank: " << e.what() << "\n";
  return 1;
}

// RL fine-tuning of a class-conditional flow-matching model on the real 8x8 digits.
//
// 1. A digit classifier is trained on the digits (held-out accuracy printed).
// 2. A small class-conditional flow model is pretrained by flow matching (cached in the output
//    root, so the algorithms start from the same weights).
// 3. The model is fine-tuned with the algorithm chosen by --algorithm — a compile-time type
//    (unirl::algo::flow_grpo<>, flow_dppo<>, ram<>, diffusion_nft<>) picked once in main — for
//    the reward "the classifier's probability that the sample shows the digit it was asked for".
//    KL to the pretrained model is kept bounded by the algorithms' own regularisers (Flow-GRPO's
//    KL term, DPPO's trust region, RAM's reference anchor) and reported.
// 4. Before and after: reward of a fixed set of ODE samples (same noise), Fréchet distance of the
//    classifier's penultimate features to the real digits, path KL to the pretrained model,
//    sample grids and the reward curve.
//
//   digits_flow --algorithm grpo|dppo|ram|nft [--out DIR] [key=value ...]   e.g. steps=60 lr=1e-4
#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>

#include <unirl/train/plot.hpp>  // first: brings the stb_image_write implementation

#include <unirl/algorithms/diffusion_nft.hpp>
#include <unirl/algorithms/flow_dppo.hpp>
#include <unirl/algorithms/flow_grpo.hpp>
#include <unirl/algorithms/ram.hpp>
#include <unirl/eval/frechet.hpp>
#include <unirl/models/flow.hpp>
#include <unirl/models/flow_nets.hpp>
#include <unirl/rollout/flow_samplers.hpp>
#include <unirl/trainer.hpp>

#include "common/digits.hpp"
#include "common/flow_example.hpp"

namespace {

using flow_t = unirl::models::flow_model<unirl::models::mlp_velocity_net>;

struct example_options {
  std::int64_t steps = 150;           // RL trainer steps
  std::int64_t conditions = 10;       // classes per step (each drawn group_size times)
  std::int64_t group_size = 8;
  std::int64_t minibatches = 4;       // optimizer steps per rollout batch (off-policy after the first)
  std::int64_t sampler_steps = 10;    // denoising steps of the RL sampler
  double lr = 3e-5;
  double kl_beta = 0.1;               // Flow-GRPO / Flow-DPPO: KL-to-reference coefficient
  double multiplier = 0.5;            // RAM: reward multiplier m
  std::int64_t pretrain_iters = 800;  // flow-matching iterations (cached)
  std::int64_t hidden = 128;
  std::int64_t seed = 1;
};

/// The reward: p_classifier(class = condition | sample).
struct class_confidence {
  examples::digit_classifier clf;
  torch::Tensor operator()(const unirl::rollout::flow_rollout& b) {
    torch::NoGradGuard ng;
    const auto p = torch::softmax(clf->forward(b.samples().clamp(-1, 1)), 1);
    return p.gather(1, b.conditions.reshape({-1, 1}).to(torch::kInt64)).squeeze(1);
  }
};

struct evaluation {
  double reward = 0, frechet = 0, kl = 0;
  torch::Tensor samples;  // (100, 1, 8, 8): 10 per class, class-major
};

/// Reward and Fréchet distance of 300 ODE samples from fixed noise, and the path KL of the
/// Flow-GRPO SDE (sum over elements and steps) from `policy` to `reference`.
evaluation evaluate(flow_t& policy, flow_t& reference, class_confidence& reward, const torch::Tensor& real_features) {
  torch::NoGradGuard ng;
  namespace rl = unirl::rollout;
  evaluation e;
  torch::manual_seed(1234);
  const auto labels = torch::arange(10, torch::kInt64).repeat_interleave(30);
  const auto noise = torch::randn({300, 1, 8, 8});
  const auto b = rl::sample_trajectory(rl::ode::euler({.steps = 20}), policy, labels, noise);
  e.reward = reward(b).mean().item<double>();
  e.frechet = unirl::eval::frechet_distance(reward.clf->features(b.samples().clamp(-1, 1)), real_features);
  e.samples = b.samples().reshape({10, 30, 1, 8, 8}).slice(1, 0, 10).reshape({100, 1, 8, 8});
  const rl::sde::flow_grpo sde({.steps = 10, .reduction = rl::logprob_reduction::sum});
  const auto path = rl::sample_trajectory(sde, policy, labels);
  torch::Tensor kl = torch::zeros({300});
  for (std::int64_t k = 0; k < path.steps(); ++k) {
    const auto ref = rl::replay_step(sde, reference, path, k);
    kl += rl::gaussian_kl(path.means.select(1, k), ref.step.mean, ref.step.std, rl::logprob_reduction::sum);
  }
  e.kl = kl.mean().item<double>();
  return e;
}

template <class Algo>
int run(const std::string& name, typename Algo::options algo, const example_options& opt, const std::string& root) {
  const std::string out = root + "/" + name;
  std::filesystem::create_directories(out);

  // Data in [-1, 1], and a classifier trained on a fixed split (the reward and the Fréchet features).
  auto setup = examples::prepare_digits(std::string(UNIRL_DATA_DIR) + "/digits.csv.gz");
  const auto& images = setup.images;
  const auto& labels = setup.labels;
  auto& clf = setup.clf;
  const auto& real_features = setup.real_features;
  const double accuracy = setup.accuracy;

  // Pretraining (cached): class-conditional flow matching, 10% unconditional for guidance.
  torch::manual_seed(static_cast<std::uint64_t>(opt.seed));
  unirl::models::mlp_velocity_net net(unirl::models::flow_net_options{
      .shape = {1, 8, 8}, .num_classes = 10, .hidden = opt.hidden, .depth = 3, .embed_dim = 64});
  const std::string cache = root + "/pretrained_flow_h" + std::to_string(opt.hidden) + ".pt";
  double pretrain_seconds = 0;
  if (std::filesystem::exists(cache)) {
    torch::load(net, cache);
    std::cout << "loaded the pretrained flow model from " << cache << "\n";
  } else {
    flow_t m(net, {1, 8, 8});
    torch::optim::AdamW opt_fm(net->parameters(), torch::optim::AdamWOptions(1e-3).weight_decay(0.0));
    const auto t0 = std::chrono::steady_clock::now();
    for (std::int64_t i = 0; i < opt.pretrain_iters; ++i) {
      for (auto& g : opt_fm.param_groups())
        static_cast<torch::optim::AdamWOptions&>(g.options())
            .lr(1e-3 * 0.5 * (1 + std::cos(M_PI * static_cast<double>(i) / static_cast<double>(opt.pretrain_iters))));
      const auto idx = torch::randint(0, images.size(0), {256}, torch::kInt64);
      const auto loss = m.flow_matching_loss(images.index_select(0, idx), labels.index_select(0, idx), 0.1);
      opt_fm.zero_grad();
      loss.backward();
      opt_fm.step();
      if (i % 1000 == 0) std::cout << "pretrain " << i << " loss " << loss.item<double>() << "\n";
    }
    pretrain_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    torch::save(net, cache);
    std::cout << "pretrained in " << pretrain_seconds << " s, saved " << cache << "\n";
  }

  using trainer_t = unirl::trainer<flow_t, Algo, class_confidence>;
  typename trainer_t::options topts{.algorithm = algo,
                                    .optim = {.lr = opt.lr},
                                    .clip = {.max_grad_norm = 1.0},
                                    .group_size = opt.group_size,
                                    .minibatches = opt.minibatches,
                                    .seed = opt.seed,
                                    .metrics_path = out + "/metrics.jsonl",
                                    .progress = true,
                                    .total_steps = opt.steps};
  std::filesystem::remove(topts.metrics_path);
  trainer_t t(flow_t(net, {1, 8, 8}), class_confidence{clf}, topts);
  std::cout << t.describe() << "\n";
  flow_t reference = t.models().policy.clone();

  const auto before = evaluate(t.models().policy, reference, t.reward(), real_features);
  std::cout << "before: reward " << before.reward << "  frechet " << before.frechet << "\n";

  const auto start = std::chrono::steady_clock::now();
  for (std::int64_t s = 0; s < opt.steps; ++s) {
    const auto cond = torch::randperm(10, torch::kInt64).slice(0, 0, std::min<std::int64_t>(opt.conditions, 10));
    t.step(cond);
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  const auto after = evaluate(t.models().policy, reference, t.reward(), real_features);
  std::cout << "\nafter:  reward " << after.reward << "  frechet " << after.frechet << "  kl " << after.kl << "  ("
            << opt.steps << " steps, " << seconds << " s)\n";

  examples::write_grid_png(out + "/samples_before.png", before.samples.reshape({100, 8, 8}), 10, 10);
  examples::write_grid_png(out + "/samples_after.png", after.samples.reshape({100, 8, 8}), 10, 10);
  unirl::train::plot_metrics(topts.metrics_path, out + "/reward_curve.png", {"reward_mean", "kl"});
  nlohmann::json summary{{"algorithm", name},
                         {"reward_before", before.reward},
                         {"reward_after", after.reward},
                         {"kl_to_reference", after.kl},
                         {"frechet_before", before.frechet},
                         {"frechet_after", after.frechet},
                         {"steps", opt.steps},
                         {"seconds", seconds},
                         {"reward_gain_per_step", (after.reward - before.reward) / static_cast<double>(opt.steps)},
                         {"reward_gain_per_second", (after.reward - before.reward) / seconds},
                         {"samples_per_step", opt.conditions * opt.group_size},
                         {"classifier_accuracy", accuracy},
                         {"pretrain_seconds", pretrain_seconds},
                         {"algorithm_options", unirl::options::to_json(algo)}};
  std::ofstream(out + "/summary.json") << summary.dump(2) << "\n";
  std::cout << "wrote " << out << "/{summary.json, metrics.jsonl, reward_curve.png, samples_before.png, "
            << "samples_after.png}\n";
  return 0;
}

}  // namespace

BOOST_HANA_ADAPT_STRUCT(example_options, steps, conditions, group_size, minibatches, sampler_steps, lr, kl_beta, multiplier,
                        pretrain_iters, hidden, seed);

int main(int argc, char** argv) try {
  example_options opt;
  auto flags = unirl::options::parse_command_line(opt, argc, argv, {{"out", "runs/20_digits_flow"}, {"algorithm", "grpo"}});
  const std::string algorithm = flags["algorithm"], root = flags["out"];
  std::cout << unirl::options::to_string(opt) << "\n";
  const unirl::rollout::flow_sampler_options sde{.steps = opt.sampler_steps};
  namespace algo = unirl::algo;
  // The algorithm is a type: each branch instantiates the whole pipeline for it.
  if (algorithm == "grpo")
    return run<algo::flow_grpo<>>("flow_grpo", {.clip_range = 1e-3, .beta = opt.kl_beta, .sampler = sde}, opt, root);
  if (algorithm == "dppo")
    return run<algo::flow_dppo<>>("flow_dppo", {.delta = 1e-5, .beta = opt.kl_beta, .sampler = sde}, opt, root);
  if (algorithm == "ram")
    return run<algo::ram<>>("ram", {.multiplier = opt.multiplier, .draws = 4, .ema_decay = 0.9, .sampler = sde}, opt, root);
  if (algorithm == "nft")
    return run<algo::diffusion_nft<>>("diffusion_nft", {.beta = 1.0, .sampler = sde}, opt, root);
  throw unirl::config_error("--algorithm", "value '" + algorithm + "': expected grpo, dppo, ram or nft");
} catch (const std::exception& e) {
  std::cerr << e.what() << "\n";
  return 2;
}

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
//   (--algorithm dppo dppo_trust_region=clamped_kl: seed 000's clamped-KL trust region)
#include <cstdint>
#include <filesystem>
#include <iostream>
#include <string>
#include <type_traits>

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
  unirl::algo::dppo_trust_region dppo_trust_region{};  // Flow-DPPO: kl_mask (UniRL) or clamped_kl (seed 000)
  std::int64_t pretrain_iters = 800;  // flow-matching iterations (cached)
  std::int64_t hidden = 128;
  std::int64_t seed = 1;
};

/// The reward: p_classifier(class = condition | sample).
struct class_confidence {
  examples::digit_classifier clf;
  torch::Tensor operator()(const unirl::flow_rollout& b) {
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
  evaluation e;
  const examples::scoped_seed fixed_noise(1234);  // the run's own random stream is left as it was
  const auto labels = torch::arange(10, torch::kInt64).repeat_interleave(30);
  const auto noise = torch::randn({300, 1, 8, 8});
  const auto b = unirl::sample_trajectory(unirl::ode::euler({.steps = 20}), policy, labels, noise);
  e.reward = reward(b).mean().item<double>();
  e.frechet = unirl::eval::frechet_distance(reward.clf->features(b.samples().clamp(-1, 1)), real_features);
  e.samples = b.samples().reshape({10, 30, 1, 8, 8}).slice(1, 0, 10).reshape({100, 1, 8, 8});
  e.kl = examples::path_kl(policy, reference, labels, 10);
  return e;
}

/// The velocity network, initialised after the run's seed.
unirl::models::mlp_velocity_net make_net(const example_options& opt) {
  torch::manual_seed(static_cast<std::uint64_t>(opt.seed));
  return unirl::models::mlp_velocity_net(unirl::models::flow_net_options{
      .shape = {1, 8, 8}, .num_classes = 10, .hidden = opt.hidden, .depth = 3, .embed_dim = 64});
}

/// Pretraining: class-conditional flow matching, 10% unconditional for guidance, through the
/// library's stage; its run directory in the output root is the cache (a finished run loads).
/// Returns the seconds it took.
double pretrain(unirl::models::mlp_velocity_net& net, const example_options& opt, const std::string& root,
                const examples::digit_setup& setup) {
  return examples::pretrain_flow(
      flow_t(net, {1, 8, 8}),
      {.objective = {.p_uncond = 0.1},
       .optim = {.lr = 1e-3},
       .schedule = {.kind = unirl::train::schedule_kind::cosine},
       .batch_size = 256,
       .steps = opt.pretrain_iters,
       .out = root + "/pretrained_flow_h" + std::to_string(opt.hidden) + "_i" + std::to_string(opt.pretrain_iters) +
              "_s" + std::to_string(opt.seed)},
      [&](std::int64_t n) {
        const auto idx = torch::randint(0, setup.images.size(0), {n}, torch::kInt64);
        return unirl::train::flow_matching_batch{setup.images.index_select(0, idx), setup.labels.index_select(0, idx)};
      });
}

template <class Algo>
int run(const std::string& name, const typename Algo::options& algo, const example_options& opt,
        const std::string& root) {
  const std::string out = root + "/" + name;
  std::filesystem::create_directories(out);

  // Data in [-1, 1], and a classifier trained on a fixed split (the reward and the Fréchet features).
  auto setup = examples::prepare_digits(std::string(UNIRL_DATA_DIR) + "/digits.csv.gz");

  unirl::models::mlp_velocity_net net = make_net(opt);
  const double pretrain_seconds = pretrain(net, opt, root, setup);

  using trainer_t = unirl::trainer<flow_t, Algo, class_confidence>;
  trainer_t t(flow_t(net, {1, 8, 8}), class_confidence{setup.clf},
              examples::trainer_options<trainer_t>(algo, opt, out));
  std::cout << t.describe() << "\n";
  flow_t reference = t.models().policy.clone();

  const auto before = evaluate(t.models().policy, reference, t.reward(), setup.real_features);
  std::cout << "before: reward " << before.reward << "  frechet " << before.frechet << "\n";
  const double seconds = examples::train_on_random_classes(t, opt);
  const auto after = evaluate(t.models().policy, reference, t.reward(), setup.real_features);
  std::cout << "\nafter:  reward " << after.reward << "  frechet " << after.frechet << "  kl " << after.kl << "  ("
            << opt.steps << " steps, " << seconds << " s)\n";

  auto summary = examples::summarize(name, algo, before, after, opt);
  summary.seconds = seconds;
  summary.pretrain_seconds = pretrain_seconds;
  summary.classifier_accuracy = setup.accuracy;
  summary.extra = {{"frechet_before", before.frechet},
                   {"frechet_after", after.frechet},
                   {"reward_gain_per_step", (after.reward - before.reward) / static_cast<double>(opt.steps)},
                   {"reward_gain_per_second", (after.reward - before.reward) / seconds},
                   {"samples_per_step", opt.conditions * opt.group_size}};
  examples::write_outputs(out, "samples", before.samples.reshape({100, 8, 8}), after.samples.reshape({100, 8, 8}), 10,
                          10, 4, summary);
  return 0;
}

}  // namespace

BOOST_HANA_ADAPT_STRUCT(example_options, steps, conditions, group_size, minibatches, sampler_steps, lr, kl_beta, multiplier,
                        dppo_trust_region, pretrain_iters, hidden, seed);

#include "20_digits_flow/split.hpp"  // mode=split: one learner, N samplers (uses the helpers above)

int main(int argc, char** argv) try {
  example_options opt;
  const auto split = examples::take_split_mode(argc, argv);  // mode=, max_staleness=: not example_options
  UNIRL_CHECK(!split.partial, "partial = 1: partial rollouts are for token samplers (the quickstart); the flow ",
              "sampler draws whole trajectories of a fixed number of steps");
  // The algorithm is a type: each branch instantiates the whole pipeline for it.
  return examples::run_chosen_algorithm(
      opt, argc, argv, "runs/20_digits_flow", {.beta = 1.0},
      [&]<class Algo>(std::type_identity<Algo>, const std::string& name, const typename Algo::options& algo,
                      const std::string& root) {
        return split.split ? digits_flow_split::run<Algo>(split, name, algo, opt, root) : run<Algo>(name, algo, opt, root);
      });
} catch (const std::exception& e) {
  std::cerr << e.what() << "\n";
  return 2;
}

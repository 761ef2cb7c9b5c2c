// Video RL on the flow track: clips of a real 8x8 digit moving across a 16x16 canvas.
//
// 1. Clips (F = 5 frames, 2 pixels a frame) are made from the real digits: each moves right,
//    left, down or up, the direction at random.
// 2. A small video flow model, conditioned on the digit's class, is pretrained by flow matching
//    on these clips (cached), with the convolutional temporal_velocity_net (space and time
//    convolutions; a residual MLP over the whole clip did not learn these clips at all).
// 3. It is RL-fine-tuned — the same samplers and algorithms as for images, on (B, F, C, H, W) —
//    for the reward "the digit moves to the right": the horizontal displacement of the clip's
//    centre of mass from the first to the last frame, in canvas widths (about +0.5 for a full
//    rightward sweep, -0.5 leftward, 0 vertical).
// 4. Before / after: the reward and the share of rightward clips on fixed noise, the path KL to
//    the pretrained model, a frame-to-frame consistency figure (mean change of total intensity),
//    strips of frames as PNGs and summary.json.
//
//   video_flow [--algorithm grpo|dppo|ram|nft] [--out DIR] [key=value ...]    e.g. steps=40
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
#include <unirl/models/flow.hpp>
#include <unirl/models/flow_nets.hpp>
#include <unirl/rollout/flow_samplers.hpp>
#include <unirl/trainer.hpp>

#include "common/digits.hpp"
#include "common/flow_example.hpp"

namespace {

using video_net = unirl::models::temporal_velocity_net;
using video_t = unirl::models::video_flow_model<video_net>;
constexpr std::int64_t kFrames = 5, kCanvas = 16, kSpeed = 2;

struct example_options {
  std::int64_t steps = 40;             // RL trainer steps
  std::int64_t conditions = 4;         // digit classes per step
  std::int64_t group_size = 8;
  std::int64_t sampler_steps = 8;
  double lr = 2e-4;
  double multiplier = 1.0;             // RAM: reward multiplier m
  std::int64_t pretrain_iters = 1000;
  std::int64_t hidden = 16;
  std::int64_t seed = 1;
};

/// (N, F, 1, 16, 16) clips in [-1, 1] of the given digits moving in direction `dir`
/// (0 right, 1 left, 2 down, 3 up), starting at a random offset across the motion.
torch::Tensor make_clips(const torch::Tensor& digits /* (N, 1, 8, 8) in [0, 1] */, const torch::Tensor& dir) {
  const auto n = digits.size(0);
  auto clips = torch::zeros({n, kFrames, 1, kCanvas, kCanvas});
  const auto across = torch::randint(0, kCanvas - 8 + 1, {n}, torch::kInt64);
  for (std::int64_t i = 0; i < n; ++i) {
    const auto d = dir[i].item<std::int64_t>();
    const auto o = across[i].item<std::int64_t>();
    for (std::int64_t f = 0; f < kFrames; ++f) {
      const std::int64_t along = (d == 0 || d == 2) ? f * kSpeed : (kFrames - 1 - f) * kSpeed;
      const std::int64_t x = d < 2 ? along : o, y = d < 2 ? o : along;
      clips[i][f][0].slice(0, y, y + 8).slice(1, x, x + 8).copy_(digits[i][0]);
    }
  }
  return clips * 2 - 1;
}

/// Horizontal centre of mass (B, F) of each frame, in canvas widths.
torch::Tensor centre_x(const torch::Tensor& clips) {
  const auto w = (clips.clamp(-1, 1) + 1).squeeze(2);  // (B, F, H, W), >= 0
  const auto xs = torch::arange(kCanvas, torch::kFloat32) / static_cast<double>(kCanvas);
  return (w.sum(2) * xs).sum(2) / (w.sum({2, 3}) + 1e-6);
}

/// The reward: how far the digit travels to the right between the first and the last frame.
struct rightward_motion {
  torch::Tensor operator()(const unirl::rollout::flow_rollout& b) {
    const auto cx = centre_x(b.samples());
    return cx.select(1, kFrames - 1) - cx.select(1, 0);
  }
};

struct evaluation {
  double reward = 0, rightward = 0, kl = 0, consistency = 0;
  torch::Tensor strip;  // (4 * F, 16, 16)
};

evaluation evaluate(video_t& policy, video_t& reference) {
  torch::NoGradGuard ng;
  namespace rl = unirl::rollout;
  evaluation e;
  torch::manual_seed(4321);
  const auto labels = torch::arange(10, torch::kInt64).repeat_interleave(10);
  const auto noise = torch::randn({100, kFrames, 1, kCanvas, kCanvas});
  const auto b = rl::sample_trajectory(rl::ode::euler({.steps = 16}), policy, labels, noise);
  const auto r = rightward_motion{}(b);
  e.reward = r.mean().item<double>();
  e.rightward = (r > 0.2).to(torch::kFloat64).mean().item<double>();
  const auto mass = (b.samples().clamp(-1, 1) + 1).sum({2, 3, 4});  // (B, F)
  e.consistency = ((mass.slice(1, 1) - mass.slice(1, 0, -1)).abs() / (mass.slice(1, 0, -1) + 1e-6)).mean().item<double>();
  e.strip = b.samples().index_select(0, torch::tensor({0, 33, 66, 99}, torch::kInt64)).reshape({4 * kFrames, kCanvas, kCanvas});
  const rl::sde::flow_grpo sde({.steps = 8, .reduction = rl::logprob_reduction::sum});
  const auto path = rl::sample_trajectory(sde, policy, labels);
  torch::Tensor kl = torch::zeros({100});
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
  const auto data = examples::load_digits(std::string(UNIRL_DATA_DIR) + "/digits.csv.gz");

  torch::manual_seed(static_cast<std::uint64_t>(opt.seed));
  const std::vector<std::int64_t> shape{kFrames, 1, kCanvas, kCanvas};
  video_net net(unirl::models::flow_net_options{
      .channels = 1, .num_classes = 10, .hidden = opt.hidden, .depth = 2, .embed_dim = 32});
  const std::string cache = root + "/pretrained_video_h" + std::to_string(opt.hidden) + ".pt";
  double pretrain_seconds = 0;
  if (std::filesystem::exists(cache)) {
    torch::load(net, cache);
    std::cout << "loaded the pretrained video model from " << cache << "\n";
  } else {
    video_t m(net, shape);
    torch::optim::AdamW o(net->parameters(), torch::optim::AdamWOptions(2e-3).weight_decay(0.0));
    const auto t0 = std::chrono::steady_clock::now();
    for (std::int64_t i = 0; i < opt.pretrain_iters; ++i) {
      for (auto& g : o.param_groups())
        static_cast<torch::optim::AdamWOptions&>(g.options())
            .lr(2e-3 * 0.5 * (1 + std::cos(M_PI * static_cast<double>(i) / static_cast<double>(opt.pretrain_iters))));
      const auto idx = torch::randint(0, data.images.size(0), {64}, torch::kInt64);
      const auto clips = make_clips(data.images.index_select(0, idx), torch::randint(0, 4, {64}, torch::kInt64));
      const auto loss = m.flow_matching_loss(clips, data.labels.index_select(0, idx), 0.1);
      o.zero_grad();
      loss.backward();
      o.step();
      if (i % 250 == 0) std::cout << "pretrain " << i << " loss " << loss.item<double>() << std::endl;
    }
    pretrain_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    torch::save(net, cache);
    std::cout << "pretrained in " << pretrain_seconds << " s, saved " << cache << "\n";
  }

  using trainer_t = unirl::trainer<video_t, Algo, rightward_motion>;
  typename trainer_t::options topts{.algorithm = algo,
                                    .optim = {.lr = opt.lr},
                                    .clip = {.max_grad_norm = 1.0},
                                    .group_size = opt.group_size,
                                    .seed = opt.seed,
                                    .metrics_path = out + "/metrics.jsonl",
                                    .progress = true,
                                    .total_steps = opt.steps};
  std::filesystem::remove(topts.metrics_path);
  trainer_t t(video_t(net, shape), rightward_motion{}, topts);
  video_t reference = t.models().policy.clone();
  const auto before = evaluate(t.models().policy, reference);
  std::cout << "before: reward " << before.reward << "  rightward " << before.rightward << "\n";

  const auto start = std::chrono::steady_clock::now();
  for (std::int64_t s = 0; s < opt.steps; ++s)
    t.step(torch::randperm(10, torch::kInt64).slice(0, 0, std::min<std::int64_t>(opt.conditions, 10)));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const auto after = evaluate(t.models().policy, reference);
  std::cout << "\nafter:  reward " << after.reward << "  rightward " << after.rightward << "  kl " << after.kl
            << "  (" << opt.steps << " steps, " << seconds << " s)\n";

  examples::write_grid_png(out + "/strip_before.png", before.strip, 4, kFrames, 6);
  examples::write_grid_png(out + "/strip_after.png", after.strip, 4, kFrames, 6);
  unirl::train::plot_metrics(topts.metrics_path, out + "/reward_curve.png", {"reward_mean", "kl"});
  nlohmann::json summary{{"algorithm", name},
                         {"reward", "horizontal displacement of the centre of mass, first to last frame (canvas widths)"},
                         {"reward_before", before.reward},
                         {"reward_after", after.reward},
                         {"rightward_share_before", before.rightward},
                         {"rightward_share_after", after.rightward},
                         {"kl_to_reference", after.kl},
                         {"intensity_change_before", before.consistency},
                         {"intensity_change_after", after.consistency},
                         {"steps", opt.steps},
                         {"seconds", seconds},
                         {"pretrain_seconds", pretrain_seconds},
                         {"clip_shape", shape},
                         {"algorithm_options", unirl::options::to_json(algo)}};
  std::ofstream(out + "/summary.json") << summary.dump(2) << "\n";
  std::cout << "wrote " << out << "/{summary.json, metrics.jsonl, reward_curve.png, strip_before.png, strip_after.png}\n";
  return 0;
}

}  // namespace

BOOST_HANA_ADAPT_STRUCT(example_options, steps, conditions, group_size, sampler_steps, lr, multiplier, pretrain_iters,
                        hidden, seed);

int main(int argc, char** argv) try {
  example_options opt;
  std::string algorithm = "grpo", root = "runs/21_video_flow";
  auto rest = unirl::options::parse_command_line(opt, argc, argv);
  for (std::size_t i = 0; i < rest.size(); ++i) {
    if (rest[i] == "--out" && i + 1 < rest.size()) root = rest[++i];
    else if (rest[i].starts_with("--out=")) root = rest[i].substr(6);
    else if (rest[i] == "--algorithm" && i + 1 < rest.size()) algorithm = rest[++i];
    else if (rest[i].starts_with("--algorithm=")) algorithm = rest[i].substr(12);
    else throw unirl::config_error(rest[i], "unknown flag; expected --algorithm NAME, --out DIR or key=value");
  }
  std::cout << unirl::options::to_string(opt) << "\n";
  const unirl::rollout::flow_sampler_options sde{.steps = opt.sampler_steps};
  if (algorithm == "grpo")
    return run<unirl::algo::flow_grpo<>>("flow_grpo", {.clip_range = 1e-3, .beta = 0.01, .sampler = sde}, opt, root);
  if (algorithm == "dppo")
    return run<unirl::algo::flow_dppo<>>("flow_dppo", {.delta = 1e-5, .sampler = sde}, opt, root);
  if (algorithm == "ram")
    return run<unirl::algo::ram<>>("ram", {.multiplier = opt.multiplier, .draws = 4, .sampler = sde}, opt, root);
  if (algorithm == "nft")
    return run<unirl::algo::diffusion_nft<>>("diffusion_nft", {.beta = 1.0, .adv_clip_max = 1.0, .sampler = sde}, opt,
                                             root);
  throw unirl::config_error("--algorithm", "value '" + algorithm + "': expected grpo, dppo, ram or nft");
} catch (const std::exception& e) {
  std::cerr << e.what() << "\n";
  return 2;
}

// Video RL on the flow track: clips of a real 8x8 digit moving across a 16x16 canvas.
//
// 1. Clips (F = 4 frames, 2 pixels a frame, a 6-pixel sweep through the centre) are made from
//    the real digits: each moves right, left, down or up, the direction at random — so a
//    quarter of the data moves right.
// 2. A digit classifier is trained on the digits (the per-frame check below).
// 3. A small video flow model conditioned on the digit's class (not on the direction) is
//    pretrained by flow matching on these clips (cached): `clip_unet_velocity_net`, a two-level
//    U-Net with the frames stacked as channels, so every convolution mixes all frames.
// 4. It is RL-fine-tuned — the same samplers and algorithms as for images, on (B, F, C, H, W) —
//    for the reward "the digit moves to the right": the horizontal displacement of the clip's
//    centre of mass from the first to the last frame, in units of the full sweep (+1 for a
//    rightward sweep, -1 leftward, 0 vertical; about 0 on average for the base model, whose
//    clips go every way).
// 5. Before / after, on fixed noise: the reward, the share of rightward clips, the path KL to
//    the pretrained model, and two "still digits" checks on the frames (8x8 crops around each
//    frame's centre of mass): the classifier's accuracy for the requested class and the Fréchet
//    distance of its features to the real digits; strips of frames as PNGs and summary.json.
//
//   video_flow [--algorithm grpo|dppo|ram|nft] [--out DIR] [key=value ...]    e.g. steps=60
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <iostream>
#include <string>
#include <type_traits>
#include <vector>

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

using video_net = unirl::models::clip_unet_velocity_net;
using video_t = unirl::models::video_flow_model<video_net>;
constexpr std::int64_t kFrames = 4, kCanvas = 16, kSpeed = 2, kStart = 1;
constexpr double kSweep = static_cast<double>((kFrames - 1) * kSpeed);  // pixels from the first to the last frame

struct example_options {
  std::int64_t steps = 60;             // RL trainer steps
  std::int64_t conditions = 4;         // digit classes per step
  std::int64_t group_size = 8;
  std::int64_t minibatches = 2;        // optimizer steps per rollout batch
  std::int64_t sampler_steps = 8;
  double lr = 2e-4;
  double kl_beta = 0.01;               // Flow-GRPO / Flow-DPPO: KL-to-reference coefficient
  double multiplier = 1.0;             // RAM: reward multiplier m
  std::int64_t pretrain_iters = 2500;  // flow-matching iterations of 64 clips (cached)
  std::int64_t hidden = 32;
  std::int64_t seed = 1;
};

/// (N, F, 1, 16, 16) clips in [-1, 1] of the digits (N, 1, 8, 8) in [-1, 1] moving in direction
/// `dir` (0 right, 1 left, 2 down, 3 up) through the centre of the canvas.
torch::Tensor make_clips(const torch::Tensor& digits, const torch::Tensor& dir) {
  const auto n = digits.size(0);
  auto clips = torch::full({n, kFrames, 1, kCanvas, kCanvas}, -1.0);
  const std::int64_t across = (kCanvas - 8) / 2;
  const auto d = dir.contiguous();
  const auto* dp = d.data_ptr<std::int64_t>();
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t f = 0; f < kFrames; ++f) {
      const std::int64_t step = (dp[i] == 0 || dp[i] == 2) ? f : kFrames - 1 - f;
      const std::int64_t along = kStart + step * kSpeed;
      const std::int64_t x = dp[i] < 2 ? along : across, y = dp[i] < 2 ? across : along;
      clips[i][f][0].slice(0, y, y + 8).slice(1, x, x + 8).copy_(digits[i][0]);
    }
  return clips;
}

/// Centre of mass (B, F) of each frame along the width (`axis` 4) or the height (3), in pixels.
torch::Tensor centre(const torch::Tensor& clips, std::int64_t axis) {
  const auto w = (clips.clamp(-1, 1) + 1).squeeze(2);  // (B, F, H, W), >= 0
  const auto profile = w.sum(axis == 4 ? 2 : 3);        // (B, F, L)
  const auto pos = torch::arange(kCanvas, torch::kFloat32);
  return (profile * pos).sum(2) / (profile.sum(2) + 1e-6);
}

/// The reward: how far the digit travels to the right between the first and the last frame,
/// in units of the full sweep.
struct rightward_motion {
  torch::Tensor operator()(const unirl::flow_rollout& b) {
    const auto cx = centre(b.samples(), 4);
    return (cx.select(1, kFrames - 1) - cx.select(1, 0)) / kSweep;
  }
};

/// (B * F, 1, 8, 8) crops of every frame around its centre of mass: what the classifier sees.
torch::Tensor frame_crops(const torch::Tensor& clips) {
  const auto cx = centre(clips, 4), cy = centre(clips, 3);
  const auto b = clips.size(0);
  auto crops = torch::empty({b * kFrames, 1, 8, 8});
  const auto c = clips.clamp(-1, 1);
  for (std::int64_t i = 0; i < b; ++i)
    for (std::int64_t f = 0; f < kFrames; ++f) {
      const auto x = std::clamp<std::int64_t>(std::lround(cx[i][f].item<double>() - 3.5), 0, kCanvas - 8);
      const auto y = std::clamp<std::int64_t>(std::lround(cy[i][f].item<double>() - 3.5), 0, kCanvas - 8);
      crops[i * kFrames + f][0].copy_(c[i][f][0].slice(0, y, y + 8).slice(1, x, x + 8));
    }
  return crops;
}

struct evaluation {
  double reward = 0, rightward = 0, kl = 0, frame_accuracy = 0, frechet = 0, consistency = 0;
  torch::Tensor strip;  // (10 * F, 16, 16): one clip per class
};

/// On 100 ODE clips from fixed noise (10 per class): reward, share of clips that sweep at least
/// half way to the right, per-frame classifier accuracy and Fréchet distance, the mean relative
/// change of total intensity between frames, and the path KL of the Flow-GRPO SDE (sum over
/// elements and steps) from `policy` to `reference`.
evaluation evaluate(video_t& policy, video_t& reference, examples::digit_classifier& clf,
                    const torch::Tensor& real_features) {
  torch::NoGradGuard ng;
  evaluation e;
  const examples::scoped_seed fixed_noise(4321);  // the run's own random stream is left as it was
  const auto labels = torch::arange(10, torch::kInt64).repeat_interleave(10);
  const auto noise = torch::randn({100, kFrames, 1, kCanvas, kCanvas});
  const auto b = unirl::sample_trajectory(unirl::ode::euler({.steps = 16}), policy, labels, noise);
  const auto r = rightward_motion{}(b);
  e.reward = r.mean().item<double>();
  e.rightward = (r > 0.5).to(torch::kFloat64).mean().item<double>();
  const auto crops = frame_crops(b.samples());
  const auto pred = clf->forward(crops).argmax(1);
  e.frame_accuracy = (pred == labels.repeat_interleave(kFrames)).to(torch::kFloat64).mean().item<double>();
  e.frechet = unirl::eval::frechet_distance(clf->features(crops), real_features);
  const auto mass = (b.samples().clamp(-1, 1) + 1).sum({2, 3, 4});  // (B, F)
  e.consistency = ((mass.slice(1, 1) - mass.slice(1, 0, -1)).abs() / (mass.slice(1, 0, -1) + 1e-6)).mean().item<double>();
  e.strip = b.samples().index_select(0, torch::arange(0, 100, 10, torch::kInt64)).reshape({10 * kFrames, kCanvas, kCanvas});
  e.kl = examples::path_kl(policy, reference, labels, 8);
  return e;
}

template <class Algo>
int run(const std::string& name, const typename Algo::options& algo, const example_options& opt,
        const std::string& root) {
  const auto t_start = std::chrono::steady_clock::now();
  const std::string out = root + "/" + name;
  std::filesystem::create_directories(out);
  // The per-frame check: a digit classifier on a fixed split.
  auto setup = examples::prepare_digits(std::string(UNIRL_DATA_DIR) + "/digits.csv.gz");
  double real_frame_accuracy = 0;  // the per-frame check on real clips: its ceiling
  {
    torch::NoGradGuard ng;
    const auto held_out = setup.perm.slice(0, setup.n_train, setup.n_train + 100);
    const auto crops =
        frame_crops(make_clips(setup.images.index_select(0, held_out), torch::arange(100, torch::kInt64) % 4));
    real_frame_accuracy =
        (setup.clf->forward(crops).argmax(1) == setup.labels.index_select(0, held_out).repeat_interleave(kFrames))
                              .to(torch::kFloat64)
                              .mean()
                              .item<double>();
    std::cout << "per-frame accuracy on real held-out clips: " << real_frame_accuracy << "\n";
  }

  // Pretraining: class-conditional flow matching on clips, 10% unconditional, through the
  // library's stage; its run directory in the output root is the cache (a finished run loads).
  torch::manual_seed(static_cast<std::uint64_t>(opt.seed));
  const std::vector<std::int64_t> shape{kFrames, 1, kCanvas, kCanvas};
  video_net net(unirl::models::flow_net_options{
      .shape = shape, .channels = 1, .num_classes = 10, .hidden = opt.hidden, .depth = 2, .embed_dim = 64});
  const double pretrain_seconds = examples::pretrain_flow(
      video_t(net, shape),
      {.objective = {.p_uncond = 0.1},
       .optim = {.lr = 2e-3},
       .schedule = {.kind = unirl::train::schedule_kind::cosine, .warmup_steps = 50},
       .batch_size = 64,
       .steps = opt.pretrain_iters,
       .out = root + "/pretrained_clip_unet_h" + std::to_string(opt.hidden) + "_i" +
              std::to_string(opt.pretrain_iters) + "_s" + std::to_string(opt.seed)},
      [&](std::int64_t n) {
        const auto idx = torch::randint(0, setup.images.size(0), {n}, torch::kInt64);
        const auto clips = make_clips(setup.images.index_select(0, idx), torch::randint(0, 4, {n}, torch::kInt64));
        return unirl::train::flow_matching_batch{clips, setup.labels.index_select(0, idx)};
      });

  using trainer_t = unirl::trainer<video_t, Algo, rightward_motion>;
  trainer_t t(video_t(net, shape), rightward_motion{}, examples::trainer_options<trainer_t>(algo, opt, out));
  video_t reference = t.models().policy.clone();
  const auto before = evaluate(t.models().policy, reference, setup.clf, setup.real_features);
  std::cout << "before: reward " << before.reward << "  rightward " << before.rightward << "  frame accuracy "
            << before.frame_accuracy << "  frechet " << before.frechet << "\n";

  const double seconds = examples::train_on_random_classes(t, opt);
  const auto after = evaluate(t.models().policy, reference, setup.clf, setup.real_features);
  const double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
  std::cout << "\nafter:  reward " << after.reward << "  rightward " << after.rightward << "  frame accuracy "
            << after.frame_accuracy << "  frechet " << after.frechet << "  kl " << after.kl << "  (" << opt.steps
            << " steps, " << seconds << " s; " << total << " s in all)\n";

  auto summary = examples::summarize(name, algo, before, after, opt);
  summary.seconds = seconds;
  summary.pretrain_seconds = pretrain_seconds;
  summary.classifier_accuracy = setup.accuracy;
  summary.extra = {
      {"reward", "horizontal displacement of the centre of mass, first to last frame, in full sweeps (6 pixels)"},
      {"rightward_share_before", before.rightward},
      {"rightward_share_after", after.rightward},
      {"frame_accuracy_before", before.frame_accuracy},
      {"frame_accuracy_after", after.frame_accuracy},
      {"frame_frechet_before", before.frechet},
      {"frame_frechet_after", after.frechet},
      {"intensity_change_before", before.consistency},
      {"intensity_change_after", after.consistency},
      {"frame_accuracy_real_clips", real_frame_accuracy},
      {"total_seconds", total},
      {"clip_shape", shape}};
  examples::write_outputs(out, "strip", before.strip, after.strip, 10, kFrames, 3, summary);
  return 0;
}

}  // namespace

BOOST_HANA_ADAPT_STRUCT(example_options, steps, conditions, group_size, minibatches, sampler_steps, lr, kl_beta,
                        multiplier, pretrain_iters, hidden, seed);

int main(int argc, char** argv) try {
  example_options opt;
  return examples::run_chosen_algorithm(
      opt, argc, argv, "runs/21_video_flow", {.beta = 1.0, .adv_clip_max = 1.0},
      [&]<class Algo>(std::type_identity<Algo>, const std::string& name, const typename Algo::options& algo,
                      const std::string& root) { return run<Algo>(name, algo, opt, root); });
} catch (const std::exception& e) {
  std::cerr << e.what() << "\n";
  return 2;
}

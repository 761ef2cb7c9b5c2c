#pragma once
// Shared by the flow-track examples (20_digits_flow, 21_video_flow): a small digit classifier
// (the reward model and the feature extractor of the Fréchet distance), PNG grids of samples,
// and the scaffolding around the algorithm: the command line and the choice of algorithm type,
// flow-matching pretraining through the library's stage, the trainer's options and loop, the
// path KL to the pretrained model and the summary.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#include <unirl/train/plot.hpp>  // before stb_image_write.h: brings its (static) implementation

#include <nlohmann/json.hpp>
#include <stb_image_write.h>
#include <torch/torch.h>

#include <unirl/algorithms/diffusion_nft.hpp>
#include <unirl/algorithms/flow_dppo.hpp>
#include <unirl/algorithms/flow_grpo.hpp>
#include <unirl/algorithms/ram.hpp>
#include <unirl/core/error.hpp>
#include <unirl/core/command_line.hpp>
#include <unirl/core/options.hpp>
#include <unirl/rollout/flow_samplers.hpp>
#include <unirl/train/flow_matching.hpp>
#include <unirl/train/report.hpp>

#include "common/digits.hpp"

namespace examples {

/// Seeds LibTorch's default CPU generator for the scope (fixed evaluation noise) and restores its
/// state afterwards, so an evaluation between training steps leaves the run's random stream as
/// it was: the run's `seed` alone decides its draws.
class scoped_seed {
 public:
  explicit scoped_seed(std::uint64_t seed) : gen_(at::detail::getDefaultCPUGenerator()) {
    std::lock_guard<std::mutex> lock(gen_.mutex());
    state_ = gen_.get_state();
    gen_.set_current_seed(seed);
  }
  ~scoped_seed() {
    std::lock_guard<std::mutex> lock(gen_.mutex());
    gen_.set_state(state_);
  }
  scoped_seed(const scoped_seed&) = delete;
  scoped_seed& operator=(const scoped_seed&) = delete;

 private:
  at::Generator gen_;
  torch::Tensor state_;
};

/// An MLP on 8x8 digits in [-1, 1]: 64 -> 128 -> 64 (features) -> 10.
class digit_classifierImpl : public torch::nn::Module {
 public:
  digit_classifierImpl()
      : l1_(register_module("l1", torch::nn::Linear(64, 128))),
        l2_(register_module("l2", torch::nn::Linear(128, 64))),
        l3_(register_module("l3", torch::nn::Linear(64, 10))) {}
  /// Penultimate features (N, 64): what the Fréchet distance compares.
  torch::Tensor features(const torch::Tensor& x) {
    return torch::silu(l2_(torch::silu(l1_(x.reshape({x.size(0), 64})))));
  }
  torch::Tensor forward(const torch::Tensor& x) { return l3_(features(x)); }

 private:
  torch::nn::Linear l1_, l2_, l3_;
};
TORCH_MODULE(digit_classifier);

/// Trains the classifier on (N, 1, 8, 8) images in [-1, 1]; returns the held-out accuracy.
inline double train_classifier(digit_classifier& clf, const torch::Tensor& x, const torch::Tensor& y,
                               const torch::Tensor& test_x, const torch::Tensor& test_y, int iterations = 600) {
  torch::optim::Adam opt(clf->parameters(), torch::optim::AdamOptions(2e-3).weight_decay(1e-4));
  const auto n = x.size(0);
  for (int i = 0; i < iterations; ++i) {
    const auto idx = torch::randint(0, n, {128}, torch::kInt64);
    // Light noise makes the classifier less brittle on generated samples.
    const auto xb = x.index_select(0, idx) + 0.1 * torch::randn({128, 1, 8, 8});
    const auto loss = torch::cross_entropy_loss(clf->forward(xb), y.index_select(0, idx));
    opt.zero_grad();
    loss.backward();
    opt.step();
  }
  torch::NoGradGuard ng;
  clf->eval();
  return (clf->forward(test_x).argmax(1) == test_y).to(torch::kFloat64).mean().item<double>();
}

/// The digits in [-1, 1], a classifier trained on a fixed split (the first `n_train` of a seed-0
/// permutation; the rest is held out), and the classifier's features of every real image — the
/// reference statistics of the Fréchet distance.
struct digit_setup {
  torch::Tensor images;         // (N, 1, 8, 8) in [-1, 1]
  torch::Tensor labels;         // (N,) int64
  torch::Tensor perm;           // (N,) the split's permutation
  std::int64_t n_train = 1500;  // perm[0, n_train) trains the classifier
  digit_classifier clf;
  double accuracy = 0.0;        // the classifier's held-out accuracy
  torch::Tensor real_features;  // (N, F)
};

inline digit_setup prepare_digits(const std::string& csv_gz_path) {
  digit_setup s;
  const auto data = load_digits(csv_gz_path);
  s.images = data.images * 2 - 1;
  s.labels = data.labels;
  torch::manual_seed(0);
  s.perm = torch::randperm(s.images.size(0), torch::kInt64);
  s.clf = digit_classifier();  // initialised after the seed: the same classifier on every run
  const auto x = s.images.index_select(0, s.perm), y = s.labels.index_select(0, s.perm);
  s.accuracy = train_classifier(s.clf, x.slice(0, 0, s.n_train), y.slice(0, 0, s.n_train), x.slice(0, s.n_train),
                                y.slice(0, s.n_train));
  std::cout << "classifier held-out accuracy: " << s.accuracy << "\n";
  torch::NoGradGuard ng;
  s.real_features = s.clf->features(s.images);
  return s;
}

/// Writes (rows * cols) gray images (N, H, W) in [-1, 1] as one PNG, each pixel `scale` pixels wide,
/// with a 1-pixel gap between tiles.
inline void write_grid_png(const std::string& path, const torch::Tensor& images, std::int64_t rows, std::int64_t cols,
                           int scale = 4) {
  const auto img = ((images.detach().to(torch::kCPU, torch::kFloat32).clamp(-1, 1) + 1) * 127.5)
                       .round()
                       .to(torch::kUInt8)
                       .contiguous();
  UNIRL_CHECK(img.dim() == 3 && img.size(0) >= rows * cols, "write_grid_png: got ", img.sizes(), " for a ", rows,
              " x ", cols, " grid");
  const auto h = img.size(1), w = img.size(2);
  const auto tile_h = h * scale + 1, tile_w = w * scale + 1;
  const auto H = rows * tile_h + 1, W = cols * tile_w + 1;
  std::vector<std::uint8_t> px(static_cast<std::size_t>(H * W), 64);
  const auto* p = img.data_ptr<std::uint8_t>();
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c)
      for (std::int64_t y = 0; y < h * scale; ++y)
        for (std::int64_t x = 0; x < w * scale; ++x)
          px[static_cast<std::size_t>((1 + r * tile_h + y) * W + 1 + c * tile_w + x)] =
              p[((r * cols + c) * h + y / scale) * w + x / scale];
  const std::filesystem::path fp(path);
  if (fp.has_parent_path()) std::filesystem::create_directories(fp.parent_path());
  UNIRL_CHECK(stbi_write_png(path.c_str(), static_cast<int>(W), static_cast<int>(H), 1, px.data(),
                             static_cast<int>(W)) != 0,
              "write_grid_png: cannot write '", path, "'");
}

/// Flow-matching pretraining through the library's stage (`unirl::train::flow_matching_trainer`,
/// with `o`, batches from `next(n)`); `o.out` is its run directory and the cache: a finished run
/// loads its last checkpoint (with the generators' states) instead of training, an interrupted
/// one resumes. Returns the seconds spent training (0 when loaded).
template <class Model, class NextBatch>
double pretrain_flow(Model model, const typename unirl::train::flow_matching_trainer<Model>::options& o,
                     NextBatch&& next) {
  unirl::train::flow_matching_trainer<Model> stage(std::move(model), o);
  const auto r = stage.run(std::forward<NextBatch>(next));
  if (r.steps == 0)
    std::cout << "loaded the pretrained model from " << o.out << " (step " << stage.step_count() << ")\n";
  else
    std::cout << "pretrained " << r.steps << " steps in " << r.seconds << " s (loss " << r.loss_first << " -> "
              << r.loss_last << "), checkpoint in " << o.out << "\n";
  return r.seconds;
}

/// The trainer options both examples use: AdamW at `opt.lr`, gradient clip 1, `opt.group_size`,
/// `opt.minibatches`, `opt.seed`, progress on, and metrics in `<out>/metrics.jsonl` (removed first).
template <class Trainer, class Opt>
typename Trainer::options trainer_options(const typename Trainer::algorithm_type::options& algo, const Opt& opt,
                                          const std::string& out) {
  typename Trainer::options t{.algorithm = algo,
                              .optim = {.lr = opt.lr},
                              .clip = {.max_grad_norm = 1.0},
                              .group_size = opt.group_size,
                              .minibatches = opt.minibatches,
                              .seed = opt.seed,
                              .metrics_path = out + "/metrics.jsonl",
                              .progress = true,
                              .total_steps = opt.steps};
  std::filesystem::remove(t.metrics_path);
  return t;
}

/// Runs `opt.steps` trainer steps, each on `opt.conditions` distinct classes of the 10 drawn at
/// random; returns the seconds they took.
template <class Trainer, class Opt>
double train_on_random_classes(Trainer& t, const Opt& opt) {
  const auto start = std::chrono::steady_clock::now();
  for (std::int64_t s = 0; s < opt.steps; ++s)
    t.step(torch::randperm(10, torch::kInt64).slice(0, 0, std::min<std::int64_t>(opt.conditions, 10)));
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

/// The path KL of the Flow-GRPO SDE (`steps` steps, sum over elements and steps) from `policy` to
/// `reference` on trajectories of `policy` for `labels`, averaged over the samples.
template <class Model>
double path_kl(Model& policy, Model& reference, const torch::Tensor& labels, std::int64_t steps) {
  torch::NoGradGuard ng;
  const unirl::sde::flow_grpo sde({.steps = steps, .reduction = unirl::logprob_reduction::sum});
  const auto path = unirl::sample_trajectory(sde, policy, labels);
  torch::Tensor kl = torch::zeros({labels.size(0)});
  for (std::int64_t k = 0; k < path.steps(); ++k) {
    const auto ref = unirl::replay_step(sde, reference, path, k);
    kl += unirl::gaussian_kl(path.means.select(1, k), ref.step.mean, ref.step.std, unirl::logprob_reduction::sum);
  }
  return kl.mean().item<double>();
}

/// What every run reports in `summary.json`; `extra` holds the example's own fields.
struct run_summary {
  std::string algorithm;
  double reward_before = 0, reward_after = 0, kl_to_reference = 0;
  std::int64_t steps = 0;
  double seconds = 0, pretrain_seconds = 0, classifier_accuracy = 0;
  nlohmann::json algorithm_options;
  nlohmann::json extra = nlohmann::json::object();
};

/// The fields of `run_summary` that come from the algorithm (`name`, its options `algo`), the
/// evaluations before and after training (their `reward`, and the `kl` after) and `opt.steps`.
template <class AlgoOptions, class Evaluation, class Opt>
run_summary summarize(const std::string& name, const AlgoOptions& algo, const Evaluation& before,
                      const Evaluation& after, const Opt& opt) {
  return {.algorithm = name,
          .reward_before = before.reward,
          .reward_after = after.reward,
          .kl_to_reference = after.kl,
          .steps = opt.steps,
          .algorithm_options = unirl::options::to_json(algo)};
}

/// Writes the outputs of a run in `out`: `<stem>_before.png` and `<stem>_after.png` (grids of
/// `rows` x `cols` tiles of (N, H, W) images, `scale` pixels a pixel), `reward_curve.png` from
/// `metrics.jsonl`, `summary.json` and the run report `report.html`; then says so.
inline void write_outputs(const std::string& out, const std::string& stem, const torch::Tensor& before,
                          const torch::Tensor& after, std::int64_t rows, std::int64_t cols, int scale,
                          const run_summary& s) {
  write_grid_png(out + "/" + stem + "_before.png", before, rows, cols, scale);
  write_grid_png(out + "/" + stem + "_after.png", after, rows, cols, scale);
  unirl::train::plot_metrics(out + "/metrics.jsonl", out + "/reward_curve.png", {"reward_mean", "kl"});
  nlohmann::json summary = s.extra;
  summary.update(nlohmann::json{{"algorithm", s.algorithm},
                                {"reward_before", s.reward_before},
                                {"reward_after", s.reward_after},
                                {"kl_to_reference", s.kl_to_reference},
                                {"steps", s.steps},
                                {"seconds", s.seconds},
                                {"pretrain_seconds", s.pretrain_seconds},
                                {"classifier_accuracy", s.classifier_accuracy},
                                {"algorithm_options", s.algorithm_options}});
  std::ofstream(out + "/summary.json") << summary.dump(2) << "\n";
  unirl::train::write_report(out);
  std::cout << "wrote " << out << "/{summary.json, metrics.jsonl, reward_curve.png, " << stem << "_before.png, " << stem
            << "_after.png, report.html}\n";
}

/// The command line of the flow examples, `[--algorithm grpo|dppo|ram|nft] [--out DIR]
/// [key=value ...]` (key=value sets a member of `opt`, which is then printed), and the choice of
/// algorithm: calls `run(std::type_identity<Algo>{}, name, algorithm options, out)` with the
/// algorithm type --algorithm picks — each branch instantiates the whole pipeline for its type.
/// The options come from `opt` (`kl_beta`, `multiplier`, `sampler_steps`); `nft` is DiffusionNFT's
/// (its sampler is set here).
template <class Opt, class Run>
int run_chosen_algorithm(Opt& opt, int argc, char** argv, const std::string& default_out,
                         unirl::algo::diffusion_nft_options nft, Run&& run) {
  auto flags = unirl::options::parse_command_line(opt, argc, argv, {{"out", default_out}, {"algorithm", "grpo"}});
  const std::string algorithm = flags["algorithm"], root = flags["out"];
  std::cout << unirl::options::to_string(opt) << "\n";
  const unirl::flow_sampler_options sde{.steps = opt.sampler_steps};
  namespace algo = unirl::algo;
  if (algorithm == "grpo")
    return run(std::type_identity<algo::flow_grpo<>>{}, "flow_grpo",
               algo::flow_grpo_options{.clip_range = 1e-3, .beta = opt.kl_beta, .sampler = sde}, root);
  if (algorithm == "dppo") {
    algo::flow_dppo_options dppo{.delta = 1e-5, .beta = opt.kl_beta, .sampler = sde};
    // An example whose options have `dppo_trust_region` can pick seed 000's clamped-KL variant
    // (dppo_trust_region=clamped_kl); its outputs go to <out>/flow_dppo_clamped_kl.
    if constexpr (requires { opt.dppo_trust_region; }) dppo.trust_region = opt.dppo_trust_region;
    const bool clamped = dppo.trust_region == algo::dppo_trust_region::clamped_kl;
    return run(std::type_identity<algo::flow_dppo<>>{}, clamped ? "flow_dppo_clamped_kl" : "flow_dppo", dppo, root);
  }
  if (algorithm == "ram")
    return run(std::type_identity<algo::ram<>>{}, "ram",
               algo::ram_options{.multiplier = opt.multiplier, .draws = 4, .ema_decay = 0.9, .sampler = sde}, root);
  if (algorithm == "nft") {
    nft.sampler = sde;
    return run(std::type_identity<algo::diffusion_nft<>>{}, "diffusion_nft", nft, root);
  }
  throw unirl::config_error("--algorithm", "value '" + algorithm + "': expected grpo, dppo, ram or nft");
}

}  // namespace examples

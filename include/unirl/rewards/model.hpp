#pragma once
/// \file model.hpp
/// Learned reward models: a `torch::nn` module or a TorchScript file scoring a tensor taken from
/// the batch (generated images by default), with the robust multi-scale / multi-crop option for
/// image rewards: the model scores several views of each image and the views' scores are
/// aggregated (mean, or min — a reward that holds only if every view agrees is harder to hack
/// with a pattern that works at one scale).
///
/// ```cpp
/// unirl::rewards::learned_reward rm{my_classifier, unirl::rewards::images_input{},
///     {.scales = {0.5, 0.75}, .crops = 5, .aggregate = unirl::rewards::view_aggregate::min,
///      .activation = unirl::rewards::output_activation::softmax, .output_index = 3}};
/// unirl::rewards::learned_reward scripted{unirl::rewards::torchscript_model("rm.pt"), unirl::rewards::images_input{}};
/// torch::Tensor r = rm(batch);   // (B,)
/// ```
#include <algorithm>
#include <array>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <boost/hana.hpp>
#include <torch/script.h>
#include <torch/torch.h>

#include <unirl/core/error.hpp>
#include <unirl/core/options.hpp>
#include <unirl/rewards/scorer.hpp>

namespace unirl::rewards {

/// How the scores of an image's views combine.
enum class view_aggregate { mean, min };
/// What is applied to the model's output before `output_index` picks a column.
enum class output_activation { identity, sigmoid, softmax };
}  // namespace unirl::rewards

template <>
inline constexpr std::array unirl::enum_names<unirl::rewards::view_aggregate>{std::string_view{"mean"},
                                                                              std::string_view{"min"}};
template <>
inline constexpr std::array unirl::enum_names<unirl::rewards::output_activation>{
    std::string_view{"identity"}, std::string_view{"sigmoid"}, std::string_view{"softmax"}};

namespace unirl::rewards {

/// Options of `learned_reward`.
struct learned_reward_options {
  std::vector<double> scales{};   // multi-scale views: resize by s, then back (e.g. {0.5, 0.75})
  std::int64_t crops = 0;         // multi-crop views: 1 = centre, 5 = centre + four corners
  double crop_fraction = 0.875;   // crop side / image side; crops are resized back
  bool include_original = true;   // the unaltered image is one of the views
  view_aggregate aggregate = view_aggregate::mean;
  output_activation activation = output_activation::identity;
  std::int64_t output_index = -1; // (B, K) output: the column to use; -1: the output is (B,) or (B, 1)
  double scale = 1.0;             // reward = scale * score
  std::int64_t chunk_size = 0;    // > 0: at most this many inputs per forward

  void validate(const std::string& prefix) const {
    for (std::size_t i = 0; i < scales.size(); ++i)
      options::require(scales[i] > 0, prefix + "scales[" + std::to_string(i) + "]", scales[i], "> 0");
    options::require(crops >= 0 && crops <= 5, prefix + "crops", crops, "in [0, 5]");
    options::require(crop_fraction > 0 && crop_fraction <= 1, prefix + "crop_fraction", crop_fraction, "in (0, 1]");
    options::require(output_index >= -1, prefix + "output_index", output_index, ">= -1");
    options::require(chunk_size >= 0, prefix + "chunk_size", chunk_size, ">= 0");
    options::require(include_original || !scales.empty() || crops > 0, prefix + "include_original", include_original,
                     "true when no scales or crops are given (there would be no view to score)");
  }
};
}  // namespace unirl::rewards
BOOST_HANA_ADAPT_STRUCT(unirl::rewards::learned_reward_options, scales, crops, crop_fraction, include_original,
                        aggregate, activation, output_index, scale, chunk_size);
namespace unirl::rewards {

/// The default input of a learned reward: the batch's images (B, C, H, W) — `images` or `samples()`.
struct images_input {
  template <HasImages B>
  torch::Tensor operator()(const B& b) const { return images_of(b); }
};

/// A TorchScript reward model loaded with `torch::jit::load`; `forward(x)` returns its tensor output.
class torchscript_model {
 public:
  explicit torchscript_model(const std::string& path, torch::Device device = torch::kCPU) : path_(path) {
    try {
      module_ = std::make_shared<torch::jit::script::Module>(torch::jit::load(path, device));
    } catch (const c10::Error& e) {
      throw runtime_failure("unirl: cannot load the TorchScript reward model '" + path + "': " + e.what_without_backtrace());
    }
    module_->eval();
  }
  torch::Tensor forward(const torch::Tensor& x) const {
    auto out = module_->forward({x});
    UNIRL_CHECK(out.isTensor(), "TorchScript reward model '", path_, "' returned a ", out.tagKind(),
                "; expected a tensor of scores");
    return out.toTensor();
  }
  torch::Device device() const {
    for (const auto& p : module_->parameters()) return p.device();
    for (const auto& b : module_->buffers()) return b.device();
    return torch::kCPU;
  }
  const std::string& path() const { return path_; }
  torch::jit::script::Module& module() { return *module_; }

 private:
  std::string path_;
  std::shared_ptr<torch::jit::script::Module> module_;
};

/// The views of a batch of images (N, C, H, W) the robust option scores, concatenated: (V*N, C, H, W).
inline torch::Tensor image_views(const torch::Tensor& x, const learned_reward_options& o, std::int64_t* n_views = nullptr) {
  std::vector<torch::Tensor> views;
  if (o.include_original) views.push_back(x);
  if (!o.scales.empty() || o.crops > 0)
    UNIRL_CHECK(x.dim() == 4, "learned_reward: multi-scale / multi-crop views need (N, C, H, W) images; got shape ", x.sizes());
  namespace F = torch::nn::functional;
  const auto H = o.scales.empty() && o.crops == 0 ? 0 : x.size(2), W = o.scales.empty() && o.crops == 0 ? 0 : x.size(3);
  auto resize = [](const torch::Tensor& t, std::int64_t h, std::int64_t w) {
    return F::interpolate(t, F::InterpolateFuncOptions()
                                 .size(std::vector<std::int64_t>{h, w})
                                 .mode(torch::kBilinear)
                                 .align_corners(false));
  };
  for (double s : o.scales) {
    const auto h = std::max<std::int64_t>(1, std::llround(s * static_cast<double>(H)));
    const auto w = std::max<std::int64_t>(1, std::llround(s * static_cast<double>(W)));
    views.push_back(resize(resize(x, h, w), H, W));
  }
  if (o.crops > 0) {
    const auto ch = std::max<std::int64_t>(1, std::llround(o.crop_fraction * static_cast<double>(H)));
    const auto cw = std::max<std::int64_t>(1, std::llround(o.crop_fraction * static_cast<double>(W)));
    const std::array<std::pair<std::int64_t, std::int64_t>, 5> corners{
        {{(H - ch) / 2, (W - cw) / 2}, {0, 0}, {0, W - cw}, {H - ch, 0}, {H - ch, W - cw}}};
    for (std::int64_t k = 0; k < o.crops; ++k) {
      const auto [top, left] = corners[static_cast<std::size_t>(k)];
      views.push_back(resize(x.narrow(2, top, ch).narrow(3, left, cw), H, W));
    }
  }
  if (n_views) *n_views = static_cast<std::int64_t>(views.size());
  return torch::cat(views, 0);
}

/// A learned reward model over a tensor drawn from the batch.
///
/// Minimal requirement: `Model` has `torch::Tensor forward(const torch::Tensor&)` reachable as
/// `model->forward(x)` (a `torch::nn` module holder) or `model.forward(x)` (`torchscript_model`,
/// any struct); `Input` is a callable `torch::Tensor(const Batch&)` (default: `batch.images`).
template <class Model, class Input = images_input>
class learned_reward {
 public:
  using options = learned_reward_options;
  static constexpr std::string_view name = "reward_model";

  explicit learned_reward(Model model, Input input = {}, options o = {})
      : model_(std::move(model)), input_(std::move(input)), opts_(std::move(o)) {
    unirl::options::validate(opts_);
  }

  template <class Batch>
    requires std::invocable<Input&, const Batch&>
  torch::Tensor operator()(const Batch& batch) {
    torch::NoGradGuard no_grad;
    torch::Tensor x = input_(batch);
    UNIRL_CHECK(x.defined() && x.dim() >= 1, "learned_reward: the input is undefined or 0-dim; expected (B, ...)");
    const auto n = x.size(0);
    x = x.to(model_device());
    std::int64_t v = 1;
    const auto views = image_views(x, opts_, &v);
    auto scores = score(views).view({v, n});
    auto r = opts_.aggregate == view_aggregate::min ? std::get<0>(scores.min(0)) : scores.mean(0);
    return r * opts_.scale;
  }

  Model& model() { return model_; }
  const options& opts() const { return opts_; }

 private:
  torch::Device model_device() const {
    if constexpr (requires { model_.device(); }) return model_.device();
    else if constexpr (requires { model_->parameters(); }) {
      for (const auto& p : model_->parameters()) return p.device();
      return torch::kCPU;
    } else return torch::kCPU;
  }

  torch::Tensor forward(const torch::Tensor& x) {
    if constexpr (requires { model_->forward(x); }) return model_->forward(x);
    else return model_.forward(x);
  }

  torch::Tensor score(const torch::Tensor& x) {
    const auto total = x.size(0);
    const auto chunk = opts_.chunk_size > 0 ? opts_.chunk_size : std::max<std::int64_t>(total, 1);
    std::vector<torch::Tensor> outs;
    for (std::int64_t s = 0; s < total; s += chunk) outs.push_back(head(forward(x.narrow(0, s, std::min(chunk, total - s)))));
    return outs.empty() ? torch::zeros({0}) : torch::cat(outs, 0);
  }

  torch::Tensor head(torch::Tensor out) const {
    out = out.to(torch::kFloat32);
    if (opts_.activation == output_activation::sigmoid) out = torch::sigmoid(out);
    else if (opts_.activation == output_activation::softmax) {
      UNIRL_CHECK(out.dim() == 2, "learned_reward: softmax needs (B, K) model outputs; got ", out.sizes());
      out = torch::softmax(out, 1);
    }
    if (opts_.output_index >= 0) {
      UNIRL_CHECK(out.dim() == 2 && opts_.output_index < out.size(1), "learned_reward: output_index = ", opts_.output_index,
                  " but the model output has shape ", out.sizes(), "; expected (B, K) with K > output_index");
      return out.select(1, opts_.output_index);
    }
    if (out.dim() == 2 && out.size(1) == 1) out = out.squeeze(1);
    UNIRL_CHECK(out.dim() == 1, "learned_reward: the model output has shape ", out.sizes(),
                "; expected (B,) or (B, 1) scores, or set output_index to pick a column of (B, K)");
    return out;
  }

  Model model_;
  Input input_;
  options opts_;
};

}  // namespace unirl::rewards

#pragma once
/// \file consistency.hpp
/// A learned consistency reward (seed 003 §4.2: a visual model checks that the generated answer
/// agrees with the image): a small digit classifier trained on the images, and a verifier that
/// scores an (image, answer) pair by the probability the classifier gives the class the answer
/// names. It runs through `learned_reward` (rewards/model.hpp): the input of sample i is its
/// answer's class followed by its image's pixels, and the verifier's forward scores those rows.
///
/// ```cpp
/// unirl::rewards::digit_classifier clf{unirl::rewards::classifier_config{}};   // 8x8 grey digits
/// unirl::rewards::train_digit_classifier(clf, images, labels, {.steps = 300});
/// auto consistent = unirl::rewards::make_consistency_reward(clf, unirl::rewards::slot_images{model.shared_images()});
/// torch::Tensor r = consistent(batch);   // (B,) p(answer's digit | image); `invalid` without a digit
/// ```
/// The answer's class is the last whole number written in the completion ("7", "It is 7.") when it
/// is one of the classes, else the last class name among its words ("seven"), else none: the
/// reward `invalid` (default 0). Completions are untrusted text: only the first `max_chars` bytes
/// are read; numbers too large, fractions and names not in the list are no class.
#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <boost/hana.hpp>
#include <torch/torch.h>

#include <unirl/core/error.hpp>
#include <unirl/core/options.hpp>
#include <unirl/rewards/clip.hpp>
#include <unirl/rewards/model.hpp>
#include <unirl/rewards/rules.hpp>
#include <unirl/rewards/scorer.hpp>

namespace unirl::rewards {

/// The shape of a `digit_classifier`.
struct classifier_config {
  std::int64_t channels = 1;
  std::int64_t input_size = 8;   // images are resized to input_size x input_size
  std::int64_t classes = 10;
  std::int64_t width = 32;

  void validate(const std::string& prefix) const {
    options::require(channels >= 1, prefix + "channels", channels, ">= 1");
    options::require(input_size >= 4, prefix + "input_size", input_size, ">= 4");
    options::require(classes >= 2, prefix + "classes", classes, ">= 2");
    options::require(width >= 1, prefix + "width", width, ">= 1");
  }
};
}  // namespace unirl::rewards
BOOST_HANA_ADAPT_STRUCT(unirl::rewards::classifier_config, channels, input_size, classes, width);
namespace unirl::rewards {

/// A small conv net: (N, C, H, W) images -> (N, classes) logits (images resized to input_size first).
class digit_classifier_impl : public torch::nn::Module {
 public:
  explicit digit_classifier_impl(classifier_config c = {}) : cfg_(std::move(c)) {
    unirl::options::validate(cfg_);
    conv1_ = register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(cfg_.channels, 16, 3).padding(1)));
    conv2_ = register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(16, 32, 3).stride(2).padding(1)));
    hidden_ = register_module("hidden", torch::nn::Linear(32 * 4, cfg_.width));
    out_ = register_module("out", torch::nn::Linear(cfg_.width, cfg_.classes));
  }

  torch::Tensor forward(torch::Tensor x) {
    UNIRL_CHECK(x.defined() && x.dim() == 4 && x.size(1) == cfg_.channels && x.is_floating_point(),
                "digit_classifier: images of shape ", x.defined() ? x.sizes() : torch::IntArrayRef{},
                "; expected floating (N, ", cfg_.channels, ", H, W)");
    x = x.to(conv1_->weight.device(), torch::kFloat32);
    if (x.size(2) != cfg_.input_size || x.size(3) != cfg_.input_size) {
      namespace F = torch::nn::functional;
      x = F::interpolate(x, F::InterpolateFuncOptions()
                                .size(std::vector<std::int64_t>{cfg_.input_size, cfg_.input_size})
                                .mode(torch::kArea));
    }
    x = torch::relu(conv1_->forward(x));
    x = torch::relu(conv2_->forward(x));
    x = torch::adaptive_avg_pool2d(x, {2, 2}).flatten(1);
    return out_->forward(torch::relu(hidden_->forward(x)));
  }
  const classifier_config& config() const { return cfg_; }

 private:
  classifier_config cfg_;
  torch::nn::Conv2d conv1_{nullptr}, conv2_{nullptr};
  torch::nn::Linear hidden_{nullptr}, out_{nullptr};
};
TORCH_MODULE_IMPL(digit_classifier, digit_classifier_impl);

/// Trains `model` with cross-entropy on `images` (N, C, H, W) and `labels` (N,) int64 in
/// [0, classes); batches drawn uniformly with replacement from `o.seed`.
inline encoder_train_result train_digit_classifier(digit_classifier& model, const torch::Tensor& images,
                                                   const torch::Tensor& labels, encoder_train_options o = {}) {
  unirl::options::validate(o);
  UNIRL_CHECK(images.defined() && images.dim() == 4 && labels.defined() && labels.dim() == 1 &&
                  labels.size(0) == images.size(0) && images.size(0) >= 1,
              "train_digit_classifier: images of shape ", images.defined() ? images.sizes() : torch::IntArrayRef{},
              " and labels of shape ", labels.defined() ? labels.sizes() : torch::IntArrayRef{},
              "; expected (N, C, H, W) and (N,), N >= 1");
  const auto K = model->config().classes;
  auto lab = labels.to(torch::kInt64);
  UNIRL_CHECK(lab.min().item<std::int64_t>() >= 0 && lab.max().item<std::int64_t>() < K, "train_digit_classifier: labels in [",
              lab.min().item<std::int64_t>(), ", ", lab.max().item<std::int64_t>(), "]; expected in [0, ", K, ")");
  return detail::train_minibatches(*model, o, images.size(0), [&](const std::vector<std::int64_t>& idx) {
    auto index = torch::tensor(idx, torch::kInt64);
    auto logits = model->forward(images.index_select(0, index.to(images.device())));
    return torch::nn::functional::cross_entropy(logits, lab.index_select(0, index.to(lab.device())).to(logits.device()));
  });
}

/// Options of the answer parsing of `consistency_reward`.
struct answer_class_options {
  std::vector<std::string> names = {"zero", "one", "two",   "three", "four",
                                    "five", "six", "seven", "eight", "nine"};  // class k's word
  std::int64_t max_chars = 4096;   // bytes of a completion that are read
  double invalid = 0.0;            // the reward of an answer that names no class

  void validate(const std::string& prefix) const {
    options::require(max_chars >= 1, prefix + "max_chars", max_chars, ">= 1");
  }
};
}  // namespace unirl::rewards
BOOST_HANA_ADAPT_STRUCT(unirl::rewards::answer_class_options, names, max_chars, invalid);
namespace unirl::rewards {

/// The class an answer names, in [0, classes), or -1 (see the file comment).
inline std::int64_t answer_class(const std::string& completion, std::int64_t classes, const answer_class_options& o = {}) {
  const std::string text = completion.substr(0, static_cast<std::size_t>(std::max<std::int64_t>(o.max_chars, 0)));
  const auto nums = detail::numbers_in(text);
  if (!nums.empty()) {
    const double v = nums.back();
    if (std::isfinite(v) && v == std::floor(v) && v >= 0 && v < static_cast<double>(classes)) return static_cast<std::int64_t>(v);
    return -1;  // a number that is no class: the answer is that number, not a word elsewhere
  }
  std::int64_t found = -1;
  std::size_t i = 0;
  while (i < text.size()) {
    while (i < text.size() && !std::isalpha(static_cast<unsigned char>(text[i]))) ++i;
    std::size_t j = i;
    while (j < text.size() && std::isalpha(static_cast<unsigned char>(text[j]))) ++j;
    if (j > i) {
      std::string w = text.substr(i, j - i);
      std::transform(w.begin(), w.end(), w.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
      for (std::size_t k = 0; k < o.names.size() && static_cast<std::int64_t>(k) < classes; ++k)
        if (w == o.names[k]) found = static_cast<std::int64_t>(k);
    }
    i = j;
  }
  return found;
}

/// The verifier `learned_reward` runs: rows (N, 1 + C*S*S) of [answer class (or -1), the image's
/// pixels resized to S = input_size] -> (N,) p(class | image) from the classifier, `invalid`
/// where the class is -1.
class answer_verifier_impl : public torch::nn::Module {
 public:
  answer_verifier_impl(digit_classifier classifier, double invalid)
      : clf_(register_module("classifier", std::move(classifier))), invalid_(invalid) {}

  torch::Tensor forward(const torch::Tensor& rows) {
    const auto& c = clf_->config();
    const auto D = c.channels * c.input_size * c.input_size;
    UNIRL_CHECK(rows.dim() == 2 && rows.size(1) == 1 + D, "answer_verifier: input of shape ", rows.sizes(), "; expected (N, ",
                1 + D, ") rows of [answer class, pixels]");
    auto cls = rows.select(1, 0).round().to(torch::kInt64);
    auto img = rows.narrow(1, 1, D).reshape({rows.size(0), c.channels, c.input_size, c.input_size});
    auto p = torch::softmax(clf_->forward(img), 1);
    auto valid = cls >= 0;
    auto picked = p.gather(1, cls.clamp_min(0).unsqueeze(1).to(p.device())).squeeze(1);
    return torch::where(valid.to(p.device()), picked, torch::full_like(picked, invalid_));
  }
  digit_classifier& classifier() { return clf_; }

 private:
  digit_classifier clf_;
  double invalid_;
};
TORCH_MODULE_IMPL(answer_verifier, answer_verifier_impl);

/// The input of the verifier: for each sample, its answer's class and its image (from `Source`:
/// `slot_images`, `prompt_images`, ...) resized to the classifier's input size, as one row.
template <class Source>
struct answer_image_rows {
  Source source;
  classifier_config config;
  answer_class_options parse;

  template <HasCompletions B>
    requires std::invocable<const Source&, const B&>
  torch::Tensor operator()(const B& b) const {
    const auto& texts = completions_of(b, "consistency_reward");
    const auto images = source(b);
    UNIRL_CHECK(images.size() == texts.size(), "consistency_reward: ", images.size(), " images for ", texts.size(),
                " completions; expected one image per sample");
    const auto S = config.input_size, D = config.channels * S * S;
    auto rows = torch::empty({static_cast<std::int64_t>(texts.size()), 1 + D}, torch::kFloat32);
    namespace F = torch::nn::functional;
    for (std::size_t i = 0; i < texts.size(); ++i) {
      auto im = images[i];
      UNIRL_CHECK(im.defined() && (im.dim() == 3 || (im.dim() == 4 && im.size(0) == 1)) && im.size(-3) == config.channels,
                  "consistency_reward: the image of sample ", i, " has shape ", im.defined() ? im.sizes() : torch::IntArrayRef{},
                  "; expected (", config.channels, ", H, W)");
      im = im.reshape({1, config.channels, im.size(-2), im.size(-1)}).to(torch::kCPU, torch::kFloat32);
      if (im.size(2) != S || im.size(3) != S)
        im = F::interpolate(im, F::InterpolateFuncOptions().size(std::vector<std::int64_t>{S, S}).mode(torch::kArea));
      const auto k = static_cast<std::int64_t>(i);
      rows[k][0] = static_cast<double>(answer_class(texts[i], config.classes, parse));
      rows[k].narrow(0, 1, D).copy_(im.reshape({D}));
    }
    return rows;
  }
};

/// The consistency reward: `learned_reward` over the verifier and `answer_image_rows`.
template <class Source>
using consistency_reward = learned_reward<answer_verifier, answer_image_rows<Source>>;

/// A consistency reward from a trained classifier; `reward` options (scale, chunk_size) pass to
/// `learned_reward` (its multi-view options do not apply: the input is rows, not images).
template <class Source>
consistency_reward<Source> make_consistency_reward(digit_classifier classifier, Source source, answer_class_options parse = {},
                                                   learned_reward_options reward = {}) {
  UNIRL_CHECK(!classifier.is_empty(), "make_consistency_reward: the classifier is empty; expected a trained model");
  unirl::options::validate(parse);
  UNIRL_CHECK(reward.scales.empty() && reward.crops == 0 && reward.include_original && reward.output_index == -1 &&
                  reward.activation == output_activation::identity,
              "make_consistency_reward: multi-scale / multi-crop views, output_index and activation do not apply to the "
              "verifier's rows; expected the defaults (scale and chunk_size may be set)");
  classifier->eval();
  const auto cfg = classifier->config();
  answer_verifier verifier{std::move(classifier), parse.invalid};
  verifier->eval();
  return consistency_reward<Source>{std::move(verifier), answer_image_rows<Source>{std::move(source), cfg, std::move(parse)},
                                    std::move(reward)};
}

}  // namespace unirl::rewards

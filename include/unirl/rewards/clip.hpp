#pragma once
/// \file clip.hpp
/// A small CLIP-style image–text encoder (Radford et al. 2021) for the vision-language tasks, the
/// symmetric InfoNCE loss that trains it (learnable temperature), and the alignment reward that
/// scores a completion by the cosine between its text and the image of its prompt
/// (seed 003 §4.1: `cosine_similarity(encode_image(pixels), encode_text(generated_text))`).
///
/// ```cpp
/// unirl::rewards::tiny_clip clip{unirl::rewards::clip_config{}};            // 8x8 grey digits
/// unirl::rewards::train_clip(clip, images, captions, labels, {.steps = 400}); // "7", "seven", "a seven"
/// // A token-track batch carries its images as image-slot ids in `prompt_ids`: the reward looks
/// // them up in the VLM's image table (the step's `vision_cache`).
/// auto align = unirl::rewards::make_clip_alignment(clip, unirl::rewards::slot_images{model.shared_images()},
///                                                  {.clamp_negative = true});
/// torch::Tensor r = align(batch);   // (B,) cos(image of sample i's prompt, completion i)
/// ```
/// Texts are untrusted: a caption is read as bytes (lower-cased ASCII), at most
/// `clip_config::max_chars` of them; any byte string, the empty one included, has an embedding.
#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <boost/hana.hpp>
#include <torch/torch.h>

#include <unirl/core/error.hpp>
#include <unirl/core/options.hpp>
#include <unirl/rewards/alignment.hpp>
#include <unirl/rewards/scorer.hpp>

namespace unirl::rewards {

/// The shape of a `tiny_clip`.
struct clip_config {
  std::int64_t channels = 1;      // image channels
  std::int64_t input_size = 8;    // images are resized to input_size x input_size first (0: as given)
  std::int64_t embed_dim = 32;    // the joint embedding width
  std::int64_t width = 64;        // hidden width of both encoders
  std::int64_t buckets = 1024;    // hashed text features (characters, character pairs, words)
  std::int64_t max_chars = 256;   // characters of a text that are read (the rest is ignored)
  double init_temperature = 0.07; // CLIP's: logit scale = log(1 / 0.07) at the start
  double max_logit_scale = 100.0; // CLIP's clamp of exp(logit_scale)

  void validate(const std::string& prefix) const {
    options::require(channels >= 1, prefix + "channels", channels, ">= 1");
    options::require(input_size == 0 || input_size >= 4, prefix + "input_size", input_size, "0 or >= 4");
    options::require(embed_dim >= 1, prefix + "embed_dim", embed_dim, ">= 1");
    options::require(width >= 1, prefix + "width", width, ">= 1");
    options::require(buckets >= 16, prefix + "buckets", buckets, ">= 16");
    options::require(max_chars >= 1, prefix + "max_chars", max_chars, ">= 1");
    options::require(init_temperature > 0, prefix + "init_temperature", init_temperature, "> 0");
    options::require(max_logit_scale >= 1, prefix + "max_logit_scale", max_logit_scale, ">= 1");
  }
};
}  // namespace unirl::rewards
BOOST_HANA_ADAPT_STRUCT(unirl::rewards::clip_config, channels, input_size, embed_dim, width, buckets, max_chars,
                        init_temperature, max_logit_scale);
namespace unirl::rewards {

namespace detail {
inline std::uint64_t fnv1a(std::uint64_t salt, std::string_view s) {
  std::uint64_t h = 1469598103934665603ull ^ (salt * 1099511628211ull);
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}
}  // namespace detail

/// The hashed features of a text, in [0, buckets): each character, each pair of neighbouring
/// characters (with the word boundaries), and each whitespace-separated word — lower-cased, the
/// first `max_chars` bytes only. Never empty: a text without features gets the "empty" feature.
inline std::vector<std::int64_t> text_features(std::string_view text, std::int64_t buckets, std::int64_t max_chars) {
  std::string s(text.substr(0, static_cast<std::size_t>(std::max<std::int64_t>(0, max_chars))));
  for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  std::vector<std::int64_t> f;
  const auto b = static_cast<std::uint64_t>(buckets);
  auto add = [&](std::uint64_t salt, std::string_view piece) { f.push_back(static_cast<std::int64_t>(detail::fnv1a(salt, piece) % b)); };
  std::size_t i = 0;
  while (i < s.size()) {
    while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) ++i;
    std::size_t j = i;
    while (j < s.size() && !std::isspace(static_cast<unsigned char>(s[j]))) ++j;
    if (j > i) {
      const std::string word = "^" + s.substr(i, j - i) + "$";
      add(3, word);
      for (std::size_t k = 1; k + 1 < word.size(); ++k) add(1, std::string_view(word).substr(k, 1));
      for (std::size_t k = 0; k + 1 < word.size(); ++k) add(2, std::string_view(word).substr(k, 2));
    }
    i = j;
  }
  if (f.empty()) add(4, "");
  return f;
}

/// The symmetric InfoNCE loss of CLIP: with L = exp(logit_scale) * cos(img_i, txt_j) (rows
/// L2-normalised inside), the mean of the image->text and text->image cross-entropies:
/// `(CE(L, P) + CE(L^T, P^T)) / 2`, where the target P is the identity (pair i is the positive of
/// row i) or, when `positives` (B, B) bool is given, its rows normalised to sum to 1 (several
/// positives per row: e.g. every pair of the same class). `img`, `txt` are (B, D); `logit_scale`
/// a scalar tensor (the log of the inverse temperature; gradients flow into it).
inline torch::Tensor info_nce_loss(const torch::Tensor& img, const torch::Tensor& txt, const torch::Tensor& logit_scale,
                                   const torch::Tensor& positives = {}) {
  UNIRL_CHECK(img.dim() == 2 && txt.dim() == 2 && img.sizes() == txt.sizes() && img.size(0) >= 1,
              "info_nce_loss: embeddings of shapes ", img.sizes(), " and ", txt.sizes(), "; expected two (B, D), B >= 1");
  UNIRL_CHECK(logit_scale.defined() && logit_scale.numel() == 1, "info_nce_loss: logit_scale of shape ",
              logit_scale.defined() ? logit_scale.sizes() : torch::IntArrayRef{}, "; expected a scalar tensor");
  namespace F = torch::nn::functional;
  const auto B = img.size(0);
  auto i = F::normalize(img, F::NormalizeFuncOptions().dim(1).eps(1e-8));
  auto t = F::normalize(txt, F::NormalizeFuncOptions().dim(1).eps(1e-8));
  auto logits = logit_scale.reshape({}).exp() * i.matmul(t.t());
  if (!positives.defined()) {
    auto target = torch::arange(B, torch::TensorOptions().dtype(torch::kInt64).device(img.device()));
    return (F::cross_entropy(logits, target) + F::cross_entropy(logits.t(), target)) / 2;
  }
  UNIRL_CHECK(positives.dim() == 2 && positives.size(0) == B && positives.size(1) == B,
              "info_nce_loss: positives of shape ", positives.sizes(), "; expected (", B, ", ", B, ")");
  auto p = positives.to(logits.options());
  const auto rows = p.sum(1), cols = p.sum(0);
  UNIRL_CHECK((rows > 0).all().item<bool>() && (cols > 0).all().item<bool>(),
              "info_nce_loss: a row or column of positives has no positive pair; expected at least one each");
  auto i2t = -(p / rows.unsqueeze(1) * torch::log_softmax(logits, 1)).sum(1).mean();
  auto t2i = -(p.t() / cols.unsqueeze(1) * torch::log_softmax(logits.t(), 1)).sum(1).mean();
  return (i2t + t2i) / 2;
}

/// A small CLIP: a conv net over (N, C, H, W) images and an embedding bag of hashed text
/// features followed by an MLP, both into `embed_dim`, and CLIP's learnable logit scale.
class tiny_clip_impl : public torch::nn::Module {
 public:
  explicit tiny_clip_impl(clip_config c = {}) : cfg_(std::move(c)) {
    unirl::options::validate(cfg_);
    conv1_ = register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(cfg_.channels, 16, 3).padding(1)));
    conv2_ = register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(16, 32, 3).stride(2).padding(1)));
    img_proj_ = register_module("img_proj", torch::nn::Linear(32 * 4, cfg_.embed_dim));
    bag_ = register_module("bag", torch::nn::EmbeddingBag(torch::nn::EmbeddingBagOptions(cfg_.buckets, cfg_.width)
                                                              .mode(torch::kMean)));
    txt_hidden_ = register_module("txt_hidden", torch::nn::Linear(cfg_.width, cfg_.width));
    txt_proj_ = register_module("txt_proj", torch::nn::Linear(cfg_.width, cfg_.embed_dim));
    logit_scale_ = register_parameter("logit_scale", torch::full({}, std::log(1.0 / cfg_.init_temperature)));
  }

  /// Image embeddings (N, embed_dim), not normalised. `x`: (N, C, H, W) or (C, H, W), float.
  torch::Tensor encode_image(torch::Tensor x) {
    UNIRL_CHECK(x.defined() && x.is_floating_point() && (x.dim() == 3 || x.dim() == 4), "tiny_clip::encode_image: images of shape ",
                x.defined() ? x.sizes() : torch::IntArrayRef{}, "; expected floating (N, C, H, W) or (C, H, W)");
    if (x.dim() == 3) x = x.unsqueeze(0);
    UNIRL_CHECK(x.size(1) == cfg_.channels, "tiny_clip::encode_image: images have ", x.size(1), " channels; expected ",
                cfg_.channels);
    x = resized(x.to(conv1_->weight.device(), torch::kFloat32));
    x = torch::relu(conv1_->forward(x));
    x = torch::relu(conv2_->forward(x));
    x = torch::adaptive_avg_pool2d(x, {2, 2}).flatten(1);
    return img_proj_->forward(x);
  }

  /// Image embeddings of images of possibly different sizes (each resized to `input_size`, or
  /// encoded alone when `input_size` is 0 and the sizes differ): (N, embed_dim).
  torch::Tensor encode_images(const std::vector<torch::Tensor>& images) {
    UNIRL_CHECK(!images.empty(), "tiny_clip::encode_images: no images; expected at least one");
    std::vector<torch::Tensor> xs;
    bool same = true;
    for (const auto& im : images) {
      UNIRL_CHECK(im.defined() && (im.dim() == 3 || (im.dim() == 4 && im.size(0) == 1)), "tiny_clip::encode_images: an image of shape ",
                  im.defined() ? im.sizes() : torch::IntArrayRef{}, "; expected (C, H, W) or (1, C, H, W)");
      xs.push_back(resized(im.dim() == 3 ? im.unsqueeze(0).to(torch::kFloat32) : im.to(torch::kFloat32)));
      same = same && xs.back().sizes() == xs.front().sizes();
    }
    if (same) return encode_image(torch::cat(xs, 0));
    std::vector<torch::Tensor> out;
    for (const auto& x : xs) out.push_back(encode_image(x));
    return torch::cat(out, 0);
  }

  /// Text embeddings (N, embed_dim), not normalised.
  torch::Tensor encode_text(const std::vector<std::string>& texts) {
    UNIRL_CHECK(!texts.empty(), "tiny_clip::encode_text: no texts; expected at least one");
    std::vector<std::int64_t> ids, offsets;
    for (const auto& t : texts) {
      offsets.push_back(static_cast<std::int64_t>(ids.size()));
      const auto f = text_features(t, cfg_.buckets, cfg_.max_chars);
      ids.insert(ids.end(), f.begin(), f.end());
    }
    const auto dev = bag_->weight.device();
    auto h = bag_->forward(torch::tensor(ids, torch::kInt64).to(dev), torch::tensor(offsets, torch::kInt64).to(dev));
    h = torch::relu(txt_hidden_->forward(torch::relu(h)));
    return txt_proj_->forward(h);
  }

  /// log of the inverse temperature, clamped at log(max_logit_scale) as CLIP does.
  torch::Tensor logit_scale() const { return logit_scale_.clamp_max(std::log(cfg_.max_logit_scale)); }
  const clip_config& config() const { return cfg_; }

 private:
  torch::Tensor resized(const torch::Tensor& x) const {
    if (cfg_.input_size == 0 || (x.size(2) == cfg_.input_size && x.size(3) == cfg_.input_size)) return x;
    namespace F = torch::nn::functional;
    return F::interpolate(x, F::InterpolateFuncOptions()
                                 .size(std::vector<std::int64_t>{cfg_.input_size, cfg_.input_size})
                                 .mode(torch::kArea));
  }

  clip_config cfg_;
  torch::nn::Conv2d conv1_{nullptr}, conv2_{nullptr};
  torch::nn::Linear img_proj_{nullptr}, txt_hidden_{nullptr}, txt_proj_{nullptr};
  torch::nn::EmbeddingBag bag_{nullptr};
  torch::Tensor logit_scale_;
};
TORCH_MODULE_IMPL(tiny_clip, tiny_clip_impl);

/// Options of `train_clip` (and of `train_digit_classifier`).
struct encoder_train_options {
  std::int64_t steps = 400;
  std::int64_t batch = 64;
  double lr = 3e-3;          // Adam
  double weight_decay = 0.0;
  std::uint64_t seed = 0;    // the batches drawn (the parameters are as constructed)

  void validate(const std::string& prefix) const {
    options::require(steps >= 1, prefix + "steps", steps, ">= 1");
    options::require(batch >= 2, prefix + "batch", batch, ">= 2");
    options::require(lr > 0, prefix + "lr", lr, "> 0");
    options::require(weight_decay >= 0, prefix + "weight_decay", weight_decay, ">= 0");
  }
};
}  // namespace unirl::rewards
BOOST_HANA_ADAPT_STRUCT(unirl::rewards::encoder_train_options, steps, batch, lr, weight_decay, seed);
namespace unirl::rewards {

/// What a training run did: the loss of its first step, the mean loss of its last 10 steps, seconds.
struct encoder_train_result {
  double first_loss = 0.0;
  double last_loss = 0.0;
  double seconds = 0.0;
};

namespace detail {
// The training loop of the small reward encoders: `o.steps` Adam steps (lr, weight decay) on
// minibatches of `o.batch` indices drawn uniformly from [0, n) with the seeded generator;
// `loss(indices)` is one minibatch's loss. Reports the first loss and the mean of the last ten.
template <class Module, class Loss>
encoder_train_result train_minibatches(Module& model, const encoder_train_options& o, std::int64_t n, Loss&& loss) {
  const auto t0 = std::chrono::steady_clock::now();
  model.train();
  torch::optim::Adam opt(model.parameters(), torch::optim::AdamOptions(o.lr).weight_decay(o.weight_decay));
  std::mt19937_64 rng(o.seed);
  std::uniform_int_distribution<std::int64_t> pick(0, n - 1);
  encoder_train_result res;
  double tail = 0.0;
  std::int64_t tail_n = 0;
  for (std::int64_t step = 0; step < o.steps; ++step) {
    std::vector<std::int64_t> idx(static_cast<std::size_t>(o.batch));
    for (auto& i : idx) i = pick(rng);
    auto l = loss(idx);
    opt.zero_grad();
    l.backward();
    opt.step();
    const double v = l.template item<double>();
    if (step == 0) res.first_loss = v;
    if (step >= o.steps - 10) tail += v, ++tail_n;
  }
  model.eval();
  res.last_loss = tail / static_cast<double>(std::max<std::int64_t>(tail_n, 1));
  res.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return res;
}
}  // namespace detail

/// Trains `model` with `info_nce_loss` on image–caption pairs: `images` (N, C, H, W), `captions`
/// (N texts). With `labels` ((N,) int64) every pair of a batch with the same label is a positive
/// (captions like "7" and "seven" of one class are not pushed apart); without, identical caption
/// texts are. Batches of `batch` pairs are drawn uniformly with replacement from `seed`.
inline encoder_train_result train_clip(tiny_clip& model, const torch::Tensor& images, const std::vector<std::string>& captions,
                                       const torch::Tensor& labels = {}, encoder_train_options o = {}) {
  unirl::options::validate(o);
  UNIRL_CHECK(images.defined() && images.dim() == 4 && images.size(0) == static_cast<std::int64_t>(captions.size()) &&
                  images.size(0) >= 2,
              "train_clip: ", images.defined() ? images.size(0) : 0, " images of shape ",
              images.defined() ? images.sizes() : torch::IntArrayRef{}, " for ", captions.size(),
              " captions; expected (N, C, H, W) images and N >= 2 captions");
  const auto N = images.size(0);
  torch::Tensor lab;
  if (labels.defined()) {
    UNIRL_CHECK(labels.dim() == 1 && labels.size(0) == N, "train_clip: labels of shape ", labels.sizes(), "; expected (", N, ",)");
    lab = labels.to(torch::kCPU, torch::kInt64);
  }
  const auto dev = model->logit_scale().device();
  return detail::train_minibatches(*model, o, N, [&](const std::vector<std::int64_t>& idx) {
    std::vector<std::string> caps;
    for (auto i : idx) caps.push_back(captions[static_cast<std::size_t>(i)]);
    auto index = torch::tensor(idx, torch::kInt64);
    torch::Tensor pos;
    if (lab.defined()) {
      auto l = lab.index_select(0, index);
      pos = l.unsqueeze(1) == l.unsqueeze(0);
    } else {
      pos = torch::zeros({o.batch, o.batch}, torch::kBool);
      for (std::int64_t a = 0; a < o.batch; ++a)
        for (std::int64_t b = 0; b < o.batch; ++b) pos[a][b] = caps[static_cast<std::size_t>(a)] == caps[static_cast<std::size_t>(b)];
    }
    return info_nce_loss(model->encode_image(images.index_select(0, index.to(images.device())).to(dev)),
                         model->encode_text(caps), model->logit_scale(), pos.to(dev));
  });
}

/// Zero-shot classification: for each image (N, C, H, W), the index of the caption (of `captions`,
/// one per class) whose embedding is closest in cosine. (N,) int64.
inline torch::Tensor zero_shot_classify(tiny_clip& model, const torch::Tensor& images, const std::vector<std::string>& captions) {
  torch::NoGradGuard no_grad;
  namespace F = torch::nn::functional;
  auto i = F::normalize(model->encode_image(images), F::NormalizeFuncOptions().dim(1));
  auto t = F::normalize(model->encode_text(captions), F::NormalizeFuncOptions().dim(1));
  return i.matmul(t.t()).argmax(1).to(torch::kCPU);
}

// ---- where a batch's images are ------------------------------------------------------------------

/// The image of each sample of a token-track batch, looked up in a VLM's image table: the first
/// image-slot id (>= the text vocabulary) among the real tokens of the sample's prompt names the
/// slot; the image is that slot's as registered. `Cache` is `models::vlm::vision_cache` (or any
/// type with `vocab_size()`, `size()` and `image(slot)`); hold the model's
/// `shared_images()`, so the table scored is the step's. A prompt without an image-slot id is an
/// error naming the sample.
template <class Cache>
struct slot_images {
  std::shared_ptr<Cache> cache;

  template <class B>
    requires requires(const B& b) { { b.prompt_ids } -> std::convertible_to<const torch::Tensor&>; }
  std::vector<torch::Tensor> operator()(const B& b) const {
    UNIRL_CHECK(cache != nullptr, "slot_images: no image table; expected the VLM's shared_images()");
    UNIRL_CHECK(b.prompt_ids.defined() && b.prompt_ids.dim() == 2, "slot_images: prompt_ids of shape ",
                b.prompt_ids.defined() ? b.prompt_ids.sizes() : torch::IntArrayRef{}, "; expected (B, P)");
    auto ids = b.prompt_ids.to(torch::kCPU, torch::kInt64).contiguous();
    torch::Tensor mask;
    if constexpr (requires { { b.prompt_mask } -> std::convertible_to<const torch::Tensor&>; })
      if (b.prompt_mask.defined()) mask = (b.prompt_mask.to(torch::kCPU) > 0).contiguous();
    const auto V = static_cast<std::int64_t>(cache->vocab_size()), n = ids.size(0), P = ids.size(1);
    std::vector<torch::Tensor> out;
    out.reserve(static_cast<std::size_t>(n));
    const auto* p = ids.template data_ptr<std::int64_t>();
    const bool* m = mask.defined() ? mask.template data_ptr<bool>() : nullptr;
    for (std::int64_t i = 0; i < n; ++i) {
      std::int64_t slot = -1;
      for (std::int64_t k = 0; k < P && slot < 0; ++k)
        if ((!m || m[i * P + k]) && p[i * P + k] >= V) slot = p[i * P + k] - V;
      UNIRL_CHECK(slot >= 0, "slot_images: the prompt of sample ", i, " has no image-slot id (>= vocab_size = ", V,
                  "); expected a prompt with an image");
      UNIRL_CHECK(slot < static_cast<std::int64_t>(cache->size()), "slot_images: sample ", i, " shows image slot ", slot,
                  " but the image table holds ", cache->size(), "; expected the step's table (clear() before adding its images)");
      out.push_back(cache->image(slot));
    }
    return out;
  }
};
template <class Cache>
slot_images(std::shared_ptr<Cache>) -> slot_images<Cache>;

/// The image of each sample from a per-prompt table: sample i shows `table[prompt_index[i]]`
/// (the token track's `prompt_index`, or sample i itself when the batch has none). Set
/// `*table` to the step's images, in the order of the prompts given to `step()`.
struct prompt_images {
  std::shared_ptr<std::vector<torch::Tensor>> table = std::make_shared<std::vector<torch::Tensor>>();

  template <class B>
  std::vector<torch::Tensor> operator()(const B& b) const {
    UNIRL_CHECK(table != nullptr, "prompt_images: no image table");
    const auto n = batch_size(b);
    std::vector<torch::Tensor> out;
    out.reserve(static_cast<std::size_t>(n));
    torch::Tensor index;
    if constexpr (requires { { b.prompt_index } -> std::convertible_to<const torch::Tensor&>; })
      if (b.prompt_index.defined()) index = b.prompt_index.to(torch::kCPU, torch::kInt64).contiguous();
    UNIRL_CHECK(!index.defined() || index.numel() == n, "prompt_images: prompt_index has ", index.numel(), " entries for ",
                n, " samples; expected one per sample");
    for (std::int64_t i = 0; i < n; ++i) {
      const auto k = index.defined() ? index.template data_ptr<std::int64_t>()[i] : i;
      UNIRL_CHECK(k >= 0 && k < static_cast<std::int64_t>(table->size()), "prompt_images: sample ", i, " answers prompt ",
                  k, " but the table holds ", table->size(), " image(s); expected one image per prompt");
      out.push_back((*table)[static_cast<std::size_t>(k)]);
    }
    return out;
  }
};

// ---- the alignment reward ------------------------------------------------------------------------

/// The image side of `clip_alignment`: the CLIP image embedding of each sample's image.
template <class Source>
struct clip_image_side {
  tiny_clip model;
  Source source;
  template <class B>
    requires std::invocable<const Source&, const B&>
  torch::Tensor operator()(const B& b) { return model->encode_images(source(b)); }
};

/// The text side of `clip_alignment`: the CLIP text embedding of each completion.
struct clip_text_side {
  tiny_clip model;
  template <HasCompletions B>
  torch::Tensor operator()(const B& b) { return model->encode_text(completions_of(b, "clip_alignment")); }
};

/// The alignment reward: `embedding_alignment` (scale * cos, optionally clamped at 0) between
/// the image of each sample (from `Source`: `slot_images`, `prompt_images`, or any callable
/// giving the per-sample images) and its completion text, both through a trained `tiny_clip`.
template <class Source>
using clip_alignment = embedding_alignment<clip_image_side<Source>, clip_text_side>;

template <class Source>
clip_alignment<Source> make_clip_alignment(tiny_clip model, Source source, alignment_options o = {}) {
  UNIRL_CHECK(!model.is_empty(), "make_clip_alignment: the tiny_clip is empty; expected a trained model");
  model->eval();
  return clip_alignment<Source>{clip_image_side<Source>{model, std::move(source)}, clip_text_side{model}, std::move(o)};
}

}  // namespace unirl::rewards

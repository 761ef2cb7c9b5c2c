#pragma once
/// \file alignment.hpp
/// Embedding alignment (CLIP-style): the cosine similarity between what two encoders make of
/// each sample — e.g. an image encoder on the generated image and a text encoder on its prompt.
///
/// ```cpp
/// auto image_side = [&](const flow_batch& b) { return image_encoder->forward(b.images); };       // (B, D)
/// auto text_side  = [&](const flow_batch& b) { return text_encoder->forward(tokenize(b.prompts)); }; // (B, D)
/// unirl::rewards::embedding_alignment align{image_side, text_side, {.scale = 2.5, .clamp_negative = true}};
/// torch::Tensor r = align(batch);   // (B,) = 2.5 * max(cos, 0)  (CLIPScore's w = 2.5)
/// ```
#include <concepts>
#include <string>
#include <string_view>
#include <utility>

#include <boost/hana.hpp>
#include <torch/torch.h>

#include <unirl/core/error.hpp>
#include <unirl/core/options.hpp>
#include <unirl/rewards/scorer.hpp>

namespace unirl::rewards {

/// Options of `embedding_alignment`.
struct alignment_options {
  double scale = 1.0;            // reward = scale * cos (+ offset)
  double offset = 0.0;
  bool clamp_negative = false;   // max(cos, 0) first, as CLIPScore
  double eps = 1e-8;             // guards the norms

  void validate(const std::string& prefix) const {
    options::require(eps > 0, prefix + "eps", eps, "> 0");
  }
};
}  // namespace unirl::rewards
BOOST_HANA_ADAPT_STRUCT(unirl::rewards::alignment_options, scale, offset, clamp_negative, eps);
namespace unirl::rewards {

/// Cosine similarity of two encoders' (B, D) outputs, row by row, under `NoGradGuard`.
///
/// Minimal requirement: `EncA` and `EncB` are callables `torch::Tensor(const Batch&)` giving
/// (B, D) embeddings of the same width `D` (extra trailing dimensions are flattened).
template <class EncA, class EncB>
class embedding_alignment {
 public:
  using options = alignment_options;
  static constexpr std::string_view name = "alignment";

  embedding_alignment(EncA a, EncB b, options o = {}) : a_(std::move(a)), b_(std::move(b)), opts_(std::move(o)) {
    unirl::options::validate(opts_);
  }

  template <class Batch>
    requires std::invocable<EncA&, const Batch&> && std::invocable<EncB&, const Batch&>
  torch::Tensor operator()(const Batch& batch) {
    torch::NoGradGuard no_grad;
    torch::Tensor ea = a_(batch), eb = b_(batch);
    UNIRL_CHECK(ea.defined() && eb.defined() && ea.dim() >= 1 && eb.dim() >= 1,
                "embedding_alignment: an encoder returned an undefined or 0-dim tensor; expected (B, D)");
    ea = ea.flatten(1).to(torch::kFloat32);
    eb = eb.flatten(1).to(torch::kFloat32).to(ea.device());
    UNIRL_CHECK(ea.sizes() == eb.sizes(), "embedding_alignment: embeddings of shapes ", ea.sizes(), " and ", eb.sizes(),
                "; expected the same (B, D)");
    auto cos = (ea * eb).sum(1) / (ea.norm(2, 1) * eb.norm(2, 1)).clamp_min(opts_.eps);
    if (opts_.clamp_negative) cos = cos.clamp_min(0);
    return cos * opts_.scale + opts_.offset;
  }

  const options& opts() const { return opts_; }

 private:
  EncA a_;
  EncB b_;
  options opts_;
};

}  // namespace unirl::rewards

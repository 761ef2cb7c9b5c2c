#pragma once
/// \file projector.hpp
/// `llava_projector`: LLaVA's connector (Hugging Face's LlavaMultiModalProjector) from vision
/// features to the language model's embedding space: `linear_2(act(linear_1(x)))` with
/// act = `projector_hidden_act` (gelu). Parameter names are Hugging Face's (`linear_1.weight`,
/// `linear_1.bias`, `linear_2.weight`, `linear_2.bias`; in a LLaVA checkpoint under
/// `multi_modal_projector.`).
///
/// ```cpp
/// namespace vision = unirl::models::vision;
/// vision::llava_projector proj(cfg);                       // from a llava_config (or the sizes)
/// auto tokens = proj(tower->features(pixels));              // (B, n, text hidden_size)
/// ```
#include <cstdint>
#include <string>

#include <torch/torch.h>

#include <unirl/core/error.hpp>
#include <unirl/models/hf/causal_lm.hpp>
#include <unirl/models/lora.hpp>
#include <unirl/models/vision/clip.hpp>
#include <unirl/models/vision/config.hpp>

namespace unirl::models::vision {

/// LlavaMultiModalProjector: linear_1 (vision hidden -> text hidden), act, linear_2 (text hidden -> text hidden).
class llava_projector_impl : public torch::nn::Cloneable<llava_projector_impl>, public lora::adaptable {
 public:
  llava_projector_impl(std::int64_t vision_hidden, std::int64_t text_hidden, std::string act = "gelu",
                       bool bias = true)
      : in_(vision_hidden), out_(text_hidden), act_(std::move(act)), bias_(bias) {
    UNIRL_CHECK(in_ >= 1 && out_ >= 1, "vision::llava_projector: sizes ", in_, " -> ", out_, ": expected >= 1");
    bool known = false;
    for (const auto a : supported_activations) known = known || a == act_;
    UNIRL_CHECK(known, "vision::llava_projector: projector_hidden_act = \"", act_,
                "\": unsupported; expected quick_gelu, gelu, gelu_pytorch_tanh, gelu_new, silu or relu");
    reset();
  }
  /// The projector of a LLaVA config: vision.hidden_size -> text.hidden_size, projector_hidden_act,
  /// multimodal_projector_bias.
  explicit llava_projector_impl(const llava_config& c)
      : llava_projector_impl(c.vision.hidden_size, c.text.hidden_size, c.projector_hidden_act,
                             c.multimodal_projector_bias) {}

  void reset() override {
    linear_1 = register_module("linear_1", hf::detail::make_linear(in_, out_, bias_));
    linear_2 = register_module("linear_2", hf::detail::make_linear(out_, out_, bias_));
  }

  /// features (..., vision hidden) -> (..., text hidden).
  torch::Tensor forward(const torch::Tensor& features) const {
    UNIRL_CHECK(features.dim() >= 1 && features.size(-1) == in_, "vision::llava_projector: features of sizes ",
                features.sizes(), ": expected a last dimension of ", in_, " (the vision tower's hidden_size)");
    const auto& w = linear_1->weight;
    const auto x = features.to(w.device(), w.scalar_type());
    return hf::detail::dense(detail::activate(hf::detail::dense(x, linear_1), act_), linear_2);
  }

  std::int64_t in_features() const { return in_; }
  std::int64_t out_features() const { return out_; }
  const std::string& activation() const { return act_; }

  torch::nn::Linear linear_1{nullptr}, linear_2{nullptr};

 private:
  std::int64_t in_, out_;
  std::string act_;
  bool bias_;
};
TORCH_MODULE_IMPL(llava_projector, llava_projector_impl);

}  // namespace unirl::models::vision

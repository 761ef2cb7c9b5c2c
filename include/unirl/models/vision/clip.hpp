#pragma once
/// \file clip.hpp
/// `clip_vision`: the vision tower of a LLaVA model as a `torch::nn` module — Hugging Face's
/// CLIPVisionModel (patch embedding Conv2d without bias, class embedding, learned position
/// embedding, pre_layrnorm, pre-norm encoder layers with q/k/v/out_proj biases, quick_gelu or gelu
/// MLP, post_layernorm) or, selected by `vision_config::family`, SiglipVisionModel (patch
/// embedding with bias, no class token, no pre_layrnorm, gelu_pytorch_tanh). Parameter names are
/// Hugging Face's (`vision_model.embeddings.patch_embedding.weight`,
/// `vision_model.encoder.layers.0.self_attn.q_proj.weight`, ...), so `named_parameters()` maps 1:1
/// onto a checkpoint's `vision_tower.*` tensors (vision/llava.hpp loads them).
///
/// ```cpp
/// namespace vision = unirl::models::vision;
/// vision::clip_vision tower(cfg.vision);                          // random; or vision::load_llava(dir)
/// auto f = tower->features(pixels, -2, vision::select_strategy::drop_first);   // (B, grid^2, hidden)
/// auto packed = tower->features_packed({img_a, img_b});          // (n_a + n_b, hidden), one sequence
/// tower->set_checkpointing({"vision_tower"});                    // recompute layers in the backward
/// ```
/// Images of other sizes than `image_size`: H and W multiples of `patch_size` with at most the
/// configured grid of patches per side. The h x w patches take the position embeddings of the
/// configured grid at the same (row, column) — the top-left h x w corner of the table (the class
/// token keeps its own) — with no interpolation; at the configured size this is Hugging Face's
/// forward exactly. (Hugging Face's `interpolate_pos_encoding=True` resizes the table bicubically
/// instead: a different function; this choice keeps every patch's embedding a row of the
/// checkpoint's table and makes a packed call equal to the images run one by one.)
///
/// `features` returns a hidden state of Hugging Face's `output_hidden_states` list (index 0: the
/// embeddings after pre_layrnorm; index i: the output of layer i; negative: from the end, so LLaVA's
/// default -2 is the input of the last layer); `post_layernorm` is applied by `last_hidden_state`
/// for SigLIP only, as Hugging Face does (CLIP normalises only its pooled output). Numerics follow
/// Hugging Face's eager forward (float and double attention through `ops::attention`, half types
/// with a float32 softmax). Dropout is not applied.
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <unirl/core/error.hpp>
#include <unirl/models/activation_checkpoint.hpp>
#include <unirl/models/hf/causal_lm.hpp>
#include <unirl/models/lora.hpp>
#include <unirl/models/vision/config.hpp>

namespace unirl::models::vision {

namespace detail {

/// Hugging Face's ACT2FN of `name` (one of `supported_activations`).
inline torch::Tensor activate(const torch::Tensor& x, const std::string& name) {
  if (name == "quick_gelu") return x * torch::sigmoid(1.702 * x);
  if (name == "gelu") return torch::gelu(x);
  if (name == "gelu_pytorch_tanh") return torch::gelu(x, "tanh");
  if (name == "gelu_new") return hf::detail::gelu_new(x);
  if (name == "silu") return torch::silu(x);
  if (name == "relu") return torch::relu(x);
  throw error("unirl: activation \"" + name +
              "\": unsupported; expected quick_gelu, gelu, gelu_pytorch_tanh, gelu_new, silu or relu");
}

/// (1, 1, N, N) additive mask of packed sequences of `lengths`: 0 within a sequence, -inf across.
inline torch::Tensor block_diagonal_bias(const std::vector<std::int64_t>& lengths, const torch::TensorOptions& opts) {
  std::vector<std::int64_t> seg;
  for (std::size_t i = 0; i < lengths.size(); ++i) seg.insert(seg.end(), static_cast<std::size_t>(lengths[i]),
                                                              static_cast<std::int64_t>(i));
  const auto s = torch::tensor(seg, torch::TensorOptions(torch::kInt64)).to(opts.device());
  const auto allowed = s.unsqueeze(1) == s.unsqueeze(0);
  return torch::zeros(allowed.sizes(), opts)
      .masked_fill(allowed.logical_not(), -std::numeric_limits<double>::infinity())
      .unsqueeze(0)
      .unsqueeze(0);
}

inline torch::nn::LayerNorm make_layer_norm(std::int64_t d, double eps) {
  return torch::nn::LayerNorm(torch::nn::LayerNormOptions({d}).eps(eps));
}

/// `self_attn`: q_proj, k_proj, v_proj, out_proj (all with biases), bidirectional.
class vision_attention_impl : public torch::nn::Cloneable<vision_attention_impl> {
 public:
  explicit vision_attention_impl(const vision_config& c)
      : hidden_(c.hidden_size), heads_(c.num_attention_heads), dim_(c.head_dim()) {
    reset();
  }
  void reset() override {
    q_proj = register_module("q_proj", hf::detail::make_linear(hidden_, hidden_, true));
    k_proj = register_module("k_proj", hf::detail::make_linear(hidden_, hidden_, true));
    v_proj = register_module("v_proj", hf::detail::make_linear(hidden_, hidden_, true));
    out_proj = register_module("out_proj", hf::detail::make_linear(hidden_, hidden_, true));
  }
  /// x (B, n, hidden), bias (1|B, 1, n, n) or undefined -> (B, n, hidden).
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& bias) {
    const auto B = x.size(0), n = x.size(1);
    const auto split = [&](const torch::Tensor& t) { return t.view({B, n, heads_, dim_}).transpose(1, 2); };
    const auto q = split(hf::detail::dense(x, q_proj));
    const auto k = split(hf::detail::dense(x, k_proj));
    const auto v = split(hf::detail::dense(x, v_proj));
    const auto y = hf::detail::attend(q, k, v, bias, 1.0 / std::sqrt(static_cast<double>(dim_)));
    return hf::detail::dense(y.transpose(1, 2).reshape({B, n, hidden_}), out_proj);
  }
  torch::nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, out_proj{nullptr};

 private:
  std::int64_t hidden_, heads_, dim_;
};
TORCH_MODULE_IMPL(vision_attention, vision_attention_impl);

/// `mlp`: fc2(act(fc1(x))).
class vision_mlp_impl : public torch::nn::Cloneable<vision_mlp_impl> {
 public:
  explicit vision_mlp_impl(const vision_config& c)
      : hidden_(c.hidden_size), inter_(c.intermediate_size), act_(c.hidden_act) {
    reset();
  }
  void reset() override {
    fc1 = register_module("fc1", hf::detail::make_linear(hidden_, inter_, true));
    fc2 = register_module("fc2", hf::detail::make_linear(inter_, hidden_, true));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return hf::detail::dense(activate(hf::detail::dense(x, fc1), act_), fc2);
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};

 private:
  std::int64_t hidden_, inter_;
  std::string act_;
};
TORCH_MODULE_IMPL(vision_mlp, vision_mlp_impl);

/// `encoder.layers.i`: layer_norm1, self_attn, layer_norm2, mlp (pre-norm, residuals).
class vision_layer_impl : public torch::nn::Cloneable<vision_layer_impl> {
 public:
  explicit vision_layer_impl(vision_config c) : c_(std::move(c)) { reset(); }
  void reset() override {
    self_attn = register_module("self_attn", vision_attention(c_));
    layer_norm1 = register_module("layer_norm1", make_layer_norm(c_.hidden_size, c_.layer_norm_eps));
    mlp = register_module("mlp", vision_mlp(c_));
    layer_norm2 = register_module("layer_norm2", make_layer_norm(c_.hidden_size, c_.layer_norm_eps));
  }
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& bias) {
    const auto h = x + self_attn->forward(layer_norm1(x), bias);
    return h + mlp(layer_norm2(h));
  }
  vision_attention self_attn{nullptr};
  torch::nn::LayerNorm layer_norm1{nullptr}, layer_norm2{nullptr};
  vision_mlp mlp{nullptr};

 private:
  vision_config c_;
};
TORCH_MODULE_IMPL(vision_layer, vision_layer_impl);

/// `embeddings`: class_embedding (CLIP), patch_embedding, position_embedding.
class vision_embeddings_impl : public torch::nn::Cloneable<vision_embeddings_impl> {
 public:
  explicit vision_embeddings_impl(vision_config c) : c_(std::move(c)) { reset(); }
  void reset() override {
    if (!c_.is_siglip()) class_embedding = register_parameter("class_embedding", torch::randn({c_.hidden_size}));
    patch_embedding = register_module(
        "patch_embedding", torch::nn::Conv2d(torch::nn::Conv2dOptions(c_.num_channels, c_.hidden_size, c_.patch_size)
                                                 .stride(c_.patch_size)
                                                 .bias(c_.is_siglip())));
    position_embedding = register_module("position_embedding", torch::nn::Embedding(c_.num_positions(), c_.hidden_size));
  }
  /// pixels (B, C, H, W) (checked by the caller) -> (B, [1 +] h*w, hidden), rows in row-major patch order.
  torch::Tensor forward(const torch::Tensor& pixels) {
    const auto& w = patch_embedding->weight;
    const auto B = pixels.size(0);
    const auto h = pixels.size(2) / c_.patch_size, wd = pixels.size(3) / c_.patch_size;
    const auto patches = patch_embedding(pixels.to(w.device(), w.scalar_type())).flatten(2).transpose(1, 2);
    // Rows of the configured grid's table at the same (row, column); CLIP's row 0 is the class token's.
    const auto io = torch::TensorOptions(torch::kInt64).device(w.device());
    auto idx = (torch::arange(h, io).unsqueeze(1) * c_.grid() + torch::arange(wd, io).unsqueeze(0)).reshape({-1});
    const auto& table = position_embedding->weight;
    if (c_.is_siglip()) return patches + table.index_select(0, idx).unsqueeze(0);
    const auto cls = class_embedding.view({1, 1, -1}).expand({B, 1, c_.hidden_size});
    return torch::cat({cls, patches}, 1) + table.index_select(0, torch::cat({torch::zeros({1}, io), idx + 1}))
                                               .unsqueeze(0);
  }
  torch::Tensor class_embedding;
  torch::nn::Conv2d patch_embedding{nullptr};
  torch::nn::Embedding position_embedding{nullptr};

 private:
  vision_config c_;
};
TORCH_MODULE_IMPL(vision_embeddings, vision_embeddings_impl);

/// `vision_model.encoder`: `layers`.
class vision_encoder_impl : public torch::nn::Cloneable<vision_encoder_impl> {
 public:
  explicit vision_encoder_impl(vision_config c) : c_(std::move(c)) { reset(); }
  void reset() override {
    layers = register_module("layers", torch::nn::ModuleList());
    for (std::int64_t i = 0; i < c_.num_hidden_layers; ++i) layers->push_back(vision_layer(c_));
  }
  torch::nn::ModuleList layers{nullptr};

 private:
  vision_config c_;
};
TORCH_MODULE_IMPL(vision_encoder, vision_encoder_impl);

/// `vision_model`: embeddings, pre_layrnorm (CLIP; Hugging Face's spelling), encoder, post_layernorm.
class vision_transformer_impl : public torch::nn::Cloneable<vision_transformer_impl> {
 public:
  explicit vision_transformer_impl(vision_config c) : c_(std::move(c)) { reset(); }
  void reset() override {
    embeddings = register_module("embeddings", vision_embeddings(c_));
    if (!c_.is_siglip()) pre_layrnorm = register_module("pre_layrnorm", make_layer_norm(c_.hidden_size, c_.layer_norm_eps));
    encoder = register_module("encoder", vision_encoder(c_));
    post_layernorm = register_module("post_layernorm", make_layer_norm(c_.hidden_size, c_.layer_norm_eps));
  }
  vision_embeddings embeddings{nullptr};
  torch::nn::LayerNorm pre_layrnorm{nullptr};
  vision_encoder encoder{nullptr};
  torch::nn::LayerNorm post_layernorm{nullptr};

 private:
  vision_config c_;
};
TORCH_MODULE_IMPL(vision_transformer, vision_transformer_impl);

}  // namespace detail

/// A CLIP or SigLIP vision tower (see the file comment).
class clip_vision_impl : public torch::nn::Cloneable<clip_vision_impl>, public lora::adaptable {
 public:
  explicit clip_vision_impl(vision_config c) : c_(std::move(c)) {
    c_.validate();
    reset();
  }

  void reset() override {
    vision_model = register_module("vision_model", detail::vision_transformer(c_));
    // N(0, 0.02) weights, zero biases, unit LayerNorms (a tower built from a config alone).
    torch::NoGradGuard ng;
    for (auto& p : named_parameters()) {
      const auto& name = p.key();
      if (name.find("layer_norm") != std::string::npos || name.find("layrnorm") != std::string::npos ||
          name.find("layernorm") != std::string::npos)
        p.value().fill_(name.ends_with(".weight") ? 1.0 : 0.0);
      else if (name.ends_with(".bias")) p.value().zero_();
      else p.value().normal_(0.0, 0.02);
    }
  }

  const vision_config& config() const { return c_; }

  /// Feature rows of one image of H x W pixels under `strategy`.
  std::int64_t num_features(std::int64_t height, std::int64_t width,
                            select_strategy strategy = select_strategy::drop_first) const {
    const auto n = (height / c_.patch_size) * (width / c_.patch_size) + (c_.is_siglip() ? 0 : 1);
    return strategy == select_strategy::drop_first ? n - 1 : n;
  }

  /// Hidden state `layer` of Hugging Face's `output_hidden_states` (0: embeddings [after
  /// pre_layrnorm]; i: output of layer i; negative: from the end, -1 the last layer's output)
  /// of images `pixels` (B, C, H, W) of one size, rows chosen by `strategy` -> (B, n, hidden).
  /// Runs only the layers it needs.
  torch::Tensor features(const torch::Tensor& pixels, std::int64_t layer = -2,
                         select_strategy strategy = select_strategy::drop_first) const {
    UNIRL_CHECK(pixels.dim() == 4, "vision::clip_vision: pixels must be (B, C, H, W), got sizes ", pixels.sizes());
    check_image(pixels.size(1), pixels.size(2), pixels.size(3), "pixels");
    const auto k = layer_index(layer);
    auto x = run(embed(pixels), torch::Tensor(), k);
    return strategy == select_strategy::drop_first ? x.slice(1, 1) : x;
  }

  /// `features` of images of different sizes (each (C, H, W), or (1, C, H, W)) in ONE forward:
  /// their patch sequences are concatenated into one sequence whose attention is block-diagonal
  /// (no padding). Equal to `features` of each image alone, concatenated -> (sum n_i, hidden).
  /// Images all of one size run as one batch instead (each its own row): the same result, with
  /// attention linear in the number of images rather than quadratic in their total patches.
  torch::Tensor features_packed(const std::vector<torch::Tensor>& images, std::int64_t layer = -2,
                                select_strategy strategy = select_strategy::drop_first) const {
    UNIRL_CHECK(!images.empty(), "vision::clip_vision::features_packed: no images: expected at least one");
    const auto k = layer_index(layer);
    std::vector<torch::Tensor> rows;
    std::vector<std::int64_t> lengths;
    for (std::size_t i = 0; i < images.size(); ++i) {
      auto img = images[i];
      UNIRL_CHECK(img.defined() && (img.dim() == 3 || (img.dim() == 4 && img.size(0) == 1)),
                  "vision::clip_vision::features_packed: image ", i, " must be (C, H, W) or (1, C, H, W), got sizes ",
                  img.defined() ? img.sizes() : torch::IntArrayRef{});
      if (img.dim() == 3) img = img.unsqueeze(0);
      check_image(img.size(1), img.size(2), img.size(3), "image " + std::to_string(i));
      rows.push_back(embed(img));
      lengths.push_back(rows.back().size(1));
    }
    bool same = true;
    for (const auto& r : rows) same = same && r.sizes() == rows.front().sizes();
    if (same && rows.size() > 1) {  // one batch: (B, n, hidden), no mask
      const auto x = run(torch::cat(rows, 0), torch::Tensor(), k);
      const auto kept = strategy == select_strategy::full ? x : x.slice(1, 1);
      return kept.reshape({-1, x.size(2)});
    }
    const auto& w = vision_model.ptr()->embeddings->patch_embedding->weight;
    const auto bias = images.size() == 1 ? torch::Tensor()
                                         : detail::block_diagonal_bias(lengths, w.options().requires_grad(false));
    const auto x = run(torch::cat(rows, 1), bias, k).squeeze(0);
    if (strategy == select_strategy::full) return x;
    std::vector<torch::Tensor> out;
    std::int64_t start = 0;
    for (const auto n : lengths) {
      out.push_back(x.slice(0, start + 1, start + n));
      start += n;
    }
    return torch::cat(out, 0);
  }

  /// Hugging Face's `last_hidden_state`: the last layer's output (B, [1 +] h*w, hidden), after
  /// post_layernorm for SigLIP.
  torch::Tensor last_hidden_state(const torch::Tensor& pixels) const {
    auto x = features(pixels, -1, select_strategy::full);
    return c_.is_siglip() ? vision_model.ptr()->post_layernorm(x) : x;
  }
  torch::Tensor forward(const torch::Tensor& pixels) const { return last_hidden_state(pixels); }

  /// Activation checkpointing of the encoder layers (`checkpoint_kind::vision_tower`) in
  /// forwards with gradients; other kinds throw `config_error`.
  void set_checkpointing(const std::vector<std::string>& kinds) {
    check_checkpointing_kinds(kinds, checkpointing_kinds(), "models::vision::clip_vision");
    checkpoint_layers_ = wants_checkpointing(kinds, checkpoint_kind::vision_tower);
  }
  std::vector<std::string> checkpointing_kinds() const { return {std::string(checkpoint_kind::vision_tower)}; }
  bool checkpoint_layers() const { return checkpoint_layers_; }

  detail::vision_transformer vision_model{nullptr};

 private:
  void check_image(std::int64_t C, std::int64_t H, std::int64_t W, const std::string& what) const {
    const auto p = c_.patch_size, G = c_.grid();
    UNIRL_CHECK(C == c_.num_channels, "vision::clip_vision: ", what, " has ", C, " channels: expected num_channels = ",
                c_.num_channels);
    UNIRL_CHECK(H >= p && W >= p && H % p == 0 && W % p == 0 && H / p <= G && W / p <= G, "vision::clip_vision: ",
                what, " is ", H, " x ", W, " pixels: expected multiples of patch_size = ", p, " from ", p,
                " to image_size = ", c_.image_size);
  }
  std::int64_t layer_index(std::int64_t layer) const {
    const auto L = c_.num_hidden_layers;
    UNIRL_CHECK(layer >= -(L + 1) && layer <= L, "vision::clip_vision: feature layer ", layer, ": expected in [",
                -(L + 1), ", ", L, "] (hidden states 0..", L, " of a tower of ", L, " layers)");
    return layer < 0 ? L + 1 + layer : layer;
  }
  torch::Tensor embed(const torch::Tensor& pixels) const {
    const auto vm = vision_model.ptr();
    auto x = vm->embeddings->forward(pixels);
    return c_.is_siglip() ? x : vm->pre_layrnorm(x);
  }
  // The first k encoder layers on x (B, N, hidden) with an additive bias (or none).
  torch::Tensor run(torch::Tensor x, const torch::Tensor& bias, std::int64_t k) const {
    const bool recompute = checkpoint_layers_ && torch::GradMode::is_enabled();
    const auto layers = vision_model.ptr()->encoder->layers;
    for (std::int64_t i = 0; i < k; ++i) {
      auto layer = layers->ptr<detail::vision_layer_impl>(static_cast<std::size_t>(i));
      if (!recompute) {
        x = layer->forward(x, bias);
        continue;
      }
      x = checkpoint([layer, bias](const torch::autograd::variable_list& in) {
            return torch::autograd::variable_list{layer->forward(in[0], bias)};
          }, {x}, layer->parameters())[0];
    }
    return x;
  }

  vision_config c_;
  bool checkpoint_layers_ = false;
};
TORCH_MODULE_IMPL(clip_vision, clip_vision_impl);

}  // namespace unirl::models::vision

#pragma once
/// \file flow_nets.hpp
/// Small built-in velocity / noise networks for the flow track, class-conditional (or
/// conditioned on an embedding) with a null condition for classifier-free guidance:
/// - `mlp_velocity_net`: a residual MLP over the flattened sample (8x8 digits train in seconds);
/// - `conv_velocity_net`: a FiLM-conditioned residual conv net for (C, H, W) images (8x8, 16x16);
/// - `temporal_velocity_net`: factorised space / time convolutions for clips (F, C, H, W);
/// - `clip_unet_velocity_net`: a small U-Net over short clips with the frames stacked as channels.
///
/// ```cpp
/// using namespace unirl::models;
/// flow_model<conv_velocity_net> m(conv_velocity_net({.channels = 1, .num_classes = 10}), {1, 16, 16});
/// video_flow_model<temporal_velocity_net> v(temporal_velocity_net({.channels = 1, .num_classes = 4}),
///                                           {6, 1, 16, 16});
/// ```
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <boost/hana.hpp>
#include <torch/torch.h>

#include <unirl/core/error.hpp>
#include <unirl/core/options.hpp>
#include <unirl/core/precision.hpp>
#include <unirl/models/activation_checkpoint.hpp>
#include <unirl/models/flow.hpp>
#include <unirl/models/lora.hpp>

namespace unirl::models {

/// How a net is conditioned: `num_classes > 0` for labels (B,) int64 (the null label is
/// `num_classes`), otherwise `cond_dim > 0` for embeddings (B, cond_dim) (the null one is zeros).
struct flow_net_options {
  std::vector<std::int64_t> shape{1, 8, 8};  // mlp: the sample shape it flattens
  std::int64_t channels = 1;                 // conv / temporal: input channels C
  std::int64_t num_classes = 10;
  std::int64_t cond_dim = 0;
  std::int64_t hidden = 256;                 // mlp width / conv channels
  std::int64_t depth = 3;                    // residual blocks
  std::int64_t embed_dim = 64;               // time + condition embedding width

  void validate(const std::string& p) const {
    options::require(num_classes > 0 || cond_dim > 0, p + "num_classes", num_classes,
                     "> 0 (labels), or cond_dim > 0 (embeddings)");
    options::require(hidden >= 1, p + "hidden", hidden, ">= 1");
    options::require(depth >= 1, p + "depth", depth, ">= 1");
    options::require(embed_dim >= 2 && embed_dim % 2 == 0, p + "embed_dim", embed_dim, "even and >= 2");
    options::require(channels >= 1, p + "channels", channels, ">= 1");
  }
};

}  // namespace unirl::models

BOOST_HANA_ADAPT_STRUCT(unirl::models::flow_net_options, shape, channels, num_classes, cond_dim, hidden, depth,
                        embed_dim);

namespace unirl::models {

namespace detail {
/// Activation checkpointing of a flow net's residual blocks (`checkpoint_kind::flow_blocks`):
/// each net holds one of these and runs its blocks through `run`.
struct flow_block_checkpointing {
  bool on = false;

  void set(const std::vector<std::string>& kinds, const char* net) {
    check_checkpointing_kinds(kinds, offered(), net);
    on = wants_checkpointing(kinds, checkpoint_kind::flow_blocks);
  }
  static std::vector<std::string> offered() { return {std::string(checkpoint_kind::flow_blocks)}; }

  /// `body(h, e)` of one block whose parameters are those of `modules`, recomputed in the
  /// backward when on (and gradients are being recorded).
  template <class Body>
  torch::Tensor run(const Body& body, const torch::Tensor& h, const torch::Tensor& e,
                    const std::vector<std::shared_ptr<torch::nn::Module>>& modules) const {
    if (!on || !torch::GradMode::is_enabled()) return body(h, e);
    std::vector<torch::Tensor> params;
    for (const auto& m : modules)
      for (auto& p : m->parameters()) params.push_back(p);
    return checkpoint([body](const torch::autograd::variable_list& in) {
             return torch::autograd::variable_list{body(in[0], in[1])};
           }, {h, e}, params)[0];
  }
};
}  // namespace detail

/// Sinusoidal features of t in [0, 1] followed by a two-layer MLP, plus the condition's embedding.
class condition_embeddingImpl : public torch::nn::Cloneable<condition_embeddingImpl> {
 public:
  explicit condition_embeddingImpl(const flow_net_options& o) : o_(o) { reset(); }

  void reset() override {
    options::validate(o_);
    const auto e = o_.embed_dim;
    time1_ = register_module("time1", torch::nn::Linear(e, e));
    time2_ = register_module("time2", torch::nn::Linear(e, e));
    if (o_.num_classes > 0) labels_ = register_module("labels", torch::nn::Embedding(o_.num_classes + 1, e));
    else project_ = register_module("project", torch::nn::Linear(o_.cond_dim, e));
  }

  /// (B, embed_dim) from t (B,) and the condition.
  torch::Tensor forward(const torch::Tensor& t, const torch::Tensor& cond) {
    const auto half = o_.embed_dim / 2;
    const auto freqs = torch::exp(torch::arange(half, t.options()) * (-std::log(1000.0) / static_cast<double>(half)));
    const auto arg = (t.reshape({-1, 1}) * 1000.0) * freqs.reshape({1, -1});
    auto h = lora::forward(time2_, torch::silu(lora::forward(time1_, torch::cat({arg.sin(), arg.cos()}, 1))));
    if (o_.num_classes > 0) {
      UNIRL_CHECK(cond.dim() == 1 && !cond.is_floating_point(), "flow net: labels must be (B,) integers, got ",
                  cond.sizes(), " ", cond.dtype());
      h = h + labels_(cond.to(torch::kInt64));
    } else {
      UNIRL_CHECK(cond.dim() == 2 && cond.size(1) == o_.cond_dim, "flow net: embeddings have sizes ", cond.sizes(),
                  "; expected (B, ", o_.cond_dim, ")");
      h = h + lora::forward(project_, cond.to(t.scalar_type()));
    }
    return torch::silu(h);
  }

  torch::Tensor null_condition(const torch::Tensor& cond) const {
    return o_.num_classes > 0 ? torch::full_like(cond, o_.num_classes) : torch::zeros_like(cond);
  }

 private:
  flow_net_options o_;
  torch::nn::Linear time1_{nullptr}, time2_{nullptr}, project_{nullptr};
  torch::nn::Embedding labels_{nullptr};
};
TORCH_MODULE(condition_embedding);

/// Residual MLP velocity net over the flattened sample:
/// `h += W2 silu(W1 norm(h) + U e)` per block, e the time + condition embedding.
class mlp_velocity_netImpl : public torch::nn::Cloneable<mlp_velocity_netImpl>, public lora::adaptable {
 public:
  explicit mlp_velocity_netImpl(const flow_net_options& o) : o_(o) { reset(); }

  void reset() override {
    options::validate(o_);
    std::int64_t in = 1;
    for (auto s : o_.shape) in *= s;
    UNIRL_CHECK(in >= 1, "mlp_velocity_net: empty sample shape");
    embed_ = register_module("embed", condition_embedding(o_));
    input_ = register_module("input", torch::nn::Linear(in, o_.hidden));
    blocks_ = register_module("blocks", torch::nn::ModuleList());
    for (std::int64_t i = 0; i < o_.depth; ++i) {
      blocks_->push_back(torch::nn::LayerNorm(torch::nn::LayerNormOptions({o_.hidden})));
      blocks_->push_back(torch::nn::Linear(o_.hidden, o_.hidden));
      blocks_->push_back(torch::nn::Linear(o_.embed_dim, o_.hidden));
      blocks_->push_back(torch::nn::Linear(o_.hidden, o_.hidden));
    }
    output_ = register_module("output", torch::nn::Linear(o_.hidden, in));
    // Start as the zero velocity: training begins from a stable point.
    torch::NoGradGuard ng;
    output_->weight.mul_(0.1);
    output_->bias.zero_();
  }

  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& t, const torch::Tensor& cond) {
    const auto b = x.size(0);
    const auto e = embed_->forward(t, cond);
    auto h = lora::forward(input_, x.reshape({b, -1}));
    for (std::int64_t i = 0; i < o_.depth; ++i) {
      auto norm = std::dynamic_pointer_cast<torch::nn::LayerNormImpl>(blocks_->ptr(4 * i));
      auto w1 = std::dynamic_pointer_cast<torch::nn::LinearImpl>(blocks_->ptr(4 * i + 1));
      auto u = std::dynamic_pointer_cast<torch::nn::LinearImpl>(blocks_->ptr(4 * i + 2));
      auto w2 = std::dynamic_pointer_cast<torch::nn::LinearImpl>(blocks_->ptr(4 * i + 3));
      h = checkpointing_.run([norm, w1, u, w2](const torch::Tensor& x, const torch::Tensor& c) {
            return x + lora::forward(*w2, torch::silu(lora::forward(*w1, norm->forward(upcast(x))) + lora::forward(*u, c)));
          }, h, e, {norm, w1, u, w2});
    }
    return lora::forward(output_, torch::silu(h)).reshape(x.sizes());
  }

  torch::Tensor null_condition(const torch::Tensor& cond) const { return embed_->null_condition(cond); }

  /// Activation checkpointing of the residual blocks (`checkpoint_kind::flow_blocks`).
  void set_checkpointing(const std::vector<std::string>& kinds) { checkpointing_.set(kinds, "mlp_velocity_net"); }
  std::vector<std::string> checkpointing_kinds() const { return detail::flow_block_checkpointing::offered(); }

 private:
  detail::flow_block_checkpointing checkpointing_;
  flow_net_options o_;
  condition_embedding embed_{nullptr};
  torch::nn::Linear input_{nullptr}, output_{nullptr};
  torch::nn::ModuleList blocks_{nullptr};
};
TORCH_MODULE(mlp_velocity_net);

/// FiLM-conditioned residual conv net for (B, C, H, W): every block is
/// `h += conv(silu(norm(h) * (1 + scale(e)) + shift(e)))` at full resolution.
class conv_velocity_netImpl : public torch::nn::Cloneable<conv_velocity_netImpl>, public lora::adaptable {
 public:
  explicit conv_velocity_netImpl(const flow_net_options& o) : o_(o) { reset(); }

  void reset() override {
    options::validate(o_);
    const auto ch = o_.hidden;
    embed_ = register_module("embed", condition_embedding(o_));
    input_ = register_module("input", torch::nn::Conv2d(torch::nn::Conv2dOptions(o_.channels, ch, 3).padding(1)));
    blocks_ = register_module("blocks", torch::nn::ModuleList());
    for (std::int64_t i = 0; i < o_.depth; ++i) {
      blocks_->push_back(torch::nn::GroupNorm(torch::nn::GroupNormOptions(ch % 8 == 0 ? 8 : 1, ch)));
      blocks_->push_back(torch::nn::Linear(o_.embed_dim, 2 * ch));
      blocks_->push_back(torch::nn::Conv2d(torch::nn::Conv2dOptions(ch, ch, 3).padding(1)));
    }
    output_ = register_module("output", torch::nn::Conv2d(torch::nn::Conv2dOptions(ch, o_.channels, 3).padding(1)));
    torch::NoGradGuard ng;
    output_->weight.mul_(0.1);
    output_->bias.zero_();
  }

  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& t, const torch::Tensor& cond) {
    UNIRL_CHECK(x.dim() == 4 && x.size(1) == o_.channels, "conv_velocity_net: input sizes ", x.sizes(),
                "; expected (B, ", o_.channels, ", H, W)");
    const auto e = embed_->forward(t, cond);
    auto h = input_(x);
    for (std::int64_t i = 0; i < o_.depth; ++i) {
      auto norm = std::dynamic_pointer_cast<torch::nn::GroupNormImpl>(blocks_->ptr(3 * i));
      auto film = std::dynamic_pointer_cast<torch::nn::LinearImpl>(blocks_->ptr(3 * i + 1));
      auto conv = std::dynamic_pointer_cast<torch::nn::Conv2dImpl>(blocks_->ptr(3 * i + 2));
      h = checkpointing_.run([norm, film, conv](const torch::Tensor& x, const torch::Tensor& c) {
            const auto ss = lora::forward(*film, c).unsqueeze(-1).unsqueeze(-1).chunk(2, 1);
            return x + conv->forward(torch::silu(norm->forward(upcast(x)) * (1 + ss[0]) + ss[1]));
          }, h, e, {norm, film, conv});
    }
    return output_(torch::silu(h));
  }

  torch::Tensor null_condition(const torch::Tensor& cond) const { return embed_->null_condition(cond); }

  /// Activation checkpointing of the residual blocks (`checkpoint_kind::flow_blocks`).
  void set_checkpointing(const std::vector<std::string>& kinds) { checkpointing_.set(kinds, "conv_velocity_net"); }
  std::vector<std::string> checkpointing_kinds() const { return detail::flow_block_checkpointing::offered(); }

 private:
  detail::flow_block_checkpointing checkpointing_;
  flow_net_options o_;
  condition_embedding embed_{nullptr};
  torch::nn::Conv2d input_{nullptr}, output_{nullptr};
  torch::nn::ModuleList blocks_{nullptr};
};
TORCH_MODULE(conv_velocity_net);

/// Velocity net for clips (B, F, C, H, W): a strided conv down to half resolution, blocks of a
/// (1, 3, 3) spatial and a (3, 1, 1) temporal convolution with FiLM conditioning, then a
/// transposed conv back up with a skip connection. H and W must be even.
class temporal_velocity_netImpl : public torch::nn::Cloneable<temporal_velocity_netImpl>, public lora::adaptable {
 public:
  explicit temporal_velocity_netImpl(const flow_net_options& o) : o_(o) { reset(); }

  void reset() override {
    using torch::nn::Conv3dOptions;
    options::validate(o_);
    const auto ch = o_.hidden;
    embed_ = register_module("embed", condition_embedding(o_));
    input_ = register_module("input", torch::nn::Conv3d(Conv3dOptions(o_.channels, ch, {1, 3, 3}).padding({0, 1, 1})));
    down_ = register_module("down", torch::nn::Conv3d(Conv3dOptions(ch, ch, {1, 4, 4}).stride({1, 2, 2}).padding({0, 1, 1})));
    blocks_ = register_module("blocks", torch::nn::ModuleList());
    for (std::int64_t i = 0; i < o_.depth; ++i) {
      blocks_->push_back(torch::nn::GroupNorm(torch::nn::GroupNormOptions(ch % 8 == 0 ? 8 : 1, ch)));
      blocks_->push_back(torch::nn::Linear(o_.embed_dim, 2 * ch));
      blocks_->push_back(torch::nn::Conv3d(Conv3dOptions(ch, ch, {1, 3, 3}).padding({0, 1, 1})));
      blocks_->push_back(torch::nn::Conv3d(Conv3dOptions(ch, ch, {3, 1, 1}).padding({1, 0, 0})));
    }
    up_ = register_module("up", torch::nn::ConvTranspose3d(
                                    torch::nn::ConvTranspose3dOptions(ch, ch, {1, 4, 4}).stride({1, 2, 2}).padding({0, 1, 1})));
    output_ = register_module("output", torch::nn::Conv3d(Conv3dOptions(2 * ch, o_.channels, {3, 3, 3}).padding(1)));
    torch::NoGradGuard ng;
    output_->weight.mul_(0.1);
    output_->bias.zero_();
  }

  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& t, const torch::Tensor& cond) {
    UNIRL_CHECK(x.dim() == 5 && x.size(2) == o_.channels && x.size(3) % 2 == 0 && x.size(4) % 2 == 0,
                "temporal_velocity_net: input sizes ", x.sizes(), "; expected (B, F, ", o_.channels,
                ", H, W) with even H and W");
    const auto e = embed_->forward(t, cond);
    const auto h0 = torch::silu(input_(x.transpose(1, 2)));  // (B, ch, F, H, W)
    auto h = down_(h0);
    for (std::int64_t i = 0; i < o_.depth; ++i) {
      auto norm = std::dynamic_pointer_cast<torch::nn::GroupNormImpl>(blocks_->ptr(4 * i));
      auto film = std::dynamic_pointer_cast<torch::nn::LinearImpl>(blocks_->ptr(4 * i + 1));
      auto space = std::dynamic_pointer_cast<torch::nn::Conv3dImpl>(blocks_->ptr(4 * i + 2));
      auto time = std::dynamic_pointer_cast<torch::nn::Conv3dImpl>(blocks_->ptr(4 * i + 3));
      h = checkpointing_.run([norm, film, space, time](const torch::Tensor& y, const torch::Tensor& c) {
            const auto ss = lora::forward(*film, c).reshape({y.size(0), -1, 1, 1, 1}).chunk(2, 1);
            return y + time->forward(torch::silu(space->forward(torch::silu(norm->forward(upcast(y)) * (1 + ss[0]) + ss[1]))));
          }, h, e, {norm, film, space, time});
    }
    const auto u = torch::silu(up_(h));
    return output_(torch::cat({u, h0}, 1)).transpose(1, 2);
  }

  torch::Tensor null_condition(const torch::Tensor& cond) const { return embed_->null_condition(cond); }

  /// Activation checkpointing of the residual blocks (`checkpoint_kind::flow_blocks`).
  void set_checkpointing(const std::vector<std::string>& kinds) { checkpointing_.set(kinds, "temporal_velocity_net"); }
  std::vector<std::string> checkpointing_kinds() const { return detail::flow_block_checkpointing::offered(); }

 private:
  detail::flow_block_checkpointing checkpointing_;
  flow_net_options o_;
  condition_embedding embed_{nullptr};
  torch::nn::Conv3d input_{nullptr}, down_{nullptr}, output_{nullptr};
  torch::nn::ConvTranspose3d up_{nullptr};
  torch::nn::ModuleList blocks_{nullptr};
};
TORCH_MODULE(temporal_velocity_net);

namespace detail {
/// A FiLM-conditioned residual block of two 3x3 convolutions:
/// `h + conv2(silu(norm2(conv1(silu(norm1(h) * (1 + scale(e)) + shift(e))))))`.
class film_res_blockImpl : public torch::nn::Cloneable<film_res_blockImpl> {
 public:
  film_res_blockImpl(std::int64_t channels, std::int64_t embed_dim) : ch_(channels), embed_dim_(embed_dim) { reset(); }

  void reset() override {
    using torch::nn::Conv2dOptions;
    const auto groups = ch_ % 8 == 0 ? 8 : 1;
    norm1_ = register_module("norm1", torch::nn::GroupNorm(torch::nn::GroupNormOptions(groups, ch_)));
    film_ = register_module("film", torch::nn::Linear(embed_dim_, 2 * ch_));
    conv1_ = register_module("conv1", torch::nn::Conv2d(Conv2dOptions(ch_, ch_, 3).padding(1)));
    norm2_ = register_module("norm2", torch::nn::GroupNorm(torch::nn::GroupNormOptions(groups, ch_)));
    conv2_ = register_module("conv2", torch::nn::Conv2d(Conv2dOptions(ch_, ch_, 3).padding(1)));
  }

  torch::Tensor forward(const torch::Tensor& h, const torch::Tensor& e) {
    const auto ss = lora::forward(film_, e).unsqueeze(-1).unsqueeze(-1).chunk(2, 1);
    const auto r = conv1_(torch::silu(norm1_(upcast(h)) * (1 + ss[0]) + ss[1]));
    return h + conv2_(torch::silu(norm2_(upcast(r))));
  }

 private:
  std::int64_t ch_, embed_dim_;
  torch::nn::GroupNorm norm1_{nullptr}, norm2_{nullptr};
  torch::nn::Linear film_{nullptr};
  torch::nn::Conv2d conv1_{nullptr}, conv2_{nullptr};
};
TORCH_MODULE(film_res_block);
}  // namespace detail

/// Velocity net for short clips (B, F, C, H, W) with the frames stacked as channels: a small
/// two-level U-Net (H x W, H/2 x W/2 with 2 * hidden channels, H/4 x W/4 with `depth` blocks)
/// of FiLM residual blocks, so every convolution mixes all frames (cheap for a few frames) and
/// the bottleneck sees the whole canvas. `shape` is the clip shape (F, C, H, W), H and W
/// divisible by 4.
/// ```cpp
/// clip_unet_velocity_net net({.shape = {4, 1, 16, 16}, .num_classes = 10, .hidden = 32, .depth = 2});
/// video_flow_model<clip_unet_velocity_net> m(net, {4, 1, 16, 16});
/// ```
class clip_unet_velocity_netImpl : public torch::nn::Cloneable<clip_unet_velocity_netImpl>, public lora::adaptable {
 public:
  explicit clip_unet_velocity_netImpl(const flow_net_options& o) : o_(o) { reset(); }

  void reset() override {
    using torch::nn::Conv2dOptions;
    using torch::nn::ConvTranspose2dOptions;
    options::validate(o_);
    UNIRL_CHECK(o_.shape.size() == 4 && o_.shape[2] % 4 == 0 && o_.shape[3] % 4 == 0,
                "clip_unet_velocity_net: shape ", c10::IntArrayRef(o_.shape),
                "; expected the clip shape (F, C, H, W) with H and W divisible by 4");
    const auto fc = o_.shape[0] * o_.shape[1], ch = o_.hidden, e = o_.embed_dim;
    embed_ = register_module("embed", condition_embedding(o_));
    input_ = register_module("input", torch::nn::Conv2d(Conv2dOptions(fc, ch, 3).padding(1)));
    down1_ = register_module("down1", torch::nn::Conv2d(Conv2dOptions(ch, 2 * ch, 4).stride(2).padding(1)));
    enc_ = register_module("enc", detail::film_res_block(2 * ch, e));
    down2_ = register_module("down2", torch::nn::Conv2d(Conv2dOptions(2 * ch, 2 * ch, 4).stride(2).padding(1)));
    mid_ = register_module("mid", torch::nn::ModuleList());
    for (std::int64_t i = 0; i < o_.depth; ++i) mid_->push_back(detail::film_res_block(2 * ch, e));
    up2_ = register_module("up2", torch::nn::ConvTranspose2d(ConvTranspose2dOptions(2 * ch, 2 * ch, 4).stride(2).padding(1)));
    dec_ = register_module("dec", detail::film_res_block(2 * ch, e));
    up1_ = register_module("up1", torch::nn::ConvTranspose2d(ConvTranspose2dOptions(2 * ch, ch, 4).stride(2).padding(1)));
    output_ = register_module("output", torch::nn::Conv2d(Conv2dOptions(2 * ch, fc, 3).padding(1)));
    torch::NoGradGuard ng;
    output_->weight.mul_(0.1);
    output_->bias.zero_();
  }

  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& t, const torch::Tensor& cond) {
    UNIRL_CHECK(x.dim() == 5 && x.size(1) == o_.shape[0] && x.size(2) == o_.shape[1] && x.size(3) == o_.shape[2] &&
                    x.size(4) == o_.shape[3],
                "clip_unet_velocity_net: input sizes ", x.sizes(), "; expected (B, ", c10::IntArrayRef(o_.shape), ")");
    const auto b = x.size(0);
    const auto e = embed_->forward(t, cond);
    const auto h0 = torch::silu(input_(x.reshape({b, -1, x.size(3), x.size(4)})));  // (B, ch, H, W)
    const auto h1 = res_block(enc_.ptr(), down1_(h0), e);                            // (B, 2ch, H/2, W/2)
    auto h = down2_(h1);                                                               // (B, 2ch, H/4, W/4)
    for (std::int64_t i = 0; i < o_.depth; ++i)
      h = res_block(std::dynamic_pointer_cast<detail::film_res_blockImpl>(mid_->ptr(i)), h, e);
    h = res_block(dec_.ptr(), up2_(h) + h1, e);
    h = torch::silu(up1_(h));
    return output_(torch::cat({h, h0}, 1)).reshape(x.sizes());
  }

  torch::Tensor null_condition(const torch::Tensor& cond) const { return embed_->null_condition(cond); }

  /// Activation checkpointing of the FiLM residual blocks (`checkpoint_kind::flow_blocks`).
  void set_checkpointing(const std::vector<std::string>& kinds) { checkpointing_.set(kinds, "clip_unet_velocity_net"); }
  std::vector<std::string> checkpointing_kinds() const { return detail::flow_block_checkpointing::offered(); }

 private:
  torch::Tensor res_block(const std::shared_ptr<detail::film_res_blockImpl>& b, const torch::Tensor& h,
                          const torch::Tensor& e) const {
    return checkpointing_.run([b](const torch::Tensor& x, const torch::Tensor& c) { return b->forward(x, c); }, h, e,
                              {b});
  }

  detail::flow_block_checkpointing checkpointing_;
  flow_net_options o_;
  condition_embedding embed_{nullptr};
  torch::nn::Conv2d input_{nullptr}, down1_{nullptr}, down2_{nullptr}, output_{nullptr};
  torch::nn::ConvTranspose2d up2_{nullptr}, up1_{nullptr};
  detail::film_res_block enc_{nullptr}, dec_{nullptr};
  torch::nn::ModuleList mid_{nullptr};
};
TORCH_MODULE(clip_unet_velocity_net);

static_assert(ConditionalNet<mlp_velocity_net>);
static_assert(ConditionalNet<conv_velocity_net>);
static_assert(ConditionalNet<temporal_velocity_net>);
static_assert(ModelAdapter<flow_model<mlp_velocity_net>>);
static_assert(VelocityModel<flow_model<mlp_velocity_net>>);
static_assert(ModelAdapter<video_flow_model<temporal_velocity_net>>);
static_assert(VelocityModel<video_flow_model<temporal_velocity_net>>);
static_assert(ConditionalNet<clip_unet_velocity_net>);
static_assert(ModelAdapter<video_flow_model<clip_unet_velocity_net>>);
static_assert(ModelAdapter<ddpm_model<conv_velocity_net>>);
static_assert(NoiseModel<ddpm_model<conv_velocity_net>>);

}  // namespace unirl::models

#pragma once
/// \file autoencoder_kl.hpp
/// `autoencoder_kl`: diffusers' `AutoencoderKL` (the VAE of Stable Diffusion 3 / 3.5, FLUX, SDXL)
/// with diffusers' parameter names (`encoder.down_blocks.0.resnets.0.norm1.weight`,
/// `decoder.mid_block.attentions.0.to_q.weight`, ...).
///
/// ```cpp
/// namespace df = unirl::models::diffusers;
/// df::autoencoder_kl vae(df::autoencoder_kl_config::load("sd3/vae"));
/// auto z = vae->encode_latents(images);      // (B, latent, H/f, W/f): (mean - shift) * scale
/// auto x = vae->decode_latents(z);           // (B, 3, H, W): decode(z / scale + shift)
/// ```
/// Encoder: conv_in, DownEncoderBlock2D stages (ResnetBlock2D x layers_per_block, then a
/// stride-2 conv after zero padding right and bottom, but in the last stage), the mid block
/// (resnet, single-head attention over the pixels with a GroupNorm, resnet), GroupNorm, SiLU,
/// conv_out to the mean and log-variance. Decoder: conv_in, mid block, UpDecoderBlock2D stages
/// (layers_per_block + 1 resnets, then nearest 2x upsampling and a conv), GroupNorm, SiLU,
/// conv_out. GroupNorms use eps 1e-6. `quant_conv` / `post_quant_conv` when the config has them.
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <unirl/core/error.hpp>
#include <unirl/models/diffusers/config.hpp>
#include <unirl/models/hf/causal_lm.hpp>

namespace unirl::models::diffusers {

namespace detail {

inline torch::nn::Conv2d conv(std::int64_t in, std::int64_t out, std::int64_t k, std::int64_t stride = 1,
                              std::int64_t pad = -1) {
  return torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, k).stride(stride).padding(pad < 0 ? k / 2 : pad));
}
inline torch::nn::GroupNorm group_norm(std::int64_t groups, std::int64_t ch) {
  return torch::nn::GroupNorm(torch::nn::GroupNormOptions(groups, ch).eps(1e-6));
}

/// ResnetBlock2D without a time embedding: conv2(silu(norm2(conv1(silu(norm1(x)))))) + shortcut(x).
class resnet_impl : public torch::nn::Cloneable<resnet_impl> {
 public:
  resnet_impl(std::int64_t in, std::int64_t out, std::int64_t groups) : in_(in), out_(out), groups_(groups) { reset(); }
  void reset() override {
    norm1 = register_module("norm1", group_norm(groups_, in_));
    conv1 = register_module("conv1", conv(in_, out_, 3));
    norm2 = register_module("norm2", group_norm(groups_, out_));
    conv2 = register_module("conv2", conv(out_, out_, 3));
    if (in_ != out_) conv_shortcut = register_module("conv_shortcut", conv(in_, out_, 1));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const auto h = conv2(torch::silu(norm2(conv1(torch::silu(norm1(x))))));
    return (conv_shortcut ? conv_shortcut(x) : x) + h;
  }
  torch::nn::GroupNorm norm1{nullptr}, norm2{nullptr};
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr}, conv_shortcut{nullptr};

 private:
  std::int64_t in_, out_, groups_;
};
TORCH_MODULE_IMPL(resnet, resnet_impl);

/// The mid block's attention: group_norm, to_q/k/v, to_out.0, one head over the H*W pixels, residual.
class pixel_attention_impl : public torch::nn::Cloneable<pixel_attention_impl> {
 public:
  pixel_attention_impl(std::int64_t ch, std::int64_t groups) : ch_(ch), groups_(groups) { reset(); }
  void reset() override {
    group_norm = register_module("group_norm", detail::group_norm(groups_, ch_));
    to_q = register_module("to_q", torch::nn::Linear(ch_, ch_));
    to_k = register_module("to_k", torch::nn::Linear(ch_, ch_));
    to_v = register_module("to_v", torch::nn::Linear(ch_, ch_));
    to_out = register_module("to_out", torch::nn::ModuleList());
    to_out->push_back(torch::nn::Linear(ch_, ch_));
    to_out->push_back(torch::nn::Dropout(0.0));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const auto B = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3);
    const auto h = group_norm(x).view({B, C, H * W}).transpose(1, 2);  // (B, HW, C)
    const auto q = to_q(h).unsqueeze(1), k = to_k(h).unsqueeze(1), v = to_v(h).unsqueeze(1);
    const auto y = hf::detail::attend(q, k, v, torch::Tensor(), 1.0 / std::sqrt(static_cast<double>(C))).squeeze(1);
    const auto o = to_out->ptr<torch::nn::LinearImpl>(0)->forward(y);
    return o.transpose(1, 2).reshape({B, C, H, W}) + x;
  }
  torch::nn::GroupNorm group_norm{nullptr};
  torch::nn::Linear to_q{nullptr}, to_k{nullptr}, to_v{nullptr};
  torch::nn::ModuleList to_out{nullptr};

 private:
  std::int64_t ch_, groups_;
};
TORCH_MODULE_IMPL(pixel_attention, pixel_attention_impl);

/// UNetMidBlock2D: resnets.0, attentions.0 (when on), resnets.1.
class mid_block_impl : public torch::nn::Cloneable<mid_block_impl> {
 public:
  mid_block_impl(std::int64_t ch, std::int64_t groups, bool attention) : ch_(ch), groups_(groups), attn_(attention) {
    reset();
  }
  void reset() override {
    resnets = register_module("resnets", torch::nn::ModuleList());
    resnets->push_back(resnet(ch_, ch_, groups_));
    resnets->push_back(resnet(ch_, ch_, groups_));
    if (attn_) {
      attentions = register_module("attentions", torch::nn::ModuleList());
      attentions->push_back(pixel_attention(ch_, groups_));
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    x = resnets->ptr<resnet_impl>(0)->forward(x);
    if (attn_) x = attentions->ptr<pixel_attention_impl>(0)->forward(x);
    return resnets->ptr<resnet_impl>(1)->forward(x);
  }
  torch::nn::ModuleList resnets{nullptr}, attentions{nullptr};

 private:
  std::int64_t ch_, groups_;
  bool attn_;
};
TORCH_MODULE_IMPL(mid_block, mid_block_impl);

/// A conv holder (`downsamplers.0` / `upsamplers.0`: `conv`).
class sampler_conv_impl : public torch::nn::Cloneable<sampler_conv_impl> {
 public:
  sampler_conv_impl(std::int64_t ch, bool down) : ch_(ch), down_(down) { reset(); }
  void reset() override { conv = register_module("conv", down_ ? detail::conv(ch_, ch_, 3, 2, 0) : detail::conv(ch_, ch_, 3)); }
  torch::Tensor forward(const torch::Tensor& x) {
    if (down_) return conv(torch::constant_pad_nd(x, {0, 1, 0, 1}, 0.0));
    return conv(torch::upsample_nearest2d(x, {x.size(2) * 2, x.size(3) * 2}));
  }
  torch::nn::Conv2d conv{nullptr};

 private:
  std::int64_t ch_;
  bool down_;
};
TORCH_MODULE_IMPL(sampler_conv, sampler_conv_impl);

/// DownEncoderBlock2D / UpDecoderBlock2D: resnets, then downsamplers.0 / upsamplers.0 (when set).
class stage_impl : public torch::nn::Cloneable<stage_impl> {
 public:
  stage_impl(std::int64_t in, std::int64_t out, std::int64_t layers, std::int64_t groups, bool resample, bool down)
      : in_(in), out_(out), layers_(layers), groups_(groups), resample_(resample), down_(down) {
    reset();
  }
  void reset() override {
    resnets = register_module("resnets", torch::nn::ModuleList());
    for (std::int64_t i = 0; i < layers_; ++i) resnets->push_back(resnet(i == 0 ? in_ : out_, out_, groups_));
    if (resample_) {
      samplers = register_module(down_ ? "downsamplers" : "upsamplers", torch::nn::ModuleList());
      samplers->push_back(sampler_conv(out_, down_));
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    for (std::int64_t i = 0; i < layers_; ++i) x = resnets->ptr<resnet_impl>(static_cast<std::size_t>(i))->forward(x);
    return resample_ ? samplers->ptr<sampler_conv_impl>(0)->forward(x) : x;
  }
  torch::nn::ModuleList resnets{nullptr}, samplers{nullptr};

 private:
  std::int64_t in_, out_, layers_, groups_;
  bool resample_, down_;
};
TORCH_MODULE_IMPL(stage, stage_impl);

/// `encoder` (down = true) or `decoder`.
class coder_impl : public torch::nn::Cloneable<coder_impl> {
 public:
  coder_impl(const autoencoder_kl_config& c, bool down) : c_(c), down_(down) { reset(); }
  void reset() override {
    const auto& ch = c_.block_out_channels;
    const auto n = ch.size();
    const auto g = c_.norm_num_groups;
    if (down_) {
      conv_in = register_module("conv_in", conv(c_.in_channels, ch[0], 3));
      down_blocks = register_module("down_blocks", torch::nn::ModuleList());
      auto prev = ch[0];
      for (std::size_t i = 0; i < n; ++i) {
        down_blocks->push_back(stage(prev, ch[i], c_.layers_per_block, g, i + 1 < n, true));
        prev = ch[i];
      }
      mid_block = register_module("mid_block", detail::mid_block(ch[n - 1], g, c_.mid_block_add_attention));
      conv_norm_out = register_module("conv_norm_out", group_norm(g, ch[n - 1]));
      conv_out = register_module("conv_out", conv(ch[n - 1], 2 * c_.latent_channels, 3));
    } else {
      conv_in = register_module("conv_in", conv(c_.latent_channels, ch[n - 1], 3));
      mid_block = register_module("mid_block", detail::mid_block(ch[n - 1], g, c_.mid_block_add_attention));
      up_blocks = register_module("up_blocks", torch::nn::ModuleList());
      auto prev = ch[n - 1];
      for (std::size_t i = 0; i < n; ++i) {
        const auto out = ch[n - 1 - i];
        up_blocks->push_back(stage(prev, out, c_.layers_per_block + 1, g, i + 1 < n, false));
        prev = out;
      }
      conv_norm_out = register_module("conv_norm_out", group_norm(g, ch[0]));
      conv_out = register_module("conv_out", conv(ch[0], c_.out_channels, 3));
    }
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = conv_in(x);
    if (down_) {
      for (std::size_t i = 0; i < down_blocks->size(); ++i) h = down_blocks->ptr<stage_impl>(i)->forward(h);
      h = mid_block->forward(h);
    } else {
      h = mid_block->forward(h);
      for (std::size_t i = 0; i < up_blocks->size(); ++i) h = up_blocks->ptr<stage_impl>(i)->forward(h);
    }
    return conv_out(torch::silu(conv_norm_out(h)));
  }
  torch::nn::Conv2d conv_in{nullptr}, conv_out{nullptr};
  torch::nn::ModuleList down_blocks{nullptr}, up_blocks{nullptr};
  detail::mid_block mid_block{nullptr};
  torch::nn::GroupNorm conv_norm_out{nullptr};

 private:
  autoencoder_kl_config c_;
  bool down_;
};
TORCH_MODULE_IMPL(coder, coder_impl);

}  // namespace detail

/// diffusers' AutoencoderKL (see the file comment).
class autoencoder_kl_impl : public torch::nn::Cloneable<autoencoder_kl_impl> {
 public:
  explicit autoencoder_kl_impl(autoencoder_kl_config c) : c_(std::move(c)) { reset(); }
  void reset() override {
    encoder = register_module("encoder", detail::coder(c_, true));
    decoder = register_module("decoder", detail::coder(c_, false));
    const auto l = c_.latent_channels;
    if (c_.use_quant_conv) quant_conv = register_module("quant_conv", detail::conv(2 * l, 2 * l, 1));
    if (c_.use_post_quant_conv) post_quant_conv = register_module("post_quant_conv", detail::conv(l, l, 1));
  }
  const autoencoder_kl_config& config() const { return c_; }
  /// Spatial downsampling factor: 2^(stages - 1).
  std::int64_t downsample_factor() const { return std::int64_t{1} << (c_.block_out_channels.size() - 1); }

  /// The latent distribution's (mean, logvar) of images (B, in_channels, H, W) in [-1, 1]
  /// (logvar clamped to [-30, 20] as diffusers' DiagonalGaussianDistribution).
  std::pair<torch::Tensor, torch::Tensor> encode(const torch::Tensor& images) {
    const auto f = downsample_factor();
    UNIRL_CHECK(images.dim() == 4 && images.size(1) == c_.in_channels && images.size(2) % f == 0 &&
                    images.size(3) % f == 0,
                "diffusers::autoencoder_kl: images of sizes ", images.sizes(), ": expected (B, ", c_.in_channels,
                ", H, W) with H and W multiples of ", f);
    auto m = encoder->forward(images);
    if (quant_conv) m = quant_conv(m);
    const auto parts = m.chunk(2, 1);
    return {parts[0], parts[1].clamp(-30.0, 20.0)};
  }
  /// Images of raw latents z (B, latent_channels, h, w).
  torch::Tensor decode(const torch::Tensor& z) {
    UNIRL_CHECK(z.dim() == 4 && z.size(1) == c_.latent_channels, "diffusers::autoencoder_kl: latents of sizes ",
                z.sizes(), ": expected (B, ", c_.latent_channels, ", h, w)");
    return decoder->forward(post_quant_conv ? post_quant_conv(z) : z);
  }
  /// The latents the transformer sees: (mean - shift_factor) * scaling_factor (`sample` draws
  /// mean + std * noise instead of the mean).
  torch::Tensor encode_latents(const torch::Tensor& images, bool sample = false) {
    auto [mean, logvar] = encode(images);
    const auto z = sample ? mean + (0.5 * logvar).exp() * torch::randn_like(mean) : mean;
    return (z - c_.shift_factor) * c_.scaling_factor;
  }
  /// Images of the transformer's latents: decode(z / scaling_factor + shift_factor).
  torch::Tensor decode_latents(const torch::Tensor& z) { return decode(z / c_.scaling_factor + c_.shift_factor); }

  detail::coder encoder{nullptr}, decoder{nullptr};
  torch::nn::Conv2d quant_conv{nullptr}, post_quant_conv{nullptr};

 private:
  autoencoder_kl_config c_;
};
TORCH_MODULE_IMPL(autoencoder_kl, autoencoder_kl_impl);

}  // namespace unirl::models::diffusers

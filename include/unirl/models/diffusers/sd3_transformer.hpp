#pragma once
/// \file sd3_transformer.hpp
/// `sd3_transformer`: diffusers' `SD3Transformer2DModel` (Stable Diffusion 3 / 3.5's MMDiT) as a
/// `torch::nn` module whose parameter names are diffusers' (`pos_embed.proj.weight`,
/// `transformer_blocks.0.attn.to_q.weight`, `transformer_blocks.0.ff.net.0.proj.weight`, ...), so
/// `named_parameters()` maps 1:1 onto `transformer/diffusion_pytorch_model.safetensors`.
///
/// ```cpp
/// namespace df = unirl::models::diffusers;
/// df::sd3_transformer net(df::sd3_transformer_config::load("sd3/transformer"));
/// auto v = net->forward(latents, timesteps, text_tokens, pooled);   // (B, C, H, W); t in [0, 1000]
/// ```
/// The forward follows diffusers: patch embedding (a strided conv) plus the centre crop of the
/// sin-cos position table (`pos_embed.pos_embed`, pos_embed_max_size^2 rows); the conditioning
/// `temb` = timestep MLP(256 sinusoidal features, cos first) + pooled-text MLP; the text tokens
/// through `context_embedder`; joint-attention blocks (image tokens first, then text) with
/// AdaLN-Zero modulation (shift, scale, gate for attention and MLP; the last block is
/// `context_pre_only`: its text stream gets AdaLayerNormContinuous and no output), optional
/// RMS norm of q and k per head (`qk_norm: rms_norm`, SD3.5); `norm_out` (scale, shift) and
/// `proj_out`, unpatchified. Every linear runs through `lora::forward`, so LoRA attaches to any
/// of them; each block is recomputed in the backward under activation checkpointing
/// (`checkpoint_kind::flow_blocks`). Dropout is not applied.
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <unirl/core/error.hpp>
#include <unirl/models/activation_checkpoint.hpp>
#include <unirl/models/diffusers/config.hpp>
#include <unirl/models/hf/causal_lm.hpp>
#include <unirl/models/lora.hpp>

namespace unirl::models::diffusers {

namespace detail {

inline torch::nn::Linear linear(std::int64_t in, std::int64_t out, bool bias = true) {
  return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(bias));
}

/// LayerNorm without affine parameters (diffusers' `elementwise_affine=False`), eps 1e-6.
inline torch::Tensor plain_layer_norm(const torch::Tensor& x, double eps = 1e-6) {
  return torch::layer_norm(x, {x.size(-1)}, {}, {}, eps);
}

/// diffusers' RMSNorm: x * rsqrt(mean(x^2) + eps) in float32, times the weight.
inline torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps = 1e-6) {
  const auto xf = x.to(torch::kFloat);
  const auto y = xf * torch::rsqrt(xf.pow(2).mean(-1, true) + eps);
  return (y * weight.to(torch::kFloat)).to(x.scalar_type());
}

/// diffusers' `get_timestep_embedding(t, dim, flip_sin_to_cos=True, downscale_freq_shift=0)`:
/// [cos, sin] of t * exp(-ln(10000) k / (dim/2)).
inline torch::Tensor timestep_features(const torch::Tensor& t, std::int64_t dim) {
  const auto half = dim / 2;
  const auto k = torch::arange(half, t.options().dtype(torch::kFloat));
  const auto freqs = torch::exp(k * (-std::log(10000.0) / static_cast<double>(half)));
  const auto arg = t.to(torch::kFloat).reshape({-1, 1}) * freqs.reshape({1, -1});
  return torch::cat({arg.cos(), arg.sin()}, 1);
}

/// diffusers' `get_2d_sincos_pos_embed(dim, grid, base_size)` (float64, then float32): row
/// i * grid + j holds [1-D(dim/2, j * base / grid), 1-D(dim/2, i * base / grid)], 1-D(d, p) =
/// [sin(p w), cos(p w)], w_k = 10000^(-k / (d/2)).
inline torch::Tensor sincos_position_table(std::int64_t dim, std::int64_t grid, std::int64_t base) {
  UNIRL_CHECK(dim % 4 == 0, "diffusers: sin-cos position embedding of width ", dim, ": expected a multiple of 4");
  const auto f64 = torch::TensorOptions(torch::kFloat64);
  const auto pos = torch::arange(grid, f64) / (static_cast<double>(grid) / static_cast<double>(base));
  const auto quarter = dim / 4;
  const auto omega = 1.0 / torch::pow(10000.0, torch::arange(quarter, f64) / static_cast<double>(quarter));
  const auto one_d = [&](const torch::Tensor& p) {
    const auto out = p.reshape({-1, 1}) * omega.reshape({1, -1});
    return torch::cat({out.sin(), out.cos()}, 1);
  };
  const auto w = pos.repeat({grid});                        // column index j of row i*grid + j
  const auto h = pos.repeat_interleave(grid);               // row index i
  return torch::cat({one_d(w), one_d(h)}, 1).to(torch::kFloat).unsqueeze(0);  // (1, grid^2, dim)
}

/// `ff.net.0`: the GELU's projection `proj`.
class gelu_proj_impl : public torch::nn::Cloneable<gelu_proj_impl> {
 public:
  gelu_proj_impl(std::int64_t in, std::int64_t out) : in_(in), out_(out) { reset(); }
  void reset() override { proj = register_module("proj", linear(in_, out_)); }
  torch::nn::Linear proj{nullptr};

 private:
  std::int64_t in_, out_;
};
TORCH_MODULE_IMPL(gelu_proj, gelu_proj_impl);

/// `ff` / `ff_context`: net.0.proj (GELU, tanh) and net.2. (Layers are read from `net` at each
/// call: a clone replaces the list's modules.)
class feed_forward_impl : public torch::nn::Cloneable<feed_forward_impl> {
 public:
  explicit feed_forward_impl(std::int64_t dim) : dim_(dim) { reset(); }
  void reset() override {
    net = register_module("net", torch::nn::ModuleList());
    net->push_back(gelu_proj(dim_, 4 * dim_));
    net->push_back(torch::nn::Dropout(0.0));
    net->push_back(linear(4 * dim_, dim_));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const auto h = torch::gelu(lora::forward(*net->ptr<gelu_proj_impl>(0)->proj, x), "tanh");
    return lora::forward(*net->ptr<torch::nn::LinearImpl>(2), h);
  }
  torch::nn::ModuleList net{nullptr};

 private:
  std::int64_t dim_;
};
TORCH_MODULE_IMPL(feed_forward, feed_forward_impl);

/// diffusers' RMSNorm module (`weight`).
class rms_impl : public torch::nn::Cloneable<rms_impl> {
 public:
  explicit rms_impl(std::int64_t dim) : dim_(dim) { reset(); }
  void reset() override { weight = register_parameter("weight", torch::ones({dim_})); }
  torch::Tensor forward(const torch::Tensor& x) { return rms_norm(x, weight); }
  torch::Tensor weight;

 private:
  std::int64_t dim_;
};
TORCH_MODULE_IMPL(rms, rms_impl);

/// `attn`: to_q/k/v and add_q/k/v_proj (biases), optional RMS norms per head, to_out.0 and (but
/// in the last block) to_add_out.
class joint_attention_impl : public torch::nn::Cloneable<joint_attention_impl> {
 public:
  joint_attention_impl(const sd3_transformer_config& c, bool context_pre_only)
      : c_(c), pre_only_(context_pre_only) {
    reset();
  }
  void reset() override {
    const auto d = c_.inner_dim(), hd = c_.attention_head_dim;
    if (c_.qk_rms_norm) {
      norm_q = register_module("norm_q", rms(hd));
      norm_k = register_module("norm_k", rms(hd));
    }
    to_q = register_module("to_q", linear(d, d));
    to_k = register_module("to_k", linear(d, d));
    to_v = register_module("to_v", linear(d, d));
    add_k_proj = register_module("add_k_proj", linear(d, d));
    add_v_proj = register_module("add_v_proj", linear(d, d));
    add_q_proj = register_module("add_q_proj", linear(d, d));
    to_out = register_module("to_out", torch::nn::ModuleList());
    to_out->push_back(linear(d, d));
    to_out->push_back(torch::nn::Dropout(0.0));
    if (!pre_only_) to_add_out = register_module("to_add_out", linear(d, d));
    if (c_.qk_rms_norm) {
      norm_added_q = register_module("norm_added_q", rms(hd));
      norm_added_k = register_module("norm_added_k", rms(hd));
    }
  }
  /// (image tokens (B, n, d), text tokens (B, m, d)) -> their attention outputs.
  std::pair<torch::Tensor, torch::Tensor> forward(const torch::Tensor& x, const torch::Tensor& ctx) {
    const auto B = x.size(0), n = x.size(1), H = c_.num_attention_heads, hd = c_.attention_head_dim;
    const auto heads = [&](const torch::Tensor& t) { return t.view({B, -1, H, hd}).transpose(1, 2); };
    auto q = heads(lora::forward(to_q, x)), k = heads(lora::forward(to_k, x)), v = heads(lora::forward(to_v, x));
    auto cq = heads(lora::forward(add_q_proj, ctx)), ck = heads(lora::forward(add_k_proj, ctx));
    const auto cv = heads(lora::forward(add_v_proj, ctx));
    if (c_.qk_rms_norm) {
      q = norm_q(q);
      k = norm_k(k);
      cq = norm_added_q(cq);
      ck = norm_added_k(ck);
    }
    const auto y = hf::detail::attend(torch::cat({q, cq}, 2), torch::cat({k, ck}, 2), torch::cat({v, cv}, 2),
                                      torch::Tensor(), 1.0 / std::sqrt(static_cast<double>(hd)))
                       .transpose(1, 2)
                       .reshape({B, -1, H * hd});
    const auto out = lora::forward(*to_out->ptr<torch::nn::LinearImpl>(0), y.slice(1, 0, n));
    if (pre_only_) return {out, torch::Tensor()};
    return {out, lora::forward(to_add_out, y.slice(1, n))};
  }
  torch::nn::Linear to_q{nullptr}, to_k{nullptr}, to_v{nullptr}, add_q_proj{nullptr}, add_k_proj{nullptr},
      add_v_proj{nullptr}, to_add_out{nullptr};
  torch::nn::ModuleList to_out{nullptr};
  rms norm_q{nullptr}, norm_k{nullptr}, norm_added_q{nullptr}, norm_added_k{nullptr};

 private:
  sd3_transformer_config c_;
  bool pre_only_;
};
TORCH_MODULE_IMPL(joint_attention, joint_attention_impl);

/// A module holding one `linear` (AdaLayerNormZero / AdaLayerNormContinuous: norm1.linear, ...).
class modulation_impl : public torch::nn::Cloneable<modulation_impl> {
 public:
  modulation_impl(std::int64_t dim, std::int64_t chunks) : dim_(dim), chunks_(chunks) { reset(); }
  void reset() override { linear = register_module("linear", detail::linear(dim_, chunks_ * dim_)); }
  /// linear(silu(temb)) split into `chunks` (B, 1, dim) pieces.
  std::vector<torch::Tensor> forward(const torch::Tensor& temb) {
    return lora::forward(linear, torch::silu(temb)).unsqueeze(1).chunk(chunks_, -1);
  }
  torch::nn::Linear linear{nullptr};

 private:
  std::int64_t dim_, chunks_;
};
TORCH_MODULE_IMPL(modulation, modulation_impl);

/// `transformer_blocks.i`: JointTransformerBlock.
class joint_block_impl : public torch::nn::Cloneable<joint_block_impl> {
 public:
  joint_block_impl(const sd3_transformer_config& c, bool context_pre_only) : c_(c), pre_only_(context_pre_only) {
    reset();
  }
  void reset() override {
    const auto d = c_.inner_dim();
    norm1 = register_module("norm1", modulation(d, 6));
    norm1_context = register_module("norm1_context", modulation(d, pre_only_ ? 2 : 6));
    attn = register_module("attn", joint_attention(c_, pre_only_));
    ff = register_module("ff", feed_forward(d));
    if (!pre_only_) ff_context = register_module("ff_context", feed_forward(d));
  }
  /// (image tokens, text tokens, temb) -> (image tokens, text tokens; undefined after the last block).
  std::pair<torch::Tensor, torch::Tensor> forward(const torch::Tensor& x, const torch::Tensor& ctx,
                                                  const torch::Tensor& temb) {
    const auto m = norm1->forward(temb);  // shift, scale, gate (attention); shift, scale, gate (MLP)
    const auto mc = norm1_context->forward(temb);
    const auto nx = plain_layer_norm(x) * (1 + m[1]) + m[0];
    const auto nc = pre_only_ ? plain_layer_norm(ctx) * (1 + mc[0]) + mc[1]  // AdaLayerNormContinuous: scale, shift
                              : plain_layer_norm(ctx) * (1 + mc[1]) + mc[0];
    const auto [a, ca] = attn->forward(nx, nc);
    auto h = x + m[2] * a;
    h = h + m[5] * ff->forward(plain_layer_norm(h) * (1 + m[4]) + m[3]);
    if (pre_only_) return {h, torch::Tensor()};
    auto hc = ctx + mc[2] * ca;
    hc = hc + mc[5] * ff_context->forward(plain_layer_norm(hc) * (1 + mc[4]) + mc[3]);
    return {h, hc};
  }
  modulation norm1{nullptr}, norm1_context{nullptr};
  joint_attention attn{nullptr};
  feed_forward ff{nullptr}, ff_context{nullptr};

 private:
  sd3_transformer_config c_;
  bool pre_only_;
};
TORCH_MODULE_IMPL(joint_block, joint_block_impl);

/// A module holding `linear_1` and `linear_2` with SiLU between (TimestepEmbedding, PixArtAlphaTextProjection).
class two_layer_impl : public torch::nn::Cloneable<two_layer_impl> {
 public:
  two_layer_impl(std::int64_t in, std::int64_t out) : in_(in), out_(out) { reset(); }
  void reset() override {
    linear_1 = register_module("linear_1", linear(in_, out_));
    linear_2 = register_module("linear_2", linear(out_, out_));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return lora::forward(linear_2, torch::silu(lora::forward(linear_1, x)));
  }
  torch::nn::Linear linear_1{nullptr}, linear_2{nullptr};

 private:
  std::int64_t in_, out_;
};
TORCH_MODULE_IMPL(two_layer, two_layer_impl);

/// `pos_embed`: the patch projection `proj` and the sin-cos table buffer `pos_embed`.
class patch_embed_impl : public torch::nn::Cloneable<patch_embed_impl> {
 public:
  explicit patch_embed_impl(const sd3_transformer_config& c) : c_(c) { reset(); }
  void reset() override {
    const auto p = c_.patch_size;
    proj = register_module("proj", torch::nn::Conv2d(torch::nn::Conv2dOptions(c_.in_channels, c_.inner_dim(), p).stride(p)));
    pos_embed = register_buffer("pos_embed",
                                sincos_position_table(c_.inner_dim(), c_.pos_embed_max_size, c_.sample_size / p));
  }
  /// Patches of x (B, C, H, W) plus the centre crop of the table -> (B, h*w, inner_dim).
  torch::Tensor forward(const torch::Tensor& x) {
    const auto p = c_.patch_size, M = c_.pos_embed_max_size, h = x.size(2) / p, w = x.size(3) / p;
    const auto top = (M - h) / 2, left = (M - w) / 2;
    const auto pos =
        pos_embed.view({1, M, M, -1}).slice(1, top, top + h).slice(2, left, left + w).reshape({1, h * w, -1});
    return proj(x).flatten(2).transpose(1, 2) + pos;
  }
  torch::nn::Conv2d proj{nullptr};
  torch::Tensor pos_embed;

 private:
  sd3_transformer_config c_;
};
TORCH_MODULE_IMPL(patch_embed, patch_embed_impl);

/// `time_text_embed`: timestep_embedder (on 256 sinusoidal features) + text_embedder (pooled text).
class time_text_embed_impl : public torch::nn::Cloneable<time_text_embed_impl> {
 public:
  explicit time_text_embed_impl(const sd3_transformer_config& c) : c_(c) { reset(); }
  void reset() override {
    timestep_embedder = register_module("timestep_embedder", two_layer(256, c_.inner_dim()));
    text_embedder = register_module("text_embedder", two_layer(c_.pooled_projection_dim, c_.inner_dim()));
  }
  torch::Tensor forward(const torch::Tensor& t, const torch::Tensor& pooled, torch::ScalarType dtype) {
    return timestep_embedder->forward(timestep_features(t, 256).to(dtype)) + text_embedder->forward(pooled.to(dtype));
  }
  two_layer timestep_embedder{nullptr}, text_embedder{nullptr};

 private:
  sd3_transformer_config c_;
};
TORCH_MODULE_IMPL(time_text_embed, time_text_embed_impl);

}  // namespace detail

/// diffusers' SD3Transformer2DModel (see the file comment).
class sd3_transformer_impl : public torch::nn::Cloneable<sd3_transformer_impl>, public lora::adaptable {
 public:
  explicit sd3_transformer_impl(sd3_transformer_config c) : c_(std::move(c)) {
    c_.validate();
    reset();
  }

  void reset() override {
    const auto d = c_.inner_dim(), p = c_.patch_size;
    pos_embed = register_module("pos_embed", detail::patch_embed(c_));
    time_text_embed = register_module("time_text_embed", detail::time_text_embed(c_));
    context_embedder = register_module("context_embedder", detail::linear(c_.joint_attention_dim, d));
    transformer_blocks = register_module("transformer_blocks", torch::nn::ModuleList());
    for (std::int64_t i = 0; i < c_.num_layers; ++i)
      transformer_blocks->push_back(detail::joint_block(c_, i == c_.num_layers - 1));
    norm_out = register_module("norm_out", detail::modulation(d, 2));
    proj_out = register_module("proj_out", detail::linear(d, p * p * c_.out_channels));
  }

  const sd3_transformer_config& config() const { return c_; }

  /// Velocity (B, out_channels, H, W) of latents `x` (B, in_channels, H, W) at diffusers'
  /// timesteps `t` ((B,), sigma * 1000), text tokens `ctx` (B, m, joint_attention_dim) and pooled
  /// text `pooled` (B, pooled_projection_dim). H / patch and W / patch at most pos_embed_max_size.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& t, const torch::Tensor& ctx,
                        const torch::Tensor& pooled) {
    const auto p = c_.patch_size, M = c_.pos_embed_max_size;
    UNIRL_CHECK(x.dim() == 4 && x.size(1) == c_.in_channels && x.size(2) % p == 0 && x.size(3) % p == 0 &&
                    x.size(2) / p <= M && x.size(3) / p <= M,
                "diffusers::sd3_transformer: latents of sizes ", x.sizes(), ": expected (B, ", c_.in_channels,
                ", H, W) with H and W multiples of patch_size = ", p, " and at most ", M * p);
    const auto B = x.size(0), h = x.size(2) / p, w = x.size(3) / p;
    UNIRL_CHECK(t.dim() == 1 && t.size(0) == B, "diffusers::sd3_transformer: timesteps of sizes ", t.sizes(),
                ": expected (", B, ",)");
    UNIRL_CHECK(ctx.dim() == 3 && ctx.size(0) == B && ctx.size(2) == c_.joint_attention_dim,
                "diffusers::sd3_transformer: text tokens of sizes ", ctx.sizes(), ": expected (", B, ", m, ",
                c_.joint_attention_dim, ")");
    UNIRL_CHECK(pooled.dim() == 2 && pooled.size(0) == B && pooled.size(1) == c_.pooled_projection_dim,
                "diffusers::sd3_transformer: pooled text of sizes ", pooled.sizes(), ": expected (", B, ", ",
                c_.pooled_projection_dim, ")");
    auto hs = pos_embed->forward(x);
    const auto temb = time_text_embed->forward(t, pooled, hs.scalar_type());
    auto cs = lora::forward(context_embedder, ctx.to(hs.scalar_type()));
    const bool recompute = checkpoint_ && torch::GradMode::is_enabled();
    for (std::int64_t i = 0; i < c_.num_layers; ++i) {
      auto block = transformer_blocks->ptr<detail::joint_block_impl>(static_cast<std::size_t>(i));
      if (!recompute) {
        std::tie(hs, cs) = block->forward(hs, cs, temb);
        continue;
      }
      const bool last = i == c_.num_layers - 1;
      const auto out = checkpoint([block, last](const torch::autograd::variable_list& in) {
                                    auto [a, b] = block->forward(in[0], in[1], in[2]);
                                    return last ? torch::autograd::variable_list{a}
                                                : torch::autograd::variable_list{a, b};
                                  }, {hs, cs, temb}, block->parameters());
      hs = out[0];
      cs = last ? torch::Tensor() : out[1];
    }
    const auto mo = norm_out->forward(temb);
    hs = lora::forward(proj_out, detail::plain_layer_norm(hs) * (1 + mo[0]) + mo[1]);
    return hs.reshape({B, h, w, p, p, c_.out_channels}).permute({0, 5, 1, 3, 2, 4}).reshape(
        {B, c_.out_channels, h * p, w * p});
  }

  /// Activation checkpointing of the joint blocks (`checkpoint_kind::flow_blocks`).
  void set_checkpointing(const std::vector<std::string>& kinds) {
    check_checkpointing_kinds(kinds, checkpointing_kinds(), "models::diffusers::sd3_transformer");
    checkpoint_ = wants_checkpointing(kinds, checkpoint_kind::flow_blocks);
  }
  std::vector<std::string> checkpointing_kinds() const { return {std::string(checkpoint_kind::flow_blocks)}; }

  detail::patch_embed pos_embed{nullptr};
  detail::time_text_embed time_text_embed{nullptr};
  torch::nn::Linear context_embedder{nullptr}, proj_out{nullptr};
  torch::nn::ModuleList transformer_blocks{nullptr};
  detail::modulation norm_out{nullptr};

 private:
  sd3_transformer_config c_;
  bool checkpoint_ = false;
};
TORCH_MODULE_IMPL(sd3_transformer, sd3_transformer_impl);

}  // namespace unirl::models::diffusers

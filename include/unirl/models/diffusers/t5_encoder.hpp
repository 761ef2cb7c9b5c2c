#pragma once
/// \file t5_encoder.hpp
/// Stable Diffusion 3's third text encoder as a component: transformers' `T5EncoderModel`
/// (`text_encoder_3/`: config.json + model.safetensors), with its parameter names
/// (`shared.weight`, `encoder.block.0.layer.0.SelfAttention.q.weight`, ...,
/// `encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight`,
/// `encoder.block.0.layer.1.DenseReluDense.wi_0.weight`, `encoder.final_layer_norm.weight`).
///
/// ```cpp
/// namespace df = unirl::models::diffusers;
/// auto t5 = df::load_t5_encoder("sd3/text_encoder_3");
/// auto hidden = t5->forward(ids);          // (B, L) int64 -> last_hidden_state (B, L, d_model)
/// ```
/// The forward is transformers' encoder without an attention mask (as SD3's pipeline calls it):
/// token embedding (unscaled); per block, an RMS layer norm (no mean, no bias; variance in
/// float32), self-attention with unscaled scores plus the bucketed bidirectional relative
/// position bias of the first block (shared by every block), the residual; an RMS layer norm,
/// the feed-forward (`gated-gelu`: wo(gelu_tanh(wi_0 x) * wi_1 x); `relu`: wo(relu(wi x))), the
/// residual; then `final_layer_norm`. Scope: the encoder takes token ids — T5's SentencePiece
/// tokenizer is outside this header — and `sd3_pipeline::encode_prompts` feeds it zero T5
/// tokens (docs/flow.md).
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <unirl/core/error.hpp>
#include <unirl/core/host.hpp>
#include <unirl/io/safetensors.hpp>
#include <unirl/models/diffusers/config.hpp>

namespace unirl::models::diffusers {

/// transformers' T5Config, the keys an encoder reads (see `from_json` for the rest).
struct t5_encoder_config {
  std::int64_t vocab_size = 32128;
  std::int64_t d_model = 4096;
  std::int64_t d_kv = 64;
  std::int64_t d_ff = 10240;
  std::int64_t num_layers = 24;
  std::int64_t num_heads = 64;
  std::int64_t relative_attention_num_buckets = 32;
  std::int64_t relative_attention_max_distance = 128;
  double layer_norm_epsilon = 1e-6;
  bool gated = true;  // feed_forward_proj "gated-gelu" (T5 v1.1, SD3's T5-XXL); false: "relu"

  static t5_encoder_config from_json(const nlohmann::json& j, const std::string& source) {
    detail::keys k(j, source);
    t5_encoder_config c;
    if (const auto* a = k.find("architectures"))
      UNIRL_CHECK(a->is_array() && a->size() == 1 && ((*a)[0] == "T5EncoderModel" || (*a)[0] == "T5ForConditionalGeneration"),
                  k.where("architectures"), " = ", a->dump(), ": expected [\"T5EncoderModel\"]");
    k.fixed("model_type", "t5", "a T5 encoder");
    c.vocab_size = k.positive("vocab_size", 32128);
    c.d_model = k.positive("d_model", 512);
    c.d_kv = k.positive("d_kv", 64);
    c.d_ff = k.positive("d_ff", 2048);
    c.num_layers = k.positive("num_layers", 6);
    c.num_heads = k.positive("num_heads", 8);
    c.relative_attention_num_buckets = k.positive("relative_attention_num_buckets", 32);
    c.relative_attention_max_distance = k.positive("relative_attention_max_distance", 128);
    UNIRL_CHECK(c.relative_attention_num_buckets >= 4 &&
                    c.relative_attention_max_distance > c.relative_attention_num_buckets / 4,
                k.where("relative_attention_max_distance"), " = ", c.relative_attention_max_distance,
                ": expected more than relative_attention_num_buckets / 4 (with at least 4 buckets)");
    c.layer_norm_epsilon = k.number("layer_norm_epsilon", 1e-6);
    const auto ff = k.string("feed_forward_proj", "relu");
    UNIRL_CHECK(ff == "gated-gelu" || ff == "relu", k.where("feed_forward_proj"), " = \"", ff,
                "\": unsupported; expected gated-gelu or relu");
    c.gated = ff == "gated-gelu";
    // Derived by T5Config from feed_forward_proj; when present they must agree with it.
    if (const auto* g = k.find("is_gated_act"))
      UNIRL_CHECK(*g == c.gated, k.where("is_gated_act"), " = ", g->dump(), ": expected ", c.gated,
                  " (feed_forward_proj = \"", ff, "\")");
    k.fixed("dense_act_fn", c.gated ? "gelu_new" : "relu", "the feed-forward's activation");
    if (const auto* d = k.find("torch_dtype"))
      UNIRL_CHECK(*d == "float32" || *d == "bfloat16" || *d == "float16", k.where("torch_dtype"), " = ", d->dump(),
                  ": expected \"float32\", \"bfloat16\" or \"float16\"");
    // The decoder's, the generation's and training's keys: no effect on the encoder's forward.
    for (const char* key : {"num_decoder_layers", "decoder_start_token_id", "eos_token_id", "pad_token_id",
                            "dropout_rate", "classifier_dropout", "initializer_factor", "is_encoder_decoder",
                            "use_cache", "tie_word_embeddings", "transformers_version", "n_positions",
                            "output_past", "task_specific_params"})
      k.ignored(key);
    k.finish();
    return c;
  }
  static t5_encoder_config load(const std::filesystem::path& file_or_dir) {
    const auto f = detail::config_file(file_or_dir, "config.json");
    return from_json(detail::read_json(f), f.string());
  }
};

namespace detail {

inline torch::nn::Linear t5_linear(std::int64_t in, std::int64_t out) {
  return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false));
}

/// T5's layer norm: x / sqrt(mean(x^2) + eps) * weight, the variance in float32.
class t5_layer_norm_impl : public torch::nn::Cloneable<t5_layer_norm_impl> {
 public:
  t5_layer_norm_impl(std::int64_t dim, double eps) : dim_(dim), eps_(eps) { reset(); }
  void reset() override { weight = register_parameter("weight", torch::ones({dim_})); }
  torch::Tensor forward(const torch::Tensor& x) {
    const auto var = x.to(torch::kFloat).pow(2).mean(-1, /*keepdim=*/true);
    return weight * (x * torch::rsqrt(var + eps_)).to(weight.scalar_type());
  }
  torch::Tensor weight;

 private:
  std::int64_t dim_;
  double eps_;
};
TORCH_MODULE_IMPL(t5_layer_norm, t5_layer_norm_impl);

/// transformers' `T5Attention._relative_position_bucket` (bidirectional) of `rel` = key - query.
inline torch::Tensor t5_relative_bucket(const torch::Tensor& rel, std::int64_t num_buckets, std::int64_t max_distance) {
  const auto half = num_buckets / 2;
  auto buckets = (rel > 0).to(torch::kLong) * half;
  const auto a = rel.abs();
  const auto max_exact = half / 2;
  const auto large = (max_exact + (torch::log(a.to(torch::kFloat) / static_cast<double>(max_exact)) /
                                   std::log(static_cast<double>(max_distance) / static_cast<double>(max_exact)) *
                                   static_cast<double>(half - max_exact))
                                      .to(torch::kLong))
                         .clamp_max(half - 1);
  return buckets + torch::where(a < max_exact, a, large);
}

class t5_attention_impl : public torch::nn::Cloneable<t5_attention_impl> {
 public:
  t5_attention_impl(const t5_encoder_config& c, bool has_bias) : c_(c), has_bias_(has_bias) { reset(); }
  void reset() override {
    const auto inner = c_.num_heads * c_.d_kv;
    q = register_module("q", detail::t5_linear(c_.d_model, inner));
    k = register_module("k", detail::t5_linear(c_.d_model, inner));
    v = register_module("v", detail::t5_linear(c_.d_model, inner));
    o = register_module("o", detail::t5_linear(inner, c_.d_model));
    if (has_bias_)
      relative_attention_bias =
          register_module("relative_attention_bias", torch::nn::Embedding(c_.relative_attention_num_buckets, c_.num_heads));
  }
  /// The (1, H, n, n) position bias of n tokens (the first block's table).
  torch::Tensor bias(std::int64_t n) {
    UNIRL_CHECK(has_bias_, "t5_encoder: the position bias lives in the first block");
    const auto pos = torch::arange(n, torch::TensorOptions(torch::kLong).device(relative_attention_bias->weight.device()));
    const auto b = t5_relative_bucket(pos.unsqueeze(0) - pos.unsqueeze(1), c_.relative_attention_num_buckets,
                                      c_.relative_attention_max_distance);
    return relative_attention_bias->forward(b).permute({2, 0, 1}).unsqueeze(0);
  }
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& position_bias) {
    const auto B = x.size(0), n = x.size(1);
    auto split = [&](const torch::Tensor& t) { return t.view({B, n, c_.num_heads, c_.d_kv}).transpose(1, 2); };
    const auto qh = split(q->forward(x)), kh = split(k->forward(x)), vh = split(v->forward(x));
    // No 1 / sqrt(d_kv): T5 folds it into the initialisation.
    const auto scores = torch::matmul(qh, kh.transpose(-1, -2)) + position_bias.to(qh.scalar_type());
    const auto w = torch::softmax(scores.to(torch::kFloat), -1).to(scores.scalar_type());
    return o->forward(torch::matmul(w, vh).transpose(1, 2).reshape({B, n, -1}));
  }
  torch::nn::Linear q{nullptr}, k{nullptr}, v{nullptr}, o{nullptr};
  torch::nn::Embedding relative_attention_bias{nullptr};

 private:
  t5_encoder_config c_;
  bool has_bias_;
};
TORCH_MODULE_IMPL(t5_attention, t5_attention_impl);

// `layer.0`: pre-norm self-attention with the residual.
class t5_self_attention_layer_impl : public torch::nn::Cloneable<t5_self_attention_layer_impl> {
 public:
  t5_self_attention_layer_impl(const t5_encoder_config& c, bool has_bias) : c_(c), has_bias_(has_bias) { reset(); }
  void reset() override {
    SelfAttention = register_module("SelfAttention", t5_attention(c_, has_bias_));
    layer_norm = register_module("layer_norm", t5_layer_norm(c_.d_model, c_.layer_norm_epsilon));
  }
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& bias) {
    return x + SelfAttention->forward(layer_norm->forward(x), bias);
  }
  t5_attention SelfAttention{nullptr};
  t5_layer_norm layer_norm{nullptr};

 private:
  t5_encoder_config c_;
  bool has_bias_;
};
TORCH_MODULE_IMPL(t5_self_attention_layer, t5_self_attention_layer_impl);

// `DenseReluDense`: gated-gelu (wi_0, wi_1, wo) or relu (wi, wo).
class t5_dense_impl : public torch::nn::Cloneable<t5_dense_impl> {
 public:
  explicit t5_dense_impl(const t5_encoder_config& c) : c_(c) { reset(); }
  void reset() override {
    if (c_.gated) {
      wi_0 = register_module("wi_0", t5_linear(c_.d_model, c_.d_ff));
      wi_1 = register_module("wi_1", t5_linear(c_.d_model, c_.d_ff));
    } else {
      wi = register_module("wi", t5_linear(c_.d_model, c_.d_ff));
    }
    wo = register_module("wo", t5_linear(c_.d_ff, c_.d_model));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    if (c_.gated) return wo->forward(torch::gelu(wi_0->forward(x), "tanh") * wi_1->forward(x));
    return wo->forward(torch::relu(wi->forward(x)));
  }
  torch::nn::Linear wi{nullptr}, wi_0{nullptr}, wi_1{nullptr}, wo{nullptr};

 private:
  t5_encoder_config c_;
};
TORCH_MODULE_IMPL(t5_dense, t5_dense_impl);

// `layer.1`: pre-norm feed-forward with the residual.
class t5_ff_layer_impl : public torch::nn::Cloneable<t5_ff_layer_impl> {
 public:
  explicit t5_ff_layer_impl(const t5_encoder_config& c) : c_(c) { reset(); }
  void reset() override {
    DenseReluDense = register_module("DenseReluDense", t5_dense(c_));
    layer_norm = register_module("layer_norm", t5_layer_norm(c_.d_model, c_.layer_norm_epsilon));
  }
  torch::Tensor forward(const torch::Tensor& x) { return x + DenseReluDense->forward(layer_norm->forward(x)); }
  t5_dense DenseReluDense{nullptr};
  t5_layer_norm layer_norm{nullptr};

 private:
  t5_encoder_config c_;
};
TORCH_MODULE_IMPL(t5_ff_layer, t5_ff_layer_impl);

// `encoder`: the blocks (`block.<i>.layer.{0,1}`) and `final_layer_norm`.
class t5_stack_impl : public torch::nn::Cloneable<t5_stack_impl> {
 public:
  explicit t5_stack_impl(const t5_encoder_config& c) : c_(c) { reset(); }
  void reset() override {
    block = register_module("block", torch::nn::ModuleList());
    for (std::int64_t i = 0; i < c_.num_layers; ++i) {
      torch::nn::ModuleList layer;
      layer->push_back(t5_self_attention_layer(c_, i == 0));
      layer->push_back(t5_ff_layer(c_));
      block->push_back(std::make_shared<t5_block>(layer));
    }
    final_layer_norm = register_module("final_layer_norm", t5_layer_norm(c_.d_model, c_.layer_norm_epsilon));
  }
  // A block: its two layers under `layer` (transformers' names).
  struct t5_block : torch::nn::Module {
    explicit t5_block(torch::nn::ModuleList l) : layer(register_module("layer", std::move(l))) {}
    torch::nn::ModuleList layer;
  };
  torch::Tensor forward(const torch::Tensor& x0) {
    auto first = block->ptr<t5_block>(0)->layer->ptr<t5_self_attention_layer_impl>(0);
    const auto bias = first->SelfAttention->bias(x0.size(1));  // the first block's, shared by every block
    auto x = x0;
    for (std::size_t i = 0; i < block->size(); ++i) {
      const auto& l = block->ptr<t5_block>(i)->layer;
      x = l->ptr<t5_self_attention_layer_impl>(0)->forward(x, bias);
      x = l->ptr<t5_ff_layer_impl>(1)->forward(x);
    }
    return final_layer_norm->forward(x);
  }
  torch::nn::ModuleList block{nullptr};
  t5_layer_norm final_layer_norm{nullptr};

 private:
  t5_encoder_config c_;
};
TORCH_MODULE_IMPL(t5_stack, t5_stack_impl);

}  // namespace detail

/// transformers' `T5EncoderModel` (see the file comment).
class t5_encoder_impl : public torch::nn::Cloneable<t5_encoder_impl> {
 public:
  explicit t5_encoder_impl(const t5_encoder_config& c) : c_(c) { reset(); }
  void reset() override {
    shared = register_module("shared", torch::nn::Embedding(c_.vocab_size, c_.d_model));
    encoder = register_module("encoder", detail::t5_stack(c_));
  }
  /// last_hidden_state (B, L, d_model) of token ids (B, L) int64 (no attention mask).
  torch::Tensor forward(const torch::Tensor& ids) {
    UNIRL_CHECK(ids.dim() == 2 && !ids.is_floating_point(), "t5_encoder: ids of sizes ", ids.sizes(), " ", ids.dtype(),
                ": expected (B, L) integer token ids");
    UNIRL_CHECK(ids.numel() > 0, "t5_encoder: ids of sizes ", ids.sizes(), ": expected at least one token");
    const auto range = to_host(torch::stack({ids.min(), ids.max()}));  // one counted read for both bounds
    const auto lo = static_cast<std::int64_t>(range[0]), hi = static_cast<std::int64_t>(range[1]);
    UNIRL_CHECK(lo >= 0 && hi < c_.vocab_size, "t5_encoder: token ids in [", lo, ", ", hi, "]: expected [0, ",
                c_.vocab_size, ")");
    return encoder->forward(shared->forward(ids.to(torch::kLong)));
  }
  const t5_encoder_config& config() const { return c_; }
  torch::nn::Embedding shared{nullptr};
  detail::t5_stack encoder{nullptr};

 private:
  t5_encoder_config c_;
};
TORCH_MODULE_IMPL(t5_encoder, t5_encoder_impl);

/// A `text_encoder_3/` folder: config.json (every key checked) and model.safetensors (or its
/// index and shards) loaded in `dtype`. transformers' tied `encoder.embed_tokens.weight` is the
/// embedding when `shared.weight` is absent, and ignored beside it.
inline t5_encoder load_t5_encoder(const std::filesystem::path& dir, torch::ScalarType dtype = torch::kFloat) {
  t5_encoder enc(t5_encoder_config::load(dir));
  enc->to(dtype);
  std::error_code ec;
  const auto single = dir / "model.safetensors";
  const io::safetensors_checkpoint ckpt(std::filesystem::is_regular_file(single, ec) ? single
                                                                                      : dir / "model.safetensors.index.json");
  std::vector<std::pair<std::string, torch::Tensor>> targets;
  for (const auto& p : enc->named_parameters()) {
    const bool alias = p.key() == "shared.weight" && !ckpt.contains("shared.weight");
    targets.emplace_back(alias ? "encoder.embed_tokens.weight" : p.key(), p.value());
  }
  io::load_into(targets, ckpt, {.ignore_unexpected = {"encoder.embed_tokens.weight"}});
  return enc;
}

}  // namespace unirl::models::diffusers

#pragma once
/// \file causal_lm.hpp
/// Hugging Face decoder architectures as one `CausalLM` adapter: `hf::causal_lm` holds either
/// the Llama-family stack (LlamaForCausalLM; Qwen2ForCausalLM with q/k/v biases;
/// Qwen3ForCausalLM with per-head q_norm / k_norm and an explicit head_dim) or the GPT-2 stack
/// (GPT2LMHeadModel: learned positions, LayerNorm, Conv1D weights stored (in, out), gelu_new),
/// so one trainer type trains any of them. Parameter names are Hugging Face's own
/// (`model.layers.0.self_attn.q_proj.weight`, `transformer.h.0.attn.c_attn.weight`, `lm_head.weight`),
/// so `named_parameters()` maps 1:1 onto a checkpoint (`hf/pretrained.hpp` loads and saves them).
///
/// ```cpp
/// auto lm = unirl::models::hf::from_pretrained("Qwen2.5-0.5B");      // hf/pretrained.hpp
/// auto logits = lm.logits(ids, mask);                                  // (B, L, V)
/// auto cache = lm.make_cache(B, 64);                                   // keys/values of the KV heads only
/// auto next = lm.logits_cached(ids, mask, cache);                      // same logits, incrementally
/// unirl::trainer<unirl::models::hf::causal_lm, unirl::algo::grpo<>, my_reward> t{lm, reward, {}};
/// ```
/// Numerics follow Hugging Face's eager forward: RMSNorm in float32 (`x.to(float32)`, variance,
/// rsqrt, `weight * x.to(input dtype)`), RoPE in the rotate_half form with cos/sin computed in
/// float32, grouped-query attention (each KV head serves its query heads without being copied),
/// SwiGLU, gelu_new. A one-row step (decoding at batch 1) runs its projections as gemv. Positions count real tokens (the mask's cumsum), so padding may sit anywhere.
/// Dropout is not applied (train and eval forwards are the same).
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <numbers>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <unirl/concepts/parallel.hpp>
#include <unirl/core/error.hpp>
#include <unirl/models/activation_checkpoint.hpp>
#include <unirl/models/causal_lm.hpp>
#include <unirl/models/gpt.hpp>
#include <unirl/models/hf/config.hpp>
#include <unirl/detail/compat.hpp>
#include <unirl/models/lora.hpp>
#include <unirl/models/module_adapter.hpp>
#include <unirl/ops/attention.hpp>
#include <unirl/ops/paged_attention.hpp>
#include <unirl/rollout/token.hpp>

namespace unirl::models::hf {

namespace detail {

/// RMSNorm as Hugging Face computes it: float32 statistics, then `weight * x.to(input dtype)`.
inline torch::Tensor rms_normalize(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  const auto h = x.to(torch::kFloat);
  const auto variance = h.pow(2).mean(-1, /*keepdim=*/true);
  return weight * (h * torch::rsqrt(variance + eps)).to(x.scalar_type());
}

/// (x1, x2) -> (-x2, x1) over the last dimension's halves.
inline torch::Tensor rotate_half(const torch::Tensor& x) {
  const auto half = x.size(-1) / 2;
  return torch::cat({-x.slice(-1, half), x.slice(-1, 0, half)}, -1);
}

/// cos and sin (B, n, head_dim) of positions (B, n) int64, computed in float32, cast to `dtype`.
inline std::pair<torch::Tensor, torch::Tensor> rope_cos_sin(const torch::Tensor& positions, std::int64_t head_dim,
                                                            double theta, torch::ScalarType dtype) {
  const auto fopts = torch::TensorOptions(torch::kFloat).device(positions.device());
  const auto exponent = torch::arange(0, head_dim, 2, fopts.dtype(torch::kInt64)).to(torch::kFloat) /
                        static_cast<double>(head_dim);
  const auto inv_freq = 1.0 / torch::pow(theta, exponent);                              // (D/2,)
  const auto freqs = positions.to(torch::kFloat).unsqueeze(-1) * inv_freq.view({1, 1, -1});  // (B, n, D/2)
  const auto emb = torch::cat({freqs, freqs}, -1);
  return {emb.cos().to(dtype), emb.sin().to(dtype)};
}

/// GPT-2's gelu_new: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
inline torch::Tensor gelu_new(const torch::Tensor& x) {
  return 0.5 * x * (1.0 + torch::tanh(std::sqrt(2.0 / std::numbers::pi) * (x + 0.044715 * torch::pow(x, 3.0))));
}

/// softmax(q k^T * scale + bias) v. Float and double run `ops::attention` (the fused CPU kernel
/// where it is faster); half and bfloat16 follow Hugging Face's eager order (scores in the
/// weights' dtype, softmax in float32, probabilities cast back).
inline torch::Tensor attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                            const torch::Tensor& bias, double scale) {
  if (q.scalar_type() == torch::kFloat || q.scalar_type() == torch::kDouble)
    return ops::attention(q, k, v, bias.defined() ? bias.to(q.scalar_type()) : bias, scale);
  auto s = torch::matmul(q, k.transpose(-2, -1)) * scale;
  if (bias.defined()) s = s + bias.to(s.scalar_type());
  return torch::matmul(torch::softmax(s, -1, torch::kFloat).to(q.scalar_type()), v);
}

/// (B, H_kv, S, D) -> (B, H_kv * groups, S, D): query head h reads KV head h / groups.
inline torch::Tensor repeat_kv(const torch::Tensor& x, std::int64_t groups) {
  if (groups == 1) return x;
  const auto B = x.size(0), H = x.size(1), S = x.size(2), D = x.size(3);
  return x.unsqueeze(2).expand({B, H, groups, S, D}).reshape({B, H * groups, S, D});
}

/// Grouped-query attention without copying keys and values per query head: q (B, H, n, D),
/// k / v (B, H_kv, S, D) with H = H_kv * groups, bias (B|R, 1, n, S). The `groups` query heads
/// of a KV head become `groups * n` query rows of that head — the same dot products as
/// `attend(q, repeat_kv(k), repeat_kv(v))` without the (B, H, S, D) copies, forward or backward.
inline torch::Tensor attend_grouped(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                    const torch::Tensor& bias, double scale, std::int64_t groups) {
  if (groups == 1) return attend(q, k, v, bias, scale);
  const auto B = q.size(0), H = q.size(1), n = q.size(2), D = q.size(3), S = k.size(2);
  const auto qg = q.reshape({B, H / groups, groups * n, D});  // a view for a decoding step (n = 1)
  torch::Tensor bg = bias;  // (B, 1, n, S): one row per query position, the same for every head
  if (bias.defined() && n > 1)
    bg = bias.unsqueeze(2).expand({bias.size(0), bias.size(1), groups, n, S}).reshape(
        {bias.size(0), bias.size(1), groups * n, S});
  return attend(qg, k, v, bg, scale).view({B, H, n, D});
}

/// x (..., in) @ weight^T (+ bias), weight (out, in). A single row — a decoding step at batch 1 —
/// runs as a matrix-vector product: LibTorch hands a one-row matmul to BLAS gemm, which packs
/// the whole weight before using it (bench_hf: several times slower than gemv at Qwen2.5 shapes).
inline torch::Tensor dense(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias = {}) {
  const auto st = x.scalar_type();
  if (x.numel() == x.size(-1) && (st == torch::kFloat || st == torch::kDouble) && x.device().is_cpu()) {
    auto sizes = x.sizes().vec();
    sizes.back() = weight.size(0);
    const auto row = x.reshape({-1});
    return (bias.defined() ? torch::addmv(bias, weight, row) : torch::mv(weight, row)).view(sizes);
  }
  return ::unirl::detail::compat::linear(x, weight, bias);
}

/// `dense` of a linear layer, plus its LoRA adapter when it has one (lora.hpp).
inline torch::Tensor dense(const torch::Tensor& x, const torch::nn::Linear& l) {
  return lora::adapt(*l.ptr(), x, dense(x, l->weight, l->bias));
}

/// Linear layers over the same input (q/k/v; gate/up) as one matmul where that pays: forwards
/// without gradients of more than one row (decoding at batch > 1, prefill), whose small matmuls
/// (k_proj, v_proj: 128 outputs at Qwen2.5-0.5B shapes) use BLAS poorly. The weights and biases
/// are concatenated on first use and kept until a part changes — new storage (a load, a move, a
/// clone) or a new version (an optimizer step) — so the parameters keep their Hugging Face names
/// and remain the only trained state. With gradients, or for one row (gemv reads the same bytes
/// either way), the layers run one by one. Not for concurrent forwards of one module.
class fused_linears {
 public:
  /// The outputs of `parts` on x (..., in), in order; fused outputs are views of one (..., sum out).
  std::vector<torch::Tensor> operator()(const torch::Tensor& x, const std::vector<torch::nn::Linear>& parts) {
    std::vector<torch::Tensor> out;
    if (torch::GradMode::is_enabled() || x.numel() == x.size(-1)) {
      for (const auto& p : parts) out.push_back(dense(x, p));
      return out;
    }
    refresh(parts);
    out = ::unirl::detail::compat::linear(x, weight_, bias_).split_with_sizes(sizes_, -1);
    for (std::size_t i = 0; i < parts.size(); ++i) out[i] = lora::adapt(*parts[i].ptr(), x, out[i]);  // LoRA adapters, if any
    return out;
  }

 private:
  void refresh(const std::vector<torch::nn::Linear>& parts) {
    std::vector<std::int64_t> key;
    for (const auto& p : parts)
      for (const auto* t : {&p->weight, &p->bias})
        if (t->defined())
          key.insert(key.end(), {reinterpret_cast<std::int64_t>(t->data_ptr()), static_cast<std::int64_t>(t->_version())});
    if (key == key_ && weight_.defined()) return;
    torch::NoGradGuard ng;
    std::vector<torch::Tensor> w, b;
    sizes_.clear();
    for (const auto& p : parts) {
      w.push_back(p->weight);
      if (p->bias.defined()) b.push_back(p->bias);
      sizes_.push_back(p->weight.size(0));
    }
    UNIRL_CHECK(b.empty() || b.size() == parts.size(), "hf::fused_linears: ", b.size(), " of ", parts.size(),
                " layers have a bias: expected all or none");
    weight_ = torch::cat(w, 0);
    bias_ = b.empty() ? torch::Tensor() : torch::cat(b, 0);
    key_ = std::move(key);
  }
  torch::Tensor weight_, bias_;
  std::vector<std::int64_t> sizes_, key_;
};

/// (B, 1, n, S) additive mask for queries at slots [start, start+n) over keys [0, S): a query
/// sees real keys at or before it, and always itself (a padding row never softmaxes over nothing).
inline torch::Tensor attention_bias(const torch::Tensor& key_mask, std::int64_t start, std::int64_t n) {
  const auto dev = key_mask.device();
  const auto S = key_mask.size(1);
  const auto qi = torch::arange(start, start + n, torch::TensorOptions(torch::kInt64).device(dev)).unsqueeze(1);
  const auto kj = torch::arange(S, torch::TensorOptions(torch::kInt64).device(dev)).unsqueeze(0);
  const auto allowed = (((kj <= qi).unsqueeze(0) & key_mask.unsqueeze(1)) | (kj == qi).unsqueeze(0));  // (B, n, S)
  return torch::zeros(allowed.sizes(), torch::TensorOptions(torch::kFloat).device(dev))
      .masked_fill(allowed.logical_not(), -std::numeric_limits<float>::infinity())
      .unsqueeze(1);
}

/// (R, 1, N, N) block-diagonal causal mask of packed sequences.
inline torch::Tensor packed_bias(const torch::Tensor& segments) {
  const auto dev = segments.device();
  const auto N = segments.size(1);
  const auto idx = torch::arange(N, torch::TensorOptions(torch::kInt64).device(dev));
  const auto causal = (idx.unsqueeze(0) <= idx.unsqueeze(1)).unsqueeze(0);
  const auto seg = segments.to(torch::kInt64);
  const auto allowed = causal & (seg.unsqueeze(2) == seg.unsqueeze(1));
  return torch::zeros(allowed.sizes(), torch::TensorOptions(torch::kFloat).device(dev))
      .masked_fill(allowed.logical_not(), -std::numeric_limits<float>::infinity())
      .unsqueeze(1);
}

/// Where one layer's keys and values go: none (a full forward), slots [start, start+n) of a
/// cache, or (`paged`) the pool slots of a paged batch, `k` / `v` then being the layer's pools.
struct kv_slot {
  torch::Tensor* k = nullptr;
  torch::Tensor* v = nullptr;
  std::int64_t start = 0;
  const paged_batch* paged = nullptr;

  /// The paged forward's attention: q (1, H, N, D), key / value (1, H_kv, N, D) of the packed
  /// tokens -> (1, N, H * D), through `ops::paged_attention` with `attend(q, k, v, bias)`.
  template <class Attend>
  torch::Tensor attend_paged(const torch::Tensor& q, const torch::Tensor& key, const torch::Tensor& value, double scale,
                             Attend&& attend) const {
    const auto y = ops::paged_attention(q[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), *k, *v,
                                        *paged, scale, attend);  // (N, H, D)
    return y.reshape({1, y.size(0), y.size(1) * y.size(2)});
  }

  /// Writes this chunk's (B, H_kv, n, D) keys and values and returns all of them so far.
  std::pair<torch::Tensor, torch::Tensor> update(const torch::Tensor& key, const torch::Tensor& value) const {
    if (!k) return {key, value};
    const auto n = key.size(2);
    k->slice(2, start, start + n).copy_(key);
    v->slice(2, start, start + n).copy_(value);
    return {k->slice(2, 0, start + n), v->slice(2, 0, start + n)};
  }
};

/// RMSNorm module (`weight`), Hugging Face's LlamaRMSNorm.
class rms_norm_impl : public torch::nn::Cloneable<rms_norm_impl> {
 public:
  rms_norm_impl(std::int64_t dim, double eps) : dim_(dim), eps_(eps) { reset(); }
  void reset() override { weight = register_parameter("weight", torch::ones({dim_})); }
  torch::Tensor forward(const torch::Tensor& x) { return rms_normalize(x, weight, eps_); }
  torch::Tensor weight;

 private:
  std::int64_t dim_;
  double eps_;
};
TORCH_MODULE_IMPL(rms_norm, rms_norm_impl);

/// GPT-2's Conv1D: a linear layer whose `weight` is stored (in, out), `bias` (out), with its LoRA
/// adapter when it has one.
class conv1d_impl : public torch::nn::Cloneable<conv1d_impl>, public lora::fan_in_fan_out {
 public:
  conv1d_impl(std::int64_t in, std::int64_t out) : in_(in), out_(out) { reset(); }
  void reset() override {
    weight = register_parameter("weight", torch::empty({in_, out_}).normal_(0.0, 0.02));
    bias = register_parameter("bias", torch::zeros({out_}));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto sizes = x.sizes().vec();
    sizes.back() = out_;
    if (x.numel() == in_ && x.device().is_cpu() && x.is_floating_point() && x.scalar_type() != torch::kBFloat16 &&
        x.scalar_type() != torch::kHalf)  // one row: gemv (see `dense`)
      return lora::adapt(*this, x, torch::addmv(bias, weight.t(), x.reshape({-1})).view(sizes));
    return lora::adapt(*this, x, torch::addmm(bias, x.reshape({-1, in_}), weight).view(sizes));
  }
  torch::Tensor weight, bias;

 private:
  std::int64_t in_, out_;
};
TORCH_MODULE_IMPL(conv1d, conv1d_impl);

/// A decoder layer recomputed in the backward (activation checkpointing). `layer(inputs, slot)`
/// runs it on `inputs` (tensors only) and writes its keys and values through `slot`. Without a
/// cache it is a pure function of `inputs`; with one, it becomes one of `inputs` and copies of
/// the keys and values so far (the cache is written after it), its new keys and values are
/// outputs, and those are copied into the cache here, as the plain path would have.
template <class Layer>
torch::Tensor checkpointed_layer(const Layer& layer, const std::vector<torch::Tensor>& params,
                                 torch::autograd::variable_list inputs, kv_cache* cache, std::size_t l,
                                 std::int64_t start) {
  if (!cache)
    return checkpoint([layer](const torch::autograd::variable_list& in) {
             return torch::autograd::variable_list{layer(in, kv_slot{})};
           }, inputs, params)[0];
  auto& K = cache->k[l];
  auto& V = cache->v[l];
  const auto m = static_cast<std::int64_t>(inputs.size());
  inputs.push_back(K.slice(2, 0, start).clone());
  inputs.push_back(V.slice(2, 0, start).clone());
  const auto outs = checkpoint([layer, m, start](const torch::autograd::variable_list& in) {
        const auto& kp = in[static_cast<std::size_t>(m)];
        const auto& vp = in[static_cast<std::size_t>(m + 1)];
        const auto n = in[0].size(1);
        auto kb = torch::cat({kp, kp.new_zeros({kp.size(0), kp.size(1), n, kp.size(3)})}, 2);
        auto vb = torch::cat({vp, vp.new_zeros({vp.size(0), vp.size(1), n, vp.size(3)})}, 2);
        auto y = layer(torch::autograd::variable_list(in.begin(), in.begin() + m), kv_slot{&kb, &vb, start});
        return torch::autograd::variable_list{y, kb.slice(2, start), vb.slice(2, start)};
      }, inputs, params);
  const auto n = outs[1].size(2);
  K.slice(2, start, start + n).copy_(outs[1]);
  V.slice(2, start, start + n).copy_(outs[2]);
  return outs[0];
}

inline torch::nn::Linear make_linear(std::int64_t in, std::int64_t out, bool bias) {
  return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(bias));
}

// ----------------------------------------------------------------------------------------------
// Llama / Qwen2 / Qwen3

/// `self_attn`: q_proj, k_proj, v_proj, o_proj (+ q_norm, k_norm for Qwen3).
class llama_attention_impl : public torch::nn::Cloneable<llama_attention_impl> {
 public:
  explicit llama_attention_impl(const decoder_config& c)
      : hidden_(c.hidden_size), heads_(c.num_attention_heads), kv_heads_(c.kv_heads()), dim_(c.head_size()),
        eps_(c.norm_eps), qkv_bias_(c.qkv_bias()), o_bias_(c.o_bias()),
        qk_norm_(c.arch == architecture::qwen3) {
    reset();
  }
  void reset() override {
    q_proj = register_module("q_proj", make_linear(hidden_, heads_ * dim_, qkv_bias_));
    k_proj = register_module("k_proj", make_linear(hidden_, kv_heads_ * dim_, qkv_bias_));
    v_proj = register_module("v_proj", make_linear(hidden_, kv_heads_ * dim_, qkv_bias_));
    o_proj = register_module("o_proj", make_linear(heads_ * dim_, hidden_, o_bias_));
    if (qk_norm_) {
      q_norm = register_module("q_norm", rms_norm(dim_, eps_));
      k_norm = register_module("k_norm", rms_norm(dim_, eps_));
    }
  }
  /// x (B, n, hidden); cos / sin (B, n, D); bias (B|R, 1, n, S) -> (B, n, hidden).
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                        const torch::Tensor& bias, const kv_slot& slot) {
    const auto B = x.size(0), n = x.size(1);
    const auto qkv = qkv_(x, {q_proj, k_proj, v_proj});
    auto q = qkv[0].view({B, n, heads_, dim_});
    auto k = qkv[1].view({B, n, kv_heads_, dim_});
    auto v = qkv[2].view({B, n, kv_heads_, dim_}).transpose(1, 2);
    if (qk_norm_) {
      q = q_norm(q);
      k = k_norm(k);
    }
    q = q.transpose(1, 2);
    k = k.transpose(1, 2);
    const auto c = cos.unsqueeze(1), s = sin.unsqueeze(1);
    q = q * c + rotate_half(q) * s;
    k = k * c + rotate_half(k) * s;
    const double scale = 1.0 / std::sqrt(static_cast<double>(dim_));
    const auto groups = heads_ / kv_heads_;
    if (slot.paged)
      return dense(slot.attend_paged(q, k, v, scale, [scale, groups](const torch::Tensor& q4, const torch::Tensor& k4,
                                                               const torch::Tensor& v4, const torch::Tensor& b4) {
                     return attend_grouped(q4, k4, v4, b4, scale, groups);
                   }), o_proj);
    auto [k_all, v_all] = slot.update(k, v);
    const auto y = attend_grouped(q, k_all, v_all, bias, scale, groups);
    return dense(y.transpose(1, 2).reshape({B, n, heads_ * dim_}), o_proj);
  }
  torch::nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
  rms_norm q_norm{nullptr}, k_norm{nullptr};

 private:
  std::int64_t hidden_, heads_, kv_heads_, dim_;
  double eps_;
  bool qkv_bias_, o_bias_, qk_norm_;
  fused_linears qkv_;
};
TORCH_MODULE_IMPL(llama_attention, llama_attention_impl);

/// `mlp`: down_proj(silu(gate_proj(x)) * up_proj(x)).
class llama_mlp_impl : public torch::nn::Cloneable<llama_mlp_impl> {
 public:
  explicit llama_mlp_impl(const decoder_config& c)
      : hidden_(c.hidden_size), inter_(c.intermediate_size), bias_(c.mlp_biases()) {
    reset();
  }
  void reset() override {
    gate_proj = register_module("gate_proj", make_linear(hidden_, inter_, bias_));
    up_proj = register_module("up_proj", make_linear(hidden_, inter_, bias_));
    down_proj = register_module("down_proj", make_linear(inter_, hidden_, bias_));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const auto gu = gate_up_(x, {gate_proj, up_proj});
    return dense(torch::silu(gu[0]) * gu[1], down_proj);
  }
  torch::nn::Linear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};

 private:
  std::int64_t hidden_, inter_;
  bool bias_;
  fused_linears gate_up_;
};
TORCH_MODULE_IMPL(llama_mlp, llama_mlp_impl);

/// `model.layers.i`: pre-norm attention and SwiGLU MLP with residuals.
class llama_layer_impl : public torch::nn::Cloneable<llama_layer_impl> {
 public:
  explicit llama_layer_impl(decoder_config c) : c_(std::move(c)) { reset(); }
  void reset() override {
    self_attn = register_module("self_attn", llama_attention(c_));
    mlp = register_module("mlp", llama_mlp(c_));
    input_layernorm = register_module("input_layernorm", rms_norm(c_.hidden_size, c_.norm_eps));
    post_attention_layernorm = register_module("post_attention_layernorm", rms_norm(c_.hidden_size, c_.norm_eps));
  }
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                        const torch::Tensor& bias, const kv_slot& slot) {
    const auto h = x + self_attn->forward(input_layernorm(x), cos, sin, bias, slot);
    return h + mlp(post_attention_layernorm(h));
  }
  llama_attention self_attn{nullptr};
  llama_mlp mlp{nullptr};
  rms_norm input_layernorm{nullptr}, post_attention_layernorm{nullptr};

 private:
  decoder_config c_;
};
TORCH_MODULE_IMPL(llama_layer, llama_layer_impl);

/// `model`: embed_tokens, layers, norm.
class llama_model_impl : public torch::nn::Cloneable<llama_model_impl> {
 public:
  explicit llama_model_impl(decoder_config c) : c_(std::move(c)) { reset(); }
  void reset() override {
    auto eo = torch::nn::EmbeddingOptions(c_.vocab_size, c_.hidden_size);
    if (c_.pad_token_id) eo.padding_idx(*c_.pad_token_id);  // as Hugging Face: no gradient to the pad row
    embed_tokens = register_module("embed_tokens", torch::nn::Embedding(eo));
    layers = register_module("layers", torch::nn::ModuleList());
    for (std::int64_t i = 0; i < c_.num_hidden_layers; ++i) layers->push_back(llama_layer(c_));
    norm = register_module("norm", rms_norm(c_.hidden_size, c_.norm_eps));
  }
  /// ids (B, n), positions (B, n), bias (B, 1, n, S) -> final hidden states (B, n, hidden).
  torch::Tensor forward(const torch::Tensor& ids, const torch::Tensor& positions, const torch::Tensor& bias,
                        kv_cache* cache, std::int64_t start) {
    return forward_from_embeddings(embed_tokens(ids), positions, bias, cache, start);
  }
  /// The same from input embeddings x0 (B, n, hidden) instead of ids.
  torch::Tensor forward_from_embeddings(const torch::Tensor& x0, const torch::Tensor& positions,
                                        const torch::Tensor& bias, kv_cache* cache, std::int64_t start) {
    auto x = x0;
    const auto [cos, sin] = rope_cos_sin(positions, c_.head_size(), c_.rope_theta, x.scalar_type());
    const bool recompute = checkpoint_layers && torch::GradMode::is_enabled();
    std::size_t l = 0;
    for (const auto& layer : *layers) {
      const kv_slot slot = cache ? kv_slot{&cache->k[l], &cache->v[l], start} : kv_slot{};
      if (recompute) {
        auto block = std::dynamic_pointer_cast<llama_layer_impl>(layer);
        // The hooks run inside the recomputed function too: a sharding policy gathers the block again there.
        x = checkpointed_layer([block, h = hooks, l](const torch::autograd::variable_list& in, const kv_slot& s) {
              if (h) h->before_block(l);
              return block->forward(in[0], in[1], in[2], in[3], s);
            }, block->parameters(), {x, cos, sin, bias}, cache, l, start);
      } else {
        if (hooks) hooks->before_block(l);
        x = layer->as<llama_layer_impl>()->forward(x, cos, sin, bias, slot);
      }
      if (hooks) x = hooks->after_block(l, x);
      ++l;
    }
    return norm(x);
  }
  /// The paged forward: x0 (1, N, hidden) packed tokens at positions (1, N) over the pool `kv`.
  torch::Tensor forward_paged(const torch::Tensor& x0, const torch::Tensor& positions, const paged_batch& b,
                              paged_kv& kv) {
    auto x = x0;
    const auto [cos, sin] = rope_cos_sin(positions, c_.head_size(), c_.rope_theta, x.scalar_type());
    std::size_t l = 0;
    for (const auto& layer : *layers) {
      x = layer->as<llama_layer_impl>()->forward(x, cos, sin, {}, kv_slot{&kv.k[l], &kv.v[l], 0, &b});
      ++l;
    }
    return norm(x);
  }
  bool checkpoint_layers = false;  // recompute each layer in the backward (activation checkpointing)
  std::shared_ptr<block_hooks> hooks;  // run around each layer (a sharding policy's gathers); null: none
  torch::nn::Embedding embed_tokens{nullptr};
  torch::nn::ModuleList layers{nullptr};
  rms_norm norm{nullptr};

 private:
  decoder_config c_;
};
TORCH_MODULE_IMPL(llama_model, llama_model_impl);

// ----------------------------------------------------------------------------------------------
// GPT-2

/// `attn`: c_attn (fused q, k, v), c_proj.
class gpt2_attention_impl : public torch::nn::Cloneable<gpt2_attention_impl> {
 public:
  gpt2_attention_impl(std::int64_t embd, std::int64_t heads) : embd_(embd), heads_(heads) { reset(); }
  void reset() override {
    c_attn = register_module("c_attn", conv1d(embd_, 3 * embd_));
    c_proj = register_module("c_proj", conv1d(embd_, embd_));
  }
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& bias, const kv_slot& slot) {
    const auto B = x.size(0), n = x.size(1), D = embd_ / heads_;
    const auto qkv = c_attn(x).split(embd_, 2);
    const auto q = qkv[0].view({B, n, heads_, D}).transpose(1, 2);
    const double scale = 1.0 / std::sqrt(static_cast<double>(D));
    if (slot.paged)
      return c_proj(slot.attend_paged(q, qkv[1].view({B, n, heads_, D}).transpose(1, 2),
                                      qkv[2].view({B, n, heads_, D}).transpose(1, 2), scale,
                                      [scale](const torch::Tensor& q4, const torch::Tensor& k4, const torch::Tensor& v4,
                                              const torch::Tensor& b4) { return attend(q4, k4, v4, b4, scale); }));
    auto [k, v] = slot.update(qkv[1].view({B, n, heads_, D}).transpose(1, 2), qkv[2].view({B, n, heads_, D}).transpose(1, 2));
    const auto y = attend(q, k, v, bias, scale);
    return c_proj(y.transpose(1, 2).reshape({B, n, embd_}));
  }
  conv1d c_attn{nullptr}, c_proj{nullptr};

 private:
  std::int64_t embd_, heads_;
};
TORCH_MODULE_IMPL(gpt2_attention, gpt2_attention_impl);

/// `mlp`: c_proj(act(c_fc(x))).
class gpt2_mlp_impl : public torch::nn::Cloneable<gpt2_mlp_impl> {
 public:
  gpt2_mlp_impl(std::int64_t embd, std::int64_t inner, std::string act) : embd_(embd), inner_(inner), act_(std::move(act)) {
    reset();
  }
  void reset() override {
    c_fc = register_module("c_fc", conv1d(embd_, inner_));
    c_proj = register_module("c_proj", conv1d(inner_, embd_));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const auto h = c_fc(x);
    const auto a = act_ == "gelu_new" ? gelu_new(h) : act_ == "gelu_pytorch_tanh" ? torch::gelu(h, "tanh") : torch::gelu(h);
    return c_proj(a);
  }
  conv1d c_fc{nullptr}, c_proj{nullptr};

 private:
  std::int64_t embd_, inner_;
  std::string act_;
};
TORCH_MODULE_IMPL(gpt2_mlp, gpt2_mlp_impl);

/// `transformer.h.i`: ln_1, attn, ln_2, mlp.
class gpt2_block_impl : public torch::nn::Cloneable<gpt2_block_impl> {
 public:
  explicit gpt2_block_impl(decoder_config c) : c_(std::move(c)) { reset(); }
  void reset() override {
    const auto ln = torch::nn::LayerNormOptions({c_.hidden_size}).eps(c_.norm_eps);
    ln_1 = register_module("ln_1", torch::nn::LayerNorm(ln));
    attn = register_module("attn", gpt2_attention(c_.hidden_size, c_.num_attention_heads));
    ln_2 = register_module("ln_2", torch::nn::LayerNorm(ln));
    mlp = register_module("mlp", gpt2_mlp(c_.hidden_size, c_.intermediate_size, c_.hidden_act));
  }
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& bias, const kv_slot& slot) {
    const auto h = x + attn->forward(ln_1(x), bias, slot);
    return h + mlp(ln_2(h));
  }
  torch::nn::LayerNorm ln_1{nullptr}, ln_2{nullptr};
  gpt2_attention attn{nullptr};
  gpt2_mlp mlp{nullptr};

 private:
  decoder_config c_;
};
TORCH_MODULE_IMPL(gpt2_block, gpt2_block_impl);

/// `transformer`: wte, wpe, h, ln_f.
class gpt2_model_impl : public torch::nn::Cloneable<gpt2_model_impl> {
 public:
  explicit gpt2_model_impl(decoder_config c) : c_(std::move(c)) { reset(); }
  void reset() override {
    wte = register_module("wte", torch::nn::Embedding(c_.vocab_size, c_.hidden_size));
    wpe = register_module("wpe", torch::nn::Embedding(c_.max_position_embeddings, c_.hidden_size));
    h = register_module("h", torch::nn::ModuleList());
    for (std::int64_t i = 0; i < c_.num_hidden_layers; ++i) h->push_back(gpt2_block(c_));
    ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c_.hidden_size}).eps(c_.norm_eps)));
  }
  torch::Tensor forward(const torch::Tensor& ids, const torch::Tensor& positions, const torch::Tensor& bias,
                        kv_cache* cache, std::int64_t start) {
    return forward_from_embeddings(wte(ids), positions, bias, cache, start);
  }
  /// The same from token embeddings x0 (B, n, hidden) instead of ids (positions are added here).
  torch::Tensor forward_from_embeddings(const torch::Tensor& x0, const torch::Tensor& positions,
                                        const torch::Tensor& bias, kv_cache* cache, std::int64_t start) {
    auto x = x0 + wpe(positions);
    const bool recompute = checkpoint_layers && torch::GradMode::is_enabled();
    std::size_t l = 0;
    for (const auto& block : *h) {
      const kv_slot slot = cache ? kv_slot{&cache->k[l], &cache->v[l], start} : kv_slot{};
      if (recompute) {
        auto b = std::dynamic_pointer_cast<gpt2_block_impl>(block);
        x = checkpointed_layer([b, hk = hooks, l](const torch::autograd::variable_list& in, const kv_slot& s) {
              if (hk) hk->before_block(l);
              return b->forward(in[0], in[1], s);
            }, b->parameters(), {x, bias}, cache, l, start);
      } else {
        if (hooks) hooks->before_block(l);
        x = block->as<gpt2_block_impl>()->forward(x, bias, slot);
      }
      if (hooks) x = hooks->after_block(l, x);
      ++l;
    }
    return ln_f(x);
  }
  /// The paged forward: token embeddings x0 (1, N, hidden) at positions (1, N) over the pool `kv`.
  torch::Tensor forward_paged(const torch::Tensor& x0, const torch::Tensor& positions, const paged_batch& b,
                              paged_kv& kv) {
    auto x = x0 + wpe(positions);
    std::size_t l = 0;
    for (const auto& block : *h) {
      x = block->as<gpt2_block_impl>()->forward(x, {}, kv_slot{&kv.k[l], &kv.v[l], 0, &b});
      ++l;
    }
    return ln_f(x);
  }
  bool checkpoint_layers = false;  // recompute each block in the backward (activation checkpointing)
  std::shared_ptr<block_hooks> hooks;  // run around each block (a sharding policy's gathers); null: none
  torch::nn::Embedding wte{nullptr}, wpe{nullptr};
  torch::nn::ModuleList h{nullptr};
  torch::nn::LayerNorm ln_f{nullptr};

 private:
  decoder_config c_;
};
TORCH_MODULE_IMPL(gpt2_model, gpt2_model_impl);

}  // namespace detail

/// The network of `causal_lm`: `model` (Llama family) or `transformer` (GPT-2), then `lm_head`
/// (absent when tied: the token embedding is the head) — or, for a critic (`out_dim` 1), a
/// value head `score` (weight and bias) in its place.
class decoder_net_impl : public torch::nn::Cloneable<decoder_net_impl>, public lora::adaptable {
 public:
  explicit decoder_net_impl(decoder_config c, std::int64_t out_dim = 0) : c_(std::move(c)), out_dim_(out_dim) {
    c_.validate();
    UNIRL_CHECK(out_dim_ >= 0, "hf::decoder_net: out_dim = ", out_dim_, ": expected 0 (logits) or >= 1 (value head)");
    reset();
  }

  void reset() override {
    if (c_.is_gpt2()) transformer = register_module("transformer", detail::gpt2_model(c_));
    else model = register_module("model", detail::llama_model(c_));
    if (out_dim_ > 0) score = register_module("score", torch::nn::Linear(c_.hidden_size, out_dim_));
    else if (!c_.tie_word_embeddings)
      lm_head = register_module("lm_head", detail::make_linear(c_.hidden_size, c_.vocab_size, false));
    // Hugging Face's initialisation: N(0, initializer_range) weights, zero biases, unit norms,
    // GPT-2's residual projections scaled by 1/sqrt(2 n_layer).
    torch::NoGradGuard ng;
    const double std = c_.initializer_range;
    for (auto& p : named_parameters()) {
      const auto& name = p.key();
      if (name.find("norm") != std::string::npos || name.find(".ln_") != std::string::npos) continue;
      if (name.ends_with(".bias")) p.value().zero_();
      else if (c_.is_gpt2() && name.ends_with("c_proj.weight"))
        p.value().normal_(0.0, std / std::sqrt(2.0 * static_cast<double>(c_.num_hidden_layers)));
      else p.value().normal_(0.0, std);
    }
    if (!c_.is_gpt2() && c_.pad_token_id) model->embed_tokens->weight[*c_.pad_token_id].zero_();
  }

  const decoder_config& config() const { return c_; }
  std::int64_t out_dim() const { return out_dim_; }

  /// Activation checkpointing of the decoder layers (forwards with gradients).
  void set_checkpoint_layers(bool on) {
    if (c_.is_gpt2()) transformer->checkpoint_layers = on;
    else model->checkpoint_layers = on;
  }
  bool checkpoint_layers() const { return c_.is_gpt2() ? transformer->checkpoint_layers : model->checkpoint_layers; }
  /// Code run around each decoder layer's forward (`block_hooks`, concepts/parallel.hpp); null: none.
  void set_block_hooks(std::shared_ptr<block_hooks> h) {
    if (c_.is_gpt2()) transformer->hooks = std::move(h);
    else model->hooks = std::move(h);
  }
  /// The parameter-name prefix of each decoder layer, in forward order (`model.layers.<l>.` or `transformer.h.<l>.`).
  std::vector<std::string> block_prefixes() const {
    std::vector<std::string> out;
    for (std::int64_t l = 0; l < c_.num_hidden_layers; ++l)
      out.push_back((c_.is_gpt2() ? "transformer.h." : "model.layers.") + std::to_string(l) + ".");
    return out;
  }

  /// The token embedding (B, n) -> (B, n, hidden) table: `model.embed_tokens` or `transformer.wte`.
  const torch::Tensor& embedding_weight() const {
    return c_.is_gpt2() ? transformer->wte->weight : model->embed_tokens->weight;
  }

  /// The LM head's weight (V, hidden): `lm_head.weight`, or the token embedding when tied.
  const torch::Tensor& head_weight() const {
    UNIRL_CHECK(out_dim_ == 0, "hf::decoder_net: a value model (out_dim = ", out_dim_, ") has no LM head");
    return c_.tie_word_embeddings ? embedding_weight() : lm_head->weight;
  }

  /// Backbone and (unless `head` is false: the final normalised hidden states) head on given
  /// positions and mask: ids (B, n) -> (B, n, out | hidden).
  torch::Tensor run(const torch::Tensor& ids, const torch::Tensor& positions, const torch::Tensor& bias,
                    kv_cache* cache, std::int64_t start, bool head = true) {
    const auto h = c_.is_gpt2() ? transformer->forward(ids, positions, bias, cache, start)
                                : model->forward(ids, positions, bias, cache, start);
    return finish(h, head);
  }
  /// `run` from input embeddings x (B, n, hidden) instead of ids.
  torch::Tensor run_from_embeddings(const torch::Tensor& x, const torch::Tensor& positions, const torch::Tensor& bias,
                                    kv_cache* cache, std::int64_t start, bool head = true) {
    const auto h = c_.is_gpt2() ? transformer->forward_from_embeddings(x, positions, bias, cache, start)
                                : model->forward_from_embeddings(x, positions, bias, cache, start);
    return finish(h, head);
  }

  /// The token embeddings (B, n, hidden) of ids (B, n) (`model.embed_tokens` / `transformer.wte`):
  /// the input of the `*_from_embeddings` forwards, e.g. with some rows replaced by image
  /// features (models/vlm). GPT-2's position embeddings are added by those forwards.
  torch::Tensor embed(const torch::Tensor& ids) {
    check_ids(ids);
    return c_.is_gpt2() ? transformer->wte(ids) : model->embed_tokens(ids);
  }

  /// Full forward: ids (B, L) int64, mask (B, L) (1 = real token) -> (B, L, out), or the final
  /// hidden states (B, L, hidden) without the head.
  torch::Tensor forward(const torch::Tensor& ids, const torch::Tensor& mask, bool head = true) {
    check_inputs(ids, mask);
    const auto m = mask.to(torch::kFloat);
    const auto positions = (m.cumsum(1) - 1.0).clamp_min(0.0).to(torch::kInt64);
    check_positions(positions);
    return run(ids, positions, detail::attention_bias(m.to(torch::kBool), 0, ids.size(1)), nullptr, 0, head);
  }
  /// `forward` from input embeddings x (B, L, hidden) instead of ids.
  torch::Tensor forward_from_embeddings(const torch::Tensor& x, const torch::Tensor& mask, bool head = true) {
    check_embeddings(x, mask);
    const auto m = mask.to(torch::kFloat);
    const auto positions = (m.cumsum(1) - 1.0).clamp_min(0.0).to(torch::kInt64);
    check_positions(positions);
    return run_from_embeddings(x, positions, detail::attention_bias(m.to(torch::kBool), 0, x.size(1)), nullptr, 0,
                               head);
  }

  /// Packed forward: ids, positions (restarting at 0 for every sequence), segments (R, N) int64
  /// -> (R, N, out | hidden); a token attends only to its own segment at or before it.
  torch::Tensor forward_packed(const torch::Tensor& ids, const torch::Tensor& positions, const torch::Tensor& segments,
                               bool head = true) {
    UNIRL_CHECK(ids.dim() == 2, "hf::causal_lm: packed ids must be (R, N) int64, got sizes ", ids.sizes());
    UNIRL_CHECK(positions.sizes() == ids.sizes() && segments.sizes() == ids.sizes(), "hf::causal_lm: packed positions ",
                positions.sizes(), " and segments ", segments.sizes(), " must have the sizes of ids ", ids.sizes());
    check_ids(ids);
    const auto pos = positions.to(torch::kInt64);
    UNIRL_CHECK(pos.numel() == 0 || pos.min().item<std::int64_t>() >= 0, "hf::causal_lm: packed positions must be >= 0");
    check_positions(pos);
    return run(ids, pos, detail::packed_bias(segments), nullptr, 0, head);
  }
  /// `forward_packed` from input embeddings x (R, N, hidden) instead of ids.
  torch::Tensor forward_packed_from_embeddings(const torch::Tensor& x, const torch::Tensor& positions,
                                               const torch::Tensor& segments, bool head = true) {
    UNIRL_CHECK(x.dim() == 3 && x.size(2) == c_.hidden_size, "hf::causal_lm: packed embeddings must be (R, N, ",
                "hidden_size = ", c_.hidden_size, "), got sizes ", x.sizes());
    const auto sizes = x.sizes().slice(0, 2);
    UNIRL_CHECK(positions.sizes() == sizes && segments.sizes() == sizes, "hf::causal_lm: packed positions ",
                positions.sizes(), " and segments ", segments.sizes(), " must have the embeddings' (R, N) = ", sizes);
    const auto pos = positions.to(torch::kInt64);
    UNIRL_CHECK(pos.numel() == 0 || pos.min().item<std::int64_t>() >= 0, "hf::causal_lm: packed positions must be >= 0");
    check_positions(pos);
    return run_from_embeddings(x, pos, detail::packed_bias(segments), nullptr, 0, head);
  }

  /// An empty cache for `batch` sequences of up to `capacity` tokens: per layer (B, H_kv, capacity, D).
  kv_cache make_cache(std::int64_t batch, std::int64_t capacity) const {
    UNIRL_CHECK(batch >= 0 && capacity >= 1, "hf::causal_lm::make_cache: batch = ", batch, ", capacity = ", capacity,
                ": expected batch >= 0 and capacity >= 1");
    const auto opts = embedding_weight().options().requires_grad(false);
    const auto kv_heads = c_.kv_heads(), dim = c_.head_size();
    kv_cache c;
    for (std::int64_t i = 0; i < c_.num_hidden_layers; ++i) {
      c.k.push_back(torch::zeros({batch, kv_heads, capacity, dim}, opts));
      c.v.push_back(torch::zeros({batch, kv_heads, capacity, dim}, opts));
    }
    c.mask = torch::zeros({batch, capacity}, opts.dtype(torch::kFloat));
    c.count = torch::zeros({batch}, opts.dtype(torch::kInt64));
    c.capacity = capacity;
    return c;
  }

  /// An empty paged pool of `slots` token slots per layer: (slots, H_kv, D) keys and values.
  paged_kv make_paged_kv(std::int64_t slots) const {
    UNIRL_CHECK(slots >= 1, "hf::causal_lm::make_paged_kv: slots = ", slots, ": expected >= 1");
    const auto opts = embedding_weight().options().requires_grad(false);
    paged_kv kv;
    kv.slots = slots;
    for (std::int64_t i = 0; i < c_.num_hidden_layers; ++i) {
      kv.k.push_back(torch::zeros({slots, c_.kv_heads(), c_.head_size()}, opts));
      kv.v.push_back(torch::zeros({slots, c_.kv_heads(), c_.head_size()}, opts));
    }
    return kv;
  }

  /// The paged forward (`PagedCausalLM`): -> (R, out | hidden) of `b.output_rows` (all N when
  /// undefined). No device read: the engine checks token ids when they are submitted and
  /// positions come with their host maximum (`b.max_position`).
  torch::Tensor forward_paged(const paged_batch& b, paged_kv& kv, bool head = true) {
    UNIRL_CHECK(b.ids.defined() && b.ids.dim() == 1 && b.positions.sizes() == b.ids.sizes(),
                "hf::causal_lm: paged ids and positions must be (N,) int64 each");
    torch::NoGradGuard ng;
    return forward_paged_from_embeddings(embed_unchecked(b.ids), b, kv, head);
  }
  /// `forward_paged` from input embeddings x (N, hidden) of the batch's rows instead of its ids
  /// (GPT-2's position embeddings are added here).
  torch::Tensor forward_paged_from_embeddings(const torch::Tensor& x, const paged_batch& b, paged_kv& kv,
                                              bool head = true) {
    UNIRL_CHECK(b.positions.defined() && b.positions.dim() == 1 && x.dim() == 2 && x.size(0) == b.positions.size(0) &&
                    x.size(1) == c_.hidden_size,
                "hf::causal_lm: paged embeddings must be (N, hidden_size = ", c_.hidden_size,
                ") with (N,) positions, got sizes ", x.sizes());
    UNIRL_CHECK(static_cast<std::int64_t>(kv.k.size()) == c_.num_hidden_layers, "hf::causal_lm: the paged pool has ",
                kv.k.size(), " layers; the model ", c_.num_hidden_layers);
    UNIRL_CHECK(!c_.is_gpt2() || b.max_position < c_.max_position_embeddings, "hf::causal_lm: position ",
                b.max_position, " is past GPT-2's n_positions = ", c_.max_position_embeddings);
    torch::NoGradGuard ng;
    const auto positions = b.positions.unsqueeze(0);
    auto h = c_.is_gpt2() ? transformer->forward_paged(x.unsqueeze(0), positions, b, kv)
                          : model->forward_paged(x.unsqueeze(0), positions, b, kv);
    h = h.squeeze(0);
    if (b.output_rows.defined()) h = h.index_select(0, b.output_rows);
    return finish(h, head);
  }
  /// Token embeddings of ids the caller has checked (the engine checks them on the host): no device read.
  torch::Tensor embed_unchecked(const torch::Tensor& ids) {
    return c_.is_gpt2() ? transformer->wte(ids) : model->embed_tokens(ids);
  }

  /// Incremental forward of the next n tokens: ids (B, n), mask (B, n) -> (B, n, out | hidden).
  torch::Tensor forward_cached(const torch::Tensor& ids, const torch::Tensor& mask, kv_cache& c, bool head = true) {
    check_inputs(ids, mask);
    const auto [positions, bias] = cache_step(ids.size(0), ids.size(1), mask, c);
    auto out = run(ids, positions, bias, &c, c.length, head);
    c.length += ids.size(1);
    return out;
  }
  /// `forward_cached` from input embeddings x (B, n, hidden) instead of ids.
  torch::Tensor forward_cached_from_embeddings(const torch::Tensor& x, const torch::Tensor& mask, kv_cache& c,
                                               bool head = true) {
    check_embeddings(x, mask);
    const auto [positions, bias] = cache_step(x.size(0), x.size(1), mask, c);
    auto out = run_from_embeddings(x, positions, bias, &c, c.length, head);
    c.length += x.size(1);
    return out;
  }

  detail::llama_model model{nullptr};
  detail::gpt2_model transformer{nullptr};
  torch::nn::Linear lm_head{nullptr}, score{nullptr};

 private:
  void check_ids(const torch::Tensor& ids) const {
    UNIRL_CHECK(ids.scalar_type() == torch::kInt64 || ids.scalar_type() == torch::kInt32,
                "hf::causal_lm: ids must be integers, got ", ids.scalar_type());
    if (ids.numel() == 0) return;
    const auto lo = ids.min().item<std::int64_t>(), hi = ids.max().item<std::int64_t>();
    UNIRL_CHECK(lo >= 0 && hi < c_.vocab_size, "hf::causal_lm: token id ", lo < 0 ? lo : hi,
                " is outside [0, vocab_size = ", c_.vocab_size, ")");
  }
  void check_inputs(const torch::Tensor& ids, const torch::Tensor& mask) const {
    UNIRL_CHECK(ids.dim() == 2, "hf::causal_lm: ids must be (B, L) int64, got sizes ", ids.sizes());
    UNIRL_CHECK(mask.sizes() == ids.sizes(), "hf::causal_lm: mask sizes ", mask.sizes(), " differ from ids sizes ",
                ids.sizes());
    check_ids(ids);
  }
  // The head on the final hidden states h, unless `head` is false.
  torch::Tensor finish(const torch::Tensor& h, bool head) {
    if (!head) return h;
    if (out_dim_ > 0) return score(h);
    return detail::dense(h, head_weight());
  }
  void check_embeddings(const torch::Tensor& x, const torch::Tensor& mask) const {
    UNIRL_CHECK(x.dim() == 3 && x.size(2) == c_.hidden_size, "hf::causal_lm: input embeddings must be (B, L, ",
                "hidden_size = ", c_.hidden_size, "), got sizes ", x.sizes());
    UNIRL_CHECK(mask.sizes() == x.sizes().slice(0, 2), "hf::causal_lm: mask sizes ", mask.sizes(),
                " differ from the embeddings' (B, L) = ", x.sizes().slice(0, 2));
  }
  // Checks the cache, writes the next n mask columns and counts: the positions and the attention
  // bias of the next n tokens of a cached forward.
  std::pair<torch::Tensor, torch::Tensor> cache_step(std::int64_t B, std::int64_t n, const torch::Tensor& mask,
                                                     kv_cache& c) const {
    const auto start = c.length;
    UNIRL_CHECK(static_cast<std::int64_t>(c.k.size()) == c_.num_hidden_layers && c.mask.defined() &&
                    c.mask.size(0) == B,
                "hf::causal_lm: the KV cache was not made by this model for a batch of ", B);
    UNIRL_CHECK(start + n <= c.capacity, "hf::causal_lm: the KV cache holds ", c.capacity, " tokens; ", start + n,
                " needed");
    const auto m = mask.to(torch::kFloat);
    c.mask.slice(1, start, start + n).copy_(m);
    const auto positions =
        (c.count.unsqueeze(1).to(torch::kFloat) + m.cumsum(1) - 1.0).clamp_min(0.0).to(torch::kInt64);
    check_positions(positions);
    c.count += m.sum(1).to(torch::kInt64);
    return {positions, detail::attention_bias(c.mask.slice(1, 0, start + n).to(torch::kBool), start, n)};
  }
  // GPT-2's learned position table ends at n_positions; RoPE has no table (max_length() still
  // reports max_position_embeddings, the length the model was trained for).
  void check_positions(const torch::Tensor& positions) const {
    if (!c_.is_gpt2() || positions.numel() == 0) return;
    const auto hi = positions.max().item<std::int64_t>();
    UNIRL_CHECK(hi < c_.max_position_embeddings, "hf::causal_lm: position ", hi, " is past GPT-2's n_positions = ",
                c_.max_position_embeddings);
  }

  decoder_config c_;
  std::int64_t out_dim_;
};
TORCH_MODULE_IMPL(decoder_net, decoder_net_impl);

/// The value model PPO builds from a `causal_lm`: the same backbone (weights copied) and a
/// scalar head `score` (Hugging Face's token-classification head name).
struct causal_lm_critic : module_adapter<causal_lm_critic, decoder_net> {
  using module_adapter::module_adapter;
  /// V of every prefix: ids (B, L), mask (B, L) -> (B, L) float.
  torch::Tensor values(const torch::Tensor& ids, const torch::Tensor& mask) const {
    return net_.ptr()->forward(ids, mask).squeeze(-1).to(torch::kFloat);
  }
  /// V of every prefix of packed sequences: (R, N) float.
  torch::Tensor values_packed(const torch::Tensor& ids, const torch::Tensor& positions,
                              const torch::Tensor& segments) const {
    return net_.ptr()->forward_packed(ids, positions, segments).squeeze(-1).to(torch::kFloat);
  }
  const decoder_config& config() const { return net_->config(); }
};
static_assert(TokenCritic<causal_lm_critic>);
static_assert(PackedTokenCritic<causal_lm_critic>);

/// A Hugging Face decoder (Llama, Qwen2, Qwen3 or GPT-2) as a `CausalLM` of the token track.
/// Built from a config alone it is randomly initialised as Hugging Face initialises it;
/// `hf::from_pretrained` (hf/pretrained.hpp) loads a checkpoint.
struct causal_lm : module_adapter<causal_lm, decoder_net> {
  using track = token_track;
  using cache_type = kv_cache;
  using module_adapter::module_adapter;
  explicit causal_lm(const decoder_config& c) : module_adapter(decoder_net(c)) {}

  const decoder_config& config() const { return net_->config(); }
  /// Dtype of the weights.
  torch::ScalarType dtype() const { return net_->embedding_weight().scalar_type(); }

  /// Next-token logits (B, L, V) in the weights' dtype; ids (B, L) int64, mask (B, L) float.
  torch::Tensor logits(const torch::Tensor& ids, const torch::Tensor& mask) const {
    return net_.ptr()->forward(ids, mask);
  }
  /// The same for unpadded ids (every position valid): `logits(ids)`, no mask to build.
  torch::Tensor logits(const torch::Tensor& ids) const {
    return logits(ids, torch::ones(ids.sizes(), torch::TensorOptions(torch::kFloat).device(ids.device())));
  }
  /// Packed logits (sequence packing): ids, positions, segments (R, N) -> (R, N, V).
  torch::Tensor logits_packed(const torch::Tensor& ids, const torch::Tensor& positions,
                              const torch::Tensor& segments) const {
    return net_.ptr()->forward_packed(ids, positions, segments);
  }
  /// A KV cache holding only the KV heads (each serves its group of query heads in place).
  kv_cache make_cache(std::int64_t batch, std::int64_t capacity) const { return net_->make_cache(batch, capacity); }
  torch::Tensor logits_cached(const torch::Tensor& ids, const torch::Tensor& mask, kv_cache& c) const {
    return net_.ptr()->forward_cached(ids, mask, c);
  }
  /// The final (normalised) hidden states (B, L, hidden) before the LM head: `logits` is
  /// `hidden_states @ lm_head_weight()^T` (`HiddenStateCausalLM`: the update's log-probs run the
  /// head in row chunks and never hold the (B, L, V) logits).
  torch::Tensor hidden_states(const torch::Tensor& ids, const torch::Tensor& mask) const {
    return net_.ptr()->forward(ids, mask, false);
  }
  torch::Tensor hidden_states_packed(const torch::Tensor& ids, const torch::Tensor& positions,
                                     const torch::Tensor& segments) const {
    return net_.ptr()->forward_packed(ids, positions, segments, false);
  }
  torch::Tensor hidden_states_cached(const torch::Tensor& ids, const torch::Tensor& mask, kv_cache& c) const {
    return net_.ptr()->forward_cached(ids, mask, c, false);
  }

  /// Input embeddings (B, L, hidden) of ids (B, L); the `*_from_embeddings` forwards take them
  /// (or any other embeddings, e.g. with image features in some rows: models/vlm) in place of
  /// ids, and `logits(ids, m) == logits_from_embeddings(embed(ids), m)` (likewise each variant).
  torch::Tensor embed(const torch::Tensor& ids) const { return net_.ptr()->embed(ids); }
  torch::Tensor logits_from_embeddings(const torch::Tensor& x, const torch::Tensor& mask) const {
    return net_.ptr()->forward_from_embeddings(x, mask);
  }
  torch::Tensor logits_packed_from_embeddings(const torch::Tensor& x, const torch::Tensor& positions,
                                              const torch::Tensor& segments) const {
    return net_.ptr()->forward_packed_from_embeddings(x, positions, segments);
  }
  torch::Tensor logits_cached_from_embeddings(const torch::Tensor& x, const torch::Tensor& mask, kv_cache& c) const {
    return net_.ptr()->forward_cached_from_embeddings(x, mask, c);
  }
  torch::Tensor hidden_states_from_embeddings(const torch::Tensor& x, const torch::Tensor& mask) const {
    return net_.ptr()->forward_from_embeddings(x, mask, false);
  }
  torch::Tensor hidden_states_packed_from_embeddings(const torch::Tensor& x, const torch::Tensor& positions,
                                                     const torch::Tensor& segments) const {
    return net_.ptr()->forward_packed_from_embeddings(x, positions, segments, false);
  }
  torch::Tensor hidden_states_cached_from_embeddings(const torch::Tensor& x, const torch::Tensor& mask,
                                                     kv_cache& c) const {
    return net_.ptr()->forward_cached_from_embeddings(x, mask, c, false);
  }
  /// The LM head (V, hidden): `lm_head.weight`, or `model.embed_tokens.weight` / `transformer.wte.weight` when tied.
  torch::Tensor lm_head_weight() const { return net_->head_weight(); }
  /// Row i of the result is row `index[i]` of `c` (prefix sharing).
  kv_cache select_cache(const kv_cache& c, const torch::Tensor& index) const { return c.select(index); }
  /// The paged cache of the rollout engine (`PagedCausalLM`): a pool of `slots` token slots.
  paged_kv make_paged_kv(std::int64_t slots) const { return net_->make_paged_kv(slots); }
  /// Logits (R, V) of the packed batch's output rows over the paged cache (`PagedCausalLM`).
  torch::Tensor logits_paged(const paged_batch& b, paged_kv& kv) const { return net_.ptr()->forward_paged(b, kv); }
  /// `logits_paged` from input embeddings x (N, hidden) of the batch's rows (models/vlm).
  torch::Tensor logits_paged_from_embeddings(const torch::Tensor& x, const paged_batch& b, paged_kv& kv) const {
    return net_.ptr()->forward_paged_from_embeddings(x, b, kv);
  }
  std::int64_t vocab_size() const { return net_->config().vocab_size; }
  std::int64_t max_length() const { return net_->config().max_position_embeddings; }
  /// Activation checkpointing of the decoder layers (`checkpoint_kind::decoder_blocks`) in
  /// forwards with gradients; other kinds throw `config_error`. Parameter names and outputs are
  /// unchanged either way.
  void set_checkpointing(const std::vector<std::string>& kinds) {
    check_checkpointing_kinds(kinds, checkpointing_kinds(), "models::hf::causal_lm");
    net_->set_checkpoint_layers(wants_checkpointing(kinds, checkpoint_kind::decoder_blocks));
  }
  std::vector<std::string> checkpointing_kinds() const { return {std::string(checkpoint_kind::decoder_blocks)}; }
  /// The decoder layers as blocks (`BlockStructuredModel`, concepts/parallel.hpp): a sharding
  /// policy (`parallel::fully_sharded`) gathers each layer's parameters around its forward.
  void set_block_hooks(std::shared_ptr<block_hooks> h) { net_->set_block_hooks(std::move(h)); }
  std::vector<std::string> block_prefixes() const { return net_->block_prefixes(); }

  /// A critic with this model's backbone weights (copied, same dtype and device) and a fresh `score` head.
  causal_lm_critic make_critic() const {
    decoder_net critic(net_->config(), 1);
    critic->set_checkpoint_layers(net_->checkpoint_layers());
    torch::NoGradGuard ng;
    const auto src = net_->named_parameters();
    critic->to(dtype());
    for (auto& p : critic->named_parameters())
      if (!p.key().starts_with("score.")) p.value().copy_(src[p.key()]);
    critic->to(device());
    return causal_lm_critic(critic);
  }
};
static_assert(CausalLM<causal_lm>);
static_assert(PackedCausalLM<causal_lm>);
static_assert(PrefixSharingCausalLM<causal_lm>);
static_assert(PagedCausalLM<causal_lm>);
static_assert(HiddenStateCausalLM<causal_lm>);
static_assert(BlockStructuredModel<causal_lm>);
static_assert(CriticFactory<causal_lm>);

}  // namespace unirl::models::hf

#pragma once
/// \file gpt.hpp
/// A small built-in GPT (pre-norm transformer, causal self-attention, learned positions) with a
/// KV cache, and its adapters: `models::gpt` (a `CausalLM` of the token track) and
/// `models::gpt_critic` (the value model PPO builds from it).
///
/// ```cpp
/// unirl::models::gpt model{{.vocab_size = 16, .max_len = 32, .n_layer = 2, .n_head = 4, .d_model = 64}};
/// auto logits = model.logits(ids, torch::ones_like(ids, torch::kFloat));      // (B, L, 16)
/// auto cache = model.make_cache(B, 32);
/// auto next = model.logits_cached(ids, torch::ones_like(ids, torch::kFloat), cache);  // same logits
/// ```
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include <boost/hana.hpp>
#include <torch/torch.h>

#include <unirl/core/error.hpp>
#include <unirl/core/host.hpp>
#include <unirl/core/options.hpp>
#include <unirl/core/precision.hpp>
#include <unirl/models/activation_checkpoint.hpp>
#include <unirl/models/causal_lm.hpp>
#include <unirl/models/lora.hpp>
#include <unirl/models/module_adapter.hpp>
#include <unirl/ops/attention.hpp>
#include <unirl/ops/paged_attention.hpp>
#include <unirl/rollout/token.hpp>

namespace unirl::models {

/// Size of a `gpt`.
struct gpt_options {
  std::int64_t vocab_size = 32;
  std::int64_t max_len = 64;   // longest sequence (prompt + completion) the position table covers
  std::int64_t n_layer = 2;
  std::int64_t n_head = 4;
  std::int64_t d_model = 64;
  std::int64_t out_dim = 0;    // 0: vocab_size logits; 1: a scalar value head (critic)

  void validate(const std::string& p) const {
    options::require(vocab_size >= 2, p + "vocab_size", vocab_size, ">= 2");
    options::require(max_len >= 2, p + "max_len", max_len, ">= 2");
    options::require(n_layer >= 1, p + "n_layer", n_layer, ">= 1");
    options::require(n_head >= 1 && d_model % n_head == 0, p + "n_head", n_head, ">= 1 and dividing d_model");
    options::require(out_dim >= 0, p + "out_dim", out_dim, ">= 0");
  }
};

}  // namespace unirl::models

BOOST_HANA_ADAPT_STRUCT(unirl::models::gpt_options, vocab_size, max_len, n_layer, n_head, d_model, out_dim);

namespace unirl::models {

/// Keys and values of every layer for incremental decoding.
struct kv_cache {
  std::vector<torch::Tensor> k, v;  // per layer (B, H, capacity, Dh)
  torch::Tensor mask;               // (B, capacity) float, 1 = real token
  torch::Tensor count;              // (B,) int64, real tokens so far (the next position)
  std::int64_t length = 0;          // slots filled
  std::int64_t capacity = 0;

  /// A cache whose row i is row `index[i]` of this one ((n,) int64): one prompt's prefill shared
  /// by its group. Differentiable (index_select), so an update forward can share it too.
  kv_cache select(const torch::Tensor& index) const {
    UNIRL_CHECK(index.dim() == 1, "kv_cache::select: index must be 1-D, got sizes ", index.sizes());
    const auto idx = index.to(mask.device(), torch::kInt64);
    kv_cache c;
    for (std::size_t i = 0; i < k.size(); ++i) {
      c.k.push_back(k[i].index_select(0, idx));
      c.v.push_back(v[i].index_select(0, idx));
    }
    c.mask = mask.index_select(0, idx);
    c.count = count.index_select(0, idx);
    c.length = length;
    c.capacity = capacity;
    return c;
  }
};

/// One pre-norm transformer block.
class gpt_block_impl : public torch::nn::Cloneable<gpt_block_impl> {
 public:
  gpt_block_impl(std::int64_t d_model, std::int64_t n_head) : d_(d_model), h_(n_head) { reset(); }

  void reset() override {
    ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d_})));
    qkv = register_module("qkv", torch::nn::Linear(d_, 3 * d_));
    proj = register_module("proj", torch::nn::Linear(d_, d_));
    ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d_})));
    fc1 = register_module("fc1", torch::nn::Linear(d_, 4 * d_));
    fc2 = register_module("fc2", torch::nn::Linear(4 * d_, d_));
  }

  /// x (B, n, D); bias (B, 1, n, S) additive; k_all/v_all receive this chunk's keys at [start, start+n)
  /// when given (cache), else keys are this chunk only.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& bias, torch::Tensor* k_all, torch::Tensor* v_all,
                        std::int64_t start) {
    const auto B = x.size(0), n = x.size(1), dh = d_ / h_;
    auto parts = lora::forward(qkv, ln1(upcast(x))).view({B, n, 3, h_, dh}).permute({2, 0, 3, 1, 4});  // (3, B, H, n, Dh)
    auto q = parts[0], k = parts[1], v = parts[2];
    if (k_all) {
      k_all->slice(2, start, start + n).copy_(k);
      v_all->slice(2, start, start + n).copy_(v);
      k = k_all->slice(2, 0, start + n);
      v = v_all->slice(2, 0, start + n);
    }
    auto y = ops::attention(q, k, v, bias, 1.0 / std::sqrt(static_cast<double>(dh))).transpose(1, 2).reshape({B, n, d_});
    auto h = x + lora::forward(proj, y);
    return h + lora::forward(fc2, torch::gelu(lora::forward(fc1, ln2(upcast(h)))));
  }

  /// The paged forward (rollout engine): x (N, D) packed tokens of several sequences; their keys
  /// and values go into the pool (k_pool, v_pool: (slots, H, Dh)) and each token attends to its
  /// sequence's context slots (`ops::paged_attention`). The projections and the MLP run on all N.
  torch::Tensor forward_paged(const torch::Tensor& x, const paged_batch& b, torch::Tensor& k_pool, torch::Tensor& v_pool) {
    const auto N = x.size(0), dh = d_ / h_;
    const auto parts = lora::forward(qkv, ln1(upcast(x))).view({N, 3, h_, dh});
    const double scale = 1.0 / std::sqrt(static_cast<double>(dh));
    const auto y = ops::paged_attention(parts.select(1, 0), parts.select(1, 1), parts.select(1, 2), k_pool, v_pool, b, scale,
                                        [scale](const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                                const torch::Tensor& bias) { return ops::attention(q, k, v, bias, scale); });
    auto h = x + lora::forward(proj, y.reshape({N, d_}));
    return h + lora::forward(fc2, torch::gelu(lora::forward(fc1, ln2(upcast(h)))));
  }

  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  torch::nn::Linear qkv{nullptr}, proj{nullptr}, fc1{nullptr}, fc2{nullptr};

 private:
  std::int64_t d_, h_;
};
TORCH_MODULE_IMPL(gpt_block, gpt_block_impl);

/// The network: token + position embeddings, `n_layer` blocks, final norm, linear head.
class gpt_net_impl : public torch::nn::Cloneable<gpt_net_impl>, public lora::adaptable {
 public:
  explicit gpt_net_impl(gpt_options o = {}) : o_(o) {
    unirl::options::validate(o_);
    reset();
  }

  void reset() override {
    tok = register_module("tok", torch::nn::Embedding(o_.vocab_size, o_.d_model));
    pos = register_module("pos", torch::nn::Embedding(o_.max_len, o_.d_model));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (std::int64_t i = 0; i < o_.n_layer; ++i) blocks->push_back(gpt_block(o_.d_model, o_.n_head));
    ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({o_.d_model})));
    head = register_module("head", torch::nn::Linear(torch::nn::LinearOptions(
                                                         o_.d_model, o_.out_dim > 0 ? o_.out_dim : o_.vocab_size)
                                                         .bias(o_.out_dim > 0)));
    // GPT-2 initialisation: N(0, 0.02) weights, zero biases, residual projections scaled down.
    for (auto& p : named_parameters()) {
      torch::NoGradGuard ng;
      const auto& name = p.key();
      if (name.find("ln") != std::string::npos) continue;
      if (name.ends_with("bias")) p.value().zero_();
      else if (name.ends_with("proj.weight") || name.ends_with("fc2.weight"))
        p.value().normal_(0.0, 0.02 / std::sqrt(2.0 * static_cast<double>(o_.n_layer)));
      else p.value().normal_(0.0, 0.02);
    }
  }

  const gpt_options& config() const { return o_; }

  /// Recompute each block in the backward of a forward with gradients (`activation_checkpoint.hpp`).
  bool checkpoint_blocks = false;

  /// The blocks on x (B, N, D) with an additive bias, each checkpointed when `checkpoint_blocks`.
  torch::Tensor run_blocks(torch::Tensor x, const torch::Tensor& bias) {
    const bool recompute = checkpoint_blocks && torch::GradMode::is_enabled();
    for (const auto& b : *blocks) {
      auto block = std::dynamic_pointer_cast<gpt_block_impl>(b);
      if (!recompute) {
        x = block->forward(x, bias, nullptr, nullptr, 0);
        continue;
      }
      x = checkpoint([block](const torch::autograd::variable_list& in) {
            return torch::autograd::variable_list{block->forward(in[0], in[1], nullptr, nullptr, 0)};
          }, {x, bias}, block->parameters())[0];
    }
    return x;
  }

  // Positions must index the position table [0, max_len). Inside a `deferred_checks` scope (the
  // trainer's step) the check waits for the step's next read and the positions are clamped
  // meanwhile; outside one it reads them at once (one host synchronisation) and throws.
  torch::Tensor checked_positions(const torch::Tensor& positions, bool packed) const {
    if (positions.numel() == 0) return positions;
    const auto range = torch::stack({positions.min(), positions.max()});
    const auto max_len = o_.max_len;
    auto message = [max_len, packed](const std::vector<double>&) {
      return packed ? ::unirl::detail::concat("gpt: packed positions must lie in [0, max_len = ", max_len, ")")
                    : ::unirl::detail::concat("gpt: a sequence has more than max_len = ", max_len, " tokens");
    };
    if (auto* deferred = deferred_checks::current()) {
      deferred->add((range.select(0, 0) >= 0) & (range.select(0, 1) < max_len), {}, message);
      return positions.clamp(0, max_len - 1);
    }
    const auto r = to_host(range);
    if (!(r.at(0) >= 0 && r.at(1) < static_cast<double>(max_len))) throw ::unirl::error("unirl: " + message(r));
    return positions;
  }

  /// The token embeddings (B, L, D) of ids (B, L): the input of the `*_from_embeddings` forwards
  /// (which add the position embeddings), e.g. with some rows replaced by image features (models/vlm).
  torch::Tensor embed(const torch::Tensor& ids) { return tok(ids); }

  /// Full forward: ids (B, L), mask (B, L) -> (B, L, out) outputs.
  torch::Tensor forward(const torch::Tensor& ids, const torch::Tensor& mask) {
    check_inputs(ids, mask);
    return full(tok(ids), mask);
  }
  /// `forward` from input embeddings x (B, L, D) (`embed`, or any other) instead of ids.
  torch::Tensor forward_from_embeddings(const torch::Tensor& x, const torch::Tensor& mask) {
    check_embeddings(x, mask);
    return full(x, mask);
  }

  /// Packed forward: several sequences concatenated into each row without padding.
  /// ids (R, N) int64, positions (R, N) int64 (restarting at 0 for every sequence), segments
  /// (R, N) int64 (equal ids = the same sequence) -> (R, N, out). A token attends only to the
  /// tokens of its own segment at or before it (block-diagonal causal mask), so each sequence's
  /// outputs equal those of `forward` on that sequence alone.
  torch::Tensor forward_packed(const torch::Tensor& ids, const torch::Tensor& positions, const torch::Tensor& segments) {
    UNIRL_CHECK(ids.dim() == 2, "gpt: packed ids must be (R, N) int64, got sizes ", ids.sizes());
    return packed(tok(ids), positions, segments);
  }
  /// `forward_packed` from input embeddings x (R, N, D) instead of ids.
  torch::Tensor forward_packed_from_embeddings(const torch::Tensor& x, const torch::Tensor& positions,
                                               const torch::Tensor& segments) {
    UNIRL_CHECK(x.dim() == 3 && x.size(2) == o_.d_model, "gpt: packed embeddings must be (R, N, d_model = ",
                o_.d_model, "), got sizes ", x.sizes());
    return packed(x, positions, segments);
  }

 private:
  torch::Tensor full(const torch::Tensor& x0, const torch::Tensor& mask) {
    const auto L = x0.size(1);
    const auto m = mask.to(torch::kFloat);
    const auto positions = checked_positions((m.cumsum(1) - 1.0).clamp_min(0.0).to(torch::kInt64), false);
    const auto bias = attention_bias(m.to(torch::kBool), 0, L, x0.device());
    auto x = x0 + pos(positions);
    x = run_blocks(x, bias);
    return head(ln_f(upcast(x)));
  }
  torch::Tensor packed(const torch::Tensor& x0, const torch::Tensor& positions, const torch::Tensor& segments) {
    const auto sizes = x0.sizes().slice(0, 2);
    UNIRL_CHECK(positions.sizes() == sizes && segments.sizes() == sizes, "gpt: packed positions sizes ",
                positions.sizes(), " and segments sizes ", segments.sizes(), " must equal ids sizes ", sizes);
    const auto N = x0.size(1);
    const auto pos_ids = checked_positions(positions.to(torch::kInt64), true);
    const auto dev = x0.device();
    const auto idx = torch::arange(N, torch::TensorOptions(torch::kInt64).device(dev));
    const auto causal = (idx.unsqueeze(0) <= idx.unsqueeze(1)).unsqueeze(0);  // (1, N, N): key <= query
    const auto seg = segments.to(torch::kInt64);
    const auto same = seg.unsqueeze(2) == seg.unsqueeze(1);                   // (R, N, N)
    const auto allowed = causal & same;
    const auto bias = torch::zeros(allowed.sizes(), torch::TensorOptions(torch::kFloat).device(dev))
                          .masked_fill(allowed.logical_not(), -std::numeric_limits<float>::infinity())
                          .unsqueeze(1);  // (R, 1, N, N)
    auto x = x0 + pos(pos_ids);
    x = run_blocks(x, bias);
    return head(ln_f(upcast(x)));
  }

 public:
  /// An empty cache for `batch` sequences of up to `capacity` tokens.
  kv_cache make_cache(std::int64_t batch, std::int64_t capacity) const {
    UNIRL_CHECK(batch >= 0 && capacity >= 1, "gpt::make_cache: batch = ", batch, ", capacity = ", capacity,
                ": expected batch >= 0 and capacity >= 1");
    const auto p = tok->weight;
    const auto opts = p.options().requires_grad(false);
    kv_cache c;
    const auto dh = o_.d_model / o_.n_head;
    for (std::int64_t i = 0; i < o_.n_layer; ++i) {
      c.k.push_back(torch::zeros({batch, o_.n_head, capacity, dh}, opts));
      c.v.push_back(torch::zeros({batch, o_.n_head, capacity, dh}, opts));
    }
    c.mask = torch::zeros({batch, capacity}, opts.dtype(torch::kFloat));
    c.count = torch::zeros({batch}, opts.dtype(torch::kInt64));
    c.capacity = capacity;
    return c;
  }

  /// An empty paged pool of `slots` token slots per layer: (slots, H, Dh) keys and values.
  paged_kv make_paged_kv(std::int64_t slots) const {
    UNIRL_CHECK(slots >= 1, "gpt::make_paged_kv: slots = ", slots, ": expected >= 1");
    const auto opts = tok->weight.options().requires_grad(false);
    paged_kv kv;
    kv.slots = slots;
    for (std::int64_t i = 0; i < o_.n_layer; ++i) {
      kv.k.push_back(torch::zeros({slots, o_.n_head, o_.d_model / o_.n_head}, opts));
      kv.v.push_back(torch::zeros({slots, o_.n_head, o_.d_model / o_.n_head}, opts));
    }
    return kv;
  }

  /// The paged forward (`PagedCausalLM`): the packed tokens of `b` -> (R, out) outputs of
  /// `b.output_rows` (all N when undefined). Positions are checked on the host (`b.max_position`).
  torch::Tensor forward_paged(const paged_batch& b, paged_kv& kv) {
    UNIRL_CHECK(b.ids.defined() && b.ids.dim() == 1, "gpt: paged ids must be (N,) int64");
    torch::NoGradGuard ng;
    return forward_paged_from_embeddings(tok(b.ids), b, kv);
  }
  /// `forward_paged` from input embeddings x (N, D) of the batch's rows instead of its ids.
  torch::Tensor forward_paged_from_embeddings(const torch::Tensor& x0, const paged_batch& b, paged_kv& kv) {
    UNIRL_CHECK(b.positions.defined() && b.positions.dim() == 1 && x0.dim() == 2 && x0.size(0) == b.positions.size(0) &&
                    x0.size(1) == o_.d_model,
                "gpt: paged embeddings must be (N, d_model = ", o_.d_model, ") with (N,) positions, got sizes ",
                x0.sizes());
    UNIRL_CHECK(b.max_position < o_.max_len, "gpt: position ", b.max_position, " is past max_len = ", o_.max_len);
    UNIRL_CHECK(static_cast<std::int64_t>(kv.k.size()) == o_.n_layer, "gpt: the paged pool has ", kv.k.size(),
                " layers; the model ", o_.n_layer);
    torch::NoGradGuard ng;
    auto x = x0 + pos(b.positions);
    std::size_t l = 0;
    for (const auto& blk : *blocks) {
      x = blk->as<gpt_block_impl>()->forward_paged(x, b, kv.k[l], kv.v[l]);
      ++l;
    }
    if (b.output_rows.defined()) x = x.index_select(0, b.output_rows);
    return head(ln_f(upcast(x)));
  }

  /// Incremental forward of the next n tokens: ids (B, n), mask (B, n) -> (B, n, out).
  torch::Tensor forward_cached(const torch::Tensor& ids, const torch::Tensor& mask, kv_cache& c) {
    check_inputs(ids, mask);
    return cached(tok(ids), mask, c);
  }
  /// `forward_cached` from input embeddings x (B, n, D) instead of ids.
  torch::Tensor forward_cached_from_embeddings(const torch::Tensor& x, const torch::Tensor& mask, kv_cache& c) {
    check_embeddings(x, mask);
    return cached(x, mask, c);
  }

 private:
  torch::Tensor cached(const torch::Tensor& x0, const torch::Tensor& mask, kv_cache& c) {
    const auto n = x0.size(1), start = c.length;
    UNIRL_CHECK(start + n <= c.capacity, "gpt: the KV cache holds ", c.capacity, " tokens; ", start + n, " needed");
    const auto m = mask.to(torch::kFloat);
    c.mask.slice(1, start, start + n).copy_(m);
    const auto positions =
        checked_positions((c.count.unsqueeze(1).to(torch::kFloat) + m.cumsum(1) - 1.0).clamp_min(0.0).to(torch::kInt64),
                          false);
    c.count += m.sum(1).to(torch::kInt64);
    const auto bias = attention_bias(c.mask.slice(1, 0, start + n).to(torch::kBool), start, n, x0.device());
    auto x = x0 + pos(positions);
    const bool recompute = checkpoint_blocks && torch::GradMode::is_enabled();
    std::int64_t l = 0;
    for (const auto& b : *blocks) {
      auto& K = c.k[static_cast<std::size_t>(l)];
      auto& V = c.v[static_cast<std::size_t>(l)];
      if (recompute) {
        // The block as a pure function of x and the keys / values so far (copies: the cache is
        // written below); its new keys and values are outputs, written into the cache here.
        auto block = std::dynamic_pointer_cast<gpt_block_impl>(b);
        const auto outs = checkpoint([block, start](const torch::autograd::variable_list& in) {
              auto kb = torch::cat({in[2], in[2].new_zeros({in[2].size(0), in[2].size(1), in[0].size(1), in[2].size(3)})}, 2);
              auto vb = torch::cat({in[3], in[3].new_zeros({in[3].size(0), in[3].size(1), in[0].size(1), in[3].size(3)})}, 2);
              auto y = block->forward(in[0], in[1], &kb, &vb, start);
              return torch::autograd::variable_list{y, kb.slice(2, start), vb.slice(2, start)};
            }, {x, bias, K.slice(2, 0, start).clone(), V.slice(2, 0, start).clone()}, block->parameters());
        K.slice(2, start, start + n).copy_(outs[1]);
        V.slice(2, start, start + n).copy_(outs[2]);
        x = outs[0];
      } else {
        x = b->as<gpt_block_impl>()->forward(x, bias, &K, &V, start);
      }
      ++l;
    }
    c.length = start + n;
    return head(ln_f(upcast(x)));
  }

 public:
  torch::nn::Embedding tok{nullptr}, pos{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::LayerNorm ln_f{nullptr};
  torch::nn::Linear head{nullptr};

 private:
  void check_inputs(const torch::Tensor& ids, const torch::Tensor& mask) const {
    UNIRL_CHECK(ids.dim() == 2, "gpt: ids must be (B, L) int64, got sizes ", ids.sizes());
    UNIRL_CHECK(mask.sizes() == ids.sizes(), "gpt: mask sizes ", mask.sizes(), " differ from ids sizes ", ids.sizes());
  }
  void check_embeddings(const torch::Tensor& x, const torch::Tensor& mask) const {
    UNIRL_CHECK(x.dim() == 3 && x.size(2) == o_.d_model, "gpt: input embeddings must be (B, L, d_model = ", o_.d_model,
                "), got sizes ", x.sizes());
    UNIRL_CHECK(mask.sizes() == x.sizes().slice(0, 2), "gpt: mask sizes ", mask.sizes(),
                " differ from the embeddings' (B, L) = ", x.sizes().slice(0, 2));
  }

  // (B, 1, n, S) additive bias for queries at slots [start, start+n) over keys [0, S): a query sees
  // real keys at or before it, and always itself (so a padding row never softmaxes over nothing).
  static torch::Tensor attention_bias(const torch::Tensor& key_mask, std::int64_t start, std::int64_t n,
                                      torch::Device dev) {
    const auto S = key_mask.size(1);
    const auto qi = torch::arange(start, start + n, torch::TensorOptions(torch::kInt64).device(dev)).unsqueeze(1);
    const auto kj = torch::arange(S, torch::TensorOptions(torch::kInt64).device(dev)).unsqueeze(0);
    const auto causal = (kj <= qi).unsqueeze(0);                 // (1, n, S)
    const auto self = (kj == qi).unsqueeze(0);
    const auto allowed = (causal & key_mask.unsqueeze(1)) | self;  // (B, n, S)
    return torch::zeros(allowed.sizes(), torch::TensorOptions(torch::kFloat).device(dev))
        .masked_fill(allowed.logical_not(), -std::numeric_limits<float>::infinity())
        .unsqueeze(1);
  }

  gpt_options o_;
};
TORCH_MODULE_IMPL(gpt_net, gpt_net_impl);

/// The value model PPO builds from a `gpt`: same backbone (weights copied), scalar head.
struct gpt_critic : module_adapter<gpt_critic, gpt_net> {
  using module_adapter::module_adapter;
  /// V of every prefix: ids (B, L), mask (B, L) -> (B, L).
  torch::Tensor values(const torch::Tensor& ids, const torch::Tensor& mask) const {
    return net_.ptr()->forward(ids, mask).squeeze(-1);
  }
  /// V of every prefix of packed sequences (see `gpt_net_impl::forward_packed`): (R, N).
  torch::Tensor values_packed(const torch::Tensor& ids, const torch::Tensor& positions,
                              const torch::Tensor& segments) const {
    return net_.ptr()->forward_packed(ids, positions, segments).squeeze(-1);
  }
};
static_assert(TokenCritic<gpt_critic>);

/// The built-in causal LM adapter of the token track.
struct gpt : module_adapter<gpt, gpt_net> {
  using track = token_track;
  using cache_type = kv_cache;
  using module_adapter::module_adapter;
  explicit gpt(const gpt_options& o) : module_adapter(gpt_net(o)) {}

  torch::Tensor logits(const torch::Tensor& ids, const torch::Tensor& mask) const { return net_.ptr()->forward(ids, mask); }
  /// Packed logits (sequence packing, `pack_sequences`): ids, positions, segments (R, N) -> (R, N, V).
  torch::Tensor logits_packed(const torch::Tensor& ids, const torch::Tensor& positions,
                              const torch::Tensor& segments) const {
    return net_.ptr()->forward_packed(ids, positions, segments);
  }
  kv_cache make_cache(std::int64_t batch, std::int64_t capacity) const { return net_->make_cache(batch, capacity); }
  torch::Tensor logits_cached(const torch::Tensor& ids, const torch::Tensor& mask, kv_cache& c) const {
    return net_.ptr()->forward_cached(ids, mask, c);
  }
  /// Row i of the result is row `index[i]` of `c` (prefix sharing, `PrefixSharingCausalLM`).
  kv_cache select_cache(const kv_cache& c, const torch::Tensor& index) const { return c.select(index); }
  /// The paged cache of the rollout engine (`PagedCausalLM`): a pool of `slots` token slots.
  paged_kv make_paged_kv(std::int64_t slots) const { return net_->make_paged_kv(slots); }
  /// Logits (R, V) of the packed batch's output rows over the paged cache (`PagedCausalLM`).
  torch::Tensor logits_paged(const paged_batch& b, paged_kv& kv) const { return net_.ptr()->forward_paged(b, kv); }
  /// `logits_paged` from input embeddings x (N, d_model) of the batch's rows (models/vlm).
  torch::Tensor logits_paged_from_embeddings(const torch::Tensor& x, const paged_batch& b, paged_kv& kv) const {
    return net_.ptr()->forward_paged_from_embeddings(x, b, kv);
  }

  /// Input embeddings (B, L, d_model) of ids (B, L); the `*_from_embeddings` forwards take them
  /// (or any other embeddings, e.g. with image features in some rows: models/vlm) in place of
  /// ids, and `logits(ids, m) == logits_from_embeddings(embed(ids), m)`.
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

  std::int64_t vocab_size() const { return net_->config().vocab_size; }
  std::int64_t max_length() const { return net_->config().max_len; }
  /// Activation checkpointing of the decoder blocks (`checkpoint_kind::decoder_blocks`) in
  /// forwards with gradients; other kinds throw `config_error`. An empty list turns it off.
  void set_checkpointing(const std::vector<std::string>& kinds) {
    check_checkpointing_kinds(kinds, checkpointing_kinds(), "models::gpt");
    net_->checkpoint_blocks = wants_checkpointing(kinds, checkpoint_kind::decoder_blocks);
  }
  std::vector<std::string> checkpointing_kinds() const { return {std::string(checkpoint_kind::decoder_blocks)}; }

  /// A critic with this model's backbone weights and a fresh scalar head.
  gpt_critic make_critic() const {
    auto o = net_->config();
    o.out_dim = 1;
    gpt_net critic(o);
    critic->checkpoint_blocks = net_->checkpoint_blocks;
    // on the policy's device and in its dtype (a float64 policy gets a float64 critic)
    const auto like = net_->parameters().front();
    critic->to(like.device(), like.scalar_type());
    torch::NoGradGuard ng;
    auto src = net_->named_parameters();
    for (auto& p : critic->named_parameters())
      if (!p.key().starts_with("head.") && src.contains(p.key())) p.value().copy_(src[p.key()]);
    return gpt_critic(critic);
  }
};
static_assert(CausalLM<gpt>);
static_assert(PackedCausalLM<gpt>);
static_assert(PrefixSharingCausalLM<gpt>);
static_assert(PagedCausalLM<gpt>);
static_assert(CriticFactory<gpt>);

}  // namespace unirl::models

#pragma once
/// \file memory_plan.hpp
/// Scale on paper: what a Hugging Face decoder needs per device under data parallelism, ZeRO-1,
/// ZeRO-2 and ZeRO-3 (`parallel::data_parallel`, `parallel::zero`, `parallel::fully_sharded`),
/// with or without LoRA, autocast and activation checkpointing, computed from its `config.json`
/// alone (docs/parallel.md#scale-on-paper; `unirl-plan` prints the table).
///
/// ```cpp
/// const auto cfg = unirl::models::hf::decoder_config::load("Qwen2.5-7B");  // config.json only
/// const auto m = unirl::parallel::estimate_memory(cfg, {.strategy = unirl::parallel::sharding::zero3,
///                                                       .ranks = 8, .activation_bytes = 2,
///                                                       .checkpointing = true, .sequence = 2048});
/// std::cout << m.total() / 1e9 << " GB per device\n";
/// ```
/// The model-state terms are the library's own layouts, not a textbook's, and are exact: a test
/// trains the fixture decoders under each strategy on real Gloo ranks and finds
/// `engine_model_state` equal to `update_engine::peak_model_state_bytes()` to the byte.
/// - **Parameters and gradients.** Data parallelism and ZeRO-1 / 2 keep every trainable parameter
///   and, after the backward, its full local gradient (the reduction to the owner runs after the
///   backward, not in buckets during it); ZeRO-1 / 2 add their own slice's gradient (kept, zeroed,
///   between steps). ZeRO-3 keeps a 1/N chunk of each unit (a decoder layer; the rest: embeddings,
///   final norm, untied head) and its gradient, and inside the step holds gathered units
///   (`live`): the rest's parameters and gradient buffer, and four layer-sized buffers at most
///   (with the default prefetch: the current layer and the prefetched one, the current layer's
///   gradients and the previous layer's in their reduce; three with two layers, two with one).
///   Each unit is padded to N equal chunks.
/// - **Optimizer**: AdamW's two moments of what the rank steps (everything; its slice; its chunks).
/// - **Frozen parameters** (a LoRA base) are neither sharded nor in the engine's count; they are
///   in `parameters` at `frozen_bytes` each (2 for a bf16 base).
/// - **Activations** are an estimate, not measured: what autograd keeps for the backward of an
///   eager-attention decoder layer (inputs of the norms, projections and MLP, the rotary q / k,
///   the attention probabilities (B, H, S, S)), per micro-batch; with checkpointing, each layer's
///   input plus one layer's activations during its recomputation; plus the chunked log-prob's
///   logits (`logprob_chunk` tokens x vocabulary, twice: logits and log-softmax).
/// - **KV**: the rollout engine's pool for `kv_tokens` slots on this device
///   (`rollout::engine::slot_bytes()` per slot), when a sampler shares it.
/// Not counted: c10d's staging buffers, the allocator's fragmentation, the CUDA context, the
/// transient flat buffers of a gradient reduction, and a reference model (with LoRA the base is the
/// reference; a full reference copy would add the parameters again at `frozen_bytes`).
#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <unirl/core/error.hpp>
#include <unirl/core/options.hpp>
#include <unirl/models/hf/config.hpp>

namespace unirl::parallel {

/// How the trainable model state is laid out over the learner ranks.
enum class sharding { data_parallel, zero1, zero2, zero3 };

inline std::string_view sharding_name(sharding s) {
  switch (s) {
    case sharding::data_parallel: return "dp";
    case sharding::zero1: return "zero1";
    case sharding::zero2: return "zero2";
    case sharding::zero3: return "zero3";
  }
  return "?";
}
/// "dp", "zero1", "zero2" or "zero3"; anything else throws `config_error` naming `key` and the value.
inline sharding parse_sharding(std::string_view name, const std::string& key = "strategy") {
  for (const auto s : {sharding::data_parallel, sharding::zero1, sharding::zero2, sharding::zero3})
    if (name == sharding_name(s)) return s;
  throw config_error(key, "value '" + std::string(name) + "' is not a strategy: expected dp, zero1, zero2 or zero3");
}

/// What is being planned.
struct memory_setup {
  sharding strategy = sharding::data_parallel;
  std::int64_t ranks = 1;           // learner ranks the state is sharded over
  std::int64_t rank = 0;            // the rank whose share is counted (the last may own less)
  std::int64_t lora_rank = 0;       // 0: full fine-tuning
  std::vector<std::string> lora_targets{"all-linear"};  // as lora::options::targets
  std::int64_t weight_bytes = 4;    // a trainable parameter, its gradient, an AdamW moment (float32)
  std::int64_t frozen_bytes = 4;    // a frozen (LoRA base) parameter: 2 for a bf16 base
  std::int64_t activation_bytes = 4;  // 2 under bf16 / fp16 autocast
  bool checkpointing = false;       // activation checkpointing per decoder layer
  std::int64_t micro_batch = 1;     // sequences per forward
  std::int64_t sequence = 1024;     // tokens per sequence
  std::int64_t logprob_chunk = 1024;  // tokens whose logits exist at once (the chunked log-prob)
  std::int64_t kv_tokens = 0;       // rollout-engine KV slots on this device (0: no sampler here)
  std::int64_t kv_element_bytes = 4;  // 2 for a bf16 pool

  void validate() const {
    using ::unirl::options::require;
    require(ranks >= 1, "ranks", ranks, "an integer >= 1");
    require(rank >= 0 && rank < ranks, "rank", rank, "in [0, ranks)");
    require(lora_rank >= 0, "lora_rank", lora_rank, ">= 0 (0: no LoRA)");
    require(!lora_targets.empty(), "lora_targets", "[]", "at least one module pattern (or all-linear)");
    for (const auto& [key, bytes] : {std::pair{"weight_bytes", weight_bytes}, std::pair{"activation_bytes", activation_bytes},
                                     std::pair{"kv_element_bytes", kv_element_bytes}})
      require(bytes == 2 || bytes == 4 || bytes == 8, key, bytes, "2, 4 or 8");
    require(frozen_bytes == 1 || frozen_bytes == 2 || frozen_bytes == 4 || frozen_bytes == 8, "frozen_bytes", frozen_bytes, "1, 2, 4 or 8");
    require(micro_batch >= 1, "micro_batch", micro_batch, "an integer >= 1");
    require(sequence >= 1, "sequence", sequence, "an integer >= 1");
    require(logprob_chunk >= 1, "logprob_chunk", logprob_chunk, "an integer >= 1");
    require(kv_tokens >= 0, "kv_tokens", kv_tokens, ">= 0");
  }
};

/// Parameter counts of a decoder (elements).
struct parameter_counts {
  std::int64_t total = 0;            // every parameter, adapters included
  std::int64_t trainable = 0;        // the adapters under LoRA, else `total`
  std::int64_t frozen = 0;           // total - trainable
  std::int64_t layers = 0;           // decoder layers
  std::int64_t layer_trainable = 0;  // trainable elements of one layer
  std::int64_t rest_trainable = 0;   // trainable elements outside the layers (embeddings, final norm, head)
};

namespace detail {

struct linear_shape {
  std::string name;  // under the layer, e.g. "self_attn.q_proj"
  std::int64_t in = 0, out = 0;
  bool bias = false;
};
inline std::vector<linear_shape> layer_linears(const models::hf::decoder_config& c) {
  const std::int64_t h = c.hidden_size, d = c.head_size(), H = c.num_attention_heads, K = c.kv_heads(),
                     I = c.intermediate_size;
  if (c.is_gpt2())
    return {{"attn.c_attn", h, 3 * h, true}, {"attn.c_proj", h, h, true}, {"mlp.c_fc", h, I, true},
            {"mlp.c_proj", I, h, true}};
  return {{"self_attn.q_proj", h, H * d, c.qkv_bias()}, {"self_attn.k_proj", h, K * d, c.qkv_bias()},
          {"self_attn.v_proj", h, K * d, c.qkv_bias()}, {"self_attn.o_proj", H * d, h, c.o_bias()},
          {"mlp.gate_proj", h, I, c.mlp_biases()},      {"mlp.up_proj", h, I, c.mlp_biases()},
          {"mlp.down_proj", I, h, c.mlp_biases()}};
}
// lora::apply's rule: a pattern matches a module name equal to it or ending in "." + pattern.
inline bool pattern_matches(const std::string& name, const std::string& pattern) {
  return pattern == "all-linear" || name == pattern ||
         (name.size() > pattern.size() && name.ends_with(pattern) && name[name.size() - pattern.size() - 1] == '.');
}
inline std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }
// Elements of a unit of n elements that rank r of w owns (chunks of ceil(n / w), the last short).
inline std::int64_t owned_chunk(std::int64_t n, std::int64_t w, std::int64_t r) {
  const std::int64_t c = ceil_div(n, w);
  return std::clamp<std::int64_t>(n - r * c, 0, c);
}

}  // namespace detail

/// The parameters of the decoder `c` (as `hf::causal_lm` builds it) and, with `lora_rank` > 0,
/// of the adapters `lora::apply` would attach for `targets`. Throws `config_error` (key
/// "lora.targets") for a pattern that matches no linear layer, as `lora::apply` does.
inline parameter_counts count_parameters(const models::hf::decoder_config& c, std::int64_t lora_rank = 0,
                                         const std::vector<std::string>& targets = {"all-linear"}) {
  c.validate();
  UNIRL_CHECK(lora_rank >= 0, "count_parameters: lora_rank = ", lora_rank, ": expected >= 0 (0: no LoRA)");
  const std::int64_t h = c.hidden_size, L = c.num_hidden_layers;
  const std::string layer_prefix = c.is_gpt2() ? "transformer.h.0." : "model.layers.0.";
  std::int64_t base_layer = 0, adapters = 0;
  const auto linears = detail::layer_linears(c);
  for (const auto& l : linears) base_layer += l.in * l.out + (l.bias ? l.out : 0);
  if (c.is_gpt2()) base_layer += 4 * h;  // ln_1, ln_2: weight and bias
  else base_layer += 2 * h + (c.arch == models::hf::architecture::qwen3 ? 2 * c.head_size() : 0);
  if (lora_rank > 0) {
    for (const auto& pattern : targets) {
      bool hit = false;
      for (const auto& l : linears) hit = hit || detail::pattern_matches(layer_prefix + l.name, pattern);
      if (!hit) {
        std::string known;
        for (const auto& l : linears) known += (known.empty() ? "" : ", ") + l.name.substr(l.name.find('.') + 1);
        throw config_error("lora.targets", "pattern \"" + pattern + "\" matches no linear layer of the network; its "
                           "linear layers (output heads excluded) end in: " + known + " (or use all-linear)");
      }
    }
    for (const auto& l : linears)
      if (std::any_of(targets.begin(), targets.end(), [&](const auto& p) { return detail::pattern_matches(layer_prefix + l.name, p); }))
        adapters += lora_rank * (l.in + l.out);
  }
  std::int64_t rest = c.vocab_size * h + (c.tie_word_embeddings ? 0 : c.vocab_size * h);
  rest += c.is_gpt2() ? c.max_position_embeddings * h + 2 * h : h;  // wpe and ln_f; or the final norm
  parameter_counts p;
  p.layers = L;
  p.total = rest + L * (base_layer + adapters);
  p.layer_trainable = lora_rank > 0 ? adapters : base_layer;
  p.rest_trainable = lora_rank > 0 ? 0 : rest;
  p.trainable = p.rest_trainable + L * p.layer_trainable;
  p.frozen = p.total - p.trainable;
  return p;
}

/// Elements autograd keeps for the backward of one decoder layer over `batch` sequences of
/// `sequence` tokens (an estimate: see the file comment).
inline std::int64_t activation_elements_per_layer(const models::hf::decoder_config& c, std::int64_t batch,
                                                  std::int64_t sequence) {
  const std::int64_t T = batch * sequence, h = c.hidden_size, d = c.head_size(), H = c.num_attention_heads,
                     K = c.kv_heads(), I = c.intermediate_size;
  // norm inputs and outputs, residual (4h); q, k, v, rotary q / k and the attention output (3Hd + 2Kd + ...);
  // the MLP (gate, up, activation, product: 4I; GPT-2: fc output and gelu: 2I); the probabilities
  // and their dropout-free softmax input (2 B H S^2).
  const std::int64_t mlp = c.is_gpt2() ? 2 * I : 4 * I;
  return T * (4 * h + 5 * H * d + 2 * K * d + mlp) + 2 * batch * H * sequence * sequence;
}

/// Per-device bytes of one setup (see the file comment for what each term is).
struct memory_estimate {
  parameter_counts counts{};
  std::int64_t parameters = 0;   // values held between steps: trainable (or its shard) + frozen
  std::int64_t gradients = 0;    // at the peak, after the backward
  std::int64_t optimizer = 0;    // AdamW's moments
  std::int64_t live = 0;         // ZeRO-3: units gathered inside the step (parameters and gradient buffers)
  std::int64_t activations = 0;  // an estimate (see above)
  std::int64_t kv = 0;           // the rollout engine's KV slots
  /// What `update_engine::peak_model_state_bytes()` reports for this setup: the trainable
  /// parameters' and gradients' peak plus the moments (frozen parameters are not counted there).
  std::int64_t engine_model_state = 0;

  std::int64_t model_state() const { return parameters + gradients + optimizer + live; }
  std::int64_t total() const { return model_state() + activations + kv; }
};

/// The estimate of `s` for the decoder `c`. Throws `config_error` naming a bad setting.
inline memory_estimate estimate_memory(const models::hf::decoder_config& c, const memory_setup& s) {
  s.validate();
  memory_estimate m;
  m.counts = count_parameters(c, s.lora_rank, s.lora_targets);
  const auto& p = m.counts;
  const std::int64_t e = s.weight_bytes, N = s.ranks, r = s.rank, L = p.layers;
  std::int64_t values = 0, grads = 0, moments = 0;  // trainable elements
  switch (s.strategy) {
    case sharding::data_parallel:
      values = grads = moments = p.trainable;
      break;
    case sharding::zero1:
    case sharding::zero2: {
      // parallel::zero's partition: rank r owns [r T / N, (r + 1) T / N) of the flat vector.
      const std::int64_t own = p.trainable * (r + 1) / N - p.trainable * r / N;
      values = p.trainable;
      grads = p.trainable + own;  // the full local gradients after the backward, and its slice's (kept zeroed)
      moments = own;
      break;
    }
    case sharding::zero3: {
      const auto unit = [&](std::int64_t n, std::int64_t count) {
        if (n == 0) return;
        values += count * detail::ceil_div(n, N);         // the shard (padded)
        grads += count * detail::owned_chunk(n, N, r);    // its pieces' gradients
        moments += count * detail::owned_chunk(n, N, r);
      };
      unit(p.layer_trainable, L);
      unit(p.rest_trainable, 1);
      std::int64_t live = 0;
      if (p.rest_trainable > 0) live += 2 * detail::ceil_div(p.rest_trainable, N) * N;
      if (p.layer_trainable > 0) {
        const std::int64_t buffers = L >= 3 ? 4 : L == 2 ? 3 : L;  // see the file comment
        live += buffers * detail::ceil_div(p.layer_trainable, N) * N;
      }
      m.live = live * e;
      break;
    }
  }
  m.parameters = values * e + p.frozen * s.frozen_bytes;
  m.gradients = grads * e;
  m.optimizer = 2 * moments * e;
  m.engine_model_state = (values + grads + 2 * moments) * e + m.live;
  // Activations of one micro-batch.
  const std::int64_t T = s.micro_batch * s.sequence;
  const std::int64_t per_layer = activation_elements_per_layer(c, s.micro_batch, s.sequence);
  std::int64_t act = s.checkpointing ? L * T * c.hidden_size + per_layer : L * per_layer;
  act += 2 * T * c.hidden_size + 2 * std::min(T, s.logprob_chunk) * c.vocab_size;  // embeddings, final norm; logits
  m.activations = act * s.activation_bytes;
  m.kv = s.kv_tokens * L * 2 * c.kv_heads() * c.head_size() * s.kv_element_bytes;
  return m;
}

}  // namespace unirl::parallel

#pragma once
/// \file causal_lm.hpp
/// Language models of the token track: `CausalLM` and its refinements (sequence packing, prefix
/// sharing), and the value models PPO trains next to them (`TokenCritic`).
///
/// ```cpp
/// static_assert(unirl::CausalLM<unirl::models::gpt>);
/// template <unirl::CausalLM M> void greedy(const M& m, const torch::Tensor& ids);
/// ```
/// The log-probability helpers over these models live in `rollout/token_logprob.hpp`, sequence
/// packing and prompt de-duplication in `rollout/packing.hpp`.
#include <concepts>
#include <cstdint>
#include <vector>

#include <torch/torch.h>

#include <unirl/concepts/model.hpp>
#include <unirl/concepts/track.hpp>

namespace unirl {

/// A causal language model adapter of the token track.
///
/// Minimal complete definition (besides `ModelAdapter` with `track = token_track`):
/// - `torch::Tensor logits(const torch::Tensor& ids, const torch::Tensor& mask) const` — ids (B, L)
///   int64, mask (B, L) float (1 = real token; padding may sit anywhere, positions count real
///   tokens only); returns (B, L, V) next-token logits;
/// - `typename M::cache_type` and `cache_type make_cache(std::int64_t batch, std::int64_t capacity) const`;
/// - `torch::Tensor logits_cached(const torch::Tensor& ids, const torch::Tensor& mask, cache_type& cache) const`
///   — the next n tokens (B, n) with their mask (B, n), appended to the cache; returns (B, n, V)
///   equal to the corresponding rows of `logits` over the whole sequence so far;
/// - `std::int64_t vocab_size() const`.
template <class M>
concept CausalLM = ModelAdapter<M> && std::same_as<typename M::track, token_track> &&
    requires(const M& m, const torch::Tensor& t, typename M::cache_type& c, std::int64_t n) {
      { m.logits(t, t) } -> std::same_as<torch::Tensor>;
      { m.make_cache(n, n) } -> std::same_as<typename M::cache_type>;
      { m.logits_cached(t, t, c) } -> std::same_as<torch::Tensor>;
      { m.vocab_size() } -> std::convertible_to<std::int64_t>;
    };

/// A `CausalLM` that can run sequence packing (`pack_sequences`): several sequences concatenated
/// into each row without padding. `logits_packed(ids, positions, segments)` takes (R, N) int64
/// each — positions restart at 0 for every sequence, equal segment ids mark one sequence, and a
/// token attends only to its own segment at or before it — and returns (R, N, V) equal to each
/// sequence's logits computed alone.
template <class M>
concept PackedCausalLM = CausalLM<M> && requires(const M& m, const torch::Tensor& t) {
  { m.logits_packed(t, t, t) } -> std::same_as<torch::Tensor>;
};

/// A `CausalLM` whose cache rows can be selected (prefix sharing): `select_cache(cache, index)`
/// returns a cache whose row i is row `index[i]` ((n,) int64) of `cache`, differentiably. The
/// sampler then prefills each distinct prompt once for its whole group, and the update forward
/// (`share_prompt`) runs each distinct prompt once and lets every completion attend to it.
template <class M>
concept PrefixSharingCausalLM = CausalLM<M> &&
    requires(const M& m, const typename M::cache_type& c, const torch::Tensor& index) {
      { m.select_cache(c, index) } -> std::same_as<typename M::cache_type>;
    };

/// A `CausalLM` whose logits are its final hidden states times an LM head without bias:
/// `hidden_states(ids, mask)` (B, L, D) and `lm_head_weight()` (V, D), with
/// `logits(ids, mask) == hidden_states(ids, mask) @ lm_head_weight()^T`. The update's log-probs
/// (`rollout::update_logprob`) then run the head and the log-softmax in row chunks
/// (`ops::linear_logprob`) and never hold the (B, L, V) logits — at a 150k vocabulary those are
/// larger than the model. The packed and shared-prompt layouts use `hidden_states_packed(ids,
/// positions, segments)` and `hidden_states_cached(ids, mask, cache)` likewise when the model has them.
template <class M>
concept HiddenStateCausalLM = CausalLM<M> && requires(const M& m, const torch::Tensor& t) {
  { m.hidden_states(t, t) } -> std::same_as<torch::Tensor>;
  { m.lm_head_weight() } -> std::same_as<torch::Tensor>;
};

/// Keys and values of a paged cache: per layer one pool of `slots` token slots, (slots, H_kv, Dh)
/// each. Which slot holds which token of which sequence is the caller's business (the rollout
/// engine's block tables, rollout/kv_pool.hpp); the model only reads and writes the slots a
/// `paged_batch` names.
struct paged_kv {
  std::vector<torch::Tensor> k, v;  // per layer (slots, H_kv, Dh)
  std::int64_t slots = 0;
};

/// One forward of a `PagedCausalLM` over a packed batch of N tokens from several sequences: each
/// sequence contributes a contiguous run of rows (a decode token, or a chunk of a prompt), and
/// its keys and values so far sit in pool slots. Built on the host by the caller
/// (`rollout::make_paged_batch`), tensors on the model's device.
struct paged_batch {
  /// One sequence's rows [row, row + n): its tokens at positions [context - n, context), which
  /// attend to the `context` slots `context_slots` ((context,) int64, in position order; the
  /// last n are this chunk's own `write_slots`). `bias` (1, 1, n, context) is the causal mask.
  struct chunk {
    std::int64_t row = 0, n = 0, context = 0;
    torch::Tensor context_slots, bias;
  };
  torch::Tensor ids;          // (N,) int64
  torch::Tensor positions;    // (N,) int64, each token's position in its sequence
  torch::Tensor write_slots;  // (N,) int64, the pool slot that receives each token's key and value
  // The sequences with one row (decoding), attended together: rows (S,), their context slots
  // (S, C) padded to the longest context C, and a bias (S, 1, 1, C): 0 for real keys, -inf for
  // padding. Undefined when no sequence has a single row.
  torch::Tensor decode_rows, decode_slots, decode_bias;
  std::vector<std::int64_t> decode_context;  // (S) their context lengths, on the host
  std::vector<chunk> chunks;  // the sequences with more than one row
  torch::Tensor output_rows;  // (R,) int64 rows whose outputs are returned; undefined: all N
  std::int64_t max_position = -1;  // the largest position (known on the host: no device read)
  // On the host, the same N rows: the ids, and each token's index in its run of equal ids within
  // its sequence (0 after a different id; a run goes on across chunks, steps and shared prefix
  // blocks). A model whose inputs are runs of ids (image-slot ids, models/vlm) reads them here
  // without a device read.
  std::vector<std::int64_t> host_ids, run_index;

  std::int64_t tokens() const { return ids.defined() ? ids.size(0) : 0; }
};

/// A `CausalLM` that runs over a paged KV cache (the rollout engine, rollout/engine.hpp): one
/// forward over a packed batch of decode tokens and prefill chunks of many sequences.
///
/// Minimal complete definition (besides `CausalLM`):
/// - `paged_kv make_paged_kv(std::int64_t slots) const` — an empty pool of `slots` token slots
///   per layer, in the weights' dtype and on their device;
/// - `torch::Tensor logits_paged(const paged_batch& b, paged_kv& kv) const` — writes each token's
///   keys and values into `b.write_slots` of `kv`, attends each token to its sequence's context
///   slots, and returns the (R, V) next-token logits of `b.output_rows` (all N rows when
///   undefined), equal to the rows of `logits` over each whole sequence;
/// - `std::int64_t max_length() const` — the longest sequence the model takes (positions are
///   checked against it on the host, from `b.max_position`).
/// Called without gradients; `ops::paged_attention` (ops/paged_attention.hpp) does the gather and
/// the attention for a model that projects its queries, keys and values itself.
template <class M>
concept PagedCausalLM = CausalLM<M> && requires(const M& m, const paged_batch& b, paged_kv& kv, std::int64_t n) {
  { m.make_paged_kv(n) } -> std::same_as<paged_kv>;
  { m.logits_paged(b, kv) } -> std::same_as<torch::Tensor>;
  { m.max_length() } -> std::convertible_to<std::int64_t>;
};

/// A value model for PPO on the token track: `values(ids, mask)` gives (B, L), V of each prefix.
template <class C>
concept TokenCritic = TrainableModule<C> && requires(const C& c, const torch::Tensor& t) {
  { c.values(t, t) } -> std::same_as<torch::Tensor>;
};

/// A `TokenCritic` that can run packed sequences: `values_packed(ids, positions, segments)` (R, N).
template <class C>
concept PackedTokenCritic = TokenCritic<C> && requires(const C& c, const torch::Tensor& t) {
  { c.values_packed(t, t, t) } -> std::same_as<torch::Tensor>;
};

}  // namespace unirl

#pragma once
/// \file embedding_lm.hpp
/// `EmbeddingCausalLM`: what a vision-language model (`models::vlm::vlm<LM>`, docs/vlm.md) needs
/// from its language model — a `CausalLM` whose forward can start from input embeddings, so image
/// features can stand in for token embeddings. A language model opens itself to it through
/// members, and its network through `embedding_lm_traits` (the way mp-units opens foreign types:
/// traits plus a concept), so a type the library never saw can be specialised without touching it.
///
/// ```cpp
/// static_assert(unirl::EmbeddingCausalLM<unirl::models::gpt>);
/// unirl::models::vlm::vlm<my_lm> model{tower, projector, my_lm{...}};   // any EmbeddingCausalLM
/// ```
#include <concepts>
#include <cstdint>
#include <type_traits>
#include <utility>

#include <torch/torch.h>

#include <unirl/concepts/causal_lm.hpp>

namespace unirl {

/// How a VLM reaches into a language model's network `Net` (a `torch::nn::ModuleHolder`). The
/// primary template uses the network's own members; specialise it for a network that has other
/// names (the library does for `models::gpt_net` and `models::hf::decoder_net`).
/// - `hidden_size(net)`: the width of its input embeddings (what the projector must give);
/// - `vocab_size(net)`: its text vocabulary (image-slot ids start there);
/// - `embed(net, ids)`: the token embeddings (B, L, D) of ids (B, L) (or (N,) -> (N, D)) the caller
///   has checked, with no device read;
/// - `remake(net)`: a fresh network of the same configuration (LibTorch's `Cloneable::reset`).
template <class Net>
struct embedding_lm_traits {
  static std::int64_t hidden_size(const Net& n)
    requires requires { { n.ptr()->hidden_size() } -> std::convertible_to<std::int64_t>; }
  {
    return n.ptr()->hidden_size();
  }
  static std::int64_t vocab_size(const Net& n)
    requires requires { { n.ptr()->vocab_size() } -> std::convertible_to<std::int64_t>; }
  {
    return n.ptr()->vocab_size();
  }
  static torch::Tensor embed(const Net& n, const torch::Tensor& ids)
    requires requires { { n.ptr()->embed(ids) } -> std::same_as<torch::Tensor>; }
  {
    return n.ptr()->embed(ids);
  }
  static Net remake(const Net& n)
    requires requires { { n.ptr()->remake() } -> std::same_as<Net>; }
  {
    return n.ptr()->remake();
  }
};

/// The network type of a language-model adapter (`net()`).
template <class LM>
using lm_net_t = std::remove_cvref_t<decltype(std::declval<const LM&>().net())>;

/// A `CausalLM` a vision-language model can be built over.
///
/// Minimal complete definition (besides `CausalLM`):
/// - `net()`, its network (a module holder; the VLM registers it as `language_model`), and a
///   constructor from that network (an adapter sharing its weights);
/// - `torch::Tensor logits_from_embeddings(const torch::Tensor& x, const torch::Tensor& mask) const`
///   — `logits(ids, mask)` with the input embeddings x (B, L, D) given;
/// - `torch::Tensor logits_cached_from_embeddings(x, mask, cache_type&) const` — `logits_cached` likewise;
/// - `embedding_lm_traits<lm_net_t<LM>>` with `hidden_size`, `vocab_size`, `embed` and `remake`.
/// The VLM models `PackedCausalLM`, `PrefixSharingCausalLM`, `HiddenStateCausalLM`,
/// `PagedCausalLM` and `CriticFactory` when its language model does and also has the matching
/// `*_from_embeddings` forward (docs/vlm.md lists them).
template <class LM>
concept EmbeddingCausalLM =
    CausalLM<LM> && std::constructible_from<LM, lm_net_t<LM>> &&
    requires(const LM& m, const lm_net_t<LM>& net, const torch::Tensor& t, typename LM::cache_type& c) {
      { m.logits_from_embeddings(t, t) } -> std::same_as<torch::Tensor>;
      { m.logits_cached_from_embeddings(t, t, c) } -> std::same_as<torch::Tensor>;
      { embedding_lm_traits<lm_net_t<LM>>::hidden_size(net) } -> std::convertible_to<std::int64_t>;
      { embedding_lm_traits<lm_net_t<LM>>::vocab_size(net) } -> std::convertible_to<std::int64_t>;
      { embedding_lm_traits<lm_net_t<LM>>::embed(net, t) } -> std::same_as<torch::Tensor>;
      { embedding_lm_traits<lm_net_t<LM>>::remake(net) } -> std::same_as<lm_net_t<LM>>;
    };

}  // namespace unirl

#pragma once
/// \file vlm.hpp
/// `vlm::vlm<LM>`: a vision-language model (vision tower, LLaVA projector, language model `LM` =
/// `models::gpt` or `models::hf::causal_lm`) as a token-track `CausalLM`, so GRPO, PPO, the token
/// sampler, packing and prefix sharing train it unchanged. Input ids >= the language model's
/// vocabulary are IMAGE-SLOT TOKENS: `vocab_size() + s` stands for one feature row of the image
/// in slot s of the model's image table (`images()`, a `vision_cache` shared by every copy of the
/// model), and the k-th id of a run of equal image-slot ids (a run: consecutive positions of one
/// row, within one packed segment) is the image's feature row k. The embedding of such a
/// position is row k of `multi_modal_projector(features of slot s)`; every other position takes
/// the language model's token embedding, and the language model runs from those embeddings.
///
/// ```cpp
/// namespace vlm = unirl::models::vlm;
/// auto model = vlm::make_small({.vocab_size = 32});            // CLIP tower + projector + models::gpt
/// model.images().clear();                                       // each step: a new image table
/// std::vector<std::int64_t> prompt = {1};
/// auto img = model.images().add(torch::rand({3, 28, 28}));      // 49 ids, each vocab_size() + 0
/// prompt.insert(prompt.end(), img.begin(), img.end());
/// prompt.push_back(2);
/// unirl::trainer<vlm::vlm<unirl::models::gpt>, unirl::algo::grpo<>, my_reward> t{model, reward, {...}};
/// auto s = t.step(unirl::prompt_batch{.tokens = {prompt}});
/// s.extra["vision_tower_calls"];                                // 1: the image was encoded once
/// ```
/// The vision tower encodes an image once per step, lazily, without gradient (`vision_cache`);
/// the projector runs in every forward (it is trained). With a trainable tower
/// (`freeze_vision_tower = false`), a forward with gradients recomputes the features of the
/// images it shows, with gradient, once per forward; a copy with its own trainable tower (the
/// reference model) encodes its own features. Parameter names are LLaVA's: `vision_tower.*`,
/// `multi_modal_projector.*`, `language_model.*`, so optimizer groups by prefix
/// (`train::optimizer_options::groups`) set per-module learning rates and clipping.
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <boost/hana.hpp>
#include <torch/torch.h>

#include <unirl/concepts/causal_lm.hpp>
#include <unirl/concepts/embedding_lm.hpp>
#include <unirl/core/error.hpp>
#include <unirl/core/options.hpp>
#include <unirl/models/activation_checkpoint.hpp>
#include <unirl/models/gpt.hpp>
#include <unirl/models/hf/causal_lm.hpp>
#include <unirl/models/lora.hpp>
#include <unirl/models/module_adapter.hpp>
#include <unirl/models/vision/clip.hpp>
#include <unirl/models/vision/config.hpp>
#include <unirl/models/vision/projector.hpp>
#include <unirl/models/vlm/vision_cache.hpp>
#include <unirl/rollout/token.hpp>

namespace unirl::models::vlm {

/// How a `vlm` turns images into feature rows, and whether its vision tower trains.
struct vlm_options {
  std::int64_t vision_feature_layer = -2;  // LLaVA's: the hidden state fed to the projector (-2: input of the last layer)
  vision::select_strategy vision_feature_select_strategy = vision::select_strategy::drop_first;  // "default": drop CLS
  bool freeze_vision_tower = true;  // true: the tower's parameters get no gradient and its features are cached for
                                    // the whole step; false: trained, the update recomputes them with gradient
  bool cache_features = true;  // false: no vision-feature cache, every forward encodes its images again (each
                               // counted in vision_tower_calls); for measuring what the cache saves

  void validate(const std::string&) const {}  // the layer is checked against the tower by the model
};

/// Size of the built-in small VLM (`make_small`): a CLIP tower, a LLaVA projector, a `models::gpt`.
struct small_vlm_options {
  std::int64_t vocab_size = 32;           // the language model's (text) vocabulary
  std::int64_t max_len = 128;             // longest sequence (text + image tokens + completion)
  std::int64_t n_layer = 2;               // language model
  std::int64_t n_head = 4;
  std::int64_t d_model = 64;
  std::int64_t image_size = 28;           // vision tower: 28 x 28 images of 4 x 4 patches: 49 feature rows
  std::int64_t patch_size = 4;
  std::int64_t num_channels = 3;
  std::int64_t vision_hidden = 64;
  std::int64_t vision_layers = 2;
  std::int64_t vision_heads = 4;
  std::int64_t vision_intermediate = 128;
  std::string vision_act = "quick_gelu";
  std::string projector_act = "gelu";
  vlm_options model{};

  void validate(const std::string& p) const {
    options::require(image_size >= 1 && patch_size >= 1 && image_size % patch_size == 0, p + "image_size", image_size,
                     "a positive multiple of patch_size");
    options::require(vision_heads >= 1 && vision_hidden % vision_heads == 0, p + "vision_heads", vision_heads,
                     ">= 1 and dividing vision_hidden");
    options::require(vision_layers >= 1, p + "vision_layers", vision_layers, ">= 1");
    options::require(vision_intermediate >= 1, p + "vision_intermediate", vision_intermediate, ">= 1");
    options::require(num_channels >= 1, p + "num_channels", num_channels, ">= 1");
  }
};

}  // namespace unirl::models::vlm

BOOST_HANA_ADAPT_STRUCT(unirl::models::vlm::vlm_options, vision_feature_layer, vision_feature_select_strategy,
                        freeze_vision_tower, cache_features);
BOOST_HANA_ADAPT_STRUCT(unirl::models::vlm::small_vlm_options, vocab_size, max_len, n_layer, n_head, d_model,
                        image_size, patch_size, num_channels, vision_hidden, vision_layers, vision_heads,
                        vision_intermediate, vision_act, projector_act, model);

namespace unirl {

/// The built-in GPT's network as a VLM's language model (concepts/embedding_lm.hpp).
template <>
struct embedding_lm_traits<models::gpt_net> {
  static std::int64_t hidden_size(const models::gpt_net& n) { return n->config().d_model; }
  static std::int64_t vocab_size(const models::gpt_net& n) { return n->config().vocab_size; }
  static torch::Tensor embed(const models::gpt_net& n, const torch::Tensor& ids) { return n.ptr()->embed(ids); }
  static models::gpt_net remake(const models::gpt_net& n) { return models::gpt_net(n->config()); }
};
/// A Hugging Face decoder's network as a VLM's language model: `embed` skips the id check (its
/// device read); the VLM's callers checked the ids.
template <>
struct embedding_lm_traits<models::hf::decoder_net> {
  static std::int64_t hidden_size(const models::hf::decoder_net& n) { return n->config().hidden_size; }
  static std::int64_t vocab_size(const models::hf::decoder_net& n) { return n->config().vocab_size; }
  static torch::Tensor embed(const models::hf::decoder_net& n, const torch::Tensor& ids) {
    return n.ptr()->embed_unchecked(ids);
  }
  static models::hf::decoder_net remake(const models::hf::decoder_net& n) {
    return models::hf::decoder_net(n->config(), n->out_dim());
  }
};

static_assert(EmbeddingCausalLM<models::gpt> && EmbeddingCausalLM<models::hf::causal_lm>);

}  // namespace unirl

namespace unirl::models::vlm {

namespace detail {

/// The network type of a language-model adapter (`gpt_net`, `hf::decoder_net`, ...).
template <class LM>
using lm_net_t = ::unirl::lm_net_t<LM>;

template <class LMNet>
using lm_traits = ::unirl::embedding_lm_traits<LMNet>;

/// A freshly initialised network of the same configuration (Cloneable's reset).
template <class LMNet>
LMNet remake(const LMNet& n) { return lm_traits<LMNet>::remake(n); }
template <class LMNet>
std::int64_t hidden_size(const LMNet& n) { return lm_traits<LMNet>::hidden_size(n); }
template <class LMNet>
std::int64_t vocab_size(const LMNet& n) { return lm_traits<LMNet>::vocab_size(n); }

/// Token embeddings of in-range ids: the network's own `embed` (with its checks) when it has one
/// callable here, else the traits' (the caller checked them).
template <class LMNet>
torch::Tensor embed_text(LMNet& lm, const torch::Tensor& ids) {
  if constexpr (requires { lm->embed(ids); }) return lm->embed(ids);
  else return lm_traits<LMNet>::embed(lm, ids);
}

/// Whether any parameter of `m` requires a gradient.
inline bool trainable(const torch::nn::Module& m) {
  for (const auto& p : m.parameters())
    if (p.requires_grad()) return true;
  return false;
}

/// The sum of the parameters' version counters (changes with every in-place update: an optimizer step, a load).
inline std::int64_t parameter_version(const torch::nn::Module& m) {
  std::int64_t v = 0;
  for (const auto& p : m.parameters()) v += static_cast<std::int64_t>(p._version());
  return v;
}

}  // namespace detail

/// The network of a `vlm` (and of its critic): `vision_tower`, `multi_modal_projector`,
/// `language_model` (LLaVA's module names, in LLaVA's order).
template <class LMNet>
class vlm_net_impl : public torch::nn::Cloneable<vlm_net_impl<LMNet>> {
 public:
  vlm_net_impl(vision::clip_vision tower, vision::llava_projector projector, LMNet lm)
      : vision_tower(std::move(tower)), multi_modal_projector(std::move(projector)), language_model(std::move(lm)) {
    UNIRL_CHECK(!vision_tower.is_empty() && !multi_modal_projector.is_empty() && !language_model.is_empty(),
                "vlm::vlm_net: the vision tower, projector and language model must all be given");
    register_all();
  }

  /// Fresh parts of the same configuration (LibTorch's `clone()` calls it, then copies the weights).
  void reset() override {
    vision_tower = vision::clip_vision(vision_tower->config());
    const auto& p = *multi_modal_projector;
    multi_modal_projector =
        vision::llava_projector(p.in_features(), p.out_features(), p.activation(), p.linear_1->bias.defined());
    language_model = detail::remake(language_model);
    register_all();
  }

  vision::clip_vision vision_tower{nullptr};
  vision::llava_projector multi_modal_projector{nullptr};
  LMNet language_model{nullptr};

 private:
  void register_all() {
    vision_tower = this->register_module("vision_tower", vision_tower);
    multi_modal_projector = this->register_module("multi_modal_projector", multi_modal_projector);
    language_model = this->register_module("language_model", language_model);
  }
};

/// Holder of a `vlm_net_impl`.
template <class LMNet>
class vlm_net : public torch::nn::ModuleHolder<vlm_net_impl<LMNet>> {
 public:
  using torch::nn::ModuleHolder<vlm_net_impl<LMNet>>::ModuleHolder;
  using Impl = vlm_net_impl<LMNet>;
};

namespace detail {

/// A deep copy of `net` (LoRA adapters included) on `device`, each parameter's requires_grad kept.
template <class LMNet>
vlm_net<LMNet> clone_net(const vlm_net<LMNet>& net, torch::Device device) {
  auto cloned = std::dynamic_pointer_cast<vlm_net_impl<LMNet>>(lora::clone(*net.ptr(), device));
  UNIRL_CHECK(cloned != nullptr, "vlm: cloning the network failed");
  const auto src = net->named_parameters();
  for (auto& p : cloned->named_parameters()) p.value().set_requires_grad(src[p.key()].requires_grad());
  return vlm_net<LMNet>(cloned);
}

/// The shared state of a model and its copies: the image table, which tower computes the
/// cached features, and the feature options.
struct vision_state {
  std::shared_ptr<vision_cache> cache;
  std::uint64_t tower_id = 0;
  vlm_options options{};
};

/// The projected feature rows (K, D) of K image-slot ids `ids`, the k-th of its run taking its
/// image's feature row `ks[i]`: checks each id against the image table, takes the features cached
/// or encodes the missing images (one tower call), and runs the projector once.
template <class LMNet>
torch::Tensor image_rows(vlm_net_impl<LMNet>& net, const vision_state& st, const std::vector<std::int64_t>& ids,
                         const std::vector<std::int64_t>& ks) {
  auto& cache = *st.cache;
  const auto V = cache.vocab_size();
  const auto K = static_cast<std::int64_t>(ids.size());
  std::map<std::int64_t, std::int64_t> offset;  // slot -> its first row in the table of the slots shown
  for (std::int64_t i = 0; i < K; ++i) {
    const auto id = ids[static_cast<std::size_t>(i)], k = ks[static_cast<std::size_t>(i)];
    UNIRL_CHECK(id >= 0, "vlm: token id ", id, " is negative: expected ids in [0, vocab_size = ", V,
                ") or image-slot ids >= ", V);
    const auto s = id - V;
    UNIRL_CHECK(s < cache.size(), "vlm: image-slot token id ", id, " (slot ", s, ") is not registered: the image ",
                "table holds ", cache.size(), " image(s), ids [", V, ", ", V + cache.size(),
                ") (vision_cache::add registers one; clear() empties the table)");
    UNIRL_CHECK(k < cache.tokens(s), "vlm: image-slot token id ", id, " (slot ", s, ") repeats ", k + 1,
                " times in a run, but its image has ", cache.tokens(s),
                " feature rows: expected each image's ids once per occurrence (add the image again for another)");
    offset.emplace(s, 0);
  }
  // The features of the slots shown: cached, or encoded now (all missing ones in one tower call).
  auto& tower = net.vision_tower;
  const auto& o = st.options;
  const bool tower_trains = detail::trainable(*tower);
  std::vector<std::int64_t> slots;
  for (const auto& [s, off] : offset) slots.push_back(s);
  std::vector<torch::Tensor> feats(slots.size());
  auto encode = [&](const std::vector<std::size_t>& which) {
    std::vector<torch::Tensor> images;
    for (const auto i : which) images.push_back(cache.image(slots[i]));
    const auto packed = tower->features_packed(images, o.vision_feature_layer, o.vision_feature_select_strategy);
    std::int64_t at = 0;
    for (const auto i : which) {
      const auto n = cache.tokens(slots[i]);
      UNIRL_CHECK(at + n <= packed.size(0), "vlm: the vision tower returned ", packed.size(0),
                  " feature rows; the images registered need more (slot ", slots[i], ": ", n, ")");
      feats[i] = packed.slice(0, at, at + n);
      at += n;
    }
  };
  std::vector<std::size_t> all(slots.size());
  for (std::size_t i = 0; i < slots.size(); ++i) all[i] = i;
  if (tower_trains && torch::GradMode::is_enabled()) {
    encode(all);  // the tower trains: this forward's features, with gradient
    cache.count_recomputed(static_cast<std::int64_t>(slots.size()));
  } else if (!o.cache_features) {
    torch::NoGradGuard ng;
    encode(all);  // no cache: this forward's features, encoded again
    cache.count_encoded(static_cast<std::int64_t>(slots.size()));
  } else {
    const std::int64_t version = tower_trains ? detail::parameter_version(*tower) : -1;
    std::vector<std::size_t> missing;
    const auto dev = tower->vision_model->embeddings->patch_embedding->weight.device();
    for (std::size_t i = 0; i < slots.size(); ++i) {
      if (const auto* f = cache.find(slots[i], st.tower_id, version)) feats[i] = f->to(dev);
      else missing.push_back(i);
    }
    cache.count_reused(static_cast<std::int64_t>(slots.size() - missing.size()));
    if (!missing.empty()) {
      torch::NoGradGuard ng;
      encode(missing);
      for (const auto i : missing) cache.store(slots[i], st.tower_id, version, feats[i]);
      cache.count_encoded(static_cast<std::int64_t>(missing.size()));
    }
  }
  std::int64_t rows = 0;
  for (std::size_t i = 0; i < slots.size(); ++i) {
    offset[slots[i]] = rows;
    rows += feats[i].size(0);
  }
  const auto table = net.multi_modal_projector->forward(torch::cat(feats, 0));  // (rows, D)
  std::vector<std::int64_t> index(static_cast<std::size_t>(K));
  for (std::size_t i = 0; i < ids.size(); ++i) index[i] = offset[ids[i] - V] + ks[i];
  const auto idx = torch::tensor(index, torch::kInt64).to(table.device());
  return table.index_select(0, idx);
}

/// The multimodal input embeddings (B, L, D) of ids (B, L) (see the file comment). `segments`
/// (packed rows) ends runs at segment boundaries too. One host read per call: the image-slot
/// positions of the ids (none for text-only ids), besides the language model's own checks.
template <class LMNet>
torch::Tensor multimodal_embeddings(vlm_net_impl<LMNet>& net, const vision_state& st, const torch::Tensor& ids,
                                    const torch::Tensor& segments = {}) {
  UNIRL_CHECK(ids.dim() == 2, "vlm: ids must be (B, L) int64, got sizes ", ids.sizes());
  UNIRL_CHECK(ids.scalar_type() == torch::kInt64 || ids.scalar_type() == torch::kInt32,
              "vlm: ids must be integers, got ", ids.scalar_type());
  auto& lm = net.language_model;
  auto& cache = *st.cache;
  const auto V = cache.vocab_size();
  if (ids.numel() == 0) return embed_text(lm, ids);
  const auto id64 = ids.to(torch::kInt64);
  const auto special = (id64 < 0) | (id64 >= V);
  // Position k of each id in its run of equal ids (a run ends at a change of id or of segment).
  const auto B = id64.size(0), L = id64.size(1);
  const auto io = torch::TensorOptions(torch::kInt64).device(id64.device());
  const auto pos = torch::arange(L, io).unsqueeze(0).expand({B, L});
  const auto first = torch::full({B, 1}, std::numeric_limits<std::int64_t>::min(), io);
  auto starts = id64 != torch::cat({first, id64.slice(1, 0, L - 1)}, 1);
  if (segments.defined()) {
    UNIRL_CHECK(segments.sizes() == ids.sizes(), "vlm: segments sizes ", segments.sizes(), " differ from ids sizes ",
                ids.sizes());
    const auto seg = segments.to(torch::kInt64);
    starts = starts | (seg != torch::cat({first, seg.slice(1, 0, L - 1)}, 1));
  }
  const auto run_start = std::get<0>(torch::where(starts, pos, torch::zeros_like(pos)).cummax(1));
  const auto host = torch::stack({id64.masked_select(special), (pos - run_start).masked_select(special)}).cpu();
  const auto K = host.size(1);
  if (K == 0) return embed_text(lm, id64);
  const auto a = host.accessor<std::int64_t, 2>();
  std::vector<std::int64_t> slot_ids(static_cast<std::size_t>(K)), run(static_cast<std::size_t>(K));
  for (std::int64_t i = 0; i < K; ++i) {
    slot_ids[static_cast<std::size_t>(i)] = a[0][i];
    run[static_cast<std::size_t>(i)] = a[1][i];
  }
  const auto x = embed_text(lm, id64.masked_fill(special, 0));
  return x.index_put({special}, image_rows(net, st, slot_ids, run).to(x.device(), x.scalar_type()));
}

/// Token embeddings of ids already checked by the caller (the engine checks them on the host): no device read.
template <class LMNet>
torch::Tensor embed_checked_ids(const LMNet& lm, const torch::Tensor& ids) {
  return lm_traits<LMNet>::embed(lm, ids);
}

/// The multimodal input embeddings (N, D) of a paged batch's rows (the rollout engine): image-slot
/// ids and their index in their run come from the batch's host copies (`paged_batch::host_ids`,
/// `run_index`), so a run split across chunks, steps or shared prefix blocks takes the right
/// feature rows, and nothing is read from the device.
template <class LMNet>
torch::Tensor paged_embeddings(vlm_net_impl<LMNet>& net, const vision_state& st, const paged_batch& b) {
  const auto N = b.tokens();
  UNIRL_CHECK(static_cast<std::int64_t>(b.host_ids.size()) == N && static_cast<std::int64_t>(b.run_index.size()) == N,
              "vlm: the paged batch has ", N, " rows but ", b.host_ids.size(), " host ids and ", b.run_index.size(),
              " run indices (rollout::make_paged_batch fills them)");
  const auto V = st.cache->vocab_size();
  std::vector<std::int64_t> rows, slot_ids, run;
  for (std::int64_t i = 0; i < N; ++i) {
    const auto id = b.host_ids[static_cast<std::size_t>(i)];
    if (id >= 0 && id < V) continue;
    rows.push_back(i);
    slot_ids.push_back(id);
    run.push_back(b.run_index[static_cast<std::size_t>(i)]);
  }
  const auto& lm = net.language_model;
  if (rows.empty()) return embed_checked_ids(lm, b.ids);
  const auto r = torch::tensor(rows, torch::kInt64).to(b.ids.device());
  const auto x = embed_checked_ids(lm, b.ids.index_fill(0, r, 0));
  return x.index_put({r}, image_rows(net, st, slot_ids, run).to(x.device(), x.scalar_type()));
}

/// Checks the parts fit together and the options the tower.
template <class LMNet>
void check_parts(const vlm_net_impl<LMNet>& net, const vlm_options& o) {
  const auto& vc = net.vision_tower->config();
  const auto& p = *net.multi_modal_projector;
  UNIRL_CHECK(p.in_features() == vc.hidden_size, "vlm: the projector takes ", p.in_features(),
              " features: expected the vision tower's hidden_size = ", vc.hidden_size);
  UNIRL_CHECK(p.out_features() == hidden_size(net.language_model), "vlm: the projector gives ", p.out_features(),
              " features: expected the language model's hidden size = ", hidden_size(net.language_model));
  const auto Lv = vc.num_hidden_layers;
  UNIRL_CHECK(o.vision_feature_layer >= -(Lv + 1) && o.vision_feature_layer <= Lv, "vlm: vision_feature_layer = ",
              o.vision_feature_layer, ": expected in [", -(Lv + 1), ", ", Lv, "] (a tower of ", Lv, " layers)");
}

}  // namespace detail

template <EmbeddingCausalLM LM>
struct vlm;

/// The value model PPO builds from a `vlm` (`make_critic()`): the same multimodal backbone
/// (weights copied; the image table shared) with the language model's value head
/// (`gpt_critic`'s / `hf::causal_lm_critic`'s): `values(ids, mask)` (B, L).
template <EmbeddingCausalLM LM>
struct vlm_critic : module_adapter<vlm_critic<LM>, vlm_net<detail::lm_net_t<LM>>> {
  using lm_net_type = detail::lm_net_t<LM>;
  using net_type = vlm_net<lm_net_type>;
  using base = module_adapter<vlm_critic<LM>, net_type>;

  vlm_critic(net_type net, detail::vision_state state) : base(std::move(net)), st_(std::move(state)) {}

  /// V of every prefix: ids (B, L) (image-slot ids allowed), mask (B, L) -> (B, L).
  torch::Tensor values(const torch::Tensor& ids, const torch::Tensor& mask) const {
    auto& n = *this->net_.ptr();
    return finish(n.language_model->forward_from_embeddings(detail::multimodal_embeddings(n, st_, ids), mask));
  }
  /// V of every prefix of packed sequences: ids, positions, segments (R, N) -> (R, N).
  torch::Tensor values_packed(const torch::Tensor& ids, const torch::Tensor& positions,
                              const torch::Tensor& segments) const {
    auto& n = *this->net_.ptr();
    return finish(n.language_model->forward_packed_from_embeddings(detail::multimodal_embeddings(n, st_, ids, segments),
                                                                   positions, segments));
  }
  /// A deep copy sharing the image table (and the cached features while its tower is frozen).
  vlm_critic clone() const {
    vlm_critic c = *this;
    c.net_ = detail::clone_net(this->net_, this->device());
    if (detail::trainable(*this->net_->vision_tower)) c.st_.tower_id = st_.cache->new_tower_id();
    return c;
  }
  vision_cache& images() const { return *st_.cache; }

 private:
  static torch::Tensor finish(const torch::Tensor& out) {
    if constexpr (std::is_same_v<lm_net_type, hf::decoder_net>) return out.squeeze(-1).to(torch::kFloat);
    else return out.squeeze(-1);
  }
  detail::vision_state st_;
};

/// A vision-language model of the token track over language model `LM`: any `EmbeddingCausalLM`
/// (concepts/embedding_lm.hpp; `models::gpt` and `models::hf::causal_lm` are); see the file
/// comment. Models `CausalLM`, and `PackedCausalLM`, `PrefixSharingCausalLM`,
/// `HiddenStateCausalLM`, `PagedCausalLM` (the rollout engine) and `CriticFactory` exactly when
/// `LM` does. A type that is not an `EmbeddingCausalLM` fails to compile naming the concept.
template <EmbeddingCausalLM LM>
struct vlm : module_adapter<vlm<LM>, vlm_net<detail::lm_net_t<LM>>> {
  using track = token_track;
  using cache_type = typename LM::cache_type;
  using language_model_type = LM;
  using lm_net_type = detail::lm_net_t<LM>;
  using net_type = vlm_net<lm_net_type>;
  using base = module_adapter<vlm<LM>, net_type>;

  /// From its parts (`vision::load_llava` gives them for a checkpoint); a new, empty image table.
  /// `freeze_vision_tower` switches the tower's requires_grad off.
  vlm(vision::clip_vision tower, vision::llava_projector projector, LM language_model, vlm_options o = {})
      : vlm(net_type(std::move(tower), std::move(projector), language_model.net()), o) {}
  explicit vlm(net_type net, vlm_options o = {}) : base(std::move(net)) {
    ::unirl::options::validate(o);
    detail::check_parts(*this->net_, o);
    const auto& vc = this->net_->vision_tower->config();
    st_.cache = std::make_shared<vision_cache>(detail::vocab_size(this->net_->language_model), vc,
                                               o.vision_feature_select_strategy);
    st_.tower_id = st_.cache->new_tower_id();
    st_.options = o;
    if (o.freeze_vision_tower)
      for (auto& p : this->net_->vision_tower->parameters()) p.set_requires_grad(false);
  }

  // ---- images ---------------------------------------------------------------------------------

  /// The image table (shared with every copy: `clone()`, the reference, the critic).
  vision_cache& images() const { return *st_.cache; }
  std::shared_ptr<vision_cache> shared_images() const { return st_.cache; }
  /// Images the vision tower encoded, this model and its copies together (`vision_cache`).
  std::int64_t vision_tower_calls() const { return st_.cache->vision_tower_calls(); }
  /// The trainer's statistics hook: `vision_tower_calls` since the previous report (one step)
  /// and `images` (the table's size).
  void report_stats(std::map<std::string, double>& out) const {
    out["vision_tower_calls"] = static_cast<double>(st_.cache->take_vision_tower_calls());
    out["images"] = static_cast<double>(st_.cache->size());
  }
  const vlm_options& options() const { return st_.options; }

  // ---- parts ------------------------------------------------------------------------------------

  vision::clip_vision& vision_tower() const { return this->net_.ptr()->vision_tower; }
  vision::llava_projector& projector() const { return this->net_.ptr()->multi_modal_projector; }
  /// The language model (an adapter sharing this model's weights).
  LM language_model() const { return LM(this->net_.ptr()->language_model); }

  /// The multimodal input embeddings (B, L, D) of ids (B, L): image-slot positions take their
  /// projected image features, the others the language model's token embeddings. `segments`
  /// ((B, L), packed rows) ends runs of image-slot ids at segment boundaries.
  torch::Tensor embed(const torch::Tensor& ids, const torch::Tensor& segments = {}) const {
    return detail::multimodal_embeddings(*this->net_.ptr(), st_, ids, segments);
  }

  // ---- CausalLM -------------------------------------------------------------------------------

  torch::Tensor logits(const torch::Tensor& ids, const torch::Tensor& mask) const {
    return language_model().logits_from_embeddings(embed(ids), mask);
  }
  cache_type make_cache(std::int64_t batch, std::int64_t capacity) const {
    return language_model().make_cache(batch, capacity);
  }
  /// The next tokens (B, n) through the language model's KV cache. A run of image-slot ids must
  /// lie within one call (the sampler and the update prefill each prompt in one).
  torch::Tensor logits_cached(const torch::Tensor& ids, const torch::Tensor& mask, cache_type& c) const {
    return language_model().logits_cached_from_embeddings(embed(ids), mask, c);
  }
  std::int64_t vocab_size() const { return detail::vocab_size(this->net_->language_model); }
  std::int64_t max_length() const
    requires requires(const LM& m) { m.max_length(); }
  {
    return language_model().max_length();
  }

  /// The paged forward of the rollout engine (`PagedCausalLM`, when `LM` is one): image-slot ids
  /// take their feature rows (found on the host from the batch's `host_ids` and `run_index`, so a
  /// run split across prefill chunks, steps or shared prefix blocks is placed right); each image
  /// is encoded once and then served from the image table's cache.
  paged_kv make_paged_kv(std::int64_t slots) const
    requires PagedCausalLM<LM>
  {
    return language_model().make_paged_kv(slots);
  }
  torch::Tensor logits_paged(const paged_batch& b, paged_kv& kv) const
    requires PagedCausalLM<LM>
  {
    return language_model().logits_paged_from_embeddings(detail::paged_embeddings(*this->net_.ptr(), st_, b), b, kv);
  }
  /// The ids the model takes: the vocabulary, then one per registered image (the engine checks
  /// requests against it; an image's feature rows repeat its id).
  std::int64_t input_vocab_size() const { return vocab_size() + st_.cache->size(); }

  /// Packed logits (`PackedCausalLM`, when `LM` is one): ids, positions, segments (R, N) -> (R, N, V).
  torch::Tensor logits_packed(const torch::Tensor& ids, const torch::Tensor& positions,
                              const torch::Tensor& segments) const
    requires PackedCausalLM<LM>
  {
    return language_model().logits_packed_from_embeddings(embed(ids, segments), positions, segments);
  }
  /// Prefix sharing (`PrefixSharingCausalLM`, when `LM` is one).
  cache_type select_cache(const cache_type& c, const torch::Tensor& index) const
    requires PrefixSharingCausalLM<LM>
  {
    return language_model().select_cache(c, index);
  }
  /// Hidden states and the LM head (`HiddenStateCausalLM`, when `LM` is one).
  torch::Tensor hidden_states(const torch::Tensor& ids, const torch::Tensor& mask) const
    requires HiddenStateCausalLM<LM>
  {
    return language_model().hidden_states_from_embeddings(embed(ids), mask);
  }
  torch::Tensor hidden_states_packed(const torch::Tensor& ids, const torch::Tensor& positions,
                                     const torch::Tensor& segments) const
    requires HiddenStateCausalLM<LM> && PackedCausalLM<LM>
  {
    return language_model().hidden_states_packed_from_embeddings(embed(ids, segments), positions, segments);
  }
  torch::Tensor hidden_states_cached(const torch::Tensor& ids, const torch::Tensor& mask, cache_type& c) const
    requires HiddenStateCausalLM<LM>
  {
    return language_model().hidden_states_cached_from_embeddings(embed(ids), mask, c);
  }
  torch::Tensor lm_head_weight() const
    requires HiddenStateCausalLM<LM>
  {
    return language_model().lm_head_weight();
  }

  // ---- training ---------------------------------------------------------------------------------

  /// Activation checkpointing: `decoder_blocks` (the language model's layers) and `vision_tower`
  /// (the tower's encoder layers, in forwards with gradients of a trained tower); other kinds
  /// throw `config_error`.
  void set_checkpointing(const std::vector<std::string>& kinds)
    requires requires(LM& lm) { lm.set_checkpointing(kinds); }
  {
    check_checkpointing_kinds(kinds, checkpointing_kinds(), "models::vlm::vlm");
    std::vector<std::string> lm_kinds, tower_kinds;
    for (const auto& k : kinds) (k == checkpoint_kind::vision_tower ? tower_kinds : lm_kinds).push_back(k);
    auto lm = language_model();
    lm.set_checkpointing(lm_kinds);
    vision_tower()->set_checkpointing(tower_kinds);
  }
  std::vector<std::string> checkpointing_kinds() const
    requires requires(LM& lm, const std::vector<std::string>& k) { lm.set_checkpointing(k); }
  {
    return {std::string(checkpoint_kind::decoder_blocks), std::string(checkpoint_kind::vision_tower)};
  }

  /// A deep copy (reference model, EMA copy) sharing the image table. While the vision tower is
  /// frozen the copy reuses the features the original cached (same weights); a copy of a
  /// trainable tower encodes its own.
  vlm clone() const {
    vlm c = *this;
    c.net_ = detail::clone_net(this->net_, this->device());
    if (detail::trainable(*this->net_->vision_tower)) c.st_.tower_id = st_.cache->new_tower_id();
    return c;
  }

  /// PPO's critic: this backbone (vision tower, projector, language model; weights copied, the
  /// image table shared) with the language model's value head (`make_critic()` of `LM`).
  vlm_critic<LM> make_critic() const
    requires CriticFactory<LM>
  {
    auto lm_critic = language_model().make_critic();
    auto& n = *this->net_.ptr();
    auto tower = std::dynamic_pointer_cast<vision::clip_vision_impl>(n.vision_tower->clone(this->device()));
    auto proj = std::dynamic_pointer_cast<vision::llava_projector_impl>(n.multi_modal_projector->clone(this->device()));
    UNIRL_CHECK(tower && proj, "vlm::make_critic: cloning the vision tower or projector failed");
    const auto src_t = n.vision_tower->named_parameters();
    for (auto& p : tower->named_parameters()) p.value().set_requires_grad(src_t[p.key()].requires_grad());
    auto st = st_;
    if (detail::trainable(*n.vision_tower)) st.tower_id = st_.cache->new_tower_id();
    return vlm_critic<LM>(net_type(vision::clip_vision(tower), vision::llava_projector(proj), lm_critic.net()),
                          std::move(st));
  }

 private:
  detail::vision_state st_;
};

/// A prompt's token ids with its image tokens replaced by image-slot ids: run i of
/// `image_token` (a processor's image token, e.g. LLaVA's `image_token_index`, either one id or
/// already repeated once per feature row) becomes `images[i]` (the ids `vision_cache::add`
/// returned). Throws naming the run when the counts or lengths do not match.
/// ```cpp
/// auto ids = vlm::place_images(tokenizer.encode("USER: <image>\nWhat is it?"), cfg.image_token_index,
///                              {model.images().add(pixels)});
/// ```
inline std::vector<std::int64_t> place_images(const std::vector<std::int64_t>& tokens, std::int64_t image_token,
                                              const std::vector<std::vector<std::int64_t>>& images) {
  std::vector<std::int64_t> out;
  std::size_t run = 0;
  for (std::size_t i = 0; i < tokens.size();) {
    if (tokens[i] != image_token) {
      out.push_back(tokens[i++]);
      continue;
    }
    std::size_t j = i;
    while (j < tokens.size() && tokens[j] == image_token) ++j;
    UNIRL_CHECK(run < images.size(), "vlm::place_images: the tokens hold more than ", images.size(),
                " run(s) of image token ", image_token, ": expected one image per run");
    const auto& img = images[run];
    UNIRL_CHECK(j - i == 1 || j - i == img.size(), "vlm::place_images: run ", run, " of image token ", image_token,
                " has ", j - i, " ids: expected 1 or the image's ", img.size(), " feature rows");
    out.insert(out.end(), img.begin(), img.end());
    ++run;
    i = j;
  }
  UNIRL_CHECK(run == images.size(), "vlm::place_images: ", images.size(), " image(s) for ", run, " run(s) of image token ",
              image_token, ": expected one image per run");
  return out;
}

/// The built-in small VLM for examples and tests: a CLIP tower (`image_size` / `patch_size`,
/// `vision_hidden`, `vision_layers`), a LLaVA projector, and a `models::gpt` language model.
inline vlm<gpt> make_small(const small_vlm_options& o = {}) {
  ::unirl::options::validate(o);
  vision::vision_config vc;
  vc.family = vision::vision_family::clip;
  vc.hidden_size = o.vision_hidden;
  vc.intermediate_size = o.vision_intermediate;
  vc.num_hidden_layers = o.vision_layers;
  vc.num_attention_heads = o.vision_heads;
  vc.image_size = o.image_size;
  vc.patch_size = o.patch_size;
  vc.num_channels = o.num_channels;
  vc.hidden_act = o.vision_act;
  gpt lm(gpt_options{.vocab_size = o.vocab_size, .max_len = o.max_len, .n_layer = o.n_layer, .n_head = o.n_head,
          .d_model = o.d_model});
  return vlm<gpt>(vision::clip_vision(vc), vision::llava_projector(o.vision_hidden, o.d_model, o.projector_act), lm,
                  o.model);
}

static_assert(CausalLM<vlm<gpt>> && PackedCausalLM<vlm<gpt>> && PrefixSharingCausalLM<vlm<gpt>>);
static_assert(!HiddenStateCausalLM<vlm<gpt>>);
static_assert(PagedCausalLM<vlm<gpt>> && PagedCausalLM<vlm<hf::causal_lm>>);
static_assert(CriticFactory<vlm<gpt>> && PackedTokenCritic<vlm_critic<gpt>>);
static_assert(CausalLM<vlm<hf::causal_lm>> && PackedCausalLM<vlm<hf::causal_lm>> &&
              PrefixSharingCausalLM<vlm<hf::causal_lm>> && HiddenStateCausalLM<vlm<hf::causal_lm>>);
static_assert(CriticFactory<vlm<hf::causal_lm>> && PackedTokenCritic<vlm_critic<hf::causal_lm>>);

}  // namespace unirl::models::vlm

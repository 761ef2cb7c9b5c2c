// The VLM adapter (include/unirl/models/vlm/): image-slot tokens against the independent LLaVA
// fixture (tests/fixtures/vlm), the vision-feature cache (encoded once per step, equal to
// recomputing), its place in the trainer (GRPO, PPO's critic, the reference, parameter groups),
// the language models' embeddings entry points it runs on, the rollout engine's paged forward
// (image runs split across prefill chunks, steps and shared prefix blocks), and multi-turn
// episodes whose observations show images (each encoded once over the rollout and the update).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include <catch2/catch.hpp>
#include <torch/torch.h>

#include <unirl/io/safetensors.hpp>
#include <unirl/models/char_tokenizer.hpp>
#include <unirl/multi_turn.hpp>
#include <unirl/rollout/engine.hpp>
#include <unirl/train/sft.hpp>
#include <unirl/vlm.hpp>

using namespace unirl;
namespace vision = unirl::models::vision;
namespace vlm = unirl::models::vlm;
using small_vlm = vlm::vlm<models::gpt>;

namespace {

std::filesystem::path fixture_dir() { return std::filesystem::path(UNIRL_SOURCE_DIR) / "tests" / "fixtures" / "vlm"; }

double max_abs_diff(const torch::Tensor& a, const torch::Tensor& b) {
  REQUIRE(a.sizes() == b.sizes());
  return (a.to(torch::kDouble) - b.to(torch::kDouble)).abs().max().item<double>();
}

// A small VLM: 16 x 16 images of 4 x 4 patches (16 feature rows), text vocabulary 16.
small_vlm tiny_vlm(bool freeze = true, std::int64_t max_len = 64) {
  return vlm::make_small({.vocab_size = 16, .max_len = max_len, .n_layer = 2, .n_head = 2, .d_model = 32,
                          .image_size = 16, .patch_size = 4, .vision_hidden = 32, .vision_layers = 2,
                          .vision_heads = 4, .vision_intermediate = 64, .model = {.freeze_vision_tower = freeze}});
}

std::vector<std::int64_t> cat(std::initializer_list<std::vector<std::int64_t>> parts) {
  std::vector<std::int64_t> out;
  for (const auto& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

// Left-padded (B, L) ids and mask of rows of different lengths.
std::pair<torch::Tensor, torch::Tensor> left_padded(const std::vector<std::vector<std::int64_t>>& rows) {
  std::size_t L = 0;
  for (const auto& r : rows) L = std::max(L, r.size());
  auto ids = torch::zeros({static_cast<std::int64_t>(rows.size()), static_cast<std::int64_t>(L)}, torch::kInt64);
  auto mask = torch::zeros(ids.sizes(), torch::kFloat);
  for (std::size_t b = 0; b < rows.size(); ++b)
    for (std::size_t j = 0; j < rows[b].size(); ++j) {
      const auto c = static_cast<std::int64_t>(L - rows[b].size() + j);
      ids[static_cast<std::int64_t>(b)][c] = rows[b][j];
      mask[static_cast<std::int64_t>(b)][c] = 1.0;
    }
  return {ids, mask};
}

// Fraction of completion tokens equal to 1.
struct count_ones {
  torch::Tensor operator()(const token_rollout& b) const {
    const auto hit = (b.completion_ids == 1).to(torch::kFloat) * b.completion_mask;
    return hit.sum(1) / b.completion_mask.sum(1).clamp_min(1.0);
  }
};

// Scores that differ within every group, so that an update has a gradient.
struct random_reward {
  torch::Tensor operator()(const token_rollout& b) const { return torch::rand({b.size()}); }
};

// Three prompts, each with its own image (a fresh table).
prompt_batch three_image_prompts(small_vlm& m, std::uint64_t seed) {
  torch::manual_seed(seed);
  m.images().clear();
  prompt_batch in;
  for (std::int64_t i = 0; i < 3; ++i) {
    const auto img = m.images().add(torch::rand({3, 16, 16}));
    in.tokens.push_back(cat({{1, 2 + i}, img, {3}}));
  }
  return in;
}

}  // namespace

TEST_CASE("vlm: logits equal the independent LLaVA implementation's, image tokens mapped to slots",
          "[cpu][vlm][fixture]") {
  for (const std::string name : {"llava_clip", "llava_siglip"}) {
    INFO(name);
    const auto parts = vision::load_llava(fixture_dir() / name);
    auto model = vlm::from_llava(parts);
    const auto ref = io::load_safetensors(fixture_dir() / (name + ".reference.safetensors"));
    const auto pixels = ref.at("pixel_values");
    const auto ids = ref.at("input_ids").to(torch::kInt64);
    const auto mask = ref.at("attention_mask");
    const auto token = parts.config.image_token_index;
    // Row b shows image b: its run of image tokens becomes image b's slot ids (place_images).
    std::vector<std::vector<std::int64_t>> rows;
    for (std::int64_t b = 0; b < ids.size(0); ++b) {
      const auto slot = model.images().add(pixels[b]);
      const auto row = ids[b].contiguous();
      const std::vector<std::int64_t> text(row.data_ptr<std::int64_t>(), row.data_ptr<std::int64_t>() + row.numel());
      rows.push_back(vlm::place_images(text, token, {slot}));
    }
    const auto slot_ids = left_padded(rows).first;
    REQUIRE(slot_ids.sizes() == ids.sizes());
    CHECK(((slot_ids >= model.vocab_size()) == (ids == token)).all().item<bool>());
    const auto want = ref.at("logits");
    const auto diff = max_abs_diff(model.logits(slot_ids, mask), want);
    WARN(name << ": max |logits - reference| = " << diff << " (fp32)");
    CHECK(diff < 1e-5);
    // The same through the hidden states and the head, packing, and the KV cache.
    CHECK(max_abs_diff(torch::matmul(model.hidden_states(slot_ids, mask), model.lm_head_weight().t()), want) < 1e-5);
    const auto L = ids.size(1);
    const auto positions = torch::arange(L, torch::kInt64).repeat({1, ids.size(0)});
    const auto segments = torch::arange(ids.size(0), torch::kInt64).repeat_interleave(L).unsqueeze(0);
    const auto packed = model.logits_packed(slot_ids.reshape({1, -1}), positions, segments);
    CHECK(max_abs_diff(packed.view_as(want), want) < 1e-5);
    auto cache = model.make_cache(ids.size(0), L + 1);
    CHECK(max_abs_diff(model.logits_cached(slot_ids, mask, cache), want) < 1e-5);
    CHECK(model.vision_tower_calls() == 2);  // each image encoded once for all four forwards
    CHECK(model.images().counts().reused == 6);
    // The rollout engine's paged forward (a Hugging Face language model): each row in two chunks
    // split inside its run of image-slot ids, over scattered blocks, equals the reference.
    torch::NoGradGuard ng;
    const std::int64_t bs = 4;
    rollout::block_pool pool{256, bs};
    auto kv = model.make_paged_kv(pool.blocks() * bs);
    std::vector<std::int32_t> scratch;
    pool.grow(scratch, 30);
    std::vector<std::vector<std::int32_t>> tables(rows.size());
    std::vector<std::vector<std::int64_t>> real(rows.size());
    std::vector<std::int64_t> split(rows.size());
    for (std::size_t b = 0; b < rows.size(); ++b) {
      for (std::int64_t j = 0; j < L; ++j)
        if (mask[static_cast<std::int64_t>(b)][j].item<double>() > 0) real[b].push_back(rows[b][static_cast<std::size_t>(j)]);
      const auto first_image = std::find_if(real[b].begin(), real[b].end(), [&](auto t) { return t >= model.vocab_size(); });
      REQUIRE(first_image != real[b].end());
      split[b] = (first_image - real[b].begin()) + 3;  // three rows into the image
      REQUIRE(split[b] < static_cast<std::int64_t>(real[b].size()));
    }
    pool.release(scratch);
    std::vector<torch::Tensor> got(rows.size());
    for (int step = 0; step < 2; ++step) {
      std::vector<rollout::paged_chunk_spec> specs;
      for (std::size_t b = 0; b < rows.size(); ++b) {
        const auto lo = step == 0 ? 0 : split[b], hi = step == 0 ? split[b] : static_cast<std::int64_t>(real[b].size());
        REQUIRE(pool.grow(tables[b], hi));
        specs.push_back({std::vector<std::int64_t>(real[b].begin() + lo, real[b].begin() + hi), lo, &tables[b],
                         step == 0 ? 0 : 3});
      }
      const auto batch = rollout::make_paged_batch(specs, bs, {}, torch::kCPU);
      const auto out = model.logits_paged(batch, kv);
      std::int64_t at = 0;
      for (std::size_t b = 0; b < rows.size(); ++b) {
        const auto n = static_cast<std::int64_t>(specs[b].ids.size());
        got[b] = step == 0 ? out.slice(0, at, at + n) : torch::cat({got[b], out.slice(0, at, at + n)});
        at += n;
      }
    }
    for (std::size_t b = 0; b < rows.size(); ++b) {
      const auto cols = torch::nonzero(mask[static_cast<std::int64_t>(b)] > 0).squeeze(1);
      CHECK(max_abs_diff(got[b], want[static_cast<std::int64_t>(b)].index_select(0, cols)) < 1e-5);
    }
    CHECK(model.vision_tower_calls() == 2);  // the paged forward reads the same cache
  }
}

TEST_CASE("vlm: the language models' embeddings entry points equal their ids forwards", "[cpu][vlm]") {
  torch::manual_seed(3);
  const auto [ids, mask] = left_padded({{1, 5, 7, 2}, {3, 4}});
  const auto positions = torch::tensor({0, 1, 2, 3, 0, 1}, torch::kInt64).unsqueeze(0);
  const auto segments = torch::tensor({0, 0, 0, 0, 1, 1}, torch::kInt64).unsqueeze(0);
  const auto flat = torch::tensor({1, 5, 7, 2, 3, 4}, torch::kInt64).unsqueeze(0);
  models::gpt g(models::gpt_options{.vocab_size = 8, .max_len = 16, .n_layer = 2, .n_head = 2, .d_model = 16});
  CHECK(torch::equal(g.logits(ids, mask), g.logits_from_embeddings(g.embed(ids), mask)));
  CHECK(torch::equal(g.logits_packed(flat, positions, segments),
                     g.logits_packed_from_embeddings(g.embed(flat), positions, segments)));
  auto c1 = g.make_cache(2, 8), c2 = g.make_cache(2, 8);
  CHECK(torch::equal(g.logits_cached(ids, mask, c1), g.logits_cached_from_embeddings(g.embed(ids), mask, c2)));
  models::hf::decoder_config c;
  c.arch = models::hf::architecture::llama;
  c.vocab_size = 8;
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.max_position_embeddings = 32;
  models::hf::causal_lm h(c);
  CHECK(torch::equal(h.logits(ids, mask), h.logits_from_embeddings(h.embed(ids), mask)));
  CHECK(torch::equal(h.hidden_states(ids, mask), h.hidden_states_from_embeddings(h.embed(ids), mask)));
  CHECK(torch::equal(h.logits_packed(flat, positions, segments),
                     h.logits_packed_from_embeddings(h.embed(flat), positions, segments)));
  CHECK(torch::equal(h.hidden_states_packed(flat, positions, segments),
                     h.hidden_states_packed_from_embeddings(h.embed(flat), positions, segments)));
  auto k1 = h.make_cache(2, 8), k2 = h.make_cache(2, 8);
  CHECK(torch::equal(h.logits_cached(ids, mask, k1), h.logits_cached_from_embeddings(h.embed(ids), mask, k2)));
  CHECK(torch::equal(h.hidden_states_cached(ids, mask, k1), h.hidden_states_cached_from_embeddings(h.embed(ids), mask, k2)));
  CHECK_THROWS_WITH(g.logits_from_embeddings(torch::zeros({2, 4, 7}), mask), Catch::Contains("d_model = 16"));
  CHECK_THROWS_WITH(h.logits_from_embeddings(torch::zeros({2, 3, 16}), mask), Catch::Contains("differ"));
}

TEST_CASE("vlm: cached image features give the logits of recomputing them every forward (fp64)", "[cpu][vlm]") {
  torch::manual_seed(7);
  auto model = tiny_vlm(/*freeze=*/true);
  model.net()->to(torch::kFloat64);
  const auto V = model.vocab_size();
  const auto img0 = torch::rand({3, 16, 16}), img1 = torch::rand({3, 12, 8});  // 16 and 6 feature rows
  const auto s0 = model.images().add(img0), s1 = model.images().add(img1);
  REQUIRE(s0 == std::vector<std::int64_t>(16, V));
  REQUIRE(s1 == std::vector<std::int64_t>(6, V + 1));
  // Two images in one row, one image in two rows, left padding.
  const auto [ids, mask] = left_padded({cat({{1, 2}, s0, {3}, s1, {4}}), cat({{5}, s1, {6, 7}}), {1, 2, 3}});

  // Independent of the cache: each image's features from the tower alone, projected, written
  // into the token embeddings at the image positions by hand.
  auto lm = model.language_model();
  const auto proj = [&](const torch::Tensor& img) {
    torch::NoGradGuard ng;
    return model.projector()(model.vision_tower()->features(img.unsqueeze(0), -2)[0]);
  };
  const auto p0 = proj(img0), p1 = proj(img1);
  auto x = lm.embed(ids.masked_fill(ids >= V, 0)).detach().clone();
  for (std::int64_t b = 0; b < ids.size(0); ++b) {
    std::int64_t k = 0;
    for (std::int64_t j = 0; j < ids.size(1); ++j) {
      const auto id = ids[b][j].item<std::int64_t>();
      const bool prev_same = j > 0 && ids[b][j - 1].item<std::int64_t>() == id;
      k = prev_same ? k + 1 : 0;
      if (id == V) x[b][j] = p0[k];
      if (id == V + 1) x[b][j] = p1[k];
    }
  }
  torch::NoGradGuard ng;
  const auto want = lm.logits_from_embeddings(x, mask);
  const auto first = model.logits(ids, mask);
  CHECK(model.vision_tower_calls() == 2);
  const auto again = model.logits(ids, mask);
  CHECK(model.vision_tower_calls() == 2);  // served from the cache
  CHECK(model.images().counts().reused == 2);
  CHECK(max_abs_diff(first, want) < 1e-12);
  CHECK(torch::equal(first, again));

  // A copy shares the table and, its tower frozen, the cached features.
  auto copy = model.clone();
  CHECK(&copy.images() == &model.images());
  CHECK(max_abs_diff(copy.logits(ids, mask), want) < 1e-12);
  CHECK(model.vision_tower_calls() == 2);

  // A trainable tower in a forward with gradients recomputes both images (one packed call).
  auto trained = model.clone();
  for (auto& p : trained.vision_tower()->parameters()) p.set_requires_grad(true);
  {
    torch::AutoGradMode on(true);
    const auto with_grad = trained.logits(ids, mask);
    CHECK(model.images().counts().recomputed == 2);
    CHECK(max_abs_diff(with_grad, want) < 1e-12);
    with_grad.sum().backward();
    CHECK(trained.vision_tower()->vision_model->embeddings->patch_embedding->weight.grad().abs().sum().item<double>() > 0);
  }
  // The critic sees the same embeddings: its values through packing equal the padded ones.
  auto critic = model.make_critic();
  const auto values = critic.values(ids, mask);
  CHECK(values.sizes() == ids.sizes());
  CHECK(model.vision_tower_calls() == 4);  // the trained copy's 2; the critic reused the frozen tower's features
}

TEST_CASE("vlm: with cache_features off every forward encodes its images again, same logits (fp64)", "[cpu][vlm]") {
  const auto make = [](bool cache) {
    torch::manual_seed(7);
    auto m = vlm::make_small({.vocab_size = 16,
                              .max_len = 64,
                              .n_layer = 2,
                              .n_head = 2,
                              .d_model = 32,
                              .image_size = 16,
                              .patch_size = 4,
                              .vision_hidden = 32,
                              .vision_layers = 2,
                              .vision_heads = 4,
                              .vision_intermediate = 64,
                              .model = {.cache_features = cache}});
    m.net()->to(torch::kFloat64);
    return m;
  };
  auto cached = make(true), uncached = make(false);
  torch::manual_seed(8);
  const auto img0 = torch::rand({3, 16, 16}), img1 = torch::rand({3, 12, 8});
  for (auto* m : {&cached, &uncached}) {
    const auto s0 = m->images().add(img0), s1 = m->images().add(img1);
    REQUIRE(s0.size() == 16);
    REQUIRE(s1.size() == 6);
  }
  const auto V = cached.vocab_size();
  // Image 1 in two rows: still one encoding of it per forward.
  const auto [ids, mask] =
      left_padded({cat({{1, 2}, std::vector<std::int64_t>(16, V), {3}, std::vector<std::int64_t>(6, V + 1), {4}}),
                   cat({{5}, std::vector<std::int64_t>(6, V + 1), {6, 7}}),
                   {1, 2, 3}});
  torch::NoGradGuard ng;
  const std::int64_t forwards = 3, images = 2;
  for (std::int64_t f = 0; f < forwards; ++f) {
    const auto want = cached.logits(ids, mask);
    const auto got = uncached.logits(ids, mask);
    CHECK(max_abs_diff(got, want) < 1e-12);
  }
  CHECK(cached.vision_tower_calls() == images);               // encoded once, then reused
  CHECK(uncached.vision_tower_calls() == forwards * images);  // every forward encodes every image it shows
  CHECK(uncached.images().counts().reused == 0);
}

TEST_CASE("vlm: one GRPO step encodes each prompt's image once, whatever the layout; a trained tower recomputes",
          "[cpu][vlm][trainer]") {
  using grpo_trainer = trainer<small_vlm, algo::grpo<>, count_ones>;
  for (const auto layout : {rollout::update_layout::shared_prompt, rollout::update_layout::packed,
                            rollout::update_layout::padded}) {
    INFO(enum_to_string(layout));
    auto model = tiny_vlm(/*freeze=*/true);
    grpo_trainer t{model, count_ones{},
                   {.algorithm = {.kl_coef = 0.1, .layout = layout, .sampling = {.max_new_tokens = 4}},
                    .optim = {.lr = 1e-3}, .group_size = 8, .progress = false}};
    REQUIRE(t.models().reference.has_value());
    const auto in = three_image_prompts(model, 11);
    const auto s = t.step(in);
    CHECK(s.samples == 24);
    // 3 prompts x 8 samples, sampled, scored by the reference and updated: 3 images encoded.
    CHECK(s.extra.at("vision_tower_calls") == 3.0);
    CHECK(s.extra.at("images") == 3.0);
    CHECK(model.vision_tower_calls() == 3);
    CHECK(model.images().counts().reused >= 3);
    // The next step with new images: 3 again (the statistics count one step).
    const auto s2 = t.step(three_image_prompts(model, 12));
    CHECK(s2.extra.at("vision_tower_calls") == 3.0);
  }
  // A trained tower: the policy encodes 3 without gradient to sample; the reference (its own
  // frozen copy of the tower) encodes its 3; the update forward recomputes the 3 with gradient.
  auto model = tiny_vlm(/*freeze=*/false);
  grpo_trainer t{model, count_ones{},
                 {.algorithm = {.kl_coef = 0.1, .sampling = {.max_new_tokens = 4}}, .optim = {.lr = 1e-3},
                  .group_size = 8, .progress = false}};
  const auto s = t.step(three_image_prompts(model, 13));
  CHECK(s.extra.at("vision_tower_calls") == 9.0);
  CHECK(model.images().counts().recomputed == 3);
  CHECK(model.images().counts().encoded == 6);
}

TEST_CASE("vlm: roles — reference only with kl_coef > 0, PPO's critic, per-module groups, a frozen tower stays",
          "[cpu][vlm][trainer]") {
  using grpo_trainer = trainer<small_vlm, algo::grpo<>, count_ones>;
  SECTION("no reference without a KL term; the frozen tower is unchanged by a step, the rest trained") {
    auto model = tiny_vlm(/*freeze=*/true);
    trainer<small_vlm, algo::grpo<>, random_reward> t{model, random_reward{},
                   {.algorithm = {.kl_coef = 0.0, .sampling = {.max_new_tokens = 4}}, .optim = {.lr = 1e-2},
                    .group_size = 4, .progress = false}};
    CHECK(!t.models().reference.has_value());
    std::map<std::string, torch::Tensor> before;
    for (const auto& [n, p] : model.named_parameters()) before[n] = p.detach().clone();
    // Rewards that differ within each group, so the update has a gradient.
    t.step(three_image_prompts(model, 21));
    std::int64_t tower = 0, changed = 0;
    for (const auto& [n, p] : t.models().policy.named_parameters()) {
      if (n.starts_with("vision_tower.")) {
        ++tower;
        CHECK(torch::equal(p, before.at(n)));
        CHECK(!p.requires_grad());
      } else if (!torch::equal(p, before.at(n))) {
        ++changed;
      }
    }
    CHECK(tower > 0);
    CHECK(changed > 0);
  }
  SECTION("per-module learning rates and clipping reach the optimizer") {
    auto model = tiny_vlm(/*freeze=*/false);
    grpo_trainer t{model, count_ones{},
                   {.algorithm = {.sampling = {.max_new_tokens = 4}},
                    .optim = {.lr = 1e-3,
                              .groups = {{.prefix = "vision_tower.", .lr_scale = 0.1},
                                         {.prefix = "multi_modal_projector.", .max_grad_norm = 0.5}}},
                    .group_size = 4, .progress = false}};
    auto& opt = t.optimizer();
    REQUIRE(opt.group_count() == 3);
    std::map<std::string, std::size_t> g;
    for (std::size_t i = 0; i < opt.group_count(); ++i) g[opt.group_name(i)] = i;
    REQUIRE(g.size() == 3);
    CHECK(opt.group_learning_rate(g.at("vision_tower.")) == Approx(1e-4));
    CHECK(opt.group_learning_rate(g.at("")) == Approx(1e-3));
    CHECK(opt.group_max_grad_norm(g.at("multi_modal_projector.")) == 0.5);
    for (const auto& n : opt.group_param_names(g.at("")))
      CHECK(n.starts_with("language_model."));
    CHECK(opt.group_param_names(g.at("multi_modal_projector.")).size() == 4);  // linear_1/2 weight and bias
    const auto s = t.step(three_image_prompts(model, 22));
    CHECK(std::isfinite(s.loss));
  }
  SECTION("PPO trains the VLM with a critic on the same multimodal backbone") {
    auto model = tiny_vlm(/*freeze=*/true);
    trainer<small_vlm, algo::ppo<>, count_ones> t{
        model, count_ones{}, {.algorithm = {.kl_coef = 0.05, .track = {.sampling = {.max_new_tokens = 4}}},
                              .optim = {.lr = 1e-3},
                              .group_size = 2, .progress = false}};
    REQUIRE(t.models().critic.has_value());
    REQUIRE(t.models().reference.has_value());
    bool tower = false;
    for (const auto& [n, p] : t.models().critic->named_parameters()) tower = tower || n.starts_with("vision_tower.");
    CHECK(tower);
    const auto s = t.step(three_image_prompts(model, 23));
    CHECK(std::isfinite(s.value_loss));
    CHECK(s.value_loss > 0);
    // The critic's and the reference's towers are frozen copies: they reuse the policy's features.
    CHECK(s.extra.at("vision_tower_calls") == 3.0);
  }
}

TEST_CASE("vlm: the SFT loss takes prompts with images, padded equal to packed", "[cpu][vlm][sft]") {
  torch::manual_seed(4);
  auto model = tiny_vlm(false, 64);
  const auto a = model.images().add(torch::rand({3, 16, 16})), b = model.images().add(torch::rand({3, 16, 16}));
  // prompts hold image-slot ids (beyond the vocabulary): only the answers are targets
  const std::vector<std::vector<std::int64_t>> prompts{cat({{1}, a, {2, 3}}), cat({{1, 4}, b, {2}})};
  const std::vector<std::vector<std::int64_t>> answers{{5, 6, 7}, {8, 9}};
  const auto batch = train::make_sft_batch(prompts, answers, 0);
  const auto padded = train::sft_loss(model, batch, train::sft_layout::padded);
  const auto packed = train::sft_loss(model, batch, train::sft_layout::packed);
  CHECK(std::isfinite(padded.item<double>()));
  CHECK(padded.item<double>() == Approx(packed.item<double>()).epsilon(1e-5));
  padded.backward();
  CHECK(model.images().vision_tower_calls() >= 2);
}

TEST_CASE("vlm: bad image-slot ids are errors naming the id", "[cpu][vlm]") {
  auto model = tiny_vlm();
  const auto V = model.vocab_size();
  const auto s0 = model.images().add(torch::rand({3, 16, 16}));
  const auto ones = [](const std::vector<std::int64_t>& r) {
    return std::pair{torch::tensor(r, torch::kInt64).unsqueeze(0), torch::ones({1, static_cast<std::int64_t>(r.size())})};
  };
  {
    const auto [ids, mask] = ones({1, -3, 2});
    CHECK_THROWS_WITH(model.logits(ids, mask), Catch::Contains("token id -3 is negative"));
  }
  {
    const auto [ids, mask] = ones({1, V + 4, 2});
    CHECK_THROWS_WITH(model.logits(ids, mask), Catch::Contains("image-slot token id " + std::to_string(V + 4) +
                                                               " (slot 4) is not registered"));
  }
  {
    auto too_long = cat({{1}, s0, {V}, {2}});  // 17 ids in a run of an image of 16 rows
    const auto [ids, mask] = ones(too_long);
    CHECK_THROWS_WITH(model.logits(ids, mask), Catch::Contains("image-slot token id " + std::to_string(V)) &&
                                                   Catch::Contains("16 feature rows"));
  }
  CHECK_THROWS_WITH(model.images().add(torch::rand({3, 15, 16})), Catch::Contains("15 x 16"));
  CHECK_THROWS_WITH(model.images().add(torch::rand({1, 16, 16})), Catch::Contains("1 channels"));
  CHECK_THROWS_WITH(vlm::place_images({1, 9, 9, 2}, 9, {s0}), Catch::Contains("has 2 ids"));
  model.images().clear();
  const auto [ids, mask] = ones(cat({{1}, s0}));
  CHECK_THROWS_WITH(model.logits(ids, mask), Catch::Contains("table holds 0 image(s)"));
}

namespace {
// logits() over one whole sequence: (L, V).
torch::Tensor whole_logits(const small_vlm& m, const std::vector<std::int64_t>& ids) {
  const auto t = torch::tensor(ids, torch::kInt64).unsqueeze(0);
  return m.logits(t, torch::ones({1, t.size(1)})).squeeze(0);
}
}  // namespace

TEST_CASE("vlm: logits through the rollout engine equal logits() - image runs split across prefill chunks, steps "
          "and shared prefix blocks; each image encoded once", "[cpu][vlm][engine]") {
  for (const auto dt : {torch::kFloat, torch::kDouble}) {
    INFO((dt == torch::kDouble ? "float64" : "float32"));
    torch::manual_seed(11);
    auto model = tiny_vlm(/*freeze=*/true, 96);
    model.net()->to(dt);
    model.train(false);
    const auto V = model.vocab_size();
    const auto a = model.images().add(torch::rand({3, 16, 16}));  // 16 rows each
    const auto b = model.images().add(torch::rand({3, 16, 16}));
    const auto c = model.images().add(torch::rand({3, 12, 8}));   // 6 rows
    REQUIRE(model.input_vocab_size() == V + 3);
    // Prompts of mixed lengths; the first two share a prefix of 19 tokens. The second is submitted
    // after the others ran: the prefix cache serves 4 full blocks of 4, so its prefill starts at
    // position 16, inside image a's run (positions 2 to 17).
    std::vector<rollout::request> reqs;
    const std::vector<std::vector<std::int64_t>> prompts{cat({{1, 2}, a, {3, 4}, c, {5}}), cat({{1, 2}, a, {3, 9}}),
                                                         cat({{6}, b, {7}, a, {8}}), cat({c, {2}})};
    for (std::size_t i = 0; i < prompts.size(); ++i)
      reqs.push_back({.prompt = prompts[i],
                      .sampling = {.max_new_tokens = 4 + static_cast<std::int64_t>(i), .stop_tokens = {0}},
                      .seed = 100 + i, .n = i % 2 == 0 ? 3 : 1});
    const double tol = dt == torch::kDouble ? 1e-10 : 1e-5;
    for (const std::int64_t budget : {5, 7, 128}) {
      INFO("max_batch_tokens = " << budget);
      rollout::engine eng{model, {.block_size = 4, .kv_tokens = 1024, .max_sequences = 8, .max_batch_tokens = budget,
                                  .keep_logits = true}};
      std::map<std::int64_t, std::size_t> req_of;  // submit id -> request
      for (const std::size_t i : {0, 2, 3}) req_of[eng.submit(reqs[i])] = i;
      auto results = eng.run();
      req_of[eng.submit(reqs[1])] = 1;
      for (auto& r : eng.run()) results.push_back(std::move(r));
      REQUIRE(results.size() == 8);
      for (const auto& r : results) {
        auto seq = reqs[req_of.at(r.request)].prompt;
        const auto P = static_cast<std::int64_t>(seq.size());
        const auto T = static_cast<std::int64_t>(r.tokens.size());
        for (const auto t : r.tokens) CHECK((t >= 0 && t < V));  // sampled from the text vocabulary
        seq.insert(seq.end(), r.tokens.begin(), r.tokens.end());
        const auto ref = whole_logits(model, seq).slice(0, P - 1, P - 1 + T);
        REQUIRE(r.logits.defined());
        CHECK(max_abs_diff(r.logits, ref) < tol);
        const auto lsm = torch::log_softmax(ref.to(torch::kDouble), -1);
        for (std::int64_t t = 0; t < T; ++t)
          CHECK(std::abs(r.logp[static_cast<std::size_t>(t)] -
                         lsm[t][r.tokens[static_cast<std::size_t>(t)]].item<double>()) < 10 * tol);
      }
      CHECK(eng.stats().prefix_hit_tokens == 16);  // the shared prefix's 4 full blocks
      CHECK(eng.stats().used_blocks == 0);
    }
    // Three images, each encoded once: the engine's chunks and every reference forward reuse them.
    CHECK(model.vision_tower_calls() == 3);
  }
}

TEST_CASE("vlm: the engine names an unregistered image-slot id in a request; GRPO samples a VLM on the engine",
          "[cpu][vlm][engine][trainer]") {
  auto model = tiny_vlm();
  const auto V = model.vocab_size();
  const auto s0 = model.images().add(torch::rand({3, 16, 16}));
  rollout::engine eng{model, {.block_size = 4, .kv_tokens = 256}};
  CHECK_THROWS_WITH(eng.submit({.prompt = {1, V + 1, 2}}),
                    Catch::Contains("prompt token id " + std::to_string(V + 1)) &&
                        Catch::Contains("input_vocab_size = " + std::to_string(V + 1)));
  CHECK_NOTHROW(eng.submit({.prompt = cat({{1}, s0, {2}}), .sampling = {.max_new_tokens = 2}}));
  // The trainer's default sampler is the engine for a VLM too (its figures in the statistics).
  using grpo_trainer = trainer<small_vlm, algo::grpo<>, count_ones>;
  grpo_trainer t{model, count_ones{},
                 {.algorithm = {.sampling = {.max_new_tokens = 4}}, .optim = {.lr = 1e-3}, .group_size = 4,
                  .progress = false}};
  const auto st = t.step(three_image_prompts(model, 5));
  CHECK(st.extra.at("engine/steps") >= 4.0);
  CHECK(st.extra.at("engine/peak_blocks") >= 3.0);
  CHECK(st.extra.at("vision_tower_calls") == 3.0);
}

namespace {
// Three screens per episode: the first with the task, one after each of the first two turns; a
// turn scores 0.5 when it says "3". The screens are drawn from the seed and the turn.
struct screens_env {
  std::uint64_t seed = 0;
  int turn = 0;
  static torch::Tensor screen(std::uint64_t seed, int turn) {
    auto g = at::detail::createCPUGenerator(seed * 10 + static_cast<std::uint64_t>(turn));
    return torch::rand({3, 16, 16}, g);
  }
  agents::image_observation reset(std::uint64_t s) {
    seed = s;
    turn = 0;
    return {.text = "Find the 3.\n<image>", .images = {screen(s, 0)}};
  }
  agents::image_step step(const std::string& action) {
    ++turn;
    return {.observation = {.text = "Now:<image>", .images = {screen(seed, turn)}},
            .reward = action.find('3') != std::string::npos ? 0.5 : 0.0, .done = turn == 3};
  }
};
static_assert(TextEnvironment<screens_env>);
// The same, with a marker and no image (or an image and no marker).
struct mismatched_env : screens_env {
  bool extra_marker = true;
  agents::image_observation reset(std::uint64_t s) {
    auto o = screens_env::reset(s);
    if (extra_marker) o.text += "<image>";
    else o.images.push_back(screen(s, 9));
    return o;
  }
};
}  // namespace

TEST_CASE("vlm: multi-turn episodes whose observations show images - slot ids at the markers, resumed logits equal "
          "a full forward, each screen encoded once over the rollout and the update", "[cpu][vlm][agents]") {
  std::string alphabet = "\n";
  for (char ch = 32; ch < 127; ++ch) alphabet += ch;
  const models::char_tokenizer tok{alphabet};
  torch::manual_seed(21);
  auto model = vlm::make_small({.vocab_size = tok.vocab_size(), .max_len = 320, .n_layer = 2, .n_head = 2,
                                .d_model = 32, .image_size = 16, .patch_size = 4, .vision_hidden = 32,
                                .vision_layers = 1, .vision_heads = 4, .vision_intermediate = 64});
  model.net()->to(torch::kDouble);
  model.train(false);
  {
    // Turns end soon ("\n\n" ends a plain turn) and never write the padding id: a constant
    // feature (the final norm's bias) that the head reads only for those two ids.
    torch::NoGradGuard ng;
    auto& lm = model.net()->language_model;
    lm->ln_f->bias.zero_();
    lm->ln_f->bias[0] = 10.0;
    lm->head->weight.select(1, 0).zero_();
    lm->head->weight[tok.encode("\n").front()][0] = 0.4;
    lm->head->weight[tok.pad_id()][0] = -3.0;
  }
  const agents::agent_text io{.encode = [&](const std::string& s) { return tok.encode(s); },
                              .decode = [&](const std::vector<std::int64_t>& ids) { return tok.decode(ids); }};
  const agents::agent_options ao{.format = tokenizers::chat_format::plain, .max_turns = 4, .max_turn_tokens = 8,
                                 .max_episode_tokens = 300,
                                 .engine = {.block_size = 8, .max_sequences = 4, .max_batch_tokens = 20,
                                            .keep_logits = true}};
  const auto V = model.vocab_size();
  agents::episodes_result out;
  {
    torch::NoGradGuard ng;
    torch::manual_seed(5);
    out = agents::run_episodes(model, screens_env{}, {1, 2}, /*group=*/3, io, ao);
  }
  REQUIRE(out.episodes.size() == 6);
  // One first screen per task (its group shares the prompt), then one per continued turn.
  std::int64_t expected_images = 2, multi = 0;
  for (const auto& t : out.episodes) expected_images += t.turns() - 1, multi += t.turns() > 1;
  CHECK(multi > 0);
  CHECK(out.stats.at("images") == static_cast<double>(expected_images));
  CHECK(model.images().size() == expected_images);
  CHECK(model.vision_tower_calls() == expected_images);  // the engine's chunks encoded each once
  for (const auto& t : out.episodes) {
    // Image-slot ids: context only, in runs of 16 (one run per screen shown), none sampled.
    std::int64_t image_ids = 0;
    for (std::size_t j = 0; j < t.tokens.size(); ++j)
      if (t.tokens[j] >= V) {
        ++image_ids;
        CHECK(t.policy[j] == 0);
      }
    CHECK(image_ids == 16 * t.turns());
    // The policy's kept logits and log-probs against one forward over the whole trajectory.
    torch::NoGradGuard ng;
    const auto ids = torch::tensor(t.tokens, torch::kInt64).unsqueeze(0);
    const auto full = model.logits(ids, torch::ones({1, ids.size(1)})).squeeze(0);
    std::vector<std::int64_t> rows;
    for (std::size_t j = 1; j < t.tokens.size(); ++j)
      if (t.policy[j]) rows.push_back(static_cast<std::int64_t>(j) - 1);
    const auto ref = full.index_select(0, torch::tensor(rows, torch::kInt64));
    CHECK(max_abs_diff(torch::cat(t.logits, 0), ref) < 1e-9);
    const auto lsm = torch::log_softmax(ref, -1);
    for (std::size_t k = 0, j = 1; j < t.tokens.size(); ++j)
      if (t.policy[j]) CHECK(std::abs(t.logp[j] - lsm[static_cast<std::int64_t>(k++)][t.tokens[j]].item<double>()) < 1e-9);
  }
  CHECK(model.vision_tower_calls() == expected_images);  // the full forwards read the cache
  // One GRPO update over the episodes (the tower frozen): still no image encoded again.
  agents::episode_grpo<small_vlm> learner{model, {.optim = {.lr = 1e-3}}};
  const auto st = learner.step(out.episodes, 3, tok.pad_id());
  CHECK(std::isfinite(st.at("loss")));
  CHECK(model.vision_tower_calls() == expected_images);

  // Errors: markers and images that do not match; images for a policy without an image table.
  torch::NoGradGuard ng;
  CHECK_THROWS_WITH(agents::run_episodes(model, mismatched_env{}, {1}, 1, io, ao),
                    Catch::Contains("1 image(s) but the text has 2 <image> marker(s)"));
  CHECK_THROWS_WITH(agents::run_episodes(model, mismatched_env{{}, false}, {1}, 1, io, ao),
                    Catch::Contains("2 image(s) but the text has 1 <image> marker(s)"));
  models::gpt text_only{models::gpt_options{.vocab_size = tok.vocab_size(), .max_len = 320, .n_layer = 1, .n_head = 2,
                                            .d_model = 16}};
  CHECK_THROWS_WITH(agents::run_episodes(text_only, screens_env{}, {1}, 1, io, ao),
                    Catch::Contains("the policy has no image table"));
}

// ---- vlm<LM> over a third language model (concepts/embedding_lm.hpp) ----
namespace {
// A language model the library never saw: each position's logits are head(tanh(mix(mean of the
// input embeddings of the real tokens so far))) — causal, attention-free; its cache is the running
// sum and count of each row.
struct bag_lm_impl : torch::nn::Cloneable<bag_lm_impl> {
  bag_lm_impl(std::int64_t vocab, std::int64_t dim) : V(vocab), D(dim) { reset(); }
  void reset() override {
    wte = register_module("wte", torch::nn::Embedding(V, D));
    mix = register_module("mix", torch::nn::Linear(D, D));
    head = register_module("head", torch::nn::Linear(D, V));
  }
  torch::Tensor embed(const torch::Tensor& ids) { return wte(ids); }
  // x (B, L, D), mask (B, L); sum (B, D) and count (B, 1) carried in and updated.
  torch::Tensor forward_from(const torch::Tensor& x, const torch::Tensor& mask, torch::Tensor& sum,
                             torch::Tensor& count) {
    const auto m = mask.unsqueeze(-1).to(x.scalar_type());
    const auto cs = (x * m).cumsum(1) + sum.unsqueeze(1);
    const auto cc = m.cumsum(1) + count.unsqueeze(1);
    sum = cs.select(1, -1);
    count = cc.select(1, -1);
    return head(torch::tanh(mix(cs / cc.clamp_min(1.0))));
  }
  std::int64_t V, D;
  torch::nn::Embedding wte{nullptr};
  torch::nn::Linear mix{nullptr}, head{nullptr};
};
TORCH_MODULE_IMPL(bag_lm_net, bag_lm_impl);

struct bag_lm : models::module_adapter<bag_lm, bag_lm_net> {
  using track = token_track;
  struct cache_type {
    torch::Tensor sum, count;
  };
  explicit bag_lm(bag_lm_net net) : module_adapter(std::move(net)) {}
  bag_lm(std::int64_t vocab, std::int64_t dim) : bag_lm(bag_lm_net(vocab, dim)) {}
  torch::Tensor logits_from_embeddings(const torch::Tensor& x, const torch::Tensor& mask) const {
    auto c = make_cache(x.size(0), 0);
    return logits_cached_from_embeddings(x, mask, c);
  }
  torch::Tensor logits_cached_from_embeddings(const torch::Tensor& x, const torch::Tensor& mask, cache_type& c) const {
    return net_.ptr()->forward_from(x, mask, c.sum, c.count);
  }
  torch::Tensor logits(const torch::Tensor& ids, const torch::Tensor& mask) const {
    return logits_from_embeddings(net_.ptr()->embed(ids), mask);
  }
  cache_type make_cache(std::int64_t batch, std::int64_t) const {
    const auto o = net_->wte->weight.options();
    return {torch::zeros({batch, net_->D}, o), torch::zeros({batch, 1}, o)};
  }
  torch::Tensor logits_cached(const torch::Tensor& ids, const torch::Tensor& mask, cache_type& c) const {
    return logits_cached_from_embeddings(net_.ptr()->embed(ids), mask, c);
  }
  std::int64_t vocab_size() const { return net_->V; }
};
}  // namespace

// Its network opens itself to the VLM through the traits (the primary template would need
// hidden_size() / vocab_size() / remake() members; this one has other names).
template <>
struct unirl::embedding_lm_traits<bag_lm_net> {
  static std::int64_t hidden_size(const bag_lm_net& n) { return n->D; }
  static std::int64_t vocab_size(const bag_lm_net& n) { return n->V; }
  static torch::Tensor embed(const bag_lm_net& n, const torch::Tensor& ids) { return n.ptr()->embed(ids); }
  static bag_lm_net remake(const bag_lm_net& n) { return bag_lm_net(n->V, n->D); }
};

static_assert(EmbeddingCausalLM<bag_lm>);
static_assert(CausalLM<vlm::vlm<bag_lm>>);
static_assert(!PagedCausalLM<vlm::vlm<bag_lm>> && !PackedCausalLM<vlm::vlm<bag_lm>>);
static_assert(!CriticFactory<vlm::vlm<bag_lm>>);

TEST_CASE("vlm: over a third language model that models EmbeddingCausalLM - logits equal an independent computation, "
          "it samples, trains with GRPO and encodes each image once", "[cpu][vlm][trainer]") {
  torch::manual_seed(21);
  vision::vision_config vc;
  vc.family = vision::vision_family::clip;
  vc.hidden_size = 32;
  vc.intermediate_size = 64;
  vc.num_hidden_layers = 2;
  vc.num_attention_heads = 4;
  vc.image_size = 16;
  vc.patch_size = 4;
  vc.num_channels = 3;
  using bag_vlm = vlm::vlm<bag_lm>;
  bag_vlm m(vision::clip_vision(vc), vision::llava_projector(32, 24, "gelu"), bag_lm(16, 24));
  m.net()->to(torch::kDouble);
  m.train(false);
  CHECK(m.vocab_size() == 16);
  const auto img_px = torch::rand({3, 16, 16}, torch::kDouble);
  const auto img = m.images().add(img_px);
  REQUIRE(img.size() == 16);
  const auto row = cat({{1, 2}, img, {3, 4}});
  const auto [ids, mask] = left_padded({row, {5, 6, 7}});
  torch::Tensor got;
  {
    torch::NoGradGuard ng;
    got = m.logits(ids, mask);
  }
  {
  // Independently: the embeddings of each row (text rows from the LM's table, image rows the
  // projected features of the tower), then the bag LM's formula over the real tokens.
  torch::NoGradGuard ng;
  auto& lm = *m.language_model().net().ptr();
  const auto feats = m.projector()->forward(m.vision_tower()->features_packed(
      {img_px}, m.options().vision_feature_layer, m.options().vision_feature_select_strategy));
  REQUIRE(feats.size(0) == 16);
  for (std::int64_t b = 0; b < 2; ++b) {
    const std::vector<std::int64_t> seq = b == 0 ? row : std::vector<std::int64_t>{5, 6, 7};
    const auto L = static_cast<std::int64_t>(seq.size());
    std::vector<torch::Tensor> x;
    std::int64_t k = 0;
    for (const auto t : seq) x.push_back(t < 16 ? lm.wte->weight[t] : feats[k++]);
    const auto X = torch::stack(x);                                                  // (L, D)
    const auto n = torch::arange(1, L + 1, torch::kDouble).unsqueeze(1);             // real tokens so far
    const auto ref = lm.head(torch::tanh(lm.mix(X.cumsum(0) / n)));                  // (L, V)
    const auto pad = ids.size(1) - L;
    CHECK(max_abs_diff(got[b].slice(0, pad), ref) < 1e-12);
  }
  // The cached forward (prompt, then one more token) equals the whole forward.
  auto c = m.make_cache(2, 32);
  const auto P = ids.size(1);
  const auto next = torch::tensor({{9}, {10}}, torch::kInt64);
  const auto first = m.logits_cached(ids, mask, c);
  const auto second = m.logits_cached(next, torch::ones({2, 1}), c);
  const auto whole = m.logits(torch::cat({ids, next}, 1), torch::cat({mask, torch::ones({2, 1})}, 1));
  CHECK(max_abs_diff(first, whole.slice(1, 0, P)) < 1e-12);
  CHECK(max_abs_diff(second, whole.slice(1, P)) < 1e-12);
  }

  // GRPO over vlm<bag_lm> (the static sampler: no paged forward): the reward rises, each prompt's
  // image encoded once per step.
  torch::manual_seed(22);
  bag_vlm pm(vision::clip_vision(vc), vision::llava_projector(32, 24, "gelu"), bag_lm(16, 24));
  trainer<bag_vlm, algo::grpo<>, count_ones> t{
      pm, count_ones{},
      {.algorithm = {.layout = rollout::update_layout::padded, .sampling = {.max_new_tokens = 4}},
       .optim = {.lr = 3e-2}, .group_size = 8, .progress = false}};
  double first_reward = 0, last_reward = 0;
  for (int s = 0; s < 30; ++s) {
    pm.images().clear();
    prompt_batch in;
    for (std::int64_t i = 0; i < 3; ++i) in.tokens.push_back(cat({{2 + i}, pm.images().add(torch::rand({3, 16, 16})), {3}}));
    const auto st = t.step(in);
    CHECK(st.extra.at("vision_tower_calls") == 3.0);
    if (s == 0) first_reward = st.reward_mean;
    last_reward = st.reward_mean;
  }
  CHECK(last_reward > first_reward + 0.3);
}
